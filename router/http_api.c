/* http_api.c: the HTTP server of the OpenAI-compatible API (http_api.h):
 * libmicrohttpd in "external" mode driven by the router loop, one tw_hconn_t
 * per request, the Bearer key check, the body limit, errors in OpenAI's
 * shape, Server-Sent Events, and cancellation when a client goes away. */
#include "router/http_impl.h"

#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/model/model_path.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TW_HTTP_KEEPALIVE_NS (10LL * 1000000000LL) /* an idle stream gets a comment */
#define TW_HTTP_STOP_FLUSH_MS 1000 /* at a stop: the longest wait for answers to be written */
#define TW_HTTP_IDLE_S 300u        /* a connection silent this long is closed (libmicrohttpd) */

bool tw_http_owns(const uint8_t *id, size_t id_len) {
  return id_len == TW_HTTP_ID_LEN && id[0] == 0 && id[1] == 'H' && id[2] == 'T';
}

int tw_http_fd(const tw_http_t *h) { return h ? h->fd : -1; }

int tw_http_wait_ms(const tw_http_t *h, int cap_ms) {
  MHD_UNSIGNED_LONG_LONG to = 0;
  if (!h || MHD_get_timeout(h->d, &to) != MHD_YES) return cap_ms;
  return to < (MHD_UNSIGNED_LONG_LONG)cap_ms ? (int)to : cap_ms;
}

unsigned tw_http_status_of_code(int code) {
  switch (code) {
    case TWAIN__V1__CODE__INVALID_ARGUMENT: case TWAIN__V1__CODE__UNIMPLEMENTED: return 400;
    case TWAIN__V1__CODE__UNAUTHENTICATED: return 401;
    case TWAIN__V1__CODE__NOT_FOUND: return 404;
    case TWAIN__V1__CODE__RESOURCE_EXHAUSTED: return 429;
    case TWAIN__V1__CODE__UNAVAILABLE: case TWAIN__V1__CODE__CANCELLED: return 503;
    case TWAIN__V1__CODE__DEADLINE_EXCEEDED: return 504;
    default: return 500;
  }
}

static const char *tw_http_error_type(unsigned status) {
  switch (status) {
    case 400: case 405: case 413: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    case 504: return "timeout_error";
    default: return "server_error";
  }
}

bool tw_http_check(tw_hconn_t *c, tw_status_t st) {
  if (st == TW_OK) return true;
  /* answered already, or a stream already ended by its error event */
  if (c->broken || (c->finished && (!c->sse || c->failing))) return false;
  TW_ERROR("http", "request %llu: cannot build its %s (%s): ending it with an error",
           (unsigned long long)c->serial, c->submitted ? "answer" : "request", tw_last_error());
  if (c->submitted && !c->finished) { /* stop the generation nobody will read */
    c->want_cancel = true;
    c->h->pending_cancel = true;
  }
  /* a stream whose part could not be made (not a failed write: the output so
   * far ends with whole events) ends with its error event, as any error after
   * its start; a write that failed (out of memory) may have left half an
   * event, so that stream, or an error event that could not be written, is
   * cut off instead */
  if (c->sse && !c->finished && !c->failing && st != TW_ERR_NO_MEMORY) {
    c->failing = true;
    tw_http_fail(c, 500, NULL, "the server could not build the %s: %s",
                 c->submitted ? "answer" : "request", tw_last_error());
    if (!c->broken) return false;
  }
  if (c->sse) { /* cut it off (tw_http_sse_reader) */
    if (!c->broken && !c->error_counted) tw_metric_add(c->h->m_errors, 1);
    c->error_counted = true;
    c->broken = true;
    c->finished = true;
  } else {
    tw_http_fail(c, 500, NULL, "the server could not build the %s: %s",
                 c->submitted ? "answer" : "request", tw_last_error());
  }
  return false;
}

void tw_http_out(tw_hconn_t *c, const char *s, size_t len) {
  if (c->broken || (c->sse && c->finished && c->failing)) return; /* ended by its error event */
  if (c->out_off && c->out_off == c->out.len) c->out.len = c->out_off = 0;
  tw_http_check(c, tw_tok_buf_append(&c->out, s, len));
}

