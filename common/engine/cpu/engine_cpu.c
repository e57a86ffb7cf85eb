/* engine_cpu.c: the CPU backend of engine.h, the float32 reference of the
 * gpt-oss forward pass (spec §2).
 *
 * One forward runs a batch of T tokens, each with its own position and block
 * table: a prefill pass (consecutive positions of one or more sequences,
 * concatenated) or a decode step (one token of each of T sequences). Per layer it writes all T tokens'
 * K/V into the pool first, then attends; causality comes from each token
 * reading only positions <= its own, so the two cases share one code path.
 * Weights are read in place from the model mmap (cpu_ops.h); activations,
 * the residual stream and the KV pool are float32. MoE runs expert by
 * expert over the tokens routed to it, so each expert's weights are read
 * once per forward. With the window ring (engine.h, kv_ring.h) a sliding
 * layer's tokens read and write through a second table per token: in a
 * decode step a view of its ring, in a prefill pass its segment's scratch
 * table (the ring blocks copied in first, the last ones copied back after
 * the write). Scratch buffers grow to the largest batch seen. One
 * call at a time per engine (the scratch and the thread pool are shared). */
#include "common/engine/engine_impl.h"

#include "common/base/log.h"
#include "common/engine/cpu/cpu_ops.h"
#include "common/engine/cpu/engine_cpu_tp.h"
#include "common/kv/kv_ring.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define TW_CPU_KV_CAP_BYTES (1ll << 30) /* default pool: at most 1 GiB */
/* planned max batch: a cpu decode step costs in proportion to its rows */
#define TW_CPU_MAX_BATCH 64

typedef struct {
  tw_cpu_pool_t *pool;
  double *inv_freq;     /* [D/2] */
  double concentration;
  float *sinks;         /* [L][NQ] f32 copy (small) */
  float *kv_pool;       /* mmap, kv.total_bytes */
  /* scratch, sized for cap_tokens tokens */
  int64_t cap_tokens;
  float *x, *xn, *q, *k, *v, *attn, *proj; /* [T,H] [T,H] [T,NQ*D] [T,NKV*D] x2 [T,NQ*D] [T,H] */
  float *rope_cos, *rope_sin;               /* [T, D/2] */
  float *router;                            /* [T, E] */
  int32_t *topk_idx;                        /* [T, k] */
  float *topk_w;                            /* [T, k] */
  int32_t *exp_tok;                         /* [T] tokens routed to the current expert */
  float *exp_w;                             /* [T] their weights */
  float *xe, *ue, *ae, *ye;                 /* [T,H] [T,2I] [T,I] [T,H] */
  const int32_t **tables;                   /* [T] block table per token */
  const int32_t **rtables;                  /* [T] ring layers' table per token (kv_ring.h) */
  int32_t *views;                           /* decode: the ring views of the tables */
  int64_t cap_views;
  tw_kv_ring_pass_t ring; /* prefill: the pass's ring plan */
  float *ring_scratch;    /* prefill: its scratch blocks of one layer */
  int64_t cap_scratch;    /* blocks */
  bool ring_prefill;      /* the running forward is a planned pass */
  int64_t cap_logits_rows;
  float *logits;                            /* [rows, V] when the caller gives none */
  float *scores;                            /* [n_threads, max_pos] */
  float *sample_scratch;                    /* [2V] */
  tw_cpu_tp_t tp;                           /* this rank's heads/experts/vocab (issue 6) */
  const tw_prefill_pass_t *layer_cb;        /* prefill: on_pass_layer after each KV write */
  /* the running decode step's tw_decode_args_t.while_running, called once
   * per layer (NULL outside a decode step) */
  void (*while_running)(void *arg);
  void *while_running_arg;
} tw_cpu_state_t;

/* ---- model checks ---------------------------------------------------------- */

