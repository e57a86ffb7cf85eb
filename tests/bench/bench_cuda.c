/* bench_cuda.c (twain-bench-cuda): the CUDA engine end to end on one GPU.
 *
 *   (a) prefill of one sequence (batch 1) at 8192, 32768, 65536, 128000
 *       tokens: latency, cost per million input tokens at $3.00 per GPU-hour,
 *       ratio to the yardstick (in-house FP8 engine, one H200);
 *   (a') with --prefill-batch SxL,...: S prompts of L tokens each as one
 *       batched (variable-length) prefill, tw_engine_prefill_batch, in
 *       passes of --chunk tokens (engine max_prefill_chunk, default 8192):
 *       latency of the whole batch and prompt tokens/s (e.g. 1x1024 against
 *       32x1024: short prompts at batch-1 rates or not);
 *   (b) decode steps at batch 1, 8, 32, 64, 128, 256 and contexts 8192 and
 *       32768: tokens/s per sequence and per GPU, cost per million output
 *       tokens; configurations whose KV cache does not fit are skipped.
 * Models: synthetic gpt-oss-20b / gpt-oss-120b weights (real shapes, MXFP4
 * experts, tw_model_synthetic), or a checkpoint with --model DIR.
 *
 * Timing: the engine calls are synchronous (they end with a stream sync), so
 * a monotonic host clock around each call measures the device work plus the
 * launch path; a warm-up call runs first (graph capture, cuBLASLt
 * heuristics), then the median of the repeats is taken. Decode contexts are
 * distinct KV blocks per sequence (no sharing, so no false L2 reuse); only
 * sequence 0's context is filled by a real prefill, the others hold the
 * pool's initial zeros (attention cost does not depend on the values).
 *
 * With --kv-window-ring 1 the sliding layers keep only their window
 * (common/kv/kv_ring.h): rings for the largest batch asked, every other byte of
 * the pool for positions of the full layers; the sequences' tables give each
 * its ring from the ring blocks (bench_tables).
 *
 * Usage: twain-bench-cuda [--model DIR | --synthetic 20b|120b|both]
 *          [--prefill 8192,32768,...] [--batches 1,8,...] [--contexts 8192,...]
 *          [--prefill-batch 1x1024,32x1024,...] [--chunk N] [--steps N] [--reps N]
 *          [--kv-window-ring 0|1|auto] [--kv-dtype bf16|fp8]
 * With --kv-dtype fp8 the KV cache is e4m3 with per-head scales
 * (common/kv/kv_fp8.h): 1.88x the blocks in the same bytes (the engine's
 * memory plan line says so), fewer KV bytes per decode step.
 * (a list may be "none": e.g. --prefill none --batches none for (a') alone). */
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/engine/engine.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_ring.h"
#include "common/model/model.h"
#include "common/model/model_path.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAXL 16
#define PRICE_PER_HOUR 3.00

