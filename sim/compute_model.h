// ComputeModel: how long a kernel takes on the profile's GPU. A roofline: a kernel is bound either by
// arithmetic (flops / peak) or by memory traffic (bytes / HBM bandwidth), whichever is slower
// (Williams, Waterman & Patterson, "Roofline", CACM 2009). A 16-bit GEMM's arithmetic rate depends on its
// shape (output tiles, waves of tiles over the SMs, k), scaled so that it reproduces a measured large GEMM;
// fused attention runs at a measured fraction of the 16-bit peak. docs/model.md ("Compute") has the
// formulas and the source of every constant.
#pragma once

#include <cstdint>
#include <vector>

#include "common/profile.h"
#include "common/tensor.h"

namespace ranklab::sim {

// A kernel's two roofline times: its arithmetic at the rate its SMs reach, and its HBM traffic at the
// bandwidth it reaches. It takes the slower of the two; kept apart, they say how a kernel slows when
// communication takes some of the SMs or of the HBM bandwidth (SimWorld::launch_kernel).
struct KernelCost {
  double math_us = 0;
  double memory_us = 0;
  double us() const { return math_us > memory_us ? math_us : memory_us; }
};

// One way cuBLAS can run a 16-bit GEMM: output tiles of tile_m x tile_n, each tile's k-loop split over
// `splits` SMs (1: no split), and the time it takes (docs/model.md, "Compute").
struct GemmCandidate {
  int tile_m = 0;
  int tile_n = 0;
  int splits = 1;
  double us = 0;
};

class ComputeModel {
 public:
  // UsageError when the profile's measured GEMM is faster than the model's shape factors allow.
  explicit ComputeModel(const GpuModel& gpu);

  // The roofline times of a kernel doing `flops` operations and moving `bytes` to and from HBM.
  KernelCost kernel_cost(double flops, double bytes, DType dtype) const;
  // op(a) [m, k] @ op(b) [k, n] with inputs and output of `dtype`.
  double gemm_us(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
    return gemm_cost(m, n, k, dtype).us();
  }
  KernelCost gemm_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const;
  // Fused attention (FlashAttention-style) over `batch` sequences of `seq` tokens, `heads` heads of
  // `head_dim`; the backward when `backward`.
  double attention_us(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t head_dim,
                      bool causal, bool backward, DType dtype) const {
    return attention_cost(batch, seq, heads, head_dim, causal, backward, dtype).us();
  }
  KernelCost attention_cost(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t head_dim,
                            bool causal, bool backward, DType dtype) const;
  // A memory-bound kernel moving `bytes` to and from HBM.
  double memory_us(double bytes) const;
  KernelCost memory_cost(double bytes) const { return {0, memory_us(bytes)}; }
  // Host time to launch one kernel.
  double launch_us() const { return gpu_.launch_overhead_us; }

  // The factors of a 16-bit GEMM's rate, each in (0, 1]: the output tiles' fill of their last partial tile
  // times the last wave's fill of the SMs (for the better orientation of the profile's tile), k / (k + k0),
  // a tile's rate against the largest tile's, and the ceiling that makes the model reproduce the profile's
  // measured GEMM. Exposed for tests and docs.
  double gemm_quantization(std::int64_t m, std::int64_t n) const;
  double gemm_k_efficiency(std::int64_t k) const;
  double gemm_tile_efficiency(std::int64_t tile_m, std::int64_t tile_n, DType dtype) const;
  double gemm_ceiling() const { return gemm_ceiling_; }
  // Every way the model considers running a 16-bit GEMM, each with its time; gemm_cost takes the fastest.
  // The profile's tile and its transpose; with gemm_ridge_flops_per_byte, also the smaller tiles and, for
  // a GEMM whose tiles do not fill the SMs, each tile with its k-loop split.
  std::vector<GemmCandidate> gemm_candidates(std::int64_t m, std::int64_t n, std::int64_t k,
                                             DType dtype) const;
  // Whether 16-bit GEMMs use the shape model (the profile has sm_count and a measured GEMM).
  bool gemm_shape_model() const { return gemm_ceiling_ > 0; }

 private:
  double peak_tflops(DType dtype) const;
  GemmCandidate gemm_fastest(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const;
  GpuModel gpu_;
  double gemm_ceiling_ = 0;
};

}  // namespace ranklab::sim
