/* model_impl.h: loader-private parts of tw_model_t (model.c, model_load.c,
 * model_synthetic.c): the impl object behind tw_model_t.impl and the table of
 * expected tensors that drives both the loader and the synthetic builder. */
#ifndef TW_COMMON_MODEL_IMPL_H
#define TW_COMMON_MODEL_IMPL_H

#include "common/model/model.h"
#include "common/model/safetensors.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MODEL_IMPL_MAGIC 0x74776d64u /* "twmd" */
#define TW_SPECS_PER_LAYER 19           /* MXFP4 layout; bf16 has 17 */

/* How the synthetic builder fills a tensor. */
typedef enum {
  TW_INIT_WEIGHT = 0, /* bf16 ~ N(0, 0.02) */
  TW_INIT_NORM = 1,   /* bf16 ~ 1 + N(0, 0.02) */
  TW_INIT_SINK = 2,   /* bf16 ~ N(0, 1) */
  TW_INIT_FP4 = 3,    /* u8 random nibbles */
  TW_INIT_SCALE = 4,  /* u8 E8M0 in 118..122 (2^-9 .. 2^-5) */
  TW_INIT_ROUTER = 5, /* bf16 ~ N(0, (2/sqrt(in))^2): router logits of sd ~2 */
} tw_init_kind_t;

/* One expected tensor: HF name, dtype, shape, and where its view goes. */
typedef struct {
  char name[128];
  tw_tensor_t *dst;
  tw_init_kind_t init;
  tw_dtype_t dtype;
  bool alt_f32; /* F32 accepted instead of `dtype` */
  int ndim;
  int64_t shape[4];
} tw_tensor_spec_t;

typedef struct {
  tw_tensor_spec_t *specs;
  int64_t n;
} tw_model_specs_t;

typedef struct {
  char *name;
  int file; /* index into files */
} tw_index_entry_t;

typedef struct {
  uint32_t magic;
  tw_safetensors_t **files; /* loaded: one per safetensors file */
  int n_files;
  char *source;             /* loaded: model.safetensors or the index path, for messages */
  tw_index_entry_t *map;    /* sharded: weight_map sorted by name */
  int64_t n_map;
  void *arena;              /* synthetic: one anonymous mapping */
  size_t arena_bytes;
  int64_t n_tensors;        /* tensors in use */
  int64_t n_misaligned;     /* loaded tensors whose data is not element-aligned */
} tw_model_impl_t;

/** Allocate a model with config copied, zeroed layers and an empty impl.
 *  Errors: TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_model_alloc(const tw_model_config_t *config, tw_model_t **model_p);

/** The expected tensors of `m` (spec §3.2, §3.5) in file order of the HF
 *  checkpoint; each layer's experts_format must be set first. Errors:
 *  TW_ERR_NO_MEMORY. Free with tw_model_specs_fini. */
TW_NODISCARD tw_status_t tw_model_specs_build(const tw_model_config_t *config, tw_model_t *m,
                                              tw_model_specs_t *specs_p);
void tw_model_specs_fini(tw_model_specs_t *specs);

/** Bytes of a spec's tensor: dtype size times its shape's elements. */
int64_t tw_tensor_spec_bytes(const tw_tensor_spec_t *spec);

/* ---- seeded values (model_synthetic.c) ---- */

/* Values are drawn per 4 MiB chunk, each chunk with its own RNG stream keyed
 * by (seed, chunk index over all tensors in spec order), so they depend on
 * neither the thread count nor where the bytes go. */
#define TW_SYN_CHUNK_BYTES ((int64_t)4 << 20)

/** One tensor to fill: its spec, byte count, and either `data` (filled in
 *  place) or NULL (each chunk goes to the sink). first_chunk is set by
 *  tw_synthetic_fill. `user`: the sink's per-tensor value (e.g. a file
 *  offset). */
typedef struct {
  const tw_tensor_spec_t *spec;
  uint8_t *data;
  int64_t n_bytes;
  int64_t first_chunk;
  int64_t user;
} tw_syn_tensor_t;

/** Where a chunk of a tensor whose data is NULL goes: `n` bytes at byte
 *  offset `off` of tensor t, in a buffer valid for the call only. Runs on the
 *  filling threads, concurrently; returns TW_OK or an error that stops the
 *  fill (first error wins). */
typedef TW_NODISCARD tw_status_t (*tw_syn_sink_fn)(void *ctx, const tw_syn_tensor_t *t, int64_t off,
                                                   const uint8_t *buf, int64_t n);

/** Fill tensors [0, n) with the synthetic recipe (tw_init_kind_t: bf16
 *  weights N(0, 0.02), norms 1 + N(0, 0.02), sinks N(0, 1), routers
 *  N(0, 4/in), FP4 nibbles uniform, E8M0 scales 118..122) from `seed`, on up
 *  to max_threads threads (0: one per core, at most 64) claiming 4 MiB
 *  chunks in order. *threads_p (may be NULL) gets the threads used. Errors:
 *  the sink's first error; TW_ERR_NO_MEMORY (chunk buffers). The same seed
 *  and tensors give the same bytes whatever the threads or the sink. */
TW_NODISCARD tw_status_t tw_synthetic_fill(tw_syn_tensor_t *t, int64_t n, uint64_t seed,
                                           int max_threads, tw_syn_sink_fn sink, void *ctx,
                                           int *threads_p);

/** "[a, b, c]" into buf; returns the length written (like snprintf). */
int tw_model_shape_str(const int64_t *shape, int ndim, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
