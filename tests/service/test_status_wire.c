/* test_status_wire.c: the one status -> wire code map (common/comm/msg.h
 * tw_status_wire_code) against gRPC's code numbers written out by hand
 * (grpc/status.h: CANCELLED 1, INVALID_ARGUMENT 3, DEADLINE_EXCEEDED 4,
 * NOT_FOUND 5, RESOURCE_EXHAUSTED 8, UNIMPLEMENTED 12, INTERNAL 13,
 * UNAVAILABLE 14), for every status the router, prefill and decode workers
 * report, so a reply means the same thing whichever process sends it. */
#include "common/comm/msg.h"
#include "tests/test_expect.h"

int main(void) {
  static const struct {
    tw_status_t st;
    int code;
  } want[] = {
      {TW_OK, 0},
      {TW_INPROGRESS, 0},
      {TW_ERR_INVALID_ARGUMENT, 3},
      {TW_ERR_FORMAT, 3},
      {TW_ERR_OUT_OF_RANGE, 3},
      {TW_ERR_NOT_FOUND, 5},
      {TW_ERR_UNSUPPORTED, 12},
      {TW_ERR_CANCELLED, 1},
      {TW_ERR_DEADLINE, 4},
      {TW_ERR_NO_MEMORY, 8},
      {TW_ERR_EXHAUSTED, 8},
      {TW_ERR_IO, 13},
      {TW_ERR_UNAVAILABLE, 14},
      {TW_ERR_TRANSPORT, 14},
      {TW_ERR_CUDA, 13},
      {TW_ERR_NCCL, 13},
      {TW_ERR_INTERNAL, 13},
      {(tw_status_t)-999, 13},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    EXPECT(tw_status_wire_code(want[i].st) == want[i].code, "%s (%d): wire code %d, want %d",
           tw_status_str(want[i].st), (int)want[i].st, tw_status_wire_code(want[i].st),
           want[i].code);
  return tw_test_exit("test_status_wire");
}
