/* http_impl.h: internals shared by http_api.c (the server: connections,
 * routing, authentication, limits, SSE output) and http_openai.c (OpenAI
 * request JSON -> twain.v1 requests, router replies -> OpenAI JSON and
 * events). Not a public interface. */
#ifndef TW_ROUTER_HTTP_IMPL_H
#define TW_ROUTER_HTTP_IMPL_H

#include "router/http_api.h"

#include "common/text/tokenizer.h"

#include <cjson/cJSON.h>

#include <stdbool.h>
#include <stdint.h>

typedef enum {
  TW_HK_NONE = 0,
  TW_HK_CHAT = 1,        /* POST /v1/chat/completions */
  TW_HK_RESPONSES = 2,   /* POST /v1/responses */
  TW_HK_COMPLETIONS = 3, /* POST /v1/completions */
} tw_hkind_t;

/* One output item: a Harmony message as the OpenAI APIs show it. */
typedef enum {
  TW_HI_TEXT = 0,      /* final, or commentary without a recipient: content */
  TW_HI_REASONING = 1, /* analysis: reasoning_content / a reasoning item */
  TW_HI_CALL = 2,      /* a message to a tool: a function call */
} tw_hitem_kind_t;

typedef struct {
  tw_hitem_kind_t kind;
  char *name;          /* call: the function name (recipient without "functions.") */
  char id[40];         /* item id (responses); call: the call id */
  tw_tok_buf_t text;   /* content, reasoning or arguments */
  bool closed;         /* call: its ToolCall arrived */
  bool ended;          /* responses: its done events were sent */
} tw_hitem_t;

#define TW_HTTP_MAX_STOPS 4

typedef struct tw_hconn {
  struct tw_http *h;
  void *mc;            /* struct MHD_Connection */
  uint64_t serial;
  uint8_t id[TW_HTTP_ID_LEN];
  tw_hkind_t kind;
  tw_tok_buf_t body;
  bool stream, include_usage;
  bool submitted;      /* handed to the router */
  bool finished;       /* the answer is complete (or failed) */
  bool close_after;    /* the connection closes after the answer (a request framed ambiguously) */
  bool suspended;      /* waiting in the access handler for the router */
  bool queued;         /* an MHD response was queued */
  bool preflight;      /* a CORS preflight (OPTIONS): 204 with the Access-Control headers */
  bool sse;            /* the stream started: status 200 and events */
  bool want_cancel;    /* cancel the router request at the next tw_http_run */
  bool cancel_stopped; /* ... as finished by a stop string (CancelRequest.stopped) */
  bool broken;         /* the stream could not be built (out of memory): it ends with an error */
  bool failing;        /* an error event is being written (tw_http_check: no second one) */
  bool error_counted;  /* in router_http_errors_total already */
  unsigned status;     /* the answer decided before any stream: status + body */
  char *answer;
  tw_tok_buf_t out;    /* SSE bytes not yet written */
  size_t out_off;
  int64_t last_write_ns;
  int64_t created;     /* unix seconds */
  tw_hitem_t *items;
  int n_items, cap_items;
  bool sent_head;      /* chat: the role chunk; responses: created/in_progress */
  int32_t prompt_tokens, completion_tokens, reasoning_tokens;
  int finish;          /* Twain__V1__FinishReason */
  bool last_cut;       /* the last item was cut off before its end (ServerReply.last_message_cut) */
  const char *max_key; /* the request's max tokens field as the client named it (a literal) */
  int64_t seq;         /* responses: sequence_number */
  /* completions */
  tw_tok_stream_t dec;
  tw_tok_buf_t ctext;  /* decoded text so far */
  size_t ctext_sent;   /* bytes of it already streamed */
  char *stops[TW_HTTP_MAX_STOPS];
  int n_stops;
  size_t max_stop;
  int32_t n_seen;      /* generated ids read so far */
  /* responses: the request's tool_choice and tools, echoed in the response object */
  cJSON *echo_tool_choice, *echo_tools;
  struct tw_hconn *next, *prev;
} tw_hconn_t;

struct tw_http {
  tw_router_t *r;
  void *d;             /* struct MHD_Daemon */
  int fd, port;
  bool stopping;
  bool pending_cancel;
  uint64_t next_serial;
  uint32_t boot; /* random, drawn at start: ids (chatcmpl-BOOTSERIAL...) differ across restarts */
  tw_hconn_t *conns;
  char model[256];
  int64_t created;
  int64_t last_tick_ns;
  tw_metric_t *m_requests, *m_errors, *m_conns;
  int32_t n_conns;        /* open HTTP connections (MHD_OPTION_NOTIFY_CONNECTION) */
  int64_t full_warned_ns; /* when reaching --http-max-connections was last logged */
};

/* ---- http_api.c ---- */
/** Decide the answer before any stream: an OpenAI error object with `status`
 *  (type from the status; `param` may be NULL), or after the stream began an
 *  error event and the end of the stream. Marks the connection finished. */
void tw_http_fail(tw_hconn_t *c, unsigned status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/** The HTTP status for a twain.v1 Code. */
unsigned tw_http_status_of_code(int code);
/** Whether an error message (the router's or this layer's) says the prompt,
 *  or the prompt with the tokens asked for, is over the model context or the
 *  prompt limit: OpenAI's code context_length_exceeded, param the input. */
bool tw_http_msg_context(const char *msg);
/** Check a status from building c's request or answer (an append that
 *  could not grow, a token without text). TW_OK: true. Otherwise (logged
 *  once) c ends with an error: before any stream a 500 answer, after it
 *  began the stream is cut off with an error (a client sees a failed
 *  transfer, never a silently shortened answer); a request handed to the
 *  router is cancelled. Returns false. */
bool tw_http_check(tw_hconn_t *c, tw_status_t st);
/** Append bytes to the connection's pending SSE output (tw_http_check on a
 *  failure). */
void tw_http_out(tw_hconn_t *c, const char *s, size_t len);
/** Append "data: <json>\n\n" (obj is deleted). */
void tw_http_sse_data(tw_hconn_t *c, cJSON *obj);
/** Append "event: <type>\ndata: <json with type and sequence_number>\n\n"
 *  (obj is deleted). */
void tw_http_sse_event(tw_hconn_t *c, const char *type, cJSON *obj);
/** Finish with a complete JSON body (obj is deleted), status 200; when c
 *  already finished (a failure decided first) obj is only deleted. */
void tw_http_answer_json(tw_hconn_t *c, cJSON *obj);

/* ---- http_openai.c ---- */
/** Parse the body of a POST (c->kind) and hand the request to the router
 *  (tw_router_dispatch); a bad body ends in tw_http_fail (400, 404). */
void tw_hoai_submit(tw_hconn_t *c);
/** One router reply for c: update its items, queue events, on the last one
 *  build the answer. */
void tw_hoai_on_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep);
/** Free what the conversion keeps per connection. */
void tw_hoai_free(tw_hconn_t *c);

#endif
