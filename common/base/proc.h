/* proc.h: a process and the host and pid namespace it runs in. A peer on
 * the same host and in the same pid namespace can tell that a process is
 * gone (kill(pid, 0), /proc/pid/stat) without any message from it: the
 * staged KV receiver takes back the slots of a dead sender (kv_transfer.c),
 * rank 0 of a worker tells a dead rank from a peer it refused (dist.c). */
#ifndef TW_COMMON_PROC_H
#define TW_COMMON_PROC_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A process, as it describes itself to peers (sent on the wire as is:
 *  fixed layout, 64 bytes). */
typedef struct {
  char boot_id[40]; /* /proc/sys/kernel/random/boot_id ("" unknown) */
  uint64_t pid_ns;  /* inode of /proc/self/ns/pid (0: unknown) */
  int32_t pid;
  uint32_t pad;
  uint64_t nonce; /* free for the user (kv_transfer.c: random per process) */
} tw_proc_t;

/** The host's boot id, NUL-terminated in out[40] ("" when unknown). */
void tw_proc_boot_id(char out[40]);

/** This process (nonce 0). */
void tw_proc_self(tw_proc_t *p);

/** Whether `other` runs on the host and in the pid namespace of `self`
 *  (both known), so that tw_proc_alive can answer for it. Terminates
 *  other's boot id (it may come from the wire). */
bool tw_proc_local(const tw_proc_t *self, tw_proc_t *other);

/** Whether the local process `p` (tw_proc_local) still runs: not when
 *  kill(pid, 0) says there is no such process, nor when it is a zombie. */
bool tw_proc_alive(const tw_proc_t *p);

#ifdef __cplusplus
}
#endif
#endif
