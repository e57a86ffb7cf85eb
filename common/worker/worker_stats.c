/* worker_stats.c: when a worker's stats line is due (worker_stats.h). */
#include "common/worker/worker_stats.h"

void tw_worker_stats_add(tw_worker_stats_t *s, int64_t tokens, int64_t steps) {
  s->tokens += tokens;
  s->steps += steps;
}

bool tw_worker_stats_due(tw_worker_stats_t *s, int64_t now_ns, bool busy_now, double *tok_s,
                         double *steps_s) {
  if (s->interval_s <= 0) return false;
  if (!s->last_ns) s->last_ns = now_ns;
  int64_t dt = now_ns - s->last_ns;
  if (dt < (int64_t)s->interval_s * 1000000000LL) return false;
  bool due = busy_now || s->tokens || s->steps;
  *tok_s = (double)s->tokens * 1e9 / (double)dt;
  *steps_s = (double)s->steps * 1e9 / (double)dt;
  s->tokens = s->steps = 0;
  s->last_ns = now_ns;
  return due;
}
