"""The router checks what it is sent (issue 19 item 4), with fake workers that
hold the link keys (so what is tested is the router, not the link security):
- from workers: token ids outside the vocabulary (-1, 2^31-1), an unknown
  finish reason (99) and an unknown error code (999) fail that request with
  INTERNAL and a message that says so; tokens for a request the worker does
  not hold are dropped; a handoff naming a UCX address the decode worker did
  not register is refused before any prefill worker sees it; the router
  keeps serving;
- from clients: a date that is not a real YYYY-MM-DD (or that carries text),
  a NUL byte in any string (content, stop strings), invalid UTF-8 in a role,
  a 17th stop_token_id, 20 MiB of whitespace: each an INVALID_ARGUMENT naming
  the field or the cause, and every reply parses (its error message is valid
  UTF-8); after bursts of 20 MiB requests the router's RSS returns to within
  24 MiB of what it was before."""
import time

import fixtures
import svc

from svc import check, finish

zmq = svc.zmq
E = svc.E
EXPIRE_S = 30  # the fakes heartbeat only while a step waits for them
c = svc.Cluster(0, 0, router_args=["--expire-ms", str(EXPIRE_S * 1000)])
ctx = zmq.Context.instance()


def fake(name, pool):
    s = svc.worker_socket(ctx, name.encode(), c.worker_ep)
    s.send(svc.register_envelope(name, pool, free_blocks=1000).SerializeToString())
    return s


dec, pre = fake("fake-decode", "POOL_DECODE"), fake("fake-prefill", "POOL_PREFILL")


def rss_mib(pid):
    return svc.rss_kb(pid) // 1024


def recv(sock, body, timeout=15):
    end = time.time() + timeout
    while time.time() < end:
        if sock.poll(20):
            e = svc.Envelope()
            e.ParseFromString(sock.recv())
            if e.WhichOneof("body") == body:
                return e
    raise AssertionError("no %s within %d s" % (body, timeout))


def run(first_token, tokens=None, finish_reason=1, code=0, finished=True):
    """One generate request through the fakes; the client's last reply."""
    rid = cl.send(svc.generate(fixtures.ids("short_dog"), 8, deadline_ms=60000))
    rv = recv(dec, "reserve")
    out = svc.Envelope()
    out.reserved.request_id = rv.reserve.request_id
    out.reserved.handoff.block_ids.append(0)
    dec.send(out.SerializeToString())
    pr = recv(pre, "prefill")
    done = svc.Envelope()
    done.prefill_done.request_id = pr.prefill.request_id
    done.prefill_done.first_token = first_token
    pre.send(done.SerializeToString())
    if tokens is not None:
        d = recv(dec, "decode")
        t = svc.Envelope()
        t.tokens.request_id = d.decode.request_id
        t.tokens.tokens.extend(tokens)
        t.tokens.finished = finished
        t.tokens.finish_reason = finish_reason
        if code:
            t.tokens.status.code = code
            t.tokens.status.message = "worker says \xe9"
        dec.send(t.SerializeToString())
    return cl.wait([rid], 30)[0][-1]


