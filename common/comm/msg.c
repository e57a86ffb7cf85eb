/* msg.c: ZeroMQ framing of protobuf messages (see msg.h). */
#include "common/comm/msg.h"

#include "common/base/log.h"
#include "common/comm/link_auth.h"
#include "common/text/tokenizer.h"
#include "proto/twain_api.pb-c.h"

#include <zmq.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int64_t tw_msg_clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

bool tw_msg_tcp_host_port(const char *endpoint, char *host, size_t cap, const char **port_p) {
  if (strncmp(endpoint, "tcp://", 6) != 0) return false;
  const char *h = strchr(endpoint + 6, ';'); /* ZeroMQ's "tcp://SOURCE;HOST:PORT" */
  h = h ? h + 1 : endpoint + 6;
  const char *colon = strrchr(h, ':');
  if (!colon || colon == h || !colon[1]) return false;
  size_t hl = (size_t)(colon - h);
  if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2; /* [v6] */
  if (hl == 0 || hl >= cap) return false;
  memcpy(host, h, hl);
  host[hl] = '\0';
  *port_p = colon + 1;
  return true;
}

void tw_msg_fini(tw_msg_t *msg) {
  if (!msg) return;
  free(msg->data);
  msg->data = NULL;
  msg->len = 0;
}

/* Discard the remaining frames of a multipart message. */
static void tw_msg_drain(void *sock) {
  int more = 1;
  size_t sz = sizeof more;
  for (int guard = 0; guard < 1 << 20; guard++) {
    if (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) != 0 || !more) return;
    zmq_msg_t f;
    zmq_msg_init(&f);
    int rc = zmq_msg_recv(&f, sock, 0);
    zmq_msg_close(&f);
    if (rc < 0) return;
  }
}

TW_NODISCARD tw_status_t tw_msg_recv(void *sock, bool has_identity, int timeout_ms, tw_msg_t *out) {
  if (timeout_ms != 0) {
    zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc < 0) {
      if (errno == EINTR) return TW_INPROGRESS;
      return tw_err(TW_ERR_TRANSPORT, "zmq_poll failed: %s", zmq_strerror(errno));
    }
    if (rc == 0) return TW_INPROGRESS;
  }
  zmq_msg_t frames[TW_MSG_MAX_FRAMES];
  int n = 0;
  bool too_many = false;
  for (;;) {
    if (n == TW_MSG_MAX_FRAMES) {
      too_many = true;
      tw_msg_drain(sock);
      break;
    }
    zmq_msg_init(&frames[n]);
    int rc = zmq_msg_recv(&frames[n], sock, n == 0 ? ZMQ_DONTWAIT : 0);
    if (rc < 0) {
      int e = errno;
      zmq_msg_close(&frames[n]);
      for (int i = 0; i < n; i++) zmq_msg_close(&frames[i]);
      if (e == EAGAIN || e == EINTR) return TW_INPROGRESS;
      return tw_err(TW_ERR_TRANSPORT, "zmq_msg_recv failed: %s", zmq_strerror(e));
    }
    n++;
    if (!zmq_msg_more(&frames[n - 1])) break;
  }
  tw_msg_t m = {0};
  tw_status_t st = TW_OK;
  int first = 0;
  if (has_identity) {
    size_t l = zmq_msg_size(&frames[0]);
    if (l > TW_MSG_MAX_ID) l = TW_MSG_MAX_ID;
    memcpy(m.id, zmq_msg_data(&frames[0]), l);
    m.id_len = l;
    first = 1;
    if (n > 2 && zmq_msg_size(&frames[1]) == 0) {
      m.delim = true;
      first = 2;
    }
  }
  if (too_many || n - first != 1) {
    st = tw_err_quiet(TW_ERR_FORMAT, "expected %s one payload frame, got %s%d frames",
                      has_identity ? "identity, optional delimiter and" : "", too_many ? "over " : "",
                      n);
  } else {
    size_t l = zmq_msg_size(&frames[first]);
    if (l > TW_MSG_MAX_BYTES) {
      st = tw_err_quiet(TW_ERR_FORMAT, "message of %zu bytes is over the limit of %u", l,
                        TW_MSG_MAX_BYTES);
    } else {
      m.data = malloc(l ? l : 1);
      if (!m.data) {
        st = tw_err(TW_ERR_NO_MEMORY, "cannot allocate %zu bytes for a message", l);
      } else {
        memcpy(m.data, zmq_msg_data(&frames[first]), l);
        m.len = l;
      }
    }
  }
  for (int i = 0; i < n; i++) zmq_msg_close(&frames[i]);
  *out = m; /* on FORMAT errors the identity is still useful for a reply */
  return st;
}

