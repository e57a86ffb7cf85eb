/* safetensors.c: mmap a safetensors file and validate its header completely
 * (see safetensors.h). No tensor byte is read here: only the 8-byte length
 * and the JSON header, so opening a 65 GB checkpoint costs its headers. */
#include "common/model/safetensors.h"

#include "common/base/log.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define TW_SAFETENSORS_MAGIC 0x74777374u /* "twst" */

typedef struct {
  char *key;
  char *value;
} tw_st_meta_t;

struct tw_safetensors {
  uint32_t magic;
  char *path;
  const uint8_t *bytes;  /* whole file */
  int64_t n_bytes;
  int64_t data_start;    /* 8 + header length */
  bool mapped;           /* bytes is our mmap */
  int64_t n_tensors;
  tw_safetensors_tensor_t *tensors; /* sorted by name */
  char *names;           /* storage for all names */
  int64_t n_meta;
  tw_st_meta_t *meta;
};

static const struct {
  const char *name;
  tw_dtype_t dtype;
} tw_st_dtypes[] = {
    {"F32", TW_DTYPE_F32},   {"BF16", TW_DTYPE_BF16}, {"F16", TW_DTYPE_F16},
    {"U8", TW_DTYPE_U8},     {"I8", TW_DTYPE_I8},     {"I16", TW_DTYPE_I16},
    {"I32", TW_DTYPE_I32},   {"I64", TW_DTYPE_I64},   {"F64", TW_DTYPE_F64},
    {"BOOL", TW_DTYPE_BOOL}, {"F8_E4M3", TW_DTYPE_F8_E4M3}, {"F8_E5M2", TW_DTYPE_F8_E5M2},
};

TW_NODISCARD tw_status_t tw_safetensors_dtype_parse(const char *s, tw_dtype_t *dtype_p) {
  for (size_t i = 0; i < sizeof tw_st_dtypes / sizeof tw_st_dtypes[0]; i++) {
    if (strcmp(s, tw_st_dtypes[i].name) == 0) {
      *dtype_p = tw_st_dtypes[i].dtype;
      return TW_OK;
    }
  }
  return TW_ERR_NOT_FOUND;
}

/* JSON numbers are doubles: offsets and dims must be integral, >= 0 (or the
 * caller reports negative) and exactly representable (< 2^53). */
static bool json_int(const cJSON *it, int64_t *v_p) {
  if (!cJSON_IsNumber(it)) return false;
  double d = it->valuedouble;
  if (d != floor(d) || fabs(d) > 9007199254740992.0) return false;
  *v_p = (int64_t)d;
  return true;
}

static int cmp_by_name(const void *a, const void *b) {
  return strcmp(((const tw_safetensors_tensor_t *)a)->name,
                ((const tw_safetensors_tensor_t *)b)->name);
}

