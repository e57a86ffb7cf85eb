"""Faults: cancel mid-stream frees the blocks; a client that goes away
mid-stream frees them too; kill -9 of a decode worker mid-stream: the router
expires it after 1 s of silence and resumes its streams on the other decode
worker from the tokens they had (their prompt and those tokens prefilled
again), so every stream finishes with exactly the greedy tokens of an
uninterrupted run; a prefill worker that freezes (SIGSTOP) before any
token was sent has its requests retried elsewhere; the router keeps serving
throughout and every daemon still alive stops cleanly."""
import signal
import time

import fixtures
import svc

from svc import check, finish



prompt = fixtures.ids("short_dog")
c = svc.Cluster(2, 2)
try:
    cl = c.client()
    # ---- explicit cancel mid-stream
    rid = cl.send(svc.generate(prompt, 3000))
    svc.wait_tokens(cl, rid, 5)
    creq = svc.ClientRequest()
    creq.cancel.target_request_id = rid
    cid = cl.send(creq)
    reps = cl.wait([rid, cid], 30)
    last = reps[0][-1]
    check(last.finish_reason == svc.E["FINISH_CANCELLED"] and last.error.code == svc.E["CANCELLED"],
          "cancel: the stream ends with CANCELLED (%s)" % last.error.message)
    check(reps[1][-1].done and reps[1][-1].error.code == 0, "cancel: the cancel request is answered OK")
    for d in c.decodes:
        check(svc.wait_metric(d.metrics_port, "twain_kv_blocks_used", 0) == 0,
              "cancel: %s holds 0 kv blocks" % d.worker_name)
    # cancelling it again: NOT_FOUND, clearly
    creq2 = svc.ClientRequest()
    creq2.cancel.target_request_id = rid
    r2 = cl.wait([cl.send(creq2)], 10)[0][-1]
    check(r2.error.code == svc.E["NOT_FOUND"], "cancel of a finished request: NOT_FOUND (%s)" % r2.error.message)

    # ---- the client goes away mid-stream
    gone = c.client()
    grid = gone.send(svc.generate(prompt, 3000))
    svc.wait_tokens(gone, grid, 5)
    # this backend's speed: the kill -9 streams below must outlast the kill
    t0 = time.time()
    svc.wait_tokens(gone, grid, 55)
    rate = 50 / max(time.time() - t0, 1e-3)
    gone.close()
    check(svc.wait_metric(c.router_metrics_port, "twain_router_running_requests", 0) == 0,
          "client gone: the router drops the request")
    for d in c.decodes:
        check(svc.wait_metric(d.metrics_port, "twain_kv_blocks_used", 0) == 0,
              "client gone: %s holds 0 kv blocks" % d.worker_name)

    # ---- kill -9 of a decode worker mid-stream
    time.sleep(0.5)  # let heartbeats report the freed blocks, so both workers get streams
    # long enough to be mid-stream at the kill on any backend: about 3 s of
    # decoding at the rate measured above, at least 400 tokens and at most
    # 3000 (the tiny model's context is 4096)
    n_kill = max(400, min(3000, int(rate * 3)))
    print("  kill -9 streams: %d tokens each (one stream decodes %.0f tokens/s here)" % (n_kill, rate))
    def kill_req(i):  # even: greedy; odd: sampled with a seed (its draw depends on the position)
        q = svc.generate(prompt, n_kill)
        if i % 2:
            q.generate.sampling.temperature = 1.0
            q.generate.sampling.seed = 7
        return q

    rids = [cl.send(kill_req(i)) for i in range(6)]
    for r in rids:
        svc.wait_tokens(cl, r, 3)
    # Where the streams run is the router's choice (the most free blocks by the
    # last heartbeat: one sent before the frees above, late on a loaded
    # machine, puts all 6 on the other worker). Read it from the workers, so
    # the number of streams the kill must resume is known exactly.
    running = svc.running_by_worker(c.decodes, lambda: len(rids), lambda: time.sleep(0.05))
    for d in c.decodes:
        print("  before kill: %s %s" % (d.worker_name, {k: v for k, v in svc.metrics(d.metrics_port).items() if "blocks" in k or "running" in k}))
    victim = c.decodes[0] if running[c.decodes[0].worker_name] else c.decodes[1]
    resumed0 = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0)
    t_kill = time.time()
    victim.p.send_signal(signal.SIGKILL)
    res = cl.wait(rids, 120)
    print("  kill -9: every stream ended %.2f s after the kill" % (time.time() - t_kill))
    c.procs.remove(victim)
    c.decodes.remove(victim)
    # the references: the same requests, uninterrupted, on the surviving worker
    refs = cl.wait([cl.send(kill_req(i)) for i in range(2)], 120)
    want = [svc.tokens_of(x) for x in refs]
    check(all(x[-1].error.code == 0 for x in refs) and [len(w) for w in want] == [n_kill, n_kill],
          "after kill -9: new requests are served")
    check(want[0] != want[1], "the sampled reference differs from the greedy one")
    for i, (r, rep) in enumerate(zip(rids, res)):
        got, w = svc.tokens_of(rep), want[i % 2]
        check(rep[-1].error.code == 0 and rep[-1].finish_reason == svc.E["FINISH_LENGTH"] and got == w,
              "kill -9: request %d (%s) finished with the uninterrupted run's %d tokens (got %d, "
              "first difference at %s; error %r)" % (
                  r, "sampled, seed 7" if i % 2 else "greedy", n_kill, len(got),
                  next((k for k, (a, b) in enumerate(zip(got, w)) if a != b), "-"),
                  rep[-1].error.message))
    resumed = svc.metrics(c.router_metrics_port).get("twain_router_requests_resumed_total", 0) - resumed0
    check(resumed == running[victim.worker_name] > 0,
          "kill -9: %d streams resumed elsewhere, %d were on the killed worker" % (
              resumed, running[victim.worker_name]))

    # ---- a frozen prefill worker: requests retried elsewhere before any token
    frozen = c.prefills[0]
    frozen.p.send_signal(signal.SIGSTOP)
    rids = [cl.send(svc.generate(prompt, 20)) for _ in range(4)]
    res = cl.wait(rids, 90)
    ref = svc.reference_generate(prompt, 20)
    ok = all(svc.tokens_of(r) == ref for r in res)
    if not ok:
        for r in res:
            print("   got", svc.tokens_of(r), r[-1].error)
        for line in c.router.lines:  # what the router did with them
            if "retrying" in line or "expired" in line or "failed" in line or "stale" in line:
                print("   router:", line)
    check(ok, "frozen prefill: all 4 requests complete with the reference output")
    check(c.router.seen(r"retrying elsewhere"), "frozen prefill: the router retried requests elsewhere")
    frozen.p.send_signal(signal.SIGCONT)
    time.sleep(0.5)
    res = cl.wait([cl.send(svc.generate(prompt, 20)) for _ in range(2)], 60)
    check(all(svc.tokens_of(r) == ref for r in res), "thawed prefill: later requests still correct")
    for d in c.decodes:
        m = svc.metrics(d.metrics_port)
        print("  %s: blocks used %d (quarantined reservations of the frozen requests count as used)" % (
            d.worker_name, m["twain_kv_blocks_used"]))
    cl.close()
finally:
    rcs = c.close()
print("exit codes:", rcs)
check(not any(rcs.values()), "every remaining daemon stops cleanly on SIGTERM")
finish()
