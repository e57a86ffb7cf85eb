/* attention.c: GQA attention with sinks and sliding window (spec §2.6), and
 * the MoE router selection and clamped SwiGLU (spec §2.8, §2.9). K/V are read
 * through the sequence's block table from the engine.h pool layout. */
#include "common/engine/cpu/cpu_ops.h"

#include "common/engine/cpu/simd.h"

#include <math.h>
#include <string.h>

static float tw_attn_dot(const float *a, const float *b, int32_t n) {
  tw_vf acc = {0}, x, y;
  int32_t i = 0;
  for (; i + TW_VL <= n; i += TW_VL) {
    TW_VF_LOAD(x, a + i);
    TW_VF_LOAD(y, b + i);
    acc += x * y;
  }
  float s = tw_vf_sum(&acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

void tw_cpu_attention(const float *q, int32_t n_heads, int32_t head_begin, int32_t head_end,
                      const tw_cpu_kv_view_t *kv, const int32_t *block_table, int64_t pos,
                      int32_t window, const float *sinks, float scale, float *scores,
                      float *out) {
  const int32_t D = kv->head_dim;
  float row[TW_CPU_KV_MAX_HEAD_DIM]; /* fp8: one dequantized K or V */
  const int32_t group = n_heads / kv->n_kv_heads;
  /* sliding: W keys including the current one, p-(W-1)..p (spec §2.6) */
  int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
  int64_t n = pos - lo + 1;
  for (int32_t h = head_begin; h < head_end; h++) {
    int32_t g = h / group;
    const float *qh = q + (int64_t)h * D;
    float m = sinks[h]; /* the sink is a logit already in scaled units */
    for (int64_t j = 0; j < n; j++) {
      float s = tw_attn_dot(qh, tw_cpu_kv_read(kv, block_table, lo + j, 0, g, row), D) * scale;
      scores[j] = s;
      if (s > m) m = s;
    }
    float den = expf(sinks[h] - m);
    float *o = out + (int64_t)h * D;
    for (int32_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
      float p = expf(scores[j] - m);
      den += p;
      const float *v = tw_cpu_kv_read(kv, block_table, lo + j, 1, g, row);
      int32_t d = 0;
      for (; d + TW_VL <= D; d += TW_VL) {
        tw_vf ov, vv;
        TW_VF_LOAD(ov, o + d);
        TW_VF_LOAD(vv, v + d);
        ov += p * vv;
        TW_VF_STORE(o + d, ov);
      }
      for (; d < D; d++) o[d] += p * v[d];
    }
    float inv = 1.0f / den;
    for (int32_t d = 0; d < D; d++) o[d] *= inv;
  }
}

void tw_cpu_kv_write(const tw_cpu_kv_view_t *v, const int32_t *block_table, int64_t pos, int kv,
                     int32_t kv_head, const float *x) {
  char *part = tw_cpu_kv_part(v, block_table, pos, kv, kv_head);
  int64_t slot = pos % v->block_size, D = v->head_dim;
  if (!v->fp8) {
    memcpy((float *)part + slot * D, x, sizeof(float) * (size_t)D);
    return;
  }
  float scale;
  tw_kv_fp8_quantize(x, (int32_t)D, (uint8_t *)part + slot * D, &scale);
  memcpy(part + (int64_t)v->block_size * D + slot * 4, &scale, sizeof scale);
}

void tw_cpu_router_topk(const float *logits, int32_t n_experts, int32_t k, int32_t *idx_out,
                        float *w_out) {
  /* selection by repeated scan: strictly greater wins, so equal values keep
   * the lowest index (spec §2.8 tie rule of [ref-metal]) */
  for (int32_t s = 0; s < k; s++) {
    int32_t best = -1;
    for (int32_t e = 0; e < n_experts; e++) {
      int taken = 0;
      for (int32_t t = 0; t < s; t++) taken |= idx_out[t] == e;
      if (taken) continue;
      if (best < 0 || logits[e] > logits[best]) best = e;
    }
    idx_out[s] = best;
  }
  float m = logits[idx_out[0]];
  double sum = 0.0;
  for (int32_t s = 0; s < k; s++) sum += exp((double)logits[idx_out[s]] - m);
  for (int32_t s = 0; s < k; s++) w_out[s] = (float)(exp((double)logits[idx_out[s]] - m) / sum);
}

void tw_cpu_swiglu(const float *u, int64_t I, float alpha, float limit, float *a) {
  for (int64_t i = 0; i < I; i++) {
    float g = u[2 * i];
    float l = u[2 * i + 1];
    g = g > limit ? limit : g;                           /* gate: clamped above only */
    l = l > limit ? limit : (l < -limit ? -limit : l);   /* linear: both sides */
    a[i] = g / (1.0f + expf(-alpha * g)) * (l + 1.0f);
  }
}
