/* offline.c: the offline mode of twain-prefill (offline.h): one prompt from
 * a JSON file of token ids, its logits dumped for every position, and a
 * greedy continuation through KV-cache decode steps (never by recomputing
 * the sequence). */
#include "offline.h"

#include "common/base/log.h"
#include "common/kv/kv_blocks.h"
#include "common/model/model.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

TW_NODISCARD tw_status_t tw_offline_read_tokens(const char *path, int32_t **ids_p, int32_t *n_p) {
  FILE *f = fopen(path, "rb");
  if (!f) return tw_err(TW_ERR_IO, "prompt tokens: cannot open %s: %s", path, strerror(errno));
  tw_status_t st = TW_OK;
  char *text = NULL;
  cJSON *json = NULL;
  int32_t *ids = NULL;
  if (fseek(f, 0, SEEK_END) != 0) {
    st = tw_err(TW_ERR_IO, "prompt tokens: cannot seek %s: %s", path, strerror(errno));
    goto out;
  }
  long len = ftell(f);
  rewind(f);
  text = len >= 0 ? malloc((size_t)len + 1) : NULL;
  if (!text) {
    st = tw_err(TW_ERR_NO_MEMORY, "prompt tokens: cannot hold %s (%ld bytes)", path, len);
    goto out;
  }
  if (fread(text, 1, (size_t)len, f) != (size_t)len) {
    st = tw_err(TW_ERR_IO, "prompt tokens: short read of %s", path);
    goto out;
  }
  text[len] = 0;
  json = cJSON_Parse(text);
  if (!cJSON_IsArray(json)) {
    st = tw_err(TW_ERR_FORMAT, "prompt tokens: %s is not a JSON array of token ids", path);
    goto out;
  }
  int n = cJSON_GetArraySize(json);
  if (n <= 0) {
    st = tw_err(TW_ERR_FORMAT, "prompt tokens: %s is an empty array", path);
    goto out;
  }
  ids = malloc(sizeof(int32_t) * (size_t)n);
  if (!ids) {
    st = tw_err(TW_ERR_NO_MEMORY, "prompt tokens: out of memory for %d ids", n);
    goto out;
  }
  for (int i = 0; i < n; i++) {
    const cJSON *it = cJSON_GetArrayItem(json, i);
    double v = cJSON_IsNumber(it) ? it->valuedouble : NAN;
    if (!(v >= 0 && v <= INT32_MAX && v == floor(v))) {
      st = tw_err(TW_ERR_FORMAT, "prompt tokens: %s: element %d is not a non-negative integer",
                  path, i);
      goto out;
    }
    ids[i] = (int32_t)v;
  }
  *ids_p = ids;
  *n_p = n;
  ids = NULL;
out:
  free(ids);
  cJSON_Delete(json);
  free(text);
  fclose(f);
  return st;
}

/* float32 little-endian, whatever the host order. */
static TW_NODISCARD tw_status_t tw_offline_write_logits(const char *path, const float *logits,
                                                        int64_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return tw_err(TW_ERR_IO, "dump logits: cannot create %s: %s", path, strerror(errno));
  unsigned char buf[4096];
  int64_t i = 0;
  while (i < n) {
    size_t k = 0;
    for (; k + 4 <= sizeof(buf) && i < n; i++, k += 4) {
      uint32_t u;
      memcpy(&u, &logits[i], 4);
      buf[k] = (unsigned char)u;
      buf[k + 1] = (unsigned char)(u >> 8);
      buf[k + 2] = (unsigned char)(u >> 16);
      buf[k + 3] = (unsigned char)(u >> 24);
    }
    if (fwrite(buf, 1, k, f) != k) {
      fclose(f);
      return tw_err(TW_ERR_IO, "dump logits: write to %s failed: %s", path, strerror(errno));
    }
  }
  if (fclose(f) != 0)
    return tw_err(TW_ERR_IO, "dump logits: closing %s failed: %s", path, strerror(errno));
  return TW_OK;
}

static int tw_offline_is_stop(const tw_offline_opts_t *o, int32_t tok) {
  for (int32_t i = 0; i < o->n_stop_ids; i++)
    if (o->stop_ids[i] == tok) return 1;
  return 0;
}

