/* cuda_common.h: small helpers shared by the CUDA kernels and the CUDA engine.
 *
 * TW_CUDA_CHECK turns a failing CUDA runtime call into tw_err(TW_ERR_CUDA)
 * with the call text, the CUDA error name and file:line, and returns it from
 * the enclosing function (which must return tw_status_t). TW_CUDA_CHECK_LAUNCH
 * does the same for the last launch error (cudaGetLastError), so a launcher
 * reports a bad configuration at once instead of at the next sync.
 *
 * Shared by the helpers `cuattn` and `cumoe`: additions only, keep it small.
 * Included from .cu and .c files; it needs only the CUDA runtime header. */
#ifndef TW_KERNELS_CUDA_COMMON_H
#define TW_KERNELS_CUDA_COMMON_H

#include "common/base/status.h"
#include "kernels/knobs.h"

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Return tw_err(TW_ERR_CUDA, ...) from the enclosing function if `call`
 *  does not return cudaSuccess. The message names the call and the error. */
#define TW_CUDA_CHECK(call)                                                        \
  do {                                                                             \
    cudaError_t tw_cuda_e_ = (call);                                               \
    if (tw_cuda_e_ != cudaSuccess)                                                 \
      return tw_err(TW_ERR_CUDA, "cuda call %s failed: %s (%s)", #call,            \
                    cudaGetErrorName(tw_cuda_e_), cudaGetErrorString(tw_cuda_e_)); \
  } while (0)

/** Like TW_CUDA_CHECK, but stores the status in `st` and jumps to `label`. */
#define TW_CUDA_CHECK_GOTO(call, st, label)                                          \
  do {                                                                               \
    cudaError_t tw_cuda_e_ = (call);                                                 \
    if (tw_cuda_e_ != cudaSuccess) {                                                 \
      (st) = tw_err(TW_ERR_CUDA, "cuda call %s failed: %s (%s)", #call,              \
                    cudaGetErrorName(tw_cuda_e_), cudaGetErrorString(tw_cuda_e_));   \
      goto label;                                                                    \
    }                                                                                \
  } while (0)

/** After a kernel launch: return TW_ERR_CUDA naming `what` if the launch
 *  failed (bad grid, too much shared memory, a sticky earlier error). */
#define TW_CUDA_CHECK_LAUNCH(what)                                                 \
  do {                                                                             \
    cudaError_t tw_cuda_e_ = cudaGetLastError();                                   \
    if (tw_cuda_e_ != cudaSuccess)                                                 \
      return tw_err(TW_ERR_CUDA, "launch of %s failed: %s (%s)", (what),           \
                    cudaGetErrorName(tw_cuda_e_), cudaGetErrorString(tw_cuda_e_)); \
  } while (0)

/** The CUDA driver API function `name` (its 12.0 version), reached through
 *  the runtime so that nothing links libcuda; NULL (and the runtime's error
 *  cleared) where the driver lacks it. */
static inline void *tw_cuda_driver_sym(const char *name) {
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return fn;
}

/** Ceiling division for positive integers. */
#define TW_CDIV(a, b) (((a) + (b) - 1) / (b))

#ifdef __cplusplus
}
#endif
#endif
