/* test_st_fuzz.c: the safetensors parser on randomly corrupted copies of the
 * tiny checkpoint's header (fixed seed, bounded loop). It must never crash or
 * hand out a view outside the buffer: every result is either TW_OK with all
 * tensors inside the data section, or TW_ERR_FORMAT with a message. Byte-level
 * mutations (bit flips, JSON punctuation, digits, the length field, a short
 * file) and structural ones (an entry's keys deleted or retyped) are mixed. */
#include "check.h"
#include "st_writer.h"

#include "common/base/log.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

#include <cjson/cJSON.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_ITERS 3000

static uint64_t rng_g = 0x7477616e66757a7aull; /* fixed seed */
static uint64_t rnd(void) {
  rng_g ^= rng_g << 13;
  rng_g ^= rng_g >> 7;
  rng_g ^= rng_g << 17;
  return rng_g;
}
static int64_t rnd_below(int64_t n) { return n > 0 ? (int64_t)(rnd() % (uint64_t)n) : 0; }

static int n_ok_g, n_err_g;

static void check_parse(const uint8_t *buf, int64_t n) {
  tw_safetensors_t *f = NULL;
  tw_clear_error();
  tw_status_t st = tw_safetensors_parse(buf, n, "fuzz.safetensors", &f);
  if (st == TW_OK) {
    n_ok_g++;
    for (int64_t i = 0; i < tw_safetensors_count(f); i++) {
      const tw_safetensors_tensor_t *t = tw_safetensors_tensor_at(f, i);
      const uint8_t *d = t->data;
      if (d < buf + 8 || d + t->n_bytes > buf + n || t->n_bytes < 0 ||
          t->n_bytes != t->n_elems * (int64_t)tw_dtype_size(t->dtype) ||
          tw_safetensors_find(f, t->name) != t) {
        fprintf(stderr, "FAILED: tensor '%s' escapes the buffer or is inconsistent\n", t->name);
        fails++;
      }
    }
    tw_safetensors_destroy(f);
  } else {
    n_err_g++;
    if (st != TW_ERR_FORMAT || f != NULL || tw_last_error()[0] == '\0') {
      fprintf(stderr, "FAILED: status %s, message \"%s\"\n", tw_status_str(st), tw_last_error());
      fails++;
    }
  }
}

static void replace(cJSON *obj, const char *key, cJSON *v) {
  if (!cJSON_ReplaceItemInObject(obj, key, v)) cJSON_Delete(v); /* e.g. __metadata__ */
}

