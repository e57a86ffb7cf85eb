/* engine_cuda.cu: the CUDA backend of engine.h: creation (weights uploaded
 * once, RoPE tables, KV pool, workspace), the memory plan logged at start,
 * and destruction. The forward pass lives in engine_cuda_step.cu.
 *
 * Device formats: bf16 matrices and norm weights as bf16 (exact copies), the
 * QKV projections stacked into one [NQ*D + 2*NKV*D, H] matrix with a bf16
 * bias (the cuBLASLt bias epilogue takes the output dtype), MXFP4 experts as
 * their packed bytes and scales (spec §3.4), every other bias and the sinks
 * as f32. The KV pool is bf16 in the engine.h layout, zeroed at start. */
#include "kernels/engine_cuda_impl.h"

#include "common/base/log.h"
#include "common/comm/collective.h"
#include "common/kv/kv_fp8.h"
#include "kernels/attention.h"
#include "kernels/cuda_common.h"
#include "kernels/norm_rope.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The window ring of the sliding layers is on by default (kv_window_ring 0):
 * verified on the H200 (test_kv_ring_cuda: ring against full layout; the
 * service with --verify-kv: greedy output identical to one process, layer
 * checksums equal; docs/benchmarks.md). */
#define TW_CE_RING_DEFAULT true

#define TW_CE_ALIGN 256

static size_t tw_ce_align(size_t n) { return (n + TW_CE_ALIGN - 1) / TW_CE_ALIGN * TW_CE_ALIGN; }

extern "C" int tw_cuda_available(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n > 0;
}

/* ---- weight upload: one walk sizes the arena, a second one fills it ------ */

typedef struct {
  char *base;   /* NULL during the sizing walk */
  size_t off;
  void *tmp;    /* host conversion buffer */
  size_t tmp_bytes;
  int views;    /* 1: the arena holds the weights already (CUDA IPC): pointers only */
  void *dscr;   /* device scratch: an expert tensor's blocks before packing */
  size_t dscr_bytes;
} tw_ce_up_t;

static TW_NODISCARD tw_status_t tw_ce_tmp(tw_ce_up_t *u, size_t bytes) {
  if (bytes <= u->tmp_bytes) return TW_OK;
  void *p = realloc(u->tmp, bytes);
  if (!p) return tw_err(TW_ERR_NO_MEMORY, "cuda engine: out of host memory (%zu bytes)", bytes);
  u->tmp = p;
  u->tmp_bytes = bytes;
  return TW_OK;
}

static int64_t tw_ce_numel(const tw_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

/* Place `n_bytes` of `src` (host) at the cursor; returns the device pointer. */
static TW_NODISCARD tw_status_t tw_ce_put(tw_ce_up_t *u, const void *src, size_t n_bytes, const void **dst_p) {
  size_t at = u->off;
  u->off += tw_ce_align(n_bytes);
  if (!u->base) {
    *dst_p = NULL;
    return TW_OK;
  }
  if (!u->views) TW_CUDA_CHECK(cudaMemcpy(u->base + at, src, n_bytes, cudaMemcpyHostToDevice));
  *dst_p = u->base + at;
  return TW_OK;
}

/* Upload a tensor converted to `to` (bf16 or f32) from its bf16/f32 dtype;
 * other dtypes are copied unchanged. */
static TW_NODISCARD tw_status_t tw_ce_put_as(tw_ce_up_t *u, const tw_tensor_t *t, tw_dtype_t to,
                                const char *name, const void **dst_p) {
  if (!t->data) return tw_err(TW_ERR_NOT_FOUND, "cuda engine: tensor %s is absent", name);
  int64_t n = tw_ce_numel(t);
  if (t->dtype == to || (to != TW_DTYPE_F32 && to != TW_DTYPE_BF16))
    return tw_ce_put(u, t->data, (size_t)t->n_bytes, dst_p);
  if (t->dtype != TW_DTYPE_F32 && t->dtype != TW_DTYPE_BF16)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: tensor %s has dtype %s, want bf16 or f32",
                  name, tw_dtype_name(t->dtype));
  size_t bytes = (size_t)n * tw_dtype_size(to);
  if (!u->base || u->views) return tw_ce_put(u, NULL, bytes, dst_p);
  TW_CHECK(tw_ce_tmp(u, bytes));
  for (int64_t i = 0; i < n; i++) {
    if (to == TW_DTYPE_F32)
      ((float *)u->tmp)[i] = tw_bf16_to_f32(((const uint16_t *)t->data)[i]);
    else
      ((uint16_t *)u->tmp)[i] = tw_f32_to_bf16(((const float *)t->data)[i]);
  }
  return tw_ce_put(u, u->tmp, bytes, dst_p);
}

/* Upload a bf16 (or f32) expert tensor [E, R, C] (HF in-memory orientation,
 * used as x @ W) transposed to bf16 [E, C, R], the layout the MoE GEMM path
 * multiplies (spec §3.5: even/odd columns become even/odd rows). */
static TW_NODISCARD tw_status_t tw_ce_put_experts_t(tw_ce_up_t *u, const tw_tensor_t *t, int64_t E, int64_t R,
                                       int64_t C, const char *name, const void **dst_p) {
  if (!t->data) return tw_err(TW_ERR_NOT_FOUND, "cuda engine: tensor %s is absent", name);
  if (t->ndim != 3 || t->shape[0] != E || t->shape[1] != R || t->shape[2] != C)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "cuda engine: expert tensor %s is not [%lld, %lld, %lld]", name, (long long)E,
                  (long long)R, (long long)C);
  if (t->dtype != TW_DTYPE_BF16 && t->dtype != TW_DTYPE_F32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: tensor %s has dtype %s, want bf16 or f32",
                  name, tw_dtype_name(t->dtype));
  size_t bytes = (size_t)(E * R * C) * 2;
  if (!u->base || u->views) return tw_ce_put(u, NULL, bytes, dst_p);
  TW_CHECK(tw_ce_tmp(u, bytes));
  uint16_t *o = (uint16_t *)u->tmp;
  for (int64_t e = 0; e < E; e++)
    for (int64_t r = 0; r < R; r++)
      for (int64_t c = 0; c < C; c++) {
        int64_t si = (e * R + r) * C + c;
        o[(e * C + c) * R + r] = t->dtype == TW_DTYPE_BF16
                                     ? ((const uint16_t *)t->data)[si]
                                     : tw_f32_to_bf16(((const float *)t->data)[si]);
      }
  return tw_ce_put(u, u->tmp, bytes, dst_p);
}

/* ---- this rank's shard of the weights (ce->sh: every row at tp = ep = 1) ---- */

/* Rows [r0, r0+nr) and columns [c0, c0+nc) of a tensor seen as [R, C]
 * (R = shape[0], C the rest). */
typedef struct {
  const tw_tensor_t *t;
  int64_t r0, nr, c0, nc;
} tw_ce_blk_t;

static tw_ce_blk_t tw_ce_rows(const tw_tensor_t *t, int64_t r0, int64_t nr) {
  int64_t R = t->ndim > 0 ? t->shape[0] : 1;
  tw_ce_blk_t b = {t, r0, nr, 0, R > 0 ? tw_ce_numel(t) / R : 0};
  return b;
}

