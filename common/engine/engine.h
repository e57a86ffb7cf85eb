/* engine.h: the backend-agnostic engine interface (ARCHITECTURE.md "The
 * engine interface"). Workers are written against this only; `cpu` (fp32,
 * the reference) and `cuda` implement it behind engine_impl.h.
 *
 * KV cache. The engine owns a pool of `kv_num_blocks` blocks, each holding
 * `kv_block_size` token positions of every layer. Memory layout of the pool
 * (the handoff and re-sharding rely on it):
 *     [layer][block][k=0 | v=1][kv_head (local to this rank)][slot][head_dim]
 * in the engine's kv dtype (cpu: f32, cuda: bf16; kv_dtype fp8: e4m3 values
 * and a f32 scale per slot in each (k|v, kv_head) part, kv_fp8.h). K is stored post-RoPE
 * (spec §2.5). A sequence's block table lists its block ids in position
 * order: position p lives in block_table[p / kv_block_size], slot
 * p % kv_block_size. The block ids are handed out by the block manager of
 * kv_blocks.h, not by the engine.
 *
 * Window ring (kv_window_ring, on by default): sliding
 * layers only ever read the last `sliding_window` positions (spec §2.6), so
 * they keep only those: a sequence's sliding-layer K/V live in a ring of its
 * first R = ceil(window / block_size) + 1 table entries (kv_ring.h):
 * position p of a sliding layer is in block block_table[(p / kv_block_size)
 * % R], slot p % kv_block_size. Sliding layers hold only blocks
 * 0..n_ring_blocks-1 (a smaller region), full layers all n_blocks, so layer
 * l starts at tw_kv_layer_offset (kv_ring.h), no longer l x one stride; the
 * block manager gives every sequence ring-capable ids (< n_ring_blocks) for
 * its first R entries. Without the ring (ring_blocks 0) every layer holds
 * every position in block_table[p / kv_block_size]. */
#ifndef TW_COMMON_ENGINE_H
#define TW_COMMON_ENGINE_H

#include "common/base/status.h"
#include "common/engine/sampling.h"
#include "common/model/model.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_BACKEND_AUTO = 0, /* cuda if a GPU is usable, else cpu */
  TW_BACKEND_CPU = 1,
  TW_BACKEND_CUDA = 2,
} tw_backend_kind_t;

/** Parse "auto"/"cpu"/"cuda". Errors: TW_ERR_INVALID_ARGUMENT naming the value. */
TW_NODISCARD tw_status_t tw_backend_parse(const char *name, tw_backend_kind_t *kind_p);

/** The --backend option's parser (opts.h TW_OPT_FN; dst: tw_backend_kind_t *):
 *  0 with *dst set, or -1 with "must be auto, cpu or cuda, got 'X'" in err. */
int tw_backend_opt(const char *text, void *dst, char *err, size_t errlen);
const char *tw_backend_name(tw_backend_kind_t kind);

/** The backend `kind` stands for on this machine: TW_BACKEND_AUTO is cuda
 *  when this build has CUDA and a GPU is usable at run time, else cpu; cpu
 *  and cuda are returned as they are (whether cuda can run here is
 *  tw_engine_create's to answer: TW_ERR_UNSUPPORTED). Probes the CUDA driver
 *  on the first call (auto only). */
tw_backend_kind_t tw_backend_resolve(tw_backend_kind_t kind);

/** Whether `kind` (auto resolved as tw_backend_resolve) can create an
 *  engine on this machine: cpu always, cuda with a CUDA build and a usable
 *  GPU. */
bool tw_backend_usable(tw_backend_kind_t kind);

/** What a backend implements, for daemons to check options against before
 *  they create an engine (tw_backend_caps). */
typedef struct {
  /* computes on a GPU: one device per rank (tw_engine_params_t.device), the
   * ranks of a worker exchange device buffers over NCCL (collective.h
   * TW_COLL_NCCL); false: host memory, MPI (TW_COLL_HOST) */
  bool on_device;
  /* data-parallel attention (tw_engine_params_t.dp_attention) */
  bool dp_attention;
} tw_backend_caps_t;

/** The capabilities of backend `kind` (auto resolved as tw_backend_resolve):
 *  cpu {on_device false, dp_attention true}, cuda {on_device true,
 *  dp_attention false}. */
tw_backend_caps_t tw_backend_caps(tw_backend_kind_t kind);

