/* kv_transfer.c: UCX one-sided KV handoff (see kv_transfer.h). */
#include "common/kv/kv_transfer.h"

#include "common/kv/kv_fp8.h"
#include "common/kv/kv_ring.h"
#include "common/kv/kv_seal.h"
#include "common/kv/ucx_log.h"

#include "common/base/log.h"
#include "common/base/proc.h"
#include "common/comm/msg.h"

#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TW_KV_XFER_MAGIC 0x7478666bu /* "kfxt" */
#define TW_KV_MAX_PEERS 64
#define TW_KV_MAX_RX_REGIONS 16
#define TW_KV_BOUNCE_BYTES (4u << 20)

/* ---- CUDA runtime through dlopen (staging, device checksums) ---- */
typedef int (*tw_cuda_memcpy_fn)(void *, const void *, size_t, int);
typedef int (*tw_cuda_memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef int (*tw_cuda_host_alloc_fn)(void **, size_t, unsigned);
typedef int (*tw_cuda_free_host_fn)(void *);
typedef int (*tw_cuda_host_register_fn)(void *, size_t, unsigned);
typedef int (*tw_cuda_stream_create_fn)(void **, unsigned);
typedef int (*tw_cuda_ptr_fn)(void *);
typedef int (*tw_cuda_event_create_fn)(void **, unsigned);
typedef int (*tw_cuda_event_record_fn)(void *, void *);
/* cudaIpcMemHandle_t: 64 opaque bytes, passed by value */
typedef struct {
  char reserved[64];
} tw_cuda_ipc_handle_t;
typedef int (*tw_cuda_ipc_get_fn)(tw_cuda_ipc_handle_t *, void *);
typedef int (*tw_cuda_ipc_open_fn)(void **, tw_cuda_ipc_handle_t, unsigned);
typedef int (*tw_cuda_get_device_fn)(int *);
typedef struct {
  void *lib;
  tw_cuda_memcpy_fn memcpy_;
  tw_cuda_memcpy_async_fn memcpy_async;
  tw_cuda_host_alloc_fn host_alloc;
  tw_cuda_free_host_fn free_host;
  tw_cuda_host_register_fn host_register;   /* cudaHostRegister (optional) */
  tw_cuda_ptr_fn host_unregister;           /* cudaHostUnregister (optional) */
  tw_cuda_stream_create_fn stream_create;   /* cudaStreamCreateWithFlags */
  tw_cuda_ptr_fn stream_destroy;
  tw_cuda_event_create_fn event_create;     /* cudaEventCreateWithFlags */
  tw_cuda_event_record_fn event_record;
  tw_cuda_ptr_fn event_sync;                /* cudaEventSynchronize */
  tw_cuda_ptr_fn event_query;               /* cudaEventQuery */
  tw_cuda_ptr_fn event_destroy;
  tw_cuda_ptr_fn free_;                     /* cudaFree(NULL): binds the primary context */
  /* CUDA IPC (the direct path); NULL when the runtime lacks them */
  tw_cuda_ipc_get_fn ipc_get;       /* cudaIpcGetMemHandle */
  tw_cuda_ipc_open_fn ipc_open;     /* cudaIpcOpenMemHandle */
  tw_cuda_ptr_fn ipc_close;         /* cudaIpcCloseMemHandle */
  tw_cuda_get_device_fn get_device; /* cudaGetDevice */
} tw_cudart_t;
enum { TW_CUDA_H2D = 1, TW_CUDA_D2H = 2, TW_CUDA_DEFAULT = 4 };
enum { TW_CUDA_IPC_LAZY_PEER = 1 }; /* cudaIpcMemLazyEnablePeerAccess */
enum { TW_CUDA_STREAM_NON_BLOCKING = 1, TW_CUDA_EVENT_DISABLE_TIMING = 2 };
enum { TW_CUDA_NOT_READY = 600 }; /* cudaErrorNotReady */

/* ---- the direct path over CUDA IPC ----
 * UCX 1.13's RMA puts never reach CUDA memory over cuda_ipc: its put
 * protocols use RMA lanes only and cuda_ipc is an rma_bw lane (it serves the
 * rendezvous protocols), so a put into a CUDA region is emulated over active
 * messages (docs/operations.md "UCX's own CUDA transports"; UCX 1.14 and
 * later put over rma_bw lanes, cuda_ipc included). So a decode worker
 * whose pool is device memory also exports the pool with
 * cudaIpcGetMemHandle and appends this descriptor to the rkey blob it
 * publishes; a prefill worker on the same host (same boot id) whose pool is
 * device memory opens it once per decode worker (cudaIpcOpenMemHandle, peer
 * access enabled lazily across GPUs) and copies each run of blocks device to
 * device with cudaMemcpyAsync on its own stream; the flush waits for the
 * copies. A descriptor that cannot be opened (another host, another IPC
 * namespace, no peer access) falls back to the UCX paths, logged once. The
 * decode worker learns from PrefillDone.kv_in_place that nothing is left to
 * commit from its host mirror. */
#define TW_KV_IPC_MAGIC "TWKVIPC1"
typedef struct {
  char boot_id[40];            /* /proc/sys/kernel/random/boot_id of the owner's host */
  int32_t pid;                 /* the owner's process (a process cannot open its own) */
  int32_t device;              /* the owner's CUDA device ordinal */
  tw_cuda_ipc_handle_t handle; /* of the pool's allocation (its base) */
  int64_t pool_bytes;
  uint32_t ucx_rkey_len; /* the bytes before this descriptor */
  uint32_t desc_bytes;   /* sizeof(tw_kv_ipc_desc_t) */
  char magic[8];         /* TW_KV_IPC_MAGIC, last: found from the blob's end */
} tw_kv_ipc_desc_t;

static TW_NODISCARD tw_status_t tw_cudart_load(tw_cudart_t *rt) {
  if (rt->lib) return TW_OK;
  /* the runtime the engine already uses first (same instance, same device
   * and context), then any */
  const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  const int n_names = (int)(sizeof names / sizeof names[0]);
  for (int i = 0; i < n_names && !rt->lib; i++)
    rt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  for (int i = 0; i < n_names && !rt->lib; i++)
    rt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!rt->lib)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "device KV pool needs staging but libcudart cannot be loaded: %s", dlerror());
  rt->memcpy_ = (tw_cuda_memcpy_fn)dlsym(rt->lib, "cudaMemcpy");
  rt->memcpy_async = (tw_cuda_memcpy_async_fn)dlsym(rt->lib, "cudaMemcpyAsync");
  rt->host_alloc = (tw_cuda_host_alloc_fn)dlsym(rt->lib, "cudaHostAlloc");
  rt->free_host = (tw_cuda_free_host_fn)dlsym(rt->lib, "cudaFreeHost");
  rt->host_register = (tw_cuda_host_register_fn)dlsym(rt->lib, "cudaHostRegister");
  rt->host_unregister = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaHostUnregister");
  rt->stream_create = (tw_cuda_stream_create_fn)dlsym(rt->lib, "cudaStreamCreateWithFlags");
  rt->stream_destroy = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaStreamDestroy");
  rt->event_create = (tw_cuda_event_create_fn)dlsym(rt->lib, "cudaEventCreateWithFlags");
  rt->event_record = (tw_cuda_event_record_fn)dlsym(rt->lib, "cudaEventRecord");
  rt->event_sync = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventSynchronize");
  rt->event_query = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventQuery");
  rt->event_destroy = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventDestroy");
  rt->free_ = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaFree");
  rt->ipc_get = (tw_cuda_ipc_get_fn)dlsym(rt->lib, "cudaIpcGetMemHandle");
  rt->ipc_open = (tw_cuda_ipc_open_fn)dlsym(rt->lib, "cudaIpcOpenMemHandle");
  rt->ipc_close = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaIpcCloseMemHandle");
  rt->get_device = (tw_cuda_get_device_fn)dlsym(rt->lib, "cudaGetDevice");
  if (!rt->memcpy_ || !rt->memcpy_async || !rt->host_alloc || !rt->free_host ||
      !rt->stream_create || !rt->stream_destroy || !rt->event_create || !rt->event_record ||
      !rt->event_sync || !rt->event_query || !rt->event_destroy || !rt->free_) {
    dlclose(rt->lib);
    *rt = (tw_cudart_t){0};
    return tw_err(TW_ERR_UNSUPPORTED, "libcudart lacks the copy, stream or event entry points");
  }
  return TW_OK;
}

/* ---- pieces into a staged receiver's ring (kv_transfer.h) ----
 * Receiver-granted puts, three small eager active messages per piece:
 *  1. "want" (sender -> receiver): this header, then the sender's worker
 *     address as data; the piece waits in the receiver's queue;
 *  2. "grant" (receiver -> sender, over the receiver's own endpoint to the
 *     sender): slot k of the receiver's ring is the piece's;
 *  3. the sender puts the piece into slot k (the ring is allocated by UCX,
 *     ucp_mem_map ALLOCATE: shared memory on one host, so the put is one
 *     memcpy into the receiver's slot, or RDMA across hosts), flushes, and
 *     sends "filled": the receiver copies the slot to the pool on its own
 *     stream and frees it.
 * The receiver never waits on UCX for a sender: it issues no rendezvous and
 * no get, so a sender killed at any point leaves only slots granted to it,
 * which the receiver takes back once it knows the sender is gone (on one
 * host: its pid, checked every 20 ms; elsewhere: no "filled" within
 * TW_KV_GRANT_TIMEOUT_MS, longer than any sender waits for a grant, so a
 * late put cannot land in a slot given to another piece). UCX 1.13's AM
 * rendezvous, used before, could abort the receiver (an assertion in
 * ucp_am_rndv_process_rts) when a sender was killed mid-handoff.
 *
 * Over TCP (UCX 1.13, worker-address wireup) two more UCX paths abort a
 * receiver whose sender dies, and the protocol keeps the receiver off both:
 *  - connection setup: when the sender's first message arrives, the
 *    receiver's UCX answers its wireup request (WIREUP_MSG REPLY) over a TCP
 *    connection back to the sender, queued until the sender's UCX
 *    acknowledges that connection; a sender that dies before that makes UCX
 *    fail the connection and purge the queued reply, and Debian's build
 *    (assertions on) aborts in ucp_request_send_state_ff ("got REP
 *    message"; the assertion was removed upstream in UCX 1.14). So a sender
 *    greets a receiver once per endpoint before its first piece ("hello",
 *    answered on the reply endpoint, behind UCX's own reply): once the
 *    answer is back the receiver has no wireup message queued towards it,
 *    and the window is limited to the greeting itself (see
 *    docs/operations.md, "KV handoff and a dying prefill worker");
 *  - software-emulated puts: TCP has no put of its own in UCX 1.13
 *    (protocols v1), so a put is sent as active messages and the
 *    receiver's UCX acknowledges each one (UCP_AM_ID_CMPL); one that
 *    arrives after the connection back failed makes that acknowledgement
 *    fail, and UCX treats that as fatal (ucs_fatal "unexpected error" in
 *    ucp_request_try_send, in every build). So where the sender's endpoint
 *    has no lane that puts (tw_kv_ep_lanes) and the slot is not mapped, the
 *    piece's bytes travel inside its "filled" message (eager, no answer
 *    from UCX), copied into the slot by the receiver's callback. */
#define TW_KV_AM_WANT_ID 0x4b57u
#define TW_KV_AM_GRANT_ID 0x4b58u
#define TW_KV_AM_FILLED_ID 0x4b59u
#define TW_KV_AM_HELLO_ID 0x4b5au     /* sender -> receiver: token (uint64_t) */
/* receiver -> sender, on the reply endpoint: the token as header, the
 * receiving process as data (tw_kv_am_hello_ack_t; a sender that knows
 * only the token ignores the data) */
#define TW_KV_AM_HELLO_ACK_ID 0x4b5bu
#define TW_KV_HELLO_TIMEOUT_MS 10000
#define TW_KV_GRANT_TIMEOUT_MS 120000
typedef struct {
  uint64_t base;     /* the receiving pool's published remote_base (which region) */
  uint64_t offset;   /* destination offset in that pool */
  uint64_t len;      /* bytes of the piece */
  uint64_t tag;      /* the handoff (request id) */
  uint64_t piece;    /* the sender's id of the piece */
  uint32_t addr_len; /* the data: the sender's worker address, sealed (kv_seal.h) */
  uint32_t pad;
  tw_proc_t proc; /* the sending process */
} tw_kv_am_hdr_t;
typedef struct {
  uint64_t piece;
  uint64_t slot_addr; /* where to put it (in the ring the receiver's rkey maps) */
  int32_t slot;
  int32_t status; /* UCS_OK: granted; else why the receiver refused the piece */
} tw_kv_am_grant_t;
/* The answer to a greeting: its token and the receiving process, so that a
 * sender on the same host can tell at once that its receiver died (its pid)
 * instead of waiting out a timeout. */
typedef struct {
  uint64_t token;
  tw_proc_t proc;
} tw_kv_am_hello_ack_t;
typedef struct {
  uint64_t base;
  uint64_t piece;
  uint64_t nonce; /* the sender's tw_proc_t.nonce */
  int32_t slot;
  int32_t pad;
} tw_kv_am_filled_t;
/* ---- connecting through a listener over TCP ----
 * Worker-address wireup over TCP leaves a window in which a peer dying
 * aborts this process (the wireup reply above, queued on a TCP connection
 * that UCX then fails); UCX's client-server wireup through a listener
 * (ucp_listener, an endpoint made from a socket address) keeps its wireup
 * messages on proxy endpoints that are purged without that check, and a
 * peer killed at any point of it leaves the other side serving (measured,
 * docs/operations.md). It selects lanes on the listener's device only, so
 * it is used where nothing is lost by that: when this worker's transports
 * are TCP alone (UCX_TLS=tcp, tcp,cuda_copy...). Such a worker listens on
 * the address of its first TCP device (a non-loopback one when there is
 * one) and appends this descriptor to the worker address it publishes; a
 * sender whose transports are TCP alone connects to it through the
 * listener, any other sender uses the worker address before it. */
#define TW_KV_LSN_MAGIC "TWKVLSN1"
typedef struct {
  uint8_t ip[16];   /* IPv4 (first 4 bytes) or IPv6, network order */
  uint16_t family;  /* AF_INET or AF_INET6 */
  uint16_t port;    /* host order */
  uint32_t ucx_len; /* the UCX worker address before this descriptor */
  char magic[8];    /* TW_KV_LSN_MAGIC, last: found from the blob's end */
} tw_kv_lsn_desc_t;
#define TW_KV_MAX_ACCEPTED 256 /* endpoints made from connection requests */

/* Pieces a sender has in flight at once (over every receiver). */
#define TW_KV_PIECES 512
#define TW_KV_MAX_SLOTS 1024 /* TWAIN_KV_STAGING_SLOTS' limit (kv_rxring.h) */
typedef enum {
  TW_PIECE_WANT = 0,    /* "want" sent, waiting for a grant */
  TW_PIECE_GRANTED = 1, /* slot known: to put */
  TW_PIECE_PUTTING = 2, /* put issued, its flush in flight */
  TW_PIECE_FILLED = 3,  /* "filled" sent (until its send completes) */
  TW_PIECE_COPYING = 4, /* device source: copying into the slot, mapped here */
  TW_PIECE_REFUSED = -1,
} tw_kv_piece_state_t;
typedef struct {
  uint64_t id;        /* 0: free; else seq * TW_KV_PIECES + index */
  tw_kv_peer_t *peer; /* the receiver */
  void *req;          /* the message in flight ("want", then "filled") */
  void *flush;        /* the put's flush */
  tw_kv_piece_state_t state;
  int32_t slot;
  uint64_t slot_addr;
  const void *buf;
  int64_t len;
  int64_t slot_bytes; /* the receiver's slot size */
  bool device;        /* buf is device memory: copied straight into the mapped slot */
  int16_t pos;        /* its place in the xfer's active list */
  tw_kv_am_hdr_t hdr;
  tw_kv_am_filled_t fill;
} tw_kv_piece_t;

/* ---- the sender's bounded ring of bounce buffers ----
 * Used for device sources that cannot be put directly (staged path: the
 * copies run on the ring's own stream, chunk k+1..k+R-1 copying while chunk
 * k is put) and to gather scattered local pieces (re-sharding) into one
 * contiguous put. A slot is reused only once its put completed locally. */
#define TW_KV_RING_SLOTS 4
#define TW_KV_RING_SLOT_BYTES ((int64_t)8 << 20)
typedef struct {
  uint8_t *mem;        /* TW_KV_RING_SLOTS x TW_KV_RING_SLOT_BYTES */
  bool pinned;         /* cudaHostAlloc (device sources) or malloc */
  ucp_mem_h memh;
  void *stream;        /* cudaStream_t of the device-to-host copies */
  void *req[TW_KV_RING_SLOTS];    /* in-flight put from the slot */
  void *event[TW_KV_RING_SLOTS];  /* cudaEvent_t: the copy into the slot is done */
  uint64_t piece[TW_KV_RING_SLOTS]; /* the piece put from the slot (tw_kv_piece_t.id) */
  uint32_t next;       /* next slot to fill */
} tw_kv_ring_t;

struct tw_kv_peer {
  struct tw_kv_peer *grave_next; /* closed, kept until the worker is destroyed (tw_kv_peer_close) */
  uint8_t *address;
  size_t address_len;
  uint8_t *rkey_buf;
  size_t rkey_len;
  ucp_ep_h ep;
  ucp_rkey_h rkey;
  int failed;
  bool cuda_ipc;        /* puts reach CUDA memory: a cuda_ipc lane, protocols v2 */
  bool put_am_emulated; /* ... but emulated over active messages (UCX < 1.14) */
  /* the direct path: the decode worker's device pool mapped here over CUDA
   * IPC (tw_kv_ipc_desc_t in its rkey blob), copied into device to device */
  bool has_ipc; /* the rkey blob carries a descriptor for this host */
  tw_kv_ipc_desc_t ipc;
  void *ipc_ptr;          /* cudaIpcOpenMemHandle of ipc.handle, or NULL */
  bool ipc_failed;        /* opening it failed once: UCX paths from then on */
  bool ipc_pending;       /* copies enqueued since the last flush */
  bool ipc_allowed;       /* the xfer's setting at the last tw_kv_xfer_peer */
  char lanes[160];        /* the endpoint's transports, for logs */
  unsigned logged_paths;  /* bit per tw_kv_path_t already logged */
  int64_t t_first_put_ns; /* 0 when nothing is in flight */
  int32_t n_pieces;       /* pieces sent to it not yet answered */
  int32_t refused;        /* the first refusal's ucs_status_t since the last flush */
  /* a staged receiver's ring mapped into this process (ucp_rkey_ptr: shared
   * memory on one host): 0 not known yet, 1 mapped (pieces are copied into
   * the slots, device sources by cudaMemcpyAsync straight from the pool),
   * -1 not (pieces are put) */
  int8_t slot_ptr;
  void **slot_reg; /* [TW_KV_MAX_SLOTS]: a slot's mapping, cudaHostRegister'd */
  bool am_pieces;  /* no lane puts (TCP): unmapped pieces travel in "filled" */
  bool via_listener; /* connected through the receiver's listener */
  bool greeted;      /* the receiver answered this endpoint's "hello" */
  uint64_t hello_token;
  /* the receiving process, from its answer to the greeting: when it is on
   * this host, waits for it check its pid (tw_kv_peer_gone) */
  tw_proc_t proc;
  bool local;
  int64_t checked_ns; /* its pid was last checked */
};

