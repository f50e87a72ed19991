// CudaRank: the Rank interface on one GPU.
//
// Streams mirror the simulator's clocks. Kernels (ours and cuBLAS's) run on the compute stream; NCCL runs
// on the communication stream. A collective first makes the communication stream wait for an event
// recorded on the compute stream at the call, so it sees every kernel issued before it. Then:
//  - synchronous (Async::No): the compute stream waits for the collective's end event, and the host goes
//    on at once, as torch.distributed does with NCCL;
//  - asynchronous (Async::Yes): the end event goes into the returned Work, whose wait() makes the compute
//    stream wait. Until then (or until synchronize()), touching any of its tensors from the compute stream
//    or the host is a UsageError, as in the simulator: on a GPU it would be a race that sometimes works.
// synchronize() waits for both streams. barrier() is a rendezvous of host threads or processes that waits
// for no device work, so barrier() before synchronize() measures too little, as the lecture shows.
// now() is the host's steady clock since the launch.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/rank.h"
#include "real/cuda_backend.h"
#include "real/device_memory.h"
#include "real/host_comm.h"
#include "real/nccl_comm.h"
#include "real/rank_log.h"
#include "real/timeline.h"
#include "real/watchdog.h"

namespace ranklab {

struct RankSetup {
  int rank = 0;
  int world = 1;
  int device = 0;
  HostComm* host = nullptr;
  const std::atomic<bool>* abort_flag = nullptr;  // raised when another rank failed
  const CudaConfig* config = nullptr;
};

class CudaRank : public Rank {
 public:
  // Makes the streams, the cuBLAS handle and the memory account on the current device.
  explicit CudaRank(const RankSetup& setup);
  ~CudaRank() override;

  // Creates the world communicator: rank 0's NCCL unique id reaches the others through the HostComm.
  void connect();
  // Starts the clocks, after a host rendezvous of all ranks.
  void start();
  // After the lesson returned: waits for the device, frees the communicators and returns the timings.
  RankLog finish();
  // After a failure: ends the communicators' kernels so nothing of this rank keeps the GPU busy.
  void abort() noexcept;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Tensor empty(const Shape& s) override;
  Tensor zeros(const Shape& s) override;
  Tensor full(const Shape& s, float value) override;
  Tensor arange(const Shape& s, float start) override;
  Tensor randn(const Shape& s, std::uint64_t seed, float std) override;
  Tensor from_host(const Shape& s, const std::vector<float>& values) override;
  Tensor phantom(const Shape& s) override;
  std::vector<float> to_host(const Tensor& t) override;

  Tensor matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) override;
  Tensor relu(const Tensor& x) override;
  Tensor relu_backward(const Tensor& grad_out, const Tensor& x) override;
  Tensor add(const Tensor& a, const Tensor& b) override;
  void add_(const Tensor& dst, const Tensor& src, float alpha) override;
  void scale_(const Tensor& t, float factor) override;
  void copy_(const Tensor& dst, const Tensor& src) override;
  Tensor sum(const Tensor& t) override;
  Tensor slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) override;
  Tensor cat(const std::vector<Tensor>& parts, int dim) override;
  void sgd_step(const Tensor& param, const Tensor& grad, float lr) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamW& h,
                  int step) override;

  Work communicate(const CommCall& call) override;
  Group new_group(const std::vector<int>& ranks) override;

  void synchronize() override;
  double now() override;

  std::int64_t memory_allocated() const override { return account_->in_use(); }
  std::int64_t memory_peak() const override { return account_->peak(); }
  std::int64_t memory_capacity() const override { return account_->capacity(); }

  void region_begin(const std::string& name) override;
  void region_end() override;
  void print(const std::string& line) override;
  void show(const std::string& label, const Tensor& t) override;
  void check(const std::string& what, bool passed, const std::string& detail) override;

 private:
  struct Resolved;  // a collective's communicator and ranks inside it (cuda_comm.cc)

  void init();
  void release() noexcept;

  // Argument checks, in the simulator's words.
  std::string where(const char* op) const;  // "rank 1: matmul"
  // The tensor's device buffer, after checking it is defined and this rank's.
  float* require(const Tensor& t, const char* op, const char* arg) const;
  // Raises when a kernel would touch a tensor an unwaited asynchronous call still uses.
  void before_kernel(std::initializer_list<const Tensor*> tensors, const char* op);
  void require_same_shape(const Tensor& a, const Tensor& b, const char* op) const;
  void require_same_kind(const Tensor& dst, const Tensor& src, const char* op) const;
  Tensor allocate(const Shape& s, bool phantom, const char* op);
  // Runs `launch` on the compute stream between a timed pair of events named `name`.
  template <typename Launch>
  void kernel(const char* name, Launch&& launch);

  void validate(const CommCall& call) const;
  Resolved resolve(const CommCall& call) const;
  void launch_nccl(const CommCall& call, const Resolved& r);
  void settle(ncclResult_t r, ncclComm_t comm, const char* what);

  int rank_;
  int world_;
  int device_;
  HostComm* host_;
  const CudaConfig& config_;
  std::string host_name_;
  std::string device_name_;

  cudaStream_t compute_ = nullptr;
  cudaStream_t comm_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cudaEvent_t issue_ = nullptr;  // compute -> communication ordering, reused per call
  cudaEvent_t sync_compute_ = nullptr;
  cudaEvent_t sync_comm_ = nullptr;
  double* sum_scratch_ = nullptr;
  static constexpr size_t kCublasWorkspaceBytes = 32 << 20;
  void* cublas_workspace_ = nullptr;

  std::shared_ptr<DeviceAccount> account_;
  Watchdog watchdog_;
  Timeline timeline_;
  Communicators comms_;

  std::chrono::steady_clock::time_point origin_;
  int next_group_id_ = 1;
  std::map<int, std::int64_t> group_calls_;  // calls per group, to match them across members
  std::map<int, std::int64_t> sends_to_;     // point-to-point calls per peer
  std::map<int, std::int64_t> recvs_from_;

  struct TimedKernel {
    std::string name;
    int interval;
  };
  std::vector<TimedKernel> kernels_;
  struct TimedComm {
    CommTiming timing;
    int interval;
  };
  std::vector<TimedComm> comm_timings_;
  std::vector<std::shared_ptr<AsyncOp>> outstanding_;  // async calls not yet waited on
  std::vector<std::pair<std::string, double>> open_regions_;
  RankLog log_;
};

}  // namespace ranklab
