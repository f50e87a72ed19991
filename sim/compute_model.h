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
  // Host time to launch one kernel.
  double launch_us() const { return gpu_.launch_overhead_us; }

 private:
  GpuModel gpu_;
};

}  // namespace ranklab::sim