static TW_NODISCARD tw_status_t tw_cpu_check_tensor(const tw_tensor_t *t, tw_dtype_t dtype,
                                                    const char *name, int32_t layer) {
  if (!t->data)
    return tw_err(TW_ERR_NOT_FOUND, "cpu engine: layer %d: tensor %s is absent", layer, name);
  if (t->dtype != dtype)
    return tw_err(TW_ERR_UNSUPPORTED, "cpu engine: layer %d: tensor %s is %s, expected %s", layer,
                  name, tw_dtype_name(t->dtype), tw_dtype_name(dtype));
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_cpu_check_model(const tw_model_t *m) {
  const tw_model_config_t *c = &m->config;
  TW_CHECK(tw_cpu_check_tensor(&m->embed, TW_DTYPE_BF16, "embed_tokens", -1));
  TW_CHECK(tw_cpu_check_tensor(&m->final_norm, TW_DTYPE_BF16, "norm", -1));
  TW_CHECK(tw_cpu_check_tensor(&m->lm_head, TW_DTYPE_BF16, "lm_head", -1));
  if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "cpu engine: n_heads %d / n_kv_heads %d / head_dim %d",
                  c->n_heads, c->n_kv_heads, c->head_dim);
  for (int32_t l = 0; l < c->n_layers; l++) {
    const tw_layer_weights_t *w = &m->layers[l];
    const struct { const tw_tensor_t *t; const char *name; } bf16[] = {
        {&w->attn_norm, "input_layernorm"}, {&w->q_w, "q_proj.weight"}, {&w->q_b, "q_proj.bias"},
        {&w->k_w, "k_proj.weight"},         {&w->k_b, "k_proj.bias"},   {&w->v_w, "v_proj.weight"},
        {&w->v_b, "v_proj.bias"},           {&w->o_w, "o_proj.weight"}, {&w->o_b, "o_proj.bias"},
        {&w->mlp_norm, "post_attention_layernorm"}, {&w->router_w, "router.weight"},
        {&w->router_b, "router.bias"},      {&w->gate_up_bias, "gate_up_proj_bias"},
        {&w->down_bias, "down_proj_bias"}};
    for (size_t i = 0; i < sizeof(bf16) / sizeof(bf16[0]); i++)
      TW_CHECK(tw_cpu_check_tensor(bf16[i].t, TW_DTYPE_BF16, bf16[i].name, l));
    if (!w->sinks.data || (w->sinks.dtype != TW_DTYPE_BF16 && w->sinks.dtype != TW_DTYPE_F32))
      return tw_err(TW_ERR_UNSUPPORTED, "cpu engine: layer %d: sinks absent or not bf16/f32", l);
    if (w->experts_format == TW_EXPERTS_MXFP4) {
      TW_CHECK(tw_cpu_check_tensor(&w->gate_up_blocks, TW_DTYPE_U8, "gate_up_proj_blocks", l));
      TW_CHECK(tw_cpu_check_tensor(&w->gate_up_scales, TW_DTYPE_U8, "gate_up_proj_scales", l));
      TW_CHECK(tw_cpu_check_tensor(&w->down_blocks, TW_DTYPE_U8, "down_proj_blocks", l));
      TW_CHECK(tw_cpu_check_tensor(&w->down_scales, TW_DTYPE_U8, "down_proj_scales", l));
      if (c->hidden % 32 != 0 || c->intermediate % 32 != 0)
        return tw_err(TW_ERR_INVALID_ARGUMENT,
                      "cpu engine: MXFP4 needs hidden %d and intermediate %d multiples of 32",
                      c->hidden, c->intermediate);
    } else {
      TW_CHECK(tw_cpu_check_tensor(&w->gate_up, TW_DTYPE_BF16, "gate_up_proj", l));
      TW_CHECK(tw_cpu_check_tensor(&w->down, TW_DTYPE_BF16, "down_proj", l));
    }
  }
  return TW_OK;
}

/* ---- scratch --------------------------------------------------------------- */

static void tw_cpu_scratch_free(tw_cpu_state_t *s) {
  float **fs[] = {&s->x, &s->xn, &s->q, &s->k, &s->v, &s->attn, &s->proj, &s->rope_cos,
                  &s->rope_sin, &s->router, &s->topk_w, &s->exp_w, &s->xe, &s->ue, &s->ae, &s->ye};
  for (size_t i = 0; i < sizeof(fs) / sizeof(fs[0]); i++) {
    free(*fs[i]);
    *fs[i] = NULL;
  }
  free(s->topk_idx);
  free(s->exp_tok);
  free((void *)s->tables);
  free((void *)s->rtables);
  s->topk_idx = NULL;
  s->exp_tok = NULL;
  s->tables = NULL;
  s->rtables = NULL;
  s->cap_tokens = 0;
}

