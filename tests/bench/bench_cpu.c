/* bench_cpu.c: twain-bench-cpu, the CPU engine benchmark (not a test).
 *
 * On a checkpoint (default: the tiny MXFP4 model) it measures:
 *   - peak RSS (getrusage ru_maxrss) after loading the model and after
 *     creating the engine, against the weight bytes: the CPU backend reads
 *     weights in place from the mmap, so RSS must stay ~1x the weights;
 *   - prefill of a P-token prompt (default 512) in one call: ms and tokens/s
 *     (best of R runs);
 *   - greedy decode at batch 1 through the KV cache: tokens/s over N steps;
 *   - decode at batch 8 (8 sequences, one step each): tokens/s.
 * With --synthetic-20b L it runs instead on seeded synthetic weights with the
 * real gpt-oss-20b shapes (spec §1.1: H = I = 2880, 64/8 heads, 32 experts
 * top-4, MXFP4 experts, V = 201088) cut to L layers.
 * Progress goes to stderr, the table to stdout. Prompt tokens are a fixed
 * pseudo-random sequence of ordinary (non-special) ids. */
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/engine/engine.h"
#include "common/kv/kv_blocks.h"
#include "common/model/config.h"
#include "common/model/model.h"
#include "common/model/model_path.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double peak_rss_mib(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
}

/* gpt-oss-20b config.json (spec §1.1) with num_hidden_layers = %d. */
static const char *tw_bench_20b_json =
    "{\"num_hidden_layers\": %d, \"num_local_experts\": 32, \"num_experts_per_tok\": 4,"
    " \"vocab_size\": 201088, \"hidden_size\": 2880, \"intermediate_size\": 2880,"
    " \"head_dim\": 64, \"num_attention_heads\": 64, \"num_key_value_heads\": 8,"
    " \"sliding_window\": 128, \"attention_bias\": true, \"swiglu_limit\": 7.0,"
    " \"rms_norm_eps\": 1e-05, \"rope_theta\": 150000,"
    " \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 32.0, \"beta_fast\": 32.0,"
    " \"beta_slow\": 1.0, \"original_max_position_embeddings\": 4096, \"truncate\": false},"
    " \"initial_context_length\": 4096, \"max_position_embeddings\": 131072,"
    " \"tie_word_embeddings\": false, \"eos_token_id\": 200002, \"pad_token_id\": 199999,"
    " \"layer_types\": [%s],"
    " \"quantization_config\": {\"quant_method\": \"mxfp4\"}}";

static TW_NODISCARD tw_status_t tw_bench_synthetic(int n_layers, tw_model_t **m_p) {
  char types[TW_MAX_LAYERS * 24] = "";
  for (int l = 0; l < n_layers; l++)
    strcat(types, l % 2 == 0 ? (l ? ",\"sliding_attention\"" : "\"sliding_attention\"")
                             : ",\"full_attention\"");
  char json[8192];
  snprintf(json, sizeof(json), tw_bench_20b_json, n_layers, types);
  tw_model_config_t c;
  TW_CHECK(tw_config_parse(json, &c));
  return tw_model_synthetic(&c, 1, m_p);
}

