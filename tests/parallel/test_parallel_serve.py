"""`twain serve` with each pool's parallelism on its command line (issue 6):
--prefill-tp 2 --decode-tp 2 --decode-ep 2 starts a 2-rank prefill worker and
a 2-rank decode worker (each under mpirun, supervised); with the argument
`dp`, --decode-dp 2 --decode-ep 2 makes the decode worker's 2 ranks
data-parallel attention replicas instead. `twain generate` equals
twain-prefill --generate (TP 1) token for token; SIGINT stops everything
with exit 0. Every wait is bounded."""
import signal
import subprocess
import sys

import fixtures
import svc
from partest import check, finish


dp = sys.argv[1:] == ["dp"]
decode_par = ["--decode-dp", "2", "--decode-ep", "2"] if dp else ["--decode-tp", "2", "--decode-ep", "2"]
what = "DP 2 EP 2" if dp else "EP 2 TP 2"
twain = svc.bin_path("router", "twain")
serve = svc.Proc([twain, "serve", "--listen", "tcp://127.0.0.1:0", "--threads", "1", "--metrics-port", "0",
                  "--backend", "cpu", "--prefill-tp", "2"] + decode_par + ["--verify-kv"], "serve")
try:
    ep = serve.wait_line(r"ready.*clients at (\S+)", 90).group(1)
    check(serve.wait_count(r"twain-prefill\[\d+\] r1 .*rank 1 of 2 pid \d+ following rank 0", 1) == 1 and
          serve.wait_count(r"twain-decode\[\d+\] r1 .*rank 1 of 2 pid \d+ following rank 0", 1) == 1,
          "serve started a 2-rank prefill worker and a 2-rank decode worker")
    if dp:
        check(serve.wait_count(r"twain-decode\[\d+\] .*data-parallel attention over 2 ranks", 1) == 1,
              "the decode worker's ranks are data-parallel attention replicas")
    ids = fixtures.ids("system_water")
    r = subprocess.run([twain, "generate", "--endpoint", ep, "--max-tokens", "20"] + [str(i) for i in ids],
                       capture_output=True, text=True, timeout=120)
    got = [int(x) for x in r.stdout.split()]
    check(r.returncode == 0 and got == svc.reference_generate(ids, 20),
          "twain generate through TP 2 prefill and %s decode equals TP 1 (%s)" % (what, r.stderr.strip()[-200:]))
finally:
    rc = serve.stop(signal.SIGINT, 40)
check(rc == 0, "SIGINT: serve and every rank exit 0 (rc %s)" % rc)
finish()
