"""svc.py: helpers for the service integration tests: the twain.v1 and
internal protobuf classes (from the descriptor set protoc-c writes at build
time), a cluster of real router/prefill/decode processes on 127.0.0.1 with
ephemeral ports, and a ZeroMQ client. Every wait is bounded."""
import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
import urllib.request

if os.environ.get("TW_ZMQ_CTYPES") == "1":  # forced: the ctypes binding, tested in CI
    import zmq_ctypes as zmq
else:
    try:
        import zmq
    except ImportError:  # no pyzmq (the GPU machine): ctypes over libzmq.so.5
        import zmq_ctypes as zmq
from google.protobuf import descriptor_pb2, descriptor_pool

try:
    from google.protobuf.message_factory import GetMessageClass as _get_class
except ImportError:  # protobuf < 4.22
    from google.protobuf import message_factory as _mf
    _factory = None

    def _get_class(desc):
        global _factory
        if _factory is None:
            _factory = _mf.MessageFactory(desc.file.pool)
        return _factory.GetPrototype(desc)

BUILD = os.environ.get("TW_BUILD_DIR", "")
# Every wait below is bounded for an optimised build; a sanitizer build runs
# several times slower and raises this factor (deploy/dev.sh sanitize sets it).
TIME_SCALE = max(1.0, float(os.environ.get("TWAIN_TEST_TIME_SCALE", "1") or 1))


def scaled(seconds):
    """A time bound (optimised-build seconds) stretched for this build: for
    the timeouts and deadlines a test hands to a process (`--timeout-ms`,
    `--deadline-ms`, subprocess timeouts)."""
    return seconds * TIME_SCALE


# Router option for tests whose subject is not worker expiry. The router
# expires a worker it has not heard from for --expire-ms (1 s, x
# TWAIN_TEST_TIME_SCALE in a sanitizer build) and fails the requests that were
# streaming from it ("decode worker ... stopped responding"). In the sanitizer
# pass on a loaded 2-core machine the scheduler has left a worker silent for
# 4 to 13 s, heartbeat thread included; such a test would fail for a reason
# that is not its subject. Expiry stays covered where it is the subject
# (test_service_stall, test_service_stall_retry).
CALM_EXPIRE = ["--expire-ms", str(int(scaled(20) * 1000))]


def deadline(seconds):
    """time.time() at which a wait of `seconds` (optimised-build time) ends."""
    return time.time() + scaled(seconds)
MODEL = os.environ.get("TW_MODEL_DIR", "")
DESC = os.environ.get("TW_PROTO_DESC", os.path.join(BUILD, "tests", "service", "twain.desc"))


def load_protos(path=DESC):
    fds = descriptor_pb2.FileDescriptorSet()
    with open(path, "rb") as f:
        fds.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)
    ns = {}
    for fd in fds.file:
        for name in fd.message_type:
            full = fd.package + "." + name.name
            ns[full] = _get_class(pool.FindMessageTypeByName(full))
    enums = {}
    for fd in fds.file:
        for e in fd.enum_type:
            for v in e.value:
                enums[v.name] = v.number
    return ns, enums


def link_keys():
    """The link keys (common/comm/link_auth.h) every process of the tests' clusters
    shares: made once per test process with `twain keygen` into a private
    temporary file, published as TWAIN_KEYS_FILE so children inherit it;
    returns {name: key} (e.g. "client-secret") for fake workers."""
    global _LINK_KEYS
    if _LINK_KEYS is None:
        path = os.environ.get("TWAIN_KEYS_FILE")
        if not path:
            d = tempfile.mkdtemp(prefix="tw_keys_")
            atexit.register(shutil.rmtree, d, True)
            path = os.path.join(d, "link.keys")
            subprocess.run([os.path.join(BUILD, "router", "twain"), "keygen", path], check=True,
                           timeout=30)
            os.environ["TWAIN_KEYS_FILE"] = path
        _LINK_KEYS = read_keys(path)
    return _LINK_KEYS


