/* compare_hf.c (twain-compare-hf): the engine (CUDA, or the fp32 CPU
 * reference engine, or both) against Hugging Face transformers on any
 * checkpoint, with references written by tests/reference/make_reference.py
 * (manifest.json, prompts.json, logits). Issue 5 item 3 runs it on a random
 * 4-layer checkpoint with gpt-oss-20b's shapes and MXFP4 experts
 * (tests/gpu/run_gpu.sh, on the GPU machine).
 *
 * For each named prompt and each backend: one prefill with all logits; the
 * relative L2 error ||ours - HF|| / ||HF|| over the stored logit rows (also
 * split into rows 0..7 and rows 8.., so an error that grows with the length
 * shows), the argmax agreement over all prompt positions, and the first
 * sampled (greedy) token against HF's; then batch-1 decode steps over HF's
 * greedy continuation (teacher forced), counting the tokens that differ.
 * With --backend both, also the CUDA logits against the CPU engine's on the
 * same prompt (a "cuda-vs-cpu" line, same row regions): no Hugging Face in
 * between, so a CUDA bug shows apart from HF's own numerics. Passes when every
 * prompt's relative L2 against HF is at most --max-rel (default 2e-2) for
 * every backend run.
 *
 * Usage: twain-compare-hf --model DIR --fixtures DIR [--variant mxfp4]
 *          [--prompts a,b,c] [--max-rel 0.02] [--backend cuda|cpu|both]
 *          [--threads N] */
#include "common/base/opts.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "tests/engine/fixture_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PROMPTS 8
#define N_EARLY 8 /* rows 0..N_EARLY-1 form the "early" region */

