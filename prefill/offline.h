/* offline.h: the offline mode of twain-prefill: run one prompt given as
 * token ids through the engine, optionally dump the logits of every prompt
 * position and continue greedily with KV-cache decode steps. Used by tests
 * and for checking a backend against reference logits. */
#ifndef TW_PREFILL_OFFLINE_H
#define TW_PREFILL_OFFLINE_H

#include "common/base/status.h"
#include "common/engine/engine.h"

#include <stdint.h>
#include <stdio.h>

#define TW_OFFLINE_MAX_STOP_IDS 16

typedef struct {
  const char *model_dir;           /* checkpoint directory */
  tw_backend_kind_t backend;
  const char *prompt_tokens_path;  /* JSON array of token ids */
  const char *maybe_dump_logits_path; /* NULL, or where to write f32 LE [T, vocab] */
  int32_t generate;                /* greedy tokens to generate after the prompt (>= 0) */
  int32_t stop_ids[TW_OFFLINE_MAX_STOP_IDS]; /* stop after emitting one of these */
  int32_t n_stop_ids;
  int32_t n_threads;               /* 0 = all cores */
  int32_t block_size;              /* KV block size in tokens */
} tw_offline_opts_t;

/** Read a JSON array of token ids from `path` into a malloc'd array (the
 *  caller frees *ids_p). Errors: TW_ERR_IO, TW_ERR_FORMAT (not a JSON array
 *  of integers, or empty; the message names the element), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_offline_read_tokens(const char *path, int32_t **ids_p, int32_t *n_p);

/** Run the offline mode: load the model, prefill the prompt (all logits if
 *  a dump path is given, written as little-endian float32 [T, vocab]), then
 *  generate opts->generate tokens greedily (exactly that many, unless a stop
 *  id is emitted: it is printed and generation ends) and print them to `out`
 *  as one JSON array line (printed only when generate > 0).
 *  Errors: those of tw_offline_read_tokens, tw_model_load, tw_engine_create,
 *  tw_engine_prefill/decode (a token id outside the vocabulary is
 *  TW_ERR_INVALID_ARGUMENT; a prompt plus generation longer than
 *  max_position_embeddings is TW_ERR_OUT_OF_RANGE), TW_ERR_IO on the dump. */
TW_NODISCARD tw_status_t tw_offline_run(const tw_offline_opts_t *opts, FILE *out);

#endif
