/* fuzz_tokenizer.c: bytes -> ids -> bytes. Valid UTF-8 must encode and
 * decode back to the same bytes (with and without special tokens allowed);
 * invalid UTF-8 must be refused with INVALID_ARGUMENT, appending nothing. */
#include "common/base/log.h"
#include "common/text/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const tw_tokenizer_t *tok_g;
static tw_tok_encoder_t *enc_g;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!tok_g) {
    tok_g = tw_fuzz_tokenizer();
    if (tw_tok_encoder_create(tok_g, &enc_g) != TW_OK) abort();
  }
  if (size > (1 << 16)) return 0;
  unsigned flags = size && (data[0] & 1) ? TW_TOK_ALLOW_SPECIAL : 0;
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  tw_status_t st = tw_tok_encoder_encode(enc_g, (const char *)data, size, flags, &ids);
  bool valid = tw_utf8_valid((const char *)data, size, NULL);
  if (!valid) {
    if (st != TW_ERR_INVALID_ARGUMENT || ids.n) abort(); /* invalid UTF-8 must be refused */
  } else {
    if (st != TW_OK) {
      fprintf(stderr, "encode failed on valid UTF-8: %s\n", tw_last_error());
      abort();
    }
    tw_tok_buf_t out;
    tw_tok_buf_init(&out);
    if (tw_tokenizer_decode(tok_g, ids.ids, ids.n, 0, &out) != TW_OK) abort();
    if (out.len != size || (size && memcmp(out.data, data, size) != 0)) abort(); /* round trip */
    tw_tok_buf_fini(&out);
  }
  tw_token_ids_fini(&ids);
  return 0;
}
