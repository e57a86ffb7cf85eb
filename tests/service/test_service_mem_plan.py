"""The memory plan through `twain serve` (cpu backend, tiny model): every
worker logs its plan for the workers that share its device (serve passes
--colocated), the decode and prefill pools come from it, and the flags
override it.

Figures worked out by hand for the tiny model (4 layers, 2 kv heads of 64,
f32 KV: 4 KiB a token, 64 KiB a block of 16; context 4,096 = 256 blocks):
  - decode: at most 1 GiB of KV a worker on the cpu backend = 16,384 blocks,
    equal to max batch 64 x 256 blocks of the full context; max batch 64;
  - prefill: one prompt of the full context plus a token budget of 8,192 in
    flight = 12,288 tokens = 768 blocks.
With --kv-blocks 300 --max-batch 5 --gpu-memory-utilization 0.5 the decode
worker runs 300 blocks at max batch 5 and every plan has utilization 0.50.
Bad values of the workers' flags are refused with exit 2."""
import subprocess

import svc

from svc import check, finish

twain = svc.bin_path("router", "twain")
decode_bin = svc.bin_path("decode", "twain-decode")


def serve(*extra):
    return svc.Proc([twain, "serve", "--backend", "cpu", "--listen", "tcp://127.0.0.1:0",
                     "--threads", "1", "--metrics-port", "0"] + list(extra), "serve")


s = serve("--prefill", "1", "--decode", "2")
try:
    s.wait_line(r"ready.*clients at (\S+)", 120)
    check(s.wait_count(r"memory plan: .*1 prefill \+ 2 decode workers on it", 3) == 3,
          "each of the 3 workers plans for 1 prefill + 2 decode workers")
    check(s.wait_count(r"memory plan: this decode worker: kv pool 16384 blocks .* max batch 64", 2) == 2,
          "each decode worker plans 16,384 blocks at max batch 64")
    check(s.seen(r"memory plan: this prefill worker: kv pool 768 blocks .* prefill token budget 8192"),
          "the prefill worker plans 768 blocks and a token budget of 8,192")
    check(s.wait_count(r"decode-\d-\d+: cpu backend, 16384 kv blocks of 16 tokens, max batch 64", 2) == 2,
          "both decode workers run the planned pool and batch")
    check(s.seen(r"prefill-0-\d+: cpu backend, local pool 768 blocks"),
          "the prefill worker runs the planned pool")
finally:
    s.stop()

s = serve("--kv-blocks", "300", "--max-batch", "5", "--gpu-memory-utilization", "0.5")
try:
    s.wait_line(r"ready.*clients at (\S+)", 120)
    check(s.seen(r"memory plan: this decode worker: kv pool 300 blocks .*from --kv-blocks, "
                 r"max batch 5 from --max-batch"), "the flags override the decode plan, and it says so")
    check(s.wait_count(r"memory plan: device .* \(utilization 0\.50\)", 2) == 2,
          "--gpu-memory-utilization 0.5 reaches both workers")
    check(s.seen(r"decode-0-\d+: cpu backend, 300 kv blocks of 16 tokens, max batch 5"),
          "the decode worker runs 300 blocks at max batch 5")
finally:
    s.stop()

for args, what in ((["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5"),
                   (["--colocated", "1,0"], "--colocated 1,0 (no decode worker)"),
                   (["--max-batch", "-1"], "--max-batch -1")):
    r = subprocess.run([decode_bin, "--router", "tcp://127.0.0.1:1", "--backend", "cpu"] + args,
                       capture_output=True, text=True, timeout=60)
    check(r.returncode != 0 and args[0] in r.stderr,
          "twain-decode %s refused (exit %d): %s" % (what, r.returncode, r.stderr.strip()[-160:]))
finish()
