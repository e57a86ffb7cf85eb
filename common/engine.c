/* engine.c: the backend dispatcher of engine.h. It picks the backend, checks
 * every argument of prefill/decode once for all backends (so a bad request is
 * answered with its status and a message naming the field, and the engine
 * keeps working), then calls the backend through engine_impl.h. */
#include "common/engine.h"

#include "common/engine_impl.h"
#include "common/log.h"

#include <stdio.h>
#include <string.h>

tw_status_t tw_backend_parse(const char *name, tw_backend_kind_t *kind_p) {
  if (!name) return tw_err(TW_ERR_INVALID_ARGUMENT, "backend: name is NULL");
  if (strcmp(name, "auto") == 0) {
    *kind_p = TW_BACKEND_AUTO;
  } else if (strcmp(name, "cpu") == 0) {
    *kind_p = TW_BACKEND_CPU;
  } else if (strcmp(name, "cuda") == 0) {
    *kind_p = TW_BACKEND_CUDA;
  } else {
    return tw_err(TW_ERR_INVALID_ARGUMENT, "backend: unknown backend '%s' (auto, cpu or cuda)",
                  name);
  }
  return TW_OK;
}

int tw_backend_opt(const char *text, void *dst, char *err, size_t errlen) {
  if (tw_backend_parse(text, dst) == TW_OK) return 0;
  snprintf(err, errlen, "must be auto, cpu or cuda, got '%s'", text);
  return -1;
}

const char *tw_backend_name(tw_backend_kind_t kind) {
  switch (kind) {
  case TW_BACKEND_AUTO: return "auto";
  case TW_BACKEND_CPU: return "cpu";
  case TW_BACKEND_CUDA: return "cuda";
  }
  return "unknown";
}

#ifndef TWAIN_HAVE_CUDA
int tw_cuda_available(void) { return 0; }
#endif

static tw_status_t tw_engine_params_check(const tw_engine_params_t *p) {
  if (p->kv_block_size <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: kv_block_size %d <= 0", p->kv_block_size);
  if (p->kv_num_blocks < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: kv_num_blocks %d < 0", p->kv_num_blocks);
  if (p->max_batch <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: max_batch %d <= 0", p->max_batch);
  if (p->max_prefill_chunk <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: max_prefill_chunk %d <= 0",
                  p->max_prefill_chunk);
  if (p->n_threads < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: n_threads %d < 0", p->n_threads);
  if (p->tp_size < 1 || p->tp_rank < 0 || p->tp_rank >= p->tp_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: tp_rank %d of tp_size %d", p->tp_rank,
                  p->tp_size);
  if (p->ep_size < 1 || p->ep_rank < 0 || p->ep_rank >= p->ep_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: ep_rank %d of ep_size %d", p->ep_rank,
                  p->ep_size);
  return TW_OK;
}

tw_status_t tw_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                             tw_engine_t **engine_p) {
  if (!model) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: model is NULL");
  if (!engine_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: engine_p is NULL");
  tw_engine_params_t p = params ? *params : TW_ENGINE_PARAMS_DEFAULT;
  TW_CHECK(tw_engine_params_check(&p));
  tw_backend_kind_t kind = p.backend;
  if (kind == TW_BACKEND_AUTO) kind = tw_cuda_available() ? TW_BACKEND_CUDA : TW_BACKEND_CPU;
  p.backend = kind;
  switch (kind) {
  case TW_BACKEND_CPU: return tw_cpu_engine_create(model, &p, engine_p);
  case TW_BACKEND_CUDA:
#ifdef TWAIN_HAVE_CUDA
    if (!tw_cuda_available())
      return tw_err(TW_ERR_UNSUPPORTED, "engine: backend cuda requested but no usable GPU");
    return tw_cuda_engine_create(model, &p, engine_p);
#else
    return tw_err(TW_ERR_UNSUPPORTED, "engine: backend cuda requested but this build has no CUDA");
#endif
  default: break;
  }
  return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: unknown backend %d", (int)kind);
}

void tw_engine_destroy(tw_engine_t *engine) {
  if (!engine) return;
  if (engine->magic != TW_ENGINE_MAGIC) {
    TW_ERROR("engine", "destroy of a handle that is not a live engine (magic %08x)", engine->magic);
    return;
  }
  engine->ops->destroy(engine);
}

static tw_status_t tw_engine_check(const tw_engine_t *engine, const char *op) {
  if (!engine) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: engine is NULL", op);
  if (engine->magic != TW_ENGINE_MAGIC)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: not a live engine (magic %08x)", op,
                  engine->magic);
  return TW_OK;
}

const tw_kv_layout_t *tw_engine_kv_layout(const tw_engine_t *engine) {
  if (tw_engine_check(engine, "kv_layout") != TW_OK) return NULL;
  return &engine->kv;
}

tw_backend_kind_t tw_engine_backend(const tw_engine_t *engine) {
  if (tw_engine_check(engine, "backend") != TW_OK) return TW_BACKEND_AUTO;
  return engine->params.backend;
}

/* A sequence's KV span [0, end): the table must cover it with ids of the pool. */
static tw_status_t tw_engine_check_blocks(const tw_engine_t *e, const char *op, int32_t seq,
                                          const int32_t *table, int32_t n_blocks, int64_t end) {
  int64_t bs = e->kv.block_size;
  int64_t need = (end + bs - 1) / bs;
  if (n_blocks < 0 || (n_blocks > 0 && !table))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: sequence %d: block table NULL or n_blocks %d",
                  op, seq, n_blocks);
  if (n_blocks < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine %s: sequence %d: block table too short: %d blocks of %lld tokens cover "
                  "%lld positions, %lld needed",
                  op, seq, n_blocks, (long long)bs, (long long)n_blocks * bs, (long long)end);
  for (int64_t b = 0; b < need; b++)
    if (table[b] < 0 || table[b] >= e->kv.n_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "engine %s: sequence %d: block_table[%lld] = %d outside the pool [0, %d)", op,
                    seq, (long long)b, table[b], e->kv.n_blocks);
  return TW_OK;
}

static tw_status_t tw_engine_check_token(const tw_engine_t *e, const char *op, const char *what,
                                         int64_t i, int32_t token) {
  int32_t vocab = e->model->config.vocab_size;
  if (token < 0 || token >= vocab)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: %s[%lld] = %d outside the vocabulary [0, %d)",
                  op, what, (long long)i, token, vocab);
  return TW_OK;
}

static tw_status_t tw_engine_check_sample(const char *op, int64_t i, const tw_sample_params_t *s) {
  if (s && s->temperature != s->temperature)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: sample[%lld].temperature is NaN", op,
                  (long long)i);
  return TW_OK;
}