/* prefix, obj as JSON (deleted), "\n\n" */
static void tw_http_out_json(tw_hconn_t *c, const char *prefix, cJSON *obj) {
  char *t = cJSON_PrintUnformatted(obj);
  cJSON_Delete(obj);
  if (!t) return;
  tw_http_out(c, prefix, strlen(prefix));
  tw_http_out(c, t, strlen(t));
  tw_http_out(c, "\n\n", 2);
  free(t);
}

void tw_http_sse_data(tw_hconn_t *c, cJSON *obj) { tw_http_out_json(c, "data: ", obj); }

void tw_http_sse_event(tw_hconn_t *c, const char *type, cJSON *obj) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "type", type);
  cJSON_AddNumberToObject(o, "sequence_number", (double)c->seq++);
  cJSON *it = obj ? obj->child : NULL;
  while (it) { /* move obj's members after type and sequence_number */
    cJSON *next = it->next;
    cJSON_AddItemToObject(o, it->string, cJSON_DetachItemViaPointer(obj, it));
    it = next;
  }
  cJSON_Delete(obj);
  char prefix[160];
  snprintf(prefix, sizeof prefix, "event: %s\ndata: ", type);
  tw_http_out_json(c, prefix, o);
}

bool tw_http_msg_context(const char *msg) {
  return strstr(msg, "exceeds the model context") || strstr(msg, "exceeds the limit of") ||
         strstr(msg, "over the limit of");
}

static cJSON *tw_http_error_obj(unsigned status, const char *param, const char *msg) {
  cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(e, "message", msg);
  cJSON_AddStringToObject(e, "type", tw_http_error_type(status));
  if (param) cJSON_AddStringToObject(e, "param", param);
  else cJSON_AddNullToObject(e, "param");
  if (status == 429) cJSON_AddStringToObject(e, "code", "resource_exhausted");
  else if (status == 401) cJSON_AddStringToObject(e, "code", "invalid_api_key");
  else if (status == 404 && param && !strcmp(param, "model"))
    cJSON_AddStringToObject(e, "code", "model_not_found");
  else if (status == 400 && tw_http_msg_context(msg))
    cJSON_AddStringToObject(e, "code", "context_length_exceeded"); /* OpenAI's code for it */
  else cJSON_AddNullToObject(e, "code");
  return o;
}

static void tw_http_set_answer(tw_hconn_t *c, unsigned status, cJSON *obj) {
  free(c->answer);
  c->answer = cJSON_PrintUnformatted(obj);
  cJSON_Delete(obj);
  c->status = status;
  c->finished = true;
}

void tw_http_answer_json(tw_hconn_t *c, cJSON *obj) {
  if (c->finished) { /* an answer already decided (a failure: tw_http_check) stands */
    cJSON_Delete(obj);
    return;
  }
  tw_http_set_answer(c, 200, obj);
}

void tw_http_fail(tw_hconn_t *c, unsigned status, const char *param, const char *fmt, ...) {
  char raw[768], msg[1024]; /* msg: raw with what is not UTF-8 escaped */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  if (c->finished) return;
  tw_utf8_escape(raw, msg, sizeof msg);
  TW_LOG(status >= 500 ? TW_LOG_INFO : TW_LOG_DEBUG, "http", "request %llu: %u %s",
         (unsigned long long)c->serial, status, msg);
  if (!c->error_counted) tw_metric_add(c->h->m_errors, 1);
  c->error_counted = true;
  if (!c->sse) {
    tw_http_set_answer(c, status, tw_http_error_obj(status, param, msg));
    return;
  }
  cJSON *e = tw_http_error_obj(status, param, msg);
  if (c->kind == TW_HK_RESPONSES) {
    cJSON *inner = cJSON_DetachItemFromObject(e, "error");
    cJSON_AddStringToObject(e, "message", cJSON_GetObjectItem(inner, "message")->valuestring);
    cJSON_AddStringToObject(e, "code", tw_http_error_type(status));
    cJSON_AddNullToObject(e, "param");
    cJSON_Delete(inner);
    tw_http_sse_event(c, "error", e);
  } else {
    tw_http_sse_data(c, e);
    tw_http_out(c, "data: [DONE]\n\n", 14);
  }
  c->finished = true;
}

/* ---- connections ---- */