cl = None
try:
    recv(dec, "register_ack")
    recv(pre, "register_ack")
    c.wait_registered(1, 1, 10)
    cl = c.client()
    ok = run(5, [6, 7], finish_reason=E["FINISH_LENGTH"])
    check(ok.error.code == 0, "a well-formed exchange through the fakes is served (%s)" % ok.error.message)
    for first, toks, reason, code, what in (
            (-1, None, 1, 0, "first token -1"),
            (5, [2 ** 31 - 1], 1, 0, "token 2^31-1"),
            (5, [6], 99, 0, "finish_reason 99"),
            (5, [6], 1, 999, "error code 999")):
        r = run(first, toks, reason, code)
        want = "invalid token id" if "token" in what else "invalid finish reason" if "finish" in what \
            else "worker says"
        check(r.done and r.error.code == E["INTERNAL"] and want in r.error.message,
              "%s from a worker: INTERNAL (%s)" % (what, r.error.message))
    # tokens for a request the worker does not hold: dropped, nothing reaches a client
    stray = svc.Envelope()
    stray.tokens.request_id = 987654
    stray.tokens.tokens.extend([1, 2])
    dec.send(stray.SerializeToString())
    ok2 = run(5, [6, 7], finish_reason=E["FINISH_LENGTH"])
    check(ok2.error.code == 0 and svc.tokens_of(cl.replies[ok2.request_id]) == [5, 6, 7],
          "after all that the router still serves: tokens %s" % svc.tokens_of(cl.replies[ok2.request_id]))

    # a handoff naming a UCX address the decode worker did not register never
    # reaches a prefill worker (UCX aborts on some malformed addresses)
    reg = svc.register_envelope("fake-decode", "POOL_DECODE", free_blocks=1000)
    reg.register.kv_addresses.append(b"\x01the-real-address")
    dec.send(reg.SerializeToString())
    recv(dec, "register_ack")
    for addr, ok_ in ((b"\x02\xff garbage", False), (b"\x01the-real-address", True)):
        rid = cl.send(svc.generate(fixtures.ids("short_dog"), 8, deadline_ms=60000))
        rv = recv(dec, "reserve")
        out = svc.Envelope()
        out.reserved.request_id = rv.reserve.request_id
        out.reserved.handoff.block_ids.append(0)
        out.reserved.handoff.ucx_address = addr
        dec.send(out.SerializeToString())
        if ok_:
            pr = recv(pre, "prefill")
            check(pr.prefill.handoff.ucx_address == addr, "the registered address is forwarded")
            cancel = svc.ClientRequest()
            cancel.cancel.target_request_id = rid
            cl.wait([cl.send(cancel), rid], 30)
        else:
            r = cl.wait([rid], 30)[0][-1]
            try:
                recv(pre, "prefill", timeout=1)
                leaked = True
            except AssertionError:
                leaked = False
            check(r.error.code == E["INTERNAL"] and "unregistered UCX address" in r.error.message and not leaked,
                  "a handoff with an unregistered UCX address: INTERNAL, no PrefillRequest (%s)" % r.error.message)

    # pools sent once at registration (Register.kv_pools): a reservation that
    # names no address gets them from the router; with --dp the replica it
    # names; a worker that registered none has its pool-less reservation refused
    def reserve_with(handoff_fill):
        rid = cl.send(svc.generate(fixtures.ids("short_dog"), 8, deadline_ms=60000))
        rv = recv(dec, "reserve")
        out = svc.Envelope()
        out.reserved.request_id = rv.reserve.request_id
        out.reserved.handoff.block_ids.extend([3, 4])
        handoff_fill(out.reserved.handoff)
        dec.send(out.SerializeToString())
        return rid

    def finish_req(rid):
        cancel = svc.ClientRequest()
        cancel.cancel.target_request_id = rid
        cl.wait([cl.send(cancel), rid], 30)

    reg = svc.register_envelope("fake-decode", "POOL_DECODE", free_blocks=1000)
    reg.register.kv_addresses.extend([b"\x01rank-0", b"\x01rank-1"])
    pools = reg.register.kv_pools
    pools.ucx_address = b"\x01rank-0"
    pools.rkey = b"rkey-0"
    pools.layout.n_blocks = 77
    for i in range(2):
        k = pools.ranks.add()
        k.ucx_address = b"\x01rank-%d" % i
        k.rkey = b"rkey-%d" % i
        k.layout.n_blocks = 70 + i
        k.layout.kv_head_offset = 0
    dec.send(reg.SerializeToString())
    recv(dec, "register_ack")
    rid = reserve_with(lambda h: None)
    pr = recv(pre, "prefill").prefill
    check(pr.handoff.ucx_address == b"\x01rank-0" and pr.handoff.rkey == b"rkey-0" and
          pr.handoff.layout.n_blocks == 77 and len(pr.handoff.ranks) == 2 and
          list(pr.handoff.block_ids) == [3, 4] and pr.handoff.replica == 0,
          "registered pools: the prefill request carries them with the reserved blocks")
    finish_req(rid)
    rid = reserve_with(lambda h: setattr(h, "replica", 2))
    pr = recv(pre, "prefill").prefill
    check(pr.handoff.ucx_address == b"\x01rank-1" and pr.handoff.rkey == b"rkey-1" and
          pr.handoff.layout.n_blocks == 71 and len(pr.handoff.ranks) == 0 and pr.handoff.replica == 0,
          "--dp replica 2: the prefill request carries rank 1's pool alone")
    finish_req(rid)
    rid = reserve_with(lambda h: setattr(h, "replica", 3))
    r = cl.wait([rid], 30)[0][-1]
    check(r.error.code == E["INTERNAL"] and "without its kv pools" in r.error.message,
          "a replica the worker never registered: INTERNAL (%s)" % r.error.message)
    reg = svc.register_envelope("fake-decode", "POOL_DECODE", free_blocks=1000)
    reg.register.kv_addresses.append(b"\x01rank-0")
    dec.send(reg.SerializeToString())  # registered again, without pools
    recv(dec, "register_ack")
    rid = reserve_with(lambda h: None)
    pr = recv(pre, "prefill").prefill
    check(pr.handoff.ucx_address == b"" and list(pr.handoff.block_ids) == [3, 4],
          "no pools registered: the handoff goes as it is (the prefill worker refuses it)")
    finish_req(rid)

    # ---- clients
    def ask(req, raw=None):
        if raw is None:
            rid = cl.send(req)
        else:
            rid = req.request_id = cl.next_id
            cl.next_id += 1
            cl.replies.setdefault(rid, [])
            cl.send_raw(raw(req.SerializeToString()))
        return cl.wait([rid], 30)[0][-1]

    for date in ("2025-02-30", "2025-13-01", "2025-6-1", "2025-06-01\nReasoning: high"):
        r = ask(svc.chat("hi", date=date))
        check(r.error.code == E["INVALID_ARGUMENT"] and "date" in r.error.message,
              "chat date %r: INVALID_ARGUMENT (%s)" % (date, r.error.message))
    def accepted(req, what):
        """req is valid: it reaches the decode fake as a Reserve; cancelled then."""
        rid = cl.send(req)
        rv = recv(dec, "reserve")
        check(rv.reserve.request_id > 0 and not cl.done(rid), "%s is accepted" % what)
        cancel = svc.ClientRequest()
        cancel.cancel.target_request_id = rid
        cl.wait([cl.send(cancel), rid], 30)

    accepted(svc.chat("hi", date="2024-02-29"), "chat date 2024-02-29 (a leap day)")
    r = ask(svc.chat("card 4111\x00 then the rest"))
    check(r.error.code == E["INVALID_ARGUMENT"] and "content contains a NUL byte at offset 9" in r.error.message,
          "a NUL in message content: INVALID_ARGUMENT, not a silent cut (%s)" % r.error.message)
    q = svc.chat("hi")
    q.chat.sampling.stop.append("a\x00b")
    r = ask(q)
    check(r.error.code == E["INVALID_ARGUMENT"] and "stop contains a NUL byte" in r.error.message,
          "a NUL in a stop string: INVALID_ARGUMENT (%s)" % r.error.message)
    q = svc.chat("hi")
    q.chat.messages[0].role = "uZZZ"
    r = ask(q, raw=lambda b: b.replace(b"uZZZ", b"u\xff\xfeZ"))
    check(r.error.code == E["INVALID_ARGUMENT"] and "role is not valid UTF-8 at offset 1" in r.error.message,
          "invalid UTF-8 in a role: INVALID_ARGUMENT and a reply that parses (%s)" % r.error.message)
    base_rss = rss_mib(c.router.p.pid)
    r = ask(svc.chat("hello" + " " * (20 << 20) + "world"))
    check(r.error.code == E["INVALID_ARGUMENT"],
          "20 MiB of spaces in a message: INVALID_ARGUMENT, never INTERNAL (%s)" % r.error.message[:120])
    # bursts of such requests: the router's memory returns to where it was
    # (it once grew from 169 MiB to 1.4 GiB over these attacks and stayed)
    for _ in range(6):
        big = [cl.send(svc.chat("hello" + " " * (20 << 20) + "world")) for _ in range(4)]
        cl.wait(big, 60)
    end = time.time() + 10
    while rss_mib(c.router.p.pid) > base_rss + 24 and time.time() < end:
        time.sleep(0.2)
    if svc.RSS_CHECK:
        check(rss_mib(c.router.p.pid) <= base_rss + 24,
              "after 25 requests of 20 MiB the router's RSS is back within 24 MiB of %d MiB: %d MiB" % (
                  base_rss, rss_mib(c.router.p.pid)))
    else:
        print("router RSS %d MiB -> %d MiB: not checked under ASan (TW_SOAK_RSS_CHECK=0)" % (
            base_rss, rss_mib(c.router.p.pid)))
    r = ask(svc.generate(fixtures.ids("short_dog"), 4, stop_ids=list(range(1, 18))))
    check(r.error.code == E["INVALID_ARGUMENT"] and "at most 16" in r.error.message,
          "17 stop_token_ids: INVALID_ARGUMENT, none dropped silently (%s)" % r.error.message)
    accepted(svc.generate(fixtures.ids("short_dog"), 4, stop_ids=list(range(1, 17))), "16 stop_token_ids")
finally:
    if cl:
        cl.close()
    dec.close()
    pre.close()
    rcs = c.close()
check(not any(rcs.values()), "the router stops cleanly: %s" % rcs)
finish()
