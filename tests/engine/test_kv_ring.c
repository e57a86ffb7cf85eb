/* test_kv_ring.c: the window ring of the sliding layers (common/kv/kv_ring.h,
 * engine.h) on the CPU backend.
 *   1. The prefill pass plan on a case worked out by hand (scratch tables,
 *      copies in and out), and the ring length.
 *   2. The block manager's ring: a sequence's first R ids ring-capable,
 *      all or nothing when the ring ids run out, everything back on free.
 *   3. The engine with the ring against the engine without it (the full
 *      layout): prompts of 128, 129, 144, 145 and 300 tokens with the
 *      model's window set to 128 (and the fixture's own 32), prefilled in
 *      chunks of 7, 100, 200 and 8192 tokens (smaller and larger than the
 *      window), then 16 greedy decode steps: every prompt logit and every
 *      decode logit bit for bit the same (the cpu backend reads the same
 *      floats in the same order), the same greedy tokens, through a pool
 *      whose sliding layers hold fewer blocks than the others (kv_ring_blocks)
 *      and tables from the block manager; then all blocks back (0 in use).
 *   4. A decode batch of sequences at different lengths around the wrap
 *      equals each sequence alone.
 * The Hugging Face comparison with the ring on (the cpu default) is
 * engine.fixtures.*. With the argument "cuda" (ctest test_kv_ring_cuda,
 * label gpu; exits 77 without a GPU) 3 and 4 run on the CUDA engine: ring
 * against full layout at the same prefill chunk within rel L2 1e-4 and the
 * same greedy tokens (the same kernels read the same bf16 values; a ring
 * prefill attends through scratch tables of the window's blocks, so the
 * attention's splits may add in another order), the batch against alone
 * within 1e-2 (GEMM tiles of other row counts). With the argument "fp8" (ctest
 * engine.kv_ring_fp8, and test_kv_ring_cuda_fp8 on the GPU) the engines
 * keep the fp8 KV cache (kv_fp8.h): each token is quantized on its own, so
 * the ring and the full layout store the same bytes and the same bounds hold. */
#include "common/engine/engine.h"
#include "common/kv/kv_blocks.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_ring.h"
#include "common/model/model.h"

#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static tw_backend_kind_t g_backend = TW_BACKEND_CPU;
static int32_t g_kv_dtype = TW_KV_DTYPE_AUTO; /* argument "fp8": the fp8 KV cache (kv_fp8.h) */

static void test_plan(void) {
  EXPECT(tw_kv_ring_len(128, 16) == 9 && tw_kv_ring_len(32, 16) == 3 && tw_kv_ring_len(6, 4) == 3 &&
             tw_kv_ring_len(0, 16) == 0,
         "ring lengths");
  /* block size 4, window 6, R = 3. Segment 0: positions 10..16 of table
   * 100..104: window from 10 - 5 = 5, blocks 1..4 -> scratch 0..3; in: the
   * blocks of positions 5..9 (1, 2) from ring entries 1, 2; out: blocks
   * 2..4 to ring entries 2, 0, 1. Segment 1: positions 0..2 of table 200:
   * block 0 -> scratch 4, nothing in, out to its entry 0. */
  const int32_t t0[5] = {100, 101, 102, 103, 104}, t1[1] = {200};
  const int32_t *tabs[2] = {t0, t1};
  const int32_t start[2] = {10, 0}, n[2] = {7, 3};
  tw_kv_ring_pass_t p = {0};
  EXPECT(tw_kv_ring_pass_plan(&p, 2, start, n, tabs, 0, 4, 6, 3, 0) == TW_OK, "plan: %s",
         tw_last_error());
  const int32_t row0[5] = {0, 0, 1, 2, 3}, row1[5] = {4, 4, 4, 4, 4};
  const int32_t in[4] = {101, 0, 102, 1}, out[8] = {1, 102, 2, 100, 3, 101, 4, 200};
  EXPECT(p.stride == 5 && p.n_scratch == 5 && p.n_in == 2 && p.n_out == 4, "plan sizes %d %d %d %d",
         p.stride, p.n_scratch, p.n_in, p.n_out);
  EXPECT(!memcmp(p.tables, row0, sizeof row0) && !memcmp(p.tables + 5, row1, sizeof row1),
         "scratch tables");
  EXPECT(!memcmp(p.copy_in, in, sizeof in) && !memcmp(p.copy_out, out, sizeof out),
         "copies in and out");
  EXPECT(p.n_scratch <= tw_kv_ring_scratch_blocks(10, 2, 4, 6), "scratch bound %d",
         tw_kv_ring_scratch_blocks(10, 2, 4, 6));
  EXPECT(tw_kv_ring_pass_plan(&p, 2, start, n, tabs, 4, 4, 6, 3, 0) == TW_ERR_INVALID_ARGUMENT,
         "a stride too short is refused");
  EXPECT(tw_kv_ring_pass_plan(&p, 2, start, n, tabs, 0, 4, 6, 3, 4) == TW_ERR_INVALID_ARGUMENT,
         "more scratch than allowed is refused");
  tw_kv_ring_pass_free(&p);
  /* transfers: entries [2, 7) of a ring of 3 touch entries 4..6 only */
  EXPECT(tw_kv_ring_first(2, 7, 3) == 4 && tw_kv_ring_first(5, 7, 3) == 5 &&
             tw_kv_ring_first(2, 7, 0) == 2,
         "ring first");
}

