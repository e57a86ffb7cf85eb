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

int tw_cli_tokenize(int argc, char **argv);
int tw_cli_detokenize(int argc, char **argv);
int tw_cli_render(int argc, char **argv);
int tw_cli_parse(int argc, char **argv);

#endif