typedef struct {
  tw_backend_kind_t backend;
  int32_t kv_block_size;   /* tokens per KV block (default 16) */
  int32_t kv_num_blocks;   /* blocks in the pool; 0 = backend picks from memory */
  int32_t max_batch;       /* most sequences in one decode step (default 256) */
  int32_t max_prefill_chunk; /* tokens per prefill chunk (default 8192) */
  int32_t n_threads;       /* cpu: worker threads for matmuls; 0 = all cores */
  int32_t device;          /* cuda: device ordinal */
  /* parallelism (issue 6): this process is rank tp_rank of tp_size for
   * attention and ep_rank of ep_size for experts; 1/0 means no split. */
  int32_t tp_size, tp_rank;
  int32_t ep_size, ep_rank;
  /* the worker's collective group (collective.h), borrowed; required when
   * tp_size or ep_size > 1 (each is then 1 or the group size). NULL default. */
  struct tw_coll *coll;
  /* data-parallel attention (issue 6): with ep_size = the group size and
   * tp_size = 1, each rank runs attention on its own sequences (its own
   * batch and KV pool) and the MoE runs over every rank's tokens (EP). All
   * ranks must call prefill/decode together (one forward per call per chunk). */
  int32_t dp_attention;
  /* memory plan (mem_plan.h). With mem_role set (1 prefill, 2 decode), the
   * engine plans its memory once its weights are in place: kv_num_blocks,
   * max_batch and max_prefill_chunk at 0 are planned, non-zero ones override.
   * mem_role 0 keeps the fixed counts above (kv_num_blocks 0: most of the
   * memory left, as before). */
  int32_t mem_role;
  int32_t mem_prefill_workers, mem_decode_workers; /* on this device, this one
                                                    * included; 0, 0: this one alone */
  double mem_utilization;  /* share of the device the workers on it use; 0: 0.90 */
  /* cuda: a directory private to the workers of one service (0700): the
   * first engine to create its weights there exports them through CUDA IPC,
   * the others on the same device and shard map that copy instead of
   * uploading their own. NULL: an own copy. */
  const char *weights_share_dir;
  /* window ring for the sliding layers (the top of this file): 1 on, -1 off,
   * 0 the backend's default (on for cpu and cuda) */
  int32_t kv_window_ring;
  /* blocks the sliding layers hold with the ring (kv_ring.h); 0: the memory
   * plan's (mem_role set), else kv_num_blocks (the ring's layout without its
   * saving) */
  int32_t kv_ring_blocks;
  /* KV cache dtype (kv_fp8.h tw_kv_dtype_t): 0 the backend's own (cpu f32,
   * cuda bf16), TW_KV_DTYPE_FP8 e4m3 with a scale per (token, kv head) */
  int32_t kv_dtype;
  /* cuda: a bf16 copy of the MXFP4 experts for the prefill MoE (dense
   * tensor-core GEMMs; mem_plan.h): 1 on, -1 off, 0 auto (the memory plan's
   * rule with mem_role set; off without a plan). Every worker on the device
   * takes the same setting: the decode workers plan around the copies. */
  int32_t prefill_bf16_experts;
} tw_engine_params_t;

#define TW_ENGINE_PARAMS_DEFAULT                                              \
  ((tw_engine_params_t){.backend = TW_BACKEND_AUTO, .kv_block_size = 16,      \
                        .kv_num_blocks = 0, .max_batch = 256,                 \
                        .max_prefill_chunk = 8192, .n_threads = 0, .device = 0, \
                        .tp_size = 1, .tp_rank = 0, .ep_size = 1, .ep_rank = 0})

/** Where the KV pool lives, for the transfer layer. */
typedef struct {
  tw_dtype_t dtype;          /* f32 (cpu) or bf16 (cuda); F8_E4M3: kv_fp8.h's layout */
  bool on_device;            /* true: device memory of `device` */
  int32_t device;
  int32_t n_layers;
  int32_t n_blocks;
  int32_t block_size;        /* tokens */
  int32_t n_kv_heads_local;  /* kv heads held by this rank */
  int32_t kv_head_offset;    /* first global kv head held by this rank */
  int32_t head_dim;
  void *base;                /* start of the pool */
  int64_t layer_stride_bytes; /* bytes of a full layer (n_blocks blocks); without
                               * the ring, between layer l and l+1 */
  int64_t block_bytes;       /* bytes of one block of one layer (K and V) */
  int64_t total_bytes;
  /* the window ring (top of this file): ring_blocks R per sequence, 0 = no
   * ring; ring layers (bit l of ring_layers: layer l) hold only blocks
   * 0..n_ring_blocks-1 (= n_blocks without the ring) */
  int32_t ring_blocks;
  int32_t n_ring_blocks;
  uint64_t ring_layers;
} tw_kv_layout_t;

