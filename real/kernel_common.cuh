// What the real backend's kernel files share (kernels.cu, fp8_kernels.cu): the launch shape of a grid-stride
// loop, the launch check, an operand of any dtype, and the block reductions. Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/tensor.h"
#include "real/cuda_check.h"

namespace ranklab::kernels {

inline constexpr int kThreads = 256;

// Enough blocks to fill the GPU several times over, and no more: beyond that a grid-stride loop only adds
// scheduling work.
inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65536 ? wanted : 65536);
}

inline void check_launch(const char* kernel) {
  cuda_check(cudaGetLastError(), kernel);
}

__device__ inline std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

// An operand whose dtype is not the kernel's own (the source of a mixed-precision add_ or copy_, layer
// norm's parameters, a cast's input): one warp-uniform switch per load instead of a template per pair of
// types.
struct AnyIn {
  const void* p;
  DType t;
  __device__ float operator[](std::int64_t i) const {
    switch (t) {
      case DType::BFloat16:
        return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
      case DType::Float16:
        return __half2float(static_cast<const __half*>(p)[i]);
      case DType::Float8E4M3:  // codes with scales: only fp8_kernels.cu reads them (dispatch refuses them)
      case DType::Float8E5M2:
      case DType::Float32:
        break;
    }
    return static_cast<const float*>(p)[i];
  }
};

// Reduces `value` over the block (blockDim.x a multiple of 32) with `op` and returns the result to every
// thread. `scratch` holds 32 floats of shared memory. The order is fixed: within warps by shuffles, then
// warp 0's result combined with warp 1's, 2's, ... in turn. Every thread of the block must call it.
template <typename Op>
__device__ float block_reduce(float value, Op op, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // an earlier reduction's readers are done with scratch
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) r = op(r, scratch[w]);
  return r;
}

struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ inline float block_sum_f(float v, float* scratch) {
  return block_reduce(v, Add{}, scratch);
}
__device__ inline float block_max_f(float v, float* scratch) {
  return block_reduce(v, Max{}, scratch);
}

}  // namespace ranklab::kernels
