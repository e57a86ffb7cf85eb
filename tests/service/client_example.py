#!/usr/bin/env python3
"""client_example.py: a minimal twain.v1 client in Python (docs/api.md), with
Debian's python3-zmq and python3-protobuf only.

    python3 client_example.py [--endpoint tcp://127.0.0.1:7400]
                              [--desc build/tests/service/twain.desc] "question"

The message classes are built at run time from the descriptor set that the
build writes (protoc-c --descriptor_set_out, see tests/service/CMakeLists.txt),
so no generated Python files are needed. It sends one streaming Chat request,
prints the final-channel text as it arrives, then the usage line."""
import argparse
import os
import sys

import zmq
from google.protobuf import descriptor_pb2, descriptor_pool

try:
    from google.protobuf.message_factory import GetMessageClass
except ImportError:  # python3-protobuf 3.x/4.21 (Debian 12)
    from google.protobuf import message_factory

    def GetMessageClass(desc):
        return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)


def load(desc_path):
    fds = descriptor_pb2.FileDescriptorSet()
    with open(desc_path, "rb") as f:
        fds.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)
    get = lambda name: GetMessageClass(pool.FindMessageTypeByName(name))
    return get("twain.v1.ClientRequest"), get("twain.v1.ServerReply"), pool


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:7400")
    ap.add_argument("--desc", default=os.environ.get("TW_PROTO_DESC", "build/tests/service/twain.desc"))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("question")
    args = ap.parse_args()
    ClientRequest, ServerReply, pool = load(args.desc)
    code_names = {v.number: v.name for v in pool.FindEnumTypeByName("twain.v1.Code").values}

    sock = zmq.Context.instance().socket(zmq.DEALER)  # DEALER: streamed replies
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)

    req = ClientRequest(request_id=1)
    msg = req.chat.messages.add()
    msg.role = "user"
    msg.content = args.question
    req.chat.stream = True
    req.chat.sampling.max_tokens = 256
    sock.send(req.SerializeToString())

    while True:
        if not sock.poll(int(args.timeout * 1000)):
            print("no reply within %.0f s" % args.timeout, file=sys.stderr)
            return 1
        rep = ServerReply()
        rep.ParseFromString(sock.recv())
        for d in rep.deltas:
            if d.channel == "final":
                print(d.content, end="", flush=True)
        if rep.done:
            print()
            if rep.error.code:
                print("error %s: %s" % (code_names.get(rep.error.code), rep.error.message), file=sys.stderr)
                return 1
            print("usage: prompt %d, completion %d tokens, ttft %.1f ms" % (
                rep.usage.prompt_tokens, rep.usage.completion_tokens, rep.timings.ttft_ms))
            return 0


if __name__ == "__main__":
    sys.exit(main())
