"""Greedy output through router -> prefill (chunked, overlapped with the
handoff) -> UCX KV handoff -> decode equals
`twain-prefill --generate` in one process, token for token, for several
prompts (one over several blocks and past the 32-token sliding window); and
the KV bytes the decode worker received equal what the prefill worker
computed, checked by per-layer checksums (--verify-kv), with every block
freed afterwards."""
import json
import os
import sys

import fixtures
import svc

N = 40
cases = {
    "short_dog": fixtures.ids("short_dog"),
    "short_book": fixtures.ids("short_book"),
    "system_water": fixtures.ids("system_water"),
    "long": fixtures.long_prompt(),
    "multiturn": fixtures.ids("multiturn"),
}
assert len(cases["long"]) > 96 and len(cases["system_water"]) > 32

# 32-token prefill chunks: the KV of each chunk is handed off while the next
# one computes; the output must still equal the single-chunk reference
# (--batch-seqs 1: one prompt per pass, so the put batches counted below follow
# each prompt's own chunks; batched prompts: test_service_prefill_batch.py)
# --max-batch 3 with 9 requests in flight: sequences wait for a batch slot and
# take turns, and the output must not depend on the batch composition
c = svc.Cluster(1, 1, decode_args=["--verify-kv", "--max-batch", "3"], prefill_args=["--chunk-tokens", "32", "--batch-seqs", "1"])
try:
    cl = c.client()
    rids = {name: cl.send(svc.generate(ids, N)) for name, ids in cases.items()}
    stop_rid = cl.send(svc.generate(cases["short_dog"], 200, stop_ids=fixtures.STOPS))
    nonstream_rid = cl.send(svc.generate(cases["system_water"], N, stream=False))
    sampled = []
    for _ in range(2):  # same seed, same tokens: the draw depends on (seed, position) only
        g = svc.generate(cases["short_book"], N)
        g.generate.sampling.temperature = 0.9
        g.generate.sampling.seed = 7
        sampled.append(cl.send(g))
    got = {name: svc.tokens_of(reps) for name, reps in zip(rids, cl.wait(list(rids.values()), 180))}
    stop_reps = cl.wait([stop_rid], 60)[0]
    nonstream = cl.wait([nonstream_rid], 60)[0]
    fails = 0
    s1, s2 = [svc.tokens_of(r) for r in cl.wait(sampled, 60)]
    print("sampled (T=0.9, seed 7) twice: %s" % ("identical" if s1 == s2 and len(s1) == N else "DIFFERENT"))
    if s1 != s2 or len(s1) != N:
        fails += 1
    for name, ids in cases.items():
        ref = svc.reference_generate(ids, N)
        ok = got[name] == ref and len(ref) == N
        print("%-13s prompt %3d tokens: %s" % (name, len(ids), "identical" if ok else "DIFFERENT"))
        if not ok:
            print("  service:  ", got[name])
            print("  reference:", ref)
            fails += 1
    ref = svc.reference_generate(cases["short_dog"], 200, stop_ids=fixtures.STOPS)
    stop_got = svc.tokens_of(stop_reps)
    print("stop ids: %d tokens, last %d, finish %d" % (len(stop_got), stop_got[-1], stop_reps[-1].finish_reason))
    if stop_got != ref or stop_got[-1] not in fixtures.STOPS or \
            stop_reps[-1].finish_reason != svc.E["FINISH_STOP"]:
        print("  service:  ", stop_got, "\n  reference:", ref)
        fails += 1
    if len(nonstream) != 1 or list(nonstream[0].token_ids) != got["system_water"] or \
            nonstream[0].usage.completion_tokens != N or nonstream[0].usage.prompt_tokens != 75:
        print("non-streamed reply differs:", nonstream)
        fails += 1
    n_req = len(cases) + 4
    svc.wait_metric(c.decodes[0].metrics_port, "twain_kv_blocks_used", 0)
    m = svc.metrics(c.decodes[0].metrics_port)
    print("decode metrics: checksum ok %d, mismatch %d, blocks used %d" % (
        m["twain_kv_checksum_ok_total"], m["twain_kv_checksum_mismatch_total"], m["twain_kv_blocks_used"]))
    if m["twain_kv_checksum_ok_total"] != 4 * n_req or m["twain_kv_checksum_mismatch_total"] != 0:
        print("FAIL: every layer of every handoff must match its checksum")
        fails += 1
    if m["twain_kv_blocks_used"] != 0:
        print("FAIL: blocks still in use after every request finished")
        fails += 1
    pm = svc.metrics(c.prefills[0].metrics_port)
    print("prefill: %d kv bytes sent, decode: %d kv bytes received" % (
        pm["twain_kv_bytes_sent_total"], m["twain_kv_bytes_received_total"]))
    if pm["twain_kv_bytes_sent_total"] != m["twain_kv_bytes_received_total"]:
        print("FAIL: bytes sent != bytes received")
        fails += 1
    # per-layer overlap: every layer's finished blocks are put from the engine's
    # on_layer_done callback, one put batch per (layer, chunk that completes
    # blocks), all before the final flush. Expected count derived from the
    # prompt lengths, the 32-token chunks, 16-token blocks and the model's
    # layer types / window (config.json), independent of the worker's code.
    cfg = json.load(open(os.path.join(svc.MODEL, "config.json")))
    W, BS, CH = cfg["sliding_window"], 16, 32
    prompts = list(cases.values()) + [cases["short_dog"], cases["system_water"]] + [cases["short_book"]] * 2
    want = 0
    for ids in prompts:
        n = len(ids)
        nb = (n + BS - 1) // BS
        for lt in cfg["layer_types"]:
            sent = (n - W) // BS if lt == "sliding_attention" and n > W else 0
            for end in range(CH, n + CH, CH):
                done = nb if end >= n else end // BS
                if done > sent:
                    want += 1
                    sent = done
    print("prefill: %d layer put batches, %d from the per-layer callback (expected %d)" % (
        pm["twain_kv_layer_sends_total"], pm["twain_kv_layer_sends_overlapped_total"], want))
    if pm["twain_kv_layer_sends_total"] != want or pm["twain_kv_layer_sends_overlapped_total"] != want:
        print("FAIL: KV puts were not issued layer by layer from the engine callback")
        fails += 1
    cl.close()
    # a REQ socket (one reply a request): stream = false answers with every
    # id at once, the reference's; stream = true is refused, since its later
    # replies would answer the socket's next request, which then still works
    req = svc.zmq.Context.instance().socket(svc.zmq.REQ)
    req.setsockopt(svc.zmq.LINGER, 0)
    req.setsockopt(svc.zmq.RCVTIMEO, int(svc.scaled(60) * 1000))
    req.connect(c.client_ep)
    answers = []
    for rid, stream in ((901, False), (902, True), (903, False)):
        g = svc.generate(cases["short_dog"], 8, stream=stream)
        g.request_id = rid
        req.send(g.SerializeToString())
        rep = svc.ServerReply()
        rep.ParseFromString(req.recv())
        answers.append(rep)
    ref8 = svc.reference_generate(cases["short_dog"], 8)
    ok = [answers[0].request_id == 901 and answers[0].done and list(answers[0].token_ids) == ref8,
          answers[1].request_id == 902 and answers[1].done and answers[1].error.code == svc.E["INVALID_ARGUMENT"]
          and "REQ socket" in answers[1].error.message,
          answers[2].request_id == 903 and answers[2].done and list(answers[2].token_ids) == ref8]
    print("REQ socket: stream=false %s, stream=true %s (%s), then stream=false %s" % (
        "as the reference" if ok[0] else "WRONG", "refused" if ok[1] else "NOT REFUSED",
        answers[1].error.message, "as the reference" if ok[2] else "WRONG"))
    fails += 0 if all(ok) else 1
    req.close()
finally:
    rcs = c.close()
print("exit codes:", rcs)
if any(rcs.values()):
    print("FAIL: a daemon did not stop cleanly")
    fails += 1
print("PASS" if not fails else "FAIL (%d)" % fails)
sys.exit(1 if fails else 0)
