/* model_load.c: tw_model_load: config.json + model.safetensors, or
 * model.safetensors.index.json and its shards (spec §3.1), into views of the
 * read-only mappings. Checks every expected tensor's presence, dtype and
 * shape against the config (spec §3.2, §3.5) and validates the index. */
#include "common/model/model.h"

#include "common/base/file_read.h"

#include "common/base/log.h"
#include "common/model/model_impl.h"
#include "common/model/safetensors.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define TW_INDEX_MAX_BYTES (64 << 20)

static bool file_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static TW_NODISCARD tw_status_t open_file(tw_model_impl_t *impl, const char *path) {
  tw_safetensors_t *f = NULL;
  TW_CHECK(tw_safetensors_open(path, &f));
  impl->files[impl->n_files++] = f;
  TW_INFO("loader", "mapped %s: %lld tensors, %.1f MiB", path,
          (long long)tw_safetensors_count(f),
          (double)tw_safetensors_file_bytes(f) / (1024.0 * 1024.0));
  return TW_OK;
}

/* Read every weight file once before the engine does, logging the progress
 * (bytes, rate) every 2 s and a summary: the first start of a big model shows
 * where it is instead of a silent minute; the engine's reads then come from
 * the page cache. A failure here only ends the pre-read (the mapped file
 * reports real errors where it is used). */
static void tw_load_preread(const tw_model_impl_t *impl) {
  int64_t total = 0, done = 0;
  for (int i = 0; i < impl->n_files; i++) total += tw_safetensors_file_bytes(impl->files[i]);
  size_t cap = 1u << 20; /* small: the load adds no resident memory (test_load_rss) */
  char *buf = malloc(cap);
  if (!buf) return;
  const double t0 = now_s();
  double last = t0;
  for (int i = 0; i < impl->n_files; i++) {
    const char *path = tw_safetensors_path(impl->files[i]);
    FILE *f = fopen(path, "rb");
    if (!f) break;
    for (size_t got; (got = fread(buf, 1, cap, f)) > 0;) {
      done += (int64_t)got;
      double t = now_s();
      if (t - last >= 2.0) {
        last = t;
        TW_INFO("loader", "reading weights: %.2f of %.2f GB (%.0f%%), %.2f GB/s", done * 1e-9,
                total * 1e-9, total ? 100.0 * (double)done / (double)total : 100.0,
                done * 1e-9 / (t - t0));
      }
    }
    fclose(f);
  }
  free(buf);
  double dt = now_s() - t0;
  TW_INFO("loader", "read %.2f GB of weights from %d file(s) in %.1f s (%.2f GB/s)", done * 1e-9,
          impl->n_files, dt, dt > 0 ? done * 1e-9 / dt : 0.0);
}

static int cmp_entry(const void *a, const void *b) {
  return strcmp(((const tw_index_entry_t *)a)->name, ((const tw_index_entry_t *)b)->name);
}

static TW_NODISCARD tw_status_t read_text(const char *path, char **text_p) {
  return tw_file_read(path, TW_INDEX_MAX_BYTES, "checkpoint index", text_p, NULL);
}

/* Parse the index, open each shard it names once, and check that every
 * tensor it maps is in the shard it names. */
