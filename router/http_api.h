/* http_api.h: the router's OpenAI-compatible HTTP API (docs/api.md "HTTP
 * API"): POST /v1/chat/completions, /v1/responses, /v1/completions, GET
 * /v1/models, /v1/models/ID and /health, served by libmicrohttpd inside the
 * router's own loop (its epoll fd is one more item of the loop's zmq_poll),
 * so HTTP requests enter the router exactly like protobuf ones: each HTTP
 * connection is a client whose routing id no ZeroMQ peer can have (a leading
 * zero byte and a length no ZeroMQ-generated id has), and replies addressed
 * to such an id come here (tw_http_on_reply) instead of going to the socket.
 * Harmony rendering and parsing stay in router_chat.c; this layer turns the
 * parsed deltas, tool calls and usage into OpenAI JSON and Server-Sent Events.
 * Router thread only. */
#ifndef TW_ROUTER_HTTP_API_H
#define TW_ROUTER_HTTP_API_H

#include "router/router_impl.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TW_HTTP_ID_LEN 11 /* 0x00 'H' 'T' + 8 bytes of connection serial */

/** Start serving on params http_addr:http_port (NULL *h_p when http_port < 0).
 *  Errors: TW_ERR_INVALID_ARGUMENT (address not numeric), TW_ERR_TRANSPORT
 *  (cannot listen there, e.g. the port is taken), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_http_start(tw_router_t *r, tw_http_t **h_p);
/** Close every connection (no request is cancelled through the router: it is
 *  shutting down) and stop. NULL does nothing. */
void tw_http_stop(tw_http_t *h);
/** The fd the router polls for readability (libmicrohttpd's epoll set); -1
 *  for NULL. */
int tw_http_fd(const tw_http_t *h);
/** How long the router may block in its poll of tw_http_fd: cap_ms, or less
 *  where libmicrohttpd says so (MHD_get_timeout: 0 while a connection is
 *  ready without a new epoll event, e.g. the next request of a kept-alive
 *  connection read along with the last answer, which would otherwise wait
 *  for the cap; a connection timeout's deadline). cap_ms for NULL. */
int tw_http_wait_ms(const tw_http_t *h, int cap_ms);
/** Accept, read and write whatever is ready, without blocking; once a second
 *  also keeps idle streams alive. NULL does nothing. */
void tw_http_run(tw_http_t *h);
/** Whether a client routing id is an HTTP connection's. */
bool tw_http_owns(const uint8_t *id, size_t id_len);
/** A router reply for the HTTP connection `id`: converted at once (rep is
 *  borrowed for the call). TW_ERR_UNAVAILABLE when that connection is gone
 *  (the router then cancels the request). */
TW_NODISCARD tw_status_t tw_http_on_reply(tw_http_t *h, const uint8_t *id, size_t id_len,
                                          Twain__V1__ServerReply *rep);

#endif
