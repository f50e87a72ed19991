// RANKLAB_HD marks a function both backends run: the simulator on the host, the real backend in a CUDA
// kernel, so that their arithmetic is one text.
#pragma once

#if defined(__CUDACC__)
#define RANKLAB_HD __host__ __device__
#else
#define RANKLAB_HD
#endif
