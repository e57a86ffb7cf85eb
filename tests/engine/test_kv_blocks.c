/* test_kv_blocks.c: the KV block manager (kv_blocks.h): allocation order,
 * all-or-nothing exhaustion, free/reuse, double free and bad ids leaving the
 * state unchanged. */
#include "common/kv/kv_blocks.h"

#include "test_util.h"

int main(void) {
  tw_kv_blocks_t *m = NULL;
  EXPECT(tw_kv_blocks_create(0, 16, &m) == TW_ERR_INVALID_ARGUMENT, "0 blocks");
  EXPECT(tw_kv_blocks_create(8, 0, &m) == TW_ERR_INVALID_ARGUMENT, "block size 0");
  EXPECT(m == NULL, "output set on failure");
  EXPECT(tw_kv_blocks_create(8, 16, &m) == TW_OK && m, "create");
  if (!m) return tw_test_exit("test_kv_blocks");
  EXPECT(tw_kv_blocks_total(m) == 8 && tw_kv_blocks_block_size(m) == 16, "totals");
  EXPECT(tw_kv_blocks_needed(m, 0) == 0 && tw_kv_blocks_needed(m, 1) == 1 &&
                tw_kv_blocks_needed(m, 16) == 1 && tw_kv_blocks_needed(m, 17) == 2,
            "needed");
  int32_t a[8] = {-9, -9, -9, -9, -9, -9, -9, -9}, b[8];
  EXPECT(tw_kv_blocks_alloc(m, 3, a) == TW_OK, "alloc 3");
  EXPECT(a[0] == 0 && a[1] == 1 && a[2] == 2, "fresh ids 0,1,2: %d %d %d", a[0], a[1], a[2]);
  EXPECT(tw_kv_blocks_free_count(m) == 5 && tw_kv_blocks_used_count(m) == 3, "counts after alloc");
  /* exhaustion: nothing allocated */
  b[0] = -9;
  EXPECT(tw_kv_blocks_alloc(m, 6, b) == TW_ERR_EXHAUSTED, "6 of 5 free");
  EXPECT(tw_kv_blocks_free_count(m) == 5 && b[0] == -9, "all or nothing");
  EXPECT(tw_kv_blocks_alloc(m, -1, b) == TW_ERR_INVALID_ARGUMENT, "negative n");
  EXPECT(tw_kv_blocks_alloc(m, 0, b) == TW_OK, "n = 0");
  EXPECT(tw_kv_blocks_alloc(m, 5, b) == TW_OK && tw_kv_blocks_free_count(m) == 0, "take the rest");
  int distinct = 1;
  for (int i = 0; i < 5; i++)
    for (int j = 0; j < 3; j++) distinct &= b[i] != a[j];
  EXPECT(distinct, "ids handed out twice");
  EXPECT(tw_kv_blocks_alloc(m, 1, b + 5) == TW_ERR_EXHAUSTED, "empty pool");
  /* free, then reuse */
  EXPECT(tw_kv_blocks_free(m, 2, a) == TW_OK && tw_kv_blocks_free_count(m) == 2, "free 2");
  int32_t c[2];
  EXPECT(tw_kv_blocks_alloc(m, 2, c) == TW_OK, "realloc");
  EXPECT((c[0] == 0 || c[0] == 1) && (c[1] == 0 || c[1] == 1) && c[0] != c[1], "reuse %d %d", c[0], c[1]);
  /* double free: the second release of block 2 in one call; nothing changes */
  int32_t dbl[2] = {2, 2};
  EXPECT(tw_kv_blocks_free(m, 2, dbl) == TW_ERR_INVALID_ARGUMENT, "double free in one call");
  EXPECT(tw_kv_blocks_free_count(m) == 0, "state unchanged after double free");
  EXPECT(tw_kv_blocks_free(m, 1, dbl) == TW_OK && tw_kv_blocks_free_count(m) == 1, "single free of 2");
  EXPECT(tw_kv_blocks_free(m, 1, dbl) == TW_ERR_INVALID_ARGUMENT, "free of an already free block");
  int32_t mixed[3] = {c[0], 2, c[1]}; /* valid, already free, valid: all or nothing */
  EXPECT(tw_kv_blocks_free(m, 3, mixed) == TW_ERR_INVALID_ARGUMENT, "mixed free");
  EXPECT(tw_kv_blocks_free_count(m) == 1, "mixed free changed the state");
  int32_t bad[2] = {c[0], 8};
  EXPECT(tw_kv_blocks_free(m, 2, bad) == TW_ERR_INVALID_ARGUMENT, "id out of range");
  bad[1] = -1;
  EXPECT(tw_kv_blocks_free(m, 2, bad) == TW_ERR_INVALID_ARGUMENT, "negative id");
  EXPECT(tw_kv_blocks_free_count(m) == 1, "bad ids changed the state");
  EXPECT(tw_kv_blocks_free(m, 2, c) == TW_OK && tw_kv_blocks_free(m, 5, b) == TW_OK &&
                tw_kv_blocks_free(m, 1, a + 2) == TW_ERR_INVALID_ARGUMENT,
            "free all");
  EXPECT(tw_kv_blocks_free_count(m) == 8 && tw_kv_blocks_used_count(m) == 0, "all free at the end");
  tw_kv_blocks_destroy(m);
  tw_kv_blocks_destroy(NULL);
  return tw_test_exit("test_kv_blocks");
}
