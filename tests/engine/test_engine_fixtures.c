/* test_engine_fixtures.c: the whole CPU engine against Hugging Face
 * transformers (fp32, eager) on the tiny gpt-oss checkpoints.
 *
 * Usage: test_engine_fixtures mxfp4|bf16. For each prompt of the fixtures:
 *   1. one prefill with all logits: relative L2 error <= 1e-4 over the stored
 *      rows, and argmax equal to the manifest at every prompt position;
 *   2. greedy continuation of 48 tokens with KV-cache decode steps, equal to
 *      greedy_continuation_ids;
 *   3. prefill in chunks of 7 (max_prefill_chunk) and as two calls (the
 *      second with start_pos), and decode one token at a time: the same
 *      logits as (1) within 1e-6 (same arithmetic per token, any batching).
 * The bf16 model and fixtures live in TW_SHARED_DIR; without it the bf16
 * run exits 77 (skip). */
#include "common/base/log.h"
#include "common/engine/engine.h"
#include "common/kv/kv_blocks.h"
#include "common/model/model.h"

#include "fixture_util.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TW_REL_L2_HF 1e-4  /* fp32 engine vs fp32 HF: only summation order differs */
#define TW_REL_L2_SELF 1e-6 /* the same engine batched differently */

typedef struct {
  tw_engine_t *engine;
  tw_kv_blocks_t *blocks;
  int32_t table[64];
  int32_t n_table;
  int32_t vocab;
} ctx_t;

/* tw_decode_args_t.while_running: counts its calls */
static void count_call(void *arg) { (*(int *)arg)++; }

static int ctx_init(ctx_t *c, const tw_model_t *m, int32_t chunk, int32_t n_threads) {
  memset(c, 0, sizeof(*c));
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_num_blocks = 64;
  p.max_prefill_chunk = chunk;
  p.n_threads = n_threads;
  if (tw_engine_create(m, &p, &c->engine) != TW_OK) return -1;
  if (tw_kv_blocks_create(64, p.kv_block_size, &c->blocks) != TW_OK) return -1;
  /* a scattered table: take 8 blocks, give back the even ones, then take
   * what the sequence needs, so ids are not in position order */
  int32_t junk[8];
  if (tw_kv_blocks_alloc(c->blocks, 8, junk) != TW_OK) return -1;
  int32_t even[4] = {junk[0], junk[2], junk[4], junk[6]};
  if (tw_kv_blocks_free(c->blocks, 4, even) != TW_OK) return -1;
  c->n_table = 24; /* 384 positions: prompt + 48 */
  if (tw_kv_blocks_alloc(c->blocks, c->n_table, c->table) != TW_OK) return -1;
  c->vocab = m->config.vocab_size;
  return 0;
}

static void ctx_fini(ctx_t *c) {
  tw_engine_destroy(c->engine);
  tw_kv_blocks_destroy(c->blocks);
}

static double rel_l2_rows(const float *a, const float *ref, int64_t n) {
  return tw_test_rel_l2_ff(a, ref, n);
}

