"""Robustness found by a new-user test of the service:
- a decode worker whose prefill peer died mid-handoff drains without
  waiting for (or counting) its quarantined reservations;
- CLI usage errors: loose numbers, --help, --reasoning, --date, unknown options
  (exit 2 naming the flag and the value); `twain chat` with no server fails
  fast instead of waiting out --timeout-ms;
- a standalone router's /healthz is 503 with a reason while a pool is empty;
  a worker whose router died logs it once and keeps running; malformed-frame
  warnings are rate limited;
- `twain serve` restarts a worker killed with -9 and serves again; a 600 MiB
  frame is dropped by libzmq (ZMQ_MAXMSGSIZE) without a memory spike; empty
  chat prompts and stop ids outside the vocabulary are INVALID_ARGUMENT;
  `chat --json` prints the error as JSON; an answer cut by max_tokens before
  the final channel is exit 3 with a note; workers default --model.
Every wait is bounded."""
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import zmq

import fixtures
import svc

from svc import check, finish


twain = svc.bin_path("router", "twain")


def run(*argv, timeout=60):
    try:
        return subprocess.run([twain] + list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, -999, "", "TIMEOUT after %d s" % timeout)


def healthz(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/healthz" % port, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_health(port, code, timeout=15):
    end = svc.deadline(timeout)
    got = None
    while time.time() < end:
        got = healthz(port)
        if got[0] == code:
            return got
        time.sleep(0.05)
    return got


def dead_port():
    """A port nobody listens on and nobody else can take while the test
    runs (ctest -j runs other servers on ephemeral ports): bound, never
    listening, so a connection to it is refused. Returns (socket, port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def vm_hwm_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


# ---- 5, 6, 10: usage errors, no server needed
bad = [
    (["generate", "abc"], "token id", "abc"),
    (["generate", "12abc"], "token id", "12abc"),
    (["generate", "1.5"], "token id", "1.5"),
    (["generate", "--max-tokens", "1e3", "1"], "--max-tokens", "1e3"),
    (["generate", "--max-tokens", "abc", "1"], "--max-tokens", "abc"),
    (["generate", "--max-tokens", "99999999999999999999", "1"], "--max-tokens", "99999999999999999999"),
    (["generate", "--stop-ids", "5,x", "1"], "--stop-ids", "x"),
    (["chat", "--temperature", "abc", "hi"], "--temperature", "abc"),
    (["chat", "--seed", "abc", "hi"], "--seed", "abc"),
    (["chat", "--max-tokens", "abc", "hi"], "--max-tokens", "abc"),
    (["generate", "--temperature", "abc", "1"], "--temperature", "abc"),
    (["generate", "--seed", "abc", "1"], "--seed", "abc"),
    (["chat", "--date", "2025-13-01", "hi"], "--date", "2025-13-01"),
    (["chat", "--date", "June 1", "hi"], "--date", "June 1"),
]
for argv, flag, val in bad:
    r = run(*argv, timeout=20)
    check(r.returncode == 2 and flag in r.stderr and ("'%s'" % val) in r.stderr,
          "twain %s: exit 2 naming %s and '%s' (rc %s: %s)" % (" ".join(argv), flag, val, r.returncode,
                                                              r.stderr.strip().splitlines()[:1]))
for cmd in ("chat", "generate"):
    r = run(cmd, "--help", timeout=20)
    check(r.returncode == 0 and r.stdout.startswith("usage: twain " + cmd), "twain %s --help: usage, exit 0" % cmd)
r = run("chat", "--reasoning", "extreme", "hi", timeout=20)
check(r.returncode == 2 and "--reasoning must be low, medium or high, got 'extreme'" in r.stderr,
      "chat --reasoning extreme: %s" % r.stderr.strip().splitlines()[:1])
r = run("serve", "--bogus", timeout=20)
check(r.returncode == 2 and "unknown option --bogus" in r.stderr, "serve --bogus: %s" % r.stderr.strip().splitlines()[:1])
r = run("chat", "--bogus", timeout=20)
check(r.returncode == 2 and "unknown option --bogus" in r.stderr, "chat --bogus: unknown option")

# ---- 2: no server: fail fast (the default --timeout-ms is 300000; this is bounded by 60 s)
dead_sock, dead = dead_port()
dead_ep = "tcp://127.0.0.1:%d" % dead
r = run("chat", "--endpoint", dead_ep, "hi", timeout=60)
check(r.returncode == 1 and ("no answer from %s within 5000 ms (is `twain serve` running?)" % dead_ep) in r.stderr,
      "chat with no server fails fast: rc %s %r" % (r.returncode, r.stderr.strip()[:160]))
r = run("chat", "--json", "--endpoint", dead_ep, "--connect-timeout-ms", "300", "hi", timeout=60)
ok = r.returncode == 1
try:
    j = json.loads(r.stdout)
    ok = ok and j["error"]["code"] == "UNAVAILABLE" and "no answer from" in j["error"]["message"]
except (ValueError, KeyError, TypeError):
    ok = False
check(ok, "chat --json with no server: a JSON error object (%r)" % r.stdout.strip()[:160])
dead_sock.close()

# ---- 1 (router side), 9, 10: standalone router; /healthz, worker defaults, orphan, rate limit
c = svc.Cluster(1, 0)
try:
    code, text = wait_health(c.router_metrics_port, 503, 5)
    check(code == 503 and "no decode worker" in text, "router /healthz with no decode worker: %s %r" % (code, text.strip()))
    # 9: a decode worker without --model joins with the default model
    name = "decode-nomodel-%d" % os.getpid()
    d = svc.Proc([svc.bin_path("decode", "twain-decode"), "--router", c.worker_ep, "--name", name,
                  "--backend", "cpu", "--threads", "1", "--metrics-port", "0"], name)
    c.procs.append(d)
    c.wait_registered(1, 1, 60)
    code, text = wait_health(c.router_metrics_port, 200, 10)
    check(code == 200, "twain-decode without --model registers; router /healthz 200 (%s %r)" % (code, text.strip()))
    r = subprocess.run([svc.bin_path("decode", "twain-decode"), "--backend", "cpu"], capture_output=True,
                       text=True, timeout=30)
    check(r.returncode == 2 and "missing --router" in r.stderr, "twain-decode without --router says so")
    r = subprocess.run([svc.bin_path("prefill", "twain-prefill"), "--router", "tcp://127.0.0.1:1",
                        "--help-me", "x"], capture_output=True, text=True, timeout=30)
    check(r.returncode == 2 and "--help-me" in r.stderr, "twain-prefill unknown option named")
    # 1: kill -9 the only decode worker: not ready, with a reason
    d.p.send_signal(signal.SIGKILL)
    code, text = wait_health(c.router_metrics_port, 503, 15)
    check(code == 503 and "no decode worker registered" in text,
          "router /healthz after kill -9 of the only decode worker: %s %r" % (code, text.strip()))
    # 10: malformed frames: warnings rate limited, with a "suppressed" count
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(c.client_ep)
    for burst in range(2):
        for _ in range(60):
            s.send(b"\xff\xff\xff\xff")
        end = svc.deadline(10)
        n = 0
        while time.time() < end and n < 60:
            if s.poll(200):
                s.recv()
                n += 1
        time.sleep(1.1)
    s.send(b"\xff\xff\xff\xff")
    suppressed = c.router.seen(r"suppressed \d+ similar warnings")
    n_warn = c.router.count(r"malformed protobuf from a client")
    check(n_warn <= 3 * 5 and suppressed,
          "malformed-frame warnings rate limited: %d lines for 121 frames, plus a suppressed count" % n_warn)
    s.close(0)
    # 1: a worker whose router died logs it once and keeps running
    pre = c.prefills[0]
    c.router.p.send_signal(signal.SIGKILL)
    try:
        pre.wait_line(r"lost the router at", 15)
        time.sleep(1.5)
        check(pre.p.poll() is None and pre.count(r"lost the router at") == 1,
              "orphaned prefill worker logs the lost router once and keeps running")
    except AssertionError as e:
        check(False, "orphaned prefill worker logs the lost router: %s" % str(e)[:300])
finally:
    c.close()

# ---- 4: the decode drain does not wait for (or count) quarantined reservations
c = svc.Cluster(1, 1)
try:
    # the prefill worker's greeting of the decode worker done first: a kill
    # during that greeting is UCX 1.13's own abort (Debian's assertions, "got
    # REP message", docs/architecture.md), not the handoff this case is about
    c.router.wait_line(r"prefill worker \S+ connected to 1 decode workers' kv pools ahead of traffic", 30)
    cl = c.client()
    long_ids = (fixtures.long_prompt() * 10)[:1000]
    rids = [cl.send(svc.generate(long_ids, 8)) for _ in range(12)]
    end = svc.deadline(10)
    while time.time() < end:  # until the decode worker holds reservations
        cl.pump(0.01)
        if svc.metrics(c.decodes[0].metrics_port).get("twain_kv_blocks_used", 0) > 0:
            break
    c.prefills[0].p.send_signal(signal.SIGKILL)  # mid-handoff: reservations get cancelled
    try:
        cl.wait(rids, 30)
    except AssertionError as e:
        print(str(e)[:200])
    d = c.decodes[0]
    if d.p.poll() is not None:  # how it ended, rather than a refused /metrics below
        d.settle()
        check(False, "the decode worker survives its prefill peer's kill -9 mid-handoff: it exited (%s); "
              "its last lines:\n%s" % (d.p.poll(), "\n".join(d.lines[-60:])))
    else:
        # the router cancels the reservations as it fails the requests; on a
        # loaded machine the cancels can still be on their way when the
        # replies are here
        svc.wait_metric(d.metrics_port, "twain_decode_queue_depth", 0)
        dm = svc.metrics(d.metrics_port)
        q, used = dm.get("twain_kv_blocks_quarantined", -1), dm.get("twain_kv_blocks_used", -1)
        check(0 < q <= used, "the quarantined reservations' blocks are shown apart: "
              "twain_kv_blocks_quarantined %s of twain_kv_blocks_used %s" % (q, used))
        rc = d.stop(signal.SIGTERM, 30)
        m = re.search(r"draining: (\d+) sequences to finish \((\d+) quarantined", "\n".join(d.lines))
        check(m is not None and m.group(1) == "0" and int(m.group(2)) > 0,
              "decode drain: 0 sequences to finish, quarantined reported apart (%s)" % (
                  m.group(0) if m else d.lines[-3:]))
        check(rc == 0 and d.count(r"stopped: 0 kv blocks in use") == 1,
              "decode stops at once with every block free (rc %s)" % rc)
        # known, not fixed: UCX's own receive-side requests towards the dead
        # peer (error handling mode NONE) are reported at ucp_worker_destroy
        print("note: %d UCX 'not returned to mpool' lines at the decode shutdown" % d.count(r"not returned to mpool"))
finally:
    c.close()

# ---- serve: restart, 600 MiB frame, chat errors
serve = svc.Proc([twain, "serve", "--listen", "tcp://127.0.0.1:0", "--threads", "1", "--metrics-port", "0",
                  "--backend", "cpu"], "serve")
try:
    m = serve.wait_line(r"ready.*clients at (\S+)", 90)
    ep = m.group(1)
    mport = int(serve.wait_line(r"metrics port (\d+)", 10).group(1))
    ids = [str(i) for i in fixtures.ids("short_dog")]
    # 1: kill -9 the decode worker mid-stream: serve restarts it, the stream is
    # resumed on the restarted worker and ends with the uninterrupted run's tokens
    dpid = int(serve.wait_line(r"registered: decode pool, backend \w+, pid (\d+)", 10).group(1))
    n_long = 3000  # about 1.5 s or more of decoding here: mid-stream at the kill
    stream = subprocess.Popen([twain, "generate", "--endpoint", ep, "--max-tokens", str(n_long)] + ids,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = svc.deadline(60)
    while time.time() < end and svc.metrics(mport).get("twain_router_tokens_streamed_total", 0) < 1:
        time.sleep(0.01)
    os.kill(dpid, signal.SIGKILL)
    try:
        serve.wait_line(r"worker decode-0-\d+ \(pid %d\) exited \(signal 9\): restarting it" % dpid, 15)
        serve.wait_line(r"worker decode-0-\d+-r1 registered", 90)
        restarted = True
    except AssertionError as e:
        print(str(e)[:400])
        restarted = False
    check(restarted and serve.p.poll() is None, "serve restarted the killed decode worker")
    code, _ = wait_health(mport, 200, 15)
    check(code == 200, "router /healthz 200 again after the restart")
    try:
        out, err = stream.communicate(timeout=svc.scaled(120))
    except subprocess.TimeoutExpired:
        stream.kill()
        out, err = stream.communicate()
    want = svc.reference_generate(fixtures.ids("short_dog"), n_long)
    got = [int(t) for t in out.split()]
    check(stream.returncode == 0 and got == want,
          "the stream under way at the kill resumed on the restarted worker: %d of %d tokens as the "
          "reference (rc %s, first difference at %s) %s" % (
              len(got), n_long, stream.returncode,
              next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), "-"), err.strip()[-200:]))
    check(svc.metrics(mport).get("twain_router_requests_resumed_total", 0) == 1,
          "serve's router resumed one stream")
    r = run("generate", "--endpoint", ep, "--max-tokens", "4", *ids, timeout=120)
    check(r.returncode == 0 and len(r.stdout.split()) == 4, "generate after the restart: %r %r" % (r.stdout.strip(), r.stderr.strip()[-200:]))
    # 3: a 600 MiB frame is dropped by libzmq; the router's peak memory stays bounded
    hwm0 = vm_hwm_kb(serve.p.pid)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    big = bytearray(600 << 20)
    s.send(big, copy=False)
    time.sleep(4)  # bounded: the frame is either dropped or delivered by then
    s.close(0)
    del big
    hwm1 = vm_hwm_kb(serve.p.pid)
    check(hwm1 - hwm0 < 128 * 1024, "router VmHWM after a 600 MiB frame: +%d MiB" % ((hwm1 - hwm0) // 1024))
    r = run("generate", "--endpoint", ep, "--max-tokens", "4", *ids, timeout=120)
    check(r.returncode == 0 and len(r.stdout.split()) == 4, "still serving after the big frame")
    # 7: empty / whitespace-only chat prompt
    for text in ("", "   \n\t"):
        r = run("chat", "--endpoint", ep, text, timeout=60)
        check(r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "empty" in r.stderr,
              "chat %r: INVALID_ARGUMENT (%s)" % (text, r.stderr.strip()[:160]))
    # 10: stop ids outside the vocabulary; chat --json error object
    r = run("generate", "--endpoint", ep, "--stop-ids", "999999999", "--max-tokens", "4", *ids, timeout=60)
    check(r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "stop_token_ids[0] = 999999999" in r.stderr,
          "stop id outside the vocabulary: %s" % r.stderr.strip()[:160])
    r = run("chat", "--endpoint", ep, "--json", "  ", timeout=60)
    try:
        j = json.loads(r.stdout)
        ok = r.returncode == 1 and j["error"]["code"] == "INVALID_ARGUMENT"
    except (ValueError, KeyError, TypeError):
        ok = False
    check(ok, "chat --json error: %r" % r.stdout.strip()[:160])
    # 8: max_tokens cuts the analysis before the final channel
    r = run("chat", "--endpoint", ep, "--max-tokens", "3", "What does the word 'dog' mean?", timeout=120)
    check(r.returncode == 3 and "LENGTH" in r.stderr and "analysis" in r.stderr,
          "chat cut by max_tokens: exit 3 with a note (rc %s, %r)" % (r.returncode, r.stderr.strip()[:200]))
    check(serve.count(r"cuda memory staged") == 0, "CPU workers do not mention CUDA staging")
finally:
    rc = serve.stop(signal.SIGINT, 40)
check(rc == 0, "serve stops with 0 (rc %s)" % rc)
finish()
