"""Overload loses nothing (issue 15 item 5), driven by `twain bench`:
1. ten times more requests than the KV pools hold (decode and prefill pools
   of 64 blocks, 6 blocks a request), the router's request limit below the
   burst and a short deadline: every request completes or ends with
   RESOURCE_EXHAUSTED (with the limit in its message) or DEADLINE_EXCEEDED,
   none lost, none with a stale-request failure, and every KV block returns;
2. a prefill backlog longer than the prefill worker's 20 s KV-write guard
   would allow if the router handed every prompt over at once (40 prompts of
   1,000 tokens, a decode pool with room for all): the router holds them in
   its queue and hands them over as the prefill worker takes them, so every
   request completes, with no failure and no retry."""
import json
import os
import subprocess
import tempfile

import svc
from svc import check, finish

twain = svc.bin_path("router", "twain")
tmp = tempfile.mkdtemp(prefix="twover")
STALE = ("stale", "older than", "kv-write guard", "not writing its kv")


def bench(ep, *args, timeout=420):
    path = os.path.join(tmp, "b%d.json" % len(os.listdir(tmp)))
    r = subprocess.run([twain, "bench", "--endpoint", ep, "--model", svc.MODEL, "--json", path, "--quiet",
                        "--timeout-ms", "%d" % svc.scaled(400000)] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=svc.scaled(timeout))
    return r, (json.load(open(path)) if os.path.exists(path) else None)


def logs(*procs):
    out = []
    for p in procs:
        with p.lock:
            out += p.lines
    return out


# 1. ten times the pools
cl = svc.Cluster(decode_args=["--kv-blocks", "64"], prefill_args=["--kv-blocks", "64"],
                 router_args=["--max-requests", "70"])
try:
    r, j = bench(cl.client_ep, "--num-requests", 100, "--concurrency", 100, "--input-len", 40,
                 "--output-len", 56, "--deadline-ms", "%d" % svc.scaled(4000))
    check(j is not None and r.returncode == 0, "overload: bench ran (%s)" % r.stderr.strip()[-200:])
    if j:
        fails = [q for q in j["requests"] if q["outcome"] == "failed"]
        codes = {q["code"] for q in fails}
        check(j["lost"] == 0 and j["completed"] + j["failed"] == 100,
              "overload: all 100 accounted for: %d completed, %d failed, %d lost" %
              (j["completed"], j["failed"], j["lost"]))
        check(j["completed"] >= 10 and codes <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"},
              "overload: failures only RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED: %s" % j["failures"])
        check(j["failures"].get("RESOURCE_EXHAUSTED", 0) >= 30 and
              all("the limit is 70" in q["message"] for q in fails if q["code"] == "RESOURCE_EXHAUSTED"),
              "overload: the 30 past the router's limit are refused clearly (%s)" %
              next((q["message"] for q in fails if q["code"] == "RESOURCE_EXHAUSTED"), "-"))
        check(not [q for q in fails if any(s in q["message"] for s in STALE)],
              "overload: no stale-request failure")
        check(all(q["tokens_received"] == 56 for q in j["requests"] if q["outcome"] == "completed"),
              "overload: every completed request got its 56 tokens")
    d = cl.decodes[0]
    # deadline-cancelled reservations stay quarantined for 40 s (decode_worker.c)
    check(svc.wait_metric(d.metrics_port, "twain_kv_blocks_used", 0, 60) == 0,
          "overload: decode kv blocks back to zero")
    check(not [l for l in logs(cl.router, *cl.prefills) if any(s in l for s in STALE)],
          "overload: no stale-request line in the router or prefill log")
finally:
    cl.close()

# 2. a prefill backlog past the 20 s guard, held in the router's queue
cl = svc.Cluster(decode_args=["--kv-blocks", "8192"])
try:
    r, j = bench(cl.client_ep, "--num-requests", 40, "--concurrency", 40, "--input-len", 1000,
                 "--output-len", 4)
    check(j is not None and j["completed"] == 40 and j["failed"] == 0 and j["lost"] == 0,
          "prefill backlog: all 40 completed (%s)" % (j and {k: j[k] for k in ("completed", "failed", "lost",
                                                                             "failures", "duration_s")}))
    if j:
        print("prefill backlog: %.1f s, TTFT p50 %.0f ms, p99 %.0f ms" %
              (j["duration_s"], j["ttft_ms"]["p50"], j["ttft_ms"]["p99"]))
    m = svc.metrics(cl.prefills[0].metrics_port)
    check(m.get("twain_prefill_failures_total", 0) == 0 and m.get("twain_prefill_requests_total") == 40,
          "prefill backlog: the prefill worker ran each prompt once, none failed (%s)" %
          m.get("twain_prefill_requests_total"))
    check(not [l for l in logs(cl.router, *cl.prefills) if "retrying" in l or any(s in l for s in STALE)],
          "prefill backlog: no retry, no stale line")
    check(svc.wait_metric(cl.decodes[0].metrics_port, "twain_kv_blocks_used", 0, 30) == 0,
          "prefill backlog: decode kv blocks back to zero")
finally:
    cl.close()
finish()
