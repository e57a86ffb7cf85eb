/* fuzz_http_request.c: any bytes as the body of a POST to the HTTP API
 * (router/http_openai.c): JSON parsing, the checks of every field (a 400 or
 * 404 naming it), the conversion to a twain.v1 request and its validation by
 * the router, then a few generated tokens through the router's Harmony
 * parser and back out as OpenAI JSON or Server-Sent Events
 * (http_openai_reply.c).
 *
 * Input: byte 0 picks the endpoint (bits 0-1: chat, responses, completions,
 * chat) and how many tokens the fake decode worker produces (bits 2-7); those
 * tokens are the last 2 bytes each of the input (little-endian, modulo the
 * fixture's vocabulary, the last one with `finished`), the body is what lies
 * between. The HTTP server itself (libmicrohttpd) is not involved: the
 * connection is a tw_hconn_t the harness owns, registered with a stand-in
 * tw_http_t so the router's replies reach it as they would a real one.
 *
 * Checked after each input: the request is answered or running, never both;
 * an answer has a status the API documents; every byte that would go to the
 * client (the JSON answer or the SSE stream) is valid UTF-8, and a JSON
 * answer parses. */
#include "tests/fuzz/fuzz_router.h"

#include "common/model/model_path.h"
#include "router/http_impl.h"

#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tw_http_t http_g;

static void tw_fuzz_http_init(tw_router_t *r) {
  static int init;
  if (init) return;
  init = 1;
  http_g.r = r;
  http_g.fd = -1;
  tw_model_name(NULL, r->p->model_dir, http_g.model, sizeof http_g.model);
  r->http = &http_g;
}

static void tw_fuzz_check_utf8(const char *what, const char *s, size_t len) {
  size_t bad = 0;
  if (s && !tw_utf8_valid(s, len, &bad)) {
    fprintf(stderr, "fuzz: the %s is not valid UTF-8 at byte %zu of %zu: ", what, bad, len);
    fwrite(s, 1, len, stderr);
    fputc('\n', stderr);
    abort();
  }
}

/* The router request of connection c, if it holds one. */
static tw_req_t *tw_fuzz_req_of(tw_router_t *r, const tw_hconn_t *c) {
  for (int32_t i = 0; i < r->n_reqs; i++) {
    tw_req_t *q = r->reqs[i];
    if (!q->done && q->cid_len == TW_HTTP_ID_LEN && !memcmp(q->cid, c->id, TW_HTTP_ID_LEN))
      return q;
  }
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  tw_router_t *r = tw_fuzz_router();
  tw_fuzz_http_init(r);
  if (size < 1 || size > (1 << 20)) return 0;
  static const tw_hkind_t kinds[4] = {TW_HK_CHAT, TW_HK_RESPONSES, TW_HK_COMPLETIONS, TW_HK_CHAT};
  size_t n_tok = data[0] >> 2;
  if (1 + 2 * n_tok > size) n_tok = (size - 1) / 2;
  const uint8_t *body = data + 1, *tail = data + size - 2 * n_tok;
  size_t body_len = (size_t)(tail - body);

  tw_hconn_t *c = calloc(1, sizeof *c);
  if (!c) return 0;
  c->h = &http_g;
  c->serial = ++http_g.next_serial;
  c->id[0] = 0, c->id[1] = 'H', c->id[2] = 'T';
  memcpy(c->id + 3, &c->serial, sizeof c->serial);
  c->kind = kinds[data[0] & 3];
  tw_tok_buf_init(&c->body);
  tw_tok_buf_init(&c->out);
  tw_tok_buf_append(&c->body, (const char *)body, body_len);
  http_g.conns = c;
  c->submitted = true;
  tw_hoai_submit(c);

  tw_req_t *q = tw_fuzz_req_of(r, c);
  if (q && c->finished) {
    fprintf(stderr, "fuzz: the request was answered (%u) and still runs\n", c->status);
    abort();
  }
  if (!q && !c->finished) {
    fprintf(stderr, "fuzz: the request is neither answered nor running\n");
    abort();
  }
  if (q) tw_router_schedule(r, tw_msg_clock_ns());
  /* generated tokens: one per reply for the first few, then the rest at once */
  int32_t toks[64];
  for (size_t i = 0; i < n_tok; i++)
    toks[i] = (int32_t)((tail[2 * i] | tail[2 * i + 1] << 8) % (unsigned)r->config.vocab_size);
  for (size_t i = 0; i < n_tok && (q = tw_fuzz_req_of(r, c)) != NULL;) {
    size_t n = i < 4 ? 1 : n_tok - i;
    tw_router_on_tokens(r, q, toks + i, n, i + n == n_tok, TWAIN__V1__FINISH_REASON__FINISH_STOP);
    i += n;
  }
  if (http_g.pending_cancel) { /* a stop string: the API cancels the rest */
    http_g.pending_cancel = false;
    c->want_cancel = false;
    if ((q = tw_fuzz_req_of(r, c)) != NULL)
      tw_router_fail(r, q, TWAIN__V1__CODE__CANCELLED, "fuzz: stop string");
  }
  tw_fuzz_router_reset(); /* a request still running ends CANCELLED: answered too */

  if (!c->finished) {
    fprintf(stderr, "fuzz: the connection got no answer after its request ended\n");
    abort();
  }
  static const unsigned statuses[] = {200, 400, 401, 404, 413, 429, 500, 503, 504};
  bool known = c->sse;
  for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++)
    known |= c->status == statuses[i];
  if (!known) {
    fprintf(stderr, "fuzz: HTTP status %u is not one the API answers\n", c->status);
    abort();
  }
  tw_fuzz_check_utf8("SSE stream", c->out.data, c->out.len);
  if (!c->sse) {
    if (!c->answer) {
      fprintf(stderr, "fuzz: a finished request without an answer body\n");
      abort();
    }
    tw_fuzz_check_utf8("JSON answer", c->answer, strlen(c->answer));
    cJSON *j = cJSON_Parse(c->answer);
    if (!j) {
      fprintf(stderr, "fuzz: the answer is not JSON: %.200s\n", c->answer);
      abort();
    }
    cJSON_Delete(j);
  }
  http_g.conns = NULL;
  tw_hoai_free(c);
  tw_tok_buf_fini(&c->body);
  tw_tok_buf_fini(&c->out);
  free(c->answer);
  free(c);
  return 0;
}
