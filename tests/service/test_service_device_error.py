"""A device error in a prefill batch, as real processes on 127.0.0.1 (the test
hook TWAIN_TEST_DEVICE_ERROR=3, compiled with TWAIN_TEST_HOOKS, makes the
victim prefill worker's 3rd engine batch fail with the status a sticky CUDA
error gives, TW_ERR_CUDA):

- the two prompts before it complete with the reference output;
- the third is answered with the device error marked as the worker's
  (Status.worker_failed): the router sends the victim nothing more ("reports
  its device failed") and keeps the prompt queued for another prefill worker;
- the victim logs "device error in a prefill batch, stopping" and exits with a
  failure status (a CUDA context with a sticky error serves nothing again: its
  supervisor, twain serve or Kubernetes, starts a fresh worker), and the
  router drops it from its registry;
- a fresh prefill worker then serves the third prompt (the router's retry)
  and the next one with the reference output, and every decode block is
  free afterwards (the failed attempt's reservation after the decode
  worker's 40 s quarantine).

The same for a decode worker whose 6th step fails (the hook in the decode
worker): its stream, answered with the error marked as the worker's, is
resumed from the tokens it had on a fresh decode worker once the victim has
exited, and ends with the reference output. And for a decode worker whose
2nd commit of a handed-off KV cache fails (TWAIN_TEST_KV_DEVICE_ERROR=2): the
first request completes, the second (its first token already streamed) is
answered with the error marked as the worker's, the victim exits, and the
stream ends with the reference output on a fresh decode worker.
Every wait is bounded."""
import os
import time

import fixtures
import svc
from svc import check, finish

N = 16


def victim_fails(c, victim, what, where):
    """The router takes the victim's answer as its device failing; the victim
    logs why it stops (`where`: "prefill batch" or "decode step") and exits
    with a failure status."""
    check(c.router.seen(r"WARN .*worker %s reports its device failed: sending it nothing more" %
                        victim.worker_name, 30),
          "%s: the router takes the victim's answer as its device failing, not the request's" % what)
    check(victim.seen(r"ERROR .*device error in a %s, stopping: .*simulated device error" % where, 15),
          "%s: the victim logs that it stops on the device error" % what)
    end = svc.deadline(15)
    while victim.p.poll() is None and time.time() < end:
        time.sleep(0.05)
    rc = victim.p.poll()
    check(rc is not None and rc != 0, "%s: the victim exits with a failure status (exit %s)" % (what, rc))

def add_victim(add, env, n):
    """A worker started by `add` with the hook `env` set to `n` (the victim
    only: the hook is unset again for the workers started after it)."""
    os.environ[env] = str(n)
    try:
        return add()
    finally:
        del os.environ[env]


def said(reps):
    """The last reply's error code and message, for a check's text."""
    return "%d %r" % (reps[-1].error.code, reps[-1].error.message) if reps else "no reply"


prompt = fixtures.ids("short_dog")
ref = svc.reference_generate(prompt, N)

# the router waits for a new prefill worker as long as twain serve's would (the
# test starts one once the victim is gone), not twain-router's 5 s
c = svc.Cluster(0, 1, router_args=["--pool-grace-ms", "180000"])
try:
    victim = add_victim(c.add_prefill, "TWAIN_TEST_DEVICE_ERROR", 3)
    c.wait_registered(1, 1)
    cl = c.client()
    for i in range(2):
        reps = cl.wait([cl.send(svc.generate(prompt, N))], 60)[0]
        check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
              "prompt %d before the device error: the reference output (error %r)" % (
                  i + 1, reps[-1].error.message if reps else "no reply"))
    third = cl.send(svc.generate(prompt, N))
    victim_fails(c, victim, "prefill", "prefill batch")
    check(c.router.seen(r"prefill worker %s failed: .*simulated device error.*; retrying elsewhere" %
                        victim.worker_name, 10), "the router keeps prompt 3 for another prefill worker")
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
    reps = cl.wait([third], 60)[0]
    check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
          "prompt 3 (retried) is served by the fresh prefill worker with the reference output (%s)" %
          said(reps))
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

# ---- a device error in a decode step
c = svc.Cluster(1, 0, router_args=["--pool-grace-ms", "180000"])
try:
    victim = add_victim(c.add_decode, "TWAIN_TEST_DEVICE_ERROR", 6)  # its 6th step
    c.wait_registered(1, 1)
    cl = c.client()
    stream = cl.send(svc.generate(prompt, N))
    victim_fails(c, victim, "decode", "decode step")
    c.add_decode()  # what its supervisor would start
    reps = cl.wait([stream], 60)[0]
    resumed = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0)
    check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref and resumed == 1,
          "decode: the stream is resumed on the fresh decode worker and ends with the reference "
          "output (%s; %d resumed)" % (said(reps), resumed))
finally:
    rcs = c.close()
check(all(rc == 0 for name, rc in rcs.items() if name != victim.name),
      "decode: every other daemon stopped cleanly on SIGTERM: %s" % rcs)

# ---- a device error in a decode worker's commit of a handed-off kv cache
c = svc.Cluster(1, 0, router_args=["--pool-grace-ms", "180000"])
try:
    victim = add_victim(c.add_decode, "TWAIN_TEST_KV_DEVICE_ERROR", 2)  # its 2nd commit
    c.wait_registered(1, 1)
    cl = c.client()
    reps = cl.wait([cl.send(svc.generate(prompt, N))], 60)[0]
    check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
          "kv commit: the request before the device error: the reference output (%s)" % said(reps))
    stream = cl.send(svc.generate(prompt, N))
    victim_fails(c, victim, "kv commit", "kv commit")
    c.add_decode()  # what its supervisor would start
    reps = cl.wait([stream], 60)[0]
    check(reps and reps[-1].error.code == 0 and svc.tokens_of(reps) == ref,
          "kv commit: the stream ends with the reference output on the fresh decode worker (%s)" %
          said(reps))
finally:
    rcs = c.close()
check(all(rc == 0 for name, rc in rcs.items() if name != victim.name),
      "kv commit: every other daemon stopped cleanly on SIGTERM: %s" % rcs)
finish()
