"""A poisoned KV handoff that reaches a real prefill worker (sent by the
router itself, issue 19 item 3): garbage where the decode worker's UCX
address or rkey belongs fails that request with INVALID_ARGUMENT naming the
fault, never a crash, and the same worker then serves a real handoff whose
decode equals the reference.

The test is the router (fake_router.py, the deployment's CURVE keys) of a
real decode and a real prefill worker (cpu backend, the tiny model). The
published address and rkey are sealed (common/kv/kv_seal.h: "TWKV", kind,
version, length, CRC32C); the poisons are: random bytes, the sealed address
cut in half, an empty address, a sealed address with one payload byte
flipped, the raw UCX address without its envelope, a sealed rkey in the
address field, a sealed rkey with one byte flipped, and a correctly sealed
rkey blob whose CUDA IPC descriptor cannot describe a pool (pool -1 bytes:
the check runs on the cpu too). A KvPeers naming a garbage pool is counted
as failed, the worker serves on. Before the envelope, the random address
ended the prefill worker inside UCX (ucp_address_unpack)."""
import random
import struct

import fixtures
import svc
from fake_router import FakeRouter, with_pools

from svc import check, finish

E = svc.E
prompt = fixtures.ids("short_dog")


def crc32c(data):
    """CRC32C (Castagnoli, reflected 0x82F63B78; RFC 3720 B.4), bitwise."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def seal(kind, payload):
    """The envelope of kv_seal.h: kind 1 address, 2 rkey."""
    head = b"TWKV" + bytes([kind, 1, 0, 0]) + struct.pack("<I", len(payload))
    return head + struct.pack("<I", crc32c(head + payload)) + payload


def ipc_desc(pid, device, pool_bytes, ucx_len):
    """kv_transfer.c's tw_kv_ipc_desc_t: boot id[40], pid, device, handle[64],
    pool bytes, ucx rkey length, descriptor bytes (136), "TWKVIPC1"."""
    return (b"00000000-1111-2222-3333-444444444444".ljust(40, b"\0") +
            struct.pack("<ii", pid, device) + b"\xab" * 64 +
            struct.pack("<qII", pool_bytes, ucx_len, 136) + b"TWKVIPC1")


check(crc32c(b"123456789") == 0xE3069283, "crc32c known answer (RFC 3720)")

fr = FakeRouter()
dec, pre = fr.start_workers([])
try:
    pools = fr.register((b"fd", b"fp"))[b"fd"].kv_pools
    addr, rkey = pools.ucx_address, pools.rkey
    check(addr[:4] == b"TWKV" and addr[4] == 1 and addr == seal(1, addr[16:]) and
          rkey[:4] == b"TWKV" and rkey[4] == 2 and rkey == seal(2, rkey[16:]),
          "the decode worker publishes a sealed address (%d bytes) and rkey (%d bytes)" % (len(addr), len(rkey)))

    # a KvPeers naming a garbage pool: not connected, counted, no crash
    kp = svc.Envelope()
    garbage_pool = kp.kv_peers.pools.add()
    garbage_pool.CopyFrom(pools)
    garbage_pool.decode_worker = "fd"
    garbage_pool.ucx_address = random.Random(19).randbytes(300)
    fr.send(b"fp", kp)
    ready = fr.recv_body(b"fp", "kv_peers_ready").kv_peers_ready
    check(ready.failed == 1 and ready.connected == 0 and pre.p.poll() is None,
          "KvPeers with a garbage address: failed %d, connected %d, the worker runs" % (ready.failed, ready.connected))

    rv = svc.Envelope()
    rv.reserve.request_id = 40
    rv.reserve.n_prompt_tokens = len(prompt)
    rv.reserve.max_tokens = 12
    fr.send(b"fd", rv)
    h = with_pools(fr.recv_body(b"fd", "reserved", rid=40).reserved.handoff, pools)
    flipped = bytearray(addr)
    flipped[len(addr) // 2] ^= 0x01
    rflipped = bytearray(rkey)
    rflipped[-1] ^= 0x80
    poisons = [  # (what, field, bytes, words the error names)
        ("random bytes as the address", "ucx_address", random.Random(7).randbytes(256), "bad magic"),
        ("the sealed address cut in half", "ucx_address", addr[:len(addr) // 2], "truncated"),
        ("an empty address", "ucx_address", b"", "UCX address"),
        ("a sealed address with a byte flipped", "ucx_address", bytes(flipped), "checksum mismatch"),
        ("the raw UCX address (no envelope)", "ucx_address", addr[16:], "bad magic"),
        ("the sealed rkey as the address", "ucx_address", rkey, "not a UCX address"),
        ("a sealed rkey with a byte flipped", "rkey", bytes(rflipped), "checksum mismatch"),
        ("a sealed rkey whose CUDA IPC descriptor says pool -1 bytes", "rkey",
         seal(2, ipc_desc(4242, 0, -1, 0)), "malformed CUDA IPC descriptor"),
    ]
    for i, (what, field, data, words) in enumerate(poisons):
        pr = svc.Envelope()
        pr.prefill.request_id = 100 + i
        pr.prefill.prompt_ids.extend(prompt)
        pr.prefill.handoff.CopyFrom(h)
        setattr(pr.prefill.handoff, field, data)
        fr.send(b"fp", pr)
        done = fr.recv_body(b"fp", "prefill_done", rid=100 + i).prefill_done
        names = "UCX address" if field == "ucx_address" else "rkey"
        check(done.status.code == E["INVALID_ARGUMENT"] and words in done.status.message and
              names in done.status.message,
              "%s -> %s: %s" % (what, done.status.code, done.status.message[:160]))
        check(pre.p.poll() is None, "the prefill worker is still running after %s" % what)
    logged = pre.wait_count(r"request 10\d failed", len(poisons))
    check(logged == len(poisons), "each poisoned request is logged as failed (%d lines)" % logged)

    # the same worker serves a real handoff; the decode equals the reference
    pr = svc.Envelope()
    pr.prefill.request_id = 40
    pr.prefill.prompt_ids.extend(prompt)
    pr.prefill.handoff.CopyFrom(h)
    fr.send(b"fp", pr)
    done = fr.recv_body(b"fp", "prefill_done", rid=40).prefill_done
    toks = fr.decode(b"fd", 40, len(prompt), done, 12) if done.status.code == 0 else []
    check(done.status.code == 0 and len(done.layer_checksums) == 4 and
          toks == svc.reference_generate(prompt, 12),
          "then a real handoff (%s %s), whose decode equals the reference" % (done.status.code,
                                                                              done.status.message))
finally:
    rcs = fr.close()
    check(rcs == [0, 0], "workers stop cleanly on SIGTERM: %s" % rcs)
finish()
