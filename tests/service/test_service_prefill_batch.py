"""Batched prefill through the service: the prefill worker takes the prompts
queued behind a long one as one variable-length engine prefill (passes of at
most --chunk-tokens 256 tokens, the long prompt alone over several passes),
and every prompt's greedy output still equals `twain-prefill --generate` of
that prompt alone in one process, token for token. The decode worker checks
every layer's KV against the checksum the prefill worker sent (--verify-kv),
all blocks are freed afterwards, and the prefill worker's metrics show fewer
engine batches than prompts (the prompts did share passes) and at least one
batch whose handoff finished while the next batch computed. The prefill
worker runs its warm-up first (--warmup 1; on by default only for GPU
workers): its throwaway passes of 16 and 200 tokens (1,024 is past this
test's budget of 256) must leave nothing behind that changes an output."""
import sys

import fixtures
import svc

N = 8
base = [fixtures.ids("short_dog"), fixtures.ids("short_book"), fixtures.ids("system_water"),
        fixtures.long_prompt(), fixtures.ids("multiturn")]
long_ids = []
while len(long_ids) < 1500:  # alone: ~6 passes of 256, so the others queue behind it
    long_ids += fixtures.long_prompt()
prompts = [long_ids[:1500]]
for k in range(12):  # 12 prompts of different lengths, some past the 32-token window
    b = base[k % len(base)]
    prompts.append(b[:max(3, len(b) - 5 * (k // len(base)))])

fails = 0
c = svc.Cluster(1, 1, decode_args=["--verify-kv", "--max-batch", "16"],
                prefill_args=["--chunk-tokens", "256", "--batch-seqs", "8", "--warmup", "1"])
try:
    m = c.prefills[0].wait_line(r"warm-up: prefill calls of (.*) tokens \((\d+) in all\)", 5)
    print("prefill warm-up: calls of %s tokens, %s in all" % (m.group(1), m.group(2)))
    if (m.group(1), m.group(2)) != ("16, 200", "216"):
        print("FAIL: the warm-up should run calls of 16 and 200 tokens under a budget of 256")
        fails += 1
    cl = c.client()
    rids = [cl.send(svc.generate(ids, N)) for ids in prompts]
    got = [svc.tokens_of(reps) for reps in cl.wait(rids, 180)]
    for k, ids in enumerate(prompts):
        ref = svc.reference_generate(ids, N)
        ok = got[k] == ref and len(ref) == N
        print("prompt %2d (%4d tokens): %s" % (k, len(ids), "identical" if ok else "DIFFERENT"))
        if not ok:
            print("  service:  ", got[k])
            print("  reference:", ref)
            fails += 1
    svc.wait_metric(c.decodes[0].metrics_port, "twain_kv_blocks_used", 0)
    m = svc.metrics(c.decodes[0].metrics_port)
    pm = svc.metrics(c.prefills[0].metrics_port)
    n_req, n_layers = len(prompts), 4
    print("decode: checksum ok %d mismatch %d, blocks used %d; prefill: %d requests in %d batches" % (
        m["twain_kv_checksum_ok_total"], m["twain_kv_checksum_mismatch_total"],
        m["twain_kv_blocks_used"], pm["twain_prefill_requests_total"], pm["twain_prefill_batches_total"]))
    if m["twain_kv_checksum_ok_total"] != n_layers * n_req or m["twain_kv_checksum_mismatch_total"] != 0:
        print("FAIL: every layer of every handoff must match its checksum")
        fails += 1
    if m["twain_kv_blocks_used"] != 0:
        print("FAIL: blocks still in use after every request finished")
        fails += 1
    if pm["twain_prefill_requests_total"] != n_req:
        print("FAIL: the prefill worker did not hand off every prompt")
        fails += 1
    if not 1 <= pm["twain_prefill_batches_total"] < n_req:
        print("FAIL: the queued prompts were not prefilled together")
        fails += 1
    # the long prompt's batch had prompts queued behind it: its flush and
    # answers ran during the next batch's compute
    print("prefill: %d batch handoffs finished while the next batch computed" %
          pm["twain_prefill_batch_handoffs_overlapped_total"])
    if pm["twain_prefill_batch_handoffs_overlapped_total"] < 1:
        print("FAIL: no batch's handoff overlapped the next batch's compute")
        fails += 1
    if c.prefills[0].count(r"warm-up.*(not freed|failed)"):
        print("FAIL: the warm-up failed or kept blocks")
        fails += 1
    cl.close()
finally:
    rcs = c.close()
print("exit codes:", rcs)
if any(rcs.values()):
    print("FAIL: a daemon did not stop cleanly")
    fails += 1
print("PASS" if not fails else "FAIL (%d)" % fails)
sys.exit(1 if fails else 0)
