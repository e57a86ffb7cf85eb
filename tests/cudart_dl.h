/* cudart_dl.h: the few CUDA runtime calls the two-process KV transfer test
 * and benchmark make, through a run-time loaded libcudart (header-only,
 * static), so they build without CUDA and exit 77 where no GPU is usable.
 * Load it only after fork(): a CUDA context does not survive one. */
#ifndef TW_TESTS_CUDART_DL_H
#define TW_TESTS_CUDART_DL_H

#include <dlfcn.h>
#include <stddef.h>

typedef struct {
  int (*set_device)(int);
  int (*malloc_)(void **, size_t);
  int (*memset_)(void *, int, size_t);
  int (*memcpy_)(void *, const void *, size_t, int); /* kind 1: H2D, 2: D2H */
  int (*sync)(void);
} tw_test_cudart_t;

/** Load libcudart and select device 0. 0 on success, -1 when unusable. */
static inline int tw_test_cudart_load(tw_test_cudart_t *rt) {
  const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  void *lib = NULL;
  for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
    lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!lib) return -1;
  rt->set_device = (int (*)(int))dlsym(lib, "cudaSetDevice");
  rt->malloc_ = (int (*)(void **, size_t))dlsym(lib, "cudaMalloc");
  rt->memset_ = (int (*)(void *, int, size_t))dlsym(lib, "cudaMemset");
  rt->memcpy_ = (int (*)(void *, const void *, size_t, int))dlsym(lib, "cudaMemcpy");
  rt->sync = (int (*)(void))dlsym(lib, "cudaDeviceSynchronize");
  if (!rt->set_device || !rt->malloc_ || !rt->memset_ || !rt->memcpy_ || !rt->sync) return -1;
  return rt->set_device(0) == 0 ? 0 : -1;
}

/** cudaMalloc'd bytes set to `fill` (NULL when not possible). */
static inline void *tw_test_device_alloc(tw_test_cudart_t *rt, size_t bytes, int fill) {
  void *p = NULL;
  if (rt->malloc_(&p, bytes) != 0) return NULL;
  if (rt->memset_(p, fill, bytes) != 0 || rt->sync() != 0) return NULL;
  return p; /* freed with the process */
}

#endif