static TW_NODISCARD tw_status_t tw_cpu_scratch_ensure(const tw_engine_t *e, tw_cpu_state_t *s,
                                                      int64_t T) {
  if (T <= s->cap_tokens) return TW_OK;
  const tw_model_config_t *c = &e->model->config;
  tw_cpu_scratch_free(s);
  size_t t = (size_t)T, f = sizeof(float);
  size_t H = (size_t)c->hidden, QD = (size_t)c->n_heads * c->head_dim;
  size_t KD = (size_t)c->n_kv_heads * c->head_dim, I = (size_t)c->intermediate;
  size_t k = (size_t)c->n_experts_per_tok;
  s->x = malloc(t * H * f);
  s->xn = malloc(t * H * f);
  s->q = malloc(t * QD * f);
  s->k = malloc(t * KD * f);
  s->v = malloc(t * KD * f);
  s->attn = malloc(t * QD * f);
  s->proj = malloc(t * H * f);
  s->rope_cos = malloc(t * (size_t)(c->head_dim / 2) * f);
  s->rope_sin = malloc(t * (size_t)(c->head_dim / 2) * f);
  s->router = malloc(t * (size_t)c->n_experts * f);
  s->topk_idx = malloc(t * k * sizeof(int32_t));
  s->topk_w = malloc(t * k * f);
  s->exp_tok = malloc(t * sizeof(int32_t));
  s->exp_w = malloc(t * f);
  s->xe = malloc(t * H * f);
  s->ue = malloc(t * 2 * I * f);
  s->ae = malloc(t * I * f);
  s->ye = malloc(t * H * f);
  s->tables = malloc(t * sizeof(*s->tables));
  s->rtables = malloc(t * sizeof(*s->rtables));
  if (!s->rtables || !s->x || !s->xn || !s->q || !s->k || !s->v || !s->attn || !s->proj ||
      !s->rope_cos || !s->rope_sin || !s->router || !s->topk_idx || !s->topk_w || !s->exp_tok ||
      !s->exp_w || !s->xe || !s->ue || !s->ae || !s->ye || !s->tables) {
    tw_cpu_scratch_free(s);
    return tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory for the scratch of %lld tokens",
                  (long long)T);
  }
  s->cap_tokens = T;
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_cpu_logits_ensure(const tw_engine_t *e, tw_cpu_state_t *s,
                                                     int64_t rows) {
  if (rows <= s->cap_logits_rows) return TW_OK;
  float *p = realloc(s->logits, sizeof(float) * (size_t)rows * (size_t)e->model->config.vocab_size);
  if (!p) return tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory for %lld logits rows",
                        (long long)rows);
  s->logits = p;
  s->cap_logits_rows = rows;
  return TW_OK;
}

/* ---- parallel attention ------------------------------------------------------ */

typedef struct {
  const tw_engine_t *e;
  tw_cpu_state_t *s;
  tw_cpu_kv_view_t kv;
  int64_t T;
  const int32_t *positions;
  const int32_t *const *tables; /* [T] the table each token reads through */
  int32_t window;
  const float *sinks;
} tw_cpu_attn_ctx_t;

static void tw_cpu_attn_task(void *ctx_v, int ti, int nt) {
  const tw_cpu_attn_ctx_t *a = ctx_v;
  const tw_model_config_t *c = &a->e->model->config;
  /* (token, head) items dealt round-robin: in a prefill chunk later tokens
   * attend to more keys, so contiguous shares would be unbalanced */
  const int32_t nh = a->s->tp.sh.nq; /* this rank's query heads */
  int64_t items = a->T * nh;
  float *scores = a->s->scores + (int64_t)ti * c->max_position_embeddings;
  int64_t QD = (int64_t)nh * c->head_dim;
  float scale = 1.0f / sqrtf((float)c->head_dim);
  for (int64_t i = ti; i < items; i += nt) {
    int64_t t = i / nh;
    int32_t h = (int32_t)(i % nh);
    tw_cpu_attention(a->s->q + t * QD, nh, h, h + 1, &a->kv, a->tables[t], a->positions[t],
                     a->window, a->sinks, scale, scores, a->s->attn + t * QD);
  }
}

/* ---- the forward pass --------------------------------------------------------- */

static void tw_cpu_moe(const tw_engine_t *e, tw_cpu_state_t *s, const tw_layer_weights_t *w,
                       int64_t T) {
  const tw_model_config_t *c = &e->model->config;
  const int64_t H = c->hidden, E = c->n_experts, k = c->n_experts_per_tok;
  tw_cpu_matmul_bf16(s->pool, s->xn, T, H, w->router_w.data, w->router_b.data, E, s->router);
  for (int64_t t = 0; t < T; t++)
    tw_cpu_router_topk(s->router + t * E, (int32_t)E, (int32_t)k, s->topk_idx + t * k,
                       s->topk_w + t * k);
  const tw_cpu_experts_t ex = {.hidden = H,
                               .intermediate = c->intermediate,
                               .mxfp4 = w->experts_format == TW_EXPERTS_MXFP4,
                               .gate_up_blocks = w->gate_up_blocks.data,
                               .gate_up_scales = w->gate_up_scales.data,
                               .down_blocks = w->down_blocks.data,
                               .down_scales = w->down_scales.data,
                               .gate_up = w->gate_up.data,
                               .down = w->down.data,
                               .gate_up_bias = w->gate_up_bias.data,
                               .down_bias = w->down_bias.data,
                               .swiglu_alpha = c->swiglu_alpha,
                               .swiglu_limit = c->swiglu_limit};
  const tw_cpu_moe_scratch_t scratch = {
      .tok = s->exp_tok, .w = s->exp_w, .xe = s->xe, .ue = s->ue, .ae = s->ae, .ye = s->ye};
  /* this rank's experts (all of them at EP 1; engine_cpu_tp.h) */
  tw_cpu_moe_experts(s->pool, &ex, s->tp.sh.e0, s->tp.sh.e1, s->xn, T, (int32_t)k, s->topk_idx,
                     s->topk_w, &scratch, s->proj);
}

