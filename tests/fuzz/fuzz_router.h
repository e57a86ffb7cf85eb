/* fuzz_router.h: one in-process router for the router harnesses: sockets on
 * inproc endpoints (nothing listens on the network), no metrics server, the
 * tiny fixture's config and tokenizer; two fake workers registered over the
 * worker socket's message handler. */
#ifndef TW_TESTS_FUZZ_ROUTER_H
#define TW_TESTS_FUZZ_ROUTER_H

#include "common/base/log.h"
#include "common/comm/msg.h"
#include "router/router_impl.h"
#include "tests/fuzz/fuzz_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static tw_router_t router_g;
static tw_router_params_t params_g;

/* Feed a packed Envelope to the router as if worker `id` sent it. */
static inline void tw_fuzz_from_worker(const char *id, const uint8_t *data, size_t size) {
  tw_msg_t m = {0};
  m.id_len = strlen(id);
  memcpy(m.id, id, m.id_len);
  m.data = (uint8_t *)data;
  m.len = size;
  tw_router_on_worker_msg(&router_g, &m);
}

static inline void tw_fuzz_register(const char *id, Twain__Internal__V1__Pool pool) {
  Twain__Internal__V1__Capacity cap = TWAIN__INTERNAL__V1__CAPACITY__INIT;
  cap.free_kv_blocks = cap.total_kv_blocks = 1 << 20;
  Twain__Internal__V1__Register g = TWAIN__INTERNAL__V1__REGISTER__INIT;
  g.pool = pool;
  g.name = (char *)id;
  g.ranks = 1;
  g.kv_block_size = 16;
  g.capacity = &cap;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER;
  env.register_ = &g;
  uint8_t buf[256];
  size_t n = protobuf_c_message_pack(&env.base, buf);
  tw_fuzz_from_worker(id, buf, n);
}

static inline tw_router_t *tw_fuzz_router(void) {
  static int init;
  if (init) return &router_g;
  init = 1;
  setenv("TWAIN_LOG", "error", 0);
  tw_log_init("fuzz", 0);
  setenv("TWAIN_INSECURE_PLAINTEXT", "1", 1); /* inproc sockets only */
  params_g = TW_ROUTER_PARAMS_DEFAULT;
  params_g.model_dir = tw_fuzz_model_dir();
  params_g.client_endpoint = "inproc://fuzz-clients";
  params_g.worker_endpoint = "inproc://fuzz-workers";
  params_g.metrics_port = -1;
  params_g.max_requests = 64;
  if (tw_router_init(&router_g, &params_g) != TW_OK) {
    fprintf(stderr, "fuzz: router init failed: %s\n", tw_last_error());
    abort();
  }
  tw_fuzz_register("fuzz-prefill", TWAIN__INTERNAL__V1__POOL__POOL_PREFILL);
  tw_fuzz_register("fuzz-decode", TWAIN__INTERNAL__V1__POOL__POOL_DECODE);
  return &router_g;
}

/* Fail whatever is left and free it: every input starts from an empty queue. */
static inline void tw_fuzz_router_reset(void) {
  for (int32_t i = 0; i < router_g.n_reqs; i++)
    tw_router_fail(&router_g, router_g.reqs[i], TWAIN__V1__CODE__CANCELLED, "fuzz reset");
  tw_router_sweep(&router_g, tw_msg_clock_ns());
}

#endif
