/* bench_tokenizer.c (twain-bench-tokenizer): single-thread encode throughput.
 *
 *   twain-bench-tokenizer TOKENIZER_JSON CORPUS_DIR [REPEATS]
 *
 * Encodes every document of CORPUS_DIR/corpus.bin (gen_corpus.py; the same
 * corpus tests/tokenizer/bench_reference.py times with HF tokenizers and
 * tiktoken) with one encoder on one thread, REPEATS times (default 5), and
 * prints the best MB/s (MB = 10^6 bytes; wall and thread-CPU time) for ordinary
 * text and with special tokens allowed, a per-kind breakdown (CPU time), plus the load time and the number of ids. The piece cache is
 * emptied before each repeat (a fresh encoder), so repeats do not flatter it. */
#include "common/base/log.h"
#include "common/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of this thread: on a shared, loaded machine (2 cores, others
 * building) wall time also counts waiting for a core; CPU time does not. */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s TOKENIZER_JSON CORPUS_DIR [REPEATS]\n", argv[0]);
    return 2;
  }
  tw_log_init("twain-bench-tokenizer", 0);
  int repeats = argc > 3 ? atoi(argv[3]) : 5;
  if (repeats < 1) repeats = 1;
  char path[4096];
  size_t corpus_len, idx_len;
  snprintf(path, sizeof path, "%s/corpus.bin", argv[2]);
  char *corpus = read_file(path, &corpus_len);
  snprintf(path, sizeof path, "%s/corpus.idx", argv[2]);
  char *idx = read_file(path, &idx_len);
  if (!corpus || !idx) {
    fprintf(stderr, "cannot read %s/corpus.bin and corpus.idx (run tests/tokenizer/setup.sh)\n",
            argv[2]);
    return 1;
  }
  size_t n_docs = 0, cap = 1024;
  size_t *offs = malloc(cap * sizeof *offs), *lens = malloc(cap * sizeof *lens);
  char(*kinds)[16] = malloc(cap * sizeof *kinds);
  for (char *line = idx; line && *line;) {
    char *nl = strchr(line, '\n');
    if (n_docs == cap) {
      cap *= 2;
      offs = realloc(offs, cap * sizeof *offs);
      lens = realloc(lens, cap * sizeof *lens);
      kinds = realloc(kinds, cap * sizeof *kinds);
    }
    strcpy(kinds[n_docs], "?");
    if (sscanf(line, "%zu %zu %15s", &offs[n_docs], &lens[n_docs], kinds[n_docs]) >= 2) n_docs++;
    line = nl ? nl + 1 : NULL;
  }
  double t0 = now_s();
  tw_tokenizer_t *tok;
  if (tw_tokenizer_load(argv[1], &tok) != TW_OK) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], tw_last_error());
    return 1;
  }
  double load_s = now_s() - t0;
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  printf("tokenizer %s: loaded in %.2f s; corpus %zu documents, %zu bytes; %d repeats\n", argv[1],
         load_s, n_docs, corpus_len, repeats);
  for (int mode = 0; mode < 2; mode++) {
    double best = 1e30, best_cpu = 1e30;
    size_t n_ids = 0;
    for (int r = 0; r < repeats; r++) {
      tw_tok_encoder_t *enc;
      if (tw_tok_encoder_create(tok, &enc) != TW_OK) return 1;
      n_ids = 0;
      double s = now_s(), c = cpu_s();
      for (size_t d = 0; d < n_docs; d++) {
        ids.n = 0;
        if (tw_tok_encoder_encode(enc, corpus + offs[d], lens[d], mode ? TW_TOK_ALLOW_SPECIAL : 0,
                                  &ids) != TW_OK) {
          fprintf(stderr, "encode failed on document %zu: %s\n", d, tw_last_error());
          return 1;
        }
        n_ids += ids.n;
      }
      double e = now_s() - s, ec = cpu_s() - c;
      if (e < best) best = e;
      if (ec < best_cpu) best_cpu = ec;
      tw_tok_encoder_destroy(enc);
    }
    printf("twain encode (%s): %.2f MB/s wall, %.2f MB/s cpu, single thread (best of %d: %.3f s "
           "wall, %.3f s cpu, %zu ids)\n", mode ? "special allowed" : "ordinary",
           (double)corpus_len / best / 1e6, (double)corpus_len / best_cpu / 1e6, repeats, best,
           best_cpu, n_ids);
  }
  /* per kind of text, ordinary mode, one pass each (where the time goes) */
  tw_tok_encoder_t *enc;
  if (tw_tok_encoder_create(tok, &enc) != TW_OK) return 1;
  for (size_t d0 = 0; d0 < n_docs;) {
    size_t d1 = d0, bytes = 0;
    double s = cpu_s();
    for (; d1 < n_docs && strcmp(kinds[d1], kinds[d0]) == 0; d1++) {
      ids.n = 0;
      if (tw_tok_encoder_encode(enc, corpus + offs[d1], lens[d1], 0, &ids) != TW_OK) return 1;
      bytes += lens[d1];
    }
    double e = cpu_s() - s;
    printf("  %-12s %9zu bytes  %7.2f MB/s cpu\n", kinds[d0], bytes, (double)bytes / e / 1e6);
    d0 = d1;
  }
  tw_tok_encoder_destroy(enc);
  tw_token_ids_fini(&ids);
  tw_tokenizer_destroy(tok);
  free(offs);
  free(lens);
  free(kinds);
  free(corpus);
  free(idx);
  return 0;
}