/* Exchange the MoE buffers of the state with b (data-parallel attention runs
 * the MoE over every rank's tokens in tp.all, engine_cpu_tp.h). */
static void tw_cpu_moe_bufs_swap(tw_cpu_state_t *s, tw_cpu_moe_bufs_t *b) {
#define TW_SWAP(f)      \
  do {                  \
    void *t_ = (void *)s->f; \
    s->f = b->f;        \
    b->f = t_;          \
  } while (0)
  TW_SWAP(xn);
  TW_SWAP(proj);
  TW_SWAP(router);
  TW_SWAP(topk_idx);
  TW_SWAP(topk_w);
  TW_SWAP(exp_tok);
  TW_SWAP(exp_w);
  TW_SWAP(xe);
  TW_SWAP(ue);
  TW_SWAP(ae);
  TW_SWAP(ye);
#undef TW_SWAP
}

/* Run T tokens; write the logits of tokens rows[0..n_rows) to logits[n_rows, V]. */
static TW_NODISCARD tw_status_t tw_cpu_forward(tw_engine_t *e, int64_t T, const int32_t *tokens,
                                               const int32_t *positions, const int32_t *rows,
                                               int64_t n_rows, float *logits) {
  tw_cpu_state_t *s = e->backend;
  const tw_model_t *m = e->model;
  const tw_model_config_t *c = &m->config;
  const int64_t H = c->hidden, D = c->head_dim, half = D / 2;
  /* this rank's heads (all of them at TP 1); engine_cpu_tp.h */
  const int64_t QD = (int64_t)s->tp.sh.nq * D, KD = (int64_t)s->tp.sh.nkv * D;
  const int64_t QDall = (int64_t)c->n_heads * D, q0 = s->tp.sh.q0 * D, k0 = s->tp.sh.kv0 * D;
  const uint16_t *embed = m->embed.data;
  for (int64_t t = 0; t < T; t++) {
    const uint16_t *row = embed + (int64_t)tokens[t] * H;
    for (int64_t i = 0; i < H; i++) s->x[t * H + i] = tw_bf16_to_f32(row[i]);
    tw_cpu_rope_table(s->inv_freq, (int32_t)half, s->concentration, positions[t],
                      s->rope_cos + t * half, s->rope_sin + t * half);
  }
  for (int32_t l = 0; l < c->n_layers; l++) {
    const tw_layer_weights_t *w = &m->layers[l];
    if (s->while_running) s->while_running(s->while_running_arg);
    tw_cpu_rmsnorm(s->x, T, H, w->attn_norm.data, c->rms_norm_eps, s->xn);
    const uint16_t *qw = w->q_w.data, *qb = w->q_b.data, *kw = w->k_w.data, *kb = w->k_b.data;
    const uint16_t *vw = w->v_w.data, *vb = w->v_b.data, *ow = w->o_w.data;
    tw_cpu_matmul_bf16(s->pool, s->xn, T, H, qw + q0 * H, qb + q0, QD, s->q);
    tw_cpu_matmul_bf16(s->pool, s->xn, T, H, kw + k0 * H, kb + k0, KD, s->k);
    tw_cpu_matmul_bf16(s->pool, s->xn, T, H, vw + k0 * H, vb + k0, KD, s->v);
    /* ring layers (kv_ring.h): decode through the ring views, a prefill pass
     * through its scratch, the ring blocks of earlier positions copied in */
    bool ring = tw_kv_is_ring_layer(e->kv.ring_layers, e->kv.ring_blocks, l);
    char *lbase = (char *)s->kv_pool + tw_kv_layer_offset(&e->kv, l);
    char *scratch = (char *)s->ring_scratch;
    const int64_t bb = e->kv.block_bytes;
    tw_cpu_attn_ctx_t a = {.e = e,
                           .s = s,
                           .T = T,
                           .positions = positions,
                           .tables = ring ? s->rtables : s->tables,
                           .sinks = s->sinks + (int64_t)l * c->n_heads + s->tp.sh.q0,
                           .window = c->layer_types[l] == TW_LAYER_SLIDING ? c->sliding_window : 0,
                           .kv = {.layer_base = ring && s->ring_prefill ? scratch : lbase,
                                  .block_size = e->kv.block_size,
                                  .n_kv_heads = s->tp.sh.nkv,
                                  .head_dim = (int32_t)D,
                                  .fp8 = e->kv.dtype == TW_DTYPE_F8_E4M3}};
    if (ring && s->ring_prefill)
      for (int32_t i = 0; i < s->ring.n_in; i++)
        memcpy(scratch + s->ring.copy_in[2 * i + 1] * bb, lbase + s->ring.copy_in[2 * i] * bb,
               (size_t)bb);
    for (int64_t t = 0; t < T; t++) {
      tw_cpu_rope_apply(s->q + t * QD, s->tp.sh.nq, (int32_t)D, s->rope_cos + t * half,
                        s->rope_sin + t * half);
      tw_cpu_rope_apply(s->k + t * KD, s->tp.sh.nkv, (int32_t)D, s->rope_cos + t * half,
                        s->rope_sin + t * half);
      for (int32_t g = 0; g < s->tp.sh.nkv; g++) { /* K post-RoPE (§2.5) */
        tw_cpu_kv_write(&a.kv, a.tables[t], positions[t], 0, g, s->k + t * KD + g * D);
        tw_cpu_kv_write(&a.kv, a.tables[t], positions[t], 1, g, s->v + t * KD + g * D);
      }
    }
    if (ring && s->ring_prefill) /* the last blocks back into the ring */
      for (int32_t i = 0; i < s->ring.n_out; i++)
        memcpy(lbase + s->ring.copy_out[2 * i + 1] * bb, scratch + s->ring.copy_out[2 * i] * bb,
               (size_t)bb);
    if (s->layer_cb && s->layer_cb->on_pass_layer) /* this layer's K/V of the pass is final */
      s->layer_cb->on_pass_layer(s->layer_cb->on_pass_arg, l);
    tw_cpu_pool_run(s->pool, tw_cpu_attn_task, &a);
    /* row-parallel: this rank's columns of o_proj, bias once (rank 0), then the sum */
    tw_cpu_matmul_bf16_ld(s->pool, s->attn, T, QD, ow + q0, QDall,
                          s->tp.sh.tp_rank == 0 ? w->o_b.data : NULL, H, s->proj);
    TW_CHECK(tw_cpu_tp_reduce_attn(&s->tp, s->proj, T * H));
    for (int64_t i = 0; i < T * H; i++) s->x[i] += s->proj[i];
    tw_cpu_rmsnorm(s->x, T, H, w->mlp_norm.data, c->rms_norm_eps, s->xn);
    if (s->tp.sh.dp_attention) { /* dp attention: the MoE over every rank's tokens, then our rows */
      TW_CHECK(tw_cpu_tp_dp_gather(&s->tp, c, s->xn, T));
      tw_cpu_moe_bufs_swap(s, &s->tp.all);
      tw_cpu_moe(e, s, w, s->tp.t_total);
      tw_cpu_moe_bufs_swap(s, &s->tp.all);
      TW_CHECK(tw_cpu_tp_dp_combine(&s->tp, H, s->proj, T));
    } else {
      tw_cpu_moe(e, s, w, T);
      TW_CHECK(tw_cpu_tp_reduce_moe(&s->tp, s->proj, T * H));
    }
    for (int64_t i = 0; i < T * H; i++) s->x[i] += s->proj[i];
  }
  if (n_rows > 0) {
    for (int64_t r = 0; r < n_rows; r++)
      memcpy(s->xe + r * H, s->x + (int64_t)rows[r] * H, sizeof(float) * (size_t)H);
    tw_cpu_rmsnorm(s->xe, n_rows, H, m->final_norm.data, c->rms_norm_eps, s->xe);
    TW_CHECK(tw_cpu_tp_unembed(&s->tp, s->pool, s->xe, n_rows, H, m->lm_head.data,
                               c->vocab_size, logits));
  }
  return TW_OK;
}

