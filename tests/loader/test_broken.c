/* test_broken.c: every kind of broken safetensors file, index and checkpoint
 * directory gives its own status and a message naming the file and tensor;
 * nothing crashes, and a good checkpoint still loads afterwards (the process
 * keeps serving, STYLE.md "Tests"). */
#include "check.h"
#include "st_writer.h"

#include "common/model/model.h"
#include "common/model/safetensors.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- in-memory headers --------------------------------------------------- */

static uint8_t buf_g[1 << 16];

/* Build [u64 len][header][data_bytes zeros] and parse it. */
static TW_NODISCARD tw_status_t parse_hdr(const char *header, int64_t data_bytes) {
  size_t n = strlen(header);
  memset(buf_g, 0, sizeof buf_g);
  for (int i = 0; i < 8; i++) buf_g[i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(buf_g + 8, header, n);
  tw_safetensors_t *f = NULL;
  tw_status_t st = tw_safetensors_parse(buf_g, (int64_t)(8 + n) + data_bytes, "mem.safetensors", &f);
  tw_safetensors_destroy(f);
  return st;
}

static TW_NODISCARD tw_status_t parse_len(uint64_t len_field, int64_t file_bytes) {
  memset(buf_g, ' ', sizeof buf_g);
  for (int i = 0; i < 8; i++) buf_g[i] = (uint8_t)(len_field >> (8 * i));
  tw_safetensors_t *f = NULL;
  tw_status_t st = tw_safetensors_parse(buf_g, file_bytes, "mem.safetensors", &f);
  tw_safetensors_destroy(f);
  return st;
}

#define T1(entry) "{\"w\":" entry "}"

static void test_headers(void) {
  const tw_status_t F = TW_ERR_FORMAT;
  EXPECT_ERR(parse_len(0, 3), F, "mem.safetensors: file is 3 bytes, shorter than the 8-byte");
  EXPECT_ERR(parse_len(1000, 100), F, "header length 1000 goes beyond the end of the file");
  EXPECT_ERR(parse_len(1ull << 40, 100), F, "is absurd");
  EXPECT_ERR(parse_hdr("{\"w\": ", 0), F, "mem.safetensors: header is not valid JSON");
  EXPECT_ERR(parse_hdr("{} xyz", 0), F, "trailing bytes");
  EXPECT_ERR(parse_hdr("[1, 2]", 0), F, "header is not a JSON object");
  EXPECT_ERR(parse_hdr(T1("5"), 0), F, "tensor 'w': header entry is not an object");
  EXPECT_ERR(parse_hdr(T1("{\"shape\":[2],\"data_offsets\":[0,4]}"), 4), F,
             "tensor 'w': missing 'dtype'");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"data_offsets\":[0,4]}"), 4), F,
             "tensor 'w': missing 'shape'");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[2]}"), 4), F,
             "tensor 'w': missing 'data_offsets'");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":16,\"shape\":[2],\"data_offsets\":[0,4]}"), 4), F,
             "'dtype' is not a string");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF17\",\"shape\":[2],\"data_offsets\":[0,4]}"), 4), F,
             "tensor 'w': unknown dtype \"BF17\"");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":2,\"data_offsets\":[0,4]}"), 4), F,
             "'shape' is not a list");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[\"2\"],\"data_offsets\":[0,4]}"), 4), F,
             "shape[0] is not an integer");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[2,-4],\"data_offsets\":[0,4]}"), 4), F,
             "shape[1] = -4 is negative");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],"
                          "\"data_offsets\":[0,4]}"),
                       4),
             F, "shape product overflows");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0]}"), 4), F,
             "'data_offsets' is not a list of 2");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[\"0\",4]}"), 4), F,
             "'data_offsets' must be 2 non-negative integers");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[-4,0]}"), 4), F,
             "'data_offsets' must be 2 non-negative integers");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[8,4]}"), 8), F,
             "tensor 'w': data_offsets begin 8 > end 4");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[16],\"data_offsets\":[0,32]}"), 16), F,
             "tensor 'w': byte range [0, 32) lies beyond the data section (16 bytes)");
  EXPECT_ERR(parse_hdr(T1("{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,16]}"), 16), F,
             "tensor 'w': shape x dtype size (BF16) is 8 bytes but data_offsets span 16 bytes");
  EXPECT_ERR(parse_hdr("{\"a\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[8,24]}}",
                       24),
             F, "tensors 'a' [0, 16) and 'b' [8, 24) have overlapping byte ranges");
  EXPECT_ERR(parse_hdr("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                       "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
                       8),
             F, "tensor 'a' appears twice");
  EXPECT_ERR(parse_hdr("{\"__metadata__\":[1]}", 0), F, "'__metadata__' is not an object");

  /* a good header: metadata, every dtype, a scalar and an empty tensor */
  const char *good =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"f32\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
      "\"scalar\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[16,24]},"
      "\"empty\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[24,24]},"
      "\"e4m3\":{\"dtype\":\"F8_E4M3\",\"shape\":[3],\"data_offsets\":[24,27]},"
      "\"e5m2\":{\"dtype\":\"F8_E5M2\",\"shape\":[1],\"data_offsets\":[27,28]},"
      "\"b\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[28,29]},"
      "\"i8\":{\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[29,30]},"
      "\"i16\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[30,32]},"
      "\"f16\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[32,36]},"
      "\"i32\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[36,40]},"
      "\"f64\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[40,48]}}";
  size_t n = strlen(good);
  memset(buf_g, 0, sizeof buf_g);
  for (int i = 0; i < 8; i++) buf_g[i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(buf_g + 8, good, n);
  tw_safetensors_t *f = NULL;
  EXPECT_OK(tw_safetensors_parse(buf_g, (int64_t)(8 + n + 48), "good", &f));
  if (f) {
    EXPECT_EQ_I64(tw_safetensors_count(f), 11);
    EXPECT_TRUE(strcmp(tw_safetensors_metadata(f, "format"), "pt") == 0);
    EXPECT_TRUE(tw_safetensors_metadata(f, "nope") == NULL);
    EXPECT_TRUE(tw_safetensors_find(f, "absent") == NULL);
    const tw_safetensors_tensor_t *t = tw_safetensors_find(f, "scalar");
    EXPECT_TRUE(t && t->ndim == 0 && t->n_elems == 1 && t->n_bytes == 8 && t->dtype == TW_DTYPE_I64);
    EXPECT_TRUE(t && (const uint8_t *)t->data == buf_g + 8 + n + 16);
    t = tw_safetensors_find(f, "empty");
    EXPECT_TRUE(t && t->n_bytes == 0 && t->shape[1] == 5);
    t = tw_safetensors_find(f, "e4m3");
    EXPECT_TRUE(t && t->dtype == TW_DTYPE_F8_E4M3 && t->n_bytes == 3);
    t = tw_safetensors_find(f, "f64");
    EXPECT_TRUE(t && t->dtype == TW_DTYPE_F64 && t->begin == 40);
    EXPECT_EQ_I64(tw_safetensors_data_bytes(f), 48);
    tw_safetensors_destroy(f);
  }
}

