/* mem_plan.c: the memory plan of the workers on one device (mem_plan.h). */
#include "common/engine/mem_plan.h"

#include "common/base/log.h"
#include "common/kv/kv_ring.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* free memory kept aside when this worker's share is checked against it */
#define TW_MEM_FREE_SLACK ((int64_t)256 << 20)

static double tw_gib(int64_t b) { return (double)b / TW_MEM_GIB; }

int64_t tw_mem_weight_bytes(const tw_model_config_t *c, int64_t *mxfp4_p, int64_t *rest_p) {
  int64_t L = c->n_layers, E = c->n_experts, H = c->hidden, I = c->intermediate;
  int64_t V = c->vocab_size, D = c->head_dim, NQ = c->n_heads, NKV = c->n_kv_heads;
  int64_t qkv = (NQ + 2 * NKV) * D;
  /* per layer, not experts: norms, qkv + o (bf16), their biases + sinks +
   * router bias (f32), router (bf16) */
  int64_t layer = 2 * H * 2 + qkv * H * 2 + qkv * 4 + H * NQ * D * 2 + H * 4 + NQ * 4 + E * H * 2 +
                  E * 4;
  int64_t bias = E * 2 * I * 4 + E * H * 4; /* expert biases, f32 */
  int64_t vals = E * 2 * I * H + E * H * I; /* expert weight values */
  int64_t mx = c->mxfp4 ? L * (vals / 2 + vals / 32) : 0;
  int64_t rest = 2 * V * H * 2 + H * 2 + L * (layer + bias) + (c->mxfp4 ? 0 : L * vals * 2);
  if (mxfp4_p) *mxfp4_p = mx;
  if (rest_p) *rest_p = rest;
  return mx + rest;
}

static int32_t tw_mem_buckets(int64_t top, int64_t lo) {
  int32_t n = 1; /* top itself */
  for (int64_t p = lo; p < top; p *= 2) n++;
  return n;
}

static void tw_mem_line(tw_mem_plan_t *p, const char *fmt, ...) {
  if (p->n_lines >= TW_MEM_MAX_LINES) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->lines[p->n_lines++], sizeof p->lines[0], fmt, ap);
  va_end(ap);
}

static int64_t tw_mem_ws(const tw_mem_plan_in_t *in, int32_t b, int32_t chunk) {
  return in->ws_bytes ? in->ws_bytes(in->ws_arg, b, chunk) : 0;
}

/* One decode worker's share `per`: its max batch, workspace + graphs, kv. */
typedef struct {
  int32_t b;
  int64_t ws, graphs, kv;
  int32_t n_graphs;
} tw_mem_dec_t;

/* The KV pool's geometry (kv_ring.h): blocks over the layers that keep every
 * position (blk_full bytes each), ring blocks over the sliding layers
 * (blk_ring each; 0 without the ring), R ring blocks a sequence, rings for
 * ring_seqs sequences per max-batch sequence. */
typedef struct {
  int64_t blk_full, blk_ring;
  int32_t R;
} tw_mem_kv_t;

static int64_t tw_mem_pool_bytes(const tw_mem_kv_t *g, int64_t nb, int64_t nr) {
  return nb * g->blk_full + (g->R ? nr : nb) * g->blk_ring;
}

/* Ring blocks of a pool of nb blocks for `seqs` sequences. */
static int64_t tw_mem_ring_blocks(const tw_mem_kv_t *g, int64_t nb, int64_t seqs) {
  int64_t nr = (int64_t)TW_MEM_RING_SEQS * seqs * g->R;
  return !g->R || nr > nb ? nb : nr;
}

/* The most blocks `bytes` hold with rings for `seqs` sequences. */
static int64_t tw_mem_pool_blocks(const tw_mem_kv_t *g, int64_t bytes, int64_t seqs) {
  if (bytes <= 0) return 0;
  int64_t rings = (int64_t)TW_MEM_RING_SEQS * seqs * g->R;
  if (g->R && bytes >= rings * (g->blk_full + g->blk_ring))
    return (bytes - rings * g->blk_ring) / g->blk_full;
  return bytes / (g->blk_full + g->blk_ring);
}

