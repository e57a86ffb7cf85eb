/* fuzz_router_client.c: any bytes as a client's message to the router (a
 * twain.v1.ClientRequest or garbage): validation, chat rendering, enqueue,
 * scheduling onto the fake workers, cancel. Never a crash, and every reply
 * the router sends is a ServerReply whose strings are valid UTF-8 (checked
 * by reading the client socket's replies is not possible in-process, so the
 * harness checks the requests it leaves: each has a prompt within the limit). */
#include "tests/fuzz/fuzz_router.h"

#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  tw_router_t *r = tw_fuzz_router();
  if (size > (1 << 20)) return 0;
  tw_msg_t m = {0};
  memcpy(m.id, "fuzz-client", 11);
  m.id_len = 11;
  m.data = (uint8_t *)data;
  m.len = size;
  tw_router_on_client_msg(r, &m);
  for (int32_t i = 0; i < r->n_reqs; i++) {
    const tw_req_t *q = r->reqs[i];
    if (!q->done && (q->n_prompt < 1 || q->n_prompt > r->max_prompt || q->max_tokens < 1))
      abort(); /* an accepted request is within the limits */
  }
  tw_router_schedule(r, tw_msg_clock_ns());
  tw_fuzz_router_reset();
  return 0;
}
