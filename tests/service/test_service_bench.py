"""`twain bench` (the serving benchmark) against `twain serve --backend cpu`
with the tiny model: its counts are checked against what the service says it
did (the router's request and streamed-token counters) and against what was
asked (fixed and uniform lengths: raw generate has no stop ids, so every
output has exactly its max_tokens); every request is accounted for; with
cancels and client disconnects nothing is lost and the decode worker's KV
blocks return to zero; ShareGPT-like lengths and a Poisson rate are seeded
(same seed, same lengths); a dead endpoint and bad flags fail clearly."""
import json
import os
import re
import subprocess
import tempfile

import svc
from svc import check, finish

twain = svc.bin_path("router", "twain")
MODEL = os.environ["TW_MODEL_DIR"]
tmp = tempfile.mkdtemp(prefix="twbench")


def bench(*args, timeout=180):
    path = os.path.join(tmp, "b%d.json" % len(os.listdir(tmp)))
    r = subprocess.run([twain, "bench", "--endpoint", ep, "--model", MODEL, "--json", path,
                        "--timeout-ms", "%d" % svc.scaled(60000)] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=svc.scaled(timeout))
    out = json.load(open(path)) if os.path.exists(path) else None
    return r, out


def outcomes(j):
    return {k: j[k] for k in ("completed", "failed", "cancelled", "disconnected", "lost")}


serve = svc.Proc([twain, "serve", "--listen", "tcp://127.0.0.1:0", "--backend", "cpu", "--threads", "1",
                  "--metrics-port", "0"], "serve")
