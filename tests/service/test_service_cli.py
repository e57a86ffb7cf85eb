"""The twain CLI end to end: `twain serve` (ephemeral client port) prints a
line with "ready" once its workers registered; `twain chat` streams the final
answer (and the analysis with --show-analysis); `twain chat --json` prints the
messages and usage, with --date/--reasoning rendering the exact fixture prompt
(75 tokens); `twain generate` equals twain-prefill --generate; the Python
client example works; Ctrl-C (SIGINT) stops the server and every worker."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import fixtures
import svc

from svc import check, finish


twain = svc.bin_path("router", "twain")
serve = svc.Proc([twain, "serve", "--listen", "tcp://127.0.0.1:0", "--threads", "1", "--metrics-port", "0"] +
                 svc.CALM_EXPIRE, "serve")
try:
    m = serve.wait_line(r"ready.*clients at (\S+)", 90)
    ep = m.group(1)
    print("serve is ready at", ep)

    def run(*argv, timeout=120):
        return subprocess.run([twain] + list(argv), capture_output=True, text=True, timeout=timeout)

    r = run("chat", "--endpoint", ep, "What does the word 'dog' mean?")
    check(r.returncode == 0 and "dog" in r.stdout and "genus Canis" in r.stdout,
          "twain chat: %r" % r.stdout.strip()[:120])
    r = run("chat", "--endpoint", ep, "--show-analysis", "What does the word 'dog' mean?")
    check(r.returncode == 0 and "[analysis] " in r.stdout and "[final] " in r.stdout,
          "twain chat --show-analysis: %r" % r.stdout.strip()[:160])
    r = run("chat", "--endpoint", ep, "--json", "--reasoning", "low", "--date", "2025-06-01",
            "What does the word 'water' mean?")
    ok = r.returncode == 0
    if ok:
        out = json.loads(r.stdout)
        chans = [m["channel"] for m in out["messages"]]
        ok = out["usage"]["prompt_tokens"] == len(fixtures.ids("system_water")) and "final" in chans and \
            all(set(m) >= {"role", "channel", "recipient", "content"} for m in out["messages"])
    check(ok, "twain chat --json --reasoning low --date: %s" % r.stdout.strip()[:200])
    ids = fixtures.ids("short_dog")
    r = run("generate", "--endpoint", ep, "--max-tokens", "20", *[str(i) for i in ids])
    got = [int(x) for x in r.stdout.split()]
    check(r.returncode == 0 and got == svc.reference_generate(ids, 20), "twain generate equals the reference")
    # no ids as arguments: they come on stdin (a JSON array, or numbers)
    for stdin in (json.dumps(ids), " ".join(str(i) for i in ids) + "\n"):
        g = subprocess.run([twain, "generate", "--endpoint", ep, "--max-tokens", "20"], input=stdin,
                           capture_output=True, text=True, timeout=120)
        check(g.returncode == 0 and [int(x) for x in g.stdout.split()] == got,
              "twain generate with the ids on stdin (%r...): %r" % (stdin[:12], g.stdout.strip()[:80]))
    # no text: a piped stdin is the message; on a terminal, a conversation
    c = subprocess.run([twain, "chat", "--endpoint", ep], input="What does the word 'dog' mean?\n",
                       capture_output=True, text=True, timeout=120)
    check(c.returncode == 0 and "genus Canis" in c.stdout, "twain chat with the text on stdin: %r" % c.stdout[:80])
    import pty
    finished_re = r"request \d+ finished: \w+, prompt (\d+) tokens, output (\d+)"

    def n_finished():
        return len(re.findall(finished_re, "\n".join(serve.lines)))
    # the router logs a request's line after its last token went out: let
    # the lines of the requests above arrive (no new one for 0.5 s), so
    # the next two lines are the two turns below
    n_before, quiet, end = n_finished(), time.time(), time.time() + svc.scaled(10)
    while time.time() - quiet < svc.scaled(0.5) and time.time() < end:
        time.sleep(0.05)
        if n_finished() != n_before:
            n_before, quiet = n_finished(), time.time()
    master, slave = pty.openpty()
    ic = subprocess.Popen([twain, "chat", "--endpoint", ep], stdin=slave, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    os.close(slave)
    os.write(master, b"What does the word 'dog' mean?\nAnd the word 'book'?\n/exit\n")
    try:
        iout, ierr = ic.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        ic.kill()
        iout, ierr = ic.communicate()
    os.close(master)
    answers = [l for l in iout.splitlines() if l.strip()]
    check(ic.returncode == 0 and len(answers) == 2 and "genus Canis" in answers[0] and ierr.count("> ") >= 3,
          "interactive twain chat: two turns, then /exit (rc %s, %r)" % (ic.returncode, answers))
    end = time.time() + svc.scaled(10)  # both turns' lines (bounded)
    while n_finished() < n_before + 2 and time.time() < end:
        time.sleep(0.05)
    turns = [int(x) for x in re.findall(finished_re, "\n".join(serve.lines))[n_before:n_before + 2]
             for x in x]
    # alone, the second question would be about as long as the first (75 tokens)
    check(len(turns) == 4 and turns[2] > turns[0] + 40,
          "the second turn carries the first question and answer (prompt, output tokens: %s)" % turns)
    # every daemon's metrics address, printed once ready
    mline = serve.wait_line(r"twain serve: metrics: (.*)", 10)
    urls = re.findall(r"(router|prefill-0|decode-0) (http://127\.0\.0\.1:\d+/metrics)", mline.group(1) if mline else "")
    check(len(urls) == 3, "serve prints the router's and each worker's metrics address: %s" % urls)
    for who, url in urls:
        import urllib.request
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        want = "router" if who == "router" else who.split("-")[0]
        check(('process="%s' % want) in text and 'model_name="' in text, "%s serves its metrics at %s" % (who, url))
    r = run("generate", "--endpoint", ep, "--max-tokens", "0", *[str(i) for i in ids])
    check(r.returncode == 2 and "--max-tokens must be an integer in [1," in r.stderr,
          "twain generate --max-tokens 0: a usage error, not sent (%s)" % r.stderr.strip())
    # sampling: --seed gives the same ids every time (0 too); without it every
    # run draws its own seed (OpenAI's behaviour), so sampled runs differ

    def sampled(*extra):
        r = run("generate", "--endpoint", ep, "--max-tokens", "64", "--temperature", "1.5", *extra,
                *[str(i) for i in ids])
        return tuple(r.stdout.split()) if r.returncode == 0 else r.stderr.strip()[-200:]
    a, b = sampled("--seed", "0"), sampled("--seed", "0")
    check(isinstance(a, tuple) and len(a) == 64 and a == b, "--seed 0 twice: the same 64 ids (%s)" % ("yes" if a == b else (a, b),))
    runs = [sampled() for _ in range(3)]
    check(all(isinstance(x, tuple) and len(x) == 64 for x in runs) and len(set(runs)) > 1,
          "without --seed, three sampled runs are not all alike (%d distinct)" % len(set(map(str, runs))))
    ex = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "client_example.py"),
                         "--endpoint", ep, "What does the word 'book' mean?"],
                        capture_output=True, text=True, timeout=120)
    check(ex.returncode == 0 and "book" in ex.stdout and "usage: prompt" in ex.stdout,
          "python client example: %r" % ex.stdout.strip()[:160])
    # the registered lines (stderr) may reach us after the ready line (stdout)
    reg = r"registered: \w+ pool, backend \w+, pid (\d+)"
    serve.wait_count(reg, 2)
    with serve.lock:
        pids = [int(p) for p in re.findall(reg, "\n".join(serve.lines))]
    check(len(pids) == 2, "serve started 2 workers (pids %s)" % pids)
finally:
    t0 = time.time()
    rc = serve.stop(signal.SIGINT, 40)
    print("serve stopped in %.1f s" % (time.time() - t0))
check(rc == 0 and serve.count(r"twain serve: stopped") == 1, "Ctrl-C: serve exits 0 (rc %s)" % rc)
time.sleep(0.2)
alive = [p for p in pids if os.path.exists("/proc/%d" % p) and
         open("/proc/%d/stat" % p).read().split()[2] != "Z"]
check(not alive, "every worker process is gone (alive: %s)" % alive)
finish()