static int argmax_row(const float *r, int V) {
  int b = 0;
  for (int i = 1; i < V; i++)
    if (r[i] > r[b]) b = i;
  return b;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Relative L2 of got rows [r0, r1) against ref rows [r0, r1) (both [*, V]);
 * the worst single row and its index into *worst_p / *worst_at_p (if given).
 * Returns -1 for an empty region, INFINITY if anything is not finite. */
static double region_rel(const float *got, const float *ref, int V, int r0, int r1,
                         double *worst_p, int *worst_at_p) {
  double e2 = 0, r2 = 0, worst = 0;
  int at = -1;
  if (r1 <= r0) return -1;
  for (int r = r0; r < r1; r++) {
    double re2 = 0, rr2 = 0;
    for (int v = 0; v < V; v++) {
      double a = got[(size_t)r * V + v], b = ref[(size_t)r * V + v];
      re2 += (a - b) * (a - b);
      rr2 += b * b;
      if (!isfinite(a)) re2 = INFINITY;
    }
    e2 += re2;
    r2 += rr2;
    double rr = rr2 > 0 ? sqrt(re2 / rr2) : INFINITY;
    if (rr > worst || at < 0) worst = rr, at = r;
  }
  if (worst_p) *worst_p = worst;
  if (worst_at_p) *worst_at_p = at;
  return r2 > 0 ? sqrt(e2 / r2) : INFINITY;
}

/* "rows 0..7 X, rows 8.. Y" for got vs ref over n rows. */
static void region_text(char *buf, size_t cap, const float *got, const float *ref, int V, int n) {
  int e = n < N_EARLY ? n : N_EARLY;
  double a = region_rel(got, ref, V, 0, e, NULL, NULL);
  double b = region_rel(got, ref, V, e, n, NULL, NULL);
  if (b < 0) snprintf(buf, cap, "rows 0..%d %.3e", e - 1, a);
  else snprintf(buf, cap, "rows 0..%d %.3e, rows %d.. %.3e", e - 1, a, e, b);
}

/* One backend on one prompt: prefill with all logits into lg ([n_ids, V]),
 * the HF comparison and the teacher-forced greedy decode. Returns 1 if the
 * prompt passes, 0 if not. */
static int run_prompt(tw_engine_t *e, const char *bname, const char *pname, const tw_fx_entry_t *f,
                      int V, int32_t *table, double max_rel, float *lg, double *rel_p) {
  int32_t next = -1;
  tw_prefill_args_t a = {.tokens = f->ids, .n_tokens = f->n_ids, .block_table = table,
                         .n_blocks = 512, .all_logits = true, .logits_out = lg,
                         .next_token_out = &next};
  double t0 = now_s();
  if (tw_engine_prefill(e, &a) != TW_OK) {
    printf("hf-compare[%s] %s: FAIL prefill: %s\n", bname, pname, tw_last_error());
    *rel_p = INFINITY;
    return 0;
  }
  double t_pf = now_s() - t0;
  int same = 0;
  for (int i = 0; i < f->n_ids; i++) same += argmax_row(lg + (size_t)i * V, V) == f->argmax[i];
  const float *mine = lg + (size_t)f->pos_begin * V;
  double worst = 0;
  int worst_at = 0;
  double rel = region_rel(mine, f->logits, V, 0, f->n_rows, &worst, &worst_at);
  char reg[160];
  region_text(reg, sizeof reg, mine, f->logits, V, f->n_rows);
  /* greedy continuation, teacher forced, batch-1 decode (graphs on CUDA) */
  int mism = 0, pos = f->n_ids;
  int32_t tok = f->n_greedy > 0 ? f->greedy[0] : next;
  const int32_t *tabs[1] = {table};
  for (int g = 1; g < f->n_greedy; g++) {
    int32_t out = -1, nb = 512, ps = pos;
    tw_decode_args_t d = {.n_seqs = 1, .tokens = &tok, .positions = &ps, .block_tables = tabs,
                          .n_blocks = &nb, .next_tokens_out = &out};
    if (tw_engine_decode(e, &d) != TW_OK) {
      printf("hf-compare[%s] %s: FAIL decode: %s\n", bname, pname, tw_last_error());
      mism = -1;
      break;
    }
    mism += out != f->greedy[g];
    tok = f->greedy[g];
    pos++;
  }
  int ok = rel <= max_rel && isfinite(rel);
  printf("hf-compare[%s] %-4s: %d tokens, final logits rel L2 %.3e (%s; worst row %.3e at %d) "
         "%s %.0e, argmax %d/%d positions, first token %d (HF %d), greedy %d of %d differ "
         "(prefill %.2f s)\n",
         bname, pname, f->n_ids, rel, reg, worst, f->pos_begin + worst_at, ok ? "<=" : "> FAIL",
         max_rel, same, f->n_ids, next, f->n_greedy > 0 ? f->greedy[0] : -1, mism,
         f->n_greedy > 0 ? f->n_greedy - 1 : 0, t_pf);
  fflush(stdout);
  *rel_p = rel;
  return ok;
}

static tw_engine_t *make_engine(tw_model_t *m, tw_backend_kind_t kind, int threads) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = kind;
  p.max_batch = 1;
  p.max_prefill_chunk = 1024;
  p.kv_num_blocks = 512; /* 8192 positions */
  p.n_threads = threads;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &p, &e) != TW_OK) {
    printf("hf-compare: FAIL %s engine create: %s\n", tw_backend_name(kind), tw_last_error());
    return NULL;
  }
  return e;
}

