/* opts.h: the command line of every twain program, declared as one table.
 *
 * Each program lists its options as tw_opt_t rows (TW_OPT_INT, TW_OPT_STR,
 * ...) pointing at the variables they set, and calls tw_opts_parse() once.
 * The parser (getopt_long underneath) gives every program the same rules:
 *   --flag value and --flag=value; -h/--help (every option, its default and
 *   the environment names, on stdout, exit 0); --version (stdout, exit 0);
 *   strict numbers: the whole value must be a decimal number inside the
 *   row's range, else "PROG: --flag must be an integer in [LO, HI], got 'V'"
 *   and exit 2; unknown options and missing values exit 2 naming the option;
 *   an environment variable per option: env_prefix + the name in upper case
 *   with '-' as '_' (TWAIN_DECODE_KV_BLOCKS=64 is --kv-blocks 64; a flag
 *   takes 1/true/yes/on or 0/false/no/off);
 *   --config FILE (when the spec allows it; also from env_prefix + CONFIG):
 *   one option per line, "name: value" or "name = value" (the name without
 *   the dashes; '#' starts a comment; quotes around the value are dropped).
 * Precedence: command line > environment > config file > the defaults the
 * variables held before the call. Adding an option is one table row. */
#ifndef TW_COMMON_OPTS_H
#define TW_COMMON_OPTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_OPT_KIND_FLAG,   /* bool *: set to true when given (no value on the command line) */
  TW_OPT_KIND_STR,    /* const char **: the value (strings stay valid for the process);
                         with a parse function, it stores what it makes of the value */
  TW_OPT_KIND_INT,    /* int *: a decimal integer in [lo, hi] */
  TW_OPT_KIND_LONG,   /* long long *: a decimal integer in [lo, hi] */
  TW_OPT_KIND_DOUBLE, /* double *: a finite decimal number in [dlo, dhi] */
  TW_OPT_KIND_FN,     /* void *: parse(value, dst, err, errlen) decides */
} tw_opt_kind_t;

/** A custom value parser (TW_OPT_FN): store the value of `text` into `dst`
 *  and return 0, or write why it is wrong into err (errlen bytes; the parser
 *  prefixes "PROG: --flag ") and return -1. Called again for each source that
 *  sets the option (config, environment, command line): it replaces, never
 *  accumulates. */
typedef int (*tw_opt_parse_fn)(const char *text, void *dst, char *err, size_t errlen);

/** One option. Build rows with the TW_OPT_* macros below (they check the
 *  destination's type at compile time). `given` is set by tw_opts_parse when
 *  any source set the option. */
typedef struct {
  const char *name;    /* long name without the leading "--" */
  tw_opt_kind_t kind;
  void *dst;
  long long lo, hi;    /* TW_OPT_KIND_INT / LONG range, inclusive */
  double dlo, dhi;     /* TW_OPT_KIND_DOUBLE range, inclusive */
  tw_opt_parse_fn parse;
  const char *metavar; /* shown in --help: --name METAVAR */
  const char *help;    /* one or more lines ('\n' continues, indented) */
  const char *defval;  /* --help default: NULL = the variable's value, "" = none shown */
  bool given;
} tw_opt_t;

#define TW_OPT_FLAG(n, p, h) \
  {.name = (n), .kind = TW_OPT_KIND_FLAG, .dst = _Generic((p), bool *: (p)), .help = (h)}
#define TW_OPT_STR(n, p, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_STR, .dst = _Generic((p), const char **: (p)), \
   .metavar = (meta), .help = (h)}
#define TW_OPT_STR_FN(n, p, fn, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_STR, .dst = _Generic((p), const char **: (p)), .parse = (fn), \
   .metavar = (meta), .help = (h)}
#define TW_OPT_INT(n, p, lo_, hi_, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_INT, .dst = _Generic((p), int *: (p)), .lo = (lo_), \
   .hi = (hi_), .metavar = (meta), .help = (h)}
#define TW_OPT_LONG(n, p, lo_, hi_, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_LONG, .dst = _Generic((p), long long *: (p)), .lo = (lo_), \
   .hi = (hi_), .metavar = (meta), .help = (h)}