TW_NODISCARD tw_status_t tw_msg_send_to(void *sock, const void *id, size_t id_len, bool delim,
                                        const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  zmq_msg_t body;
  if (zmq_msg_init_size(&body, len ? len : 0) != 0)
    return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a %zu-byte message", len);
  if (len) protobuf_c_message_pack(msg, zmq_msg_data(&body));
  if (id_len) {
    if (zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) goto fail;
    if (delim && zmq_send(sock, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) goto fail;
  }
  if (zmq_msg_send(&body, sock, ZMQ_DONTWAIT) < 0) goto fail;
  return TW_OK;
fail: {
  int e = errno;
  zmq_msg_close(&body);
  if (e == EHOSTUNREACH || e == EAGAIN)
    return tw_err_quiet(TW_ERR_UNAVAILABLE, "peer unreachable or its queue is full: %s",
                        zmq_strerror(e));
  return tw_err(TW_ERR_TRANSPORT, "zmq send failed: %s", zmq_strerror(e));
}
}

TW_NODISCARD tw_status_t tw_msg_send(void *sock, const tw_msg_t *maybe_to,
                                     const ProtobufCMessage *msg) {
  if (maybe_to) return tw_msg_send_to(sock, maybe_to->id, maybe_to->id_len, maybe_to->delim, msg);
  return tw_msg_send_to(sock, NULL, 0, false, msg);
}

static bool tw_pb_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    uint8_t b = *(*p)++;
    x |= (uint64_t)(b & 0x7F) << shift;
    if (!(b & 0x80)) {
      *v = x;
      return true;
    }
  }
  return false;
}

static TW_NODISCARD tw_status_t tw_pb_check(const ProtobufCMessageDescriptor *d, const uint8_t *p,
                                            const uint8_t *end, int depth, char *path,
                                            size_t path_len) {
  if (depth > 32) return tw_err_quiet(TW_ERR_FORMAT, "message nested deeper than 32 levels");
  while (p < end) {
    uint64_t key, n;
    if (!tw_pb_varint(&p, end, &key)) return TW_OK; /* unpack accepted it; nothing to add */
    switch (key & 7) {
      case 0: if (!tw_pb_varint(&p, end, &n)) return TW_OK; continue;
      case 1: p += 8; continue;
      case 5: p += 4; continue;
      case 2: break;
      default: return TW_OK;
    }
    if (!tw_pb_varint(&p, end, &n) || n > (uint64_t)(end - p)) return TW_OK;
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
    size_t pl = strlen(path);
    if (f && (f->type == PROTOBUF_C_TYPE_STRING || f->type == PROTOBUF_C_TYPE_MESSAGE))
      snprintf(path + pl, path_len - pl, "%s%s", pl ? "." : "", f->name);
    if (f && f->type == PROTOBUF_C_TYPE_STRING) {
      const void *nul = memchr(p, 0, (size_t)n);
      size_t bad = 0;
      if (nul)
        return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s contains a NUL byte at offset %zu", path,
                            (size_t)((const uint8_t *)nul - p));
      if (!tw_utf8_valid((const char *)p, (size_t)n, &bad))
        return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s is not valid UTF-8 at offset %zu", path, bad);
    } else if (f && f->type == PROTOBUF_C_TYPE_MESSAGE) {
      TW_CHECK(tw_pb_check(f->descriptor, p, p + n, depth + 1, path, path_len));
    }
    path[pl] = '\0';
    p += n;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_msg_check_strings(const ProtobufCMessageDescriptor *desc,
                                              const uint8_t *data, size_t len) {
  char path[256] = "";
  return tw_pb_check(desc, data, data + len, 0, path, sizeof path);
}

bool tw_msg_ratelimit(tw_msg_ratelimit_t *rl, uint64_t *suppressed_p) {
  int64_t now = tw_msg_clock_ns();
  if (now - rl->window_start_ns >= 1000000000LL) {
    rl->window_start_ns = now;
    rl->n_in_window = 0;
  }
  if (rl->n_in_window >= TW_MSG_WARN_PER_S) {
    rl->suppressed++;
    return false;
  }
  rl->n_in_window++;
  *suppressed_p = rl->suppressed;
  rl->suppressed = 0;
  return true;
}

void tw_msg_limit_size(void *sock) {
  int64_t max = TW_MSG_MAX_BYTES;
  zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &max, sizeof max);
}

