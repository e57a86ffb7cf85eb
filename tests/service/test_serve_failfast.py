"""Fail fast: `twain serve` whose worker cannot start because of its
configuration or environment stops at once with that error instead of
restarting it (it used to restart each worker five times over 17 s):
- a model whose config and tokenizer are fine (the router loads them) but
  whose weights are not there: the workers exit 78 naming the file, serve
  exits 78 within 3 s;
- a bad option value reaching a worker (TWAIN_DECODE_MAX_BATCH=abc from the
  environment): the decode worker exits 2 naming it, serve exits within 3 s;
- `--backend cuda` on a machine without a GPU: serve exits 78 within 3 s
  naming the cause, and so does a lone twain-decode (78: its own check);
- a worker that was serving and is killed is still restarted (the restart
  policy is for crashes only), and a restart that cannot start (its metrics
  port taken meanwhile: exit 78) is retried, not taken for a configuration
  error, until a restart serves again;
- a decode worker killed six times in a row is not restarted a sixth time,
  and from then on a request fails at once (UNAVAILABLE, "none will be
  restarted") instead of waiting out --pool-grace-ms;
- serve killed with SIGKILL mid-answer takes its workers with it (a decode
  worker drained on its own before, decoding for nobody), and its clients
  (`twain generate`, `twain bench`, the Python client) see the connection
  close at once instead of waiting out their timeout.
Every wait is bounded."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import svc
from svc import check, finish

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto", "python"))
import twain_client  # noqa: E402

TWAIN = svc.bin_path("router", "twain")
LIMIT_S = 3.0


def serve(args, env=None, timeout=30):
    e = {k: v for k, v in os.environ.items() if not k.startswith("TWAIN_") or k == "TWAIN_LOG"}
    e.update(env or {})
    t0 = time.monotonic()
    try:
        r = subprocess.run([TWAIN, "serve", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "-1",
                            "--backend", "cpu", "--threads", "1"] + args,
                           capture_output=True, text=True, timeout=timeout, env=e)
        return r, time.monotonic() - t0
    except subprocess.TimeoutExpired as ex:
        return subprocess.CompletedProcess(ex.cmd, -1, "", str(ex.stderr or "")), time.monotonic() - t0


def decode_children(serve_p):
    """The pids of the twain-decode processes serve started."""
    return subprocess.run(["pgrep", "-P", str(serve_p.p.pid), "-f", "twain-decode"], capture_output=True,
                          text=True).stdout.split()


tmp = tempfile.mkdtemp(prefix="tw_failfast_")
broken = os.path.join(tmp, "no-weights")
os.makedirs(broken)
for f in ("config.json", "tokenizer.json", "generation_config.json"):
    shutil.copy(os.path.join(svc.MODEL, f), broken)

r, dt = serve(["--model", broken])
check(r.returncode == 78 and dt < LIMIT_S, "bad model: serve exit 78 in %.2f s (< %.0f s): rc %d" % (dt, LIMIT_S, r.returncode))
check("could not start: a configuration or environment error" in r.stderr and broken in r.stderr
      and "restarting" not in r.stderr,
      "bad model: the worker's error and serve's verdict, no restart: %r" % r.stderr.strip()[-400:])

missing = os.path.join(tmp, "no-model-here")
r, dt = serve(["--model", missing])
check(r.returncode == 78 and dt < LIMIT_S and ("twain serve: no model at %s" % missing) in r.stderr and
      "router failed" not in r.stderr and r.stderr.count("cannot open config") == 2,
      "no model at the path: serve exit 78 at once, one error and its verdict (rc %d, %.2f s): %r" %
      (r.returncode, dt, r.stderr.strip()[-300:]))

r, dt = serve([], env={"TWAIN_DECODE_MAX_BATCH": "abc"})
check(r.returncode == 78 and dt < LIMIT_S, "bad worker option: serve exit 78 in %.2f s: rc %d" % (dt, r.returncode))
check("environment TWAIN_DECODE_MAX_BATCH: --max-batch must be an integer" in r.stderr
      and "exit status 2" in r.stderr and "restarting" not in r.stderr,
      "bad worker option: named, no restart: %r" % r.stderr.strip()[-300:])

gpu = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
if not gpu:
    r, dt = serve(["--backend", "cuda"])
    check(r.returncode == 78 and dt < LIMIT_S and "--backend cuda: no CUDA GPU is usable" in r.stderr,
          "--backend cuda without a GPU: serve exit 78 in %.2f s: %r" % (dt, r.stderr.strip()[-200:]))
    t0 = time.monotonic()
    d = subprocess.run([svc.bin_path("decode", "twain-decode"), "--router", "tcp://127.0.0.1:9", "--backend", "cuda",
                        "--model", svc.MODEL], capture_output=True, text=True, timeout=30)
    dt = time.monotonic() - t0
    check(d.returncode == 78 and dt < LIMIT_S and "cannot start" in d.stderr,
          "twain-decode --backend cuda without a GPU: exit 78 in %.2f s: %r" % (dt, d.stderr.strip()[-200:]))

# a serving worker that dies is restarted (crash), serve stays up
e = {k: v for k, v in os.environ.items() if not k.startswith("TWAIN_") or k == "TWAIN_LOG"}
serve_p = svc.Proc([TWAIN, "serve", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--http-port", "-1",
                    "--backend", "cpu", "--threads", "1"], "serve", env=e)
serve_p.wait_line(r"twain serve: ready", 60)
kids = decode_children(serve_p)
check(len(kids) == 1, "one decode worker child: %s" % kids)
if kids:
    os.kill(int(kids[0]), signal.SIGKILL)
check(serve_p.seen(r"restarted worker decode-0", 30) and serve_p.p.poll() is None,
      "a killed serving worker is restarted, serve stays up")
# one that drains and exits 0 after a SIGTERM of someone else's: started again
# (INFO, not a crash: no restart count, no warning)
check(serve_p.seen(r"worker decode-0-\d+-r1 registered", 30), "the restarted worker registered", serve_p)
kids = decode_children(serve_p)
if kids:
    os.kill(int(kids[0]), signal.SIGTERM)
check(serve_p.seen(r"INFO .*worker decode-0-\d+-r1 \(pid \d+\) drained and exited \(status 0\): starting a "
                   r"fresh one", 30) and serve_p.seen(r"INFO .*restarted worker decode-0-\d+-r2 as pid", 15) and
      serve_p.seen(r"worker decode-0-\d+-r2 registered", 30),
      "a worker that drained and exited 0 is started again, logged at INFO", serve_p)
check(serve_p.count(r"restart 2 of") == 0, "a drained exit is not counted as a crash")
rc = serve_p.stop(signal.SIGTERM, 30)
check(rc == 0, "serve stops cleanly (rc %s)" % rc)

# serve killed (kill -9, the OOM killer) while a long answer is decoded: its
# workers go with it (their router was inside serve); the decode worker used
# to drain on its own, decoding for nobody
serve_p = svc.Proc([TWAIN, "serve", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0", "--http-port", "-1",
                    "--backend", "cpu", "--threads", "1"], "serve", env=e)
ready = serve_p.wait_line(r"twain serve: ready.*clients at (\S+)", 60)
rport = int(serve_p.wait_line(r"twain serve: metrics: router http://127\.0\.0\.1:(\d+)/metrics", 10).group(1))
kids = decode_children(serve_p) + subprocess.run(["pgrep", "-P", str(serve_p.p.pid), "-f", "twain-prefill"],
                                                 capture_output=True, text=True).stdout.split()
gens = [subprocess.Popen([TWAIN, "generate", "--endpoint", ready.group(1), "--max-tokens", "4000", "--timeout-ms",
                          "60000", "1", "2", str(3 + i)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(4)]
bench_json = os.path.join(tmp, "bench.json")
bench = subprocess.Popen([TWAIN, "bench", "--endpoint", ready.group(1), "--model", svc.MODEL, "--num-requests", "8",
                          "--concurrency", "2", "--input-len", "8", "--output-len", "4000", "--timeout-ms", "60000",
                          "--json", bench_json], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
py_end = {}


def py_client():  # the Python client module, the same way
    t = None
    try:
        c = twain_client.Client(ready.group(1), timeout_s=60)
        list(c._call(_py_req(c)))
    except Exception as ex:  # noqa: BLE001 (what it raised is the result)
        t = ex
    py_end["t"], py_end["ex"] = time.monotonic(), t


def _py_req(c):
    req = c.ClientRequest()
    req.generate.prompt_ids.extend([1, 2, 9])
    req.generate.stream = True
    req.generate.sampling.max_tokens = 4000
    return req


py = threading.Thread(target=py_client, daemon=True)
py.start()
# every client's request is being served (4 generate, 2 of bench, 1 Python)
running = svc.wait_metric(rport, "twain_router_running_requests", 7, svc.scaled(30))
check(running == 7, "7 answers are being decoded before the kill (%s)" % running)
serve_p.p.send_signal(signal.SIGKILL)
serve_p.p.wait(10)
t_kill = time.monotonic()
# the clients see the router's connection close at once (they waited out
# their --timeout-ms, 300 s by default, before)
ends = []
for g in gens + [bench]:
    try:
        _, err = g.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        g.kill()
        _, err = g.communicate(timeout=10)
    ends.append((g.returncode, time.monotonic() - t_kill, err.strip().splitlines()[-1:] if err else []))
check(all(rc == 1 and dt < 5 and "connection to the router" in (e[0] if e else "") for rc, dt, e in ends[:-1]),
      "kill -9 of serve: each twain generate ends within 5 s saying the connection closed: %s" % ends[:-1])
py.join(10)
check(isinstance(py_end.get("ex"), twain_client.TwainError) and py_end["ex"].code == "UNAVAILABLE" and
      py_end["t"] - t_kill < 5, "and the Python client raises UNAVAILABLE within 5 s: %r" % (py_end,))
try:
    bj = json.load(open(bench_json))
except (OSError, ValueError) as ex:
    bj = {"error": str(ex)}
check(ends[-1][0] == 1 and ends[-1][1] < 5 and bj.get("lost") == 2 and bj.get("completed", 0) == 0 and
      bj.get("failures") == {"UNAVAILABLE": 6},
      "and twain bench ends within 5 s: its 2 running requests lost, the 6 unsent UNAVAILABLE (%s; %s)" % (
          ends[-1], {k: bj.get(k) for k in ("completed", "lost", "failures", "error")}))
end = time.monotonic() + 5
while time.monotonic() < end and any(os.path.exists("/proc/%s" % k) for k in kids):
    time.sleep(0.1)
def running_pid(k):
    try:  # a process, not a zombie (it may be reaped meanwhile)
        return "Z" not in open("/proc/%s/stat" % k).read().split(")")[-1].split()[:1]
    except OSError:
        return False


alive = [k for k in kids if running_pid(k)]
check(len(kids) == 2 and not alive, "kill -9 of serve: its prefill and decode workers %s are gone within 5 s "
      "(alive: %s)" % (kids, alive))
for k in alive:
    os.kill(int(k), signal.SIGKILL)

# a restart that cannot start (here: the killed decode worker's metrics port
# is taken before its restart binds it, so the restart exits 78) is retried
# like a crash instead of stopping serve; once the port is free again the
# next restart serves
serve_p = svc.Proc([TWAIN, "serve", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0", "--http-port", "-1",
                    "--backend", "cpu", "--threads", "1"], "serve", env=e)
ready = serve_p.wait_line(r"twain serve: ready.*clients at (\S+)", 60)
m = serve_p.wait_line(r"twain serve: metrics: .*decode-0 http://127\.0\.0\.1:(\d+)/metrics", 5)
check(ready is not None and m is not None, "serve ready with the decode worker's metrics port printed")
kids = decode_children(serve_p)
if m and len(kids) == 1:
    port = int(m.group(1))
    os.kill(int(kids[0]), signal.SIGKILL)
    hold = socket.socket()
    bound = False
    t_end = time.monotonic() + 2.0  # the restart is due 0.5 s after the death
    while not bound and time.monotonic() < t_end:
        try:
            hold.bind(("127.0.0.1", port))
            hold.listen(1)
            bound = True
        except OSError:
            time.sleep(0.005)
    check(bound, "the killed decode worker's metrics port %d taken before its restart" % port)
    failed = serve_p.wait_line(r"worker decode-0-\d+-r1 \(pid \d+\) could not start again \(exit status 78", 15)
    hold.close()
    check(failed is not None and serve_p.p.poll() is None,
          "the restart that could not bind its port is logged, serve stays up")
    check(serve_p.seen(r"restarted worker decode-0-\d+-r2 as pid", 15), "serve restarts it again after its backoff")
    check(serve_p.seen(r"worker decode-0-\d+-r2 registered", 30),
          "the second restart registers with the router")
    r = subprocess.run([TWAIN, "generate", "--endpoint", ready.group(1), "--max-tokens", "3", "1", "2", "3"],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and len(r.stdout.split()) == 3,
          "a request is served after the retried restart: %r %r" % (r.stdout.strip(), r.stderr.strip()[-300:]))
else:
    check(False, "one decode worker child to kill: %s" % kids)
rc = serve_p.stop(signal.SIGTERM, 30)
check(rc == 0, "serve stops cleanly after the retried restart (rc %s)" % rc)

# a decode worker that keeps dying: after its restarts are used up, serve
# says no decode worker will come back and a request fails at once with
# UNAVAILABLE (it waited the whole --pool-grace-ms, 180 s, before), and a
# drain is not held up by it
serve_p = svc.Proc([TWAIN, "serve", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--http-port", "-1",
                    "--backend", "cpu", "--threads", "1"], "serve", env=e)
ready = serve_p.wait_line(r"twain serve: ready.*clients at (\S+)", 60)
check(ready is not None, "serve ready (the restart budget run)")
for k in range(6):  # the first start and five restarts (backoff 0.5 + 1 + 2 + 4 + 8 s)
    kids = decode_children(serve_p)
    if len(kids) != 1:
        break
    os.kill(int(kids[0]), signal.SIGKILL)
    if k < 5 and not serve_p.seen(r"restarted worker decode-0-\d+-r%d as pid" % (k + 1), 30):
        break
    if k < 5 and not serve_p.seen(r"worker decode-0-\d+-r%d registered" % (k + 1), 30):
        break
check(serve_p.seen(r"after 5 restarts in a row: not restarting it", 30) and
      serve_p.seen(r"no decode worker will be started again", 5),
      "serve gives up on the decode worker after 5 restarts in a row and says so")
if ready:
    t0 = time.monotonic()
    r = subprocess.run([TWAIN, "generate", "--endpoint", ready.group(1), "--max-tokens", "3", "1", "2", "3"],
                       capture_output=True, text=True, timeout=60)
    dt = time.monotonic() - t0
    check(r.returncode != 0 and dt < 10 and "none will be restarted" in r.stderr,
          "a request after that fails at once (%.1f s): %r" % (dt, r.stderr.strip()[-200:]))
t0 = time.monotonic()
rc = serve_p.stop(signal.SIGTERM, 30)
check(rc == 0 and time.monotonic() - t0 < 15, "serve stops cleanly after giving up (rc %s, %.1f s)" %
      (rc, time.monotonic() - t0))
shutil.rmtree(tmp, ignore_errors=True)
if gpu and not svc.fails:
    print("SKIP: the --backend cuda checks need a machine without a GPU")
    raise SystemExit(77)
finish()
