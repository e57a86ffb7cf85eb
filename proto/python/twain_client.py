"""twain_client: a small Python client of the twain.v1 API (docs/api.md) over
ZeroMQ, with python3-zmq and python3-protobuf only (Debian's packages work).

    import twain_client
    c = twain_client.Client("tcp://127.0.0.1:7400")
    for text in c.chat("What does the word dog mean?"):   # final-channel text
        print(text, end="", flush=True)
    print(c.last.usage.completion_tokens)                  # the done reply
    ids = c.generate([1, 2, 3], max_tokens=8)               # token ids

The message classes are built at run time from the protobuf descriptor set
(twain.desc), so no generated Python files are needed. It is found in this
order: the `desc` argument, $TW_PROTO_DESC, a twain.desc next to this file or
in ../proto/ (the relocatable bundle: share/twain/python/ and
share/twain/proto/), then the build tree (build/tests/service/twain.desc).

A router whose client socket is CURVE (`--client-keys`, docs/operations.md
"Client socket security") needs its public key: Client(server_key=KEY) or
$TWAIN_SERVER_KEY (40 Z85 characters, or a file with a `server-public = KEY`
line); identity= or $TWAIN_IDENTITY_FILE names this client's key pair (a
`twain keygen` file; default: a fresh pair), needed when the router admits
only an allow-list of client keys."""
import os
import time

import zmq
from google.protobuf import descriptor_pb2, descriptor_pool

try:
    from google.protobuf.message_factory import GetMessageClass
except ImportError:  # python3-protobuf 3.x/4.21 (Debian 12)
    from google.protobuf import message_factory

    def GetMessageClass(desc):
        return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7400"


def _set_sampling(sp, sampling):
    """SamplingParams fields from keyword arguments: lists (stop,
    stop_token_ids) into their repeated fields; a seed of the caller's, 0
    included, marked explicit (the same tokens every time)."""
    for k, v in sampling.items():
        if isinstance(v, (list, tuple)):
            getattr(sp, k).extend(v)
        else:
            setattr(sp, k, v)
    if "seed" in sampling:
        sp.explicit_seed = True


class TwainError(Exception):
    """An error reply: .code is the v1 Code name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message


def find_descriptor_set(desc=None):
    """The path of twain.desc (see the module text), or raise FileNotFoundError."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [desc, os.environ.get("TW_PROTO_DESC"), os.path.join(here, "twain.desc"),
                  os.path.join(here, "..", "proto", "twain.desc"),
                  os.path.join(here, "..", "..", "build", "tests", "service", "twain.desc")]
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    raise FileNotFoundError("twain.desc not found (give desc=, set TW_PROTO_DESC, or use the bundle's "
                            "share/twain/python/ where it is found by itself)")


def load(desc=None):
    """(ClientRequest, ServerReply, pool) classes from the descriptor set."""
    fds = descriptor_pb2.FileDescriptorSet()
    with open(find_descriptor_set(desc), "rb") as f:
        fds.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)

    def get(name):
        return GetMessageClass(pool.FindMessageTypeByName(name))

    return get("twain.v1.ClientRequest"), get("twain.v1.ServerReply"), pool


def _key_file(path, names):
    """{name: key} of the `name = key` lines of a key file, for `names`."""
    keys = {}
    with open(path) as f:
        for line in f:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                keys[k.strip()] = v.strip()
    missing = [n for n in names if len(keys.get(n, "")) != 40]
    if missing:
        raise ValueError("%s: no %s line with a 40-character key" % (path, missing[0]))
    return keys


def curve_keys(server_key=None, identity=None):
    """(server public, client public, client secret) for a CURVE router, or
    None for plaintext (no server key given, none in $TWAIN_SERVER_KEY)."""
    server_key = server_key or os.environ.get("TWAIN_SERVER_KEY")
    identity = identity or os.environ.get("TWAIN_IDENTITY_FILE")
    if not server_key:
        if identity:
            raise ValueError("a client key pair (identity) needs the router's public key (server_key)")
        return None
    if len(server_key) != 40 or os.path.isfile(server_key):
        server_key = _key_file(server_key, ["server-public"])["server-public"]
    if identity:
        k = _key_file(identity, ["client-public", "client-secret"])
        pub, sec = k["client-public"].encode(), k["client-secret"].encode()
    else:
        pub, sec = zmq.curve_keypair()
    return server_key.encode(), pub, sec


