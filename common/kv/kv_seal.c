/* kv_seal.c: the sealed envelope of published UCX blobs (see kv_seal.h). */
#include "common/kv/kv_seal.h"

#include <stdlib.h>
#include <string.h>

static const uint8_t tw_kv_seal_magic[4] = {'T', 'W', 'K', 'V'};

uint32_t tw_crc32c(uint32_t crc, const void *data, size_t len) {
  /* bitwise, reflected (RFC 3720 B.4): the blobs are small and sealed or
   * opened once per decode worker, never per put */
  const uint8_t *p = data;
  crc = ~crc;
  for (size_t i = 0; i < len; i++) {
    crc ^= p[i];
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

static void tw_kv_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t tw_kv_get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The CRC of a sealed blob: header bytes 0..11, then the payload. */
static uint32_t tw_kv_seal_crc(const uint8_t *header, const void *payload, size_t len) {
  return tw_crc32c(tw_crc32c(0, header, 12), payload, len);
}

TW_NODISCARD tw_status_t tw_kv_seal(tw_kv_seal_kind_t kind, const void *payload, size_t len,
                                    uint8_t **out_p, size_t *out_len_p) {
  if (len > TW_KV_SEAL_MAX_PAYLOAD)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv seal: %zu bytes, at most %u", len,
                  TW_KV_SEAL_MAX_PAYLOAD);
  uint8_t *b = malloc(TW_KV_SEAL_HEADER + len);
  if (!b) return tw_err(TW_ERR_NO_MEMORY, "kv seal: cannot allocate %zu bytes", len);
  memcpy(b, tw_kv_seal_magic, 4);
  b[4] = (uint8_t)kind;
  b[5] = TW_KV_SEAL_VERSION;
  b[6] = b[7] = 0;
  tw_kv_put32(b + 8, (uint32_t)len);
  if (len) memcpy(b + TW_KV_SEAL_HEADER, payload, len);
  tw_kv_put32(b + 12, tw_kv_seal_crc(b, b + TW_KV_SEAL_HEADER, len));
  *out_p = b;
  *out_len_p = TW_KV_SEAL_HEADER + len;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_unseal(tw_kv_seal_kind_t kind, const void *blob, size_t len,
                                      const char *what, const uint8_t **payload_p,
                                      size_t *payload_len_p) {
  const uint8_t *b = blob;
  const char *kind_name = kind == TW_KV_SEAL_ADDRESS ? "UCX address" : "rkey";
  if (!b || len == 0) return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s is empty", what);
  if (len < TW_KV_SEAL_HEADER)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                        "%s is %zu bytes, shorter than its %d-byte envelope (truncated or garbage)",
                        what, len, TW_KV_SEAL_HEADER);
  if (memcmp(b, tw_kv_seal_magic, 4) != 0)
    return tw_err_quiet(
        TW_ERR_INVALID_ARGUMENT,
        "%s (%zu bytes) is not a sealed twain %s: bad magic (garbage, or raw UCX bytes)", what, len,
        kind_name);
  if (b[5] != TW_KV_SEAL_VERSION)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s: envelope version %u, this build reads %d",
                        what, (unsigned)b[5], TW_KV_SEAL_VERSION);
  if (b[4] != (uint8_t)kind)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s: the envelope holds %s, not %s", what,
                        b[4] == TW_KV_SEAL_ADDRESS ? "a UCX address"
                        : b[4] == TW_KV_SEAL_RKEY  ? "an rkey"
                                                   : "a blob of unknown kind",
                        kind == TW_KV_SEAL_ADDRESS ? "a UCX address" : "an rkey");
  uint32_t n = tw_kv_get32(b + 8);
  if (n > TW_KV_SEAL_MAX_PAYLOAD || (size_t)n != len - TW_KV_SEAL_HEADER)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                        "%s: the envelope says %u bytes, %zu are present (truncated or padded)",
                        what, n, len - TW_KV_SEAL_HEADER);
  uint32_t want = tw_kv_get32(b + 12), got = tw_kv_seal_crc(b, b + TW_KV_SEAL_HEADER, n);
  if (want != got)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                        "%s: checksum mismatch (CRC32C %08x, the envelope says %08x): corrupted",
                        what, got, want);
  *payload_p = b + TW_KV_SEAL_HEADER;
  *payload_len_p = n;
  return TW_OK;
}
