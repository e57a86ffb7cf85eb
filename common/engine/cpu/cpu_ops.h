/* cpu_ops.h: the CPU reference operators of gpt-oss (spec §2), in float32.
 *
 * Weights are read straight from the checkpoint mmap: bf16 matrices and MXFP4
 * experts are converted to float32 one row (or row segment) at a time inside
 * the matmul loops, never as a whole. Activations are float32 throughout.
 * Matmuls split their output rows over a small persistent thread pool; the
 * other operators are single-threaded per call (the engine parallelises them
 * over tokens and heads). None of these functions allocates, except the pool. */
#ifndef TW_COMMON_CPU_CPU_OPS_H
#define TW_COMMON_CPU_CPU_OPS_H

#include "common/base/status.h"
#include "common/kv/kv_fp8.h"
#include "common/model/config.h"

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- thread pool --------------------------------------------------------- */

typedef struct tw_cpu_pool tw_cpu_pool_t;

/** A parallel task: called once per thread with (ctx, thread index, thread
 *  count); each call picks its share of the work from the index. */
typedef void (*tw_cpu_task_fn)(void *ctx, int thread_idx, int n_threads);

/** Start a pool of `n_threads` (>= 1; the caller's thread counts as one, so
 *  n_threads - 1 worker threads are created; 0 = all online cores).
 *  Errors: TW_ERR_INVALID_ARGUMENT (n_threads < 0), TW_ERR_NO_MEMORY,
 *  TW_ERR_INTERNAL (pthread_create failed). */
TW_NODISCARD tw_status_t tw_cpu_pool_create(int n_threads, tw_cpu_pool_t **pool_p);
/** Stop and join the workers. NULL does nothing. */
void tw_cpu_pool_destroy(tw_cpu_pool_t *pool);
/** Number of threads of the pool (>= 1); 1 for a NULL pool. */
int tw_cpu_pool_size(const tw_cpu_pool_t *pool);
/** Run fn on every thread of the pool and wait for all of them. A NULL pool
 *  runs fn(ctx, 0, 1) on the caller. Not reentrant: one run at a time. */
void tw_cpu_pool_run(tw_cpu_pool_t *pool, tw_cpu_task_fn fn, void *ctx);

/* ---- matmuls (float32 accumulate) ----------------------------------------- */

/** Linear layer with a bf16 weight in PyTorch orientation:
 *  y[t][n] = sum_k x[t][k] * W[n][k] + b[n]   for t < T, n < N.
 *  x f32 [T, K]; w bf16 bits [N, K] row-major; maybe_bias bf16 [N] or NULL;
 *  y f32 [T, N] (overwritten). Each weight row is converted once and used for
 *  all T tokens. K must be a multiple of 8 (true for every gpt-oss shape). */
void tw_cpu_matmul_bf16(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                        const uint16_t *w, const uint16_t *maybe_bias, int64_t N, float *y);

/** tw_cpu_matmul_bf16 over a column slice of a wider weight: row n of W
 *  starts at w + n * ldw (ldw >= K). Used by the row-parallel output
 *  projection of a TP rank (columns of its heads, issue 6). */
void tw_cpu_matmul_bf16_ld(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                           const uint16_t *w, int64_t ldw, const uint16_t *maybe_bias, int64_t N,
                           float *y);

/** Linear layer with an MXFP4 weight [N, K] stored as blocks [N, K/32, 16] u8
 *  and scales [N, K/32] u8 (spec §3.4: low nibble = even element, value =
 *  FP4[nib] * 2^(scale-127)): y[t][n] = sum_k x[t][k] * W[n][k] + b[n].
 *  maybe_bias bf16 [N] or NULL. K must be a multiple of 32. */
void tw_cpu_matmul_mxfp4(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                         const uint8_t *blocks, const uint8_t *scales,
                         const uint16_t *maybe_bias, int64_t N, float *y);

/** x @ W with a bf16 weight in HF in-memory orientation W [K, N] (bf16
 *  experts, spec §3.5): y[t][n] = sum_k x[t][k] * W[k][n] + b[n].
 *  maybe_bias bf16 [N] or NULL; y f32 [T, N] (overwritten). */
void tw_cpu_matmul_bf16_kn(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                           const uint16_t *w, const uint16_t *maybe_bias, int64_t N, float *y);

/** Dequantise one MXFP4 row of `n_blocks` blocks to f32 out[n_blocks*32]
 *  (spec §3.4; same values as tw_mxfp4_dequant_row, with a byte table). */
void tw_cpu_mxfp4_row(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks,
                      float *out);

