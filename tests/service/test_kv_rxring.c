/* test_kv_rxring.c: the receiving bounce ring of the staged KV handoff
 * (kv_rxring.h) on host memory, with a copy step that runs only when the test
 * says so (as a cudaMemcpyAsync finishes when the GPU gets to it), so slot
 * accounting, back-pressure, out-of-order completion, placement at each
 * piece's offset and the per-block completion are all checked on the CPU.
 * Pool: 3 layers x 8 blocks of 1000 bytes (layer stride 8000); ring: 3 slots
 * of 2500 bytes. */
#include "common/base/log.h"
#include "common/kv/kv_rxring.h"

#include "tests/test_expect.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define NL 3
#define NB 8
#define BB 1000
#define NSLOT 3
#define SLOT 2500
#define POOL ((int64_t)NL * NB * BB)

/* The deferred copy: start records, complete() performs. */
typedef struct {
  void *dst[NSLOT];
  const void *src[NSLOT];
  size_t len[NSLOT];
  int pending[NSLOT];
  int fail_start; /* the next start fails */
  int fail_copy;  /* the slot whose copy reports an error, -1 none */
  int starts;
} fake_copy_t;

static TW_NODISCARD tw_status_t fake_start(void *ctx, int32_t slot, void *dst, const void *src,
                                           size_t len) {
  fake_copy_t *f = ctx;
  if (f->fail_start) {
    f->fail_start = 0;
    return tw_err(TW_ERR_CUDA, "planted copy start failure");
  }
  f->dst[slot] = dst;
  f->src[slot] = src;
  f->len[slot] = len;
  f->pending[slot] = 1; /* started, not yet run */
  f->starts++;
  return TW_OK;
}
static TW_NODISCARD tw_status_t fake_poll(void *ctx, int32_t slot) {
  fake_copy_t *f = ctx;
  if (f->pending[slot] == 1) return TW_INPROGRESS;
  if (slot == f->fail_copy) {
    f->fail_copy = -1;
    return tw_err(TW_ERR_CUDA, "planted copy failure");
  }
  return TW_OK;
}
/* Run the copy of `slot` (the "GPU" gets to it). */
static void complete(fake_copy_t *f, int slot) {
  if (f->pending[slot] != 1) return;
  memcpy(f->dst[slot], f->src[slot], f->len[slot]);
  f->pending[slot] = 2;
}

static uint8_t pat(int64_t off, uint32_t tag) {
  return (uint8_t)(off * 7 + (off >> 9) + tag * 31 + 1);
}

/* Receive one piece through the ring: acquire, fill with the pattern, filled. */
static TW_NODISCARD tw_status_t deliver(tw_kv_rxring_t *r, int64_t off, int64_t len, uint32_t tag,
                                        int32_t *slot_p) {
  void *buf = NULL;
  tw_status_t st = tw_kv_rxring_acquire(r, off, len, tag, slot_p, &buf);
  if (st != TW_OK) return st;
  for (int64_t i = 0; i < len; i++) ((uint8_t *)buf)[i] = pat(off + i, tag);
  return tw_kv_rxring_filled(r, *slot_p, true);
}

static int64_t first_bad(const uint8_t *pool, int64_t off, int64_t len, uint32_t tag) {
  for (int64_t i = 0; i < len; i++)
    if (pool[off + i] != pat(off + i, tag)) return off + i;
  return -1;
}

