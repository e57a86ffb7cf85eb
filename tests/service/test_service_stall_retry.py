"""A stalled worker gives its requests their attempts back (issue 19 item 8),
with fake workers (fake_workers.py) whose prefill side goes silent on a
PrefillRequest -- no heartbeat, no answer -- until the router expires it,
then registers again. Four times in a row for the same request, one more
than the router's 3 attempts: when it comes back as the same process
(Register.instance unchanged: a stall) the request is served; when it comes
back as a new process each time (a worker that crashes on that request and
is restarted) the request still ends UNAVAILABLE after 3 attempts, so a
crash loop stays bounded. And --pool-grace-ms: with the prefill pool empty
since its only worker expired, a request waits that long for one to
register, then ends UNAVAILABLE saying so (300 ms against a 4.5 s stall;
the default, 5 s, outlasts it above). A worker that heartbeats again after
its stall but registers only later (its main loop busy: seconds on a loaded
host) keeps its pool's requests waiting meanwhile: 2.5 s of grace, the pool
empty for 1 s and then 3 s of heartbeats before the registration (5.5 s
after the expiry, past the grace), and the request is served."""
import fake_workers
import svc

from svc import check, finish

SCRIPT = fake_workers.tokenize("<|channel|>final<|message|>Dogs bark.<|return|>")
prompt = [1, 2, 3, 4]


def one_request(extra, **fake_kw):
    """A router with fake workers (router_with_fakes(SCRIPT, extra, **fake_kw)),
    one request of 4 tokens (deadline 60 s); returns its replies, the
    stopped router and the fakes."""
    router, fw, ep, url = fake_workers.router_with_fakes(SCRIPT, extra=extra, **fake_kw)
    try:
        cl = svc.Client(ep)
        res = cl.wait([cl.send(svc.generate(prompt, 4, deadline_ms=60000))], 60)[0]
    finally:
        fw.close()
        rc = router.stop()
    check(rc == 0, "router stops cleanly (%s)" % rc)
    return res, router, fw


for new_instance in (False, True):
    what = "a new process each time" if new_instance else "the same process (stalled)"
    # expiry 3 s against heartbeats every 0.2 s: a loaded machine does not
    # expire the fakes that are not stalled; each stall outlasts the expiry
    res, router, fw = one_request(["--expire-ms", "3000"], instance=1000 + new_instance,
                                  stall_prefills=4, stall_s=4.5, new_instance=new_instance)
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
# --pool-grace-ms: shorter than the stall, the request ends while the pool is empty
res, router, fw = one_request(["--expire-ms", "3000", "--pool-grace-ms", "300"], instance=1002,
                              stall_prefills=1, stall_s=4.5)
check(res[-1].error.code == svc.E["UNAVAILABLE"]
      and "no prefill worker is registered (for 300 ms) after its worker failed" in res[-1].error.message
      and fw.stalls == 1, "--pool-grace-ms 300 against a 4.5 s stall: %s (%s), %d stall" % (
          res[-1].error.code, res[-1].error.message, fw.stalls))
# alive but not registered yet: its heartbeats hold the grace open
res, router, fw = one_request(["--expire-ms", "3000", "--pool-grace-ms", "2500"], instance=1003,
                              stall_prefills=1, stall_s=4.0, register_delay_s=3.0)
check(res[-1].error.code == 0 and svc.tokens_of(res) == SCRIPT[:4] and fw.stalls == 1
      and router.count(r"worker fake-prefill heartbeats again \(it expired \d+ ms ago\): waiting for "
                       r"it to register") >= 1,
      "--pool-grace-ms 2500, a stall of 4 s and 3 s of heartbeats before it registers again: "
      "served (%s), 'heartbeats again' logged" % (res[-1].error.message or "ok"))
finish()
