/* test_sampling.c: sampling.h: greedy ties, top-k = 1 and tiny top-p equal
 * greedy, reproducibility per seed, and the sampled distribution against the
 * softmax computed here in double (chi-square over a bounded number of
 * positions, each position giving one independent draw). */
#include "common/engine/sampling.h"

#include "test_util.h"

#include <string.h>

static int32_t sample1(const float *z, int32_t v, float temp, int32_t k, float p, uint64_t seed,
                       int64_t pos) {
  tw_sample_params_t sp = {.temperature = temp, .top_k = k, .top_p = p, .seed = seed};
  int32_t tok = -1;
  tw_status_t st = tw_sample(z, v, &sp, pos, NULL, &tok);
  EXPECT(st == TW_OK, "tw_sample status %d", st);
  return tok;
}

/* chi-square of counts against probabilities want[] (0 where excluded). */
static double chi2(const int *count, const double *want, int v, int n, int *bad_p) {
  double x = 0;
  *bad_p = 0;
  for (int i = 0; i < v; i++) {
    if (want[i] == 0.0) {
      *bad_p += count[i];
      continue;
    }
    double e = want[i] * n;
    x += (count[i] - e) * (count[i] - e) / e;
  }
  return x;
}

static void check_distribution(const float *z, int v, float temp, int32_t k, float p, int keep) {
  /* expected: softmax of z/temp over the `keep` best (z sorted descending here) */
  double want[16] = {0}, sum = 0;
  for (int i = 0; i < keep; i++) sum += exp((double)z[i] / temp - (double)z[0] / temp);
  for (int i = 0; i < keep; i++) want[i] = exp((double)z[i] / temp - (double)z[0] / temp) / sum;
  enum { N = 20000 };
  int count[16] = {0};
  for (int64_t pos = 0; pos < N; pos++) count[sample1(z, v, temp, k, p, 1234, pos)]++;
  int bad;
  double x = chi2(count, want, v, N, &bad);
  /* keep-1 degrees of freedom (<= 7): P(chi2 > 30) < 1e-4 */
  EXPECT(bad == 0, "temp %g k %d p %g: %d draws outside the kept set", temp, k, p, bad);
  EXPECT(x < 30.0, "temp %g k %d p %g: chi-square %.2f over %d tokens", temp, k, p, x, keep);
}

/* The documented rules of sampling.c, written out with a full sort. */
static int32_t reference_sample(const float *logits, int v, float temp, int32_t k, float p,
                                uint64_t seed, int64_t pos) {
  static float z[1000];
  static int32_t idx[1000];
  for (int i = 0; i < v; i++) {
    z[i] = logits[i] / temp;
    idx[i] = i;
  }
  for (int i = 1; i < v; i++) { /* insertion sort: z descending, id ascending */
    int32_t t = idx[i];
    int j = i - 1;
    while (j >= 0 && (z[idx[j]] < z[t] || (z[idx[j]] == z[t] && idx[j] > t))) {
      idx[j + 1] = idx[j];
      j--;
    }
    idx[j + 1] = t;
  }
  int n = (k > 0 && k < v) ? k : v;
  double m = z[idx[0]], total = 0;
  for (int i = 0; i < n; i++) total += exp((double)z[idx[i]] - m);
  if (p > 0 && p < 1) {
    double cum = 0;
    int keep = 0;
    while (keep < n) {
      cum += exp((double)z[idx[keep]] - m);
      keep++;
      if (cum >= p * total) break;
    }
    n = keep;
    total = cum;
  }
  /* draw: kept tokens in increasing id order */
  static int32_t kept[1000];
  for (int i = 0; i < n; i++) kept[i] = idx[i];
  for (int i = 1; i < n; i++) {
    int32_t t = kept[i];
    int j = i - 1;
    while (j >= 0 && kept[j] > t) {
      kept[j + 1] = kept[j];
      j--;
    }
    kept[j + 1] = t;
  }
  double target = tw_sample_uniform(seed, pos) * total, cum = 0;
  for (int i = 0; i < n; i++) {
    cum += exp((double)z[kept[i]] - m);
    if (cum > target) return kept[i];
  }
  return kept[n - 1];
}

