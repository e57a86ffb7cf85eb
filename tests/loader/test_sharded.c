/* test_sharded.c: split the tiny checkpoints into shards plus a
 * model.safetensors.index.json (the HF layout of spec §3.1) and check that
 * the sharded load gives views with the same dtypes, shapes and bytes as the
 * single-file load. */
#include "check.h"
#include "st_writer.h"

#include "common/model/model.h"
#include "common/model/model_impl.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void expect_same(const tw_tensor_t *a, const tw_tensor_t *b, const char *what, int l) {
  if ((a->data == NULL) != (b->data == NULL) || a->dtype != b->dtype || a->ndim != b->ndim ||
      a->n_bytes != b->n_bytes || memcmp(a->shape, b->shape, sizeof a->shape) != 0 ||
      (a->data && memcmp(a->data, b->data, (size_t)a->n_bytes) != 0)) {
    fprintf(stderr, "FAILED: layer %d %s differs between single-file and sharded loads\n", l,
            what);
    fails++;
  }
  if (a->data && a->data == b->data) fails++; /* must be separate mappings */
}

static void compare_models(const tw_model_t *a, const tw_model_t *b) {
  expect_same(&a->embed, &b->embed, "embed", -1);
  expect_same(&a->final_norm, &b->final_norm, "final_norm", -1);
  expect_same(&a->lm_head, &b->lm_head, "lm_head", -1);
  EXPECT_EQ_I64(a->weight_bytes, b->weight_bytes);
  for (int l = 0; l < a->config.n_layers; l++) {
    const tw_layer_weights_t *x = &a->layers[l], *y = &b->layers[l];
    EXPECT_EQ_I64(x->experts_format, y->experts_format);
#define SAME(f) expect_same(&x->f, &y->f, #f, l)
    SAME(attn_norm); SAME(q_w); SAME(q_b); SAME(k_w); SAME(k_b); SAME(v_w); SAME(v_b);
    SAME(o_w); SAME(o_b); SAME(sinks); SAME(mlp_norm); SAME(router_w); SAME(router_b);
    SAME(gate_up); SAME(gate_up_blocks); SAME(gate_up_scales); SAME(gate_up_bias);
    SAME(down); SAME(down_blocks); SAME(down_scales); SAME(down_bias);
#undef SAME
  }
}

/* Write `n_shards` shards of `src_dir`'s model into a new directory. */
static char *make_sharded(const char *src_dir, int n_shards) {
  char *dir = stw_tmpdir("sharded");
  char src[4096], dst[4096];
  snprintf(src, sizeof src, "%s/config.json", src_dir);
  snprintf(dst, sizeof dst, "%s/config.json", dir);
  EXPECT_TRUE(stw_copy(src, dst) == 0);
  snprintf(src, sizeof src, "%s/model.safetensors", src_dir);
  static stw_tensor_t all[256], part[256];
  void *buf = NULL;
  int n = stw_read(src, all, 256, &buf);
  EXPECT_TRUE(n > 0);
  cJSON *index = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(index, "metadata");
  cJSON *wm = cJSON_AddObjectToObject(index, "weight_map");
  int64_t total = 0;
  for (int s = 0; s < n_shards; s++) {
    char name[128];
    /* HF naming: numbered from 0, suffix is the last index (spec §3.1) */
    snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s, n_shards - 1);
    int k = 0;
    for (int i = s; i < n; i += n_shards) { /* interleaved: layers span shards */
      part[k++] = all[i];
      cJSON_AddStringToObject(wm, all[i].name, name);
      total += all[i].n_bytes;
    }
    snprintf(dst, sizeof dst, "%s/%s", dir, name);
    EXPECT_TRUE(stw_write(dst, part, k) == 0);
  }
  cJSON_AddNumberToObject(meta, "total_size", (double)total);
  char *text = cJSON_Print(index);
  snprintf(dst, sizeof dst, "%s/model.safetensors.index.json", dir);
  EXPECT_TRUE(stw_write_text(dst, text) == 0);
  free(text);
  cJSON_Delete(index);
  free(buf);
  return dir;
}

static void check_dir(const char *src_dir, int n_shards) {
  char *dir = make_sharded(src_dir, n_shards);
  tw_model_t *a = NULL, *b = NULL;
  EXPECT_OK(tw_model_load(src_dir, &a));
  EXPECT_OK(tw_model_load(dir, &b));
  if (a && b) {
    compare_models(a, b);
    EXPECT_EQ_I64(((const tw_model_impl_t *)b->impl)->n_files, n_shards);
    EXPECT_EQ_I64(((const tw_model_impl_t *)b->impl)->n_tensors,
                  ((const tw_model_impl_t *)a->impl)->n_tensors);
  }
  tw_model_destroy(a);
  tw_model_destroy(b);
  stw_rmtree(dir);
  free(dir);
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  const char *shared = getenv("TW_SHARED_DIR");
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/tiny-gptoss-wordnet-mxfp4", fixtures ? fixtures : "tests/fixtures");
  check_dir(dir, 3);
  snprintf(dir, sizeof dir, "%s/models/tiny-gptoss-wordnet", shared ? shared : "../shared");
  char probe[4200];
  snprintf(probe, sizeof probe, "%s/config.json", dir);
  FILE *f = fopen(probe, "r");
  if (f) {
    fclose(f);
    check_dir(dir, 2);
  }
  return CHECK_DONE("test_sharded");
}
