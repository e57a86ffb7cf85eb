"""A router that stalls (SIGSTOP for 1.6 s, past its 1 s worker expiry) while
its workers keep heartbeating expires none of them: their heartbeats of that
time wait unread in its socket, and the router credits its own gap to every
worker before judging silence. Requests in flight around the stall are all
served with the reference output, none retried: the prefill worker put each
prompt's kv once (kv bytes sent equal received) and the decode worker
quarantined no abandoned reservation (every block free afterwards). A stall
of a worker itself still expires it (test_service_stall)."""
import os
import signal
import time

import fixtures
import svc

from svc import check, finish

N = 16
prompts = [fixtures.ids("short_dog"), fixtures.ids("system_water"), fixtures.long_prompt(),
           fixtures.ids("multiturn")]
refs = [svc.reference_generate(ids, N) for ids in prompts]
c = svc.Cluster(1, 1)
try:
    cl = c.client()
    cl.wait([cl.send(svc.generate(prompts[0], 4))], 60)  # warm
    pm0 = svc.metrics(c.prefills[0].metrics_port)
    dm0 = svc.metrics(c.decodes[0].metrics_port)
    rids = [cl.send(svc.generate(ids, N)) for ids in prompts]
    time.sleep(0.02)
    os.kill(c.router.p.pid, signal.SIGSTOP)
    time.sleep(svc.scaled(1.6))  # past the router's 1 s (x TW_SLOW_BUILD) expiry
    os.kill(c.router.p.pid, signal.SIGCONT)
    res = cl.wait(rids, 120)
    for ids, ref, r in zip(prompts, refs, res):
        got = svc.tokens_of(r)
        check(got == ref, "prompt of %3d tokens around the router stall: %s" % (
            len(ids), "reference output" if got == ref else "got %s (%s)" % (got, r[-1].error.message)))
    check(c.router.wait_count(r"the router did not run for \d+ ms", 1, 10) >= 1,
          "the router noticed its own stall (premise)")
    expired = svc.metrics(c.router_metrics_port).get("twain_router_workers_expired_total", 0)
    check(expired == 0 and c.router.count(r"expired: no heartbeat") == 0,
          "no live worker expired by the router's stall: %d" % expired)
    check(c.router.count(r"retrying elsewhere") == 0, "no request retried")
    pm = svc.metrics(c.prefills[0].metrics_port)
    dm = svc.metrics(c.decodes[0].metrics_port)
    sent = pm["twain_kv_bytes_sent_total"] - pm0["twain_kv_bytes_sent_total"]
    got = dm["twain_kv_bytes_received_total"] - dm0["twain_kv_bytes_received_total"]
    check(sent == got > 0, "kv bytes: %d sent, %d received (each prompt's kv put once)" % (sent, got))
    check(svc.wait_metric(c.decodes[0].metrics_port, "twain_kv_blocks_used", 0, 10) == 0,
          "every decode block free afterwards (no quarantined reservation)")
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)
finish()
