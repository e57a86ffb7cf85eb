"""A decode worker with data-parallel attention (issue 6 point 2), as real
processes on 127.0.0.1: `twain-decode --dp 2 --ep 2` runs two ranks, each an
attention replica with its own sequences and its own KV pool (every kv
head), the experts split over both.

0. refused combinations: --dp 2 without --ep 2, --dp with --tp 2, and --dp on
   the cuda backend end the worker with a message that names the rule.
1. a single-rank prefill worker (per-layer checksums, chunked handoff): the
   greedy output of 4 prompts sent at once (the 298-token multiturn fixture
   and one past the 32-token sliding window included) equals
   `twain-prefill --generate` (TP 1, one process) token for token; both dp
   ranks received sequences and generated tokens (per-rank counters, which
   add up to the requests and tokens), every layer's checksum matched on the
   rank that received the KV, the bytes sent equal the bytes received.
2. steps where one rank has no sequence (it runs a padding row so the MoE's
   collectives still meet): a lone request, then a short and a long one at
   once; outputs equal TP 1.
3. a prefill worker with --tp 2: each prefill rank puts its kv head into the
   one dp rank chosen (re-sharded handoff, per-head checksums checked there);
   outputs equal TP 1.
4. no block leaked: the gauges go back to 0, in all and per rank.
5. kill -9 of dp rank 1 while it streams: the worker is out of the router's
   registry within 2 s, its streams end with an error, its other rank exits.
Every wait is bounded."""
import os
import subprocess
import time

import svc
from partest import (check, finish, router_workers, cases, greedy_at_once, kill_rank_streaming,
                     wait_gone, error_summary, stop_all)


def dp_counters(port):
    m = svc.metrics(port)
    return ([m.get("twain_decode_dp_rank%d_sequences_total" % r, -1) for r in range(2)],
            [m.get("twain_decode_dp_rank%d_tokens_total" % r, -1) for r in range(2)])