static const char *cfg_json(int big) {
  static char buf[4096];
  char types[2048] = "";
  int L = big ? 36 : 24;
  for (int l = 0; l < L; l++)
    strcat(types, l % 2 ? "\"full_attention\"," : "\"sliding_attention\",");
  types[strlen(types) - 1] = 0;
  snprintf(buf, sizeof buf,
           "{\"architectures\":[\"GptOssForCausalLM\"],\"model_type\":\"gpt_oss\","
           "\"num_hidden_layers\":%d,\"num_local_experts\":%d,\"num_experts_per_tok\":4,"
           "\"experts_per_token\":4,\"vocab_size\":201088,\"hidden_size\":2880,"
           "\"intermediate_size\":2880,\"head_dim\":64,\"num_attention_heads\":64,"
           "\"num_key_value_heads\":8,\"sliding_window\":128,\"attention_bias\":true,"
           "\"swiglu_limit\":7.0,\"rms_norm_eps\":1e-05,\"rope_theta\":150000,"
           "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":32.0,\"beta_fast\":32.0,"
           "\"beta_slow\":1.0,\"original_max_position_embeddings\":4096,\"truncate\":false},"
           "\"initial_context_length\":4096,\"max_position_embeddings\":131072,"
           "\"tie_word_embeddings\":false,\"eos_token_id\":200002,\"pad_token_id\":199999,"
           "\"layer_types\":[%s],"
           "\"quantization_config\":{\"quant_method\":\"mxfp4\"}}",
           L, big ? 128 : 32, types);
  return buf;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A --prefill/--batches/--contexts list (opts.h TW_OPT_FN): positive
 * numbers separated by commas, at most MAXL; "" is the empty list. */
typedef struct {
  int v[MAXL];
  int n;
} int_list_t;

static int parse_list(const char *s, void *dst, char *err, size_t errlen) {
  int_list_t *l = dst;
  if (!strcmp(s, "none")) { /* the empty list, like "" */
    l->n = 0;
    return 0;
  }
  if (tw_opts_id_list(s, l->v, MAXL, &l->n, err, errlen)) return -1;
  for (int i = 0; i < l->n; i++)
    if (l->v[i] < 1) {
      snprintf(err, errlen, "must be positive numbers separated by commas, got '%s'", s);
      return -1;
    }
  return 0;
}

/* --prefill-batch "SxL,SxL,...": S sequences of L tokens each (opts.h TW_OPT_FN). */
typedef struct {
  int s[MAXL], l[MAXL];
  int n;
} pair_list_t;

static int parse_pairs(const char *text, void *dst, char *err, size_t errlen) {
  pair_list_t *p = dst;
  char buf[512];
  p->n = 0;
  if (snprintf(buf, sizeof buf, "%s", text) >= (int)sizeof buf) {
    snprintf(err, errlen, "is too long");
    return -1;
  }
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    char *x = strchr(t, 'x');
    long long a = 0, b = 0;
    if (x) *x = '\0'; /* t: the count, x + 1: the length */
    if (p->n == MAXL || !x || tw_opts_ll(t, 1, INT32_MAX, &a) || tw_opts_ll(x + 1, 1, INT32_MAX, &b)) {
      snprintf(err, errlen, "must be at most %d SxL pairs (sequences x tokens) separated by commas, got '%s'",
               MAXL, text);
      return -1;
    }
    p->s[p->n] = (int)a;
    p->l[p->n++] = (int)b;
  }
  return 0;
}

/* The machine's ceilings (measured on the H200, shared/design/MACHINES.md):
 * device copy counting read plus write, and bf16 dense GEMM. */
#define COPY_BYTES_PER_S 4.20e12
#define BF16_FLOP_PER_S 742e12

/* The fewest bytes a decode step of B sequences at context ctx must move and
 * the FLOPs it must do (spec §2), for the roofline columns:
 *   bytes: the dense weights once (QKV, O, router, norms: bf16; lm_head: bf16
 *   V x H), the experts the batch selects once (MXFP4: 4.25 bits a weight;
 *   E (1 - (1 - k/E)^B) distinct experts per layer under uniform routing),
 *   each sequence's keys and values (bf16, or fp8 + scales; full layers ctx keys, sliding
 *   layers the window), and the step's KV writes;
 *   flops: 2 x (dense + k experts' weights) per token, plus attention's
 *   2 x 2 x keys x NQ x D per token and layer. */
static int32_t g_kv_dtype; /* --kv-dtype (engine.h kv_dtype) */

static void decode_cost(const tw_model_config_t *c, int B, int ctx, double *bytes,
                        double *flops) {
  /* bytes of one (token, kv head) of K or V: bf16, or fp8 and its f32 scale */
  const double kvb = g_kv_dtype == TW_KV_DTYPE_FP8 ? c->head_dim + 4.0 : c->head_dim * 2.0;
  const double H = c->hidden, I = c->intermediate, D = c->head_dim, NQ = c->n_heads,
               NKV = c->n_kv_heads, E = c->n_experts, k = c->n_experts_per_tok;
  const double dense_l = H * (NQ + 2 * NKV) * D + NQ * D * H + E * H; /* QKV, O, router */
  const double expert = 2 * I * H + H * I;                            /* gate_up + down */
  const double sel = E * (1.0 - pow(1.0 - k / E, (double)B));
  double by = (double)c->vocab_size * H * 2, fl = 2.0 * B * c->vocab_size * H;
  for (int l = 0; l < c->n_layers; l++) {
    const double keys =
        c->layer_types[l] == TW_LAYER_SLIDING && c->sliding_window < ctx ? c->sliding_window : ctx;
    by += dense_l * 2 + sel * expert * 4.25 / 8 + B * keys * 2 * NKV * kvb + B * 2 * NKV * kvb;
    fl += 2.0 * B * (dense_l + k * expert) + 4.0 * B * keys * NQ * D;
  }
  *bytes = by;
  *flops = fl;
}

