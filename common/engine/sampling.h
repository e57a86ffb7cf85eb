/* sampling.h: token sampling shared by every backend: greedy, temperature,
 * top-k, top-p, seeded. The random number for a step is a pure function of
 * (seed, position) (a counter-based hash), so the same seed gives the same
 * tokens on any backend, batch composition or worker. */
#ifndef TW_COMMON_SAMPLING_H
#define TW_COMMON_SAMPLING_H

#include "common/base/status.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  float temperature; /* <= 0: greedy (argmax, lowest id on ties) */
  int32_t top_k;     /* <= 0: no top-k cut */
  float top_p;       /* >= 1 or <= 0: no nucleus cut */
  uint64_t seed;
} tw_sample_params_t;

#define TW_SAMPLE_PARAMS_GREEDY \
  ((tw_sample_params_t){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0})

/** Uniform random in [0, 1) for (seed, position): splitmix64-style hash.
 *  Same on every backend. */
double tw_sample_uniform(uint64_t seed, int64_t position);

/** Sample one token from host logits [vocab] f32 at `position` (the position
 *  of the token being produced). Order: temperature scaling, top-k, softmax,
 *  top-p (smallest set with cumulative probability >= top_p, at least one
 *  token), then inverse-CDF draw with tw_sample_uniform.
 *  `scratch` must hold 2*vocab floats (or NULL: allocated inside).
 *  Errors: TW_ERR_INVALID_ARGUMENT (vocab <= 0, NaN temperature),
 *  TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_sample(const float *logits, int32_t vocab,
                                   const tw_sample_params_t *params, int64_t position,
                                   float *scratch, int32_t *token_p);

#ifdef __cplusplus
}
#endif
#endif