/* The most token positions `bytes` hold with rings for `seqs` sequences. */
static int64_t tw_mem_pool_tokens(const tw_mem_kv_t *g, int64_t bytes, int64_t seqs,
                                  int32_t block_size) {
  if (bytes <= 0) return 0;
  int64_t rings = (int64_t)TW_MEM_RING_SEQS * seqs * g->R;
  if (g->R && bytes >= rings * (g->blk_full + g->blk_ring))
    return (bytes - rings * g->blk_ring) / (g->blk_full / block_size);
  return bytes / ((g->blk_full + g->blk_ring) / block_size);
}

static tw_mem_dec_t tw_mem_decode_fit(const tw_mem_plan_in_t *in, int64_t per, int64_t seq_bytes,
                                      int32_t cap_b, int32_t max_pos) {
  int32_t fixed = in->role == TW_MEM_ROLE_DECODE ? in->max_batch : 0;
  int32_t ctx_buckets = tw_mem_buckets(max_pos, TW_MEM_GRAPH_CTX_MIN);
  tw_mem_dec_t d = {0, 0, 0, 0, 0};
  /* candidates: the override; else cap_b, then the powers of two below it */
  for (int32_t b = fixed ? fixed : cap_b; b >= 1;) {
    d.b = b;
    d.ws = tw_mem_ws(in, b, b);
    d.n_graphs = in->graph_bytes <= 0 ? 0
                 : in->graph_count ? in->graph_count(in->ws_arg, b)
                                   : tw_mem_buckets(b, 1) * ctx_buckets;
    d.graphs = (int64_t)d.n_graphs * in->graph_bytes;
    d.kv = per - d.ws - d.graphs;
    if (fixed || d.kv >= (int64_t)b * seq_bytes) break;
    int32_t p = 1;
    while (p * 2 < b) p *= 2;
    b = b == 1 ? 0 : p; /* the next power of two below b */
  }
  if (d.kv < 0) d.kv = 0;
  return d;
}

