/* proto_engine.c: protocol <-> engine conversions (see proto_engine.h). */
#include "common/comm/proto_engine.h"

#include <time.h>

tw_sample_params_t tw_proto_sample_params(const Twain__Internal__V1__Sampling *s) {
  tw_sample_params_t sp = TW_SAMPLE_PARAMS_GREEDY;
  if (!s) return sp;
  sp.temperature = s->temperature;
  sp.top_k = s->top_k;
  sp.top_p = s->top_p > 0 ? s->top_p : 1.0f;
  sp.seed = s->seed;
  return sp;
}

void tw_proto_sampling_from_api(const Twain__V1__SamplingParams *s,
                                Twain__Internal__V1__Sampling *out) {
  twain__internal__v1__sampling__init(out);
  if (!s) return;
  out->temperature = s->temperature;
  out->top_p = s->top_p;
  out->top_k = s->top_k;
  out->seed = s->seed;
}

void tw_proto_kv_layout_to_remote(const Twain__Internal__V1__KvLayout *k,
                                  tw_kv_remote_layout_t *out) {
  *out = (tw_kv_remote_layout_t){.dtype = (tw_dtype_t)k->dtype,
                                 .on_device = k->on_device,
                                 .n_layers = k->n_layers,
                                 .n_blocks = k->n_blocks,
                                 .block_size = k->block_size,
                                 .n_kv_heads = k->n_kv_heads,
                                 .head_dim = k->head_dim,
                                 .layer_stride_bytes = k->layer_stride_bytes,
                                 .block_bytes = k->block_bytes,
                                 .remote_base = k->remote_base,
                                 .total_bytes = k->total_bytes,
                                 .staging_slot_bytes = k->staging_slot_bytes,
                                 .ring_blocks = k->ring_blocks,
                                 .n_ring_blocks = k->n_ring_blocks,
                                 .ring_layers = k->ring_layers};
}

void tw_proto_kv_layout_from_remote(const tw_kv_remote_layout_t *rl, int32_t kv_head_offset,
                                    Twain__Internal__V1__KvLayout *out) {
  twain__internal__v1__kv_layout__init(out);
  out->dtype = rl->dtype;
  out->on_device = rl->on_device;
  out->n_layers = rl->n_layers;
  out->block_size = rl->block_size;
  out->n_kv_heads = rl->n_kv_heads;
  out->head_dim = rl->head_dim;
  out->layer_stride_bytes = rl->layer_stride_bytes;
  out->block_bytes = rl->block_bytes;
  out->remote_base = rl->remote_base;
  out->total_bytes = rl->total_bytes;
  out->n_blocks = rl->n_blocks;
  out->kv_head_offset = kv_head_offset;
  out->staging_slot_bytes = rl->staging_slot_bytes;
  out->ring_blocks = rl->ring_blocks;
  out->n_ring_blocks = rl->n_ring_blocks;
  out->ring_layers = rl->ring_layers;
}

int64_t tw_proto_unix_ms(void) {
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  return (int64_t)wall.tv_sec * 1000 + wall.tv_nsec / 1000000;
}

int64_t tw_proto_age_ms(int64_t issued_unix_ms) {
  return issued_unix_ms ? tw_proto_unix_ms() - issued_unix_ms : 0;
}

bool tw_proto_stale(int64_t issued_unix_ms, int64_t max_age_ms, int64_t *age_ms_p) {
  int64_t age = tw_proto_age_ms(issued_unix_ms);
  if (age_ms_p) *age_ms_p = age;
  return max_age_ms > 0 && age > max_age_ms;
}

TW_NODISCARD tw_status_t tw_proto_kv_write_guard(uint64_t request_id, int64_t issued_unix_ms,
                                                 int64_t max_age_ms) {
  int64_t age = 0;
  if (!tw_proto_stale(issued_unix_ms, max_age_ms, &age)) return TW_OK;
  return tw_err(TW_ERR_DEADLINE,
                "request %llu was handed to this prefill worker %lld ms ago, more than %lld ms: "
                "not writing its kv (its decode blocks may have been reused)",
                (unsigned long long)request_id, (long long)age, (long long)max_age_ms);
}
