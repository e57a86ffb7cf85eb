/* opts.c: the shared option parser (opts.h): getopt_long over a table,
 * strict numbers, --help/--version, TWAIN_* environment, --config FILE. */
#include "common/base/opts.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_VERSION
#define TW_VERSION "0.0.0"
#endif

#define TW_OPTS_VAL0 1000 /* getopt_long val of row i: TW_OPTS_VAL0 + i */
#define TW_OPTS_VAL_CONFIG 900
#define TW_OPTS_VAL_VERSION 901
#define TW_OPTS_MAX_CLI 512 /* options on one command line */
#define TW_OPTS_MAX_NAME 64

const char *tw_opts_version(void) { return TW_VERSION; }

/* Strings read from a config file stay valid for the process: they are kept
 * here and freed at exit. */
static char **tw_opts_kept_g;
static size_t tw_opts_n_kept_g;

static void tw_opts_free_kept(void) {
  for (size_t i = 0; i < tw_opts_n_kept_g; i++) free(tw_opts_kept_g[i]);
  free(tw_opts_kept_g);
  tw_opts_kept_g = NULL;
  tw_opts_n_kept_g = 0;
}

const char *tw_opts_keep(const char *s) {
  char **grown = realloc(tw_opts_kept_g, (tw_opts_n_kept_g + 1) * sizeof *grown);
  char *copy = strdup(s);
  if (!grown || !copy) {
    free(copy);
    if (grown) tw_opts_kept_g = grown;
    return NULL;
  }
  if (!tw_opts_kept_g) atexit(tw_opts_free_kept);
  tw_opts_kept_g = grown;
  tw_opts_kept_g[tw_opts_n_kept_g++] = copy;
  return copy;
}

int tw_opts_switch_auto(const char *text, void *dst, char *err, size_t errlen) {
  int32_t *v = dst;
  if (text && !strcmp(text, "1"))
    *v = 1;
  else if (text && !strcmp(text, "0"))
    *v = -1;
  else if (text && !strcmp(text, "auto"))
    *v = 0;
  else {
    snprintf(err, errlen, "must be 0, 1 or auto, got '%s'", text ? text : "");
    return -1;
  }
  return 0;
}

int tw_opts_ll(const char *text, long long lo, long long hi, long long *out) {
  if (!text[0] || isspace((unsigned char)text[0])) return -1;
  char *end = NULL;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

int tw_opts_int(const char *prog, const char *what, const char *text, long long lo, long long hi,
                long long *out) {
  if (tw_opts_ll(text, lo, hi, out) == 0) return 0;
  fprintf(stderr, "%s: %s must be an integer in [%lld, %lld], got '%s'\n", prog, what, lo, hi,
          text);
  return -1;
}

int tw_opts_id_list(const char *text, int32_t *ids, int cap, int *n, char *err, size_t errlen) {
  char buf[1024];
  *n = 0;
  if (snprintf(buf, sizeof buf, "%s", text) >= (int)sizeof buf) {
    snprintf(err, errlen, "is longer than %zu characters", sizeof buf - 1);
    return -1;
  }
  /* strtok would pass over empty items ("1,,2", ","): each one is an error */
  size_t len = strlen(buf);
  for (size_t i = 0; i <= len; i++)
    if ((i == len || buf[i] == ',') && (i == 0 || buf[i - 1] == ',')) {
      snprintf(err, errlen, "must be ids in [0, %d] separated by commas, got an empty item in '%s'",
               INT32_MAX, text);
      return -1;
    }
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    long long v;
    if (*n == cap) {
      snprintf(err, errlen, "takes at most %d ids", cap);
      return -1;
    }
    if (tw_opts_ll(t, 0, INT32_MAX, &v)) {
      snprintf(err, errlen, "must be ids in [0, %d] separated by commas, got '%s'", INT32_MAX, t);
      return -1;
    }
    ids[(*n)++] = (int32_t)v;
  }
  return 0;
}

static int tw_opts_bool(const char *t, bool *out) {
  static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
  for (int i = 0; i < 4; i++) {
    if (!strcasecmp(t, yes[i])) return *out = true, 0;
    if (!strcasecmp(t, no[i])) return *out = false, 0;
  }
  return -1;
}

/* Store `text` into row o; `origin` names where it came from ("" for the
 * command line). Returns 0, or -1 after printing why on stderr. */
