/* harmony_impl.h: the inside of tw_harmony_t, shared by harmony_render.c and
 * harmony_parse.c. Not for other modules: use harmony.h. */
#ifndef TW_COMMON_HARMONY_IMPL_H
#define TW_COMMON_HARMONY_IMPL_H

#include "common/text/harmony.h"

/* The special tokens Harmony uses (spec §4.1), looked up by content. */
enum {
  TW_HT_START = 0,
  TW_HT_END,
  TW_HT_MESSAGE,
  TW_HT_CHANNEL,
  TW_HT_CONSTRAIN,
  TW_HT_RETURN,
  TW_HT_CALL,
  TW_HT_COUNT
};

struct tw_harmony {
  const tw_tokenizer_t *tok; /* borrowed */
  int32_t ids[TW_HT_COUNT];
};

#endif
