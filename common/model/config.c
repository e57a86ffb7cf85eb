/* config.c: parse a Hugging Face gpt-oss config.json into tw_model_config_t
 * (spec §1.1). Every field is checked: a missing required field is
 * TW_ERR_NOT_FOUND, a field of the wrong JSON type TW_ERR_FORMAT, a value out
 * of range or inconsistent TW_ERR_INVALID_ARGUMENT; each message names the
 * field. Both spellings of the RoPE block are accepted (rope_scaling, the
 * original HF name, and rope_parameters, the newer one, §1.1 notes). */
#include "common/model/config.h"

#include "common/base/file_read.h"

#include "common/base/log.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_CONFIG_MAX_FILE_BYTES (16 << 20) /* a config.json is a few KiB */
#define TW_CONFIG_MAX_ROPE_THETA 1e12
#define TW_CONFIG_MAX_ROPE_FACTOR 1024.0

/* ---- typed field readers ------------------------------------------------ */

/* Look up `key` in `obj`: *it_p is the item, or NULL when the field is absent
 * (or null) and not required. A required absent field is TW_ERR_NOT_FOUND
 * naming it; `where` prefixes nested names ("rope_scaling."). */
static TW_NODISCARD tw_status_t get_field(const cJSON *obj, const char *where, const char *key,
                                          bool required, const cJSON **it_p) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (!it || cJSON_IsNull(it)) {
    if (required)
      return tw_err(TW_ERR_NOT_FOUND, "config: required field '%s%s' is missing", where, key);
    it = NULL;
  }
  *it_p = it;
  return TW_OK;
}

/* Read an integer field that must fit int32. `where` prefixes the field name
 * for nested objects ("rope_scaling."). */
static TW_NODISCARD tw_status_t get_i32(const cJSON *obj, const char *where, const char *key,
                                        bool required, int32_t def, int32_t *out_p) {
  const cJSON *it = NULL; /* set by get_field; -O3 cannot tell */
  TW_CHECK(get_field(obj, where, key, required, &it));
  if (!it) {
    *out_p = def;
    return TW_OK;
  }
  if (!cJSON_IsNumber(it))
    return tw_err(TW_ERR_FORMAT, "config: field '%s%s' must be an integer", where, key);
  double v = it->valuedouble;
  if (v != floor(v) || v < -2147483648.0 || v > 2147483647.0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field '%s%s' = %g is not an int32", where,
                  key, v);
  *out_p = (int32_t)v;
  return TW_OK;
}

static TW_NODISCARD tw_status_t get_f64(const cJSON *obj, const char *where, const char *key,
                                        bool required, double def, double *out_p) {
  const cJSON *it;
  TW_CHECK(get_field(obj, where, key, required, &it));
  if (!it) {
    *out_p = def;
    return TW_OK;
  }
  if (!cJSON_IsNumber(it))
    return tw_err(TW_ERR_FORMAT, "config: field '%s%s' must be a number", where, key);
  if (!isfinite(it->valuedouble))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field '%s%s' is not finite", where, key);
  *out_p = it->valuedouble;
  return TW_OK;
}

static TW_NODISCARD tw_status_t get_bool(const cJSON *obj, const char *where, const char *key,
                                         bool required, bool def, bool *out_p) {
  const cJSON *it;
  TW_CHECK(get_field(obj, where, key, required, &it));
  if (!it) {
    *out_p = def;
    return TW_OK;
  }
  if (!cJSON_IsBool(it))
    return tw_err(TW_ERR_FORMAT, "config: field '%s%s' must be true or false", where, key);
  *out_p = cJSON_IsTrue(it);
  return TW_OK;
}

