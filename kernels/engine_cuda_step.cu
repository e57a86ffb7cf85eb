/* engine_cuda_step.cu: the forward pass of the CUDA engine (spec §2): chunked
 * prefill of one sequence and batched decode, the latter captured into one
 * CUDA graph per (batch bucket, context bucket). Inside a step nothing
 * synchronises the host but the copy-out of the results the caller asked for
 * at the end. Exception: on GPUs without the grouped-GEMM MoE (compute
 * capability other than 9.0, or TWAIN_CUDA_MOE_CUBLAS=1) the MoE of more than
 * TW_CE_GEMV_MAX_TOKENS rows runs the cuBLAS path, which reads the per-expert
 * counts on the host once per layer; those decode steps are not graphed.
 *
 * Per layer: x (f32 residual) -> RMSNorm -> QKV GEMM (+bias, f32) -> RoPE (bf16 q) +
 * paged KV write -> attention -> O GEMM (+bias, f32) -> residual add + RMSNorm
 * -> router GEMM (f32 logits, spec §2.8) -> top-k/sort -> MoE (f32 out) ->
 * residual add at the next norm. */
#include "kernels/engine_cuda_impl.h"

#include "common/base/log.h"
#include "common/engine/sampling.h"
#include "kernels/attention.h"
#include "kernels/cuda_common.h"
#include "kernels/kv_block_copy.h"
#include "kernels/norm_rope.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *const tw_ce_prof_names[TW_CE_PROF_N] = {
    "embed", "norm", "qkv", "rope+kv", "attention", "o_proj", "router", "route", "moe", "lm_head",
    "sample"};

/* Run `call`; in profile mode time it alone with events (stream synced). */
#define TW_CE_OP(cat, call)                                                       \
  do {                                                                            \
    if (ce->profile) TW_CUDA_CHECK(cudaEventRecord(ce->prof_ev[0], ce->stream)); \
    TW_CHECK(call);                                                               \
    if (ce->profile) {                                                            \
      float ms_ = 0.0f;                                                           \
      TW_CUDA_CHECK(cudaEventRecord(ce->prof_ev[1], ce->stream));                 \
      TW_CUDA_CHECK(cudaEventSynchronize(ce->prof_ev[1]));                        \
      TW_CUDA_CHECK(cudaEventElapsedTime(&ms_, ce->prof_ev[0], ce->prof_ev[1]));  \
      ce->prof_ms[cat] += ms_;                                                    \
    }                                                                             \
  } while (0)

void tw_ce_profile_log(const tw_ce_t *ce) {
  double tot = 0;
  for (int i = 0; i < TW_CE_PROF_N; i++) tot += ce->prof_ms[i];
  if (tot <= 0) return;
  char line[1024];
  int n = snprintf(line, sizeof line, "cuda profile over %lld prefill chunks + %lld decode steps, "
                   "total %.3f ms:", (long long)ce->prof_steps[0], (long long)ce->prof_steps[1], tot);
  for (int i = 0; i < TW_CE_PROF_N && n < (int)sizeof line - 40; i++)
    n += snprintf(line + n, sizeof line - (size_t)n, " %s %.3f (%.1f%%)", tw_ce_prof_names[i],
                  ce->prof_ms[i], 100.0 * ce->prof_ms[i] / tot);
  TW_INFO("engine", "%s", line);
}

/* T token rows: a decode step (one row per sequence) or a prefill pass of
 * n_seqs sequences (rows concatenated, ce->d_cu / d_start / d_block_tables).
 * kv_ev: NULL, or one event per layer, recorded once that layer's K/V
 * writes are enqueued (prefill with on_pass_layer, see tw_ce_prefill_pass). */
