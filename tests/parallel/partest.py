"""partest.py: what the multi-rank service tests of tests/parallel share: the
check/summary bookkeeping, the prompts and their TP 1 references, sending
prompts at once and comparing the greedy output, the router's registry
count, and kill -9 of a rank while its worker streams. Every wait is
bounded."""
import os
import signal
import time

import fixtures
import svc

from svc import check, finish  # noqa: F401  (the parallel tests import them from here)


def router_workers(c, kind):
    return svc.metrics(c.router_metrics_port).get("twain_router_%s_workers" % kind, 0)


def cases():
    """Prompts from 15 tokens to the 298-token multiturn fixture: one over
    several blocks and past the 32-token sliding window."""
    return {
        "short_dog": fixtures.ids("short_dog"),
        "system_water": fixtures.ids("system_water"),
        "long": fixtures.long_prompt(),
        "multiturn": fixtures.ids("multiturn"),
    }


def greedy_at_once(cl, prompts, refs, n, timeout=180):
    """Send every prompt at once, check each greedy output equals its TP 1
    reference (n tokens); returns the outputs by name."""
    rids = {name: cl.send(svc.generate(ids, n)) for name, ids in prompts.items()}
    got = {name: svc.tokens_of(reps) for name, reps in zip(rids, cl.wait(list(rids.values()), timeout))}
    for name in rids:
        check(got[name] == refs[name] and len(refs[name]) == n,
              "%-12s prompt %3d tokens: greedy %s TP 1" % (
                  name, len(prompts[name]), "identical to" if got[name] == refs[name] else "DIFFERENT from"))
        if got[name] != refs[name]:
            print("  service:  ", got[name], "\n  reference:", refs[name])
    return got


def kill_rank_streaming(c, cl, victim, prompt, n_streams, kind, remaining, what, n_tokens=300):
    """Start n_streams streams of n_tokens, SIGKILL rank 1 of `victim` once each has
    a few tokens, check the worker leaves the router's registry (its `kind`
    pool count drops to `remaining`) within 2 s; returns the streams'
    replies once all ended and how many of them ran on the victim at the
    kill (its decode_running_sequences, polled until the streams' placement
    adds up over the decode workers)."""
    pid1 = int(victim.wait_line(r"r1 .*rank 1 of 2 pid (\d+) following rank 0", 10).group(1))
    streams = [cl.send(svc.generate(prompt, n_tokens)) for _ in range(n_streams)]
    end = svc.deadline(60)
    while time.time() < end and not all(len(svc.tokens_of(cl.replies.get(r, []))) >= 3 or cl.done(r)
                                        for r in streams):
        cl.pump(0.02)
    running = svc.running_by_worker(c.decodes, lambda: sum(1 for r in streams if not cl.done(r)),
                                    lambda: cl.pump(0.02))
    on_victim = int(running.get(victim.worker_name, 0))
    t_kill = time.time()
    os.kill(pid1, signal.SIGKILL)
    gone_at = None
    while time.time() < t_kill + svc.scaled(10):
        if router_workers(c, kind) == remaining:
            gone_at = time.time() - t_kill
            break
        cl.pump(0.02)
    check(gone_at is not None and gone_at <= svc.scaled(2.0),  # the router's expiry: 1 s x TW_SLOW_BUILD
          "kill -9 of %s: worker out of the registry after %s s" % (
              what, "%.2f" % gone_at if gone_at is not None else "> 10"))
    return cl.wait(streams, 120), on_victim


def wait_gone(c, victim, pool):
    """The killed worker's other rank ends too (bounded); forget it."""
    end = svc.deadline(10)
    while time.time() < end and victim.p.poll() is None:
        time.sleep(0.05)
    check(victim.p.poll() is not None, "the killed worker's other rank is gone too (exit %s)" % victim.p.poll())
    c.procs.remove(victim)
    pool.remove(victim)


def error_summary(res):
    """The distinct error messages (first 40 characters) of finished requests."""
    return ", ".join(sorted({r[-1].error.message[:40] for r in res if r[-1].error.code}))


def stop_all(c, what="every daemon stopped cleanly on SIGTERM"):
    """SIGTERM every daemon of the cluster; each must exit 0."""
    rcs = c.close()
    print("exit codes:", rcs)
    check(all(v == 0 for v in rcs.values()), what)
