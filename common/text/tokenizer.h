/* tokenizer.h: the gpt-oss tokenizer (byte-level BPE, o200k pre-tokenizer), spec §5.
 *
 * Loads a Hugging Face tokenizer.json of gpt-oss's kind: model.type BPE over
 * GPT-2 byte-level vocab keys, merges giving the pair priorities, ignore_merges
 * (a piece that is itself a vocab entry is one token, spec §5.3 step 1), a
 * Split(regex) pre-tokenizer run through PCRE2 (UTF + Unicode properties, JIT),
 * and added tokens (the Harmony specials, spec §4.1) found by their content,
 * never by hard-coded ids (the small test model numbers them differently).
 *
 * Promises: encode gives exactly the ids of the Hugging Face tokenizer for
 * valid UTF-8 input (tests/tokenizer compares 5+ MB against it); invalid UTF-8
 * is refused with TW_ERR_INVALID_ARGUMENT naming the byte offset; decode gives
 * the raw bytes; the stream decoder only ever emits whole, valid UTF-8.
 *
 * Threads: a loaded tw_tokenizer_t is read-only and may be shared. A
 * tw_tok_encoder_t holds per-thread scratch (PCRE2 match data, JIT stack,
 * piece cache): one per thread. */
#ifndef TW_COMMON_TOKENIZER_H
#define TW_COMMON_TOKENIZER_H

#include "common/base/status.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- flags ------------------------------------------------------------- */

/** Encode flag: split out added/special tokens written in the text (what HF
 *  `encode` does). Without it every byte is ordinary text, so a user who
 *  types "<|end|>" gets the ids of "<|", "end", "|>" (spec §4.2, §6.9). */
#define TW_TOK_ALLOW_SPECIAL 1u
/** Decode flag: leave out added tokens marked special. */
#define TW_TOK_SKIP_SPECIAL 2u

/* ---- types ------------------------------------------------------------- */

typedef struct tw_tokenizer tw_tokenizer_t;
typedef struct tw_tok_encoder tw_tok_encoder_t;

/** A growable id vector the caller owns (tw_token_ids_init / _fini).
 *  Encode functions append to it. */
typedef struct {
  int32_t *ids;
  size_t n;
  size_t cap;
} tw_token_ids_t;

/** A growable byte buffer the caller owns (tw_tok_buf_init / _fini). Always
 *  NUL-terminated after any append (data may be NULL while len is 0). */
typedef struct {
  char *data;
  size_t len;
  size_t cap;
} tw_tok_buf_t;

/** Streaming decoder state (caller storage; tw_tok_stream_init). Holds at most
 *  3 bytes of an unfinished UTF-8 sequence between tokens. */
typedef struct {
  const tw_tokenizer_t *tok; /* borrowed */
  unsigned char pending[4];
  int n_pending;
  unsigned flags; /* TW_TOK_SKIP_SPECIAL or 0 */
} tw_tok_stream_t;

/* ---- vectors ----------------------------------------------------------- */

void tw_token_ids_init(tw_token_ids_t *v);
void tw_token_ids_fini(tw_token_ids_t *v);
/** Append one id. TW_ERR_NO_MEMORY if growing fails. */
TW_NODISCARD tw_status_t tw_token_ids_push(tw_token_ids_t *v, int32_t id);
/** Make room for `extra` more ids. TW_ERR_NO_MEMORY if growing fails. */
TW_NODISCARD tw_status_t tw_token_ids_reserve(tw_token_ids_t *v, size_t extra);

void tw_tok_buf_init(tw_tok_buf_t *b);
void tw_tok_buf_fini(tw_tok_buf_t *b);
/** Append `len` bytes (NUL-terminates). TW_ERR_NO_MEMORY if growing fails. */
TW_NODISCARD tw_status_t tw_tok_buf_append(tw_tok_buf_t *b, const void *data, size_t len);

/* ---- loading ----------------------------------------------------------- */

#define TW_TOKENIZER_MAX_FILE_BYTES ((size_t)256 << 20) /* o200k's tokenizer.json: 27 MiB */

/** Load a tokenizer.json file: a regular file of at most
 *  TW_TOKENIZER_MAX_FILE_BYTES. Errors: TW_ERR_IO (cannot open or read),
 *  TW_ERR_INVALID_ARGUMENT (a FIFO, a device,
 *  a directory: refused without reading), TW_ERR_FORMAT (too large,
 *  not JSON, not model.type BPE, a vocab key that is not byte-level, a merge
 *  whose parts or result are missing, a byte without a token, a pre-tokenizer
 *  without a Split regex), TW_ERR_UNSUPPORTED (a regex PCRE2 cannot compile),
 *  TW_ERR_NO_MEMORY. On success *tok_p owns everything (tw_tokenizer_destroy). */
TW_NODISCARD tw_status_t tw_tokenizer_load(const char *path, tw_tokenizer_t **tok_p);

/** Same, from the JSON text in memory (borrowed, `len` bytes). */
TW_NODISCARD tw_status_t tw_tokenizer_load_json(const char *json, size_t len,
                                                tw_tokenizer_t **tok_p);