# ---- 0. refused combinations (checked before any rank starts)
decode_bin = svc.bin_path("decode", "twain-decode")
for extra, env, want in ((["--dp", "2", "--ep", "1", "--backend", "cpu"], {}, "needs --dp N --ep N --tp 1"),
                         (["--dp", "2", "--ep", "2", "--tp", "2", "--backend", "cpu"], {}, "needs --dp N --ep N --tp 1"),
                         (["--dp", "2", "--ep", "2", "--backend", "cuda"], {}, "runs on the cpu backend only"),
                         # the staged ring with dp replicas: refused, not run with kv copied late
                         (["--dp", "2", "--ep", "2", "--backend", "cpu"], {"TWAIN_KV_PATH": "staged"},
                          "with TWAIN_KV_PATH=staged")):
    r = subprocess.run([decode_bin, "--router", "tcp://127.0.0.1:9", "--model", svc.MODEL] + extra,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
    check(r.returncode != 0 and want in r.stderr,
          "twain-decode %s%s refused (exit %d): %s" % (
              "".join("%s=%s " % kv for kv in env.items()), " ".join(extra), r.returncode,
              r.stderr.strip().splitlines()[-1:] or ["(no message)"]))

N = 24
cases = cases()
refs = {name: svc.reference_generate(ids, N) for name, ids in cases.items()}
n_layers = 4

c = svc.Cluster(1, 1, decode_args=["--dp", "2", "--ep", "2", "--verify-kv"])
try:
    cl = c.client()
    dec = c.decodes[0]
    port = dec.metrics_port
    # written before it registered, but read through mpirun and our reader threads: waited for
    check(dec.wait_count(r"r1 .*rank 1 of 2 pid \d+ following rank 0", 1) == 1 and
          dec.wait_count(r"data-parallel attention over 2 ranks", 1) == 1,
          "the decode worker runs 2 ranks as data-parallel attention replicas")
    check(dec.wait_count(r"rank 1 pool: kv heads \[0,2\)", 1) == 1, "dp rank 1's pool holds every kv head")

    # ---- 1. four prompts at once through a single-rank prefill worker
    greedy_at_once(cl, cases, refs, N)
    seqs, toks = dp_counters(port)
    check(all(s >= 1 for s in seqs) and sum(seqs) == len(cases),
          "both dp ranks received sequences: %s (of %d)" % (seqs, len(cases)))
    # the first token of each comes from prefill; the decode ranks make the other N - 1
    check(all(t >= 1 for t in toks) and sum(toks) == len(cases) * (N - 1),
          "both dp ranks generated tokens: %s (%d in all)" % (toks, len(cases) * (N - 1)))
    dm = svc.metrics(port)
    pm = svc.metrics(c.prefills[0].metrics_port)
    check(dm["twain_kv_checksum_ok_total"] == n_layers * len(cases) and dm["twain_kv_checksum_mismatch_total"] == 0,
          "per-layer kv checksums on the receiving dp rank: %d layers ok, %d mismatched" % (
              dm["twain_kv_checksum_ok_total"], dm["twain_kv_checksum_mismatch_total"]))
    check(pm["twain_kv_bytes_sent_total"] == dm["twain_kv_bytes_received_total"] > 0,
          "kv bytes: %d sent, %d received" % (pm["twain_kv_bytes_sent_total"], dm["twain_kv_bytes_received_total"]))

    # ---- 2. steps with one rank empty
    seqs0, toks0 = dp_counters(port)
    lone = cl.wait([cl.send(svc.generate(cases["short_dog"], N))], 120)[0]
    check(svc.tokens_of(lone) == refs["short_dog"], "a lone request (the other rank runs padding rows) equals TP 1")
    pair = cl.wait([cl.send(svc.generate(cases["long"], 4)), cl.send(svc.generate(cases["system_water"], N))], 120)
    check(svc.tokens_of(pair[0]) == refs["long"][:4] and svc.tokens_of(pair[1]) == refs["system_water"],
          "a short and a long request at once (the short one's rank goes idle first) equal TP 1")
    seqs1, toks1 = dp_counters(port)
    check(sum(seqs1) - sum(seqs0) == 3 and sum(toks1) - sum(toks0) == (N - 1) + 3 + (N - 1),
          "dp counters: 3 more sequences %s, %d more tokens" % (seqs1, sum(toks1) - sum(toks0)))

    # ---- 3. a TP 2 prefill worker re-shards into the one dp rank chosen
    c.prefill_args = ["--tp", "2"]
    c.add_prefill()
    c.wait_registered(2, 1)
    first = c.prefills[0]
    rc_first = first.stop()
    c.procs.remove(first)
    c.prefills.remove(first)
    check(rc_first == 0, "the single-rank prefill worker stopped cleanly (rc %s)" % rc_first)
    end = svc.deadline(10)
    while time.time() < end and router_workers(c, "prefill") != 1:
        time.sleep(0.05)
    ok0 = svc.metrics(port)["twain_kv_checksum_ok_total"]
    two = {name: cases[name] for name in ("short_dog", "multiturn")}
    greedy_at_once(cl, two, refs, N)  # prefill TP 2 -> the one decode dp rank chosen
    dm = svc.metrics(port)
    check(dm["twain_kv_checksum_ok_total"] - ok0 == n_layers * len(two) and dm["twain_kv_checksum_mismatch_total"] == 0,
          "per-head kv checksums on the receiving dp rank: %d layers ok, %d mismatched" % (
              dm["twain_kv_checksum_ok_total"] - ok0, dm["twain_kv_checksum_mismatch_total"]))

    # ---- 4. nothing leaked
    used = svc.wait_metric(port, "twain_kv_blocks_used", 0)
    per_rank = [svc.wait_metric(port, "twain_decode_dp_rank%d_kv_blocks_used" % r, 0) for r in range(2)]
    check(used == 0 and per_rank == [0, 0], "every decode block freed: %s in all, %s per rank" % (used, per_rank))
    dm = svc.metrics(port)
    check(dm["twain_kv_blocks_free"] == dm["twain_kv_blocks_free"] // 2 * 2 > 0,
          "free blocks are the sum over the 2 equal dp pools (%d)" % dm["twain_kv_blocks_free"])

    # ---- 5. kill -9 of dp rank 1 mid-stream
    res, _ = kill_rank_streaming(c, cl, dec, cases["short_dog"], 4, "decode", 0, "dp rank 1")
    # a stream may finish its 300 tokens between its third token and the
    # kill (the tiny model decodes fast); every other one must end with an
    # error, none may end short without one
    n_err = sum(1 for r in res if r[-1].error.code)
    n_ok = sum(1 for r in res if not r[-1].error.code and len(svc.tokens_of(r)) == 300)
    check(n_err > 0 and n_err + n_ok == len(res),
          "its streams: %d ended with an error (%s), %d had completed before the kill, of %d" % (
              n_err, error_summary(res), n_ok, len(res)))
    wait_gone(c, dec, c.decodes)
    cl.close()
finally:
    stop_all(c, "every remaining daemon stopped cleanly on SIGTERM")
finish()
