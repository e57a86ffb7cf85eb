/* norm_rope.c: RMSNorm (spec §2.3) and YaRN rotary embedding (spec §2.5).
 * The RoPE frequencies and per-position tables are computed in double and
 * rounded to float32 once: at p near 131072 a float32 phase loses ~1e-2 rad
 * (spec §2.5 "Precision"), a double one does not. */
#include "common/engine/cpu/cpu_ops.h"

#include "common/model/model.h"

#include <math.h>

void tw_cpu_rmsnorm(const float *x, int64_t T, int64_t H, const uint16_t *w, float eps,
                    float *y) {
  for (int64_t t = 0; t < T; t++) {
    const float *xt = x + t * H;
    float *yt = y + t * H;
    double ss = 0.0;
    for (int64_t i = 0; i < H; i++) ss += (double)xt[i] * xt[i];
    float r = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
    for (int64_t i = 0; i < H; i++) yt[i] = (xt[i] * r) * tw_bf16_to_f32(w[i]);
  }
}

/* Dimension index at which a wavelength makes `n_rot` turns over the
 * original context L0 (YaRN find_correction_dim). */
static double tw_rope_correction_dim(double n_rot, int32_t dim, double theta, double l0) {
  return (double)dim * log(l0 / (n_rot * 2.0 * M_PI)) / (2.0 * log(theta));
}

void tw_cpu_rope_init(const tw_model_config_t *config, double *inv_freq_out,
                      double *concentration_p) {
  const int32_t dim = config->head_dim;
  const int32_t half = dim / 2;
  const double theta = config->rope_theta;
  const double f = config->rope_factor;
  const double l0 = (double)config->rope_original_max_pos;
  double low = tw_rope_correction_dim(config->rope_beta_fast, dim, theta, l0);
  double high = tw_rope_correction_dim(config->rope_beta_slow, dim, theta, l0);
  if (config->rope_truncate) {
    low = floor(low);
    high = ceil(high);
  }
  if (low < 0.0) low = 0.0;
  if (high > dim - 1) high = dim - 1;
  if (low == high) high += 0.001; /* as YaRN's linear ramp does */
  for (int32_t i = 0; i < half; i++) {
    double base = pow(theta, (2.0 * i) / dim);
    double extra = 1.0 / base;
    double inter = 1.0 / (f * base);
    double r = ((double)i - low) / (high - low);
    r = r < 0.0 ? 0.0 : (r > 1.0 ? 1.0 : r);
    inv_freq_out[i] = f > 1.0 ? inter * r + extra * (1.0 - r) : extra;
  }
  *concentration_p = f > 1.0 ? 0.1 * log(f) + 1.0 : 1.0;
}

void tw_cpu_rope_table(const double *inv_freq, int32_t half, double concentration,
                       int64_t position, float *cos_out, float *sin_out) {
  for (int32_t i = 0; i < half; i++) {
    double ph = (double)position * inv_freq[i];
    cos_out[i] = (float)(concentration * cos(ph));
    sin_out[i] = (float)(concentration * sin(ph));
  }
}

void tw_cpu_rope_apply(float *x, int32_t n_heads, int32_t head_dim, const float *cos_tab,
                       const float *sin_tab) {
  const int32_t half = head_dim / 2;
  for (int32_t h = 0; h < n_heads; h++) {
    float *v = x + (int64_t)h * head_dim;
    for (int32_t i = 0; i < half; i++) {
      float a = v[i], b = v[i + half];
      v[i] = a * cos_tab[i] - b * sin_tab[i];
      v[i + half] = b * cos_tab[i] + a * sin_tab[i];
    }
  }
}