static void check_entry(const tw_model_t *m, const char *variant, const tw_fx_entry_t *fx) {
  ctx_t c;
  if (ctx_init(&c, m, 8192, 2) != 0) {
    EXPECT(0, "engine setup failed: %s", tw_last_error());
    return;
  }
  const int64_t V = c.vocab, T = fx->n_ids;
  float *full = malloc(sizeof(float) * T * V);
  float *other = malloc(sizeof(float) * T * V);
  /* 1. one prefill, all logits */
  int32_t next = -1;
  tw_prefill_args_t pa = {.tokens = fx->ids, .n_tokens = fx->n_ids, .start_pos = 0,
                          .block_table = c.table, .n_blocks = c.n_table, .all_logits = true,
                          .logits_out = full, .next_token_out = &next};
  tw_status_t st = tw_engine_prefill(c.engine, &pa);
  EXPECT(st == TW_OK, "%s/%s prefill: %s", variant, fx->prompt, tw_last_error());
  double e = rel_l2_rows(full + (int64_t)fx->pos_begin * V, fx->logits, (int64_t)fx->n_rows * V);
  int argmax_ok = 0;
  for (int64_t t = 0; t < T; t++) {
    int32_t best = 0;
    for (int32_t v = 1; v < V; v++)
      if (full[t * V + v] > full[t * V + best]) best = v;
    argmax_ok += best == fx->argmax[t];
  }
  printf("%s %-12s prefill: rel L2 %.3g over %d rows (positions %d..%d), argmax %d/%lld\n", variant,
         fx->prompt, e, fx->n_rows, fx->pos_begin, fx->pos_begin + fx->n_rows - 1, argmax_ok,
         (long long)T);
  EXPECT(e <= TW_REL_L2_HF, "%s/%s: logits rel L2 %.3g", variant, fx->prompt, e);
  EXPECT(argmax_ok == T, "%s/%s: argmax agrees at %d of %lld positions", variant, fx->prompt,
            argmax_ok, (long long)T);

  /* 2. greedy continuation through the KV cache */
  int32_t gen[64];
  int n_gen = 0, n_want = fx->n_greedy;
  gen[n_gen++] = next;
  for (int i = 1; i < n_want && i < 64; i++) {
    int32_t tok = gen[n_gen - 1], pos = (int32_t)(T + i - 1), nb = c.n_table, out = -1;
    const int32_t *tab = c.table;
    tw_decode_args_t da = {.n_seqs = 1, .tokens = &tok, .positions = &pos, .block_tables = &tab,
                           .n_blocks = &nb, .next_tokens_out = &out};
    st = tw_engine_decode(c.engine, &da);
    if (st != TW_OK) {
      EXPECT(0, "%s/%s decode step %d: %s", variant, fx->prompt, i, tw_last_error());
      break;
    }
    gen[n_gen++] = out;
  }
  int same = n_gen == n_want;
  int first_diff = -1;
  for (int i = 0; i < n_gen && i < n_want; i++)
    if (gen[i] != fx->greedy[i] && first_diff < 0) first_diff = i;
  same = same && first_diff < 0;
  printf("%s %-12s greedy %d tokens: %s", variant, fx->prompt, n_want,
         same ? "identical\n" : "DIFFERENT");
  if (!same) printf(" (first difference at %d)\n", first_diff);
  EXPECT(same, "%s/%s: greedy continuation differs at %d", variant, fx->prompt, first_diff);
  ctx_fini(&c);

  /* 3a. chunks of 7 (one thread, to vary the split too) */
  if (ctx_init(&c, m, 7, 1) == 0) {
    pa.logits_out = other;
    pa.block_table = c.table;
    pa.next_token_out = NULL;
    st = tw_engine_prefill(c.engine, &pa);
    e = rel_l2_rows(other, full, T * V);
    EXPECT(st == TW_OK && e <= TW_REL_L2_SELF, "%s/%s chunk 7: rel L2 %.3g vs one prefill",
              variant, fx->prompt, e);
    printf("%s %-12s chunked(7) vs one prefill: rel L2 %.3g\n", variant, fx->prompt, e);
    ctx_fini(&c);
  }
  /* 3b. two calls, the second with start_pos */
  if (ctx_init(&c, m, 8192, 2) == 0) {
    int32_t split = fx->n_ids / 2 + 1;
    tw_prefill_args_t p1 = pa, p2 = pa;
    p1.block_table = p2.block_table = c.table;
    p1.n_tokens = split;
    p1.logits_out = other;
    p2.tokens = fx->ids + split;
    p2.n_tokens = fx->n_ids - split;
    p2.start_pos = split;
    p2.logits_out = other + (int64_t)split * V;
    st = tw_engine_prefill(c.engine, &p1);
    if (st == TW_OK) st = tw_engine_prefill(c.engine, &p2);
    e = rel_l2_rows(other, full, T * V);
    EXPECT(st == TW_OK && e <= TW_REL_L2_SELF, "%s/%s start_pos %d: rel L2 %.3g", variant,
              fx->prompt, split, e);
    printf("%s %-12s prefill 0..%d + start_pos %d: rel L2 %.3g\n", variant, fx->prompt, split - 1,
           split, e);
    /* only the last row, and the sampled token, when all_logits is false
     * (positions 0..split-1 written again first: with the window ring a
     * sequence only moves forward, the later positions overwrote them) */
    float *last = malloc(sizeof(float) * V);
    int32_t tok = -1;
    p2.all_logits = false;
    p2.logits_out = last;
    p2.next_token_out = &tok;
    p1.logits_out = NULL;
    p1.all_logits = false;
    if (st == TW_OK) st = tw_engine_prefill(c.engine, &p1);
    if (st == TW_OK) st = tw_engine_prefill(c.engine, &p2);
    e = rel_l2_rows(last, full + (T - 1) * V, V);
    EXPECT(st == TW_OK && e <= TW_REL_L2_SELF && tok == fx->greedy[0],
              "%s/%s last-row prefill: rel L2 %.3g, token %d", variant, fx->prompt, e, tok);
    free(last);
    ctx_fini(&c);
  }
  /* 3c. one token at a time: prefill of 1, then decode steps with logits */
  if (ctx_init(&c, m, 8192, 2) == 0) {
    tw_prefill_args_t p1 = pa;
    p1.block_table = c.table;
    p1.n_tokens = 1;
    p1.logits_out = other;
    st = tw_engine_prefill(c.engine, &p1);
    for (int32_t i = 1; i < fx->n_ids && st == TW_OK; i++) {
      int32_t nb = c.n_table;
      const int32_t *tab = c.table;
      tw_decode_args_t da = {.n_seqs = 1, .tokens = &fx->ids[i], .positions = &i,
                             .block_tables = &tab, .n_blocks = &nb, .logits_out = other + i * V};
      st = tw_engine_decode(c.engine, &da);
    }
    e = rel_l2_rows(other, full, T * V);
    EXPECT(st == TW_OK && e <= TW_REL_L2_SELF, "%s/%s token by token: rel L2 %.3g", variant,
              fx->prompt, e);
    printf("%s %-12s decode token by token vs one prefill: rel L2 %.3g\n", variant, fx->prompt, e);
    ctx_fini(&c);
  }
  free(full);
  free(other);
}

