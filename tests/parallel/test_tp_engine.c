/* test_tp_engine.c: the cpu engine split over ranks (issue 6 item 2) gives
 * the logits and greedy tokens of TP 1 and of Hugging Face.
 *
 * Usage: mpirun -np P test_tp_engine TP EP [N_PROMPTS]   (TP, EP each 1 or P;
 * the first N_PROMPTS of the 4 fixture prompts, default all).
 * Every rank loads the tiny mxfp4 model, joins the host (MPI) group and, for
 * each fixture prompt:
 *   1. prefills the prompt with all logits on the split engine (chunks of 7
 *      so that several forwards and a start_pos > 0 run) and on an unsplit
 *      TP 1 engine in the same process: relative L2 <= 1e-5 between them,
 *      and <= 1e-4 against the HF reference rows (as engine.fixtures);
 *   2. decodes the HF greedy continuation length on both: identical tokens,
 *      equal to the HF greedy_continuation_ids;
 *   3. a batched decode step of two prompts: logits within 1e-5 of TP 1.
 * Each rank checks for itself; mpirun fails if any rank fails. */
#include "common/base/log.h"
#include "common/comm/collective.h"
#include "common/engine/engine.h"
#include "common/model/model.h"

#include "fixture_util.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

#define TW_REL_L2_TP 1e-5  /* issue 6: only the reduction order differs from TP 1 */
#define TW_REL_L2_HF 1e-4  /* as tests/engine: fp32 engine vs fp32 HF */
#define TW_NBLK 48

typedef struct {
  tw_engine_t *e;
  int32_t table[TW_NBLK];
} eng_t;

static int32_t g_dp; /* data-parallel attention for the split engine */

static int eng_init(eng_t *g, const tw_model_t *m, tw_coll_t *coll, int32_t tp, int32_t ep,
                    int32_t chunk) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_num_blocks = TW_NBLK;
  p.max_prefill_chunk = chunk;
  p.n_threads = 1;
  p.tp_size = tp;
  p.ep_size = ep;
  p.tp_rank = tp > 1 ? tw_coll_rank(coll) : 0;
  p.ep_rank = ep > 1 ? tw_coll_rank(coll) : 0;
  p.coll = coll;
  p.dp_attention = coll ? g_dp : 0;
  for (int i = 0; i < TW_NBLK; i++) g->table[i] = TW_NBLK - 1 - i; /* not in position order */
  return tw_engine_create(m, &p, &g->e) == TW_OK ? 0 : -1;
}

static int32_t argmax(const float *x, int64_t n) {
  int32_t b = 0;
  for (int64_t i = 1; i < n; i++)
    if (x[i] > x[b]) b = (int32_t)i;
  return b;
}

/* Greedy decode of n tokens after a prefill whose next token is `first`. */
static int greedy(eng_t *g, int32_t first, int32_t start, int32_t n, int32_t *out) {
  out[0] = first;
  for (int32_t i = 1; i < n; i++) {
    int32_t tok = out[i - 1], pos = start + i - 1, nb = TW_NBLK, nx = -1;
    const int32_t *tab = g->table;
    tw_decode_args_t da = {.n_seqs = 1, .tokens = &tok, .positions = &pos, .block_tables = &tab,
                           .n_blocks = &nb, .next_tokens_out = &nx};
    if (tw_engine_decode(g->e, &da) != TW_OK) return -1;
    out[i] = nx;
  }
  return 0;
}

