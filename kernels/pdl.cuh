/* pdl.cuh: programmatic dependent launch (PDL, sm_90) for the kernels of the
 * decode step. A kernel launched by tw_pdl_launch may be scheduled while the
 * kernel before it on the stream is still draining; it must begin with
 * TW_PDL_WAIT(), which blocks until that kernel has completed and its writes
 * are visible (griddepcontrol.wait), so the ordering of the stream is kept:
 * only the launch latency overlaps. Inside a CUDA graph the launch becomes a
 * programmatic edge. TW_PDL_WAIT() is a no-op for a kernel launched without
 * the attribute. TWAIN_CUDA_PDL=0 in the environment turns PDL off (read
 * once per process). CUDA C++ only; not a public header. */
#ifndef TW_KERNELS_PDL_CUH
#define TW_KERNELS_PDL_CUH

#include <cuda_runtime.h>

#include <stdint.h>
#include <utility>

/* TW_PDL_WAIT() also lets the next kernel on the stream launch as soon as
 * every CTA of this one has passed its wait (griddepcontrol.launch_dependents;
 * without it the next grid launches only when this one has exited): the
 * next grid's launch and CTA placement then overlap this kernel's run, while
 * its own TW_PDL_WAIT() still blocks until this kernel has completed. Every
 * CTA of a PDL kernel must run TW_PDL_WAIT() before anything else, an early
 * return included, so that completion stays ordered along the stream.
 * Build with -DTW_PDL_EARLY_TRIGGER=0 to measure without the early launch. */
#ifndef TW_PDL_EARLY_TRIGGER
#define TW_PDL_EARLY_TRIGGER 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && TW_PDL_EARLY_TRIGGER
#define TW_PDL_WAIT() \
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TW_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define TW_PDL_WAIT() \
  do {                \
  } while (0)
#endif

/** 1 unless TWAIN_CUDA_PDL=0 (kernels/pdl.cu). */
extern "C" int tw_cuda_pdl_enabled(void);

/** Launch `kernel` like <<<grid, block, smem, stream>>>(args...), with the
 *  programmatic stream serialization attribute when PDL is enabled and
 *  `stream` is a created stream (not 0 / legacy / per-thread). Returns
 *  the launch error (also left for cudaGetLastError). */
template <typename... KArgs, typename... Args>
static inline cudaError_t tw_pdl_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                        size_t smem, cudaStream_t stream, Args &&...args) {
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = at;
  /* only on created streams: the legacy / per-thread default streams (0, 1, 2)
   * keep plain launches (their implicit synchronisation rules come first) */
  cfg.numAttrs = tw_cuda_pdl_enabled() && (uintptr_t)stream > 2 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

#endif