static TW_NODISCARD tw_status_t tw_ce_layers(tw_ce_t *ce, int32_t T, int decode, int32_t max_seq_len,
                                int32_t block_size, int32_t n_seqs, cudaEvent_t *kv_ev) {
  const tw_model_config_t *c = ce->cfg;
  cudaStream_t s = ce->stream;
  int32_t H = c->hidden, E = c->n_experts, QKV = ce->qkv_dim, QD = ce->q_dim;
  tw_cuda_attn_shape_t sh = {ce->sh.nq, ce->sh.nkv, c->head_dim, block_size, 0,
                             (float)(1.0 / sqrt((double)c->head_dim)), ce->kv_fp8 ? 1 : 0};
  TW_CE_OP(TW_CE_PROF_EMBED, tw_cuda_embed(ce->embed, c->vocab_size, H, ce->d_tokens, T, ce->x, s));
  bool gemm_moe = T > ce->gemv_max && !ce->bf16_experts && ce->sh.ep_size == 1 && !ce->moe_grouped;
  if (gemm_moe) { /* layer 0's experts, after whatever ran before on s */
    TW_CUDA_CHECK(cudaEventRecord(ce->dq_start, s));
    TW_CUDA_CHECK(cudaStreamWaitEvent(ce->dq_stream, ce->dq_start, 0));
    TW_CHECK(tw_cuda_moe_dequant(&ce->layers[0].moe, NULL, ce->dq_buf[0], ce->dq_stream));
    TW_CUDA_CHECK(cudaEventRecord(ce->dq_done[0], ce->dq_stream));
  }
  for (int l = 0; l < c->n_layers; l++) {
    const tw_ce_layer_t *L = &ce->layers[l];
    if (gemm_moe && l + 1 < c->n_layers) {
      /* layer l+1 into the buffer layer l-1 used, once its GEMMs are done */
      int nb = (l + 1) % 2;
      if (l >= 1) TW_CUDA_CHECK(cudaStreamWaitEvent(ce->dq_stream, ce->dq_free[nb], 0));
      TW_CHECK(tw_cuda_moe_dequant(&ce->layers[l + 1].moe, NULL, ce->dq_buf[nb], ce->dq_stream));
      TW_CUDA_CHECK(cudaEventRecord(ce->dq_done[nb], ce->dq_stream));
    }
    void *kv = (char *)ce->kv_pool + ce->kv_layer_off[l];
    /* ring layers (common/kv/kv_ring.h): a decode step through the ring views;
     * a prefill pass in its scratch, the ring blocks of earlier positions
     * copied in first and its last blocks copied back after the write */
    bool ring = tw_kv_is_ring_layer(ce->ring_layers, ce->ring_blocks, l);
    void *akv = ring && !decode ? ce->ring_scratch : kv;
    const int32_t *slots = ring ? ce->d_ring_slots : ce->d_slots;
    const int32_t *tables = ring ? ce->d_ring_tables : ce->d_block_tables;
    if (ring && !decode)
      TW_CE_OP(TW_CE_PROF_ROPE, tw_cuda_kv_block_copy(akv, kv, ce->d_ring_pairs, ce->n_ring_in,
                                                      ce->kv_block_bytes, s));
    TW_CE_OP(TW_CE_PROF_NORM, tw_cuda_rmsnorm_residual(ce->x, l ? ce->moe_out : NULL, TW_DTYPE_F32, L->attn_norm,
                                      c->rms_norm_eps, T, H, ce->xn, s));
    /* QKV in f32, rounded to bf16 once after RoPE (q for the attention, k and v
     * into the cache): one rounding instead of two */
    TW_CE_OP(TW_CE_PROF_QKV, tw_cuda_gemm_bf16(ce->gemm, T, QKV, H, ce->xn, H, L->wqkv, H, L->bqkv, ce->qkv,
                               TW_DTYPE_F32, QKV, s));
    TW_CE_OP(TW_CE_PROF_ROPE, (ce->kv_fp8 ? tw_cuda_rope_kv_write_fp8 : tw_cuda_rope_kv_write_f32)(
                                  (const float *)ce->qkv, QKV, T, ce->sh.nq, ce->sh.nkv,
                                  c->head_dim, ce->d_positions, ce->rope_cos, ce->rope_sin,
                                  ce->max_pos, slots, akv, block_size, ce->q, QD, s));
    if (ring && !decode)
      TW_CE_OP(TW_CE_PROF_ROPE, tw_cuda_kv_block_copy(kv, akv, ce->d_ring_pairs + 2 * ce->n_ring_in,
                                                      ce->n_ring_out, ce->kv_block_bytes, s));
    if (kv_ev) TW_CUDA_CHECK(cudaEventRecord(kv_ev[l], s)); /* layer l's K/V of this chunk */
    sh.window = c->layer_types[l] == TW_LAYER_SLIDING ? c->sliding_window : 0;
    if (decode)
      TW_CE_OP(TW_CE_PROF_ATTN, tw_cuda_attention_decode(&sh, ce->q, QD, akv, L->sinks, T, ce->d_seq_lens,
                                        tables, ce->max_blocks_per_seq, max_seq_len,
                                        ce->attn_ws, ce->attn_ws_bytes, ce->attn, s));
    else
      TW_CE_OP(TW_CE_PROF_ATTN, tw_cuda_attention_prefill(&sh, ce->q, QD, akv, L->sinks, n_seqs, T, ce->d_cu,
                                         ce->d_start, tables, ce->max_blocks_per_seq,
                                         ce->attn, s));
    TW_CE_OP(TW_CE_PROF_OPROJ, tw_cuda_gemm_bf16(ce->gemm, T, H, QD, ce->attn, QD, L->wo, QD, L->bo, ce->o,
                               TW_DTYPE_F32, H, s));
    if (ce->sh.tp_size > 1) TW_CE_OP(TW_CE_PROF_OPROJ, tw_ce_tp_allreduce(ce, ce->o, (int64_t)T * H));
    TW_CE_OP(TW_CE_PROF_NORM, tw_cuda_rmsnorm_residual(ce->x, ce->o, TW_DTYPE_F32, L->mlp_norm, c->rms_norm_eps, T,
                                      H, ce->xn, s));
    if (ce->sh.ep_size > 1) { /* router, masked GEMV on the local experts, all-reduce */
      TW_CE_OP(TW_CE_PROF_MOE, tw_ce_ep_moe(ce, L, T));
      continue;
    }
    if (tw_cuda_moe_router_fused_supported(&ce->route, ce->xn, L->wr, T, H)) /* GEMV+top-k+sort */
      TW_CE_OP(TW_CE_PROF_ROUTER, tw_cuda_moe_router_fused(&ce->route, ce->xn, L->wr, L->br, T, H,
                                                           ce->rlog, s));
    else {
      TW_CE_OP(TW_CE_PROF_ROUTER, tw_cuda_gemm_bf16(ce->gemm, T, E, H, ce->xn, H, L->wr, H, L->br,
                                                    ce->rlog, TW_DTYPE_F32, E, s));
      TW_CE_OP(TW_CE_PROF_ROUTE, tw_cuda_moe_route(&ce->route, ce->rlog, T, s));
    }
    if (!decode && L->pwdq && T > ce->gemv_max && T >= ce->pbf16_min) /* on the bf16 copy */
      TW_CE_OP(TW_CE_PROF_MOE, tw_cuda_moe_prefill_cublas(ce->gemm, &L->moe, &ce->route, T,
                                                          ce->xn, L->pwdq, ce->moe_pre_ws,
                                                          ce->moe_pre_bytes, ce->h_counts,
                                                          ce->moe_out, s));
    else if (ce->moe_grouped && (ce->bf16_experts || T > ce->gemv_max))
      TW_CE_OP(TW_CE_PROF_MOE, tw_cuda_moe_prefill(&L->moe, &ce->route, T, ce->xn,
                                                   ce->bf16_experts ? L->wdq : NULL,
                                                   ce->moe_pre_ws, ce->moe_pre_bytes,
                                                   ce->moe_out, s));
    else if (ce->bf16_experts)
      TW_CE_OP(TW_CE_PROF_MOE, tw_cuda_moe_prefill_cublas(ce->gemm, &L->moe, &ce->route, T,
                                                          ce->xn, L->wdq, ce->moe_pre_ws,
                                                          ce->moe_pre_bytes, ce->h_counts,
                                                          ce->moe_out, s));
    else if (T <= TW_CE_GEMV_MAX_TOKENS)
      TW_CE_OP(TW_CE_PROF_MOE, tw_cuda_moe_decode(&L->moe, &ce->route, T, ce->xn, ce->moe_dec_ws,
                                  ce->moe_dec_bytes, ce->moe_out, s));
    else {
      TW_CUDA_CHECK(cudaStreamWaitEvent(s, ce->dq_done[l % 2], 0));
      TW_CE_OP(TW_CE_PROF_MOE, tw_cuda_moe_prefill_cublas(ce->gemm, &L->moe, &ce->route, T,
                                                          ce->xn, ce->dq_buf[l % 2],
                                                          ce->moe_pre_ws, ce->moe_pre_bytes,
                                                          ce->h_counts, ce->moe_out, s));
      TW_CUDA_CHECK(cudaEventRecord(ce->dq_free[l % 2], s));
    }
  }
  TW_CE_OP(TW_CE_PROF_NORM, tw_cuda_rmsnorm_residual(ce->x, ce->moe_out, TW_DTYPE_F32,
                                                     ce->final_norm, c->rms_norm_eps, T, H,
                                                     ce->xn, s));
  return TW_OK;
}