/* Structural mutation of one entry; returns a new malloc'd file image. */
static uint8_t *mutate_structure(const char *header, const uint8_t *data, int64_t n_data,
                                 int64_t *n_p) {
  cJSON *root = cJSON_Parse(header);
  int n = cJSON_GetArraySize(root);
  cJSON *e = cJSON_GetArrayItem(root, (int)rnd_below(n));
  static const char *const keys[] = {"dtype", "shape", "data_offsets"};
  static const char *const dtypes[] = {"F32", "BF16", "U8", "I64", "BOOL", "F8_E4M3", "FP4", ""};
  const char *k = keys[rnd_below(3)];
  switch (rnd_below(6)) {
    case 0: cJSON_DeleteItemFromObject(e, k); break;
    case 1: replace(e, k, cJSON_CreateString(dtypes[rnd_below(8)])); break;
    case 2: replace(e, k, cJSON_CreateNumber((double)rnd_below(1000) - 10)); break;
    case 3: { /* one dim or offset replaced by an odd number */
      cJSON *arr = cJSON_GetObjectItem(e, k);
      static const double odd[] = {-1, 0, 1, 3.5, 1e300, 9007199254740993.0, 4294967296.0,
                                   16624224, 16624225};
      if (cJSON_IsArray(arr) && cJSON_GetArraySize(arr) > 0)
        cJSON_ReplaceItemInArray(arr, (int)rnd_below(cJSON_GetArraySize(arr)),
                                 cJSON_CreateNumber(odd[rnd_below(9)]));
      break;
    }
    case 4: { /* an extra dimension or offset */
      cJSON *arr = cJSON_GetObjectItem(e, k);
      if (cJSON_IsArray(arr)) cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)rnd_below(4)));
      break;
    }
    default: /* the entry replaced by a non-object */
      replace(root, e->string, cJSON_CreateArray());
      break;
  }
  char *text = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  int64_t hl = (int64_t)strlen(text);
  uint8_t *out = malloc((size_t)(8 + hl + n_data));
  for (int i = 0; i < 8; i++) out[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  memcpy(out + 8, text, (size_t)hl);
  memcpy(out + 8 + hl, data, (size_t)n_data);
  free(text);
  *n_p = 8 + hl + n_data;
  return out;
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  char path[4096];
  snprintf(path, sizeof path, "%s/tiny-gptoss-wordnet-mxfp4/model.safetensors",
           fixtures ? fixtures : "tests/fixtures");
  int64_t n = 0;
  uint8_t *orig = (uint8_t *)stw_slurp(path, &n);
  EXPECT_TRUE(orig != NULL);
  if (!orig) return CHECK_DONE("test_st_fuzz");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | orig[i];
  const int64_t head = 8 + (int64_t)hlen;
  char *header = malloc(hlen + 1);
  memcpy(header, orig + 8, hlen);
  header[hlen] = '\0';
  uint8_t *work = malloc((size_t)n);
  memcpy(work, orig, (size_t)n);
  tw_log_level_g = -1; /* thousands of expected errors: keep the log quiet */

  check_parse(orig, n); /* the pristine file parses */
  EXPECT_EQ_I64(n_ok_g, 1);
  static const char punct[] = "{}[]\",:-+.0123456789eE \\u";
  for (int it = 0; it < N_ITERS; it++) {
    memcpy(work, orig, (size_t)head);
    int64_t len = n;
    int kind = (int)rnd_below(6);
    int n_mut = 1 + (int)rnd_below(4);
    for (int k = 0; k < n_mut; k++) {
      int64_t at = 8 + rnd_below((int64_t)hlen);
      switch (kind) {
        case 0: work[at] ^= (uint8_t)(1u << rnd_below(8)); break;
        case 1: work[at] = (uint8_t)punct[rnd_below((int64_t)sizeof punct - 1)]; break;
        case 2: /* a digit changed: offsets and dims move */
          for (int64_t j = at; j < head; j++) {
            if (work[j] >= '0' && work[j] <= '9') {
              work[j] = (uint8_t)('0' + rnd_below(10));
              break;
            }
          }
          break;
        case 3: { /* the length field */
          uint64_t v = rnd_below(2) ? hlen + (uint64_t)rnd_below(64) - 32 : rnd();
          for (int i = 0; i < 8; i++) work[i] = (uint8_t)(v >> (8 * i));
          break;
        }
        case 4: len = rnd_below(n); break; /* a short file */
        default: break;
      }
    }
    if (kind == 5) {
      int64_t m = 0;
      uint8_t *img = mutate_structure(header, orig + head, n - head, &m);
      check_parse(img, m);
      free(img);
    } else {
      check_parse(work, len);
    }
  }
  /* config.json text: byte mutations of the tiny config never crash and give
   * TW_OK or an error with a message */
  char cpath[4096];
  snprintf(cpath, sizeof cpath, "%s/tiny-gptoss-wordnet-mxfp4/config.json",
           fixtures ? fixtures : "tests/fixtures");
  int64_t cn = 0;
  char *ctext = stw_slurp(cpath, &cn);
  EXPECT_TRUE(ctext != NULL);
  char *cwork = ctext ? malloc((size_t)cn + 1) : NULL;
  int c_ok = 0, c_err = 0;
  for (int it = 0; cwork && it < 1000; it++) {
    memcpy(cwork, ctext, (size_t)cn + 1);
    int n_mut = 1 + (int)rnd_below(3);
    for (int k = 0; k < n_mut; k++) {
      int64_t at = rnd_below(cn);
      cwork[at] = rnd_below(2) ? punct[rnd_below((int64_t)sizeof punct - 1)]
                               : (char)('a' + rnd_below(26));
    }
    tw_model_config_t c;
    tw_clear_error();
    tw_status_t st = tw_config_parse(cwork, &c);
    if (st == TW_OK) {
      c_ok++;
      EXPECT_TRUE(c.n_layers > 0 && c.n_layers <= TW_MAX_LAYERS && c.hidden > 0 && c.n_kv_heads > 0 &&
             c.n_heads % c.n_kv_heads == 0);
    } else {
      c_err++;
      EXPECT_TRUE(tw_last_error()[0] != '\0');
    }
  }
  fprintf(stderr, "config fuzz: 1000 iterations, %d parsed, %d rejected\n", c_ok, c_err);
  free(cwork);
  free(ctext);
  tw_log_level_g = TW_LOG_INFO;
  fprintf(stderr, "fuzz: %d iterations, %d parsed, %d rejected\n", N_ITERS + 1, n_ok_g, n_err_g);
  EXPECT_TRUE(n_err_g > N_ITERS / 2); /* the corruptions are mostly caught */
  free(work);
  free(header);
  free(orig);
  return CHECK_DONE("test_st_fuzz");
}
