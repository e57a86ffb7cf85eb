/* engine_cuda_tp.cu: tensor- and expert-parallel parts of the CUDA engine
 * (issue 6 item 2), on the shard plan both backends use (common/engine/shard_plan.h):
 *   TP P, rank r: query heads [r NQ/P, (r+1) NQ/P), KV heads likewise (the
 *     QKV rows, o_proj columns, sinks of those heads; o_proj bias on rank 0),
 *     an all-reduce of the O projection's f32 [T, H] partials; vocabulary rows
 *     [r Vp, min(V, (r+1) Vp)), Vp = ceil(V/P) rounded up to a multiple of 8,
 *     all-gathered before sampling so every rank samples the TP 1 token.
 *   EP P, rank r: experts [r E/P, (r+1) E/P); the router runs in full on
 *     every rank, assignments to other ranks' experts get weight 0 and are
 *     not computed, and the combine is an all-reduce of the f32 [T, H]
 *     weighted sums (b2 added by the holder, inside its weighted output).
 * Collectives are NCCL on the engine's stream (collective.h), so they are
 * captured into the decode graphs; they run only when tp or ep > 1 (the
 * plan and the weight walk of engine_cuda.cu run at every size).
 * Not yet run on a GPU (docs/parallelism.md, CUDA). */
#include "kernels/engine_cuda_impl.h"

#include "common/comm/collective.h"
#include "common/base/log.h"
#include "kernels/cuda_common.h"

TW_NODISCARD tw_status_t tw_ce_tp_init(tw_ce_t *ce, const tw_model_config_t *c,
                                       const tw_engine_params_t *p, int bf16_experts) {
  TW_CHECK(tw_shard_plan_init(c, p, "cuda", &ce->sh));
  const tw_shard_plan_t *sh = &ce->sh;
  if (p->dp_attention)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: data-parallel attention is not built");
  if (sh->tp_size == 1 && sh->ep_size == 1) return TW_OK;
  if (tw_coll_kind(p->coll) != TW_COLL_NCCL)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: tp_size %d / ep_size %d need an NCCL "
                  "group in params.coll", sh->tp_size, sh->ep_size);
  if (sh->ep_size > 1 && bf16_experts)
    return tw_err(TW_ERR_UNSUPPORTED, "cuda engine: ep_size %d with bf16 experts is not built",
                  sh->ep_size);
  TW_CHECK(tw_coll_nccl_set_stream(p->coll, ce->stream));
  ce->coll = p->coll;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_ce_tp_allreduce(tw_ce_t *ce, float *x, int64_t n) {
  return tw_coll_allreduce_sum_f32(ce->coll, x, n);
}

TW_NODISCARD tw_status_t tw_ce_tp_unembed(tw_ce_t *ce, const void *xn, int32_t rows) {
  const tw_model_config_t *c = ce->cfg;
  int32_t H = c->hidden, V = c->vocab_size, vp = ce->sh.vp;
  cudaStream_t s = ce->stream;
  TW_CHECK(tw_cuda_gemm_bf16(ce->gemm, rows, ce->sh.nv, H, xn, H, ce->lm_head, H, NULL, ce->lg_local,
                             TW_DTYPE_F32, vp, s));
  TW_CHECK(tw_coll_allgather(ce->coll, ce->lg_local, ce->lg_all, (int64_t)rows * vp * 4));
  for (int32_t r = 0; r < ce->sh.tp_size; r++) { /* rank r's [rows, nv_r] block to columns r*vp */
    int32_t nv_r = V - r * vp < vp ? V - r * vp : vp;
    TW_CUDA_CHECK(cudaMemcpy2DAsync(ce->logits + (size_t)r * vp, (size_t)V * 4,
                                    ce->lg_all + (size_t)r * rows * vp, (size_t)vp * 4,
                                    (size_t)nv_r * 4, (size_t)rows, cudaMemcpyDeviceToDevice, s));
  }
  return TW_OK;
}

/* One block: weight 0 for the assignments of experts outside [e0, e1), and
 * the active list cut to the local experts (it is in increasing id order, so
 * it stays so), so the GEMV kernels run only this rank's experts. */
__global__ void tw_ce_ep_mask_kernel(const int32_t *__restrict__ topk_idx, float *topk_w,
                                     int32_t *active, int32_t *n_active, int tk, int e0, int e1) {
  for (int a = threadIdx.x; a < tk; a += blockDim.x) {
    int e = topk_idx[a];
    if (e < e0 || e >= e1) topk_w[a] = 0.0f;
  }
  if (threadIdx.x == 0) {
    int n = *n_active, m = 0;
    for (int i = 0; i < n; i++) {
      int e = active[i];
      if (e >= e0 && e < e1) active[m++] = e;
    }
    *n_active = m;
  }
}

TW_NODISCARD tw_status_t tw_ce_ep_moe(tw_ce_t *ce, const tw_ce_layer_t *L, int32_t T) {
  const tw_model_config_t *c = ce->cfg;
  cudaStream_t s = ce->stream;
  int32_t H = c->hidden, E = c->n_experts;
  for (int32_t t0 = 0; t0 < T; t0 += TW_CE_GEMV_MAX_TOKENS) {
    int32_t n = T - t0 < TW_CE_GEMV_MAX_TOKENS ? T - t0 : TW_CE_GEMV_MAX_TOKENS;
    const void *xn = (const char *)ce->xn + (size_t)t0 * H * 2;
    if (tw_cuda_moe_router_fused_supported(&ce->route, xn, L->wr, n, H)) {
      TW_CHECK(tw_cuda_moe_router_fused(&ce->route, xn, L->wr, L->br, n, H, ce->rlog, s));
    } else {
      TW_CHECK(tw_cuda_gemm_bf16(ce->gemm, n, E, H, xn, H, L->wr, H, L->br, ce->rlog,
                                 TW_DTYPE_F32, E, s));
      TW_CHECK(tw_cuda_moe_route(&ce->route, ce->rlog, n, s));
    }
    tw_ce_ep_mask_kernel<<<1, 256, 0, s>>>(ce->route.topk_idx, ce->route.topk_w,
                                            ce->route.active, ce->route.n_active,
                                            n * c->n_experts_per_tok, ce->sh.e0, ce->sh.e1);
    TW_CUDA_CHECK_LAUNCH("tw_ce_ep_mask_kernel");
    TW_CHECK(tw_cuda_moe_decode(&L->moe, &ce->route, n, xn, ce->moe_dec_ws, ce->moe_dec_bytes,
                                ce->moe_out + (size_t)t0 * H, s));
  }
  return tw_ce_tp_allreduce(ce, ce->moe_out, (int64_t)T * H);
}
