/* test_load_rss.c: loading maps, it does not copy (model.h). Measures the
 * process's resident set (VmRSS from /proc/self/statm, peak from getrusage)
 * before the load, after the load, and after reading every weight byte once.
 * The load itself must add less than 2 MiB; reading everything must add
 * about weight_bytes (between 90% and 100% + 2 MiB), i.e. one copy of the
 * weights, the page-cache pages themselves. Usage: test_load_rss DIR. Prints
 * one line with the figures (used in docs/benchmarks.md). */
#include "check.h"

#include "common/base/log.h"
#include "common/model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static long rss_kib(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  long size = 0, resident = 0;
  if (f) {
    if (fscanf(f, "%ld %ld", &size, &resident) != 2) resident = 0;
    fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static long peak_kib(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

static uint64_t touch(const tw_tensor_t *t) {
  uint64_t s = 0;
  const uint8_t *p = t->data;
  for (int64_t i = 0; p && i < t->n_bytes; i++) s += p[i];
  return s;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  char probe[4200];
  snprintf(probe, sizeof probe, "%s/config.json", argv[1]);
  if (access(probe, R_OK) != 0) {
    fprintf(stderr, "%s absent: skipped\n", probe);
    return 77;
  }
  tw_log_level_g = TW_LOG_WARN;
  const long rss0 = rss_kib(), peak0 = peak_kib();
  tw_model_t *m = NULL;
  EXPECT_OK(tw_model_load(argv[1], &m));
  if (!m) return CHECK_DONE("test_load_rss");
  const long rss1 = rss_kib(), peak1 = peak_kib();
  uint64_t sum = touch(&m->embed) + touch(&m->final_norm) + touch(&m->lm_head);
  for (int l = 0; l < m->config.n_layers; l++) {
    const tw_layer_weights_t *w = &m->layers[l];
    const tw_tensor_t *all[] = {&w->attn_norm, &w->q_w, &w->q_b, &w->k_w, &w->k_b, &w->v_w,
                                &w->v_b, &w->o_w, &w->o_b, &w->sinks, &w->mlp_norm,
                                &w->router_w, &w->router_b, &w->gate_up, &w->gate_up_blocks,
                                &w->gate_up_scales, &w->gate_up_bias, &w->down,
                                &w->down_blocks, &w->down_scales, &w->down_bias};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) sum += touch(all[i]);
  }
  const long rss2 = rss_kib(), peak2 = peak_kib();
  const long weights_kib = (long)(m->weight_bytes / 1024);
  printf("load_rss %s: weight_bytes %lld (%ld KiB); RSS before %ld KiB, after load +%ld KiB, "
         "after reading all weights +%ld KiB (%.3f x weights); ru_maxrss %ld -> %ld -> %ld KiB "
         "(checksum %llu)\n",
         argv[1], (long long)m->weight_bytes, weights_kib, rss0, rss1 - rss0, rss2 - rss0,
         (double)(rss2 - rss0) / (double)weights_kib, peak0, peak1, peak2,
         (unsigned long long)sum);
#ifdef __SANITIZE_ADDRESS__
  /* ASan's shadow memory and quarantine inflate RSS: report, do not judge */
  tw_model_destroy(m);
  return 77;
#endif
  EXPECT_TRUE(rss1 - rss0 < 2048);
  EXPECT_TRUE(peak1 - peak0 < 2048);
  EXPECT_TRUE(rss2 - rss0 >= weights_kib * 9 / 10);
  EXPECT_TRUE(rss2 - rss0 <= weights_kib + 2048);
  tw_model_destroy(m);
  return CHECK_DONE("test_load_rss");
}
