/* engine.c: the backend dispatcher of engine.h. It picks the backend, checks
 * every argument of prefill/decode once for all backends (so a bad request is
 * answered with its status and a message naming the field, and the engine
 * keeps working), then calls the backend through engine_impl.h. */
#include "common/engine/engine.h"

#include "common/base/log.h"
#include "common/engine/engine_impl.h"
#include "common/kv/kv_fp8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TW_NODISCARD tw_status_t tw_backend_parse(const char *name, tw_backend_kind_t *kind_p) {
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

tw_backend_kind_t tw_backend_resolve(tw_backend_kind_t kind) {
  if (kind == TW_BACKEND_AUTO) return tw_cuda_available() ? TW_BACKEND_CUDA : TW_BACKEND_CPU;
  return kind;
}

bool tw_backend_usable(tw_backend_kind_t kind) {
  switch (tw_backend_resolve(kind)) {
    case TW_BACKEND_CPU: return true;
    case TW_BACKEND_CUDA: return tw_cuda_available() != 0;
    default: return false;
  }
}

tw_backend_caps_t tw_backend_caps(tw_backend_kind_t kind) {
  if (tw_backend_resolve(kind) == TW_BACKEND_CUDA)
    return (tw_backend_caps_t){.on_device = true, .dp_attention = false};
  return (tw_backend_caps_t){.on_device = false, .dp_attention = true};
}