static int cmp_by_begin(const void *a, const void *b) {
  const tw_safetensors_tensor_t *x = *(const tw_safetensors_tensor_t *const *)a;
  const tw_safetensors_tensor_t *y = *(const tw_safetensors_tensor_t *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return (x->n_bytes > y->n_bytes) - (x->n_bytes < y->n_bytes);
}

/* Parse one tensor entry `e` named `name` into `t`. */
static TW_NODISCARD tw_status_t parse_entry(const tw_safetensors_t *f, const char *name,
                                            const cJSON *e, int64_t data_bytes,
                                            tw_safetensors_tensor_t *t) {
  const char *p = f->path;
  if (!cJSON_IsObject(e))
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': header entry is not an object", p, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
  if (!dt) return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': missing 'dtype'", p, name);
  if (!sh) return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': missing 'shape'", p, name);
  if (!off) return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': missing 'data_offsets'", p, name);
  if (!cJSON_IsString(dt))
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': 'dtype' is not a string", p, name);
  if (tw_safetensors_dtype_parse(dt->valuestring, &t->dtype) != TW_OK)
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': unknown dtype \"%.32s\"", p, name,
                  dt->valuestring);

  if (!cJSON_IsArray(sh))
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': 'shape' is not a list", p, name);
  int ndim = cJSON_GetArraySize(sh);
  if (ndim > TW_SAFETENSORS_MAX_DIMS)
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': %d dimensions (at most %d supported)", p,
                  name, ndim, TW_SAFETENSORS_MAX_DIMS);
  t->ndim = ndim;
  int64_t n_elems = 1;
  bool overflow = false;
  int d = 0;
  const cJSON *dim;
  cJSON_ArrayForEach(dim, sh) {
    int64_t v;
    if (!json_int(dim, &v))
      return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not an integer", p, name, d);
    if (v < 0)
      return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': shape[%d] = %lld is negative", p, name, d,
                    (long long)v);
    t->shape[d++] = v;
    if (__builtin_mul_overflow(n_elems, v, &n_elems)) overflow = true;
  }
  int64_t n_bytes = 0;
  if (overflow ||
      __builtin_mul_overflow(n_elems, (int64_t)tw_dtype_size(t->dtype), &n_bytes))
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': shape product overflows 64 bits", p, name);
  t->n_elems = n_elems;
  t->n_bytes = n_bytes;

  if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': 'data_offsets' is not a list of 2 integers",
                  p, name);
  int64_t begin, end;
  if (!json_int(off->child, &begin) || !json_int(off->child->next, &end) || begin < 0 ||
      end < 0)
    return tw_err(TW_ERR_FORMAT,
                  "%s: tensor '%s': 'data_offsets' must be 2 non-negative integers", p, name);
  if (begin > end)
    return tw_err(TW_ERR_FORMAT, "%s: tensor '%s': data_offsets begin %lld > end %lld", p, name,
                  (long long)begin, (long long)end);
  if (end > data_bytes)
    return tw_err(TW_ERR_FORMAT,
                  "%s: tensor '%s': byte range [%lld, %lld) lies beyond the data section "
                  "(%lld bytes): file truncated?",
                  p, name, (long long)begin, (long long)end, (long long)data_bytes);
  if (end - begin != n_bytes)
    return tw_err(TW_ERR_FORMAT,
                  "%s: tensor '%s': shape x dtype size (%s) is %lld bytes but data_offsets "
                  "span %lld bytes",
                  p, name, tw_dtype_name(t->dtype), (long long)n_bytes,
                  (long long)(end - begin));
  t->begin = begin;
  t->data = f->bytes + f->data_start + begin;
  return TW_OK;
}

static TW_NODISCARD tw_status_t parse_metadata(tw_safetensors_t *f, const cJSON *m) {
  if (!cJSON_IsObject(m))
    return tw_err(TW_ERR_FORMAT, "%s: '__metadata__' is not an object", f->path);
  int n = cJSON_GetArraySize(m);
  f->meta = calloc((size_t)n + 1, sizeof *f->meta);
  if (!f->meta) return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory (metadata)", f->path);
  const cJSON *kv;
  cJSON_ArrayForEach(kv, m) {
    if (!cJSON_IsString(kv)) continue; /* the format says strings; ignore anything else */
    tw_st_meta_t *e = &f->meta[f->n_meta];
    e->key = strdup(kv->string);
    e->value = strdup(kv->valuestring);
    if (!e->key || !e->value) {
      free(e->key);
      free(e->value);
      return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory (metadata)", f->path);
    }
    f->n_meta++;
  }
  return TW_OK;
}