static void test_blocks(void) {
  tw_kv_blocks_t *m = NULL;
  EXPECT(tw_kv_blocks_create_ring(10, 16, 4, 2, &m) == TW_OK, "create: %s", tw_last_error());
  if (!m) return;
  int32_t a[3], b[3], c[3];
  EXPECT(tw_kv_blocks_alloc(m, 3, a) == TW_OK && a[0] < 4 && a[1] < 4 && a[2] >= 4,
         "first 2 ids from the ring: %d %d %d", a[0], a[1], a[2]);
  EXPECT(tw_kv_blocks_alloc(m, 3, b) == TW_OK && b[0] < 4 && b[1] < 4 && b[2] >= 4,
         "second table: %d %d %d", b[0], b[1], b[2]);
  EXPECT(tw_kv_blocks_free_count(m) == 4 && !tw_kv_blocks_can_alloc(m, 1),
         "4 free, none of them ring-capable: no table fits");
  EXPECT(tw_kv_blocks_alloc(m, 1, c) == TW_ERR_EXHAUSTED && tw_kv_blocks_free_count(m) == 4,
         "exhausted ring: nothing taken");
  EXPECT(tw_kv_blocks_free(m, 3, a) == TW_OK && tw_kv_blocks_can_alloc(m, 3), "freed");
  EXPECT(tw_kv_blocks_alloc(m, 3, c) == TW_OK && c[0] < 4 && c[1] < 4, "again");
  EXPECT(tw_kv_blocks_free(m, 3, b) == TW_OK && tw_kv_blocks_free(m, 3, c) == TW_OK &&
             tw_kv_blocks_used_count(m) == 0,
         "all back");
  /* the rest ids exhausted: later entries fall back to ring-capable ids */
  int32_t big[8];
  EXPECT(tw_kv_blocks_alloc(m, 8, big) == TW_OK && big[0] < 4 && big[1] < 4, "8 of 10");
  EXPECT(tw_kv_blocks_free(m, 8, big) == TW_OK && tw_kv_blocks_used_count(m) == 0, "back");
  tw_kv_blocks_destroy(m);
  m = NULL;
  EXPECT(tw_kv_blocks_create_ring(10, 16, 11, 2, &m) == TW_ERR_INVALID_ARGUMENT && !m,
         "more ring blocks than blocks");
}

enum { NBLK = 96, NRING = 40, MAXLEN = 320, STEPS = 16 };

typedef struct {
  tw_engine_t *e;
  tw_kv_blocks_t *bm;
} tw_rctx_t;

static int rctx_init(tw_rctx_t *c, const tw_model_t *m, bool ring, int32_t chunk) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = g_backend;
  p.kv_num_blocks = NBLK;
  p.kv_ring_blocks = NRING;
  p.kv_window_ring = ring ? 1 : -1;
  p.kv_dtype = g_kv_dtype;
  p.max_prefill_chunk = chunk;
  p.max_batch = 8;
  p.n_threads = 2;
  c->e = NULL;
  c->bm = NULL;
  if (tw_engine_create(m, &p, &c->e) != TW_OK) return -1;
  const tw_kv_layout_t *l = tw_engine_kv_layout(c->e);
  if (ring != (l->ring_blocks > 0) || (ring && l->n_ring_blocks != NRING)) return -1;
  if ((l->dtype == TW_DTYPE_F8_E4M3) != (g_kv_dtype == TW_KV_DTYPE_FP8)) return -1;
  return tw_kv_blocks_create_ring(l->n_blocks, l->block_size, l->n_ring_blocks, l->ring_blocks,
                                  &c->bm) == TW_OK
             ? 0
             : -1;
}

static void rctx_fini(tw_rctx_t *c) {
  if (c->bm)
    EXPECT(tw_kv_blocks_used_count(c->bm) == 0, "blocks in use at the end: %d",
           tw_kv_blocks_used_count(c->bm));
  tw_kv_blocks_destroy(c->bm);
  tw_engine_destroy(c->e);
}

