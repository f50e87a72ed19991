// The real backend's FP8 kernels: quantizing into e4m3 and e5m2 with per-tensor or per-block scales, reading
// FP8 codes back as the values they stand for, the k-major copy cuBLASLt's FP8 GEMMs read, and the
// per-tensor scale's small kernels. Every value is rounded by the simulator's own functions
// (common/dtype_round.h, compiled for the device), so the two backends hold the same numbers.
#include <cmath>
#include <cstdint>

#include "common/dtype_round.h"
#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/kernel_common.cuh"
#include "real/kernels.h"

namespace ranklab::kernels {

namespace {

__device__ inline std::uint8_t encode(float x, const Float8Format& f) {
  return float8_code(round_to_float8(x, f), f);
}

// A non-negative float's atomic max: their bits order as the values do.
__device__ inline void atomic_max_nonnegative(float* at, float v) {
  atomicMax(reinterpret_cast<int*>(at), __float_as_int(v));
}

__global__ void quantize_tensor_kernel(std::uint8_t* out, const void* x, DType x_t, std::int64_t n,
                                       Float8Format f, const float* scale, float* scale_inv,
                                       float* record_amax) {
  __shared__ float scratch[32];
  const float s = scale != nullptr ? *scale : 1.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0 && scale_inv != nullptr) *scale_inv = 1.0f / s;
  const AnyIn in{x, x_t};
  float most = 0;
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const float v = in[i];
    most = fmaxf(most, fabsf(v));
    out[i] = encode(v * s, f);
  }
  if (record_amax != nullptr) {
    most = block_max_f(most, scratch);
    if (threadIdx.x == 0) atomic_max_nonnegative(record_amax, most);
  }
}

// One thread block per scaling block (block b = row block b / per_row, column block b % per_row).
__global__ void quantize_blocks_kernel(std::uint8_t* out, const void* x, DType x_t, std::int64_t rows,
                                       std::int64_t cols, Float8Format f, Fp8Blocks blocks, void* scales) {
  __shared__ float scratch[32];
  const AnyIn in{x, x_t};
  const std::int64_t per_row = (cols + blocks.cols - 1) / blocks.cols;
  const std::int64_t b = blockIdx.x;
  const std::int64_t r0 = (b / per_row) * blocks.rows, c0 = (b % per_row) * blocks.cols;
  const std::int64_t r1 = min(rows, r0 + blocks.rows), c1 = min(cols, c0 + blocks.cols);
  const std::int64_t width = c1 - c0, n = (r1 - r0) * width;
  float most = 0;
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    most = fmaxf(most, fabsf(in[(r0 + t / width) * cols + c0 + t % width]));
  }
  most = block_max_f(most, scratch);
  float s = fp8_scale_for(most, f.largest);
  if (blocks.e8m0) s = power_of_two_below(s);
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const std::int64_t i = (r0 + t / width) * cols + c0 + t % width;
    out[i] = encode(in[i] * s, f);
  }
  if (threadIdx.x == 0) {
    if (blocks.e8m0) {
      static_cast<std::uint8_t*>(scales)[b] = e8m0_code_of_inverse(s);
    } else {
      static_cast<float*>(scales)[b] = 1.0f / s;
    }
  }
}

__global__ void dequantize_kernel(float* out, const std::uint8_t* codes, std::int64_t rows, std::int64_t cols,
                                  Float8Format f, Fp8Blocks blocks, const void* scales,
                                  std::int64_t first_row, std::int64_t scale_row_blocks) {
  const std::int64_t n = rows * cols;
  for (std::int64_t idx = first_index(); idx < n; idx += stride()) {
    const std::int64_t i = idx / cols, j = idx % cols;
    float inverse = 0;
    if (blocks.rows == 0) {  // per tensor
      inverse = static_cast<const float*>(scales)[0];
    } else {
      const std::int64_t b = ((first_row + i) / blocks.rows) * scale_row_blocks + j / blocks.cols;
      inverse = blocks.e8m0 ? e8m0_value(static_cast<const std::uint8_t*>(scales)[b])
                            : static_cast<const float*>(scales)[b];
    }
    out[idx] = float8_value(codes[idx], f) * inverse;
  }
}