struct tw_kv_xfer {
  uint32_t magic;
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_address_t *address;
  size_t address_len;
  uint8_t *sealed_address; /* the address as published (kv_seal.h) */
  size_t sealed_address_len;
  bool cuda_native;
  bool proto_v2;      /* UCX protocols v2: puts may go over zero-copy rma_bw lanes */
  bool put_rma_bw;    /* UCX >= 1.14: v2 puts use rma_bw lanes (cuda_ipc), not RMA lanes alone */
  tw_kv_peer_t *peers[TW_KV_MAX_PEERS];
  int n_peers;
  tw_kv_peer_t *graves; /* closed peers (tw_kv_peer_close), freed after ucp_worker_destroy */
  tw_cudart_t cudart;
  tw_kv_ring_t ring;
  /* the local device pool registered as CUDA memory (direct puts) */
  void *src_base;
  int64_t src_bytes;
  ucp_mem_h src_memh;
  tw_kv_xfer_stats_t stats;
  /* regions that receive into a bounce ring (the active message handler's) */
  tw_kv_region_t *rx[TW_KV_MAX_RX_REGIONS];
  int n_rx;
  bool ipc_allowed; /* tw_kv_xfer_set_direct_ipc */
  void *ipc_stream; /* cudaStream_t of the direct-path copies */
  void *ipc_event;  /* recorded at a flush: the copies are done */
  /* sender of pieces to staged receivers */
  tw_kv_piece_t pieces[TW_KV_PIECES];
  uint64_t piece_seq;
  int32_t n_pieces;
  int16_t active[TW_KV_PIECES];    /* the entries in use, [0, n_pieces), any order */
  tw_proc_t self;                  /* this process, in the pieces it announces */
  void *d2h_stream;                /* cudaStream_t of device pieces copied into receivers' slots */
  bool staged_put;                 /* TWAIN_KV_STAGED_PUT=1: put pieces even into mapped slots */
  void *piece_event[TW_KV_PIECES]; /* cudaEvent_t per piece entry, made on first use */
  /* receiver: endpoints to the workers that send pieces into our rings */
  struct tw_kv_sender *senders[TW_KV_MAX_PEERS];
  int n_senders;
  uint64_t hello_seq; /* tokens of this sender's greetings */
  /* TCP alone: the listener senders connect through, and the blob
   * tw_kv_xfer_address publishes (the worker address, then a
   * tw_kv_lsn_desc_t) */
  bool tcp_only;
  /* the context's transports (tw_kv_ctx_transports), UCX_TLS as asked,
   * whether that is the operator's (else TW_KV_DEFAULT_TLS) */
  char tls[96];
  char fifo_tls[24]; /* those of them that are shared-memory FIFOs */
  char tls_asked[96];
  bool tls_operator;
  ucp_listener_h listener;
  uint8_t *published;
  size_t published_len;
  ucp_ep_h accepted[TW_KV_MAX_ACCEPTED]; /* made from connection requests */
  bool accepted_failed[TW_KV_MAX_ACCEPTED];
  int n_accepted;
};

/* A worker that sends pieces into this worker's rings: our endpoint to it
 * (grants). */
typedef struct tw_kv_sender {
  uint8_t *address;
  size_t address_len;
  ucp_ep_h ep;
  bool failed; /* gone: its granted slots were taken back, its pieces dropped */
  int64_t used_ns;
  tw_proc_t proc;
  bool local;         /* same host and pid namespace: its pid can be checked */
  int64_t checked_ns; /* its pid was last checked */
  bool accepted;      /* ep is one of x->accepted (not ours to close) */
} tw_kv_sender_t;

/* A piece that wants a slot, in arrival order: its header and the
 * sender's address (malloc; NULL once dropped). */
typedef struct {
  tw_kv_am_hdr_t h;
  uint8_t *addr;
  ucp_ep_h accepted; /* the endpoint it came on, when made from a connection request */
} tw_kv_rx_pending_t;

/* Who a slot is granted to: the sender, its piece, when; `filled` once its
 * "filled" message came, for the next pump to copy it out. */
typedef struct {
  tw_kv_region_t *r;
  int32_t slot;
  tw_kv_sender_t *sender; /* NULL: not granted */
  uint64_t piece, nonce;
  int64_t granted_ns;
  int64_t len; /* the piece's bytes */
  void *buf;   /* the slot */
  bool filled;
} tw_kv_rx_slot_ctx_t;

struct tw_kv_region {
  tw_kv_xfer_t *xfer;
  tw_kv_layout_t layout;
  void *registered; /* the pool itself (NULL when staged: nothing is registered) */
  bool staged;      /* receives into a bounce ring */
  ucp_mem_h memh;
  void *rkey; /* the packed ucx rkey, then a tw_kv_ipc_desc_t when exported */
  size_t rkey_len;
  uint8_t *sealed_rkey; /* rkey as published (kv_seal.h) */
  size_t sealed_rkey_len;
  /* staged: the ring, its pinned slots, the copies' stream and events */
  tw_kv_rxring_t *ring;
  uint8_t *slots;
  int32_t n_slots;
  int64_t slot_bytes;
  bool slots_pinned;
  ucp_mem_h slots_memh;
  void *stream;
  void **event;                  /* [n_slots] */
  tw_kv_rx_slot_ctx_t *slot_ctx; /* [n_slots] */
  tw_kv_rx_pending_t *pending;   /* FIFO: [head, head + n_pending) mod cap_pending */
  int32_t head, n_pending, cap_pending;
  int32_t receiving; /* slots whose get is in flight or not yet answered */
  int64_t dropped;   /* pieces refused (bad header, out of memory, failed sender) */
};

static int64_t tw_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

uint64_t tw_kv_fnv1a(uint64_t h, const void *data, size_t len) {
  const uint8_t *p = data;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/* ---- network devices ---- */

/* The interface holding local address `a` (IFF_LOOPBACK's when a is NULL). */
static bool tw_kv_iface_of(const struct sockaddr *a, char *name, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
    const struct sockaddr *ia = i->ifa_addr;
    if (!ia) continue;
    if (!a)
      found = (i->ifa_flags & IFF_LOOPBACK) && ia->sa_family == AF_INET;
    else if (ia->sa_family == AF_INET && a->sa_family == AF_INET)
      found = ((const struct sockaddr_in *)ia)->sin_addr.s_addr ==
              ((const struct sockaddr_in *)a)->sin_addr.s_addr;
    else if (ia->sa_family == AF_INET6 && a->sa_family == AF_INET6)
      found = !memcmp(&((const struct sockaddr_in6 *)ia)->sin6_addr,
                      &((const struct sockaddr_in6 *)a)->sin6_addr, sizeof(struct in6_addr));
    if (found) snprintf(name, cap, "%s", i->ifa_name);
  }
  freeifaddrs(ifs);
  return found;
}

/* The local address the kernel would use to reach host:port (a UDP
 * connect() sends nothing), then its interface. */
static TW_NODISCARD tw_status_t tw_kv_route_iface(const char *host, const char *port, char *name,
                                                  size_t cap) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM}, *res = NULL;
  int rc = getaddrinfo(host, port, &hints, &res);
  if (rc != 0)
    return tw_err(TW_ERR_NOT_FOUND, "router host \"%s\" does not resolve: %s", host,
                  gai_strerror(rc));
  bool found = false;
  for (struct addrinfo *ai = res; ai && !found; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    struct sockaddr_storage local;
    socklen_t len = sizeof local;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, (struct sockaddr *)&local, &len) == 0)
      found = tw_kv_iface_of((const struct sockaddr *)&local, name, cap);
    close(fd);
  }
  freeaddrinfo(res);
  return found ? TW_OK
               : tw_err(TW_ERR_NOT_FOUND, "no local interface routes to the router host \"%s\"",
                        host);
}

TW_NODISCARD tw_status_t tw_kv_net_devices(const char *endpoint, char *out, size_t cap) {
  char name[IF_NAMESIZE + 1] = "";
  if (!strncmp(endpoint, "ipc://", 6) || !strncmp(endpoint, "inproc://", 9)) {
    if (!tw_kv_iface_of(NULL, name, sizeof name))
      return tw_err(TW_ERR_NOT_FOUND, "no loopback interface on this host");
  } else if (!strncmp(endpoint, "tcp://", 6)) {
    char host[256];
    const char *port;
    if (!tw_msg_tcp_host_port(endpoint, host, sizeof host, &port))
      return tw_err(TW_ERR_INVALID_ARGUMENT, "router endpoint %s: want tcp://HOST:PORT", endpoint);
    TW_CHECK(tw_kv_route_iface(host, port, name, sizeof name));
  } else {
    return tw_err(TW_ERR_INVALID_ARGUMENT, "router endpoint %s: not tcp://, ipc:// or inproc://",
                  endpoint);
  }
  size_t n = (size_t)snprintf(out, cap, "%s", name);
  if (n >= cap) return tw_err(TW_ERR_OUT_OF_RANGE, "network device list over %zu bytes", cap);
  DIR *d = opendir("/sys/class/infiniband"); /* RDMA ports: no socket listens there */
  for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.') continue;
    char path[512];
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports", e->d_name);
    DIR *pd = opendir(path);
    for (struct dirent *pe; pd && (pe = readdir(pd)) != NULL;) {
      if (pe->d_name[0] == '.') continue;
      n += (size_t)snprintf(out + n, n < cap ? cap - n : 0, ",%s:%s", e->d_name, pe->d_name);
    }
    if (pd) closedir(pd);
  }
  if (d) closedir(d);
  if (n >= cap) return tw_err(TW_ERR_OUT_OF_RANGE, "network device list over %zu bytes", cap);
  return TW_OK;
}

/* The value of `key` ("UCX_TLS", ...) in the configuration `cfg` as
 * ucp_config_print writes it, into val (empty when it is not printed). */
static void tw_kv_cfg_value(const ucp_config_t *cfg, const char *key, char *val, size_t cap) {
  char *text = NULL;
  size_t len = 0;
  val[0] = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f) return;
  ucp_config_print(cfg, f, NULL, UCS_CONFIG_PRINT_CONFIG);
  fclose(f);
  size_t klen = strlen(key);
  const char *q = text;
  while (q && (strncmp(q, key, klen) != 0 || q[klen] != '=')) {
    q = strchr(q, '\n');
    if (q) q++;
  }
  if (q) snprintf(val, cap, "%.*s", (int)strcspn(q + klen + 1, "\n"), q + klen + 1);
  free(text);
}

/* Whether the configuration `cfg` has protocols v2 on (UCX_PROTO_ENABLE as
 * ucp_config_print writes it: 'n' by default in 1.13, 'y' from 1.16 on);
 * `fallback` when the field is not printed. */
static bool tw_kv_cfg_proto_v2(const ucp_config_t *cfg, bool fallback) {
  char q[16];
  tw_kv_cfg_value(cfg, "UCX_PROTO_ENABLE", q, sizeof q);
  if (!q[0]) return fallback;
  return q[0] == 'y' || q[0] == 'Y' || q[0] == '1' || strncasecmp(q, "on", 2) == 0;
}

/* The transports a context without `shm_fifo` takes where the operator
 * names none (UCX_TLS unset in the environment and in UCX's configuration
 * file): every one UCX finds but its shared-memory FIFO transports, the
 * "mm" family (sysv, posix, xpmem). Such a transport takes an element of
 * the receiver's FIFO by moving its head, writes the message, and only
 * then marks the element written; the receiver reads in order and waits
 * at an unmarked element. So a prefill worker killed inside that write
 * left the decode worker unable to receive anything from anyone again
 * (docs/operations.md, "Staged receive"). Between processes on one host
 * TCP (loopback) then carries the messages and cma the zero-copy
 * transfers (puts too from UCX 1.14 on, protocols v2); TCP, cma, RDMA (rc,
 * ud, dc), cuda_copy, cuda_ipc and self all stay. "mm" is UCX's own alias
 * for the three, so a UCX without xpmem does not warn about it. */
#define TW_KV_DEFAULT_TLS "^mm"

/* ucp_init (RMA, WAKEUP) with UCX's configuration from the environment,
 * TW_KV_DEFAULT_TLS unless the operator set UCX_TLS or `shm_fifo`,
 * protocols v2 forced on when `v2`, NET_DEVICES `devices` unless NULL; then
 * UCX_TLS as asked and whether it is the operator's, whether protocols v2
 * are in effect and CUDA memory is supported. */
static TW_NODISCARD tw_status_t tw_kv_ucp_init(tw_kv_xfer_t *x, bool v2, bool shm_fifo,
                                               const char *devices) {
  ucp_config_t *cfg = NULL;
  tw_ucx_log_install(); /* UCX's warnings as this process's log lines, rate-limited */
  ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
  if (us != UCS_OK) return tw_err(TW_ERR_TRANSPORT, "ucp_config_read failed: %s", ucs_status_string(us));
  if (devices && (us = ucp_config_modify(cfg, "NET_DEVICES", devices)) != UCS_OK) {
    ucp_config_release(cfg);
    return tw_err(TW_ERR_TRANSPORT, "UCX NET_DEVICES=%s: %s", devices, ucs_status_string(us));
  }
  /* the operator's: UCX_TLS in the environment, or anything but UCX's
   * default ("all") read from its configuration file */
  const char *tls_env = getenv("UCX_TLS");
  tw_kv_cfg_value(cfg, "UCX_TLS", x->tls_asked, sizeof x->tls_asked);
  x->tls_operator = (tls_env && *tls_env) || (x->tls_asked[0] && strcmp(x->tls_asked, "all") != 0);
  if (!x->tls_operator && !shm_fifo) {
    if ((us = ucp_config_modify(cfg, "TLS", TW_KV_DEFAULT_TLS)) != UCS_OK) {
      ucp_config_release(cfg);
      return tw_err(TW_ERR_TRANSPORT, "UCX TLS=%s: %s", TW_KV_DEFAULT_TLS, ucs_status_string(us));
    }
    snprintf(x->tls_asked, sizeof x->tls_asked, "%s", TW_KV_DEFAULT_TLS);
  }
  bool forced = v2 && ucp_config_modify(cfg, "PROTO_ENABLE", "y") == UCS_OK;
  x->proto_v2 = tw_kv_cfg_proto_v2(cfg, forced);
  /* WAKEUP: the receiving side sleeps on the worker's event fd (see
   * tw_kv_xfer_wait_fd); emulated puts and flushes need its progress */
  /* AM: pieces into a staged receiver's bounce ring (kv_transfer.h) */
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                         .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
  us = ucp_init(&params, cfg, &x->ctx);
  ucp_config_release(cfg);
  if (us != UCS_OK) {
    x->ctx = NULL;
    return tw_err(TW_ERR_TRANSPORT, "ucp_init failed: %s", ucs_status_string(us));
  }
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  if (ucp_context_query(x->ctx, &attr) == UCS_OK)
    x->cuda_native = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  /* upstream 3dd0828 ("use RMA_BW lanes for RMA bcopy/zcopy ops"), first
   * in 1.14.0: before it put/offload/zcopy takes RMA lanes only */
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  x->put_rma_bw = major > 1 || (major == 1 && minor >= 14);
  return TW_OK;
}

static ucs_status_t tw_kv_am_want(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param);
static ucs_status_t tw_kv_am_filled(void *arg, const void *header, size_t header_length, void *data,
                                    size_t length, const ucp_am_recv_param_t *param);
static ucs_status_t tw_kv_am_grant(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
static ucs_status_t tw_kv_am_hello(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param);
static ucs_status_t tw_kv_am_hello_ack(void *arg, const void *header, size_t header_length,
                                       void *data, size_t length, const ucp_am_recv_param_t *param);

/* The context's transports from ucp_context_print_info's
 * "flags -- <tl>/<device>" resource lines: x->tls (each once, in UCX's
 * order), x->fifo_tls (those of the shared-memory FIFO family), x->tcp_only
 * (TCP alone: self and cuda_copy, which reach no other process, aside) and
 * dev, the first TCP device (a non-loopback one when there is one). */
static void tw_kv_ctx_transports(tw_kv_xfer_t *x, char dev[IF_NAMESIZE]) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  dev[0] = x->tls[0] = x->fifo_tls[0] = 0;
  x->tcp_only = false;
  if (!f) return;
  ucp_context_print_info(x->ctx, f);
  fclose(f);
  if (!text) return;
  bool tcp = false, other = false;
  size_t used = 0, fused = 0;
  for (char *line = text, *nl; line && *line; line = nl ? nl + 1 : NULL) {
    nl = strchr(line, '\n');
    if (nl) *nl = 0;
    const char *q = strstr(line, "flags -- ");
    char tl[32], d[IF_NAMESIZE];
    if (!strstr(line, "resource") || !q || sscanf(q, "flags -- %31[^/]/%15s", tl, d) != 2) continue;
    if (strcmp(tl, "tcp") == 0) {
      tcp = true;
      if (!dev[0] || (strcmp(dev, "lo") == 0 && strcmp(d, "lo") != 0))
        snprintf(dev, IF_NAMESIZE, "%s", d);
    } else if (strcmp(tl, "self") != 0 && strcmp(tl, "cuda_copy") != 0) {
      other = true;
    }
    char word[40];
    snprintf(word, sizeof word, ",%s,", tl);
    char seen[sizeof x->tls + 2];
    snprintf(seen, sizeof seen, ",%s,", x->tls);
    if (strstr(seen, word)) continue;
    int w = snprintf(x->tls + used, sizeof x->tls - used, "%s%s", used ? "," : "", tl);
    if (w > 0 && (size_t)w < sizeof x->tls - used) used += (size_t)w;
    bool fifo = strcmp(tl, "sysv") == 0 || strcmp(tl, "posix") == 0 || strcmp(tl, "xpmem") == 0;
    w = fifo ? snprintf(x->fifo_tls + fused, sizeof x->fifo_tls - fused, "%s%s", fused ? "," : "",
                        tl)
             : 0;
    if (w > 0 && (size_t)w < sizeof x->fifo_tls - fused) fused += (size_t)w;
  }
  free(text);
  x->tcp_only = tcp && !other;
}

static void tw_kv_accepted_error(void *arg, ucp_ep_h ep, ucs_status_t status);

/* A connection request on the listener: an endpoint for it (error mode
 * PEER: TCP detects a dead peer), kept in x->accepted; refused when the
 * table is full. */
static void tw_kv_on_conn_request(ucp_conn_request_h req, void *arg) {
  tw_kv_xfer_t *x = arg;
  int k = -1;
  for (int i = 0; i < x->n_accepted && k < 0; i++)
    if (!x->accepted[i]) k = i;
  if (k < 0 && x->n_accepted < TW_KV_MAX_ACCEPTED) k = x->n_accepted++;
  if (k < 0) {
    TW_WARN("kvx", "refusing a prefill worker's kv connection: %d connections open",
            TW_KV_MAX_ACCEPTED);
    (void)ucp_listener_reject(x->listener, req); /* the sender's connect fails */
    return;
  }
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
                        .conn_request = req,
                        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                        .err_handler = {.cb = tw_kv_accepted_error, .arg = x}};
  ucs_status_t us = ucp_ep_create(x->worker, &ep, &x->accepted[k]);
  x->accepted_failed[k] = false;
  if (us != UCS_OK) {
    x->accepted[k] = NULL;
    TW_WARN("kvx", "ucp_ep_create for a prefill worker's kv connection failed: %s",
            ucs_status_string(us));
  }
}

/* TCP alone: listen on the first TCP device's address (ephemeral port) and
 * publish the worker address with a tw_kv_lsn_desc_t. Failing that, the
 * worker address alone is published (warned). */