/* ---- files on disk -------------------------------------------------------- */

static char *tmp_g;
static char fixture_g[4096];
static stw_tensor_t model_g[128];
static int n_model_g;

static void path_in(char *out, size_t n, const char *dir, const char *name) {
  snprintf(out, n, "%s/%s", dir, name);
}

static void test_files(void) {
  char p[4096];
  tw_safetensors_t *f = NULL;
  EXPECT_ERR(tw_safetensors_open("/nonexistent/x.safetensors", &f), TW_ERR_NOT_FOUND,
             "/nonexistent/x.safetensors: cannot open");
  EXPECT_ERR(tw_safetensors_open(tmp_g, &f), TW_ERR_IO, "not a regular file");
  path_in(p, sizeof p, tmp_g, "short.safetensors");
  EXPECT_TRUE(stw_write_text(p, "abc") == 0);
  EXPECT_ERR(tw_safetensors_open(p, &f), TW_ERR_FORMAT, "short.safetensors: file is 3 bytes");
  path_in(p, sizeof p, tmp_g, "empty.safetensors");
  EXPECT_TRUE(stw_write_text(p, "") == 0);
  EXPECT_ERR(tw_safetensors_open(p, &f), TW_ERR_FORMAT, "file is 0 bytes");
  path_in(p, sizeof p, tmp_g, "len.safetensors");
  EXPECT_TRUE(stw_write_raw(p, 5000, "{}", NULL, 10) == 0);
  EXPECT_ERR(tw_safetensors_open(p, &f), TW_ERR_FORMAT, "len.safetensors: header length 5000");
  EXPECT_TRUE(f == NULL);
}

