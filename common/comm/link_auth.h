/* link_auth.h: ZeroMQ CURVE encryption and ZAP authentication of the internal
 * links (router <-> workers, rank 0 <-> the other ranks of a worker), see
 * docs/operations.md "Link security".
 *
 * One key set per deployment: a server key pair (the router's worker socket,
 * rank 0's control sockets) and a client key pair (workers, ranks 1..N-1).
 * Holding the set is what makes a process part of the deployment: the ZAP
 * handler of a server accepts exactly one client public key, so a peer without
 * the client secret cannot finish the handshake (CURVE, RFC 26/CurveZMQ; ZAP,
 * RFC 27). Keys are Z85 text (40 characters).
 *
 * Where keys come from (tw_auth_keys_from_env):
 *   TWAIN_KEYS        the key set itself (the text `twain keygen` writes)
 *   TWAIN_KEYS_FILE   a file holding it: a regular file readable by its owner only
 *   TWAIN_INSECURE_PLAINTEXT=1   no keys, no encryption, no authentication
 *                     (logged as a warning at every socket it affects)
 * With none of them a server or client refuses to start.
 *
 * The router's client socket (the twain.v1 API, docs/api.md) is plaintext
 * unless the operator gives it a key set (tw_auth_socket_keys: the router
 * uses the set's server pair). Its clients then need the server public key
 * (tw_auth_client_keys) and hold a key pair of their own; a ZAP handler
 * admits every client key, or only those of an allow-list
 * (tw_auth_guard_start_clients). */
#ifndef TW_COMMON_LINK_AUTH_H
#define TW_COMMON_LINK_AUTH_H

#include "common/base/status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_AUTH_KEY_Z85 41 /* 40 Z85 characters + NUL */
#define TW_AUTH_KEYS_ENV "TWAIN_KEYS"
#define TW_AUTH_KEYS_FILE_ENV "TWAIN_KEYS_FILE"
#define TW_AUTH_PLAINTEXT_ENV "TWAIN_INSECURE_PLAINTEXT"
#define TW_AUTH_MAX_FILE 4096 /* bytes of a key file */
/* the router's client socket (docs/operations.md "Client socket security") */
#define TW_AUTH_CLIENT_KEYS_ENV "TWAIN_CLIENT_KEYS"           /* router: key set text */
#define TW_AUTH_CLIENT_KEYS_FILE_ENV "TWAIN_CLIENT_KEYS_FILE" /* router: key set file */
#define TW_AUTH_CLIENT_ALLOW_ENV "TWAIN_CLIENT_ALLOW_FILE"    /* router: allowed client keys */
#define TW_AUTH_SERVER_KEY_ENV "TWAIN_SERVER_KEY"             /* client: the router's public key */
#define TW_AUTH_IDENTITY_ENV "TWAIN_IDENTITY_FILE"            /* client: its own key pair */
#define TW_AUTH_MAX_ALLOW_FILE (1 << 20)                      /* bytes of an allow-list file */

/* Which keys a parse needs (tw_auth_keys_parse_need): a bit per key. */
#define TW_AUTH_SERVER_PUBLIC 1u
#define TW_AUTH_SERVER_SECRET 2u
#define TW_AUTH_CLIENT_PUBLIC 4u
#define TW_AUTH_CLIENT_SECRET 8u
#define TW_AUTH_ALL_KEYS 15u

typedef struct {
  bool plaintext; /* TWAIN_INSECURE_PLAINTEXT=1: no CURVE on these links */
  char server_public[TW_AUTH_KEY_Z85], server_secret[TW_AUTH_KEY_Z85];
  char client_public[TW_AUTH_KEY_Z85], client_secret[TW_AUTH_KEY_Z85];
} tw_auth_keys_t;

/** Fresh random key set (libzmq's zmq_curve_keypair, libsodium).
 *  Errors: TW_ERR_INTERNAL when libzmq was built without CURVE. */
TW_NODISCARD tw_status_t tw_auth_keys_generate(tw_auth_keys_t *keys);

/** Write the key set as text ("server-public = Z85" lines, one per key) to
 *  buf[n]. Returns the length, or -1 if it does not fit. */
int tw_auth_keys_format(const tw_auth_keys_t *keys, char *buf, size_t n);

/** Parse the text of tw_auth_keys_format (blank lines and '#' comments
 *  allowed). Errors: TW_ERR_INVALID_ARGUMENT naming the missing or malformed
 *  key (never quoting a secret). */
TW_NODISCARD tw_status_t tw_auth_keys_parse(const char *text, tw_auth_keys_t *keys);

/** tw_auth_keys_parse needing only the keys of `need` (TW_AUTH_* bits); the
 *  other keys may be present (they are read) or absent (left empty). Errors:
 *  those of tw_auth_keys_parse. */