/* Unembedding of `rows` normalised rows starting at row r0 into ce->logits. */
static TW_NODISCARD tw_status_t tw_ce_unembed(tw_ce_t *ce, int32_t r0, int32_t rows) {
  const tw_model_config_t *c = ce->cfg;
  const char *xn = (const char *)ce->xn + (size_t)r0 * c->hidden * 2;
  if (ce->sh.tp_size > 1) { /* this rank's vocabulary rows, all-gathered */
    TW_CE_OP(TW_CE_PROF_LMHEAD, tw_ce_tp_unembed(ce, xn, rows));
    return TW_OK;
  }
  TW_CE_OP(TW_CE_PROF_LMHEAD,
           tw_cuda_gemm_bf16(ce->gemm, rows, c->vocab_size, c->hidden, xn, c->hidden, ce->lm_head,
                             c->hidden, NULL, ce->logits, TW_DTYPE_F32, c->vocab_size, ce->stream));
  return TW_OK;
}

static tw_cuda_sample_row_t tw_ce_sample_row(const tw_sample_params_t *sp, int64_t position) {
  tw_cuda_sample_row_t r;
  memset(&r, 0, sizeof(r));
  if (sp) {
    r.temperature = sp->temperature;
    r.top_k = sp->top_k;
    r.top_p = sp->top_p;
    r.uniform = tw_sample_uniform(sp->seed, position);
  }
  return r;
}