/* A positive integer field (sizes, counts). */
static TW_NODISCARD tw_status_t get_pos_i32(const cJSON *obj, const char *key, int32_t *out_p) {
  int32_t v = 0;
  TW_CHECK(get_i32(obj, "", key, true, 0, &v));
  if (v <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field '%s' = %d must be positive", key, v);
  *out_p = v;
  return TW_OK;
}

/* eos_token_id / pad_token_id: an int, a list of ints (first one is used),
 * null or absent (-1). */
static TW_NODISCARD tw_status_t get_token_id(const cJSON *obj, const char *key, int32_t *out_p) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (cJSON_IsArray(it)) {
    const cJSON *first = it->child;
    if (!first) {
      *out_p = -1;
      return TW_OK;
    }
    const cJSON *el;
    cJSON_ArrayForEach(el, it) {
      if (!cJSON_IsNumber(el) || el->valuedouble != floor(el->valuedouble) ||
          el->valuedouble < 0 || el->valuedouble > 2147483647.0)
        return tw_err(TW_ERR_FORMAT, "config: field '%s' must be a token id or a list of ids",
                      key);
    }
    *out_p = (int32_t)first->valuedouble;
    return TW_OK;
  }
  if (it && !cJSON_IsNull(it) && !cJSON_IsNumber(it))
    return tw_err(TW_ERR_FORMAT, "config: field '%s' must be a token id or a list of ids", key);
  int32_t v = -1;
  TW_CHECK(get_i32(obj, "", key, false, -1, &v));
  if (v < -1)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field '%s' = %d is negative", key, v);
  *out_p = v;
  return TW_OK;
}

/* ---- sections ------------------------------------------------------------ */

/* RoPE / YaRN block (spec §2.5). `rope` is rope_parameters or rope_scaling;
 * `other`, if both are present, must agree with it on every shared field. */
static TW_NODISCARD tw_status_t parse_rope(const cJSON *root, tw_model_config_t *c) {
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
  const cJSON *scaling = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
  if (cJSON_IsNull(params)) params = NULL;
  if (cJSON_IsNull(scaling)) scaling = NULL;
  if (params && !cJSON_IsObject(params))
    return tw_err(TW_ERR_FORMAT, "config: field 'rope_parameters' must be an object");
  if (scaling && !cJSON_IsObject(scaling))
    return tw_err(TW_ERR_FORMAT, "config: field 'rope_scaling' must be an object");
  if (!params && !scaling)
    return tw_err(TW_ERR_NOT_FOUND,
                  "config: required field 'rope_scaling' (or 'rope_parameters') is missing");
  const cJSON *rope = params ? params : scaling;
  const char *where = params ? "rope_parameters." : "rope_scaling.";

  const cJSON *type = cJSON_GetObjectItemCaseSensitive(rope, "rope_type");
  if (!type) type = cJSON_GetObjectItemCaseSensitive(rope, "type"); /* older HF spelling */
  if (!type)
    return tw_err(TW_ERR_NOT_FOUND, "config: required field '%srope_type' is missing", where);
  if (!cJSON_IsString(type))
    return tw_err(TW_ERR_FORMAT, "config: field '%srope_type' must be a string", where);
  if (strcmp(type->valuestring, "yarn") != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field '%srope_type' is \"%s\"; gpt-oss uses \"yarn\" (spec §2.5)",
                  where, type->valuestring);

  TW_CHECK(get_f64(rope, where, "factor", true, 0, &c->rope_factor));
  TW_CHECK(get_f64(rope, where, "beta_fast", true, 0, &c->rope_beta_fast));
  TW_CHECK(get_f64(rope, where, "beta_slow", true, 0, &c->rope_beta_slow));
  TW_CHECK(get_i32(rope, where, "original_max_position_embeddings", true, 0,
                   &c->rope_original_max_pos));
  /* transformers' YaRN defaults truncate to true when the key is absent;
   * gpt-oss sets it to false explicitly. */
  TW_CHECK(get_bool(rope, where, "truncate", false, true, &c->rope_truncate));
  /* gpt-oss: factor 32; far beyond that the YaRN ramp and mscale are
   * meaningless (a checkpoint error, not a model) */
  if (!(c->rope_factor >= 1.0 && c->rope_factor <= TW_CONFIG_MAX_ROPE_FACTOR))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field '%sfactor' = %g must be in [1, %g]", where,
                  c->rope_factor, TW_CONFIG_MAX_ROPE_FACTOR);
  if (c->rope_beta_fast <= 0 || c->rope_beta_slow <= 0 ||
      c->rope_beta_fast < c->rope_beta_slow)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: fields '%sbeta_fast' = %g and 'beta_slow' = %g must be positive with "
                  "beta_fast >= beta_slow",
                  where, c->rope_beta_fast, c->rope_beta_slow);
  if (c->rope_original_max_pos <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field '%soriginal_max_position_embeddings' = %d must be positive",
                  where, c->rope_original_max_pos);

  if (params && scaling) { /* both spellings present: they must say the same */
    static const char *const keys[] = {"factor", "beta_fast", "beta_slow",
                                       "original_max_position_embeddings"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
      const cJSON *a = cJSON_GetObjectItemCaseSensitive(params, keys[i]);
      const cJSON *b = cJSON_GetObjectItemCaseSensitive(scaling, keys[i]);
      if (b && (!cJSON_IsNumber(b) || b->valuedouble != a->valuedouble))
        return tw_err(TW_ERR_INVALID_ARGUMENT,
                      "config: field 'rope_scaling.%s' disagrees with 'rope_parameters.%s'",
                      keys[i], keys[i]);
    }
  }

  /* rope_theta: top level (original HF) or inside rope_parameters (newer). */
  const cJSON *top = cJSON_GetObjectItemCaseSensitive(root, "rope_theta");
  const cJSON *inner = params ? cJSON_GetObjectItemCaseSensitive(params, "rope_theta") : NULL;
  if (top && !cJSON_IsNull(top)) {
    TW_CHECK(get_f64(root, "", "rope_theta", true, 0, &c->rope_theta));
    if (inner && (!cJSON_IsNumber(inner) || inner->valuedouble != c->rope_theta))
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "config: field 'rope_parameters.rope_theta' disagrees with 'rope_theta'");
  } else if (inner) {
    TW_CHECK(get_f64(params, "rope_parameters.", "rope_theta", true, 0, &c->rope_theta));
  } else {
    return tw_err(TW_ERR_NOT_FOUND, "config: required field 'rope_theta' is missing (top level "
                                    "or in rope_parameters)");
  }
  /* gpt-oss: 150000; below 1 the frequencies grow with the dimension */
  if (!(c->rope_theta >= 1.0 && c->rope_theta <= TW_CONFIG_MAX_ROPE_THETA))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field 'rope_theta' = %g must be in [1, %g]",
                  c->rope_theta, TW_CONFIG_MAX_ROPE_THETA);
  return TW_OK;
}

