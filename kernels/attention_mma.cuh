/* attention_mma.cuh: device helpers shared by attention_prefill.cu and
 * attention_decode.cu (private to the attention kernels): cp.async 16-byte
 * copies, ldmatrix, the bf16 m16n8k16 tensor-core MMA with f32 accumulation,
 * and the swizzled shared-memory layout of 64-wide bf16 tiles.
 *
 * Tiles of head_dim 64 bf16 are 128-byte rows = 8 chunks of 16 bytes. Chunk
 * c of row r is stored at chunk c ^ (r & 7): the 8 row addresses of one
 * ldmatrix 8x8 matrix (8 consecutive rows, same logical chunk) then fall in 8
 * different 16-byte bank groups, so ldmatrix and cp.async are conflict-free.
 *
 * Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
 *   A 16x16 row-major: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
 *                      a[3] = (g+8, 2t+8..)
 *   B 16x8 "col":      b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
 *   C 16x8:            c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1) */
#ifndef TW_KERNELS_ATTENTION_MMA_CUH
#define TW_KERNELS_ATTENTION_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#define TW_ATTN_D 64 /* the only head_dim built */

static __device__ __forceinline__ uint32_t tw_smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* Byte offset of (row, 16-byte chunk) in a swizzled 64-wide bf16 tile. */
static __device__ __forceinline__ uint32_t tw_swz(int row, int chunk) {
  return (uint32_t)((row * 8 + (chunk ^ (row & 7))) * 16);
}

/* 16-byte global->shared copy; zero-fills when !valid (nothing is read). */
static __device__ __forceinline__ void tw_cp_async16(uint32_t dst, const void *src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
static __device__ __forceinline__ void tw_cp_async_commit(void) {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
static __device__ __forceinline__ void tw_cp_async_wait(void) {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void tw_ldmatrix_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
static __device__ __forceinline__ void tw_ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* c += a * b, bf16 inputs, f32 accumulators. */
static __device__ __forceinline__ void tw_mma16816(float c[4], const uint32_t a[4], uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats to one register of two bf16 (lo in the low half). */
static __device__ __forceinline__ uint32_t tw_pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

static __device__ __forceinline__ float tw_fast_exp2(float x) { return exp2f(x); }

#define TW_LOG2E 1.4426950408889634f

#endif
