/* test_prefill_batch.c: batched (variable-length) prefill on the CPU backend
 * (engine.h tw_engine_prefill_batch) against each prompt's prefill alone.
 * The CPU backend is the fp32 reference and computes every token row the
 * same way whatever else is in the pass, so the comparison is exact:
 *   - the first token of every prompt (greedy, and sampled with a seed),
 *   - its last-position logits (bit for bit),
 *   - the whole KV pool (bit for bit: every layer, K and V, every position),
 * for prompts of 1 to 300 tokens (past the sliding window of 32), one that
 * continues a prefix already in the cache (start_pos > 0), in one pass and
 * with a small pass budget that splits prompts over passes and a segment
 * limit (max_batch). on_layer_done must cover every (prompt, layer,
 * position) exactly once, in position order, and only once that layer's
 * K/V are final (checked against the reference pool inside the
 * callback). Errors: a bad token in any prompt and two prompts writing one
 * block are refused before anything runs. With the window ring (engine.h,
 * on by default on the cpu backend) the sliding layers keep only their
 * ring: the pools are compared at every position still live at the end
 * (full layers: all; ring layers: the last R blocks of each prompt). */
#include "common/engine/engine.h"
#include "common/engine/sampling.h"
#include "common/kv/kv_ring.h"
#include "common/model/model.h"

#include "test_util.h"

#include <stdlib.h>
#include <string.h>

enum { S = 7, BS = 16, NBLK = 160 };

static const int32_t k_len[S] = {1, 7, 16, 33, 300, 100, 58};

typedef struct {
  int32_t tokens[S][300];
  int32_t table[S][32];
  int32_t n_blocks[S];
  int32_t prefix; /* prompt 6 continues positions 0..prefix-1 already in the cache */
} tw_prompts_t;

static void tw_prompts_make(tw_prompts_t *p, int32_t vocab) {
  uint64_t seed = 11;
  int32_t next = 3; /* scattered, disjoint block ids */
  for (int s = 0; s < S; s++) {
    for (int i = 0; i < k_len[s]; i++) p->tokens[s][i] = (int32_t)(tw_test_rand_u64(&seed) % vocab);
    p->n_blocks[s] = (k_len[s] + BS - 1) / BS;
    for (int b = 0; b < p->n_blocks[s]; b++) {
      p->table[s][b] = next;
      next = (next + 7) % NBLK;
    }
  }
  p->prefix = 20;
}

static tw_engine_t *tw_engine_make(const tw_model_t *m, int32_t chunk, int32_t max_batch) {
  tw_engine_params_t ep = TW_ENGINE_PARAMS_DEFAULT;
  ep.backend = TW_BACKEND_CPU;
  ep.kv_block_size = BS;
  ep.kv_num_blocks = NBLK;
  ep.n_threads = 2;
  ep.max_prefill_chunk = chunk;
  ep.max_batch = max_batch;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &ep, &e) != TW_OK) {
    fprintf(stderr, "engine: %s\n", tw_last_error());
    return NULL;
  }
  return e;
}

/* Per (prompt, layer): positions reported done, and the reference pool. */
typedef struct {
  const tw_kv_layout_t *kv, *ref;
  const tw_prompts_t *p;
  const tw_prefill_seq_t *seqs;
  int32_t covered[S][4];
  int early, bad;
} tw_cb_state_t;

static const float *tw_kv_pos(const tw_kv_layout_t *kv, int32_t layer, const int32_t *table,
                              int32_t pos, int kvi, int32_t g) {
  return (const float *)((const char *)kv->base + tw_test_kv_offset(kv, layer, table, pos, kvi, g));
}

static void tw_on_layer(void *arg, int32_t seq, int32_t layer, int32_t start, int32_t n) {
  tw_cb_state_t *c = arg;
  if (seq < 0 || seq >= S || layer < 0 || layer >= 4) {
    c->bad++;
    return;
  }
  const tw_prefill_seq_t *q = &c->seqs[seq];
  if (start != q->start_pos + c->covered[seq][layer] || n <= 0) c->bad++;
  c->covered[seq][layer] += n;
  /* ring layers: the reference keeps only the prompt's last R blocks */
  int32_t from = tw_test_kv_live_from(c->kv, layer, q->start_pos + q->n_tokens);
  if (from < start) from = start;
  for (int32_t pos = from; pos < start + n; pos++) /* final already: equal to the reference */
    for (int kvi = 0; kvi < 2; kvi++)
      for (int32_t g = 0; g < c->kv->n_kv_heads_local; g++)
        if (memcmp(tw_kv_pos(c->kv, layer, q->block_table, pos, kvi, g),
                   tw_kv_pos(c->ref, layer, q->block_table, pos, kvi, g),
                   sizeof(float) * (size_t)c->kv->head_dim) != 0)
          c->early++;
}