static int tw_opts_set(const tw_opts_spec_t *spec, tw_opt_t *o, const char *text,
                       const char *origin) {
  char err[1024] = "";
  long long v = 0;
  int bad = 0;
  switch (o->kind) {
  case TW_OPT_KIND_FLAG:
    bad = tw_opts_bool(text, (bool *)o->dst);
    if (bad) snprintf(err, sizeof err, "is a flag: 1/true/yes/on or 0/false/no/off, got '%s'", text);
    break;
  case TW_OPT_KIND_STR:
    if (o->parse) bad = o->parse(text, o->dst, err, sizeof err);
    else *(const char **)o->dst = text;
    if (bad && !err[0]) snprintf(err, sizeof err, "got a bad value '%s'", text);
    break;
  case TW_OPT_KIND_INT:
  case TW_OPT_KIND_LONG:
    bad = tw_opts_ll(text, o->lo, o->hi, &v);
    if (bad) snprintf(err, sizeof err, "must be an integer in [%lld, %lld], got '%s'", o->lo, o->hi, text);
    else if (o->kind == TW_OPT_KIND_INT) *(int *)o->dst = (int)v;
    else *(long long *)o->dst = v;
    break;
  case TW_OPT_KIND_DOUBLE: {
    char *end = NULL;
    errno = 0;
    double d = text[0] && !isspace((unsigned char)text[0]) ? strtod(text, &end) : NAN;
    bad = !end || end == text || *end || errno == ERANGE || !isfinite(d) || d < o->dlo || d > o->dhi;
    if (bad) snprintf(err, sizeof err, "must be a number in [%g, %g], got '%s'", o->dlo, o->dhi, text);
    else *(double *)o->dst = d;
    break;
  }
  case TW_OPT_KIND_FN:
    bad = o->parse(text, o->dst, err, sizeof err);
    if (bad && !err[0]) snprintf(err, sizeof err, "got a bad value '%s'", text);
    break;
  }
  if (bad) {
    fprintf(stderr, "%s: %s--%s %s\n", spec->prog, origin, o->name, err);
    return -1;
  }
  o->given = true;
  return 0;
}

static tw_opt_t *tw_opts_find(const tw_opts_spec_t *spec, const char *name) {
  for (size_t i = 0; i < spec->n_opts; i++)
    if (!strcmp(spec->opts[i].name, name)) return &spec->opts[i];
  return NULL;
}

bool tw_opts_given(const tw_opts_spec_t *spec, const char *name) {
  const tw_opt_t *o = tw_opts_find(spec, name);
  return o && o->given;
}

/* "kv-blocks" -> "TWAIN_DECODE_KV_BLOCKS" */
static void tw_opts_env_name(const tw_opts_spec_t *spec, const char *name, char *out, size_t len) {
  int n = snprintf(out, len, "%s", spec->env_prefix ? spec->env_prefix : "");
  for (const char *p = name; *p && n + 1 < (int)len; p++)
    out[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
  out[n < (int)len ? n : (int)len - 1] = '\0';
}

static char *tw_opts_trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

/* Apply the config file at `path`. 0 ok, -1 after printing FILE:LINE: why. */
static int tw_opts_config(const tw_opts_spec_t *spec, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "%s: --config %s: cannot open: %s\n", spec->prog, path, strerror(errno));
    return -1;
  }
  char line[4096], origin[600];
  int rc = 0;
  for (int ln = 1; rc == 0 && fgets(line, sizeof line, f); ln++) {
    snprintf(origin, sizeof origin, "%s:%d: ", path, ln);
    if (!strchr(line, '\n') && !feof(f)) {
      fprintf(stderr, "%s: %sline longer than %zu bytes\n", spec->prog, origin, sizeof line - 2);
      rc = -1;
      break;
    }
    char *s = line;
    if (*s != '"' && *s != '\'') { /* a '#' starts a comment outside quotes */
      char *hash = strchr(s, '#');
      if (hash) *hash = '\0';
    }
    s = tw_opts_trim(s);
    if (!*s) continue;
    size_t k = strcspn(s, ":=");
    if (!s[k]) {
      fprintf(stderr, "%s: %sexpected \"name: value\", got '%s'\n", spec->prog, origin, s);
      rc = -1;
      break;
    }
    s[k] = '\0';
    char *name = tw_opts_trim(s), *val = tw_opts_trim(s + k + 1);
    while (*name == '-') name++;
    size_t vl = strlen(val);
    if (vl >= 2 && (val[0] == '"' || val[0] == '\'') && val[vl - 1] == val[0]) {
      val[vl - 1] = '\0';
      val++;
    }
    tw_opt_t *o = tw_opts_find(spec, name);
    if (!o) {
      fprintf(stderr, "%s: %sunknown option '%s' (see --help)\n", spec->prog, origin, name);
      rc = -1;
      break;
    }
    const char *kept = tw_opts_keep(val);
    if (!kept) {
      fprintf(stderr, "%s: %sout of memory\n", spec->prog, origin);
      rc = -1;
      break;
    }
    rc = tw_opts_set(spec, o, kept, origin);
  }
  fclose(f);
  return rc;
}

