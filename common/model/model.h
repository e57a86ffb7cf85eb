/* model.h: a loaded gpt-oss checkpoint: its config and views of every weight
 * tensor, memory-mapped from the safetensors file(s) (spec §3). Nothing is
 * copied or converted at load: bf16 stays bf16, MXFP4 stays packed. Backends
 * read these views (the CPU backend directly; the CUDA backend uploads them).
 *
 * Orientation, exactly as stored in the Hugging Face layout (spec §3.2, §3.5):
 *   linear weights [out, in] row-major, y = W·x + b;
 *   bf16 experts:  gate_up [E, H, 2I] used as x @ W (gate = cols 0::2, up = 1::2),
 *                  down [E, I, H] used as a @ W;
 *   MXFP4 experts: gate_up blocks [E, 2I, H/32, 16] + scales [E, 2I, H/32],
 *                  down blocks [E, H, I/32, 16] + scales [E, H, I/32]
 *                  (each output row blocked along its input dimension, §3.4). */
#ifndef TW_COMMON_MODEL_H
#define TW_COMMON_MODEL_H

#include "common/base/status.h"
#include "common/model/config.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_DTYPE_F32 = 0,
  TW_DTYPE_BF16 = 1,
  TW_DTYPE_F16 = 2,
  TW_DTYPE_U8 = 3,
  TW_DTYPE_I32 = 4,
  TW_DTYPE_I64 = 5,
  TW_DTYPE_F64 = 6,
  TW_DTYPE_I8 = 7,
  TW_DTYPE_I16 = 8,
  TW_DTYPE_BOOL = 9,
  TW_DTYPE_F8_E4M3 = 10,
  TW_DTYPE_F8_E5M2 = 11,
} tw_dtype_t;

/** Bytes per element of a dtype. */
size_t tw_dtype_size(tw_dtype_t dtype);
/** safetensors name of a dtype ("BF16", ...). Never NULL. */
const char *tw_dtype_name(tw_dtype_t dtype);

/** A read-only view of a tensor (borrowed; lives as long as its model). */
typedef struct {
  const void *data;   /* NULL if the tensor is absent */
  tw_dtype_t dtype;
  int32_t ndim;
  int64_t shape[4];
  int64_t n_bytes;
} tw_tensor_t;

typedef enum {
  TW_EXPERTS_BF16 = 0,  /* gate_up [E,H,2I], down [E,I,H] */
  TW_EXPERTS_MXFP4 = 1, /* blocks/scales as in the file */
} tw_experts_format_t;

typedef struct {
  tw_tensor_t attn_norm;   /* input_layernorm.weight [H] bf16 */
  tw_tensor_t q_w, q_b;    /* [NQ*D, H], [NQ*D] */
  tw_tensor_t k_w, k_b;    /* [NKV*D, H], [NKV*D] */
  tw_tensor_t v_w, v_b;    /* [NKV*D, H], [NKV*D] */
  tw_tensor_t o_w, o_b;    /* [H, NQ*D], [H] */
  tw_tensor_t sinks;       /* [NQ] (bf16 in the checkpoint; f32 accepted) */
  tw_tensor_t mlp_norm;    /* post_attention_layernorm.weight [H] */
  tw_tensor_t router_w;    /* [E, H] */
  tw_tensor_t router_b;    /* [E] */
  tw_experts_format_t experts_format;
  tw_tensor_t gate_up;         /* bf16: [E, H, 2I] */
  tw_tensor_t gate_up_blocks;  /* mxfp4: [E, 2I, H/32, 16] u8 */
  tw_tensor_t gate_up_scales;  /* mxfp4: [E, 2I, H/32] u8 (E8M0) */
  tw_tensor_t gate_up_bias;    /* [E, 2I] interleaved gate/up */
  tw_tensor_t down;            /* bf16: [E, I, H] */
  tw_tensor_t down_blocks;     /* mxfp4: [E, H, I/32, 16] */
  tw_tensor_t down_scales;     /* mxfp4: [E, H, I/32] */
  tw_tensor_t down_bias;       /* [E, H] */
} tw_layer_weights_t;

typedef struct tw_model tw_model_t;

struct tw_model {
  tw_model_config_t config;
  tw_tensor_t embed;       /* model.embed_tokens.weight [V, H] */
  tw_tensor_t final_norm;  /* model.norm.weight [H] */
  tw_tensor_t lm_head;     /* lm_head.weight [V, H] */
  tw_layer_weights_t *layers; /* [n_layers] */
  int64_t weight_bytes;    /* sum of n_bytes of all tensors used */
  void *impl;              /* loader-private: mmaps, parsed headers */
};

