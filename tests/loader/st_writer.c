/* st_writer.c: see st_writer.h. Independent of the loader: it writes the
 * header with cJSON and reads files back with plain stdio, so a test never
 * checks the loader against itself. */
#include "st_writer.h"

#include <cjson/cJSON.h>

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int write_all(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }

int stw_write_raw(const char *path, uint64_t len_field, const char *header, const void *data,
                  int64_t n_data) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  uint8_t len[8];
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)(len_field >> (8 * i));
  int rc = write_all(f, len, 8);
  if (!rc && header) rc = write_all(f, header, strlen(header));
  if (!rc && n_data > 0) {
    if (data) {
      rc = write_all(f, data, (size_t)n_data);
    } else {
      static const uint8_t zeros[4096];
      for (int64_t left = n_data; !rc && left > 0; left -= (int64_t)sizeof zeros)
        rc = write_all(f, zeros, (size_t)(left < (int64_t)sizeof zeros ? left : (int64_t)sizeof zeros));
    }
  }
  if (fclose(f) != 0) rc = -1;
  return rc;
}

int stw_write(const char *path, const stw_tensor_t *t, int n) {
  cJSON *root = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
  cJSON_AddStringToObject(meta, "format", "pt");
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    cJSON *e = cJSON_AddObjectToObject(root, t[i].name);
    cJSON_AddStringToObject(e, "dtype", t[i].dtype);
    cJSON *shape = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < t[i].ndim; d++)
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t[i].shape[d]));
    cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + t[i].n_bytes)));
    off += t[i].n_bytes;
  }
  char *text = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  size_t len = strlen(text), padded = (len + 7) / 8 * 8;
  char *hdr = malloc(padded + 1);
  memcpy(hdr, text, len);
  memset(hdr + len, ' ', padded - len);
  hdr[padded] = '\0';
  free(text);
  FILE *f = fopen(path, "wb");
  int rc = f ? 0 : -1;
  if (!rc) {
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    rc = write_all(f, lenb, 8);
    if (!rc) rc = write_all(f, hdr, padded);
    for (int i = 0; !rc && i < n; i++) {
      if (t[i].data) {
        rc = write_all(f, t[i].data, (size_t)t[i].n_bytes);
      } else {
        for (int64_t k = 0; !rc && k < t[i].n_bytes; k++) rc = fputc(0, f) == EOF ? -1 : 0;
      }
    }
    if (fclose(f) != 0) rc = -1;
  }
  free(hdr);
  return rc;
}

char *stw_slurp(const char *path, int64_t *n_p) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) {
    buf[n] = '\0';
    if (n_p) *n_p = n;
  }
  return buf;
}

int stw_read(const char *path, stw_tensor_t *out, int cap, void **mapping_p) {
  int64_t n = 0;
  char *buf = stw_slurp(path, &n);
  if (!buf || n < 8) {
    free(buf);
    return -1;
  }
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | (uint8_t)buf[i];
  cJSON *root = cJSON_ParseWithLength(buf + 8, (size_t)hlen);
  if (!root) {
    free(buf);
    return -1;
  }
  int k = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, root) {
    if (strcmp(e->string, "__metadata__") == 0 || k >= cap) continue;
    stw_tensor_t *t = &out[k++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", e->string);
    snprintf(t->dtype, sizeof t->dtype, "%s",
             cJSON_GetObjectItem(e, "dtype")->valuestring);
    const cJSON *d;
    cJSON_ArrayForEach(d, cJSON_GetObjectItem(e, "shape")) t->shape[t->ndim++] = (int64_t)d->valuedouble;
    const cJSON *o = cJSON_GetObjectItem(e, "data_offsets");
    int64_t b = (int64_t)o->child->valuedouble, en = (int64_t)o->child->next->valuedouble;
    t->data = buf + 8 + hlen + b;
    t->n_bytes = en - b;
  }
  cJSON_Delete(root);
  *mapping_p = buf;
  return k;
}

char *stw_tmpdir(const char *tag) {
  const char *base = getenv("TMPDIR");
  char tmpl[4096];
  snprintf(tmpl, sizeof tmpl, "%s/twain-%s-XXXXXX", base && *base ? base : "/tmp", tag);
  if (!mkdtemp(tmpl)) return NULL;
  return strdup(tmpl);
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

void stw_rmtree(const char *dir) {
  if (dir) nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

int stw_copy(const char *src, const char *dst) {
  int64_t n = 0;
  char *buf = stw_slurp(src, &n);
  if (!buf) return -1;
  FILE *f = fopen(dst, "wb");
  int rc = f ? write_all(f, buf, (size_t)n) : -1;
  if (f && fclose(f) != 0) rc = -1;
  free(buf);
  return rc;
}

int stw_write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  int rc = f ? write_all(f, text, strlen(text)) : -1;
  if (f && fclose(f) != 0) rc = -1;
  return rc;
}
