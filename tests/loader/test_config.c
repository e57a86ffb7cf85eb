/* test_config.c: tw_config_parse / tw_config_load against the tiny model's
 * config.json (values as in the file) and a gpt-oss-20b config built from
 * spec §1.1; then each missing, mistyped or invalid field gives its own error
 * naming the field. */
#include "check.h"

#include "common/model/config.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* gpt-oss-20b config.json, spec §1.1 (values of the table, rope_scaling form). */
static const char *const k_20b =
    "{\"architectures\":[\"GptOssForCausalLM\"],\"model_type\":\"gpt_oss\","
    "\"num_hidden_layers\":24,\"num_local_experts\":32,"
    "\"layer_types\":[\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\",\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\",\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\",\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\",\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\",\"sliding_attention\",\"full_attention\",\"sliding_attention\","
    "\"full_attention\"],"
    "\"hidden_size\":2880,\"intermediate_size\":2880,\"head_dim\":64,"
    "\"num_attention_heads\":64,\"num_key_value_heads\":8,\"num_experts_per_tok\":4,"
    "\"experts_per_token\":4,\"vocab_size\":201088,\"sliding_window\":128,"
    "\"attention_bias\":true,\"attention_dropout\":0.0,\"hidden_act\":\"silu\","
    "\"swiglu_limit\":7.0,\"rms_norm_eps\":1e-05,\"rope_theta\":150000,"
    "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":32.0,\"beta_fast\":32.0,"
    "\"beta_slow\":1.0,\"original_max_position_embeddings\":4096,\"truncate\":false},"
    "\"initial_context_length\":4096,\"max_position_embeddings\":131072,"
    "\"tie_word_embeddings\":false,\"eos_token_id\":200002,\"pad_token_id\":199999,"
    "\"initializer_range\":0.02,\"router_aux_loss_coef\":0.9,\"output_router_logits\":false,"
    "\"use_cache\":true,\"quantization_config\":{\"quant_method\":\"mxfp4\","
    "\"modules_to_not_convert\":[\"model.layers.*.self_attn\",\"model.layers.*.mlp.router\","
    "\"model.embed_tokens\",\"lm_head\"]},\"transformers_version\":\"4.55.0.dev0\"}";