static void tw_kv_listen(tw_kv_xfer_t *x) {
  char dev[IF_NAMESIZE];
  tw_kv_ctx_transports(x, dev);
  if (!x->tcp_only) return;
  struct ifaddrs *ifs = NULL, *hit = NULL;
  if (getifaddrs(&ifs) == 0)
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
      if (i->ifa_addr && strcmp(i->ifa_name, dev) == 0 &&
          (i->ifa_addr->sa_family == AF_INET || (i->ifa_addr->sa_family == AF_INET6 && !hit)))
        if (!hit || i->ifa_addr->sa_family == AF_INET) hit = i;
  struct sockaddr_storage sa = {0};
  socklen_t sl = 0;
  if (hit) {
    sl = hit->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in)
                                             : sizeof(struct sockaddr_in6);
    memcpy(&sa, hit->ifa_addr, sl);
  }
  if (ifs) freeifaddrs(ifs);
  ucp_listener_params_t lp = {
      .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
      .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sl},
      .conn_handler = {.cb = tw_kv_on_conn_request, .arg = x}};
  ucs_status_t us = hit ? ucp_listener_create(x->worker, &lp, &x->listener) : UCS_ERR_NO_DEVICE;
  ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
  if (us == UCS_OK) us = ucp_listener_query(x->listener, &la);
  tw_kv_lsn_desc_t d = {.ucx_len = (uint32_t)x->address_len};
  if (us == UCS_OK) {
    d.family = la.sockaddr.ss_family;
    if (d.family == AF_INET) {
      const struct sockaddr_in *a = (const struct sockaddr_in *)&la.sockaddr;
      memcpy(d.ip, &a->sin_addr, 4);
      d.port = ntohs(a->sin_port);
    } else {
      const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&la.sockaddr;
      memcpy(d.ip, &a->sin6_addr, 16);
      d.port = ntohs(a->sin6_port);
    }
    memcpy(d.magic, TW_KV_LSN_MAGIC, sizeof d.magic);
    x->published = malloc(x->address_len + sizeof d);
  }
  if (us != UCS_OK || !x->published) {
    TW_WARN("kvx",
            "UCX transports are TCP alone but no listener on %s (%s): prefill workers connect "
            "by worker address, whose TCP setup can abort this worker if one dies meanwhile",
            dev[0] ? dev : "no TCP device", us != UCS_OK ? ucs_status_string(us) : "out of memory");
    if (x->listener) ucp_listener_destroy(x->listener);
    x->listener = NULL;
    return;
  }
  memcpy(x->published, x->address, x->address_len);
  memcpy(x->published + x->address_len, &d, sizeof d);
  x->published_len = x->address_len + sizeof d;
  char ip[INET6_ADDRSTRLEN] = "?";
  inet_ntop(d.family, d.ip, ip, sizeof ip);
  TW_INFO("kvx",
          "UCX transports are TCP alone: prefill workers connect through a listener on %s:%u (%s)",
          ip, (unsigned)d.port, dev);
}

/* Whether a published address blob ends with a listener descriptor (*d). */
static bool tw_kv_lsn_split(const void *blob, size_t len, tw_kv_lsn_desc_t *d) {
  if (len < sizeof *d) return false;
  memcpy(d, (const uint8_t *)blob + len - sizeof *d, sizeof *d);
  return memcmp(d->magic, TW_KV_LSN_MAGIC, sizeof d->magic) == 0 && d->ucx_len == len - sizeof *d &&
         (d->family == AF_INET || d->family == AF_INET6);
}

TW_NODISCARD tw_status_t tw_kv_xfer_create(tw_kv_xfer_t **xfer_p) {
  return tw_kv_xfer_create_bound(NULL, false, xfer_p);
}

TW_NODISCARD tw_status_t tw_kv_xfer_create_bound(const char *router_endpoint, bool shm_fifo,
                                                 tw_kv_xfer_t **xfer_p) {
  char devs[1024];
  const char *devices = NULL, *env = getenv("UCX_NET_DEVICES");
  if (router_endpoint && env && *env) {
    TW_INFO("kvx", "UCX network devices %s (UCX_NET_DEVICES)", env);
  } else if (router_endpoint) {
    if (tw_kv_net_devices(router_endpoint, devs, sizeof devs) == TW_OK) {
      devices = devs;
      TW_INFO("kvx",
              "UCX network devices %s: the interface of the router link %s (UCX_NET_DEVICES "
              "picks others, \"all\" every one)",
              devs, router_endpoint);
    } else {
      TW_WARN("kvx", "UCX network devices: every one UCX finds (%s; set UCX_NET_DEVICES)",
              tw_last_error());
    }
  }
  tw_kv_xfer_t *x = calloc(1, sizeof *x);
  if (!x) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the kv transfer handle");
  x->magic = TW_KV_XFER_MAGIC;
  tw_proc_self(&x->self);
  const char *sp = getenv("TWAIN_KV_STAGED_PUT");
  x->staged_put = sp && strcmp(sp, "1") == 0;
  tw_status_t st = TW_OK;
  /* UCX 1.13's default (v1) RMA protocols put only over lanes with put
   * short/bcopy, which cuda_ipc lacks (it is zero-copy only): a put into CUDA
   * memory would be emulated with active messages that the receiver writes
   * as host memory (the crash of the first trial). Its protocols v2 tell the
   * receiver the rkey's memory type (still emulated, see tw_kv_ep_lanes);
   * from 1.14 on, v2 puts go over the zero-copy rma_bw lanes, cuda_ipc
   * included, and from 1.16 on v2 is the default. So with CUDA support, and
   * unless UCX_PROTO_ENABLE says otherwise, the context is made again with
   * v2. */
  const char *proto_env = getenv("UCX_PROTO_ENABLE");
  TW_CHECK_GOTO(tw_kv_ucp_init(x, false, shm_fifo, devices), st, fail);
  if (x->cuda_native && !proto_env && !x->proto_v2) {
    ucp_cleanup(x->ctx);
    x->ctx = NULL;
    TW_CHECK_GOTO(tw_kv_ucp_init(x, true, shm_fifo, devices), st, fail);
  }
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  ucs_status_t us = ucp_worker_create(x->ctx, &wp, &x->worker);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_worker_create failed: %s", ucs_status_string(us));
    goto fail;
  }
  /* pieces for a staged pool of this worker, and the grants to the pieces
   * it sends (defined below) */
  const struct {
    unsigned id;
    ucp_am_recv_callback_t cb;
  } handlers[] = {{TW_KV_AM_WANT_ID, tw_kv_am_want},
                  {TW_KV_AM_FILLED_ID, tw_kv_am_filled},
                  {TW_KV_AM_GRANT_ID, tw_kv_am_grant},
                  {TW_KV_AM_HELLO_ID, tw_kv_am_hello},
                  {TW_KV_AM_HELLO_ACK_ID, tw_kv_am_hello_ack}};
  for (size_t i = 0; i < sizeof handlers / sizeof handlers[0] && us == UCS_OK; i++) {
    ucp_am_handler_param_t ah = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = handlers[i].id,
                                 .cb = handlers[i].cb,
                                 .arg = x};
    us = ucp_worker_set_am_recv_handler(x->worker, &ah);
  }
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_worker_set_am_recv_handler failed: %s",
                ucs_status_string(us));
    goto fail;
  }
  us = ucp_worker_get_address(x->worker, &x->address, &x->address_len);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_worker_get_address failed: %s", ucs_status_string(us));
    goto fail;
  }
  tw_kv_listen(x);
  /* what tw_kv_xfer_address publishes, sealed (kv_seal.h) */
  TW_CHECK_GOTO(tw_kv_seal(TW_KV_SEAL_ADDRESS, x->published ? x->published : (uint8_t *)x->address,
                           x->published ? x->published_len : x->address_len, &x->sealed_address,
                           &x->sealed_address_len),
                st, fail);
  /* how device pools travel is logged when one is registered: a CPU worker
   * has none, and must not claim CUDA staging */
  const char *why = x->tls_operator ? "the operator's"
                    : shm_fifo ? "twain's default for a prefill worker or a pool with puts in place"
                               : "twain's default: no shared-memory FIFOs";
  TW_INFO("kvx",
          "ucx worker up: transports %s (UCX_TLS=%s, %s), address %zu bytes, CUDA memory %s, "
          "protocols %s",
          x->tls[0] ? x->tls : "?", x->tls_asked[0] ? x->tls_asked : "?", why, x->address_len,
          x->cuda_native ? "supported" : "not supported", x->proto_v2 ? "v2" : "v1");
  if (x->fifo_tls[0])
    TW_INFO("kvx",
            "UCX's shared-memory FIFO transports in use (%s): a peer on this host killed while "
            "its UCX writes a message into this worker's FIFO blocks that FIFO until this "
            "worker restarts (peers without them, such as decode workers on the staged ring by "
            "default, do not use them; docs/operations.md, \"Staged receive\")",
            x->fifo_tls);
  *xfer_p = x;
  return TW_OK;
fail:
  tw_kv_xfer_destroy(x);
  return st;
}

static void tw_kv_ring_free(tw_kv_xfer_t *x);
static void tw_kv_sender_close(tw_kv_xfer_t *x, tw_kv_sender_t *s);
static void tw_kv_peer_drop(tw_kv_xfer_t *x, tw_kv_peer_t *p);
static void tw_kv_ep_lanes(tw_kv_peer_t *p, const tw_kv_xfer_t *x);

/* ---- the sender's pieces for staged receivers ---- */

/* Free a piece's entry (its requests released: UCX frees them once done). */
static void tw_kv_piece_release(tw_kv_xfer_t *x, tw_kv_piece_t *e) {
  if (e->req) ucp_request_free(e->req);
  if (e->flush) ucp_request_free(e->flush);
  if (e->peer) e->peer->n_pieces--;
  int16_t last = x->active[--x->n_pieces]; /* the last active entry takes its place */
  x->active[e->pos] = last;
  x->pieces[last].pos = e->pos;
  *e = (tw_kv_piece_t){0};
}

static void tw_kv_piece_refuse(tw_kv_piece_t *e, ucs_status_t why) {
  e->state = TW_PIECE_REFUSED;
  if (e->peer && e->peer->refused == UCS_OK) e->peer->refused = why;
}

/* Whether the receiver behind p is gone: its endpoint failed, or, when it
 * runs on this host (named in its answer to the greeting), its process no
 * longer does (checked every 20 ms, or at once when `at_once`: a flush, which
 * completes a handoff, always looks), so that a sender learns of a killed
 * decode worker at once instead of waiting out its timeouts. Marks p
 * failed. */
static bool tw_kv_peer_gone(tw_kv_peer_t *p, bool at_once) {
  if (p->failed) return true;
  int64_t now = tw_now_ns();
  if (!p->local || (!at_once && now - p->checked_ns < 20 * 1000000LL)) return false;
  p->checked_ns = now;
  if (tw_proc_alive(&p->proc)) return false;
  TW_WARN("kvx", "decode worker pid %d is gone: its kv handoffs fail, its endpoint is dropped",
          (int)p->proc.pid);
  p->failed = 1;
  return true;
}

/* "the decode worker", with its pid when it named one (for messages). */
static const char *tw_kv_peer_name(const tw_kv_peer_t *p, char *buf, size_t cap) {
  if (p->proc.pid > 0)
    snprintf(buf, cap, "decode worker pid %d", (int)p->proc.pid);
  else
    snprintf(buf, cap, "the decode worker");
  return buf;
}

/* "grant" (UCX's active message callback): the piece's slot, or a refusal. */
static ucs_status_t tw_kv_am_grant(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param) {
  (void)data;
  (void)length;
  (void)param;
  tw_kv_xfer_t *x = arg;
  tw_kv_am_grant_t g;
  if (header_length != sizeof g) {
    TW_WARN("kvx", "ignoring a malformed staged kv grant (%zu bytes)", header_length);
    return UCS_OK;
  }
  memcpy(&g, header, sizeof g);
  tw_kv_piece_t *e = &x->pieces[g.piece % TW_KV_PIECES];
  if (e->id != g.piece || e->state != TW_PIECE_WANT) return UCS_OK; /* given up on */
  if (g.status != UCS_OK) {
    tw_kv_piece_refuse(e, (ucs_status_t)g.status);
    return UCS_OK;
  }
  e->slot = g.slot;
  e->slot_addr = g.slot_addr;
  e->state = TW_PIECE_GRANTED;
  return UCS_OK;
}

/* "hello" answered (UCX's callback): the peer whose greeting carried the token. */
static ucs_status_t tw_kv_am_hello_ack(void *arg, const void *header, size_t header_length,
                                       void *data, size_t length,
                                       const ucp_am_recv_param_t *param) {
  tw_kv_xfer_t *x = arg;
  tw_kv_am_hello_ack_t a;
  memset(&a, 0, sizeof a);
  if (header_length != sizeof a.token) return UCS_OK;
  memcpy(&a.token, header, sizeof a.token);
  /* no process (a receiver that sends the token alone): nothing to watch */
  bool named = length == sizeof a.proc && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
  if (named) memcpy(&a.proc, data, sizeof a.proc);
  for (int i = 0; i < x->n_peers; i++) {
    tw_kv_peer_t *p = x->peers[i];
    if (p->hello_token != a.token) continue;
    p->greeted = true;
    p->proc = a.proc;
    p->local = named && tw_proc_local(&x->self, &p->proc);
  }
  return UCS_OK;
}

/* The greeting (kv_transfer.h): "hello", answered by the receiver's worker
 * on the endpoint UCX made for ours, behind UCX's own wireup reply, so that
 * once the answer is here the receiver has no wireup message queued towards
 * this process (pieces, above). A failed greeting marks the peer failed. */
TW_NODISCARD tw_status_t tw_kv_xfer_greet(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (p->failed) {
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_UNAVAILABLE, "the decode worker's ucx endpoint failed");
  }
  if (p->greeted) return TW_OK;
  p->hello_token = ++x->hello_seq;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY};
  void *req = ucp_am_send_nbx(p->ep, TW_KV_AM_HELLO_ID, &p->hello_token, sizeof p->hello_token,
                              NULL, 0, &prm);
  if (UCS_PTR_IS_ERR(req)) {
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_TRANSPORT, "ucp_am_send_nbx of the greeting to a decode worker failed: %s",
                  ucs_status_string(UCS_PTR_STATUS(req)));
  }
  int64_t deadline = tw_now_ns() + (int64_t)TW_KV_HELLO_TIMEOUT_MS * 1000000;
  while (!p->greeted && !p->failed && tw_now_ns() < deadline) ucp_worker_progress(x->worker);
  if (UCS_PTR_IS_PTR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && !p->failed && tw_now_ns() < deadline)
      ucp_worker_progress(x->worker);
    ucp_request_free(req); /* UCX completes it even if it is still in flight */
  }
  if (p->greeted) {
    if (p->via_listener) { /* connected now: its lanes are known */
      char was[sizeof p->lanes];
      memcpy(was, p->lanes, sizeof was);
      tw_kv_ep_lanes(p, x);
      if (!p->lanes[0]) memcpy(p->lanes, was, sizeof was);
      p->am_pieces = true; /* TCP alone: no lane puts */
      /* the rkey was unpacked while the endpoint had only its connection
       * lane: unpack it again for the lanes it has now (UCX 1.22 segfaults
       * in ucp_put_nbx updating such an rkey's configuration) */
      ucp_rkey_h fresh = NULL;
      if (p->rkey && ucp_ep_rkey_unpack(p->ep, p->rkey_buf, &fresh) == UCS_OK) {
        ucp_rkey_destroy(p->rkey);
        p->rkey = fresh;
      }
    }
    return TW_OK;
  }
  bool failed = p->failed;
  tw_kv_peer_drop(x, p);
  if (failed)
    return tw_err(TW_ERR_UNAVAILABLE,
                  "the decode worker's ucx endpoint failed during the greeting");
  return tw_err(TW_ERR_DEADLINE, "the decode worker did not answer the greeting within %d ms",
                TW_KV_HELLO_TIMEOUT_MS);
}

/* Send "filled" for piece e: its bytes are in the slot (data NULL), or are
 * the message's data (len bytes at data, host memory that stays until the
 * piece is released). */
static void tw_kv_piece_filled(tw_kv_xfer_t *x, tw_kv_piece_t *e, const void *data, size_t len) {
  e->fill = (tw_kv_am_filled_t){
      .base = e->hdr.base, .piece = e->id, .nonce = x->self.nonce, .slot = e->slot};
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
      .flags = UCP_AM_SEND_FLAG_EAGER,
      .memory_type = UCS_MEMORY_TYPE_HOST};
  void *req = ucp_am_send_nbx(e->peer->ep, TW_KV_AM_FILLED_ID, &e->fill, sizeof e->fill, data,
                              data ? len : 0, &prm);
  if (UCS_PTR_IS_ERR(req)) {
    tw_kv_piece_refuse(e, UCS_PTR_STATUS(req));
  } else {
    e->req = req;
    e->state = TW_PIECE_FILLED;
  }
}

/* Start copying a device piece into its slot, mapped here at `ptr`: the
 * slot's mapping pinned once (cudaHostRegister, else the copy runs from
 * pageable memory), cudaMemcpyAsync on the pieces' stream, an event. */
static TW_NODISCARD tw_status_t tw_kv_piece_copy_device(tw_kv_xfer_t *x, tw_kv_piece_t *e,
                                                        void *ptr) {
  tw_kv_peer_t *p = e->peer;
  tw_cudart_t *rt = &x->cudart;
  int idx = (int)(e->id % TW_KV_PIECES);
  if (!x->d2h_stream && rt->stream_create(&x->d2h_stream, TW_CUDA_STREAM_NON_BLOCKING) != 0) {
    x->d2h_stream = NULL;
    return tw_err(TW_ERR_CUDA, "cudaStreamCreate for the staged kv copies failed");
  }
  if (!x->piece_event[idx] &&
      rt->event_create(&x->piece_event[idx], TW_CUDA_EVENT_DISABLE_TIMING) != 0) {
    x->piece_event[idx] = NULL;
    return tw_err(TW_ERR_CUDA, "cudaEventCreate for the staged kv copies failed");
  }
  if (!p->slot_reg) p->slot_reg = calloc(TW_KV_MAX_SLOTS, sizeof *p->slot_reg);
  if (p->slot_reg && e->slot >= 0 && e->slot < TW_KV_MAX_SLOTS && !p->slot_reg[e->slot] &&
      rt->host_register && rt->host_register(ptr, (size_t)e->slot_bytes, 0) == 0)
    p->slot_reg[e->slot] = ptr;
  if (rt->memcpy_async(ptr, e->buf, (size_t)e->len, TW_CUDA_D2H, x->d2h_stream) != 0 ||
      rt->event_record(x->piece_event[idx], x->d2h_stream) != 0)
    return tw_err(TW_ERR_CUDA,
                  "cudaMemcpyAsync of %lld kv bytes into a decode worker's staging "
                  "slot failed",
                  (long long)e->len);
  return TW_OK;
}

/* A piece's slot was granted: copy it in where the slot is mapped here,
 * else put it (then flush). */
static void tw_kv_piece_start(tw_kv_xfer_t *x, tw_kv_piece_t *e) {
  tw_kv_peer_t *p = e->peer;
  void *ptr = NULL;
  bool mapped = p->rkey && p->slot_ptr >= 0 && !x->staged_put &&
                ucp_rkey_ptr(p->rkey, e->slot_addr, &ptr) == UCS_OK;
  bool in_msg = !mapped && p->am_pieces && !e->device;
  if (p->slot_ptr == 0) {
    p->slot_ptr = mapped ? 1 : -1;
    TW_INFO("kvx", "staged kv pieces to a decode worker: %s",
            mapped   ? "copied straight into its ring's slots (mapped here: shared memory)"
            : in_msg ? "sent inside their \"filled\" messages (no lane puts: UCX would emulate "
                       "the put)"
            : x->staged_put ? "put into its ring's slots (TWAIN_KV_STAGED_PUT=1)"
                            : "put into its ring's slots (not mapped here)");
  }
  if (in_msg) {
    tw_kv_piece_filled(x, e, e->buf, (size_t)e->len);
    return;
  }
  if (mapped && e->device) {
    if (tw_kv_piece_copy_device(x, e, ptr) != TW_OK) { /* logged by tw_err */
      tw_kv_piece_refuse(e, UCS_ERR_IO_ERROR);
      return;
    }
    e->state = TW_PIECE_COPYING;
    return;
  }
  if (mapped) {
    memcpy(ptr, e->buf, (size_t)e->len);
    tw_kv_piece_filled(x, e, NULL, 0);
    return;
  }
  if (e->device) { /* only sent so once the ring was mapped here */
    TW_WARN("kvx",
            "a decode worker's staging slot is not mapped here: a device kv piece cannot "
            "be copied into it");
    tw_kv_piece_refuse(e, UCS_ERR_UNSUPPORTED);
    return;
  }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                             .memory_type = UCS_MEMORY_TYPE_HOST};
  void *req = p->rkey ? ucp_put_nbx(p->ep, e->buf, (size_t)e->len, e->slot_addr, p->rkey, &prm)
                      : UCS_STATUS_PTR(UCS_ERR_INVALID_PARAM);
  if (UCS_PTR_IS_ERR(req)) {
    TW_WARN("kvx", "ucp_put_nbx of a %lld-byte staged kv piece failed: %s", (long long)e->len,
            ucs_status_string(UCS_PTR_STATUS(req)));
    tw_kv_piece_refuse(e, UCS_PTR_STATUS(req));
    return;
  }
  if (req) ucp_request_free(req); /* the flush completes it */
  prm.op_attr_mask = 0;
  void *fl = ucp_ep_flush_nbx(p->ep, &prm);
  if (UCS_PTR_IS_ERR(fl)) {
    tw_kv_piece_refuse(e, UCS_PTR_STATUS(fl));
    return;
  }
  e->flush = fl;
  e->state = TW_PIECE_PUTTING;
}

