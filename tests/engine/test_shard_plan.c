/* test_shard_plan.c: the TP/EP shard plan both backends use
 * (common/engine/shard_plan.h) on the gpt-oss-20b and -120b shapes and on small
 * hand-made configs: heads, experts and vocabulary rows of given ranks
 * (every figure worked out by hand in its comment), that the ranks of a
 * group cover each range exactly once, and every configuration fault
 * answered with TW_ERR_INVALID_ARGUMENT and a message naming the field. */
#include "common/engine/shard_plan.h"
#include "common/model/config.h"

#include "test_util.h"

#include <string.h>

static tw_engine_params_t params(int32_t tp, int32_t tp_rank, int32_t ep, int32_t ep_rank) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.tp_size = tp;
  p.tp_rank = tp_rank;
  p.ep_size = ep;
  p.ep_rank = ep_rank;
  return p;
}

/* rank `rank` of a group of `size`, tp and ep each 1 or size */
static tw_status_t plan(const tw_model_config_t *c, int32_t size, int32_t rank, int tp, int ep,
                        tw_shard_plan_t *s) {
  tw_engine_params_t p = params(tp ? size : 1, tp ? rank : 0, ep ? size : 1, ep ? rank : 0);
  memset(s, 0xab, sizeof *s);
  return tw_shard_plan_make(c, &p, size, rank, s);
}

static void expect_plan(const tw_shard_plan_t *s, int32_t q0, int32_t nq, int32_t kv0, int32_t nkv,
                        int32_t e0, int32_t e1, int32_t v0, int32_t nv, int32_t vp) {
  EXPECT_EQ_I64(s->q0, q0);
  EXPECT_EQ_I64(s->nq, nq);
  EXPECT_EQ_I64(s->kv0, kv0);
  EXPECT_EQ_I64(s->nkv, nkv);
  EXPECT_EQ_I64(s->e0, e0);
  EXPECT_EQ_I64(s->e1, e1);
  EXPECT_EQ_I64(s->v0, v0);
  EXPECT_EQ_I64(s->nv, nv);
  EXPECT_EQ_I64(s->vp, vp);
}

/* The ranks of a group of `size` cover heads, KV heads, experts and the
 * vocabulary in order, each row once. */
static void expect_cover(const tw_model_config_t *c, int32_t size, int tp, int ep) {
  int32_t q = 0, kv = 0, e = 0, v = 0;
  for (int32_t r = 0; r < size; r++) {
    tw_shard_plan_t s;
    EXPECT_OK(plan(c, size, r, tp, ep, &s));
    if (tp) {
      EXPECT(s.q0 == q && s.kv0 == kv && s.v0 == v, "size %d rank %d: q0 %d kv0 %d v0 %d", size, r,
             s.q0, s.kv0, s.v0);
      EXPECT(s.nv >= 1 && s.nv <= s.vp && s.vp % TW_SHARD_VOCAB_ALIGN == 0,
             "size %d rank %d: nv %d vp %d", size, r, s.nv, s.vp);
      q += s.nq;
      kv += s.nkv;
      v += s.nv;
    }
    if (ep) {
      EXPECT(s.e0 == e, "size %d rank %d: e0 %d, want %d", size, r, s.e0, e);
      e = s.e1;
    }
  }
  if (tp)
    EXPECT(q == c->n_heads && kv == c->n_kv_heads && v == c->vocab_size,
           "tp %d covers %d heads, %d kv heads, %d rows", size, q, kv, v);
  if (ep) EXPECT(e == c->n_experts, "ep %d covers %d experts", size, e);
}

static tw_model_config_t small(int32_t nq, int32_t nkv, int32_t e, int32_t v) {
  tw_model_config_t c;
  tw_config_gptoss(0, &c);
  c.n_heads = nq;
  c.n_kv_heads = nkv;
  c.n_experts = e;
  c.vocab_size = v;
  return c;
}

