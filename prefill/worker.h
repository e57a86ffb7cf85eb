/* worker.h: the prefill worker daemon mode of `twain-prefill` (ARCHITECTURE.md
 * item 2): `twain-prefill --router tcp://HOST:PORT --model DIR ...`.
 * It registers with the router (pool prefill, capacity = queued prompt
 * tokens), runs the queued PrefillRequests' prompts through the engine into
 * its own KV pool, several at a time as one variable-length prefill up to a
 * token budget (--chunk-tokens, --batch-seqs), samples each first token, writes the prompt's KV layer by layer into
 * the blocks the decode worker reserved (UCX puts, sliding layers only their
 * window, kv_transfer.h), flushes for remote completion and only then answers
 * PrefillDone with the first token and per-layer checksums. */
#ifndef TW_PREFILL_WORKER_H
#define TW_PREFILL_WORKER_H

/** Whether argv asks for the daemon mode (has --router). */
int tw_prefill_worker_wanted(int argc, char **argv);

/** Parse the daemon options and run until SIGTERM/SIGINT (then finish the
 *  request in progress, refuse the queued ones and return). Returns the
 *  process exit code: 0 ok, 1 failure, 2 bad usage. */
int tw_prefill_worker_main(int argc, char **argv);

#endif
