/* model_impl.h: loader-private parts of tw_model_t (model.c, model_load.c,
 * model_synthetic.c): the impl object behind tw_model_t.impl and the table of
 * expected tensors that drives both the loader and the synthetic builder. */
#ifndef TW_COMMON_MODEL_IMPL_H
#define TW_COMMON_MODEL_IMPL_H

#include "common/model.h"
#include "common/safetensors.h"

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
tw_status_t tw_model_alloc(const tw_model_config_t *config, tw_model_t **model_p);

/** The expected tensors of `m` (spec §3.2, §3.5) in file order of the HF
 *  checkpoint; each layer's experts_format must be set first. Errors:
 *  TW_ERR_NO_MEMORY. Free with tw_model_specs_fini. */
tw_status_t tw_model_specs_build(const tw_model_config_t *config, tw_model_t *m,
                                 tw_model_specs_t *specs_p);
void tw_model_specs_fini(tw_model_specs_t *specs);

/** "[a, b, c]" into buf; returns the length written (like snprintf). */
int tw_model_shape_str(const int64_t *shape, int ndim, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