tw_status_t tw_engine_prefill(tw_engine_t *engine, const tw_prefill_args_t *args) {
  TW_CHECK(tw_engine_check(engine, "prefill"));
  if (!args) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill: args is NULL");
  if (args->n_tokens <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill: n_tokens %d <= 0", args->n_tokens);
  if (!args->tokens) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill: tokens is NULL");
  if (args->start_pos < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill: start_pos %d < 0", args->start_pos);
  int64_t end = (int64_t)args->start_pos + args->n_tokens;
  int32_t max_pos = engine->model->config.max_position_embeddings;
  if (end > max_pos)
    return tw_err(TW_ERR_OUT_OF_RANGE,
                  "engine prefill: positions %d..%lld beyond max_position_embeddings %d",
                  args->start_pos, (long long)end - 1, max_pos);
  for (int32_t i = 0; i < args->n_tokens; i++)
    TW_CHECK(tw_engine_check_token(engine, "prefill", "tokens", i, args->tokens[i]));
  TW_CHECK(tw_engine_check_blocks(engine, "prefill", 0, args->block_table, args->n_blocks, end));
  TW_CHECK(tw_engine_check_sample("prefill", 0, args->sample));
  return engine->ops->prefill(engine, args);
}

tw_status_t tw_engine_decode(tw_engine_t *engine, const tw_decode_args_t *args) {
  TW_CHECK(tw_engine_check(engine, "decode"));
  if (!args) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine decode: args is NULL");
  if (args->n_seqs <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine decode: n_seqs %d <= 0", args->n_seqs);
  if (args->n_seqs > engine->params.max_batch)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine decode: n_seqs %d > max_batch %d", args->n_seqs,
                  engine->params.max_batch);
  if (!args->tokens || !args->positions || !args->block_tables || !args->n_blocks)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine decode: tokens, positions, block_tables and n_blocks are required");
  int32_t max_pos = engine->model->config.max_position_embeddings;
  for (int32_t i = 0; i < args->n_seqs; i++) {
    TW_CHECK(tw_engine_check_token(engine, "decode", "tokens", i, args->tokens[i]));
    int32_t pos = args->positions[i];
    if (pos < 0)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "engine decode: positions[%d] = %d < 0", i, pos);
    if (pos >= max_pos)
      return tw_err(TW_ERR_OUT_OF_RANGE,
                    "engine decode: positions[%d] = %d beyond max_position_embeddings %d", i, pos,
                    max_pos);
    TW_CHECK(tw_engine_check_blocks(engine, "decode", i, args->block_tables[i], args->n_blocks[i],
                                    (int64_t)pos + 1));
    if (args->sample) TW_CHECK(tw_engine_check_sample("decode", i, &args->sample[i]));
  }
  return engine->ops->decode(engine, args);
}
