#include "real/timeline.h"

#include "real/cuda_check.h"

namespace ranklab {

Timeline::Timeline(int max_intervals) : max_intervals_(max_intervals) {
  RANKLAB_CUDA(cudaEventCreate(&origin_));
}

Timeline::~Timeline() {
  for (auto& [a, b] : intervals_) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  if (origin_) cudaEventDestroy(origin_);
}

void Timeline::start(cudaStream_t stream) {
  RANKLAB_CUDA(cudaEventRecord(origin_, stream));
  RANKLAB_CUDA(cudaEventSynchronize(origin_));
}

int Timeline::begin(cudaStream_t stream) {
  if (static_cast<int>(intervals_.size()) >= max_intervals_) {
    truncated_ = true;
    return -1;
  }
  cudaEvent_t a = nullptr, b = nullptr;
  RANKLAB_CUDA(cudaEventCreate(&a));
  if (cudaError_t e = cudaEventCreate(&b); e != cudaSuccess) {
    cudaEventDestroy(a);
    throw_cuda_error(e, "cudaEventCreate");
  }
  intervals_.emplace_back(a, b);
  RANKLAB_CUDA(cudaEventRecord(a, stream));
  return static_cast<int>(intervals_.size()) - 1;
}

void Timeline::end(int id, cudaStream_t stream) {
  if (id < 0) return;
  RANKLAB_CUDA(cudaEventRecord(intervals_[static_cast<size_t>(id)].second, stream));
}

double Timeline::since_origin_us(cudaEvent_t e) const {
  float ms = 0;
  RANKLAB_CUDA(cudaEventElapsedTime(&ms, origin_, e));
  return static_cast<double>(ms) * 1000.0;
}

std::pair<double, double> Timeline::times(int id) const {
  const auto& [a, b] = intervals_[static_cast<size_t>(id)];
  // The duration from its own pair: a float of milliseconds since the origin loses microseconds in long runs.
  float ms = 0;
  RANKLAB_CUDA(cudaEventElapsedTime(&ms, a, b));
  const double start = since_origin_us(a);
  return {start, start + static_cast<double>(ms) * 1000.0};
}

}  // namespace ranklab
