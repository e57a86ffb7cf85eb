"""A worker that stalls (SIGSTOP for 3 s, three times its 1 s expiry) costs
latency, not requests (issue 19 item 8 and its acceptance test: 256
concurrent streams, zero requests without a token fail): the router expires
it, and every
request waits for the pool to come back (the worker registers again when it
resumes) and is served: one that had no token yet from the start, a stream
that already had tokens from the stalled decode worker from where it stopped
(its prompt and those tokens prefilled again), so all 256 end with the same
greedy tokens. Once for the only prefill worker, once for the only decode
worker."""
import os
import signal
import time

import fixtures
import svc

from svc import check, finish

prompt = fixtures.ids("short_dog")
N = 256  # concurrent streams, as the acceptance test
c = svc.Cluster(1, 1)
try:
    cl = c.client()
    cl.wait([cl.send(svc.generate(prompt, 4))], 60)  # warm
    for victim, pool in ((c.prefills[0], "prefill"), (c.decodes[0], "decode")):
        expired_before = c.router.count(r"worker %s expired" % victim.worker_name)
        resumed_before = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0)
        rids = [cl.send(svc.generate(prompt, 16, deadline_ms=240000)) for _ in range(N)]
        end = time.time() + 0.3
        while time.time() < end:
            cl.pump(0.02)
        # the decode worker stalls with streams under way (bounded: 60 s)
        end = time.time() + 60
        while pool == "decode" and time.time() < end and not any(
                0 < len(svc.tokens_of(cl.replies.get(r, []))) < 16 for r in rids):
            cl.pump(0.005)
        os.kill(victim.p.pid, signal.SIGSTOP)
        t0 = time.time()
        while time.time() < t0 + svc.scaled(3.0):  # past the router's 1 s (x TW_SLOW_BUILD) expiry
            cl.pump(0.02)
        os.kill(victim.p.pid, signal.SIGCONT)
        t_stall = time.time()
        res = cl.wait(rids, 240)
        print("%s stall: all %d streams ended %.1f s after SIGCONT" % (pool, N, time.time() - t_stall))
        expired = c.router.count(r"worker %s expired" % victim.worker_name) - expired_before
        no_token_failed = [r[-1].error.message for r in res if r[-1].error.code and not svc.tokens_of(r)]
        served = sum(1 for r in res if r[-1].error.code == 0)
        with_tokens_failed = [r[-1].error.code for r in res if r[-1].error.code and svc.tokens_of(r)]
        check(expired >= 1, "the 3 s stall of the %s worker expired it (premise): %d" % (pool, expired))
        check(not no_token_failed,
              "%s stall: %d of %d requests without a token failed %s" % (
                  pool, len(no_token_failed), N, no_token_failed[:2]))
        cut = [(r[-1].error.code, r[-1].error.message) for r in res if r[-1].error.code and svc.tokens_of(r)]
        check(not cut, "%s stall: %d served, %d streams cut after tokens (%s)" % (
            pool, served, len(cut), sorted(set(cut))[:3]))
        resumed = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0) - resumed_before
        if pool == "decode":
            check(resumed >= 1, "decode stall: %d streams resumed from their tokens so far" % resumed)
        outputs = set(tuple(svc.tokens_of(r)) for r in res if r[-1].error.code == 0)
        check(len(outputs) == 1 and len(next(iter(outputs))) == 16,
              "%s stall: every stream has the same 16 greedy tokens (%d different outputs)" % (
                  pool, len(outputs)))
        c.wait_registered(1, 1, 30)
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)
finish()
