"""What an operator sees, checked under load (8 concurrent streams, one bad
request, one chat):
- metrics: every metric of the table in docs/operations.md ("Metrics") is
  served by the daemon the table names, with its type, the model_name label
  and the documented labels, and the request counters add up exactly (prompt
  and generation tokens, finished by reason, errors by code, one TTFT / E2E /
  queue-time sample per request);
- one INFO line per finished request on the router (id, finish reason,
  prompt and output tokens, TTFT, TPOT), none with --disable-log-requests;
- the workers' periodic stats lines while busy (--log-stats-interval 1):
  decode "running, waiting, KV cache %, generation tok/s", prefill "waiting,
  prompt tok/s";
- loading progress: each worker logs the bytes of weights read and the rate.
Every wait is bounded."""
import os
import re
import time
import urllib.request

import fixtures
import svc
from svc import check, finish

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")
MODEL_NAME = os.path.basename(os.path.normpath(svc.MODEL))


def documented():
    """(name, type, daemons, labels) rows of the docs' metrics table."""
    rows, inside = [], False
    with open(DOC) as f:
        for line in f:
            if line.startswith("### Metrics"):
                inside = True
            elif inside and line.startswith("#"):
                break
            m = re.match(r"^\| `(twain_[a-z0-9_]+)` \| (counter|gauge|histogram) \| ([a-z, ]+) \| ([^|]*) \|", line)
            if inside and m:
                labels = re.findall(r"`([a-z_]+)`", m.group(4))
                rows.append((m.group(1), m.group(2), [d.strip() for d in m.group(3).split(",")], labels))
    return rows


def scrape(port):
    """{name: (type, [(labels dict, value)])} from one /metrics page."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    out, types = {}, {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-z0-9_]+)\{(.*)\} (\S+)$", line)
        if not m:
            continue
        name, labels = m.group(1), dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(2)))
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        out.setdefault(base, (types.get(base), []))[1].append((name, labels, float(m.group(3))))
    return out


def value(page, name, series=None, **labels):
    for s, lab, v in page.get(name, (None, []))[1]:
        if (series is None or s == series) and all(lab.get(k) == w for k, w in labels.items()):
            return v
    return None


rows = documented()
check(len(rows) >= 12, "docs/operations.md documents %d metrics" % len(rows))

N, OUT = 8, 160
prompt = fixtures.ids("short_dog")
c = svc.Cluster(1, 1, decode_args=["--log-stats-interval", "1"], prefill_args=["--log-stats-interval", "1"])
try:
    cl = c.client()
    for i in range(N):
        cl.send(svc.generate(prompt, OUT, request_id=100 + i))
    cl.send(svc.generate(prompt, 10 ** 8, request_id=99))  # over --max-tokens-limit: INVALID_ARGUMENT
    cl.wait([100 + i for i in range(N)] + [99], timeout=180)
    time.sleep(1.5)  # a stats interval after the last step
    pages = {"router": scrape(c.router_metrics_port), "decode": scrape(c.decodes[0].metrics_port),
             "prefill": scrape(c.prefills[0].metrics_port)}
    for name, typ, daemons, labels in rows:
        for d in daemons:
            got = pages[d].get(name)
            ok = got is not None and got[0] == typ and \
                all(lab.get("model_name") == MODEL_NAME and all(k in lab for k in labels if k != "le")
                    for _, lab, _ in got[1])
            check(ok, "%s: %s %s with model_name=%s and labels %s" % (d, name, typ, MODEL_NAME, labels))
    R = pages["router"]
    check(value(R, "twain_prompt_tokens_total") == N * len(prompt),
          "prompt tokens: %s == %d" % (value(R, "twain_prompt_tokens_total"), N * len(prompt)))
    check(value(R, "twain_generation_tokens_total") == N * OUT,
          "generation tokens: %s == %d" % (value(R, "twain_generation_tokens_total"), N * OUT))
    check(value(R, "twain_request_success_total", finished_reason="length") == N and
          value(R, "twain_request_success_total", finished_reason="stop") == 0,
          "finished by reason: length %s, stop %s" % (value(R, "twain_request_success_total", finished_reason="length"),
                                                      value(R, "twain_request_success_total", finished_reason="stop")))
    check(value(R, "twain_request_errors_total", code="INVALID_ARGUMENT") == 1 and
          value(R, "twain_request_errors_total", code="INTERNAL") == 0, "errors by code: one INVALID_ARGUMENT")
    for h in ("twain_time_to_first_token_seconds", "twain_e2e_request_latency_seconds",
              "twain_request_queue_time_seconds", "twain_time_per_output_token_seconds"):
        check(value(R, h, series=h + "_count") == N, "%s: %d samples (%s)" % (h, N, value(R, h, series=h + "_count")))
    kv = value(pages["decode"], "twain_kv_cache_usage_perc")
    check(kv is not None and 0 <= kv <= 1, "kv_cache_usage_perc in [0, 1]: %s" % kv)

    # one line per finished request, with its figures
    reqs = [l for l in c.router.lines if "finished: " in l]
    pat = re.compile(r"INFO .*router: request \d+ finished: length, prompt %d tokens, output %d tokens, "
                     r"ttft [0-9.]+ ms, tpot [0-9.]+ ms, e2e [0-9.]+ ms, queue [0-9.]+ ms" % (len(prompt), OUT))
    check(sum(1 for l in reqs if pat.search(l)) == N, "%d request lines like %r" % (N, reqs[:1]))
    dec = [l for l in c.decodes[0].lines if "stats: " in l]
    check(any(re.search(r"INFO .*decode: stats: running \d+ seqs, waiting \d+, KV cache [0-9.]+% \(\d+ of \d+ blocks\), "
                        r"generation [0-9.]+ tok/s", l) and not re.search(r"generation 0\.0 tok/s", l) for l in dec),
          "decode stats lines while busy: %r" % dec[:2])
    pre = [l for l in c.prefills[0].lines if "stats: " in l]
    check(any(re.search(r"INFO .*prefill: stats: waiting \d+ prompts \(\d+ tokens\), prompt [0-9.]+ tok/s", l) for l in pre),
          "prefill stats line: %r" % pre[:1])
    n_idle = len(dec)
    time.sleep(2.5)
    check(len([l for l in c.decodes[0].lines if "stats: " in l]) == n_idle, "no stats lines while idle")
    for w in (c.prefills[0], c.decodes[0]):
        check(any(re.search(r"read [0-9.]+ GB of weights from 1 file\(s\) in [0-9.]+ s \([0-9.]+ GB/s\)", l)
                  for l in w.lines), "%s logs the weights read and the rate" % w.name)
finally:
    c.close()

c = svc.Cluster(1, 1, router_args=["--disable-log-requests"])
try:
    cl = c.client()
    cl.send(svc.generate(prompt, 4, request_id=7))
    cl.wait([7], timeout=60)
    time.sleep(0.3)
    check(not any("finished: " in l for l in c.router.lines), "--disable-log-requests: no request line")
finally:
    c.close()
finish()