static tw_hconn_t *tw_http_find(tw_http_t *h, const uint8_t *id) {
  uint64_t serial;
  memcpy(&serial, id + 3, sizeof serial);
  for (tw_hconn_t *c = h->conns; c; c = c->next)
    if (c->serial == serial) return c;
  return NULL;
}

static void tw_http_wake(tw_hconn_t *c) {
  if (!c->suspended) return;
  c->suspended = false;
  MHD_resume_connection(c->mc);
}

static void tw_http_unlink(tw_hconn_t *c) {
  tw_http_t *h = c->h;
  if (c->prev) c->prev->next = c->next;
  else if (h->conns == c) h->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  c->next = c->prev = NULL;
}

static void tw_http_free_conn(tw_hconn_t *c) {
  tw_hoai_free(c);
  tw_tok_buf_fini(&c->body);
  tw_tok_buf_fini(&c->out);
  free(c->answer);
  free(c);
}

/* Cancel c's router request (a CancelRequest from its routing id). */
static void tw_http_cancel(tw_http_t *h, tw_hconn_t *c) {
  Twain__V1__CancelRequest cq = TWAIN__V1__CANCEL_REQUEST__INIT;
  cq.target_request_id = 1;
  cq.stopped = c->cancel_stopped;
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.request_id = 2;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CANCEL;
  cr.cancel = &cq;
  tw_msg_t from = {.id_len = TW_HTTP_ID_LEN};
  memcpy(from.id, c->id, TW_HTTP_ID_LEN);
  tw_router_dispatch(h->r, &from, &cr);
}

TW_NODISCARD tw_status_t tw_http_on_reply(tw_http_t *h, const uint8_t *id, size_t id_len,
                                          Twain__V1__ServerReply *rep) {
  (void)id_len;
  tw_hconn_t *c = h ? tw_http_find(h, id) : NULL;
  if (!c) return tw_err_quiet(TW_ERR_UNAVAILABLE, "the HTTP client went away");
  if (c->finished) return TW_OK; /* e.g. the cancel after a stop string */
  if (rep->request_id != 1) return TW_OK; /* the answer to our own cancel */
  tw_hoai_on_reply(c, rep);
  /* a stream has output to write; a whole answer waits for its last reply
   * (waking it for each token kept it from ever being suspended at the
   * once-a-second check for clients that went away, tw_http_run) */
  if (c->sse || c->finished) tw_http_wake(c);
  return TW_OK;
}

/* ---- the access handler ---- */

/* --http-allow-origin: the origin on every answer; a preflight's as well
 * what it may send (the Fetch standard's CORS protocol). */
static void tw_http_cors(const tw_hconn_t *c, struct MHD_Response *resp) {
  const char *origin = c->h->r->p->http_allow_origin;
  if (!origin || !origin[0]) return;
  MHD_add_response_header(resp, "Access-Control-Allow-Origin", origin);
  if (strcmp(origin, "*") != 0) MHD_add_response_header(resp, "Vary", "Origin");
  if (!c->preflight) return;
  MHD_add_response_header(resp, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
  /* the headers the page asks to send (an SDK sends its own x-... ones; "*"
   * would not cover Authorization), when they are plain header names */
  const char *want =
      MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, "Access-Control-Request-Headers");
  size_t wl = want ? strlen(want) : 0;
  bool plain = wl && wl < 2048 && strspn(want, TW_ALNUM_CHARS "-_, ") == wl;
  MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                          plain ? want : "Authorization, Content-Type");
  MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
}

