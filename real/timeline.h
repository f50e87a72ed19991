// Timeline: when each kernel and collective ran on a rank's GPU, from pairs of CUDA events.
//
// Events are recorded on the streams as the work is queued and read only at the end of the run, so
// timing costs the host two event records per operation and never a wait. Times are microseconds since
// the origin event recorded at launch; the host clock (now()) starts at the moment that event completed,
// so host and device times share one axis.
#pragma once

#include <cuda_runtime.h>

#include <utility>
#include <vector>

namespace ranklab {

class Timeline {
 public:
  explicit Timeline(int max_intervals);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Records the origin on `stream` and blocks until it completes (the device is idle at launch).
  void start(cudaStream_t stream);
  // Opens an interval on `stream`: returns its id, or -1 past the limit (the work then runs untimed).
  int begin(cudaStream_t stream);
  void end(int id, cudaStream_t stream);
  bool truncated() const { return truncated_; }
  // Start and end of interval `id` in microseconds since the origin; call once the device is done.
  std::pair<double, double> times(int id) const;

 private:
  double since_origin_us(cudaEvent_t e) const;
  int max_intervals_;
  bool truncated_ = false;
  cudaEvent_t origin_ = nullptr;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> intervals_;
};

}  // namespace ranklab