static TW_NODISCARD tw_status_t open_sharded(tw_model_impl_t *impl, const char *dir,
                                             const char *index_path) {
  char *text = NULL;
  TW_CHECK(read_text(index_path, &text));
  cJSON *root = cJSON_Parse(text);
  free(text);
  tw_status_t st = TW_OK;
  char **shards = NULL;
  int n_shards = 0;
  if (!root) return tw_err(TW_ERR_FORMAT, "%s: not valid JSON", index_path);
  const cJSON *wm = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map")
                                         : NULL;
  if (!wm) {
    st = tw_err(TW_ERR_FORMAT, "%s: no 'weight_map' object", index_path);
    goto out;
  }
  if (!cJSON_IsObject(wm)) {
    st = tw_err(TW_ERR_FORMAT, "%s: 'weight_map' is not an object", index_path);
    goto out;
  }
  int n = cJSON_GetArraySize(wm);
  impl->map = calloc((size_t)n + 1, sizeof *impl->map);
  shards = calloc((size_t)n + 1, sizeof *shards);
  impl->files = calloc((size_t)n + 1, sizeof *impl->files);
  if (!impl->map || !shards || !impl->files) {
    st = tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", index_path);
    goto out;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, wm) {
    if (!cJSON_IsString(e)) {
      st = tw_err(TW_ERR_FORMAT, "%s: weight_map['%s'] is not a file name", index_path,
                  e->string);
      goto out;
    }
    const char *shard = e->valuestring;
    if (shard[0] == '\0' || strchr(shard, '/') || strcmp(shard, "..") == 0) {
      st = tw_err(TW_ERR_FORMAT, "%s: weight_map['%s'] = \"%s\" is not a file in %s", index_path,
                  e->string, shard, dir);
      goto out;
    }
    int s = 0;
    while (s < n_shards && strcmp(shards[s], shard) != 0) s++;
    if (s == n_shards) {
      shards[n_shards] = strdup(shard);
      if (!shards[n_shards]) {
        st = tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", index_path);
        goto out;
      }
      n_shards++;
    }
    impl->map[impl->n_map].name = strdup(e->string);
    impl->map[impl->n_map].file = s;
    if (!impl->map[impl->n_map].name) {
      st = tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", index_path);
      goto out;
    }
    impl->n_map++;
  }
  qsort(impl->map, (size_t)impl->n_map, sizeof *impl->map, cmp_entry);
  for (int64_t i = 1; i < impl->n_map; i++) {
    if (strcmp(impl->map[i - 1].name, impl->map[i].name) == 0) {
      st = tw_err(TW_ERR_FORMAT, "%s: tensor '%s' appears twice in weight_map", index_path,
                  impl->map[i].name);
      goto out;
    }
  }
  for (int s = 0; s < n_shards; s++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, shards[s]);
    if (!file_exists(path)) {
      st = tw_err(TW_ERR_NOT_FOUND, "%s: shard '%s' listed in the index does not exist (%s)",
                  index_path, shards[s], path);
      goto out;
    }
    TW_CHECK_GOTO(open_file(impl, path), st, out);
  }
  for (int64_t i = 0; i < impl->n_map; i++) {
    const tw_index_entry_t *m = &impl->map[i];
    if (!tw_safetensors_find(impl->files[m->file], m->name)) {
      st = tw_err(TW_ERR_FORMAT,
                  "%s: the index maps tensor '%s' to shard '%s', which does not contain it",
                  index_path, m->name, shards[m->file]);
      goto out;
    }
  }
out:
  for (int s = 0; s < n_shards; s++) free(shards[s]);
  free(shards);
  cJSON_Delete(root);
  return st;
}

/* The tensor named `name` and the file holding it, or NULL. */
static const tw_safetensors_tensor_t *lookup(const tw_model_impl_t *impl, const char *name,
                                             const tw_safetensors_t **file_p) {
  if (impl->map) {
    tw_index_entry_t key = {(char *)name, 0};
    const tw_index_entry_t *e =
        bsearch(&key, impl->map, (size_t)impl->n_map, sizeof *impl->map, cmp_entry);
    if (!e) return NULL;
    *file_p = impl->files[e->file];
    return tw_safetensors_find(impl->files[e->file], name);
  }
  *file_p = impl->files[0];
  return tw_safetensors_find(impl->files[0], name);
}

/* A NaN or an infinity in a weight makes every logit NaN (greedy then picks
 * token 0 forever): refuse the checkpoint, naming the tensor and the first
 * bad element. bf16/f16/f32: exponent all ones; U8 "_scales" of MXFP4
 * experts: E8M0 0xFF is NaN (OCP MX spec §5.4.1). The MXFP4 values
 * themselves (E2M1) have no NaN or infinity. One pass over the bytes. */