static void tw_opts_print_default(const tw_opt_t *o, FILE *f) {
  if (o->help && strstr(o->help, "(default")) return; /* the help names its own default */
  if (o->defval) {
    if (o->defval[0]) fprintf(f, " (default %s)", o->defval);
    return;
  }
  switch (o->kind) {
  case TW_OPT_KIND_STR:
    if (*(const char *const *)o->dst) fprintf(f, " (default %s)", *(const char *const *)o->dst);
    break;
  case TW_OPT_KIND_INT: fprintf(f, " (default %d)", *(const int *)o->dst); break;
  case TW_OPT_KIND_LONG: fprintf(f, " (default %lld)", *(const long long *)o->dst); break;
  case TW_OPT_KIND_DOUBLE: fprintf(f, " (default %g)", *(const double *)o->dst); break;
  default: break;
  }
}

static void tw_opts_print_row(FILE *f, const char *lhs, const char *help, const tw_opt_t *o) {
  fprintf(f, "  %-28s", lhs);
  if (strlen(lhs) > 28) fprintf(f, "\n  %-28s", "");
  for (const char *p = help; *p; p++) {
    fputc(*p, f);
    if (*p == '\n') fprintf(f, "  %-28s", "");
  }
  if (o) tw_opts_print_default(o, f);
  fputc('\n', f);
}

void tw_opts_usage(const tw_opts_spec_t *spec, FILE *f) {
  fprintf(f, "usage: %s %s\n", spec->prog, spec->synopsis ? spec->synopsis : "[OPTIONS]");
  if (spec->description) fprintf(f, "%s\n", spec->description);
  fprintf(f, "\noptions:\n");
  char lhs[TW_OPTS_MAX_NAME + 40];
  for (size_t i = 0; i < spec->n_opts; i++) {
    const tw_opt_t *o = &spec->opts[i];
    snprintf(lhs, sizeof lhs, "--%s%s%s", o->name, o->kind == TW_OPT_KIND_FLAG ? "" : " ",
             o->kind == TW_OPT_KIND_FLAG ? "" : o->metavar ? o->metavar : "VALUE");
    tw_opts_print_row(f, lhs, o->help ? o->help : "", o);
  }
  if (spec->config)
    tw_opts_print_row(f, "--config FILE", "read options from FILE: one \"name: value\" per line\n"
                                          "(the name without dashes; '#' comments)", NULL);
  tw_opts_print_row(f, "-h, --help", "print this text and exit", NULL);
  tw_opts_print_row(f, "--version", "print the version and exit", NULL);
  if (spec->epilog) fprintf(f, "\n%s\n", spec->epilog);
  if (spec->env_prefix && spec->n_opts) {
    char ex[TW_OPTS_MAX_NAME + 40];
    tw_opts_env_name(spec, spec->opts[0].name, ex, sizeof ex);
    fprintf(f,
            "\nenvironment: every option also reads %s<NAME> (the name in upper case, '-' as\n"
            "'_'; e.g. %s for --%s); a flag takes 1/true/yes/on or 0/false/no/off.\n",
            spec->env_prefix, ex, spec->opts[0].name);
    if (spec->config)
      fprintf(f, "precedence: command line, environment, --config FILE (or %sCONFIG), defaults.\n",
              spec->env_prefix);
    else
      fprintf(f, "precedence: command line, environment, defaults.\n");
  }
}