static TW_NODISCARD tw_status_t tw_engine_params_check(const tw_engine_params_t *p) {
  if (p->kv_block_size <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: kv_block_size %d <= 0", p->kv_block_size);
  if (p->kv_num_blocks < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: kv_num_blocks %d < 0", p->kv_num_blocks);
  /* with a memory plan, 0 = planned */
  int32_t lo = p->mem_role ? 0 : 1;
  if (p->max_batch < lo)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: max_batch %d < %d", p->max_batch, lo);
  if (p->max_prefill_chunk < lo)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: max_prefill_chunk %d < %d",
                  p->max_prefill_chunk, lo);
  if (p->mem_role < 0 || p->mem_role > 2 || p->mem_prefill_workers < 0 ||
      p->mem_decode_workers < 0 || p->mem_utilization < 0 || p->mem_utilization > 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine: memory plan role %d, %d prefill + %d decode workers, utilization %.3f",
                  p->mem_role, p->mem_prefill_workers, p->mem_decode_workers, p->mem_utilization);
  if (p->n_threads < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: n_threads %d < 0", p->n_threads);
  if (p->kv_dtype != TW_KV_DTYPE_AUTO && p->kv_dtype != TW_KV_DTYPE_FP8)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: kv_dtype %d (0 the backend's, 1 fp8)",
                  p->kv_dtype);
  if (p->tp_size < 1 || p->tp_rank < 0 || p->tp_rank >= p->tp_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: tp_rank %d of tp_size %d", p->tp_rank,
                  p->tp_size);
  if (p->ep_size < 1 || p->ep_rank < 0 || p->ep_rank >= p->ep_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: ep_rank %d of ep_size %d", p->ep_rank,
                  p->ep_size);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                          tw_engine_t **engine_p) {
  if (!model) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: model is NULL");
  if (!engine_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine: engine_p is NULL");
  tw_engine_params_t p = params ? *params : TW_ENGINE_PARAMS_DEFAULT;
  TW_CHECK(tw_engine_params_check(&p));
  tw_backend_kind_t kind = tw_backend_resolve(p.backend);
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

static TW_NODISCARD tw_status_t tw_engine_check(const tw_engine_t *engine, const char *op) {
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

const tw_engine_params_t *tw_engine_params(const tw_engine_t *engine) {
  if (tw_engine_check(engine, "params") != TW_OK) return NULL;
  return &engine->params;
}

int tw_engine_weights_origin(const tw_engine_t *engine) {
  if (tw_engine_check(engine, "weights_origin") != TW_OK) return 0;
  return engine->weights_origin;
}

void tw_engine_plan_input(const tw_model_t *model, const tw_engine_params_t *p,
                          tw_mem_plan_in_t *in) {
  memset(in, 0, sizeof *in);
  in->cfg = &model->config;
  in->utilization = p->mem_utilization;
  in->block_size = p->kv_block_size;
  in->role = (tw_mem_role_t)p->mem_role;
  in->n_prefill = p->mem_prefill_workers;
  in->n_decode = p->mem_decode_workers;
  if (in->n_prefill + in->n_decode == 0) { /* this worker alone */
    in->n_prefill = p->mem_role == TW_MEM_ROLE_PREFILL;
    in->n_decode = p->mem_role == TW_MEM_ROLE_DECODE;
  }
  in->kv_blocks = p->kv_num_blocks;
  in->max_batch = p->mem_role == TW_MEM_ROLE_DECODE ? p->max_batch : 0;
  in->prefill_tokens = p->mem_role == TW_MEM_ROLE_PREFILL ? p->max_prefill_chunk : 0;
  in->window_ring = p->kv_window_ring > 0; /* a backend with the ring on by default sets it */
  in->kv_fp8 = p->kv_dtype == TW_KV_DTYPE_FP8;
  in->prefill_bf16 = p->prefill_bf16_experts; /* the bytes: the backend's (cuda) */
}

void tw_engine_plan_apply(const tw_mem_plan_t *plan, tw_engine_params_t *p) {
  tw_mem_plan_log(plan, "engine");
  p->kv_num_blocks = plan->kv_blocks; /* the plan keeps an override */
  if (!p->kv_ring_blocks) p->kv_ring_blocks = plan->kv_ring_blocks;
  if (!p->max_batch) p->max_batch = plan->max_batch;
  if (!p->max_prefill_chunk) p->max_prefill_chunk = plan->prefill_tokens;
}

tw_backend_kind_t tw_engine_backend(const tw_engine_t *engine) {
  if (tw_engine_check(engine, "backend") != TW_OK) return TW_BACKEND_AUTO;
  return engine->params.backend;
}

/* A sequence's KV span [0, end): the table must cover it with ids of the pool. */
static TW_NODISCARD tw_status_t tw_engine_check_blocks(const tw_engine_t *e, const char *op,
                                                       int32_t seq, const int32_t *table,
                                                       int32_t n_blocks, int64_t end) {
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
  /* the window ring of the sliding layers lives in its first R entries (engine.h) */
  for (int64_t b = 0; e->kv.ring_blocks > 0 && b < need && b < e->kv.ring_blocks; b++)
    if (table[b] >= e->kv.n_ring_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "engine %s: sequence %d: block_table[%lld] = %d is a ring entry of the sliding "
                    "layers but outside their blocks [0, %d) (allocate with kv_blocks.h's ring)",
                    op, seq, (long long)b, table[b], e->kv.n_ring_blocks);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_engine_check_token(const tw_engine_t *e, const char *op,
                                                      const char *what, int64_t i, int32_t token) {
  int32_t vocab = e->model->config.vocab_size;
  if (token < 0 || token >= vocab)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: %s[%lld] = %d outside the vocabulary [0, %d)",
                  op, what, (long long)i, token, vocab);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_engine_check_sample(const char *op, int64_t i,
                                                       const tw_sample_params_t *s) {
  if (s && s->temperature != s->temperature)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: sample[%lld].temperature is NaN", op,
                  (long long)i);
  return TW_OK;
}

/* Every check of one prefill sequence; `seq` names it in the messages of a batch (-1: alone). */
static TW_NODISCARD tw_status_t tw_engine_check_prefill_seq(const tw_engine_t *e, int32_t seq,
                                                            const tw_prefill_seq_t *q) {
  char op[48];
  if (seq < 0) snprintf(op, sizeof op, "prefill");
  else snprintf(op, sizeof op, "prefill_batch: seqs[%d]", seq);
  if (q->n_tokens <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: n_tokens %d <= 0", op, q->n_tokens);
  if (!q->tokens) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: tokens is NULL", op);
  if (q->start_pos < 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine %s: start_pos %d < 0", op, q->start_pos);
  int64_t end = (int64_t)q->start_pos + q->n_tokens;
  int32_t max_pos = e->model->config.max_position_embeddings;
  if (end > max_pos)
    return tw_err(TW_ERR_OUT_OF_RANGE,
                  "engine %s: positions %d..%lld beyond max_position_embeddings %d", op,
                  q->start_pos, (long long)end - 1, max_pos);
  for (int32_t i = 0; i < q->n_tokens; i++)
    TW_CHECK(tw_engine_check_token(e, op, "tokens", i, q->tokens[i]));
  TW_CHECK(tw_engine_check_blocks(e, op, seq < 0 ? 0 : seq, q->block_table, q->n_blocks, end));
  TW_CHECK(tw_engine_check_sample(op, seq < 0 ? 0 : seq, q->sample));
  return TW_OK;
}

/* No block written by two sequences of a batch (the blocks of positions
 * start_pos.. of each; earlier positions may be shared, they are only read;
 * with the window ring a sequence's ring entries are written as well). */
static TW_NODISCARD tw_status_t tw_engine_check_disjoint(const tw_engine_t *e,
                                                         const tw_prefill_batch_args_t *a) {
  if (a->n_seqs < 2) return TW_OK;
  uint8_t *used = calloc((size_t)e->kv.n_blocks, 1);
  if (!used) return tw_err(TW_ERR_NO_MEMORY, "engine prefill_batch: out of memory");
  int32_t bs = e->kv.block_size;
  tw_status_t st = TW_OK;
  for (int32_t i = 0; i < a->n_seqs && st == TW_OK; i++) {
    const tw_prefill_seq_t *q = &a->seqs[i];
    int32_t b0 = q->start_pos / bs, b1 = (q->start_pos + q->n_tokens - 1) / bs;
    int32_t r1 = b1 < e->kv.ring_blocks - 1 ? b1 : e->kv.ring_blocks - 1; /* ring: 0..r1 */
    for (int32_t pass = 0; pass < 2; pass++)                              /* check, then mark */
      for (int32_t k = 0; k < 2; k++)
        for (int32_t b = k ? 0 : b0; b <= (k ? r1 : b1) && st == TW_OK; b++) {
          if (pass) {
            used[q->block_table[b]] = 1;
          } else if (used[q->block_table[b]]) {
            st = tw_err(TW_ERR_INVALID_ARGUMENT,
                        "engine prefill_batch: seqs[%d] writes block %d that an earlier sequence "
                        "of the batch also writes",
                        i, q->block_table[b]);
          }
        }
  }
  free(used);
  return st;
}

/* One prefill call being planned into passes (the chunking of engine.h). */
typedef struct {
  const tw_prefill_seq_t *seqs;
  int32_t n_seqs;
  float *all_logits; /* tw_engine_prefill with all_logits: [n_tokens, V] of its one sequence */
  const tw_prefill_batch_args_t *batch; /* its on_layer_done, or NULL */
  const tw_prefill_args_t *single;      /* its on_layer_done, or NULL */
  /* the pass in flight */
  const tw_prefill_seg_t *segs;
  const int32_t *seg_seq; /* sequence of each segment */
  int32_t n_segs;
} tw_prefill_plan_t;

/* tw_prefill_pass_t.on_pass_layer: the caller's per-sequence callback. */
static void tw_prefill_plan_layer(void *arg, int32_t layer) {
  const tw_prefill_plan_t *p = arg;
  for (int32_t s = 0; s < p->n_segs; s++) {
    const tw_prefill_seg_t *g = &p->segs[s];
    if (p->batch)
      p->batch->on_layer_done(p->batch->on_layer_arg, p->seg_seq[s], layer, g->start_pos,
                              g->n_tokens);
    else
      p->single->on_layer_done(p->single->on_layer_arg, layer, g->start_pos, g->n_tokens);
  }
}

/* Pack the sequences into passes of at most max_prefill_chunk tokens and
 * max_batch segments, in order, and run them. */
static TW_NODISCARD tw_status_t tw_prefill_plan_run(tw_engine_t *e, tw_prefill_plan_t *p) {
  const int64_t V = e->model->config.vocab_size;
  const int32_t budget = e->params.max_prefill_chunk;
  const int32_t max_segs = p->n_seqs < e->params.max_batch ? p->n_seqs : e->params.max_batch;
  bool has_cb = (p->batch && p->batch->on_layer_done) || (p->single && p->single->on_layer_done);
  size_t n = (size_t)max_segs;
  tw_prefill_seg_t *segs = malloc(n * sizeof *segs);
  int32_t *seg_seq = malloc(n * sizeof *seg_seq), *out_seq = malloc(n * sizeof *out_seq);
  int32_t *next = malloc(n * sizeof *next);
  float **rows = malloc(n * sizeof *rows);
  tw_sample_params_t *sample = malloc(n * sizeof *sample);
  int64_t *sample_pos = malloc(n * sizeof *sample_pos);
  tw_status_t st = TW_OK;
  if (!segs || !seg_seq || !out_seq || !next || !rows || !sample || !sample_pos)
    st = tw_err(TW_ERR_NO_MEMORY, "engine prefill: out of memory for a plan of %d sequences",
                p->n_seqs);
  int32_t i = 0, off = 0; /* next sequence, and how many of its tokens already ran */
  while (st == TW_OK && i < p->n_seqs) {
    int32_t ns = 0, nt = 0, n_out = 0;
    bool want_tokens = false;
    while (i < p->n_seqs && ns < max_segs && nt < budget) {
      const tw_prefill_seq_t *q = &p->seqs[i];
      int32_t take = q->n_tokens - off < budget - nt ? q->n_tokens - off : budget - nt;
      bool last = off + take == q->n_tokens;
      segs[ns] = (tw_prefill_seg_t){.tokens = q->tokens + off, .n_tokens = take,
                                    .start_pos = q->start_pos + off,
                                    .block_table = q->block_table, .n_blocks = q->n_blocks,
                                    .out = -1};
      if (last && (q->logits_out || q->next_token_out)) {
        segs[ns].out = n_out;
        out_seq[n_out] = i;
        rows[n_out] = q->logits_out;
        sample[n_out] = q->sample ? *q->sample : TW_SAMPLE_PARAMS_GREEDY;
        sample_pos[n_out] = (int64_t)q->start_pos + q->n_tokens; /* the token that follows */
        want_tokens |= q->next_token_out != NULL;
        n_out++;
      }
      seg_seq[ns++] = i;
      nt += take;
      if (last) {
        i++;
        off = 0;
      } else {
        off += take;
      }
    }
    p->segs = segs;
    p->seg_seq = seg_seq;
    p->n_segs = ns;
    tw_prefill_pass_t pass = {
        .n_segs = ns, .n_tokens = nt, .n_out = n_out, .segs = segs,
        .all_logits = p->all_logits
                          ? p->all_logits + (int64_t)(segs[0].start_pos - p->seqs[0].start_pos) * V
                          : NULL,
        .logits_rows = rows, .sample = sample, .sample_pos = sample_pos,
        .next_tokens = want_tokens ? next : NULL,
        .on_pass_layer = has_cb ? tw_prefill_plan_layer : NULL, .on_pass_arg = p};
    st = e->ops->prefill_pass(e, &pass);
    for (int32_t k = 0; st == TW_OK && want_tokens && k < n_out; k++)
      if (p->seqs[out_seq[k]].next_token_out) *p->seqs[out_seq[k]].next_token_out = next[k];
  }
  free(segs);
  free(seg_seq);
  free(out_seq);
  free(next);
  free(rows);
  free(sample);
  free(sample_pos);
  return st;
}

TW_NODISCARD tw_status_t tw_engine_prefill(tw_engine_t *engine, const tw_prefill_args_t *args) {
  TW_CHECK(tw_engine_check(engine, "prefill"));
  if (!args) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill: args is NULL");
  bool all = args->all_logits && args->logits_out;
  tw_prefill_seq_t q = {.tokens = args->tokens, .n_tokens = args->n_tokens,
                        .start_pos = args->start_pos, .block_table = args->block_table,
                        .n_blocks = args->n_blocks, .logits_out = all ? NULL : args->logits_out,
                        .sample = args->sample, .next_token_out = args->next_token_out};
  TW_CHECK(tw_engine_check_prefill_seq(engine, -1, &q));
  tw_prefill_plan_t p = {.seqs = &q, .n_seqs = 1, .all_logits = all ? args->logits_out : NULL,
                         .single = args};
  return tw_prefill_plan_run(engine, &p);
}

TW_NODISCARD tw_status_t tw_engine_prefill_batch(tw_engine_t *engine,
                                                 const tw_prefill_batch_args_t *args) {
  TW_CHECK(tw_engine_check(engine, "prefill_batch"));
  if (!args) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill_batch: args is NULL");
  if (args->n_seqs <= 0 || !args->seqs)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine prefill_batch: n_seqs %d (> 0) or seqs NULL",
                  args->n_seqs);
  for (int32_t i = 0; i < args->n_seqs; i++)
    TW_CHECK(tw_engine_check_prefill_seq(engine, i, &args->seqs[i]));
  TW_CHECK(tw_engine_check_disjoint(engine, args));
  tw_prefill_plan_t p = {.seqs = args->seqs, .n_seqs = args->n_seqs, .batch = args};
  return tw_prefill_plan_run(engine, &p);
}

TW_NODISCARD tw_status_t tw_engine_warmup(tw_engine_t *engine) {
  TW_CHECK(tw_engine_check(engine, "warmup"));
  return engine->ops->warmup ? engine->ops->warmup(engine) : TW_OK;
}

TW_NODISCARD tw_status_t tw_engine_decode(tw_engine_t *engine, const tw_decode_args_t *args) {
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
