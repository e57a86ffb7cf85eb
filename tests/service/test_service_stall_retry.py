"""A stalled worker gives its requests their attempts back (issue 19 item 8),
with fake workers (fake_workers.py) whose prefill side goes silent on a
PrefillRequest -- no heartbeat, no answer -- until the router expires it,
then registers again. Four times in a row for the same request, one more
than the router's 3 attempts: when it comes back as the same process
(Register.instance unchanged: a stall) the request is served; when it comes
back as a new process each time (a worker that crashes on that request and
is restarted) the request still ends UNAVAILABLE after 3 attempts, so a
crash loop stays bounded."""
import fake_workers
import svc

from svc import check, finish

SCRIPT = fake_workers.tokenize("<|channel|>final<|message|>Dogs bark.<|return|>")
prompt = [1, 2, 3, 4]

for new_instance in (False, True):
    what = "a new process each time" if new_instance else "the same process (stalled)"
    router, fw, ep, url = fake_workers.router_with_fakes(SCRIPT, extra=["--expire-ms", "2000"])
    fw.close()  # this test's own fakes: instance and stalls
    fw = fake_workers.FakeWorkers(router.wait_line(r"listening clients=(\S+) workers=(\S+)", 5).group(2),
                                  SCRIPT, instance=1000 + new_instance, stall_prefills=4, stall_s=3.5,
                                  new_instance=new_instance)
    fw.start()
    try:
        cl = svc.Client(ep)
        res = cl.wait([cl.send(svc.generate(prompt, 4, deadline_ms=60000))], 60)[0]
    finally:
        fw.close()
        rc = router.stop()
    check(rc == 0, "router stops cleanly (%s)" % rc)
    expired = router.count(r"worker fake-prefill expired")  # every line, once it exited
    back = router.count(r"worker fake-prefill is back \(the same process: it was stalled\): 1 requests")
    want = 3 if new_instance else 4  # a restarted worker: the request ends at its 3rd attempt
    check(fw.stalls == want and expired == want, "%s: the prefill side stalled %d times, expired %d "
          "times (want %d)" % (what, fw.stalls, expired, want))
    if new_instance:
        check(res[-1].error.code == svc.E["UNAVAILABLE"] and "stopped responding" in res[-1].error.message
              and back == 0, "%s: UNAVAILABLE after 3 attempts (%s), no attempt given back" % (
                  what, res[-1].error.message))
    else:
        check(res[-1].error.code == 0 and svc.tokens_of(res) == SCRIPT[:4] and back == 4,
              "%s: served after 4 stalls (%s), its attempt given back %d times" % (
                  what, res[-1].error.message or "ok", back))
finish()
