/* metrics.c: Prometheus text, /healthz and /livez over libmicrohttpd (see metrics.h). */
#include "common/base/metrics.h"

#include "common/base/log.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/resource.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double tw_metrics_latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                             0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 30.0, 60.0};
const int tw_metrics_latency_n = 15;

typedef enum { TW_M_COUNTER, TW_M_GAUGE, TW_M_HISTOGRAM } tw_metric_kind_t;

struct tw_metric {
  tw_metrics_t *owner;
  tw_metric_kind_t kind;
  char name[96];
  char help[160];
  char label[160]; /* its own label, rendered key="value"; "" none */
  double value;
  double bounds[TW_METRICS_MAX_BUCKETS];
  uint64_t counts[TW_METRICS_MAX_BUCKETS + 1];
  int n_bounds;
  double sum;
  uint64_t count;
};

struct tw_metrics {
  pthread_mutex_t mu;
  char process[160]; /* process="NAME", escaped (tw_metrics_label_text) */
  char labels[320]; /* ,key="value" pairs every sample carries after process */
  tw_metric_t metrics[TW_METRICS_MAX];
  int n;
  bool healthy;
  char reason[128];
  struct MHD_Daemon *mhd;
  int port;
};

typedef struct {
  char *buf;
  size_t len, cap;
  int oom;
} tw_sb_t;

static void tw_sb_printf(tw_sb_t *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tw_sb_printf(tw_sb_t *sb, const char *fmt, ...) {
  if (sb->oom) return;
  for (int tries = 0; tries < 2; tries++) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(sb->buf + sb->len, sb->cap - sb->len, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sb->cap - sb->len) {
      sb->len += (size_t)n;
      return;
    }
    size_t cap = (sb->cap + (size_t)n + 1) * 2;
    char *b = realloc(sb->buf, cap);
    if (!b) {
      sb->oom = 1;
      return;
    }
    sb->buf = b;
    sb->cap = cap;
  }
}

/* x's samples; HELP and TYPE only for the first of the metrics that share
 * its name (labeled variants are registered one after another). */
static void tw_metric_render(tw_sb_t *sb, const tw_metrics_t *m, const tw_metric_t *x,
                             const tw_metric_t *prev) {
  static const char *const kinds[] = {"counter", "gauge", "histogram"};
  if (!prev || strcmp(prev->name, x->name))
    tw_sb_printf(sb, "# HELP %s %s\n# TYPE %s %s\n", x->name, x->help, x->name, kinds[x->kind]);
  char lab[sizeof m->process + sizeof m->labels + sizeof x->label + 16];
  snprintf(lab, sizeof lab, "%s%s%s%s", m->process, m->labels, x->label[0] ? "," : "", x->label);
  if (x->kind != TW_M_HISTOGRAM) {
    tw_sb_printf(sb, "%s{%s} %.17g\n", x->name, lab, x->value);
    return;
  }
  uint64_t cum = 0;
  for (int i = 0; i < x->n_bounds; i++) {
    cum += x->counts[i];
    tw_sb_printf(sb, "%s_bucket{%s,le=\"%g\"} %llu\n", x->name, lab, x->bounds[i],
                 (unsigned long long)cum);
  }
  cum += x->counts[x->n_bounds];
  tw_sb_printf(sb, "%s_bucket{%s,le=\"+Inf\"} %llu\n", x->name, lab, (unsigned long long)cum);
  tw_sb_printf(sb, "%s_sum{%s} %.17g\n%s_count{%s} %llu\n", x->name, lab, x->sum, x->name, lab,
               (unsigned long long)x->count);
}

/* key="value" with the value escaped for the exposition format (\\, \", \n). */
static void tw_metrics_label_text(char *out, size_t len, const char *key, const char *value) {
  size_t n = (size_t)snprintf(out, len, "%s=\"", key);
  for (const char *p = value; *p && n + 3 < len; p++) {
    if (*p == '\\' || *p == '"') out[n++] = '\\';
    if (*p == '\n') {
      out[n++] = '\\';
      out[n++] = 'n';
    } else {
      out[n++] = *p;
    }
  }
  if (n + 1 < len) out[n++] = '"';
  out[n < len ? n : len - 1] = '\0';
}

void tw_metrics_set_label(tw_metrics_t *m, const char *key, const char *value) {
  if (!m) return;
  char one[192];
  tw_metrics_label_text(one, sizeof one, key, value);
  pthread_mutex_lock(&m->mu);
  size_t n = strlen(m->labels);
  snprintf(m->labels + n, sizeof m->labels - n, ",%s", one);
  pthread_mutex_unlock(&m->mu);
}