static TW_NODISCARD tw_status_t tw_ce_pass_run(tw_engine_t *e, const tw_prefill_pass_t *p, cudaEvent_t *kv_ev);

/* One prefill pass (engine_impl.h); with p->on_pass_layer, one event per
 * layer marks its K/V writes: after the pass is enqueued, each layer's event
 * is waited for in order and the callback called, so the transfer of layer
 * l runs while the GPU computes the layers after it (engine.h: late, never
 * early). */
TW_NODISCARD tw_status_t tw_ce_prefill_pass(tw_engine_t *e, const tw_prefill_pass_t *p) {
  if (!p->on_pass_layer) return tw_ce_pass_run(e, p, NULL);
  tw_ce_t *ce = (tw_ce_t *)e->backend;
  int32_t L = ce->cfg->n_layers;
  cudaEvent_t *ev = (cudaEvent_t *)calloc((size_t)L, sizeof(cudaEvent_t));
  if (!ev) return tw_err(TW_ERR_NO_MEMORY, "cuda prefill: cannot allocate %d layer events", L);
  tw_status_t st = TW_OK;
  int32_t made = 0;
  for (; made < L; made++) {
    cudaError_t ce_err = cudaEventCreateWithFlags(&ev[made], cudaEventDisableTiming);
    if (ce_err != cudaSuccess) {
      st = tw_err(TW_ERR_CUDA, "cuda prefill: cudaEventCreate for layer %d: %s", made,
                  cudaGetErrorString(ce_err));
      break;
    }
  }
  if (st == TW_OK) st = tw_ce_pass_run(e, p, ev);
  if (st != TW_OK) cudaStreamSynchronize(ce->stream); /* no event in use when destroyed */
  for (int32_t l = 0; l < made; l++) cudaEventDestroy(ev[l]);
  free(ev);
  return st;
}

/* A prefill pass's ring plan (common/kv/kv_ring.h) on the device: its scratch
 * (grown to the plan; the stream is idle here), every token's slot in it,
 * the segments' scratch tables, the copies in and out. h_start: the
 * segments' first positions. */
static TW_NODISCARD tw_status_t tw_ce_ring_pass(tw_ce_t *ce, const tw_prefill_pass_t *p,
                                                const int32_t *h_start) {
  const int32_t ns = p->n_segs, mbps = ce->max_blocks_per_seq, bs = ce->block_size;
  cudaStream_t s = ce->stream;
  int32_t *n_tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)ns);
  const int32_t **tabs = (const int32_t **)malloc(sizeof(*tabs) * (size_t)ns);
  tw_status_t st = TW_OK;
  if (!n_tok || !tabs) st = tw_err(TW_ERR_NO_MEMORY, "cuda prefill: out of memory for the ring plan");
  for (int32_t g = 0; st == TW_OK && g < ns; g++) {
    n_tok[g] = p->segs[g].n_tokens;
    tabs[g] = p->segs[g].block_table;
  }
  if (st == TW_OK)
    st = tw_kv_ring_pass_plan(&ce->ring_plan, ns, h_start, n_tok, tabs, mbps, bs,
                              ce->cfg->sliding_window, ce->ring_blocks, 0);
  free(n_tok);
  free((void *)tabs);
  TW_CHECK(st);
  const tw_kv_ring_pass_t *rp = &ce->ring_plan;
  if (rp->n_scratch > ce->cap_scratch) {
    if (ce->ring_scratch) TW_CUDA_CHECK(cudaFree(ce->ring_scratch));
    ce->ring_scratch = NULL;
    ce->cap_scratch = 0;
    size_t bytes = (size_t)rp->n_scratch * (size_t)ce->kv_block_bytes;
    TW_CUDA_CHECK(cudaMalloc(&ce->ring_scratch, bytes));
    TW_CUDA_CHECK(cudaMemset(ce->ring_scratch, 0, bytes)); /* finite where never written */
    ce->cap_scratch = rp->n_scratch;
  }
  for (int32_t g = 0, t = 0; g < ns; g++) {
    const int32_t *row = rp->tables + (size_t)g * mbps;
    for (int32_t i = 0; i < p->segs[g].n_tokens; i++, t++) {
      int32_t pos = h_start[g] + i;
      ce->h_ring_slots[t] = row[pos / bs] * bs + pos % bs;
    }
  }
  memcpy(ce->h_ring_tables, rp->tables, sizeof(int32_t) * (size_t)ns * (size_t)mbps);
  memcpy(ce->h_ring_pairs, rp->copy_in, sizeof(int32_t) * 2 * (size_t)rp->n_in);
  memcpy(ce->h_ring_pairs + 2 * rp->n_in, rp->copy_out, sizeof(int32_t) * 2 * (size_t)rp->n_out);
  ce->n_ring_in = rp->n_in;
  ce->n_ring_out = rp->n_out;
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_ring_slots, ce->h_ring_slots, (size_t)p->n_tokens * 4,
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_ring_tables, ce->h_ring_tables, (size_t)ns * mbps * 4,
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_ring_pairs, ce->h_ring_pairs,
                                (size_t)(rp->n_in + rp->n_out) * 8, cudaMemcpyHostToDevice, s));
  return TW_OK;
}

