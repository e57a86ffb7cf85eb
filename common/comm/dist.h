/* dist.h: a worker as a group of ranks, one process per GPU (issue 6 item 1).
 *
 * Identity. A rank learns who it is from its launcher (tw_dist_identity_from_env):
 *   - mpirun (OpenMPI): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK;
 *   - torchrun-style: RANK / WORLD_SIZE / LOCAL_RANK, with the rendezvous in
 *     TWAIN_RENDEZVOUS (tcp://HOST:PORT) or MASTER_ADDR + MASTER_PORT;
 *   - Slurm: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (rendezvous as above,
 *     or MASTER_ADDR from the first host of the allocation in the sbatch script);
 *   - none of these: a group of one, unless `--tp N` asks tw_dist_spawn() to
 *     start the N ranks on this node.
 *
 * Control link. Rank 0 binds a ZeroMQ ROUTER (the rendezvous port, or an
 * ephemeral port on 127.0.0.1 sent to the others by MPI_Bcast); every other
 * rank connects a DEALER. Only that one port is fixed: the watchdog's socket
 * is ephemeral and announced over the control link. Over it rank 0 hands out the NCCL unique id
 * (cuda), broadcasts each step's plan (tw_dist_plan_send), and collects the
 * ranks' replies (tw_dist_reply / tw_dist_replies_recv). Rank 0 alone talks
 * to the router.
 *
 * Liveness. A watchdog thread per rank watches its connection to rank 0 (a
 * ZeroMQ monitor: a dead process closes its TCP connections at once, so a
 * DISCONNECTED event means the peer is gone; on rank 0, whose socket anyone
 * can connect to and where a peer the guard refused closes a connection
 * too, it means a lost rank only when a rank on this host is gone from
 * /proc (the pid from its hello; checked at once and for 300 ms) or another
 * rank sends no ping in those 300 ms) and exchanges pings with rank 0
 * every TW_DIST_PING_MS, so a hung peer is caught after TW_DIST_LOST_MS
 * (TWAIN_DIST_LOST_MS; long enough not to take a loaded machine's stall for
 * a hang). Either way, or when the parent that spawned it is gone, the rank
 * calls `on_lost`, which ends the process: a collective that waits for a dead
 * rank never returns, so the whole worker has to go, and the router expires
 * it (TW_WORKER_EXPIRE_MS) once rank 0 stops heartbeating.
 *
 * Security. Both links are ZeroMQ CURVE, rank 0 the server with a ZAP handler
 * that admits only the group's client key (common/comm/link_auth.h). The keys are
 * TWAIN_DIST_KEYS, which tw_dist_spawn fills with a fresh set for the ranks
 * it starts, else the deployment's link keys (TWAIN_KEYS_FILE for ranks that
 * srun or mpirun start across hosts). */
#ifndef TW_COMMON_DIST_H
#define TW_COMMON_DIST_H

#include "common/base/status.h"
#include "common/comm/collective.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_DIST_PING_MS 100
#define TW_DIST_LOST_MS (3000 * TW_SLOW_BUILD)
#define TW_DIST_KEYS_ENV "TWAIN_DIST_KEYS"

typedef enum {
  TW_DIST_LAUNCH_NONE = 0,  /* plain process: a group of one */
  TW_DIST_LAUNCH_MPI = 1,   /* mpirun / srun --mpi=pmix (OMPI_COMM_WORLD_*) */
  TW_DIST_LAUNCH_ENV = 2,   /* RANK / WORLD_SIZE / LOCAL_RANK (torchrun style, our spawner) */
  TW_DIST_LAUNCH_SLURM = 3, /* SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID */
} tw_dist_launch_t;

typedef struct {
  tw_dist_launch_t launch;
  int32_t rank, size, local_rank;
  char rendezvous[256]; /* tcp://HOST:PORT, or "" */
} tw_dist_identity_t;

/** Read the identity from the environment (see the file comment; the first
 *  launcher whose variables are set wins, in the order listed). Only call
 *  from option parsing (STYLE: getenv only in config parsing).
 *  Errors: TW_ERR_INVALID_ARGUMENT (a malformed number, rank outside
 *  [0, size), size > 1 without a rendezvous for ENV/SLURM). */
TW_NODISCARD tw_status_t tw_dist_identity_from_env(tw_dist_identity_t *id_p);