/* Two sequences in one decode batch give the same logits as each alone. */
static void check_batched_decode(const tw_model_t *m, const tw_fx_entry_t *a,
                                 const tw_fx_entry_t *b) {
  ctx_t c;
  if (ctx_init(&c, m, 8192, 2) != 0) return;
  const int64_t V = c.vocab;
  int32_t tb[24];
  int32_t nb_b = 12;
  /* sequence b gets its own blocks: the upper half of the table */
  memcpy(tb, c.table + 12, sizeof(int32_t) * 12);
  tw_prefill_args_t pa = {.tokens = a->ids, .n_tokens = a->n_ids - 1, .block_table = c.table,
                          .n_blocks = 12};
  tw_prefill_args_t pb = {.tokens = b->ids, .n_tokens = b->n_ids - 1, .block_table = tb,
                          .n_blocks = nb_b};
  EXPECT(tw_engine_prefill(c.engine, &pa) == TW_OK && tw_engine_prefill(c.engine, &pb) == TW_OK,
            "batched: prefills");
  float *both = malloc(sizeof(float) * 2 * V);
  int32_t toks[2] = {a->ids[a->n_ids - 1], b->ids[b->n_ids - 1]};
  int32_t pos[2] = {a->n_ids - 1, b->n_ids - 1}, nbs[2] = {12, nb_b};
  const int32_t *tabs[2] = {c.table, tb};
  int hook_calls = 0;
  tw_decode_args_t da = {.n_seqs = 2, .tokens = toks, .positions = pos, .block_tables = tabs,
                         .n_blocks = nbs, .logits_out = both, .while_running = count_call,
                         .while_running_arg = &hook_calls};
  EXPECT(tw_engine_decode(c.engine, &da) == TW_OK, "batched decode: %s", tw_last_error());
  /* the cpu backend gives the caller the time before each layer (engine.h) */
  EXPECT(hook_calls == tw_engine_kv_layout(c.engine)->n_layers,
            "while_running called %d times, %d layers", hook_calls,
            tw_engine_kv_layout(c.engine)->n_layers);
  const tw_fx_entry_t *fx[2] = {a, b};
  for (int s = 0; s < 2; s++) {
    int32_t last = fx[s]->n_ids - 1 - fx[s]->pos_begin;
    double e = rel_l2_rows(both + s * V, fx[s]->logits + (int64_t)last * V, V);
    printf("batched decode, sequence %d (%s): rel L2 %.3g vs HF last row\n", s, fx[s]->prompt, e);
    EXPECT(e <= TW_REL_L2_HF, "batched decode sequence %d: rel L2 %.3g", s, e);
  }
  free(both);
  ctx_fini(&c);
}

int main(int argc, char **argv) {
  const char *variant = argc > 1 ? argv[1] : "mxfp4";
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  const char *shared = getenv("TW_SHARED_DIR");
  char model_dir[1024], fx_dir[1024];
  if (strcmp(variant, "mxfp4") == 0) {
    if (!fixtures) fixtures = "tests/fixtures";
    snprintf(model_dir, sizeof(model_dir), "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
    snprintf(fx_dir, sizeof(fx_dir), "%s/tiny-gptoss-wordnet", fixtures);
  } else if (strcmp(variant, "bf16") == 0) {
    if (!shared) shared = "../shared";
    snprintf(model_dir, sizeof(model_dir), "%s/models/tiny-gptoss-wordnet", shared);
    snprintf(fx_dir, sizeof(fx_dir), "%s/fixtures/tiny-gptoss-wordnet", shared);
    if (access(model_dir, R_OK) != 0 || access(fx_dir, R_OK) != 0) {
      printf("skip: %s or %s absent\n", model_dir, fx_dir);
      return 77;
    }
  } else {
    fprintf(stderr, "usage: %s mxfp4|bf16\n", argv[0]);
    return 2;
  }
  tw_model_t *m = NULL;
  if (tw_model_load(model_dir, &m) != TW_OK) {
    fprintf(stderr, "cannot load %s: %s\n", model_dir, tw_last_error());
    return 1;
  }
  tw_fx_entry_t fx[4];
  int loaded = 0;
  for (int i = 0; i < 4; i++) {
    if (tw_fx_load(fx_dir, variant, tw_fx_prompts[i], &fx[i]) != 0) {
      EXPECT(0, "cannot load fixture %s/%s", variant, tw_fx_prompts[i]);
      break;
    }
    loaded++;
    EXPECT(fx[i].vocab == m->config.vocab_size, "vocab %d vs model %d", fx[i].vocab,
              m->config.vocab_size);
    check_entry(m, variant, &fx[i]);
  }
  if (loaded == 4) check_batched_decode(m, &fx[2], &fx[0]);
  for (int i = 0; i < loaded; i++) tw_fx_free(&fx[i]);
  tw_model_destroy(m);
  return tw_test_exit(strcmp(variant, "bf16") == 0 ? "test_engine_fixtures bf16"
                                                     : "test_engine_fixtures mxfp4");
}