static enum MHD_Result tw_http_queue(tw_hconn_t *c, unsigned status, char *body) {
  struct MHD_Response *resp =
      MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
  if (!resp) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(resp, "Content-Type", "application/json");
  if (status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
  if (c->close_after) MHD_add_response_header(resp, "Connection", "close");
  tw_http_cors(c, resp);
  enum MHD_Result ret = MHD_queue_response(c->mc, status, resp);
  MHD_destroy_response(resp);
  c->queued = true;
  return ret;
}

static enum MHD_Result tw_http_queue_answer(tw_hconn_t *c) {
  char *body = c->answer ? c->answer : strdup("{}");
  c->answer = NULL;
  if (!body) return MHD_NO;
  return tw_http_queue(c, c->status ? c->status : 200, body);
}

static ssize_t tw_http_sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  tw_hconn_t *c = cls;
  if (c->broken) return MHD_CONTENT_READER_END_WITH_ERROR;
  size_t avail = c->out.len - c->out_off;
  if (avail) {
    size_t n = avail < max ? avail : max;
    memcpy(buf, c->out.data + c->out_off, n);
    c->out_off += n;
    if (c->out_off == c->out.len) c->out.len = c->out_off = 0;
    c->last_write_ns = tw_msg_clock_ns();
    return (ssize_t)n;
  }
  if (c->finished) return MHD_CONTENT_READER_END_OF_STREAM;
  c->suspended = true; /* until tw_http_wake: new output or a keepalive */
  MHD_suspend_connection(c->mc);
  return 0;
}

static enum MHD_Result tw_http_queue_sse(tw_hconn_t *c) {
  /* each event goes out as it is made: no Nagle wait for the previous ACK */
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
  int one = 1;
  if (ci) setsockopt(ci->connect_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct MHD_Response *resp =
      MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, tw_http_sse_reader, c, NULL);
  if (!resp) return MHD_NO;
  MHD_add_response_header(resp, "Content-Type", "text/event-stream");
  MHD_add_response_header(resp, "Cache-Control", "no-cache");
  tw_http_cors(c, resp);
  enum MHD_Result ret = MHD_queue_response(c->mc, 200, resp);
  MHD_destroy_response(resp);
  c->queued = true;
  return ret;
}

static void tw_http_models(tw_hconn_t *c, const char *one) {
  tw_http_t *h = c->h;
  if (one && strcmp(one, h->model) != 0) {
    tw_http_fail(c, 404, "model", "The model `%s` does not exist: this server serves `%s`", one,
                 h->model);
    return;
  }
  cJSON *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "id", h->model);
  cJSON_AddStringToObject(m, "object", "model");
  cJSON_AddNumberToObject(m, "created", (double)h->created);
  cJSON_AddStringToObject(m, "owned_by", "twain");
  cJSON_AddNumberToObject(m, "max_model_len", h->r->config.max_position_embeddings);
  if (one) {
    tw_http_answer_json(c, m);
    return;
  }
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "object", "list");
  cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "data"), m);
  tw_http_answer_json(c, o);
}

static void tw_http_health(tw_hconn_t *c) {
  tw_router_t *r = c->h->r;
  const char *why = r->draining ? "draining"
                    : !tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL)
                        ? "no prefill worker registered"
                    : !tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_DECODE)
                        ? "no decode worker registered"
                        : NULL;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "status", why ? "unavailable" : "ok");
  if (why) cJSON_AddStringToObject(o, "reason", why);
  tw_http_set_answer(c, why ? 503 : 200, o);
}

/* Route a new request; may decide its answer at once. */
static void tw_http_route(tw_hconn_t *c, const char *url, const char *method) {
  tw_http_t *h = c->h;
  bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
  const char *origin = h->r->p->http_allow_origin;
  if (!strcmp(method, "OPTIONS") && origin &&
      origin[0]) { /* a browser's preflight: no key needed */
    c->preflight = true;
    free(c->answer);
    c->answer = strdup("");
    c->status = 204;
    c->finished = true;
    return;
  }
  if (!strcmp(url, "/health")) {
    if (get) tw_http_health(c);
    else tw_http_fail(c, 405, NULL, "%s %s: use GET", method, url);
    return;
  }
  if (strncmp(url, "/v1/", 4) != 0) {
    tw_http_fail(c, 404, NULL, "no such endpoint: %s %s (the API is under /v1/)", method, url);
    return;
  }
  const char *auth = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, "Authorization");
  if (h->r->p->api_key && h->r->p->api_key[0]) {
    const char *key = auth && !strncasecmp(auth, "Bearer ", 7) ? auth + 7 : NULL;
    while (key && *key == ' ') key++;
    if (!key || !tw_router_key_ok(h->r, key)) {
      tw_http_fail(c, 401, NULL, "%s: send the key as \"Authorization: Bearer KEY\"",
                   key ? "Incorrect API key provided" : "Missing API key");
      return;
    }
  }
  static const struct { const char *url; tw_hkind_t kind; } posts[] = {
      {"/v1/chat/completions", TW_HK_CHAT}, {"/v1/responses", TW_HK_RESPONSES},
      {"/v1/completions", TW_HK_COMPLETIONS}};
  for (size_t i = 0; i < sizeof posts / sizeof posts[0]; i++) {
    if (strcmp(url, posts[i].url) != 0) continue;
    if (!post) {
      tw_http_fail(c, 405, NULL, "%s %s: use POST", method, url);
      return;
    }
    c->kind = posts[i].kind;
    const char *cl = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoll(cl, NULL, 10) > h->r->p->http_max_body)
      tw_http_fail(c, 413, NULL, "request body of %s bytes is over this server's limit of %lld bytes",
                   cl, (long long)h->r->p->http_max_body);
    return;
  }
  if (!strcmp(url, "/v1/models") || !strncmp(url, "/v1/models/", 11)) {
    if (get) tw_http_models(c, url[10] == '/' ? url + 11 : NULL);
    else tw_http_fail(c, 405, NULL, "%s %s: use GET", method, url);
    return;
  }
  tw_http_fail(c, 404, NULL, "no such endpoint: %s %s (served: POST /v1/chat/completions, "
               "/v1/responses, /v1/completions; GET /v1/models, /health)", method, url);
}