int main(void) {
  tw_model_t *m = NULL;
  if (tw_test_load_tiny(&m)) return 1;
  const int32_t V = m->config.vocab_size, L = m->config.n_layers;
  if (L != 4) {
    fprintf(stderr, "fixture has %d layers, the test is written for 4\n", L);
    return 1;
  }
  static tw_prompts_t p;
  tw_prompts_make(&p, V);
  static float ref_logits[S][8064], ref_logits_s[S][8064], got_logits[S][8064];
  if (V > 8064) return 1;
  int32_t ref_tok[S], ref_tok_s[S];
  tw_sample_params_t sp = {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .seed = 42};

  /* reference: each prompt alone (prompt 6 as its prefix, then the rest) */
  tw_engine_t *ref = tw_engine_make(m, 8192, 1);
  EXPECT(ref != NULL, "reference engine");
  if (!ref) return 1;
  for (int s = 0; s < S; s++) {
    int32_t from = s == 6 ? p.prefix : 0;
    if (from) {
      tw_prefill_args_t a0 = {.tokens = p.tokens[s], .n_tokens = from, .block_table = p.table[s],
                              .n_blocks = p.n_blocks[s]};
      EXPECT(tw_engine_prefill(ref, &a0) == TW_OK, "prefix: %s", tw_last_error());
    }
    tw_prefill_args_t a = {.tokens = p.tokens[s] + from, .n_tokens = k_len[s] - from,
                           .start_pos = from, .block_table = p.table[s],
                           .n_blocks = p.n_blocks[s], .logits_out = ref_logits[s],
                           .next_token_out = &ref_tok[s]};
    EXPECT(tw_engine_prefill(ref, &a) == TW_OK, "prompt %d alone: %s", s, tw_last_error());
  }
  const tw_kv_layout_t *rkv = tw_engine_kv_layout(ref);
  /* the sampled first tokens: same engine state, rerun each prompt alone */
  tw_engine_t *ref2 = tw_engine_make(m, 8192, 1);
  if (!ref2) return 1;
  for (int s = 0; s < S; s++) {
    int32_t from = s == 6 ? p.prefix : 0;
    if (from) {
      tw_prefill_args_t a0 = {.tokens = p.tokens[s], .n_tokens = from, .block_table = p.table[s],
                              .n_blocks = p.n_blocks[s]};
      EXPECT(tw_engine_prefill(ref2, &a0) == TW_OK, "prefix: %s", tw_last_error());
    }
    tw_prefill_args_t a = {.tokens = p.tokens[s] + from, .n_tokens = k_len[s] - from,
                           .start_pos = from, .block_table = p.table[s],
                           .n_blocks = p.n_blocks[s], .logits_out = ref_logits_s[s],
                           .sample = &sp, .next_token_out = &ref_tok_s[s]};
    EXPECT(tw_engine_prefill(ref2, &a) == TW_OK, "prompt %d sampled: %s", s, tw_last_error());
    /* drawn at the position of the token it produces (k_len: the one after
     * the prompt), as a decode step draws at its position + 1 */
    int32_t want = -1;
    EXPECT(
        tw_sample(ref_logits_s[s], V, &sp, k_len[s], NULL, &want) == TW_OK && want == ref_tok_s[s],
        "prompt %d: sampled %d, tw_sample of its logits at position %d gives %d", s, ref_tok_s[s],
        k_len[s], want);
  }
  tw_engine_destroy(ref2);

  /* batched: one big pass; a small budget (prompts split over passes); a
   * segment limit of 3 */
  const struct { int32_t chunk, max_batch; } cfgs[] = {{8192, 256}, {48, 256}, {4096, 3}, {37, 2}};
  for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
    for (int sampled = 0; sampled < 2; sampled++) {
      tw_engine_t *e = tw_engine_make(m, cfgs[ci].chunk, cfgs[ci].max_batch);
      if (!e) return 1;
      const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
      tw_prefill_args_t a0 = {.tokens = p.tokens[6], .n_tokens = p.prefix,
                              .block_table = p.table[6], .n_blocks = p.n_blocks[6]};
      EXPECT(tw_engine_prefill(e, &a0) == TW_OK, "prefix: %s", tw_last_error());
      tw_prefill_seq_t seqs[S];
      int32_t tok[S];
      for (int s = 0; s < S; s++) {
        int32_t from = s == 6 ? p.prefix : 0;
        tok[s] = -1;
        seqs[s] = (tw_prefill_seq_t){.tokens = p.tokens[s] + from, .n_tokens = k_len[s] - from,
                                     .start_pos = from, .block_table = p.table[s],
                                     .n_blocks = p.n_blocks[s],
                                     .logits_out = s % 2 ? got_logits[s] : NULL,
                                     .sample = sampled ? &sp : NULL, .next_token_out = &tok[s]};
      }
      tw_cb_state_t cb = {.kv = kv, .ref = rkv, .p = &p, .seqs = seqs};
      tw_prefill_batch_args_t ba = {.n_seqs = S, .seqs = seqs, .on_layer_done = tw_on_layer,
                                    .on_layer_arg = &cb};
      EXPECT(tw_engine_prefill_batch(e, &ba) == TW_OK, "batch (chunk %d, max_batch %d): %s",
                cfgs[ci].chunk, cfgs[ci].max_batch, tw_last_error());
      for (int s = 0; s < S; s++) {
        int32_t want = sampled ? ref_tok_s[s] : ref_tok[s];
        EXPECT(tok[s] == want, "chunk %d max_batch %d sampled %d: prompt %d (%d tokens): "
                  "first token %d, alone %d", cfgs[ci].chunk, cfgs[ci].max_batch, sampled, s,
                  k_len[s], tok[s], want);
        if (s % 2)
          EXPECT(memcmp(got_logits[s], sampled ? ref_logits_s[s] : ref_logits[s],
                           sizeof(float) * (size_t)V) == 0,
                    "chunk %d: prompt %d: last logits differ from its prefill alone (rel L2 %g)",
                    cfgs[ci].chunk, s, tw_test_rel_l2_ff(got_logits[s], ref_logits[s], V));
        for (int l = 0; l < L; l++)
          EXPECT(cb.covered[s][l] == seqs[s].n_tokens,
                    "prompt %d layer %d: on_layer_done covered %d of %d positions", s, l,
                    cb.covered[s][l], seqs[s].n_tokens);
      }
      EXPECT(cb.bad == 0 && cb.early == 0,
                "on_layer_done: %d calls out of order, %d K/V rows not final when reported",
                cb.bad, cb.early);
      int diff = kv->total_bytes != rkv->total_bytes;
      for (int s = 0; s < S && !diff; s++) /* every live position, every layer */
        for (int l = 0; l < L; l++) {
          for (int32_t pos = tw_test_kv_live_from(kv, l, k_len[s]); pos < k_len[s]; pos++)
            for (int kvi = 0; kvi < 2; kvi++)
              for (int32_t g = 0; g < kv->n_kv_heads_local; g++)
                diff |= memcmp(tw_kv_pos(kv, l, p.table[s], pos, kvi, g),
                               tw_kv_pos(rkv, l, p.table[s], pos, kvi, g),
                               sizeof(float) * (size_t)kv->head_dim) != 0;
        }
      EXPECT(!diff, "chunk %d max_batch %d: the KV pool differs from the prompts' prefill alone",
             cfgs[ci].chunk, cfgs[ci].max_batch);
      tw_engine_destroy(e);
    }
  }

  /* errors: nothing runs, the message names the prompt */
  tw_engine_t *e = tw_engine_make(m, 8192, 256);
  if (!e) return 1;
  const tw_kv_layout_t *kv = tw_engine_kv_layout(e);
  tw_prefill_seq_t seqs[2] = {
      {.tokens = p.tokens[1], .n_tokens = k_len[1], .block_table = p.table[1], .n_blocks = 1},
      {.tokens = p.tokens[2], .n_tokens = k_len[2], .block_table = p.table[2], .n_blocks = 1}};
  int32_t badtok[16];
  memcpy(badtok, p.tokens[2], sizeof badtok);
  badtok[5] = V;
  seqs[1].tokens = badtok;
  tw_prefill_batch_args_t ba = {.n_seqs = 2, .seqs = seqs};
  EXPECT(tw_engine_prefill_batch(e, &ba) == TW_ERR_INVALID_ARGUMENT, "token id V in seqs[1]");
  EXPECT(strstr(tw_last_error(), "seqs[1]") != NULL, "message names the prompt: %s",
            tw_last_error());
  const float *k0 = tw_kv_pos(kv, 0, p.table[1], 0, 0, 0);
  int touched = 0;
  for (int d = 0; d < kv->head_dim; d++) touched |= k0[d] != 0.0f;
  EXPECT(!touched, "a refused batch wrote the K/V of its valid prompt");
  seqs[1].tokens = p.tokens[2];
  seqs[1].block_table = p.table[1]; /* both write block table[1][0] */
  EXPECT(tw_engine_prefill_batch(e, &ba) == TW_ERR_INVALID_ARGUMENT, "shared block");
  seqs[1].block_table = p.table[2];
  EXPECT(tw_engine_prefill_batch(e, &ba) == TW_OK, "valid batch: %s", tw_last_error());
  ba.n_seqs = 0;
  EXPECT(tw_engine_prefill_batch(e, &ba) == TW_ERR_INVALID_ARGUMENT, "n_seqs 0");
  EXPECT(tw_engine_prefill_batch(e, NULL) == TW_ERR_INVALID_ARGUMENT, "NULL args");
  EXPECT(tw_engine_prefill_batch(NULL, &ba) == TW_ERR_INVALID_ARGUMENT, "NULL engine");
  tw_engine_destroy(e);
  tw_engine_destroy(ref);
  tw_model_destroy(m);
  return tw_test_exit("test_prefill_batch");
}
