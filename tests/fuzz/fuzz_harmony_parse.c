/* fuzz_harmony_parse.c: any sequence of ids (valid, special, out of range)
 * through the Harmony parser: events only, never a failure other than
 * out-of-memory, never a crash; text events are valid UTF-8. */
#include "common/base/log.h"
#include "common/text/harmony.h"
#include "common/text/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const tw_tokenizer_t *tok_g;
static tw_harmony_t *h_g;

static void on_event(void *user, const tw_harmony_event_t *ev) {
  (void)user;
  if (ev->kind == TW_HARMONY_EV_TEXT_DELTA && ev->text &&
      !tw_utf8_valid(ev->text, ev->text_len, NULL))
    abort(); /* deltas are whole UTF-8 */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!tok_g) {
    tok_g = tw_fuzz_tokenizer();
    if (tw_harmony_create(tok_g, &h_g) != TW_OK) abort();
  }
  if (size < 1 || size > (1 << 16)) return 0;
  int32_t n_ids = tw_tokenizer_n_ids(tok_g);
  tw_harmony_parser_t *p = NULL;
  /* first byte: start before any message (-1) or inside an assistant header */
  if (tw_harmony_parser_create(h_g, data[0] & 1 ? TW_HARMONY_ROLE_ASSISTANT : -1, on_event, NULL, &p) !=
      TW_OK)
    abort();
  for (size_t i = 1; i + 3 <= size; i += 3) {
    /* 3 bytes per id: mostly ids of the vocabulary, some specials, some out of range */
    uint32_t v = (uint32_t)data[i] | (uint32_t)data[i + 1] << 8 | (uint32_t)data[i + 2] << 16;
    int32_t id = (int32_t)(v % (uint32_t)(n_ids + 64)) - 32;
    if (tw_harmony_parser_push(p, id) != TW_OK) abort();
  }
  if (tw_harmony_parser_finish(p) != TW_OK) abort();
  tw_harmony_parser_destroy(p);
  return 0;
}