int main(void) {
  tw_model_config_t g20, g120;
  tw_config_gptoss(0, &g20);  /* 64 query heads, 8 KV heads, 32 experts, V 201088 */
  tw_config_gptoss(1, &g120); /* 64, 8, 128 experts, V 201088 */
  tw_shard_plan_t s;

  tw_test_case = "single rank";
  /* P = 1: everything on rank 0; vp = 201088 (already a multiple of 8) */
  EXPECT_OK(plan(&g20, 1, 0, 1, 1, &s));
  expect_plan(&s, 0, 64, 0, 8, 0, 32, 0, 201088, 201088);
  EXPECT(s.tp_size == 1 && s.tp_rank == 0 && s.ep_size == 1 && s.ep_rank == 0 && !s.dp_attention,
         "sizes and ranks of a single rank");
  tw_engine_params_t p = params(1, 0, 1, 0); /* no group at all */
  EXPECT_OK(tw_shard_plan_init(&g20, &p, "test", &s));
  expect_plan(&s, 0, 64, 0, 8, 0, 32, 0, 201088, 201088);

  /* Given ranks: q0 nq kv0 nkv e0 e1 v0 nv vp, each worked out by hand. */
  const tw_model_config_t c100 = small(6, 3, 6, 100), c10 = small(4, 2, 4, 10),
                          tiny = small(64, 8, 32, 8064);
  const struct {
    const char *name;
    const tw_model_config_t *c;
    int32_t size, rank;
    int tp, ep;
    int32_t want[9];
  } cases[] = {
      /* 64/2 = 32 heads, 8/2 = 4 KV heads; ceil(201088/2) = 100544 = 8 * 12568 */
      {"gpt-oss-20b tp 2 rank 1", &g20, 2, 1, 1, 0, {32, 32, 4, 4, 0, 32, 100544, 100544, 100544}},
      /* 8 heads from 56, 1 KV head (7); ceil(201088/8) = 25136 = 8 * 3142,
       * v0 = 7 * 25136 = 175952, nv = 201088 - 175952 = 25136 */
      {"gpt-oss-20b tp 8 rank 7", &g20, 8, 7, 1, 0, {56, 8, 7, 1, 0, 32, 175952, 25136, 25136}},
      /* 128/4 = 32 experts from 64; 16 heads from 32; 2 KV heads from 4;
       * ceil(201088/4) = 50272 = 8 * 6284, v0 = 100544 */
      {"gpt-oss-120b tp 4 ep 4 rank 2",
       &g120,
       4,
       2,
       1,
       1,
       {32, 16, 4, 2, 64, 96, 100544, 50272, 50272}},
      /* experts [7*16, 8*16); attention and vocabulary unsplit */
      {"gpt-oss-120b ep 8 rank 7", &g120, 8, 7, 0, 1, {0, 64, 0, 8, 112, 128, 0, 201088, 201088}},
      /* V 100, tp 3: ceil(100/3) = 34 -> vp 40; ranks [0,40) [40,80) [80,100) */
      {"V 100 tp 3 rank 0", &c100, 3, 0, 1, 0, {0, 2, 0, 1, 0, 6, 0, 40, 40}},
      {"V 100 tp 3 rank 2", &c100, 3, 2, 1, 0, {4, 2, 2, 1, 0, 6, 80, 20, 40}},
      /* V 10, tp 2: ceil(10/2) = 5 -> vp 8; ranks [0,8) [8,10) */
      {"V 10 tp 2 ep 2 rank 1", &c10, 2, 1, 1, 1, {2, 2, 1, 1, 2, 4, 8, 2, 8}},
      /* the tiny test model: V 8064, tp 4: 2016 rows each */
      {"V 8064 tp 4 rank 3", &tiny, 4, 3, 1, 0, {48, 16, 6, 2, 0, 32, 6048, 2016, 2016}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const int32_t *w = cases[i].want;
    tw_test_case = cases[i].name;
    EXPECT_OK(plan(cases[i].c, cases[i].size, cases[i].rank, cases[i].tp, cases[i].ep, &s));
    expect_plan(&s, w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]);
    EXPECT(s.tp_size == (cases[i].tp ? cases[i].size : 1) &&
               s.ep_size == (cases[i].ep ? cases[i].size : 1),
           "sizes tp %d ep %d", s.tp_size, s.ep_size);
  }

  tw_test_case = "cover";
  for (int32_t size = 1; size <= 8; size *= 2) {
    expect_cover(&g20, size, 1, 0);
    expect_cover(&g120, size, 0, 1);
    expect_cover(&g120, size, 1, 1);
  }
  expect_cover(&c100, 3, 1, 1);

  tw_test_case = "data-parallel attention";
  p = params(1, 0, 4, 1);
  p.dp_attention = 1;
  EXPECT_OK(tw_shard_plan_make(&g120, &p, 4, 1, &s));
  EXPECT(s.dp_attention == 1 && s.e0 == 32 && s.e1 == 64 && s.nq == 64,
         "dp ep 4 rank 1: dp %d experts [%d,%d) heads %d", s.dp_attention, s.e0, s.e1, s.nq);
  p = params(4, 1, 4, 1);
  p.dp_attention = 1;
  EXPECT_ERR(tw_shard_plan_make(&g120, &p, 4, 1, &s), TW_ERR_INVALID_ARGUMENT, "dp_attention");
  p = params(1, 0, 1, 0);
  p.dp_attention = 1;
  EXPECT_ERR(tw_shard_plan_make(&g120, &p, 0, 0, &s), TW_ERR_INVALID_ARGUMENT, "dp_attention");

  tw_test_case = "faults";
  p = params(2, 0, 1, 0);
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 0, 0, &s), TW_ERR_INVALID_ARGUMENT, "params.coll");
  EXPECT_ERR(tw_shard_plan_init(&g20, &p, "test", &s), TW_ERR_INVALID_ARGUMENT, "params.coll");
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 4, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "tp_size 2 is not the group size 4");
  p = params(2, 1, 1, 0);
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 2, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "tp_rank 1 is not the group rank 0");
  p = params(1, 0, 2, 1);
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 2, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "ep_rank 1 is not the group rank 0");
  p = params(2, 2, 1, 0);
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 2, 2, &s), TW_ERR_INVALID_ARGUMENT, "tp_rank 2");
  p = params(1, 0, 0, 0);
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 0, 0, &s), TW_ERR_INVALID_ARGUMENT, "ep_size 0");
  p = params(3, 0, 1, 0); /* 64 heads over 3 */
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 3, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "num_attention_heads 64 not divisible by tp_size 3");
  tw_model_config_t c = small(16, 8, 32, 201088);
  p = params(16, 0, 1, 0); /* 16 heads over 16 ranks, but 8 KV heads */
  EXPECT_ERR(tw_shard_plan_make(&c, &p, 16, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "num_key_value_heads 8 not divisible by tp_size 16");
  p = params(1, 0, 3, 2); /* 32 experts over 3 */
  EXPECT_ERR(tw_shard_plan_make(&g20, &p, 3, 2, &s), TW_ERR_INVALID_ARGUMENT,
             "num_local_experts 32 not divisible by ep_size 3");
  /* V 10, tp 4: ceil(10/4) = 3 -> vp 8; rank 3 would start at 24 >= 10 */
  c = small(4, 4, 4, 10);
  p = params(4, 0, 1, 0);
  EXPECT_ERR(tw_shard_plan_make(&c, &p, 4, 0, &s), TW_ERR_INVALID_ARGUMENT,
             "vocab_size 10 too small for tp_size 4");
  return tw_test_exit("test_shard_plan");
}
