"""zmq_ctypes.py: the part of pyzmq's API that twain's Python service tests use,
as a ctypes binding over libzmq.so.5 (for machines that have libzmq but no
pyzmq and no package registry: the GPU machine, where run_gpu.sh carries
libzmq.so.5 in the twain bundle).

Covered: Context (Context.instance(), socket(), term(), destroy()); Socket
(setsockopt/getsockopt/set/get for int, int64 and bytes options, bind,
connect, unbind, disconnect, bind_to_random_port, send/recv, send_multipart/
recv_multipart, send_string/recv_string, poll, close, closed, the
context-manager protocol); Poller (register/modify/unregister/poll, zmq
sockets or plain file descriptors); the error classes ZMQError, Again,
ContextTerminated, ZMQBindError; zmq_version(); and the constants below.
Nothing else (no zero-copy frames, no message tracking, no monitors, no
asyncio): copy=False and track=False are accepted and ignored.

Semantics follow pyzmq: timeouts are in milliseconds (None = forever),
send() of str raises TypeError, a call that would block with NOBLOCK raises
Again, a call interrupted by a signal is retried (the Python signal handler
runs in between, so SIGTERM/SIGINT handlers still work). ctypes releases the
GIL around every libzmq call, so a blocking recv() in one thread does not
stop the others.

Used by tests/service/svc.py when `import zmq` fails or TW_ZMQ_CTYPES=1, and
as the module `zmq` itself when tests/service/zmq_compat is first on
PYTHONPATH (tests/service/zmq_compat/zmq.py). The library is TW_LIBZMQ when
set, else libzmq.so.5 through the dynamic loader (LD_LIBRARY_PATH)."""
import ctypes
import ctypes.util
import errno as _errno
import os
import random
import threading
import weakref

BACKEND = "ctypes"
__version__ = "0+twain.zmq_ctypes"

# socket types (zmq.h)
PAIR, PUB, SUB, REQ, REP, DEALER, ROUTER, PULL, PUSH, XPUB, XSUB, STREAM = range(12)
# send/recv flags
DONTWAIT = NOBLOCK = 1
SNDMORE = 2
# poll events
POLLIN, POLLOUT, POLLERR = 1, 2, 4
# socket options
AFFINITY, ROUTING_ID, SUBSCRIBE, UNSUBSCRIBE, RATE, RECOVERY_IVL = 4, 5, 6, 7, 8, 9
IDENTITY = ROUTING_ID
SNDBUF, RCVBUF, RCVMORE, FD, EVENTS, TYPE, LINGER, RECONNECT_IVL, BACKLOG = 11, 12, 13, 14, 15, 16, 17, 18, 19
RECONNECT_IVL_MAX, MAXMSGSIZE, SNDHWM, RCVHWM, MULTICAST_HOPS = 21, 22, 23, 24, 25
RCVTIMEO, SNDTIMEO, LAST_ENDPOINT, ROUTER_MANDATORY, TCP_KEEPALIVE, IMMEDIATE = 27, 28, 32, 33, 34, 39
ROUTER_HANDOVER, HEARTBEAT_IVL, HEARTBEAT_TTL, HEARTBEAT_TIMEOUT, CONNECT_TIMEOUT = 56, 75, 76, 77, 79
CURVE_SERVER, CURVE_PUBLICKEY, CURVE_SECRETKEY, CURVE_SERVERKEY = 47, 48, 49, 50
# value kinds: 'q' int64/uint64, 'b' bytes, every other option int
_KIND = {AFFINITY: "q", MAXMSGSIZE: "q", ROUTING_ID: "b", SUBSCRIBE: "b", UNSUBSCRIBE: "b",
         LAST_ENDPOINT: "b", CURVE_PUBLICKEY: "b", CURVE_SECRETKEY: "b", CURVE_SERVERKEY: "b"}

_HAUSNUMERO = 156384712
EAGAIN = _errno.EAGAIN
EINTR = _errno.EINTR
ETERM = _HAUSNUMERO + 53
ENOTSOCK = _errno.ENOTSOCK
EADDRINUSE = _errno.EADDRINUSE


def _load():
    names = [os.environ["TW_LIBZMQ"]] if os.environ.get("TW_LIBZMQ") else []
    names += ["libzmq.so.5", ctypes.util.find_library("zmq") or "libzmq.so"]
    errs = []
    for n in names:
        try:
            return ctypes.CDLL(n, use_errno=True)
        except OSError as ex:
            errs.append("%s: %s" % (n, ex))
    raise ImportError("zmq_ctypes: cannot load libzmq (" + "; ".join(errs) + ")")