/* Content-Length headers of a request: how many, the first, whether any
 * other differs from it. */
typedef struct {
  int n;
  const char *first;
  bool differ;
} tw_http_lengths_t;
static enum MHD_Result tw_http_length_of(void *cls, enum MHD_ValueKind kind, const char *key,
                                         const char *value) {
  (void)kind;
  tw_http_lengths_t *l = cls;
  if (!key || strcasecmp(key, "Content-Length") != 0) return MHD_YES;
  if (l->n++ == 0)
    l->first = value;
  else if (!value || !l->first || strcmp(value, l->first) != 0)
    l->differ = true;
  return MHD_YES;
}

static enum MHD_Result tw_http_access(void *cls, struct MHD_Connection *mc, const char *url,
                                      const char *method, const char *version,
                                      const char *upload, size_t *upload_size, void **ptr) {
  (void)version;
  tw_http_t *h = cls;
  tw_hconn_t *c = *ptr;
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return MHD_NO;
    c->h = h;
    c->mc = mc;
    c->serial = ++h->next_serial;
    c->id[0] = 0, c->id[1] = 'H', c->id[2] = 'T';
    memcpy(c->id + 3, &c->serial, sizeof c->serial);
    c->created = (int64_t)time(NULL);
    c->last_write_ns = tw_msg_clock_ns();
    tw_tok_buf_init(&c->body);
    tw_tok_buf_init(&c->out);
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    *ptr = c;
    tw_metric_add(h->m_requests, 1);
    tw_http_lengths_t len = {0};
    MHD_get_connection_values(mc, MHD_HEADER_KIND, tw_http_length_of, &len);
    if (len.differ) { /* RFC 9112 6.3: where the body ends is unknown (request smuggling) */
      c->close_after = true;
      tw_http_fail(c, 400, NULL,
                   "the request has %d Content-Length headers that disagree: where its body ends "
                   "is unknown",
                   len.n);
    } else if (
        h->stopping) { /* a request that arrives while the answers in flight are written out */
      tw_http_fail(c, 503, NULL, "the router is shutting down");
    } else {
      tw_http_route(c, url, method);
    }
    if (c->finished) return tw_http_queue_answer(c);
    return MHD_YES;
  }
  if (c->queued) { /* answered early (e.g. 413): drop the rest of the body */
    *upload_size = 0;
    return MHD_YES;
  }
  if (*upload_size) {
    if ((int64_t)(c->body.len + *upload_size) > h->r->p->http_max_body) {
      tw_http_fail(c, 413, NULL, "request body is over this server's limit of %lld bytes",
                   (long long)h->r->p->http_max_body);
      *upload_size = 0;
      return tw_http_queue_answer(c);
    }
    tw_status_t as = tw_tok_buf_append(&c->body, upload, *upload_size);
    *upload_size = 0;
    if (!tw_http_check(c, as)) return tw_http_queue_answer(c); /* 500 */
    return MHD_YES;
  }
  if (!c->submitted && !c->finished) {
    c->submitted = true;
    tw_hoai_submit(c);
  }
  if (c->sse) return tw_http_queue_sse(c);
  if (c->finished) return tw_http_queue_answer(c);
  c->suspended = true; /* until the router's first reply (stream) or last one */
  MHD_suspend_connection(mc);
  return MHD_YES;
}

