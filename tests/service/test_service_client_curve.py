"""CURVE on the router's client socket (issue 19, deliverable 2): a router run
with --client-keys serves only CURVE clients that hold its public key; the
twain clients (generate, chat, bench) connect with --server-key or
TWAIN_SERVER_KEY. A client without CURVE, or with a wrong server key, gets no
service and a clear error within a bounded wait, the router logs it and keeps
serving. With --client-allow only the listed client keys are admitted; an
unknown key is refused and logged with its key. Without --client-keys the
socket stays plaintext and the router says so."""
import json
import os
import re
import subprocess
import tempfile
import time

import sys

import fixtures
import svc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto", "python"))
import twain_client  # noqa: E402

from svc import check, finish

zmq = svc.zmq
TWAIN = svc.bin_path("router", "twain")
ROUTER = svc.bin_path("router", "twain-router")
tmp = tempfile.mkdtemp(prefix="tw_ccurve_")


def keygen(name):
    """A fresh `twain keygen` file: (path, {name: key})."""
    path = os.path.join(tmp, name)
    r = subprocess.run([TWAIN, "keygen", path], capture_output=True, text=True, timeout=svc.scaled(30))
    assert r.returncode == 0, r.stderr
    return path, svc.read_keys(path)


def client(ep, *args, env=None, timeout=svc.scaled(120)):
    """Run a twain client command against ep: (CompletedProcess, seconds)."""
    t0 = time.time()
    e = {k: v for k, v in os.environ.items() if k not in ("TWAIN_SERVER_KEY", "TWAIN_IDENTITY_FILE")}
    e.update(env or {})
    r = subprocess.run([TWAIN, args[0], "--endpoint", ep] + list(args[1:]), capture_output=True, text=True,
                       timeout=timeout, env=e)
    return r, time.time() - t0


def ids_of(r):
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else None


prompt = fixtures.ids("short_dog")
want = svc.reference_generate(prompt, 8)
gen = ["generate", "--max-tokens", "8"] + [str(i) for i in prompt]
sk_path, sk = keygen("client-socket.keys")  # the router's client-socket key set
spub = sk["server-public"]
# the server public key alone, in a file anyone may read (it is not a secret)
pub_path = os.path.join(tmp, "router.pub")
with open(pub_path, "w") as f:
    f.write("# the router's client socket\nserver-public = %s\n" % spub)
os.chmod(pub_path, 0o644)

