/* model.c: load a Hugging Face gpt-oss checkpoint into tw_model_t views
 * (spec §3.2, §3.5), or build synthetic weights of the same shapes.
 *
 * Loading maps every safetensors file read-only and points each view into
 * the mapping: no weight byte is copied or read at load, so peak RSS is the
 * headers plus whatever the engine later touches. Every tensor's dtype and
 * shape is checked against the config (one table, model_specs(), drives both
 * the loader and the synthetic builder). */
#include "common/model/model.h"

#include "common/base/log.h"
#include "common/model/model_impl.h"
#include "common/model/safetensors.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

/* ---- dtypes and MXFP4 (spec §3.4) ---------------------------------------- */

size_t tw_dtype_size(tw_dtype_t dtype) {
  switch (dtype) {
    case TW_DTYPE_F64: case TW_DTYPE_I64: return 8;
    case TW_DTYPE_F32: case TW_DTYPE_I32: return 4;
    case TW_DTYPE_BF16: case TW_DTYPE_F16: case TW_DTYPE_I16: return 2;
    case TW_DTYPE_U8: case TW_DTYPE_I8: case TW_DTYPE_BOOL:
    case TW_DTYPE_F8_E4M3: case TW_DTYPE_F8_E5M2: return 1;
  }
  return 0;
}

const char *tw_dtype_name(tw_dtype_t dtype) {
  switch (dtype) {
    case TW_DTYPE_F32: return "F32";
    case TW_DTYPE_BF16: return "BF16";
    case TW_DTYPE_F16: return "F16";
    case TW_DTYPE_U8: return "U8";
    case TW_DTYPE_I32: return "I32";
    case TW_DTYPE_I64: return "I64";
    case TW_DTYPE_F64: return "F64";
    case TW_DTYPE_I8: return "I8";
    case TW_DTYPE_I16: return "I16";
    case TW_DTYPE_BOOL: return "BOOL";
    case TW_DTYPE_F8_E4M3: return "F8_E4M3";
    case TW_DTYPE_F8_E5M2: return "F8_E5M2";
  }
  return "?";
}

const float tw_fp4_e2m1_table[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void tw_mxfp4_dequant_row(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks,
                          float *out) {
  for (int64_t b = 0; b < n_blocks; b++) {
    const uint8_t *blk = blocks + b * 16;
    float *o = out + b * 32;
    const int s = scales[b];
    if (s == 255) {
      /* 2^128 is not a float: apply the exponent to each value, as the
       * references' ldexp does (spec §3.4; OCP's NaN code is not special). */
      for (int j = 0; j < 16; j++) {
        o[2 * j] = ldexpf(tw_fp4_e2m1_table[blk[j] & 0xF], s - 127);
        o[2 * j + 1] = ldexpf(tw_fp4_e2m1_table[blk[j] >> 4], s - 127);
      }
      continue;
    }
    /* 2^(s-127) is exact for s in 0..254 (s == 0 is the subnormal 2^-127), and
     * FP4 values have one mantissa bit, so value * m == ldexpf(value, s-127). */
    union { uint32_t u; float f; } m;
    m.u = s ? (uint32_t)s << 23 : 1u << 22;
    for (int j = 0; j < 16; j++) {
      o[2 * j] = tw_fp4_e2m1_table[blk[j] & 0xF] * m.f;
      o[2 * j + 1] = tw_fp4_e2m1_table[blk[j] >> 4] * m.f;
    }
  }
}

/* ---- the tensor table ----------------------------------------------------- */

static void spec_add(tw_model_specs_t *s, tw_tensor_t *dst, tw_init_kind_t init,
                     tw_dtype_t dtype, int ndim, int64_t d0, int64_t d1, int64_t d2,
                     int64_t d3, const char *fmt, int layer) {
  tw_tensor_spec_t *t = &s->specs[s->n++];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, fmt, layer);
  t->dst = dst;
  t->init = init;
  t->dtype = dtype;
  t->ndim = ndim;
  t->shape[0] = d0;
  t->shape[1] = d1;
  t->shape[2] = d2;
  t->shape[3] = d3;
}

