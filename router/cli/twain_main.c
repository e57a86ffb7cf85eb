/* twain_main.c: the `twain` program, one table of subcommands.
 *
 * Adding a subcommand is one row in tw_commands plus its function, declared in
 * a router/cli/cli*.h header and defined in its own router/cli/cli_*.c file. Each
 * function gets argv starting at the subcommand's name and returns the exit
 * code (0 ok, 1 failed, 2 bad usage). */
#include "router/cli/cli.h"
#include "router/cli/cli_text.h"

#include "common/base/log.h"
#include "common/base/opts.h"

#include <stdio.h>
#include <string.h>

typedef struct {
  const char *name;
  int (*fn)(int argc, char **argv);
  const char *summary;
} tw_command_t;

static const tw_command_t tw_commands[] = {
    {"serve", tw_cli_serve, "start router + prefill + decode workers locally (default tiny model)"},
    {"chat", tw_cli_chat, "send one chat request to a running service and print the answer"},
    {"generate", tw_cli_generate, "send prompt ids to a running service and print the ids"},
    {"bench", tw_cli_bench, "serving benchmark: N requests against a running service (TTFT, TPOT, tok/s)"},
    {"write-checkpoint", tw_cli_write_checkpoint,
     "write random gpt-oss-20b/120b-shaped weights in the Hugging Face MXFP4 layout"},
    {"router", tw_cli_router, "run the router daemon alone (as twain-router)"},
    {"keygen", tw_cli_keygen, "write a new key set for the internal links (CURVE) to FILE"},
    {"tokenize", tw_cli_tokenize, "UTF-8 text on stdin -> token ids as a JSON array"},
    {"detokenize", tw_cli_detokenize, "token ids on stdin -> the text (raw bytes)"},
    {"render", tw_cli_render, "a conversation (OpenAI chat JSON) on stdin -> Harmony prompt ids"},
    {"parse", tw_cli_parse, "generated ids on stdin -> the parsed Harmony messages as JSON"},
};

static void tw_usage(FILE *f) {
  fprintf(f, "usage: twain COMMAND [OPTIONS]   (twain COMMAND --help for its options)\n"
             "       twain --version\n\n");
  int w = 0; /* the longest name: the summaries in one column */
  for (size_t i = 0; i < sizeof tw_commands / sizeof tw_commands[0]; i++)
    if ((int)strlen(tw_commands[i].name) > w) w = (int)strlen(tw_commands[i].name);
  for (size_t i = 0; i < sizeof tw_commands / sizeof tw_commands[0]; i++)
    fprintf(f, "  %-*s  %s\n", w, tw_commands[i].name, tw_commands[i].summary);
}

int main(int argc, char **argv) {
  tw_log_init("twain", 0);
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
      !strcmp(argv[1], "help")) {
    tw_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("twain %s\n", tw_opts_version());
    return 0;
  }
  for (size_t i = 0; i < sizeof tw_commands / sizeof tw_commands[0]; i++)
    if (!strcmp(argv[1], tw_commands[i].name)) return tw_commands[i].fn(argc - 1, argv + 1);
  fprintf(stderr, "twain: unknown command \"%s\"\n\n", argv[1]);
  tw_usage(stderr);
  return 2;
}