/* Upload blocks stacked contiguously, bf16/f32 converted to `to`; any other
 * `to` (u8) copies bytes and wants the tensor's own dtype. */
static TW_NODISCARD tw_status_t tw_ce_put_blocks(tw_ce_up_t *u, const tw_ce_blk_t *b, int n, tw_dtype_t to,
                                    const char *name, const void **dst_p) {
  int cvt = to == TW_DTYPE_F32 || to == TW_DTYPE_BF16;
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    const tw_tensor_t *t = b[i].t;
    int64_t R = t->ndim > 0 ? t->shape[0] : 1, C = R > 0 ? tw_ce_numel(t) / R : 0;
    if (!t->data) return tw_err(TW_ERR_NOT_FOUND, "cuda engine: tensor %s[%d] is absent", name, i);
    if (cvt ? (t->dtype != TW_DTYPE_F32 && t->dtype != TW_DTYPE_BF16) : t->dtype != to)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: tensor %s[%d] has dtype %s", name, i,
                    tw_dtype_name(t->dtype));
    if (b[i].r0 < 0 || b[i].r0 + b[i].nr > R || b[i].c0 < 0 || b[i].c0 + b[i].nc > C)
      return tw_err(TW_ERR_INTERNAL, "cuda engine: shard of %s[%d] outside [%lld, %lld]", name,
                    i, (long long)R, (long long)C);
    total += (size_t)(b[i].nr * b[i].nc) * tw_dtype_size(cvt ? to : t->dtype);
  }
  if (!u->base || u->views) return tw_ce_put(u, NULL, total, dst_p);
  int direct = 1; /* every block whole rows of its tensor, in the wanted dtype */
  for (int i = 0; i < n; i++) {
    const tw_tensor_t *t = b[i].t;
    int64_t C = tw_ce_numel(t) / (t->ndim > 0 ? t->shape[0] : 1);
    direct &= b[i].c0 == 0 && b[i].nc == C && (!cvt || t->dtype == to);
  }
  if (direct) { /* contiguous bytes: straight from the model, no host copy */
    char *dst = u->base + u->off, *o = dst;
    u->off += tw_ce_align(total);
    for (int i = 0; i < n; i++) {
      size_t row = (size_t)b[i].nc * tw_dtype_size(b[i].t->dtype);
      TW_CUDA_CHECK(cudaMemcpy(o, (const char *)b[i].t->data + (size_t)b[i].r0 * row,
                               (size_t)b[i].nr * row, cudaMemcpyHostToDevice));
      o += (size_t)b[i].nr * row;
    }
    *dst_p = dst;
    return TW_OK;
  }
  TW_CHECK(tw_ce_tmp(u, total));
  char *o = (char *)u->tmp;
  for (int i = 0; i < n; i++) {
    const tw_tensor_t *t = b[i].t;
    int64_t C = tw_ce_numel(t) / (t->ndim > 0 ? t->shape[0] : 1);
    size_t es = tw_dtype_size(t->dtype), os = tw_dtype_size(cvt ? to : t->dtype);
    for (int64_t r = b[i].r0; r < b[i].r0 + b[i].nr; r++) {
      int64_t si = r * C + b[i].c0;
      if (!cvt || t->dtype == to) {
        memcpy(o, (const char *)t->data + (size_t)si * es, (size_t)b[i].nc * es);
      } else {
        for (int64_t j = 0; j < b[i].nc; j++) {
          if (to == TW_DTYPE_F32)
            ((float *)o)[j] = tw_bf16_to_f32(((const uint16_t *)t->data)[si + j]);
          else
            ((uint16_t *)o)[j] = tw_f32_to_bf16(((const float *)t->data)[si + j]);
        }
      }
      o += (size_t)b[i].nc * os;
    }
  }
  return tw_ce_put(u, u->tmp, total, dst_p);
}

/* Rows [e0, e1) of an [E, ...] expert tensor; *dst_p is set so that global
 * expert e's row is at the usual offset (only local experts are read). */
static TW_NODISCARD tw_status_t tw_ce_put_experts(tw_ce_up_t *u, const tw_ce_t *ce, const tw_tensor_t *t,
                                     tw_dtype_t to, const char *name, const void **dst_p) {
  tw_ce_blk_t b = tw_ce_rows(t, ce->sh.e0, ce->sh.e1 - ce->sh.e0);
  const void *p = NULL;
  TW_CHECK(tw_ce_put_blocks(u, &b, 1, to, name, &p));
  size_t row = (size_t)b.nc * tw_dtype_size(to == TW_DTYPE_F32 ? to : t->dtype);
  *dst_p = p ? (const char *)p - (size_t)ce->sh.e0 * row : NULL;
  return TW_OK;
}

/* The MXFP4 blocks [E, N, K/32, 16] of this rank's experts [e0, e1) in the
 * packed device layout (moe.h TW_MX_CHUNK), packed on the device from a
 * scratch copy of the checkpoint's bytes; *dst_p as tw_ce_put_experts sets
 * it (global expert e at its usual place). */
static TW_NODISCARD tw_status_t tw_ce_put_experts_mx(tw_ce_up_t *u, const tw_ce_t *ce,
                                                     const tw_tensor_t *t, int32_t N, int32_t K,
                                                     const char *name, const void **dst_p) {
  const int64_t e0 = ce->sh.e0, ne = ce->sh.e1 - ce->sh.e0;
  if (!t->data) return tw_err(TW_ERR_NOT_FOUND, "cuda engine: tensor %s is absent", name);
  if (t->dtype != TW_DTYPE_U8 || t->ndim < 1 || tw_ce_numel(t) != t->shape[0] * (int64_t)N * (K / 2) ||
      e0 < 0 || e0 + ne > t->shape[0])
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "cuda engine: expert blocks %s are not u8 [E, %d, %d, 16] with experts %lld..%lld",
                  name, N, K / 32, (long long)e0, (long long)(e0 + ne));
  const size_t per = tw_cuda_mxfp4_packed_bytes(1, N, K), bytes = per * (size_t)ne;
  const void *p = NULL;
  if (!u->base || u->views) {
    TW_CHECK(tw_ce_put(u, NULL, bytes, &p));
  } else {
    const size_t nat = (size_t)ne * N * (K / 2);
    if (u->dscr_bytes < nat) {
      cudaFree(u->dscr);
      u->dscr = NULL;
      u->dscr_bytes = 0;
      TW_CUDA_CHECK(cudaMalloc(&u->dscr, nat));
      u->dscr_bytes = nat;
    }
    TW_CUDA_CHECK(cudaMemcpy(u->dscr, (const uint8_t *)t->data + (size_t)e0 * N * (K / 2), nat,
                             cudaMemcpyHostToDevice));
    char *dst = u->base + u->off;
    u->off += tw_ce_align(bytes);
    TW_CHECK(tw_cuda_mxfp4_pack((const uint8_t *)u->dscr, (int32_t)ne, N, K, (uint8_t *)dst, 0));
    TW_CUDA_CHECK(cudaDeviceSynchronize());
    p = dst;
  }
  *dst_p = p ? (const char *)p - (size_t)e0 * per : NULL;
  return TW_OK;
}