/* Move every piece on: start the granted ones, send "filled" for those
 * whose bytes are in their slots, release the finished and refused ones.
 * Never blocks. */
static void tw_kv_pieces_advance(tw_kv_xfer_t *x) {
  for (int a = x->n_pieces - 1; a >= 0; a--) { /* backwards: a release moves the last one here */
    int i = x->active[a];
    tw_kv_piece_t *e = &x->pieces[i];
    ucs_status_t s = e->req ? ucp_request_check_status(e->req) : UCS_OK;
    if (s != UCS_INPROGRESS && e->req) { /* "want" or "filled" sent */
      ucp_request_free(e->req);
      e->req = NULL;
      if (s != UCS_OK) tw_kv_piece_refuse(e, s);
    }
    if (e->state == TW_PIECE_GRANTED) tw_kv_piece_start(x, e);
    if (e->state == TW_PIECE_COPYING) {
      int c = x->cudart.event_query(x->piece_event[i]);
      if (c == 0) {
        tw_kv_piece_filled(x, e, NULL, 0);
      } else if (c != TW_CUDA_NOT_READY) {
        TW_WARN("kvx", "a staged kv copy into a decode worker's slot failed (cuda error %d)", c);
        tw_kv_piece_refuse(e, UCS_ERR_IO_ERROR);
      }
    }
    if (e->state == TW_PIECE_PUTTING) {
      s = e->flush ? ucp_request_check_status(e->flush) : UCS_OK;
      if (s != UCS_INPROGRESS) {
        if (e->flush) ucp_request_free(e->flush);
        e->flush = NULL;
        if (s != UCS_OK)
          tw_kv_piece_refuse(e, s);
        else
          tw_kv_piece_filled(x, e, NULL, 0);
      }
    }
    if ((e->state == TW_PIECE_FILLED || e->state == TW_PIECE_REFUSED) && !e->flush &&
        (!e->req || ucp_request_check_status(e->req) != UCS_INPROGRESS))
      tw_kv_piece_release(x, e);
  }
}

typedef enum {
  TW_KV_WAIT_PEER = 0, /* every piece sent to the peer finished */
  TW_KV_WAIT_ID = 1,   /* piece `id` finished */
  TW_KV_WAIT_ROOM = 2, /* a free entry */
} tw_kv_wait_t;

/* Progress until `what`, at most timeout_ms. Errors: TW_ERR_DEADLINE (the
 * receiver of the awaited pieces is marked failed and they are released),
 * TW_ERR_UNAVAILABLE (its endpoint failed). */
static TW_NODISCARD tw_status_t tw_kv_pieces_wait(tw_kv_xfer_t *x, tw_kv_peer_t *p,
                                                  tw_kv_wait_t what, uint64_t id, int timeout_ms) {
  int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
  for (;;) {
    tw_kv_pieces_advance(x);
    bool done = what == TW_KV_WAIT_PEER ? p->n_pieces == 0
                : what == TW_KV_WAIT_ID ? x->pieces[id % TW_KV_PIECES].id != id
                                        : x->n_pieces < TW_KV_PIECES;
    if (done) return TW_OK;
    if (what == TW_KV_WAIT_ID) p = x->pieces[id % TW_KV_PIECES].peer;
    bool failed = p && tw_kv_peer_gone(p, false);
    if (failed || tw_now_ns() > deadline) {
      int n = 0;
      for (int i = 0; i < TW_KV_PIECES; i++) n += x->pieces[i].id && (!p || x->pieces[i].peer == p);
      char name[48] = "the decode worker";
      if (p) {
        tw_kv_peer_name(p, name, sizeof name);
        tw_kv_peer_drop(x, p); /* its pieces released; made again at the next handoff */
      } else {
        for (int i = 0; i < TW_KV_PIECES; i++)
          if (x->pieces[i].id) tw_kv_piece_release(x, &x->pieces[i]);
      }
      if (failed)
        return tw_err(TW_ERR_UNAVAILABLE,
                      "%s is gone (its ucx endpoint failed or its process "
                      "ended) with %d staged kv pieces not taken",
                      name, n);
      return tw_err(TW_ERR_DEADLINE, "%s did not take %d staged kv pieces within %d ms", name, n,
                    timeout_ms);
    }
    ucp_worker_progress(x->worker);
  }
}

/* Ask the staged receiver `dst` for a slot for `len` bytes at `buf` (which
 * stay put until the piece finished), bound for raddr: one "want" message;
 * tw_kv_pieces_advance puts the piece once the slot is granted. *id_p: the
 * piece (tw_kv_pieces_wait). */
static TW_NODISCARD tw_status_t tw_kv_piece_send(tw_kv_xfer_t *x, tw_kv_peer_t *p,
                                                 const tw_kv_remote_layout_t *dst, const void *buf,
                                                 bool device, int64_t len, uint64_t raddr,
                                                 uint64_t *id_p) {
  if (!p->rkey)
    return tw_err(TW_ERR_TRANSPORT, "the staged decode worker published no rkey of its ring");
  TW_CHECK(tw_kv_xfer_greet(x, p)); /* once per endpoint */
  if (x->n_pieces == TW_KV_PIECES) TW_CHECK(tw_kv_pieces_wait(x, p, TW_KV_WAIT_ROOM, 0, 10000));
  int idx = 0;
  for (int i = 0; i < TW_KV_PIECES; i++) {
    idx = (int)((x->piece_seq + (uint64_t)i) % TW_KV_PIECES);
    if (!x->pieces[idx].id) break;
  }
  tw_kv_piece_t *e = &x->pieces[idx];
  uint64_t id = (++x->piece_seq) * TW_KV_PIECES + (uint64_t)idx;
  *e = (tw_kv_piece_t){
      .buf = buf, .len = len, .slot = -1, .device = device, .slot_bytes = dst->staging_slot_bytes};
  e->hdr = (tw_kv_am_hdr_t){.base = dst->remote_base,
                            .offset = raddr - dst->remote_base,
                            .len = (uint64_t)len,
                            .tag = dst->handoff_tag,
                            .piece = id,
                            .addr_len = (uint32_t)x->sealed_address_len,
                            .proc = x->self};
  /* REPLY: a receiver that accepted our connection answers on that endpoint */
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
      .flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY,
      .memory_type = UCS_MEMORY_TYPE_HOST};
  void *req = ucp_am_send_nbx(p->ep, TW_KV_AM_WANT_ID, &e->hdr, sizeof e->hdr, x->sealed_address,
                              x->sealed_address_len, &prm);
  if (UCS_PTR_IS_ERR(req)) {
    *e = (tw_kv_piece_t){0};
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_TRANSPORT, "ucp_am_send_nbx of a staged kv piece's request failed: %s",
                  ucs_status_string(UCS_PTR_STATUS(req)));
  }
  e->id = id;
  e->peer = p;
  e->req = req;
  e->state = TW_PIECE_WANT;
  p->n_pieces++;
  e->pos = (int16_t)x->n_pieces;
  x->active[x->n_pieces++] = (int16_t)idx;
  *id_p = id;
  x->stats.puts++;
  x->stats.ring_bytes += len;
  return TW_OK;
}

/* Forget the mapping of a receiver's ring: no copy into it may still run,
 * the slots' registrations go. */
static void tw_kv_peer_unmap(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  for (int i = 0; i < TW_KV_PIECES; i++)
    if (x->pieces[i].id && x->pieces[i].peer == p && x->pieces[i].state == TW_PIECE_COPYING)
      x->cudart.event_sync(x->piece_event[i]);
  for (int k = 0; p->slot_reg && k < TW_KV_MAX_SLOTS; k++)
    if (p->slot_reg[k] && x->cudart.host_unregister) x->cudart.host_unregister(p->slot_reg[k]);
  free(p->slot_reg);
  p->slot_reg = NULL;
  p->slot_ptr = 0;
}

/* Close an endpoint at once (UCP_EP_CLOSE_FLAG_FORCE: nothing is flushed);
 * with `wait`, progressing until UCX is done with it (bounded), else the
 * close request is released to UCX, which finishes it (from inside the
 * progress loop, where progressing again is not wanted). */
static void tw_kv_ep_close_force(tw_kv_xfer_t *x, ucp_ep_h ep, bool wait) {
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
  void *req = ucp_ep_close_nbx(ep, &prm);
  if (UCS_PTR_IS_PTR(req)) {
    for (int i = 0; wait && i < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++)
      ucp_worker_progress(x->worker);
    ucp_request_free(req);
  }
}

/* Let go of a receiver's UCX state now: its ring unmapped, its endpoint
 * closed (forced, bounded), its pieces released (their answers will not
 * come), its rkey destroyed. The peer stays, failed, for the handoffs that
 * still name it; tw_kv_xfer_peer makes a new one for its address. A failed
 * receiver is dropped at once, so nothing of a dead decode worker lingers
 * in the cache until it is evicted. */
static void tw_kv_peer_drop(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  p->failed = 1;
  tw_kv_peer_unmap(x, p);
  if (p->ep) tw_kv_ep_close_force(x, p->ep, true);
  p->ep = NULL;
  for (int i = 0; i < TW_KV_PIECES; i++)
    if (x->pieces[i].id && x->pieces[i].peer == p) tw_kv_piece_release(x, &x->pieces[i]);
  if (p->rkey) ucp_rkey_destroy(p->rkey);
  p->rkey = NULL;
}

/* The peer struct itself is not freed here: it is its endpoint's error
 * handler argument, and a forced close that has not finished within its
 * bound (a connect to a dead receiver still retrying) lets UCX call that
 * handler later, from any ucp_worker_progress (AddressSanitizer caught the
 * write into a freed peer in parallel.bad_plan). It waits on x->graves,
 * a few hundred bytes a replaced receiver, until tw_kv_xfer_destroy has
 * destroyed the worker. */
static void tw_kv_peer_close(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (!p) return;
  tw_kv_peer_drop(x, p);
  if (p->ipc_ptr) {
    if (p->ipc_pending && x->ipc_stream) x->cudart.event_sync(x->ipc_event); /* no copy in flight */
    x->cudart.ipc_close(p->ipc_ptr);
    p->ipc_ptr = NULL;
  }
  free(p->address);
  p->address = NULL;
  free(p->rkey_buf);
  p->rkey_buf = NULL;
  p->grave_next = x->graves;
  x->graves = p;
}

void tw_kv_xfer_destroy(tw_kv_xfer_t *x) {
  if (!x) return;
  for (int i = 0; i < x->n_peers; i++) tw_kv_peer_close(x, x->peers[i]);
  for (int i = 0; i < x->n_senders; i++) tw_kv_sender_close(x, x->senders[i]);
  if (x->listener) ucp_listener_destroy(x->listener);
  for (int i = 0; i < x->n_accepted; i++)
    if (x->accepted[i]) tw_kv_ep_close_force(x, x->accepted[i], true);
  free(x->published);
  tw_kv_ring_free(x);
  for (int i = 0; i < TW_KV_PIECES; i++)
    if (x->piece_event[i]) x->cudart.event_destroy(x->piece_event[i]);
  if (x->d2h_stream) x->cudart.stream_destroy(x->d2h_stream);
  if (x->address) ucp_worker_release_address(x->worker, x->address);
  free(x->sealed_address);
  if (x->ipc_event) x->cudart.event_destroy(x->ipc_event);
  if (x->ipc_stream) x->cudart.stream_destroy(x->ipc_stream);
  if (x->src_memh) ucp_mem_unmap(x->ctx, x->src_memh);
  if (x->worker) ucp_worker_destroy(x->worker);
  while (x->graves) { /* no endpoint callback can come now */
    tw_kv_peer_t *g = x->graves;
    x->graves = g->grave_next;
    free(g);
  }
  if (x->ctx) ucp_cleanup(x->ctx);
  if (x->cudart.lib) dlclose(x->cudart.lib);
  x->magic = 0;
  free(x);
}

const void *tw_kv_xfer_address(const tw_kv_xfer_t *x, size_t *len_p) {
  *len_p = x->sealed_address_len;
  return x->sealed_address;
}
bool tw_kv_xfer_cuda_native(const tw_kv_xfer_t *x) { return x->cuda_native; }
/* ---- the staged receive path: pieces into the region's bounce ring ---- */

/* The ring's copy step: cudaMemcpyAsync on the region's stream and an event
 * per slot (device pools), or memcpy (host pools, tests and benchmarks). */
static TW_NODISCARD tw_status_t tw_kv_rx_cuda_start(void *ctx, int32_t slot, void *dst,
                                                    const void *src, size_t len) {
  tw_kv_region_t *r = ctx;
  tw_cudart_t *rt = &r->xfer->cudart;
  if (rt->memcpy_async(dst, src, len, TW_CUDA_H2D, r->stream) != 0)
    return tw_err(TW_ERR_CUDA, "cudaMemcpyAsync of %zu staged kv bytes to the device failed", len);
  if (rt->event_record(r->event[slot], r->stream) != 0)
    return tw_err(TW_ERR_CUDA, "cudaEventRecord after a staged kv copy failed");
  return TW_OK;
}
static TW_NODISCARD tw_status_t tw_kv_rx_cuda_poll(void *ctx, int32_t slot) {
  tw_kv_region_t *r = ctx;
  int e = r->xfer->cudart.event_query(r->event[slot]);
  if (e == TW_CUDA_NOT_READY) return TW_INPROGRESS;
  if (e != 0)
    return tw_err(TW_ERR_CUDA, "a staged kv copy to the device failed (cuda error %d)", e);
  return TW_OK;
}
static TW_NODISCARD tw_status_t tw_kv_rx_host_start(void *ctx, int32_t slot, void *dst,
                                                    const void *src, size_t len) {
  (void)ctx;
  (void)slot;
  memcpy(dst, src, len);
  return TW_OK;
}
static TW_NODISCARD tw_status_t tw_kv_rx_host_poll(void *ctx, int32_t slot) {
  (void)ctx;
  (void)slot;
  return TW_OK;
}

static tw_kv_region_t *tw_kv_rx_find(tw_kv_xfer_t *x, uint64_t base) {
  for (int i = 0; i < x->n_rx; i++)
    if ((uint64_t)(uintptr_t)x->rx[i]->layout.base == base) return x->rx[i];
  return NULL;
}

/* ---- the receiver: slots granted to the senders of pieces ---- */

static void tw_kv_sender_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  (void)ep;
  tw_kv_sender_t *s = arg;
  if (!s->failed)
    TW_WARN("kvx", "ucx endpoint to a prefill worker sending staged kv failed: %s",
            ucs_status_string(status));
}

/* An endpoint made from a connection request failed (its sender is gone,
 * or closed its side): marked, the pump forgets its senders and closes it. */
static void tw_kv_accepted_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  tw_kv_xfer_t *x = arg;
  for (int i = 0; i < x->n_accepted; i++)
    if (x->accepted[i] == ep && !x->accepted_failed[i]) {
      x->accepted_failed[i] = true;
      TW_DEBUG("kvx", "a prefill worker's kv connection ended: %s", ucs_status_string(status));
    }
}

/* Forget a sender. Its endpoint is closed without waiting: error mode NONE
 * allows no forced close, and a flush towards a dead sender never ends, so
 * the close request is released to UCX. One made from a connection request
 * is the listener's (x->accepted), closed by the pump. */
static void tw_kv_sender_close(tw_kv_xfer_t *x, tw_kv_sender_t *s) {
  (void)x;
  if (s->ep && !s->accepted) {
    ucp_request_param_t prm = {.op_attr_mask = 0};
    void *req = ucp_ep_close_nbx(s->ep, &prm);
    if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
  }
  free(s->address);
  free(s);
}

/* The sender at worker address addr: found, or connected (evicting the
 * least recently used one that holds no slot when the table is full). NULL
 * when the table is full of senders holding slots (the piece waits). Called
 * outside UCX callbacks. */
static tw_kv_sender_t *tw_kv_sender_get(tw_kv_xfer_t *x, const uint8_t *addr, size_t len,
                                        const tw_proc_t *proc, ucp_ep_h accepted) {
  for (int i = 0; i < x->n_senders; i++) {
    tw_kv_sender_t *s = x->senders[i];
    if (s->address_len == len && memcmp(s->address, addr, len) == 0) {
      s->used_ns = tw_now_ns();
      if (accepted && s->accepted && !s->failed) s->ep = accepted; /* its latest connection */
      return s;
    }
  }
  if (x->n_senders == TW_KV_MAX_PEERS) {
    int victim = -1;
    for (int i = 0; i < x->n_senders; i++) {
      bool holds = false;
      for (int j = 0; j < x->n_rx && !holds; j++)
        for (int32_t k = 0; k < x->rx[j]->n_slots && !holds; k++)
          holds = x->rx[j]->slot_ctx[k].sender == x->senders[i];
      if (!holds && (victim < 0 || x->senders[i]->used_ns < x->senders[victim]->used_ns))
        victim = i;
    }
    if (victim < 0) return NULL;
    tw_kv_sender_close(x, x->senders[victim]);
    x->senders[victim] = x->senders[--x->n_senders];
  }
  tw_kv_sender_t *s = calloc(1, sizeof *s);
  if (!s || !(s->address = malloc(len))) {
    free(s);
    TW_ERROR("kvx", "out of memory for a prefill worker's endpoint");
    return NULL;
  }
  memcpy(s->address, addr, len);
  s->address_len = len;
  s->used_ns = tw_now_ns();
  s->proc = *proc;
  s->local = tw_proc_local(&x->self, &s->proc);
  const uint8_t *ucx_addr = NULL;
  size_t ucx_len = 0;
  tw_status_t st = tw_kv_unseal(TW_KV_SEAL_ADDRESS, s->address, s->address_len,
                                "a prefill worker's UCX address (staged kv)", &ucx_addr, &ucx_len);
  if (st != TW_OK) { /* never handed to UCX; kept, so that its other pieces are dropped too */
    TW_WARN("kvx", "%s: its pieces are dropped", tw_last_error());
    s->failed = true;
    x->senders[x->n_senders++] = s;
    return s;
  }
  /* error mode NONE, as the senders' (UCX 1.13's shared-memory transports
   * have no peer-failure support; PEER would leave only TCP). Only grants go
   * over it: one that never arrives costs a slot until the sender is known
   * gone (the pump) */
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
                        .address = (const ucp_address_t *)ucx_addr,
                        .err_mode = UCP_ERR_HANDLING_MODE_NONE,
                        .err_handler = {.cb = tw_kv_sender_error, .arg = s}};
  /* a sender connected through the listener is answered on that endpoint */
  s->accepted = accepted != NULL;
  s->ep = accepted;
  ucs_status_t us = accepted ? UCS_OK : ucp_ep_create(x->worker, &ep, &s->ep);
  if (us != UCS_OK) {
    TW_WARN("kvx",
            "ucp_ep_create to a prefill worker sending staged kv failed: %s (gone? its "
            "pieces are dropped)",
            ucs_status_string(us));
    s->ep = NULL;
    s->failed = true; /* kept, so that its other pieces are dropped too */
  }
  x->senders[x->n_senders++] = s;
  return s;
}