/** `--tp N` on one node: start the N ranks of this worker. With `use_mpi`
 *  (cpu backend: the host collective is MPI) this process starts
 *  `mpirun -np N argv...` and supervises it: SIGTERM/SIGINT reach the ranks
 *  as SIGUSR1 (which a rank turns into SIGTERM: rank 0 drains and stops the
 *  others), and when mpirun ends this returns TW_OK with *supervised_rc_p
 *  set to its exit status, which main returns. Otherwise *supervised_rc_p is
 *  -1 and the caller goes on as a rank. Without `use_mpi` (cuda)
 *  (cuda) it forks N - 1 children that exec argv with RANK, WORLD_SIZE,
 *  LOCAL_RANK and TWAIN_RENDEZVOUS set (and die with their parent), and
 *  returns in the parent with *id_p = rank 0. NCCL_NVLS_ENABLE=0 is set
 *  unless already present, and TWAIN_DIST_KEYS (a fresh link key set the
 *  ranks inherit) unless already present. Errors: TW_ERR_INVALID_ARGUMENT (n < 1),
 *  TW_ERR_IO (exec/fork failed, with strerror). */
TW_NODISCARD tw_status_t tw_dist_spawn(int argc, char **argv, int32_t n, int use_mpi,
                                       tw_dist_identity_t *id_p, int *supervised_rc_p);

typedef struct tw_dist tw_dist_t;

/** Called from the watchdog thread when a peer is lost; must end the
 *  process. `why` says which rank and how. NULL: the process sends itself
 *  SIGKILL (nothing can be cleaned up while a collective waits for the dead
 *  rank; the launcher or rank 0's watchdog takes the other ranks down). */
typedef void (*tw_dist_lost_fn)(const char *why);

/** Join the group: the collective (host: MPI; nccl: the unique id from rank
 *  0 over the control link, device `device`), the control link and the
 *  watchdog. A group of one makes a handle with a NULL collective link.
 *  Errors: TW_ERR_INVALID_ARGUMENT (identity and MPI disagree; no link keys
 *  for a group of more than one),
 *  TW_ERR_TRANSPORT (ZeroMQ), those of tw_coll_create_*, TW_ERR_UNAVAILABLE
 *  (a rank did not show up within 60 s), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_dist_create(const tw_dist_identity_t *id, tw_coll_kind_t kind,
                                        int32_t device, tw_dist_lost_fn on_lost,
                                        tw_dist_t **dist_p);
/** Stop the watchdog (a clean stop: the other ranks are about to exit and
 *  their silence must not end this one). NULL does nothing. */
void tw_dist_watchdog_stop(tw_dist_t *dist);
/** Stop the watchdog, close the link, leave the collective. NULL does nothing. */
void tw_dist_destroy(tw_dist_t *dist);

int32_t tw_dist_rank(const tw_dist_t *dist);
int32_t tw_dist_size(const tw_dist_t *dist);
/** Peers refused on this rank's links so far: ZAP denials and failed CURVE
 *  handshakes (tw_auth_guard_refused; 0 for a group of one). */
uint64_t tw_dist_refused(const tw_dist_t *dist);
/** The group's collective (borrowed; NULL for a group of one). */
tw_coll_t *tw_dist_coll(tw_dist_t *dist);

/** Rank 0: send one plan message (copied) to every other rank, in order.
 *  Errors: TW_ERR_TRANSPORT. */
TW_NODISCARD tw_status_t tw_dist_plan_send(tw_dist_t *dist, const void *buf, size_t len);
/** Other ranks: receive the next plan (malloc'd into *buf_p, free() it),
 *  waiting at most timeout_ms (-1: forever). TW_INPROGRESS on timeout.
 *  Errors: TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_dist_plan_recv(tw_dist_t *dist, int timeout_ms, void **buf_p,
                                           size_t *len_p);
/** Other ranks: send a reply to rank 0. Errors: TW_ERR_TRANSPORT. */
TW_NODISCARD tw_status_t tw_dist_reply(tw_dist_t *dist, const void *buf, size_t len);
/** Rank 0: one reply from each other rank, bufs_out[r] (malloc'd, r = 1..
 *  size-1; [0] is set to NULL) and lens_out[r], within timeout_ms.
 *  Errors: TW_ERR_DEADLINE (a rank did not answer), TW_ERR_TRANSPORT. */
TW_NODISCARD tw_status_t tw_dist_replies_recv(tw_dist_t *dist, int timeout_ms, void **bufs_out,
                                              size_t *lens_out);

#ifdef __cplusplus
}
#endif
#endif
