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

#include <cublasLt.h>
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
#include "real/kernels.h"
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

  // The factories without a dtype (Rank's float32 overloads) stay visible next to these overrides.
  using Rank::arange;
  using Rank::empty;
  using Rank::from_host;
  using Rank::full;
  using Rank::phantom;
  using Rank::randn;
  using Rank::zeros;
  Tensor empty(const Shape& s, DType dtype) override;
  Tensor zeros(const Shape& s, DType dtype) override;
  Tensor full(const Shape& s, float value, DType dtype) override;
  Tensor arange(const Shape& s, float start) override;
  Tensor randn(const Shape& s, std::uint64_t seed, float std, DType dtype) override;
  Tensor randn_slice(const Shape& full, int dim, std::int64_t start, std::int64_t length, std::uint64_t seed,
                     float std, DType dtype) override;
  Tensor from_host(const Shape& s, const std::vector<float>& values, DType dtype) override;
  Tensor phantom(const Shape& s, DType dtype) override;
  Tensor view(const Tensor& base, std::int64_t offset, const Shape& shape) override;
  std::vector<float> to_host(const Tensor& t) override;

  using Rank::matmul;
  Tensor matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) override;
  Tensor relu(const Tensor& x) override;
  Tensor relu_backward(const Tensor& grad_out, const Tensor& x) override;
  Tensor add(const Tensor& a, const Tensor& b) override;
  void add_(const Tensor& dst, const Tensor& src, float alpha) override;
  void scale_(const Tensor& t, float factor) override;
  void copy_(const Tensor& dst, const Tensor& src) override;
  Tensor cast(const Tensor& t, DType dtype) override;
  Quantized quantize(const Tensor& x, DType format, const Fp8Scaling& scaling, const Tensor& scale,
                     bool both_layouts, const Tensor& record_amax) override;
  Tensor amax(const Tensor& x) override;
  Tensor fp8_scale(const Tensor& amax, DType format) override;
  void fp8_delayed_update(const Tensor& reduced, const std::vector<Tensor>& histories,
                          const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes, DType format,
                          int margin) override;
  Tensor sum(const Tensor& t) override;
  Tensor squared_norm(const std::vector<Tensor>& ts) override;
  Tensor slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) override;
  Tensor cat(const std::vector<Tensor>& parts, int dim) override;
  void sgd_step(const Tensor& param, const Tensor& grad, float lr) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamW& h,
                  int step) override;
  // Each part's own adamw_step kernel: the simulator times the fused kernel the frameworks run.
  void fused_adamw_step(const std::vector<AdamWPart>& parts, const AdamW& h, int step) override;

  void add_bias_(const Tensor& x, const Tensor& bias) override;
  Tensor sum_rows(const Tensor& x) override;
  LayerNormOut layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) override;
  LayerNormGrads layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd) override;
  Tensor gelu(const Tensor& x) override;
  Tensor gelu_backward(const Tensor& dy, const Tensor& x) override;
  Tensor dropout(const Tensor& x, float p, std::uint64_t seed, const DropoutRows& rows) override;
  using Rank::attention;
  using Rank::attention_backward;
  AttentionOut attention(const Tensor& qkv, const AttentionSpec& spec) override;
  Tensor attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                            const AttentionSpec& spec) override;
  void rope_(const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position, double base,
             bool inverse) override;
  Tensor key_values(const Tensor& qkv, const AttentionSpec& spec) override;
  void add_key_values_(const Tensor& dqkv, const Tensor& dkv, const AttentionSpec& spec) override;
  void attention_block_(AttentionOut& acc, const Tensor& qkv, const Tensor& kv, const AttentionSpec& spec,
                        const AttentionBlock& block) override;
  void attention_block_backward_(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                                 const Tensor& kv, const Tensor& out, const Tensor& lse,
                                 const AttentionSpec& spec, const AttentionBlock& block) override;
  void attention_sinks_(AttentionOut& acc, const AttentionSpec& spec) override;
  Tensor attention_sinks_backward(const Tensor& dout, const Tensor& out, const Tensor& lse,
                                  const AttentionSpec& spec) override;
  Tensor gather_rows(const Tensor& x, const Tensor& index, const Tensor& weights) override;
  // Reads the index on the host to group the routes by output row (the CSR its deterministic kernel walks).
  Tensor scatter_add_rows(const Tensor& src, const Tensor& index, const Tensor& weights,
                          std::int64_t rows) override;
  Tensor row_dots(const Tensor& a, const Tensor& b) override;
  RmsNormOut rmsnorm(const Tensor& x, const Tensor& gamma, float eps) override;
  RmsNormGrads rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                const Tensor& rstd) override;
  using Rank::swiglu;
  using Rank::swiglu_backward;
  Tensor swiglu(const Tensor& x, const GluSpec& glu) override;
  Tensor swiglu_backward(const Tensor& dy, const Tensor& x, const GluSpec& glu) override;
  Tensor embedding(const Tensor& ids, const Tensor& table, std::int64_t vocab_start) override;
  void embedding_backward_(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                           std::int64_t vocab_start) override;
  Tensor row_max(const Tensor& logits) override;
  Tensor softmax_stats(const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                       std::int64_t vocab_start) override;
  Tensor cross_entropy_loss(const Tensor& row_max, const Tensor& stats) override;
  Tensor cross_entropy_backward(const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                const Tensor& targets, std::int64_t vocab_start, float scale) override;

  Work communicate(const CommCall& call) override;
  std::vector<Work> batch_isend_irecv(const std::vector<P2POp>& ops) override;
  Group new_group(const std::vector<int>& ranks) override;

  void synchronize() override;
  double now() override;
  Event record_event() override;
  double elapsed_us(const Event& start, const Event& end) override;
  std::optional<double> elapsed_us_if_ended(const Event& start, const Event& end) override;

  const Profile& profile() const override { return config_.profile; }

  std::int64_t memory_allocated() const override { return account_->in_use(); }
  std::int64_t memory_peak() const override { return account_->peak(); }
  std::int64_t memory_capacity() const override { return account_->capacity(); }
  void reset_peak_memory() override { account_->reset_peak(); }

  void region_begin(const std::string& name) override;
  void region_end() override;
  void print(const std::string& line) override;
  void show(const std::string& label, const Tensor& t) override;
  void check(const std::string& what, bool passed, const std::string& detail) override;
  void report_training(const TrainingStats& stats) override { log_.training = stats; }
  void report_pipeline(const std::vector<PipelineTask>& tasks) override {
    log_.pipeline.insert(log_.pipeline.end(), tasks.begin(), tasks.end());
  }

 private:
  // c = op(a) @ op(b) on cuBLAS, or c += op(a) @ op(b) when `accumulate` (beta 1); the arguments checked.
  void gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb, const char* op,
            bool accumulate = false);
  // Rank::matmul_ (or matmul_add_ when `accumulate`): the arguments checked, then gemm.
  void matmul_into(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                   bool accumulate) override;

  // ---- FP8 (cuda_rank_fp8.cc) ----
  // gemm of two FP8 inputs: cuBLASLt's FP8 GEMM where both are scaled per tensor and the GPU and shapes
  // allow it, else the values they stand for multiplied in float32 (fp8_gemm_dequantized).
  void fp8_gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb, bool accumulate);
  bool fp8_gemm_cublaslt(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                         bool accumulate);
  void fp8_gemm_dequantized(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                            bool accumulate);
  // The float32 values an FP8 tensor stands for, [rows, cols] as it is (2-D, or one row).
  Tensor fp8_values(const Tensor& t, const char* op);
  // An FP8 tensor's scales, and its first row among its allocation's (checked: a block-scaled tensor is
  // whole rows of its allocation).
  const Fp8Scales& fp8_scales_of(const Tensor& t, const char* op, const char* arg,
                                 std::int64_t* first_row) const;
  // The device pointer to the block scales of `t`'s first row, and their bytes per row (1 x N blocks only:
  // a UsageError otherwise, naming `arg` of `op`).
  char* fp8_row_scales(const Tensor& t, const char* op, const char* arg, std::int64_t* bytes_per_row) const;
  // `dst` (FP8) takes the scales of `src`, whose bytes are moved into it: per tensor it shares them; per
  // 1 x N block its allocation gets block scales (made the first time), and with `copy_rows` src's rows of
  // them are copied in on the compute stream (a collective moves them beside its bytes instead).
  void take_fp8_scales(const Tensor& dst, const Tensor& src, const char* op, bool copy_rows);
  // The GPU has FP8 tensor cores (and MX block scaling with `mx`); UsageError naming it otherwise.
  void require_fp8_gpu(bool mx, const char* op) const;
  struct Resolved;  // a collective's communicator and ranks inside it (cuda_comm.cc)

  void init();
  void release() noexcept;

  // Argument checks, in the simulator's words.
  std::string where(const char* op) const;  // "rank 1: matmul"
  // `e` as this rank's CUDA event; UsageError naming `arg` of `op` for an undefined or foreign one.
  cudaEvent_t own_event(const Event& e, const char* arg, const char* op) const;
  // The tensor's device buffer, after checking it is defined and this rank's.
  void* require(const Tensor& t, const char* op, const char* arg) const;
  // require(), plus: the tensor is float32 (statistics, ids, optimizer state).
  float* require_f32(const Tensor& t, const char* op, const char* arg) const;
  // Raises when a kernel would touch a tensor an unwaited asynchronous call still uses.
  void before_kernel(std::initializer_list<const Tensor*> tensors, const char* op);
  void require_same_shape(const Tensor& a, const Tensor& b, const char* op) const;
  void require_same_dtype(const Tensor& a, const Tensor& b, const char* op) const;
  void require_same_kind(const Tensor& dst, const Tensor& src, const char* op) const;
  void require_ndim(const Tensor& t, int ndim, const char* op, const char* arg) const;
  // `t` has shape `s`; `why` says where the expected shape comes from ("the columns of x").
  void require_shape(const Tensor& t, const Shape& s, const char* op, const char* arg, const char* why) const;
  Tensor allocate(const Shape& s, DType dtype, bool phantom, const char* op);
  // An attention call's sizes from qkv [seq * batch, (heads + 2 kv_heads) * head_dim], checked.
  kernels::AttentionShape attention_shape(const Tensor& qkv, const AttentionSpec& spec, const char* op) const;
  // A context-parallel block's sizes and queries, checked with its running out and lse.
  kernels::AttentionBlockShape block_shape(const Tensor& qkv, const Tensor& kv, const Tensor& out,
                                           const Tensor& lse, const AttentionSpec& spec,
                                           const AttentionBlock& block, const char* op) const;
  // Runs `launch` on the compute stream between a timed pair of events named `name`.
  template <typename Launch>
  void kernel(const char* name, Launch&& launch) {
    const int interval = timeline_.begin(compute_);
    launch();
    timeline_.end(interval, compute_);
    if (interval >= 0) kernels_.push_back(TimedKernel{name, interval});
  }

  void validate(const CommCall& call) const;
  Resolved resolve(const CommCall& call) const;
  void launch_nccl(const CommCall& call, const Resolved& r);
  // A block-scaled FP8 tensor's scale bytes per row (0 for any other tensor), and an all_to_all's scales
  // moved row by row as its rows are (`sent` and `received` rows per member).
  std::int64_t fp8_scale_row_bytes(const Tensor& t) const;
  void all_to_all_fp8_scales(const CommCall& call, const Resolved& r, const CommCall::Splits& sent,
                             const CommCall::Splits& received);
  CommTiming timing_of(const CommCall& call, const Resolved& r);
  // `started` and `done` are timing events around the call on the communication stream.
  Work async_work(const CommCall& call, const std::shared_ptr<CudaEvent>& started,
                  const std::shared_ptr<CudaEvent>& done);
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
  cublasLtHandle_t cublaslt_ = nullptr;
  int compute_capability_ = 0;   // major * 10 + minor: 90 for Hopper
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