try:
    ep = serve.wait_line(r"ready.*clients at (\S+)", 90).group(1)
    rport = int(serve.wait_line(r"router: listening.*metrics port (\d+)", 10).group(1))
    dport = int(serve.wait_line(r"twain-decode\[\d+\].*serving /metrics and /healthz on 127\.0\.0\.1:(\d+)",
                                30).group(1))

    # fixed lengths: counts equal what was asked and what the router streamed
    m0 = svc.metrics(rport)
    r, j = bench("--num-requests", 24, "--concurrency", 6, "--input-len", 24, "--output-len", 12)
    m1 = svc.metrics(rport)
    check(r.returncode == 0 and j is not None, "fixed lengths: exit 0 and JSON (%s)" % r.stderr.strip()[-200:])
    check(j and outcomes(j) == {"completed": 24, "failed": 0, "cancelled": 0, "disconnected": 0, "lost": 0},
          "fixed lengths: all 24 completed: %s" % (j and outcomes(j)))
    check(j and j["total_output_tokens"] == 24 * 12 and j["tokens_received"] == 24 * 12 and
          j["total_input_tokens"] == 24 * 24 and j["token_count_mismatches"] == 0,
          "fixed lengths: 288 output / 576 input tokens counted (%s / %s)" %
          (j and j["total_output_tokens"], j and j["total_input_tokens"]))
    check(j and all(q["tokens_received"] == 12 and q["completion_tokens"] == 12 for q in j["requests"]),
          "fixed lengths: every request received exactly its 12 tokens")
    dreq = m1["twain_router_requests_total"] - m0.get("twain_router_requests_total", 0)
    dtok = m1["twain_router_tokens_streamed_total"] - m0.get("twain_router_tokens_streamed_total", 0)
    check(dreq == 24 and j and dtok == j["tokens_received"],
          "the router accepted 24 requests (%d) and streamed as many tokens as counted (%d)" % (dreq, dtok))
    ok = j is not None
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        ok = ok and 0 < j[k]["p50"] <= j[k]["p90"] <= j[k]["p99"] and j[k]["mean"] > 0
    check(ok, "latency percentiles are positive and ordered: ttft %s" % (j and j["ttft_ms"]))
    check(j and j["output_throughput"] > 0 and
          abs(j["output_throughput"] * j["duration_s"] - 288) < 1e-6 and
          abs(j["request_throughput"] * j["duration_s"] - 24) < 1e-6 and
          abs(j["total_token_throughput"] * j["duration_s"] - 288 - 576) < 1e-6,
          "throughputs are the counts over the duration")
    check("Output token throughput (tok/s):" in r.stdout and "TTFT" in r.stdout and "ITL" in r.stdout,
          "the text report has throughput and latency sections")

    # uniform lengths: each output equals its own max_tokens
    r, j = bench("--num-requests", 16, "--concurrency", 8, "--input-len", 20, "--output-len", 10,
                 "--range-ratio", "0.5", "--seed", 7)
    lens = sorted({q["max_tokens"] for q in j["requests"]}) if j else []
    check(r.returncode == 0 and j and j["completed"] == 16 and len(lens) > 1 and
          all(5 <= n <= 15 for n in lens) and
          all(q["tokens_received"] == q["max_tokens"] for q in j["requests"]) and
          all(10 <= q["input_len"] <= 30 for q in j["requests"]),
          "uniform lengths in [5, 15] out, [10, 30] in, each output exactly its length (%s)" % lens)

    # ShareGPT-like lengths at a Poisson rate: seeded, so two runs ask the same
    runs = [bench("--num-requests", 8, "--dataset", "sharegpt", "--request-rate", 20, "--seed", 3)
            for _ in range(2)]
    asked = [[(q["input_len"], q["max_tokens"]) for q in j["requests"]] if j else None for _, j in runs]
    j = runs[0][1]
    check(all(r.returncode == 0 for r, _ in runs) and j and j["completed"] == 8 and asked[0] == asked[1] and
          len(set(asked[0])) > 1 and all(i < 1024 and i + o < 2048 for i, o in asked[0]),
          "sharegpt at 20 req/s: seeded lengths, all completed: %s" % (asked[0]))
    check(j and all(q["tokens_received"] == q["max_tokens"] for q in j["requests"]) and
          j["total_output_tokens"] == sum(o for _, o in asked[0]),
          "sharegpt: tokens counted equal tokens asked")

    # rendered chats: prompts come back counted by the router (Harmony adds the header)
    r, j = bench("--num-requests", 4, "--concurrency", 2, "--chat", "--input-len", 12, "--output-len", 8)
    check(r.returncode == 0 and j and j["completed"] == 4 and
          all(q["input_len"] > 12 and 1 <= q["tokens_received"] <= 8 for q in j["requests"]),
          "chat prompts: all completed, rendered prompts longer than their 12 words")

    # cancels and disconnects: every request accounted for, no KV left behind,
    # and each counted once by the router as finished (disconnects as aborts)
    def finished_total(m):
        return sum(v for k, v in m.items() if k.startswith("twain_request_success_total"))
    m0 = svc.metrics(rport)
    r, j = bench("--num-requests", 60, "--concurrency", 16, "--input-len", 16, "--output-len", 24,
                 "--range-ratio", "0.5", "--cancel-prob", "0.25", "--disconnect-prob", "0.25", "--seed", 11)
    check(r.returncode == 0 and j and sum(outcomes(j).values()) == 60 and j["lost"] == 0 and
          j["failed"] == 0 and j["cancelled"] > 0 and j["disconnected"] > 0 and j["completed"] > 0,
          "cancels and disconnects: every request accounted for: %s" % (j and outcomes(j)))
    check(svc.wait_metric(dport, "twain_kv_blocks_used", 0, 30) == 0,
          "decode kv blocks back to zero after cancels and disconnects")
    m1 = svc.metrics(rport)
    check(m1.get("twain_router_requests_total", 0) - m0.get("twain_router_requests_total", 0) == 60 and
          finished_total(m1) - finished_total(m0) == 60,
          "the router counts 60 requests and 60 finished ones, disconnects included (%s finished)" %
          (finished_total(m1) - finished_total(m0)))

    # disconnects at concurrency 1 (the default without --rate): the request's
    # own socket is polled beside the shared one and the connection watch
    # (it was left out, so its replies were never read: lost after --timeout-ms)
    r, j = bench("--num-requests", 3, "--concurrency", 1, "--input-len", 16, "--output-len", 24,
                 "--disconnect-prob", "1", "--seed", 5, timeout=60)
    check(r.returncode == 0 and j and j["disconnected"] == 3 and j["lost"] == 0,
          "three disconnects at concurrency 1: disconnected, none lost (%s)" % (j and outcomes(j)))

    # every request refused (prompts over the model's context): nothing was
    # measured, so exit 1 (it exited 0)
    r, j = bench("--num-requests", 2, "--input-len", 100000, "--output-len", 4)
    check(r.returncode == 1 and "every request failed (2)" in r.stderr and j and j["failed"] == 2,
          "every request failed: exit 1 with the reason (rc %d, %s)" % (r.returncode, r.stderr.strip()[-160:]))
    check(re.search(r"INVALID_ARGUMENT +2\n +\(first: prompt of 100000 tokens exceeds the limit", r.stdout),
          "the failures by code name the first one's reason: %r" % r.stdout[r.stdout.find("failed:"):][:200])
    nowrite = subprocess.run([twain, "bench", "--endpoint", ep, "--model", MODEL, "--num-requests", "2",
                              "--json", os.path.join(tmp, "no-such-dir", "b.json")],
                             capture_output=True, text=True, timeout=30)
    check(nowrite.returncode == 1 and "cannot write --json" in nowrite.stderr and
          "Serving Benchmark Result" not in nowrite.stdout,
          "--json to a path that cannot be written: refused before the run (%s)" % nowrite.stderr.strip()[-160:])

    # nobody listening: a clear, bounded failure
    dead = subprocess.run([twain, "bench", "--endpoint", "tcp://127.0.0.1:1", "--model", MODEL,
                           "--num-requests", "2", "--connect-timeout-ms", "500"],
                          capture_output=True, text=True, timeout=30)
    check(dead.returncode == 1 and "is `twain serve` running?" in dead.stderr,
          "dead endpoint: exit 1 with a clear message (%s)" % dead.stderr.strip()[-160:])
    for bad in (["--num-requests", "0"], ["--dataset", "nope"], ["--cancel-prob", "0.7", "--disconnect-prob", "0.7"],
                ["--frobnicate", "1"]):
        b = subprocess.run([twain, "bench", "--model", MODEL] + bad, capture_output=True, text=True, timeout=30)
        check(b.returncode == 2 and "twain bench:" in b.stderr, "bad usage %s: exit 2 (%s)" %
              (bad, b.stderr.splitlines()[0] if b.stderr else ""))
finally:
    serve.stop()
finish()