static void tw_http_completed(void *cls, struct MHD_Connection *mc, void **ptr,
                              enum MHD_RequestTerminationCode toe) {
  (void)mc;
  tw_http_t *h = cls;
  tw_hconn_t *c = *ptr;
  if (!c) return;
  *ptr = NULL;
  tw_http_unlink(c);
  if (c->submitted && !c->finished && !h->stopping) {
    TW_INFO("http", "request %llu: the client went away (%d): cancelling it",
            (unsigned long long)c->serial, (int)toe);
    tw_http_cancel(h, c);
  }
  tw_http_free_conn(c);
}

/* Open connections counted (a gauge); reaching --http-max-connections is
 * logged, at most every 10 s: libmicrohttpd then stops accepting, so new
 * clients wait in the listen backlog (or time out) until one closes. */
static void tw_http_notify_conn(void *cls, struct MHD_Connection *mc, void **socket_context,
                                enum MHD_ConnectionNotificationCode toe) {
  (void)mc;
  (void)socket_context;
  tw_http_t *h = cls;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    h->n_conns++;
    const int64_t now = tw_msg_clock_ns();
    if (h->n_conns >= h->r->p->http_max_conns && now - h->full_warned_ns > 10000000000LL) {
      h->full_warned_ns = now;
      TW_WARN("http",
              "%d HTTP connections are open, --http-max-connections: new connections wait until "
              "one closes (idle ones close after %u s)",
              h->n_conns, TW_HTTP_IDLE_S);
    }
  } else if (h->n_conns > 0) {
    h->n_conns--;
  }
  tw_metric_set(h->m_conns, h->n_conns);
}

static void tw_http_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
  TW_DEBUG("http", "libmicrohttpd: %s", msg);
}

TW_NODISCARD tw_status_t tw_http_start(tw_router_t *r, tw_http_t **h_p) {
  *h_p = NULL;
  const tw_router_params_t *p = r->p;
  if (p->http_port < 0) return TW_OK;
  struct sockaddr_storage ss;
  bool v6;
  const char *addr;
  TW_CHECK(tw_metrics_listen_addr("HTTP", p->http_addr, p->http_port, &ss, &v6, &addr));
  tw_http_t *h = calloc(1, sizeof *h);
  if (!h) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the HTTP server");
  h->r = r;
  h->fd = -1;
  h->created = (int64_t)time(NULL);
  h->last_tick_ns = tw_msg_clock_ns();
  if (getrandom(&h->boot, sizeof h->boot, 0) != (ssize_t)sizeof h->boot)
    h->boot = (uint32_t)(tw_msg_clock_ns() ^ (uint64_t)getpid() << 16);
  h->m_requests = tw_metrics_counter(r->metrics, "router_http_requests_total", "HTTP API requests");
  h->m_conns = tw_metrics_gauge(r->metrics, "router_http_connections", "open HTTP API connections");
  h->m_errors = tw_metrics_counter(r->metrics, "router_http_errors_total",
                                   "HTTP API requests answered with an error (status >= 400, "
                                   "or a stream ended by an error event)");
  tw_model_name(p->served_model_name, p->model_dir, h->model, sizeof h->model);
  unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG |
                   (v6 ? MHD_USE_IPv6 : 0);
  const struct sockaddr *sock = (const struct sockaddr *)&ss;
  h->d = MHD_start_daemon(flags, (uint16_t)p->http_port, NULL, NULL, tw_http_access, h,
                          MHD_OPTION_SOCK_ADDR, sock, MHD_OPTION_CONNECTION_TIMEOUT, TW_HTTP_IDLE_S,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)p->http_max_conns,
                          MHD_OPTION_NOTIFY_CONNECTION, tw_http_notify_conn, h,
                          MHD_OPTION_NOTIFY_COMPLETED, tw_http_completed, h,
                          MHD_OPTION_EXTERNAL_LOGGER, tw_http_log, h, MHD_OPTION_END);
  if (!h->d) {
    free(h);
    return tw_err(TW_ERR_TRANSPORT, "cannot start the HTTP API on %s port %d (in use? "
                  "--http-port picks another, -1 turns it off)", addr, p->http_port);
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD);
  h->fd = di ? di->epoll_fd : -1;
  di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
  h->port = di ? di->port : p->http_port;
  char url[300];
  snprintf(url, sizeof url, "http://%s%s%s:%d/v1", v6 ? "[" : "", addr, v6 ? "]" : "", h->port);
  TW_INFO("http", "serving the OpenAI API on %s (model \"%s\"%s)", url, h->model,
          p->api_key && p->api_key[0] ? ", API key required" : "");
  bool loopback = v6 ? IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sock)->sin6_addr)
                     : (ntohl(((const struct sockaddr_in *)sock)->sin_addr.s_addr) >> 24) == 127;
  if (!loopback && !(p->api_key && p->api_key[0]))
    TW_WARN("http",
            "the OpenAI API on %s answers anyone who can reach it: no API key "
            "(--api-key-file or --api-key requires one)",
            url);
  if (p->on_http) p->on_http(p->on_http_arg, url);
  *h_p = h;
  return TW_OK;
}