static TW_NODISCARD tw_status_t parse_header(tw_safetensors_t *f) {
  const char *p = f->path;
  if (f->n_bytes < 8)
    return tw_err(TW_ERR_FORMAT,
                  "%s: file is %lld bytes, shorter than the 8-byte header length", p,
                  (long long)f->n_bytes);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->bytes[i]; /* little endian */
  if (hlen > (uint64_t)TW_SAFETENSORS_MAX_HEADER_BYTES)
    return tw_err(TW_ERR_FORMAT, "%s: header length %llu is absurd (more than %lld bytes)", p,
                  (unsigned long long)hlen, (long long)TW_SAFETENSORS_MAX_HEADER_BYTES);
  if ((int64_t)hlen > f->n_bytes - 8)
    return tw_err(TW_ERR_FORMAT,
                  "%s: header length %llu goes beyond the end of the file (%lld bytes)", p,
                  (unsigned long long)hlen, (long long)f->n_bytes);
  f->data_start = 8 + (int64_t)hlen;
  const int64_t data_bytes = f->n_bytes - f->data_start;

  const char *text = (const char *)f->bytes + 8;
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, 0);
  if (!root) {
    const char *at = end ? end : cJSON_GetErrorPtr();
    return tw_err(TW_ERR_FORMAT, "%s: header is not valid JSON (error near header byte %lld)", p,
                  at ? (long long)(at - text) : -1LL);
  }
  for (const char *c = end; c && c < text + hlen; c++) { /* only padding may follow */
    if (*c != ' ' && *c != '\t' && *c != '\n' && *c != '\r' && *c != '\0') {
      cJSON_Delete(root);
      return tw_err(TW_ERR_FORMAT, "%s: header is not valid JSON (trailing bytes at %lld)", p,
                    (long long)(c - text));
    }
  }
  tw_status_t st = TW_OK;
  tw_safetensors_tensor_t **by_begin = NULL;
  if (!cJSON_IsObject(root)) {
    st = tw_err(TW_ERR_FORMAT, "%s: header is not a JSON object", p);
    goto out;
  }

  /* count entries and the bytes of their names */
  int64_t n = 0;
  size_t names_bytes = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, root) {
    if (strcmp(e->string, "__metadata__") == 0) continue;
    n++;
    names_bytes += strlen(e->string) + 1;
  }
  f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
  f->names = malloc(names_bytes + 1);
  by_begin = malloc(((size_t)n + 1) * sizeof *by_begin);
  if (!f->tensors || !f->names || !by_begin) {
    st = tw_err(TW_ERR_NO_MEMORY, "%s: out of memory for a header of %lld tensors", p,
                (long long)n);
    goto out;
  }
  char *name_at = f->names;
  cJSON_ArrayForEach(e, root) {
    if (strcmp(e->string, "__metadata__") == 0) {
      TW_CHECK_GOTO(parse_metadata(f, e), st, out);
      continue;
    }
    tw_safetensors_tensor_t *t = &f->tensors[f->n_tensors];
    size_t len = strlen(e->string);
    memcpy(name_at, e->string, len + 1);
    t->name = name_at;
    name_at += len + 1;
    TW_CHECK_GOTO(parse_entry(f, t->name, e, data_bytes, t), st, out);
    by_begin[f->n_tensors] = t;
    f->n_tensors++;
  }

  /* no two tensors may share bytes (empty tensors share nothing) */
  qsort(by_begin, (size_t)f->n_tensors, sizeof *by_begin, cmp_by_begin);
  const tw_safetensors_tensor_t *prev = NULL;
  for (int64_t i = 0; i < f->n_tensors; i++) {
    const tw_safetensors_tensor_t *t = by_begin[i];
    if (t->n_bytes == 0) continue;
    if (prev && t->begin < prev->begin + prev->n_bytes) {
      st = tw_err(TW_ERR_FORMAT,
                  "%s: tensors '%s' [%lld, %lld) and '%s' [%lld, %lld) have overlapping byte "
                  "ranges",
                  p, prev->name, (long long)prev->begin, (long long)(prev->begin + prev->n_bytes),
                  t->name, (long long)t->begin, (long long)(t->begin + t->n_bytes));
      goto out;
    }
    prev = t;
  }

  /* name order for binary search; a JSON object may repeat a key */
  qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_by_name);
  for (int64_t i = 1; i < f->n_tensors; i++) {
    if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) {
      st = tw_err(TW_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", p,
                  f->tensors[i].name);
      goto out;
    }
  }
out:
  free(by_begin);
  cJSON_Delete(root);
  return st;
}

static tw_safetensors_t *st_alloc(const char *path) {
  tw_safetensors_t *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  f->magic = TW_SAFETENSORS_MAGIC;
  f->path = strdup(path ? path : "(memory)");
  if (!f->path) {
    free(f);
    return NULL;
  }
  return f;
}