TW_NODISCARD tw_status_t tw_model_specs_build(const tw_model_config_t *c, tw_model_t *m,
                                              tw_model_specs_t *specs_p) {
  const int64_t H = c->hidden, I = c->intermediate, E = c->n_experts, D = c->head_dim;
  const int64_t NQ = c->n_heads, NKV = c->n_kv_heads, V = c->vocab_size;
  tw_model_specs_t s;
  s.n = 0;
  s.specs = calloc(3 + (size_t)c->n_layers * TW_SPECS_PER_LAYER, sizeof *s.specs);
  if (!s.specs) return tw_err(TW_ERR_NO_MEMORY, "model: out of memory (tensor table)");
  const tw_dtype_t B = TW_DTYPE_BF16, U = TW_DTYPE_U8;
  spec_add(&s, &m->embed, TW_INIT_WEIGHT, B, 2, V, H, 0, 0, "model.embed_tokens.weight", 0);
  for (int l = 0; l < c->n_layers; l++) {
    tw_layer_weights_t *w = &m->layers[l];
    const char *p = "model.layers.%d.";
    char f[160];
#define ADD(dst, init, dt, nd, a, b_, c_, d_, suffix)                   \
  do {                                                                  \
    snprintf(f, sizeof f, "%s%s", p, suffix);                           \
    spec_add(&s, dst, init, dt, nd, a, b_, c_, d_, f, l);               \
  } while (0)
    ADD(&w->attn_norm, TW_INIT_NORM, B, 1, H, 0, 0, 0, "input_layernorm.weight");
    ADD(&w->q_w, TW_INIT_WEIGHT, B, 2, NQ * D, H, 0, 0, "self_attn.q_proj.weight");
    ADD(&w->q_b, TW_INIT_WEIGHT, B, 1, NQ * D, 0, 0, 0, "self_attn.q_proj.bias");
    ADD(&w->k_w, TW_INIT_WEIGHT, B, 2, NKV * D, H, 0, 0, "self_attn.k_proj.weight");
    ADD(&w->k_b, TW_INIT_WEIGHT, B, 1, NKV * D, 0, 0, 0, "self_attn.k_proj.bias");
    ADD(&w->v_w, TW_INIT_WEIGHT, B, 2, NKV * D, H, 0, 0, "self_attn.v_proj.weight");
    ADD(&w->v_b, TW_INIT_WEIGHT, B, 1, NKV * D, 0, 0, 0, "self_attn.v_proj.bias");
    ADD(&w->o_w, TW_INIT_WEIGHT, B, 2, H, NQ * D, 0, 0, "self_attn.o_proj.weight");
    ADD(&w->o_b, TW_INIT_WEIGHT, B, 1, H, 0, 0, 0, "self_attn.o_proj.bias");
    ADD(&w->sinks, TW_INIT_SINK, B, 1, NQ, 0, 0, 0, "self_attn.sinks");
    s.specs[s.n - 1].alt_f32 = true; /* sinks: bf16 in the checkpoint, f32 accepted */
    ADD(&w->mlp_norm, TW_INIT_NORM, B, 1, H, 0, 0, 0, "post_attention_layernorm.weight");
    ADD(&w->router_w, TW_INIT_ROUTER, B, 2, E, H, 0, 0, "mlp.router.weight");
    ADD(&w->router_b, TW_INIT_WEIGHT, B, 1, E, 0, 0, 0, "mlp.router.bias");
    if (w->experts_format == TW_EXPERTS_MXFP4) {
      ADD(&w->gate_up_blocks, TW_INIT_FP4, U, 4, E, 2 * I, H / 32, 16,
          "mlp.experts.gate_up_proj_blocks");
      ADD(&w->gate_up_scales, TW_INIT_SCALE, U, 3, E, 2 * I, H / 32, 0,
          "mlp.experts.gate_up_proj_scales");
      ADD(&w->gate_up_bias, TW_INIT_WEIGHT, B, 2, E, 2 * I, 0, 0,
          "mlp.experts.gate_up_proj_bias");
      ADD(&w->down_blocks, TW_INIT_FP4, U, 4, E, H, I / 32, 16, "mlp.experts.down_proj_blocks");
      ADD(&w->down_scales, TW_INIT_SCALE, U, 3, E, H, I / 32, 0, "mlp.experts.down_proj_scales");
      ADD(&w->down_bias, TW_INIT_WEIGHT, B, 2, E, H, 0, 0, "mlp.experts.down_proj_bias");
    } else {
      ADD(&w->gate_up, TW_INIT_WEIGHT, B, 3, E, H, 2 * I, 0, "mlp.experts.gate_up_proj");
      ADD(&w->gate_up_bias, TW_INIT_WEIGHT, B, 2, E, 2 * I, 0, 0,
          "mlp.experts.gate_up_proj_bias");
      ADD(&w->down, TW_INIT_WEIGHT, B, 3, E, I, H, 0, "mlp.experts.down_proj");
      ADD(&w->down_bias, TW_INIT_WEIGHT, B, 2, E, H, 0, 0, "mlp.experts.down_proj_bias");
    }
#undef ADD
  }
  spec_add(&s, &m->final_norm, TW_INIT_NORM, B, 1, H, 0, 0, 0, "model.norm.weight", 0);
  spec_add(&s, &m->lm_head, TW_INIT_WEIGHT, B, 2, V, H, 0, 0, "lm_head.weight", 0);
  *specs_p = s;
  return TW_OK;
}