/* The one weight walk, the same at every TP/EP size: this rank's rows of
 * each tensor (ce->sh, shard_plan.h; at tp = ep = 1 every row, so a single
 * GPU runs the same code as a shard). Run twice: sizing (u->base NULL), then
 * upload (or pointers only with u->views). */
static TW_NODISCARD tw_status_t tw_ce_walk(tw_ce_t *ce, const tw_model_t *m, tw_ce_up_t *u) {
  const tw_model_config_t *c = &m->config;
  int64_t D = c->head_dim, QD = (int64_t)c->n_heads * D;
  tw_ce_blk_t b[3];
  TW_CHECK(tw_ce_put_as(u, &m->embed, TW_DTYPE_BF16, "embed", &ce->embed));
  b[0] = tw_ce_rows(&m->lm_head, ce->sh.v0, ce->sh.nv);
  TW_CHECK(tw_ce_put_blocks(u, b, 1, TW_DTYPE_BF16, "lm_head", &ce->lm_head));
  TW_CHECK(tw_ce_put_as(u, &m->final_norm, TW_DTYPE_BF16, "final_norm", &ce->final_norm));
  for (int l = 0; l < c->n_layers; l++) {
    const tw_layer_weights_t *lw = &m->layers[l];
    tw_ce_layer_t *d = &ce->layers[l];
    const void *p;
    if (u->base && !u->views && l % 8 == 0) /* the upload pass: progress for the log */
      TW_INFO("engine", "uploading weights: layer %d of %d (%.2f GiB so far)", l, c->n_layers,
              (double)u->off / (1024.0 * 1024.0 * 1024.0));
    TW_CHECK(tw_ce_put_as(u, &lw->attn_norm, TW_DTYPE_BF16, "attn_norm", &d->attn_norm));
    b[0] = tw_ce_rows(&lw->q_w, ce->sh.q0 * D, ce->sh.nq * D);
    b[1] = tw_ce_rows(&lw->k_w, ce->sh.kv0 * D, ce->sh.nkv * D);
    b[2] = tw_ce_rows(&lw->v_w, ce->sh.kv0 * D, ce->sh.nkv * D);
    TW_CHECK(tw_ce_put_blocks(u, b, 3, TW_DTYPE_BF16, "qkv weight", &d->wqkv));
    b[0] = tw_ce_rows(&lw->q_b, ce->sh.q0 * D, ce->sh.nq * D);
    b[1] = tw_ce_rows(&lw->k_b, ce->sh.kv0 * D, ce->sh.nkv * D);
    b[2] = tw_ce_rows(&lw->v_b, ce->sh.kv0 * D, ce->sh.nkv * D);
    TW_CHECK(tw_ce_put_blocks(u, b, 3, TW_DTYPE_F32, "qkv bias", &d->bqkv));
    b[0] = (tw_ce_blk_t){&lw->o_w, 0, c->hidden, ce->sh.q0 * D, ce->sh.nq * D}; /* [H, NQ*D] columns */
    if (b[0].t->ndim != 2 || b[0].t->shape[1] != QD)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: o_proj is not [%d, %lld]", c->hidden,
                    (long long)QD);
    TW_CHECK(tw_ce_put_blocks(u, b, 1, TW_DTYPE_BF16, "o_proj", &d->wo));
    d->bo = NULL; /* the bias is added once, by tp rank 0 */
    if (ce->sh.tp_rank == 0) {
      TW_CHECK(tw_ce_put_as(u, &lw->o_b, TW_DTYPE_F32, "o_proj bias", &p));
      d->bo = (const float *)p;
    }
    b[0] = tw_ce_rows(&lw->sinks, ce->sh.q0, ce->sh.nq);
    TW_CHECK(tw_ce_put_blocks(u, b, 1, TW_DTYPE_F32, "sinks", &p));
    d->sinks = (const float *)p;
    TW_CHECK(tw_ce_put_as(u, &lw->mlp_norm, TW_DTYPE_BF16, "mlp_norm", &d->mlp_norm));
    TW_CHECK(tw_ce_put_as(u, &lw->router_w, TW_DTYPE_BF16, "router", &d->wr));
    TW_CHECK(tw_ce_put_as(u, &lw->router_b, TW_DTYPE_F32, "router bias", &p));
    d->br = (const float *)p;
    tw_cuda_moe_weights_t *mw = &d->moe;
    mw->n_experts = c->n_experts; /* global ids; only [e0, e1) are uploaded and read */
    mw->hidden = c->hidden;
    mw->intermediate = c->intermediate;
    mw->swiglu_alpha = c->swiglu_alpha;
    mw->swiglu_limit = c->swiglu_limit;
    if (lw->experts_format == TW_EXPERTS_BF16) { /* ep = 1 (tw_ce_tp_init) */
      int64_t E = c->n_experts, H = c->hidden, I = c->intermediate;
      TW_CHECK(tw_ce_put_experts_t(u, &lw->gate_up, E, H, 2 * I, "gate_up_proj", &d->wdq));
      TW_CHECK(tw_ce_put_experts_t(u, &lw->down, E, I, H, "down_proj", &p));
      if (u->base && (const char *)p != (const char *)d->wdq + tw_ce_align((size_t)(E * 2 * I * H) * 2))
        return tw_err(TW_ERR_INTERNAL, "cuda engine: layer %d bf16 experts not contiguous", l);
      TW_CHECK(tw_ce_put_as(u, &lw->gate_up_bias, TW_DTYPE_F32, "gate_up_bias", &p));
      mw->gate_up_bias = (const float *)p;
      TW_CHECK(tw_ce_put_as(u, &lw->down_bias, TW_DTYPE_F32, "down_bias", &p));
      mw->down_bias = (const float *)p;
      continue;
    }
    TW_CHECK(tw_ce_put_experts_mx(u, ce, &lw->gate_up_blocks, 2 * c->intermediate, c->hidden,
                                  "gate_up_blocks", &p));
    mw->gate_up_blocks = (const uint8_t *)p;
    TW_CHECK(tw_ce_put_experts(u, ce, &lw->gate_up_scales, TW_DTYPE_U8, "gate_up_scales", &p));
    mw->gate_up_scales = (const uint8_t *)p;
    TW_CHECK(tw_ce_put_experts(u, ce, &lw->gate_up_bias, TW_DTYPE_F32, "gate_up_bias", &p));
    mw->gate_up_bias = (const float *)p;
    TW_CHECK(tw_ce_put_experts_mx(u, ce, &lw->down_blocks, c->hidden, c->intermediate,
                                  "down_blocks", &p));
    mw->down_blocks = (const uint8_t *)p;
    TW_CHECK(tw_ce_put_experts(u, ce, &lw->down_scales, TW_DTYPE_U8, "down_scales", &p));
    mw->down_scales = (const uint8_t *)p;
    TW_CHECK(tw_ce_put_experts(u, ce, &lw->down_bias, TW_DTYPE_F32, "down_bias", &p));
    mw->down_bias = (const float *)p;
  }
  return TW_OK;
}

/* ---- workspace carve ---------------------------------------------------- */