/* layer_types: one of "sliding_attention"/"full_attention" per layer; if
 * absent, transformers' GptOssConfig default: alternating, sliding first. */
static TW_NODISCARD tw_status_t parse_layer_types(const cJSON *root, tw_model_config_t *c) {
  const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
  if (!lt || cJSON_IsNull(lt)) {
    for (int32_t i = 0; i < c->n_layers; i++)
      c->layer_types[i] = (i % 2 == 0) ? TW_LAYER_SLIDING : TW_LAYER_FULL;
    return TW_OK;
  }
  if (!cJSON_IsArray(lt))
    return tw_err(TW_ERR_FORMAT, "config: field 'layer_types' must be a list of strings");
  int n = cJSON_GetArraySize(lt);
  if (n != c->n_layers)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'layer_types' has %d entries but num_hidden_layers is %d", n,
                  c->n_layers);
  int32_t i = 0;
  const cJSON *el;
  cJSON_ArrayForEach(el, lt) {
    if (!cJSON_IsString(el))
      return tw_err(TW_ERR_FORMAT, "config: field 'layer_types[%d]' must be a string", i);
    if (strcmp(el->valuestring, "sliding_attention") == 0)
      c->layer_types[i] = TW_LAYER_SLIDING;
    else if (strcmp(el->valuestring, "full_attention") == 0)
      c->layer_types[i] = TW_LAYER_FULL;
    else
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "config: field 'layer_types[%d]' is \"%s\"; expected \"sliding_attention\" "
                    "or \"full_attention\"",
                    i, el->valuestring);
    i++;
  }
  return TW_OK;
}