int tw_opts_parse(tw_opts_spec_t *spec, int argc, char **argv, int *first_arg) {
  size_t n = spec->n_opts;
  struct option *lo = calloc(n + 3, sizeof *lo);
  struct {
    int row;           /* index in spec->opts */
    const char *value; /* NULL for a flag */
  } *cli = calloc(TW_OPTS_MAX_CLI, sizeof *cli);
  int rc = TW_OPTS_RUN, n_cli = 0;
  const char *config_path = NULL;
  if (!lo || !cli) {
    fprintf(stderr, "%s: out of memory\n", spec->prog);
    free(lo);
    free(cli);
    return 2;
  }
  for (size_t i = 0; i < n; i++) {
    spec->opts[i].given = false;
    lo[i] = (struct option){spec->opts[i].name,
                            spec->opts[i].kind == TW_OPT_KIND_FLAG ? no_argument : required_argument,
                            NULL, TW_OPTS_VAL0 + (int)i};
  }
  size_t k = n;
  if (spec->config) lo[k++] = (struct option){"config", required_argument, NULL, TW_OPTS_VAL_CONFIG};
  lo[k++] = (struct option){"help", no_argument, NULL, 'h'};
  lo[k++] = (struct option){"version", no_argument, NULL, TW_OPTS_VAL_VERSION};
  optind = 0; /* glibc: start over (a program may parse twice, tests do) */
  opterr = 0;
  for (int c; rc == TW_OPTS_RUN && (c = getopt_long(argc, argv, ":h", lo, NULL)) != -1;) {
    if (c == 'h') {
      tw_opts_usage(spec, stdout);
      rc = 0;
    } else if (c == TW_OPTS_VAL_VERSION) {
      printf("%s %s\n", spec->prog, TW_VERSION);
      rc = 0;
    } else if (c == TW_OPTS_VAL_CONFIG) {
      config_path = optarg;
    } else if (c >= TW_OPTS_VAL0 && c < TW_OPTS_VAL0 + (int)n) {
      if (n_cli == TW_OPTS_MAX_CLI) {
        fprintf(stderr, "%s: more than %d options\n", spec->prog, TW_OPTS_MAX_CLI);
        rc = 2;
      } else {
        cli[n_cli].row = c - TW_OPTS_VAL0;
        cli[n_cli++].value = optarg;
      }
    } else {
      const char *arg = optind > 0 && optind <= argc ? argv[optind - 1] : "?";
      int len = (int)strcspn(arg, "=");
      if (c == ':')
        fprintf(stderr, "%s: %.*s needs a value (see --help)\n", spec->prog, len, arg);
      else if (optopt >= TW_OPTS_VAL0 && optopt < TW_OPTS_VAL0 + (int)n)
        fprintf(stderr, "%s: --%s is a flag and takes no value, got '%s'\n", spec->prog,
                spec->opts[optopt - TW_OPTS_VAL0].name, arg);
      else if (optopt && optopt < 256)
        fprintf(stderr, "%s: unknown option -%c (see --help)\n", spec->prog, optopt);
      else
        fprintf(stderr, "%s: unknown option %.*s (see --help)\n", spec->prog, len, arg);
      rc = 2;
    }
  }
  int first = optind;
  free(lo);
  if (rc == TW_OPTS_RUN) {
    int n_args = argc - first;
    if (n_args < spec->min_args || (spec->max_args >= 0 && n_args > spec->max_args)) {
      if (n_args < spec->min_args)
        fprintf(stderr, "%s: missing argument%s (see --help)\n", spec->prog,
                spec->min_args > 1 ? "s" : "");
      else
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", spec->prog,
                argv[first + spec->max_args]);
      rc = 2;
    }
  }
  char env[TW_OPTS_MAX_NAME + 40];
  if (rc == TW_OPTS_RUN && spec->config && !config_path && spec->env_prefix) {
    tw_opts_env_name(spec, "config", env, sizeof env);
    const char *e = getenv(env);
    if (e && *e) config_path = e;
  }
  if (rc == TW_OPTS_RUN && config_path && tw_opts_config(spec, config_path)) rc = 2;
  for (size_t i = 0; rc == TW_OPTS_RUN && spec->env_prefix && i < n; i++) {
    tw_opts_env_name(spec, spec->opts[i].name, env, sizeof env);
    const char *e = getenv(env);
    char origin[TW_OPTS_MAX_NAME + 56];
    snprintf(origin, sizeof origin, "environment %s: ", env);
    if (e && tw_opts_set(spec, &spec->opts[i], e, origin)) rc = 2;
  }
  for (int i = 0; rc == TW_OPTS_RUN && i < n_cli; i++)
    if (tw_opts_set(spec, &spec->opts[cli[i].row], cli[i].value ? cli[i].value : "1", ""))
      rc = 2;
  free(cli);
  if (first_arg) *first_arg = first;
  return rc;
}
