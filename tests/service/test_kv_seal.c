/* test_kv_seal.c: the envelope of published UCX blobs (kv_seal.h) and
 * tw_kv_xfer_peer's refusal of every blob that fails it, in one process:
 *  - CRC32C known answers (RFC 3720 B.4);
 *  - seal then unseal gives the payload back (0 to 3,000 bytes);
 *  - every truncation, one byte of padding, every single-bit flip, the
 *    other kind, another version, 20,000 random blobs and 2,000 blobs with a
 *    right header and a random checksum are refused as INVALID_ARGUMENT
 *    with a message naming the fault;
 *  - a real ucp worker refuses, without reaching UCX: a raw UCX address
 *    (unsealed), random bytes, a truncated and a corrupted sealed address,
 *    an empty one, a garbage rkey, an rkey blob whose CUDA IPC descriptor is
 *    malformed; then connects to the real sealed address and rkey (the
 *    garbage left nothing behind). */
#include "common/base/log.h"
#include "common/kv/kv_seal.h"
#include "common/kv/kv_transfer.h"
#include "tests/test_expect.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the CUDA IPC descriptor's wire layout (kv_transfer.c tw_kv_ipc_desc_t):
 * boot id [40], pid i32 @40, device i32 @44, handle [64] @48, pool bytes
 * i64 @112, ucx rkey length u32 @120, descriptor bytes u32 @124, magic [8]
 * "TWKVIPC1" @128; 136 bytes, last in the rkey blob */
#define DESC_BYTES 136
static void make_desc(uint8_t *d, int32_t pid, int32_t device, int64_t pool, uint32_t ucx_len) {
  memset(d, 0, DESC_BYTES);
  memcpy(d, "00000000-1111-2222-3333-444444444444", 36);
  memcpy(d + 40, &pid, 4);
  memcpy(d + 44, &device, 4);
  memset(d + 48, 0xAB, 64);
  memcpy(d + 112, &pool, 8);
  memcpy(d + 120, &ucx_len, 4);
  uint32_t n = DESC_BYTES;
  memcpy(d + 124, &n, 4);
  memcpy(d + 128, "TWKVIPC1", 8);
}

