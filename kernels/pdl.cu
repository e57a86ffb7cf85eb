/* pdl.cu: the switch of programmatic dependent launch (pdl.cuh). */
#include "kernels/pdl.cuh"

#include "kernels/knobs.h"

extern "C" int tw_cuda_pdl_enabled(void) { return tw_cuda_knobs()->pdl; }