/* A checkpoint directory with the fixture's config (or `config_text`) and a
 * model.safetensors made of `t[0..n)`. */
static char *make_dir(const stw_tensor_t *t, int n, const char *config_text) {
  char *dir = stw_tmpdir("broken");
  char p[4096], src[4200];
  path_in(p, sizeof p, dir, "config.json");
  if (config_text) {
    EXPECT_TRUE(stw_write_text(p, config_text) == 0);
  } else {
    snprintf(src, sizeof src, "%s/config.json", fixture_g);
    EXPECT_TRUE(stw_copy(src, p) == 0);
  }
  if (t) {
    path_in(p, sizeof p, dir, "model.safetensors");
    EXPECT_TRUE(stw_write(p, t, n) == 0);
  }
  return dir;
}

static TW_NODISCARD tw_status_t load_dir(char *dir) {
  tw_model_t *m = NULL;
  tw_status_t st = tw_model_load(dir, &m);
  if (st == TW_OK) { /* what a worker does before it serves */
    st = tw_model_check_finite(m);
    if (st != TW_OK) {
      tw_model_destroy(m);
      m = NULL;
    }
  }
  tw_model_destroy(m);
  if (st != TW_OK) EXPECT_TRUE(m == NULL);
  stw_rmtree(dir);
  free(dir);
  return st;
}

static int find_g(const char *name) {
  for (int i = 0; i < n_model_g; i++)
    if (strcmp(model_g[i].name, name) == 0) return i;
  fprintf(stderr, "test bug: no tensor %s\n", name);
  exit(2);
}

