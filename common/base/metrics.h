/* metrics.h: Prometheus text metrics and a /healthz endpoint for every
 * daemon, served over HTTP by libmicrohttpd on its own thread.
 *
 *   GET /metrics  -> text/plain; version=0.0.4 (counters, gauges, histograms)
 *   GET /healthz  -> 200 "ok" while healthy, 503 "<reason>" otherwise
 *                    (draining or failed): readiness (take traffic?).
 *   GET /livez    -> 200 "alive" whenever the process answers, also while
 *                    draining: liveness (restart only a wedged process).
 *
 * Metric names are prefixed "twain_"; every sample carries the label
 * process="<name>" and the registry's labels (tw_metrics_set_label). Updates take a mutex (cheap next to a decode step) so the
 * HTTP thread always reads a consistent snapshot. */
#ifndef TW_COMMON_METRICS_H
#define TW_COMMON_METRICS_H

#include "common/base/status.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_METRICS_MAX 96
#define TW_METRICS_MAX_BUCKETS 24

typedef struct tw_metrics tw_metrics_t;
typedef struct tw_metric tw_metric_t;

#define TW_METRICS_MAX_CONNECTIONS 16384 /* open HTTP connections; idle ones close after 10 s */

/** Raise this process's soft RLIMIT_NOFILE to its hard limit (once; a
 *  server holding thousands of connections needs more than the usual 1024
 *  descriptors). tw_metrics_create calls it. */
void tw_raise_nofile(void);

/** Create the registry and, if port >= 0, start serving on maybe_addr:port
 *  (a numeric IPv4 or IPv6 address, "0.0.0.0" / "::" for all interfaces;
 *  NULL or "" = 127.0.0.1); port 0 picks a free one (see tw_metrics_port).
 *  The server polls with epoll (no select() ceiling), holds up to
 *  TW_METRICS_MAX_CONNECTIONS connections and closes idle ones after 10 s.
 *  Errors: TW_ERR_INVALID_ARGUMENT (address not numeric, port > 65535),
 *  TW_ERR_TRANSPORT (the HTTP server could not start on that address and
 *  port), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_metrics_create(const char *process, int port, const char *maybe_addr,
                                           tw_metrics_t **metrics_p);
/** A numeric listen address for an HTTP server of this process (metrics,
 *  the router's HTTP API): maybe_addr (IPv4 or IPv6; NULL or "" =
 *  127.0.0.1) and port into *ss, *v6_p = IPv6, *addr_p = the address text
 *  used. `what` names the server in errors. Errors: TW_ERR_INVALID_ARGUMENT
 *  (not numeric, port > 65535). */
struct sockaddr_storage;
TW_NODISCARD tw_status_t tw_metrics_listen_addr(const char *what, const char *maybe_addr, int port,
                                                struct sockaddr_storage *ss, bool *v6_p,
                                                const char **addr_p);
/** Stop the server and free everything. NULL does nothing. */
void tw_metrics_destroy(tw_metrics_t *metrics);
/** The TCP port being served, or -1 if none. */
int tw_metrics_port(const tw_metrics_t *metrics);

/** Register a metric ("twain_" is prepended to name). Returns NULL when the
 *  registry is full (TW_METRICS_MAX); updates on NULL do nothing. */
tw_metric_t *tw_metrics_counter(tw_metrics_t *metrics, const char *name, const char *help);
tw_metric_t *tw_metrics_gauge(tw_metrics_t *metrics, const char *name, const char *help);
/** A counter with one label of its own (key="value", e.g. finished_reason=
 *  "stop"): register the values of one name one after another; they share
 *  one HELP/TYPE. NULL when the registry is full. */
tw_metric_t *tw_metrics_counter_labeled(tw_metrics_t *metrics, const char *name, const char *help,
                                        const char *key, const char *value);
/** Add key="value" to every sample of the registry, after process (e.g.
 *  model_name="gpt-oss-20b", so that dashboards made for vLLM's names can
 *  filter by model; docs/operations.md). The value is escaped. Call before
 *  serving. */
void tw_metrics_set_label(tw_metrics_t *metrics, const char *key, const char *value);
/** Histogram with ascending upper bounds[n] (n <= TW_METRICS_MAX_BUCKETS; +Inf
 *  is implicit). */
tw_metric_t *tw_metrics_histogram(tw_metrics_t *metrics, const char *name, const char *help,
                                  const double *bounds, int n);

void tw_metric_add(tw_metric_t *metric, double v);      /* counter or gauge */
void tw_metric_set(tw_metric_t *metric, double v);      /* gauge */
void tw_metric_observe(tw_metric_t *metric, double v);  /* histogram */
double tw_metric_value(const tw_metric_t *metric);      /* counter/gauge; histogram: count */

/** Health as /healthz reports it (reason copied; NULL = "ok"). */
void tw_metrics_set_health(tw_metrics_t *metrics, bool healthy, const char *maybe_reason);

/** Render the exposition text (malloc'ed, caller frees).
 *  Errors: TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_metrics_render(tw_metrics_t *metrics, char **text_p);

/** Latency buckets in seconds, 1 ms .. 60 s, for TTFT/TPOT/transfer time. */
extern const double tw_metrics_latency_buckets[];
extern const int tw_metrics_latency_n;

#ifdef __cplusplus
}
#endif
#endif