/** Load a Hugging Face gpt-oss checkpoint directory: config.json plus either
 *  model.safetensors or model.safetensors.index.json with its shards. Files
 *  are mmapped read-only; every tensor's name, dtype and shape is checked
 *  against the config. Progress is logged per file.
 *  Errors: TW_ERR_IO, TW_ERR_FORMAT (bad header/index/JSON, overlapping or
 *  out-of-file byte ranges, truncated file), TW_ERR_NOT_FOUND (missing
 *  tensor or file, named), TW_ERR_INVALID_ARGUMENT (wrong dtype or shape,
 *  named with expected and found), TW_ERR_NO_MEMORY. Each message names the
 *  file and tensor. */
TW_NODISCARD tw_status_t tw_model_load(const char *dir, tw_model_t **model_p);

/** Read every weight of a loaded model once and refuse a NaN or infinity
 *  (bf16/f16/f32 exponent all ones; MXFP4 E8M0 scales 0xFF, OCP MX §5.4.1),
 *  which would make every logit NaN. Separate from tw_model_load, which maps
 *  the files without reading them: a worker calls it before it serves (its
 *  engine reads the weights then anyway). Errors: TW_ERR_INVALID_ARGUMENT
 *  naming the file, the tensor and the first bad element; TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_model_check_finite(const tw_model_t *model);

/** Synthetic weights with the real shapes and dtypes of `config` (MXFP4
 *  experts if config->mxfp4), seeded random values of realistic scale, for
 *  benchmarks where no checkpoint is present. Errors: TW_ERR_NO_MEMORY,
 *  TW_ERR_INVALID_ARGUMENT (a non-positive size, or MXFP4 with hidden or
 *  intermediate not a multiple of 32). */
TW_NODISCARD tw_status_t tw_model_synthetic(const tw_model_config_t *config, uint64_t seed,
                                            tw_model_t **model_p);

/** What tw_model_write_synthetic wrote (or would write). */
typedef struct {
  int64_t total_bytes; /* tensor bytes, the index's metadata.total_size */
  int64_t n_tensors;
  int32_t n_shards;
  double seconds;      /* writing time (0 for a plan) */
} tw_model_write_info_t;

/** Write a checkpoint of `config`'s shapes (MXFP4 experts: config->mxfp4
 *  must be set) into `dir` (created if missing) in the Hugging Face layout
 *  (spec §3.1, §3.2): the tensors in file order split into shards of at most
 *  max_shard_bytes (one tensor may exceed it alone), named
 *  model-0000k-of-0000N.safetensors (k from 0, N the last index), plus
 *  model.safetensors.index.json (metadata.total_size, weight_map). Values
 *  are tw_model_synthetic's for `seed`, so tw_model_load of the result
 *  equals tw_model_synthetic(config, seed) byte for byte. Streams: memory
 *  is one 4 MiB buffer per thread (threads 0: one per core); progress is
 *  logged every 10 %. config.json, the tokenizer and the rest are the
 *  caller's (`twain write-checkpoint`). plan_only: fill *info, write
 *  nothing. Errors: TW_ERR_INVALID_ARGUMENT (no MXFP4, sizes not multiples
 *  of 32, shard size <= 0), TW_ERR_IO (naming the file), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_model_write_synthetic(const tw_model_config_t *config, const char *dir,
                                                  uint64_t seed, int64_t max_shard_bytes,
                                                  int threads, bool plan_only,
                                                  tw_model_write_info_t *info);

/** Unmap and free. NULL does nothing. */
void tw_model_destroy(tw_model_t *model);

/* ---- element conversion helpers (exact) ---- */

/** bf16 bits to float (exact). */
static inline float tw_bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}

/** float to bf16 bits, round to nearest even (NaN kept NaN). */
static inline uint16_t tw_f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
  uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
  return (uint16_t)((v.u + rounding) >> 16);
}

/** FP4 E2M1 value table, nibble -> value (spec §3.4). */
extern const float tw_fp4_e2m1_table[16];

/** Dequantise one MXFP4 row: `n_blocks` blocks of 32 values from `blocks`
 *  [n_blocks, 16] u8 and `scales` [n_blocks] u8 (E8M0, bias 127) into
 *  out[n_blocks * 32] float32, exactly as spec §3.4: low nibble is the even
 *  element; value = FP4[nib] * 2^(scale - 127). */
void tw_mxfp4_dequant_row(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks,
                          float *out);

#ifdef __cplusplus
}
#endif
#endif
