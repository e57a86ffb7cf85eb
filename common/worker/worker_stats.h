/* worker_stats.h: the periodic stats line of a worker daemon (like vLLM's
 * "Avg prompt throughput ... Running: N reqs, Waiting: M reqs, KV cache
 * usage"): every interval while busy, one INFO line with the worker's queue
 * and its token rate over the interval. The worker counts tokens and steps;
 * this decides when a line is due and the rates. */
#ifndef TW_COMMON_WORKER_STATS_H
#define TW_COMMON_WORKER_STATS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Default --log-stats-interval of the workers, seconds. */
#define TW_WORKER_STATS_INTERVAL_S 5

typedef struct {
  int interval_s;  /* 0: no lines */
  int64_t last_ns; /* the last line (or the first call) */
  int64_t tokens, steps;
} tw_worker_stats_t;

/** Count work done now: tokens (prompt tokens prefilled, or tokens
 *  generated) and steps (forward passes). */
void tw_worker_stats_add(tw_worker_stats_t *s, int64_t tokens, int64_t steps);

/** Whether a stats line is due at now_ns (CLOCK_MONOTONIC ns): interval_s
 *  passed since the last one and there was work since (tokens or steps
 *  counted) or busy_now. When due, writes the rates over the interval
 *  (tokens/s, steps/s) and starts the next one; an idle interval restarts
 *  silently. */
bool tw_worker_stats_due(tw_worker_stats_t *s, int64_t now_ns, bool busy_now, double *tok_s,
                         double *steps_s);

#ifdef __cplusplus
}
#endif
#endif
