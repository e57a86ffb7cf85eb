"""64 concurrent chat requests through 2 prefill + 2 decode workers: every
one completes with the correct answer (the token ids of `twain-prefill
--generate` on the same prompt, and a final-channel message), both workers
of each pool take a share, and a decode worker started while serving gets
traffic. Prompts are the fixture ids (system message for reasoning low and
date 2025-06-01, then the question), so the router's Harmony rendering is
checked too (usage.prompt_tokens and identical output)."""
import sys
import time

import fixtures
import svc

MAX = 160
questions = {
    "dog": ("What does the word 'dog' mean?", fixtures.chat_prompt("short_dog")),
    "book": ("Define book.", fixtures.chat_prompt("short_book")),
    "water": ("What does the word 'water' mean?", fixtures.ids("system_water")),
}
refs = {k: svc.reference_generate(ids, MAX, stop_ids=fixtures.STOPS) for k, (_, ids) in questions.items()}

fails = 0
c = svc.Cluster(2, 2)
try:
    cl = c.client()
    order = [list(questions)[i % 3] for i in range(64)]
    rids = []
    for i, k in enumerate(order):
        rids.append(cl.send(svc.chat(questions[k][0], MAX, stream=(i % 2 == 0), reasoning="low")))
    # a third decode worker joins while the 64 are being served
    time.sleep(0.3)
    newcomer = c.add_decode()
    c.wait_registered(2, 3)
    results = cl.wait(rids, 200)
    for i, (k, reps) in enumerate(zip(order, results)):
        last = reps[-1]
        toks = svc.tokens_of(reps)
        finals = [m for m in last.messages if m.channel == "final"]
        ok = (not last.HasField("error") or last.error.code == 0) and toks == refs[k] and \
            last.usage.prompt_tokens == len(questions[k][1]) and finals and finals[0].content
        if i % 2 == 0:  # streamed: the deltas add up to the final message
            text = "".join(d.content for r in reps for d in r.deltas if d.channel == "final")
            ok = ok and finals and text == finals[0].content
        if not ok:
            fails += 1
            print("request %d (%s) wrong: error=%s prompt_tokens=%d (want %d)\n  got %s\n  ref %s" % (
                i, k, last.error, last.usage.prompt_tokens, len(questions[k][1]), toks, refs[k]))
    print("64 chat requests: %d correct" % (64 - fails))
    for k in questions:
        i = order.index(k)
        print("  %s -> %s" % (k, [m.content for m in results[i][-1].messages if m.channel == "final"][0][:100]))
    # more traffic after the newcomer registered: it has the most free blocks
    more = [cl.send(svc.chat(questions["dog"][0], 8, reasoning="low")) for _ in range(8)]
    for reps in cl.wait(more, 120):
        if reps[-1].error.code:
            fails += 1
            print("late request failed:", reps[-1].error)
    shares = {}
    for p in c.prefills:
        shares[p.worker_name] = svc.metrics(p.metrics_port)["twain_prefill_requests_total"]
    for p in c.decodes:
        used = svc.wait_metric(p.metrics_port, "twain_kv_blocks_used", 0)
        shares[p.worker_name] = svc.metrics(p.metrics_port)["twain_decode_tokens_total"]
        if used != 0:
            fails += 1
            print("FAIL: %s still holds %d blocks" % (p.worker_name, used))
    print("work per worker (prefills: prompts, decodes: tokens):", shares)
    if any(v <= 0 for v in shares.values()):
        fails += 1
        print("FAIL: every worker, the newcomer %s included, must get traffic" % newcomer.worker_name)
    cl.close()
finally:
    rcs = c.close()
print("exit codes:", rcs)
fails += sum(1 for v in rcs.values() if v)
print("PASS" if not fails else "FAIL (%d)" % fails)
sys.exit(1 if fails else 0)