typedef struct {
  char model[32];
  char kind[16];
  int a, b; /* prefill: tokens, 0; decode: batch, context */
  double t; /* seconds: prefill latency or decode step */
  double yard;
  double bytes, flops; /* decode: the step's floor (decode_cost) */
  int skipped;
} row_t;

static row_t rows[256];
static int n_rows;

static uint32_t rng = 12345u;
static int32_t rand_tok(int V) {
  rng = rng * 1664525u + 1013904223u;
  return (int32_t)((rng >> 8) % (uint32_t)(V < 200000 ? V : 200000));
}

/* Block tables of S sequences of `per` blocks each into table[S * per],
 * distinct blocks: sequence q's first R entries (its window ring, kv_ring.h)
 * are ring blocks q R .., the others blocks after the ring ones; without the
 * ring q per ... false when the pool cannot hold them. */
static bool bench_tables(const tw_kv_layout_t *kv, long S, long per, int32_t *table) {
  long R = kv->ring_blocks, rest = per > R ? per - R : 0, ring = per < R ? per : R;
  if (R ? S * ring > kv->n_ring_blocks || kv->n_ring_blocks + S * rest > kv->n_blocks
        : S * per > kv->n_blocks)
    return false;
  for (long q = 0; table && q < S; q++)
    for (long j = 0; j < per; j++)
      table[q * per + j] = (int32_t)(!R      ? q * per + j
                                     : j < R ? q * R + j
                                             : kv->n_ring_blocks + q * rest + j - R);
  return true;
}

/* Batched prefills of pb_s[i] prompts of pb_l[i] tokens (distinct random
 * tokens per prompt, distinct blocks): the (a') rows. */
static void bench_prefill_batch(const char *name, tw_engine_t *e, const tw_model_t *m,
                                const int *pb_s, const int *pb_l, int n_pb, int reps) {
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
  int bs = kv->block_size, V = m->config.vocab_size, pool = kv->n_blocks;
  for (int i = 0; i < n_pb; i++) {
    int S = pb_s[i], L = pb_l[i], per = (L + bs - 1) / bs;
    row_t *r = &rows[n_rows++];
    snprintf(r->model, sizeof r->model, "%s", name);
    snprintf(r->kind, sizeof r->kind, "prefill-batch");
    r->a = S;
    r->b = L;
    if (!bench_tables(kv, S, per, NULL) || L > m->config.max_position_embeddings) {
      r->skipped = 1;
      printf("[%s] prefill batch %d x %d: skipped (needs %ld KV blocks, pool %d)\n", name, S, L,
             (long)S * per, pool);
      continue;
    }
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)S * L);
    int32_t *table = malloc(sizeof(int32_t) * (size_t)S * per);
    int32_t *first = malloc(sizeof(int32_t) * (size_t)S);
    tw_prefill_seq_t *seqs = malloc(sizeof(tw_prefill_seq_t) * (size_t)S);
    for (long k = 0; k < (long)S * L; k++) toks[k] = rand_tok(V);
    bench_tables(kv, S, per, table);
    for (int q = 0; q < S; q++)
      seqs[q] = (tw_prefill_seq_t){.tokens = toks + (size_t)q * L, .n_tokens = L,
                                   .block_table = table + (size_t)q * per, .n_blocks = per,
                                   .next_token_out = &first[q]};
    tw_prefill_batch_args_t a = {.n_seqs = S, .seqs = seqs};
    double ts[17];
    int n = 0;
    for (int k = 0; k <= reps; k++) { /* k = 0: warm-up (workspace, cuBLASLt heuristics) */
      double t0 = now_s();
      if (tw_engine_prefill_batch(e, &a) != TW_OK) {
        fprintf(stderr, "prefill batch failed: %s\n", tw_last_error());
        r->skipped = 1;
        break;
      }
      if (k > 0) ts[n++] = now_s() - t0;
    }
    if (!r->skipped) {
      r->t = median(ts, n);
      printf("[%s] prefill batch %3d x %6d tokens: %.3f s (%.0f tok/s, median of %d)\n", name, S,
             L, r->t, (double)S * L / r->t, n);
      fflush(stdout);
    }
    free(toks);
    free(table);
    free(first);
    free(seqs);
  }
}