TW_NODISCARD tw_status_t tw_mem_plan(const tw_mem_plan_in_t *in, tw_mem_plan_t *plan_p) {
  if (plan_p) memset(plan_p, 0, sizeof *plan_p);
  if (!in || !plan_p || !in->cfg)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "memory plan: NULL input, plan or model config");
  const tw_model_config_t *c = in->cfg;
  tw_mem_plan_t *p = plan_p;
  double util = in->utilization > 0 ? in->utilization : TW_MEM_DEFAULT_UTILIZATION;
  int32_t np = in->n_prefill, nd = in->n_decode;
  if (np < 0 || nd < 0 || np + nd < 1 || np + nd > 64)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "memory plan: %d prefill + %d decode workers on the device (1 to 64 in all)",
                  np, nd);
  if ((in->role == TW_MEM_ROLE_PREFILL && np < 1) || (in->role == TW_MEM_ROLE_DECODE && nd < 1) ||
      (in->role != TW_MEM_ROLE_PREFILL && in->role != TW_MEM_ROLE_DECODE))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "memory plan: this worker's role (%d) is not among the %d prefill + %d decode "
                  "workers of the device",
                  (int)in->role, np, nd);
  if (in->block_size < 1 || in->kv_elem_bytes < 1 || in->utilization < 0 || util > 1.0 ||
      in->total_bytes <= 0 || c->n_layers < 1 || c->max_position_embeddings < 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "memory plan: block size %d, kv value bytes %d, utilization %.3f (0 < u <= 1), "
                  "device bytes %lld, %d layers, context %d: each must be positive",
                  in->block_size, in->kv_elem_bytes, in->utilization, (long long)in->total_bytes,
                  c->n_layers, c->max_position_embeddings);
  if (in->kv_blocks < 0 || in->max_batch < 0 || in->prefill_tokens < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "memory plan: --kv-blocks %d, --max-batch %d, prefill tokens %d: none may be "
                  "negative (0 = planned)", in->kv_blocks, in->max_batch, in->prefill_tokens);
  int64_t mx = 0, rest = 0, W = in->weight_bytes;
  if (W <= 0) W = tw_mem_weight_bytes(c, &mx, &rest);
  int32_t kvh = in->kv_heads > 0 ? in->kv_heads : c->n_kv_heads;
  /* fp8 (kv_fp8.h): a byte a value plus a 4-byte scale per (token, kv head) */
  int64_t kv_head_tok = in->kv_fp8 ? c->head_dim + 4 : (int64_t)c->head_dim * in->kv_elem_bytes;
  int64_t kv_tok = (int64_t)c->n_layers * 2 * kvh * kv_head_tok;
  /* the window ring (kv_ring.h): the sliding layers hold R blocks a sequence */
  uint64_t ring_mask = in->window_ring ? tw_kv_ring_layer_mask(c) : 0;
  int32_t n_ring_layers = 0;
  for (int32_t l = 0; l < 64; l++) n_ring_layers += (int32_t)((ring_mask >> l) & 1u);
  tw_mem_kv_t g = {.R = ring_mask ? tw_kv_ring_len(c->sliding_window, in->block_size) : 0};
  int64_t lay_blk = kv_tok / c->n_layers * in->block_size; /* one layer's block */
  g.blk_full = lay_blk * (c->n_layers - n_ring_layers);
  g.blk_ring = lay_blk * n_ring_layers;
  int64_t kv_tok_full = g.blk_full / in->block_size; /* what a position costs past the window */
  /* a sequence of TW_MEM_TOKENS_PER_SEQ tokens, its ring included */
  int64_t seq_bytes =
      (int64_t)TW_MEM_TOKENS_PER_SEQ * kv_tok_full +
      (g.R ? (int64_t)g.R * g.blk_ring : (int64_t)TW_MEM_TOKENS_PER_SEQ * (kv_tok - kv_tok_full));
  int32_t max_pos = c->max_position_embeddings;
  int64_t mbps = (max_pos + in->block_size - 1) / in->block_size;
  int32_t copies = in->shared_weights ? 1 : np + nd;
  int64_t reserve = in->process_reserve == 0 ? TW_MEM_PROCESS_RESERVE
                    : in->process_reserve < 0 ? 0 : in->process_reserve;
  int32_t cap_b = in->max_batch_cap > 0 ? in->max_batch_cap : TW_MEM_MAX_BATCH;
  int64_t budget = (int64_t)(util * (double)in->total_bytes);
  int64_t fixed = (int64_t)copies * W + (int64_t)(np + nd) * reserve;
  p->budget_bytes = budget;
  p->weight_bytes = W;
  p->weight_copies = copies;
  if (fixed > budget)
    return tw_err(TW_ERR_NO_MEMORY,
                  "memory plan: the weights (%.2f GiB x %d cop%s) and the runtime reserve "
                  "(%.2f GiB x %d processes) need %.2f GiB, more than the budget of %.2f GiB "
                  "(%.2f of %.2f GiB): use a device with more memory, split the model over more "
                  "devices (--tp/--ep)%s, or raise --gpu-memory-utilization",
                  tw_gib(W), copies, copies == 1 ? "y" : "ies", tw_gib(reserve), np + nd,
                  tw_gib(fixed), tw_gib(budget), util, tw_gib(in->total_bytes),
                  copies > 1 ? ", share one copy of the weights between the workers" : "");
  static const int32_t budgets[] = {TW_MEM_PREFILL_TOKENS, 4096, 2048, 1024};
  int32_t n_try = in->prefill_tokens ? 1 : (int32_t)(sizeof budgets / sizeof budgets[0]);
  int32_t T = 0, pblocks = 0, pring = 0, dring = 0;
  int64_t pws = 0, pkv = 0, left = 0;
  tw_mem_dec_t d = {0, 0, 0, 0, 0};
  int32_t dblocks = 0;
  bool fits = false;
  /* the prefill workers' bf16 copies of the experts (the top of mem_plan.h):
   * asked for, or by the share rule; by the rule only where the plan then fits */
  int64_t pbf_all = (int64_t)np * (in->prefill_bf16_bytes > 0 ? in->prefill_bf16_bytes : 0);
  bool pbf =
      pbf_all > 0 && (in->prefill_bf16 > 0 ||
                      (in->prefill_bf16 == 0 &&
                       (double)pbf_all <= TW_MEM_PREFILL_BF16_SHARE * (double)(budget - fixed)));
  bool retry = pbf && in->prefill_bf16 == 0; /* by the rule: without them if they do not fit */
  for (int pass = 0; pass < (retry ? 2 : 1) && !fits; pass++) {
    if (pass == 1) pbf = false;
    for (int32_t k = 0; k < n_try && !fits; k++) {
      T = in->prefill_tokens ? in->prefill_tokens : budgets[k];
      pws = np ? tw_mem_ws(in, TW_MEM_PREFILL_SEQS, T) + (pbf ? in->prefill_bf16_bytes : 0) : 0;
      left = budget - fixed - (int64_t)np * pws;
      if (left <= 0) continue;
      pkv = 0;
      pblocks = 0;
      if (np) { /* one full-context prompt + a batch in flight, within [2 T, left / 8] */
        int64_t want = (int64_t)max_pos + T, lo = 2 * (int64_t)T;
        int64_t share = tw_mem_pool_tokens(&g, left / 8 / np, TW_MEM_PREFILL_SEQS, in->block_size);
        int64_t tok = want < (share > lo ? share : lo) ? want : (share > lo ? share : lo);
        int64_t nb = (tok + in->block_size - 1) / in->block_size;
        if (in->kv_cap_bytes > 0 &&
            tw_mem_pool_bytes(&g, nb, tw_mem_ring_blocks(&g, nb, TW_MEM_PREFILL_SEQS)) >
                in->kv_cap_bytes)
          nb = tw_mem_pool_blocks(&g, in->kv_cap_bytes, TW_MEM_PREFILL_SEQS);
        if (nb > INT32_MAX / in->block_size) nb = INT32_MAX / in->block_size;
        pblocks = (int32_t)nb;
        pring = (int32_t)tw_mem_ring_blocks(&g, nb, TW_MEM_PREFILL_SEQS);
        pkv = tw_mem_pool_bytes(&g, nb, pring);
      }
      int64_t rem = left - (int64_t)np * pkv;
      if (rem < 0) continue;
      if (!nd) {
        fits = pblocks >= 1;
        break;
      }
      d = tw_mem_decode_fit(in, rem / nd, seq_bytes, cap_b, max_pos);
      int64_t nb = tw_mem_pool_blocks(&g, d.kv, d.b);
      if (nb > (int64_t)d.b * mbps) nb = (int64_t)d.b * mbps; /* every sequence at full context */
      if (in->kv_cap_bytes > 0 &&
          tw_mem_pool_bytes(&g, nb, tw_mem_ring_blocks(&g, nb, d.b)) > in->kv_cap_bytes)
        nb = tw_mem_pool_blocks(&g, in->kv_cap_bytes, d.b);
      if (nb > INT32_MAX / in->block_size) nb = INT32_MAX / in->block_size;
      dblocks = (int32_t)nb;
      dring = (int32_t)tw_mem_ring_blocks(&g, nb, d.b);
      fits = (int64_t)dblocks * in->block_size >= TW_MEM_MIN_DECODE_TOKENS;
    }
  }
  if (!fits)
    return tw_err(TW_ERR_NO_MEMORY,
                  "memory plan: after the weights (%.2f GiB x %d cop%s), the runtime reserve and "
                  "the workspaces%s, the budget of %.2f GiB (%.2f of %.2f GiB) leaves no KV pool "
                  "of %d tokens per decode worker (%d prefill + %d decode workers, %.1f KiB of KV "
                  "a token): use a device with more memory, fewer workers on it, --tp/--ep, or "
                  "raise --gpu-memory-utilization%s",
                  tw_gib(W), copies, copies == 1 ? "y" : "ies",
                  pbf ? " (with a bf16 copy of the experts in each prefill worker)" : "",
                  tw_gib(budget), util, tw_gib(in->total_bytes), TW_MEM_MIN_DECODE_TOKENS, np, nd,
                  kv_tok / 1024.0, pbf ? ", or --prefill-bf16-experts 0" : "");
  p->prefill_kv_blocks = pblocks;
  p->prefill_kv_bytes = pkv;
  p->decode_kv_blocks = dblocks;
  p->prefill_kv_ring_blocks = pring;
  p->decode_kv_ring_blocks = dring;
  p->decode_kv_bytes = tw_mem_pool_bytes(&g, dblocks, dring);
  p->decode_max_batch = d.b;
  p->prefill_bf16 = pbf;
  p->prefill_bf16_bytes = pbf ? in->prefill_bf16_bytes : 0;
  p->unplanned_bytes = left - (int64_t)np * pkv -
                       (nd ? (int64_t)nd * (d.ws + d.graphs + p->decode_kv_bytes) : 0);
  if (p->unplanned_bytes < 0) p->unplanned_bytes = 0;
  bool pre = in->role == TW_MEM_ROLE_PREFILL;
  p->max_batch = pre ? TW_MEM_PREFILL_SEQS : d.b;
  p->prefill_tokens = pre ? T : d.b;
  p->kv_blocks = pre ? pblocks : dblocks;
  p->kv_ring_blocks = pre ? pring : dring;
  int32_t seqs = pre ? TW_MEM_PREFILL_SEQS : d.b; /* whose rings this worker's pool holds */
  p->workspace_bytes = pre ? pws : d.ws + d.graphs;
  /* the lines */
  if (mx || rest)
    tw_mem_line(p, "memory plan: device %.2f GiB, budget %.2f GiB (utilization %.2f); %d prefill + "
                "%d decode workers on it; weights %.2f GiB (MXFP4 experts %.2f, bf16/f32 rest "
                "%.2f) x %d cop%s", tw_gib(in->total_bytes), tw_gib(budget), util, np, nd,
                tw_gib(W), tw_gib(mx), tw_gib(rest), copies, copies == 1 ? "y" : "ies");
  else
    tw_mem_line(p, "memory plan: device %.2f GiB, budget %.2f GiB (utilization %.2f); %d prefill + "
                "%d decode workers on it; weights %.2f GiB as loaded x %d cop%s%s",
                tw_gib(in->total_bytes), tw_gib(budget), util, np, nd, tw_gib(W), copies,
                copies == 1 ? "y" : "ies",
                copies == 1 && np + nd > 1 ? " (shared by the workers)" : "");
  char rs[128] = "no runtime reserve";
  if (reserve)
    snprintf(rs, sizeof rs, "runtime reserve %.2f GiB x %d processes (context, cuBLAS, allocator "
             "slack)", tw_gib(reserve), np + nd);
  char kvd[64];
  if (in->kv_fp8)
    snprintf(kvd, sizeof kvd, "fp8: %d x 1 + 4 scale", c->head_dim);
  else
    snprintf(kvd, sizeof kvd, "%s: %d x %d", in->kv_elem_bytes == 4 ? "f32" : "bf16", c->head_dim,
             in->kv_elem_bytes);
  tw_mem_line(p,
              "memory plan: %s; KV %.1f KiB a token (%d layers x %d kv heads x 2 x (%s) "
              "bytes), blocks of %d tokens",
              rs, kv_tok / 1024.0, c->n_layers, kvh, kvd, in->block_size);
  if (g.R)
    tw_mem_line(p,
                "memory plan: window ring: %d sliding layers keep %d blocks a sequence (window "
                "%d), so past it a token costs %.1f KiB",
                n_ring_layers, g.R, c->sliding_window, kv_tok_full / 1024.0);
  if (np) {
    char bf[160] = "";
    if (pbf)
      snprintf(bf, sizeof bf, " (of it %.2f GiB: a bf16 copy of the experts for the prefill MoE)",
               tw_gib(in->prefill_bf16_bytes));
    else if (pbf_all > 0 && in->prefill_bf16 == 0)
      snprintf(bf, sizeof bf,
               " (no bf16 copy of the experts: %.2f GiB a worker is over %.0f%% of "
               "the %.2f GiB after the weights, or leaves no decode pool)",
               tw_gib(in->prefill_bf16_bytes), 100.0 * TW_MEM_PREFILL_BF16_SHARE,
               tw_gib(budget - fixed));
    tw_mem_line(p,
                "memory plan: each prefill worker: token budget %d, workspace %.2f GiB%s, kv "
                "pool %.2f GiB = %d blocks (%lld tokens: prompts until their handoff)",
                T, tw_gib(pws), bf, tw_gib(pkv), pblocks, (long long)pblocks * in->block_size);
  }
  if (nd)
    tw_mem_line(p, "memory plan: each decode worker: max batch %d, workspace %.2f GiB + %d decode "
                "graphs %.2f GiB, kv pool %.2f GiB = %d blocks (%lld tokens, %lld a sequence at "
                "max batch)", d.b, tw_gib(d.ws), d.n_graphs, tw_gib(d.graphs),
                tw_gib(p->decode_kv_bytes), dblocks, (long long)dblocks * in->block_size,
                (long long)dblocks * in->block_size / d.b);
  tw_mem_line(p, "memory plan: %.2f GiB of the budget left unplanned, %.2f GiB outside it",
              tw_gib(p->unplanned_bytes), tw_gib(in->total_bytes - budget));
  if (nd && (int64_t)dblocks * in->block_size < max_pos)
    tw_mem_line(p, "memory plan: warning: a decode kv pool holds %lld tokens, less than one "
                "sequence of the full context (%d)%s", (long long)dblocks * in->block_size,
                max_pos, copies > 1 ? ": sharing one copy of the weights would add the other "
                "copies to it" : "");
  /* this worker's share against what is free now */
  if (in->free_bytes > 0 && !in->kv_blocks) {
    int64_t room = in->free_bytes - TW_MEM_FREE_SLACK - p->workspace_bytes;
    int64_t want_bytes = tw_mem_pool_bytes(&g, p->kv_blocks, p->kv_ring_blocks);
    if (room < want_bytes) {
      int32_t nb = room > 0 ? (int32_t)tw_mem_pool_blocks(&g, room, seqs) : 0;
      int64_t min_tok = pre ? T : TW_MEM_MIN_DECODE_TOKENS;
      if ((int64_t)nb * in->block_size < min_tok) {
        tw_status_t st = tw_err(TW_ERR_NO_MEMORY,
                                "memory plan: only %.2f GiB of the device is free, this %s worker "
                                "needs %.2f GiB (workspace %.2f + kv pool %.2f): another process "
                                "uses the device, or lower --gpu-memory-utilization on the others",
                                tw_gib(in->free_bytes), pre ? "prefill" : "decode",
                                tw_gib(p->workspace_bytes + want_bytes), tw_gib(p->workspace_bytes),
                                tw_gib(want_bytes));
        memset(p, 0, sizeof *p);
        return st;
      }
      tw_mem_line(p, "memory plan: only %.2f GiB free now (another process on the device?): this "
                  "worker's kv pool cut from %d to %d blocks", tw_gib(in->free_bytes),
                  p->kv_blocks, nb);
      p->kv_blocks = nb;
      p->kv_ring_blocks = (int32_t)tw_mem_ring_blocks(&g, nb, seqs);
    }
  }
  if (in->kv_blocks) {
    p->kv_blocks = in->kv_blocks;
    p->kv_ring_blocks = (int32_t)tw_mem_ring_blocks(&g, in->kv_blocks, seqs);
  }
  p->kv_bytes = tw_mem_pool_bytes(&g, p->kv_blocks, p->kv_ring_blocks);
  tw_mem_line(p, "memory plan: this %s worker: kv pool %d blocks (%.2f GiB)%s, max batch %d%s, "
              "prefill token budget %d%s", pre ? "prefill" : "decode", p->kv_blocks,
              tw_gib(p->kv_bytes), in->kv_blocks ? " from --kv-blocks" : "", p->max_batch,
              !pre && in->max_batch ? " from --max-batch" : "", p->prefill_tokens,
              pre && in->prefill_tokens ? " as given" : "");
  return TW_OK;
}

