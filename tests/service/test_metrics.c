/* test_metrics.c: the Prometheus text and /healthz served over HTTP on an
 * ephemeral 127.0.0.1 port: exact exposition lines for a counter, a gauge and
 * a histogram, 200/503 health, 404 for other paths. */
#include "common/base/log.h"
#include "common/base/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "tests/test_expect.h"

/* `method` path from 127.0.0.1:port; the whole response in buf. */
static int http_req(int port, const char *method, const char *path, char *buf, size_t cap) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct timeval tv = {5, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
    close(s);
    return -1;
  }
  char req[256];
  int n = snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                   method, path);
  if (write(s, req, (size_t)n) != n) {
    close(s);
    return -1;
  }
  size_t len = 0;
  for (int i = 0; i < 1000 && len + 1 < cap; i++) {
    ssize_t r = read(s, buf + len, cap - 1 - len);
    if (r <= 0) break;
    len += (size_t)r;
  }
  buf[len] = '\0';
  close(s);
  return (int)len;
}

static int http_get(int port, const char *path, char *buf, size_t cap) {
  return http_req(port, "GET", path, buf, cap);
}

/* Open `n` idle TCP connections to 127.0.0.1:port (fds into fds[]); returns
 * how many connected. */
static int hold_connections(int port, int *fds, int n) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int k = 0;
  for (; k < n; k++) {
    fds[k] = socket(AF_INET, SOCK_STREAM, 0);
    if (fds[k] < 0 || connect(fds[k], (struct sockaddr *)&a, sizeof a) != 0) {
      if (fds[k] >= 0) close(fds[k]);
      break;
    }
  }
  return k;
}