typedef struct tw_engine tw_engine_t;

/** Create an engine over a loaded model (borrowed: it must outlive the
 *  engine). Allocates the KV pool and workspaces and logs the memory plan.
 *  Errors: TW_ERR_INVALID_ARGUMENT (bad params, named), TW_ERR_UNSUPPORTED
 *  (backend not built or no GPU), TW_ERR_NO_MEMORY, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                          tw_engine_t **engine_p);

/** Free everything. NULL does nothing. */
void tw_engine_destroy(tw_engine_t *engine);

/** Layout of the KV pool (valid until destroy). */
const tw_kv_layout_t *tw_engine_kv_layout(const tw_engine_t *engine);

/** The parameters the engine runs with: those given, with the backend and
 *  the memory plan's kv_num_blocks, max_batch and max_prefill_chunk filled
 *  in (valid until destroy). */
const tw_engine_params_t *tw_engine_params(const tw_engine_t *engine);

/** Where this engine's weights live: 0 its own copy, 1 its own copy that it
 *  exports to the other workers (weights_share_dir), 2 another worker's copy
 *  mapped through CUDA IPC. */
int tw_engine_weights_origin(const tw_engine_t *engine);

/** The backend actually used (never AUTO). */
tw_backend_kind_t tw_engine_backend(const tw_engine_t *engine);

/** Prefill: run `n_tokens` prompt tokens at positions start_pos..start_pos+
 *  n_tokens-1 of one sequence, writing their K/V into the blocks of
 *  `block_table` (which must cover start_pos + n_tokens positions; positions
 *  before start_pos must already be in the cache, as after an earlier chunk).
 *  Long prompts are chunked internally by max_prefill_chunk.
 *    logits_out: NULL, or host f32 [n_tokens, V] if all_logits, else [1, V]
 *      (the last position only).
 *    sample/next_token_out: if next_token_out != NULL, samples the token that
 *      follows the last position with `sample` (NULL = greedy).
 *  Errors: TW_ERR_INVALID_ARGUMENT (token id outside [0, V), n_tokens <= 0,
 *  block table too short or a block id out of the pool), TW_ERR_OUT_OF_RANGE
 *  (position beyond max_position_embeddings), TW_ERR_CUDA. */
typedef struct {
  const int32_t *tokens;        /* [n_tokens] */
  int32_t n_tokens;
  int32_t start_pos;
  const int32_t *block_table;   /* [n_blocks] */
  int32_t n_blocks;
  bool all_logits;
  float *logits_out;            /* may be NULL */
  const tw_sample_params_t *sample; /* may be NULL (greedy) */
  int32_t *next_token_out;      /* may be NULL */
  /* Optional (NULL = none): per-layer progress, for overlapping the KV
   * handoff with compute. Called on the calling thread, in layer order, for
   * each internal chunk (positions chunk_start_pos .. chunk_start_pos +
   * chunk_n_tokens - 1) once that layer's K/V for those positions are
   * complete in the pool and safe to read by the transfer layer (for a
   * device pool: the writes have finished on the device). The backend may
   * call it late (after later layers were enqueued or computed), never
   * early. It must not call the engine. */
  void (*on_layer_done)(void *arg, int32_t layer, int32_t chunk_start_pos,
                        int32_t chunk_n_tokens);
  void *on_layer_arg;
} tw_prefill_args_t;
TW_NODISCARD tw_status_t tw_engine_prefill(tw_engine_t *engine, const tw_prefill_args_t *args);