void tw_mem_plan_log(const tw_mem_plan_t *plan, const char *subsys) {
  for (int i = 0; i < plan->n_lines; i++) TW_INFO(subsys, "%s", plan->lines[i]);
}

TW_NODISCARD tw_status_t tw_mem_parse_utilization(const char *s, double *out_p) {
  char *end = NULL;
  errno = 0;
  double v = s ? strtod(s, &end) : 0;
  if (!s || errno || end == s || *end || !(v > 0 && v <= 1.0))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "--gpu-memory-utilization %s: want a fraction of the device in (0, 1], e.g. 0.90",
                  s ? s : "(none)");
  *out_p = v;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_mem_parse_colocated(const char *s, int32_t *n_prefill_p,
                                                int32_t *n_decode_p) {
  int a = -1, b = -1, n = 0;
  if (!s || sscanf(s, "%d,%d%n", &a, &b, &n) != 2 || s[n] || a < 0 || b < 0 || a > 64 || b > 64 ||
      a + b < 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "--colocated %s: want P,D, the prefill and decode workers on this device (this "
                  "one included), e.g. 1,1", s ? s : "(none)");
  *n_prefill_p = a;
  *n_decode_p = b;
  return TW_OK;
}

int tw_mem_colocated_opt(const char *text, void *dst, char *err, size_t errlen) {
  const tw_mem_colocated_t *c = dst;
  if (tw_mem_parse_colocated(text, c->n_prefill, c->n_decode) == TW_OK) return 0;
  snprintf(err, errlen, "%s", tw_last_error());
  return -1;
}