typedef struct {
  char *base;
  size_t off;
} tw_ce_carve_t;

static void *tw_ce_take(tw_ce_carve_t *c, size_t bytes) {
  void *p = c->base ? c->base + c->off : NULL;
  c->off += tw_ce_align(bytes);
  return p;
}

static TW_NODISCARD tw_status_t tw_ce_carve(tw_ce_t *ce, tw_ce_carve_t *cv) {
  const tw_model_config_t *c = ce->cfg;
  size_t R = (size_t)ce->max_rows, H = (size_t)c->hidden, E = (size_t)c->n_experts;
  size_t B = (size_t)ce->max_batch, V = (size_t)c->vocab_size;
  size_t lrows = B > TW_CE_LOGIT_ROWS ? B : TW_CE_LOGIT_ROWS;
  ce->x = (float *)tw_ce_take(cv, R * H * 4);
  ce->o = (float *)tw_ce_take(cv, R * H * 4);
  ce->moe_out = (float *)tw_ce_take(cv, R * H * 4);
  ce->rlog = (float *)tw_ce_take(cv, R * E * 4);
  ce->xn = tw_ce_take(cv, R * H * 2);
  ce->qkv = tw_ce_take(cv, R * (size_t)ce->qkv_dim * 4); /* f32: rounded once, after RoPE */
  ce->q = tw_ce_take(cv, R * (size_t)ce->q_dim * 2);
  ce->attn = tw_ce_take(cv, R * (size_t)ce->q_dim * 2);
  ce->logits = (float *)tw_ce_take(cv, lrows * V * 4);
  if (ce->sh.tp_size > 1) {
    ce->lg_local = (float *)tw_ce_take(cv, lrows * (size_t)ce->sh.vp * 4);
    ce->lg_all = (float *)tw_ce_take(cv, (size_t)ce->sh.tp_size * lrows * (size_t)ce->sh.vp * 4);
  }
  size_t rb = tw_cuda_moe_route_bytes((int32_t)R, c->n_experts, c->n_experts_per_tok);
  void *rmem = tw_ce_take(cv, rb);
  if (cv->base)
    TW_CHECK(tw_cuda_moe_route_init(rmem, rb, (int32_t)R, c->n_experts, c->n_experts_per_tok,
                                    &ce->route));
  /* EP runs every batch as GEMV slices of up to TW_CE_GEMV_MAX_TOKENS rows
   * (engine_cuda_tp.cu tw_ce_ep_moe), whatever gemv_max says */
  const size_t gemv_cap = ce->sh.ep_size > 1 ? (size_t)TW_CE_GEMV_MAX_TOKENS : (size_t)ce->gemv_max;
  int32_t gemv_rows = (int32_t)(R < gemv_cap ? R : gemv_cap);
  ce->moe_dec_bytes = tw_cuda_moe_decode_ws_bytes(gemv_rows, c->n_experts_per_tok, c->hidden,
                                                  c->intermediate);
  ce->moe_dec_ws = tw_ce_take(cv, ce->moe_dec_bytes);
  ce->moe_pre_bytes = 0;
  if ((R > (size_t)ce->gemv_max || ce->bf16_experts) && ce->sh.ep_size == 1) {
    /* the grouped GEMM's, the cuBLAS path's (without the grouped GEMM, or
     * for the prefill MoE on the bf16 copy), or the larger of the two */
    size_t g = ce->moe_grouped ? tw_cuda_moe_prefill_ws_bytes((int32_t)R, c->n_experts_per_tok,
                                                              c->hidden, c->intermediate)
                               : 0;
    size_t cb = !ce->moe_grouped || (size_t)ce->pbf16_min <= R
                    ? tw_cuda_moe_prefill_cublas_ws_bytes((int32_t)R, c->n_experts,
                                                          c->n_experts_per_tok, c->hidden,
                                                          c->intermediate, 0)
                    : 0;
    ce->moe_pre_bytes = g > cb ? g : cb;
    ce->moe_pre_ws = tw_ce_take(cv, ce->moe_pre_bytes);
  }
  if (R > (size_t)TW_CE_GEMV_MAX_TOKENS && !ce->bf16_experts && ce->sh.ep_size == 1 && !ce->moe_grouped) {
    ce->dq_bytes = tw_cuda_moe_dequant_bytes(c->n_experts, c->hidden, c->intermediate);
    ce->dq_buf[0] = tw_ce_take(cv, ce->dq_bytes);
    ce->dq_buf[1] = tw_ce_take(cv, ce->dq_bytes);
  }
  ce->attn_ws = tw_ce_take(cv, ce->attn_ws_bytes);
  ce->d_tokens = (int32_t *)tw_ce_take(cv, R * 4);
  ce->d_positions = (int32_t *)tw_ce_take(cv, R * 4);
  ce->d_slots = (int32_t *)tw_ce_take(cv, R * 4);
  ce->d_seq_lens = (int32_t *)tw_ce_take(cv, B * 4);
  ce->d_cu = (int32_t *)tw_ce_take(cv, (B + 1) * 4);
  ce->d_start = (int32_t *)tw_ce_take(cv, B * 4);
  ce->d_block_tables = (int32_t *)tw_ce_take(cv, B * (size_t)ce->max_blocks_per_seq * 4);
  ce->d_next = (int32_t *)tw_ce_take(cv, B * 4);
  ce->d_params = (tw_cuda_sample_row_t *)tw_ce_take(cv, B * sizeof(tw_cuda_sample_row_t));
  return TW_OK;
}

static void tw_ce_destroy(tw_engine_t *engine) {
  if (!engine) return;
  tw_ce_t *ce = (tw_ce_t *)engine->backend;
  if (ce) {
    if (ce->stream) cudaStreamSynchronize(ce->stream);
    if (ce->profile) {
      tw_ce_profile_log(ce);
      cudaEventDestroy(ce->prof_ev[0]);
      cudaEventDestroy(ce->prof_ev[1]);
    }
    tw_ce_graphs_destroy(ce);
    /* its stream is destroyed below; cannot fail: the handle is the NCCL one it was set on */
    if (ce->coll) TW_IGNORE(tw_coll_nccl_set_stream(ce->coll, NULL));
    if (ce->dq_stream) {
      cudaStreamSynchronize(ce->dq_stream);
      cudaStreamDestroy(ce->dq_stream);
      cudaEventDestroy(ce->dq_start);
      for (int i = 0; i < 2; i++) {
        cudaEventDestroy(ce->dq_done[i]);
        cudaEventDestroy(ce->dq_free[i]);
      }
    }
    tw_cuda_gemm_destroy(ce->gemm);
    tw_ce_share_close(ce); /* the weight arena: own, exported or mapped */
    if (ce->kv_pool) cudaFree(ce->kv_pool);
    if (ce->pbf16) cudaFree(ce->pbf16);
    if (ce->ring_scratch) cudaFree(ce->ring_scratch);
    if (ce->d_ring_slots) cudaFree(ce->d_ring_slots);
    if (ce->h_ring_slots) cudaFreeHost(ce->h_ring_slots);
    tw_kv_ring_pass_free(&ce->ring_plan);
    free(ce->kv_layer_off);
    if (ce->ws_arena) cudaFree(ce->ws_arena);
    if (ce->rope_cos) cudaFree(ce->rope_cos);
    if (ce->rope_sin) cudaFree(ce->rope_sin);
    if (ce->h_arena) cudaFreeHost(ce->h_arena);
    if (ce->stream) cudaStreamDestroy(ce->stream);
    free(ce->layers);
    free(ce);
  }
  engine->magic = 0;
  free(engine);
}

