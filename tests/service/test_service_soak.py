"""Chaos soak (issue 19 item 9), CPU backend, bounded: 2 prefill + 2 decode
workers under a steady load of streams for TW_SOAK_SECONDS (default 180),
while a chaos loop pauses workers (SIGSTOP/SIGCONT, 0.5-3 s), kills one
(SIGKILL) and starts a replacement, and clients cancel streams and vanish
mid-stream. At the end: every request that was sent got a terminal reply
(none lost), every decode worker holds 0 KV blocks, and the router's resident
memory grew less than 10% over the last three quarters of the soak."""
import os
import random
import signal
import time

import fixtures
import svc

from svc import check, finish

SECONDS = float(os.environ.get("TW_SOAK_SECONDS", "180"))
RSS_CHECK = svc.RSS_CHECK  # off under ASan (svc.py)
rng = random.Random(19)
prompts = [fixtures.ids("short_dog"), fixtures.ids("short_book")]


rss_kb = svc.rss_kb


c = svc.Cluster(2, 2)
lost, sent, answered, events = [], 0, 0, []
try:
    cl = c.client()
    inflight = {}

    def send_some(client, n):
        global sent
        for _ in range(n):
            rid = client.send(svc.generate(rng.choice(prompts), rng.randint(4, 40), deadline_ms=60000))
            inflight[rid] = client
            sent += 1

    def reap(client):
        global answered
        for rid in [r for r, cc in inflight.items() if cc is client and client.done(r)]:
            del inflight[rid]
            answered += 1

    # warm-up, then the memory baseline
    send_some(cl, 16)
    end = time.time() + 60
    while inflight and time.time() < end:
        cl.pump(0.05)
        reap(cl)
    base_rss = None  # after a quarter of the soak: the router's tables have grown to their size
    t_base = time.time() + SECONDS / 4
    t_end = time.time() + SECONDS
    next_chaos = time.time() + 2
    while time.time() < t_end:
        if base_rss is None and time.time() >= t_base:
            base_rss = rss_kb(c.router.p.pid)
        if len(inflight) < 24:
            send_some(cl, 4)
        cl.pump(0.02)
        reap(cl)
        if rng.random() < 0.02 and inflight:  # a cancel
            rid = rng.choice(list(inflight))
            if inflight[rid] is cl:
                x = svc.ClientRequest()
                x.cancel.target_request_id = rid
                cl.send(x)
        if time.time() < next_chaos:
            continue
        next_chaos = time.time() + rng.uniform(2, 5)
        kind = rng.choice(["stop", "stop", "kill", "vanish"])
        if kind == "vanish":  # a client that goes away mid-stream (its requests end with it)
            gone = c.client()
            for _ in range(4):
                gone.send(svc.generate(rng.choice(prompts), 60))
            gone.pump(0.3)
            gone.close()
            events.append("client vanished")
            continue
        pool = rng.choice(["prefill", "decode"])
        victims = c.prefills if pool == "prefill" else c.decodes
        v = rng.choice(victims)
        if kind == "stop":
            pause = rng.uniform(0.5, 3.0)
            os.kill(v.p.pid, signal.SIGSTOP)
            t0 = time.time()
            while time.time() < t0 + pause:
                cl.pump(0.02)
                reap(cl)
            os.kill(v.p.pid, signal.SIGCONT)
            events.append("SIGSTOP %s %.1f s" % (pool, pause))
        else:
            v.stop(signal.SIGKILL, 5)
            victims.remove(v)
            c.procs.remove(v)
            (c.add_prefill if pool == "prefill" else c.add_decode)()
            events.append("kill -9 + restart %s" % pool)
    # drain: every request gets its terminal reply
    end = time.time() + 120
    while inflight and time.time() < end:
        cl.pump(0.05)
        reap(cl)
    lost = list(inflight)
    if c.router.p.poll() is not None:  # say how, rather than a refused /metrics below
        c.router.settle()
        check(False, "the router survives the soak: it exited (%s); its last lines:\n%s" % (
            c.router.p.poll(), "\n".join(c.router.lines[-40:])))
    c.wait_registered(2, 2, 30)
    blocks = {d.worker_name: svc.wait_metric(d.metrics_port, "twain_kv_blocks_used", 0, 45) for d in c.decodes}
    end_rss = rss_kb(c.router.p.pid)
    print("chaos: %d events: %s" % (len(events), "; ".join(events)))
    check(len(events) >= SECONDS / 6, "chaos happened: %d events in %.0f s" % (len(events), SECONDS))
    check(not lost and answered == sent, "%d requests sent, %d answered, none lost (%s)" % (sent, answered, lost[:5]))
    check(all(b == 0 for b in blocks.values()), "every decode worker back to 0 kv blocks: %s" % blocks)
    if RSS_CHECK:
        check(end_rss < base_rss * 1.10, "router RSS %d kB -> %d kB (%+.1f%%, limit 10%%)" % (
            base_rss, end_rss, 100.0 * (end_rss - base_rss) / max(base_rss, 1)))
    else:
        print("router RSS %d kB -> %d kB: not checked under ASan (TW_SOAK_RSS_CHECK=0)" % (base_rss, end_rss))
finally:
    rcs = c.close()
check(all(rc in (0, None) for rc in rcs.values()), "router and workers stop cleanly: %s" % rcs)
finish()
