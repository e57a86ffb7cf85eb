/* test_proto_engine.c: the protocol <-> engine conversions of
 * common/comm/proto_engine.h, every field against values written out here:
 * sampling parameters (wire defaults read as sampling.h means them), a
 * decode pool's KvLayout both ways, and the request-staleness rule of the
 * prefill worker's KV-write guard (ages made by stamping requests in the
 * past: no test waits on a clock). */
#include "common/comm/proto_engine.h"
#include "tests/test_expect.h"

static void test_sampling(void) {
  tw_test_case = "sampling";
  tw_sample_params_t g = tw_proto_sample_params(NULL);
  EXPECT_EQ_F64(g.temperature, 0.0);
  EXPECT_EQ_I64(g.top_k, 0);
  EXPECT_EQ_F64(g.top_p, 1.0);
  EXPECT_EQ_I64(g.seed, 0);
  Twain__Internal__V1__Sampling s = TWAIN__INTERNAL__V1__SAMPLING__INIT;
  s.temperature = 0.75f;
  s.top_k = 40;
  s.top_p = 0.5f;
  s.seed = 0x1234567890abcdefULL;
  tw_sample_params_t p = tw_proto_sample_params(&s);
  EXPECT_EQ_F64(p.temperature, 0.75);
  EXPECT_EQ_I64(p.top_k, 40);
  EXPECT_EQ_F64(p.top_p, 0.5);
  EXPECT(p.seed == 0x1234567890abcdefULL, "seed %llx", (unsigned long long)p.seed);
  s.top_p = 0; /* unset on the wire: no nucleus cut */
  EXPECT_EQ_F64(tw_proto_sample_params(&s).top_p, 1.0);

  Twain__V1__SamplingParams a = TWAIN__V1__SAMPLING_PARAMS__INIT;
  a.temperature = 1.25f;
  a.top_p = 0.9f;
  a.top_k = 7;
  a.seed = 99;
  a.max_tokens = 12; /* not the Sampling's business */
  Twain__Internal__V1__Sampling q;
  tw_proto_sampling_from_api(&a, &q);
  EXPECT_EQ_F64(q.temperature, 1.25);
  EXPECT_EQ_F64(q.top_p, (double)0.9f);
  EXPECT_EQ_I64(q.top_k, 7);
  EXPECT_EQ_I64(q.seed, 99);
  q.top_k = 3;
  tw_proto_sampling_from_api(NULL, &q);
  EXPECT_TRUE(q.temperature == 0 && q.top_p == 0 && q.top_k == 0 && q.seed == 0);
}

/* The fields of a layout, in one order, as numbers: the KvLayout on the
 * wire and the transfer layer's struct compared against one list. */
#define TW_LAYOUT_FIELDS(l)                                                                        \
  {                                                                                                \
    (int64_t)(l).dtype, (int64_t)(l).on_device, (l).n_layers, (l).n_blocks, (l).block_size,        \
        (l).n_kv_heads, (l).head_dim, (l).layer_stride_bytes, (l).block_bytes,                     \
        (int64_t)(l).remote_base, (l).total_bytes, (l).staging_slot_bytes, (l).ring_blocks,        \
        (l).n_ring_blocks, (int64_t)(l).ring_layers                                                \
  }
static const char *const layout_names[] = {
    "dtype",       "on_device",          "n_layers",           "n_blocks",      "block_size",
    "n_kv_heads",  "head_dim",           "layer_stride_bytes", "block_bytes",   "remote_base",
    "total_bytes", "staging_slot_bytes", "ring_blocks",        "n_ring_blocks", "ring_layers"};

static void expect_fields(const char *what, const int64_t *got, const int64_t *want) {
  for (size_t i = 0; i < sizeof layout_names / sizeof layout_names[0]; i++)
    EXPECT(got[i] == want[i], "%s.%s = %lld, want %lld", what, layout_names[i], (long long)got[i],
           (long long)want[i]);
}

