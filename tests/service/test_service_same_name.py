"""A worker restarted under its name before the router expired the one
before (a container restart keeps --name $(POD_NAME)): the router takes the
new process for a new one (its Register carries another instance), retries
what the old one held, and the stream that ran on it goes on from its tokens
(resumed) instead of hanging until its deadline. The expiry is set to 10 s
so that the restart lands well inside it on any machine. A second worker
under a name the router already hears is not heard at all (ZeroMQ refuses a
routing id in use): it says so within a few seconds instead of waiting
silently. A name that is not a plain routing id is refused at start."""
import os
import signal
import subprocess
import time

import fixtures
import svc

from svc import check, finish

# a name that is not a plain routing id is refused at start ("NAME/hb" is the
# heartbeat socket's id; a quote or newline would break the metrics labels)
for bad in ("dZ/hb", 'q"x', "a b", "x" * 49):
    r = subprocess.run([svc.bin_path("decode", "twain-decode"), "--router", "tcp://127.0.0.1:1", "--name", bad,
                        "--backend", "cpu"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 2 and "--name must be 1 to 48 letters" in r.stderr,
          "--name %r: exit 2 naming the rule (rc %d, %r)" % (bad[:12], r.returncode, r.stderr.strip()[-120:]))

prompt = fixtures.ids("short_dog")
N = 300
ref = svc.reference_generate(prompt, N)
c = svc.Cluster(1, 0, router_args=["--expire-ms", "10000"])
try:
    def decode(name):
        p = svc.Proc([svc.bin_path("decode", "twain-decode"), "--router", c.worker_ep, "--model", svc.MODEL,
                      "--name", name, "--backend", "cpu", "--threads", "1", "--metrics-port", "0"], name)
        c.procs.append(p)
        return p
    d1 = decode("dsame")
    c.wait_registered(1, 1)
    cl = c.client()
    rid = cl.send(svc.generate(prompt, N))
    svc.wait_tokens(cl, rid, 20)
    os.kill(d1.p.pid, signal.SIGKILL)
    d1.p.wait(10)
    d2 = decode("dsame")  # at once: the router still holds the first one (10 s expiry)
    check(c.router.seen(r"worker dsame registered again as a new process \(pid %d\)" % d2.p.pid, 30),
          "the router takes the restarted worker for a new process")
    t0 = time.time()
    reps = cl.wait([rid], 60)[0]
    got = svc.tokens_of(reps)
    check(got == ref and cl.done(rid) and time.time() - t0 < svc.scaled(30),
          "the stream that ran on the first process resumes on the second: %d of %d tokens, the "
          "reference (%s) in %.1f s" % (len(got), N, "yes" if got == ref else "no", time.time() - t0))
    check(svc.metrics(c.router_metrics_port).get("twain_router_workers_expired_total", 0) == 1,
          "the first process counted as lost once")
    # a second live worker under the same name: never heard, says so
    d3 = decode("dsame")
    check(d3.seen(r"has not answered dsame's registration for \d+ s: .*give each its own --name", 30),
          "a duplicate name is said, not waited on silently")
    r2 = cl.wait([cl.send(svc.generate(prompt, 8))], 60)[0]
    check(svc.tokens_of(r2) == ref[:8], "the registered worker keeps serving")
    cl.close()
finally:
    c.close()
finish()
