/* fuzz_checkpoint.c: a safetensors file (header + data) and a config.json,
 * as the loader reads them: the first byte picks which. Either a clear
 * error or a complete, consistent result; never a crash or an overread. */
#include "common/base/log.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int init;
  if (!init) {
    tw_log_init("fuzz", 0);
    init = 1;
  }
  if (size < 1 || size > (1 << 20)) return 0;
  if (data[0] & 1) {
    char *text = malloc(size);
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    tw_model_config_t c;
    if (tw_config_parse(text, &c) == TW_OK && (c.n_layers < 1 || c.vocab_size < 1 || c.hidden < 1))
      abort(); /* an accepted config has sane sizes */
    free(text);
    return 0;
  }
  /* an exact-size copy, so that ASan catches any read past the file */
  uint8_t *file = malloc(size - 1 ? size - 1 : 1);
  memcpy(file, data + 1, size - 1);
  tw_safetensors_t *f = NULL;
  if (tw_safetensors_parse(file, (int64_t)size - 1, "fuzz.safetensors", &f) == TW_OK) {
    int64_t n = tw_safetensors_count(f);
    for (int64_t i = 0; i < n; i++) {
      const tw_safetensors_tensor_t *t = tw_safetensors_tensor_at(f, i);
      if (!t || (const uint8_t *)t->data < file ||
          (const uint8_t *)t->data + t->n_bytes > file + size - 1)
        abort(); /* every accepted tensor lies inside the file */
      volatile uint8_t sum = 0;
      for (int64_t b = 0; b < t->n_bytes; b++) sum += ((const uint8_t *)t->data)[b];
    }
  }
  tw_safetensors_destroy(f);
  free(file);
  return 0;
}
