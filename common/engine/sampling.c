/* sampling.c: token sampling (sampling.h), identical on every backend.
 *
 * Exact rules, so that another implementation can reproduce a draw bit for
 * bit given the same float logits:
 *   - temperature <= 0: argmax, lowest id on ties (NaN logits never win);
 *   - z_i = logit_i / temperature (float); NaN counts as -inf;
 *   - ranking is by z descending, then id ascending;
 *   - top_k > 0 keeps the first top_k of that ranking;
 *   - p_i = exp(z_i - max z) over the kept set (double), normalised;
 *   - 0 < top_p < 1 keeps the shortest prefix of the ranking whose
 *     cumulative probability reaches top_p * total (at least one token);
 *   - the draw: u = tw_sample_uniform(seed, position), target = u * total of
 *     the kept set; the kept tokens are walked in increasing id order and the
 *     first whose running sum exceeds the target is chosen. */
#include "common/engine/sampling.h"

#include <math.h>
#include <stdlib.h>

static uint64_t tw_splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double tw_sample_uniform(uint64_t seed, int64_t position) {
  uint64_t h = tw_splitmix64(tw_splitmix64(seed) ^ (uint64_t)position);
  return (double)(h >> 11) * 0x1.0p-53;
}

/* Ranking order: a before b if z[a] > z[b], or equal and a < b. */
static int tw_rank_before(const float *z, int32_t a, int32_t b) {
  return z[a] > z[b] || (z[a] == z[b] && a < b);
}

static int tw_rank_cmp(const void *a, const void *b, void *z_v) {
  int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
  const float *z = z_v;
  if (tw_rank_before(z, ia, ib)) return -1;
  if (tw_rank_before(z, ib, ia)) return 1;
  return 0;
}

static int tw_id_cmp(const void *a, const void *b) {
  int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
  return (ia > ib) - (ia < ib);
}

/* Min-heap on the ranking (root = the worst kept), for top-k selection. */
static void tw_heap_sift_down(int32_t *heap, int32_t n, int32_t i, const float *z) {
  for (;;) {
    int32_t l = 2 * i + 1, r = l + 1, w = i;
    if (l < n && tw_rank_before(z, heap[w], heap[l])) w = l;
    if (r < n && tw_rank_before(z, heap[w], heap[r])) w = r;
    if (w == i) return;
    int32_t t = heap[i];
    heap[i] = heap[w];
    heap[w] = t;
    i = w;
  }
}

static int32_t tw_argmax(const float *logits, int32_t vocab) {
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; i++)
    if (logits[i] > logits[best] || (isnan(logits[best]) && !isnan(logits[i]))) best = i;
  return best;
}

TW_NODISCARD tw_status_t tw_sample(const float *logits, int32_t vocab,
                                   const tw_sample_params_t *params, int64_t position,
                                   float *scratch, int32_t *token_p) {
  if (vocab <= 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "sample: vocab %d <= 0", vocab);
  if (params && isnan(params->temperature))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "sample: temperature is NaN");
  if (!params || params->temperature <= 0.0f) {
    *token_p = tw_argmax(logits, vocab);
    return TW_OK;
  }
  float *own = NULL;
  if (!scratch) {
    own = malloc(sizeof(float) * 2 * (size_t)vocab);
    if (!own) return tw_err(TW_ERR_NO_MEMORY, "sample: out of memory for vocab %d", vocab);
    scratch = own;
  }
  float *z = scratch;
  int32_t *idx = (int32_t *)(scratch + vocab);
  for (int32_t i = 0; i < vocab; i++) {
    float v = logits[i] / params->temperature;
    z[i] = isnan(v) ? -INFINITY : v;
  }
  int32_t n = vocab;
  int sorted = 0;
  if (params->top_k > 0 && params->top_k < vocab) {
    n = params->top_k;
    for (int32_t i = 0; i < n; i++) idx[i] = i;
    for (int32_t i = n / 2 - 1; i >= 0; i--) tw_heap_sift_down(idx, n, i, z);
    for (int32_t i = n; i < vocab; i++) {
      if (tw_rank_before(z, i, idx[0])) {
        idx[0] = i;
        tw_heap_sift_down(idx, n, 0, z);
      }
    }
  } else {
    for (int32_t i = 0; i < vocab; i++) idx[i] = i;
  }
  int use_top_p = params->top_p > 0.0f && params->top_p < 1.0f;
  double full_total = 0.0; /* top-p without top-k: mass of the whole vocabulary */
  if (use_top_p && n == vocab) {
    /* Only tokens with p_i >= (1 - top_p) / vocab can be in the nucleus: the
     * others sum to less than 1 - top_p, so the ranked prefix reaching top_p
     * lies among the kept ones. Sorting those few is exact and avoids a
     * full-vocabulary sort. */
    float zmax = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) zmax = z[i] > zmax ? z[i] : zmax;
    if (zmax > -INFINITY) {
      for (int32_t i = 0; i < vocab; i++) full_total += exp((double)z[i] - zmax);
      double cut = (1.0 - (double)params->top_p) / vocab * full_total;
      int32_t kept = 0;
      for (int32_t i = 0; i < vocab; i++)
        if (exp((double)z[i] - zmax) >= cut) idx[kept++] = i;
      n = kept;
    }
  }
  if (use_top_p || n < vocab) {
    qsort_r(idx, (size_t)n, sizeof(int32_t), tw_rank_cmp, z);
    sorted = 1;
  }
  float m = -INFINITY;
  for (int32_t i = 0; i < n; i++) m = z[idx[i]] > m ? z[idx[i]] : m;
  if (m == -INFINITY) { /* nothing finite: fall back to the lowest id */
    *token_p = tw_argmax(logits, vocab);
    free(own);
    return TW_OK;
  }
  double total = 0.0;
  if (full_total > 0.0) {
    total = full_total; /* the same max: m is the top token, kept by the filter */
  } else {
    for (int32_t i = 0; i < n; i++) total += exp((double)z[idx[i]] - m);
  }
  if (use_top_p && sorted) {
    double need = (double)params->top_p * total, cum = 0.0;
    int32_t keep = 0;
    while (keep < n) {
      cum += exp((double)z[idx[keep]] - m);
      keep++;
      if (cum >= need) break;
    }
    n = keep;
    total = cum;
  }
  if (sorted) qsort(idx, (size_t)n, sizeof(int32_t), tw_id_cmp);
  double target = tw_sample_uniform(params->seed, position) * total, cum = 0.0;
  int32_t tok = idx[n - 1];
  for (int32_t i = 0; i < n; i++) {
    cum += exp((double)z[idx[i]] - m);
    if (cum > target) {
      tok = idx[i];
      break;
    }
  }
  *token_p = tok;
  free(own);
  return TW_OK;
}
