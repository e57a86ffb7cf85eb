"""Thousands of idle connections (issue 19 item 5): about 1,100 idle TCP
connections to a router used to exhaust its 1,024 descriptors and its
select()-based servers, so /healthz and /livez failed while they were held.
Here a real router (with the HTTP API) and its workers get 2,000 idle
connections to the ZeroMQ client port, 500 to the metrics port and 500 to
the HTTP API port, all held at once: /healthz, /livez and the HTTP API still
answer, a protobuf request is served with the reference tokens, and once the
connections are closed everything still answers."""
import json
import resource
import socket
import time
import urllib.request

import fixtures
import svc

from svc import check, finish

N_CLIENT, N_METRICS, N_HTTP = 2000, 500, 500
need = N_CLIENT + N_METRICS + N_HTTP + 256
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < need:
    svc.skip_part("the hard descriptor limit %d is below the %d this test holds" % (hard, need))
    finish()
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need) if hard == resource.RLIM_INFINITY else
                                            max(soft, min(hard, 2 * need)), hard))


def hold(port, n):
    """n idle TCP connections to 127.0.0.1:port (never a byte sent)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def get(port, path, timeout=svc.scaled(10)):
    """(status, body) of GET http://127.0.0.1:port/path."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


prompt = fixtures.ids("short_dog")
want = svc.reference_generate(prompt, 8)
c = svc.Cluster(1, 1, router_args=["--http-port", "0"])
try:
    http_port = int(c.router.wait_line(r"serving the OpenAI API on http://127\.0\.0\.1:(\d+)/v1", 15).group(1))
    mport = c.router_metrics_port
    client_port = int(c.client_ep.rsplit(":", 1)[1])
    held = []
    try:
        held += hold(client_port, N_CLIENT)
        held += hold(mport, N_METRICS)
        held += hold(http_port, N_HTTP)
        check(len(held) == N_CLIENT + N_METRICS + N_HTTP,
              "%d idle connections held (client port %d, metrics %d, HTTP %d)" % (len(held), N_CLIENT, N_METRICS,
                                                                                  N_HTTP))
        time.sleep(0.5)  # the servers have accepted them
        st, body = get(mport, "/healthz")
        check(st == 200 and body.strip() == "ok", "/healthz answers while they are held: %s %r" % (st, body[:60]))
        st, body = get(mport, "/livez")
        check(st == 200, "/livez answers while they are held: %s %r" % (st, body[:60]))
        st, body = get(http_port, "/v1/models")
        check(st == 200 and json.loads(body)["data"], "the HTTP API answers while they are held: %s" % st)
        cl = c.client()
        res = cl.wait([cl.send(svc.generate(prompt, 8))], 60)
        check(svc.tokens_of(res[0]) == want and res[0][-1].error.code == 0,
              "a protobuf request is served while they are held: %s" % svc.tokens_of(res[0]))
        cl.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    st, _ = get(mport, "/healthz")
    cl = c.client()
    res = cl.wait([cl.send(svc.generate(prompt, 8))], 60)
    cl.close()
    check(st == 200 and svc.tokens_of(res[0]) == want, "after they closed: /healthz %s, a request served" % st)
    check(not c.router.seen(r"Too many open files|EMFILE", 1), "the router never ran out of descriptors")
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)
finish()
