/* kv_seal.h: the envelope around the opaque UCX bytes a worker publishes for
 * the KV handoff: its ucp worker address and its packed rkey blob (the rkey,
 * plus the CUDA IPC descriptor of kv_transfer.c for a device pool).
 *
 * UCX's packed formats carry no length and no check: ucp_ep_create on bytes
 * that are not a worker address reads past them or asserts
 * (ucp_address_unpack), so a garbage descriptor would end the prefill worker
 * it reaches. Every such blob therefore travels sealed, and is opened
 * (checked) before any byte of it reaches UCX; random bytes, a truncated or
 * corrupted blob, or an rkey where an address belongs are an error for that
 * handoff, and the worker serves on.
 *
 * Layout (16 bytes, little-endian, then the payload):
 *   0  "TWKV"      magic
 *   4  u8 kind     TW_KV_SEAL_ADDRESS or TW_KV_SEAL_RKEY
 *   5  u8 version  TW_KV_SEAL_VERSION
 *   6  u16         0
 *   8  u32 length  payload bytes (at most TW_KV_SEAL_MAX_PAYLOAD)
 *  12  u32 crc     CRC32C of bytes 0..11 and the payload
 * CRC32C (Castagnoli, reflected polynomial 0x82F63B78; RFC 3720 B.4) detects
 * every burst error of up to 32 bits (so every single-bit error), and random
 * bytes pass magic, kind, version, length and CRC with odds far below 2^-64.
 * It is a check against garbage and corruption, not a signature: the links
 * that carry the blobs are authenticated (link_auth.h). */
#ifndef TW_COMMON_KV_SEAL_H
#define TW_COMMON_KV_SEAL_H

#include "common/base/status.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_KV_SEAL_HEADER 16
#define TW_KV_SEAL_VERSION 1
#define TW_KV_SEAL_MAX_PAYLOAD (1u << 20) /* UCX addresses and rkeys are < 4 KiB */

typedef enum {
  TW_KV_SEAL_ADDRESS = 1, /* a ucp worker address */
  TW_KV_SEAL_RKEY = 2,    /* a packed rkey blob (kv_transfer.c) */
} tw_kv_seal_kind_t;

/** CRC32C of len bytes, continuing from crc (start with 0). Known answer:
 *  "123456789" gives 0xE3069283 (RFC 3720 B.4). */
uint32_t tw_crc32c(uint32_t crc, const void *data, size_t len);

/** Seal payload[len] as `kind`: writes TW_KV_SEAL_HEADER + len bytes to a
 *  malloc'd *out_p (free() it) and their count to *out_len_p.
 *  Errors: TW_ERR_INVALID_ARGUMENT (len over TW_KV_SEAL_MAX_PAYLOAD),
 *  TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_seal(tw_kv_seal_kind_t kind, const void *payload, size_t len,
                                    uint8_t **out_p, size_t *out_len_p);

/** Open a sealed blob[len] that must be a `kind`: on TW_OK *payload_p points
 *  into blob (TW_KV_SEAL_HEADER bytes in) and *payload_len_p is its
 *  length. `what` names the blob in messages ("the decode worker's UCX
 *  address"). Errors (stored, not logged: the caller reports them), all
 *  TW_ERR_INVALID_ARGUMENT with a message naming
 *  `what`, the byte count and the fault: empty, shorter than the header, not
 *  sealed (bad magic: random bytes, or a raw UCX blob), another version,
 *  another kind, a length that disagrees with the bytes present (truncated
 *  or padded), a checksum mismatch (corrupted). */
TW_NODISCARD tw_status_t tw_kv_unseal(tw_kv_seal_kind_t kind, const void *blob, size_t len,
                                      const char *what, const uint8_t **payload_p,
                                      size_t *payload_len_p);

#ifdef __cplusplus
}
#endif
#endif