/* ---- norms and positions -------------------------------------------------- */

/** RMSNorm (spec §2.3), per row of x [T, H]:
 *  y = x / sqrt(mean(x^2) + eps) * w, w bf16 [H]. y may alias x. */
void tw_cpu_rmsnorm(const float *x, int64_t T, int64_t H, const uint16_t *w, float eps,
                    float *y);

/** YaRN RoPE parameters (spec §2.5), computed in double from the config:
 *  inv_freq_out[D/2] and the concentration c (0.1 ln f + 1, or 1 if f <= 1).
 *  Low/high correction dims are rounded only if config->rope_truncate. */
void tw_cpu_rope_init(const tw_model_config_t *config, double *inv_freq_out,
                      double *concentration_p);

/** The rotation tables of one position: cos_out[i] = c cos(p inv_freq_i),
 *  sin_out[i] = c sin(p inv_freq_i) for i < half (computed in double, rounded
 *  to f32). */
void tw_cpu_rope_table(const double *inv_freq, int32_t half, double concentration,
                       int64_t position, float *cos_out, float *sin_out);

/** Rotate n_heads vectors of head_dim D in place, half-split (NeoX) layout:
 *  x'[i] = x[i] C - x[i+D/2] S;  x'[i+D/2] = x[i+D/2] C + x[i] S. */
void tw_cpu_rope_apply(float *x, int32_t n_heads, int32_t head_dim, const float *cos_tab,
                       const float *sin_tab);

/* ---- attention ------------------------------------------------------------- */

/** Where one layer's K/V lives: the engine.h pool layout
 *  [block][k|v][kv_head][slot][head_dim] f32, with `layer_base` at block 0;
 *  with fp8 each (k|v, kv_head) part of a block is [slot][head_dim] e4m3
 *  then [slot] f32 scales (kv_fp8.h). */
typedef struct {
  void *layer_base;
  int32_t block_size;
  int32_t n_kv_heads;
  int32_t head_dim;
  int32_t fp8; /* 1: the kv_fp8.h layout */
} tw_cpu_kv_view_t;

#define TW_CPU_KV_MAX_HEAD_DIM 512 /* fp8: the dequantized row's scratch */

/** The (k|v = kv, kv_head) part of the block holding position `pos` of a
 *  sequence whose blocks are `block_table`. */
static inline char *tw_cpu_kv_part(const tw_cpu_kv_view_t *v, const int32_t *block_table,
                                   int64_t pos, int kv, int32_t kv_head) {
  int64_t blk = block_table[pos / v->block_size];
  int64_t part = (int64_t)v->block_size * (v->fp8 ? v->head_dim + 4 : v->head_dim * 4);
  return (char *)v->layer_base + ((blk * 2 + kv) * v->n_kv_heads + kv_head) * part;
}

/** Pointer to K (kv = 0) or V (kv = 1) of kv_head at position `pos` of an
 *  f32 pool (fp8 0). */
static inline float *tw_cpu_kv_at(const tw_cpu_kv_view_t *v, const int32_t *block_table,
                                  int64_t pos, int kv, int32_t kv_head) {
  return (float *)tw_cpu_kv_part(v, block_table, pos, kv, kv_head) +
         (pos % v->block_size) * v->head_dim;
}

/** Store one token's K (kv = 0) or V (kv = 1) of kv_head, x f32 [head_dim],
 *  at position `pos`: as it is (f32), or quantized (fp8, kv_fp8.h). */
void tw_cpu_kv_write(const tw_cpu_kv_view_t *v, const int32_t *block_table, int64_t pos, int kv,
                     int32_t kv_head, const float *x);

/** K or V of kv_head at position `pos` as f32 [head_dim]: a pointer into
 *  the pool (f32), or `tmp` [head_dim] holding the dequantized values (fp8). */
static inline const float *tw_cpu_kv_read(const tw_cpu_kv_view_t *v, const int32_t *block_table,
                                          int64_t pos, int kv, int32_t kv_head, float *tmp) {
  char *part = tw_cpu_kv_part(v, block_table, pos, kv, kv_head);
  int64_t slot = pos % v->block_size;
  if (!v->fp8) return (const float *)part + slot * v->head_dim;
  float scale;
  memcpy(&scale, part + (int64_t)v->block_size * v->head_dim + slot * 4, sizeof scale);
  tw_kv_fp8_dequantize((const uint8_t *)part + slot * v->head_dim, v->head_dim, scale, tmp);
  return tmp;
}