int main(void) {
  tw_log_init("test_kv_rxring", 0);
  static uint8_t pool[POOL], slots[NSLOT * SLOT];
  memset(pool, 0xEE, sizeof pool);
  fake_copy_t f = {.fail_copy = -1};
  tw_kv_rxring_params_t p = {.pool = pool,
                             .n_layers = NL,
                             .n_blocks = NB,
                             .block_bytes = BB,
                             .layer_stride_bytes = NB * BB,
                             .total_bytes = POOL,
                             .slots_mem = slots,
                             .n_slots = NSLOT,
                             .slot_bytes = SLOT,
                             .copy = {fake_start, fake_poll, &f}};
  tw_kv_rxring_t *r = NULL;
  tw_kv_rxring_params_t bad = p;
  bad.layer_stride_bytes = NB * BB - 1;
  EXPECT(tw_kv_rxring_create(&bad, &r) == TW_ERR_INVALID_ARGUMENT && !r,
         "stride shorter than a layer");
  bad = p;
  bad.n_slots = 0;
  EXPECT(tw_kv_rxring_create(&bad, &r) == TW_ERR_INVALID_ARGUMENT, "no slots");
  EXPECT(tw_kv_rxring_create(&p, &r) == TW_OK && r, "create");
  if (!r) return tw_test_exit("test_kv_rxring");

  /* a sequence in blocks 2..4 (ids 5, 6, 7 in its table: one run) of layers
   * 0 and 2 (all), of layer 1 only block 7 (a sliding layer's window) */
  const int32_t ids[3] = {5, 6, 7};
  const int32_t firsts[NL] = {0, 2, 0};
  const uint32_t T = 7;
  /* pieces (offset, len): layer 0 as one 2500-byte piece and a 500-byte
   * tail; layer 1 block 7 as two halves; layer 2 as three whole blocks */
  const int64_t L0 = 0, L1 = NB * BB, L2 = 2 * NB * BB;
  const int64_t pieces[][2] = {
      {L0 + 5 * BB, 2500}, {L0 + 5 * BB + 2500, 500}, {L1 + 7 * BB + 500, 500}, {L1 + 7 * BB, 500},
      {L2 + 7 * BB, BB},   {L2 + 5 * BB, BB},         {L2 + 6 * BB, BB}};
  const int n_pieces = (int)(sizeof pieces / sizeof pieces[0]);
  int32_t slot_of[16];
  /* the first three take the three slots; the fourth waits (back-pressure) */
  for (int i = 0; i < 3; i++)
    EXPECT(deliver(r, pieces[i][0], pieces[i][1], T, &slot_of[i]) == TW_OK, "piece %d taken", i);
  tw_kv_rxring_stats_t s;
  tw_kv_rxring_stats(r, &s);
  EXPECT(s.slots_in_use == 3 && s.slots_peak == 3, "3 slots in use (%d, peak %d)", s.slots_in_use,
         s.slots_peak);
  EXPECT(deliver(r, pieces[3][0], pieces[3][1], T, &slot_of[3]) == TW_INPROGRESS,
         "a fourth piece waits while the ring is full");
  tw_kv_rxring_stats(r, &s);
  EXPECT(s.full_waits == 1, "one wait counted (%lld)", (long long)s.full_waits);
  int32_t freed = -1;
  EXPECT(tw_kv_rxring_poll(r, &freed) == TW_OK && freed == 0, "no copy done yet: nothing freed");
  EXPECT(first_bad(pool, L0 + 5 * BB, 3 * BB, T) == L0 + 5 * BB,
         "nothing written before the copy runs");
  EXPECT(tw_kv_rxring_landed(r, T, ids, 3, firsts) == TW_INPROGRESS, "not landed");
  /* copies finish out of order: the third piece's first */
  complete(&f, slot_of[2]);
  EXPECT(tw_kv_rxring_poll(r, &freed) == TW_OK && freed == 1, "one slot freed (%d)", freed);
  EXPECT(first_bad(pool, L1 + 7 * BB + 500, 500, T) < 0, "the third piece at its offset");
  EXPECT(deliver(r, pieces[3][0], pieces[3][1], T, &slot_of[3]) == TW_OK,
         "the waiting piece now fits");
  EXPECT(slot_of[3] == slot_of[2], "it took the freed slot (%d, freed %d)", slot_of[3], slot_of[2]);
  for (int i = 0; i < 4; i++) complete(&f, slot_of[i]);
  EXPECT(tw_kv_rxring_poll(r, &freed) == TW_OK && freed == 3, "three freed (%d)", freed);
  EXPECT(tw_kv_rxring_landed(r, T, ids, 3, firsts) == TW_INPROGRESS, "layer 2 still missing");
  /* layer 2, one piece at a time; one planted start failure on the way */
  for (int i = 4; i < n_pieces; i++) {
    if (i == 5) {
      f.fail_start = 1;
      EXPECT(deliver(r, pieces[i][0], pieces[i][1], T, &slot_of[i]) == TW_ERR_CUDA,
             "a failed copy start is reported");
      tw_kv_rxring_stats(r, &s);
      EXPECT(s.slots_in_use == 0 && s.pieces_failed == 1, "its slot is free again, 1 failed piece");
    }
    EXPECT(deliver(r, pieces[i][0], pieces[i][1], T, &slot_of[i]) == TW_OK, "piece %d", i);
    complete(&f, slot_of[i]);
    EXPECT(tw_kv_rxring_poll(r, &freed) == TW_OK && freed == 1, "piece %d copied", i);
    if (i < n_pieces - 1)
      EXPECT(tw_kv_rxring_landed(r, T, ids, 3, firsts) == TW_INPROGRESS,
             "not landed after piece %d", i);
  }
  EXPECT(tw_kv_rxring_landed(r, T, ids, 3, firsts) == TW_OK, "every byte landed");
  EXPECT(tw_kv_rxring_landed(r, T, ids, 3, NULL) == TW_INPROGRESS,
         "layer 1 blocks 5, 6 were never sent: not landed when asked for");
  EXPECT(tw_kv_rxring_landed(r, T + 1, ids, 3, firsts) == TW_INPROGRESS,
         "another handoff: not landed");
  /* exact bytes where sent, untouched elsewhere */
  int64_t sent_lo[] = {L0 + 5 * BB, L1 + 7 * BB, L2 + 5 * BB}, sent_len[] = {3 * BB, BB, 3 * BB};
  for (int k = 0; k < 3; k++)
    EXPECT(first_bad(pool, sent_lo[k], sent_len[k], T) < 0, "range %d exact", k);
  int64_t untouched = 0;
  for (int64_t o = 0; o < POOL; o++) {
    bool in = false;
    for (int k = 0; k < 3; k++) in |= o >= sent_lo[k] && o < sent_lo[k] + sent_len[k];
    untouched += !in && pool[o] == 0xEE;
  }
  EXPECT(untouched == POOL - 7 * BB, "bytes outside the pieces untouched (%lld of %lld)",
         (long long)untouched, (long long)(POOL - 7 * BB));
  tw_kv_rxring_stats(r, &s);
  EXPECT(s.bytes_landed == 7 * BB && s.pieces == n_pieces && s.slots_in_use == 0,
         "stats: %lld bytes in %lld pieces, %d in use", (long long)s.bytes_landed,
         (long long)s.pieces, s.slots_in_use);

  /* a new handoff into the same blocks: a stale piece does not count, a
   * failed receive or copy leaves its block incomplete */
  const int32_t one[1] = {3};
  const uint32_t U = 9;
  int32_t k0;
  EXPECT(deliver(r, L0 + 3 * BB, 500, T, &k0) == TW_OK, "stale half of block 3 (old handoff)");
  complete(&f, k0);
  EXPECT(deliver(r, L0 + 3 * BB + 500, 500, U, &k0) == TW_OK, "second half, new handoff");
  complete(&f, k0);
  TW_IGNORE(tw_kv_rxring_poll(r, NULL)); /* both copies were completed above */
  const int32_t fl[NL] = {0, 1, 1};      /* layer 0 only */
  EXPECT(tw_kv_rxring_landed(r, U, one, 1, fl) == TW_INPROGRESS, "half of block 3: not landed");
  void *buf;
  EXPECT(tw_kv_rxring_acquire(r, L0 + 3 * BB, 500, U, &k0, &buf) == TW_OK, "acquire");
  EXPECT(tw_kv_rxring_filled(r, k0, false) == TW_OK, "a failed receive frees its slot");
  EXPECT(tw_kv_rxring_landed(r, U, one, 1, fl) == TW_INPROGRESS, "still not landed");
  f.fail_copy = -1;
  EXPECT(deliver(r, L0 + 3 * BB, 500, U, &k0) == TW_OK, "first half again");
  f.fail_copy = k0;
  complete(&f, k0);
  EXPECT(tw_kv_rxring_poll(r, &freed) == TW_ERR_CUDA && freed == 1,
         "a failed copy is reported, its slot freed");
  EXPECT(tw_kv_rxring_landed(r, U, one, 1, fl) == TW_INPROGRESS, "a failed copy counts nothing");
  EXPECT(deliver(r, L0 + 3 * BB, 500, U, &k0) == TW_OK, "first half once more");
  complete(&f, k0);
  EXPECT(tw_kv_rxring_drain(r, 1000) == TW_OK, "drain");
  EXPECT(tw_kv_rxring_landed(r, U, one, 1, fl) == TW_OK, "block 3 landed for the new handoff");

  /* bad pieces */
  EXPECT(tw_kv_rxring_acquire(r, 0, SLOT + 1, U, &k0, &buf) == TW_ERR_INVALID_ARGUMENT,
         "longer than a slot");
  EXPECT(tw_kv_rxring_acquire(r, POOL - 10, 11, U, &k0, &buf) == TW_ERR_INVALID_ARGUMENT,
         "past the pool");
  EXPECT(tw_kv_rxring_acquire(r, -1, 10, U, &k0, &buf) == TW_ERR_INVALID_ARGUMENT,
         "negative offset");
  EXPECT(tw_kv_rxring_acquire(r, 0, 0, U, &k0, &buf) == TW_ERR_INVALID_ARGUMENT, "empty piece");
  EXPECT(tw_kv_rxring_filled(r, 1, true) == TW_ERR_INVALID_ARGUMENT, "filled on a free slot");
  const int32_t out[1] = {NB};
  EXPECT(tw_kv_rxring_landed(r, U, out, 1, NULL) == TW_ERR_INVALID_ARGUMENT,
         "block outside the pool");
  tw_kv_rxring_stats(r, &s);
  EXPECT(s.slots_in_use == 0 && s.busy_seconds > 0, "idle at the end, busy time counted");

  /* the size setting */
  int32_t ns = 0;
  int64_t sb = 0;
  unsetenv("TWAIN_KV_STAGING_SLOTS");
  unsetenv("TWAIN_KV_STAGING_SLOT_MB");
  EXPECT(tw_kv_rxring_size_from_env(&ns, &sb) == TW_OK && ns == 16 && sb == 8 << 20,
         "default 16 x 8 MiB");
  setenv("TWAIN_KV_STAGING_SLOTS", "4", 1);
  setenv("TWAIN_KV_STAGING_SLOT_MB", "2", 1);
  EXPECT(tw_kv_rxring_size_from_env(&ns, &sb) == TW_OK && ns == 4 && sb == 2 << 20, "4 x 2 MiB");
  setenv("TWAIN_KV_STAGING_SLOTS", "1", 1);
  EXPECT(tw_kv_rxring_size_from_env(&ns, &sb) == TW_ERR_INVALID_ARGUMENT, "1 slot refused");
  setenv("TWAIN_KV_STAGING_SLOTS", "8x", 1);
  EXPECT(tw_kv_rxring_size_from_env(&ns, &sb) == TW_ERR_INVALID_ARGUMENT, "not a number");
  tw_kv_rxring_destroy(r);
  return tw_test_exit("test_kv_rxring");
}
