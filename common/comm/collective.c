/* collective.c: the host (MPI) and NCCL implementations of collective.h.
 * MPI is compiled in when TWAIN_HAVE_MPI (common/CMakeLists.txt finds
 * OpenMPI), NCCL when TWAIN_HAVE_NCCL (CUDA builds with nccl.h); without
 * them the constructors answer TW_ERR_UNSUPPORTED. Large buffers are sent in
 * pieces of at most 1 GiB because MPI counts are int. */
#include "common/comm/collective.h"

#include "common/base/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TWAIN_HAVE_MPI
#include <mpi.h>
#endif
#ifdef TWAIN_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

#define TW_COLL_MAGIC 0x74636f6cu /* "tcol" */
#define TW_COLL_PIECE_BYTES (1ll << 30)

struct tw_coll {
  uint32_t magic;
  tw_coll_kind_t kind;
  int32_t rank, size;
#ifdef TWAIN_HAVE_MPI
  MPI_Comm comm;
  int initialised_mpi; /* this handle called MPI_Init_thread */
#endif
#ifdef TWAIN_HAVE_NCCL
  ncclComm_t nccl;
  cudaStream_t stream;
  float *one; /* device scratch for the barrier */
#endif
};

int tw_coll_have(tw_coll_kind_t kind) {
#ifdef TWAIN_HAVE_MPI
  if (kind == TW_COLL_HOST) return 1;
#endif
#ifdef TWAIN_HAVE_NCCL
  if (kind == TW_COLL_NCCL) return 1;
#endif
  (void)kind;
  return 0;
}

static TW_NODISCARD tw_status_t tw_coll_check(const tw_coll_t *c, const char *op) {
  if (!c) return tw_err(TW_ERR_INVALID_ARGUMENT, "collective %s: handle is NULL", op);
  if (c->magic != TW_COLL_MAGIC)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective %s: not a live handle (magic %08x)", op,
                  c->magic);
  return TW_OK;
}

/* ---- MPI ------------------------------------------------------------------ */

#ifdef TWAIN_HAVE_MPI
static TW_NODISCARD tw_status_t tw_mpi_err(int rc, const char *what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof(msg), "code %d", rc);
  return tw_err(TW_ERR_TRANSPORT, "collective host: %s failed: %s", what, msg);
}
#define TW_MPI_CHECK(call)                             \
  do {                                                 \
    int tw_rc_ = (call);                               \
    if (tw_rc_ != MPI_SUCCESS) return tw_mpi_err(tw_rc_, #call); \
  } while (0)
#endif

TW_NODISCARD tw_status_t tw_coll_create_host(tw_coll_t **coll_p) {
#ifdef TWAIN_HAVE_MPI
  int inited = 0, provided = 0, was_inited;
  TW_MPI_CHECK(MPI_Initialized(&inited));
  was_inited = inited;
  /* FUNNELED: only the thread that made the handle calls MPI (header rule) */
  if (!inited) TW_MPI_CHECK(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided));
  tw_coll_t *c = calloc(1, sizeof(*c));
  if (!c) return tw_err(TW_ERR_NO_MEMORY, "collective host: out of memory");
  c->magic = TW_COLL_MAGIC;
  c->kind = TW_COLL_HOST;
  c->initialised_mpi = !was_inited;
  /* errors come back as codes (tw_status_t), never abort inside MPI */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->comm);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(c->comm, &c->rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(c->comm, &c->size);
  if (rc != MPI_SUCCESS) {
    free(c);
    return tw_mpi_err(rc, "MPI_Comm_dup/rank/size");
  }
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  TW_DEBUG("coll", "host group: rank %d of %d", c->rank, c->size);
  *coll_p = c;
  return TW_OK;
#else
  (void)coll_p;
  return tw_err(TW_ERR_UNSUPPORTED, "collective host: this build has no MPI (libopenmpi-dev)");
#endif
}

/* ---- NCCL ----------------------------------------------------------------- */

#ifdef TWAIN_HAVE_NCCL
#define TW_NCCL_CHECK(call)                                                              \
  do {                                                                                   \
    ncclResult_t tw_r_ = (call);                                                         \
    if (tw_r_ != ncclSuccess)                                                            \
      return tw_err(TW_ERR_NCCL, "collective nccl: %s failed: %s (%s)", #call,          \
                    ncclGetErrorString(tw_r_), ncclGetLastError(NULL));                  \
  } while (0)
#endif