/* ---- engine ops ----------------------------------------------------------------- */

/* A prefill pass's ring plan (kv_ring.h) and its scratch of one layer; every
 * token's ring table is its segment's scratch table. */
static TW_NODISCARD tw_status_t tw_cpu_ring_plan(const tw_engine_t *e, tw_cpu_state_t *s,
                                                 const tw_prefill_pass_t *p) {
  const tw_model_config_t *c = &e->model->config;
  int32_t ns = p->n_segs;
  int32_t *meta = malloc(sizeof(int32_t) * 2 * (size_t)ns);
  const int32_t **tabs = malloc(sizeof(*tabs) * (size_t)ns);
  tw_status_t st = TW_OK;
  if (!meta || !tabs) {
    st = tw_err(TW_ERR_NO_MEMORY, "cpu prefill: out of memory for the ring plan");
    goto done;
  }
  for (int32_t g = 0; g < ns; g++) {
    meta[g] = p->segs[g].start_pos;
    meta[ns + g] = p->segs[g].n_tokens;
    tabs[g] = p->segs[g].block_table;
  }
  st = tw_kv_ring_pass_plan(&s->ring, ns, meta, meta + ns, tabs, 0, e->kv.block_size,
                            c->sliding_window, e->kv.ring_blocks, 0);
  if (st != TW_OK) goto done;
  if (s->ring.n_scratch > s->cap_scratch) {
    float *sc = realloc(s->ring_scratch, (size_t)s->ring.n_scratch * (size_t)e->kv.block_bytes);
    if (!sc) {
      st = tw_err(TW_ERR_NO_MEMORY, "cpu prefill: out of memory for %d ring scratch blocks",
                  s->ring.n_scratch);
      goto done;
    }
    memset((char *)sc + s->cap_scratch * e->kv.block_bytes, 0,
           (size_t)(s->ring.n_scratch - s->cap_scratch) * (size_t)e->kv.block_bytes);
    s->ring_scratch = sc;
    s->cap_scratch = s->ring.n_scratch;
  }
  for (int32_t g = 0, t = 0; g < ns; g++)
    for (int32_t i = 0; i < p->segs[g].n_tokens; i++, t++)
      s->rtables[t] = s->ring.tables + (int64_t)g * s->ring.stride;
done:
  free(meta);
  free((void *)tabs);
  return st;
}