TW_NODISCARD tw_status_t tw_auth_keys_parse_need(const char *text, unsigned need,
                                                 tw_auth_keys_t *keys);

/** tw_auth_keys_load_file needing only the keys of `need` (TW_AUTH_* bits).
 *  Errors: those of tw_auth_keys_load_file. */
TW_NODISCARD tw_status_t tw_auth_keys_load_file_need(const char *path, unsigned need,
                                                     tw_auth_keys_t *keys);

/** Read and parse a key file: a regular file (a FIFO or device is refused at
 *  once) of at most TW_AUTH_MAX_FILE bytes that its group and others cannot
 *  read. Errors: TW_ERR_IO (cannot open/read), TW_ERR_INVALID_ARGUMENT (not a
 *  regular file, too large, readable by others, malformed). */
TW_NODISCARD tw_status_t tw_auth_keys_load_file(const char *path, tw_auth_keys_t *keys);

/** The key set from the environment (TWAIN_KEYS, then TWAIN_KEYS_FILE, then
 *  TWAIN_INSECURE_PLAINTEXT=1; see the file comment). `what` names the links
 *  for messages ("router worker socket"). Errors: TW_ERR_INVALID_ARGUMENT
 *  when none is set (the message says how to make keys), errors of
 *  tw_auth_keys_parse / tw_auth_keys_load_file. */
TW_NODISCARD tw_status_t tw_auth_keys_from_env(const char *what, tw_auth_keys_t *keys);

/** Put the key set into this process's environment as TWAIN_KEYS (children
 *  started afterwards inherit it). Errors: TW_ERR_INTERNAL (setenv). */
TW_NODISCARD tw_status_t tw_auth_keys_export(const tw_auth_keys_t *keys, const char *env_name);

/** Make `sock` a CURVE server with ZAP domain "twain" (call before bind;
 *  a tw_auth_guard with the ZAP handler must run on its context). A no-op
 *  for plaintext keys. Errors: TW_ERR_TRANSPORT (setsockopt). */
TW_NODISCARD tw_status_t tw_auth_server(void *sock, const tw_auth_keys_t *keys);

/** Make `sock` a CURVE client of the key set's server (before connect).
 *  A no-op for plaintext keys. Errors: TW_ERR_TRANSPORT (setsockopt). */
TW_NODISCARD tw_status_t tw_auth_client(void *sock, const tw_auth_keys_t *keys);

/** The keys of the router's client socket: the server pair of the key set
 *  in `maybe_file` (--client-keys), else $TWAIN_CLIENT_KEYS (its text), else
 *  $TWAIN_CLIENT_KEYS_FILE; with none, keys->plaintext (logged as a warning:
 *  requests and answers cross the network unencrypted). `what` names the
 *  socket in messages. Errors: those of tw_auth_keys_parse_need and
 *  tw_auth_keys_load_file_need. */
TW_NODISCARD tw_status_t tw_auth_socket_keys(const char *what, const char *maybe_file,
                                             tw_auth_keys_t *keys);

/** The keys of a client of the router's client socket (twain chat, generate,
 *  bench). `maybe_server_key`: the router's public key, 40 Z85 characters or
 *  the path of a key file with a server-public line (NULL or "":
 *  $TWAIN_SERVER_KEY; none at all: keys->plaintext, no CURVE).
 *  `maybe_identity`: a key file with this client's client-public and
 *  client-secret (NULL or "": $TWAIN_IDENTITY_FILE; none: a fresh pair for
 *  this process, fine when the router has no allow-list). Errors:
 *  TW_ERR_INVALID_ARGUMENT (a malformed key, an identity without a server
 *  key), those of tw_auth_keys_load_file_need and tw_auth_keys_generate. */
TW_NODISCARD tw_status_t tw_auth_client_keys(const char *maybe_server_key,
                                             const char *maybe_identity, tw_auth_keys_t *keys);

/** Open a DEALER client socket on `ctx`, connect it to `endpoint` (a CURVE
 *  client of `keys` unless they are plaintext) and wait at most timeout_ms
 *  for the ZeroMQ handshake to finish. The socket: linger 0, ZMQ_IMMEDIATE,
 *  ZMQ_SNDTIMEO timeout_ms, send/receive high-water marks `hwm` (0: libzmq's),
 *  twain's message size limit. Errors (nothing opened): TW_ERR_UNAVAILABLE (no
 *  connection within timeout_ms: nothing listens at endpoint), TW_ERR_FORMAT
 *  (a malformed endpoint), TW_ERR_INVALID_ARGUMENT (the server ended the
 *  handshake: it requires CURVE and we have no server key, the server key is
 *  wrong, our key is not on its allow-list, or we speak CURVE to a plaintext
 *  socket: the message says which it can tell), TW_ERR_TRANSPORT (socket,
 *  monitor). */
