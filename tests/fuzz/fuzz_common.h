/* fuzz_common.h: shared set-up of the libFuzzer harnesses (tests/fuzz,
 * docs/testing.md "Fuzzing"): the tiny fixture model's directory, from
 * TW_FUZZ_MODEL or the path compiled in, and its tokenizer. */
#ifndef TW_TESTS_FUZZ_COMMON_H
#define TW_TESTS_FUZZ_COMMON_H

#include "common/base/log.h"
#include "common/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

#ifndef TW_FUZZ_MODEL_DIR
#define TW_FUZZ_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

static inline const char *tw_fuzz_model_dir(void) {
  const char *d = getenv("TW_FUZZ_MODEL");
  return d && *d ? d : TW_FUZZ_MODEL_DIR;
}

/* The fixture's tokenizer, loaded once (aborts if it cannot be). */
static inline const tw_tokenizer_t *tw_fuzz_tokenizer(void) {
  static tw_tokenizer_t *tok;
  if (tok) return tok;
  tw_log_init("fuzz", 0);
  char path[4096];
  snprintf(path, sizeof path, "%s/tokenizer.json", tw_fuzz_model_dir());
  if (tw_tokenizer_load(path, &tok) != TW_OK) {
    fprintf(stderr, "fuzz: %s\n", tw_last_error());
    abort();
  }
  return tok;
}

#endif
