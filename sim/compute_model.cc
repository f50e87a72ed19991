#include "sim/compute_model.h"

#include <algorithm>

namespace ranklab::sim {

double ComputeModel::kernel_us(double flops, double bytes, DType dtype) const {
  double peak_tflops = 0;
  switch (dtype) {
    case DType::Float32:
      peak_tflops = gpu_.peak_tflops_fp32;  // numerics are float32 without tensor cores
      break;
  }
  // TFLOP/s = 1e12 flop/s = 1e6 flop/us; GB/s = 1e9 B/s = 1e3 B/us.
  const double math_us = flops / (peak_tflops * 1e6 * gpu_.compute_efficiency);
  const double memory_us = bytes / (gpu_.hbm_bandwidth_gbps * 1e3 * gpu_.memory_efficiency);
  return std::max(math_us, memory_us);
}

}  // namespace ranklab::sim
