"""fake_router.py: the router's worker socket run by a test, to drive real
prefill and decode workers with messages a router would never send. A CURVE
server with the deployment's link keys (the workers talk only CURVE, to the
key set's server), on 127.0.0.1. Every wait is bounded."""
import time

import svc
from svc import zmq  # pyzmq, or the ctypes binding where it is missing


class FakeRouter:
    def __init__(self):
        self.ctx = zmq.Context.instance()
        self.rs = self.ctx.socket(zmq.ROUTER)
        self.rs.setsockopt(zmq.LINGER, 0)
        self.rs.setsockopt(zmq.CURVE_SERVER, 1)
        self.rs.setsockopt(zmq.CURVE_SECRETKEY, svc.link_keys()["server-secret"].encode())
        port = self.rs.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = "tcp://127.0.0.1:%d" % port
        self.procs = []

    def start_workers(self, decode_args=()):
        """A real decode worker "fd" and prefill worker "fp" of this router
        (cpu backend, the tiny model, one thread each): (decode, prefill)."""
        common = ["--router", self.endpoint, "--model", svc.MODEL, "--backend", "cpu", "--threads", "1",
                  "--metrics-port", "0"]
        self.procs = [svc.Proc([svc.bin_path("decode", "twain-decode"), "--name", "fd"] + common +
                               list(decode_args), "decode"),
                      svc.Proc([svc.bin_path("prefill", "twain-prefill"), "--name", "fp"] + common, "prefill")]
        return self.procs[0], self.procs[1]

    def recv_from(self, name, pred, timeout=20):
        """The next envelope from worker `name` (bytes) for which pred(env)
        holds; others are dropped. AssertionError after timeout s."""
        end = svc.deadline(timeout)
        while time.time() < end:
            if self.rs.poll(50):
                ident, data = self.rs.recv_multipart()
                e = svc.Envelope()
                try:
                    e.ParseFromString(data)
                except Exception:
                    continue
                if ident == name and pred(e):
                    return e
        raise AssertionError("no expected message from %s within %d s" % (name, timeout))

    def recv_body(self, name, body, timeout=20, rid=None):
        """The next envelope with that oneof body (and request_id rid, when given)."""
        return self.recv_from(name, lambda e: e.WhichOneof("body") == body and
                              (rid is None or getattr(e, body).request_id == rid), timeout)

    def send(self, name, env):
        self.rs.send_multipart([name, env.SerializeToString()])

    def send_raw(self, name, data):
        self.rs.send_multipart([name, data])

    def register(self, names):
        """Wait for each worker's Register and acknowledge it: {name: Register}."""
        regs = {}
        for name in names:
            regs[name] = self.recv_body(name, "register").register
            ack = svc.Envelope()
            ack.register_ack.worker_id = name.decode()
            self.send(name, ack)
        return regs

    def decode(self, name, rid, n_prompt_tokens, done, max_tokens, timeout=30):
        """Start decoding request rid on decode worker `name` after its
        PrefillDone `done` (checksums verified when the worker runs
        --verify-kv) and collect its ids, the first token included, until
        finished or timeout s."""
        d = svc.Envelope()
        d.decode.request_id = rid
        d.decode.n_prompt_tokens = n_prompt_tokens
        d.decode.first_token = done.first_token
        d.decode.max_tokens = max_tokens
        d.decode.layer_checksums.extend(done.layer_checksums)
        self.send(name, d)
        toks = [done.first_token]
        end = svc.deadline(timeout)
        while time.time() < end:
            t = self.recv_body(name, "tokens", rid=rid).tokens
            toks.extend(t.tokens)
            if t.finished:
                break
        return toks

    def close(self):
        """Stop the workers (SIGTERM) and the socket: the workers' exit codes."""
        rcs = [p.stop() for p in self.procs]
        self.rs.close(0)
        return rcs


def with_pools(handoff, pools):
    """What the router adds to a reservation's handoff: the decode worker's
    pools from its Register (address, rkey, layout)."""
    full = svc.Envelope().prefill.handoff
    full.CopyFrom(handoff)
    full.ucx_address, full.rkey = pools.ucx_address, pools.rkey
    full.layout.CopyFrom(pools.layout)
    return full
