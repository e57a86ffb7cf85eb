/* test_prefill_cli.c: twain-prefill offline mode end to end, on the MXFP4
 * tiny model against the Hugging Face fixtures: for every prompt,
 * --dump-logits writes logits within 1e-4 relative L2 of the fixture rows and
 * --generate 48 prints exactly the fixture's greedy continuation. Also
 * --stop-ids, and the exit status of bad input (1: run failed, 2: usage).
 * Usage: test_prefill_cli PATH/TO/twain-prefill */
#include "fixture_util.h"
#include "test_util.h"

#include <cjson/cJSON.h>

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[64];

/* Run a shell command; its stdout into out[cap]; returns the exit status. */
static int run(const char *cmd, char *out, size_t cap) {
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t n = 0;
  if (out) {
    while (n + 1 < cap) {
      size_t k = fread(out + n, 1, cap - 1 - n, p);
      if (k == 0) break;
      n += k;
    }
    out[n] = 0;
  } else {
    char sink[256];
    while (fread(sink, 1, sizeof(sink), p) > 0) {
    }
  }
  int rc = pclose(p);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void write_ids(const char *path, const int32_t *ids, int32_t n) {
  FILE *f = fopen(path, "w");
  if (!f) return;
  fputc('[', f);
  for (int32_t i = 0; i < n; i++) fprintf(f, i ? ", %d" : "%d", ids[i]);
  fputs("]\n", f);
  fclose(f);
}

static void check_prompt(const char *bin, const char *model, const tw_fx_entry_t *fx) {
  char ids_path[256], dump_path[256], cmd[2048], out[4096];
  int ni = snprintf(ids_path, sizeof(ids_path), "%s/%s.json", tmpdir, fx->prompt);
  int nd = snprintf(dump_path, sizeof(dump_path), "%s/%s.bin", tmpdir, fx->prompt);
  int nc = snprintf(cmd, sizeof(cmd),
                    "'%s' --model '%s' --backend cpu --threads 2 --prompt-tokens '%s' "
                    "--dump-logits '%s' --generate 48 2>/dev/null",
                    bin, model, ids_path, dump_path);
  if (ni >= (int)sizeof(ids_path) || nd >= (int)sizeof(dump_path) || nc >= (int)sizeof(cmd)) {
    EXPECT(0, "%s: paths too long for the command line", fx->prompt);
    return;
  }
  write_ids(ids_path, fx->ids, fx->n_ids);
  int rc = run(cmd, out, sizeof(out));
  EXPECT(rc == 0, "%s: exit status %d", fx->prompt, rc);
  cJSON *arr = cJSON_Parse(out);
  int n = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : -1;
  int same = n == fx->n_greedy;
  for (int i = 0; same && i < n; i++)
    same = (int32_t)cJSON_GetArrayItem(arr, i)->valuedouble == fx->greedy[i];
  cJSON_Delete(arr);
  EXPECT(same, "%s: --generate 48 printed '%s'", fx->prompt, out);
  long len = 0;
  float *logits = (float *)tw_fx_read_file(dump_path, &len);
  EXPECT(logits && len == (long)fx->n_ids * fx->vocab * 4, "%s: dump has %ld bytes", fx->prompt,
            len);
  if (logits && len == (long)fx->n_ids * fx->vocab * 4) {
    double e = tw_test_rel_l2_ff(logits + (int64_t)fx->pos_begin * fx->vocab, fx->logits,
                                 (int64_t)fx->n_rows * fx->vocab);
    printf("twain-prefill %-12s dump rel L2 %.3g, generate 48: %s\n", fx->prompt, e,
           same ? "identical" : "DIFFERENT");
    EXPECT(e <= 1e-4, "%s: dumped logits rel L2 %.3g", fx->prompt, e);
  }
  free(logits);
  /* stop ids: generation ends after the first stop id, which is printed */
  snprintf(cmd, sizeof(cmd),
           "'%s' --model '%s' --backend cpu --prompt-tokens '%s' --generate 48 --stop-ids 8063,%d "
           "2>/dev/null",
           bin, model, ids_path, fx->greedy[4]);
  rc = run(cmd, out, sizeof(out));
  int first = 0;
  while (first < 4 && fx->greedy[first] != fx->greedy[4]) first++;
  char want[256] = "[";
  for (int i = 0; i <= first; i++)
    snprintf(want + strlen(want), sizeof(want) - strlen(want), i ? ", %d" : "%d", fx->greedy[i]);
  strcat(want, "]\n");
  EXPECT(rc == 0 && strcmp(out, want) == 0, "%s: --stop-ids printed '%s', want '%s'",
            fx->prompt, out, want);
  unlink(ids_path);
  unlink(dump_path);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s PATH/TO/twain-prefill\n", argv[0]);
    return 2;
  }
  const char *bin = argv[1];
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  if (!fixtures) fixtures = "tests/fixtures";
  char model[512], fx_dir[512];
  snprintf(model, sizeof(model), "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
  snprintf(fx_dir, sizeof(fx_dir), "%s/tiny-gptoss-wordnet", fixtures);
  strcpy(tmpdir, "/tmp/twain-prefill-cli-XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  for (int i = 0; i < 4; i++) {
    tw_fx_entry_t fx;
    if (tw_fx_load(fx_dir, "mxfp4", tw_fx_prompts[i], &fx) != 0) {
      EXPECT(0, "cannot load fixture %s", tw_fx_prompts[i]);
      continue;
    }
    check_prompt(bin, model, &fx);
    tw_fx_free(&fx);
  }
  /* bad input: clear message, non-zero exit */
  char cmd[1024], path[128];
  snprintf(path, sizeof(path), "%s/bad.json", tmpdir);
  const int32_t bad_ids[2] = {8008, 9000}; /* 9000 >= vocab 8064 */
  write_ids(path, bad_ids, 2);
  snprintf(cmd, sizeof(cmd), "'%s' --model '%s' --prompt-tokens '%s' 2>/dev/null", bin, model, path);
  EXPECT(run(cmd, NULL, 0) == 1, "token id outside the vocabulary must exit 1");
  FILE *f = fopen(path, "w");
  if (f) {
    fputs("{\"ids\": [1, 2]}", f);
    fclose(f);
  }
  EXPECT(run(cmd, NULL, 0) == 1, "a JSON object instead of an array must exit 1");
  unlink(path);
  snprintf(cmd, sizeof(cmd), "'%s' --model '%s/nope' --prompt-tokens '%s' 2>/dev/null", bin,
           tmpdir, path);
  EXPECT(run(cmd, NULL, 0) == 1, "a missing prompt file must exit 1");
  snprintf(cmd, sizeof(cmd), "'%s' --generate -3 --prompt-tokens x 2>/dev/null", bin);
  EXPECT(run(cmd, NULL, 0) == 2, "a negative --generate must exit 2");
  snprintf(cmd, sizeof(cmd), "'%s' --frobnicate 1 2>/dev/null", bin);
  EXPECT(run(cmd, NULL, 0) == 2, "an unknown option must exit 2");
  snprintf(cmd, sizeof(cmd), "'%s' --help", bin);
  EXPECT(run(cmd, NULL, 0) == 0, "--help exits 0");
  rmdir(tmpdir);
  return tw_test_exit("test_prefill_cli");
}