def read_keys(path):
    """{name: key} of a `twain keygen` file (its `name = key` lines)."""
    keys = {}
    with open(path) as f:
        for line in f:
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                keys[k.strip()] = v.strip()
    return keys


_LINK_KEYS = None


def worker_socket(ctx, routing_id, endpoint, keys=None):
    """A DEALER to the router's worker endpoint, as a worker makes it: CURVE
    with the link keys (keys=False: plaintext, as an intruder would try;
    a dict: those keys instead)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, routing_id)
    if keys is not False:
        k = keys if keys else link_keys()
        s.setsockopt(zmq.CURVE_SERVERKEY, k["server-public"].encode())
        s.setsockopt(zmq.CURVE_PUBLICKEY, k["client-public"].encode())
        s.setsockopt(zmq.CURVE_SECRETKEY, k["client-secret"].encode())
    s.connect(endpoint)
    return s


if BUILD and os.path.exists(os.path.join(BUILD, "router", "twain")):
    link_keys()  # every process a test starts inherits the set

P, E = load_protos()


def register_envelope(name, pool, ranks=1, free_blocks=0):
    """The Register a fake worker sends: `pool` "POOL_PREFILL" or
    "POOL_DECODE", 16-token blocks, 4 layers, cpu backend."""
    env = P["twain.internal.v1.Envelope"]()
    g = env.register
    g.pool = E[pool]
    g.name = name
    g.ranks = ranks
    g.kv_block_size = 16
    g.n_layers = 4
    g.backend = "cpu"
    g.capacity.free_kv_blocks = g.capacity.total_kv_blocks = free_blocks
    return env
ClientRequest = P["twain.v1.ClientRequest"]
ServerReply = P["twain.v1.ServerReply"]
Envelope = P["twain.internal.v1.Envelope"]


def _die_with_parent():
    """Child side of Popen: SIGKILL when the test process dies, so a test
    that is killed (ctest timeout) never leaves daemons behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_ALL_PROCS = []