/** Attention of one query position (spec §2.6) for query heads
 *  [head_begin, head_end): keys/values at positions lo..pos read through
 *  block_table, where lo = 0 (window <= 0: full layer) or max(0, pos-window+1);
 *  s_j = q·k_j * scale; softmax with the head's sink in the denominator;
 *  out[h*D..] = sum_j p_j v_j. q f32 [NQ*D] (post-RoPE); sinks f32 [NQ];
 *  out f32 [NQ*D] (only the given heads written); scores scratch [pos+1]. */
void tw_cpu_attention(const float *q, int32_t n_heads, int32_t head_begin, int32_t head_end,
                      const tw_cpu_kv_view_t *kv, const int32_t *block_table, int64_t pos,
                      int32_t window, const float *sinks, float scale, float *scores,
                      float *out);

/* ---- MoE ----------------------------------------------------------------- */

/** Router selection (spec §2.8): the k largest of logits[E] (ties: lowest
 *  index first), in descending order, into idx_out[k], and the softmax over
 *  those k logits into w_out[k]. */
void tw_cpu_router_topk(const float *logits, int32_t n_experts, int32_t k, int32_t *idx_out,
                        float *w_out);

/** Clamped interleaved SwiGLU (spec §2.9) of one token: u f32 [2I] with gate
 *  at even and linear at odd indices; a[i] = g σ(alpha g) (l + 1) with
 *  g = min(u[2i], limit), l = clamp(u[2i+1], -limit, limit). a f32 [I]. */
void tw_cpu_swiglu(const float *u, int64_t I, float alpha, float limit, float *a);

/** The experts of one layer, views of the checkpoint (spec §3.4, §3.5).
 *  MXFP4 (mxfp4 = 1): gate_up blocks [E, 2I, H/32, 16] u8 + scales
 *  [E, 2I, H/32] u8, down blocks [E, H, I/32, 16] + scales [E, H, I/32];
 *  bf16 (mxfp4 = 0): gate_up [E, H, 2I] and down [E, I, H] in HF in-memory
 *  orientation. Biases bf16 bits: gate_up_bias [E, 2I], down_bias [E, H].
 *  Gate rows are the even ones of gate_up (§2.9). */
typedef struct {
  int64_t hidden, intermediate; /* H, I: multiples of 32 */
  int mxfp4;                    /* 1: the blocks/scales below; 0: the bf16 matrices */
  const uint8_t *gate_up_blocks, *gate_up_scales, *down_blocks, *down_scales;
  const uint16_t *gate_up, *down;
  const uint16_t *gate_up_bias, *down_bias;
  float swiglu_alpha, swiglu_limit; /* the config's (1.702, 7.0 for gpt-oss) */
} tw_cpu_experts_t;

/** Scratch of tw_cpu_moe_experts for up to T tokens, owned by the caller:
 *  tok int32 [T], w f32 [T], xe f32 [T, H], ue f32 [T, 2I], ae f32 [T, I],
 *  ye f32 [T, H]. Contents on return are unspecified. */
typedef struct {
  int32_t *tok;
  float *w;
  float *xe, *ue, *ae, *ye;
} tw_cpu_moe_scratch_t;

/** The expert part of the MoE block (spec §2.9) for T tokens already routed
 *  (§2.8, tw_cpu_router_topk), over the experts [e0, e1) only (all of them,
 *  or an EP rank's share; 0 <= e0 <= e1 <= E): for each expert e, its tokens
 *  (those with e among their k picks, each at most once) are gathered,
 *  y = W2[e] · swiglu(W1[e] · x + b1[e]) + b2[e] (f32 accumulate, weights
 *  converted to f32, clamped SwiGLU of tw_cpu_swiglu), and
 *  out[t] = sum over the picks j of token t with e0 <= idx[t][j] < e1 of
 *  w[t][j] * y_{idx[t][j]}(x[t]) (the routing weight scales b2 too), summed
 *  in expert order. x f32 [T, H]; topk_idx int32 [T, k] (each row distinct
 *  experts); topk_w f32 [T, k]; out f32 [T, H], overwritten (zero for tokens
 *  with no pick in [e0, e1)); out must not alias x. Does not allocate;
 *  cannot fail (shapes are the caller's contract). */
void tw_cpu_moe_experts(tw_cpu_pool_t *pool, const tw_cpu_experts_t *w, int64_t e0, int64_t e1,
                        const float *x, int64_t T, int32_t k, const int32_t *topk_idx,
                        const float *topk_w, const tw_cpu_moe_scratch_t *scratch, float *out);

#ifdef __cplusplus
}
#endif
#endif