static void check_20b(const tw_model_config_t *c) {
  EXPECT_EQ_I64(c->n_layers, 24);
  EXPECT_EQ_I64(c->n_experts, 32);
  EXPECT_EQ_I64(c->n_experts_per_tok, 4);
  EXPECT_EQ_I64(c->vocab_size, 201088);
  EXPECT_EQ_I64(c->hidden, 2880);
  EXPECT_EQ_I64(c->intermediate, 2880);
  EXPECT_EQ_I64(c->head_dim, 64);
  EXPECT_EQ_I64(c->n_heads, 64);
  EXPECT_EQ_I64(c->n_kv_heads, 8);
  EXPECT_EQ_I64(c->sliding_window, 128);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ_F64(c->swiglu_limit, 7.0f);
  EXPECT_EQ_F64(c->swiglu_alpha, 1.702f);
  EXPECT_EQ_F64(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ_F64(c->rope_theta, 150000.0);
  EXPECT_EQ_F64(c->rope_factor, 32.0);
  EXPECT_EQ_F64(c->rope_beta_fast, 32.0);
  EXPECT_EQ_F64(c->rope_beta_slow, 1.0);
  EXPECT_EQ_I64(c->rope_original_max_pos, 4096);
  EXPECT_TRUE(!c->rope_truncate);
  EXPECT_EQ_I64(c->initial_context_length, 4096);
  EXPECT_EQ_I64(c->max_position_embeddings, 131072);
  EXPECT_TRUE(!c->tie_word_embeddings);
  EXPECT_EQ_I64(c->eos_token_id, 200002);
  EXPECT_EQ_I64(c->pad_token_id, 199999);
  EXPECT_TRUE(c->mxfp4);
  for (int i = 0; i < 24; i++)
    EXPECT_EQ_I64(c->layer_types[i], i % 2 == 0 ? TW_LAYER_SLIDING : TW_LAYER_FULL);
  EXPECT_EQ_I64(tw_config_kv_bytes_per_token(c, 2), 2048); /* spec §3.7 */
}

static void test_tiny(const char *fixtures) {
  char path[4096];
  snprintf(path, sizeof path, "%s/tiny-gptoss-wordnet-mxfp4/config.json", fixtures);
  tw_model_config_t c;
  memset(&c, 0x5a, sizeof c);
  EXPECT_OK(tw_config_load(path, &c));
  /* values as written in the file */
  EXPECT_EQ_I64(c.n_layers, 4);
  EXPECT_EQ_I64(c.n_experts, 8);
  EXPECT_EQ_I64(c.n_experts_per_tok, 2);
  EXPECT_EQ_I64(c.vocab_size, 8064);
  EXPECT_EQ_I64(c.hidden, 256);
  EXPECT_EQ_I64(c.intermediate, 512);
  EXPECT_EQ_I64(c.head_dim, 64);
  EXPECT_EQ_I64(c.n_heads, 4);
  EXPECT_EQ_I64(c.n_kv_heads, 2);
  EXPECT_EQ_I64(c.sliding_window, 32);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ_F64(c.swiglu_limit, 7.0f);
  EXPECT_EQ_F64(c.swiglu_alpha, 1.702f); /* not in the file: the default */
  EXPECT_EQ_F64(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ_F64(c.rope_theta, 150000.0);
  EXPECT_EQ_F64(c.rope_factor, 32.0);
  EXPECT_EQ_F64(c.rope_beta_fast, 32.0);
  EXPECT_EQ_F64(c.rope_beta_slow, 1.0);
  EXPECT_EQ_I64(c.rope_original_max_pos, 4096);
  EXPECT_TRUE(!c.rope_truncate);
  EXPECT_EQ_I64(c.initial_context_length, 4096);
  EXPECT_EQ_I64(c.max_position_embeddings, 4096);
  EXPECT_TRUE(!c.tie_word_embeddings);
  EXPECT_EQ_I64(c.eos_token_id, 8004);
  EXPECT_EQ_I64(c.pad_token_id, 8001);
  EXPECT_TRUE(c.mxfp4);
  EXPECT_EQ_I64(c.layer_types[0], TW_LAYER_SLIDING);
  EXPECT_EQ_I64(c.layer_types[1], TW_LAYER_FULL);
  EXPECT_EQ_I64(c.layer_types[2], TW_LAYER_SLIDING);
  EXPECT_EQ_I64(c.layer_types[3], TW_LAYER_FULL);
  EXPECT_EQ_I64(tw_config_kv_bytes_per_token(&c, 4), 2 * 2 * 64 * 4);
}

/* ---- mutations of the 20b config ---- */

static char *mutate(const char *path, const char *key, const char *json_value) {
  cJSON *root = cJSON_Parse(k_20b);
  cJSON *obj = root;
  if (path) obj = cJSON_GetObjectItemCaseSensitive(root, path);
  if (json_value) {
    cJSON *v = cJSON_Parse(json_value);
    if (cJSON_HasObjectItem(obj, key))
      cJSON_ReplaceItemInObjectCaseSensitive(obj, key, v);
    else
      cJSON_AddItemToObject(obj, key, v);
  } else {
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
  }
  char *out = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  return out;
}

static TW_NODISCARD tw_status_t parse_mut(const char *path, const char *key, const char *value,
                                          tw_model_config_t *c) {
  char *text = mutate(path, key, value);
  tw_status_t st = tw_config_parse(text, c);
  free(text);
  return st;
}

static void test_missing(void) {
  static const char *const required[] = {
      "num_hidden_layers", "num_local_experts", "vocab_size", "hidden_size",
      "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
      "sliding_window", "swiglu_limit", "rms_norm_eps", "rope_theta", "rope_scaling",
      "max_position_embeddings"};
  tw_model_config_t c;
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
    memset(&c, 0x5a, sizeof c);
    tw_model_config_t before = c;
    EXPECT_ERR(parse_mut(NULL, required[i], NULL, &c), TW_ERR_NOT_FOUND, required[i]);
    EXPECT_TRUE(memcmp(&before, &c, sizeof c) == 0); /* output untouched on error */
  }
  EXPECT_ERR(parse_mut("rope_scaling", "factor", NULL, &c), TW_ERR_NOT_FOUND,
             "rope_scaling.factor");
  EXPECT_ERR(parse_mut("rope_scaling", "original_max_position_embeddings", NULL, &c),
             TW_ERR_NOT_FOUND, "rope_scaling.original_max_position_embeddings");
  EXPECT_ERR(parse_mut("rope_scaling", "rope_type", NULL, &c), TW_ERR_NOT_FOUND,
             "rope_type");
  EXPECT_ERR(parse_mut("quantization_config", "quant_method", NULL, &c), TW_ERR_NOT_FOUND,
             "quantization_config.quant_method");
  /* one of the two spellings of k is enough; neither is an error */
  EXPECT_OK(parse_mut(NULL, "num_experts_per_tok", NULL, &c));
  EXPECT_EQ_I64(c.n_experts_per_tok, 4);
  EXPECT_OK(parse_mut(NULL, "experts_per_token", NULL, &c));
  EXPECT_EQ_I64(c.n_experts_per_tok, 4);
  char *t = mutate(NULL, "experts_per_token", NULL);
  cJSON *r = cJSON_Parse(t);
  cJSON_DeleteItemFromObject(r, "num_experts_per_tok");
  char *t2 = cJSON_PrintUnformatted(r);
  EXPECT_ERR(tw_config_parse(t2, &c), TW_ERR_NOT_FOUND, "num_experts_per_tok");
  free(t);
  free(t2);
  cJSON_Delete(r);
  /* optional fields take their defaults */
  EXPECT_OK(parse_mut(NULL, "eos_token_id", NULL, &c));
  EXPECT_EQ_I64(c.eos_token_id, -1);
  EXPECT_OK(parse_mut(NULL, "quantization_config", NULL, &c));
  EXPECT_TRUE(!c.mxfp4);
  EXPECT_OK(parse_mut(NULL, "layer_types", NULL, &c)); /* HF default: alternating */
  EXPECT_EQ_I64(c.layer_types[0], TW_LAYER_SLIDING);
  EXPECT_EQ_I64(c.layer_types[23], TW_LAYER_FULL);
}

static void test_bad_values(void) {
  tw_model_config_t c;
  /* wrong JSON types: TW_ERR_FORMAT naming the field */
  EXPECT_ERR(parse_mut(NULL, "hidden_size", "\"2880\"", &c), TW_ERR_FORMAT, "hidden_size");
  EXPECT_ERR(parse_mut(NULL, "attention_bias", "1", &c), TW_ERR_FORMAT, "attention_bias");
  EXPECT_ERR(parse_mut(NULL, "layer_types", "\"sliding_attention\"", &c), TW_ERR_FORMAT,
             "layer_types");
  EXPECT_ERR(parse_mut(NULL, "rope_scaling", "\"yarn\"", &c), TW_ERR_FORMAT, "rope_scaling");
  EXPECT_ERR(parse_mut(NULL, "rms_norm_eps", "[1e-5]", &c), TW_ERR_FORMAT, "rms_norm_eps");
  EXPECT_ERR(parse_mut(NULL, "eos_token_id", "\"<|return|>\"", &c), TW_ERR_FORMAT,
             "eos_token_id");
  EXPECT_ERR(parse_mut("rope_scaling", "truncate", "\"no\"", &c), TW_ERR_FORMAT,
             "rope_scaling.truncate");
  /* invalid values: TW_ERR_INVALID_ARGUMENT naming the field */
  EXPECT_ERR(parse_mut(NULL, "hidden_size", "-2880", &c), TW_ERR_INVALID_ARGUMENT,
             "hidden_size");
  EXPECT_ERR(parse_mut(NULL, "hidden_size", "2880.5", &c), TW_ERR_INVALID_ARGUMENT,
             "hidden_size");
  EXPECT_ERR(parse_mut(NULL, "num_hidden_layers", "0", &c), TW_ERR_INVALID_ARGUMENT,
             "num_hidden_layers");
  EXPECT_ERR(parse_mut(NULL, "num_attention_heads", "60", &c), TW_ERR_INVALID_ARGUMENT,
             "num_attention_heads");
  EXPECT_ERR(parse_mut(NULL, "head_dim", "63", &c), TW_ERR_INVALID_ARGUMENT, "head_dim");
  {
    cJSON *r = cJSON_Parse(k_20b);
    cJSON_DeleteItemFromObject(r, "experts_per_token");
    cJSON_ReplaceItemInObject(r, "num_experts_per_tok", cJSON_CreateNumber(33));
    char *t = cJSON_PrintUnformatted(r);
    EXPECT_ERR(tw_config_parse(t, &c), TW_ERR_INVALID_ARGUMENT,
               "'num_experts_per_tok' = 33 must be in 1..num_local_experts");
    free(t);
    cJSON_Delete(r);
  }
  EXPECT_ERR(parse_mut(NULL, "experts_per_token", "3", &c), TW_ERR_INVALID_ARGUMENT,
             "experts_per_token");
  EXPECT_ERR(parse_mut(NULL, "tie_word_embeddings", "true", &c), TW_ERR_INVALID_ARGUMENT,
             "tie_word_embeddings");
  EXPECT_ERR(parse_mut(NULL, "attention_bias", "false", &c), TW_ERR_INVALID_ARGUMENT,
             "attention_bias");
  EXPECT_ERR(parse_mut(NULL, "layer_types", "[\"sliding_attention\",\"full_attention\"]", &c),
             TW_ERR_INVALID_ARGUMENT, "layer_types");
  EXPECT_ERR(parse_mut("rope_scaling", "rope_type", "\"linear\"", &c), TW_ERR_INVALID_ARGUMENT,
             "rope_scaling.rope_type");
  EXPECT_ERR(parse_mut("rope_scaling", "factor", "0.5", &c), TW_ERR_INVALID_ARGUMENT,
             "rope_scaling.factor");
  EXPECT_ERR(parse_mut(NULL, "rms_norm_eps", "0", &c), TW_ERR_INVALID_ARGUMENT,
             "rms_norm_eps");
  EXPECT_ERR(parse_mut(NULL, "sliding_window", "-1", &c), TW_ERR_INVALID_ARGUMENT,
             "sliding_window");
  EXPECT_ERR(parse_mut(NULL, "eos_token_id", "300000", &c), TW_ERR_INVALID_ARGUMENT,
             "eos_token_id");
  EXPECT_ERR(parse_mut(NULL, "num_key_value_heads", "3000000000", &c), TW_ERR_INVALID_ARGUMENT,
             "num_key_value_heads");
  EXPECT_ERR(parse_mut("quantization_config", "quant_method", "\"gptq\"", &c),
             TW_ERR_INVALID_ARGUMENT, "quant_method");
  {
    char *t = mutate(NULL, "layer_types", NULL);
    cJSON *r = cJSON_Parse(t);
    cJSON *lt = cJSON_AddArrayToObject(r, "layer_types");
    for (int i = 0; i < 24; i++)
      cJSON_AddItemToArray(lt, cJSON_CreateString(i == 5 ? "local_attention" : "full_attention"));
    char *t2 = cJSON_PrintUnformatted(r);
    EXPECT_ERR(tw_config_parse(t2, &c), TW_ERR_INVALID_ARGUMENT, "layer_types[5]");
    free(t);
    free(t2);
    cJSON_Delete(r);
  }
  EXPECT_ERR(tw_config_parse("{\"num_hidden_layers\": 24,", &c), TW_ERR_FORMAT, "not valid JSON");
  EXPECT_ERR(tw_config_parse("[1, 2]", &c), TW_ERR_FORMAT, "not an object");
  EXPECT_ERR(tw_config_load("/nonexistent/config.json", &c), TW_ERR_IO, "/nonexistent");

  /* accepted variants */
  EXPECT_OK(parse_mut(NULL, "eos_token_id", "[200002, 199999, 200012]", &c));
  EXPECT_EQ_I64(c.eos_token_id, 200002);
  EXPECT_OK(parse_mut(NULL, "swiglu_alpha", "1.5", &c));
  EXPECT_EQ_F64(c.swiglu_alpha, 1.5f);
  EXPECT_OK(parse_mut("rope_scaling", "truncate", "true", &c));
  EXPECT_TRUE(c.rope_truncate);
}

/* The newer spelling: rope_parameters with rope_theta inside, no top-level
 * rope_theta, no rope_scaling. */
static void test_rope_parameters(void) {
  cJSON *r = cJSON_Parse(k_20b);
  cJSON *rs = cJSON_DetachItemFromObject(r, "rope_scaling");
  cJSON_DeleteItemFromObject(r, "rope_theta");
  cJSON_AddNumberToObject(rs, "rope_theta", 150000.0);
  cJSON_AddItemToObject(r, "rope_parameters", rs);
  char *t = cJSON_PrintUnformatted(r);
  tw_model_config_t c;
  EXPECT_OK(tw_config_parse(t, &c));
  check_20b(&c);
  /* both present and disagreeing: an error naming the field */
  cJSON_AddNumberToObject(r, "rope_theta", 10000.0);
  char *t2 = cJSON_PrintUnformatted(r);
  EXPECT_ERR(tw_config_parse(t2, &c), TW_ERR_INVALID_ARGUMENT, "rope_theta");
  free(t);
  free(t2);
  cJSON_Delete(r);
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  test_tiny(fixtures ? fixtures : "tests/fixtures");
  tw_model_config_t c;
  EXPECT_OK(tw_config_parse(k_20b, &c));
  check_20b(&c);
  test_missing();
  test_bad_values();
  test_rope_parameters();
  return CHECK_DONE("test_config");
}