/* One prefill pass (engine_impl.h): the segments' tokens as one batch, each
 * token with its own position and block table, so attention stays within
 * its sequence; every row's result is the same as in a pass of its segment
 * alone (the matmuls and norms compute each row the same way whatever T). */
static TW_NODISCARD tw_status_t tw_cpu_prefill_pass(tw_engine_t *e, const tw_prefill_pass_t *p) {
  tw_cpu_state_t *s = e->backend;
  const int64_t V = e->model->config.vocab_size, T = p->n_tokens;
  TW_CHECK(tw_cpu_scratch_ensure(e, s, T));
  int32_t *tokens = malloc(sizeof(int32_t) * (size_t)T * 3);
  if (!tokens) return tw_err(TW_ERR_NO_MEMORY, "cpu prefill: out of memory for %lld tokens",
                             (long long)T);
  int32_t *pos = tokens + T, *rows = pos + T;
  int64_t t = 0, n_rows = 0;
  for (int32_t g = 0; g < p->n_segs; g++) {
    const tw_prefill_seg_t *sg = &p->segs[g];
    for (int32_t i = 0; i < sg->n_tokens; i++, t++) {
      tokens[t] = sg->tokens[i];
      pos[t] = sg->start_pos + i;
      s->tables[t] = sg->block_table;
    }
    if (sg->out >= 0) rows[n_rows++] = (int32_t)(t - 1); /* out rows come in segment order */
  }
  tw_status_t st = e->kv.ring_blocks > 0 ? tw_cpu_ring_plan(e, s, p) : TW_OK;
  if (st != TW_OK) {
    free(tokens);
    return st;
  }
  float *dst = NULL;
  if (p->all_logits) { /* every row; the output rows are read from there */
    for (int64_t r = 0; r < T; r++) rows[r] = (int32_t)r;
    n_rows = T;
    dst = p->all_logits;
  } else if (n_rows > 0) {
    st = tw_cpu_logits_ensure(e, s, n_rows);
    if (st != TW_OK) {
      free(tokens);
      return st;
    }
    dst = s->logits;
  }
  s->layer_cb = p;
  s->ring_prefill = e->kv.ring_blocks > 0;
  st = tw_cpu_forward(e, T, tokens, pos, rows, n_rows, dst);
  s->ring_prefill = false;
  s->layer_cb = NULL;
  for (int32_t g = 0, k = 0, end = 0; st == TW_OK && g < p->n_segs; g++) {
    const tw_prefill_seg_t *sg = &p->segs[g];
    end += sg->n_tokens;
    if (sg->out < 0) continue;
    const float *row = dst + (p->all_logits ? (int64_t)(end - 1) : (int64_t)k++) * V;
    if (p->logits_rows[sg->out])
      memcpy(p->logits_rows[sg->out], row, sizeof(float) * (size_t)V);
    if (p->next_tokens)
      st = tw_sample(row, (int32_t)V, &p->sample[sg->out], p->sample_pos[sg->out],
                     s->sample_scratch, &p->next_tokens[sg->out]);
  }
  free(tokens);
  return st;
}

