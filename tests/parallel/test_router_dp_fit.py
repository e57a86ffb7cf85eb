"""The router's choice for a decode worker with data-parallel attention
(issue 6 point 2): such a worker reports free_kv_blocks as the sum over its
replicas and Capacity.replica_free_kv_blocks as the most free blocks of any
one, and a sequence's KV must fit in one replica.

A real router and two fake workers on 127.0.0.1 (a prefill and a decode
worker speaking twain.internal.v1 over DEALER sockets, heartbeating every
100 ms). The decode worker has 22 blocks of 16 tokens, 6 free in all but at
most 3 in one replica; a request of 15 + 60 tokens needs 5 blocks: it fits
the sum, not a replica, so no Reserve may reach the worker while that lasts
(without the per-replica test the router sends it at once). Once a
heartbeat reports a replica with 11 free blocks, the Reserve arrives. A
request needing more blocks than the largest replica holds
(Capacity.replica_total_kv_blocks), or without dp the whole pool, is refused
at once with INVALID_ARGUMENT (a retry cannot help), never sent to the
worker (it used to wait for its deadline); one whose max_tokens is the
router's default gets a max_tokens that fits instead. Two requests that each fit the emptiest replica but not
together get one Reserve until the next heartbeat (the second used to be
sent too, to come back RESOURCE_EXHAUSTED). Every wait is bounded."""
import time

import fixtures
import svc
from partest import check, finish, stop_all

zmq = svc.zmq
# the fakes go silent for a while below (no heartbeat, so the router's count
# of reserved blocks stands): longer than the default 1 s before expiry
EXPIRE_S = 5
c = svc.Cluster(0, 0, router_args=["--expire-ms", str(EXPIRE_S * 1000)])
ctx = zmq.Context.instance()


def fake(name, pool):
    s = svc.worker_socket(ctx, name.encode(), c.worker_ep)
    env = svc.register_envelope(name, pool, ranks=2)
    return s, env


dec, reg_d = fake("fake-dp-decode", "POOL_DECODE")
pre, reg_p = fake("fake-prefill", "POOL_PREFILL")
cap = {"free": 6, "total": 22, "replica": 3, "replica_total": 11}


def fill(capacity):
    capacity.free_kv_blocks = cap["free"]
    capacity.total_kv_blocks = cap["total"]
    capacity.replica_free_kv_blocks = cap["replica"]
    capacity.replica_total_kv_blocks = cap["replica_total"]


fill(reg_d.register.capacity)
dec.send(reg_d.SerializeToString())
pre.send(reg_p.SerializeToString())


def beat():
    for s, name in ((dec, "fake-dp-decode"), (pre, "fake-prefill")):
        env = svc.Envelope()
        env.heartbeat.worker = name
        if s is dec:
            fill(env.heartbeat.capacity)
        s.send(env.SerializeToString())


def decode_messages(seconds):
    """Heartbeat both fakes every 100 ms for `seconds`; the decode fake's messages."""
    got, end, last = [], time.time() + seconds, 0.0
    while time.time() < end:
        if time.time() - last >= 0.1:
            beat()
            last = time.time()
        if dec.poll(20):
            e = svc.Envelope()
            e.ParseFromString(dec.recv())
            got.append(e)
        while pre.poll(0):
            pre.recv()
    return got


