/* test_mem_plan.c: the memory plan (common/engine/mem_plan.h) on gpt-oss-20b and
 * gpt-oss-120b shapes, one or two workers on a device, separate or shared
 * weights, GPUs of given sizes (H200, H100, a 24 GB card), the cpu rule,
 * flags overriding, errors.
 *
 * Device sizes are what cudaMemGetInfo reports as total: H200 143,771 MiB,
 * H100 SXM 80 GB 81,559 MiB, a 24 GB card 24,564 MiB (nvidia-smi). The
 * workspace is a stand-in with the CUDA engine's shape (tw_ce_carve):
 * 256 KiB of activations a token row (rows = max(max batch, chunk)), a f32
 * logits row of the vocabulary per decode sequence (at least 256 rows), and
 * 64 MiB of fixed buffers; 4 MiB a decode graph. Every expected figure
 * below is worked out by hand in its comment. With the CUDA backend built,
 * the 20b and 120b plans on one H200 are also made with the engine's own
 * workspace (tw_cuda_engine_workspace_bytes), printed (docs/operations.md
 * quotes them) and checked against bounds. */
#include "common/engine/mem_plan.h"

#include "test_util.h"

#include <string.h>

#define MIB ((int64_t)1 << 20)
#define GIB ((int64_t)1 << 30)
#define H200 (143771 * MIB)
#define H100 (81559 * MIB)
#define CARD24 (24564 * MIB)
/* the prefill bf16 copy of the experts (test_prefill_bf16 below) */
#define PBF16_20B 38220595200LL
#define PBF16_120B 229323571200LL /* 36 x 128 x 24,883,200 x 2 */

static tw_model_config_t gptoss(int big) {
  tw_model_config_t c;
  tw_config_gptoss(big, &c);
  return c;
}

static int64_t ws_model(void *arg, int32_t max_batch, int32_t chunk) {
  const tw_model_config_t *c = arg;
  int64_t rows = max_batch > chunk ? max_batch : chunk;
  int64_t lrows = max_batch > 256 ? max_batch : 256;
  return 64 * MIB + rows * 256 * 1024 + lrows * c->vocab_size * 4;
}

static tw_mem_plan_in_t gpu_in(const tw_model_config_t *c, int64_t total, int np, int nd,
                               bool shared, tw_mem_role_t role) {
  tw_mem_plan_in_t in;
  memset(&in, 0, sizeof in);
  in.total_bytes = total;
  in.cfg = c;
  in.kv_elem_bytes = 2;
  in.block_size = 16;
  in.n_prefill = np;
  in.n_decode = nd;
  in.shared_weights = shared;
  in.role = role;
  in.ws_bytes = ws_model;
  in.ws_arg = (void *)c;
  in.graph_bytes = 4 * MIB;
  return in;
}

#ifdef TWAIN_HAVE_CUDA
#include "common/engine/engine_impl.h"
/* the CUDA engine's own workspace (grouped-GEMM MoE, as on Hopper) */
static int64_t ws_cuda(void *arg, int32_t max_batch, int32_t chunk) {
  return tw_cuda_engine_workspace_bytes(arg, 16, max_batch, chunk, 1);
}
static int32_t graphs_cuda(void *arg, int32_t max_batch) {
  return tw_cuda_engine_graph_count(arg, max_batch);
}

/* The plans docs/operations.md quotes: 20b and 120b, one prefill and one
 * decode worker sharing one H200 and one copy of the weights, with the
 * engine's real workspace and graph count and 4 MiB a decode graph. */
