/* test_engine_errors.c: every argument error of engine.h returns its
 * documented status, leaves the outputs untouched, and the engine keeps
 * working afterwards (checked against the HF fixture of short_book). */
#include "common/engine/engine.h"
#include "common/engine/engine_impl.h"
#include "common/model/model.h"

#include "fixture_util.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static void check_still_works(tw_engine_t *e, const tw_fx_entry_t *fx, const int32_t *table,
                              int32_t n_blocks, const char *after) {
  int64_t V = fx->vocab;
  float *logits = malloc(sizeof(float) * fx->n_ids * V);
  int32_t next = -1;
  tw_prefill_args_t pa = {.tokens = fx->ids, .n_tokens = fx->n_ids, .block_table = table,
                          .n_blocks = n_blocks, .all_logits = true, .logits_out = logits,
                          .next_token_out = &next};
  tw_status_t st = tw_engine_prefill(e, &pa);
  double err = tw_test_rel_l2_ff(logits, fx->logits, fx->n_rows * V);
  EXPECT(st == TW_OK && err <= 1e-4 && next == fx->greedy[0],
            "after %s: status %d, rel L2 %.3g, next %d", after, st, err, next);
  free(logits);
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  if (!fixtures) fixtures = "tests/fixtures";
  char model_dir[512], fx_dir[512];
  snprintf(model_dir, sizeof(model_dir), "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
  snprintf(fx_dir, sizeof(fx_dir), "%s/tiny-gptoss-wordnet", fixtures);
  tw_model_t *m = NULL;
  if (tw_model_load(model_dir, &m) != TW_OK) {
    fprintf(stderr, "cannot load %s\n", model_dir);
    return 1;
  }
  tw_fx_entry_t fx;
  if (tw_fx_load(fx_dir, "mxfp4", "short_book", &fx) != 0) return 1;
  const int32_t V = m->config.vocab_size, max_pos = m->config.max_position_embeddings;

  /* backend names */
  tw_backend_kind_t kind = TW_BACKEND_CPU;
  EXPECT(tw_backend_parse("gpu", &kind) == TW_ERR_INVALID_ARGUMENT && kind == TW_BACKEND_CPU,
            "parse 'gpu'");
  EXPECT(tw_backend_parse("cuda", &kind) == TW_OK && kind == TW_BACKEND_CUDA, "parse cuda");
  EXPECT(strcmp(tw_backend_name(TW_BACKEND_CPU), "cpu") == 0, "name cpu");
  /* resolving and capabilities (engine.h): what the daemons check options against */
  EXPECT(tw_backend_resolve(TW_BACKEND_CPU) == TW_BACKEND_CPU, "resolve cpu");
  EXPECT(tw_backend_resolve(TW_BACKEND_CUDA) == TW_BACKEND_CUDA, "resolve cuda");
  EXPECT(tw_backend_resolve(TW_BACKEND_AUTO) ==
             (tw_cuda_available() ? TW_BACKEND_CUDA : TW_BACKEND_CPU),
         "resolve auto");
  EXPECT(tw_backend_usable(TW_BACKEND_CPU), "cpu is usable everywhere");
  EXPECT(tw_backend_usable(TW_BACKEND_CUDA) == (tw_cuda_available() != 0), "cuda usable");
  EXPECT(tw_backend_usable(TW_BACKEND_AUTO), "auto is usable everywhere");
  EXPECT(!tw_backend_caps(TW_BACKEND_CPU).on_device && tw_backend_caps(TW_BACKEND_CPU).dp_attention,
         "cpu: host memory, data-parallel attention");
  EXPECT(
      tw_backend_caps(TW_BACKEND_CUDA).on_device && !tw_backend_caps(TW_BACKEND_CUDA).dp_attention,
      "cuda: on the device, no data-parallel attention");
  EXPECT(tw_backend_caps(TW_BACKEND_AUTO).on_device == tw_backend_usable(TW_BACKEND_CUDA),
         "auto: the caps of what it resolves to");

  /* create: bad params */
  tw_engine_t *e = NULL;
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_block_size = 0;
  EXPECT(tw_engine_create(m, &p, &e) == TW_ERR_INVALID_ARGUMENT && !e, "kv_block_size 0");
  p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.max_batch = -1;
  EXPECT(tw_engine_create(m, &p, &e) == TW_ERR_INVALID_ARGUMENT && !e, "max_batch -1");
  p.max_batch = 256;
  p.tp_size = 2;
  /* TP/EP > 1 needs the worker's collective group (issue 6, params.coll) */
  EXPECT(tw_engine_create(m, &p, &e) == TW_ERR_INVALID_ARGUMENT && !e, "cpu tp_size 2 without coll");
  p.tp_size = 1;
  p.ep_rank = 1;
  EXPECT(tw_engine_create(m, &p, &e) == TW_ERR_INVALID_ARGUMENT && !e, "ep_rank 1 of 1");
  p.ep_rank = 0;
  if (!tw_cuda_available()) {
    p.backend = TW_BACKEND_CUDA;
    EXPECT(tw_engine_create(m, &p, &e) == TW_ERR_UNSUPPORTED && !e, "cuda without a GPU");
  }

  p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_num_blocks = 8;
  p.max_batch = 2;
  p.n_threads = 2;
  EXPECT(tw_engine_create(m, &p, &e) == TW_OK && e, "create");
  if (!e) return tw_test_exit("test_engine_errors");
  EXPECT(tw_engine_backend(e) == TW_BACKEND_CPU, "backend cpu");
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
  EXPECT(kv && kv->n_blocks == 8 && kv->block_size == 16 && kv->dtype == TW_DTYPE_F32 &&
                kv->n_kv_heads_local == 2 && kv->head_dim == 64 && kv->n_layers == 4 &&
                kv->block_bytes == 2 * 2 * 16 * 64 * 4 &&
                kv->layer_stride_bytes == 8 * kv->block_bytes &&
                kv->total_bytes == 4 * kv->layer_stride_bytes,
            "kv layout");
  int32_t table[8] = {7, 6, 5, 4, 3, 2, 1, 0};
  check_still_works(e, &fx, table, 8, "create");

  /* prefill errors */
  int32_t toks[3] = {8008, 305, 8010};
  int32_t next = -12345;
  float sentinel = 42.0f;
  tw_prefill_args_t pa = {.tokens = toks, .n_tokens = 3, .block_table = table, .n_blocks = 8,
                          .logits_out = &sentinel, .next_token_out = &next};
  toks[1] = V;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "token id V");
  toks[1] = -1;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "token id -1");
  EXPECT(strstr(tw_last_error(), "tokens[1]") != NULL, "message names the token: %s",
            tw_last_error());
  toks[1] = 305;
  pa.n_tokens = 0;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "n_tokens 0");
  pa.n_tokens = 3;
  pa.start_pos = 15;
  pa.n_blocks = 1; /* 16 positions, 18 needed */
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "block table too short");
  EXPECT(strstr(tw_last_error(), "too short") != NULL, "message: %s", tw_last_error());
  pa.start_pos = 0;
  pa.n_blocks = 8;
  int32_t bad_table[8] = {0, 1, 2, 3, 4, 5, 6, 8}; /* 8 is outside a pool of 8 */
  pa.block_table = bad_table;
  pa.start_pos = 7 * 16;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "block id out of the pool");
  pa.block_table = table;
  pa.start_pos = max_pos - 2;
  pa.n_blocks = 8;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_OUT_OF_RANGE, "positions beyond max_position");
  pa.start_pos = -1;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "negative start_pos");
  pa.start_pos = 0;
  pa.tokens = NULL;
  EXPECT(tw_engine_prefill(e, &pa) == TW_ERR_INVALID_ARGUMENT, "NULL tokens");
  EXPECT(tw_engine_prefill(e, NULL) == TW_ERR_INVALID_ARGUMENT, "NULL args");
  EXPECT(tw_engine_prefill(NULL, &pa) == TW_ERR_INVALID_ARGUMENT, "NULL engine");
  EXPECT(next == -12345 && sentinel == 42.0f, "outputs written on error");
  check_still_works(e, &fx, table, 8, "prefill errors");

  /* decode errors */
  int32_t dt[3] = {8008, 8008, 8008}, dp[3] = {fx.n_ids, fx.n_ids, fx.n_ids}, dnb[3] = {8, 8, 8};
  const int32_t *dtabs[3] = {table, table, table};
  int32_t dnext[3] = {-7, -7, -7};
  tw_decode_args_t da = {.n_seqs = 3, .tokens = dt, .positions = dp, .block_tables = dtabs,
                         .n_blocks = dnb, .next_tokens_out = dnext};
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "n_seqs 3 > max_batch 2");
  EXPECT(strstr(tw_last_error(), "max_batch") != NULL, "message: %s", tw_last_error());
  da.n_seqs = 0;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "n_seqs 0");
  da.n_seqs = 1;
  dt[0] = V + 5;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "decode token id");
  dt[0] = 8008;
  dp[0] = -1;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "decode position -1");
  dp[0] = max_pos;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_OUT_OF_RANGE, "decode position max_pos");
  dp[0] = 16;
  dnb[0] = 1; /* position 16 needs 2 blocks */
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "decode table too short");
  dnb[0] = 8;
  dtabs[0] = bad_table;
  dp[0] = 7 * 16 + 3;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "decode block id out of pool");
  dtabs[0] = table;
  da.positions = NULL;
  EXPECT(tw_engine_decode(e, &da) == TW_ERR_INVALID_ARGUMENT, "decode NULL positions");
  EXPECT(dnext[0] == -7, "decode output written on error");
  check_still_works(e, &fx, table, 8, "decode errors");

  /* and a valid decode step continues the greedy path */
  int32_t tok = fx.greedy[0], pos = fx.n_ids, nb = 8, out = -1;
  const int32_t *tab = table;
  tw_decode_args_t ok = {.n_seqs = 1, .tokens = &tok, .positions = &pos, .block_tables = &tab,
                         .n_blocks = &nb, .next_tokens_out = &out};
  EXPECT(tw_engine_decode(e, &ok) == TW_OK && out == fx.greedy[1], "decode after errors: %d vs %d",
            out, fx.greedy[1]);
  tw_engine_destroy(e);
  tw_engine_destroy(NULL);
  tw_fx_free(&fx);
  tw_model_destroy(m);
  return tw_test_exit("test_engine_errors");
}