static const tw_engine_ops_t tw_ce_ops = {"cuda", tw_ce_destroy, tw_ce_prefill_pass, tw_ce_decode,
                                          tw_ce_warmup};

static TW_NODISCARD tw_status_t tw_ce_config_check(const tw_model_t *m, const tw_engine_params_t *p) {
  const tw_model_config_t *c = &m->config;
  if (m->layers == NULL || c->n_layers <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: model has no layers");
  (void)p; /* tp_size / ep_size: tw_ce_tp_init */
  for (int l = 1; l < c->n_layers; l++)
    if (m->layers[l].experts_format != m->layers[0].experts_format)
      return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: layer %d's experts format differs from "
                    "layer 0's (mixed MXFP4/bf16 checkpoints are not built)", l);
  if (c->hidden % 32 || c->intermediate % 32)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: hidden %d / intermediate %d not multiples of 32",
                  c->hidden, c->intermediate);
  if (c->head_dim != 64)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: head_dim %d (only 64 is built)", c->head_dim);
  if (c->n_experts > 1024 || c->n_experts_per_tok > 32 || c->n_experts_per_tok > c->n_experts)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: %d experts, top-%d not supported",
                  c->n_experts, c->n_experts_per_tok);
  return TW_OK;
}

static double tw_gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

static size_t tw_ce_rope_bytes(const tw_ce_t *ce) {
  return 2 * (size_t)ce->max_pos * (ce->cfg->head_dim / 2) * sizeof(float);
}

static size_t tw_ce_attn_ws_bytes(const tw_ce_t *ce) {
  tw_cuda_attn_shape_t sh = {ce->sh.nq, ce->sh.nkv, ce->cfg->head_dim, ce->block_size, 0, 0.125f};
  return tw_cuda_attention_decode_workspace_bytes(&sh, ce->max_batch, ce->max_pos);
}

/* The memory plan's workspace (mem_plan.h tw_mem_ws_fn): the carve of
 * tw_ce_carve sized for (max_batch, chunk) on a copy of the engine, plus the
 * RoPE tables. */
static int64_t tw_ce_ws_fn(void *arg, int32_t max_batch, int32_t chunk) {
  tw_ce_t t = *(const tw_ce_t *)arg;
  t.max_batch = max_batch;
  t.chunk = chunk;
  t.max_rows = chunk > max_batch ? chunk : max_batch;
  t.attn_ws_bytes = tw_ce_attn_ws_bytes(&t);
  tw_ce_carve_t cv = {NULL, 0};
  if (tw_ce_carve(&t, &cv) < 0) return INT64_MAX / 4; /* never: sizing allocates nothing */
  return (int64_t)(cv.off + tw_ce_rope_bytes(&t));
}

/* The memory plan's decode graph count (mem_plan.h): one graph per batch
 * bucket of tw_ce_batch_bucket up to max_batch, times the context buckets
 * (powers of two from 256 to the context) for the batches whose attention
 * splits follow the context (as tw_ce_ctx_bucket in engine_cuda_step.cu
 * decides), at most TW_CE_MAX_GRAPHS kept. */
static int32_t tw_ce_graphs_fn(void *arg, int32_t max_batch) {
  const tw_ce_t *ce = (const tw_ce_t *)arg;
  if (!ce->use_graphs) return 0;
  tw_cuda_attn_shape_t sh = {ce->sh.nq, ce->sh.nkv, ce->cfg->head_dim, 16, 0, 1.0f};
  int32_t n_ctx = 1, n = 0, last = 0;
  for (int32_t p = 256; p < ce->max_pos; p *= 2) n_ctx++;
  for (int32_t b = 1; b <= max_batch; b++) {
    int32_t B = tw_ce_batch_bucket(b, max_batch);
    if (B == last) continue; /* buckets grow with b */
    last = B;
    n += tw_cuda_attention_decode_splits(&sh, B, 1) ==
                 tw_cuda_attention_decode_splits(&sh, B, ce->max_pos)
             ? 1
             : n_ctx;
  }
  return n < TW_CE_MAX_GRAPHS ? n : TW_CE_MAX_GRAPHS;
}

/* The engine's GEMV bound without TWAIN_CUDA_MOE_GEMV_MAX: see
 * TW_CE_GEMV_GROUPED_DEFAULT. */
static int32_t tw_ce_gemv_default(int grouped_moe) {
  if (!grouped_moe) return TW_CE_GEMV_MAX_TOKENS;
  return tw_cuda_moe_stream() && tw_cuda_moe_stream_balance() ? TW_CE_GEMV_STREAM_DEFAULT
                                                              : TW_CE_GEMV_GROUPED_DEFAULT;
}

/* A single-GPU (tp = ep = 1) engine state for sizing, no device touched. */
static tw_ce_t *tw_ce_sizing(const tw_model_config_t *c, int32_t block_size, int grouped_moe) {
  tw_ce_t *t = (tw_ce_t *)calloc(1, sizeof *t);
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT; /* tp = ep = 1: no device, no group */
  if (!t) return NULL;
  t->cfg = c;
  t->block_size = block_size;
  t->max_pos = c->max_position_embeddings;
  t->max_blocks_per_seq = (t->max_pos + block_size - 1) / block_size;
  t->moe_grouped = grouped_moe;
  t->use_graphs = 1;
  t->gemv_max = tw_ce_gemv_default(grouped_moe); /* defaults */
  if (tw_ce_tp_init(t, c, &p, 0) != TW_OK) {
    free(t);
    return NULL;
  }
  t->q_dim = t->sh.nq * c->head_dim;
  t->qkv_dim = (t->sh.nq + 2 * t->sh.nkv) * c->head_dim;
  return t;
}

extern "C" int64_t tw_cuda_engine_workspace_bytes(const tw_model_config_t *c,
                                                  int32_t block_size, int32_t max_batch,
                                                  int32_t chunk, int grouped_moe) {
  tw_ce_t *t = tw_ce_sizing(c, block_size, grouped_moe);
  int64_t bytes = t ? tw_ce_ws_fn(t, max_batch, chunk) : -1;
  free(t);
  return bytes;
}

extern "C" int32_t tw_cuda_engine_graph_count(const tw_model_config_t *c, int32_t max_batch) {
  tw_ce_t *t = tw_ce_sizing(c, 16, 1);
  int32_t n = t ? tw_ce_graphs_fn(t, max_batch) : -1;
  free(t);
  return n;
}

