"""A decode follower rank that cannot read its step plan, as real processes
on 127.0.0.1 (the test hook TWAIN_TEST_BAD_PLAN=5, compiled with
TWAIN_TEST_HOOKS, makes rank 1 of the victim read its 5th decode plan as a
short one, as a mis-sized or corrupted plan would be):

- rank 1 logs why and leaves the group instead of following plans that rank
  0, waiting in that step's collectives, never gets past;
- rank 0's watchdog sees it go and takes the worker down: the router drops
  it from its registry within a few seconds, and both ranks exit;
- the requests sent before it all complete with the reference output: those
  running on the victim are resumed on the spare decode worker from the
  tokens they had (the router prefills their prompt and those tokens again),
  the others ran there from the start; none hangs;
- the spare's KV blocks are all free afterwards and the router keeps
  serving.
Every wait is bounded."""
import os
import time

import svc
from partest import check, finish, router_workers, cases, error_summary, wait_gone, stop_all

N = 24
short = cases()["short_dog"]
ref = svc.reference_generate(short, N)

c = svc.Cluster(1, 0)
try:
    cl = c.client()
    os.environ["TWAIN_TEST_BAD_PLAN"] = "5"  # the victim's ranks only
    victim = c.add_decode(["--tp", "2", "--ep", "2"])
    del os.environ["TWAIN_TEST_BAD_PLAN"]
    c.wait_registered(1, 1)
    victim.wait_line(r"r1 .*rank 1 of 2 pid \d+ following rank 0", 10)
    # the spare has fewer blocks, so the router (most free blocks first)
    # puts the first requests on the victim
    total = svc.metrics(victim.metrics_port)["twain_kv_blocks_free"]
    spare = c.add_decode(["--kv-blocks", str(int(total) - 48)])
    c.wait_registered(1, 2)

    t0 = time.time()
    resumed0 = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0)
    rids = [cl.send(svc.generate(short, N)) for _ in range(4)]
    left = victim.seen(r"r1 .*rank 1 of 2 cannot read plan 2 \(dist: short decode plan\): leaving the group", 30)
    check(left, "victim rank 1 logs that it cannot read plan 2 and leaves the group")
    if not left:
        print("  victim's last lines:\n  " + "\n  ".join(victim.lines[-20:]))
    t_fail = time.time()
    gone_at = None
    while time.time() < t_fail + svc.scaled(10):
        if router_workers(c, "decode") == 1:
            gone_at = time.time() - t_fail
            break
        cl.pump(0.02)
    check(gone_at is not None and gone_at <= svc.scaled(5.0),
          "the victim is out of the router's registry %s s after rank 1 left" % (
              "%.2f" % gone_at if gone_at is not None else "> 10"))
    ended = {}  # request -> seconds after rank 1 left at which its last reply came
    end = svc.deadline(60)
    while time.time() < end and len(ended) < len(rids):
        cl.pump(0.02)
        for r in rids:
            if r not in ended and cl.done(r):
                ended[r] = time.time() - t_fail
    res = cl.wait(rids, 1)
    n_ok = sum(1 for reps in res if not reps[-1].error.code and svc.tokens_of(reps) == ref)
    resumed = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0) - resumed0
    check(n_ok == len(rids) and resumed >= 1,
          "requests: %d of %d completed with the reference output (errors: %s), the last %.2f s after "
          "rank 1 left; %d resumed on the spare after the victim went" % (
              n_ok, len(rids), error_summary(res), max(ended.values(), default=-1.0), resumed))
    wait_gone(c, victim, c.decodes)
    check(svc.wait_metric(spare.metrics_port, "twain_kv_blocks_used", 0, 10) == 0,
          "every block of the spare decode worker freed")
    after = cl.wait([cl.send(svc.generate(short, N))], 60)[0]
    check(svc.tokens_of(after) == ref, "after the failure the router keeps serving (the spare)")
    cl.close()
finally:
    stop_all(c)
finish()