static void crc_known_answers(void) {
  tw_test_case = "crc32c";
  uint8_t zeros[32] = {0}, ones[32];
  memset(ones, 0xFF, sizeof ones);
  EXPECT_EQ_I64(tw_crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ_I64(tw_crc32c(0, zeros, 32), 0x8A9136AAu);
  EXPECT_EQ_I64(tw_crc32c(0, ones, 32), 0x62A8AB43u);
  /* continued over pieces = over the whole */
  EXPECT_EQ_I64(tw_crc32c(tw_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
}

static void seal_unseal(void) {
  tw_test_case = "seal/unseal";
  const size_t lens[] = {0, 1, 100, 3000};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    uint8_t *pl = malloc(lens[i] + 1), *b = NULL;
    for (size_t k = 0; k < lens[i]; k++) pl[k] = (uint8_t)(k * 7 + i);
    size_t n = 0, got_len = 99;
    const uint8_t *got = NULL;
    EXPECT_OK(tw_kv_seal(TW_KV_SEAL_ADDRESS, pl, lens[i], &b, &n));
    EXPECT_EQ_I64(n, TW_KV_SEAL_HEADER + lens[i]);
    EXPECT_OK(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, n, "addr", &got, &got_len));
    EXPECT(got_len == lens[i] && got == b + TW_KV_SEAL_HEADER &&
               (lens[i] == 0 || memcmp(got, pl, lens[i]) == 0),
           "round trip of %zu bytes", lens[i]);
    free(b);
    free(pl);
  }
  /* a 300-byte payload: truncations, padding, bit flips, kind, version */
  uint8_t pl[300], *b = NULL;
  for (int k = 0; k < 300; k++) pl[k] = (uint8_t)(k ^ 0x5A);
  size_t n = 0, ol;
  const uint8_t *o;
  EXPECT_OK(tw_kv_seal(TW_KV_SEAL_ADDRESS, pl, sizeof pl, &b, &n));
  int accepted = 0;
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, 0, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "addr is empty");
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, 10, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "shorter than its 16-byte envelope");
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, n - 1, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "the envelope says 300 bytes, 299 are present");
  for (size_t len = 0; len < n; len++)
    accepted += tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, len, "addr", &o, &ol) == TW_OK;
  EXPECT(accepted == 0, "%d of %zu truncations accepted", accepted, n);
  uint8_t *pad = malloc(n + 1);
  memcpy(pad, b, n);
  pad[n] = 0;
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, pad, n + 1, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "truncated or padded");
  free(pad);
  accepted = 0;
  for (size_t bit = 0; bit < n * 8; bit++) {
    b[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    accepted += tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, n, "addr", &o, &ol) == TW_OK;
    b[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  }
  EXPECT(accepted == 0, "%d of %zu single-bit flips accepted", accepted, n * 8);
  b[TW_KV_SEAL_HEADER + 150] ^= 0x10;
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, n, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "checksum mismatch");
  b[TW_KV_SEAL_HEADER + 150] ^= 0x10;
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_RKEY, b, n, "rkey", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "the envelope holds a UCX address, not an rkey");
  b[5] = 2;
  EXPECT_ERR(tw_kv_unseal(TW_KV_SEAL_ADDRESS, b, n, "addr", &o, &ol), TW_ERR_INVALID_ARGUMENT,
             "envelope version 2");
  free(b);
  EXPECT_ERR(tw_kv_seal(TW_KV_SEAL_RKEY, pl, TW_KV_SEAL_MAX_PAYLOAD + 1u, &b, &n),
             TW_ERR_INVALID_ARGUMENT, "at most");
  /* random blobs; then right headers with random checksums */
  srand(19);
  uint8_t r[600];
  accepted = 0;
  for (int t = 0; t < 20000; t++) {
    size_t len = (size_t)rand() % sizeof r;
    for (size_t k = 0; k < len; k++) r[k] = (uint8_t)rand();
    if (t % 4 == 0 && len >= 4) memcpy(r, "TWKV", 4); /* a quarter with the magic */
    accepted += tw_kv_unseal(TW_KV_SEAL_ADDRESS, r, len, "addr", &o, &ol) == TW_OK;
  }
  EXPECT(accepted == 0, "%d of 20000 random blobs accepted", accepted);
  accepted = 0;
  for (int t = 0; t < 2000; t++) {
    uint32_t len = (uint32_t)(rand() % 500);
    memcpy(r, "TWKV\x01\x01\0\0", 8);
    memcpy(r + 8, &len, 4);
    for (size_t k = 12; k < 16 + len; k++) r[k] = (uint8_t)rand();
    accepted += tw_kv_unseal(TW_KV_SEAL_ADDRESS, r, 16 + len, "addr", &o, &ol) == TW_OK;
  }
  EXPECT(accepted == 0, "%d of 2000 right headers with random checksums accepted", accepted);
}

