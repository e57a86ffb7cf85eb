/* test_embed_sample.c: embedding gather and GPU sampling (kernels/
 * embed_sample.h) against the CPU: the gather must be exact (bf16 -> f32),
 * argmax and every sampled token must equal common/engine/sampling.c tw_sample on
 * the same f32 logits (greedy, temperature, top-k, top-p and their mixes,
 * with ties, NaN and -inf in the rows), at V = 201088 (gpt-oss) and 8064
 * (the tiny model) and an odd V. */
#include "attn_test_util.h"
#include "common/engine/sampling.h"
#include "kernels/embed_sample.h"

#define V_DUMMY_K (-7) /* marker: top_k = V - 1 */

static int test_embed(int V, int H, int T) {
  uint16_t *tab = malloc((size_t)V * H * 2);
  int32_t *tok = malloc((size_t)T * 4);
  float *out = malloc((size_t)T * H * 4);
  for (size_t i = 0; i < (size_t)V * H; i++) tab[i] = tt_rand_bf16(2.0f);
  for (int t = 0; t < T; t++) tok[t] = t == 0 ? V - 1 : tt_randint(0, V - 1);
  void *dtab, *dtok, *dout;
  TT_CUDA(cudaMalloc(&dtab, (size_t)V * H * 2));
  TT_CUDA(cudaMalloc(&dtok, (size_t)T * 4));
  TT_CUDA(cudaMalloc(&dout, (size_t)T * H * 4));
  TT_CUDA(cudaMemcpy(dtab, tab, (size_t)V * H * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(dtok, tok, (size_t)T * 4, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(dout, 0xff, (size_t)T * H * 4));
  if (tw_cuda_embed(dtab, V, H, dtok, T, dout, 0) != TW_OK) return 1;
  TT_CUDA(cudaMemcpy(out, dout, (size_t)T * H * 4, cudaMemcpyDeviceToHost));
  long bad = 0;
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      if (out[(size_t)t * H + h] != tt_bf2f(tab[(size_t)tok[t] * H + h])) bad++;
  printf("%s embed(V=%d,H=%d,T=%d): %ld values differ\n", bad ? "FAIL" : "ok  ", V, H, T, bad);
  cudaFree(dtab); cudaFree(dtok); cudaFree(dout);
  free(tab); free(tok); free(out);
  return bad ? 1 : 0;
}

/* n_rows rows of logits, each sampled with a parameter set of the table. */
static int test_sample(int V, int n_rows) {
  static const tw_sample_params_t sets[] = {
      {0.0f, 0, 1.0f, 1},   {1.0f, 0, 1.0f, 7},    {0.7f, 40, 1.0f, 3},  {0.7f, 0, 0.9f, 11},
      {1.3f, 50, 0.8f, 5},  {0.5f, 1, 1.0f, 9},    {1.0f, 0, 0.5f, 13},  {2.0f, 1000, 0.95f, 17},
      {1.0f, 0, 0.05f, 19}, {0.9f, V_DUMMY_K, 0.99f, 23},
  };
  float *lg = malloc((size_t)n_rows * V * 4);
  tw_cuda_sample_row_t *rows = malloc((size_t)n_rows * sizeof(*rows));
  int32_t *want = malloc((size_t)n_rows * 4), *got = malloc((size_t)n_rows * 4);
  int32_t *got_am = malloc((size_t)n_rows * 4);
  int n_sets = (int)(sizeof sets / sizeof sets[0]);
  for (int r = 0; r < n_rows; r++) {
    float *row = lg + (size_t)r * V;
    float scale = r % 3 == 0 ? 8.0f : 2.0f; /* peaked and flat rows */
    for (int i = 0; i < V; i++) row[i] = tt_normal(scale);
    if (r % 4 == 1) row[tt_randint(0, V - 1)] = NAN;
    if (r % 4 == 2) row[tt_randint(0, V - 1)] = -INFINITY;
    if (r % 5 == 3) { /* a tie at the top */
      int a = tt_randint(0, V - 1), b = tt_randint(0, V - 1);
      row[a] = row[b] = 60.0f;
    }
    tw_sample_params_t p = sets[r % n_sets];
    if (p.top_k == V_DUMMY_K) p.top_k = V - 1;
    p.seed += (uint64_t)r * 1000003u;
    int64_t pos = tt_randint(0, 100000);
    if (tw_sample(row, V, &p, pos, NULL, &want[r]) != TW_OK) return 1;
    rows[r].temperature = p.temperature;
    rows[r].top_k = p.top_k;
    rows[r].top_p = p.top_p;
    rows[r].pad_ = 0;
    rows[r].uniform = tw_sample_uniform(p.seed, pos);
  }
  void *dl, *dp, *dout, *dam;
  TT_CUDA(cudaMalloc(&dl, (size_t)n_rows * V * 4));
  TT_CUDA(cudaMalloc(&dp, (size_t)n_rows * sizeof(*rows)));
  TT_CUDA(cudaMalloc(&dout, (size_t)n_rows * 4));
  TT_CUDA(cudaMalloc(&dam, (size_t)n_rows * 4));
  TT_CUDA(cudaMemcpy(dl, lg, (size_t)n_rows * V * 4, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(dp, rows, (size_t)n_rows * sizeof(*rows), cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(dout, 0xff, (size_t)n_rows * 4));
  if (tw_cuda_sample(dl, V, n_rows, V, dp, dout, 0) != TW_OK) return 1;
  if (tw_cuda_argmax(dl, V, n_rows, V, dam, 0) != TW_OK) return 1;
  TT_CUDA(cudaMemcpy(got, dout, (size_t)n_rows * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(got_am, dam, (size_t)n_rows * 4, cudaMemcpyDeviceToHost));
  int bad = 0, bad_am = 0;
  for (int r = 0; r < n_rows; r++) {
    if (got[r] != want[r]) {
      bad++;
      if (bad <= 5)
        printf("  row %d (T=%.2f k=%d p=%.2f): gpu %d cpu %d\n", r, rows[r].temperature,
               rows[r].top_k, rows[r].top_p, got[r], want[r]);
    }
    int32_t am = -1;
    bad_am += tw_sample(lg + (size_t)r * V, V, NULL, 0, NULL, &am) != TW_OK || got_am[r] != am;
  }
  printf("%s sample(V=%d,rows=%d): %d tokens differ from tw_sample\n", bad ? "FAIL" : "ok  ", V,
         n_rows, bad);
  printf("%s argmax(V=%d,rows=%d): %d tokens differ\n", bad_am ? "FAIL" : "ok  ", V, n_rows, bad_am);
  cudaFree(dl); cudaFree(dp); cudaFree(dout); cudaFree(dam);
  free(lg); free(rows); free(want); free(got); free(got_am);
  return bad || bad_am ? 1 : 0;
}

int main(void) {
  if (!tt_gpu_available()) {
    printf("SKIP: no GPU\n");
    return TT_SKIP;
  }
  tt_seed();
  int rc = 0;
  rc |= test_embed(201088, 2880, 37);
  rc |= test_embed(8064, 256, 1);
  rc |= test_sample(201088, 40);
  rc |= test_sample(8064, 60);
  rc |= test_sample(1001, 30);
  printf("%s\n", rc ? "test_embed_sample: FAILED" : "test_embed_sample: all passed");
  return rc ? 1 : 0;
}