/* Prefill `len` tokens (chunked by the engine), then STEPS greedy decode
 * steps; all logits into logits[(len + STEPS) x V], tokens into gen. */
static int run_seq(tw_rctx_t *c, const int32_t *tokens, int32_t len, int32_t V, float *logits,
                   int32_t *gen) {
  int32_t nb = (len + STEPS + 15) / 16, table[64];
  if (tw_kv_blocks_alloc(c->bm, nb, table) != TW_OK) return -1;
  int32_t next = -1;
  tw_prefill_args_t pa = {.tokens = tokens,
                          .n_tokens = len,
                          .block_table = table,
                          .n_blocks = nb,
                          .all_logits = true,
                          .logits_out = logits,
                          .next_token_out = &next};
  int rc = tw_engine_prefill(c->e, &pa) == TW_OK ? 0 : -1;
  for (int32_t i = 0; i < STEPS && rc == 0; i++) {
    gen[i] = next;
    int32_t pos = len + i;
    const int32_t *tab = table;
    tw_decode_args_t da = {.n_seqs = 1,
                           .tokens = &gen[i],
                           .positions = &pos,
                           .block_tables = &tab,
                           .n_blocks = &nb,
                           .logits_out = logits + (int64_t)pos * V,
                           .next_tokens_out = &next};
    rc = tw_engine_decode(c->e, &da) == TW_OK ? 0 : -1;
  }
  if (rc) fprintf(stderr, "run: %s\n", tw_last_error());
  if (tw_kv_blocks_free(c->bm, nb, table) != TW_OK) rc = -1;
  return rc;
}

static void test_engine(tw_model_t *m, int32_t window) {
  const int32_t V = m->config.vocab_size;
  m->config.sliding_window = window;
  static const int32_t lens[] = {128, 129, 144, 145, 300};
  static const int32_t chunks[] = {7, 100, 200, 8192};
  int32_t tokens[MAXLEN];
  uint64_t seed = 17;
  for (int i = 0; i < MAXLEN; i++) tokens[i] = (int32_t)(tw_test_rand_u64(&seed) % (uint64_t)V);
  float *ref = malloc(sizeof(float) * (size_t)(MAXLEN + STEPS) * (size_t)V);
  float *got = malloc(sizeof(float) * (size_t)(MAXLEN + STEPS) * (size_t)V);
  if (!ref || !got) {
    EXPECT(0, "out of memory");
    free(ref);
    free(got);
    return;
  }
  for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
    int32_t len = lens[li], gref[STEPS], ggot[STEPS];
    size_t n = (size_t)(len + STEPS) * (size_t)V;
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
      /* the reference: the full layout with the same prefill chunk (on cuda
       * another chunk is another GEMM row count, so other bf16 roundings:
       * chunk 7 against 8,192 moved the tiny model's logits by up to 8e-2
       * whatever the layout) */
      tw_rctx_t full;
      EXPECT(rctx_init(&full, m, false, chunks[ci]) == 0, "engine without the ring: %s",
             tw_last_error());
      EXPECT(run_seq(&full, tokens, len, V, ref, gref) == 0,
             "window %d len %d chunk %d: full layout", window, len, chunks[ci]);
      rctx_fini(&full);
      tw_rctx_t r;
      EXPECT(rctx_init(&r, m, true, chunks[ci]) == 0, "engine with the ring: %s", tw_last_error());
      memset(got, 0, n * sizeof(float));
      EXPECT(run_seq(&r, tokens, len, V, got, ggot) == 0, "window %d len %d chunk %d: ring run",
             window, len, chunks[ci]);
      double e = tw_test_rel_l2_ff(got, ref, (int64_t)n);
      bool same_logits =
          g_backend == TW_BACKEND_CPU ? memcmp(got, ref, n * sizeof(float)) == 0 : e <= 1e-4;
      bool same_tokens = memcmp(ggot, gref, sizeof gref) == 0;
      EXPECT(same_logits && same_tokens,
             "window %d len %d chunk %d: the ring differs from the full layout (logits %s, rel "
             "L2 %g; greedy %s)",
             window, len, chunks[ci], same_logits ? "equal" : "differ", e,
             same_tokens ? "equal" : "differ");
      rctx_fini(&r);
    }
    printf("window %3d, prompt %3d: ring == full layout for chunks 7, 100, 200, 8192\n", window,
           len);
  }
  free(ref);
  free(got);
}

/* Sequences of 140..147 tokens in one decode batch (each wraps its ring at
 * a different step) equal each of them alone. */
