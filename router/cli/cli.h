/* cli.h: the service subcommands of the `twain` program (router/cli/twain_main.c
 * dispatches to them with argv starting at the subcommand name):
 *   twain serve    [--model DIR] [--listen EP] [--prefill N] [--decode M] [--backend B] ...
 *   twain chat     [--endpoint EP] [--reasoning low|medium|high] [--date YYYY-MM-DD]
 *                  [--show-analysis] [--json] "text"
 *   twain generate [--endpoint EP] [--max-tokens N] [--stop-ids A,B] [--json] ID...
 *   twain bench    [--endpoint EP] [--num-requests N] [--concurrency C] [--json FILE] ...
 *   twain router   (the router daemon alone, as twain-router)
 *   twain keygen   FILE|-  (link keys for the router and workers)
 * Each declares its options as a common/base/opts.h table (--help lists them).
 * Each returns the process exit code (0 ok, 1 failed, 2 bad usage; chat: 3 when
 * max_tokens cut the answer before the final channel). */
#ifndef TW_ROUTER_CLI_H
#define TW_ROUTER_CLI_H

/* The CURVE options of every client of the router's client socket (chat,
 * generate, bench): common/opts.h rows on two const char * lvalues, read by
 * tw_auth_client_keys (common/comm/link_auth.h; empty: the environment). */
#define TW_CLIENT_CURVE_OPT_ROWS(server_key, identity)                                             \
  TW_OPT_STR("server-key", &(server_key), "KEY|FILE",                                              \
             "the router's public key (Z85, or a key file with its server-public\n"                \
             "line; or $TWAIN_SERVER_KEY): CURVE on the connection"),                              \
      TW_OPT_STR("identity", &(identity), "FILE",                                                  \
                 "this client's key pair (client-public and client-secret lines, a\n"              \
                 "`twain keygen` file; or $TWAIN_IDENTITY_FILE; default: a fresh pair)")

int tw_cli_serve(int argc, char **argv);
int tw_cli_chat(int argc, char **argv);
int tw_cli_generate(int argc, char **argv);
/** `twain bench`: the serving benchmark (router/cli/cli_bench.c, docs/benchmarks.md). */
int tw_cli_bench(int argc, char **argv);
int tw_cli_router(int argc, char **argv);
/** `twain keygen FILE|-`: a new link key set (common/comm/link_auth.h). */
int tw_cli_keygen(int argc, char **argv);
/** `twain write-checkpoint`: a random checkpoint of gpt-oss shapes (router/cli/cli_ckpt.c). */
int tw_cli_write_checkpoint(int argc, char **argv);

#endif
