/* ucx_log.h: UCX's own log messages as twain log lines. */
#ifndef TW_KV_UCX_LOG_H
#define TW_KV_UCX_LOG_H

#include <stdint.h>

/** Routes UCX's messages of level WARN and above (FATAL, ERROR, WARN, and
 *  UCX's PRINT) into this process's log, once per process (safe to call
 *  again, from any thread): one line each, `WARN ucx: MESSAGE (FILE:LINE)`
 *  (UCX's ERROR and WARN both as WARN, its FATAL as ERROR: what UCX calls an
 *  error is a peer or transport event that the caller handles and logs in
 *  its own words), at most TW_UCX_LOG_BURST lines a second, the rest counted
 *  and said in the next line that goes out. Levels below WARN that
 *  UCX_LOG_LEVEL turns on keep UCX's own format. Call before ucp_init. */
void tw_ucx_log_install(void);

#define TW_UCX_LOG_BURST 10

/** Lines of UCX's that the rate limit held back so far (tests). */
uint64_t tw_ucx_log_suppressed(void);

#endif
