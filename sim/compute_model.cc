#include "sim/compute_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

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

// The sides of the tiles cuBLAS and CUTLASS build their 16-bit kernels from: 64 is the smallest (Hopper's
// warpgroup MMA is 64 rows, wgmma.m64nNk16; CUTLASS's SM80 and SM90 tile lists start at 64x64), 256 the
// largest side of a one-SM tile (128x256, 256x128).
constexpr std::int64_t kTileSides[] = {64, 128, 256};

// A split-K partial sum is float32 (cuBLAS accumulates 16-bit GEMMs in float32).
constexpr double kPartialSumBytes = 4;

// Operand intensity of a tm x tn tile: per element of k it loads tm + tn operands and does 2 tm tn flops.
double tile_flops_per_byte(std::int64_t tm, std::int64_t tn, double element_bytes) {
  return 2.0 * static_cast<double>(tm) * static_cast<double>(tn) /
         (static_cast<double>(tm + tn) * element_bytes);
}
}  // namespace

ComputeModel::ComputeModel(const GpuModel& gpu) : gpu_(gpu) {
  if (gpu_.sm_count > 0 && gpu_.gemm_mamf_tflops > 0) {
    // The measured GEMM ran at ceiling x (the rate of the fastest candidate at a ceiling of 1); solve for the
    // ceiling. It scales every candidate alike, so the fastest one does not depend on it.
    gemm_ceiling_ = 1.0;
    const double flops = 2.0 * static_cast<double>(gpu_.gemm_mamf_m) * static_cast<double>(gpu_.gemm_mamf_n) *
                         static_cast<double>(gpu_.gemm_mamf_k);
    const double model_tflops =
        flops / gemm_fastest(gpu_.gemm_mamf_m, gpu_.gemm_mamf_n, gpu_.gemm_mamf_k, DType::BFloat16).us / 1e6;
    gemm_ceiling_ = gpu_.gemm_mamf_tflops / model_tflops;
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

double ComputeModel::gemm_tile_efficiency(std::int64_t tile_m, std::int64_t tile_n, DType dtype) const {
  const double ridge = gpu_.gemm_ridge_flops_per_byte;
  if (ridge <= 0) return 1.0;
  // A tile's SM runs its tensor cores at full rate while its operands arrive fast enough: at the ridge
  // intensity and above. Below it, the SM waits for operands and runs at intensity / ridge. Relative to the
  // profile's (largest) tile, whose rate the ceiling already carries.
  const double e = static_cast<double>(dtype_bytes(dtype));
  auto rate = [&](std::int64_t tm, std::int64_t tn) {
    return std::min(1.0, tile_flops_per_byte(tm, tn, e) / ridge);
  };
  return rate(tile_m, tile_n) / rate(gpu_.gemm_tile_m, gpu_.gemm_tile_n);
}

std::vector<GemmCandidate> ComputeModel::gemm_candidates(std::int64_t m, std::int64_t n, std::int64_t k,
                                                         DType dtype) const {
  std::vector<GemmCandidate> out;
  if (!gemm_shape_model() || m <= 0 || n <= 0 || k <= 0) return out;
  const std::int64_t tm0 = gpu_.gemm_tile_m, tn0 = gpu_.gemm_tile_n;
  std::vector<std::pair<std::int64_t, std::int64_t>> tiles = {{tm0, tn0}, {tn0, tm0}};
  const bool shapes = gpu_.gemm_ridge_flops_per_byte > 0;
  if (shapes) {
    // cuBLAS's smaller kernels: every tile of kTileSides no larger than the profile's tile.
    for (std::int64_t a : kTileSides) {
      for (std::int64_t b : kTileSides) {
        if (a * b <= tm0 * tn0 && std::find(tiles.begin(), tiles.end(), std::make_pair(a, b)) == tiles.end())
          tiles.emplace_back(a, b);
      }
    }
  }
  const int sms = gpu_.sm_count;
  // One SM's share of the peak at the ceiling, in flop per microsecond.
  const double sm_flops_per_us = peak_tflops(dtype) * 1e6 * gemm_ceiling_ / sms;
  const double k0 = gpu_.gemm_k_overhead;
  for (const auto& [tm, tn] : tiles) {
    const double tiles_count = ceil_div(m, tm) * ceil_div(n, tn);
    const double tile_flops_per_k = 2.0 * static_cast<double>(tm) * static_cast<double>(tn);
    const double sm_rate = sm_flops_per_us * gemm_tile_efficiency(tm, tn, dtype);
    // Data-parallel: waves of one tile per SM, each tile the whole k-loop and its pipeline fill and drain.
    const double waves = std::ceil(tiles_count / sms);
    out.push_back({static_cast<int>(tm), static_cast<int>(tn), 1,
                   waves * tile_flops_per_k * (static_cast<double>(k) + k0) / sm_rate});
    if (!shapes) continue;
    // Split-K (what stream-K does when the tiles do not fill the SMs): each tile's k-loop in `splits`
    // slices on as many SMs, all in one wave; no slice shorter than its own pipeline. The slices write
    // float32 partial sums and the reduction reads them back, through HBM, after the slices' arithmetic.
    for (int splits = 2; tiles_count * splits <= sms && ceil_div(k, splits) >= std::max(k0, 1.0); ++splits) {
      const double slice_us = tile_flops_per_k * (ceil_div(k, splits) + k0) / sm_rate;
      const double fixup_us =
          memory_us(2.0 * splits * kPartialSumBytes * static_cast<double>(m) * static_cast<double>(n));
      out.push_back({static_cast<int>(tm), static_cast<int>(tn), splits, slice_us + fixup_us});
    }
  }
  return out;
}

GemmCandidate ComputeModel::gemm_fastest(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
  const std::vector<GemmCandidate> all = gemm_candidates(m, n, k, dtype);
  // cuBLAS's heuristics intend the fastest kernel; ties go to the first (the profile's tile, unsplit).
  return *std::min_element(all.begin(), all.end(),
                           [](const GemmCandidate& a, const GemmCandidate& b) { return a.us < b.us; });
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
  return {gemm_fastest(m, n, k, dtype).us, memory_us(bytes)};
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
