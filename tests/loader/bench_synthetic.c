/* bench_synthetic.c: time tw_model_synthetic on gpt-oss shapes (spec §1.1:
 * H = I = 2880, 64/8 heads, D = 64, V = 201088) with E experts and L layers,
 * MXFP4 experts. Not a ctest test (no timing assertions); its figures go to
 * docs/benchmarks.md. Usage: bench_synthetic [LAYERS [EXPERTS [VOCAB]]]. */
#include "common/base/log.h"
#include "common/model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
  tw_model_config_t c;
  memset(&c, 0, sizeof c);
  c.n_layers = argc > 1 ? atoi(argv[1]) : 1;
  c.n_experts = argc > 2 ? atoi(argv[2]) : 32;
  c.vocab_size = argc > 3 ? atoi(argv[3]) : 201088;
  c.n_experts_per_tok = 4;
  c.hidden = 2880;
  c.intermediate = 2880;
  c.head_dim = 64;
  c.n_heads = 64;
  c.n_kv_heads = 8;
  c.sliding_window = 128;
  c.mxfp4 = true;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  tw_model_t *m = NULL;
  tw_status_t st = tw_model_synthetic(&c, 1, &m);
  clock_gettime(CLOCK_MONOTONIC, &b);
  if (st != TW_OK) {
    fprintf(stderr, "synthetic failed: %s\n", tw_last_error());
    return 1;
  }
  double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
  printf("synthetic L=%d E=%d V=%d mxfp4: %lld bytes in %.3f s = %.2f GB/s on %ld cpus\n",
         c.n_layers, c.n_experts, c.vocab_size, (long long)m->weight_bytes, s,
         (double)m->weight_bytes / s / 1e9, sysconf(_SC_NPROCESSORS_ONLN));
  tw_model_destroy(m);
  return 0;
}