static void tw_kv_msg_sent(void *request, ucs_status_t status, void *user_data) {
  (void)status;
  free(user_data);
  ucp_request_free(request);
}

/* Send the `len`-byte header `h` as active message `id` to a sender (a
 * copy is kept until the send completes). A lost message (a dead sender)
 * costs nothing here. */
static void tw_kv_msg_send(tw_kv_sender_t *s, unsigned id, const void *h, size_t len) {
  if (!s || s->failed || !s->ep) return;
  void *copy = malloc(len);
  if (!copy) return; /* the sender times out */
  memcpy(copy, h, len);
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                             UCP_OP_ATTR_FIELD_USER_DATA,
                             .flags = UCP_AM_SEND_FLAG_EAGER,
                             .cb.send = tw_kv_msg_sent,
                             .user_data = copy};
  void *req = ucp_am_send_nbx(s->ep, id, copy, len, NULL, 0, &prm);
  if (!UCS_PTR_IS_PTR(req)) free(copy); /* sent at once, or failed: the sender times out */
}

static void tw_kv_rx_drop(tw_kv_region_t *r, tw_kv_rx_pending_t *q) {
  r->dropped++;
  free(q->addr);
  q->addr = NULL;
}

/* Grant piece `q` a free slot: TW_OK (granted, or refused and answered, or
 * dropped), TW_INPROGRESS (no slot free, or no room for its sender: it
 * waits). */
static TW_NODISCARD tw_status_t tw_kv_rx_take(tw_kv_region_t *r, tw_kv_rx_pending_t *q) {
  tw_kv_xfer_t *x = r->xfer;
  if (!q->addr) return TW_OK; /* dropped with its sender */
  tw_kv_sender_t *s = tw_kv_sender_get(x, q->addr, q->h.addr_len, &q->h.proc, q->accepted);
  if (!s) return TW_INPROGRESS;
  if (s->failed) { /* a gone sender's piece: nobody to answer */
    tw_kv_rx_drop(r, q);
    return TW_OK;
  }
  int32_t k = -1;
  void *buf = NULL;
  tw_status_t st = tw_kv_rxring_acquire(r->ring, (int64_t)q->h.offset, (int64_t)q->h.len,
                                        (uint32_t)q->h.tag, &k, &buf);
  if (st == TW_INPROGRESS) return st;
  tw_kv_am_grant_t g = {.piece = q->h.piece, .slot = k, .status = UCS_OK};
  if (st != TW_OK) { /* refused: logged by tw_err, the sender is told */
    g.status = UCS_ERR_INVALID_PARAM;
    tw_kv_msg_send(s, TW_KV_AM_GRANT_ID, &g, sizeof g);
    tw_kv_rx_drop(r, q);
    return TW_OK;
  }
  tw_kv_rx_slot_ctx_t *c = &r->slot_ctx[k];
  c->sender = s;
  c->piece = q->h.piece;
  c->nonce = q->h.proc.nonce;
  c->granted_ns = tw_now_ns();
  c->len = (int64_t)q->h.len;
  c->buf = buf;
  c->filled = false;
  g.slot_addr = (uint64_t)(uintptr_t)buf;
  tw_kv_msg_send(s, TW_KV_AM_GRANT_ID, &g, sizeof g);
  free(q->addr);
  q->addr = NULL;
  r->receiving++;
  return TW_OK;
}

static bool tw_kv_rx_queue(tw_kv_region_t *r, const tw_kv_rx_pending_t *q) {
  if (r->n_pending == r->cap_pending) {
    int32_t cap = r->cap_pending ? 2 * r->cap_pending : 64;
    tw_kv_rx_pending_t *np = malloc(sizeof *np * (size_t)cap);
    if (!np) return false;
    for (int32_t i = 0; i < r->n_pending; i++) np[i] = r->pending[(r->head + i) % r->cap_pending];
    free(r->pending);
    r->pending = np;
    r->head = 0;
    r->cap_pending = cap;
  }
  r->pending[(r->head + r->n_pending++) % r->cap_pending] = *q;
  return true;
}

/* "want" (UCX's active message callback, in ucp_worker_progress): the piece
 * waits in its region's queue; the pump grants it a slot. */
static ucs_status_t tw_kv_am_want(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param) {
  tw_kv_xfer_t *x = arg;
  tw_kv_rx_pending_t q = {0};
  tw_kv_region_t *r = NULL;
  if (header_length == sizeof q.h) memcpy(&q.h, header, sizeof q.h);
  const char *bad = header_length != sizeof q.h                       ? "malformed header"
                    : (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? "not an eager message"
                    : !q.h.addr_len || q.h.addr_len != length         ? "no sender address"
                    : !(r = tw_kv_rx_find(x, q.h.base))
                        ? "no staged pool of this worker at that address"
                        : NULL;
  if (bad) {
    TW_WARN("kvx", "refusing a staged kv piece: %s", bad);
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
    for (int i = 0; i < x->n_accepted && !q.accepted; i++)
      if (x->accepted[i] == param->reply_ep && !x->accepted_failed[i]) q.accepted = param->reply_ep;
  if (!(q.addr = malloc(length)) || (memcpy(q.addr, data, length), !tw_kv_rx_queue(r, &q))) {
    free(q.addr);
    r->dropped++;
    TW_ERROR("kvx", "out of memory queueing a staged kv piece: dropped (its sender times out)");
  }
  return UCS_OK;
}

/* "hello" (UCX's callback): answered at once on the endpoint UCX made for
 * the sender's (kv_transfer.c, pieces). A sender that did not ask for a
 * reply endpoint is not answered (it times out). */
static ucs_status_t tw_kv_am_hello(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param) {
  (void)data;
  (void)length;
  if (header_length != sizeof(uint64_t) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    TW_WARN("kvx", "ignoring a malformed greeting from a prefill worker");
    return UCS_OK;
  }
  tw_kv_xfer_t *x = arg;
  tw_kv_am_hello_ack_t *copy = malloc(sizeof *copy);
  if (!copy) return UCS_OK; /* the sender times out */
  memset(copy, 0, sizeof *copy);
  memcpy(&copy->token, header, sizeof copy->token);
  copy->proc = x->self;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                             UCP_OP_ATTR_FIELD_USER_DATA,
                             .flags = UCP_AM_SEND_FLAG_EAGER,
                             .cb.send = tw_kv_msg_sent,
                             .user_data = copy};
  void *req = ucp_am_send_nbx(param->reply_ep, TW_KV_AM_HELLO_ACK_ID, &copy->token,
                              sizeof copy->token, &copy->proc, sizeof copy->proc, &prm);
  if (!UCS_PTR_IS_PTR(req)) free(copy); /* sent at once, or failed: the sender times out */
  return UCS_OK;
}

/* "filled" (UCX's callback): the slot holds its piece, or the message
 * carries it (copied into the slot here); the pump copies it out. */
static ucs_status_t tw_kv_am_filled(void *arg, const void *header, size_t header_length, void *data,
                                    size_t length, const ucp_am_recv_param_t *param) {
  tw_kv_xfer_t *x = arg;
  tw_kv_am_filled_t f;
  tw_kv_region_t *r = NULL;
  if (header_length != sizeof f) {
    TW_WARN("kvx", "ignoring a malformed staged kv message (%zu bytes)", header_length);
    return UCS_OK;
  }
  memcpy(&f, header, sizeof f);
  if (!(r = tw_kv_rx_find(x, f.base)) || f.slot < 0 || f.slot >= r->n_slots) return UCS_OK;
  tw_kv_rx_slot_ctx_t *c = &r->slot_ctx[f.slot];
  if (!c->sender || c->piece != f.piece || c->nonce != f.nonce)
    return UCS_OK; /* a slot taken back from a sender deemed gone: ignored */
  if (length) {
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || (int64_t)length != c->len) {
      TW_WARN("kvx",
              "ignoring a staged kv piece of %zu bytes (%s) for a %lld-byte grant: its slot "
              "is taken back after %d ms",
              length, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? "rendezvous" : "eager",
              (long long)c->len, TW_KV_GRANT_TIMEOUT_MS);
      return UCS_OK;
    }
    memcpy(c->buf, data, length);
  }
  c->filled = true;
  return UCS_OK;
}

/* Take back the slots granted to sender s and drop its waiting pieces. */
static void tw_kv_rx_forget(tw_kv_xfer_t *x, tw_kv_sender_t *s) {
  s->failed = true;
  for (int j = 0; j < x->n_rx; j++) {
    tw_kv_region_t *q = x->rx[j];
    for (int32_t k = 0; k < q->n_slots; k++) {
      tw_kv_rx_slot_ctx_t *c = &q->slot_ctx[k];
      if (c->sender != s || c->filled) continue; /* a filled one is copied out as usual */
      c->sender = NULL;
      q->receiving--;
      TW_IGNORE(tw_kv_rxring_filled(q->ring, k, false)); /* never fails for a taken slot */
    }
    for (int32_t n = 0; n < q->n_pending; n++) {
      tw_kv_rx_pending_t *e = &q->pending[(q->head + n) % q->cap_pending];
      if (e->addr && e->h.addr_len == s->address_len &&
          memcmp(e->addr, s->address, s->address_len) == 0)
        tw_kv_rx_drop(q, e); /* left in the queue without an address: skipped */
    }
  }
}

/* Copy the filled slots to the pool, free the slots whose copies are done,
 * grant free slots to waiting pieces, and take back what gone senders hold. */
static TW_NODISCARD tw_status_t tw_kv_rx_pump(tw_kv_region_t *r) {
  tw_kv_xfer_t *x = r->xfer;
  tw_status_t first = TW_OK;
  for (int32_t k = 0; k < r->n_slots; k++) {
    tw_kv_rx_slot_ctx_t *c = &r->slot_ctx[k];
    if (!c->sender || !c->filled) continue;
    c->sender = NULL;
    c->filled = false;
    r->receiving--;
    tw_status_t st = tw_kv_rxring_filled(r->ring, k, true);
    if (st != TW_OK && first == TW_OK) first = st;
  }
  tw_status_t st = tw_kv_rxring_poll(r->ring, NULL);
  if (st != TW_OK && first == TW_OK) first = st;
  /* a sender that dies holds its granted slots, and grants to it may never
   * arrive: on this host its pid says it is gone; elsewhere a slot not
   * filled within TW_KV_GRANT_TIMEOUT_MS does */
  int64_t now = tw_now_ns();
  for (int i = 0; i < x->n_senders; i++) {
    tw_kv_sender_t *s = x->senders[i];
    if (s->failed || !s->local || now - s->checked_ns < 20 * 1000000LL) continue;
    bool waits = false; /* anything of it here */
    for (int j = 0; j < x->n_rx && !waits; j++) {
      tw_kv_region_t *q = x->rx[j];
      for (int32_t k = 0; k < q->n_slots && !waits; k++) waits = q->slot_ctx[k].sender == s;
      for (int32_t n = 0; n < q->n_pending && !waits; n++) {
        const tw_kv_rx_pending_t *e = &q->pending[(q->head + n) % q->cap_pending];
        waits = e->addr && e->h.addr_len == s->address_len &&
                memcmp(e->addr, s->address, s->address_len) == 0;
      }
    }
    if (!waits) continue;
    s->checked_ns = now;
    if (!tw_proc_alive(&s->proc)) {
      TW_WARN("kvx",
              "prefill worker pid %d is gone mid-handoff: the staged kv slots granted to "
              "it are taken back, its waiting pieces dropped",
              (int)s->proc.pid);
      tw_kv_rx_forget(x, s);
    }
  }
  for (int32_t k = 0; k < r->n_slots; k++) {
    tw_kv_rx_slot_ctx_t *c = &r->slot_ctx[k];
    if (c->sender && !c->filled && now - c->granted_ns > TW_KV_GRANT_TIMEOUT_MS * 1000000LL) {
      TW_WARN("kvx",
              "a staged kv slot granted to a prefill worker was not filled in %d ms: "
              "taken back, that worker's pieces dropped",
              TW_KV_GRANT_TIMEOUT_MS);
      tw_kv_rx_forget(x, c->sender);
    }
  }
  while (r->n_pending > 0) {
    tw_kv_rx_pending_t *q = &r->pending[r->head];
    st = tw_kv_rx_take(r, q);
    if (st == TW_INPROGRESS) break;
    if (st != TW_OK && first == TW_OK) first = st;
    r->head = (r->head + 1) % r->cap_pending;
    r->n_pending--;
  }
  /* a sender whose connection through the listener ended is gone */
  for (int i = 0; i < x->n_senders; i++) {
    tw_kv_sender_t *s = x->senders[i];
    for (int k = 0; s->accepted && !s->failed && k < x->n_accepted; k++)
      if (x->accepted[k] == s->ep && x->accepted_failed[k]) {
        TW_WARN("kvx",
                "the kv connection of prefill worker pid %d ended: the staged kv slots "
                "granted to it are taken back, its waiting pieces dropped",
                (int)s->proc.pid);
        tw_kv_rx_forget(x, s);
      }
  }
  /* gone senders are forgotten once nothing names them */
  for (int i = 0; i < x->n_senders; i++) {
    tw_kv_sender_t *s = x->senders[i];
    bool named = false;
    for (int j = 0; j < x->n_rx && !named; j++)
      for (int32_t k = 0; k < x->rx[j]->n_slots && !named; k++)
        named = x->rx[j]->slot_ctx[k].sender == s;
    if (!s->failed || named) continue;
    tw_kv_sender_close(x, s);
    x->senders[i--] = x->senders[--x->n_senders];
  }
  return first;
}

/* Close the connections through the listener that ended and that no
 * sender uses (without waiting: UCX finishes the close). */
static void tw_kv_accepted_reap(tw_kv_xfer_t *x) {
  for (int k = 0; k < x->n_accepted; k++) {
    bool used = false;
    for (int i = 0; i < x->n_senders && !used; i++) used = x->senders[i]->ep == x->accepted[k];
    if (!x->accepted[k] || !x->accepted_failed[k] || used) continue;
    tw_kv_ep_close_force(x, x->accepted[k], false); /* UCX finishes it */
    x->accepted[k] = NULL;
  }
}
void tw_kv_xfer_set_direct_ipc(tw_kv_xfer_t *x, bool allow) { x->ipc_allowed = allow; }

void tw_kv_xfer_progress(tw_kv_xfer_t *x) {
  for (int round = 0; round < 64; round++) {
    int events = 0;
    while (ucp_worker_progress(x->worker)) events++;
    if (x->n_pieces) tw_kv_pieces_advance(x); /* granted pieces are put */
    int32_t moved = 0;
    for (int i = 0; i < x->n_rx; i++) {
      tw_kv_region_t *r = x->rx[i];
      int32_t before = r->n_pending;
      TW_IGNORE(tw_kv_rx_pump(r)); /* a failed copy is logged; its blocks never land */
      moved += before - r->n_pending;
    }
    if (x->n_accepted) tw_kv_accepted_reap(x);
    if (!events && !moved) break;
  }
}
void tw_kv_xfer_stats(const tw_kv_xfer_t *x, tw_kv_xfer_stats_t *out) {
  *out = x->stats;
  out->pieces_in_flight = x->n_pieces;
  out->endpoints = 0;
  for (int i = 0; i < x->n_peers; i++) out->endpoints += x->peers[i]->ep != NULL;
}

int tw_kv_xfer_wait_fd(tw_kv_xfer_t *x) {
  int fd = -1;
  if (ucp_worker_get_efd(x->worker, &fd) != UCS_OK) return -1;
  for (int i = 0; i < 64; i++) {
    tw_kv_xfer_progress(x);
    if (x->n_pieces > 0) return -1; /* pieces to put or answer: do not sleep */
    /* copies out of a ring finish without a UCX event: do not sleep on them */
    for (int k = 0; k < x->n_rx; k++) {
      tw_kv_rxring_stats_t s;
      tw_kv_rxring_stats(x->rx[k]->ring, &s);
      if (s.slots_in_use > 0 || x->rx[k]->n_pending > 0) return -1;
    }
    ucs_status_t s = ucp_worker_arm(x->worker);
    if (s == UCS_OK) return fd;
    if (s != UCS_ERR_BUSY) return -1;
  }
  return -1; /* events keep coming: do not sleep */
}

/* The ring of a staged region: pinned slots (device pools) or malloc'd ones
 * (a host pool asked to stage), the copies' stream and events. */
static TW_NODISCARD tw_status_t tw_kv_rx_ring_init(tw_kv_region_t *r,
                                                   const tw_kv_region_params_t *prm) {
  tw_kv_xfer_t *x = r->xfer;
  const tw_kv_layout_t *l = &r->layout;
  TW_CHECK(tw_kv_rxring_size_from_env(&r->n_slots, &r->slot_bytes));
  if (prm && prm->n_slots > 0) r->n_slots = prm->n_slots;
  if (prm && prm->slot_bytes > 0) r->slot_bytes = prm->slot_bytes;
  if (x->n_rx == TW_KV_MAX_RX_REGIONS)
    return tw_err(TW_ERR_EXHAUSTED, "at most %d staged kv pools per ucx worker",
                  TW_KV_MAX_RX_REGIONS);
  size_t bytes = (size_t)r->n_slots * (size_t)r->slot_bytes;
  r->event = calloc((size_t)r->n_slots, sizeof *r->event);
  r->slot_ctx = calloc((size_t)r->n_slots, sizeof *r->slot_ctx);
  if (!r->event || !r->slot_ctx)
    return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the kv staging ring");
  tw_kv_rxring_params_t rp = {.pool = l->base,
                              .n_layers = l->n_layers,
                              .n_blocks = l->n_blocks,
                              .block_bytes = l->block_bytes,
                              .layer_stride_bytes = l->layer_stride_bytes,
                              .total_bytes = l->total_bytes,
                              .ring_blocks = l->ring_blocks,
                              .n_ring_blocks = l->n_ring_blocks,
                              .ring_layers = l->ring_layers,
                              .n_slots = r->n_slots,
                              .slot_bytes = r->slot_bytes};
  /* the slots are allocated by UCX (shared memory where it can), so that a
   * sender's put into a slot is a plain copy (or RDMA), never emulated */
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = NULL,
      .length = bytes,
      .flags = UCP_MEM_MAP_ALLOCATE,
      .memory_type = UCS_MEMORY_TYPE_HOST};
  ucs_status_t us = ucp_mem_map(x->ctx, &mp, &r->slots_memh);
  ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
  if (us == UCS_OK) us = ucp_mem_query(r->slots_memh, &ma);
  if (us != UCS_OK) {
    return tw_err(TW_ERR_NO_MEMORY, "ucp_mem_map of the %zu-byte kv staging ring failed: %s", bytes,
                  ucs_status_string(us));
  }
  r->slots = ma.address;
  if (l->on_device) {
    TW_CHECK(tw_cudart_load(&x->cudart));
    /* pinned, so that the copies to the device run asynchronously */
    if (x->cudart.host_register && x->cudart.host_register(r->slots, bytes, 0) == 0)
      r->slots_pinned = true;
    else
      TW_WARN("kvx",
              "cudaHostRegister of the %zu-byte kv staging ring failed: its copies to "
              "the device run from pageable memory (slower)",
              bytes);
    if (x->cudart.stream_create(&r->stream, TW_CUDA_STREAM_NON_BLOCKING) != 0) {
      r->stream = NULL;
      return tw_err(TW_ERR_CUDA, "cudaStreamCreate for the kv staging copies failed");
    }
    for (int32_t k = 0; k < r->n_slots; k++)
      if (x->cudart.event_create(&r->event[k], TW_CUDA_EVENT_DISABLE_TIMING) != 0) {
        r->event[k] = NULL;
        return tw_err(TW_ERR_CUDA, "cudaEventCreate for the kv staging copies failed");
      }
    rp.copy = (tw_kv_rxring_copy_t){tw_kv_rx_cuda_start, tw_kv_rx_cuda_poll, r};
  } else {
    rp.copy = (tw_kv_rxring_copy_t){tw_kv_rx_host_start, tw_kv_rx_host_poll, r};
  }
  rp.slots_mem = r->slots;
  for (int32_t k = 0; k < r->n_slots; k++)
    r->slot_ctx[k] = (tw_kv_rx_slot_ctx_t){.r = r, .slot = k};
  TW_CHECK(tw_kv_rxring_create(&rp, &r->ring));
  /* senders put into the slots: the ring's rkey is what the region publishes */
  void *buf = NULL;
  size_t len = 0;
  us = ucp_rkey_pack(x->ctx, r->slots_memh, &buf, &len);
  if (us != UCS_OK)
    return tw_err(TW_ERR_TRANSPORT, "ucp_rkey_pack of the kv staging ring failed: %s",
                  ucs_status_string(us));
  r->rkey = malloc(len + sizeof(tw_kv_ipc_desc_t)); /* room for a CUDA IPC descriptor */
  if (!r->rkey) {
    ucp_rkey_buffer_release(buf);
    return tw_err(TW_ERR_NO_MEMORY, "cannot copy a %zu-byte rkey", len);
  }
  memcpy(r->rkey, buf, len);
  r->rkey_len = len;
  ucp_rkey_buffer_release(buf);
  x->rx[x->n_rx++] = r;
  return TW_OK;
}