static void test_checkpoints(void) {
  static stw_tensor_t t[128];
  int i;
  /* wrong dtype: q_proj stored as F32 (a consistent file) */
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.1.self_attn.q_proj.weight");
  snprintf(t[i].dtype, sizeof t[i].dtype, "F32");
  t[i].data = NULL;
  t[i].n_bytes *= 2;
  EXPECT_ERR(load_dir(make_dir(t, n_model_g, NULL)), TW_ERR_INVALID_ARGUMENT,
             "tensor 'model.layers.1.self_attn.q_proj.weight' has the wrong dtype: expected "
             "BF16 [256, 256], found F32 [256, 256]");
  /* wrong shape, same byte count */
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.0.self_attn.k_proj.weight");
  t[i].shape[0] = 256;
  t[i].shape[1] = 128;
  EXPECT_ERR(load_dir(make_dir(t, n_model_g, NULL)), TW_ERR_INVALID_ARGUMENT,
             "tensor 'model.layers.0.self_attn.k_proj.weight' has the wrong shape: expected "
             "BF16 [128, 256], found BF16 [256, 128]");
  /* wrong rank of the MXFP4 blocks */
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.2.mlp.experts.down_proj_blocks");
  t[i].ndim = 3;
  t[i].shape[2] = 256;
  EXPECT_ERR(load_dir(make_dir(t, n_model_g, NULL)), TW_ERR_INVALID_ARGUMENT,
             "expected U8 [8, 256, 16, 16], found U8 [8, 256, 256]");
  /* missing tensor */
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.2.self_attn.sinks");
  t[i] = t[n_model_g - 1];
  EXPECT_ERR(load_dir(make_dir(t, n_model_g - 1, NULL)), TW_ERR_NOT_FOUND,
             "tensor 'model.layers.2.self_attn.sinks' is missing (expected BF16 [4])");
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.3.mlp.experts.down_proj_scales");
  t[i] = t[n_model_g - 1];
  EXPECT_ERR(load_dir(make_dir(t, n_model_g - 1, NULL)), TW_ERR_NOT_FOUND,
             "'model.layers.3.mlp.experts.down_proj_scales' is missing");
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.3.mlp.experts.gate_up_proj_blocks");
  t[i] = t[n_model_g - 1];
  EXPECT_ERR(load_dir(make_dir(t, n_model_g - 1, NULL)), TW_ERR_NOT_FOUND,
             "'model.layers.3.mlp.experts.gate_up_proj_blocks' (MXFP4 experts) or");
  /* sinks in f32 are accepted */
  memcpy(t, model_g, sizeof t);
  i = find_g("model.layers.0.self_attn.sinks");
  snprintf(t[i].dtype, sizeof t[i].dtype, "F32");
  t[i].data = NULL;
  t[i].n_bytes = 16;
  EXPECT_OK(load_dir(make_dir(t, n_model_g, NULL)));

  /* truncated model.safetensors */
  {
    char *dir = make_dir(model_g, n_model_g, NULL);
    char p[4096];
    path_in(p, sizeof p, dir, "model.safetensors");
    int64_t n = 0;
    char *bytes = stw_slurp(p, &n);
    EXPECT_TRUE(truncate(p, n - 1000) == 0);
    free(bytes);
    EXPECT_ERR(load_dir(dir), TW_ERR_FORMAT, "lies beyond the data section");
  }
  /* no weights, no config, bad config */
  EXPECT_ERR(load_dir(make_dir(NULL, 0, NULL)), TW_ERR_NOT_FOUND,
             "neither model.safetensors nor model.safetensors.index.json exists");
  {
    char *dir = stw_tmpdir("noconfig");
    EXPECT_ERR(load_dir(dir), TW_ERR_NOT_FOUND, "config.json is missing");
  }
  char src[4200];
  snprintf(src, sizeof src, "%s/config.json", fixture_g);
  char *cfg = stw_slurp(src, NULL);
  cJSON *root = cJSON_Parse(cfg);
  cJSON_DeleteItemFromObject(root, "hidden_size");
  char *no_hidden = cJSON_Print(root);
  EXPECT_ERR(load_dir(make_dir(model_g, n_model_g, no_hidden)), TW_ERR_NOT_FOUND,
             "required field 'hidden_size' is missing");
  cJSON_Delete(root);
  free(no_hidden);
  /* config that disagrees with the weights: the first mismatching tensor is named */
  root = cJSON_Parse(cfg);
  cJSON_ReplaceItemInObject(root, "vocab_size", cJSON_CreateNumber(8100));
  char *small_vocab = cJSON_Print(root);
  EXPECT_ERR(load_dir(make_dir(model_g, n_model_g, small_vocab)), TW_ERR_INVALID_ARGUMENT,
             "'model.embed_tokens.weight' has the wrong shape: expected BF16 [8100, 256], "
             "found BF16 [8064, 256]");
  cJSON_Delete(root);
  free(small_vocab);
  free(cfg);
}

/* ---- poisoned weights, absurd config values, files that are not files ---- */

/* The fixture with one tensor's bytes copied and `bytes` written at `off`. */
static TW_NODISCARD tw_status_t load_poisoned(const char *name, int64_t off, const void *bytes,
                                              size_t n) {
  static stw_tensor_t t[128];
  memcpy(t, model_g, sizeof t);
  int i = find_g(name);
  uint8_t *copy = malloc((size_t)t[i].n_bytes);
  memcpy(copy, t[i].data, (size_t)t[i].n_bytes);
  memcpy(copy + off, bytes, n);
  t[i].data = copy;
  tw_status_t st = load_dir(make_dir(t, n_model_g, NULL));
  free(copy);
  return st;
}

/* The fixture's config with `key` (in the top level and in both rope
 * objects, wherever it is) set to v. */
static char *config_with(const char *key, double v) {
  char src[4200];
  snprintf(src, sizeof src, "%s/config.json", fixture_g);
  char *cfg = stw_slurp(src, NULL);
  cJSON *root = cJSON_Parse(cfg);
  free(cfg);
  cJSON *objs[3] = {root, cJSON_GetObjectItem(root, "rope_parameters"),
                    cJSON_GetObjectItem(root, "rope_scaling")};
  for (int k = 0; k < 3; k++)
    if (objs[k] && cJSON_GetObjectItem(objs[k], key))
      cJSON_ReplaceItemInObject(objs[k], key, cJSON_CreateNumber(v));
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  return text;
}