int main(int argc, char **argv) {
  const char *model_dir = NULL, *fx_dir = NULL, *variant = "mxfp4", *backend = "cuda";
  const char *plist = "p0,p1,p2";
  double max_rel = 2e-2;
  int threads = 16;
  tw_opt_t opts[] = {
      TW_OPT_STR("model", &model_dir, "DIR", "checkpoint (required)"),
      TW_OPT_STR("fixtures", &fx_dir, "DIR", "Hugging Face reference outputs (required)"),
      TW_OPT_STR("variant", &variant, "V", "fixture variant"),
      TW_OPT_STR("prompts", &plist, "a,b", "prompt names"),
      TW_OPT_DOUBLE("max-rel", &max_rel, 0, 1e9, "X", "largest relative logit error accepted"),
      TW_OPT_STR("backend", &backend, "cuda|cpu|both", "backends compared"),
      TW_OPT_INT("threads", &threads, 0, 4096, "N", "cpu threads"),
  };
  tw_opts_spec_t spec = {.prog = "twain-compare-hf",
                         .description = "Engine logits against Hugging Face reference outputs.",
                         .env_prefix = "TWAIN_COMPARE_HF_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0]};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  int use_cuda = !strcmp(backend, "cuda") || !strcmp(backend, "both");
  int use_cpu = !strcmp(backend, "cpu") || !strcmp(backend, "both");
  if (!model_dir || !fx_dir || (!use_cuda && !use_cpu)) {
    fprintf(stderr, "hf-compare: --model and --fixtures are required, --backend is cuda, cpu "
            "or both\n");
    return 2;
  }
  char *names[MAX_PROMPTS];
  int np = 0;
  char pbuf[512];
  snprintf(pbuf, sizeof pbuf, "%s", plist);
  for (char *t = strtok(pbuf, ","); t && np < MAX_PROMPTS; t = strtok(NULL, ",")) names[np++] = t;
  tw_model_t *m = NULL;
  if (tw_model_load(model_dir, &m) != TW_OK) {
    printf("hf-compare: FAIL cannot load %s: %s\n", model_dir, tw_last_error());
    return 1;
  }
  tw_engine_t *ecuda = use_cuda ? make_engine(m, TW_BACKEND_CUDA, threads) : NULL;
  tw_engine_t *ecpu = use_cpu ? make_engine(m, TW_BACKEND_CPU, threads) : NULL;
  if ((use_cuda && !ecuda) || (use_cpu && !ecpu)) {
    if (ecuda) tw_engine_destroy(ecuda);
    if (ecpu) tw_engine_destroy(ecpu);
    tw_model_destroy(m);
    return 1;
  }
  int V = m->config.vocab_size, bs = TW_ENGINE_PARAMS_DEFAULT.kv_block_size, bad = 0;
  double worst[2] = {0, 0};
  int32_t table[512];
  for (int b = 0; b < 512; b++) table[b] = 511 - b;
  for (int s = 0; s < np; s++) {
    tw_fx_entry_t f;
    if (tw_fx_load(fx_dir, variant, names[s], &f) != 0) {
      printf("hf-compare %s: FAIL cannot load the reference (%s)\n", names[s], fx_dir);
      bad++;
      continue;
    }
    if (f.vocab != V || f.n_ids + f.n_greedy > 512 * bs) {
      printf("hf-compare %s: FAIL reference vocab %d (model %d) or %d tokens too long\n",
             names[s], f.vocab, V, f.n_ids + f.n_greedy);
      bad++;
      tw_fx_free(&f);
      continue;
    }
    float *lg[2] = {NULL, NULL}; /* cuda, cpu */
    double rel = 0;
    for (int k = 0; k < 2; k++) {
      tw_engine_t *e = k ? ecpu : ecuda;
      if (!e) continue;
      lg[k] = malloc((size_t)f.n_ids * V * 4);
      if (!lg[k]) {
        printf("hf-compare %s: FAIL out of memory\n", names[s]);
        bad++;
        continue;
      }
      bad += !run_prompt(e, k ? "cpu" : "cuda", names[s], &f, V, table, max_rel, lg[k], &rel);
      if (rel > worst[k] || !isfinite(rel)) worst[k] = rel;
    }
    if (lg[0] && lg[1]) {
      double w = 0;
      int wat = 0;
      char reg[160];
      double r = region_rel(lg[0], lg[1], V, 0, f.n_ids, &w, &wat);
      region_text(reg, sizeof reg, lg[0], lg[1], V, f.n_ids);
      int same = 0;
      for (int i = 0; i < f.n_ids; i++)
        same += argmax_row(lg[0] + (size_t)i * V, V) == argmax_row(lg[1] + (size_t)i * V, V);
      printf("cuda-vs-cpu %-4s: %d tokens, rel L2 %.3e (%s; worst row %.3e at %d), argmax "
             "%d/%d\n", names[s], f.n_ids, r, reg, w, wat, same, f.n_ids);
      fflush(stdout);
    }
    free(lg[0]);
    free(lg[1]);
    tw_fx_free(&f);
  }
  if (ecuda) tw_engine_destroy(ecuda);
  if (ecpu) tw_engine_destroy(ecpu);
  tw_model_destroy(m);
  char wtxt[96] = "";
  if (use_cuda) snprintf(wtxt, sizeof wtxt, " cuda %.3e", worst[0]);
  if (use_cpu)
    snprintf(wtxt + strlen(wtxt), sizeof wtxt - strlen(wtxt), " cpu %.3e", worst[1]);
  printf("hf-compare: %s (%d prompts, worst rel L2%s, bound %.0e)\n", bad ? "FAIL" : "PASS", np,
         wtxt, max_rel);
  return bad ? 1 : 0;
}
