"""Nothing lost under churn (issue 15 acceptance, CPU backend, tiny model):
TW_STRESS_REQUESTS (default 2,000; the sanitizer pass 1,000) requests at concurrency 512 through
`twain bench` against `twain serve --backend cpu`, uniform lengths, a tenth
cancelled and a tenth of the clients disconnecting after a random number of
tokens. Every request is accounted for (completed, cancelled or
disconnected; none failed, none lost), every completed one got exactly its
max_tokens, and afterwards no KV block is in use on the decode worker.
Same command by hand: twain bench --num-requests 2000 --concurrency 512
--input-len 16 --output-len 32 --range-ratio 0.5 --cancel-prob 0.1
--disconnect-prob 0.1 (docs/benchmarks.md)."""
import json
import os
import subprocess
import tempfile

import svc
from svc import check, finish

twain = svc.bin_path("router", "twain")
N = int(os.environ.get("TW_STRESS_REQUESTS", "2000"))
path = os.path.join(tempfile.mkdtemp(prefix="twstress"), "stress.json")

serve = svc.Proc([twain, "serve", "--listen", "tcp://127.0.0.1:0", "--backend", "cpu", "--threads", "1",
                  "--metrics-port", "0"], "serve")
try:
    ep = serve.wait_line(r"ready.*clients at (\S+)", 90).group(1)
    dport = int(serve.wait_line(r"twain-decode\[\d+\].*serving /metrics and /healthz on 127\.0\.0\.1:(\d+)",
                                30).group(1))
    r = subprocess.run([twain, "bench", "--endpoint", ep, "--model", svc.MODEL, "--json", path, "--quiet",
                        "--num-requests", str(N), "--concurrency", "512", "--input-len", "16",
                        "--output-len", "32", "--range-ratio", "0.5", "--cancel-prob", "0.1",
                        "--disconnect-prob", "0.1", "--seed", "15", "--timeout-ms", "%d" % svc.scaled(400000)],
                       capture_output=True, text=True, timeout=svc.scaled(840))
    j = json.load(open(path)) if os.path.exists(path) else None
    check(r.returncode == 0 and j is not None, "bench exit 0 (%s)" % r.stderr.strip()[-300:])
    if j:
        print("stress: %d completed, %d cancelled, %d disconnected in %.1f s (%.0f output tok/s)" %
              (j["completed"], j["cancelled"], j["disconnected"], j["duration_s"], j["output_throughput"]))
        check(j["completed"] + j["cancelled"] + j["disconnected"] == N and j["failed"] == 0 and j["lost"] == 0,
              "all %d accounted for, none failed or lost: %s" %
              (N, {k: j[k] for k in ("completed", "cancelled", "disconnected", "failed", "lost", "failures")}))
        check(j["cancelled"] > N // 20 and j["disconnected"] > N // 20,
              "cancels and disconnects happened (%d, %d)" % (j["cancelled"], j["disconnected"]))
        check(all(q["tokens_received"] == q["max_tokens"] for q in j["requests"] if q["outcome"] == "completed"),
              "every completed request got exactly its max_tokens")
    check(svc.wait_metric(dport, "twain_kv_blocks_used", 0, 30) == 0, "no kv block in use afterwards")
finally:
    serve.stop()
finish()
