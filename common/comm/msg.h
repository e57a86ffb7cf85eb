/* msg.h: ZeroMQ + protobuf framing shared by the router, the workers and the
 * clients (docs/api.md "Transport").
 *
 * A message on the wire is a multipart ZeroMQ message whose last frame is one
 * packed protobuf (twain.v1.ClientRequest/ServerReply for clients,
 * twain.internal.v1.Envelope between router and workers). On a ROUTER socket
 * the frames before it are the peer identity and, for REQ peers, an empty
 * delimiter; tw_msg_recv() keeps them so a reply can mirror them.
 * Receives are bounded: at most TW_MSG_MAX_FRAMES frames and
 * TW_MSG_MAX_BYTES bytes of payload (sockets also carry ZMQ_MAXMSGSIZE, so
 * libzmq drops a larger frame without holding it in memory); anything else is reported as
 * TW_ERR_FORMAT and fully drained, so one bad peer cannot wedge a socket. */
#ifndef TW_COMMON_MSG_H
#define TW_COMMON_MSG_H

#include "common/base/status.h"
#include "common/comm/link_auth.h"

#include <protobuf-c/protobuf-c.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MSG_MAX_FRAMES 4
#define TW_MSG_MAX_BYTES (64u << 20) /* one protobuf, e.g. a 1M-token prompt */
#define TW_MSG_MAX_ID 256             /* bytes of a ZeroMQ routing id */

/** One received message: routing prefix (identity + optional empty
 *  delimiter) and the payload frame. Storage owned by the struct; release
 *  with tw_msg_fini(). */
typedef struct {
  uint8_t id[TW_MSG_MAX_ID];
  size_t id_len;      /* 0: no identity frame (DEALER/REQ side) */
  bool delim;         /* an empty delimiter frame followed the identity */
  uint8_t *data;      /* payload (malloc'ed), NULL if none */
  size_t len;
} tw_msg_t;

/** Receive one message from `sock`. `has_identity`: the socket is a ROUTER
 *  (first frame is the peer id). `timeout_ms` < 0 blocks, 0 polls.
 *  Returns TW_OK with *msg filled, TW_INPROGRESS when nothing arrived within
 *  the timeout (msg untouched), TW_ERR_FORMAT for a message of the wrong
 *  shape (too many frames or bytes; drained, *msg gets the identity so the
 *  caller can reply), TW_ERR_TRANSPORT for a socket error (errno text). */
TW_NODISCARD tw_status_t tw_msg_recv(void *sock, bool has_identity, int timeout_ms, tw_msg_t *msg);

/** Free the payload of a received message. NULL-safe, idempotent. */
void tw_msg_fini(tw_msg_t *msg);

/** Send `msg` packed, preceded by the routing prefix of `maybe_to` (a
 *  message received from the peer; NULL on DEALER/REQ sockets). Never
 *  blocks: a full queue or a vanished peer (ZMQ_ROUTER_MANDATORY) is
 *  TW_ERR_UNAVAILABLE; other failures TW_ERR_TRANSPORT. */
TW_NODISCARD tw_status_t tw_msg_send(void *sock, const tw_msg_t *maybe_to,
                                     const ProtobufCMessage *msg);

/** Same, with an explicit routing id (e.g. a worker id kept in a registry). */
TW_NODISCARD tw_status_t tw_msg_send_to(void *sock, const void *id, size_t id_len, bool delim,
                                        const ProtobufCMessage *msg);

/** Check every string field of a packed protobuf of type `desc` (nested
 *  messages included, by their descriptors) as proto3 requires and as C
 *  code needs: valid UTF-8 and no NUL byte (protobuf-c neither validates
 *  UTF-8 nor reports a NUL, after which strlen() would silently drop the
 *  rest). Call it on a message that unpacked. Returns TW_OK, or
 *  TW_ERR_INVALID_ARGUMENT (quiet: the caller replies) with a message that
 *  names the field ("messages.content contains a NUL byte at offset 5",
 *  "... is not valid UTF-8 at offset 3"); TW_ERR_FORMAT for a message nested
 *  deeper than 32 levels. */
