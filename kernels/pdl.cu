/* pdl.cu: the switch of programmatic dependent launch (pdl.cuh). */
#include "kernels/pdl.cuh"

#include <stdlib.h>

extern "C" int tw_cuda_pdl_enabled(void) {
  static int enabled = -1; /* benign race: every thread computes the same value */
  if (enabled < 0) {
    const char *v = getenv("TWAIN_CUDA_PDL");
    enabled = !(v && v[0] == '0');
  }
  return enabled;
}