int main(void) {
  tw_log_init("test_metrics", 0);
  tw_metrics_t *m = NULL;
  tw_metrics_t *bad = NULL;
  EXPECT(tw_metrics_create("unit", 0, "localhost", &bad) == TW_ERR_INVALID_ARGUMENT && !bad,
         "a host name is refused (numeric addresses only)");
  if (tw_metrics_create("unit", 0, NULL, &m) != 0) return 1;
  int port = tw_metrics_port(m);
  EXPECT(port > 0, "ephemeral port assigned");
  tw_metric_t *c = tw_metrics_counter(m, "things_total", "things");
  tw_metric_t *g = tw_metrics_gauge(m, "level", "a level");
  const double b[] = {0.1, 1.0};
  tw_metric_t *h = tw_metrics_histogram(m, "lat_seconds", "latency", b, 2);
  tw_metric_add(c, 3);
  tw_metric_set(g, 7);
  tw_metric_add(g, -2);
  tw_metric_observe(h, 0.05);
  tw_metric_observe(h, 0.5);
  tw_metric_observe(h, 0.5);
  tw_metric_observe(h, 5);
  static char buf[65536];
  EXPECT(http_get(port, "/metrics", buf, sizeof buf) > 0, "GET /metrics");
  const char *want[] = {
      " 200 OK",
      "# TYPE twain_things_total counter\n",
      "twain_things_total{process=\"unit\"} 3\n",
      "twain_level{process=\"unit\"} 5\n",
      "# TYPE twain_lat_seconds histogram\n",
      "twain_lat_seconds_bucket{process=\"unit\",le=\"0.1\"} 1\n",
      "twain_lat_seconds_bucket{process=\"unit\",le=\"1\"} 3\n",
      "twain_lat_seconds_bucket{process=\"unit\",le=\"+Inf\"} 4\n",
      "twain_lat_seconds_sum{process=\"unit\"} 6.0499999999999998\n",
      "twain_lat_seconds_count{process=\"unit\"} 4\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    EXPECT(strstr(buf, want[i]) != NULL, "metrics text lacks %s", want[i]);
  EXPECT(http_get(port, "/healthz", buf, sizeof buf) > 0 && strstr(buf, " 200 ") &&
             strstr(buf, "\r\n\r\nok\n"),
         "healthz ok: %s", buf);
  /* 2,000 idle connections held open (a select() server stops at 1,024
   * descriptors): /healthz still answers, and again once they are gone */
  {
    enum { N_IDLE = 2000 };
    static int fds[N_IDLE];
    int held = hold_connections(port, fds, N_IDLE);
    EXPECT(held == N_IDLE, "held %d of %d idle connections", held, N_IDLE);
    struct timespec pause = {0, 200 * 1000 * 1000}; /* the server accepts them all */
    nanosleep(&pause, NULL);
    buf[0] = '\0';
    EXPECT(http_get(port, "/healthz", buf, sizeof buf) > 0 && strstr(buf, " 200 "),
           "healthz answers while %d idle connections are open: '%.40s'", held, buf);
    EXPECT(http_get(port, "/metrics", buf, sizeof buf) > 0 && strstr(buf, " 200 "),
           "metrics answer while %d idle connections are open", held);
    for (int i = 0; i < held; i++) close(fds[i]);
    EXPECT(http_get(port, "/healthz", buf, sizeof buf) > 0 && strstr(buf, " 200 "),
           "healthz answers after they closed");
  }
  tw_metrics_set_health(m, false, "draining");
  EXPECT(http_get(port, "/healthz", buf, sizeof buf) > 0 && strstr(buf, " 503 ") &&
             strstr(buf, "draining"),
         "healthz 503 draining: %s", buf);
  EXPECT(http_get(port, "/livez", buf, sizeof buf) > 0 && strstr(buf, " 200 ") &&
             strstr(buf, "\r\n\r\nalive\n"),
         "livez 200 while draining: %s", buf);
  tw_metrics_set_health(m, true, NULL);
  EXPECT(http_get(port, "/livez", buf, sizeof buf) > 0 && strstr(buf, " 200 "), "livez 200: %s",
         buf);
  EXPECT(http_get(port, "/nope", buf, sizeof buf) > 0 && strstr(buf, " 404 "), "404");
  EXPECT(http_req(port, "POST", "/metrics", buf, sizeof buf) > 0 && strstr(buf, " 405 ") &&
             strstr(buf, "\r\nAllow: GET, HEAD\r\n") && strstr(buf, "method POST not allowed"),
         "POST /metrics: 405 with Allow: %s", buf);
  EXPECT(http_req(port, "HEAD", "/metrics", buf, sizeof buf) > 0 && strstr(buf, " 200 ") &&
             strstr(buf, "\r\n\r\n") && !strstr(buf, "# TYPE"),
         "HEAD /metrics: 200 without the text: %s", buf);
  EXPECT(tw_metric_value(h) == 4, "histogram count");
  tw_metrics_destroy(m);
  /* a process name with what the exposition format escapes (a worker's
   * --name is the operator's text): still one valid sample line */
  m = NULL;
  EXPECT(tw_metrics_create("q\"x\\y\nz", 0, NULL, &m) == TW_OK && m, "odd process name");
  if (m) {
    tw_metric_add(tw_metrics_counter(m, "odd_total", "odd"), 1);
    EXPECT(http_get(tw_metrics_port(m), "/metrics", buf, sizeof buf) > 0 &&
               strstr(buf, "\ntwain_odd_total{process=\"q\\\"x\\\\y\\nz\"} 1\n"),
           "its label escaped: %s", buf);
    tw_metrics_destroy(m);
  }
  /* an explicit address: the loopback given by number */
  m = NULL;
  EXPECT(tw_metrics_create("unit", 0, "127.0.0.1", &m) == TW_OK && m, "explicit 127.0.0.1");
  if (m) {
    EXPECT(http_get(tw_metrics_port(m), "/livez", buf, sizeof buf) > 0 && strstr(buf, " 200 "),
           "livez on an explicit address: %s", buf);
    tw_metrics_destroy(m);
  }
  printf("%s: %d failures\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