#define TW_OPT_DOUBLE(n, p, lo_, hi_, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_DOUBLE, .dst = _Generic((p), double *: (p)), .dlo = (lo_), \
   .dhi = (hi_), .metavar = (meta), .help = (h)}
#define TW_OPT_FN(n, p, fn, meta, h) \
  {.name = (n), .kind = TW_OPT_KIND_FN, .dst = (p), .parse = (fn), .metavar = (meta), .help = (h)}

/** A program's command line. */
typedef struct {
  const char *prog;        /* "twain-decode", "twain serve": starts every message */
  const char *synopsis;    /* after "usage: PROG ", e.g. "[OPTIONS] ID..." */
  const char *description; /* printed under the usage line (may be NULL) */
  const char *epilog;      /* printed after the options (may be NULL) */
  const char *env_prefix;  /* "TWAIN_DECODE_"; NULL: no environment variables */
  tw_opt_t *opts;
  size_t n_opts;
  bool config;             /* accept --config FILE */
  int min_args, max_args;  /* positional arguments allowed; max_args < 0: any number */
} tw_opts_spec_t;

/** tw_opts_parse's answer when the program should go on. */
#define TW_OPTS_RUN (-1)

/** Parse argv[1..argc) (argv[0] is the program or subcommand name) into the
 *  spec's variables: config file, environment, then command line (see the
 *  top of this file). getopt_long may reorder argv so that the positional
 *  arguments come last; *first_arg (may be NULL when max_args is 0) gets the
 *  index of the first one. Returns TW_OPTS_RUN, or the exit code the program
 *  should return at once: 0 after --help or --version (printed on stdout), 2
 *  after a usage error (one line naming the option and the rule on stderr:
 *  unknown option, missing value, value out of range or not a number, config
 *  file unreadable or with an unknown name, wrong number of arguments). Not
 *  thread-safe (getopt's globals): call it from main. */
int tw_opts_parse(tw_opts_spec_t *spec, int argc, char **argv, int *first_arg);

/** Print the --help text of `spec` on `f`. */
void tw_opts_usage(const tw_opts_spec_t *spec, FILE *f);

/** Whether option `name` (without "--") was set by any source in the last
 *  tw_opts_parse of `spec`; false for a name not in the table. */
bool tw_opts_given(const tw_opts_spec_t *spec, const char *name);

/** Strict integer: `text` must be a whole decimal integer (optional sign, no
 *  blanks, no trailing characters, no overflow) in [lo, hi]. Returns 0 with
 *  *out set, or -1 after printing "PROG: WHAT must be an integer in [LO, HI],
 *  got 'TEXT'" on stderr. For values that are not options (ids in a list). */
int tw_opts_int(const char *prog, const char *what, const char *text, long long lo, long long hi,
                long long *out);

/** A copy of `s` that stays valid for the life of the process (freed at
 *  exit), for parse functions that make a new string; NULL when out of
 *  memory. */
const char *tw_opts_keep(const char *s);

/** tw_opts_int without the message: 0 with *out set, or -1. */
int tw_opts_ll(const char *text, long long lo, long long hi, long long *out);

/** A comma-separated list of token ids ("5,17"), each in [0, INT32_MAX],
 *  into ids[0..cap): 0 with *n set, or -1 with the reason in err ("must be
 *  ids in [0, 2147483647] separated by commas, got 'x'", "takes at most CAP
 *  ids", too long). For TW_OPT_FN parsers of --stop-ids. */
int tw_opts_id_list(const char *text, int32_t *ids, int cap, int *n, char *err, size_t errlen);

/** A three-way setting "1" | "0" | "auto" (TW_OPT_FN parser; dst: int32_t *,
 *  the engine.h convention): 1, -1 or 0; else -1 with the reason in err. */
int tw_opts_switch_auto(const char *text, void *dst, char *err, size_t errlen);

/** ASCII letters and digits: with strspn and the extra characters a name
 *  allows, whether a name is made of them alone. */
#define TW_ALNUM_CHARS "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

/** The version string every --version prints ("0.1.0", from CMake's project
 *  version). */
const char *tw_opts_version(void);

#ifdef __cplusplus
}
#endif
#endif