static int32_t g_kv_ring; /* --kv-window-ring (engine.h kv_window_ring) */
static int32_t g_pbf16;   /* --prefill-bf16-experts (engine.h prefill_bf16_experts) */

static void bench_model(const char *name, const tw_model_t *m, const double *yard, const int *pre,
                        int n_pre, const int *pb_s, const int *pb_l, int n_pb, int chunk,
                        const int *bat, int n_bat, const int *ctxs, int n_ctx, int steps,
                        int reps) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CUDA;
  int maxb = 1;
  for (int i = 0; i < n_bat; i++) maxb = bat[i] > maxb ? bat[i] : maxb;
  for (int i = 0; i < n_pb; i++) maxb = pb_s[i] > maxb ? pb_s[i] : maxb;
  p.max_batch = maxb;
  p.kv_window_ring = g_kv_ring;
  p.prefill_bf16_experts = g_pbf16;
  p.kv_dtype = g_kv_dtype;
  /* rings for the largest batch (the engine sizes the rest) whenever the
   * ring is on, by default (0: the cuda backend's default, on) or asked */
  if (tw_kv_ring_wanted(g_kv_ring, true))
    p.kv_ring_blocks = maxb * tw_kv_ring_len(m->config.sliding_window, p.kv_block_size);
  if (chunk > 0) p.max_prefill_chunk = chunk;
  tw_engine_t *e = NULL;
  double t0 = now_s();
  if (tw_engine_create(m, &p, &e) != TW_OK) {
    fprintf(stderr, "%s: engine create failed: %s\n", name, tw_last_error());
    return;
  }
  printf("[%s] engine ready in %.1f s\n", name, now_s() - t0);
  fflush(stdout);
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
  /* the blocks one sequence may have (with the ring: its ring + the others) */
  int bs = kv->block_size, V = m->config.vocab_size,
      pool = kv->n_blocks - (kv->ring_blocks ? kv->n_ring_blocks - kv->ring_blocks : 0);
  int max_tok = 0;
  for (int i = 0; i < n_pre; i++) max_tok = pre[i] > max_tok ? pre[i] : max_tok;
  for (int i = 0; i < n_ctx; i++) max_tok = ctxs[i] + steps + 8 > max_tok ? ctxs[i] + steps + 8 : max_tok;
  int32_t *toks = malloc(sizeof(int32_t) * (size_t)(max_tok > 8192 ? max_tok : 8192));
  int32_t *table = malloc(sizeof(int32_t) * (size_t)pool);
  bench_tables(kv, 1, pool, table);
  for (int i = 0; i < max_tok; i++) toks[i] = rand_tok(V);
  /* warm-up */
  {
    int32_t nt;
    int n = 8192 < max_tok ? 8192 : max_tok;
    tw_prefill_args_t a = {.tokens = toks, .n_tokens = n, .block_table = table,
                           .n_blocks = (n + bs - 1) / bs, .next_token_out = &nt};
    if ((n + bs - 1) / bs <= pool && tw_engine_prefill(e, &a) != TW_OK) /* warm-up */
      fprintf(stderr, "bench: warm-up prefill failed: %s\n", tw_last_error());
  }
  for (int i = 0; i < n_pre; i++) {
    row_t *r = &rows[n_rows++];
    snprintf(r->model, sizeof r->model, "%s", name);
    snprintf(r->kind, sizeof r->kind, "prefill");
    r->a = pre[i];
    r->yard = yard[i < 4 ? i : 3];
    int nb = (pre[i] + bs - 1) / bs;
    if (nb > pool || pre[i] > m->config.max_position_embeddings) {
      r->skipped = 1;
      printf("[%s] prefill %d: skipped (needs %d KV blocks, pool %d)\n", name, pre[i], nb, pool);
      continue;
    }
    double ts[16];
    int nr = pre[i] <= 8192 ? reps : 1;
    for (int k = 0; k < nr; k++) {
      int32_t nt;
      tw_prefill_args_t a = {.tokens = toks, .n_tokens = pre[i], .block_table = table,
                             .n_blocks = nb, .next_token_out = &nt};
      double s = now_s();
      if (tw_engine_prefill(e, &a) != TW_OK) {
        fprintf(stderr, "prefill failed: %s\n", tw_last_error());
        r->skipped = 1;
        break;
      }
      ts[k] = now_s() - s;
    }
    if (r->skipped) continue;
    r->t = median(ts, nr);
    printf("[%s] prefill %6d tokens: %.3f s (%.0f tok/s, median of %d)\n", name, pre[i], r->t,
           pre[i] / r->t, nr);
    fflush(stdout);
  }
  bench_prefill_batch(name, e, m, pb_s, pb_l, n_pb, reps);
  for (int ci = 0; ci < n_ctx; ci++) {
    int ctx = ctxs[ci];
    int per_seq = (ctx + steps + 2 + bs - 1) / bs;
    /* a real context for sequence 0 */
    if (per_seq <= pool) {
      int32_t nt;
      tw_prefill_args_t a = {.tokens = toks, .n_tokens = ctx, .block_table = table,
                             .n_blocks = per_seq, .next_token_out = &nt};
      if (tw_engine_prefill(e, &a) != TW_OK) {
        fprintf(stderr, "bench: prefill of %d tokens failed: %s\n", ctx, tw_last_error());
        continue;
      }
    }
    for (int bi = 0; bi < n_bat; bi++) {
      int B = bat[bi];
      row_t *r = &rows[n_rows++];
      snprintf(r->model, sizeof r->model, "%s", name);
      snprintf(r->kind, sizeof r->kind, "decode");
      r->a = B;
      r->b = ctx;
      decode_cost(&m->config, B, ctx, &r->bytes, &r->flops);
      int32_t *dtab = bench_tables(kv, B, per_seq, NULL)
                          ? malloc(sizeof(int32_t) * (size_t)B * (size_t)per_seq)
                          : NULL;
      if (!dtab) {
        r->skipped = 1;
        printf("[%s] decode batch %d ctx %d: skipped (KV needs %ld blocks, pool %d%s)\n", name, B,
               ctx, (long)B * per_seq, kv->n_blocks,
               kv->ring_blocks ? " and the rings of the sliding layers" : "");
        continue;
      }
      bench_tables(kv, B, per_seq, dtab);
      int32_t *tk = malloc(sizeof(int32_t) * (size_t)B), *pos = malloc(sizeof(int32_t) * (size_t)B);
      int32_t *nbs = malloc(sizeof(int32_t) * (size_t)B), *out = malloc(sizeof(int32_t) * (size_t)B);
      const int32_t **tabs = malloc(sizeof(int32_t *) * (size_t)B);
      for (int s = 0; s < B; s++) {
        tk[s] = rand_tok(V);
        pos[s] = ctx;
        nbs[s] = per_seq;
        tabs[s] = dtab + (size_t)s * per_seq;
      }
      double ts[512];
      int n = 0;
      for (int st = 0; st < steps + 2; st++) {
        tw_decode_args_t d = {.n_seqs = B, .tokens = tk, .positions = pos, .block_tables = tabs,
                              .n_blocks = nbs, .next_tokens_out = out};
        double s = now_s();
        if (tw_engine_decode(e, &d) != TW_OK) {
          fprintf(stderr, "decode failed: %s\n", tw_last_error());
          r->skipped = 1;
          break;
        }
        double dt = now_s() - s;
        if (st >= 2 && n < 512) ts[n++] = dt; /* two warm-up steps: graph capture */
        for (int q = 0; q < B; q++) {
          tk[q] = out[q];
          pos[q]++;
        }
      }
      if (!r->skipped) {
        r->t = median(ts, n);
        const double floor_s = fmax(r->bytes / COPY_BYTES_PER_S, r->flops / BF16_FLOP_PER_S);
        printf("[%s] decode batch %3d ctx %6d: %.3f ms/step, %.1f tok/s/seq, %.0f tok/s/GPU; "
               "%.2f GB, %.2f TFLOP a step: %.0f GB/s, %.0f TFLOP/s, %.0f%% of the %s ceiling\n",
               name, B, ctx, r->t * 1e3, 1.0 / r->t, B / r->t, r->bytes / 1e9, r->flops / 1e12,
               r->bytes / r->t / 1e9, r->flops / r->t / 1e12, 100.0 * floor_s / r->t,
               r->bytes / COPY_BYTES_PER_S >= r->flops / BF16_FLOP_PER_S ? "copy" : "bf16 GEMM");
        fflush(stdout);
      }
      free(tk);
      free(pos);
      free(nbs);
      free(out);
      free(tabs);
      free(dtab);
    }
  }
  free(toks);
  free(table);
  tw_engine_destroy(e);
}

