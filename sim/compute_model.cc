#include "sim/compute_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace ranklab::sim {

namespace {
double ceil_div(std::int64_t a, std::int64_t b) {
  return static_cast<double>((a + b - 1) / b);
}

// The fraction of the SMs' tile slots doing useful work: each SM computes whole tm x tn tiles (a partial
// tile at an edge costs a whole one), in waves of one tile per SM (the last wave may leave SMs idle).
double tile_wave_efficiency(std::int64_t m, std::int64_t n, std::int64_t tm, std::int64_t tn, int sms) {
  const double tiles = ceil_div(m, tm) * ceil_div(n, tn);
  const double waves = std::ceil(tiles / sms);
  const double tile_fill =
      static_cast<double>(m) * static_cast<double>(n) / (tiles * static_cast<double>(tm * tn));
  const double wave_fill = tiles / (waves * sms);
  return tile_fill * wave_fill;
}
}  // namespace

ComputeModel::ComputeModel(const GpuModel& gpu) : gpu_(gpu) {
  if (gpu_.sm_count > 0 && gpu_.gemm_mamf_tflops > 0) {
    // The measured GEMM ran at peak x ceiling x (its shape's factors); solve for the ceiling.
    const double measured_fraction = gpu_.gemm_mamf_tflops / gpu_.peak_tflops_bf16;
    gemm_ceiling_ = measured_fraction / (gemm_quantization(gpu_.gemm_mamf_m, gpu_.gemm_mamf_n) *
                                         gemm_k_efficiency(gpu_.gemm_mamf_k));
    if (gemm_ceiling_ > 1) {
      throw UsageError(fmt::format(
          "profile GPU {}: the measured GEMM ({} TFLOPS at {}x{}x{}) is faster than {} of peak, which the "
          "GEMM "
          "model's tile, wave and k factors allow; check gemm_tile_m/n, gemm_k_overhead and sm_count",
          gpu_.name, gpu_.gemm_mamf_tflops, gpu_.gemm_mamf_m, gpu_.gemm_mamf_n, gpu_.gemm_mamf_k,
          gemm_ceiling_));
    }
  }
}

double ComputeModel::gemm_quantization(std::int64_t m, std::int64_t n) const {
  if (gpu_.sm_count <= 0 || m <= 0 || n <= 0) return 1.0;
  const std::int64_t tm = gpu_.gemm_tile_m, tn = gpu_.gemm_tile_n;
  // cuBLAS's heuristics pick among tile shapes; the model takes the better orientation of the profile's.
  return std::max(tile_wave_efficiency(m, n, tm, tn, gpu_.sm_count),
                  tile_wave_efficiency(m, n, tn, tm, gpu_.sm_count));
}

double ComputeModel::gemm_k_efficiency(std::int64_t k) const {
  if (k <= 0) return 1.0;
  const double kd = static_cast<double>(k);
  return kd / (kd + gpu_.gemm_k_overhead);
}

double ComputeModel::peak_tflops(DType dtype) const {
  switch (dtype) {
    case DType::Float32:
      return gpu_.peak_tflops_fp32;  // numerics are float32 without tensor cores
    case DType::BFloat16:
      return gpu_.peak_tflops_bf16;  // dense tensor-core rate
    case DType::Float16:
      return gpu_.peak_tflops_fp16 > 0 ? gpu_.peak_tflops_fp16 : gpu_.peak_tflops_bf16;
  }
  return gpu_.peak_tflops_fp32;
}

KernelCost ComputeModel::kernel_cost(double flops, double bytes, DType dtype) const {
  // TFLOP/s = 1e12 flop/s = 1e6 flop/us; GB/s = 1e9 B/s = 1e3 B/us.
  return {flops / (peak_tflops(dtype) * 1e6 * gpu_.compute_efficiency), memory_us(bytes)};
}

double ComputeModel::memory_us(double bytes) const {
  return bytes / (gpu_.hbm_bandwidth_gbps * 1e3 * gpu_.memory_efficiency);
}

KernelCost ComputeModel::gemm_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
  const double e = static_cast<double>(dtype_bytes(dtype));
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const double bytes = e * static_cast<double>(m * k + k * n + m * n);
  // float32 runs on CUDA cores: the plain roofline, as before 16-bit types existed.
  if (dtype == DType::Float32 || !gemm_shape_model() || flops == 0) return kernel_cost(flops, bytes, dtype);
  const double rate =
      peak_tflops(dtype) * 1e6 * gemm_ceiling_ * gemm_quantization(m, n) * gemm_k_efficiency(k);
  return {flops / rate, memory_us(bytes)};
}

KernelCost ComputeModel::attention_cost(std::int64_t batch, std::int64_t seq, std::int64_t heads,
                                        std::int64_t head_dim, bool causal, bool backward,
                                        DType dtype) const {
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
  if (dtype == DType::Float32) return kernel_cost(flops, bytes, dtype);
  const double measured = backward ? gpu_.attention_bwd_efficiency : gpu_.attention_fwd_efficiency;
  const double efficiency = measured > 0 ? measured : gpu_.compute_efficiency;
  return {flops / (peak_tflops(dtype) * 1e6 * efficiency), memory_us(bytes)};
}

}  // namespace ranklab::sim
