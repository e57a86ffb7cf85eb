/* simd.h: the float vector type of the CPU kernels, at the native width
 * (GCC vector extensions): 8 lanes with AVX, else 4 (SSE2 / NEON). A wider
 * generic vector than the hardware has is lowered through the stack, which
 * measured 2-3x slower in the matmul micro-kernel. Vectors are never passed
 * to or returned from functions (that would depend on -mavx: -Wpsabi). */
#ifndef TW_COMMON_CPU_SIMD_H
#define TW_COMMON_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#define TW_VL 8
#else
#define TW_VL 4
#endif

typedef float tw_vf __attribute__((vector_size(TW_VL * 4)));
typedef uint16_t tw_vu16 __attribute__((vector_size(TW_VL * 2)));
typedef uint32_t tw_vu32 __attribute__((vector_size(TW_VL * 4)));
typedef uint64_t tw_vu64 __attribute__((vector_size(TW_VL * 4)));

#define TW_VF_LOAD(v, p) memcpy(&(v), (p), sizeof(tw_vf))
#define TW_VF_STORE(p, v) memcpy((p), &(v), sizeof(tw_vf))

/* Sum of the lanes in a fixed order (pairwise). */
static inline float tw_vf_sum(const tw_vf *v) {
#if TW_VL == 8
  return (((*v)[0] + (*v)[4]) + ((*v)[1] + (*v)[5])) + (((*v)[2] + (*v)[6]) + ((*v)[3] + (*v)[7]));
#else
  return ((*v)[0] + (*v)[2]) + ((*v)[1] + (*v)[3]);
#endif
}

#endif