int main(void) {
  const float ties[5] = {1.0f, 5.0f, 2.0f, 5.0f, -1.0f};
  int32_t tok = -1;
  EXPECT(tw_sample(ties, 5, NULL, 0, NULL, &tok) == TW_OK && tok == 1, "greedy tie -> 1, got %d", tok);
  tw_sample_params_t g = TW_SAMPLE_PARAMS_GREEDY;
  EXPECT(tw_sample(ties, 5, &g, 0, NULL, &tok) == TW_OK && tok == 1, "greedy params tie");
  EXPECT(sample1(ties, 5, 1.0f, 1, 1.0f, 7, 3) == 1, "top-k 1 with a tie picks the lowest id");
  tw_sample_params_t nanp = {.temperature = NAN, .top_p = 1.0f};
  EXPECT(tw_sample(ties, 5, &nanp, 0, NULL, &tok) == TW_ERR_INVALID_ARGUMENT, "NaN temperature");
  EXPECT(tw_sample(ties, 0, NULL, 0, NULL, &tok) == TW_ERR_INVALID_ARGUMENT, "vocab 0");

  uint64_t s = 77;
  enum { V = 1000 };
  static float z[V], scratch[2 * V];
  int differ = 0;
  for (int64_t pos = 0; pos < 200; pos++) {
    for (int i = 0; i < V; i++) z[i] = (float)tw_test_uniform(&s, -2, 2);
    int32_t greedy = -1;
    EXPECT_OK(tw_sample(z, V, NULL, pos, NULL, &greedy));
    EXPECT(sample1(z, V, 0.8f, 1, 1.0f, 5, pos) == greedy, "top-k 1 != greedy at %lld", (long long)pos);
    EXPECT(sample1(z, V, 1.0f, 0, 1e-6f, 5, pos) == greedy, "tiny top-p != greedy at %lld", (long long)pos);
    int32_t a = sample1(z, V, 1.0f, 0, 1.0f, 99, pos), b = sample1(z, V, 1.0f, 0, 1.0f, 99, pos);
    tw_sample_params_t sp = {.temperature = 1.0f, .top_k = 50, .top_p = 0.9f, .seed = 99};
    int32_t c = -1;
    EXPECT_OK(tw_sample(z, V, &sp, pos, scratch, &c)); /* caller scratch gives the same draw */
    EXPECT(a == b, "same seed, same token at %lld", (long long)pos);
    EXPECT(c == sample1(z, V, 1.0f, 50, 0.9f, 99, pos), "scratch vs own buffer at %lld", (long long)pos);
    differ += sample1(z, V, 1.0f, 0, 1.0f, 100, pos) != a;
  }
  EXPECT(differ > 150, "seeds 99 and 100 agree too often: %d of 200 differ", differ);

  /* the documented rules, against a full-sort reference: top-p alone (the
   * pre-filtered path), top-k alone, both */
  const float tps[4] = {0.5f, 0.9f, 0.99f, 0.999f};
  int mismatches = 0;
  for (int64_t pos = 0; pos < 100; pos++) {
    for (int i = 0; i < V; i++) z[i] = (float)tw_test_uniform(&s, -4, 4);
    for (int j = 0; j < 4; j++) {
      mismatches += sample1(z, V, 0.9f, 0, tps[j], 11, pos) != reference_sample(z, V, 0.9f, 0, tps[j], 11, pos);
      mismatches += sample1(z, V, 1.1f, 40, tps[j], 12, pos) != reference_sample(z, V, 1.1f, 40, tps[j], 12, pos);
    }
    mismatches += sample1(z, V, 1.0f, 7, 1.0f, 13, pos) != reference_sample(z, V, 1.0f, 7, 1.0f, 13, pos);
    mismatches += sample1(z, V, 1.0f, 0, 1.0f, 14, pos) != reference_sample(z, V, 1.0f, 0, 1.0f, 14, pos);
  }
  EXPECT(mismatches == 0, "%d of 1000 draws differ from the full-sort reference", mismatches);

  double mean = 0;
  for (int64_t i = 0; i < 10000; i++) {
    double u = tw_sample_uniform(3, i);
    EXPECT(u >= 0.0 && u < 1.0, "uniform out of range %g", u);
    mean += u;
  }
  EXPECT(fabs(mean / 10000 - 0.5) < 0.01, "uniform mean %g", mean / 10000);
  EXPECT(tw_sample_uniform(3, 5) == tw_sample_uniform(3, 5), "uniform is a pure function");

  /* distributions: z sorted descending so the kept set is a prefix */
  const float zd[8] = {2.0f, 1.5f, 1.2f, 0.4f, 0.0f, -0.5f, -1.0f, -3.0f};
  check_distribution(zd, 8, 1.0f, 0, 1.0f, 8);
  check_distribution(zd, 8, 0.7f, 0, 1.0f, 8);
  check_distribution(zd, 8, 1.0f, 3, 1.0f, 3);
  /* top-p 0.7 at temp 1: p = .395 .240 .177 .080 ... cumulative reaches 0.7 at 3 tokens */
  check_distribution(zd, 8, 1.0f, 0, 0.7f, 3);
  return tw_test_exit("test_sampling");
}