__global__ void transpose_bytes_kernel(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows,
                                       std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t idx = first_index(); idx < n; idx += stride())
    out[(idx % cols) * rows + idx / cols] = in[idx];
}

__global__ void amax_kernel(float* out, const void* x, DType t, std::int64_t n) {
  __shared__ float scratch[32];
  const AnyIn in{x, t};
  float most = 0;
  for (std::int64_t i = first_index(); i < n; i += stride()) most = fmaxf(most, fabsf(in[i]));
  most = block_max_f(most, scratch);
  if (threadIdx.x == 0) atomic_max_nonnegative(out, most);
}

__global__ void fp8_scale_kernel(float* out, const float* amax, float largest) {
  *out = fp8_scale_for(*amax, largest);
}

__global__ void delayed_update_kernel(float* history, std::int64_t len, float* scale, float* amax,
                                      const float* reduced, float largest) {
  const float newest = *reduced;
  float most = newest;
  for (std::int64_t j = 0; j < len; ++j) most = fmaxf(most, history[j]);
  // TransformerEngine keeps the scale where the amax is 0 (nothing seen yet) or not finite.
  if (most > 0 && isfinite(most)) *scale = fp8_scale_for(most, largest);
  for (std::int64_t j = len - 1; j > 0; --j) history[j] = history[j - 1];
  if (len > 0) history[0] = newest;
  *amax = 0;
}

}  // namespace

void fp8_quantize(std::uint8_t* out, const void* x, DType x_t, std::int64_t rows, std::int64_t cols,
                  DType format, const Fp8Blocks& blocks, const float* scale, float* scale_inv, void* scales,
                  float* record_amax, cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  const Float8Format f = float8_format(format);
  if (blocks.per_tensor()) {
    quantize_tensor_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, x, x_t, n, f, scale, scale_inv,
                                                              record_amax);
  } else {
    const std::int64_t count =
        ((rows + blocks.rows - 1) / blocks.rows) * ((cols + blocks.cols - 1) / blocks.cols);
    if (count > 2147483647) throw UsageError("quantize: more than 2^31 - 1 scaling blocks in one launch");
    quantize_blocks_kernel<<<static_cast<unsigned>(count), kThreads, 0, s>>>(out, x, x_t, rows, cols, f,
                                                                             blocks, scales);
  }
  check_launch("quantize kernel launch");
}

void fp8_dequantize(float* out, const std::uint8_t* codes, std::int64_t rows, std::int64_t cols, DType format,
                    const Fp8Blocks& blocks, const void* scales, std::int64_t first_row,
                    std::int64_t scale_row_blocks, cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dequantize_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, codes, rows, cols, float8_format(format), blocks,
                                                       scales, first_row, scale_row_blocks);
  check_launch("dequantize kernel launch");
}

void transpose_bytes(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows, std::int64_t cols,
                     cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  transpose_bytes_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, in, rows, cols);
  check_launch("transpose kernel launch");
}

void amax(float* out, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  RANKLAB_CUDA(cudaMemsetAsync(out, 0, sizeof(float), s));
  if (n == 0) return;
  amax_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, x, t, n);
  check_launch("amax kernel launch");
}

void fp8_scale(float* out, const float* amax, float largest, cudaStream_t s) {
  fp8_scale_kernel<<<1, 1, 0, s>>>(out, amax, largest);
  check_launch("fp8_scale kernel launch");
}

void fp8_delayed_update(float* history, std::int64_t len, float* scale, float* amax, const float* reduced,
                        float largest, cudaStream_t s) {
  delayed_update_kernel<<<1, 1, 0, s>>>(history, len, scale, amax, reduced, largest);
  check_launch("fp8_delayed_update kernel launch");
}

}  // namespace ranklab::kernels