int64_t tw_tensor_spec_bytes(const tw_tensor_spec_t *spec) {
  int64_t n = (int64_t)tw_dtype_size(spec->dtype);
  for (int d = 0; d < spec->ndim; d++) n *= spec->shape[d];
  return n;
}

void tw_model_specs_fini(tw_model_specs_t *specs) {
  free(specs->specs);
  specs->specs = NULL;
  specs->n = 0;
}

int tw_model_shape_str(const int64_t *shape, int ndim, char *buf, size_t n) {
  int w = snprintf(buf, n, "[");
  for (int i = 0; i < ndim && w < (int)n; i++)
    w += snprintf(buf + w, n - (size_t)w, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (w < (int)n) w += snprintf(buf + w, n - (size_t)w, "]");
  return w;
}

/* ---- model object --------------------------------------------------------- */

TW_NODISCARD tw_status_t tw_model_alloc(const tw_model_config_t *config, tw_model_t **model_p) {
  tw_model_t *m = calloc(1, sizeof *m);
  tw_model_impl_t *impl = calloc(1, sizeof *impl);
  tw_layer_weights_t *layers = calloc((size_t)config->n_layers, sizeof *layers);
  if (!m || !impl || !layers) {
    free(m);
    free(impl);
    free(layers);
    return tw_err(TW_ERR_NO_MEMORY, "model: out of memory");
  }
  impl->magic = TW_MODEL_IMPL_MAGIC;
  m->config = *config;
  m->layers = layers;
  m->impl = impl;
  *model_p = m;
  return TW_OK;
}

void tw_model_destroy(tw_model_t *model) {
  if (!model) return;
  tw_model_impl_t *impl = model->impl;
  if (impl && impl->magic != TW_MODEL_IMPL_MAGIC) {
    TW_WARN("loader", "model destroy: bad handle (magic %08x)", impl->magic);
    return;
  }
  if (impl) {
    for (int i = 0; i < impl->n_files; i++) tw_safetensors_destroy(impl->files[i]);
    free(impl->files);
    for (int64_t i = 0; i < impl->n_map; i++) free(impl->map[i].name);
    free(impl->map);
    free(impl->source);
    if (impl->arena && munmap(impl->arena, impl->arena_bytes) != 0)
      TW_WARN("loader", "munmap of the synthetic weights failed: %s", strerror(errno));
    impl->magic = 0;
    free(impl);
  }
  free(model->layers);
  free(model);
}
