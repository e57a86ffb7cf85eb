"""UCX bound to the router link's interface (issue 19 item 3): a worker's UCX
TCP transport listens only on the interface its router link uses, here
loopback (before, it listened on every interface, unauthenticated), says so
in its log, and the KV handoff still works; an operator's UCX_NET_DEVICES
is used as given and logged as such. Every listening TCP socket of a worker
process (UCX's, the metrics server's) is read from /proc."""
import os
import socket

import fixtures
import svc

from svc import check, finish


def listening(pid):
    """(address, port) of every TCP socket process pid listens on."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for fam, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            next(f)
            for line in f:
                p = line.split()
                if p[3] != "0A" or p[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = p[1].split(":")
                raw = bytes.fromhex(hexaddr)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((socket.inet_ntop(fam, raw), int(hexport, 16)))
    return out


def interfaces():
    """Local IPv4 addresses other than loopback (the premise: there is one to not listen on)."""
    with open("/proc/net/fib_trie") as f:
        text = f.read()
    addrs = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "/32 host LOCAL" in line and i:
            a = lines[i - 1].split()[-1]
            if not a.startswith("127."):
                addrs.add(a)
    return sorted(addrs)


prompt = fixtures.ids("short_dog")
c = svc.Cluster(1, 1)
try:
    others = interfaces()
    print("non-loopback addresses of this host: %s" % others)
    for w in c.prefills + c.decodes:
        ls = listening(w.p.pid)
        check(ls and all(a == "127.0.0.1" for a, _ in ls),
              "%s listens only on 127.0.0.1 (UCX and metrics): %s" % (w.worker_name, ls))
        check(w.count(r"kvx: UCX network devices lo: the interface of the router link tcp://127\.0\.0\.1:") == 1,
              "%s logs UCX bound to lo, the router link's interface" % w.worker_name)
    cl = c.client()
    res = cl.wait([cl.send(svc.generate(prompt, 8))], 60)
    check(res[0][-1].error.code == 0 and len(svc.tokens_of(res[0])) == 8,
          "a request is served through the bound UCX (KV handoff over loopback)")
    # the operator's choice: used as given, and said so
    os.environ["UCX_NET_DEVICES"] = "lo"
    try:
        d = c.add_decode()
    finally:
        del os.environ["UCX_NET_DEVICES"]
    c.wait_registered(1, 2)
    check(d.count(r"kvx: UCX network devices lo \(UCX_NET_DEVICES\)") == 1,
          "UCX_NET_DEVICES=lo from the operator is used and logged")
    ls = listening(d.p.pid)
    check(ls and all(a == "127.0.0.1" for a, _ in ls), "... and it listens only on 127.0.0.1: %s" % ls)
    rids = [cl.send(svc.generate(prompt, 8)) for _ in range(4)]
    res = cl.wait(rids, 60)
    check(all(r[-1].error.code == 0 for r in res), "requests served with two decode workers")
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)
finish()