TW_NODISCARD tw_status_t tw_msg_check_strings(const ProtobufCMessageDescriptor *desc,
                                              const uint8_t *data, size_t len);

/** Set ZMQ_MAXMSGSIZE = TW_MSG_MAX_BYTES on `sock` (before its bind or
 *  connect): libzmq drops a larger frame as it arrives (and disconnects
 *  that peer) instead of buffering it whole. tw_msg_socket_open() does
 *  this for every socket it creates. */
void tw_msg_limit_size(void *sock);

/** Rate limit for per-message warnings (malformed frames from a peer):
 *  zero-initialise; one per call site or per socket. Not thread-safe. */
typedef struct {
  int64_t window_start_ns;
  int32_t n_in_window;
  uint64_t suppressed;
} tw_msg_ratelimit_t;
#define TW_MSG_WARN_PER_S 5

/** True when a warning may be logged now: at most TW_MSG_WARN_PER_S per
 *  second. When it returns true, *suppressed_p is how many were refused
 *  since the last one allowed (log "suppressed K" when non-zero). */
bool tw_msg_ratelimit(tw_msg_ratelimit_t *rl, uint64_t *suppressed_p);

/** Note a failed send whose failure leaves the caller nothing to do (the
 *  peer is gone or its queue is full; it retries or times out on its own):
 *  a warning "<what>: <last error>" from `who`, at most TW_MSG_WARN_PER_S a
 *  second per thread. Nothing when st >= 0. Returns st (for `return
 *  tw_msg_note_failure(...)`): this is where a status ends, so it is not
 *  TW_NODISCARD. */
tw_status_t tw_msg_note_failure(tw_status_t st, const char *who, const char *what);

/** Monotonic clock in nanoseconds. */
int64_t tw_msg_clock_ns(void);

/** The host and port of a ZeroMQ TCP endpoint, "tcp://HOST:PORT" or
 *  "tcp://SOURCE;HOST:PORT" (an IPv6 HOST in brackets, given back without
 *  them): host into host[cap], *port_p into the endpoint. false for another
 *  transport, no port, an empty host or port, or a host over cap - 1 bytes. */
bool tw_msg_tcp_host_port(const char *endpoint, char *host, size_t cap, const char **port_p);

/** Create a socket of `type` (ZMQ_ROUTER...) on `ctx` with linger 0 and,
 *  for ROUTER, ZMQ_ROUTER_MANDATORY; bind it if `bind` else connect it to
 *  `endpoint`. For a bind to port 0 ("tcp://127.0.0.1:*" or ":0"), the
 *  actual endpoint is written to maybe_bound[bound_len].
 *  Errors: TW_ERR_TRANSPORT naming the endpoint and errno text. */
TW_NODISCARD tw_status_t tw_msg_socket_open(void *ctx, int type, const char *endpoint, bool bind,
                                            char *maybe_bound, size_t bound_len, void **sock_p);

/** The one map from a status to the code clients and workers see on the wire
 *  (twain.v1.Code, proto/twain_api.proto: gRPC's numbers). Request faults are
 *  INVALID_ARGUMENT (FORMAT, OUT_OF_RANGE too), NOT_FOUND, UNIMPLEMENTED
 *  (UNSUPPORTED), CANCELLED, DEADLINE_EXCEEDED; resources RESOURCE_EXHAUSTED;
 *  peers UNAVAILABLE (TRANSPORT too: the router retries both); everything
 *  else (i/o, device, internal) INTERNAL. TW_OK and TW_INPROGRESS are OK. */
int tw_status_wire_code(tw_status_t st);

/** Same, with link security: `maybe_keys` non-NULL makes a bound socket a
 *  CURVE server and a connected one a CURVE client of that key set
 *  (common/comm/link_auth.h; a ZAP handler must run on `ctx` for a server).
 *  Errors: those of tw_msg_socket_open and tw_auth_server/tw_auth_client. */
TW_NODISCARD tw_status_t tw_msg_socket_open_auth(void *ctx, int type, const char *endpoint,
                                                 bool bind, const tw_auth_keys_t *maybe_keys,
                                                 char *maybe_bound, size_t bound_len,
                                                 void **sock_p);

#ifdef __cplusplus
}
#endif
#endif