static void test_batch(tw_model_t *m) {
  enum { NS = 4 };
  const int32_t V = m->config.vocab_size;
  m->config.sliding_window = 128;
  tw_rctx_t r;
  if (rctx_init(&r, m, true, 64) != 0) {
    EXPECT(0, "engine: %s", tw_last_error());
    return;
  }
  int32_t tokens[NS][160], tables[NS][16], nb[NS], pos[NS], tok[NS], next[NS];
  uint64_t seed = 5;
  float *alone = malloc(sizeof(float) * (size_t)V * NS * STEPS);
  float *batch = malloc(sizeof(float) * (size_t)V * NS);
  int bad = 0;
  for (int s = 0; s < NS && alone; s++) { /* alone: prefill then decode, one at a time */
    int32_t len = 140 + 2 * s;
    for (int i = 0; i < len; i++) tokens[s][i] = (int32_t)(tw_test_rand_u64(&seed) % (uint64_t)V);
    nb[s] = (len + STEPS + 15) / 16;
    EXPECT(tw_kv_blocks_alloc(r.bm, nb[s], tables[s]) == TW_OK, "alloc");
    tw_prefill_args_t pa = {.tokens = tokens[s],
                            .n_tokens = len,
                            .block_table = tables[s],
                            .n_blocks = nb[s],
                            .next_token_out = &tok[s]};
    EXPECT(tw_engine_prefill(r.e, &pa) == TW_OK, "prefill %d", s);
    int32_t t = tok[s];
    for (int i = 0; i < STEPS; i++) {
      int32_t p = len + i;
      const int32_t *tab = tables[s];
      tw_decode_args_t da = {.n_seqs = 1,
                             .tokens = &t,
                             .positions = &p,
                             .block_tables = &tab,
                             .n_blocks = &nb[s],
                             .logits_out = alone + ((int64_t)s * STEPS + i) * V,
                             .next_tokens_out = &t};
      EXPECT(tw_engine_decode(r.e, &da) == TW_OK, "decode alone");
    }
  }
  for (int s = 0; s < NS && alone; s++) { /* again, as one batch */
    tw_prefill_args_t pa = {.tokens = tokens[s],
                            .n_tokens = 140 + 2 * s,
                            .block_table = tables[s],
                            .n_blocks = nb[s],
                            .next_token_out = &tok[s]};
    EXPECT(tw_engine_prefill(r.e, &pa) == TW_OK, "prefill %d again", s);
    pos[s] = 140 + 2 * s;
  }
  const int32_t *tabs[NS] = {tables[0], tables[1], tables[2], tables[3]};
  for (int i = 0; i < STEPS && alone && batch; i++) {
    tw_decode_args_t da = {.n_seqs = NS,
                           .tokens = tok,
                           .positions = pos,
                           .block_tables = tabs,
                           .n_blocks = nb,
                           .logits_out = batch,
                           .next_tokens_out = next};
    EXPECT(tw_engine_decode(r.e, &da) == TW_OK, "batch step %d", i);
    for (int s = 0; s < NS; s++) {
      const float *a = alone + ((int64_t)s * STEPS + i) * V;
      bad += g_backend == TW_BACKEND_CPU
                 ? memcmp(batch + (int64_t)s * V, a, sizeof(float) * (size_t)V) != 0
                 : tw_test_rel_l2_ff(batch + (int64_t)s * V, a, V) > 1e-2;
      tok[s] = next[s];
      pos[s]++;
    }
  }
  EXPECT(alone && batch && bad == 0,
         "batched decode through the rings differs from alone in %d "
         "rows",
         bad);
  for (int s = 0; s < NS; s++) EXPECT(tw_kv_blocks_free(r.bm, nb[s], tables[s]) == TW_OK, "free");
  free(alone);
  free(batch);
  rctx_fini(&r);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "fp8")) {
      g_kv_dtype = TW_KV_DTYPE_FP8;
      continue;
    }
    if (strcmp(argv[i], "cuda")) {
      fprintf(stderr, "usage: test_kv_ring [cuda] [fp8]\n");
      return 2;
    }
    if (!tw_backend_usable(TW_BACKEND_CUDA)) {
      printf("test_kv_ring cuda: no usable GPU, skipped\n");
      return 77;
    }
    g_backend = TW_BACKEND_CUDA;
  }
  if (g_kv_dtype == TW_KV_DTYPE_FP8) printf("fp8 KV cache (e4m3, per-head scales)\n");
  test_plan();
  test_blocks();
  tw_model_t *m = NULL;
  if (tw_test_load_tiny(&m)) return 1;
  test_engine(m, 128);
  test_engine(m, 32);
  test_batch(m);
  tw_model_destroy(m);
  return tw_test_exit("test_kv_ring");
}