/* Append a tw_kv_ipc_desc_t of the device pool to the region's rkey blob
 * (the direct path, see above). Failure only costs the direct path: logged,
 * the blob stays the ucx rkey alone. TWAIN_KV_IPC=0 turns it off. */
static bool tw_kv_ipc_export(tw_kv_region_t *r) {
  const char *off = getenv("TWAIN_KV_IPC");
  if (off && strcmp(off, "0") == 0) {
    TW_INFO("kvx", "kv pool not exported over CUDA IPC (TWAIN_KV_IPC=0)");
    return false;
  }
  tw_cudart_t *rt = &r->xfer->cudart;
  tw_kv_ipc_desc_t d;
  memset(&d, 0, sizeof d);
  if (tw_cudart_load(rt) != TW_OK || !rt->ipc_get || !rt->ipc_open || !rt->ipc_close ||
      !rt->get_device) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: the CUDA runtime lacks IPC");
    return false;
  }
  int e = rt->get_device(&d.device);
  if (e == 0) e = rt->ipc_get(&d.handle, r->layout.base);
  if (e != 0) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: cudaIpcGetMemHandle failed (cuda error %d)",
            e);
    return false;
  }
  tw_proc_boot_id(d.boot_id);
  d.pid = (int32_t)getpid();
  d.pool_bytes = r->layout.total_bytes;
  d.ucx_rkey_len = (uint32_t)r->rkey_len;
  d.desc_bytes = (uint32_t)sizeof d;
  memcpy(d.magic, TW_KV_IPC_MAGIC, sizeof d.magic);
  uint8_t *blob = realloc(r->rkey, r->rkey_len + sizeof d);
  if (!blob) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: out of memory");
    return false;
  }
  memcpy(blob + r->rkey_len, &d, sizeof d);
  r->rkey = blob;
  r->rkey_len += sizeof d;
  TW_INFO("kvx",
          "kv pool exported over CUDA IPC (device %d, %lld bytes): prefill workers on "
          "this host copy into it device to device",
          d.device, (long long)d.pool_bytes);
  return true;
}

/* Split an (unsealed) rkey blob into the ucx rkey (*ucx_len_p bytes at its
 * start) and an optional descriptor. Errors: TW_ERR_INVALID_ARGUMENT (a
 * descriptor whose fields cannot describe a pool). */
static TW_NODISCARD tw_status_t tw_kv_rkey_split(const void *blob, size_t len,
                                                 tw_kv_ipc_desc_t *desc, bool *has,
                                                 size_t *ucx_len_p) {
  *has = false;
  *ucx_len_p = len;
  if (len < sizeof *desc) return TW_OK;
  memcpy(desc, (const uint8_t *)blob + len - sizeof *desc, sizeof *desc);
  if (memcmp(desc->magic, TW_KV_IPC_MAGIC, sizeof desc->magic) != 0) return TW_OK;
  if (desc->desc_bytes != sizeof *desc || desc->ucx_rkey_len != len - sizeof *desc ||
      desc->pid <= 0 || desc->device < 0 || desc->pool_bytes <= 0 ||
      memchr(desc->boot_id, 0, sizeof desc->boot_id) == NULL)
    return tw_err_quiet(
        TW_ERR_INVALID_ARGUMENT,
        "the decode worker's rkey carries a malformed CUDA IPC descriptor (%u bytes, "
        "ucx part %u of %zu bytes, pid %d, device %d, pool %lld bytes)",
        desc->desc_bytes, desc->ucx_rkey_len, len - sizeof *desc, (int)desc->pid, (int)desc->device,
        (long long)desc->pool_bytes);
  *has = true;
  *ucx_len_p = desc->ucx_rkey_len;
  return TW_OK;
}

/* Open the peer's descriptor once (a device source, same host, another
 * process); on failure the peer keeps the UCX paths. */
static void tw_kv_ipc_open(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (!p->has_ipc || p->ipc_ptr || p->ipc_failed) return;
  p->ipc_failed = true; /* until it opens */
  char boot[40];
  tw_proc_boot_id(boot);
  const char *off = getenv("TWAIN_KV_IPC");
  const char *why = NULL;
  if (off && strcmp(off, "0") == 0)
    why = "TWAIN_KV_IPC=0";
  else if (!boot[0] || strcmp(boot, p->ipc.boot_id) != 0)
    why = "another host";
  else if (p->ipc.pid == (int32_t)getpid())
    why = "the same process";
  else if (tw_cudart_load(&x->cudart) != TW_OK || !x->cudart.ipc_open)
    why = "no CUDA IPC";
  if (!why) {
    if (!x->ipc_stream &&
        (x->cudart.stream_create(&x->ipc_stream, TW_CUDA_STREAM_NON_BLOCKING) != 0 ||
         x->cudart.event_create(&x->ipc_event, TW_CUDA_EVENT_DISABLE_TIMING) != 0)) {
      why = "cannot create its stream";
    } else {
      int e = x->cudart.ipc_open(&p->ipc_ptr, p->ipc.handle, TW_CUDA_IPC_LAZY_PEER);
      if (e != 0) {
        p->ipc_ptr = NULL;
        TW_WARN("kvx",
                "cudaIpcOpenMemHandle of a decode worker's kv pool (pid %d, device %d) "
                "failed (cuda error %d): its handoffs take the ucx path",
                (int)p->ipc.pid, (int)p->ipc.device, e);
        return;
      }
      p->ipc_failed = false;
      TW_INFO("kvx",
              "kv pool of decode worker pid %d (device %d, %lld bytes) mapped over CUDA "
              "IPC: handoffs to it are direct device-to-device copies",
              (int)p->ipc.pid, (int)p->ipc.device, (long long)p->ipc.pool_bytes);
      return;
    }
  }
  TW_INFO("kvx", "a decode worker's CUDA IPC kv descriptor is not used (%s): ucx path", why);
}

TW_NODISCARD tw_status_t tw_kv_region_register(tw_kv_xfer_t *x, const tw_kv_layout_t *layout,
                                               tw_kv_region_t **region_p) {
  return tw_kv_region_register_ex(x, layout, NULL, region_p);
}

/* TWAIN_KV_PATH=ipc, one host (twain serve): the device pool is reached over
 * CUDA IPC alone, no ucx registration and no host mirror. */
static TW_NODISCARD tw_status_t tw_kv_region_init_ipc(tw_kv_region_t *r) {
  r->rkey = malloc(1);
  r->rkey_len = 0;
  if (!r->rkey) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a kv rkey blob");
  if (!tw_kv_ipc_export(r))
    return tw_err(TW_ERR_UNSUPPORTED,
                  "TWAIN_KV_PATH=ipc, but the device kv pool cannot be exported "
                  "over CUDA IPC (see the warning above); unset it to use ucx");
  TW_INFO("kvx",
          "kv handoff mode (receive): device KV pool over CUDA IPC only "
          "(TWAIN_KV_PATH=ipc): prefill workers on this host copy into it, nothing else can");
  return TW_OK;
}

/* The staged receive path: the ring, its rkey, plus a CUDA IPC descriptor
 * of a device pool (a prefill worker on this host may copy into it
 * directly). */
static TW_NODISCARD tw_status_t tw_kv_region_init_staged(tw_kv_region_t *r,
                                                         const tw_kv_region_params_t *prm) {
  const tw_kv_layout_t *layout = &r->layout;
  TW_CHECK(tw_kv_rx_ring_init(r, prm));
  if (layout->on_device) (void)tw_kv_ipc_export(r); /* optional: logged when it fails */
  TW_INFO("kvx",
          "registered kv pool: %lld bytes, %d layers x %d blocks, STAGED receive: a ring "
          "of %d x %lld MiB %s bounce buffers (TWAIN_KV_STAGING_SLOTS, TWAIN_KV_STAGING_SLOT_MB), "
          "copied to the pool on its own stream; no pinned mirror%s",
          (long long)layout->total_bytes, layout->n_layers, layout->n_blocks, r->n_slots,
          (long long)(r->slot_bytes >> 20), r->slots_pinned ? "pinned" : "host",
          !layout->on_device     ? " (host pool, staged on request: TWAIN_KV_PATH=staged)"
          : r->xfer->cuda_native ? " (TWAIN_KV_PATH=staged)"
                                 : " (UCX has no CUDA support)");
  return TW_OK;
}

/* The pool itself registered (ucp_mem_map, host or CUDA memory) and its
 * rkey packed, plus a CUDA IPC descriptor of a device pool. */
static TW_NODISCARD tw_status_t tw_kv_region_init_mapped(tw_kv_region_t *r) {
  tw_kv_xfer_t *x = r->xfer;
  const tw_kv_layout_t *layout = &r->layout;
  r->registered = layout->base;
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = r->registered,
      .length = (size_t)layout->total_bytes,
      .memory_type = layout->on_device ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST};
  ucs_status_t us = ucp_mem_map(x->ctx, &mp, &r->memh);
  if (us != UCS_OK) {
    r->memh = NULL;
    return tw_err(TW_ERR_TRANSPORT, "ucp_mem_map of %lld bytes failed: %s",
                  (long long)layout->total_bytes, ucs_status_string(us));
  }
  void *buf = NULL;
  size_t len = 0;
  us = ucp_rkey_pack(x->ctx, r->memh, &buf, &len);
  if (us != UCS_OK)
    return tw_err(TW_ERR_TRANSPORT, "ucp_rkey_pack failed: %s", ucs_status_string(us));
  r->rkey = malloc(len);
  if (!r->rkey) {
    ucp_rkey_buffer_release(buf);
    return tw_err(TW_ERR_NO_MEMORY, "cannot copy a %zu-byte rkey", len);
  }
  memcpy(r->rkey, buf, len);
  r->rkey_len = len;
  ucp_rkey_buffer_release(buf);
  if (layout->on_device) (void)tw_kv_ipc_export(r); /* optional: logged when it fails */
  TW_INFO("kvx", "registered kv pool: %lld bytes, %d layers x %d blocks, rkey %zu bytes",
          (long long)layout->total_bytes, layout->n_layers, layout->n_blocks, len);
  TW_INFO("kvx", "kv handoff mode (receive): %s",
          !layout->on_device
              ? "host KV pool, registered in place"
              : "device KV pool DIRECT: registered as CUDA memory (UCX cuda transports)");
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_region_register_ex(tw_kv_xfer_t *x, const tw_kv_layout_t *layout,
                                                  const tw_kv_region_params_t *prm,
                                                  tw_kv_region_t **region_p) {
  if (!layout || !layout->base || layout->total_bytes <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv region: empty pool layout");
  tw_kv_region_t *r = calloc(1, sizeof *r);
  if (!r) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a kv region");
  r->xfer = x;
  r->layout = *layout;
  /* TWAIN_KV_PATH=staged: stage even with CUDA transports (prefill workers
   * without them, nodes without a cuda_ipc path, the staged benchmark), and
   * even a host pool; a host pool otherwise stages only when asked (tests,
   * benchmarks: the staged receive path on a machine without a GPU, copies
   * out of the ring by memcpy) */
  const char *want = getenv("TWAIN_KV_PATH");
  bool force_staged = want && strcmp(want, "staged") == 0;
  tw_status_t st;
  if (layout->on_device && want && strcmp(want, "ipc") == 0) {
    st = tw_kv_region_init_ipc(r);
  } else {
    r->staged =
        (prm && prm->staging_ring) || force_staged || (layout->on_device && !x->cuda_native);
    st = r->staged ? tw_kv_region_init_staged(r, prm) : tw_kv_region_init_mapped(r);
  }
  /* every path publishes its rkey blob sealed (kv_seal.h) */
  if (st == TW_OK)
    st = tw_kv_seal(TW_KV_SEAL_RKEY, r->rkey, r->rkey_len, &r->sealed_rkey, &r->sealed_rkey_len);
  if (st != TW_OK) {
    tw_kv_region_unregister(r);
    return st;
  }
  *region_p = r;
  return TW_OK;
}

void tw_kv_region_unregister(tw_kv_region_t *r) {
  if (!r) return;
  tw_kv_xfer_t *x = r->xfer;
  for (int i = 0; i < x->n_rx; i++)
    if (x->rx[i] == r) x->rx[i] = x->rx[--x->n_rx];
  /* no copy may still write the pool (a slot granted now is unmapped below:
   * a sender's put into it fails on its side) */
  if (r->ring && tw_kv_rxring_drain(r->ring, 10000) != TW_OK)
    TW_WARN("kvx", "unregistering a staged kv pool with copies still running");
  for (int32_t i = 0; i < r->n_pending; i++) /* their senders time out */
    free(r->pending[(r->head + i) % r->cap_pending].addr);
  free(r->pending);
  for (int32_t k = 0; r->event && k < r->n_slots; k++)
    if (r->event[k]) x->cudart.event_destroy(r->event[k]);
  if (r->stream) x->cudart.stream_destroy(r->stream);
  if (r->slots && r->slots_pinned && x->cudart.host_unregister) x->cudart.host_unregister(r->slots);
  if (r->slots_memh) ucp_mem_unmap(x->ctx, r->slots_memh); /* frees the slots */
  tw_kv_rxring_destroy(r->ring);
  free(r->event);
  free(r->slot_ctx);
  if (r->memh) ucp_mem_unmap(x->ctx, r->memh);
  free(r->rkey);
  free(r->sealed_rkey);
  free(r);
}

const void *tw_kv_region_rkey(const tw_kv_region_t *r, size_t *len_p) {
  *len_p = r->sealed_rkey_len;
  return r->sealed_rkey;
}

void tw_kv_region_remote_layout(const tw_kv_region_t *r, tw_kv_remote_layout_t *o) {
  const tw_kv_layout_t *l = &r->layout;
  *o = (tw_kv_remote_layout_t){.dtype = l->dtype,
                               .on_device = l->on_device,
                               .n_layers = l->n_layers,
                               .n_blocks = l->n_blocks,
                               .block_size = l->block_size,
                               .n_kv_heads = l->n_kv_heads_local,
                               .head_dim = l->head_dim,
                               .layer_stride_bytes = l->layer_stride_bytes,
                               .block_bytes = l->block_bytes,
                               .remote_base = (uint64_t)(uintptr_t)l->base,
                               .total_bytes = l->total_bytes,
                               .staging_slot_bytes = r->staged ? r->slot_bytes : 0,
                               .ring_blocks = l->ring_blocks,
                               .n_ring_blocks = l->n_ring_blocks,
                               .ring_layers = l->ring_layers};
}

TW_NODISCARD tw_status_t tw_kv_region_landed(tw_kv_region_t *r, uint64_t tag, const int32_t *ids,
                                             int32_t n, const int32_t *firsts) {
  if (!r->staged) return TW_OK;
  tw_status_t st = tw_kv_rx_pump(r);
  if (st != TW_OK) return st;
  return tw_kv_rxring_landed(r->ring, (uint32_t)tag, ids, n, firsts);
}

TW_NODISCARD tw_status_t tw_kv_region_commit(tw_kv_region_t *r, uint64_t tag, const int32_t *ids,
                                             int32_t n, const int32_t *firsts, int timeout_ms) {
  int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
  for (;;) {
    tw_kv_xfer_progress(r->xfer);
    tw_status_t st = tw_kv_region_landed(r, tag, ids, n, firsts);
    if (st != TW_INPROGRESS) return st;
    if (tw_now_ns() > deadline)
      return tw_err(TW_ERR_DEADLINE, "the kv of handoff %llu was not all in the pool within %d ms",
                    (unsigned long long)tag, timeout_ms);
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

bool tw_kv_region_staging_stats(const tw_kv_region_t *r, tw_kv_rxring_stats_t *out) {
  if (!r->ring) return false;
  tw_kv_rxring_stats(r->ring, out);
  return true;
}

void tw_kv_layer_firsts(const tw_model_config_t *c, int32_t n_tokens, int32_t block_size,
                        int32_t *firsts) {
  for (int32_t l = 0; l < c->n_layers; l++)
    firsts[l] = tw_kv_layer_first_block(n_tokens, block_size, c->layer_types[l] == TW_LAYER_SLIDING,
                                        c->sliding_window);
}
static void tw_kv_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  tw_kv_peer_t *p = arg;
  p->failed = 1;
  TW_WARN("kvx", "ucx endpoint to a decode worker failed: %s", ucs_status_string(status));
}

/* Which transports the endpoint's lanes use, from ucp_ep_print_info (UCX
 * 1.13 has no query for it): "lane[i]:  n:<tl>/<device> md[..] -> ... rma_bw#k"
 * per lane (rma_bw#k: the lane is the k-th high-bandwidth RMA lane), then in
 * 1.13 (and with protocols v1 later) "put[i]: ..." for each RMA lane. In the
 * list "(put)" marks RMA lanes, "(rma_bw)" rma_bw lanes. With protocols v2 a
 * put into CUDA memory goes over cuda_ipc's put_zcopy from UCX 1.14 on; in
 * 1.13 put/offload/zcopy takes RMA lanes only (which need put short/bcopy),
 * so it is put/am/bcopy: active messages of a few KiB over sysv/posix, each
 * copied out of and into device memory with cuda_copy (about 0.8 GB/s on the
 * H200), marked put_am_emulated and logged. A device pool may only be put
 * into over a lane whose transport
 * reaches CUDA memory (cuda_ipc): without one, UCX emulates the put with
 * active messages and the receiver's UCX writes the payload into the
 * destination address with a host memcpy (ucp rma_sw), a segfault on a
 * device pointer. That is the crash the first direct-path trial hit (decode
 * worker SIGSEGV at the first handoff, the prefill worker's flush timing
 * out): with protocols v1, UCX 1.13 never selects cuda_ipc as an RMA lane
 * (RMA lanes need put short/bcopy; cuda_ipc is zero-copy only), so every put
 * into the registered device pool was emulated. */
#define TW_KV_MAX_LANES 16
static void tw_kv_ep_lanes(tw_kv_peer_t *p, const tw_kv_xfer_t *x) {
  const bool proto_v2 = x->proto_v2;
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  p->lanes[0] = 0;
  p->cuda_ipc = false;
  p->put_am_emulated = false;
  if (!f) return;
  ucp_ep_print_info(p->ep, f);
  fclose(f);
  if (!text) return;
  char tl[TW_KV_MAX_LANES][24] = {{0}};
  bool put[TW_KV_MAX_LANES] = {false}, rma_bw[TW_KV_MAX_LANES] = {false};
  for (char *line = text, *nl; line && *line; line = nl ? nl + 1 : NULL) {
    nl = strchr(line, '\n');
    if (nl) *nl = 0;
    const char *q;
    int i = -1, n = 0;
    if ((q = strstr(line, "lane[")) && sscanf(q, "lane[%d]: %*d:%n", &i, &n) == 1 && n > 0 &&
        i >= 0 && i < TW_KV_MAX_LANES) {
      size_t k = strcspn(q + n, "/ ");
      snprintf(tl[i], sizeof tl[i], "%.*s", (int)k, q + n);
      rma_bw[i] = strstr(q + n, " rma_bw#") != NULL;
    } else if ((q = strstr(line, "put[")) && sscanf(q, "put[%d]", &i) == 1 && i >= 0 &&
               i < TW_KV_MAX_LANES) {
      put[i] = true;
    }
  }
  free(text);
  size_t used = 0;
  int n_lanes = 0, n_tcp = 0, n_put = 0;
  for (int i = 0; i < TW_KV_MAX_LANES; i++) {
    if (!tl[i][0]) continue;
    n_lanes++;
    n_tcp += strcmp(tl[i], "tcp") == 0;
    n_put += put[i];
    /* v1: an RMA lane (put[i], never cuda_ipc); v2: a cuda_ipc lane is an
     * rma_bw lane, put over from 1.14 on, before that the rkey's memory type
     * makes the emulated put land in device memory */
    if ((put[i] || proto_v2) && strcmp(tl[i], "cuda_ipc") == 0) {
      p->cuda_ipc = true;
      p->put_am_emulated = !put[i] && !(x->put_rma_bw && rma_bw[i]);
    }
    int w = snprintf(p->lanes + used, sizeof p->lanes - used, "%s%s%s", used ? " " : "", tl[i],
                     put[i]      ? "(put)"
                     : rma_bw[i] ? "(rma_bw)"
                                 : "");
    if (w < 0 || (size_t)w >= sizeof p->lanes - used) break;
    used += (size_t)w;
  }
  /* no lane puts (v1), or only TCP lanes (v2): UCX would emulate a put with
   * active messages that the receiver's UCX acknowledges (kv_transfer.c,
   * pieces), so pieces for unmapped slots travel in their messages */
  p->am_pieces = n_lanes > 0 && n_put == 0 && (!proto_v2 || n_tcp == n_lanes);
}

TW_NODISCARD tw_status_t tw_kv_xfer_peer(tw_kv_xfer_t *x, const void *sealed_address,
                                         size_t sealed_address_len, const void *sealed_rkey,
                                         size_t sealed_rkey_len, tw_kv_peer_t **peer_p) {
  /* nothing reaches UCX before both blobs are checked (kv_seal.h) */
  const uint8_t *address = NULL, *rkey = (const uint8_t *)"";
  size_t address_len = 0, rkey_len = 0;
  TW_CHECK(tw_kv_unseal(TW_KV_SEAL_ADDRESS, sealed_address, sealed_address_len,
                        "the decode worker's UCX address", &address, &address_len));
  if (sealed_rkey_len) /* empty: no rkey (nothing is unpacked) */
    TW_CHECK(tw_kv_unseal(TW_KV_SEAL_RKEY, sealed_rkey, sealed_rkey_len, "the decode worker's rkey",
                          &rkey, &rkey_len));
  tw_kv_ipc_desc_t desc;
  bool has = false;
  size_t ucx_len = 0;
  TW_CHECK(tw_kv_rkey_split(rkey, rkey_len, &desc, &has, &ucx_len));
  tw_kv_peer_t *p = NULL;
  for (int i = 0; i < x->n_peers; i++) {
    tw_kv_peer_t *q = x->peers[i];
    if (q->address_len == address_len && memcmp(q->address, address, address_len) == 0) {
      if (q->failed) { /* drop and reconnect */
        tw_kv_peer_close(x, q);
        x->peers[i] = x->peers[--x->n_peers];
        break;
      }
      p = q;
      break;
    }
  }
  if (!p) {
    if (x->n_peers == TW_KV_MAX_PEERS) { /* evict the oldest */
      tw_kv_peer_close(x, x->peers[0]);
      memmove(x->peers, x->peers + 1, sizeof x->peers[0] * (size_t)(--x->n_peers));
    }
    p = calloc(1, sizeof *p);
    if (!p || !(p->address = malloc(address_len))) {
      free(p);
      return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a ucx peer");
    }
    memcpy(p->address, address, address_len);
    p->address_len = address_len;
    tw_kv_lsn_desc_t lsn;
    bool has_lsn = tw_kv_lsn_split(address, address_len, &lsn);
    /* Error mode NONE: UCX 1.13's shared-memory transports (cma, posix, sysv)
     * have no peer-failure support, so PEER mode would leave only TCP with
     * software-emulated puts (~0.05 GB/s measured here vs several GB/s over
     * cma). A dead decode worker is caught by the flush timeout instead, and
     * by the router's heartbeat expiry. */
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)p->address,
        .err_mode = UCP_ERR_HANDLING_MODE_NONE,
        .err_handler = {.cb = tw_kv_ep_error, .arg = p}};
    /* both sides on TCP alone: through the receiver's listener (above) */
    struct sockaddr_storage sa = {0};
    p->via_listener = has_lsn && x->tcp_only;
    if (p->via_listener) {
      socklen_t sl;
      if (lsn.family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&sa;
        a->sin_family = AF_INET;
        a->sin_port = htons(lsn.port);
        memcpy(&a->sin_addr, lsn.ip, 4);
        sl = sizeof *a;
      } else {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&sa;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(lsn.port);
        memcpy(&a->sin6_addr, lsn.ip, 16);
        sl = sizeof *a;
      }
      ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      ep.sockaddr = (ucs_sock_addr_t){.addr = (const struct sockaddr *)&sa, .addrlen = sl};
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER; /* TCP detects a dead peer */
    } /* else UCX reads its address and stops before the descriptor */
    ucs_status_t us = ucp_ep_create(x->worker, &ep, &p->ep);
    if (us != UCS_OK) {
      free(p->address);
      free(p);
      return tw_err(TW_ERR_TRANSPORT, "ucp_ep_create to a decode worker failed: %s",
                    ucs_status_string(us));
    }
    tw_kv_ep_lanes(p, x);
    if (p->via_listener) { /* TCP alone, lanes chosen once connected (tw_kv_xfer_greet) */
      p->am_pieces = true;
      if (!p->lanes[0]) snprintf(p->lanes, sizeof p->lanes, "tcp (through the listener)");
    }
    x->peers[x->n_peers++] = p;
    TW_INFO("kvx", "ucx endpoint to a decode worker created (%d cached; %s; lanes: %s)", x->n_peers,
            p->via_listener ? "through its listener" : "by worker address",
            p->lanes[0] ? p->lanes : "unknown");
  }
  if (!p->rkey_buf || p->rkey_len != rkey_len || memcmp(p->rkey_buf, rkey, rkey_len) != 0) {
    if (p->ipc_ptr && (!has || memcmp(&desc.handle, &p->ipc.handle, sizeof desc.handle) != 0)) {
      if (p->ipc_pending) x->cudart.event_sync(x->ipc_event);
      x->cudart.ipc_close(p->ipc_ptr);
      p->ipc_ptr = NULL;
    }
    if (!has || memcmp(&desc, &p->ipc, sizeof desc) != 0) p->ipc_failed = false;
    p->has_ipc = has;
    if (has) p->ipc = desc;
    tw_kv_peer_unmap(x, p); /* another ring, maybe elsewhere */
    if (p->rkey) ucp_rkey_destroy(p->rkey);
    p->rkey = NULL;
    free(p->rkey_buf);
    p->rkey_buf = malloc(rkey_len ? rkey_len : 1);
    if (!p->rkey_buf) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate an rkey copy");
    memcpy(p->rkey_buf, rkey, rkey_len);
    p->rkey_len = rkey_len;
    /* an empty ucx part: a pool reachable over CUDA IPC alone (TWAIN_KV_PATH=ipc) */
    /* an empty ucx part: a pool reachable over CUDA IPC alone
     * (TWAIN_KV_PATH=ipc), or a staged receiver (pieces into its ring) */
    ucs_status_t us = ucx_len ? ucp_ep_rkey_unpack(p->ep, p->rkey_buf, &p->rkey) : UCS_OK;
    if (us != UCS_OK) {
      p->rkey = NULL;
      p->rkey_len = 0;
      return tw_err(TW_ERR_TRANSPORT, "ucp_ep_rkey_unpack failed: %s", ucs_status_string(us));
    }
  }
  p->ipc_allowed = x->ipc_allowed;
  if (p->ipc_allowed)
    tw_kv_ipc_open(x, p); /* once per descriptor: the path is known before the first put */
  *peer_p = p;
  return TW_OK;
}