/** Batched (variable-length) prefill: several sequences' prompt tokens in
 *  as few forward passes as the engine's budget allows. Each sequence is as
 *  in tw_engine_prefill (its own tokens, start_pos and block table; positions
 *  before start_pos already in the cache). The engine concatenates the
 *  sequences' tokens (cu_seqlens style) into passes of at most
 *  max_prefill_chunk tokens and max_batch sequences, in the order given; a
 *  sequence that does not fit the rest of a pass is split and continues at
 *  the start of the next one. Every token-parallel op (norms, QKV, O, MoE)
 *  runs on the concatenation; attention runs per sequence over its own
 *  blocks (causal, sliding window, sinks as in tw_engine_prefill). The
 *  results of each sequence equal those of tw_engine_prefill of that
 *  sequence alone (bit for bit on the cpu backend; on cuda up to the
 *  order of float sums inside the GEMM tiles).
 *  Errors: those of tw_engine_prefill for any sequence (the message names
 *  it, and no sequence has run), TW_ERR_INVALID_ARGUMENT (n_seqs <= 0,
 *  seqs NULL, two sequences sharing a block id in the positions they
 *  write), TW_ERR_NO_MEMORY, TW_ERR_CUDA. */
typedef struct {
  const int32_t *tokens;            /* [n_tokens] */
  int32_t n_tokens;                 /* > 0 */
  int32_t start_pos;                /* >= 0 */
  const int32_t *block_table;       /* [n_blocks], covers start_pos + n_tokens */
  int32_t n_blocks;
  float *logits_out;                /* NULL, or host f32 [V]: the last position's logits */
  const tw_sample_params_t *sample; /* NULL = greedy */
  int32_t *next_token_out;          /* NULL, or the sampled token after the last position */
} tw_prefill_seq_t;

typedef struct {
  int32_t n_seqs;
  const tw_prefill_seq_t *seqs;     /* [n_seqs] */
  /* Optional: as tw_prefill_args_t.on_layer_done, per sequence: layer
   * `layer` of positions chunk_start_pos .. + chunk_n_tokens - 1 of
   * sequence `seq` (index into seqs) is complete in the pool. Called on the
   * calling thread, never early; must not call the engine. */
  void (*on_layer_done)(void *arg, int32_t seq, int32_t layer, int32_t chunk_start_pos,
                        int32_t chunk_n_tokens);
  void *on_layer_arg;
} tw_prefill_batch_args_t;
TW_NODISCARD tw_status_t tw_engine_prefill_batch(tw_engine_t *engine,
                                                 const tw_prefill_batch_args_t *args);

/** One decode step for a batch of sequences: sequence i feeds tokens[i] at
 *  positions[i] (its K/V is appended at that position) and gets the logits
 *  of the next position. Sequences may have any lengths and join or leave
 *  between steps (continuous batching).
 *    logits_out: NULL or host f32 [n_seqs, V].
 *    next_tokens_out: NULL or [n_seqs] sampled with sample[i] (NULL = greedy
 *      for all).
 *  Errors as prefill, plus TW_ERR_INVALID_ARGUMENT if n_seqs > max_batch. */
typedef struct {
  int32_t n_seqs;
  const int32_t *tokens;              /* [n_seqs] */
  const int32_t *positions;           /* [n_seqs] */
  const int32_t *const *block_tables; /* [n_seqs] -> [n_blocks[i]] */
  const int32_t *n_blocks;            /* [n_seqs] */
  float *logits_out;                  /* may be NULL */
  const tw_sample_params_t *sample;   /* [n_seqs] or NULL */
  int32_t *next_tokens_out;           /* may be NULL */
  /* NULL, or called on the calling thread while the step computes: CUDA,
   * again and again instead of blocking in the stream sync; CPU (which
   * computes on the calling thread), once before each layer. For work that
   * must not wait a whole step, e.g. the decode worker's UCX progress that
   * lands other workers' KV puts. Must not call the engine. */
  void (*while_running)(void *arg);
  void *while_running_arg;
} tw_decode_args_t;
TW_NODISCARD tw_status_t tw_engine_decode(tw_engine_t *engine, const tw_decode_args_t *args);

/** Prepare everything decode steps would otherwise prepare on first use, so
 *  that the first requests do not pay for it: the CUDA backend captures the
 *  decode graph of every (batch bucket, context bucket) its max_batch and
 *  the model's context allow (logging progress); the CPU backend has
 *  nothing to do. A daemon calls it before it registers as ready. Errors:
 *  TW_ERR_INVALID_ARGUMENT (not an engine), TW_ERR_CUDA (a capture failed:
 *  graphs are then off and decode runs eagerly, correct but slower). */
TW_NODISCARD tw_status_t tw_engine_warmup(tw_engine_t *engine);

#ifdef __cplusplus
}
#endif
#endif