static TW_NODISCARD tw_status_t check_finite(const char *file, const char *name, tw_dtype_t dtype,
                                             const uint8_t *p, int64_t n_bytes) {
  int64_t bad = -1;
  if (dtype == TW_DTYPE_BF16 || dtype == TW_DTYPE_F16) {
    uint16_t mask = dtype == TW_DTYPE_BF16 ? 0x7F80 : 0x7C00;
    for (int64_t i = 0; i + 2 <= n_bytes && bad < 0; i += 2) {
      uint16_t v;
      memcpy(&v, p + i, 2);
      if ((v & mask) == mask) bad = i / 2;
    }
  } else if (dtype == TW_DTYPE_F32) {
    for (int64_t i = 0; i + 4 <= n_bytes && bad < 0; i += 4) {
      uint32_t v;
      memcpy(&v, p + i, 4);
      if ((v & 0x7F800000u) == 0x7F800000u) bad = i / 4;
    }
  } else if (dtype == TW_DTYPE_U8) {
    size_t nl = strlen(name);
    if (nl < 7 || strcmp(name + nl - 7, "_scales") != 0) return TW_OK;
    const void *ff = memchr(p, 0xFF, (size_t)n_bytes);
    if (ff) bad = (const uint8_t *)ff - p;
  }
  if (bad < 0) return TW_OK;
  return tw_err(TW_ERR_INVALID_ARGUMENT,
                "%s: tensor '%s' holds a NaN or infinity (element %lld): the checkpoint is corrupt",
                file, name, (long long)bad);
}

static TW_NODISCARD tw_status_t bind_tensor(tw_model_t *m, const tw_tensor_spec_t *sp) {
  tw_model_impl_t *impl = m->impl;
  const tw_safetensors_t *f = NULL;
  const tw_safetensors_tensor_t *t = lookup(impl, sp->name, &f);
  char want[96], got[96];
  tw_model_shape_str(sp->shape, sp->ndim, want, sizeof want);
  if (!t)
    return tw_err(TW_ERR_NOT_FOUND, "%s: tensor '%s' is missing (expected %s %s)",
                  impl->source, sp->name, tw_dtype_name(sp->dtype), want);
  tw_model_shape_str(t->shape, t->ndim, got, sizeof got);
  bool dtype_ok = t->dtype == sp->dtype || (sp->alt_f32 && t->dtype == TW_DTYPE_F32);
  bool shape_ok = t->ndim == sp->ndim;
  for (int i = 0; shape_ok && i < sp->ndim; i++) shape_ok = t->shape[i] == sp->shape[i];
  if (!dtype_ok || !shape_ok)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "%s: tensor '%s' has the wrong %s: expected %s %s, found %s %s",
                  tw_safetensors_path(f), sp->name, dtype_ok ? "shape" : "dtype",
                  tw_dtype_name(sp->dtype), want, tw_dtype_name(t->dtype), got);
  if ((uintptr_t)t->data % tw_dtype_size(t->dtype) != 0)
    impl->n_misaligned++; /* legal, but element loads through typed pointers are not */
  tw_tensor_t *v = sp->dst;
  v->data = t->data;
  v->dtype = t->dtype;
  v->ndim = t->ndim;
  for (int i = 0; i < 4; i++) v->shape[i] = i < t->ndim ? t->shape[i] : 0;
  v->n_bytes = t->n_bytes;
  m->weight_bytes += t->n_bytes;
  impl->n_tensors++;
  return TW_OK;
}

/* MXFP4 or bf16 experts for layer l, from which tensors exist (spec §3.5). */
static TW_NODISCARD tw_status_t detect_experts(const tw_model_t *m, int l, const char *dir) {
  const tw_model_impl_t *impl = m->impl;
  char a[160], b[160];
  const tw_safetensors_t *f = NULL;
  snprintf(a, sizeof a, "model.layers.%d.mlp.experts.gate_up_proj_blocks", l);
  snprintf(b, sizeof b, "model.layers.%d.mlp.experts.gate_up_proj", l);
  if (lookup(m->impl, a, &f)) {
    m->layers[l].experts_format = TW_EXPERTS_MXFP4;
  } else if (lookup(m->impl, b, &f)) {
    m->layers[l].experts_format = TW_EXPERTS_BF16;
  } else {
    return tw_err(TW_ERR_NOT_FOUND,
                  "%s: tensor '%s' (MXFP4 experts) or '%s' (bf16 experts) is missing",
                  impl->source, a, b);
  }
  if (m->layers[l].experts_format == TW_EXPERTS_BF16 && m->config.mxfp4 && l == 0)
    TW_WARN("loader", "%s: config.json says mxfp4 but the experts are bf16; using bf16", dir);
  if (m->layers[l].experts_format == TW_EXPERTS_MXFP4 &&
      (m->config.hidden % 32 != 0 || m->config.intermediate % 32 != 0))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "%s: MXFP4 experts need hidden_size and intermediate_size multiples of 32", dir);
  return TW_OK;
}