TW_NODISCARD tw_status_t tw_offline_run(const tw_offline_opts_t *o, FILE *out) {
  if (o->generate < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "offline: --generate %d < 0", o->generate);
  int32_t *ids = NULL, n_ids = 0, *table = NULL, *gen = NULL;
  float *logits = NULL;
  tw_model_t *model = NULL;
  tw_engine_t *engine = NULL;
  tw_kv_blocks_t *blocks = NULL;
  tw_status_t st;
  TW_CHECK(tw_offline_read_tokens(o->prompt_tokens_path, &ids, &n_ids));
  TW_CHECK_GOTO(tw_model_load(o->model_dir, &model), st, out);
  TW_CHECK_GOTO(tw_model_check_finite(model), st, out);
  const tw_model_config_t *c = &model->config;
  int64_t total = (int64_t)n_ids + o->generate;
  if (total > c->max_position_embeddings) {
    st = tw_err(TW_ERR_OUT_OF_RANGE,
                "offline: %d prompt + %d generated tokens exceed max_position_embeddings %d",
                n_ids, o->generate, c->max_position_embeddings);
    goto out;
  }
  int64_t n_blocks = (total + o->block_size - 1) / o->block_size;
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = o->backend;
  p.kv_block_size = o->block_size;
  p.kv_num_blocks = (int32_t)n_blocks;
  p.n_threads = o->n_threads;
  TW_CHECK_GOTO(tw_engine_create(model, &p, &engine), st, out);
  TW_CHECK_GOTO(tw_kv_blocks_create((int32_t)n_blocks, o->block_size, &blocks), st, out);
  table = malloc(sizeof(int32_t) * (size_t)n_blocks);
  gen = malloc(sizeof(int32_t) * (size_t)(o->generate > 0 ? o->generate : 1));
  int64_t rows = o->maybe_dump_logits_path ? n_ids : 0;
  logits = rows ? malloc(sizeof(float) * (size_t)rows * (size_t)c->vocab_size) : NULL;
  if (!table || !gen || (rows && !logits)) {
    st = tw_err(TW_ERR_NO_MEMORY, "offline: out of memory for %d prompt tokens", n_ids);
    goto out;
  }
  TW_CHECK_GOTO(tw_kv_blocks_alloc(blocks, (int32_t)n_blocks, table), st, out);

  int32_t next = -1;
  tw_prefill_args_t pa = {.tokens = ids, .n_tokens = n_ids, .start_pos = 0, .block_table = table,
                          .n_blocks = (int32_t)n_blocks, .all_logits = rows > 0,
                          .logits_out = logits, .next_token_out = o->generate > 0 ? &next : NULL};
  TW_INFO("offline", "prefill of %d tokens on %s", n_ids, tw_backend_name(tw_engine_backend(engine)));
  TW_CHECK_GOTO(tw_engine_prefill(engine, &pa), st, out);
  if (o->maybe_dump_logits_path) {
    TW_CHECK_GOTO(tw_offline_write_logits(o->maybe_dump_logits_path, logits, rows * c->vocab_size),
                  st, out);
    TW_INFO("offline", "wrote logits [%d, %d] to %s", n_ids, c->vocab_size,
            o->maybe_dump_logits_path);
  }
  int32_t n_gen = 0;
  if (o->generate > 0) {
    gen[n_gen++] = next;
    while (n_gen < o->generate && !tw_offline_is_stop(o, gen[n_gen - 1])) {
      int32_t tok = gen[n_gen - 1], pos = n_ids + n_gen - 1, nb = (int32_t)n_blocks, nt = -1;
      const int32_t *tab = table;
      tw_decode_args_t da = {.n_seqs = 1, .tokens = &tok, .positions = &pos,
                             .block_tables = &tab, .n_blocks = &nb, .next_tokens_out = &nt};
      TW_CHECK_GOTO(tw_engine_decode(engine, &da), st, out);
      gen[n_gen++] = nt;
    }
    fputc('[', out);
    for (int32_t i = 0; i < n_gen; i++) fprintf(out, i ? ", %d" : "%d", gen[i]);
    fputs("]\n", out);
    fflush(out);
  }
  st = TW_OK;
out:
  free(logits);
  free(gen);
  free(table);
  tw_kv_blocks_destroy(blocks);
  tw_engine_destroy(engine);
  tw_model_destroy(model);
  free(ids);
  return st;
}