extern "C" tw_status_t tw_cuda_engine_create(const tw_model_t *model,
                                             const tw_engine_params_t *params,
                                             tw_engine_t **engine_p) {
  if (!model || !params || !engine_p)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "cuda engine: NULL argument");
  TW_CHECK(tw_ce_config_check(model, params));
  const tw_model_config_t *c = &model->config;
  if (params->kv_dtype == TW_KV_DTYPE_FP8 && params->kv_block_size % 4)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "cuda engine: the fp8 KV cache needs blocks of a multiple of 4 tokens, got %d",
                  params->kv_block_size);
  TW_CUDA_CHECK(cudaSetDevice(params->device));
  TW_CHECK(tw_cuda_moe_setup());
  tw_engine_t *e = (tw_engine_t *)calloc(1, sizeof(*e));
  tw_ce_t *ce = (tw_ce_t *)calloc(1, sizeof(*ce));
  tw_ce_layer_t *layers = (tw_ce_layer_t *)calloc((size_t)c->n_layers, sizeof(*layers));
  tw_status_t st = TW_OK;
  tw_ce_up_t up = {NULL, 0, NULL, 0, 0, NULL, 0};
  tw_ce_carve_t cv = {NULL, 0};
  size_t free_b = 0, total_b = 0, kv_block_all = 0, h_bytes = 0, pbf16_bytes = 0;
  bool pbf16_on = false;
  int64_t n_blocks = params->kv_num_blocks;
  if (!e || !ce || !layers) {
    free(e);
    free(ce);
    free(layers);
    return tw_err(TW_ERR_NO_MEMORY, "cuda engine: out of host memory");
  }
  e->magic = TW_ENGINE_MAGIC;
  e->ops = &tw_ce_ops;
  e->model = model;
  e->params = *params;
  e->backend = ce;
  ce->layers = layers;
  ce->cfg = c;
  ce->share_fd = -1;
  ce->share_mem_fd = -1;
  ce->share_sock = -1;
  ce->block_size = params->kv_block_size;
  ce->kv_fp8 = params->kv_dtype == TW_KV_DTYPE_FP8;
  ce->chunk = params->max_prefill_chunk; /* 0 with a memory plan: planned below */
  ce->max_batch = params->max_batch;
  ce->max_pos = c->max_position_embeddings;
  ce->max_blocks_per_seq = (ce->max_pos + params->kv_block_size - 1) / params->kv_block_size;
  ce->bf16_experts = c->n_layers > 0 && model->layers[0].experts_format == TW_EXPERTS_BF16;
  {
    /* the grouped-GEMM MoE (Hopper) needs no host sync; TWAIN_CUDA_MOE_CUBLAS=1
     * selects the per-expert cuBLAS path instead, for A/B runs */
    const tw_cuda_knobs_t *kn = tw_cuda_knobs(); /* read once per process (knobs.h) */
    ce->moe_grouped =
        tw_cuda_moe_grouped_supported(c->hidden, c->intermediate) && !kn->moe_cublas;
    /* GEMV MoE up to gemv_max rows: TW_CE_GEMV_MAX_TOKENS without the grouped
     * path, tw_ce_gemv_default with it; TWAIN_CUDA_MOE_GEMV_MAX
     * (0..TW_CE_GEMV_MAX_TOKENS) overrides for A/B runs. EP > 1 always runs
     * its GEMV slices (engine_cuda_tp.cu). */
    int g = kn->moe_gemv_max;
    ce->gemv_max = g >= 0 ? (int32_t)g : tw_ce_gemv_default(ce->moe_grouped);
    if (!ce->moe_grouped || ce->bf16_experts) ce->gemv_max = TW_CE_GEMV_MAX_TOKENS;
    ce->pbf16_min = INT32_MAX; /* no prefill bf16 copy unless one is planned below */
  }
  /* the cuBLAS MoE reads per-expert counts on the host: not capturable, so
   * without the grouped path only GEMV-MoE steps of MXFP4 experts are graphed */
  ce->use_graphs = ce->moe_grouped || !ce->bf16_experts;
  {
    /* debug knob TWAIN_CUDA_PROFILE: per-op timing with a sync after each op */
    if (tw_cuda_knobs()->profile &&
        cudaEventCreate(&ce->prof_ev[0]) == cudaSuccess &&
        cudaEventCreate(&ce->prof_ev[1]) == cudaSuccess) {
      ce->profile = 1;
      ce->use_graphs = 0;
    }
  }
  TW_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&ce->stream, cudaStreamNonBlocking), st, fail);
  TW_CHECK_GOTO(tw_cuda_gemm_create(0, &ce->gemm), st, fail);
  TW_CHECK_GOTO(tw_ce_tp_init(ce, c, params, ce->bf16_experts), st, fail);
  ce->q_dim = ce->sh.nq * c->head_dim; /* local heads: all of them when tp = 1 */
  ce->qkv_dim = (ce->sh.nq + 2 * ce->sh.nkv) * c->head_dim;
  /* weights: an own arena, or one copy shared by the workers on this GPU */
  TW_CHECK_GOTO(tw_ce_walk(ce, model, &up), st, fail);
  ce->warena_bytes = up.off;
  if (params->weights_share_dir) {
    TW_CHECK_GOTO(tw_ce_share_open(ce, model, params, ce->warena_bytes, &up.views), st, fail);
  } else {
    TW_CUDA_CHECK_GOTO(cudaMalloc(&ce->warena, ce->warena_bytes), st, fail);
  }
  up.base = (char *)ce->warena;
  up.off = 0;
  st = tw_ce_walk(ce, model, &up); /* views: pointers only, nothing uploaded */
  free(up.tmp);
  up.tmp = NULL;
  cudaFree(up.dscr);
  up.dscr = NULL;
  if (st < 0) goto fail;
  if (ce->share_fd >= 0) TW_CHECK_GOTO(tw_ce_share_publish(ce, params->device), st, fail);
  e->weights_origin = ce->warena_imported ? 2 : ce->share_exported ? 1 : 0;
  /* the prefill bf16 copy of the experts (tw_ce_t.pbf16): which workers may
   * hold one (MXFP4 experts, no EP split, the grouped MoE's GPU), its bytes */
  if (!ce->bf16_experts && ce->sh.ep_size == 1 && ce->moe_grouped && c->n_layers > 0 &&
      params->prefill_bf16_experts >= 0) {
    pbf16_bytes = (size_t)c->n_layers *
                  tw_cuda_moe_dequant_bytes(c->n_experts, c->hidden, c->intermediate);
    ce->pbf16_min = tw_cuda_knobs()->prefill_bf16_min;
  }
  /* without a plan only when asked; with one, the plan says (prefill workers) */
  pbf16_on = pbf16_bytes > 0 && params->prefill_bf16_experts > 0;
  /* the memory plan, now that the weights are in place (mem_plan.h) */
  if (params->mem_role) {
    tw_mem_plan_in_t in;
    tw_mem_plan_t plan;
    tw_engine_plan_input(model, params, &in);
    in.prefill_bf16_bytes = (int64_t)pbf16_bytes;
    in.window_ring = tw_kv_ring_wanted(params->kv_window_ring, TW_CE_RING_DEFAULT);
    TW_CUDA_CHECK_GOTO(cudaMemGetInfo(&free_b, &total_b), st, fail);
    in.total_bytes = (int64_t)total_b;
    in.free_bytes = (int64_t)free_b;
    in.weight_bytes = (int64_t)ce->warena_bytes;
    in.kv_elem_bytes = 2;
    in.kv_fp8 = ce->kv_fp8;
    in.kv_heads = ce->sh.nkv;
    in.shared_weights = params->weights_share_dir != NULL;
    in.ws_bytes = tw_ce_ws_fn;
    in.ws_arg = ce;
    in.graph_bytes = ce->use_graphs ? TW_CE_GRAPH_BYTES : 0;
    in.graph_count = tw_ce_graphs_fn;
    TW_CHECK_GOTO(tw_mem_plan(&in, &plan), st, fail);
    tw_engine_plan_apply(&plan, &e->params);
    ce->chunk = e->params.max_prefill_chunk;
    ce->max_batch = e->params.max_batch;
    n_blocks = e->params.kv_num_blocks;
    pbf16_on = pbf16_bytes > 0 && plan.prefill_bf16 && params->mem_role == TW_MEM_ROLE_PREFILL;
  }
  if (pbf16_on) { /* dequantised once (spec §3.4), the layout of bf16-expert checkpoints */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    TW_CUDA_CHECK_GOTO(cudaMalloc(&ce->pbf16, pbf16_bytes), st, fail);
    size_t per = pbf16_bytes / (size_t)c->n_layers;
    for (int32_t l = 0; l < c->n_layers; l++) {
      ce->layers[l].pwdq = (char *)ce->pbf16 + (size_t)l * per;
      TW_CHECK_GOTO(tw_cuda_moe_dequant(&ce->layers[l].moe, NULL, (void *)ce->layers[l].pwdq,
                                        ce->stream),
                    st, fail);
    }
    TW_CUDA_CHECK_GOTO(cudaStreamSynchronize(ce->stream), st, fail);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    TW_INFO("engine",
            "prefill experts: a bf16 copy of %.2f GiB (%d layers) for the MoE of prefill passes "
            "of %d tokens or more (cuBLAS), dequantised in %.2f s",
            tw_gib(pbf16_bytes), c->n_layers, (int)ce->pbf16_min,
            (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  } else {
    ce->pbf16_min = INT32_MAX; /* no copy: the workspace need not hold the cuBLAS path's */
  }
  ce->max_rows = ce->chunk > ce->max_batch ? ce->chunk : ce->max_batch;
  if (ce->max_rows > TW_CE_GEMV_MAX_TOKENS && !ce->moe_grouped) {
    TW_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&ce->dq_stream, cudaStreamNonBlocking), st, fail);
    TW_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ce->dq_start, cudaEventDisableTiming), st, fail);
    for (int i = 0; i < 2; i++) {
      TW_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ce->dq_done[i], cudaEventDisableTiming), st,
                         fail);
      TW_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ce->dq_free[i], cudaEventDisableTiming), st,
                         fail);
    }
  }
  /* RoPE tables */
  {
    size_t tb = (size_t)ce->max_pos * (c->head_dim / 2) * sizeof(float);
    float *hc = (float *)malloc(tb), *hs = (float *)malloc(tb);
    if (!hc || !hs) {
      free(hc);
      free(hs);
      st = tw_err(TW_ERR_NO_MEMORY, "cuda engine: out of host memory for rope tables");
      goto fail;
    }
    st = tw_cuda_rope_table_fill(c, ce->max_pos, hc, hs);
    if (st >= 0 && cudaMalloc((void **)&ce->rope_cos, tb) == cudaSuccess &&
        cudaMalloc((void **)&ce->rope_sin, tb) == cudaSuccess &&
        cudaMemcpy(ce->rope_cos, hc, tb, cudaMemcpyHostToDevice) == cudaSuccess &&
        cudaMemcpy(ce->rope_sin, hs, tb, cudaMemcpyHostToDevice) == cudaSuccess) {
    } else if (st >= 0) {
      st = tw_err(TW_ERR_CUDA, "cuda engine: rope table upload failed (%zu bytes each)", tb);
    }
    free(hc);
    free(hs);
    if (st < 0) goto fail;
  }
  /* workspace */
  ce->attn_ws_bytes = tw_ce_attn_ws_bytes(ce);
  TW_CHECK_GOTO(tw_ce_carve(ce, &cv), st, fail);
  ce->ws_bytes = cv.off;
  TW_CUDA_CHECK_GOTO(cudaMalloc(&ce->ws_arena, ce->ws_bytes), st, fail);
  cv.base = (char *)ce->ws_arena;
  cv.off = 0;
  TW_CHECK_GOTO(tw_ce_carve(ce, &cv), st, fail);
  /* decode attention: its split counters start at zero (attention.h) */
  TW_CUDA_CHECK_GOTO(cudaMemset(ce->attn_ws, 0, ce->attn_ws_bytes), st, fail);
  /* ep > 1: the GEMV combine reads (weight 0) outputs of other ranks'
   * assignments that are never written: start them finite */
  if (ce->sh.ep_size > 1) TW_CUDA_CHECK_GOTO(cudaMemset(ce->moe_dec_ws, 0, ce->moe_dec_bytes), st, fail);
  /* pinned staging */
  {
    size_t R = (size_t)ce->max_rows, B = (size_t)ce->max_batch;
    h_bytes = R * 3 * 4 + B * 2 * 4 + (2 * B + 2) * 4 + (size_t)c->n_experts * 4 +
              B * (size_t)ce->max_blocks_per_seq * 4 + B * sizeof(tw_cuda_sample_row_t) + 64;
    TW_CUDA_CHECK_GOTO(cudaMallocHost(&ce->h_arena, h_bytes), st, fail);
    char *h = (char *)ce->h_arena;
    ce->h_params = (tw_cuda_sample_row_t *)h; h += B * sizeof(tw_cuda_sample_row_t);
    ce->h_tokens = (int32_t *)h; h += R * 4;
    ce->h_positions = (int32_t *)h; h += R * 4;
    ce->h_slots = (int32_t *)h; h += R * 4;
    ce->h_seq_lens = (int32_t *)h; h += B * 4;
    ce->h_next = (int32_t *)h; h += B * 4;
    ce->h_cu = (int32_t *)h; h += (2 * B + 2) * 4; /* prefill cu [B + 1], then start [B] */
    ce->h_counts = (int32_t *)h; h += (size_t)c->n_experts * 4;
    ce->h_block_tables = (int32_t *)h;
  }
  /* KV pool: what is asked, or most of the memory left */
  kv_block_all = (size_t)c->n_layers * 2 * ce->sh.nkv *
                 (size_t)tw_kv_head_bytes(ce->kv_fp8 ? TW_DTYPE_F8_E4M3 : TW_DTYPE_BF16,
                                          params->kv_block_size, c->head_dim);
  TW_CUDA_CHECK_GOTO(cudaMemGetInfo(&free_b, &total_b), st, fail);
  if (n_blocks == 0) {
    size_t reserve = (size_t)2 << 30;
    size_t avail = free_b > reserve ? (size_t)((double)(free_b - reserve) * 0.9) : 0;
    n_blocks = (int64_t)(avail / kv_block_all);
    uint64_t rmask = tw_kv_ring_wanted(params->kv_window_ring, TW_CE_RING_DEFAULT) ? tw_kv_ring_layer_mask(c) : 0;
    if (rmask && e->params.kv_ring_blocks > 0) { /* rings first, the rest for the full layers */
      int64_t n_ring_layers = 0, lb = (int64_t)(kv_block_all / c->n_layers);
      for (int32_t l = 0; l < 64; l++) n_ring_layers += (int64_t)((rmask >> l) & 1u);
      int64_t left = (int64_t)avail - (int64_t)e->params.kv_ring_blocks * n_ring_layers * lb;
      n_blocks = left > 0 ? left / (lb * (c->n_layers - n_ring_layers)) : 0;
    }
    int64_t cap = (int64_t)ce->max_batch * ce->max_blocks_per_seq;
    if (n_blocks > cap) n_blocks = cap;
    if (n_blocks > 0x7fffffff / params->kv_block_size) n_blocks = 0x7fffffff / params->kv_block_size;
    if (n_blocks < 1) {
      st = tw_err(TW_ERR_NO_MEMORY, "cuda engine: no device memory left for the KV pool "
                  "(%.2f GiB free)", tw_gib(free_b));
      goto fail;
    }
  }
  /* the window ring (kv_ring.h): on unless turned off (kv_window_ring -1) */
  tw_kv_ring_setup(c, tw_kv_ring_wanted(params->kv_window_ring, TW_CE_RING_DEFAULT), (int32_t)n_blocks,
                   params->kv_block_size, e->params.kv_ring_blocks, &e->kv.ring_blocks,
                   &e->kv.n_ring_blocks, &e->kv.ring_layers);
  ce->ring_blocks = e->kv.ring_blocks;
  ce->ring_layers = e->kv.ring_layers;
  ce->kv_block_bytes = (int64_t)(kv_block_all / c->n_layers);
  ce->kv_bytes = (size_t)tw_kv_pool_bytes_of(c->n_layers, ce->kv_block_bytes, (int32_t)n_blocks,
                                             e->kv.n_ring_blocks, e->kv.ring_blocks,
                                             e->kv.ring_layers);
  ce->kv_layer_stride_bytes = (int64_t)n_blocks * ce->kv_block_bytes;
  ce->kv_layer_off = (int64_t *)malloc(sizeof(int64_t) * (size_t)c->n_layers);
  if (!ce->kv_layer_off) {
    st = tw_err(TW_ERR_NO_MEMORY, "cuda engine: out of host memory");
    goto fail;
  }
  for (int32_t l = 0; l < c->n_layers; l++)
    ce->kv_layer_off[l] = tw_kv_layer_offset_of(l, ce->kv_block_bytes, (int32_t)n_blocks,
                                                e->kv.n_ring_blocks, e->kv.ring_blocks,
                                                e->kv.ring_layers);
  if (ce->ring_blocks) { /* ring slots, tables and copy pairs: device and pinned staging */
    size_t R = (size_t)ce->max_rows, B = (size_t)ce->max_batch;
    size_t ints = R + B * (size_t)ce->max_blocks_per_seq + 4 * B * (size_t)ce->ring_blocks;
    void *d = NULL, *h = NULL;
    TW_CUDA_CHECK_GOTO(cudaMalloc(&d, ints * 4), st, fail);
    ce->d_ring_slots = (int32_t *)d;
    TW_CUDA_CHECK_GOTO(cudaMallocHost(&h, ints * 4), st, fail);
    ce->h_ring_slots = (int32_t *)h;
    ce->d_ring_tables = ce->d_ring_slots + R;
    ce->h_ring_tables = ce->h_ring_slots + R;
    ce->d_ring_pairs = ce->d_ring_tables + B * (size_t)ce->max_blocks_per_seq;
    ce->h_ring_pairs = ce->h_ring_tables + B * (size_t)ce->max_blocks_per_seq;
    TW_CUDA_CHECK_GOTO(cudaMemset(d, 0, ints * 4), st, fail);
  }
  TW_CUDA_CHECK_GOTO(cudaMalloc(&ce->kv_pool, ce->kv_bytes), st, fail);
  TW_CUDA_CHECK_GOTO(cudaMemset(ce->kv_pool, 0, ce->kv_bytes), st, fail);
  e->kv.dtype = ce->kv_fp8 ? TW_DTYPE_F8_E4M3 : TW_DTYPE_BF16;
  e->kv.on_device = true;
  e->kv.device = params->device;
  e->kv.n_layers = c->n_layers;
  e->kv.n_blocks = (int32_t)n_blocks;
  e->kv.block_size = params->kv_block_size;
  e->kv.n_kv_heads_local = ce->sh.nkv;
  e->kv.kv_head_offset = ce->sh.kv0;
  e->kv.head_dim = c->head_dim;
  e->kv.base = ce->kv_pool;
  e->kv.layer_stride_bytes = ce->kv_layer_stride_bytes;
  e->kv.block_bytes = (int64_t)(kv_block_all / c->n_layers);
  e->kv.total_bytes = (int64_t)ce->kv_bytes;
  TW_INFO("engine",
          "cuda memory plan: weights %.2f GiB, kv pool %.2f GiB %s (%lld blocks of %d tokens; "
          "sliding layers: %s %d blocks), "
          "workspace %.2f GiB (moe %s path %.2f, chunk %d, max "
          "batch %d), rope %.2f GiB, "
          "pinned host %.1f MiB; %.2f of %.2f GiB free before the pool",
          tw_gib(ce->warena_bytes), tw_gib(ce->kv_bytes), tw_kv_pool_dtype_name(e->kv.dtype),
          (long long)n_blocks,
          params->kv_block_size, e->kv.ring_blocks ? "window rings of" : "all",
          e->kv.n_ring_blocks, tw_gib(ce->ws_bytes),
          ce->moe_grouped ? "grouped-gemm" : "cublas (incl. 2 dequantised layers)",
          tw_gib(ce->moe_pre_bytes + 2 * ce->dq_bytes), ce->chunk,
          ce->max_batch, tw_gib((size_t)ce->max_pos * c->head_dim * 4),
          (double)h_bytes / 1048576.0, tw_gib(free_b), tw_gib(total_b));
  if (ce->sh.tp_size > 1 || ce->sh.ep_size > 1)
    TW_INFO("engine",
            "cuda shard: tp rank %d of %d (query heads [%d, %d), kv heads [%d, %d), vocabulary "
            "[%d, %d)), ep rank %d of %d (experts [%d, %d)): weights %.3f GiB and kv pool "
            "%.3f GiB on this rank",
            ce->sh.tp_rank, ce->sh.tp_size, ce->sh.q0, ce->sh.q0 + ce->sh.nq, ce->sh.kv0, ce->sh.kv0 + ce->sh.nkv, ce->sh.v0,
            ce->sh.v0 + ce->sh.nv, ce->sh.ep_rank, ce->sh.ep_size, ce->sh.e0, ce->sh.e1, tw_gib(ce->warena_bytes),
            tw_gib(ce->kv_bytes));
  *engine_p = e;
  return TW_OK;
fail:
  free(up.tmp);
  tw_ce_destroy(e);
  return st;
}