class Client:
    """One DEALER socket to a router's client endpoint; requests one at a time."""

    def __init__(self, endpoint=DEFAULT_ENDPOINT, desc=None, timeout_s=300.0, server_key=None,
                 identity=None):
        self.ClientRequest, self.ServerReply, pool = load(desc)
        self.codes = {v.number: v.name for v in pool.FindEnumTypeByName("twain.v1.Code").values}
        self.timeout_s = timeout_s
        curve = curve_keys(server_key, identity)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, curve[0])
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, curve[1])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, curve[2])
        # the connection's closing (the router stopped or crashed) ends a wait
        # at once: what was in flight on it can get no reply any more
        self.mon = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        self.next_id = 1
        self.last = None  # the done reply of the last request (usage, timings, finish_reason)

    def close(self):
        self.sock.disable_monitor()
        self.mon.close()
        self.sock.close()

    def _lost(self):
        """Whether the monitor saw the connection close (reads its events)."""
        from zmq.utils.monitor import recv_monitor_message
        lost = False
        while self.mon.poll(0):
            lost |= recv_monitor_message(self.mon)["event"] == zmq.EVENT_DISCONNECTED
        return lost

    def _call(self, req):
        req.request_id = self.next_id
        self.next_id += 1
        self._lost()  # a close before this request (the socket connects again) is not its
        self.sock.send(req.SerializeToString())
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        end = time.monotonic() + self.timeout_s
        while True:
            ready = dict(poller.poll(max(0, int((end - time.monotonic()) * 1000))))
            if self.sock not in ready:
                if self.mon in ready and self._lost():
                    raise TwainError("UNAVAILABLE", "the connection to the router closed before the "
                                     "answer ended (the router stopped or crashed)")
                if time.monotonic() < end:
                    continue
                raise TimeoutError("no reply within %.0f s (is `twain serve` running?)" % self.timeout_s)
            rep = self.ServerReply()
            rep.ParseFromString(self.sock.recv())
            if rep.request_id != req.request_id:
                continue
            if rep.done:
                self.last = rep
                if rep.error.code:
                    raise TwainError(self.codes.get(rep.error.code, "UNKNOWN"), rep.error.message)
            yield rep
            if rep.done:
                return

    def chat(self, messages, max_tokens=256, reasoning=None, **sampling):
        """Stream a chat: yields the final channel's text as it arrives.
        messages: a string (one user message) or [{"role", "content"}...];
        reasoning: "low", "medium" or "high"; sampling: temperature, seed..."""
        req = self.ClientRequest()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for m in messages:
            x = req.chat.messages.add()
            for k, v in m.items():
                setattr(x, k, v)
        req.chat.stream = True
        req.chat.sampling.max_tokens = max_tokens
        _set_sampling(req.chat.sampling, sampling)
        if reasoning:
            req.chat.reasoning = {"low": 1, "medium": 2, "high": 3}[reasoning]
        for rep in self._call(req):
            for d in rep.deltas:
                if d.channel == "final" and d.content:
                    yield d.content

    def generate(self, prompt_ids, max_tokens=16, stop_ids=(), **sampling):
        """Raw token ids in, the generated ids out (a list)."""
        req = self.ClientRequest()
        req.generate.prompt_ids.extend(prompt_ids)
        req.generate.stream = True
        req.generate.sampling.max_tokens = max_tokens
        req.generate.sampling.stop_token_ids.extend(stop_ids)
        _set_sampling(req.generate.sampling, sampling)
        out = []
        for rep in self._call(req):
            out.extend(rep.token_ids)
        return out
