/* fuzz_router_worker.c: any bytes as a worker's message to the router (an
 * Envelope or garbage), from one of two registered fake workers or an
 * unknown peer (first byte), while a client request is in flight: the
 * router validates it (ids in the vocabulary, known finish reasons, codes,
 * strings UTF-8 without NUL); never a crash. */
#include "tests/fuzz/fuzz_router.h"

#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A generate request from the fake client, scheduled onto the fake decode worker. */
static void tw_fuzz_request(tw_router_t *r) {
  int32_t ids[4] = {1, 2, 3, 4};
  Twain__V1__SamplingParams s = TWAIN__V1__SAMPLING_PARAMS__INIT;
  s.max_tokens = 8;
  Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
  g.prompt_ids = ids;
  g.n_prompt_ids = 4;
  g.sampling = &s;
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.request_id = 1;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
  cr.generate = &g;
  uint8_t buf[128];
  tw_msg_t m = {0};
  memcpy(m.id, "fuzz-client", 11);
  m.id_len = 11;
  m.data = buf;
  m.len = protobuf_c_message_pack(&cr.base, buf);
  tw_router_on_client_msg(r, &m);
  tw_router_schedule(r, tw_msg_clock_ns());
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  tw_router_t *r = tw_fuzz_router();
  if (size < 1 || size > (1 << 20)) return 0;
  tw_fuzz_request(r);
  static const char *const from[4] = {"fuzz-decode", "fuzz-prefill", "fuzz-decode/hb", "stranger"};
  tw_fuzz_from_worker(from[data[0] & 3], data + 1, size - 1);
  for (int32_t i = 0; i < r->n_reqs; i++)
    for (int32_t k = 0; k < r->reqs[i]->n_out; k++)
      if (r->reqs[i]->out[k] < 0 || r->reqs[i]->out[k] >= r->config.vocab_size)
        abort(); /* no token id outside the vocabulary reaches a client */
  tw_fuzz_router_reset();
  /* every input starts from the same two fresh workers */
  for (int32_t i = 0; i < r->n_workers; i++) tw_rworker_free_addrs(&r->workers[i]);
  r->n_workers = 0;
  tw_fuzz_register("fuzz-prefill", TWAIN__INTERNAL__V1__POOL__POOL_PREFILL);
  tw_fuzz_register("fuzz-decode", TWAIN__INTERNAL__V1__POOL__POOL_DECODE);
  return 0;
}
