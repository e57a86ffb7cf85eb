/* cli_text.h: the text subcommands of the `twain` program (router/cli/cli_text.c),
 * for checking and scripting the tokenizer and the Harmony format:
 *   twain tokenize   [--tokenizer FILE | --model DIR] [--allow-special]
 *   twain detokenize [--tokenizer FILE | --model DIR] [--skip-special]
 *   twain render     [--tokenizer FILE | --model DIR] [--max-prompt-tokens N] [--text]
 *   twain parse      [--tokenizer FILE | --model DIR] [--conversation] [--events]
 * Each takes argv starting at the subcommand's name and returns the exit code
 * (0 ok, 1 failed: the message is on stderr, 2 bad usage). */
#ifndef TW_ROUTER_CLI_TEXT_H
#define TW_ROUTER_CLI_TEXT_H

#include "common/text/tokenizer.h"

int tw_cli_tokenize(int argc, char **argv);
int tw_cli_detokenize(int argc, char **argv);
int tw_cli_render(int argc, char **argv);
int tw_cli_parse(int argc, char **argv);

/** Token ids from text, appended to *ids: a JSON array of non-negative
 *  integers (cJSON parses the whole text: a broken or nested array is
 *  refused), or integers in 0..INT32_MAX separated by blanks or commas,
 *  each item whole (tw_opts_int: "12abc" or "2]" is refused, naming it).
 *  Returns 1, or 0 with the reason on stderr after "twain CMD: " (bad
 *  text, or no memory); *ids may then hold the ids before the bad one. */
int tw_cli_parse_ids(const char *cmd, const char *s, tw_token_ids_t *ids);

#endif