static TW_NODISCARD tw_status_t tw_cpu_decode(tw_engine_t *e, const tw_decode_args_t *args) {
  tw_cpu_state_t *s = e->backend;
  const int64_t V = e->model->config.vocab_size, n = args->n_seqs;
  TW_CHECK(tw_cpu_scratch_ensure(e, s, n));
  float *logits = args->logits_out;
  if (!logits && args->next_tokens_out) {
    TW_CHECK(tw_cpu_logits_ensure(e, s, n));
    logits = s->logits;
  }
  int32_t *rows = malloc(sizeof(int32_t) * (size_t)n);
  if (!rows) return tw_err(TW_ERR_NO_MEMORY, "cpu decode: out of memory");
  for (int64_t i = 0; i < n; i++) {
    rows[i] = (int32_t)i;
    s->tables[i] = args->block_tables[i];
  }
  if (e->kv.ring_blocks > 0) { /* each sequence's ring view (kv_ring.h) */
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++) need += args->n_blocks[i];
    if (need > s->cap_views) {
      int32_t *v = realloc(s->views, sizeof(int32_t) * (size_t)need);
      if (!v) {
        free(rows);
        return tw_err(TW_ERR_NO_MEMORY, "cpu decode: out of memory for ring views");
      }
      s->views = v;
      s->cap_views = need;
    }
    for (int64_t i = 0, off = 0; i < n; off += args->n_blocks[i], i++) {
      tw_kv_ring_view(args->block_tables[i], args->n_blocks[i], e->kv.ring_blocks, s->views + off);
      s->rtables[i] = s->views + off;
    }
  }
  s->while_running = args->while_running;
  s->while_running_arg = args->while_running_arg;
  tw_status_t st = tw_cpu_forward(e, n, args->tokens, args->positions, rows, logits ? n : 0, logits);
  s->while_running = NULL;
  free(rows);
  TW_CHECK(st);
  if (args->next_tokens_out) {
    for (int64_t i = 0; i < n; i++) {
      int32_t tok;
      TW_CHECK(tw_sample(logits + i * V, (int32_t)V, args->sample ? &args->sample[i] : NULL,
                         (int64_t)args->positions[i] + 1, s->sample_scratch, &tok));
      args->next_tokens_out[i] = tok;
    }
  }
  return TW_OK;
}

static void tw_cpu_destroy(tw_engine_t *e) {
  tw_cpu_state_t *s = e->backend;
  if (s) {
    tw_cpu_pool_destroy(s->pool);
    tw_cpu_tp_fini(&s->tp);
    if (s->kv_pool) munmap(s->kv_pool, (size_t)e->kv.total_bytes);
    tw_cpu_scratch_free(s);
    tw_kv_ring_pass_free(&s->ring);
    free(s->ring_scratch);
    free(s->views);
    free(s->inv_freq);
    free(s->sinks);
    free(s->logits);
    free(s->scores);
    free(s->sample_scratch);
    free(s);
  }
  e->magic = 0;
  free(e);
}

static const tw_engine_ops_t tw_cpu_ops = {
    .name = "cpu", .destroy = tw_cpu_destroy, .prefill_pass = tw_cpu_prefill_pass,
    .decode = tw_cpu_decode};

