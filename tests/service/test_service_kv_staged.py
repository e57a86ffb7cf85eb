"""The staged KV receive path through the whole service on the CPU: with
TWAIN_KV_PATH=staged the decode worker's host pool is not registered with
UCX; every piece of KV arrives as an active message into its bounded ring of
bounce buffers (here 2 slots of 1 MiB) and is copied into the pool from
there (kv_transfer.h, kv_rxring.h). Greedy output must equal the single
process reference token for token (per-layer checksums checked by the
decode worker, --verify-kv), the bytes copied out of the ring must equal
the KV bytes handed in exactly, every block is free afterwards, and the
decode worker says which path it took."""
import os

import fixtures
import svc

from svc import check, finish

os.environ["TWAIN_KV_PATH"] = "staged"
os.environ["TWAIN_KV_STAGING_SLOTS"] = "2"
os.environ["TWAIN_KV_STAGING_SLOT_MB"] = "1"
N = 24
cases = {"short_dog": fixtures.ids("short_dog"), "long": fixtures.long_prompt(),
         "system_water": fixtures.ids("system_water")}
c = svc.Cluster(1, 1, decode_args=["--verify-kv"], prefill_args=["--chunk-tokens", "32"])
try:
    check(c.decodes[0].seen(r"STAGED receive: a ring of 2 x 1 MiB"),
          "the decode worker receives through its bounce ring (2 x 1 MiB)")
    cl = c.client()
    rids = {name: cl.send(svc.generate(ids, N)) for name, ids in cases.items()}
    got = {name: svc.tokens_of(reps) for name, reps in zip(rids, cl.wait(list(rids.values()), 180))}
    for name, ids in cases.items():
        ref = svc.reference_generate(ids, N)
        check(got[name] == ref and len(ref) == N, "%s (%d prompt tokens): output identical to the "
              "reference through the staged path" % (name, len(ids)))
    d = c.decodes[0]
    check(svc.wait_metric(d.metrics_port, "twain_kv_blocks_used", 0) == 0, "every kv block freed")
    m = svc.metrics(d.metrics_port)
    received = m.get("twain_kv_bytes_received_total", -1)
    staged = m.get("twain_kv_staging_bytes_total", -2)
    print("kv bytes received %s, copied out of the ring %s, ring waits %s, failed pieces %s" % (
        received, staged, m.get("twain_kv_staging_full_waits_total"),
        m.get("twain_kv_staging_pieces_failed_total")))
    check(received > 0 and staged == received, "bytes copied out of the ring (%s) == kv bytes handed in (%s)" % (
        staged, received))
    check(m.get("twain_kv_staging_pieces_failed_total", -1) == 0, "no piece failed")
    check(m.get("twain_kv_staging_slots_in_use", -1) == 0, "no slot in use at rest")
    check(m.get("twain_kv_checksum_mismatch_total", -1) == 0 and m.get("twain_kv_checksum_ok_total", 0) > 0,
          "per-layer checksums matched")
    cl.close()
finally:
    rcs = c.close()
check(not any(rcs.values()), "the daemons stop cleanly (%s)" % rcs)
finish()