# ---- CURVE, no allow-list: any client key, but only with the server's public key
c = svc.Cluster(1, 1, router_args=["--client-keys", sk_path])
try:
    ep = c.client_ep
    check(c.router.seen(r"router client socket: CURVE; admitted: any client key", 10) and
          c.router.seen(r"listening: clients \S+ \(CURVE\)", 10),
          "the router says its client socket is CURVE with no allow-list")
    r, _ = client(ep, *gen, "--server-key", spub)
    check(ids_of(r) == want, "generate --server-key KEY: the reference tokens (%s)" % (ids_of(r) or r.stderr[-160:]))
    r, _ = client(ep, *gen, env={"TWAIN_SERVER_KEY": pub_path})
    check(ids_of(r) == want, "TWAIN_SERVER_KEY=FILE (a public key file, mode 644): answered (%s)" %
          (ids_of(r) or r.stderr[-160:]))
    r, _ = client(ep, "chat", "--server-key", spub, "What does the word 'dog' mean?")
    check(r.returncode == 0 and "genus Canis" in r.stdout, "chat --server-key: %r" % (r.stdout or r.stderr)[-160:])
    b, _ = client(ep, "bench", "--server-key", spub, "--model", svc.MODEL, "--num-requests", "3",
                  "--input-len", "8", "--output-len", "4", "--quiet", "--json", os.path.join(tmp, "b.json"))
    bj = {}
    if b.returncode == 0:
        with open(os.path.join(tmp, "b.json")) as f:
            bj = json.load(f)
    check(b.returncode == 0 and bj.get("completed") == 3,
          "bench --server-key: 3 of 3 requests completed (%s)" % (bj.get("completed") if bj else b.stderr[-160:]))

    # no CURVE: refused in the handshake, a clear error long before the connect timeout
    r, took = client(ep, *gen, "--connect-timeout-ms", "20000")
    check(r.returncode == 1 and "requires CURVE" in r.stderr and "--server-key" in r.stderr and took < svc.scaled(10),
          "generate without a server key: exit %d in %.1f s: %s" % (r.returncode, took, r.stderr.strip()[-200:]))
    r, took = client(ep, *gen, "--json", "--connect-timeout-ms", "20000")
    err = json.loads(r.stdout).get("error", {}) if r.returncode == 1 and r.stdout.strip() else {}
    check(err.get("code") == "UNAUTHENTICATED", "generate --json without a server key: code %s" % err.get("code"))
    # a wrong server key (another set's): the router cannot open its hello
    _, other = keygen("other.keys")
    r, took = client(ep, *gen, "--server-key", other["server-public"], "--connect-timeout-ms", "20000")
    check(r.returncode == 1 and "CURVE handshake with the router" in r.stderr and took < svc.scaled(10),
          "generate with a wrong server key: exit %d in %.1f s: %s" % (r.returncode, took, r.stderr.strip()[-200:]))
    b, took = client(ep, "bench", "--model", svc.MODEL, "--num-requests", "2", "--connect-timeout-ms", "20000")
    check(b.returncode == 1 and "requires CURVE" in b.stderr and took < svc.scaled(10),
          "bench without a server key: exit %d in %.1f s" % (b.returncode, took))
    r, _ = client(ep, *gen, "--server-key", "not-a-key")
    check(r.returncode == 1 and "neither 40 Z85 characters nor an existing key file" in r.stderr,
          "a malformed --server-key: %s" % r.stderr.strip()[-160:])
    # a raw plaintext client: its request is never read, nothing comes back
    raw = svc.Client(ep)
    # the router refuses the handshake and the connection is dropped: a send
    # with no peer left would wait for one forever (a CI run timed out here)
    raw.s.setsockopt(svc.zmq.SNDTIMEO, 1000)
    try:
        rid = raw.send(svc.generate(prompt, 4))
    except svc.zmq.Again:
        rid = None  # never even queued: nothing can come back either
    end = time.time() + 1.5
    while time.time() < end:
        raw.pump(0.05)
    check(not raw.replies.get(rid), "a plaintext protobuf client gets no reply (%d)" % len(raw.replies.get(rid, [])))
    raw.close()
    check(c.router.seen(r"WARN.*router client socket: client socket: handshake with \S+ failed", 10),
          "the router logs the failed handshakes of the clients without the right key")
    # the router kept serving, also to a protobuf client with CURVE
    ident = {"server-public": spub, "client-public": other["client-public"], "client-secret": other["client-secret"]}
    good = svc.Client(ep, curve=ident)
    res = good.wait([good.send(svc.generate(prompt, 8)) for _ in range(3)], 60)
    check(all(svc.tokens_of(x) == want and x[-1].error.code == 0 for x in res),
          "after the refusals: 3 requests of a CURVE protobuf client answered with the reference tokens")
    good.close()
    # the Python client module: the server key as an argument or from the environment
    tc = twain_client.Client(ep, timeout_s=60, server_key=spub)
    text = "".join(tc.chat("What does the word 'dog' mean?", max_tokens=512))
    tc.close()
    check("genus Canis" in text, "twain_client.Client(server_key=KEY).chat: %r" % text[:80])
    os.environ["TWAIN_SERVER_KEY"] = pub_path
    tc = twain_client.Client(ep, timeout_s=60)
    del os.environ["TWAIN_SERVER_KEY"]
    check(tc.generate(prompt, max_tokens=8) == want, "twain_client.Client with TWAIN_SERVER_KEY=FILE: generate")
    # a list-valued sampling field goes into its repeated field (a TypeError before)
    cut = want.index(want[3]) + 1
    got = tc.generate(prompt, max_tokens=8, stop_token_ids=[want[3]])
    check(got == want[:cut], "twain_client generate(stop_token_ids=[%d]): %s, want %s" % (want[3], got, want[:cut]))
    tc.close()
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)

# ---- an allow-list: only the listed client keys
ok_path, ok = keygen("alice.keys")
bad_path, bad = keygen("mallory.keys")
allow = os.path.join(tmp, "clients.allow")
with open(allow, "w") as f:
    f.write("# clients admitted\n%s alice\nclient-public = %s\n" % (ok["client-public"], other["client-public"]))