TW_NODISCARD tw_status_t tw_coll_nccl_unique_id(uint8_t *uid_out) {
#ifdef TWAIN_HAVE_NCCL
  ncclUniqueId id;
  TW_NCCL_CHECK(ncclGetUniqueId(&id));
  memcpy(uid_out, id.internal, TW_COLL_UID_BYTES);
  return TW_OK;
#else
  (void)uid_out;
  return tw_err(TW_ERR_UNSUPPORTED, "collective nccl: this build has no NCCL");
#endif
}

TW_NODISCARD tw_status_t tw_coll_create_nccl(const uint8_t *uid, int32_t rank, int32_t size,
                                             int32_t device, void *stream, tw_coll_t **coll_p) {
  if (size < 1 || rank < 0 || rank >= size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective nccl: rank %d of size %d", rank, size);
#ifdef TWAIN_HAVE_NCCL
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess)
    return tw_err(TW_ERR_CUDA, "collective nccl: cudaSetDevice(%d): %s", device,
                  cudaGetErrorString(ce));
  tw_coll_t *c = calloc(1, sizeof(*c));
  if (!c) return tw_err(TW_ERR_NO_MEMORY, "collective nccl: out of memory");
  ncclUniqueId id;
  memcpy(id.internal, uid, TW_COLL_UID_BYTES);
  ncclResult_t r = ncclCommInitRank(&c->nccl, size, id, rank);
  if (r != ncclSuccess) {
    free(c);
    return tw_err(TW_ERR_NCCL, "collective nccl: ncclCommInitRank(rank %d of %d): %s", rank,
                  size, ncclGetErrorString(r));
  }
  ce = cudaMalloc((void **)&c->one, sizeof(float));
  if (ce != cudaSuccess) {
    ncclCommDestroy(c->nccl);
    free(c);
    return tw_err(TW_ERR_CUDA, "collective nccl: cudaMalloc: %s", cudaGetErrorString(ce));
  }
  c->magic = TW_COLL_MAGIC;
  c->kind = TW_COLL_NCCL;
  c->rank = rank;
  c->size = size;
  c->stream = (cudaStream_t)stream;
  *coll_p = c;
  return TW_OK;
#else
  (void)uid;
  (void)device;
  (void)stream;
  (void)coll_p;
  return tw_err(TW_ERR_UNSUPPORTED, "collective nccl: this build has no NCCL");
#endif
}

void tw_coll_destroy(tw_coll_t *c) {
  if (!c) return;
  if (c->magic != TW_COLL_MAGIC) {
    TW_ERROR("coll", "destroy of a handle that is not a live collective (magic %08x)", c->magic);
    return;
  }
#ifdef TWAIN_HAVE_MPI
  if (c->kind == TW_COLL_HOST) {
    MPI_Comm_free(&c->comm);
    int fin = 0;
    MPI_Finalized(&fin);
    if (c->initialised_mpi && !fin) MPI_Finalize();
  }
#endif
#ifdef TWAIN_HAVE_NCCL
  if (c->kind == TW_COLL_NCCL) {
    ncclCommDestroy(c->nccl);
    cudaFree(c->one);
  }
#endif
  c->magic = 0;
  free(c);
}

TW_NODISCARD tw_status_t tw_coll_nccl_set_stream(tw_coll_t *coll, void *stream) {
  if (!coll || coll->kind != TW_COLL_NCCL)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective: set_stream needs an NCCL handle");
#ifdef TWAIN_HAVE_NCCL
  coll->stream = (cudaStream_t)stream;
#else
  (void)stream;
#endif
  return TW_OK;
}

tw_coll_kind_t tw_coll_kind(const tw_coll_t *c) { return c ? c->kind : TW_COLL_HOST; }
int32_t tw_coll_rank(const tw_coll_t *c) { return c ? c->rank : 0; }
int32_t tw_coll_size(const tw_coll_t *c) { return c ? c->size : 1; }

/* ---- operations ------------------------------------------------------------- */

TW_NODISCARD tw_status_t tw_coll_allreduce_sum_f32(tw_coll_t *c, float *buf, int64_t n) {
  TW_CHECK(tw_coll_check(c, "allreduce"));
  if (n < 0 || (n > 0 && !buf))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective allreduce: buf %p, n %lld", (void *)buf,
                  (long long)n);
  if (c->size == 1 || n == 0) return TW_OK;
#ifdef TWAIN_HAVE_MPI
  if (c->kind == TW_COLL_HOST) {
    const int64_t piece = TW_COLL_PIECE_BYTES / (int64_t)sizeof(float);
    for (int64_t off = 0; off < n; off += piece) {
      int cnt = (int)(n - off < piece ? n - off : piece);
      TW_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, MPI_SUM, c->comm));
    }
    return TW_OK;
  }