/* The pass's tokens as one batch of rows: per token its position and KV
 * slot, per segment its row range (cu), first position and block table row
 * (the prefill attention walks the segments' query tiles in one launch). */
static TW_NODISCARD tw_status_t tw_ce_pass_run(tw_engine_t *e, const tw_prefill_pass_t *p, cudaEvent_t *kv_ev) {
  tw_ce_t *ce = (tw_ce_t *)e->backend;
  const tw_model_config_t *c = ce->cfg;
  cudaStream_t s = ce->stream;
  const int32_t bs = e->kv.block_size, V = c->vocab_size, T = p->n_tokens, ns = p->n_segs;
  const int32_t mbps = ce->max_blocks_per_seq;
  if (T > ce->chunk || ns > ce->max_batch) /* engine.c plans within both */
    return tw_err(TW_ERR_INTERNAL, "cuda prefill: pass of %d tokens / %d sequences over %d / %d",
                  T, ns, ce->chunk, ce->max_batch);
  TW_CUDA_CHECK(cudaStreamSynchronize(s)); /* staging buffers are free */
  int32_t *h_start = ce->h_cu + ns + 1; /* [ns] after cu [ns + 1] */
  int32_t maxnb = 1, t = 0;
  ce->h_cu[0] = 0;
  for (int32_t g = 0; g < ns; g++) {
    const tw_prefill_seg_t *sg = &p->segs[g];
    int32_t nb = sg->n_blocks < mbps ? sg->n_blocks : mbps;
    if (nb > maxnb) maxnb = nb;
    memcpy(ce->h_block_tables + (size_t)g * mbps, sg->block_table, (size_t)nb * 4);
    h_start[g] = sg->start_pos;
    for (int32_t i = 0; i < sg->n_tokens; i++, t++) {
      int32_t pos = sg->start_pos + i;
      ce->h_tokens[t] = sg->tokens[i];
      ce->h_positions[t] = pos;
      ce->h_slots[t] = sg->block_table[pos / bs] * bs + pos % bs;
    }
    ce->h_cu[g + 1] = t;
  }
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_tokens, ce->h_tokens, (size_t)T * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_positions, ce->h_positions, (size_t)T * 4,
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_slots, ce->h_slots, (size_t)T * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_cu, ce->h_cu, (size_t)(ns + 1) * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_start, h_start, (size_t)ns * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpy2DAsync(ce->d_block_tables, (size_t)mbps * 4, ce->h_block_tables,
                                  (size_t)mbps * 4, (size_t)maxnb * 4, (size_t)ns,
                                  cudaMemcpyHostToDevice, s));
  if (ce->ring_blocks) TW_CHECK(tw_ce_ring_pass(ce, p, h_start));
  TW_CHECK(tw_ce_layers(ce, T, 0, 0, bs, ns, kv_ev));
  ce->prof_steps[0]++;
  if (p->all_logits)
    for (int32_t r0 = 0; r0 < T; r0 += TW_CE_LOGIT_ROWS) {
      int32_t rows = T - r0 < TW_CE_LOGIT_ROWS ? T - r0 : TW_CE_LOGIT_ROWS;
      TW_CHECK(tw_ce_unembed(ce, r0, rows));
      TW_CUDA_CHECK(cudaMemcpyAsync(p->all_logits + (size_t)r0 * V, ce->logits,
                                    (size_t)rows * V * 4, cudaMemcpyDeviceToHost, s));
    }
  bool rows_wanted = p->next_tokens != NULL;
  for (int32_t k = 0; k < p->n_out; k++) rows_wanted |= p->logits_rows[k] != NULL;
  if (p->n_out > 0 && rows_wanted) {
    /* the segments' last rows of xn to rows 0..n_out-1, in order: output k
     * comes from row >= its segment index >= k, and rows < k are written
     * only by earlier copies, so copying in place never reads a moved row */
    const size_t row_bytes = (size_t)c->hidden * 2;
    for (int32_t g = 0; g < ns; g++) {
      int32_t k = p->segs[g].out, src = ce->h_cu[g + 1] - 1;
      if (k < 0 || k == src) continue;
      TW_CUDA_CHECK(cudaMemcpyAsync((char *)ce->xn + (size_t)k * row_bytes,
                                    (const char *)ce->xn + (size_t)src * row_bytes, row_bytes,
                                    cudaMemcpyDeviceToDevice, s));
    }
    TW_CHECK(tw_ce_unembed(ce, 0, p->n_out));
    for (int32_t k = 0; k < p->n_out; k++)
      if (p->logits_rows[k])
        TW_CUDA_CHECK(cudaMemcpyAsync(p->logits_rows[k], ce->logits + (size_t)k * V,
                                      (size_t)V * 4, cudaMemcpyDeviceToHost, s));
    if (p->next_tokens) {
      for (int32_t k = 0; k < p->n_out; k++)
        ce->h_params[k] = tw_ce_sample_row(&p->sample[k], p->sample_pos[k]);
      TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_params, ce->h_params,
                                    (size_t)p->n_out * sizeof(tw_cuda_sample_row_t),
                                    cudaMemcpyHostToDevice, s));
      TW_CE_OP(TW_CE_PROF_SAMPLE,
               tw_cuda_sample(ce->logits, V, p->n_out, V, ce->d_params, ce->d_next, s));
      TW_CUDA_CHECK(cudaMemcpyAsync(ce->h_next, ce->d_next, (size_t)p->n_out * 4,
                                    cudaMemcpyDeviceToHost, s));
    }
  }
  if (kv_ev) /* the pass is enqueued: hand each layer over as the GPU finishes its K/V */
    for (int32_t l = 0; l < c->n_layers; l++) {
      TW_CUDA_CHECK(cudaEventSynchronize(kv_ev[l]));
      p->on_pass_layer(p->on_pass_arg, l);
    }
  TW_CUDA_CHECK(cudaStreamSynchronize(s));
  if (p->next_tokens) memcpy(p->next_tokens, ce->h_next, (size_t)p->n_out * 4);
  return TW_OK;
}