/** Free a tokenizer. NULL does nothing. */
void tw_tokenizer_destroy(tw_tokenizer_t *tok);

/* ---- queries ----------------------------------------------------------- */

/** One past the largest id with bytes (vocab or added): 200019 for gpt-oss.
 *  The model's embedding may be larger (201088, spec §6.10). */
int32_t tw_tokenizer_n_ids(const tw_tokenizer_t *tok);

/** The id of the added token whose content is exactly `content` (e.g.
 *  "<|start|>"). TW_ERR_NOT_FOUND if there is none. */
TW_NODISCARD tw_status_t tw_tokenizer_find_added(const tw_tokenizer_t *tok, const char *content,
                                                 int32_t *id_p);

/** Whether `id` is an added token marked special. */
int tw_tokenizer_is_special(const tw_tokenizer_t *tok, int32_t id);

/** The bytes of token `id` (borrowed from the tokenizer; not NUL-terminated).
 *  TW_ERR_OUT_OF_RANGE if the id has no bytes (negative, reserved, too big). */
TW_NODISCARD tw_status_t tw_tokenizer_token_bytes(const tw_tokenizer_t *tok, int32_t id,
                                                  const char **bytes_p, size_t *len_p);

/* ---- encoding ---------------------------------------------------------- */

/** Per-thread encode scratch for `tok` (borrowed; must outlive the encoder).
 *  TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_tok_encoder_create(const tw_tokenizer_t *tok, tw_tok_encoder_t **enc_p);
void tw_tok_encoder_destroy(tw_tok_encoder_t *enc);

/** Encode `len` bytes of UTF-8 `text`, appending the ids to `out`.
 *  flags: TW_TOK_ALLOW_SPECIAL or 0. Errors: TW_ERR_INVALID_ARGUMENT (text is
 *  not valid UTF-8: the message gives the byte offset; nothing is appended;
 *  or a run the PCRE2 pre-tokenizer cannot split within its match limits,
 *  e.g. megabytes of whitespace),
 *  TW_ERR_NO_MEMORY, TW_ERR_INTERNAL (a PCRE2 match failure). On error `out`
 *  is left as it was. */
TW_NODISCARD tw_status_t tw_tok_encoder_encode(tw_tok_encoder_t *enc, const char *text, size_t len,
                                               unsigned flags, tw_token_ids_t *out);

/** Convenience: tw_tok_encoder_encode with a temporary encoder. */
TW_NODISCARD tw_status_t tw_tokenizer_encode(const tw_tokenizer_t *tok, const char *text,
                                             size_t len, unsigned flags, tw_token_ids_t *out);

/* ---- decoding ---------------------------------------------------------- */

/** Append the bytes of `n` ids to `out` (raw bytes: may be invalid UTF-8 if the
 *  ids split a character). flags: TW_TOK_SKIP_SPECIAL or 0.
 *  TW_ERR_OUT_OF_RANGE names the first id without bytes (nothing appended). */
TW_NODISCARD tw_status_t tw_tokenizer_decode(const tw_tokenizer_t *tok, const int32_t *ids,
                                             size_t n, unsigned flags, tw_tok_buf_t *out);

/** Start a streaming decode (spec §5.3: buffer incomplete UTF-8 across tokens). */
void tw_tok_stream_init(tw_tok_stream_t *s, const tw_tokenizer_t *tok, unsigned flags);

/** Feed one id (of a model's output); append to `out` every complete character
 *  now known. Bytes that can never become valid UTF-8 come out as U+FFFD (one
 *  per maximal invalid subpart, as Rust's from_utf8_lossy); an unfinished
 *  sequence is held back. An id >= 0 without bytes (the model's embedding
 *  past the tokenizer, 201,088 against 200,019 ids for gpt-oss, spec §6.10:
 *  a sampler can draw one) adds nothing, as Hugging Face's decoder skips ids
 *  it does not know. TW_ERR_OUT_OF_RANGE for a negative id (state unchanged). */
TW_NODISCARD tw_status_t tw_tok_stream_push(tw_tok_stream_t *s, int32_t id, tw_tok_buf_t *out);

/** End of stream: a held-back unfinished sequence becomes U+FFFD. */
TW_NODISCARD tw_status_t tw_tok_stream_finish(tw_tok_stream_t *s, tw_tok_buf_t *out);

/** Append `len` bytes to `out` as valid UTF-8: what is not becomes U+FFFD,
 *  one per maximal invalid subpart (as tw_tok_stream_push; an unfinished
 *  sequence at the end: one more). Errors: TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_utf8_lossy(const char *s, size_t len, tw_tok_buf_t *out);

/** Whether `len` bytes are valid UTF-8 (no surrogates, no overlongs, <= U+10FFFF).
 *  If not and bad_offset_p is non-NULL, *bad_offset_p is the first bad byte. */
int tw_utf8_valid(const char *s, size_t len, size_t *bad_offset_p);

#ifdef __cplusplus
}
#endif
#endif