TW_NODISCARD tw_status_t tw_safetensors_parse(const void *bytes, int64_t n_bytes, const char *label,
                                              tw_safetensors_t **file_p) {
  if ((!bytes && n_bytes > 0) || n_bytes < 0 || !file_p)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "safetensors: bad arguments to parse");
  tw_safetensors_t *f = st_alloc(label);
  if (!f) return tw_err(TW_ERR_NO_MEMORY, "safetensors: out of memory");
  f->bytes = bytes;
  f->n_bytes = n_bytes;
  tw_status_t st = parse_header(f);
  if (st != TW_OK) {
    tw_safetensors_destroy(f);
    return st;
  }
  *file_p = f;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_safetensors_open(const char *path, tw_safetensors_t **file_p) {
  if (!path || !file_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "safetensors: NULL argument");
  int fd;
  do {
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO: refused below, not waited on */
  } while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return tw_err(errno == ENOENT ? TW_ERR_NOT_FOUND : TW_ERR_IO, "%s: cannot open: %s", path,
                  strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    close(fd);
    return tw_err(TW_ERR_IO, "%s: fstat failed: %s", path, strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    return tw_err(TW_ERR_IO, "%s: not a regular file", path);
  }
  tw_safetensors_t *f = st_alloc(path);
  if (!f) {
    close(fd);
    return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", path);
  }
  f->n_bytes = (int64_t)sb.st_size;
  tw_status_t st = TW_OK;
  if (f->n_bytes >= 8) {
    /* read-only private mapping: pages come from the page cache on first
     * touch, so nothing but the header is read here */
    void *m = mmap(NULL, (size_t)f->n_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      st = tw_err(TW_ERR_IO, "%s: mmap of %lld bytes failed: %s", path, (long long)f->n_bytes,
                  strerror(errno));
    } else {
      f->bytes = m;
      f->mapped = true;
    }
  } else {
    f->bytes = (const uint8_t *)"";
  }
  close(fd);
  if (st == TW_OK) st = parse_header(f);
  if (st != TW_OK) {
    tw_safetensors_destroy(f);
    return st;
  }
  *file_p = f;
  return TW_OK;
}

void tw_safetensors_destroy(tw_safetensors_t *f) {
  if (!f) return;
  if (f->magic != TW_SAFETENSORS_MAGIC) {
    TW_WARN("safetensors", "destroy: bad handle (magic %08x)", f->magic);
    return;
  }
  if (f->mapped && munmap((void *)f->bytes, (size_t)f->n_bytes) != 0)
    TW_WARN("safetensors", "%s: munmap failed: %s", f->path, strerror(errno));
  for (int64_t i = 0; i < f->n_meta; i++) {
    free(f->meta[i].key);
    free(f->meta[i].value);
  }
  free(f->meta);
  free(f->tensors);
  free(f->names);
  free(f->path);
  f->magic = 0;
  free(f);
}

const char *tw_safetensors_path(const tw_safetensors_t *f) { return f->path; }
int64_t tw_safetensors_count(const tw_safetensors_t *f) { return f->n_tensors; }
int64_t tw_safetensors_file_bytes(const tw_safetensors_t *f) { return f->n_bytes; }
int64_t tw_safetensors_data_bytes(const tw_safetensors_t *f) {
  return f->n_bytes - f->data_start;
}

const tw_safetensors_tensor_t *tw_safetensors_tensor_at(const tw_safetensors_t *f, int64_t i) {
  if (i < 0 || i >= f->n_tensors) return NULL;
  return &f->tensors[i];
}

const tw_safetensors_tensor_t *tw_safetensors_find(const tw_safetensors_t *f,
                                                   const char *name) {
  tw_safetensors_tensor_t key;
  memset(&key, 0, sizeof key);
  key.name = name;
  return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_by_name);
}

const char *tw_safetensors_metadata(const tw_safetensors_t *f, const char *key) {
  for (int64_t i = 0; i < f->n_meta; i++)
    if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
  return NULL;
}