static void test_kv_layout(void) {
  tw_test_case = "kv layout";
  /* a 20b-like bf16 device pool of 1000 blocks, kv heads 4..7 of a TP rank,
   * with the window ring on the even (sliding) layers: 9 blocks a sequence,
   * 576 ring blocks */
  static const int64_t want[] = {
      TW_DTYPE_BF16,    1,         24,      1000, 16,  4,       64, 32768000, 32768,
      0x7f0012340000LL, 786432000, 8 << 20, 9,    576, 0x555555};
  tw_kv_remote_layout_t rl = {.dtype = TW_DTYPE_BF16,
                              .on_device = true,
                              .n_layers = 24,
                              .n_blocks = 1000,
                              .block_size = 16,
                              .n_kv_heads = 4,
                              .head_dim = 64,
                              .layer_stride_bytes = 32768000,
                              .block_bytes = 32768,
                              .remote_base = 0x7f0012340000ULL,
                              .total_bytes = 786432000,
                              .staging_slot_bytes = 8 << 20,
                              .ring_blocks = 9,
                              .n_ring_blocks = 576,
                              .ring_layers = 0x555555};
  Twain__Internal__V1__KvLayout k;
  tw_proto_kv_layout_from_remote(&rl, 4, &k);
  int64_t got_k[] = TW_LAYOUT_FIELDS(k);
  expect_fields("KvLayout", got_k, want);
  EXPECT_EQ_I64(k.kv_head_offset, 4);
  /* and back, through the wire encoding */
  uint8_t buf[256];
  size_t len = twain__internal__v1__kv_layout__pack(&k, buf);
  Twain__Internal__V1__KvLayout *u = twain__internal__v1__kv_layout__unpack(NULL, len, buf);
  EXPECT_TRUE(u != NULL);
  if (!u) return;
  tw_kv_remote_layout_t back;
  memset(&back, 0xa5, sizeof back);
  tw_proto_kv_layout_to_remote(u, &back);
  int64_t got_back[] = TW_LAYOUT_FIELDS(back);
  expect_fields("remote layout", got_back, want);
  twain__internal__v1__kv_layout__free_unpacked(u, NULL);
}

static void test_staleness(void) {
  tw_test_case = "staleness";
  int64_t now = tw_proto_unix_ms();
  EXPECT(now > 1600000000000LL, "unix ms %lld is not a wall clock", (long long)now);
  int64_t age = -1;
  /* unstamped: age 0, never stale */
  EXPECT_EQ_I64(tw_proto_age_ms(0), 0);
  EXPECT_TRUE(!tw_proto_stale(0, 1, &age));
  EXPECT_EQ_I64(age, 0);
  /* 30 s ago against the 20 s guard: stale, the age reported (a second of slack
   * for a slow machine between the two clock reads) */
  EXPECT_TRUE(tw_proto_stale(now - 30000, 20000, &age));
  EXPECT(age >= 30000 && age < 31000, "age %lld", (long long)age);
  /* 10 s ago: fresh; no limit (0): never stale */
  EXPECT_TRUE(!tw_proto_stale(now - 10000, 20000, NULL));
  EXPECT_TRUE(!tw_proto_stale(now - 30000, 0, NULL));
  EXPECT_OK(tw_proto_kv_write_guard(7, now - 10000, 20000));
  EXPECT_OK(tw_proto_kv_write_guard(7, 0, 20000));
  EXPECT_ERR(tw_proto_kv_write_guard(7, now - 30000, 20000), TW_ERR_DEADLINE,
             "request 7 was handed to this prefill worker 30");
  EXPECT_ERR(tw_proto_kv_write_guard(7, now - 30000, 20000), TW_ERR_DEADLINE,
             "more than 20000 ms: not writing its kv");
}

int main(void) {
  test_sampling();
  test_kv_layout();
  test_staleness();
  return tw_test_exit("test_proto_engine");
}