/* The device work of one decode step over B (bucketed) rows. */
static TW_NODISCARD tw_status_t tw_ce_decode_body(tw_ce_t *ce, int32_t B, int32_t ctx, int32_t bs) {
  TW_CHECK(tw_ce_layers(ce, B, 1, ctx, bs, B, NULL));
  TW_CHECK(tw_ce_unembed(ce, 0, B));
  TW_CE_OP(TW_CE_PROF_SAMPLE, tw_cuda_sample(ce->logits, ce->cfg->vocab_size, B,
                                             ce->cfg->vocab_size, ce->d_params, ce->d_next,
                                             ce->stream));
  return TW_OK;
}

void tw_ce_graphs_destroy(tw_ce_t *ce) {
  for (int i = 0; i < ce->n_graphs; i++) cudaGraphExecDestroy(ce->graphs[i].exec);
  ce->n_graphs = 0;
}

static int32_t tw_pow2_at_least(int32_t v, int32_t lo) {
  int32_t p = lo;
  while (p < v) p *= 2;
  return p;
}

/* The decode graph's batch bucket for n sequences: powers of two up to 16,
 * then steps of 16 to 256 (at most 23% padding, at 65), 32 to 512 and 64
 * to 1,024 (at most 12%), capped at max_batch. */
int32_t tw_ce_batch_bucket(int32_t n, int32_t max_batch) {
  int32_t b = n <= 16 ? tw_pow2_at_least(n, 1)
              : n <= 256 ? (n + 15) / 16 * 16
              : n <= 512 ? (n + 31) / 32 * 32
                         : (n + 63) / 64 * 64;
  return b > max_batch ? max_batch : b;
}

/* The graph's context bucket: powers of two from 256, capped at max_pos; one
 * bucket (max_pos) for batches whose attention splits do not depend on the
 * context (tw_cuda_attention_decode_splits at the shortest and the longest). */
static int32_t tw_ce_ctx_bucket(const tw_ce_t *ce, int32_t B, int32_t maxlen) {
  tw_cuda_attn_shape_t sh = {ce->sh.nq, ce->sh.nkv, ce->cfg->head_dim, 16, 0, 1.0f};
  if (tw_cuda_attention_decode_splits(&sh, B, 1) ==
      tw_cuda_attention_decode_splits(&sh, B, ce->max_pos))
    return ce->max_pos;
  int32_t ctx = tw_pow2_at_least(maxlen, 256);
  return ctx > ce->max_pos ? ce->max_pos : ctx;
}

/* Find or capture the graph of (B, ctx). On a capture failure graphs are
 * turned off for this engine (eager launches from then on). */
