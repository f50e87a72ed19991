#include "sim/compute_model.h"

#include <algorithm>

namespace ranklab::sim {

double ComputeModel::peak_tflops(DType dtype) const {
  switch (dtype) {
    case DType::Float32:
      return gpu_.peak_tflops_fp32;  // numerics are float32 without tensor cores
    case DType::BFloat16:
    case DType::Float16:
      return gpu_.peak_tflops_bf16;  // dense tensor-core rate; float16's equals bfloat16's on these GPUs
  }
  return gpu_.peak_tflops_fp32;
}

double ComputeModel::kernel_us(double flops, double bytes, DType dtype) const {
  // TFLOP/s = 1e12 flop/s = 1e6 flop/us; GB/s = 1e9 B/s = 1e3 B/us.
  const double math_us = flops / (peak_tflops(dtype) * 1e6 * gpu_.compute_efficiency);
  return std::max(math_us, memory_us(bytes));
}

double ComputeModel::memory_us(double bytes) const {
  return bytes / (gpu_.hbm_bandwidth_gbps * 1e3 * gpu_.memory_efficiency);
}

double ComputeModel::gemm_us(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
  const double e = static_cast<double>(dtype_bytes(dtype));
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  return kernel_us(flops, e * static_cast<double>(m * k + k * n + m * n), dtype);
}

double ComputeModel::attention_us(std::int64_t batch, std::int64_t seq, std::int64_t heads,
                                  std::int64_t head_dim, bool causal, bool backward, DType dtype) const {
  // Two GEMMs of 2 s^2 d flops per head forward (Q K^T and P V); causal masking skips half of them.
  double flops = 4.0 * static_cast<double>(batch) * static_cast<double>(seq) * static_cast<double>(seq) *
                 static_cast<double>(heads) * static_cast<double>(head_dim);
  if (causal) flops /= 2;
  if (backward) flops *= 2.5;  // five GEMMs instead of two (FlashAttention-2 paper, section 4.1)
  const double e = static_cast<double>(dtype_bytes(dtype));
  const double tokens = static_cast<double>(batch * seq);
  const double width = static_cast<double>(heads * head_dim);
  // Forward reads q, k, v and writes out and lse; backward also reads out and d out and writes d qkv.
  const double bytes = backward ? e * tokens * width * 8 + 4.0 * tokens * heads
                                : e * tokens * width * 4 + 4.0 * tokens * heads;
  return kernel_us(flops, bytes, dtype);
}

}  // namespace ranklab::sim