/* Whether the client closed its end (EOF waiting on the socket): a
 * connection suspended while its request runs is not read by libmicrohttpd. */
static bool tw_http_peer_closed(tw_hconn_t *c) {
  const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
  char b;
  return ci && recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void tw_http_run(tw_http_t *h) {
  if (!h) return;
  if (h->pending_cancel) {
    h->pending_cancel = false;
    for (tw_hconn_t *c = h->conns; c; c = c->next)
      if (c->want_cancel) {
        c->want_cancel = false;
        tw_http_cancel(h, c);
      }
  }
  int64_t now = tw_msg_clock_ns();
  if (now - h->last_tick_ns > 1000000000LL) { /* once a second */
    h->last_tick_ns = now;
    for (tw_hconn_t *c = h->conns; c; c = c->next) {
      if (!c->submitted || c->finished) continue;
      /* waiting for its answer (suspended, or woken and not yet answered):
       * libmicrohttpd does not read the socket then, so look at it here */
      if ((c->suspended || !c->queued) && tw_http_peer_closed(c)) { /* gone: cancel now */
        TW_INFO("http", "request %llu: the client went away (closed while waiting): cancelling it",
                (unsigned long long)c->serial);
        tw_http_cancel(h, c); /* its CANCELLED answer wakes the connection, which then closes */
        continue;
      }
      if (c->sse && c->out.len == c->out_off && now - c->last_write_ns > TW_HTTP_KEEPALIVE_NS) {
        tw_http_out(c, ": keepalive\n\n", 13); /* an idle stream: an SSE comment */
        tw_http_wake(c);
      }
    }
  }
  MHD_run(h->d);
}

void tw_http_stop(tw_http_t *h) {
  if (!h) return;
  h->stopping = true;
  for (tw_hconn_t *c = h->conns; c; c = c->next) {
    tw_http_fail(c, 503, NULL, "the router is shutting down");
    tw_http_wake(c);
  }
  /* write those answers out, each stream to its last chunk (a cut chunked
   * body is a protocol error to the client, not the error event it should
   * read): until every request completed, for TW_HTTP_STOP_FLUSH_MS at most */
  int64_t t0 = tw_msg_clock_ns();
  MHD_run(h->d);
  while (h->conns &&
         tw_msg_clock_ns() - t0 < (int64_t)TW_HTTP_STOP_FLUSH_MS * TW_SLOW_BUILD * 1000000) {
    for (tw_hconn_t *c = h->conns; c; c = c->next) tw_http_wake(c);
    MHD_run_wait(h->d, 10);
  }
  if (h->conns)
    TW_WARN("http", "stopping with requests whose answers were not all written in %d ms",
            TW_HTTP_STOP_FLUSH_MS);
  MHD_stop_daemon(h->d);
  while (h->conns) { /* any MHD did not report */
    tw_hconn_t *c = h->conns;
    tw_http_unlink(c);
    tw_http_free_conn(c);
  }
  free(h);
}
