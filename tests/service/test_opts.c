/* test_opts.c: the shared option parser (common/base/opts.h) on a table with one
 * row of each kind: --x value and --x=value, strict numbers rejected naming
 * the flag, flags, custom parsers, positional counts, the TWAIN_* environment,
 * --config FILE and the precedence command line > environment > config >
 * defaults, --help (stdout, every option) and --version. Messages on stderr
 * and the help text on stdout are captured through files. */
#include "common/base/opts.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/test_expect.h"

typedef struct {
  const char *name;
  int n;
  long long big;
  double temp;
  bool flag;
  int color; /* custom: red 1, blue 2 */
  int cap;   /* its help names its own default */
} vals_t;

static int color_opt(const char *t, void *dst, char *err, size_t errlen) {
  if (!strcmp(t, "red") || !strcmp(t, "blue")) {
    *(int *)dst = t[0] == 'r' ? 1 : 2;
    return 0;
  }
  snprintf(err, errlen, "must be red or blue, got '%s'", t);
  return -1;
}

static char out_buf[8192], err_buf[8192];

/* Run the parser on a NULL-terminated argument list with a fresh table;
 * stdout and stderr of the call land in out_buf / err_buf. */
static int run(vals_t *v, int *first, bool config, int max_args, const char *const *args) {
  *v = (vals_t){.name = "dflt", .n = 7, .big = 5, .temp = 1.0, .flag = false, .color = 0, .cap = 0};
  tw_opt_t opts[] = {
      TW_OPT_STR("name", &v->name, "S", "a string"),
      TW_OPT_INT("n", &v->n, -1, 100, "N", "an int in [-1, 100]"),
      TW_OPT_LONG("big", &v->big, 0, 1LL << 40, "B", "a long"),
      TW_OPT_DOUBLE("temp", &v->temp, 0, 2, "T", "a double in [0, 2]"),
      TW_OPT_FLAG("flag", &v->flag, "a flag"),
      TW_OPT_FN("color", &v->color, color_opt, "red|blue", "a custom parser"),
      TW_OPT_INT("cap", &v->cap, 0, 100, "C", "a cap (default: the other side's)"),
  };
  tw_opts_spec_t spec = {.prog = "prog", .synopsis = "[OPTIONS] [ARG]", .env_prefix = "TWTEST_",
                         .opts = opts, .n_opts = sizeof opts / sizeof opts[0], .config = config,
                         .min_args = 0, .max_args = max_args};
  char *argv[32];
  int argc = 0;
  argv[argc++] = (char *)"prog";
  for (int i = 0; args[i]; i++) argv[argc++] = (char *)args[i];
  argv[argc] = NULL;
  fflush(stdout);
  fflush(stderr);
  int so = dup(1), se = dup(2);
  FILE *fo = tmpfile(), *fe = tmpfile();
  dup2(fileno(fo), 1);
  dup2(fileno(fe), 2);
  int rc = tw_opts_parse(&spec, argc, argv, first);
  fflush(stdout);
  fflush(stderr);
  dup2(so, 1);
  dup2(se, 2);
  close(so);
  close(se);
  size_t n;
  rewind(fo);
  n = fread(out_buf, 1, sizeof out_buf - 1, fo);
  out_buf[n] = '\0';
  rewind(fe);
  n = fread(err_buf, 1, sizeof err_buf - 1, fe);
  err_buf[n] = '\0';
  fclose(fo);
  fclose(fe);
  return rc;
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

int main(void) {
  vals_t v;
  int first = -1;
  /* both spellings, every kind */
  int rc = run(&v, &first, false, 1,
               ARGS("--name", "abc", "--n=42", "--big", "1099511627776", "--temp=0.5", "--flag",
                    "--color=blue", "pos"));
  EXPECT(rc == TW_OPTS_RUN, "valid line: rc %d, stderr %s", rc, err_buf);
  EXPECT(!strcmp(v.name, "abc") && v.n == 42 && v.big == 1099511627776LL && v.temp == 0.5 &&
             v.flag && v.color == 2,
         "values: name %s n %d big %lld temp %g flag %d color %d", v.name, v.n, v.big, v.temp,
         v.flag, v.color);
  EXPECT(first == 9, "first positional at argv[9], got %d", first);
  /* defaults untouched when nothing is given */
  rc = run(&v, &first, false, 0, ARGS("--n", "-1"));
  EXPECT(rc == TW_OPTS_RUN && v.n == -1 && !strcmp(v.name, "dflt") && v.big == 5 && !v.flag,
         "defaults kept: rc %d n %d name %s", rc, v.n, v.name);

  /* strict numbers, each rejected with exit 2 naming the flag and the value */
  static const struct {
    const char *arg, *want;
  } bad[] = {
      {"--n=12abc", "prog: --n must be an integer in [-1, 100], got '12abc'"},
      {"--n=", "prog: --n must be an integer in [-1, 100], got ''"},
      {"--n= 5", "prog: --n must be an integer in [-1, 100], got ' 5'"},
      {"--n=101", "prog: --n must be an integer in [-1, 100], got '101'"},
      {"--n=1e2", "prog: --n must be an integer in [-1, 100], got '1e2'"},
      {"--big=99999999999999999999", "prog: --big must be an integer in [0, 1099511627776], got '99999999999999999999'"},
      {"--temp=abc", "prog: --temp must be a number in [0, 2], got 'abc'"},
      {"--temp=nan", "prog: --temp must be a number in [0, 2], got 'nan'"},
      {"--temp=3", "prog: --temp must be a number in [0, 2], got '3'"},
      {"--color=green", "prog: --color must be red or blue, got 'green'"},
      {"--flag=1", "prog: --flag is a flag and takes no value, got '--flag=1'"},
      {"--bogus=3", "prog: unknown option --bogus (see --help)"},
      {"-x", "prog: unknown option -x (see --help)"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    rc = run(&v, NULL, false, 0, ARGS(bad[i].arg));
    EXPECT(rc == 2 && strstr(err_buf, bad[i].want), "%s: rc %d, stderr '%s', want '%s'", bad[i].arg,
           rc, err_buf, bad[i].want);
  }
  rc = run(&v, NULL, false, 0, ARGS("--n"));
  EXPECT(rc == 2 && strstr(err_buf, "prog: --n needs a value"), "--n alone: rc %d '%s'", rc, err_buf);
  rc = run(&v, NULL, false, 1, ARGS("a", "b"));
  EXPECT(rc == 2 && strstr(err_buf, "unexpected argument 'b'"), "2 args of 1: rc %d '%s'", rc, err_buf);
  rc = run(&v, NULL, false, 0, ARGS("--config", "/dev/null"));
  EXPECT(rc == 2 && strstr(err_buf, "unknown option --config"), "no --config unless allowed: '%s'", err_buf);

  /* --help: stdout, exit 0, every option with its default; nothing on stderr */
  rc = run(&v, NULL, true, 0, ARGS("--help"));
  EXPECT(rc == 0 && !err_buf[0] && !strncmp(out_buf, "usage: prog [OPTIONS] [ARG]\n", 28),
         "--help: rc %d, stdout '%.40s', stderr '%s'", rc, out_buf, err_buf);
  static const char *const rows[] = {"--name S", "(default dflt)", "--n N", "(default 7)", "--big B",
                                     "--temp T", "(default 1)", "--flag", "--color red|blue",
                                     "--config FILE", "-h, --help", "--version", "TWTEST_<NAME>",
                                     "TWTEST_CONFIG"};
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    EXPECT(strstr(out_buf, rows[i]), "--help lists '%s'", rows[i]);
  /* a help text that names its default gets no second one from the value */
  const char *cap = strstr(out_buf, "a cap (default: the other side's)");
  EXPECT(cap && strncmp(cap + strlen("a cap (default: the other side's)"), " (default", 9) != 0,
         "--cap's own default, once: '%.60s'", cap ? cap : "(missing)");
  rc = run(&v, NULL, false, 0, ARGS("-h"));
  EXPECT(rc == 0 && strstr(out_buf, "usage: prog"), "-h: rc %d", rc);
  rc = run(&v, NULL, false, 0, ARGS("--version"));
  char want_version[64];
  snprintf(want_version, sizeof want_version, "prog %s\n", tw_opts_version());
  EXPECT(rc == 0 && !strcmp(out_buf, want_version) && !strcmp(tw_opts_version(), "0.1.0"),
         "--version: rc %d '%s'", rc, out_buf);

  /* environment: each option, strict too; the command line wins */
  setenv("TWTEST_N", "33", 1);
  setenv("TWTEST_FLAG", "yes", 1);
  setenv("TWTEST_NAME", "fromenv", 1);
  rc = run(&v, NULL, false, 0, ARGS("--name=cli"));
  EXPECT(rc == TW_OPTS_RUN && v.n == 33 && v.flag && !strcmp(v.name, "cli"),
         "environment: rc %d n %d flag %d name %s", rc, v.n, v.flag, v.name);
  setenv("TWTEST_N", "33x", 1);
  rc = run(&v, NULL, false, 0, ARGS("--name=cli"));
  EXPECT(rc == 2 && strstr(err_buf, "prog: environment TWTEST_N: --n must be an integer in [-1, 100], got '33x'"),
         "bad environment value named: rc %d '%s'", rc, err_buf);
  setenv("TWTEST_FLAG", "maybe", 1);
  unsetenv("TWTEST_N");
  rc = run(&v, NULL, false, 0, ARGS("--n=1"));
  EXPECT(rc == 2 && strstr(err_buf, "TWTEST_FLAG: --flag is a flag: 1/true/yes/on or 0/false/no/off, got 'maybe'"),
         "bad environment flag: '%s'", err_buf);
  unsetenv("TWTEST_FLAG");
  unsetenv("TWTEST_NAME");

  /* --config FILE: name: value / name = value, comments, quotes; environment
   * and command line win over it */
  char path[] = "/tmp/tw_test_opts_XXXXXX";
  int fd = mkstemp(path);
  FILE *f = fdopen(fd, "w");
  fprintf(f, "# a comment\n\nname: \"from config\"  # trailing\n--n = 12\nbig: 77\nflag: true\n"
             "color: red\ntemp: 1.5\n");
  fclose(f);
  setenv("TWTEST_BIG", "88", 1);
  rc = run(&v, NULL, true, 0, ARGS("--config", path, "--temp=0.25"));
  EXPECT(rc == TW_OPTS_RUN && !strcmp(v.name, "from config") && v.n == 12 && v.big == 88 &&
             v.flag && v.color == 1 && v.temp == 0.25,
         "config: rc %d name '%s' n %d big %lld flag %d color %d temp %g (%s)", rc, v.name, v.n,
         v.big, v.flag, v.color, v.temp, err_buf);
  unsetenv("TWTEST_BIG");
  setenv("TWTEST_CONFIG", path, 1); /* the config file from the environment */
  rc = run(&v, NULL, true, 0, ARGS("--n=3"));
  EXPECT(rc == TW_OPTS_RUN && v.n == 3 && v.big == 77, "TWTEST_CONFIG: rc %d n %d big %lld", rc, v.n, v.big);
  unsetenv("TWTEST_CONFIG");
  f = fopen(path, "w");
  fprintf(f, "n: 5\nkv: 3\n");
  fclose(f);
  rc = run(&v, NULL, true, 0, ARGS("--config", path));
  char want[256];
  snprintf(want, sizeof want, "prog: %s:2: unknown option 'kv'", path);
  EXPECT(rc == 2 && strstr(err_buf, want), "config unknown name: '%s'", err_buf);
  f = fopen(path, "w");
  fprintf(f, "n: 12abc\n");
  fclose(f);
  rc = run(&v, NULL, true, 0, ARGS("--config=" "/nonexistent/tw.conf"));
  EXPECT(rc == 2 && strstr(err_buf, "--config /nonexistent/tw.conf: cannot open"), "missing config: '%s'", err_buf);
  rc = run(&v, NULL, true, 0, ARGS("--config", path));
  snprintf(want, sizeof want, "prog: %s:1: --n must be an integer in [-1, 100], got '12abc'", path);
  EXPECT(rc == 2 && strstr(err_buf, want), "config bad number: '%s'", err_buf);
  unlink(path);

  /* the id lists of --stop-ids */
  int32_t ids[4];
  int n = 0;
  char err[128];
  EXPECT(tw_opts_id_list("5,17,0", ids, 4, &n, err, sizeof err) == 0 && n == 3 && ids[0] == 5 &&
             ids[1] == 17 && ids[2] == 0, "id list 5,17,0: n %d", n);
  EXPECT(tw_opts_id_list("5,x", ids, 4, &n, err, sizeof err) == -1 && strstr(err, "got 'x'"),
         "id list 5,x: '%s'", err);
  EXPECT(tw_opts_id_list("1,2,3,4,5", ids, 4, &n, err, sizeof err) == -1 && strstr(err, "at most 4"),
         "id list over cap: '%s'", err);
  EXPECT(tw_opts_id_list("-1", ids, 4, &n, err, sizeof err) == -1, "negative id refused");
  const char *empty[] = {"1,,2", ",", "1,", ",1", ""};
  for (int k = 0; k < 5; k++)
    EXPECT(
        tw_opts_id_list(empty[k], ids, 4, &n, err, sizeof err) == -1 && strstr(err, "empty item"),
        "an empty item in '%s' refused (%s)", empty[k], err);

  /* the three-way settings (--kv-window-ring, --prefill-bf16-experts): 1, -1, 0 */
  int32_t sw = 7;
  EXPECT(tw_opts_switch_auto("1", &sw, err, sizeof err) == 0 && sw == 1, "switch 1: %d", sw);
  EXPECT(tw_opts_switch_auto("0", &sw, err, sizeof err) == 0 && sw == -1, "switch 0: %d", sw);
  EXPECT(tw_opts_switch_auto("auto", &sw, err, sizeof err) == 0 && sw == 0, "switch auto: %d", sw);
  EXPECT(tw_opts_switch_auto("yes", &sw, err, sizeof err) == -1 && sw == 0 &&
             strstr(err, "must be 0, 1 or auto, got 'yes'"),
         "switch yes: %d '%s'", sw, err);
  printf("%s\n", fails ? "FAIL" : "ok");
  return fails ? 1 : 0;
}