c = svc.Cluster(1, 1, router_args=["--client-keys", sk_path, "--client-allow", allow])
try:
    ep = c.client_ep
    check(c.router.seen(r"admitted: the 2 client keys of ", 10), "the router read 2 keys from the allow-list")
    r, _ = client(ep, *gen, "--server-key", spub, "--identity", ok_path)
    check(ids_of(r) == want, "a listed client key (--identity): answered (%s)" % (ids_of(r) or r.stderr[-160:]))
    r, took = client(ep, *gen, "--connect-timeout-ms", "20000",
                     env={"TWAIN_SERVER_KEY": spub, "TWAIN_IDENTITY_FILE": bad_path})
    check(r.returncode == 1 and "refused this client's key" in r.stderr and took < svc.scaled(10),
          "an unlisted client key: exit %d in %.1f s: %s" % (r.returncode, took, r.stderr.strip()[-200:]))
    check(c.router.seen(r"WARN.*refused a client from 127\.0\.0\.1\S*: its key %s is not on the allow-list"
                        % re.escape(bad["client-public"]), 10),
          "the router logs the refused client with its key")
    r, _ = client(ep, *gen, "--server-key", spub, "--connect-timeout-ms", "20000")
    check(r.returncode == 1 and "refused this client's key" in r.stderr,
          "a client with a fresh (unlisted) key pair is refused too")
    ident = {"server-public": spub, "client-public": other["client-public"], "client-secret": other["client-secret"]}
    good = svc.Client(ep, curve=ident)
    res = good.wait([good.send(svc.generate(prompt, 8))], 60)
    check(svc.tokens_of(res[0]) == want, "the second listed key (client-public = KEY line) is admitted")
    good.close()
finally:
    rcs = c.close()
check(not any(rcs.values()), "router and workers stop cleanly: %s" % rcs)

# ---- start-up: plaintext is logged; an allow-list without keys, a bad list are refused at once
base = [ROUTER, "--model", svc.MODEL, "--listen", "tcp://127.0.0.1:0", "--workers", "tcp://127.0.0.1:0",
        "--metrics-port", "-1"]
env = {k: v for k, v in os.environ.items() if not k.startswith("TWAIN_CLIENT_")}
p = svc.Proc(base, "router-plain-clients", env=env)
check(p.seen(r"WARN.*router client socket: plaintext", 15) and p.seen(r"listening: clients \S+ \(plaintext\)", 15),
      "without --client-keys the client socket is plaintext, and the router says so")
plain_ep = p.wait_line(r"listening clients=(\S+)", 15).group(1)
r, took = client(plain_ep, *gen, "--server-key", spub, "--connect-timeout-ms", "20000")
check(r.returncode == 1 and "does not use CURVE" in r.stderr and took < svc.scaled(10),
      "a CURVE client of a plaintext client socket: exit %d in %.1f s: %s" % (r.returncode, took, r.stderr.strip()))
check(p.stop() == 0, "that router stops cleanly")


def router_fails(args, extra_env, pattern, what):
    t0 = time.time()
    r = subprocess.run(base + args, env=dict(env, **extra_env), capture_output=True, text=True, timeout=svc.scaled(30))
    took = time.time() - t0
    check(r.returncode != 0 and pattern in r.stderr + r.stdout and took < svc.scaled(10),
          "%s: exit %d in %.1f s: %s" % (what, r.returncode, took,
                                          (r.stderr.strip().splitlines() or ["(nothing)"])[-1]))


router_fails(["--client-allow", allow], {}, "needs CURVE on the socket", "an allow-list without --client-keys")
junk = os.path.join(tmp, "junk.allow")
with open(junk, "w") as f:
    f.write("%s\nnot a key\n" % ok["client-public"])
router_fails(["--client-keys", sk_path], {"TWAIN_CLIENT_ALLOW_FILE": junk}, "line 2 is not a client public key",
             "a malformed allow-list (TWAIN_CLIENT_ALLOW_FILE)")
os.chmod(sk_path, 0o644)
router_fails(["--client-keys", sk_path], {}, "chmod 600", "a client key set others can read")
finish()