cl = None
try:
    acks, end = [], svc.deadline(15)
    while not acks and time.time() < end:  # a loaded machine may take a while
        acks = [e for e in decode_messages(0.5) if e.WhichOneof("body") == "register_ack"]
    c.wait_registered(1, 1, 10)
    check(len(acks) == 1, "the fake dp decode worker registered (ack %s)" % [a.register_ack.worker_id for a in acks])
    cl = c.client()
    rid = cl.send(svc.generate(fixtures.ids("short_dog"), 60, deadline_ms=30000))
    early = [e for e in decode_messages(1.5) if e.WhichOneof("body") == "reserve"]
    check(not early, "needs 5 blocks, 6 free in all but 3 in the emptiest replica: no Reserve (%d sent)" % len(early))
    cap.update(free=14, replica=11)
    late = []
    end = svc.deadline(10)
    while time.time() < end and not late:
        late = [e for e in decode_messages(0.3) if e.WhichOneof("body") == "reserve"]
    check(len(late) == 1 and late[0].reserve.n_prompt_tokens == 15 and late[0].reserve.max_tokens == 60,
          "a replica with 11 free blocks: the Reserve arrives (%s)" % [
              (e.reserve.n_prompt_tokens, e.reserve.max_tokens) for e in late])
    # never fits: more than the largest replica (dp) or the pool (no dp) holds
    for replica_total, max_tokens, need, size in ((11, 180, 13, 11), (0, 400, 26, 22)):
        cap.update(replica_total=replica_total, replica=min(replica_total, 11))
        decode_messages(0.3)  # a heartbeat with it
        rid2 = cl.send(svc.generate(fixtures.ids("short_dog"), max_tokens, deadline_ms=600000))
        got = []
        end = svc.deadline(10)
        while time.time() < end and not cl.done(rid2):
            got += [e for e in decode_messages(0.1) if e.WhichOneof("body") == "reserve"]
            cl.pump(0.01)
        err = cl.replies[rid2][-1].error if cl.done(rid2) else None
        check(err is not None and err.code == svc.E["INVALID_ARGUMENT"] and not got and
              "needs %d kv blocks" % need in err.message and "holds %d" % size in err.message and
              "lower max_tokens" in err.message,
              "%d blocks > %s of %d: refused at once as INVALID_ARGUMENT, no Reserve (%s)" % (
                  need, "a replica" if replica_total else "the pool", size,
                  err.message if err is not None else "still queued after 10 s"))
    # the same with max_tokens left to the router's default (512): it shrinks
    # to what the largest replica holds after the 15-token prompt, 11 x 16 -
    # 15 = 161, and the request is reserved instead of refused
    cap.update(free=22, total=22, replica=11, replica_total=11)
    decode_messages(0.3)
    dflt = svc.generate(fixtures.ids("short_dog"), 0, deadline_ms=600000)
    dflt.generate.sampling.explicit_max_tokens = False
    rid3 = cl.send(dflt)
    got, end = [], svc.deadline(10)
    while time.time() < end and not got and not cl.done(rid3):
        got = [e for e in decode_messages(0.2) if e.WhichOneof("body") == "reserve"]
        cl.pump(0.01)
    check(len(got) == 1 and got[0].reserve.n_prompt_tokens == 15 and got[0].reserve.max_tokens == 161,
          "default max_tokens, 11-block replicas: reserved with max_tokens 161 (%s%s)" % (
              [(e.reserve.n_prompt_tokens, e.reserve.max_tokens) for e in got],
              "; " + cl.replies[rid3][-1].error.message if cl.done(rid3) else ""))
    if got:  # end it: a reservation error the router does not retry
        rep = svc.Envelope()
        rep.reserved.request_id = got[0].reserve.request_id
        rep.reserved.status.code = svc.E["INTERNAL"]
        rep.reserved.status.message = "test: not kept"
        dec.send(rep.SerializeToString())
    res = cl.wait([rid3], 30)[0]
    check(res[-1].error.code == svc.E["INTERNAL"], "and ends with the worker's error: %s" % res[-1].error.message)
    # two requests of 6 blocks at once, one replica of 11 free (22 in all):
    # the first Reserve takes that room until the next heartbeat says
    # otherwise, so the second waits instead of being sent to be refused
    cap.update(free=22, total=22, replica=11, replica_total=11)
    decode_messages(0.3)  # a heartbeat with it, then none until the check
    pair = [cl.send(svc.generate(fixtures.ids("short_dog"), 81)) for _ in range(2)]
    # the first Reserve (bounded: a loaded router may take a while), then 0.5 s
    # for a second one; all of it within the router's --expire-ms
    got, first_at, end = [], None, time.time() + EXPIRE_S - 1
    while time.time() < end and (first_at is None or time.time() < first_at + 0.5):
        if dec.poll(20):
            e = svc.Envelope()
            e.ParseFromString(dec.recv())
            if e.WhichOneof("body") == "reserve":
                got.append(e)
                first_at = first_at or time.time()
    check(len(got) == 1, "two 6-block requests, one replica with 11 free: %d Reserve(s) before the "
          "next heartbeat (1: the second waits)" % len(got))
    # end the request: the decode worker is full after all, then both fakes go away
    if late:
        rep = svc.Envelope()
        rep.reserved.request_id = late[0].reserve.request_id
        rep.reserved.status.code = svc.E["RESOURCE_EXHAUSTED"]
        rep.reserved.status.message = "full"
        dec.send(rep.SerializeToString())
    dec.close(0)
    pre.close(0)
    res = cl.wait([rid], 60)[0]
    check(res[-1].error.code != 0, "the request then fails cleanly: %s" % res[-1].error.message)
    res = cl.wait(pair, 60)
    check(all(r[-1].error.code != 0 for r in res), "so do the two others")
finally:
    if cl:
        cl.close()
    stop_all(c, "the router stops cleanly on SIGTERM")
finish()
