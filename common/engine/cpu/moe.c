/* moe.c: the expert loop of the MoE block (spec §2.9) on the CPU, shared by
 * the CPU engine and the GPU kernels' reference in tests/kernels/test_moe.c. */
#include "common/engine/cpu/cpu_ops.h"

void tw_cpu_moe_experts(tw_cpu_pool_t *pool, const tw_cpu_experts_t *w, int64_t e0, int64_t e1,
                        const float *x, int64_t T, int32_t k, const int32_t *topk_idx,
                        const float *topk_w, const tw_cpu_moe_scratch_t *scratch, float *out) {
  const int64_t H = w->hidden, I = w->intermediate;
  int32_t *tok = scratch->tok;
  float *tw = scratch->w, *xe = scratch->xe, *ue = scratch->ue, *ae = scratch->ae,
        *ye = scratch->ye;
  memset(out, 0, sizeof(float) * (size_t)(T * H));
  for (int64_t ex = e0; ex < e1; ex++) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++)
        if (topk_idx[t * k + j] == ex) {
          tok[n] = (int32_t)t;
          tw[n] = topk_w[t * k + j];
          n++;
        }
    if (n == 0) continue;
    for (int64_t i = 0; i < n; i++)
      memcpy(xe + i * H, x + (int64_t)tok[i] * H, sizeof(float) * (size_t)H);
    const uint16_t *gu_bias = w->gate_up_bias + ex * 2 * I, *dn_bias = w->down_bias + ex * H;
    if (w->mxfp4)
      tw_cpu_matmul_mxfp4(pool, xe, n, H, w->gate_up_blocks + ex * 2 * I * (H / 32) * 16,
                          w->gate_up_scales + ex * 2 * I * (H / 32), gu_bias, 2 * I, ue);
    else
      tw_cpu_matmul_bf16_kn(pool, xe, n, H, w->gate_up + ex * H * 2 * I, gu_bias, 2 * I, ue);
    for (int64_t i = 0; i < n; i++)
      tw_cpu_swiglu(ue + i * 2 * I, I, w->swiglu_alpha, w->swiglu_limit, ae + i * I);
    if (w->mxfp4)
      tw_cpu_matmul_mxfp4(pool, ae, n, I, w->down_blocks + ex * H * (I / 32) * 16,
                          w->down_scales + ex * H * (I / 32), dn_bias, H, ye);
    else
      tw_cpu_matmul_bf16_kn(pool, ae, n, I, w->down + ex * I * H, dn_bias, H, ye);
    /* the routing weight scales the whole expert output, b2 included (§2.9) */
    for (int64_t i = 0; i < n; i++) {
      float *o = out + (int64_t)tok[i] * H;
      const float *y = ye + i * H;
      for (int64_t d = 0; d < H; d++) o[d] += tw[i] * y[d];
    }
  }
}