static TW_NODISCARD tw_status_t load_into(tw_model_t *m, const char *dir) {
  tw_model_impl_t *impl = m->impl;
  char single[4096], index[4096];
  snprintf(single, sizeof single, "%s/model.safetensors", dir);
  snprintf(index, sizeof index, "%s/model.safetensors.index.json", dir);
  impl->source = strdup(file_exists(single) ? single : index);
  if (!impl->source) return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", dir);
  if (file_exists(single)) { /* transformers also prefers the single file */
    impl->files = calloc(1, sizeof *impl->files);
    if (!impl->files) return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", dir);
    TW_CHECK(open_file(impl, single));
  } else if (file_exists(index)) {
    TW_CHECK(open_sharded(impl, dir, index));
  } else {
    return tw_err(TW_ERR_NOT_FOUND,
                  "%s: neither model.safetensors nor model.safetensors.index.json exists", dir);
  }
  tw_load_preread(impl);
  for (int l = 0; l < m->config.n_layers; l++) TW_CHECK(detect_experts(m, l, dir));

  tw_model_specs_t specs;
  TW_CHECK(tw_model_specs_build(&m->config, m, &specs));
  tw_status_t st = TW_OK;
  for (int64_t i = 0; i < specs.n && st == TW_OK; i++) st = bind_tensor(m, &specs.specs[i]);
  tw_model_specs_fini(&specs);
  TW_CHECK(st);

  if (impl->n_misaligned > 0)
    TW_WARN("loader", "%s: %lld tensors start at an address that is not a multiple of their "
            "element size (header not padded to 8 bytes); read them with memcpy",
            impl->source, (long long)impl->n_misaligned);
  int64_t in_files = 0;
  for (int i = 0; i < impl->n_files; i++) in_files += tw_safetensors_count(impl->files[i]);
  if (in_files > impl->n_tensors)
    TW_WARN("loader", "%s: %lld tensors in the files are not used by the model", dir,
            (long long)(in_files - impl->n_tensors));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_model_check_finite(const tw_model_t *m) {
  const tw_model_impl_t *impl = m->impl;
  const double t0 = now_s();
  tw_model_specs_t specs;
  TW_CHECK(tw_model_specs_build(&m->config, (tw_model_t *)m, &specs));
  tw_status_t st = TW_OK;
  for (int64_t i = 0; i < specs.n && st == TW_OK; i++) {
    const tw_tensor_t *t = specs.specs[i].dst;
    if (t->data) st = check_finite(impl->source, specs.specs[i].name, t->dtype, t->data, t->n_bytes);
  }
  tw_model_specs_fini(&specs);
  if (st == TW_OK)
    TW_INFO("loader", "weights checked: no NaN or infinity (%.3f s)", now_s() - t0);
  return st;
}

TW_NODISCARD tw_status_t tw_model_load(const char *dir, tw_model_t **model_p) {
  if (!dir || !model_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "model load: NULL argument");
  const double t0 = now_s();
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", dir);
  tw_model_config_t config;
  if (!file_exists(path))
    return tw_err(TW_ERR_NOT_FOUND, "%s: config.json is missing", dir);
  TW_CHECK(tw_config_load(path, &config));
  tw_model_t *m = NULL;
  TW_CHECK(tw_model_alloc(&config, &m));
  tw_status_t st = load_into(m, dir);
  if (st != TW_OK) {
    tw_model_destroy(m);
    return st;
  }
  const tw_model_impl_t *impl = m->impl;
  TW_INFO("loader",
          "loaded %s: %d layers, %s experts, %lld tensors from %d file(s), %lld bytes "
          "(%.2f GiB) in %.3f s",
          dir, config.n_layers,
          m->layers[0].experts_format == TW_EXPERTS_MXFP4 ? "mxfp4" : "bf16",
          (long long)impl->n_tensors, impl->n_files, (long long)m->weight_bytes,
          (double)m->weight_bytes / (1024.0 * 1024.0 * 1024.0), now_s() - t0);
  *model_p = m;
  return TW_OK;
}