TW_NODISCARD tw_status_t tw_cpu_engine_create(const tw_model_t *model,
                                              const tw_engine_params_t *params,
                                              tw_engine_t **engine_p) {
  const tw_model_config_t *c = &model->config;
  tw_cpu_tp_t tp;
  TW_CHECK(tw_cpu_tp_init(c, params, &tp));
  TW_CHECK(tw_cpu_check_model(model));
  tw_engine_params_t planned = *params;
  if (params->mem_role) { /* the host rule of the memory plan (mem_plan.h) */
    tw_mem_plan_in_t in;
    tw_mem_plan_t plan;
    tw_engine_plan_input(model, params, &in);
    in.total_bytes = (int64_t)sysconf(_SC_PHYS_PAGES) * (int64_t)sysconf(_SC_PAGESIZE);
    in.weight_bytes = model->weight_bytes;
    in.kv_elem_bytes = (int32_t)sizeof(float);
    in.kv_fp8 = params->kv_dtype == TW_KV_DTYPE_FP8;
    in.kv_heads = tp.sh.nkv;
    in.shared_weights = true;   /* mapped read-only: the page cache holds one copy */
    in.process_reserve = -1;    /* no device context */
    in.max_batch_cap = TW_CPU_MAX_BATCH;
    in.kv_cap_bytes = TW_CPU_KV_CAP_BYTES;
    in.window_ring = tw_kv_ring_wanted(params->kv_window_ring, true);
    TW_CHECK(tw_mem_plan(&in, &plan));
    tw_engine_plan_apply(&plan, &planned);
  }
  params = &planned;
  tw_engine_t *e = calloc(1, sizeof(*e));
  tw_cpu_state_t *s = calloc(1, sizeof(*s));
  if (!e || !s) {
    free(e);
    free(s);
    return tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory");
  }
  e->magic = TW_ENGINE_MAGIC;
  e->ops = &tw_cpu_ops;
  e->model = model;
  e->params = *params;
  e->params.backend = TW_BACKEND_CPU;
  e->backend = s;
  s->tp = tp;
  tw_status_t st = TW_OK;

  int64_t bs = params->kv_block_size;
  tw_dtype_t kv_dtype = tw_kv_pool_dtype((tw_kv_dtype_t)params->kv_dtype, TW_DTYPE_F32);
  if (kv_dtype == TW_DTYPE_F8_E4M3 && c->head_dim > TW_CPU_KV_MAX_HEAD_DIM) {
    free(e);
    free(s);
    return tw_err(TW_ERR_UNSUPPORTED, "cpu engine: fp8 KV cache with head_dim %d (max %d)",
                  c->head_dim, TW_CPU_KV_MAX_HEAD_DIM);
  }
  int64_t block_bytes = 2ll * tp.sh.nkv * tw_kv_head_bytes(kv_dtype, (int32_t)bs, c->head_dim);
  int64_t n_blocks = params->kv_num_blocks;
  if (n_blocks == 0) {
    /* two sequences of full context, capped at 1 GiB; pages are touched lazily */
    n_blocks = 2 * ((c->max_position_embeddings + bs - 1) / bs);
    int64_t cap = TW_CPU_KV_CAP_BYTES / (block_bytes * c->n_layers);
    if (n_blocks > cap) n_blocks = cap > 1 ? cap : 1;
  }
  e->kv = (tw_kv_layout_t){.dtype = kv_dtype,
                           .on_device = false,
                           .device = -1,
                           .n_layers = c->n_layers,
                           .n_blocks = (int32_t)n_blocks,
                           .block_size = (int32_t)bs,
                           .n_kv_heads_local = tp.sh.nkv,
                           .kv_head_offset = tp.sh.kv0,
                           .head_dim = c->head_dim,
                           .layer_stride_bytes = n_blocks * block_bytes,
                           .block_bytes = block_bytes};
  tw_kv_ring_setup(c, tw_kv_ring_wanted(params->kv_window_ring, true), (int32_t)n_blocks,
                   (int32_t)bs, params->kv_ring_blocks, &e->kv.ring_blocks, &e->kv.n_ring_blocks,
                   &e->kv.ring_layers);
  e->kv.total_bytes =
      tw_kv_pool_bytes_of(c->n_layers, block_bytes, (int32_t)n_blocks, e->kv.n_ring_blocks,
                          e->kv.ring_blocks, e->kv.ring_layers);
  void *kvp = mmap(NULL, (size_t)e->kv.total_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (kvp == MAP_FAILED) {
    kvp = NULL;
    st = tw_err(TW_ERR_NO_MEMORY, "cpu engine: cannot map a KV pool of %lld bytes",
                (long long)e->kv.total_bytes);
    goto fail;
  }
  s->kv_pool = kvp;
  e->kv.base = kvp;

  TW_CHECK_GOTO(tw_cpu_pool_create(params->n_threads, &s->pool), st, fail);
  s->inv_freq = malloc(sizeof(double) * (size_t)(c->head_dim / 2));
  s->sinks = malloc(sizeof(float) * (size_t)c->n_layers * (size_t)c->n_heads);
  s->scores = malloc(sizeof(float) * (size_t)tw_cpu_pool_size(s->pool) *
                     (size_t)c->max_position_embeddings);
  s->sample_scratch = malloc(sizeof(float) * 2 * (size_t)c->vocab_size);
  if (!s->inv_freq || !s->sinks || !s->scores || !s->sample_scratch) {
    st = tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory");
    goto fail;
  }
  tw_cpu_rope_init(c, s->inv_freq, &s->concentration);
  for (int32_t l = 0; l < c->n_layers; l++) {
    const tw_tensor_t *sk = &model->layers[l].sinks;
    for (int32_t h = 0; h < c->n_heads; h++)
      s->sinks[l * c->n_heads + h] = sk->dtype == TW_DTYPE_F32
                                         ? ((const float *)sk->data)[h]
                                         : tw_bf16_to_f32(((const uint16_t *)sk->data)[h]);
  }
  TW_INFO("engine",
          "cpu: %d threads, kv pool %lld blocks x %lld tokens (sliding layers: %s %d blocks) = "
          "%.1f MiB %s (lazily touched), weights %.1f MiB in place",
          tw_cpu_pool_size(s->pool), (long long)n_blocks, (long long)bs,
          e->kv.ring_blocks ? "window rings of" : "all", e->kv.n_ring_blocks,
          (double)e->kv.total_bytes / (1 << 20), tw_kv_pool_dtype_name(kv_dtype),
          (double)model->weight_bytes / (1 << 20));
  *engine_p = e;
  return TW_OK;
fail:
  tw_cpu_destroy(e);
  return st;
}
