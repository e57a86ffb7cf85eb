"""Ready means connected (issue 15 item 6): the prefill worker connects to
every decode worker's registered KV pools (UCX endpoint; with CUDA IPC, the
pool's mapping) when the decode worker registers, not at its first handoff.
 - `twain serve --backend cpu`: by the time `ready` is printed, and before
   any request is sent, the prefill worker has logged the decode worker's
   pools connected ahead of traffic and counts it in
   twain_kv_peers_connected_ahead_total; the router waited for its
   KvPeersReady. The requests then reuse that endpoint (one endpoint created
   in all) and their greedy output equals `twain-prefill --generate`.
 - A decode worker that joins a running cluster is connected by the prefill
   worker without any request, and the one request after it is served."""
import re

import fixtures
import svc

from svc import check, finish

N = 16
prompts = {"short_dog": fixtures.ids("short_dog"), "long": fixtures.long_prompt()}
AHEAD = r"kv pools of decode worker %s connected ahead of traffic: (\d+) pools"
CREATED = r"kvx: ucx endpoint to a decode worker created"


def metric(port, suffix):
    m = svc.metrics(port)
    return sum(v for k, v in m.items() if k.endswith(suffix))


# 1. twain serve: connected before ready, before the first request
s = svc.Proc([svc.bin_path("router", "twain"), "serve", "--backend", "cpu", "--model", svc.MODEL,
              "--listen", "tcp://127.0.0.1:0", "--threads", "1", "--metrics-port", "0"], "serve")
try:
    ep = s.wait_line(r"ready.*clients at (\S+)", 120).group(1)
    # written before the KvPeersReady the router waited for; the reader
    # threads may lag, hence seen() (bounded)
    check(s.seen(AHEAD % r"decode-0-\d+", 10),
          "the prefill worker connected the decode worker's kv pools before any request")
    check(s.seen(r"router: prefill worker prefill-0-\d+ connected to 1 decode workers' kv pools "
                 r"ahead of traffic$", 10),
          "the router heard the prefill worker's KvPeersReady (ready waits for it)")
    check(s.count(CREATED) == 1, "one ucx endpoint before any request: %d" % s.count(CREATED))
    cl = svc.Client(ep)
    rids = {name: cl.send(svc.generate(ids, N)) for name, ids in prompts.items()}
    got = {name: svc.tokens_of(reps) for name, reps in zip(rids, cl.wait(list(rids.values()), 120))}
    for name, ids in prompts.items():
        ref = svc.reference_generate(ids, N)
        check(got[name] == ref and len(ref) == N,
              "%s: greedy output equals twain-prefill --generate (%s vs %s)" % (name, got[name], ref))
    cl.close()
    check(s.count(CREATED) == 1,
          "the handoffs reused the endpoint made ahead of traffic: %d endpoints" % s.count(CREATED))
    check(s.count(r"not connected ahead of traffic") == 0, "no pre-connect failure logged")
finally:
    s.stop()

# 2. a decode worker that joins later is connected without a request
c = svc.Cluster(1, 1)
try:
    p = c.prefills[0]
    first = c.decodes[0].worker_name
    check(p.seen(AHEAD % re.escape(first), 15), "the first decode worker connected ahead of traffic")
    d = c.add_decode()
    c.wait_registered(1, 2)
    m = p.wait_line(AHEAD % re.escape(d.worker_name), 30)
    check(m.group(1) == "1", "the joining decode worker's one pool connected without a request")
    check(metric(p.metrics_port, "kv_peers_connected_ahead_total") == 2,
          "twain_kv_peers_connected_ahead_total counts both decode workers")
    check(p.count(CREATED) == 2, "one endpoint per decode worker: %d" % p.count(CREATED))
    check(metric(p.metrics_port, "prefill_requests_total") == 0, "no request was sent so far")
    cl = c.client()
    res = cl.wait([cl.send(svc.generate(prompts["short_dog"], N))], 60)
    check(res[0][-1].error.code == 0 and svc.tokens_of(res[0]) == svc.reference_generate(prompts["short_dog"], N),
          "a request after the join is served with the reference's greedy output")
    check(p.count(CREATED) == 2, "its handoff reused a cached endpoint: %d" % p.count(CREATED))
    cl.close()
finally:
    c.close()
finish()
