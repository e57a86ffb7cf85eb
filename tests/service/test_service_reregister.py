"""A worker asked to register again keeps its work unless the router had
really forgotten it. A stall's queued messages come back from the router
rejected (NOT_FOUND, "unknown worker") in a burst, and a reject of a
message that crossed the registration can arrive after the RegisterAck: the
old worker took each as "the router forgot me", registered again and
dropped every reservation and sequence it held, which the router, holding
it all along, still counted on (those requests waited for their deadline).
Now (a real decode worker under a fake router, fake_router.py): five
rejects in a burst make one "registering again" line and a Register; an
ack with `known` set keeps its reservation (nothing quarantined); an ack
without it (the router had expired it) drops what it holds, said once."""
import time

import svc
from fake_router import FakeRouter
from svc import E, check, finish

fr = FakeRouter()
dec, pre = fr.start_workers()


def reject_burst(n):
    for _ in range(n):
        e = svc.Envelope()
        e.reject.request_id = 0
        e.reject.status.code = E["NOT_FOUND"]
        e.reject.status.message = "unknown worker: register first"
        fr.send(b"fd", e)


def reserve(rid):
    rv = svc.Envelope()
    rv.reserve.request_id = rid
    rv.reserve.n_prompt_tokens = 15
    rv.reserve.max_tokens = 5
    fr.send(b"fd", rv)
    return fr.recv_body(b"fd", "reserved", rid=rid).reserved


def ack(known):
    fr.recv_body(b"fd", "register")
    a = svc.Envelope()
    a.register_ack.worker_id = "fd"
    a.register_ack.known = known
    fr.send(b"fd", a)


try:
    fr.register((b"fd", b"fp"))
    port = int(dec.wait_line(r"serving /metrics and /healthz on 127\.0\.0\.1:(\d+)", 5).group(1))
    r = reserve(7)
    check(r.status.code == 0, "reserve 7: ok (%s)" % r.status.message)
    # 1: a burst of rejects, the router still holding the worker (known)
    reject_burst(5)
    ack(True)
    extra = 0  # Registers after the acknowledged one (a drop would show by then too)
    end = time.time() + svc.scaled(1.0)
    while time.time() < end:
        if fr.rs.poll(50):
            ident, data = fr.rs.recv_multipart()
            e = svc.Envelope()
            e.ParseFromString(data)
            extra += ident == b"fd" and e.WhichOneof("body") == "register"
    check(extra == 0, "5 rejects in a burst: one Register (%d more)" % extra)
    m = svc.metrics(port)
    again = dec.count(r"router does not know fd: registering again")
    check(again == 1, "5 rejects in a burst: 'registering again' said %d times (want 1)" % again)
    check(dec.count(r"router rejected a message") == 0, "the NOT_FOUND rejects are not each logged")
    check(dec.count(r"the router forgot this worker") == 0 and m.get("twain_kv_blocks_quarantined", -1) == 0
          and m.get("twain_kv_blocks_used", 0) > 0,
          "ack known: the reservation stands (used %s, quarantined %s)" % (
              m.get("twain_kv_blocks_used"), m.get("twain_kv_blocks_quarantined")))
    # 2: the router had expired it: the ack says so, both reservations go
    r = reserve(8)
    check(r.status.code == 0, "reserve 8: ok (%s)" % r.status.message)
    reject_burst(1)
    ack(False)
    dec.wait_line(r"the router forgot this worker: dropped 2 reservations and sequences", 10)
    m = svc.metrics(port)
    check(0 < m.get("twain_kv_blocks_quarantined", 0) == m.get("twain_kv_blocks_used", -1),
          "ack not known: reservations 7 and 8 dropped (quarantined %s of %s)" % (
              m.get("twain_kv_blocks_quarantined"), m.get("twain_kv_blocks_used")))
    again = dec.count(r"router does not know fd: registering again")
    check(again == 2, "'registering again' once more (%d in all)" % again)
finally:
    rcs = fr.close()
check(rcs == [0, 0], "workers stop cleanly on SIGTERM: %s" % rcs)
finish()