static void test_poison(void) {
  const uint16_t nan_bf16 = 0x7FC0, inf_bf16 = 0x7F80;
  const uint8_t nan_e8m0 = 0xFF;
  EXPECT_ERR(load_poisoned("lm_head.weight", 14, &nan_bf16, 2), TW_ERR_INVALID_ARGUMENT,
             "tensor 'lm_head.weight' holds a NaN or infinity (element 7)");
  EXPECT_ERR(load_poisoned("model.norm.weight", 0, &inf_bf16, 2), TW_ERR_INVALID_ARGUMENT,
             "tensor 'model.norm.weight' holds a NaN or infinity (element 0)");
  EXPECT_ERR(load_poisoned("model.layers.2.self_attn.sinks", 2, &nan_bf16, 2),
             TW_ERR_INVALID_ARGUMENT, "tensor 'model.layers.2.self_attn.sinks' holds a NaN");
  EXPECT_ERR(load_poisoned("model.layers.1.self_attn.q_proj.weight", 1000, &inf_bf16, 2),
             TW_ERR_INVALID_ARGUMENT, "'model.layers.1.self_attn.q_proj.weight' holds a NaN or infinity (element 500)");
  EXPECT_ERR(load_poisoned("model.layers.3.mlp.experts.down_proj_scales", 5, &nan_e8m0, 1),
             TW_ERR_INVALID_ARGUMENT, "'model.layers.3.mlp.experts.down_proj_scales' holds a NaN");

  char *c1 = config_with("rope_theta", 1e-300), *c2 = config_with("factor", 1e300);
  EXPECT_ERR(load_dir(make_dir(model_g, n_model_g, c1)), TW_ERR_INVALID_ARGUMENT,
             "field 'rope_theta' = 1e-300 must be in [1, 1e+12]");
  EXPECT_ERR(load_dir(make_dir(model_g, n_model_g, c2)), TW_ERR_INVALID_ARGUMENT,
             "factor' = 1e+300 must be in [1, 1024]");
  free(c1);
  free(c2);

  /* FIFOs (nobody ever writes them: a loader that waits hangs here) and a
   * device are refused at once, without reading */
  char p[4096];
  char *dir = make_dir(NULL, 0, NULL);
  path_in(p, sizeof p, dir, "model.safetensors");
  EXPECT_TRUE(mkfifo(p, 0600) == 0);
  EXPECT_ERR(load_dir(dir), TW_ERR_IO, "model.safetensors: not a regular file");
  dir = make_dir(model_g, n_model_g, NULL);
  path_in(p, sizeof p, dir, "config.json");
  EXPECT_TRUE(unlink(p) == 0 && mkfifo(p, 0600) == 0);
  EXPECT_ERR(load_dir(dir), TW_ERR_INVALID_ARGUMENT, "config.json is not a regular file");
}

/* ---- sharded index -------------------------------------------------------- */

/* Two shards (even/odd tensors) and an index; `edit` changes the index. */
static char *make_sharded(void (*edit)(cJSON *weight_map, cJSON *root), const char *raw_index) {
  char *dir = make_dir(NULL, 0, NULL);
  static stw_tensor_t part[128];
  cJSON *root = cJSON_CreateObject();
  cJSON *wm = cJSON_AddObjectToObject(root, "weight_map");
  for (int s = 0; s < 2; s++) {
    char name[64], p[4096];
    snprintf(name, sizeof name, "model-%05d-of-00001.safetensors", s);
    int k = 0;
    for (int i = s; i < n_model_g; i += 2) {
      part[k++] = model_g[i];
      cJSON_AddStringToObject(wm, model_g[i].name, name);
    }
    path_in(p, sizeof p, dir, name);
    EXPECT_TRUE(stw_write(p, part, k) == 0);
  }
  if (edit) edit(wm, root);
  char *text = cJSON_Print(root);
  char p[4096];
  path_in(p, sizeof p, dir, "model.safetensors.index.json");
  EXPECT_TRUE(stw_write_text(p, raw_index ? raw_index : text) == 0);
  free(text);
  cJSON_Delete(root);
  return dir;
}