static TW_NODISCARD tw_status_t tw_ce_graph_get(tw_ce_t *ce, int32_t B, int32_t ctx, int32_t bs,
                                   cudaGraphExec_t *exec_p) {
  for (int i = 0; i < ce->n_graphs; i++)
    if (ce->graphs[i].b == B && ce->graphs[i].ctx == ctx) {
      *exec_p = ce->graphs[i].exec;
      return TW_OK;
    }
  if (ce->n_graphs == TW_CE_MAX_GRAPHS) tw_ce_graphs_destroy(ce);
  cudaGraph_t g = NULL;
  TW_CUDA_CHECK(cudaStreamBeginCapture(ce->stream, cudaStreamCaptureModeThreadLocal));
  tw_status_t st = tw_ce_decode_body(ce, B, ctx, bs);
  cudaError_t ce_end = cudaStreamEndCapture(ce->stream, &g);
  if (st < 0 || ce_end != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    return st < 0 ? st
                  : tw_err(TW_ERR_CUDA, "decode graph capture (batch %d, ctx %d) failed: %s", B,
                           ctx, cudaGetErrorString(ce_end));
  }
  size_t n_nodes = 0;
  cudaGraphGetNodes(g, NULL, &n_nodes);
  cudaGraphExec_t exec = NULL;
  cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (ie != cudaSuccess) {
    cudaGetLastError(); /* not left for the eager launches after it */
    return tw_err(TW_ERR_CUDA, "decode graph instantiate (batch %d, ctx %d) failed: %s", B, ctx,
                  cudaGetErrorString(ie));
  }
  /* its device-side resources now, not at its first launch (a request's step) */
  cudaError_t ue = cudaGraphUpload(exec, ce->stream);
  if (ue != cudaSuccess) {
    cudaGetLastError();
    cudaGraphExecDestroy(exec);
    return tw_err(TW_ERR_CUDA, "decode graph upload (batch %d, ctx %d) failed: %s", B, ctx,
                  cudaGetErrorString(ue));
  }
  ce->graphs[ce->n_graphs].b = B;
  ce->graphs[ce->n_graphs].ctx = ctx;
  ce->graphs[ce->n_graphs].exec = exec;
  ce->n_graphs++;
  /* the node count is the kernels (and memsets) per decode step */
  TW_INFO("engine", "captured decode graph batch %d ctx %d: %zu nodes (%.1f per layer)", B, ctx,
          n_nodes, (double)n_nodes / ce->cfg->n_layers);
  *exec_p = exec;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_ce_warmup(tw_engine_t *e) {
  tw_ce_t *ce = (tw_ce_t *)e->backend;
  if (!ce->use_graphs) {
    TW_INFO("engine", "decode graphs are off on this engine: nothing to capture");
    return TW_OK;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* every (batch bucket, context bucket) tw_ce_decode can pick: each batch
   * bucket of 1..max_batch rows, each context bucket of a longest sequence
   * of 256, 512 .. max_pos positions */
  int32_t n_want = 0, prev_b = 0;
  for (int32_t n = 1; n <= ce->max_batch; n++) {
    int32_t B = tw_ce_batch_bucket(n, ce->max_batch);
    if (B == prev_b || !(ce->moe_grouped || B <= ce->gemv_max)) continue;
    prev_b = B;
    for (int32_t len = 256, prev_x = 0;; len = len * 2 > ce->max_pos ? ce->max_pos : len * 2) {
      int32_t x = tw_ce_ctx_bucket(ce, B, len);
      n_want += x != prev_x;
      prev_x = x;
      if (len >= ce->max_pos) break;
    }
  }
  TW_INFO("engine", "capturing %d decode graphs (batch buckets up to %d, contexts up to %d)%s",
          n_want, ce->max_batch, ce->max_pos,
          n_want > TW_CE_MAX_GRAPHS ? ": more than are kept, the largest batches stay lazy" : "");
  int32_t done = 0;
  prev_b = 0;
  for (int32_t n = 1; n <= ce->max_batch && done < TW_CE_MAX_GRAPHS; n++) {
    int32_t B = tw_ce_batch_bucket(n, ce->max_batch);
    if (B == prev_b || !(ce->moe_grouped || B <= ce->gemv_max)) continue;
    prev_b = B;
    for (int32_t len = 256, prev_x = 0; done < TW_CE_MAX_GRAPHS;
         len = len * 2 > ce->max_pos ? ce->max_pos : len * 2) {
      int32_t x = tw_ce_ctx_bucket(ce, B, len);
      if (x != prev_x) {
        cudaGraphExec_t exec = NULL;
        tw_status_t st = tw_ce_graph_get(ce, B, x, e->kv.block_size, &exec);
        if (st < 0) {
          TW_WARN("engine", "decode graphs off after a capture failure: %s", tw_last_error());
          ce->use_graphs = 0;
          return st;
        }
        done++;
      }
      prev_x = x;
      if (len >= ce->max_pos) break;
    }
    TW_INFO("engine", "decode graphs: %d of %d captured (batch bucket %d)", done, n_want, B);
  }
  TW_CUDA_CHECK(cudaStreamSynchronize(ce->stream)); /* the uploads */
  clock_gettime(CLOCK_MONOTONIC, &t1);
  TW_INFO("engine", "decode graphs ready: %d captured in %.1f s", ce->n_graphs,
          (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_ce_decode(tw_engine_t *e, const tw_decode_args_t *a) {
  tw_ce_t *ce = (tw_ce_t *)e->backend;
  const tw_model_config_t *c = ce->cfg;
  cudaStream_t s = ce->stream;
  int32_t bs = e->kv.block_size, V = c->vocab_size, n = a->n_seqs;
  int32_t B = tw_ce_batch_bucket(n, ce->max_batch);
  int32_t maxlen = 1, maxnb = 1, mbps = ce->max_blocks_per_seq;
  for (int32_t i = 0; i < n; i++) {
    int32_t p = a->positions[i];
    if (p + 1 > maxlen) maxlen = p + 1;
    int32_t nb = a->n_blocks[i] < mbps ? a->n_blocks[i] : mbps;
    if (nb > maxnb) maxnb = nb;
    ce->h_tokens[i] = a->tokens[i];
    ce->h_positions[i] = p;
    ce->h_slots[i] = a->block_tables[i][p / bs] * bs + p % bs;
    ce->h_seq_lens[i] = p + 1;
    memcpy(ce->h_block_tables + (size_t)i * mbps, a->block_tables[i], (size_t)nb * 4);
    if (ce->ring_blocks) { /* its ring view (common/kv/kv_ring.h): entry j in table[j % R] */
      int32_t R = ce->ring_blocks;
      ce->h_ring_slots[i] = a->block_tables[i][(p / bs) % R] * bs + p % bs;
      tw_kv_ring_view(a->block_tables[i], nb, R, ce->h_ring_tables + (size_t)i * mbps);
    }
    ce->h_params[i] = tw_ce_sample_row(a->sample ? &a->sample[i] : NULL, (int64_t)p + 1);
  }
  for (int32_t i = n; i < B; i++) { /* padding rows: read block 0, write nothing */
    ce->h_tokens[i] = 0;
    ce->h_positions[i] = 0;
    ce->h_slots[i] = -1;
    ce->h_seq_lens[i] = 1;
    ce->h_block_tables[(size_t)i * mbps] = 0;
    if (ce->ring_blocks) {
      ce->h_ring_slots[i] = -1;
      ce->h_ring_tables[(size_t)i * mbps] = 0;
    }
    ce->h_params[i] = tw_ce_sample_row(NULL, 0);
  }
  int32_t ctx = tw_ce_ctx_bucket(ce, B, maxlen);
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_tokens, ce->h_tokens, (size_t)B * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_positions, ce->h_positions, (size_t)B * 4,
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_slots, ce->h_slots, (size_t)B * 4, cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_seq_lens, ce->h_seq_lens, (size_t)B * 4,
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_params, ce->h_params, (size_t)B * sizeof(tw_cuda_sample_row_t),
                                cudaMemcpyHostToDevice, s));
  TW_CUDA_CHECK(cudaMemcpy2DAsync(ce->d_block_tables, (size_t)mbps * 4, ce->h_block_tables,
                                  (size_t)mbps * 4, (size_t)maxnb * 4, (size_t)B,
                                  cudaMemcpyHostToDevice, s));
  if (ce->ring_blocks) {
    TW_CUDA_CHECK(cudaMemcpyAsync(ce->d_ring_slots, ce->h_ring_slots, (size_t)B * 4,
                                  cudaMemcpyHostToDevice, s));
    TW_CUDA_CHECK(cudaMemcpy2DAsync(ce->d_ring_tables, (size_t)mbps * 4, ce->h_ring_tables,
                                    (size_t)mbps * 4, (size_t)maxnb * 4, (size_t)B,
                                    cudaMemcpyHostToDevice, s));
  }
  if (ce->profile == 1 && ce->prof_steps[1] == 2) { /* drop the warm-up's first calls, once */
    memset(ce->prof_ms, 0, sizeof ce->prof_ms);
    ce->prof_steps[0] = ce->prof_steps[1] = 0;
    ce->profile = 2;
  }
  bool graphed = false;
  if (ce->use_graphs && (ce->moe_grouped || B <= ce->gemv_max)) {
    cudaGraphExec_t exec = NULL;
    tw_status_t st = tw_ce_graph_get(ce, B, ctx, bs, &exec);
    if (st < 0) {
      TW_WARN("engine", "decode graphs off after a capture failure: %s", tw_last_error());
      ce->use_graphs = 0;
    } else {
      TW_CUDA_CHECK(cudaGraphLaunch(exec, s));
      graphed = true;
    }
  }
  if (!graphed) TW_CHECK(tw_ce_decode_body(ce, B, ctx, bs));
  ce->prof_steps[1]++;
  if (a->next_tokens_out)
    TW_CUDA_CHECK(cudaMemcpyAsync(ce->h_next, ce->d_next, (size_t)n * 4, cudaMemcpyDeviceToHost, s));
  if (a->logits_out)
    TW_CUDA_CHECK(cudaMemcpyAsync(a->logits_out, ce->logits, (size_t)n * V * 4,
                                  cudaMemcpyDeviceToHost, s));
  if (a->while_running) { /* poll the step, giving the caller the waiting time */
    for (;;) {
      cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady)
        return tw_err(TW_ERR_CUDA, "decode step: %s", cudaGetErrorString(q));
      a->while_running(a->while_running_arg);
    }
  }
  TW_CUDA_CHECK(cudaStreamSynchronize(s));
  if (a->next_tokens_out) memcpy(a->next_tokens_out, ce->h_next, (size_t)n * 4);
  return TW_OK;
}
