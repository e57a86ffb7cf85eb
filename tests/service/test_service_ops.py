"""Operator behaviour of the daemons: --metrics-addr (an explicit numeric
address is served, a host name is refused at start-up), /livez answers 200
while /healthz is 503 during a drain, --drain-timeout bounds a decode
worker's and the router's drain (a generation far longer than the timeout is
cut: the daemon logs the timeout, exits 0, and the client gets UNAVAILABLE),
a second SIGTERM ends a drain at once (decode worker, router) and a second
SIGINT the stop of `twain serve`,
an idle worker's process group holds no stray children, and the default
model is found next to a relocated bundle (share/twain/models relative to the
executable). Every wait is bounded; every process started is killed at exit
(svc.kill_all)."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import fixtures
import svc

from svc import check, finish


def outlasts(cl, rid, seconds):
    """The premise of a drain-timeout check: request rid (3900 tokens) must
    still be running `seconds` after the signal. Times 100 tokens after the
    first 5 and returns (True when the rest would take more than twice
    `seconds` at that rate, tokens/s). With the test hooks compiled in, the
    workers' 2 ms a step makes every backend qualify; without them a fast
    CPU or a GPU may decode this 4096-position model faster than a 2 s
    timeout (the flag takes whole seconds)."""
    svc.wait_tokens(cl, rid, 5)
    n0, t0 = len(svc.tokens_of(cl.replies.get(rid, []))), time.time()
    svc.wait_tokens(cl, rid, n0 + 100)
    n1, dt = len(svc.tokens_of(cl.replies.get(rid, []))), time.time() - t0
    rate = (n1 - n0) / max(dt, 1e-6)
    return (3900 - n1) / rate > 2 * seconds, rate


def skip_fast(who, rate):
    svc.skip_part("%s drain-timeout cut: at %.0f tokens/s the 3900-token stream ends before "
                  "the 2 s timeout (premise of the check; it holds on the CPU backend)" % (who, rate))


def http_code(port, path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def wait_code(port, path, want, timeout=10):
    end = svc.deadline(timeout)
    code = None
    while time.time() < end:
        code = http_code(port, path)
        if code == want:
            return code
        time.sleep(0.02)
    return code


def second_signal(cl, who, proc, sig, log_re, wait_s=10):
    """A 3900-token stream of client cl runs on daemon `proc`, whose drain
    would wait for it (the default --drain-timeout): `sig` once starts the
    drain (the stream goes on), a second `sig` stops it at once: `log_re`
    logged, exit 0 within wait_s, the stream cut with UNAVAILABLE."""
    rid = cl.send(svc.generate(prompt, 3900))
    svc.wait_tokens(cl, rid, 5)
    proc.p.send_signal(sig)
    check(proc.seen(r"draining", 10), "%s drains after the first signal" % who)
    n0 = len(svc.tokens_of(cl.replies.get(rid, [])))
    svc.wait_tokens(cl, rid, n0 + 3)
    check(proc.p.poll() is None and not cl.done(rid), "%s: the stream goes on while it drains" % who)
    t0 = time.time()
    proc.p.send_signal(sig)
    try:
        rc = proc.p.wait(svc.scaled(wait_s))
    except subprocess.TimeoutExpired:
        rc = None
    check(rc == 0, "%s exits 0 %.1f s after a second signal (rc %s)" % (who, time.time() - t0, rc))
    check(proc.count(log_re) == 1, "%s logs %r" % (who, log_re))
    reps = cl.wait([rid], 30)[0]
    check(reps and reps[-1].error.code == svc.E["UNAVAILABLE"],
          "%s: the stream ends UNAVAILABLE (%s)" % (who, reps[-1].error.message if reps else "no reply"))


def drain_cut(cl, who, proc, port, log_re, log_what, cut, ended):
    """SIGTERM daemon `proc` (metrics on `port`, started with --drain-timeout
    2) while a 3900-token stream of client cl runs: /healthz 503 and /livez
    200 while it drains, exit 0; when the stream outlasts the timeout (see
    outlasts), `log_re` logged once and the stream cut with UNAVAILABLE."""
    rid = cl.send(svc.generate(prompt, 3900))
    slow, rate = outlasts(cl, rid, 2)
    proc.p.send_signal(signal.SIGTERM)
    check(wait_code(port, "/healthz", 503, 5) == 503, "%s draining: /healthz 503" % who)
    check(http_code(port, "/livez") == 200, "%s draining: /livez 200" % who)
    try:
        rc = proc.p.wait(60)
    except subprocess.TimeoutExpired:
        rc = None
    check(rc == 0, "%s exits 0 after its drain timeout (rc %s)" % (who, rc))
    reps = cl.wait([rid], 30)[0]
    if slow:
        check(proc.count(log_re) == 1, log_what)
        check(reps[-1].error.code == svc.E["UNAVAILABLE"],
              "%s ends UNAVAILABLE (%s)" % (cut, reps[-1].error.message))
    else:
        skip_fast(who, rate)
        check(cl.done(rid), "%s ended (%s)" % (ended, reps[-1].error.message))


prompt = fixtures.ids("short_dog")
# ---- a host name as --metrics-addr is refused with a clear error
bad = subprocess.run([svc.bin_path("decode", "twain-decode"), "--router", "tcp://127.0.0.1:1", "--model",
                      svc.MODEL, "--backend", "cpu", "--threads", "1", "--metrics-addr", "localhost"],
                     capture_output=True, text=True, timeout=60)
check(bad.returncode != 0 and "not a numeric IPv4 or IPv6 address" in bad.stderr,
      "--metrics-addr localhost refused: rc %d, %r" % (bad.returncode, bad.stderr.strip()[-120:]))

# ---- decode drain bounded by --drain-timeout; /livez 200 while /healthz is 503
# (2 s: the draining daemon must still answer the /healthz and /livez polls
# below when this process gets the CPU late on a loaded machine). The decode
# workers sleep 2 ms a step (a test-build hook), so that the 3900-token stream
# outlasts the timeout on any machine: the tiny model's CPU decode alone ran
# 971 tokens/s on a 2-core machine, where the check needs under about 950.
os.environ["TWAIN_TEST_STEP_DELAY_US"] = "2000"
c = svc.Cluster(1, 1, router_args=["--drain-timeout", "2", "--max-tokens-limit", "4000"],
                decode_args=["--drain-timeout", "2", "--metrics-addr", "127.0.0.1"])
try:
    d = c.decodes[0]
    check(http_code(d.metrics_port, "/livez") == 200 and http_code(d.metrics_port, "/healthz") == 200,
          "decode: /livez and /healthz 200 while serving")
    check(http_code(c.router_metrics_port, "/livez") == 200, "router: /livez 200")
    check(http_code(c.prefills[0].metrics_port, "/livez") == 200, "prefill: /livez 200")
    cl = c.client()
    drain_cut(cl, "decode", d, d.metrics_port,
              r"drain timeout \(2 s\): stopping with 1 sequences unfinished",
              "decode logs the drain timeout with the sequence still running",
              "the cut stream", "the stream")
    # ---- router drain bounded by --drain-timeout
    c.add_decode()
    c.wait_registered(1, 1)
    drain_cut(cl, "router", c.router, c.router_metrics_port,
              r"drain timeout \(2 s\): failing 1 requests", "router logs the drain timeout",
              "the request", "the request")
    cl.close()
finally:
    c.close()
    del os.environ["TWAIN_TEST_STEP_DELAY_US"]

# ---- a second SIGTERM ends a drain at once (decode, router), a second
# SIGINT the stop of `twain serve` (Ctrl-C twice)
c = svc.Cluster(1, 1, router_args=["--max-tokens-limit", "4000"])
try:
    cl = c.client()
    second_signal(cl, "decode", c.decodes[0], signal.SIGTERM,
                  r"second stop signal: stopping with 1 sequences unfinished")
    c.add_decode()
    c.wait_registered(1, 1)
    second_signal(cl, "router", c.router, signal.SIGTERM, r"second stop signal: failing 1 requests")
    cl.close()
finally:
    c.close()
e = {k: v for k, v in os.environ.items() if not k.startswith("TWAIN_") or k == "TWAIN_LOG"}
serve_p = svc.Proc([svc.bin_path("router", "twain"), "serve", "--listen", "tcp://127.0.0.1:0",
                    "--metrics-port", "-1", "--http-port", "0", "--backend", "cpu", "--threads", "1",
                    "--max-tokens-limit", "4000"], "serve", env=e)
try:
    ready = serve_p.wait_line(r"twain serve: ready.*OpenAI API at (\S+), clients at (\S+)", 60)
    cl = svc.Client(ready.group(2))
    # HTTP streams running at the stop as well: each must end with its error
    # event, [DONE] and the last chunk of its chunked body (the stop used to
    # close them without it: curl exit 18, IncompleteRead)
    host, port = re.match(r"http://([\d.]+):(\d+)/", ready.group(1)).groups()
    body = json.dumps({"prompt": "The dog", "max_tokens": 3900, "stream": True}).encode()
    socks, raw = [], [b""] * 4
    for i in range(4):
        sk = socket.create_connection((host, int(port)), timeout=60)
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(sk)

    def http_stream(i):  # everything until the server closes
        try:
            while True:
                b = socks[i].recv(65536)
                if not b:
                    break
                raw[i] += b
        except OSError:
            pass
    threads = [threading.Thread(target=http_stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    second_signal(cl, "twain serve", serve_p, signal.SIGINT,
                  r"second stop signal: failing running requests, stopping the workers now")
    for t in threads:
        t.join(30)
    for sk in socks:
        sk.close()
    whole = [r for r in raw if b"shutting down" in r[-400:] and b"data: [DONE]" in r[-200:] and
             r.endswith(b"\r\n0\r\n\r\n")]
    check(len(whole) == 4, "twain serve: 4 HTTP streams cut by the stop end with the error event, "
          "[DONE] and the last chunk (%d do%s)" % (len(whole), "" if len(whole) == 4 else
                                                   "; first other ends %r" % [r for r in raw if r not in whole][0][-120:]))
    check(serve_p.count(r"drain timeout") == 0, "twain serve: no daemon waited for its drain timeout")
    cl.close()
finally:
    serve_p.stop()

# ---- a relocated bundle finds its default model next to the executable
tmp = tempfile.mkdtemp(prefix="tw_ops_")
try:
    os.makedirs(os.path.join(tmp, "bin"))
    shutil.copy(svc.bin_path("router", "twain"), os.path.join(tmp, "bin", "twain"))
    mdir = os.path.join(tmp, "share", "twain", "models", "tiny-gptoss-wordnet-mxfp4")
    os.makedirs(os.path.dirname(mdir))
    os.symlink(os.path.abspath(svc.MODEL), mdir)
    r = subprocess.run([os.path.join(tmp, "bin", "twain"), "tokenize", "--help"], capture_output=True,
                       text=True, timeout=30)
    check(mdir in r.stdout + r.stderr, "relocated twain names %s as its default model" % mdir)
finally:
    shutil.rmtree(tmp, ignore_errors=True)

finish()