static void edit_no_weight_map(cJSON *wm, cJSON *root) {
  (void)wm;
  cJSON_DeleteItemFromObject(root, "weight_map");
}
static void edit_missing_shard(cJSON *wm, cJSON *root) {
  (void)root;
  cJSON_ReplaceItemInObject(wm, "model.norm.weight",
                            cJSON_CreateString("model-00005-of-00009.safetensors"));
}
static void edit_wrong_shard(cJSON *wm, cJSON *root) {
  (void)root;
  const char *now = cJSON_GetObjectItem(wm, "lm_head.weight")->valuestring;
  const char *other = strstr(now, "00000-") ? "model-00001-of-00001.safetensors"
                                            : "model-00000-of-00001.safetensors";
  cJSON_ReplaceItemInObject(wm, "lm_head.weight", cJSON_CreateString(other));
}
static void edit_not_string(cJSON *wm, cJSON *root) {
  (void)root;
  cJSON_ReplaceItemInObject(wm, "lm_head.weight", cJSON_CreateNumber(3));
}
static void edit_escape(cJSON *wm, cJSON *root) {
  (void)root;
  cJSON_ReplaceItemInObject(wm, "lm_head.weight", cJSON_CreateString("../model.safetensors"));
}
static void edit_drop(cJSON *wm, cJSON *root) {
  (void)root;
  cJSON_DeleteItemFromObject(wm, "model.layers.1.mlp.router.bias");
}

static void test_index(void) {
  EXPECT_OK(load_dir(make_sharded(NULL, NULL)));
  EXPECT_ERR(load_dir(make_sharded(NULL, "{\"weight_map\": {")), TW_ERR_FORMAT,
             "model.safetensors.index.json: not valid JSON");
  EXPECT_ERR(load_dir(make_sharded(edit_no_weight_map, NULL)), TW_ERR_FORMAT,
             "model.safetensors.index.json: no 'weight_map' object");
  EXPECT_ERR(load_dir(make_sharded(NULL, "{\"weight_map\": []}")), TW_ERR_FORMAT,
             "'weight_map' is not an object");
  EXPECT_ERR(load_dir(make_sharded(edit_missing_shard, NULL)), TW_ERR_NOT_FOUND,
             "shard 'model-00005-of-00009.safetensors' listed in the index does not exist");
  EXPECT_ERR(load_dir(make_sharded(edit_wrong_shard, NULL)), TW_ERR_FORMAT,
             "the index maps tensor 'lm_head.weight' to shard");
  EXPECT_ERR(load_dir(make_sharded(edit_not_string, NULL)), TW_ERR_FORMAT,
             "weight_map['lm_head.weight'] is not a file name");
  EXPECT_ERR(load_dir(make_sharded(edit_escape, NULL)), TW_ERR_FORMAT,
             "is not a file in");
  EXPECT_ERR(load_dir(make_sharded(edit_drop, NULL)), TW_ERR_NOT_FOUND,
             "tensor 'model.layers.1.mlp.router.bias' is missing");
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  snprintf(fixture_g, sizeof fixture_g, "%s/tiny-gptoss-wordnet-mxfp4",
           fixtures ? fixtures : "tests/fixtures");
  tmp_g = stw_tmpdir("files");
  char p[4200];
  snprintf(p, sizeof p, "%s/model.safetensors", fixture_g);
  void *mapping = NULL;
  n_model_g = stw_read(p, model_g, 128, &mapping);
  EXPECT_EQ_I64(n_model_g, 79);
  test_headers();
  test_files();
  if (n_model_g == 79) {
    test_checkpoints();
    test_poison();
    test_index();
  }
  /* still serving: the good checkpoint loads after all of the above */
  tw_model_t *m = NULL;
  EXPECT_OK(tw_model_load(fixture_g, &m));
  tw_model_destroy(m);
  free(mapping);
  stw_rmtree(tmp_g);
  free(tmp_g);
  return CHECK_DONE("test_broken");
}
