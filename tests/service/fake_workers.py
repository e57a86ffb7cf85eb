"""fake_workers.py: a prefill and a decode worker speaking twain.internal.v1
from one thread, with no engine: each request's generated ids come from a
script (a list of ids, or a function of the prompt ids returning one), so
tests can drive the router's Harmony parser and its APIs with exact model
output. Records every prompt (and its sampling parameters) it was sent and
every cancel it got. Every wait
is bounded."""
import threading
import time

import svc
from svc import zmq  # pyzmq, or the ctypes binding where it is missing


def tokenize(text):
    """Token ids of text with Harmony special tokens (`twain tokenize --allow-special`)."""
    import subprocess
    tok = subprocess.run([svc.bin_path("router", "twain"), "tokenize", "--model", svc.MODEL,
                          "--allow-special"], input=text, capture_output=True, text=True,
                         timeout=60, check=True)
    return [int(x) for x in tok.stdout.strip().strip("[]").split(",") if x.strip()]


class FakeWorkers(threading.Thread):
    """script: ids, or f(prompt_ids) -> ids. token_delay: seconds between
    streamed ids (0: all at once). The decode side stops at a stop id of the
    request, at its max_tokens, or at the script's end; while `hold` is set
    it sends nothing after each request's first id. instance: Register.instance
    (0: none). stall_prefills: that many PrefillRequests make the prefill side
    go silent (no heartbeat, no answer, what arrives meanwhile dropped) for
    stall_s, then register again, with the same instance (a stalled process)
    or, with new_instance, another (a restarted one); with register_delay_s,
    it heartbeats (under its name) that long before it registers (a stalled
    process whose main loop is busy when it resumes)."""

    def __init__(self, endpoint, script, token_delay=0.0, instance=0, stall_prefills=0, stall_s=0.8,
                 new_instance=False, register_delay_s=0.0):
        super().__init__(daemon=True)
        self.ctx = zmq.Context.instance()
        self.script = script
        self.token_delay = token_delay
        self.socks = {}
        self.instance = instance
        self.stall_prefills, self.stall_s, self.new_instance = stall_prefills, stall_s, new_instance
        self.silent_until = 0
        self.register_delay_s, self.register_at = register_delay_s, 0
        self.stalls = 0
        self.lock = threading.Lock()
        self.prompts = {}      # request_id -> prompt ids
        self.sampling = {}     # request_id -> (temperature, top_p, top_k, seed) of its PrefillRequest
        self.cancelled = set()
        self.seen = []
        self.pending = {}      # request_id -> ids, between prefill and decode
        self.streams = {}      # request_id -> [ids left, stop ids, max, next time]
        for name, pool in ((b"fake-prefill", "POOL_PREFILL"), (b"fake-decode", "POOL_DECODE")):
            s = svc.worker_socket(self.ctx, name, endpoint)  # with the link keys
            self.socks[name] = s
            self._register(name)
        self.stop = False
        self.hold = False      # True: streams wait (tests line requests up)

    def _register(self, name):
        pool = "POOL_PREFILL" if name == b"fake-prefill" else "POOL_DECODE"
        env = svc.register_envelope(name.decode(), pool, ranks=0, free_blocks=100000)
        env.register.instance = self.instance
        self.socks[name].send(env.SerializeToString())

    def _ids(self, prompt):
        return list(self.script(prompt) if callable(self.script) else self.script)

    def _send_tokens(self, s, rid, toks, finished, length=False):
        o = svc.Envelope()
        o.tokens.request_id = rid
        o.tokens.tokens.extend(toks)
        o.tokens.finished = finished
        o.tokens.finish_reason = (svc.E["FINISH_LENGTH"] if length else svc.E["FINISH_STOP"]) if finished else 0
        s.send(o.SerializeToString())

    def _pump_streams(self, s):
        now = time.time()
        for rid in list(self.streams):
            left, stops, room, due = self.streams[rid]
            if due > now:
                continue
            batch = []
            while left and room > 0:
                t = left.pop(0)
                batch.append(t)
                room -= 1
                if t in stops or self.token_delay:
                    break
            stopped = bool(batch) and batch[-1] in stops
            done = not left or room <= 0 or stopped
            self._send_tokens(s, rid, batch, done, length=room <= 0 and not stopped)
            if done:
                del self.streams[rid]
            else:
                self.streams[rid] = [left, stops, room, now + self.token_delay]

    def run(self):
        last_hb = 0
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        dec = self.socks[b"fake-decode"]
        pre = self.socks[b"fake-prefill"]
        while not self.stop:
            if self.silent_until and time.time() >= self.silent_until:  # resumed
                self.silent_until = 0
                if self.new_instance:
                    self.instance += 1
                self.register_at = time.time() + self.register_delay_s
            if self.register_at and time.time() >= self.register_at:
                self.register_at = 0
                self._register(b"fake-prefill")
            if time.time() - last_hb > 0.2:
                for name, s in self.socks.items():
                    if s is pre and self.silent_until:
                        continue
                    e = svc.Envelope()
                    e.heartbeat.worker = name.decode()
                    e.heartbeat.capacity.free_kv_blocks = e.heartbeat.capacity.total_kv_blocks = 100000
                    s.send(e.SerializeToString())
                last_hb = time.time()
            # a stream's next id due sooner than 5 ms: do not sleep past it
            wait = (max(1, min(5, int(self.token_delay * 1000))) if self.token_delay else 5) if self.streams else 50
            for s, _ in poller.poll(wait):
                e = svc.Envelope()
                e.ParseFromString(s.recv())
                kind = e.WhichOneof("body")
                if s is pre and self.silent_until:
                    continue  # stalled: the work of before is void once it registers again
                if kind == "prefill" and self.stalls < self.stall_prefills:
                    self.stalls += 1
                    self.silent_until = time.time() + self.stall_s
                    continue
                with self.lock:
                    self.seen.append(kind)
                out = svc.Envelope()
                if kind == "reserve":
                    out.reserved.request_id = e.reserve.request_id
                    out.reserved.handoff.block_ids.extend([0])
                    out.reserved.handoff.layout.n_layers = 4
                elif kind == "prefill":
                    rid = e.prefill.request_id
                    ids = self._ids(list(e.prefill.prompt_ids))
                    with self.lock:
                        self.prompts[rid] = list(e.prefill.prompt_ids)
                        sp = e.prefill.sampling
                        self.sampling[rid] = (sp.temperature, sp.top_p, sp.top_k, sp.seed)
                    self.pending[rid] = ids  # streamed once decode starts
                    out.prefill_done.request_id = rid
                    out.prefill_done.first_token = ids[0]
                elif kind == "decode":
                    rid = e.decode.request_id
                    ids = self.pending.pop(rid, [0])
                    self.streams[rid] = [ids[1:], set(e.decode.stop_token_ids),
                                         e.decode.max_tokens - 1, 0]
                    if ids[0] in e.decode.stop_token_ids:
                        del self.streams[rid]  # the first token ended it (the router knows)
                    continue
                elif kind == "cancel":
                    with self.lock:
                        self.cancelled.add(e.cancel.request_id)
                    self.streams.pop(e.cancel.request_id, None)
                    continue
                else:
                    continue
                s.send(out.SerializeToString())
            if not self.hold:
                self._pump_streams(dec)

    def close(self):
        self.stop = True
        self.join(5)


def router_with_fakes(script, token_delay=0.0, extra=(), **fake_kw):
    """A twain-router (HTTP API on an ephemeral port) with fake workers
    (FakeWorkers(..., **fake_kw)); a worker is expired only after 10 s of
    silence (unless extra sets --expire-ms), so a loaded machine that starves
    the fakes' heartbeat thread does not make them vanish.
    Returns (router Proc, FakeWorkers, client endpoint, http base url)."""
    router = svc.Proc([svc.bin_path("router", "twain-router"), "--model", svc.MODEL,
                       "--listen", "tcp://127.0.0.1:0", "--workers", "tcp://127.0.0.1:0",
                       "--metrics-port", "0", "--http-port", "0", "--expire-ms", "10000",
                       "--expect-prefill", "1", "--expect-decode", "1"] + list(extra), "router")
    m = router.wait_line(r"listening clients=(\S+) workers=(\S+)", 30)
    url = router.wait_line(r"serving the OpenAI API on (http://127\.0\.0\.1:\d+)/v1", 10).group(1)
    fw = FakeWorkers(m.group(2), script, token_delay, **fake_kw)
    fw.start()
    router.wait_line(r"twain-router: ready", 30)
    return router, fw, m.group(1), url