int main(int argc, char **argv) {
  tw_log_init("twain-bench-cpu", 0);
  const char *model_dir = TW_DEFAULT_MODEL_DIR;
  int threads = 0, prompt_len = 512, decode_steps = 128, repeat = 3, synthetic = 0;
  tw_opt_t opts[] = {
      TW_OPT_STR_FN("model", &model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "checkpoint directory;\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_INT("synthetic-20b", &synthetic, 0, 24, "L",
                 "synthetic gpt-oss-20b shapes with L layers instead of --model (0: off)"),
      TW_OPT_INT("threads", &threads, 0, 1024, "N", "cpu threads (0: all cores)"),
      TW_OPT_INT("prompt-len", &prompt_len, 1, 1 << 20, "P", "prompt tokens"),
      TW_OPT_INT("decode-steps", &decode_steps, 1, 1 << 20, "N", "decode steps"),
      TW_OPT_INT("repeat", &repeat, 1, 100, "R", "repetitions (the best is reported)"),
  };
  tw_opts_spec_t spec = {.prog = "twain-bench-cpu", .description = "CPU backend prefill and decode throughput.",
                         .env_prefix = "TWAIN_BENCH_CPU_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0]};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  double rss0 = peak_rss_mib();
  char synth_name[64];
  if (synthetic) {
    snprintf(synth_name, sizeof(synth_name), "synthetic gpt-oss-20b shapes, %d layers", synthetic);
    model_dir = synth_name;
  }
  fprintf(stderr, "[bench] loading %s\n", model_dir);
  tw_model_t *m = NULL;
  double t0 = now_s();
  tw_status_t lst = synthetic ? tw_bench_synthetic(synthetic, &m) : tw_model_load(model_dir, &m);
  if (lst != TW_OK) {
    fprintf(stderr, "twain-bench-cpu: cannot load %s: %s\n", model_dir, tw_last_error());
    return 1;
  }
  double load_s = now_s() - t0, rss_load = peak_rss_mib();
  const tw_model_config_t *c = &m->config;
  const int bs = 16, batch = 8;
  int per_seq = prompt_len + decode_steps + 1;
  if (per_seq > c->max_position_embeddings) {
    fprintf(stderr, "twain-bench-cpu: prompt + decode steps exceed max_position_embeddings %d\n",
            c->max_position_embeddings);
    return 2;
  }
  int blocks_per_seq = (per_seq + bs - 1) / bs;
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_block_size = bs;
  p.kv_num_blocks = blocks_per_seq * (batch + 1);
  p.n_threads = threads;
  p.max_prefill_chunk = prompt_len;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &p, &e) != TW_OK) {
    fprintf(stderr, "twain-bench-cpu: engine: %s\n", tw_last_error());
    return 1;
  }
  double rss_engine = peak_rss_mib();
  tw_kv_blocks_t *kb = NULL;
  int32_t *tables = malloc(sizeof(int32_t) * (size_t)blocks_per_seq * (batch + 1));
  if (!tables || tw_kv_blocks_create(p.kv_num_blocks, bs, &kb) != TW_OK ||
      tw_kv_blocks_alloc(kb, blocks_per_seq * (batch + 1), tables) != TW_OK) {
    fprintf(stderr, "bench: cannot set up %d kv blocks: %s\n", p.kv_num_blocks, tw_last_error());
    return 1;
  }
  int32_t *prompt = malloc(sizeof(int32_t) * (size_t)prompt_len);
  uint64_t s = 0x9e3779b97f4a7c15ull;
  int32_t ordinary = c->vocab_size > 8000 ? 8000 : c->vocab_size; /* below the special ids */
  for (int i = 0; i < prompt_len; i++) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    prompt[i] = (int32_t)(s % (uint64_t)ordinary);
  }

  /* prefill */
  double best_prefill = 1e30;
  int32_t next = 0;
  for (int r = 0; r < repeat; r++) {
    tw_prefill_args_t pa = {.tokens = prompt, .n_tokens = prompt_len, .block_table = tables,
                            .n_blocks = blocks_per_seq, .next_token_out = &next};
    t0 = now_s();
    if (tw_engine_prefill(e, &pa) != TW_OK) {
      fprintf(stderr, "twain-bench-cpu: prefill: %s\n", tw_last_error());
      return 1;
    }
    double dt = now_s() - t0;
    fprintf(stderr, "[bench] prefill %d tokens, run %d: %.1f ms\n", prompt_len, r + 1, dt * 1e3);
    if (dt < best_prefill) best_prefill = dt;
  }

  /* decode, batch 1, greedy through the KV cache */
  int32_t tok = next, nb = blocks_per_seq;
  const int32_t *tab = tables;
  t0 = now_s();
  for (int i = 0; i < decode_steps; i++) {
    int32_t pos = prompt_len + i, out = -1;
    tw_decode_args_t da = {.n_seqs = 1, .tokens = &tok, .positions = &pos, .block_tables = &tab,
                           .n_blocks = &nb, .next_tokens_out = &out};
    if (tw_engine_decode(e, &da) != TW_OK) {
      fprintf(stderr, "twain-bench-cpu: decode: %s\n", tw_last_error());
      return 1;
    }
    tok = out;
    if ((i + 1) % 32 == 0) fprintf(stderr, "[bench] decode step %d/%d\n", i + 1, decode_steps);
  }
  double decode_s = now_s() - t0;

  /* decode, batch 8: each sequence has a 64-token prompt, then 16 steps */
  int ctx = prompt_len < 64 ? prompt_len : 64, steps8 = 16;
  int32_t toks8[8], pos8[8], nb8[8];
  const int32_t *tabs8[8];
  for (int b = 0; b < batch; b++) {
    tabs8[b] = tables + (size_t)(b + 1) * blocks_per_seq;
    nb8[b] = blocks_per_seq;
    tw_prefill_args_t pa = {.tokens = prompt + b, .n_tokens = ctx - b, .block_table = tabs8[b],
                            .n_blocks = nb8[b], .next_token_out = &toks8[b]};
    if (tw_engine_prefill(e, &pa) != TW_OK) return 1;
    pos8[b] = ctx - b;
  }
  t0 = now_s();
  for (int i = 0; i < steps8; i++) {
    tw_decode_args_t da = {.n_seqs = batch, .tokens = toks8, .positions = pos8,
                           .block_tables = tabs8, .n_blocks = nb8, .next_tokens_out = toks8};
    if (tw_engine_decode(e, &da) != TW_OK) return 1;
    for (int b = 0; b < batch; b++) pos8[b]++;
  }
  double decode8_s = now_s() - t0;
  double rss_end = peak_rss_mib();
  double weights_mib = (double)m->weight_bytes / (1 << 20);
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);

  printf("twain-bench-cpu: model %s\n", model_dir);
  printf("config: L=%d H=%d I=%d E=%d k=%d NQ=%d NKV=%d D=%d V=%d, experts %s, threads %d (0 = all cores)\n",
         c->n_layers, c->hidden, c->intermediate, c->n_experts, c->n_experts_per_tok, c->n_heads,
         c->n_kv_heads, c->head_dim, c->vocab_size, c->mxfp4 ? "MXFP4" : "bf16",
         threads);
  printf("| metric | value |\n|---|---|\n");
  printf("| weight bytes | %.1f MiB |\n", weights_mib);
  printf("| model %s | %.1f ms |\n", synthetic ? "fill (synthetic)" : "load", load_s * 1e3);
  printf("| peak RSS before load | %.1f MiB |\n", rss0);
  printf("| peak RSS after load | %.1f MiB (%.2fx weights) |\n", rss_load, rss_load / weights_mib);
  printf("| peak RSS after engine create | %.1f MiB (KV pool %.1f MiB mapped, lazily touched) |\n",
         rss_engine, (double)kv->total_bytes / (1 << 20));
  printf("| peak RSS at the end | %.1f MiB (%.2fx weights) |\n", rss_end, rss_end / weights_mib);
  printf("| prefill %d tokens (best of %d) | %.1f ms, %.0f tokens/s |\n", prompt_len, repeat,
         best_prefill * 1e3, prompt_len / best_prefill);
  printf("| greedy decode, batch 1, %d steps after %d | %.2f ms/token, %.1f tokens/s |\n",
         decode_steps, prompt_len, decode_s * 1e3 / decode_steps, decode_steps / decode_s);
  printf("| decode, batch %d, %d steps at ~%d context | %.2f ms/step, %.1f tokens/s |\n", batch,
         steps8, ctx, decode8_s * 1e3 / steps8, batch * steps8 / decode8_s);
  free(prompt);
  free(tables);
  tw_kv_blocks_destroy(kb);
  tw_engine_destroy(e);
  tw_model_destroy(m);
  return 0;
}