int32_t tw_kv_layer_first_block(int32_t n_tokens, int32_t block_size, bool sliding,
                                int32_t window) {
  if (!sliding || n_tokens <= window) return 0;
  return (n_tokens - window) / block_size;
}

int32_t tw_kv_blocks_final(int32_t end, int32_t n_tokens, int32_t n_blocks, int32_t block_size) {
  return end >= n_tokens ? n_blocks : end / block_size;
}

static TW_NODISCARD tw_status_t tw_kv_block_ptr(const tw_kv_layout_t *l, int32_t layer, int32_t id,
                                                char **ptr_p) {
  if (layer < 0 || layer >= l->n_layers || id < 0 || id >= tw_kv_layer_blocks(l, layer))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv block %d of layer %d is outside the pool (%d x %d)",
                  id, layer, l->n_layers, tw_kv_layer_blocks(l, layer));
  *ptr_p = (char *)l->base + tw_kv_layer_offset(l, layer) + (int64_t)id * l->block_bytes;
  return TW_OK;
}

/* Wait (progressing, at most 10 s) for a put request, then free it. */
static TW_NODISCARD tw_status_t tw_kv_req_wait(tw_kv_xfer_t *x, void **req_p) {
  void *req = *req_p;
  *req_p = NULL;
  if (req == NULL) return TW_OK;
  ucs_status_t s;
  int64_t deadline = tw_now_ns() + 10 * 1000000000LL;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    ucp_worker_progress(x->worker);
    if (tw_now_ns() > deadline) {
      ucp_request_free(req);
      return tw_err(TW_ERR_DEADLINE, "a ucx put from the kv bounce ring did not complete in 10 s");
    }
  }
  ucp_request_free(req);
  if (s != UCS_OK) return tw_err(TW_ERR_TRANSPORT, "ucx put failed: %s", ucs_status_string(s));
  return TW_OK;
}

static void tw_kv_ring_free(tw_kv_xfer_t *x) {
  tw_kv_ring_t *g = &x->ring;
  for (int k = 0; k < TW_KV_RING_SLOTS; k++) {
    TW_IGNORE(tw_kv_req_wait(x, &g->req[k])); /* teardown: a failed put is logged there */
    if (g->piece[k] && x->pieces[g->piece[k] % TW_KV_PIECES].id == g->piece[k])
      TW_IGNORE(tw_kv_pieces_wait(x, NULL, TW_KV_WAIT_ID, g->piece[k], 10000)); /* logged */
    if (g->event[k]) {
      x->cudart.event_sync(g->event[k]); /* no copy may still write the slot */
      x->cudart.event_destroy(g->event[k]);
    }
  }
  if (g->stream) x->cudart.stream_destroy(g->stream);
  if (g->memh) ucp_mem_unmap(x->ctx, g->memh);
  if (g->mem && g->pinned) x->cudart.free_host(g->mem);
  else free(g->mem);
  *g = (tw_kv_ring_t){0};
}

/* The ring, pinned with its stream and events when it serves device sources. */
static TW_NODISCARD tw_status_t tw_kv_ring_init(tw_kv_xfer_t *x, bool device) {
  tw_kv_ring_t *g = &x->ring;
  if (g->mem && (g->pinned || !device)) return TW_OK;
  if (g->mem) tw_kv_ring_free(x); /* a host ring, now needed for device copies */
  size_t bytes = (size_t)TW_KV_RING_SLOTS * (size_t)TW_KV_RING_SLOT_BYTES;
  if (device) {
    TW_CHECK(tw_cudart_load(&x->cudart));
    void *m = NULL;
    if (x->cudart.host_alloc(&m, bytes, 0) != 0)
      return tw_err(TW_ERR_NO_MEMORY, "cudaHostAlloc of the %zu-byte kv bounce ring failed", bytes);
    g->mem = m;
    g->pinned = true;
    if (x->cudart.stream_create(&g->stream, TW_CUDA_STREAM_NON_BLOCKING) != 0) {
      g->stream = NULL;
      tw_kv_ring_free(x);
      return tw_err(TW_ERR_CUDA, "cudaStreamCreate for the kv bounce ring failed");
    }
    for (int k = 0; k < TW_KV_RING_SLOTS; k++)
      if (x->cudart.event_create(&g->event[k], TW_CUDA_EVENT_DISABLE_TIMING) != 0) {
        g->event[k] = NULL;
        tw_kv_ring_free(x);
        return tw_err(TW_ERR_CUDA, "cudaEventCreate for the kv bounce ring failed");
      }
  } else if (!(g->mem = malloc(bytes))) {
    return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the %zu-byte kv gather ring", bytes);
  }
  /* registered once, so a put from a slot needs no registration of its own */
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = g->mem, .length = bytes, .memory_type = UCS_MEMORY_TYPE_HOST};
  if (ucp_mem_map(x->ctx, &mp, &g->memh) != UCS_OK) g->memh = NULL; /* puts still work */

  TW_DEBUG("kvx", "kv bounce ring: %d slots of %lld bytes, %s", TW_KV_RING_SLOTS,
           (long long)TW_KV_RING_SLOT_BYTES, device ? "pinned" : "pageable");
  return TW_OK;
}

/* Bind the CUDA primary context to this thread (UCX's cuda transports use the
 * driver API in the calling thread) and register the local device pool once
 * as CUDA memory, so a direct put neither detects the memory type nor
 * registers the buffer. Registration failure only costs speed. */
static TW_NODISCARD tw_status_t tw_kv_src_register(tw_kv_xfer_t *x, const tw_kv_layout_t *src) {
  if (x->src_base == src->base && x->src_bytes == src->total_bytes) return TW_OK;
  TW_CHECK(tw_cudart_load(&x->cudart));
  if (x->cudart.free_(NULL) != 0)
    return tw_err(TW_ERR_CUDA, "no CUDA context for the device kv pool in this thread");
  if (x->src_memh) ucp_mem_unmap(x->ctx, x->src_memh);
  x->src_memh = NULL;
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = src->base, .length = (size_t)src->total_bytes,
      .memory_type = UCS_MEMORY_TYPE_CUDA};
  ucs_status_t us = ucp_mem_map(x->ctx, &mp, &x->src_memh);
  if (us != UCS_OK) {
    x->src_memh = NULL;
    TW_WARN("kvx", "ucp_mem_map of the local device kv pool (%lld bytes) failed: %s; puts "
            "register per request", (long long)src->total_bytes, ucs_status_string(us));
  }
  x->src_base = src->base;
  x->src_bytes = src->total_bytes;
  return TW_OK;
}

/* A put to p failed (its endpoint did: the decode worker is gone or
 * unreachable): p is dropped. Returns TW_ERR_TRANSPORT. */
static TW_NODISCARD tw_status_t tw_kv_put_failed(tw_kv_xfer_t *x, tw_kv_peer_t *p, int64_t bytes,
                                                 ucs_status_t us) {
  char name[48];
  tw_kv_peer_drop(x, p);
  return tw_err(TW_ERR_TRANSPORT, "ucp_put_nbx of %lld kv bytes to %s failed: %s", (long long)bytes,
                tw_kv_peer_name(p, name, sizeof name), ucs_status_string(us));
}

typedef enum {
  TW_KV_RING_READ = 0, /* checksum only */
  TW_KV_RING_PUT = 1,  /* put each chunk to raddr + its offset */
  TW_KV_RING_AM = 2,   /* send each chunk into the receiver's bounce ring (dst) */
} tw_kv_ring_mode_t;

/* The largest piece a staged receiver takes (one of its slots, at most one
 * of ours). */
static int64_t tw_kv_am_chunk(const tw_kv_remote_layout_t *dst) {
  return dst->staging_slot_bytes < TW_KV_RING_SLOT_BYTES ? dst->staging_slot_bytes
                                                         : TW_KV_RING_SLOT_BYTES;
}

/* Stream the concatenated segments through the ring in slot-sized chunks:
 * fill (host memcpy, or cudaMemcpyAsync on the ring's stream for a device
 * source, up to TW_KV_RING_SLOTS chunks ahead), then checksum and, by mode,
 * put each chunk to raddr + its offset or announce it to the staged receiver
 * dst (which reads it). A slot is refilled only after its previous put
 * completed locally, or its piece was answered. */
static TW_NODISCARD tw_status_t tw_kv_ring_put(tw_kv_xfer_t *x, tw_kv_peer_t *p, bool device,
                                               const tw_kv_seg_t *segs, int32_t n_segs,
                                               int64_t total, uint64_t raddr, uint64_t *h,
                                               tw_kv_ring_mode_t mode,
                                               const tw_kv_remote_layout_t *dst) {
  TW_CHECK(tw_kv_ring_init(x, device));
  tw_kv_ring_t *g = &x->ring;
  const int64_t S = mode == TW_KV_RING_AM ? tw_kv_am_chunk(dst) : TW_KV_RING_SLOT_BYTES;
  int64_t n_chunks = (total + S - 1) / S, copied = 0, sent = 0, so = 0;
  int32_t si = 0;
  int slot_of[TW_KV_RING_SLOTS];
  while (sent < n_chunks) {
    while (copied < n_chunks && copied < sent + TW_KV_RING_SLOTS) {
      int k = (int)(g->next++ % TW_KV_RING_SLOTS);
      TW_CHECK(tw_kv_req_wait(x, &g->req[k]));
      if (g->piece[k]) { /* the staged receiver has read the slot's last piece */
        uint64_t id = g->piece[k];
        g->piece[k] = 0;
        if (x->pieces[id % TW_KV_PIECES].id == id)
          TW_CHECK(tw_kv_pieces_wait(x, p, TW_KV_WAIT_ID, id, 10000));
      }
      int64_t len = total - copied * S < S ? total - copied * S : S;
      uint8_t *slot = g->mem + (int64_t)k * TW_KV_RING_SLOT_BYTES;
      for (int64_t done = 0; done < len && si < n_segs;) {
        int64_t piece = segs[si].bytes - so < len - done ? segs[si].bytes - so : len - done;
        if (device) {
          if (piece > 0 && x->cudart.memcpy_async(slot + done, (const char *)segs[si].ptr + so,
                                                  (size_t)piece, TW_CUDA_D2H, g->stream) != 0)
            return tw_err(TW_ERR_CUDA, "cudaMemcpyAsync of %lld kv bytes to the bounce ring failed",
                          (long long)piece);
        } else if (piece > 0) {
          memcpy(slot + done, (const char *)segs[si].ptr + so, (size_t)piece);
        }
        done += piece;
        so += piece;
        if (so == segs[si].bytes) {
          si++;
          so = 0;
        }
      }
      if (device && x->cudart.event_record(g->event[k], g->stream) != 0)
        return tw_err(TW_ERR_CUDA, "cudaEventRecord on the kv bounce ring failed");
      slot_of[copied % TW_KV_RING_SLOTS] = k;
      copied++;
    }
    int k = slot_of[sent % TW_KV_RING_SLOTS];
    int64_t len = total - sent * S < S ? total - sent * S : S;
    const uint8_t *src = g->mem + (int64_t)k * TW_KV_RING_SLOT_BYTES;
    if (device && x->cudart.event_sync(g->event[k]) != 0)
      return tw_err(TW_ERR_CUDA, "a kv copy to the bounce ring failed");
    if (h) *h = tw_kv_fnv1a(*h, src, (size_t)len);
    if (mode == TW_KV_RING_AM) {
      TW_CHECK(
          tw_kv_piece_send(x, p, dst, src, false, len, raddr + (uint64_t)(sent * S), &g->piece[k]));
      if (device) x->stats.staged_bytes += len;
    } else if (mode == TW_KV_RING_PUT) {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                                 .memory_type = UCS_MEMORY_TYPE_HOST};
      if (g->memh) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = g->memh;
      }
      void *req = ucp_put_nbx(p->ep, src, (size_t)len, raddr + (uint64_t)(sent * S), p->rkey, &prm);
      if (UCS_PTR_IS_ERR(req)) return tw_kv_put_failed(x, p, len, UCS_PTR_STATUS(req));
      g->req[k] = req;
      x->stats.puts++;
      if (device) x->stats.staged_bytes += len;
    }
    sent++;
  }
  return TW_OK;
}