static void test_cuda_workspace(const tw_model_config_t *c20, const tw_model_config_t *c120) {
  for (int big = 0; big < 2; big++) {
    const tw_model_config_t *c = big ? c120 : c20;
    tw_mem_plan_in_t in = gpu_in(c, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
    in.ws_bytes = ws_cuda;
    in.graph_count = graphs_cuda;
    tw_mem_plan_t p;
    tw_status_t st = tw_mem_plan(&in, &p);
    printf("-- cuda workspace, %s, H200, 1 prefill + 1 decode, shared weights\n",
           big ? "120b" : "20b");
    for (int i = 0; i < p.n_lines; i++) printf("   %s\n", p.lines[i]);
    /* a decode workspace between 0.1 and 4 GiB at max batch 1,024 or 512;
     * the prefill worker's at 8,192 tokens between 0.5 and 8 GiB */
    int64_t ws = tw_cuda_engine_workspace_bytes(c, 16, 64, 8192, 1);
    EXPECT(st == TW_OK && ws > GIB / 2 && ws < 8 * GIB, "%s: prefill workspace %lld",
              big ? "120b" : "20b", (long long)ws);
    EXPECT(p.workspace_bytes > GIB / 10 && p.workspace_bytes < 4 * GIB, "decode ws %lld",
              (long long)p.workspace_bytes);
    /* 120b keeps more than 40 GiB of decode KV at max batch >= 256; 20b
     * more than 90 GiB at 1,024 */
    EXPECT(big ? p.kv_bytes > 40 * GIB && p.max_batch >= 256
                  : p.kv_bytes > 90 * GIB && p.max_batch == 1024,
              "kv %.2f GiB batch %d", p.kv_bytes / (double)GIB, p.max_batch);
  }
  /* 20b with the prefill worker's bf16 copy of the experts (prefill_bf16 0,
   * auto: kept where it fits): the decode worker keeps max batch 1,024 and
   * over 60 GiB */
  tw_mem_plan_in_t in = gpu_in(c20, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.ws_bytes = ws_cuda;
  in.graph_count = graphs_cuda;
  in.prefill_bf16_bytes = PBF16_20B;
  tw_mem_plan_t p;
  tw_status_t st = tw_mem_plan(&in, &p);
  printf("-- cuda workspace, 20b, H200, 1 prefill + 1 decode, shared weights, prefill bf16 copy\n");
  for (int i = 0; i < p.n_lines; i++) printf("   %s\n", p.lines[i]);
  EXPECT(st == TW_OK && p.prefill_bf16 && p.max_batch == 1024 && p.kv_bytes > 60 * GIB,
         "bf16 %d batch %d kv %.2f GiB", p.prefill_bf16, p.max_batch, p.kv_bytes / (double)GIB);
}
#endif

static void show(const char *what, const tw_mem_plan_t *p) {
  printf("-- %s\n", what);
  for (int i = 0; i < p->n_lines; i++) printf("   %s\n", p->lines[i]);
}

static bool has_line(const tw_mem_plan_t *p, const char *needle) {
  for (int i = 0; i < p->n_lines; i++)
    if (strstr(p->lines[i], needle)) return true;
  return false;
}

static TW_NODISCARD tw_status_t plan(const tw_mem_plan_in_t *in, tw_mem_plan_t *p,
                                     const char *what) {
  tw_status_t st = tw_mem_plan(in, p);
  if (st == TW_OK) show(what, p);
  else printf("-- %s: %s\n", what, tw_last_error());
  return st;
}

static void test_weights(const tw_model_config_t *c20, const tw_model_config_t *c120) {
  int64_t mx, rest;
  /* 20b: 24 layers x 32 experts x (2I x H + H x I) values x (1/2 + 1/32)
   * bytes = 10,152,345,600; the whole ~13.77 GB against the Hugging Face
   * checkpoint's 13.76 GB (its biases are bf16, ours f32: a little more) */
  int64_t w = tw_mem_weight_bytes(c20, &mx, &rest);
  EXPECT(mx == 10152345600LL, "20b mxfp4 bytes %lld", (long long)mx);
  EXPECT(w == mx + rest && w > 13.6e9 && w < 14.0e9, "20b weights %lld", (long long)w);
  /* 120b: 36 x 128 experts: 60,914,073,600; the whole ~65.3 GB (checkpoint 65.25 GB) */
  w = tw_mem_weight_bytes(c120, &mx, &rest);
  EXPECT(mx == 60914073600LL, "120b mxfp4 bytes %lld", (long long)mx);
  EXPECT(w == mx + rest && w > 64.5e9 && w < 66.5e9, "120b weights %lld", (long long)w);
  tw_model_config_t b = *c20;
  b.mxfp4 = false; /* bf16 experts: 2 bytes a value */
  w = tw_mem_weight_bytes(&b, &mx, &rest);
  EXPECT(mx == 0 && rest > 2 * 10152345600LL * 32 / 17, "bf16 experts %lld", (long long)rest);
}

/* The window ring (kv_ring.h): the same device and budget hold about twice
 * the positions, since past the window a token costs only the full layers.
 * 20b: 12 of 24 layers slide (window 128): a block over the full layers is
 * 12 x 2 x 8 x 64 x 2 x 16 = 393,216 bytes, and so is a ring block over the
 * sliding ones; R = ceil(128 / 16) + 1 = 9 ring blocks a sequence, rings for
 * TW_MEM_RING_SEQS x max batch sequences. With K bytes of KV and max batch
 * b: without the ring K / 786,432 blocks, with it (K - 2 b x 9 x 393,216) /
 * 393,216 = 2 x that - 18 b (up to rounding). */
static void test_window_ring(const tw_model_config_t *c20, const tw_model_config_t *c120) {
  tw_mem_plan_t off, on;
  tw_mem_plan_in_t in = gpu_in(c20, H200, 0, 1, false, TW_MEM_ROLE_DECODE);
  in.max_batch = 128;
  EXPECT(tw_mem_plan(&in, &off) == TW_OK, "20b no ring: %s", tw_last_error());
  in.window_ring = true;
  EXPECT(tw_mem_plan(&in, &on) == TW_OK, "20b ring: %s", tw_last_error());
  int64_t want = 2 * (int64_t)off.kv_blocks - 2 * 128 * 9;
  printf(
      "-- window ring, 20b H200 decode at max batch 128: %d blocks (%.2f GiB) without, %d "
      "blocks + %d ring blocks (%.2f GiB) with: %.3fx the positions\n",
      off.kv_blocks, off.kv_bytes / (double)GIB, on.kv_blocks, on.kv_ring_blocks,
      on.kv_bytes / (double)GIB, (double)on.kv_blocks / off.kv_blocks);
  EXPECT(on.kv_blocks >= want - 2 && on.kv_blocks <= want + 2 && on.kv_ring_blocks == 2 * 128 * 9,
         "20b ring: %d blocks (want %lld), %d ring blocks", on.kv_blocks, (long long)want,
         on.kv_ring_blocks);
  EXPECT(on.kv_bytes <= off.kv_bytes + 786432 && on.kv_bytes > off.kv_bytes - 786432,
         "same bytes: %lld vs %lld", (long long)on.kv_bytes, (long long)off.kv_bytes);
  EXPECT(has_line(&on, "window ring: 12 sliding layers keep 9 blocks"), "the ring's line");
  /* issue 17: 20b at batch 128 and 32k context fits only with the ring */
  int64_t need = 128LL * 32768;
  EXPECT((int64_t)on.kv_blocks * 16 >= need && (int64_t)off.kv_blocks * 16 < need,
         "20b batch 128 at 32k: %lld positions with the ring, %lld without, %lld needed",
         (long long)on.kv_blocks * 16, (long long)off.kv_blocks * 16, (long long)need);
  /* 120b (18 of 36 layers slide) at batch 256 and 8k: 2,097,152 positions
   * of 36 KiB (the full layers) + 2 x 256 x 9 ring blocks of 589,824 bytes
   * = about 74.5 GiB of KV: the weights (60.8 GiB) leave that with a decode
   * worker alone at utilization 0.98 */
  in = gpu_in(c120, H200, 0, 1, false, TW_MEM_ROLE_DECODE);
  in.max_batch = 256;
  in.utilization = 0.98;
  EXPECT(tw_mem_plan(&in, &off) == TW_OK, "120b no ring: %s", tw_last_error());
  in.window_ring = true;
  EXPECT(tw_mem_plan(&in, &on) == TW_OK, "120b ring: %s", tw_last_error());
  need = 256LL * 8192;
  printf(
      "-- window ring, 120b H200 decode at max batch 256, utilization 0.98: %lld positions "
      "without, %lld with (%lld needed)\n",
      (long long)off.kv_blocks * 16, (long long)on.kv_blocks * 16, (long long)need);
  EXPECT((int64_t)on.kv_blocks * 16 >= need && (int64_t)off.kv_blocks * 16 < need,
         "120b batch 256 at 8k: %lld positions with the ring, %lld without",
         (long long)on.kv_blocks * 16, (long long)off.kv_blocks * 16);
}

/* The prefill workers' bf16 copy of the experts (mem_plan.h, the cuda
 * engine's prefill_bf16_experts): 20b's is 24 layers x 32 experts x (2I x H
 * + H x I) x 2 bytes = 38,220,595,200 = 48,600 blocks of 16 x 48 KiB
 * exactly (no window ring here). */
static int64_t ws_split(void *arg, int32_t max_batch, int32_t chunk) {
  (void)arg; /* a prefill worker's (64 prompts, a token budget) 2 GiB, a decode worker's 2.8 */
  return max_batch == chunk ? 2 * GIB + 8 * GIB / 10 : 2 * GIB;
}
static void test_prefill_bf16(const tw_model_config_t *c20, const tw_model_config_t *c120) {
  tw_mem_plan_t p;
  /* 20b, H200, 1 + 1 sharing the weights: budget - weights - reserves =
   * 135,679,559,270 - 13,774,924,416 - 2 GiB = 119.76 GB; 40% of it holds
   * the 38.22 GB copy, so with auto the prefill worker keeps one: its
   * workspace grows by the copy and the decode pool shrinks by exactly
   * 48,600 blocks (120,920 + 17,516 without, batch 1,024 still fits) */
  tw_mem_plan_in_t in = gpu_in(c20, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.prefill_bf16_bytes = PBF16_20B;
  EXPECT(plan(&in, &p, "20b H200 1+1 shared, prefill bf16 auto: decode") == TW_OK, "%s",
         tw_last_error());
  EXPECT(p.prefill_bf16 && p.prefill_bf16_bytes == PBF16_20B && p.max_batch == 1024 &&
             p.kv_blocks == 120920 + 17516 - 48600,
         "bf16 %d batch %d blocks %d", p.prefill_bf16, p.max_batch, p.kv_blocks);
  in.role = TW_MEM_ROLE_PREFILL;
  tw_mem_plan_t q;
  EXPECT(plan(&in, &q, "20b H200 1+1 shared, prefill bf16 auto: prefill") == TW_OK, "%s",
         tw_last_error());
  in.prefill_bf16_bytes = 0; /* the same worker without a copy to hold */
  tw_mem_plan_t r;
  EXPECT(plan(&in, &r, "20b H200 1+1 shared, no copy: prefill") == TW_OK, "%s", tw_last_error());
  EXPECT(q.prefill_bf16 && q.workspace_bytes == r.workspace_bytes + PBF16_20B &&
             q.kv_blocks == 8704 && r.kv_blocks == 8704 && q.decode_kv_blocks == p.kv_blocks &&
             !r.prefill_bf16 && has_line(&q, "a bf16 copy of the experts for the prefill MoE"),
         "ws %lld / %lld blocks %d / %d", (long long)q.workspace_bytes,
         (long long)r.workspace_bytes, q.kv_blocks, r.kv_blocks);
  /* turned off: the plan without it, the same as a backend with none */
  in = gpu_in(c20, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.prefill_bf16_bytes = PBF16_20B;
  in.prefill_bf16 = -1;
  EXPECT(plan(&in, &p, "20b H200 prefill bf16 off") == TW_OK && !p.prefill_bf16 &&
             p.kv_blocks == 120920 + 17516,
         "bf16 %d blocks %d", p.prefill_bf16, p.kv_blocks);
  /* 20b on an H100 (80 GB): 40% of 76.97 - 15.92 GB = 24.4 GB < 38.2: not with
   * auto; asked for, it fits (the decode pool keeps >= 4,096 tokens) */
  in = gpu_in(c20, H100, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.prefill_bf16_bytes = PBF16_20B;
  EXPECT(plan(&in, &p, "20b H100 prefill bf16 auto") == TW_OK && !p.prefill_bf16 &&
             has_line(&p, "no bf16 copy of the experts"),
         "bf16 %d", p.prefill_bf16);
  in.prefill_bf16 = 1;
  EXPECT(plan(&in, &p, "20b H100 prefill bf16 on") == TW_OK && p.prefill_bf16 &&
             (int64_t)p.kv_blocks * 16 >= TW_MEM_MIN_DECODE_TOKENS,
         "bf16 %d blocks %d", p.prefill_bf16, p.kv_blocks);
  /* 120b: 229 GB never fits an H200: not kept with auto, an error when asked */
  in = gpu_in(c120, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.prefill_bf16_bytes = PBF16_120B;
  EXPECT(plan(&in, &p, "120b H200 prefill bf16 auto") == TW_OK && !p.prefill_bf16 &&
             p.max_batch == 512 && p.kv_blocks == 47918,
         "bf16 %d batch %d blocks %d", p.prefill_bf16, p.max_batch, p.kv_blocks);
  in.prefill_bf16 = 1;
  EXPECT(plan(&in, &p, "120b H200 prefill bf16 on") == TW_ERR_NO_MEMORY, "120b copy forced");
  /* by the share rule but no fit: budget - fixed = 8 GiB, a 3 GiB copy (<=
   * 40%), workspaces of 2 GiB (prefill) and 2.8 GiB (decode): with the copy
   * every token budget leaves the decode worker under 4,096 tokens, without
   * it the plan fits, so the plan is made without it */
  in = gpu_in(c20, 0, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.ws_bytes = ws_split;
  in.prefill_bf16_bytes = 3 * GIB;
  in.total_bytes = (int64_t)((double)(tw_mem_weight_bytes(c20, NULL, NULL) + 10 * GIB) / 0.9) + 1;
  EXPECT(plan(&in, &p, "no fit with the copy") == TW_OK && !p.prefill_bf16 &&
             (int64_t)p.kv_blocks * 16 >= TW_MEM_MIN_DECODE_TOKENS,
         "bf16 %d blocks %d", p.prefill_bf16, p.kv_blocks);
  in.prefill_bf16 = 1;
  EXPECT(plan(&in, &p, "no fit with the copy, asked for") == TW_ERR_NO_MEMORY, "forced");
}

int main(void) {
  tw_model_config_t c20 = gptoss(0), c120 = gptoss(1);
  tw_mem_plan_t p;
  tw_mem_plan_in_t in;
  test_weights(&c20, &c120);
  test_window_ring(&c20, &c120);
  test_prefill_bf16(&c20, &c120);
#ifdef TWAIN_HAVE_CUDA
  test_cuda_workspace(&c20, &c120);
#endif
  /* budget = 0.90 x 143,771 MiB = 135.68 GB on an H200 (the C and Python
   * products differ by rounding only: checked through the block counts) */

  /* 20b, H200, a decode worker alone: KV 24 x 2 x 8 x 64 x 2 = 48 KiB a
   * token; max batch 1,024: workspace 64 MiB + 1024 x 256 KiB + 1024 x
   * 201,088 x 4 = 1,159,200,768, graphs 11 batch x 10 context buckets x
   * 4 MiB; kv = budget - 13,774,924,416 - 1 GiB - ws - graphs =
   * 119.21 GB = 151,583 blocks of 16 x 48 KiB */
  in = gpu_in(&c20, H200, 0, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "20b H200 decode alone") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 1024 && p.kv_blocks == 151583, "batch %d blocks %d", p.max_batch,
            p.kv_blocks);
  EXPECT(p.weight_copies == 1 && p.workspace_bytes == 1159200768LL + 110 * 4 * MIB,
            "copies %d ws %lld", p.weight_copies, (long long)p.workspace_bytes);
  EXPECT(p.n_lines >= 4 && has_line(&p, "max batch 1024") &&
            has_line(&p, "this decode worker: kv pool 151583 blocks"), "lines");

  /* 20b, H200, prefill + decode with a copy each: left = budget - 2 W -
   * 2 GiB - prefill ws (64 prompts: 64 MiB + 8192 x 256 KiB + 256 x V x 4); prefill kv:
   * context 131,072 + 8,192 tokens = 8,704 blocks (under left / 8 = 263k
   * tokens); decode: the rest at max batch 1,024 = 120,920 blocks */
  in = gpu_in(&c20, H200, 1, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "20b H200 1+1 separate: decode") == TW_OK, "%s", tw_last_error());
  EXPECT(p.weight_copies == 2 && p.max_batch == 1024 && p.kv_blocks == 120920 &&
            p.prefill_kv_blocks == 8704, "copies %d batch %d blocks %d prefill %d",
            p.weight_copies, p.max_batch, p.kv_blocks, p.prefill_kv_blocks);
  in.role = TW_MEM_ROLE_PREFILL; /* the other worker's view: the same plan, its own share */
  EXPECT(plan(&in, &p, "20b H200 1+1 separate: prefill") == TW_OK, "%s", tw_last_error());
  EXPECT(p.kv_blocks == 8704 && p.max_batch == 64 && p.prefill_tokens == 8192 &&
            p.decode_kv_blocks == 120920, "blocks %d batch %d tokens %d decode %d", p.kv_blocks,
            p.max_batch, p.prefill_tokens, p.decode_kv_blocks);
  /* shared weights: the decode pool gains one copy, 13,774,924,416 / (16 x
   * 48 KiB) = 17,516 blocks more */
  in = gpu_in(&c20, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "20b H200 1+1 shared: decode") == TW_OK, "%s", tw_last_error());
  EXPECT(p.weight_copies == 1 && p.kv_blocks == 120920 + 17516, "copies %d blocks %d",
            p.weight_copies, p.kv_blocks);

  /* 120b, H200, prefill + decode sharing one copy: KV 72 KiB a token;
   * left / 8 = 111,528 tokens < context + 8,192: the prefill pool is 6,971
   * blocks; decode at 1,024 would leave 740 tokens a sequence (< 1,024), at
   * 512 it leaves 1,497: max batch 512, 47,918 blocks (52.6 GiB) */
  in = gpu_in(&c120, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "120b H200 1+1 shared: decode") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 512 && p.kv_blocks == 47918 && p.prefill_kv_blocks == 6971,
            "batch %d blocks %d prefill %d", p.max_batch, p.kv_blocks, p.prefill_kv_blocks);
  EXPECT(p.kv_bytes > 50 * GIB, "120b decode kv %.2f GiB", p.kv_bytes / (double)GIB);
  EXPECT(!has_line(&p, "warning"), "no warning");
  /* two copies of the 120b weights (121.7 GiB + reserves of a 126.4 GiB
   * budget) leave a decode pool smaller than one context: planned at a
   * small batch, with the warning that names sharing */
  in.shared_weights = false;
  EXPECT(plan(&in, &p, "120b H200 1+1 separate") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch <= 8 && p.kv_bytes < GIB && has_line(&p, "sharing one copy"),
            "batch %d kv %lld", p.max_batch, (long long)p.kv_bytes);

  /* H100 80 GB: 120b alone decodes at a smaller batch; shared with a
   * prefill worker too (pools of 2 x 8,192 tokens for prefill) */
  in = gpu_in(&c120, H100, 0, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "120b H100 decode alone") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 128 && p.kv_blocks > 8000 && p.kv_blocks < 8800, "batch %d blocks %d",
            p.max_batch, p.kv_blocks);
  in = gpu_in(&c120, H100, 1, 1, true, TW_MEM_ROLE_PREFILL);
  EXPECT(plan(&in, &p, "120b H100 1+1 shared: prefill") == TW_OK, "%s", tw_last_error());
  EXPECT(p.kv_blocks == 1024 && p.prefill_tokens == 8192 && p.decode_max_batch == 64,
            "blocks %d tokens %d decode batch %d", p.kv_blocks, p.prefill_tokens,
            p.decode_max_batch);
  in = gpu_in(&c20, H100, 1, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "20b H100 1+1 separate") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 512, "batch %d", p.max_batch);

  /* a 24 GB card: 120b does not fit, with an error that says so */
  in = gpu_in(&c120, CARD24, 0, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "120b 24 GB") == TW_ERR_NO_MEMORY, "120b on 24 GB");
  EXPECT(strstr(tw_last_error(), "60.84 GiB") && strstr(tw_last_error(), "more memory"),
            "message: %s", tw_last_error());
  EXPECT(p.kv_blocks == 0 && p.n_lines == 0, "plan zeroed on error");
  /* 20b: two copies do not fit (the error names sharing), one shared does */
  in = gpu_in(&c20, CARD24, 1, 1, false, TW_MEM_ROLE_DECODE);
  EXPECT(plan(&in, &p, "20b 24 GB separate") == TW_ERR_NO_MEMORY, "20b x2 on 24 GB");
  EXPECT(strstr(tw_last_error(), "share one copy"), "message: %s", tw_last_error());
  in.shared_weights = true;
  EXPECT(plan(&in, &p, "20b 24 GB shared") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 64 && p.kv_blocks > 4000, "batch %d blocks %d", p.max_batch,
            p.kv_blocks);

  /* flags override this worker's figures; the rest of the plan stands */
  in = gpu_in(&c20, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.kv_blocks = 2048;
  EXPECT(plan(&in, &p, "--kv-blocks 2048") == TW_OK, "%s", tw_last_error());
  EXPECT(p.kv_blocks == 2048 && p.kv_bytes == 2048LL * 16 * 49152 && p.max_batch == 1024 &&
            has_line(&p, "from --kv-blocks"), "blocks %d batch %d", p.kv_blocks, p.max_batch);
  in.kv_blocks = 0;
  in.max_batch = 64; /* a smaller batch: smaller workspace, fewer graphs, a larger pool */
  EXPECT(plan(&in, &p, "--max-batch 64") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 64 && p.kv_blocks > 120920 + 17516 && has_line(&p, "from --max-batch"),
            "batch %d blocks %d", p.max_batch, p.kv_blocks);
  /* 64 x 131,072 tokens = 524,288 blocks: the pool is never larger */
  in.max_batch = 2;
  EXPECT(plan(&in, &p, "--max-batch 2") == TW_OK && p.kv_blocks == 2 * 8192, "blocks %d",
            p.kv_blocks);
  in = gpu_in(&c20, H200, 1, 1, true, TW_MEM_ROLE_PREFILL);
  in.prefill_tokens = 2048; /* context + 2,048 tokens = 8,320 blocks */
  EXPECT(plan(&in, &p, "prefill 2048") == TW_OK, "%s", tw_last_error());
  EXPECT(p.prefill_tokens == 2048 && p.kv_blocks == 8320, "tokens %d blocks %d",
            p.prefill_tokens, p.kv_blocks);
  in = gpu_in(&c120, H200, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.utilization = 0.5; /* 70.2 GiB: 120b leaves little, still a pool */
  EXPECT(plan(&in, &p, "utilization 0.5") == TW_OK, "%s", tw_last_error());
  EXPECT(p.budget_bytes == H200 / 2 && p.max_batch < 512, "budget %lld batch %d",
            (long long)p.budget_bytes, p.max_batch);

  /* free memory below this worker's share: its pool is cut to what is free
   * (minus 256 MiB); far below, an error */
  in = gpu_in(&c20, H200, 0, 1, false, TW_MEM_ROLE_DECODE);
  in.free_bytes = 20 * GIB; /* (20 GiB - 256 MiB - ws - graphs) / 786,432 */
  EXPECT(plan(&in, &p, "free 20 GiB") == TW_OK, "%s", tw_last_error());
  int64_t room = 20 * GIB - 256 * MIB - (1159200768LL + 110 * 4 * MIB);
  EXPECT(p.kv_blocks == room / 786432 && has_line(&p, "cut from 151583"), "blocks %d",
            p.kv_blocks);
  in.free_bytes = 1 * GIB;
  EXPECT(plan(&in, &p, "free 1 GiB") == TW_ERR_NO_MEMORY, "1 GiB free");
  EXPECT(strstr(tw_last_error(), "only 1.00 GiB"), "message %s", tw_last_error());

  /* the cpu rule: f32 KV, shared (mapped) weights, no reserve, at most
   * 64 sequences and 1 GiB of KV a worker */
  in = gpu_in(&c20, 64 * GIB, 1, 1, true, TW_MEM_ROLE_DECODE);
  in.kv_elem_bytes = 4;
  in.process_reserve = -1;
  in.graph_bytes = 0;
  in.max_batch_cap = 64;
  in.kv_cap_bytes = GIB; /* 1 GiB / (16 x 96 KiB) = 682 blocks */
  EXPECT(plan(&in, &p, "cpu 64 GiB") == TW_OK, "%s", tw_last_error());
  EXPECT(p.max_batch == 64 && p.kv_blocks == 682, "batch %d blocks %d", p.max_batch,
            p.kv_blocks);

  /* bad input */
  in = gpu_in(&c20, H200, 1, 0, false, TW_MEM_ROLE_DECODE);
  EXPECT(tw_mem_plan(&in, &p) == TW_ERR_INVALID_ARGUMENT, "decode role without a decode worker");
  in = gpu_in(&c20, H200, 0, 0, false, TW_MEM_ROLE_DECODE);
  EXPECT(tw_mem_plan(&in, &p) == TW_ERR_INVALID_ARGUMENT, "no workers");
  in = gpu_in(&c20, H200, 0, 1, false, TW_MEM_ROLE_DECODE);
  in.utilization = 1.5;
  EXPECT(tw_mem_plan(&in, &p) == TW_ERR_INVALID_ARGUMENT, "utilization 1.5");
  in.utilization = 0;
  in.kv_blocks = -1;
  EXPECT(tw_mem_plan(&in, &p) == TW_ERR_INVALID_ARGUMENT, "negative override");
  EXPECT(tw_mem_plan(NULL, &p) == TW_ERR_INVALID_ARGUMENT, "NULL input");

  /* flag parsers */
  double u = 0;
  EXPECT(tw_mem_parse_utilization("0.85", &u) == TW_OK && u == 0.85, "0.85 -> %f", u);
  EXPECT(tw_mem_parse_utilization("1", &u) == TW_OK && u == 1.0, "1");
  EXPECT(tw_mem_parse_utilization("0", &u) == TW_ERR_INVALID_ARGUMENT, "0");
  EXPECT(tw_mem_parse_utilization("1.2", &u) == TW_ERR_INVALID_ARGUMENT, "1.2");
  EXPECT(tw_mem_parse_utilization("0.9x", &u) == TW_ERR_INVALID_ARGUMENT, "0.9x");
  int32_t a = -1, b = -1;
  EXPECT(tw_mem_parse_colocated("1,2", &a, &b) == TW_OK && a == 1 && b == 2, "1,2");
  EXPECT(tw_mem_parse_colocated("0,0", &a, &b) == TW_ERR_INVALID_ARGUMENT, "0,0");
  EXPECT(tw_mem_parse_colocated("1", &a, &b) == TW_ERR_INVALID_ARGUMENT, "1");
  EXPECT(tw_mem_parse_colocated("1,2,3", &a, &b) == TW_ERR_INVALID_ARGUMENT, "1,2,3");
  return tw_test_exit("test_mem_plan");
}