TW_NODISCARD tw_status_t tw_metrics_render(tw_metrics_t *m, char **text_p) {
  tw_sb_t sb = {.buf = malloc(4096), .cap = 4096};
  if (!sb.buf) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the metrics text");
  sb.buf[0] = '\0';
  pthread_mutex_lock(&m->mu);
  for (int i = 0; i < m->n; i++) tw_metric_render(&sb, m, &m->metrics[i], i ? &m->metrics[i - 1] : NULL);
  pthread_mutex_unlock(&m->mu);
  if (sb.oom) {
    free(sb.buf);
    return tw_err(TW_ERR_NO_MEMORY, "cannot grow the metrics text");
  }
  *text_p = sb.buf;
  return TW_OK;
}

static enum MHD_Result tw_metrics_answer(void *cls, struct MHD_Connection *conn, const char *url,
                                         const char *method, const char *version,
                                         const char *upload, size_t *upload_size, void **ptr) {
  tw_metrics_t *m = cls;
  unsigned code = MHD_HTTP_OK;
  char *text = NULL;
  const char *ctype = "text/plain; charset=utf-8";
  bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"); /* HEAD: MHD sends no body */
  if (!get) {
    code = MHD_HTTP_METHOD_NOT_ALLOWED;
    size_t l = strlen(method) + 64;
    text = malloc(l);
    if (text) snprintf(text, l, "method %.32s not allowed: use GET\n", method);
  } else if (strcmp(url, "/metrics") == 0) {
    if (tw_metrics_render(m, &text) != TW_OK) return MHD_NO;
    ctype = "text/plain; version=0.0.4; charset=utf-8";
  } else if (strcmp(url, "/livez") == 0) {
    text = strdup("alive\n"); /* the process answers: 200 even while draining */
  } else if (strcmp(url, "/healthz") == 0) {
    pthread_mutex_lock(&m->mu);
    code = m->healthy ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE;
    size_t l = strlen(m->reason) + 2;
    text = malloc(l);
    if (text) snprintf(text, l, "%s\n", m->reason);
    pthread_mutex_unlock(&m->mu);
  } else {
    code = MHD_HTTP_NOT_FOUND;
    text = strdup("not found: try /metrics, /healthz or /livez\n");
  }
  if (!text) return MHD_NO;
  struct MHD_Response *r =
      MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(text);
    return MHD_NO;
  }
  MHD_add_response_header(r, "Content-Type", ctype);
  if (!get) MHD_add_response_header(r, "Allow", "GET, HEAD");
  enum MHD_Result ret = MHD_queue_response(conn, code, r);
  MHD_destroy_response(r);
  return ret;
}

static void tw_raise_nofile_once(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
  rlim_t was = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
    TW_DEBUG("metrics", "descriptor limit raised from %llu to %llu", (unsigned long long)was,
             (unsigned long long)rl.rlim_max);
}

void tw_raise_nofile(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, tw_raise_nofile_once);
}