_lib = _load()


class _Msg(ctypes.Structure):
    _fields_ = [("_", ctypes.c_uint64 * 8)]  # zmq_msg_t: 64 bytes, pointer-aligned


class _PollItem(ctypes.Structure):
    _fields_ = [("socket", ctypes.c_void_p), ("fd", ctypes.c_int),
                ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _sig(name, res, *args):
    f = getattr(_lib, name)
    f.restype, f.argtypes = res, list(args)
    return f


_vp, _int, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_ctx_new = _sig("zmq_ctx_new", _vp)
_ctx_term = _sig("zmq_ctx_term", _int, _vp)
_socket = _sig("zmq_socket", _vp, _vp, _int)
_close = _sig("zmq_close", _int, _vp)
_setsockopt = _sig("zmq_setsockopt", _int, _vp, _int, _vp, _sz)
_getsockopt = _sig("zmq_getsockopt", _int, _vp, _int, _vp, ctypes.POINTER(_sz))
_bind = _sig("zmq_bind", _int, _vp, ctypes.c_char_p)
_unbind = _sig("zmq_unbind", _int, _vp, ctypes.c_char_p)
_connect = _sig("zmq_connect", _int, _vp, ctypes.c_char_p)
_disconnect = _sig("zmq_disconnect", _int, _vp, ctypes.c_char_p)
_send = _sig("zmq_send", _int, _vp, _vp, _sz, _int)
_msg_init = _sig("zmq_msg_init", _int, ctypes.POINTER(_Msg))
_msg_recv = _sig("zmq_msg_recv", _int, ctypes.POINTER(_Msg), _vp, _int)
_msg_data = _sig("zmq_msg_data", _vp, ctypes.POINTER(_Msg))
_msg_size = _sig("zmq_msg_size", _sz, ctypes.POINTER(_Msg))
_msg_more = _sig("zmq_msg_more", _int, ctypes.POINTER(_Msg))
_msg_close = _sig("zmq_msg_close", _int, ctypes.POINTER(_Msg))
_poll = _sig("zmq_poll", _int, ctypes.POINTER(_PollItem), _int, ctypes.c_long)
_errno_fn = _sig("zmq_errno", _int)
_strerror = _sig("zmq_strerror", ctypes.c_char_p, _int)
_version = _sig("zmq_version", None, ctypes.POINTER(_int), ctypes.POINTER(_int), ctypes.POINTER(_int))


class ZMQError(Exception):
    """A libzmq call failed: errno and libzmq's message (as pyzmq's ZMQError)."""

    def __init__(self, errno=None, msg=None):
        self.errno = _errno_fn() if errno is None else errno
        self.strerror = msg or _strerror(self.errno).decode("utf-8", "replace")
        super().__init__(self.strerror)

    def __str__(self):
        return self.strerror


class Again(ZMQError):
    """The call would block (EAGAIN: NOBLOCK, or a RCVTIMEO/SNDTIMEO expired)."""


class ContextTerminated(ZMQError):
    """The context was terminated (ETERM)."""


class ZMQBindError(ZMQError):
    """bind_to_random_port found no free port."""

    def __init__(self, msg):
        super().__init__(EADDRINUSE, msg)


def _raise(err=None):
    e = _errno_fn() if err is None else err
    if e == EAGAIN:
        raise Again(e)
    if e == ETERM:
        raise ContextTerminated(e)
    raise ZMQError(e)


def _call(fn, *args):
    """fn(*args), retried on EINTR; raises the matching ZMQError on -1."""
    while True:
        rc = fn(*args)
        if rc != -1:
            return rc
        e = _errno_fn()
        if e != EINTR:
            _raise(e)


def zmq_version():
    """libzmq's version as 'major.minor.patch'."""
    a, b, c = _int(), _int(), _int()
    _version(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
    return "%d.%d.%d" % (a.value, b.value, c.value)


def zmq_version_info():
    return tuple(int(x) for x in zmq_version().split("."))


def pyzmq_version():
    return __version__


class Context:
    """A libzmq context. Context.instance() is the process-wide one (a new
    one after fork, as in pyzmq)."""

    _inst = None
    _inst_pid = None
    _inst_lock = threading.Lock()

    def __init__(self, io_threads=1):
        self.handle = _ctx_new()
        if not self.handle:
            _raise()
        self._sockets = weakref.WeakSet()
        self.closed = False

    @classmethod
    def instance(cls, io_threads=1):
        with cls._inst_lock:
            if cls._inst is None or cls._inst.closed or cls._inst_pid != os.getpid():
                cls._inst = cls(io_threads)
                cls._inst_pid = os.getpid()
            return cls._inst

    def socket(self, socket_type, **kwargs):
        if self.closed:
            raise ContextTerminated(ETERM)
        s = Socket(self, socket_type)
        self._sockets.add(s)
        return s

    def term(self):
        if not self.closed:
            _call(_ctx_term, self.handle)
            self.closed = True

    def destroy(self, linger=None):
        for s in list(self._sockets):
            if not s.closed:
                s.close(linger)
        self.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def _as_bytes(v, what):
    if isinstance(v, str):
        raise TypeError("%s: str is not allowed, encode it first (pyzmq semantics)" % what)
    return bytes(v)


class Socket:
    """A libzmq socket (create it with Context.socket)."""

    def __init__(self, context, socket_type):
        self.context = context
        self.socket_type = socket_type
        self.handle = _socket(context.handle, socket_type)
        if not self.handle:
            _raise()
        self._closed = False

    @property
    def closed(self):
        return self._closed

    def _h(self):
        if self._closed:
            raise ZMQError(ENOTSOCK)
        return self.handle

    def close(self, linger=None):
        if self._closed:
            return
        if linger is not None:
            self.setsockopt(LINGER, linger)
        _close(self.handle)
        self._closed = True

    def __del__(self):
        try:
            if not self._closed and not self.context.closed:
                self.close(0)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # options
    def setsockopt(self, option, value):
        kind = _KIND.get(option, "b" if isinstance(value, (bytes, bytearray)) else "i")
        if kind == "b":
            b = _as_bytes(value, "setsockopt")
            _call(_setsockopt, self._h(), option, ctypes.c_char_p(b), len(b))
        else:
            v = (ctypes.c_int64 if kind == "q" else ctypes.c_int)(int(value))
            _call(_setsockopt, self._h(), option, ctypes.byref(v), ctypes.sizeof(v))

    def getsockopt(self, option):
        kind = _KIND.get(option, "i")
        if kind == "b":
            buf = ctypes.create_string_buffer(1024)
            n = _sz(len(buf))
            _call(_getsockopt, self._h(), option, buf, ctypes.byref(n))
            out = buf.raw[:n.value]
            return out[:-1] if option == LAST_ENDPOINT and out.endswith(b"\0") else out
        v = (ctypes.c_int64 if kind == "q" else ctypes.c_int)()
        n = _sz(ctypes.sizeof(v))
        _call(_getsockopt, self._h(), option, ctypes.byref(v), ctypes.byref(n))
        return v.value

    set, get = setsockopt, getsockopt

    def setsockopt_string(self, option, value, encoding="utf-8"):
        self.setsockopt(option, value.encode(encoding))

    def getsockopt_string(self, option, encoding="utf-8"):
        return self.getsockopt(option).decode(encoding)

    @property
    def last_endpoint(self):
        return self.getsockopt(LAST_ENDPOINT)

    # endpoints
    def bind(self, addr):
        _call(_bind, self._h(), addr.encode())

    def unbind(self, addr):
        _call(_unbind, self._h(), addr.encode())

    def connect(self, addr):
        _call(_connect, self._h(), addr.encode())

    def disconnect(self, addr):
        _call(_disconnect, self._h(), addr.encode())

    def bind_to_random_port(self, addr, min_port=49152, max_port=65536, max_tries=100):
        """Binds addr on a free port and returns it: the system's choice
        (addr:*) for the default range, else random tries within it."""
        if (min_port, max_port) == (49152, 65536):
            self.bind("%s:*" % addr)
            return int(self.last_endpoint.decode().rsplit(":", 1)[1])
        for _ in range(max_tries):
            port = random.randrange(min_port, max_port)
            try:
                self.bind("%s:%d" % (addr, port))
                return port
            except ZMQError as ex:
                if ex.errno not in (EADDRINUSE, _errno.EACCES):
                    raise
        raise ZMQBindError("could not bind %s to a port in [%d, %d) in %d tries" % (
            addr, min_port, max_port, max_tries))

    # messages
    def send(self, data, flags=0, copy=True, track=False):
        """Sends one frame (bytes, bytearray, memoryview or any buffer)."""
        if isinstance(data, str):
            raise TypeError("send: str is not allowed, use send_string (pyzmq semantics)")
        if isinstance(data, bytes):
            ptr, n, keep = ctypes.cast(ctypes.c_char_p(data), _vp), len(data), data
        else:
            mv = memoryview(data).cast("B")
            if mv.readonly or not mv.contiguous:
                keep = bytes(mv)
                ptr, n = ctypes.cast(ctypes.c_char_p(keep), _vp), len(keep)
            else:
                keep = (ctypes.c_char * mv.nbytes).from_buffer(mv)
                ptr, n = ctypes.cast(keep, _vp), mv.nbytes
        _call(_send, self._h(), ptr, n, flags)
        del keep

    def send_multipart(self, msg_parts, flags=0, copy=True, track=False):
        parts = list(msg_parts)
        for i, p in enumerate(parts):
            self.send(p, flags | (SNDMORE if i < len(parts) - 1 else 0))

    def send_string(self, u, flags=0, copy=True, encoding="utf-8"):
        self.send(u.encode(encoding), flags)

    def _recv_frame(self, flags):
        msg = _Msg()
        _msg_init(ctypes.byref(msg))
        try:
            n = _call(_msg_recv, ctypes.byref(msg), self._h(), flags)
            data = ctypes.string_at(_msg_data(ctypes.byref(msg)), n) if n else b""
            return data, bool(_msg_more(ctypes.byref(msg)))
        finally:
            _msg_close(ctypes.byref(msg))

    def recv(self, flags=0, copy=True, track=False):
        """Receives one frame as bytes (Again with NOBLOCK when none is waiting)."""
        return self._recv_frame(flags)[0]

    def recv_multipart(self, flags=0, copy=True, track=False):
        data, more = self._recv_frame(flags)
        parts = [data]
        while more:
            data, more = self._recv_frame(0)
            parts.append(data)
        return parts

    def recv_string(self, flags=0, encoding="utf-8"):
        return self.recv(flags).decode(encoding)

    def poll(self, timeout=None, flags=POLLIN):
        """Waits up to timeout ms (None: forever) for flags; returns the events seen (0 on timeout)."""
        p = Poller()
        p.register(self, flags)
        ev = dict(p.poll(timeout))
        return ev.get(self, 0)


class Poller:
    """zmq_poll over registered zmq sockets and/or file descriptors."""

    def __init__(self):
        self.sockets = []  # [(socket or fd, flags)]

    def register(self, socket, flags=POLLIN | POLLOUT):
        if flags:
            self.unregister(socket, missing_ok=True)
            self.sockets.append((socket, flags))
        else:
            self.unregister(socket, missing_ok=True)

    def modify(self, socket, flags=POLLIN | POLLOUT):
        self.register(socket, flags)

    def unregister(self, socket, missing_ok=False):
        for i, (s, _) in enumerate(self.sockets):
            if s is socket:
                del self.sockets[i]
                return
        if not missing_ok:
            raise KeyError(socket)

    def poll(self, timeout=None):
        """Returns [(socket, revents)] of the ready ones within timeout ms (None: forever)."""
        n = len(self.sockets)
        items = (_PollItem * max(n, 1))()
        for i, (s, fl) in enumerate(self.sockets):
            if isinstance(s, Socket):
                items[i].socket, items[i].fd = s._h(), 0
            else:
                items[i].socket, items[i].fd = None, s if isinstance(s, int) else s.fileno()
            items[i].events = fl
        t = -1 if timeout is None or timeout < 0 else int(timeout)
        _call(_poll, items, n, t)
        return [(self.sockets[i][0], items[i].revents) for i in range(n) if items[i].revents]


def select(rlist, wlist, xlist, timeout=None):
    """zmq.select: timeout in seconds, as pyzmq."""
    p = Poller()
    for s in set(rlist) | set(wlist) | set(xlist):
        p.register(s, (POLLIN if s in rlist else 0) | (POLLOUT if s in wlist else 0) |
                   (POLLERR if s in xlist else 0))
    ev = dict(p.poll(None if timeout is None else timeout * 1000))
    return ([s for s in rlist if ev.get(s, 0) & POLLIN], [s for s in wlist if ev.get(s, 0) & POLLOUT],
            [s for s in xlist if ev.get(s, 0) & POLLERR])