TW_NODISCARD tw_status_t tw_auth_client_open(void *ctx, const char *endpoint,
                                             const tw_auth_keys_t *keys, int timeout_ms, int hwm,
                                             void **sock_p);

/** Whether `keys` pass the handshake of the server at `endpoint`, as
 *  tw_auth_client_open (the socket closed after it), except that a refused
 *  connection fails at once: TW_ERR_UNAVAILABLE, "nothing listens at
 *  ENDPOINT" (where nothing answers at all, as there: "no answer from
 *  ENDPOINT within timeout_ms"). A completed
 *  handshake leaves no failure in the server's log, as a bare TCP connect
 *  that closes would ("handshake ... failed": a server cannot tell it from a
 *  peer without keys). Other errors as tw_auth_client_open's. */
TW_NODISCARD tw_status_t tw_auth_client_probe(void *ctx, const char *endpoint,
                                              const tw_auth_keys_t *keys, int timeout_ms);

/** A watch on the connection of a client socket of tw_auth_client_open (in
 *  context `ctx`): a PAIR socket to poll (ZMQ_POLLIN) beside `sock`, readable
 *  when libzmq reports the connection closed (ZMQ_EVENT_DISCONNECTED: the
 *  router stopped or crashed; the router's replies follow a connection, so
 *  what was in flight on it is lost even if the socket connects again).
 *  NULL when the watch cannot be set up (nothing to poll: the caller's
 *  timeouts still bound its waits). Stop it with tw_auth_client_unwatch. */
void *tw_auth_client_watch(void *ctx, void *sock);

/** Whether the watch saw the connection close (reads every event waiting on
 *  it; false for a NULL watch). */
bool tw_auth_client_lost(void *watch);

/** Stops the watch of `sock` and closes it (NULL: nothing). */
void tw_auth_client_unwatch(void *sock, void *watch);

/** The ZAP handler of a ZeroMQ context plus a watcher of handshake failures:
 *  one thread that answers ZAP requests (accepts CURVE with the key set's
 *  client key, refuses every other key and mechanism) and logs each refused
 *  peer with its address (rate-limited, a warning). */
typedef struct tw_auth_guard tw_auth_guard_t;

/** Start the guard on `zctx` for `what` (log subsystem text). `serve_zap`:
 *  bind the context's ZAP endpoint (servers; false for a context with only
 *  clients, whose guard only watches). Errors: TW_ERR_TRANSPORT (the ZAP
 *  endpoint is taken), TW_ERR_INTERNAL (thread), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_auth_guard_start(void *zctx, const tw_auth_keys_t *keys,
                                             const char *what, bool serve_zap,
                                             tw_auth_guard_t **guard_p);

/** Start a guard on `zctx` for the router's client socket (a context of its
 *  own: one ZAP handler per context): CURVE clients with any key are
 *  admitted, or, with `maybe_allow_file`, only those whose public key it
 *  lists (one Z85 key per line, or "client-public = KEY" lines; text after
 *  the key and lines starting with '#' are ignored; a regular file of at most
 *  TW_AUTH_MAX_ALLOW_FILE bytes). Each refused client is logged with its
 *  address and key. Errors: TW_ERR_INVALID_ARGUMENT (a malformed or empty
 *  list, naming the line), TW_ERR_IO (cannot read it), those of
 *  tw_auth_guard_start. */
TW_NODISCARD tw_status_t tw_auth_guard_start_clients(void *zctx, const tw_auth_keys_t *keys,
                                                     const char *what, const char *maybe_allow_file,
                                                     tw_auth_guard_t **guard_p);

/** Watch `sock` (any thread may call; before or after its bind/connect):
 *  handshake failures on it are logged as refused peers (a server) or as a
 *  server that refused us (a client: wrong keys). `label` names the socket
 *  in those lines. Errors: TW_ERR_TRANSPORT (zmq_socket_monitor),
 *  TW_ERR_INVALID_ARGUMENT (more than 8 sockets). */
TW_NODISCARD tw_status_t tw_auth_guard_watch(tw_auth_guard_t *guard, void *sock, const char *label);

/** Peers refused so far (ZAP denials + failed handshakes seen). */
uint64_t tw_auth_guard_refused(const tw_auth_guard_t *guard);

/** Stop the thread and close its sockets (before zmq_ctx_term of its
 *  context, and after the watched sockets are closed or no longer needed).
 *  NULL-safe. */
void tw_auth_guard_stop(tw_auth_guard_t *guard);

#ifdef __cplusplus
}
#endif
#endif
