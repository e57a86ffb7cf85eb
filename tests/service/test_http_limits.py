"""The HTTP API's limits with fake workers (fake_workers.py): the API key on
both APIs (401 / UNAUTHENTICATED; an empty one refused, none on a public
address warned about), a body over --http-max-body (413), more
requests than --max-requests (429), a deadline (504), a client that
disconnects mid-stream or while it waits (its request is cancelled at the
workers and the router drops it; a non-streamed completion too, whose ids
arrive faster than the router's loop turns), 256 concurrent SSE streams that all
complete, and /health and a request before workers register (503). The router keeps serving after each."""
import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import fake_workers
import http_client
import svc

from http_client import chat_text
from svc import check, finish

KEY = "sk-test-7f3a"
USER = [{"role": "user", "content": "Tell me about dogs."}]
ANSWER = "Dogs are loyal companions and good friends."
SCRIPT = fake_workers.tokenize("<|channel|>final<|message|>" + ANSWER + "<|return|>")

# ---- the key from a file (its first line); a missing or empty file is a usage error ----
tmp = tempfile.mkdtemp()
keyfile = os.path.join(tmp, "key")
with open(keyfile, "w") as f:
    f.write(KEY + "\n# comment lines after the first are ignored\n")
open(os.path.join(tmp, "empty"), "w").close()
atexit.register(shutil.rmtree, tmp, True)
for path, why in ((os.path.join(tmp, "missing"), "cannot read"), (os.path.join(tmp, "empty"), "is empty")):
    p = subprocess.run([svc.bin_path("router", "twain-router"), "--api-key-file", path], capture_output=True,
                       text=True, timeout=30)
    check(p.returncode == 2 and why in p.stderr, "--api-key-file %s: exit 2, %r" % (os.path.basename(path),
                                                                                 p.stderr.strip()))
# an empty --api-key (or variable) is refused, not taken as no key: an unset
# shell variable in `--api-key "$KEY"` must not turn authentication off
for argv, env in ((["--api-key", ""], {}), ([], {"TWAIN_ROUTER_API_KEY": ""})):
    p = subprocess.run([svc.bin_path("router", "twain-router")] + argv, capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, **env))
    check(p.returncode == 2 and "--api-key is empty" in p.stderr,
          "an empty API key %s: exit 2, %r" % (argv or env, p.stderr.strip()))
# the HTTP API on every interface without a key: served, with a warning
bare = svc.Proc([svc.bin_path("router", "twain-router"), "--model", svc.MODEL, "--listen", "tcp://127.0.0.1:0",
                 "--workers", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--http-port", "0",
                 "--http-addr", "0.0.0.0", "--http-allow-origin", "https://app.example"], "bare-router")
check(bare.seen(r"WARN .*http: the OpenAI API on http://0\.0\.0\.0:\d+/v1 answers anyone who can reach it",
                15), "--http-addr 0.0.0.0 without a key: a warning")


def raw_http(port, method, path, headers=()):
    """(status, {header: value}) of one request to 127.0.0.1:port."""
    import http.client
    hc = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        hc.request(method, path, headers=dict(headers))
        r = hc.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        hc.close()