TW_NODISCARD tw_status_t tw_msg_socket_open(void *ctx, int type, const char *endpoint, bool bind,
                                            char *maybe_bound, size_t bound_len, void **sock_p) {
  return tw_msg_socket_open_auth(ctx, type, endpoint, bind, NULL, maybe_bound, bound_len, sock_p);
}

TW_NODISCARD tw_status_t tw_msg_socket_open_auth(void *ctx, int type, const char *endpoint,
                                                 bool bind, const tw_auth_keys_t *maybe_keys,
                                                 char *maybe_bound, size_t bound_len,
                                                 void **sock_p) {
  void *s = zmq_socket(ctx, type);
  if (!s) return tw_err(TW_ERR_TRANSPORT, "zmq_socket failed: %s", zmq_strerror(errno));
  int zero = 0, one = 1, hwm = 100000;
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
  if (type == ZMQ_ROUTER) zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
  tw_msg_limit_size(s);
  if (maybe_keys) {
    tw_status_t as = bind ? tw_auth_server(s, maybe_keys) : tw_auth_client(s, maybe_keys);
    if (as != TW_OK) {
      zmq_close(s);
      return as;
    }
  }
  char ep[256];
  snprintf(ep, sizeof ep, "%s", endpoint);
  size_t el = strlen(ep);
  if (bind && el > 2 && strcmp(ep + el - 2, ":0") == 0) snprintf(ep + el - 1, sizeof ep - el + 1, "*");
  int rc = bind ? zmq_bind(s, ep) : zmq_connect(s, ep);
  if (rc != 0) {
    int e = errno;
    zmq_close(s);
    return tw_err(TW_ERR_TRANSPORT, "cannot %s %s: %s", bind ? "bind" : "connect", endpoint,
                  zmq_strerror(e));
  }
  if (maybe_bound && bound_len) {
    size_t l = bound_len;
    if (bind && zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, maybe_bound, &l) == 0) {
    } else {
      snprintf(maybe_bound, bound_len, "%s", endpoint);
    }
  }
  *sock_p = s;
  return TW_OK;
}

tw_status_t tw_msg_note_failure(tw_status_t st, const char *who, const char *what) {
  static _Thread_local tw_msg_ratelimit_t rl;
  uint64_t sup = 0;
  if (st < 0 && tw_msg_ratelimit(&rl, &sup))
    TW_WARN(who, "%s: %s (%llu like it suppressed)", what, tw_last_error(),
            (unsigned long long)sup);
  return st;
}

int tw_status_wire_code(tw_status_t st) {
  switch (st) {
    case TW_OK: case TW_INPROGRESS: return TWAIN__V1__CODE__OK;
    case TW_ERR_INVALID_ARGUMENT: case TW_ERR_FORMAT: case TW_ERR_OUT_OF_RANGE:
      return TWAIN__V1__CODE__INVALID_ARGUMENT;
    case TW_ERR_NOT_FOUND: return TWAIN__V1__CODE__NOT_FOUND;
    case TW_ERR_UNSUPPORTED: return TWAIN__V1__CODE__UNIMPLEMENTED;
    case TW_ERR_CANCELLED: return TWAIN__V1__CODE__CANCELLED;
    case TW_ERR_DEADLINE: return TWAIN__V1__CODE__DEADLINE_EXCEEDED;
    case TW_ERR_NO_MEMORY: case TW_ERR_EXHAUSTED: return TWAIN__V1__CODE__RESOURCE_EXHAUSTED;
    case TW_ERR_UNAVAILABLE: case TW_ERR_TRANSPORT: return TWAIN__V1__CODE__UNAVAILABLE;
    case TW_ERR_IO: case TW_ERR_CUDA: case TW_ERR_NCCL: case TW_ERR_INTERNAL: break;
  }
  return TWAIN__V1__CODE__INTERNAL;
}