static TW_NODISCARD tw_status_t parse_root(const cJSON *root, tw_model_config_t *c) {
  if (!cJSON_IsObject(root)) return tw_err(TW_ERR_FORMAT, "config: top level is not an object");

  TW_CHECK(get_pos_i32(root, "num_hidden_layers", &c->n_layers));
  if (c->n_layers > TW_MAX_LAYERS)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'num_hidden_layers' = %d exceeds TW_MAX_LAYERS (%d)",
                  c->n_layers, TW_MAX_LAYERS);
  TW_CHECK(get_pos_i32(root, "num_local_experts", &c->n_experts));

  /* num_experts_per_tok, with the original config's experts_per_token as an
   * alias (the official HF config has both, §1.1). */
  bool has_hf = cJSON_GetObjectItemCaseSensitive(root, "num_experts_per_tok") != NULL;
  bool has_orig = cJSON_GetObjectItemCaseSensitive(root, "experts_per_token") != NULL;
  int32_t k_hf = 0, k_orig = 0;
  if (!has_hf && !has_orig)
    return tw_err(TW_ERR_NOT_FOUND, "config: required field 'num_experts_per_tok' is missing");
  if (has_hf) TW_CHECK(get_i32(root, "", "num_experts_per_tok", true, 0, &k_hf));
  if (has_orig) TW_CHECK(get_i32(root, "", "experts_per_token", true, 0, &k_orig));
  if (has_hf && has_orig && k_hf != k_orig)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'num_experts_per_tok' = %d disagrees with 'experts_per_token' "
                  "= %d",
                  k_hf, k_orig);
  c->n_experts_per_tok = has_hf ? k_hf : k_orig;
  if (c->n_experts_per_tok <= 0 || c->n_experts_per_tok > c->n_experts)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'num_experts_per_tok' = %d must be in 1..num_local_experts (%d)",
                  c->n_experts_per_tok, c->n_experts);

  TW_CHECK(get_pos_i32(root, "vocab_size", &c->vocab_size));
  TW_CHECK(get_pos_i32(root, "hidden_size", &c->hidden));
  TW_CHECK(get_pos_i32(root, "intermediate_size", &c->intermediate));
  TW_CHECK(get_pos_i32(root, "head_dim", &c->head_dim));
  if (c->head_dim % 2 != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'head_dim' = %d must be even (RoPE rotates halves, spec §2.5)",
                  c->head_dim);
  TW_CHECK(get_pos_i32(root, "num_attention_heads", &c->n_heads));
  TW_CHECK(get_pos_i32(root, "num_key_value_heads", &c->n_kv_heads));
  if (c->n_heads % c->n_kv_heads != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'num_attention_heads' = %d is not a multiple of "
                  "'num_key_value_heads' = %d",
                  c->n_heads, c->n_kv_heads);
  TW_CHECK(get_pos_i32(root, "sliding_window", &c->sliding_window));

  TW_CHECK(get_bool(root, "", "attention_bias", false, true, &c->attention_bias));
  if (!c->attention_bias)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'attention_bias' is false; gpt-oss has q/k/v/o biases");

  double limit = 0, alpha = 0, eps = 0;
  TW_CHECK(get_f64(root, "", "swiglu_limit", true, 0, &limit));
  TW_CHECK(get_f64(root, "", "swiglu_alpha", false, 1.702, &alpha));
  TW_CHECK(get_f64(root, "", "rms_norm_eps", true, 0, &eps));
  if (limit <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field 'swiglu_limit' = %g must be positive",
                  limit);
  if (alpha <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field 'swiglu_alpha' = %g must be positive",
                  alpha);
  if (eps <= 0 || eps >= 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: field 'rms_norm_eps' = %g must be in (0, 1)",
                  eps);
  c->swiglu_limit = (float)limit;
  c->swiglu_alpha = (float)alpha;
  c->rms_norm_eps = (float)eps;

  TW_CHECK(parse_rope(root, c));

  TW_CHECK(get_i32(root, "", "initial_context_length", false, 4096,
                   &c->initial_context_length));
  if (c->initial_context_length <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'initial_context_length' = %d must be positive",
                  c->initial_context_length);
  TW_CHECK(get_pos_i32(root, "max_position_embeddings", &c->max_position_embeddings));

  TW_CHECK(get_bool(root, "", "tie_word_embeddings", false, false, &c->tie_word_embeddings));
  if (c->tie_word_embeddings)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'tie_word_embeddings' is true; gpt-oss has a separate lm_head");

  TW_CHECK(get_token_id(root, "eos_token_id", &c->eos_token_id));
  TW_CHECK(get_token_id(root, "pad_token_id", &c->pad_token_id));
  if (c->eos_token_id >= c->vocab_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'eos_token_id' = %d is not below vocab_size %d",
                  c->eos_token_id, c->vocab_size);
  if (c->pad_token_id >= c->vocab_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: field 'pad_token_id' = %d is not below vocab_size %d",
                  c->pad_token_id, c->vocab_size);

  c->mxfp4 = false;
  const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
  if (q && !cJSON_IsNull(q)) {
    if (!cJSON_IsObject(q))
      return tw_err(TW_ERR_FORMAT, "config: field 'quantization_config' must be an object");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (!m)
      return tw_err(TW_ERR_NOT_FOUND,
                    "config: required field 'quantization_config.quant_method' is missing");
    if (!cJSON_IsString(m))
      return tw_err(TW_ERR_FORMAT,
                    "config: field 'quantization_config.quant_method' must be a string");
    if (strcmp(m->valuestring, "mxfp4") != 0)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "config: field 'quantization_config.quant_method' is \"%s\"; only \"mxfp4\" "
                    "is supported",
                    m->valuestring);
    c->mxfp4 = true;
  }
  if (c->mxfp4 && (c->hidden % 32 != 0 || c->intermediate % 32 != 0))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "config: 'hidden_size' = %d and 'intermediate_size' = %d must be multiples of "
                  "32 for MXFP4 experts (spec §3.4)",
                  c->hidden, c->intermediate);

  TW_CHECK(parse_layer_types(root, c));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_config_parse(const char *json_text, tw_model_config_t *config_p) {
  if (!json_text || !config_p)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "config: NULL argument");
  cJSON *root = cJSON_Parse(json_text);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    return tw_err(TW_ERR_FORMAT, "config: not valid JSON (near byte %ld)",
                  at ? (long)(at - json_text) : -1L);
  }
  tw_model_config_t c;
  memset(&c, 0, sizeof c);
  tw_status_t st = parse_root(root, &c);
  cJSON_Delete(root);
  if (st == TW_OK) *config_p = c;
  return st;
}

