// ComputeModel: how long a kernel takes on the profile's GPU. A roofline: a kernel is bound either by
// arithmetic (flops / peak) or by memory traffic (bytes / HBM bandwidth), whichever is slower
// (Williams, Waterman & Patterson, "Roofline", CACM 2009).
#pragma once

#include <cstdint>

#include "common/profile.h"
#include "common/tensor.h"

namespace ranklab::sim {

class ComputeModel {
 public:
  explicit ComputeModel(const GpuModel& gpu) : gpu_(gpu) {}

  // Device time of a kernel doing `flops` operations and moving `bytes` to and from HBM.
  double kernel_us(double flops, double bytes, DType dtype) const;
  // op(a) [m, k] @ op(b) [k, n] with inputs and output of `dtype`.
  double gemm_us(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const;
  // Fused attention (FlashAttention-style) over `batch` sequences of `seq` tokens, `heads` heads of
  // `head_dim`; the backward when `backward`.
  double attention_us(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t head_dim,
                      bool causal, bool backward, DType dtype) const;
  // A memory-bound kernel moving `bytes` to and from HBM.
  double memory_us(double bytes) const;
  // Host time to launch one kernel.
  double launch_us() const { return gpu_.launch_overhead_us; }

 private:
  double peak_tflops(DType dtype) const;
  GpuModel gpu_;
};

}  // namespace ranklab::sim
