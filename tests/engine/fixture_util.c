/* fixture_util.c: see fixture_util.h. */
#include "fixture_util.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const tw_fx_prompts[4] = {"short_dog", "short_book", "system_water", "multiturn"};

char *tw_fx_read_file(const char *path, long *len_p) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path);
    return NULL;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "cannot read %s\n", path);
    free(buf);
    fclose(f);
    return NULL;
  }
  fclose(f);
  buf[n] = 0;
  if (len_p) *len_p = n;
  return buf;
}

static int32_t *int_array(const cJSON *a, int32_t *n_p) {
  int n = cJSON_GetArraySize(a);
  int32_t *out = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
  for (int i = 0; i < n; i++) out[i] = (int32_t)cJSON_GetArrayItem(a, i)->valuedouble;
  *n_p = n;
  return out;
}

int tw_fx_load(const char *dir, const char *variant, const char *prompt, tw_fx_entry_t *e) {
  memset(e, 0, sizeof(*e));
  snprintf(e->prompt, sizeof(e->prompt), "%s", prompt);
  char path[1024];
  snprintf(path, sizeof(path), "%s/prompts.json", dir);
  char *ptext = tw_fx_read_file(path, NULL);
  snprintf(path, sizeof(path), "%s/manifest.json", dir);
  char *mtext = tw_fx_read_file(path, NULL);
  cJSON *pj = ptext ? cJSON_Parse(ptext) : NULL, *mj = mtext ? cJSON_Parse(mtext) : NULL;
  int rc = -1;
  if (!pj || !mj) {
    fprintf(stderr, "cannot parse prompts.json/manifest.json in %s\n", dir);
    goto out;
  }
  const cJSON *p = cJSON_GetObjectItemCaseSensitive(pj, prompt);
  if (!p) {
    fprintf(stderr, "prompt %s not in prompts.json\n", prompt);
    goto out;
  }
  e->ids = int_array(cJSON_GetObjectItemCaseSensitive(p, "ids"), &e->n_ids);
  const cJSON *entry = NULL, *it;
  cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(mj, "entries")) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(it, "variant");
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(it, "prompt");
    if (cJSON_IsString(v) && cJSON_IsString(pr) && strcmp(v->valuestring, variant) == 0 &&
        strcmp(pr->valuestring, prompt) == 0)
      entry = it;
  }
  if (!entry) {
    fprintf(stderr, "no manifest entry %s/%s\n", variant, prompt);
    goto out;
  }
  int32_t n;
  int32_t *shape = int_array(cJSON_GetObjectItemCaseSensitive(entry, "shape"), &n);
  int32_t *pos = int_array(cJSON_GetObjectItemCaseSensitive(entry, "positions"), &n);
  e->n_rows = shape[0];
  e->vocab = shape[1];
  e->pos_begin = pos[0];
  free(shape);
  free(pos);
  e->argmax = int_array(cJSON_GetObjectItemCaseSensitive(entry, "argmax_all_positions"), &n);
  if (n != e->n_ids) {
    fprintf(stderr, "%s/%s: %d argmax values for %d ids\n", variant, prompt, n, e->n_ids);
    goto out;
  }
  e->greedy = int_array(cJSON_GetObjectItemCaseSensitive(entry, "greedy_continuation_ids"),
                        &e->n_greedy);
  snprintf(path, sizeof(path), "%s/%s", dir,
           cJSON_GetObjectItemCaseSensitive(entry, "logits_file")->valuestring);
  long len = 0;
  e->logits = (float *)tw_fx_read_file(path, &len);
  if (!e->logits || len != (long)e->n_rows * e->vocab * 4) {
    fprintf(stderr, "%s: %ld bytes, expected %d x %d floats\n", path, len, e->n_rows, e->vocab);
    goto out;
  }
  rc = 0;
out:
  cJSON_Delete(pj);
  cJSON_Delete(mj);
  free(ptext);
  free(mtext);
  if (rc != 0) tw_fx_free(e);
  return rc;
}

void tw_fx_free(tw_fx_entry_t *e) {
  free(e->ids);
  free(e->logits);
  free(e->argmax);
  free(e->greedy);
  memset(e, 0, sizeof(*e));
}