TW_NODISCARD tw_status_t tw_config_load(const char *path, tw_model_config_t *config_p) {
  if (!path || !config_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "config: NULL argument");
  char *buf = NULL;
  TW_CHECK(tw_file_read(path, TW_CONFIG_MAX_FILE_BYTES, "config", &buf, NULL));
  tw_status_t st = tw_config_parse(buf, config_p);
  if (st != TW_OK) {
    /* say which file, keeping the field message of the parser */
    char msg[768];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    tw_err_quiet(st, "%s (in %s)", msg, path);
  }
  free(buf);
  return st;
}

int64_t tw_config_kv_bytes_per_token(const tw_model_config_t *config, int elem_bytes) {
  return 2 * (int64_t)config->n_kv_heads * config->head_dim * elem_bytes;
}

void tw_config_gptoss(int big, tw_model_config_t *c) {
  memset(c, 0, sizeof *c);
  c->n_layers = big ? 36 : 24;
  c->n_experts = big ? 128 : 32;
  c->n_experts_per_tok = 4;
  c->vocab_size = 201088;
  c->hidden = c->intermediate = 2880;
  c->head_dim = 64;
  c->n_heads = 64;
  c->n_kv_heads = 8;
  c->sliding_window = 128;
  c->attention_bias = true;
  c->swiglu_limit = 7.0f;
  c->swiglu_alpha = 1.702f;
  c->rms_norm_eps = 1e-5f;
  c->rope_theta = 150000.0;
  c->rope_factor = 32.0;
  c->rope_beta_fast = 32.0;
  c->rope_beta_slow = 1.0;
  c->rope_original_max_pos = c->initial_context_length = 4096;
  c->max_position_embeddings = 131072;
  c->eos_token_id = 200002;
  c->pad_token_id = 199999;
  c->mxfp4 = true;
  for (int l = 0; l < c->n_layers; l++) c->layer_types[l] = l % 2 ? TW_LAYER_FULL : TW_LAYER_SLIDING;
}
