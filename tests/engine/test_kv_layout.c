/* test_kv_layout.c: the KV pool contract of engine.h, which the
 * transfer layer relies on: [layer][block][k|v][kv_head][slot][head_dim]
 * f32 at tw_kv_layout_t.base, K stored after RoPE. After a prefill, the K
 * and V of layer 0 at every position are read through the layout and the
 * block table and compared with an independent double-precision computation
 * from the checkpoint (layer 0 depends only on the embedding):
 *   t = RMSNorm(embed[token]; input_layernorm), k = Wk t + bk, v = Wv t + bv,
 *   k rotated half-split with c cos / c sin of p * inv_freq (spec §2.3-§2.5).
 * Also: later layers and untouched blocks. */
#include "common/engine/engine.h"
#include "common/model/model.h"

#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static double bf(const tw_tensor_t *t, int64_t i) {
  return (double)tw_bf16_to_f32(((const uint16_t *)t->data)[i]);
}

int main(void) {
  tw_model_t *m = NULL;
  if (tw_test_load_tiny(&m)) return 1;
  const tw_model_config_t *c = &m->config;
  const int H = c->hidden, D = c->head_dim, NKV = c->n_kv_heads, half = D / 2;
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_block_size = 5; /* odd size: slots and blocks do not line up with heads */
  p.kv_num_blocks = 16;
  p.n_threads = 2;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &p, &e) != TW_OK) return 1;
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
  enum { T = 40 };
  int32_t toks[T], table[8] = {13, 2, 9, 0, 15, 4, 11, 6}; /* 8 x 5 = 40 positions */
  uint64_t seed = 3;
  for (int i = 0; i < T; i++) toks[i] = (int32_t)(tw_test_rand_u64(&seed) % 8000);
  tw_prefill_args_t pa = {.tokens = toks, .n_tokens = T, .block_table = table, .n_blocks = 8};
  EXPECT(tw_engine_prefill(e, &pa) == TW_OK, "prefill: %s", tw_last_error());

  /* YaRN inv_freq and concentration from the spec formula, in double */
  double inv[64], conc = 0.1 * log(c->rope_factor) + 1.0;
  double low = D * log(c->rope_original_max_pos / (c->rope_beta_fast * 2 * M_PI)) /
               (2 * log(c->rope_theta));
  double high = D * log(c->rope_original_max_pos / (c->rope_beta_slow * 2 * M_PI)) /
                (2 * log(c->rope_theta));
  for (int i = 0; i < half; i++) {
    double base = pow(c->rope_theta, 2.0 * i / D);
    double r = fmin(fmax((i - low) / (high - low), 0.0), 1.0);
    inv[i] = 1.0 / (c->rope_factor * base) * r + 1.0 / base * (1 - r);
  }
  const tw_layer_weights_t *w = &m->layers[0];
  double worst = 0;
  for (int pos = 0; pos < T; pos++) {
    double t[1024], ss = 0;
    for (int i = 0; i < H; i++) {
      t[i] = bf(&m->embed, (int64_t)toks[pos] * H + i);
      ss += t[i] * t[i];
    }
    double r = 1.0 / sqrt(ss / H + c->rms_norm_eps);
    for (int i = 0; i < H; i++) t[i] = t[i] * r * bf(&w->attn_norm, i);
    for (int g = 0; g < NKV; g++) {
      double k[128], v[128];
      for (int d = 0; d < D; d++) {
        int64_t row = (int64_t)g * D + d;
        double sk = bf(&w->k_b, row), sv = bf(&w->v_b, row);
        for (int i = 0; i < H; i++) {
          sk += bf(&w->k_w, row * H + i) * t[i];
          sv += bf(&w->v_w, row * H + i) * t[i];
        }
        k[d] = sk;
        v[d] = sv;
      }
      double kr[128];
      for (int i = 0; i < half; i++) {
        double C = conc * cos(pos * inv[i]), S = conc * sin(pos * inv[i]);
        kr[i] = k[i] * C - k[i + half] * S;
        kr[i + half] = k[i + half] * C + k[i] * S;
      }
      /* the layout, by hand: layer 0, block table[pos / bs], slot pos % bs */
      int64_t blk = table[pos / kv->block_size], slot = pos % kv->block_size;
      const char *b = (const char *)kv->base + blk * kv->block_bytes;
      int64_t head_bytes = (int64_t)kv->block_size * kv->head_dim * 4;
      const float *kp = (const float *)(b + (0 * NKV + g) * head_bytes + slot * D * 4);
      const float *vp = (const float *)(b + ((int64_t)1 * NKV + g) * head_bytes + slot * D * 4);
      double ek = tw_test_rel_l2_f(kp, kr, D), ev = tw_test_rel_l2_f(vp, v, D);
      worst = fmax(worst, fmax(ek, ev));
      EXPECT(ek < 1e-5 && ev < 1e-5, "pos %d kv head %d: K rel L2 %.3g, V rel L2 %.3g", pos, g,
                ek, ev);
    }
  }
  printf("layer-0 K (post-RoPE) and V through the layout: worst rel L2 %.3g over %d positions\n",
         worst, T);
  /* later layers hold data at the same slots; unused blocks stay zero */
  int nonzero_l3 = 0, nonzero_unused = 0;
  for (int l = 0; l < c->n_layers; l++)
    for (int blk = 0; blk < kv->n_blocks; blk++) {
      int used = 0;
      for (int i = 0; i < 8; i++) used |= table[i] == blk;
      const float *f = (const float *)((const char *)kv->base + l * kv->layer_stride_bytes +
                                       blk * kv->block_bytes);
      int nz = 0;
      for (int64_t i = 0; i < kv->block_bytes / 4; i++) nz |= f[i] != 0.0f;
      if (!used) nonzero_unused += nz;
      if (used && l == c->n_layers - 1) nonzero_l3 += nz;
    }
  EXPECT(nonzero_l3 == 8, "last layer: %d of 8 used blocks hold data", nonzero_l3);
  EXPECT(nonzero_unused == 0, "%d unused blocks were written", nonzero_unused);
  EXPECT(kv->total_bytes == (int64_t)c->n_layers * kv->layer_stride_bytes &&
                kv->layer_stride_bytes == kv->n_blocks * kv->block_bytes &&
                kv->block_bytes == 2LL * NKV * kv->block_size * D * 4,
            "layout sizes");
  tw_engine_destroy(e);
  tw_model_destroy(m);
  return tw_test_exit("test_kv_layout");
}
