/* config.h: the gpt-oss model configuration, read from a Hugging Face
 * config.json (spec §1.1). Every field the engine uses is here; each one is
 * checked on load, and a missing or invalid field is an error naming it. */
#ifndef TW_COMMON_CONFIG_H
#define TW_COMMON_CONFIG_H

#include "common/base/status.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MAX_LAYERS 128

typedef enum {
  TW_LAYER_SLIDING = 0, /* "sliding_attention": keys p-(W-1)..p (spec §2.6) */
  TW_LAYER_FULL = 1,    /* "full_attention": keys 0..p */
} tw_layer_type_t;

typedef struct {
  int32_t n_layers;          /* num_hidden_layers (L) */
  int32_t n_experts;         /* num_local_experts (E) */
  int32_t n_experts_per_tok; /* num_experts_per_tok (k); experts_per_token accepted as alias */
  int32_t vocab_size;        /* V: rows of embedding and lm_head */
  int32_t hidden;            /* hidden_size (H) */
  int32_t intermediate;      /* intermediate_size (I), per expert */
  int32_t head_dim;          /* D */
  int32_t n_heads;           /* num_attention_heads (NQ) */
  int32_t n_kv_heads;        /* num_key_value_heads (NKV) */
  int32_t sliding_window;    /* W, keys including the current token */
  bool attention_bias;       /* must be true for gpt-oss */
  float swiglu_limit;        /* clamp of §2.9 (7.0) */
  float swiglu_alpha;        /* 1.702 unless config.json has swiglu_alpha */
  float rms_norm_eps;        /* 1e-5 */
  double rope_theta;         /* 150000; top level or inside rope_parameters */
  /* YaRN (spec §2.5), from rope_scaling or rope_parameters */
  double rope_factor;        /* f (32) */
  double rope_beta_fast;     /* 32 */
  double rope_beta_slow;     /* 1 */
  int32_t rope_original_max_pos; /* L0 = original_max_position_embeddings (4096) */
  bool rope_truncate;        /* false for gpt-oss: low/high are not rounded */
  int32_t initial_context_length;
  int32_t max_position_embeddings;
  bool tie_word_embeddings;  /* must be false for gpt-oss */
  int32_t eos_token_id;      /* first of eos_token_id if a list; -1 if absent */
  int32_t pad_token_id;      /* -1 if absent */
  bool mxfp4;                /* quantization_config.quant_method == "mxfp4" */
  tw_layer_type_t layer_types[TW_MAX_LAYERS];
} tw_model_config_t;

/** Parse a config.json file. Outputs set only on success.
 *  Errors: TW_ERR_IO (cannot read), TW_ERR_FORMAT (not JSON, or a field of the
 *  wrong type), TW_ERR_NOT_FOUND (a required field is missing: the message
 *  names it), TW_ERR_INVALID_ARGUMENT (a value out of range or inconsistent,
 *  e.g. n_heads not a multiple of n_kv_heads; the message names the field). */
TW_NODISCARD tw_status_t tw_config_load(const char *path, tw_model_config_t *config_p);

/** Parse config.json text (same errors as tw_config_load, minus TW_ERR_IO). */
TW_NODISCARD tw_status_t tw_config_parse(const char *json_text, tw_model_config_t *config_p);

/** The published configuration of gpt-oss-20b (big = 0: 24 layers, 32
 *  experts) or gpt-oss-120b (big = 1: 36 layers, 128 experts), as their
 *  config.json gives it (spec §1.1): H = I = 2880, 64 query and 8 KV heads of
 *  64, vocabulary 201,088, window 128 on the even (sliding) layers, YaRN
 *  factor 32 over 4,096, context 131,072, MXFP4 experts. For planning and
 *  benchmarks where no checkpoint is at hand. */
void tw_config_gptoss(int big, tw_model_config_t *config_p);

/** Bytes of K+V per token per layer at `elem_bytes` per value:
 *  2 * n_kv_heads * head_dim * elem_bytes (spec §3.7). */
int64_t tw_config_kv_bytes_per_token(const tw_model_config_t *config, int elem_bytes);

#ifdef __cplusplus
}
#endif
#endif