static void check_prompt(int rank, const char *cfg, eng_t *one, eng_t *par,
                         const tw_fx_entry_t *fx, int64_t V) {
  const int64_t T = fx->n_ids;
  float *a = malloc(sizeof(float) * T * V), *b = malloc(sizeof(float) * T * V);
  int32_t na = -1, nb = -1;
  int32_t split = (int32_t)T / 2;
  tw_prefill_args_t pa = {.tokens = fx->ids, .n_tokens = (int32_t)T, .block_table = one->table,
                          .n_blocks = TW_NBLK, .all_logits = true, .logits_out = a,
                          .next_token_out = &na};
  EXPECT(tw_engine_prefill(one->e, &pa) == TW_OK, "tp1 prefill: %s", tw_last_error());
  /* the split engine: two calls (the second from start_pos), chunks of 7 */
  tw_prefill_args_t p1 = {.tokens = fx->ids, .n_tokens = split, .block_table = par->table,
                          .n_blocks = TW_NBLK, .all_logits = true, .logits_out = b};
  tw_prefill_args_t p2 = {.tokens = fx->ids + split, .n_tokens = (int32_t)T - split,
                          .start_pos = split, .block_table = par->table, .n_blocks = TW_NBLK,
                          .all_logits = true, .logits_out = b + split * V, .next_token_out = &nb};
  EXPECT(tw_engine_prefill(par->e, &p1) == TW_OK && tw_engine_prefill(par->e, &p2) == TW_OK,
            "%s prefill: %s", cfg, tw_last_error());
  double e1 = tw_test_rel_l2_ff(b, a, T * V);
  double eh = tw_test_rel_l2_ff(b + (int64_t)fx->pos_begin * V, fx->logits,
                                (int64_t)fx->n_rows * V);
  int am = 0;
  for (int64_t t = 0; t < T; t++) am += argmax(b + t * V, V) == fx->argmax[t];
  printf("rank %d %s %-12s prefill %lld tokens: rel L2 %.3g vs TP 1, %.3g vs HF, argmax %d/%lld\n",
         rank, cfg, fx->prompt, (long long)T, e1, eh, am, (long long)T);
  EXPECT(e1 <= TW_REL_L2_TP, "%s/%s: rel L2 %.3g vs TP 1", cfg, fx->prompt, e1);
  EXPECT(eh <= TW_REL_L2_HF, "%s/%s: rel L2 %.3g vs HF", cfg, fx->prompt, eh);
  EXPECT(am == T, "%s/%s: argmax agrees at %d of %lld", cfg, fx->prompt, am, (long long)T);
  EXPECT(na == nb, "%s/%s: first token %d vs TP 1 %d", cfg, fx->prompt, nb, na);

  int32_t ga[64], gb[64], n = fx->n_greedy < 64 ? fx->n_greedy : 64;
  EXPECT(greedy(one, na, (int32_t)T, n, ga) == 0, "tp1 decode: %s", tw_last_error());
  EXPECT(greedy(par, nb, (int32_t)T, n, gb) == 0, "%s decode: %s", cfg, tw_last_error());
  int diff_tp1 = -1, diff_hf = -1;
  for (int32_t i = 0; i < n; i++) {
    if (gb[i] != ga[i] && diff_tp1 < 0) diff_tp1 = i;
    if (gb[i] != fx->greedy[i] && diff_hf < 0) diff_hf = i;
  }
  printf("rank %d %s %-12s greedy %d tokens: %s TP 1, %s HF\n", rank, cfg, fx->prompt, n,
         diff_tp1 < 0 ? "identical to" : "DIFFERENT from", diff_hf < 0 ? "identical to" : "DIFFERENT from");
  EXPECT(diff_tp1 < 0, "%s/%s: greedy differs from TP 1 at %d", cfg, fx->prompt, diff_tp1);
  EXPECT(diff_hf < 0, "%s/%s: greedy differs from HF at %d", cfg, fx->prompt, diff_hf);
  free(a);
  free(b);
}

/* Two sequences in one decode step (blocks 0..23 and 24..47 of the tables). */
static void check_batch(int rank, const char *cfg, eng_t *one, eng_t *par, const tw_fx_entry_t *x,
                        const tw_fx_entry_t *y, int64_t V) {
  float *la = malloc(sizeof(float) * 2 * V), *lb = malloc(sizeof(float) * 2 * V);
  eng_t *gs[2] = {one, par};
  float *outs[2] = {la, lb};
  for (int k = 0; k < 2; k++) {
    eng_t *g = gs[k];
    const int32_t *tx = g->table, *ty = g->table + TW_NBLK / 2;
    tw_prefill_args_t px = {.tokens = x->ids, .n_tokens = x->n_ids - 1, .block_table = tx,
                            .n_blocks = TW_NBLK / 2};
    tw_prefill_args_t py = {.tokens = y->ids, .n_tokens = y->n_ids - 1, .block_table = ty,
                            .n_blocks = TW_NBLK / 2};
    int32_t toks[2] = {x->ids[x->n_ids - 1], y->ids[y->n_ids - 1]};
    int32_t pos[2] = {x->n_ids - 1, y->n_ids - 1}, nbs[2] = {TW_NBLK / 2, TW_NBLK / 2};
    const int32_t *tabs[2] = {tx, ty};
    tw_decode_args_t da = {.n_seqs = 2, .tokens = toks, .positions = pos, .block_tables = tabs,
                           .n_blocks = nbs, .logits_out = outs[k]};
    EXPECT(tw_engine_prefill(g->e, &px) == TW_OK && tw_engine_prefill(g->e, &py) == TW_OK &&
                  tw_engine_decode(g->e, &da) == TW_OK,
              "%s batch: %s", k ? cfg : "tp1", tw_last_error());
  }
  double e = tw_test_rel_l2_ff(lb, la, 2 * V);
  printf("rank %d %s batched decode of 2: rel L2 %.3g vs TP 1\n", rank, cfg, e);
  EXPECT(e <= TW_REL_L2_TP, "%s batched decode: rel L2 %.3g", cfg, e);
  free(la);
  free(lb);
}

/* Data-parallel attention: each rank prefills and decodes its own prompt
 * (different lengths), the MoE runs over both ranks' tokens. */