# CORS (--http-allow-origin): a browser's preflight gets 204 and what it may
# send, every answer the origin; without the option OPTIONS stays a 405
bport = int(bare.wait_line(r"serving the OpenAI API on http://0\.0\.0\.0:(\d+)/v1", 10).group(1))
st, hd = raw_http(bport, "OPTIONS", "/v1/chat/completions",
                  {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
check(st == 204 and hd.get("access-control-allow-origin") == "https://app.example" and
      "POST" in hd.get("access-control-allow-methods", "") and
      hd.get("access-control-allow-headers", "").lower() == "authorization, content-type, x-stainless-os",
      "--http-allow-origin: a preflight gets 204 with the Access-Control headers (%s %s)" % (st, hd))
st, hd = raw_http(bport, "GET", "/v1/models", {"Origin": "https://app.example"})
check(st == 200 and hd.get("access-control-allow-origin") == "https://app.example",
      "--http-allow-origin: an answer carries the origin (%s %s)" % (st, hd))
bare.stop()

# ---- a router with a key and small limits; slow fake workers ----
router = svc.Proc([svc.bin_path("router", "twain-router"), "--model", svc.MODEL,
                   "--listen", "tcp://127.0.0.1:0", "--workers", "tcp://127.0.0.1:0", "--metrics-port", "0",
                   "--http-port", "0", "--api-key-file", keyfile, "--http-max-body", "65536", "--max-requests", "4",
                   "--deadline-ms", "3000", "--served-model-name", "twain-test", "--expect-prefill", "1",
                   "--expire-ms", "10000",
                   "--expect-decode", "1"], "router")
m = router.wait_line(r"listening clients=(\S+) workers=(\S+)", 30)
url = router.wait_line(r"serving the OpenAI API on (http://127\.0\.0\.1:\d+)/v1", 10).group(1)
mport = int(router.wait_line(r"metrics port (\d+)", 10).group(1))
api = http_client.Api(url, key=KEY)
st, hd = raw_http(int(url.rsplit(":", 1)[1]), "OPTIONS", "/v1/chat/completions",
                  {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
check(st in (401, 405) and "access-control-allow-origin" not in hd,
      "without --http-allow-origin: OPTIONS is refused (401 here: a key is needed) with no Access-Control "
      "header (%s %s)" % (st, hd))
st, h = api.get("/health")
check(st == 503 and h["status"] == "unavailable" and "worker" in h["reason"],
      "/health before any worker registered: 503 (%s)" % h)
st, r = api.post("/v1/chat/completions", {"messages": USER})
check(st == 503 and r["error"]["type"] == "service_unavailable_error",
      "a request with no worker registered: 503 (UNAVAILABLE) (%s)" % r)
fw = fake_workers.FakeWorkers(m.group(2), SCRIPT, token_delay=0.1)
fw.start()
router.wait_line(r"twain-router: ready", 30)
try:
    st, h = api.get("/health")
    check(st == 200, "/health with workers: 200")
    # ---- API key ----
    st, r = api.get("/v1/models", key="")
    check(st == 401 and r["error"]["type"] == "authentication_error" and "Missing" in r["error"]["message"],
          "no key: 401 (%s)" % r)
    st, r = api.post("/v1/chat/completions", {"messages": USER}, key="sk-wrong")
    check(st == 401 and "Incorrect" in r["error"]["message"], "wrong key: 401 (%s)" % r)
    st, r = api.get("/v1/models")
    check(st == 200 and r["data"][0]["id"] == "twain-test", "right key: 200, --served-model-name (%s)" % r)
    cl = svc.Client(m.group(1))
    rep = cl.wait([cl.send(svc.chat("Dogs?", 8))], 10)[0][-1]
    check(rep.error.code == svc.E["UNAUTHENTICATED"], "protobuf without api_key: UNAUTHENTICATED (%s)" % rep.error.message)
    req = svc.chat("Dogs?", 8)
    req.api_key = "sk-wrong"
    rep = cl.wait([cl.send(req)], 10)[0][-1]
    check(rep.error.code == svc.E["UNAUTHENTICATED"], "protobuf with a wrong api_key: UNAUTHENTICATED")
    req = svc.chat("Dogs?", 64)
    req.api_key = KEY
    reps = cl.wait([cl.send(req)], 30)[0]
    check(reps[-1].error.code == 0 and "".join(d.content for r in reps for d in r.deltas) == ANSWER,
          "protobuf with the key: served (%s)" % reps[-1].error.message)
    cl.close()

    # ---- body limit ----
    big = {"messages": [{"role": "user", "content": "x" * 100000}]}
    st, r = api.post("/v1/chat/completions", big)
    check(st == 413 and "limit" in r["error"]["message"], "a 100 kB body over --http-max-body 65536: 413 (%s)" % r)

    # ---- deadline: 504 ----
    fw.token_delay = 0.5  # 30 ids: 15 s, over the 3 s deadline
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 504 and r["error"]["type"] == "timeout_error", "past --deadline-ms: 504 (%s)" % r)
    fw.token_delay = 0.1

    # ---- 429: more than --max-requests in flight ----
    results = []

    def one():
        results.append(api.stream("/v1/chat/completions", {"messages": USER}))

    started = [threading.Thread(target=one) for _ in range(4)]
    for t in started:
        t.start()
    end = svc.deadline(10)
    while time.time() < end and svc.metrics(mport).get("twain_router_running_requests", 0) < 4:
        time.sleep(0.02)
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 429 and r["error"]["type"] == "rate_limit_error" and "too many" in r["error"]["message"],
          "a 5th request with --max-requests 4: 429 (%s)" % r)
    for t in started:
        t.join(30)
    check(len(results) == 4 and all(s == 200 and chat_text(ev)[0] == ANSWER for s, ev in results),
          "the 4 streams in flight complete")

    # ---- a client that disconnects mid-stream ----
    fw.token_delay = 0.2
    with fw.lock:
        seen_before = set(fw.prompts)
    st, ev = api.stream("/v1/chat/completions", {"messages": USER}, on_event=lambda i, e: i >= 3)
    check(st == 200 and len(ev) == 4, "read 4 events, then hang up")
    with fw.lock:
        rid = (set(fw.prompts) - seen_before).pop()
    end = svc.deadline(10)
    while time.time() < end and rid not in fw.cancelled:
        time.sleep(0.05)
    check(rid in fw.cancelled, "the decode worker got a Cancel for the abandoned request (frees its blocks)")
    end = svc.deadline(5)
    while time.time() < end and svc.metrics(mport).get("twain_router_running_requests", 0) != 0:
        time.sleep(0.05)
    check(svc.metrics(mport).get("twain_router_running_requests") == 0, "the router dropped it")
    check(router.seen(r"client went away .*cancelling", 5), "the router logs the cancellation")
    # a non-streamed request whose client hangs up while it runs
    def hang_up(path, body, flowing_s=0.0):
        """POST body (non-streamed) on a raw socket, close it once the
        workers have the prompt (and flowing_s more): (request id at the
        workers, seconds from the close to their Cancel, or None)."""
        with fw.lock:
            seen_before = set(fw.prompts)
        data = json.dumps(body).encode()
        sk = socket.create_connection((api.host, api.port), timeout=5)
        sk.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                   b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        end = svc.deadline(10)
        while time.time() < end and not (set(fw.prompts) - seen_before):
            time.sleep(0.02)
        time.sleep(flowing_s)
        sk.close()
        t_close = time.time()
        with fw.lock:
            new = set(fw.prompts) - seen_before
        rid = new.pop() if new else None
        while time.time() < t_close + 10 and rid not in fw.cancelled:
            time.sleep(0.05)
        return rid, round(time.time() - t_close, 2) if rid in fw.cancelled else None

    fw.token_delay = 0.5  # its ids take 7.5 s
    rid, dt = hang_up("/v1/chat/completions", {"messages": USER})
    check(rid is not None and dt is not None and dt < 4,
          "a non-streamed request whose client hung up is cancelled at the workers after %s s "
          "(its %d ids take 7.5 s)" % (dt, len(SCRIPT)))
    # the same for /v1/completions, whose ids arrive one reply each, faster
    # than the router's loop turns (every reply used to wake the connection,
    # so the check for a closed client never saw it waiting)
    fw.script, fw.token_delay = SCRIPT * 300, 0.001  # about 4,500 ids: 4.5 s or more
    rid, dt = hang_up("/v1/completions", {"prompt": "Once upon", "max_tokens": 4000}, flowing_s=0.5)
    check(rid is not None and dt is not None and dt < svc.scaled(2),
          "a non-streamed completion whose client hung up is cancelled at the workers after %s s" % dt)
    fw.script = SCRIPT
    s = socket.create_connection((api.host, api.port), timeout=5)  # a half-sent request, then gone
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
    s.close()
    # Content-Length headers that disagree: 400 and the connection closed,
    # whichever comes first (the shorter one first would leave the rest of
    # the body to be read as a second request: request smuggling)
    body = json.dumps({"messages": USER}).encode()
    for lens in ((5, len(body)), (len(body), 5)):
        s = socket.create_connection((api.host, api.port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                  KEY.encode() + b"\r\nContent-Type: application/json\r\n" +
                  b"".join(b"Content-Length: %d\r\n" % n for n in lens) + b"\r\n" + body)
        got, eof = b"", False
        while True:  # the whole answer, then the close (a kept connection times out here)
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                eof = True
                break
            got += part
        s.close()
        head, _, rest = got.partition(b"\r\n\r\n")
        check(eof and head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower() and
              b"Content-Length headers that disagree" in rest and got.count(b"HTTP/1.1") == 1,
              "Content-Length %d then %d: one 400 (OpenAI JSON), the connection closed (%r)" % (
                  lens[0], lens[1], got[:120]))
    fw.token_delay = 0.0
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 200 and r["choices"][0]["message"]["content"] == ANSWER, "the router keeps serving")
finally:
    fw.close()
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)

# ---- 256 concurrent SSE streams ----
router, fw, ep, url = fake_workers.router_with_fakes(SCRIPT, token_delay=0.02)
rport = int(router.wait_line(r"metrics port (\d+)", 10).group(1))
api = http_client.Api(url, timeout=120)
N = 256
out = [None] * N


def stream(i):
    try:
        out[i] = api.stream("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}})
    except Exception as e:  # noqa: BLE001 -- reported below
        out[i] = (0, repr(e))


try:
    fw.hold = True  # every stream stays open until all N are in flight
    t0 = time.time()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    end = svc.deadline(120)
    running = 0
    while time.time() < end and running < N:
        time.sleep(0.1)
        running = svc.metrics(rport).get("twain_router_running_requests", 0)
    check(running == N, "%d streams in flight at once (router_running_requests %d)" % (N, running))
    fw.hold = False
    for t in threads:
        t.join(max(1.0, 180 - (time.time() - t0)))
    ok = [o for o in out if o and o[0] == 200 and chat_text(o[1])[0] == ANSWER and o[1][-1][1] == "[DONE]"]
    bad = [o for o in out if o not in ok]
    check(len(ok) == N, "%d concurrent SSE streams: %d complete with the full answer in %.1f s%s" % (
        N, len(ok), time.time() - t0, "" if not bad else "; first bad: %r" % (bad[0],)))
    usage = [d["usage"]["completion_tokens"] for o in ok for _, d in o[1] if d != "[DONE]" and d.get("usage")]
    check(usage == [len(SCRIPT)] * N, "each stream's usage counts its %d ids" % len(SCRIPT))
    check(len(fw.prompts) == N, "the workers saw %d requests" % len(fw.prompts))
finally:
    fw.close()
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)

# ---- --http-max-connections: 4 idle connections fill it; it is logged and
# counted; new clients wait (not refused) and are served once one closes ----
router, fw, ep, url = fake_workers.router_with_fakes(SCRIPT, extra=["--http-max-connections", "4"])
rport = int(router.wait_line(r"metrics port (\d+)", 10).group(1))
api = http_client.Api(url, timeout=60)
try:
    idle = [socket.create_connection((api.host, api.port), timeout=5) for _ in range(4)]
    line = router.wait_line(r"4 HTTP connections are open, --http-max-connections: new connections wait", 10)
    n_open = svc.metrics(rport).get("twain_router_http_connections")
    check(line is not None and n_open == 4, "4 idle connections: the limit logged, "
          "twain_router_http_connections %s" % n_open)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=api.post("/v1/chat/completions", {"messages": USER})))
    waiter.start()
    time.sleep(svc.scaled(1.0))
    check(waiter.is_alive(), "a fifth client waits while 4 connections are open")
    for sk in idle:
        sk.close()
    waiter.join(60)
    st, r = result.get("r", (0, None))
    check(st == 200 and r["choices"][0]["message"]["content"] == ANSWER,
          "served once the idle connections closed (%s)" % st)
finally:
    fw.close()
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)
finish()
