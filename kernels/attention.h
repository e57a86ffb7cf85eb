/* attention.h: gpt-oss attention over the paged KV cache on the GPU (spec §2.6).
 *
 * Two entry points, both asynchronous on the caller's stream: they never
 * synchronise and never allocate. Data:
 *   - q: bf16, post-RoPE (the concentration c is inside, spec §2.5), row t
 *     of query head h at q[t * q_row_stride + h * D + d]; q_row_stride lets
 *     the engine pass the fused QKV buffer [T, (NQ + 2 NKV) * D] directly.
 *   - kv_layer: bf16 pool of one layer in the engine.h layout
 *     [block][k=0|v=1][kv_head (local)][slot][D], K post-RoPE. A sequence's
 *     position p is at block block_table[p / block_size], slot p % block_size.
 *     With shape.kv_fp8 the fp8 layout of common/kv/kv_fp8.h instead: the
 *     kernels copy its e4m3 tiles and scales to shared memory and
 *     dequantize them there into the bf16 tiles the MMAs read.
 *   - sinks: f32 [NQ] on the device, one logit per query head in scaled-logit
 *     units; it enters only the softmax denominator.
 *   - block_tables: int32 on the device, row s of sequence s at
 *     block_tables + s * block_table_stride. Entries past a sequence's last
 *     needed block are never read.
 * Math (spec §2.6): s_j = (q_h . k_{g,j}) * scale with g = h / (NQ / NKV);
 * keys j <= p, and on a sliding layer (window W > 0) also j >= p - (W - 1);
 * softmax in fp32 with the sink in the denominator; out_h = sum_j p_j v_j.
 * bf16 inputs, fp32 accumulation, bf16 output [T, NQ * D] (head-major). */
#ifndef TW_KERNELS_ATTENTION_H
#define TW_KERNELS_ATTENTION_H

#include "common/base/status.h"

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Shape of one attention layer (local to this rank under tensor parallelism). */
typedef struct {
  int32_t n_q_heads;   /* NQ (local); a multiple of n_kv_heads */
  int32_t n_kv_heads;  /* NKV (local) */
  int32_t head_dim;    /* D; only 64 is built (gpt-oss); others: TW_ERR_UNSUPPORTED */
  int32_t block_size;  /* tokens per KV block (engine kv_block_size) */
  int32_t window;      /* W on a sliding layer (keys p-(W-1)..p); 0 on a full layer */
  float scale;         /* softmax scale, 1/sqrt(D) = 0.125 for gpt-oss */
  /* 1: the pool is the fp8 KV cache (common/kv/kv_fp8.h: each (k|v, kv head)
   * part of a block is [slot][D] e4m3 then [slot] f32 scales; block_size a
   * multiple of 4), read as e4m3 x scale; 0: bf16 as above */
  int32_t kv_fp8;
} tw_cuda_attn_shape_t;

/** Prefill attention (FlashAttention-2 style, tensor cores) over several
 *  variable-length sequences in one launch. Query i of sequence s (token row
 *  t = cu_seqlens[s] + i) is at position start_pos[s] + i and attends to keys
 *  0..pos of its own sequence (window-limited), all read from the paged pool:
 *  the K/V of the new tokens must already be written (tw_cuda_rope_kv_write_f32),
 *  those of positions < start_pos[s] come from earlier chunks.
 *    q           bf16 rows [n_tokens], see the file comment (q_row_stride in elements)
 *    kv_layer    bf16 pool of this layer
 *    sinks       f32 [NQ], device
 *    n_seqs      sequences (>= 1); n_tokens = cu_seqlens[n_seqs] (host copy)
 *    cu_seqlens  int32 [n_seqs + 1], device, cu_seqlens[0] = 0, non-decreasing
 *    start_pos   int32 [n_seqs], device, >= 0
 *    block_tables int32, device, row stride block_table_stride
 *    out         bf16 [n_tokens, NQ * D], device (every element written)
 *  No workspace. Errors: TW_ERR_INVALID_ARGUMENT (NULL pointer, non-positive
 *  count, NQ not a multiple of NKV, scale <= 0, window < 0, block_size <= 0),
 *  TW_ERR_UNSUPPORTED (head_dim != 64), TW_ERR_CUDA (launch failed). */
TW_NODISCARD tw_status_t tw_cuda_attention_prefill(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
    const int32_t *start_pos, const int32_t *block_tables, int32_t block_table_stride, void *out,
    cudaStream_t stream);

/** Bytes of device workspace tw_cuda_attention_decode needs for up to
 *  `max_seqs` sequences of at most `max_seq_len` keys each: one int32 split
 *  counter per (sequence, KV head) first, then the partial softmax state of
 *  every split (f32). Returns 0 for an invalid shape or non-positive counts.
 *  Allocate it once at engine creation and zero it once (cudaMemset): the
 *  counters must be zero before a call, and every call leaves them zero. */
size_t tw_cuda_attention_decode_workspace_bytes(const tw_cuda_attn_shape_t *shape,
                                                int32_t max_seqs, int32_t max_seq_len);

/** Splits per (sequence, KV head) that tw_cuda_attention_decode uses for
 *  n_seqs sequences of at most `keys` keys (the window, for sliding layers):
 *  about TWAIN_CUDA_DC_CTAS CTAs in all, bounded by the keys. Callers that
 *  cache per-context launches (the engine's decode graphs) use it to tell
 *  when the context no longer changes the launch. Returns 0 for an invalid
 *  shape or non-positive counts. */
int tw_cuda_attention_decode_splits(const tw_cuda_attn_shape_t *shape, int32_t n_seqs,
                                    int32_t keys);

/** Decode attention: one query token per sequence (batch of n_seqs), split
 *  along the keys (flash-decoding: partial (m, l, acc) per split into the
 *  workspace, merged by the last split to finish or by a combine kernel; a
 *  sequence whose keys fit one split is written directly; the sink is
 *  counted in split 0 only). The split grid follows max_seq_len; each
 *  sequence spreads its own keys over all of it.
 *  Sequence s has seq_lens[s] keys (>= 1) at positions 0..seq_lens[s]-1 in
 *  the pool, its new token's K/V included; its query is at position
 *  seq_lens[s] - 1.
 *    q            bf16 rows [n_seqs] (row stride q_row_stride elements)
 *    seq_lens     int32 [n_seqs], device, 1 <= seq_lens[s] <= max_seq_len
 *    max_seq_len  host upper bound of seq_lens (sizes the split grid)
 *    workspace    device, >= tw_cuda_attention_decode_workspace_bytes(shape,
 *                 n_seqs, max_seq_len) bytes; 256-byte aligned; its first
 *                 n_seqs * NKV int32 words zero (left zero on return)
 *    out          bf16 [n_seqs, NQ * D], device (every element written)
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL pointer, non-positive count, bad
 *  shape, workspace too small: the message gives the bytes needed),
 *  TW_ERR_UNSUPPORTED (head_dim != 64, or NQ / NKV > 16), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_attention_decode(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, const int32_t *seq_lens, const int32_t *block_tables,
    int32_t block_table_stride, int32_t max_seq_len, void *workspace, size_t workspace_bytes,
    void *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
