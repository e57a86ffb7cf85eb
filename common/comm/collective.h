/* collective.h: the collectives the ranks of one worker use (issue 6):
 * all-reduce (sum), all-gather and broadcast over a group of `size` ranks.
 *
 * Two implementations behind one handle:
 *   - host: MPI (Debian's OpenMPI) over MPI_COMM_WORLD, for the cpu backend.
 *     Buffers are host memory. The processes must be started by an MPI
 *     launcher (mpirun, or srun --mpi=pmix), or by tw_dist_spawn() which
 *     re-executes itself under mpirun (dist.h).
 *   - nccl: NCCL over one communicator made from a unique id that rank 0
 *     hands out (dist.h sends it over ZeroMQ), for the cuda backend. Buffers
 *     are device memory of the communicator's device; calls are enqueued on
 *     the given CUDA stream and do not synchronise it.
 * Neither is hand-rolled: the reduction order is the library's. A sum over
 * ranks is therefore not bitwise the same as the serial sum of TP 1; the
 * difference is float rounding (tests/parallel bound it at 1e-5 relative L2).
 *
 * Not thread-safe: one thread per handle, and every rank of the group must
 * make the same calls in the same order (a collective that one rank skips
 * blocks the others until the launcher takes the group down). */
#ifndef TW_COMMON_COLLECTIVE_H
#define TW_COMMON_COLLECTIVE_H

#include "common/base/status.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_COLL_NONE = 0, /* no collective (dist.h: a group with the control link only; tests) */
  TW_COLL_HOST = 1, /* MPI, host buffers */
  TW_COLL_NCCL = 2, /* NCCL, device buffers */
} tw_coll_kind_t;

/** Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES). */
#define TW_COLL_UID_BYTES 128

typedef struct tw_coll tw_coll_t;

/** Whether this build has the host (MPI) / NCCL implementation. */
int tw_coll_have(tw_coll_kind_t kind);

/** Join the host group: MPI_Init_thread (if not yet initialised) and a
 *  duplicate of MPI_COMM_WORLD. A process not started by an MPI launcher is
 *  a group of one (singleton).
 *  Errors: TW_ERR_UNSUPPORTED (built without MPI), TW_ERR_TRANSPORT (an MPI
 *  call failed, with MPI's error string), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_coll_create_host(tw_coll_t **coll_p);

/** Rank 0 only: make an NCCL unique id (uid_out[TW_COLL_UID_BYTES]) to hand
 *  to every rank. Errors: TW_ERR_UNSUPPORTED (no NCCL), TW_ERR_NCCL. */
TW_NODISCARD tw_status_t tw_coll_nccl_unique_id(uint8_t *uid_out);

/** Join an NCCL group of `size` ranks as `rank` on CUDA device `device`,
 *  with the id from rank 0; `stream` is the cudaStream_t (NULL: default
 *  stream) collectives are enqueued on (borrowed). Blocks until all ranks
 *  joined. NVLS must stay off on the lent machines: the daemons set
 *  NCCL_NVLS_ENABLE=0 unless the environment says otherwise (docs).
 *  Errors: TW_ERR_INVALID_ARGUMENT (rank/size), TW_ERR_UNSUPPORTED (no
 *  NCCL), TW_ERR_CUDA, TW_ERR_NCCL, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_coll_create_nccl(const uint8_t *uid, int32_t rank, int32_t size,
                                             int32_t device, void *stream, tw_coll_t **coll_p);

/** NCCL only: enqueue this handle's collectives on `stream` (a cudaStream_t,
 *  borrowed; NULL: the default stream) from now on. The CUDA engine passes
 *  its own stream so the collectives are ordered with its kernels and
 *  captured into its decode graphs, and sets NULL back when destroyed.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL coll, or not an NCCL handle). */
TW_NODISCARD tw_status_t tw_coll_nccl_set_stream(tw_coll_t *coll, void *stream);

/** Leave the group (MPI_Finalize for host if this handle initialised MPI;
 *  ncclCommDestroy). NULL does nothing. */
void tw_coll_destroy(tw_coll_t *coll);

tw_coll_kind_t tw_coll_kind(const tw_coll_t *coll);
/** This process's rank and the group size (0 and 1 for NULL). */
int32_t tw_coll_rank(const tw_coll_t *coll);
int32_t tw_coll_size(const tw_coll_t *coll);

/** In-place sum over ranks of buf f32 [n]: every rank gets the sum.
 *  Errors: TW_ERR_INVALID_ARGUMENT (n < 0, NULL buf), TW_ERR_TRANSPORT (MPI),
 *  TW_ERR_NCCL. */
TW_NODISCARD tw_status_t tw_coll_allreduce_sum_f32(tw_coll_t *coll, float *buf, int64_t n);

/** Gather `bytes` from every rank: recv[r * bytes ...] = rank r's send.
 *  recv holds size * bytes; send may not alias recv.
 *  Errors as allreduce. */
TW_NODISCARD tw_status_t tw_coll_allgather(tw_coll_t *coll, const void *send, void *recv,
                                           int64_t bytes);

/** Broadcast `bytes` of buf from rank `root` to every rank.
 *  Errors as allreduce, plus TW_ERR_INVALID_ARGUMENT (root out of range). */
TW_NODISCARD tw_status_t tw_coll_broadcast(tw_coll_t *coll, void *buf, int64_t bytes, int32_t root);

/** Wait for every rank (host: MPI_Barrier; nccl: a 1-float all-reduce).
 *  Errors as allreduce. */
TW_NODISCARD tw_status_t tw_coll_barrier(tw_coll_t *coll);

#ifdef __cplusplus
}
#endif
#endif