TW_NODISCARD tw_status_t tw_metrics_listen_addr(const char *what, const char *maybe_addr, int port,
                                                struct sockaddr_storage *ss, bool *v6_p,
                                                const char **addr_p) {
  const char *addr = maybe_addr && *maybe_addr ? maybe_addr : "127.0.0.1";
  memset(ss, 0, sizeof *ss);
  struct sockaddr_in *sa = (struct sockaddr_in *)ss;
  struct sockaddr_in6 *sa6 = (struct sockaddr_in6 *)ss;
  if (port > 65535)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s port %d is not a TCP port", what, port);
  *v6_p = false;
  *addr_p = addr;
  if (inet_pton(AF_INET, addr, &sa->sin_addr) == 1) {
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    return TW_OK;
  }
  memset(ss, 0, sizeof *ss);
  if (inet_pton(AF_INET6, addr, &sa6->sin6_addr) != 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "%s address '%s' is not a numeric IPv4 or IPv6 address", what, addr);
  sa6->sin6_family = AF_INET6;
  sa6->sin6_port = htons((uint16_t)port);
  *v6_p = true;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_metrics_create(const char *process, int port, const char *maybe_addr,
                                           tw_metrics_t **m_p) {
  struct sockaddr_storage ss;
  bool v6;
  const char *addr = NULL; /* set by tw_metrics_listen_addr; -O3 cannot tell */
  TW_CHECK(tw_metrics_listen_addr("metrics", maybe_addr, port, &ss, &v6, &addr));
  tw_metrics_t *m = calloc(1, sizeof *m);
  if (!m) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the metrics registry");
  pthread_mutex_init(&m->mu, NULL);
  tw_metrics_label_text(m->process, sizeof m->process, "process", process);
  m->healthy = true;
  snprintf(m->reason, sizeof m->reason, "ok");
  m->port = -1;
  if (port >= 0) {
    tw_raise_nofile();
    /* epoll (MHD_USE_AUTO on Linux), not select(): no FD_SETSIZE ceiling, so
     * health checks answer while thousands of idle connections are open;
     * idle ones are closed after 10 s */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | (v6 ? MHD_USE_IPv6 : 0);
    const struct sockaddr *sock = (const struct sockaddr *)&ss;
    m->mhd = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, tw_metrics_answer, m,
                              MHD_OPTION_SOCK_ADDR, sock, MHD_OPTION_CONNECTION_TIMEOUT, 10u,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)TW_METRICS_MAX_CONNECTIONS,
                              MHD_OPTION_END);
    if (!m->mhd) {
      pthread_mutex_destroy(&m->mu);
      free(m);
      return tw_err(TW_ERR_TRANSPORT, "cannot start the metrics http server on %s port %d", addr,
                    port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(m->mhd, MHD_DAEMON_INFO_BIND_PORT);
    m->port = di ? di->port : port;
    TW_INFO("metrics", "serving /metrics and /healthz on %s:%d (and /livez)", addr, m->port);
  }
  *m_p = m;
  return TW_OK;
}

void tw_metrics_destroy(tw_metrics_t *m) {
  if (!m) return;
  if (m->mhd) MHD_stop_daemon(m->mhd);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

int tw_metrics_port(const tw_metrics_t *m) { return m ? m->port : -1; }

static tw_metric_t *tw_metrics_add(tw_metrics_t *m, tw_metric_kind_t kind, const char *name,
                                   const char *help) {
  if (!m) return NULL;
  pthread_mutex_lock(&m->mu);
  tw_metric_t *x = NULL;
  if (m->n < TW_METRICS_MAX) {
    x = &m->metrics[m->n++];
    memset(x, 0, sizeof *x);
    x->owner = m;
    x->kind = kind;
    snprintf(x->name, sizeof x->name, "twain_%s", name);
    snprintf(x->help, sizeof x->help, "%s", help);
  }
  pthread_mutex_unlock(&m->mu);
  return x;
}

tw_metric_t *tw_metrics_counter(tw_metrics_t *m, const char *name, const char *help) {
  return tw_metrics_add(m, TW_M_COUNTER, name, help);
}
tw_metric_t *tw_metrics_counter_labeled(tw_metrics_t *m, const char *name, const char *help,
                                        const char *key, const char *value) {
  tw_metric_t *x = tw_metrics_add(m, TW_M_COUNTER, name, help);
  if (!x) return NULL;
  pthread_mutex_lock(&m->mu);
  tw_metrics_label_text(x->label, sizeof x->label, key, value);
  pthread_mutex_unlock(&m->mu);
  return x;
}
tw_metric_t *tw_metrics_gauge(tw_metrics_t *m, const char *name, const char *help) {
  return tw_metrics_add(m, TW_M_GAUGE, name, help);
}
tw_metric_t *tw_metrics_histogram(tw_metrics_t *m, const char *name, const char *help,
                                  const double *bounds, int n) {
  if (n < 0 || n > TW_METRICS_MAX_BUCKETS) return NULL;
  tw_metric_t *x = tw_metrics_add(m, TW_M_HISTOGRAM, name, help);
  if (!x) return NULL;
  pthread_mutex_lock(&m->mu);
  memcpy(x->bounds, bounds, sizeof(double) * (size_t)n);
  x->n_bounds = n;
  pthread_mutex_unlock(&m->mu);
  return x;
}

void tw_metric_add(tw_metric_t *x, double v) {
  if (!x) return;
  pthread_mutex_lock(&x->owner->mu);
  x->value += v;
  pthread_mutex_unlock(&x->owner->mu);
}
void tw_metric_set(tw_metric_t *x, double v) {
  if (!x) return;
  pthread_mutex_lock(&x->owner->mu);
  x->value = v;
  pthread_mutex_unlock(&x->owner->mu);
}
void tw_metric_observe(tw_metric_t *x, double v) {
  if (!x) return;
  pthread_mutex_lock(&x->owner->mu);
  int i = 0;
  while (i < x->n_bounds && v > x->bounds[i]) i++;
  x->counts[i]++;
  x->sum += v;
  x->count++;
  pthread_mutex_unlock(&x->owner->mu);
}
double tw_metric_value(const tw_metric_t *x) {
  if (!x) return 0;
  pthread_mutex_lock(&x->owner->mu);
  double v = x->kind == TW_M_HISTOGRAM ? (double)x->count : x->value;
  pthread_mutex_unlock(&x->owner->mu);
  return v;
}

void tw_metrics_set_health(tw_metrics_t *m, bool healthy, const char *maybe_reason) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  m->healthy = healthy;
  snprintf(m->reason, sizeof m->reason, "%s", maybe_reason ? maybe_reason : "ok");
  pthread_mutex_unlock(&m->mu);
}