tw_kv_path_t tw_kv_xfer_path(const tw_kv_peer_t *p, bool src_on_device, bool dst_on_device) {
  if (src_on_device && p->ipc_ptr && p->ipc_allowed) return TW_KV_PATH_DIRECT_CUDA_IPC;
  if (!p->rkey) return TW_KV_PATH_UNREACHABLE; /* a pool exported over CUDA IPC alone */
  if (dst_on_device) return p->cuda_ipc ? TW_KV_PATH_DIRECT_UCX : TW_KV_PATH_UNREACHABLE;
  return src_on_device ? TW_KV_PATH_STAGED : TW_KV_PATH_HOST;
}

tw_kv_path_t tw_kv_xfer_path_to(const tw_kv_peer_t *p, bool src_on_device,
                                const tw_kv_remote_layout_t *dst) {
  if (src_on_device && p->ipc_ptr && p->ipc_allowed) return TW_KV_PATH_DIRECT_CUDA_IPC;
  return dst->staging_slot_bytes > 0 ? TW_KV_PATH_STAGED_RECV
                                     : tw_kv_xfer_path(p, src_on_device, dst->on_device);
}

const char *tw_kv_path_name(tw_kv_path_t path) {
  switch (path) {
    case TW_KV_PATH_STAGED_RECV: return "staged (the receiver's bounce ring)";
    case TW_KV_PATH_HOST: return "host";
    case TW_KV_PATH_DIRECT_CUDA_IPC: return "direct cuda_ipc";
    case TW_KV_PATH_DIRECT_UCX: return "direct ucx cuda_ipc";
    case TW_KV_PATH_STAGED: return "staged";
    default: return "unreachable";
  }
}

const char *tw_kv_xfer_peer_lanes(const tw_kv_peer_t *p) { return p->lanes; }

TW_NODISCARD tw_status_t tw_kv_xfer_put(tw_kv_xfer_t *x, tw_kv_peer_t *p, const tw_kv_layout_t *src,
                                        const tw_kv_remote_layout_t *dst, const tw_kv_seg_t *segs,
                                        int32_t n_segs, uint64_t raddr, uint64_t *maybe_checksum) {
  if (tw_kv_peer_gone(p, false)) {
    char name[48];
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_UNAVAILABLE, "%s is gone (its ucx endpoint failed or its process ended)",
                  tw_kv_peer_name(p, name, sizeof name));
  }
  int64_t total = 0;
  const char *lo = src->base, *hi = (const char *)src->base + src->total_bytes;
  for (int32_t i = 0; i < n_segs; i++) {
    const char *a = segs[i].ptr;
    if (segs[i].bytes < 0 || a < lo || a + segs[i].bytes > hi)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "kv put: piece %d (%lld bytes) is outside the local pool",
                    i, (long long)segs[i].bytes);
    total += segs[i].bytes;
  }
  if (total == 0) return TW_OK;
  if (raddr < dst->remote_base || dst->total_bytes < total ||
      raddr - dst->remote_base > (uint64_t)(dst->total_bytes - total))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv put of %lld bytes at remote offset %llu is outside the remote pool (%lld bytes)",
                  (long long)total, (unsigned long long)(raddr - dst->remote_base),
                  (long long)dst->total_bytes);
  tw_kv_path_t path = tw_kv_xfer_path_to(p, src->on_device, dst);
  if (path == TW_KV_PATH_DIRECT_CUDA_IPC &&
      (int64_t)(raddr - dst->remote_base) + total > p->ipc.pool_bytes)
    return tw_err(
        TW_ERR_INVALID_ARGUMENT,
        "kv copy of %lld bytes at remote offset %llu is outside the mapped pool (%lld bytes)",
        (long long)total, (unsigned long long)(raddr - dst->remote_base),
        (long long)p->ipc.pool_bytes);
  if (!(p->logged_paths & (1u << path))) {
    p->logged_paths |= 1u << path;
    TW_INFO("kvx", "kv handoff path to a decode worker: %s (%s pool -> %s pool; ucx lanes: %s)",
            tw_kv_path_name(path), src->on_device ? "device" : "host",
            dst->on_device ? "device" : "host", p->lanes[0] ? p->lanes : "unknown");
    if (path == TW_KV_PATH_DIRECT_UCX && p->put_am_emulated)
      TW_WARN("kvx",
              "this UCX (before 1.14) puts into device memory over active messages "
              "(put/am/bcopy, copied through host memory: about 1 GB/s), not over cuda_ipc: use "
              "the CUDA IPC path (TWAIN_KV_IPC unset) or a UCX >= 1.14 with CUDA transports "
              "(deploy/build_ucx_cuda.sh builds 1.22.0)");
  }
  if (!p->t_first_put_ns) p->t_first_put_ns = tw_now_ns();
  uint64_t *h = maybe_checksum;
  if (path == TW_KV_PATH_DIRECT_CUDA_IPC) {
    char *d = (char *)p->ipc_ptr + (raddr - dst->remote_base);
    for (int32_t i = 0; i < n_segs; i++) {
      if (segs[i].bytes == 0) continue;
      if (x->cudart.memcpy_async(d, segs[i].ptr, (size_t)segs[i].bytes, TW_CUDA_DEFAULT,
                                 x->ipc_stream) != 0)
        return tw_err(TW_ERR_CUDA,
                      "cudaMemcpyAsync of %lld kv bytes into the decode worker's "
                      "pool (CUDA IPC) failed",
                      (long long)segs[i].bytes);
      d += segs[i].bytes;
      x->stats.puts++;
      x->stats.direct_bytes += segs[i].bytes;
    }
    p->ipc_pending = true;
    if (h)
      TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, TW_KV_RING_READ, dst));
    x->stats.bytes_sent += total;
    return TW_OK;
  }
  switch (path) {
    case TW_KV_PATH_UNREACHABLE:
      if (!p->rkey)
        return tw_err(TW_ERR_UNSUPPORTED,
                      "the decode worker's kv pool is reachable over CUDA IPC only "
                      "(TWAIN_KV_PATH=ipc there) and this worker cannot map it (%s pool here, or "
                      "another host or IPC namespace): unset TWAIN_KV_PATH on the decode worker",
                      src->on_device ? "a device" : "a host");
      return tw_err(TW_ERR_UNSUPPORTED,
                    "the decode worker's kv pool is device memory but no ucx lane to it reaches "
                    "CUDA memory (lanes: %s); a put would be emulated and written by the host "
                    "into device memory. Both workers need the CUDA-enabled UCX "
                    "(deploy/build_ucx_cuda.sh) with cuda_ipc in UCX_TLS, or neither",
                    p->lanes[0] ? p->lanes : "unknown");
    case TW_KV_PATH_STAGED_RECV:
      if (src->on_device && n_segs == 1 && p->slot_ptr == 1) {
        /* the receiver's slots are mapped here: each piece is copied from
         * the device pool straight into its slot (no ring of ours) */
        for (int64_t off = 0, C = dst->staging_slot_bytes; off < total; off += C) {
          int64_t len = total - off < C ? total - off : C;
          uint64_t id = 0;
          TW_CHECK(tw_kv_piece_send(x, p, dst, (const char *)segs[0].ptr + off, true, len,
                                    raddr + (uint64_t)off, &id));
        }
        x->stats.staged_bytes += total;
        if (h) /* read back through the ring: no put */
          TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, TW_KV_RING_READ, dst));
        break;
      }
      if (src->on_device || n_segs > 1) { /* through our ring: a device copy, or a gather */
        TW_CHECK(tw_kv_ring_put(x, p, src->on_device, segs, n_segs, total, raddr, h, TW_KV_RING_AM,
                                dst));
        break;
      }
      /* one host piece: sent in place, a slot's worth at a time */
      for (int64_t off = 0, C = dst->staging_slot_bytes; off < total; off += C) {
        int64_t len = total - off < C ? total - off : C;
        uint64_t id = 0;
        TW_CHECK(tw_kv_piece_send(x, p, dst, (const char *)segs[0].ptr + off, false, len,
                                  raddr + (uint64_t)off, &id));
      }
      if (h) *h = tw_kv_fnv1a(*h, segs[0].ptr, (size_t)total);
      break;
    case TW_KV_PATH_STAGED:
      TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, TW_KV_RING_PUT, dst));
      break;
    case TW_KV_PATH_HOST:
      if (n_segs > 1) { /* gather into one put */
        TW_CHECK(tw_kv_ring_put(x, p, false, segs, n_segs, total, raddr, h, TW_KV_RING_PUT, dst));
        break;
      }
      __attribute__((fallthrough)); /* one piece: put in place */
    case TW_KV_PATH_DIRECT_CUDA_IPC: /* handled above */
    case TW_KV_PATH_DIRECT_UCX: {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                                 .memory_type = src->on_device ? UCS_MEMORY_TYPE_CUDA
                                                               : UCS_MEMORY_TYPE_HOST};
      if (src->on_device) {
        TW_CHECK(tw_kv_src_register(x, src));
        if (x->src_memh) {
          prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
          prm.memh = x->src_memh;
        }
      }
      uint64_t off = 0;
      for (int32_t i = 0; i < n_segs; i++) {
        if (segs[i].bytes == 0) continue;
        void *req = ucp_put_nbx(p->ep, segs[i].ptr, (size_t)segs[i].bytes, raddr + off, p->rkey, &prm);
        if (UCS_PTR_IS_ERR(req)) return tw_kv_put_failed(x, p, segs[i].bytes, UCS_PTR_STATUS(req));
        if (req) ucp_request_free(req); /* completion is tracked by the endpoint flush */
        off += (uint64_t)segs[i].bytes;
        x->stats.puts++;
        if (path == TW_KV_PATH_DIRECT_UCX) x->stats.direct_bytes += segs[i].bytes;
      }
      if (h && src->on_device) /* read back through the ring: no put */
        TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, TW_KV_RING_READ, dst));
      else if (h)
        for (int32_t i = 0; i < n_segs; i++) *h = tw_kv_fnv1a(*h, segs[i].ptr, (size_t)segs[i].bytes);
      break;
    }
  }
  x->stats.bytes_sent += total;
  ucp_worker_progress(x->worker);
  if (x->n_pieces) tw_kv_pieces_advance(x); /* pieces move while the caller computes */
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_xfer_send_layer(tw_kv_xfer_t *x, tw_kv_peer_t *p,
                                               const tw_kv_layout_t *src,
                                               const tw_kv_remote_layout_t *dst, int32_t layer,
                                               const int32_t *src_ids, const int32_t *dst_ids,
                                               int32_t first, int32_t n, uint64_t *maybe_checksum) {
  if (src->dtype != dst->dtype) return tw_kv_dtype_mismatch(src->dtype, dst->dtype);
  if (src->block_size != dst->block_size || src->n_kv_heads_local != dst->n_kv_heads ||
      src->head_dim != dst->head_dim || src->block_bytes != dst->block_bytes ||
      src->n_layers != dst->n_layers)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "kv layouts differ (prefill dtype %d bs=%d heads=%d dim=%d, decode dtype %d bs=%d heads=%d "
                  "dim=%d): re-sharding is not implemented",
                  (int)src->dtype, src->block_size, src->n_kv_heads_local, src->head_dim,
                  (int)dst->dtype, dst->block_size, dst->n_kv_heads, dst->head_dim);
  uint64_t h = maybe_checksum ? *maybe_checksum : TW_KV_FNV_INIT;
  int32_t *buf = NULL, dst_ring = tw_kv_layer_ring(dst->ring_layers, dst->ring_blocks, layer);
  int32_t dst_blocks = dst_ring ? dst->n_ring_blocks : dst->n_blocks;
  TW_CHECK(tw_kv_ring_ids(tw_kv_layer_ring(src->ring_layers, src->ring_blocks, layer), dst_ring,
                          src_ids, dst_ids, &first, n, &src_ids, &dst_ids, &buf));
  int64_t loff = tw_kv_layer_offset_of(layer, dst->block_bytes, dst->n_blocks, dst->n_ring_blocks,
                                       dst->ring_blocks, dst->ring_layers);
  tw_status_t st = TW_OK;
  for (int32_t i = first; i < n && st == TW_OK;) {
    int32_t k = tw_kv_run_length(src_ids, dst_ids, i, n);
    char *blk = NULL, *last = NULL;
    st = tw_kv_block_ptr(src, layer, src_ids[i], &blk);
    if (st == TW_OK) st = tw_kv_block_ptr(src, layer, src_ids[i] + k - 1, &last);
    if (st == TW_OK && (dst_ids[i] < 0 || dst_ids[i] + k > dst_blocks))
      st = tw_err(TW_ERR_INVALID_ARGUMENT, "remote kv blocks %d..%d outside the pool of %d blocks",
                  dst_ids[i], dst_ids[i] + k - 1, dst_blocks);
    tw_kv_seg_t seg = {.ptr = blk, .bytes = (int64_t)k * src->block_bytes};
    uint64_t raddr =
        dst->remote_base + (uint64_t)loff + (uint64_t)dst_ids[i] * (uint64_t)dst->block_bytes;
    if (st == TW_OK)
      st = tw_kv_xfer_put(x, p, src, dst, &seg, 1, raddr, maybe_checksum ? &h : NULL);
    i += k;
  }
  free(buf);
  TW_CHECK(st);
  if (maybe_checksum) *maybe_checksum = h;
  return TW_OK;
}

int32_t tw_kv_run_length(const int32_t *src_ids, const int32_t *dst_ids, int32_t i, int32_t n) {
  int32_t k = 1;
  while (i + k < n && src_ids[i + k] == src_ids[i] + k && dst_ids[i + k] == dst_ids[i] + k) k++;
  return k;
}

TW_NODISCARD tw_status_t tw_kv_xfer_flush(tw_kv_xfer_t *x, tw_kv_peer_t *p, int timeout_ms) {
  char name[48];
  /* pieces for a staged receiver: done when it has answered each */
  if (p->n_pieces) TW_CHECK(tw_kv_pieces_wait(x, p, TW_KV_WAIT_PEER, 0, timeout_ms));
  if (tw_kv_peer_gone(p, true)) {
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_UNAVAILABLE, "kv transfer flush: %s is gone",
                  tw_kv_peer_name(p, name, sizeof name));
  }
  if (p->refused != UCS_OK) {
    ucs_status_t why = (ucs_status_t)p->refused;
    p->refused = UCS_OK;
    return tw_err(TW_ERR_UNAVAILABLE, "the decode worker dropped staged kv pieces: %s",
                  ucs_status_string(why));
  }
  if (p->ipc_pending) { /* the direct copies: done on the device once the event is */
    if (x->cudart.event_record(x->ipc_event, x->ipc_stream) != 0)
      return tw_err(TW_ERR_CUDA, "cudaEventRecord after the direct kv copies failed");
    int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
    int e;
    while ((e = x->cudart.event_query(x->ipc_event)) == TW_CUDA_NOT_READY) {
      if (tw_now_ns() > deadline)
        return tw_err(TW_ERR_DEADLINE, "direct kv copies did not complete within %d ms",
                      timeout_ms);
      struct timespec ts = {0, 20000};
      nanosleep(&ts, NULL);
    }
    if (e != 0)
      return tw_err(TW_ERR_CUDA,
                    "a direct kv copy into the decode worker's pool failed (cuda "
                    "error %d)",
                    e);
    p->ipc_pending = false;
  }
  ucp_request_param_t prm = {.op_attr_mask = 0};
  void *req = ucp_ep_flush_nbx(p->ep, &prm);
  if (UCS_PTR_IS_ERR(req)) {
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_UNAVAILABLE, "ucp_ep_flush_nbx to %s failed: %s",
                  tw_kv_peer_name(p, name, sizeof name), ucs_status_string(UCS_PTR_STATUS(req)));
  }
  ucs_status_t s = UCS_OK;
  if (req) {
    int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
    while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
      ucp_worker_progress(x->worker);
      bool gone = tw_kv_peer_gone(p, false);
      if (gone || tw_now_ns() > deadline) {
        /* a flush cannot be cancelled: release the request (UCX frees it when
         * it completes or the endpoint is closed) and drop the endpoint */
        ucp_request_free(req);
        tw_kv_peer_drop(x, p);
        tw_kv_peer_name(p, name, sizeof name);
        if (gone) return tw_err(TW_ERR_UNAVAILABLE, "kv transfer flush: %s is gone", name);
        return tw_err(TW_ERR_DEADLINE, "kv transfer flush to %s did not complete within %d ms",
                      name, timeout_ms);
      }
    }
    ucp_request_free(req);
  }
  if (s != UCS_OK || p->failed) {
    tw_kv_peer_drop(x, p);
    return tw_err(TW_ERR_UNAVAILABLE, "kv transfer flush to %s failed: %s",
                  tw_kv_peer_name(p, name, sizeof name), ucs_status_string(s));
  }
  for (int k = 0; k < TW_KV_RING_SLOTS; k++) TW_CHECK(tw_kv_req_wait(x, &x->ring.req[k]));
  x->stats.flushes++;
  if (p->t_first_put_ns) {
    x->stats.transfer_seconds += (double)(tw_now_ns() - p->t_first_put_ns) * 1e-9;
    p->t_first_put_ns = 0;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_layer_checksum(const tw_kv_layout_t *pool, int32_t layer,
                                              const int32_t *ids, int32_t first, int32_t n,
                                              uint64_t *checksum_p) {
  uint64_t h = TW_KV_FNV_INIT;
  tw_cudart_t rt = {0};
  uint8_t *copy = NULL;
  int32_t *buf = NULL;
  const int32_t *none = NULL;
  tw_status_t st = tw_kv_ring_ids(tw_kv_layer_ring(pool->ring_layers, pool->ring_blocks, layer), 0,
                                  ids, NULL, &first, n, &ids, &none, &buf);
  if (st == TW_OK && pool->on_device && (st = tw_cudart_load(&rt)) == TW_OK &&
      !(copy = malloc((size_t)pool->block_bytes)))
    st = tw_err(TW_ERR_NO_MEMORY, "cannot allocate a %lld-byte kv block copy",
                (long long)pool->block_bytes);
  for (int32_t i = first; i < n && st == TW_OK; i++) {
    char *blk = NULL;
    st = tw_kv_block_ptr(pool, layer, ids[i], &blk);
    if (st == TW_OK && copy && rt.memcpy_(copy, blk, (size_t)pool->block_bytes, TW_CUDA_D2H) != 0)
      st = tw_err(TW_ERR_CUDA, "cudaMemcpy of kv block %d to the host failed", ids[i]);
    if (st == TW_OK) h = tw_kv_fnv1a(h, copy ? (const char *)copy : blk, (size_t)pool->block_bytes);
  }
  free(copy);
  free(buf);
  if (rt.lib) dlclose(rt.lib);
  if (st == TW_OK) *checksum_p = h;
  return st;
}
