/* fixture_util.h: reading the Hugging Face reference fixtures of
 * tests/fixtures/tiny-gptoss-wordnet (prompts.json, manifest.json and the
 * little-endian float32 logits files) for the engine tests. */
#ifndef TW_TESTS_ENGINE_FIXTURE_UTIL_H
#define TW_TESTS_ENGINE_FIXTURE_UTIL_H

#include <stdint.h>

typedef struct {
  char prompt[64];
  int32_t *ids;          /* [n_ids] prompt token ids */
  int32_t n_ids;
  float *logits;         /* [n_rows, vocab] reference logits of positions pos_begin.. */
  int32_t n_rows, vocab, pos_begin;
  int32_t *argmax;       /* [n_ids] argmax at every prompt position */
  int32_t *greedy;       /* [n_greedy] greedy continuation */
  int32_t n_greedy;
} tw_fx_entry_t;

/* Read a whole file (NUL-terminated); NULL on failure (message printed). */
char *tw_fx_read_file(const char *path, long *len_p);

/* Load the entry (variant, prompt) of `fixture_dir` (which holds
 * manifest.json, prompts.json and the logits files). Returns 0 on success. */
int tw_fx_load(const char *fixture_dir, const char *variant, const char *prompt,
               tw_fx_entry_t *entry);
void tw_fx_free(tw_fx_entry_t *entry);

/* Names of the prompts in manifest order ("short_dog", ...). */
extern const char *const tw_fx_prompts[4];

#endif