int main(int argc, char **argv) {
  tw_log_init("twain-bench-cuda", 0);
  const char *model_dir = NULL, *syn = "both";
  int_list_t pl = {{8192, 32768, 65536, 128000}, 4}, bl = {{1, 8, 32, 64, 128, 256}, 6},
             cl = {{8192, 32768}, 2};
  pair_list_t pbl = {.n = 0};
  int steps = 20, reps = 3, chunk = 0;
  tw_opt_t opts[] = {
      TW_OPT_STR_FN("model", &model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "a checkpoint instead of synthetic weights;\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_STR("synthetic", &syn, "20b|120b|both", "synthetic gpt-oss shapes"),
      TW_OPT_FN("prefill", &pl, parse_list, "LIST",
                "prefill lengths (default 8192,32768,65536,128000)"),
      TW_OPT_FN("prefill-batch", &pbl, parse_pairs, "SxL,...",
                "batched prefill: S prompts of L tokens"),
      TW_OPT_INT("chunk", &chunk, 0, INT32_MAX, "N", "prefill chunk tokens (0: the engine's)"),
      TW_OPT_FN("batches", &bl, parse_list, "LIST",
                "decode batch sizes (default 1,8,32,64,128,256)"),
      TW_OPT_FN("contexts", &cl, parse_list, "LIST", "decode context lengths (default 8192,32768)"),
      TW_OPT_INT("steps", &steps, 1, 500, "N", "decode steps per point"),
      TW_OPT_INT("reps", &reps, 1, 16, "N", "repetitions (the median is reported)"),
      TW_OPT_FN("kv-window-ring", &g_kv_ring, tw_opts_switch_auto, "0|1|auto",
                "sliding layers keep only their window's KV (auto: on)"),
      TW_OPT_FN("kv-dtype", &g_kv_dtype, tw_kv_dtype_opt, "bf16|fp8",
                "KV cache dtype (fp8: e4m3 with per-head scales)"),
      TW_OPT_FN("prefill-bf16-experts", &g_pbf16, tw_opts_switch_auto, "0|1|auto",
                "a bf16 copy of the MXFP4 experts for the prefill MoE\n"
                "(auto: off here, no memory plan)"),
  };
  tw_opts_spec_t spec = {.prog = "twain-bench-cuda", .description = "CUDA backend prefill and decode throughput.",
                         .env_prefix = "TWAIN_BENCH_CUDA_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0]};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  int *pre = pl.v, n_pre = pl.n, *bat = bl.v, n_bat = bl.n, *ctx = cl.v, n_ctx = cl.n;
  int *pb_s = pbl.s, *pb_l = pbl.l, n_pb = pbl.n;
  {
    const char *pdl = getenv("TWAIN_CUDA_PDL");
    printf("[bench] programmatic dependent launch %s (TWAIN_CUDA_PDL=%s); kernels per decode "
           "step: the 'captured decode graph' lines\n",
           pdl && pdl[0] == '0' ? "off" : "on", pdl ? pdl : "unset");
  }
  static const double y20[4] = {0.239, 1.610, 4.895, 16.037};
  static const double y120[4] = {0.364, 2.421, 7.375, 23.902};
  if (model_dir) {
    tw_model_t *m = NULL;
    if (tw_model_load(model_dir, &m) != TW_OK) {
      fprintf(stderr, "cannot load %s: %s\n", model_dir, tw_last_error());
      return 1;
    }
    bench_model("checkpoint", m, m->config.n_experts > 32 ? y120 : y20, pre, n_pre, pb_s, pb_l,
                n_pb, chunk, bat, n_bat, ctx, n_ctx, steps, reps);
    tw_model_destroy(m);
  } else {
    for (int big = 0; big < 2; big++) {
      if (strcmp(syn, "both") && strcmp(syn, big ? "120b" : "20b")) continue;
      tw_model_config_t c;
      if (tw_config_parse(cfg_json(big), &c) != TW_OK) {
        fprintf(stderr, "config: %s\n", tw_last_error());
        return 1;
      }
      tw_model_t *m = NULL;
      double t0 = now_s();
      if (tw_model_synthetic(&c, 7, &m) != TW_OK) {
        fprintf(stderr, "synthetic: %s\n", tw_last_error());
        return 1;
      }
      printf("[%s] synthetic weights in %.1f s\n", big ? "gpt-oss-120b" : "gpt-oss-20b",
             now_s() - t0);
      bench_model(big ? "gpt-oss-120b" : "gpt-oss-20b", m, big ? y120 : y20, pre, n_pre, pb_s,
                  pb_l, n_pb, chunk, bat, n_bat, ctx, n_ctx, steps, reps);
      tw_model_destroy(m);
    }
  }
  printf("\n| model | run | tokens / batch | context | time | throughput | $/M tokens | vs yardstick "
         "| bytes, FLOPs / step | of ceiling |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (int i = 0; i < n_rows; i++) {
    row_t *r = &rows[i];
    if (r->skipped) {
      printf("| %s | %s | %d | %s | n/a | n/a | n/a | skipped | | |\n", r->model, r->kind, r->a,
             r->b ? "" : "-");
      continue;
    }
    if (!strcmp(r->kind, "prefill-batch")) {
      double cost = PRICE_PER_HOUR / 3600.0 * r->t / ((double)r->a * r->b) * 1e6;
      printf("| %s | prefill batch | %d x %d | - | %.3f s | %.0f tok/s | %.4f | - |\n", r->model,
             r->a, r->b, r->t, (double)r->a * r->b / r->t, cost);
    } else if (!strcmp(r->kind, "prefill")) {
      double cost = PRICE_PER_HOUR / 3600.0 * r->t / r->a * 1e6;
      printf("| %s | prefill | %d | - | %.3f s | %.0f tok/s | %.4f | %.2fx (%.3f s) | | |\n", r->model,
             r->a, r->t, r->a / r->t, cost, r->t / r->yard, r->yard);
    } else {
      double cost = PRICE_PER_HOUR / 3600.0 * r->t / r->a * 1e6;
      double goal = strstr(r->model, "120b") ? 180.0 : 300.0;
      const double fb = r->bytes / COPY_BYTES_PER_S, ff = r->flops / BF16_FLOP_PER_S;
      printf("| %s | decode | %d | %d | %.2f ms/step | %.1f tok/s/seq, %.0f tok/s/GPU | %.3f | %s "
             "| %.2f GB, %.2f TFLOP | %.0f%% (%s) |\n",
             r->model, r->a, r->b, r->t * 1e3, 1.0 / r->t, r->a / r->t, cost,
             r->a == 1 ? (1.0 / r->t >= goal ? "meets b1 goal" : "below b1 goal") : "-",
             r->bytes / 1e9, r->flops / 1e12, 100.0 * fmax(fb, ff) / r->t,
             fb >= ff ? "copy" : "GEMM");
    }
  }
  return 0;
}