def _descendants(pids):
    """Every live descendant of pids (from /proc ppid links)."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], list(pids)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_all():
    """Teardown that cannot be skipped: SIGKILL every process (group) this test
    started that is still alive, and everything they started themselves
    (mpirun ranks, serve's workers, which sit in process groups of their own),
    found through /proc before the parents die. Runs at exit and on SIGTERM,
    so a failing or killed test leaves nothing behind."""
    for pid in _descendants([pr.p.pid for pr in _ALL_PROCS if pr.p.poll() is None]):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pr in _ALL_PROCS:
        try:
            os.killpg(pr.p.pid, signal.SIGKILL)  # own session: pgid == pid
        except OSError:
            pass
        try:
            pr.p.kill()
            pr.p.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _on_term(sig, frame):
    kill_all()
    os._exit(128 + sig)


atexit.register(kill_all)
signal.signal(signal.SIGTERM, _on_term)


class Proc:
    """A child process whose stdout/stderr lines are collected by threads. It
    runs in its own session (process group) so kill_all() reaches whatever it
    starts; SIGKILLed if the test process dies (PR_SET_PDEATHSIG)."""

    def __init__(self, argv, name, env=None):
        self.name = name
        self.argv = argv
        self.lines = []
        self.settled = False
        self.lock = threading.Lock()
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True, errors="replace",
                                  preexec_fn=_die_with_parent, start_new_session=True, env=env)
        _ALL_PROCS.append(self)
        self.pumps = [threading.Thread(target=self._pump, args=(stream,), daemon=True)
                      for stream in (self.p.stdout, self.p.stderr)]
        for t in self.pumps:
            t.start()

    def _pump(self, stream):
        for line in stream:
            with self.lock:
                self.lines.append(line.rstrip("\n"))
            if os.environ.get("TW_TEST_VERBOSE"):
                print("[%s] %s" % (self.name, line.rstrip()), flush=True)

    def settle(self, timeout=5.0):
        """Once the process has exited: waits (bounded) until the reader
        threads reached the end of its output, so `lines` holds every line it
        wrote (they lag behind the process, more so on a loaded machine). A
        no-op while it runs, or when something it started still holds the
        pipes open past the bound."""
        if self.p.poll() is None or self.settled:
            return
        end = deadline(timeout)
        for t in self.pumps:
            t.join(max(0.0, end - time.time()))
        self.settled = True

    def wait_line(self, pattern, timeout=30.0):
        rx = re.compile(pattern)
        end = deadline(timeout)
        while time.time() < end:
            exited = self.p.poll() is not None
            if exited:
                self.settle()
            with self.lock:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
            if exited:
                break
            time.sleep(0.02)
        raise AssertionError("%s: no line matching %r within %.0f s (exit %s); last lines:\n%s" % (
            self.name, pattern, timeout, self.p.poll(), "\n".join(self.lines[-30:])))

    def count(self, pattern):
        """Lines matching pattern so far (every line, once the process exited)."""
        self.settle()
        rx = re.compile(pattern)
        with self.lock:
            return sum(1 for line in self.lines if rx.search(line))

    def wait_count(self, pattern, n, timeout=15.0):
        """Polls (bounded) until at least n lines match pattern; returns the
        count then, or the last count at the deadline."""
        end = deadline(timeout)
        got = self.count(pattern)
        while got < n and time.time() < end:
            time.sleep(0.02)
            got = self.count(pattern)
        return got

    def seen(self, pattern, timeout=15.0):
        """True once a line matches pattern (polled, bounded), else False: for a
        line the process writes before the event the test waited for, which
        the reader threads may not have collected yet."""
        try:
            self.wait_line(pattern, timeout)
            return True
        except AssertionError:
            return False

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        try:  # anything it started and left behind
            os.killpg(self.p.pid, signal.SIGKILL)
        except OSError:
            pass
        self.settle()
        return self.p.returncode


def bin_path(*parts):
    return os.path.join(BUILD, *parts)


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, val = line.rsplit(" ", 1)
        key = re.sub(r"\{process=\"[^\"]*\"(,)?", "{", key)
        key = re.sub(r"model_name=\"[^\"]*\",?", "", key).replace("{}", "")  # every sample has it
        out[key] = float(val)
    return out


fails = 0


def check(cond, what, proc=None):
    """One test assertion: prints 'ok  : what' or 'FAIL: what' and counts the
    failures, so a test reports every check before finish() decides. On a
    failure, proc (a Proc, optional) has its last 40 lines printed after it:
    what the process said up to the failed check."""
    global fails
    print("%s: %s" % ("ok  " if cond else "FAIL", what), flush=True)
    if not cond:
        fails += 1
        if proc is not None:
            with proc.lock:
                tail = proc.lines[-40:]
            print("  %s's last %d lines:\n%s" % (proc.name, len(tail), "\n".join("    " + ln for ln in tail)),
                  flush=True)


skipped = 0


def require_all():
    """TWAIN_REQUIRE_ALL=1 (CI, where every dependency is installed): a skipped
    part of a test is a failure."""
    return os.environ.get("TWAIN_REQUIRE_ALL", "") not in ("", "0")


def skip_part(what):
    """A part of the test that could not run here (a missing dependency, a
    premise that does not hold): reported, and the test then exits 77 (ctest:
    skipped) instead of passing, or fails under TWAIN_REQUIRE_ALL=1."""
    global skipped
    print("SKIP (part): %s" % what, flush=True)
    skipped += 1


def exit_code(n_fails, n_skipped):
    """1 after a failure; 77, or 1 under TWAIN_REQUIRE_ALL=1, after a skipped part; else 0."""
    if n_fails:
        return 1
    if n_skipped:
        return 1 if require_all() else 77
    return 0


def finish():
    """Print the verdict and exit: 1 if any check failed, 77 (or 1 under
    TWAIN_REQUIRE_ALL=1) if a part was skipped, else 0."""
    rc = exit_code(fails, skipped)
    print("PASS" if rc == 0 else "FAIL (%d)" % fails if fails else
          "PASS with %d part(s) skipped%s" % (skipped, ": a failure under TWAIN_REQUIRE_ALL=1" if rc else ""))
    sys.exit(rc)


# The ASan pass (deploy/dev.sh sanitize) sets TW_SOAK_RSS_CHECK=0: ASan's
# quarantine keeps freed memory resident, so the router's RSS says nothing
# about leaks there; the plain pass checks its bounds (test_service_soak,
# test_service_validate).
RSS_CHECK = os.environ.get("TW_SOAK_RSS_CHECK", "1") != "0"


def rss_kb(pid):
    """Resident memory of process pid in kB (0 if it is gone)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def wait_metric(port, key, want, timeout=15):
    """Polls a worker's /metrics until `key` equals `want` (gauges are set by
    the worker loop after it sends the last reply, so a client can read the
    old value for a moment); returns the last value read."""
    end = deadline(timeout)
    v = None
    while time.time() < end:
        v = metrics(port).get(key)
        if v == want:
            return v
        time.sleep(0.05)
    return v


def wait_tokens(cl, rid, n, timeout=60):
    """Pumps client cl until request rid has n tokens or ended; raises
    AssertionError after timeout seconds."""
    end = deadline(timeout)
    while time.time() < end:
        cl.pump(0.02)
        if len(tokens_of(cl.replies.get(rid, []))) >= n or cl.done(rid):
            return
    raise AssertionError("request %d produced fewer than %d tokens in %d s" % (rid, n, timeout))


def running_by_worker(decodes, want, idle, timeout=15):
    """Where the router put the streams, read from the decode workers: polls
    their twain_decode_running_sequences until they add up to want() (or
    timeout), calling idle() between reads; returns {worker_name: count}."""
    end = deadline(timeout)
    while True:
        running = {d.worker_name: metrics(d.metrics_port).get("twain_decode_running_sequences", 0)
                   for d in decodes}
        if sum(running.values()) == want() or time.time() > end:
            return running
        idle()


class Cluster:
    """A router plus workers as separate processes on 127.0.0.1."""

    def __init__(self, prefill=1, decode=1, router_args=(), decode_args=(), prefill_args=(),
                 threads=1):
        self.procs = []
        self.threads = threads
        self.decode_args = list(decode_args)
        self.prefill_args = list(prefill_args)
        self.router = Proc([bin_path("router", "twain-router"), "--model", MODEL,
                            "--listen", "tcp://127.0.0.1:0", "--workers", "tcp://127.0.0.1:0",
                            "--metrics-port", "0"] + list(router_args), "router")
        m = self.router.wait_line(r"listening clients=(\S+) workers=(\S+)", 30)
        self.client_ep, self.worker_ep = m.group(1), m.group(2)
        self.router_metrics_port = int(self.router.wait_line(r"metrics port (\d+)", 10).group(1))
        self.n_workers = 0
        self.prefills, self.decodes = [], []
        for _ in range(prefill):
            self.add_prefill()
        for _ in range(decode):
            self.add_decode()
        self.wait_registered(prefill, decode)

    def _worker(self, kind, extra):
        self.n_workers += 1
        name = "%s-t%d-%d" % (kind, self.n_workers, os.getpid())
        exe = bin_path("prefill", "twain-prefill") if kind == "prefill" else bin_path("decode", "twain-decode")
        p = Proc([exe, "--router", self.worker_ep, "--model", MODEL, "--name", name,
                  "--backend", "cpu", "--threads", str(self.threads), "--metrics-port", "0"] + extra, name)
        p.worker_name = name
        p.metrics_port = int(p.wait_line(r"serving /metrics and /healthz on 127\.0\.0\.1:(\d+)", 60).group(1))
        self.procs.append(p)
        return p

    def add_prefill(self, extra=()):
        p = self._worker("prefill", self.prefill_args + list(extra))
        self.prefills.append(p)
        return p

    def add_decode(self, extra=()):
        p = self._worker("decode", self.decode_args + list(extra))
        self.decodes.append(p)
        return p

    def wait_registered(self, n_prefill, n_decode, timeout=60):
        end = deadline(timeout)
        while time.time() < end:
            m = metrics(self.router_metrics_port)
            if m.get("twain_router_prefill_workers", 0) >= n_prefill and \
               m.get("twain_router_decode_workers", 0) >= n_decode:
                return
            time.sleep(0.05)
        raise AssertionError("workers did not register within %d s" % timeout)

    def client(self):
        return Client(self.client_ep)

    def close(self):
        rcs = {}
        for p in self.procs:
            rcs[p.name] = p.stop()
        rcs["router"] = self.router.stop()
        return rcs


class Client:
    """A DEALER client: send requests, gather replies per request_id."""

    def __init__(self, endpoint, curve=None):
        """curve: {"server-public", "client-public", "client-secret"} for a
        router whose client socket is CURVE (--client-keys); None: plaintext."""
        self.ctx = zmq.Context.instance()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        if curve:
            self.s.setsockopt(zmq.CURVE_SERVERKEY, curve["server-public"].encode())
            self.s.setsockopt(zmq.CURVE_PUBLICKEY, curve["client-public"].encode())
            self.s.setsockopt(zmq.CURVE_SECRETKEY, curve["client-secret"].encode())
        self.s.connect(endpoint)
        self.replies = {}
        self.next_id = 1

    def send(self, req):
        if not req.request_id:
            req.request_id = self.next_id
            self.next_id += 1
        self.s.send(req.SerializeToString())
        self.replies.setdefault(req.request_id, [])
        return req.request_id

    def send_raw(self, data):
        self.s.send(data)

    def pump(self, timeout=0.05):
        if self.s.poll(int(timeout * 1000)):
            while True:
                try:
                    data = self.s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                rep = ServerReply()
                rep.ParseFromString(data)
                self.replies.setdefault(rep.request_id, []).append(rep)

    def done(self, rid):
        r = self.replies.get(rid, [])
        return bool(r) and r[-1].done

    def wait(self, rids, timeout=120.0):
        end = deadline(timeout)
        while time.time() < end and not all(self.done(r) for r in rids):
            self.pump(0.05)
        missing = [r for r in rids if not self.done(r)]
        assert not missing, "requests %s did not finish within %.0f s" % (missing[:8], timeout)
        return [self.replies[r] for r in rids]

    def close(self):
        self.s.close(0)


def generate(ids, max_tokens, stream=True, stop_ids=(), **kw):
    r = ClientRequest()
    r.generate.prompt_ids.extend(ids)
    r.generate.stream = stream
    r.generate.sampling.max_tokens = max_tokens
    r.generate.sampling.explicit_max_tokens = True
    r.generate.sampling.stop_token_ids.extend(stop_ids)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def chat(text, max_tokens=64, stream=True, date="2025-06-01", reasoning=None):
    r = ClientRequest()
    m = r.chat.messages.add()
    m.role = "user"
    m.content = text
    r.chat.stream = stream
    r.chat.date = date
    r.chat.sampling.max_tokens = max_tokens
    if reasoning:
        r.chat.reasoning = E["REASONING_" + reasoning.upper()]
    return r


def tokens_of(replies):
    out = []
    for rep in replies:
        out.extend(rep.token_ids)
    return out


def reference_generate(ids, n, stop_ids=(), tmpdir="/tmp"):
    """Greedy continuation from `twain-prefill --generate` in one process."""
    path = os.path.join(tmpdir, "tw_prompt_%d_%d.json" % (os.getpid(), abs(hash(tuple(ids))) % 100000))
    with open(path, "w") as f:
        f.write("[" + ",".join(str(i) for i in ids) + "]")
    argv = [bin_path("prefill", "twain-prefill"), "--model", MODEL, "--backend", "cpu",
            "--prompt-tokens", path, "--generate", str(n), "--threads", "1"]
    if stop_ids:
        argv += ["--stop-ids", ",".join(str(i) for i in stop_ids)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    os.unlink(path)
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]
