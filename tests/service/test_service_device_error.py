"""A device error in a prefill batch, as real processes on 127.0.0.1 (the test
hook TWAIN_TEST_DEVICE_ERROR=3, compiled with TWAIN_TEST_HOOKS, makes the
victim prefill worker's 3rd engine batch fail with the status a sticky CUDA
error gives, TW_ERR_CUDA):

- the two prompts before it complete with the reference output;
- the third ends with INTERNAL naming the device error, none hangs;
- the victim logs "device error in a prefill batch, stopping" and exits with a
  failure status (a CUDA context with a sticky error serves nothing again: its
  supervisor, twain serve or Kubernetes, starts a fresh worker), and the
  router drops it from its registry;
- a fresh prefill worker serves the next prompt with the reference output,
  and every decode block is free afterwards (the failed prompt's reservation
  after the decode worker's 40 s quarantine).
Every wait is bounded."""
import os
import time

import fixtures
import svc
from svc import check, finish

N = 16
prompt = fixtures.ids("short_dog")
ref = svc.reference_generate(prompt, N)

c = svc.Cluster(0, 1)
try:
    os.environ["TWAIN_TEST_DEVICE_ERROR"] = "3"  # the victim only
    victim = c.add_prefill()
    del os.environ["TWAIN_TEST_DEVICE_ERROR"]
    c.wait_registered(1, 1)
    cl = c.client()
    for i in range(2):
        reps = cl.wait([cl.send(svc.generate(prompt, N))], 60)[0]
        check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
              "prompt %d before the device error: the reference output (error %r)" % (
                  i + 1, reps[-1].error.message if reps else "no reply"))
    reps = cl.wait([cl.send(svc.generate(prompt, N))], 60)[0]
    last = reps[-1] if reps else None
    check(last is not None and last.done and last.error.code == svc.E["INTERNAL"] and
          "simulated device error" in last.error.message,
          "prompt 3: ends with INTERNAL naming the device error (%s)" % (
              "%d %r" % (last.error.code, last.error.message) if last else "no reply"))
    check(victim.seen(r"ERROR .*device error in a prefill batch, stopping: .*simulated device error", 15),
          "the victim logs that it stops on the device error")
    end = svc.deadline(15)
    while victim.p.poll() is None and time.time() < end:
        time.sleep(0.05)
    rc = victim.p.poll()
    check(rc is not None and rc != 0, "the victim exits with a failure status (exit %s)" % rc)
    end = svc.deadline(10)
    n_prefill = None
    while time.time() < end:
        n_prefill = svc.metrics(c.router_metrics_port).get("twain_router_prefill_workers", 0)
        if n_prefill == 0:
            break
        time.sleep(0.05)
    check(n_prefill == 0, "the router drops the victim from its registry (%s prefill workers)" % n_prefill)
    c.add_prefill()  # what its supervisor would start
    c.wait_registered(1, 1)
    reps = cl.wait([cl.send(svc.generate(prompt, N))], 60)[0]
    check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
          "a fresh prefill worker serves the next prompt with the reference output")
    # the failed prompt's reservation: quarantined for 40 s after its prefill
    # failed (a late write may still land there, decode/decode_worker.c), then freed
    check(svc.wait_metric(c.decodes[0].metrics_port, "twain_kv_blocks_used", 0, svc.scaled(50)) == 0,
          "every decode block is free afterwards (the failed prompt's after its 40 s quarantine)")
finally:
    rcs = c.close()
check(all(rc == 0 for name, rc in rcs.items() if name != victim.name),
      "every other daemon stopped cleanly on SIGTERM: %s" % rcs)
finish()