static void check_dp(int rank, eng_t *one, eng_t *par, const tw_fx_entry_t *fx, int64_t V) {
  const int64_t T = fx->n_ids;
  float *a = malloc(sizeof(float) * T * V), *b = malloc(sizeof(float) * T * V);
  int32_t na = -1, nb = -1;
  tw_prefill_args_t pa = {.tokens = fx->ids, .n_tokens = (int32_t)T, .block_table = one->table,
                          .n_blocks = TW_NBLK, .all_logits = true, .logits_out = a,
                          .next_token_out = &na};
  EXPECT(tw_engine_prefill(one->e, &pa) == TW_OK, "tp1 prefill: %s", tw_last_error());
  pa.block_table = par->table;
  pa.logits_out = b;
  pa.next_token_out = &nb;
  EXPECT(tw_engine_prefill(par->e, &pa) == TW_OK, "dp prefill: %s", tw_last_error());
  double e1 = tw_test_rel_l2_ff(b, a, T * V);
  double eh = tw_test_rel_l2_ff(b + (int64_t)fx->pos_begin * V, fx->logits,
                                (int64_t)fx->n_rows * V);
  printf("rank %d dp-ep2 %-12s prefill %lld tokens (own prompt): rel L2 %.3g vs TP 1, %.3g vs HF\n",
         rank, fx->prompt, (long long)T, e1, eh);
  EXPECT(e1 <= TW_REL_L2_TP && eh <= TW_REL_L2_HF, "dp/%s: rel L2 %.3g / %.3g", fx->prompt, e1, eh);
  int32_t ga[16], gb[16];
  EXPECT(greedy(one, na, (int32_t)T, 16, ga) == 0, "tp1 decode: %s", tw_last_error());
  EXPECT(greedy(par, nb, (int32_t)T, 16, gb) == 0, "dp decode: %s", tw_last_error());
  int same = memcmp(ga, gb, sizeof ga) == 0 && memcmp(gb, fx->greedy, sizeof gb) == 0;
  printf("rank %d dp-ep2 %-12s greedy 16 tokens: %s\n", rank, fx->prompt,
         same ? "identical to TP 1 and HF" : "DIFFERENT");
  EXPECT(same, "dp/%s: greedy differs", fx->prompt);
  free(a);
  free(b);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: mpirun -np P %s TP EP\n", argv[0]);
    return 2;
  }
  int32_t tp = atoi(argv[1]), ep = atoi(argv[2]);
  int max_prompts = argc > 3 ? atoi(argv[3]) : 4; /* CI time: the full set for EP 2 TP 2 */
  g_dp = argc > 4 && strcmp(argv[4], "dp") == 0;
  tw_coll_t *coll = NULL;
  if (tw_coll_create_host(&coll) != TW_OK) {
    fprintf(stderr, "host collective: %s\n", tw_last_error());
    return 1;
  }
  int rank = tw_coll_rank(coll);
  tw_log_init("test_tp", rank);
  char cfg[32];
  snprintf(cfg, sizeof(cfg), "ep%d-tp%d%s", ep, tp, g_dp ? "-dp" : "");
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  if (!fixtures) fixtures = "tests/fixtures";
  char model_dir[1024], fx_dir[1024];
  snprintf(model_dir, sizeof(model_dir), "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
  snprintf(fx_dir, sizeof(fx_dir), "%s/tiny-gptoss-wordnet", fixtures);
  tw_model_t *m = NULL;
  if (tw_model_load(model_dir, &m) != TW_OK) {
    fprintf(stderr, "cannot load %s: %s\n", model_dir, tw_last_error());
    tw_coll_destroy(coll);
    return 1;
  }
  const int64_t V = m->config.vocab_size;
  tw_fx_entry_t fx[4];
  int loaded = 0;
  for (; loaded < 4; loaded++)
    if (tw_fx_load(fx_dir, "mxfp4", tw_fx_prompts[loaded], &fx[loaded]) != 0) break;
  EXPECT(loaded == 4, "fixtures: loaded %d of 4", loaded);
  if (g_dp) { /* rank r runs prompt r: different sequences and lengths per rank */
    eng_t one, par;
    if (loaded == 4 && eng_init(&one, m, NULL, 1, 1, 8192) == 0 &&
        eng_init(&par, m, coll, tp, ep, 8192) == 0) {
      check_dp(rank, &one, &par, &fx[rank % 4], V);
      tw_engine_destroy(one.e);
      tw_engine_destroy(par.e);
    } else {
      EXPECT(0, "engine create: %s", tw_last_error());
    }
    max_prompts = 0;
  }
  for (int i = 0; i < loaded && i < max_prompts; i++) {
    eng_t one, par;
    if (eng_init(&one, m, NULL, 1, 1, 8192) != 0 || eng_init(&par, m, coll, tp, ep, 7) != 0) {
      EXPECT(0, "engine create: %s", tw_last_error());
      break;
    }
    check_prompt(rank, cfg, &one, &par, &fx[i], V);
    tw_engine_destroy(one.e);
    tw_engine_destroy(par.e);
  }
  if (loaded >= 2 && !g_dp) {
    eng_t one, par;
    if (eng_init(&one, m, NULL, 1, 1, 8192) == 0 && eng_init(&par, m, coll, tp, ep, 8192) == 0) {
      check_batch(rank, cfg, &one, &par, &fx[0], &fx[1], V);
      tw_engine_destroy(one.e);
      tw_engine_destroy(par.e);
    } else {
      EXPECT(0, "engine create: %s", tw_last_error());
    }
  }
  for (int i = 0; i < loaded; i++) tw_fx_free(&fx[i]);
  tw_model_destroy(m);
  tw_coll_destroy(coll);
  return tw_test_exit(cfg);
}