static void peer_refusals(void) {
  tw_test_case = "tw_kv_xfer_peer";
  tw_kv_xfer_t *x = NULL, *y = NULL;
  tw_kv_region_t *reg = NULL;
  tw_kv_layout_t pool = {.dtype = TW_DTYPE_F32,
                         .n_layers = 1,
                         .n_blocks = 4,
                         .block_size = 16,
                         .head_dim = 8,
                         .n_kv_heads_local = 1};
  pool.block_bytes = 2 * 16 * 8 * 4;
  pool.layer_stride_bytes = pool.block_bytes * pool.n_blocks;
  pool.total_bytes = pool.layer_stride_bytes;
  pool.base = calloc(1, (size_t)pool.total_bytes);
  if (tw_kv_xfer_create(&x) != TW_OK || tw_kv_xfer_create(&y) != TW_OK ||
      tw_kv_region_register(y, &pool, &reg) != TW_OK) {
    EXPECT(0, "ucx workers and a host pool: %s", tw_last_error());
    return;
  }
  size_t alen, rlen, ulen;
  const uint8_t *addr = tw_kv_xfer_address(y, &alen), *rkey = tw_kv_region_rkey(reg, &rlen), *ucx;
  EXPECT_OK(tw_kv_unseal(TW_KV_SEAL_ADDRESS, addr, alen, "addr", &ucx, &ulen));
  tw_kv_peer_t *peer = NULL;
  /* the raw UCX address of a live worker: refused (not sealed) */
  EXPECT_ERR(tw_kv_xfer_peer(x, ucx, ulen, rkey, rlen, &peer), TW_ERR_INVALID_ARGUMENT,
             "the decode worker's UCX address");
  uint8_t junk[256];
  for (size_t k = 0; k < sizeof junk; k++) junk[k] = (uint8_t)(k * 131 + 7);
  EXPECT_ERR(tw_kv_xfer_peer(x, junk, sizeof junk, rkey, rlen, &peer), TW_ERR_INVALID_ARGUMENT,
             "bad magic");
  EXPECT_ERR(tw_kv_xfer_peer(x, addr, alen / 2, rkey, rlen, &peer), TW_ERR_INVALID_ARGUMENT,
             "truncated");
  EXPECT_ERR(tw_kv_xfer_peer(x, addr, 0, rkey, rlen, &peer), TW_ERR_INVALID_ARGUMENT, "empty");
  uint8_t *bad = malloc(alen);
  memcpy(bad, addr, alen);
  bad[alen - 3] ^= 0xFF;
  EXPECT_ERR(tw_kv_xfer_peer(x, bad, alen, rkey, rlen, &peer), TW_ERR_INVALID_ARGUMENT,
             "checksum mismatch");
  free(bad);
  EXPECT_ERR(tw_kv_xfer_peer(x, addr, alen, "\x07 not an rkey", 14, &peer), TW_ERR_INVALID_ARGUMENT,
             "the decode worker's rkey");
  EXPECT_ERR(tw_kv_xfer_peer(x, addr, alen, addr, alen, &peer), TW_ERR_INVALID_ARGUMENT,
             "not an rkey");
  /* sealed rkey blobs whose CUDA IPC descriptor cannot describe a pool */
  const struct {
    int32_t pid, device;
    int64_t pool;
    const char *what;
  } descs[] = {
      {1234, 0, -1, "pool -1 bytes"}, {0, 0, 4096, "pid 0"}, {1234, -3, 4096, "device -3"}};
  for (size_t i = 0; i < sizeof descs / sizeof descs[0]; i++) {
    uint8_t d[DESC_BYTES], *sealed = NULL;
    size_t sl = 0;
    make_desc(d, descs[i].pid, descs[i].device, descs[i].pool, 0);
    EXPECT_OK(tw_kv_seal(TW_KV_SEAL_RKEY, d, sizeof d, &sealed, &sl));
    EXPECT_ERR(tw_kv_xfer_peer(x, addr, alen, sealed, sl, &peer), TW_ERR_INVALID_ARGUMENT,
               "malformed CUDA IPC descriptor");
    EXPECT(strstr(tw_last_error(), descs[i].what) != NULL, "the message names %s: %s",
           descs[i].what, tw_last_error());
    free(sealed);
  }
  /* the real ones connect */
  peer = NULL;
  EXPECT_OK(tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer));
  EXPECT(peer != NULL && tw_kv_xfer_path(peer, false, false) == TW_KV_PATH_HOST,
         "the endpoint to the real worker takes the host path");
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  tw_kv_xfer_destroy(y);
  free(pool.base);
}

int main(void) {
  tw_log_init("test_kv_seal", 0);
  crc_known_answers();
  seal_unseal();
  peer_refusals();
  return tw_test_exit("test_kv_seal");
}