#endif
#ifdef TWAIN_HAVE_NCCL
  if (c->kind == TW_COLL_NCCL) {
    TW_NCCL_CHECK(ncclAllReduce(buf, buf, (size_t)n, ncclFloat32, ncclSum, c->nccl, c->stream));
    return TW_OK;
  }
#endif
  return tw_err(TW_ERR_INTERNAL, "collective allreduce: kind %d not built", (int)c->kind);
}

TW_NODISCARD tw_status_t tw_coll_allgather(tw_coll_t *c, const void *send, void *recv,
                                           int64_t bytes) {
  TW_CHECK(tw_coll_check(c, "allgather"));
  if (bytes < 0 || (bytes > 0 && (!send || !recv)))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective allgather: send %p recv %p bytes %lld",
                  send, recv, (long long)bytes);
  if (bytes == 0) return TW_OK;
  if (c->size == 1) {
    if (c->kind == TW_COLL_HOST) {
      memcpy(recv, send, (size_t)bytes);
      return TW_OK;
    }
  }
#ifdef TWAIN_HAVE_MPI
  if (c->kind == TW_COLL_HOST) {
    if (bytes > TW_COLL_PIECE_BYTES)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "collective allgather: %lld bytes per rank > 1 GiB",
                    (long long)bytes);
    TW_MPI_CHECK(MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, c->comm));
    return TW_OK;
  }
#endif
#ifdef TWAIN_HAVE_NCCL
  if (c->kind == TW_COLL_NCCL) {
    TW_NCCL_CHECK(ncclAllGather(send, recv, (size_t)bytes, ncclUint8, c->nccl, c->stream));
    return TW_OK;
  }
#endif
  return tw_err(TW_ERR_INTERNAL, "collective allgather: kind %d not built", (int)c->kind);
}

TW_NODISCARD tw_status_t tw_coll_broadcast(tw_coll_t *c, void *buf, int64_t bytes, int32_t root) {
  TW_CHECK(tw_coll_check(c, "broadcast"));
  if (root < 0 || root >= c->size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective broadcast: root %d of size %d", root,
                  c->size);
  if (bytes < 0 || (bytes > 0 && !buf))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "collective broadcast: buf %p bytes %lld", buf,
                  (long long)bytes);
  if (c->size == 1 || bytes == 0) return TW_OK;
#ifdef TWAIN_HAVE_MPI
  if (c->kind == TW_COLL_HOST) {
    for (int64_t off = 0; off < bytes; off += TW_COLL_PIECE_BYTES) {
      int cnt = (int)(bytes - off < TW_COLL_PIECE_BYTES ? bytes - off : TW_COLL_PIECE_BYTES);
      TW_MPI_CHECK(MPI_Bcast((char *)buf + off, cnt, MPI_BYTE, root, c->comm));
    }
    return TW_OK;
  }
#endif
#ifdef TWAIN_HAVE_NCCL
  if (c->kind == TW_COLL_NCCL) {
    TW_NCCL_CHECK(ncclBroadcast(buf, buf, (size_t)bytes, ncclUint8, root, c->nccl, c->stream));
    return TW_OK;
  }
#endif
  return tw_err(TW_ERR_INTERNAL, "collective broadcast: kind %d not built", (int)c->kind);
}

TW_NODISCARD tw_status_t tw_coll_barrier(tw_coll_t *c) {
  TW_CHECK(tw_coll_check(c, "barrier"));
  if (c->size == 1) return TW_OK;
#ifdef TWAIN_HAVE_MPI
  if (c->kind == TW_COLL_HOST) {
    TW_MPI_CHECK(MPI_Barrier(c->comm));
    return TW_OK;
  }
#endif
#ifdef TWAIN_HAVE_NCCL
  if (c->kind == TW_COLL_NCCL) {
    TW_NCCL_CHECK(ncclAllReduce(c->one, c->one, 1, ncclFloat32, ncclSum, c->nccl, c->stream));
    cudaError_t ce = cudaStreamSynchronize(c->stream);
    if (ce != cudaSuccess)
      return tw_err(TW_ERR_CUDA, "collective barrier: cudaStreamSynchronize: %s",
                    cudaGetErrorString(ce));
    return TW_OK;
  }
#endif
  return tw_err(TW_ERR_INTERNAL, "collective barrier: kind %d not built", (int)c->kind);
}
