/* bench_util.h: helpers shared by the CUDA kernel benchmarks (header-only,
 * static): the CUDA error check that fails the benchmark and the float
 * comparison for qsort (medians). */
#ifndef TW_TESTS_BENCH_BENCH_UTIL_H
#define TW_TESTS_BENCH_BENCH_UTIL_H

#include <cuda_runtime.h>
#include <stdio.h>

#define TFLOPS_CEIL 742.0 /* bf16 GEMM, MACHINES.md */
#define GBS_CEIL 4200.0   /* device copy, read + write, MACHINES.md */

/* Print the failing call and return 1 from the enclosing int function. */
#define CK(call)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

static inline int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

#endif
