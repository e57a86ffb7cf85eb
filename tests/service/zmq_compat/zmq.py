"""`import zmq` resolves here when tests/service/zmq_compat is first on
PYTHONPATH: the ctypes binding over libzmq.so.5 (tests/service/zmq_ctypes.py)
stands in for pyzmq, for the tests that import zmq themselves. Put this folder
on the path only where that is wanted (the GPU machine, which has no pyzmq;
the TW_ZMQ_CTYPES ctests): it hides a real pyzmq."""
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zmq_ctypes import *  # noqa: E402,F401,F403
from zmq_ctypes import __version__  # noqa: E402,F401
