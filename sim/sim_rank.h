// SimRank: the Rank interface on the simulator. Compute is done for real on the host (Eigen, GEMM
// through OpenBLAS) and timed by the compute model; communication is handed to SimWorld.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/rank.h"
#include "sim/world.h"

namespace ranklab::sim {

class SimRank : public Rank {
 public:
  SimRank(SimWorld& world, int rank) : world_(world), rank_(rank), memory_(world.memory(rank)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_.size(); }
  // Counts this rank's real tensors against the host memory of the launch (sim/host_memory.h).
  void set_host_memory(std::shared_ptr<HostMemory> host) { memory_->host = std::move(host); }

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
  Group new_group(const std::vector<int>& ranks) override { return world_.new_group(rank_, ranks); }

  void synchronize() override;
  double now() override;
  Event record_event() override;
  double elapsed_us(const Event& start, const Event& end) override;
  std::optional<double> elapsed_us_if_ended(const Event& start, const Event& end) override;
  double comm_slowed_compute_us() override { return world_.comm_slowed_compute_us(rank_); }
  double host_wait_us() override { return world_.host_wait_us(rank_); }
  const Profile& profile() const override { return world_.profile(); }
  std::string collective_algorithm(CommOp op, std::int64_t bytes, int root) override {
    return world_.world_algorithm(op, bytes, root);
  }

  std::int64_t memory_allocated() const override { return memory_->allocated; }
  std::int64_t memory_peak() const override { return memory_->peak; }
  std::int64_t memory_capacity() const override { return memory_->capacity; }
  void reset_peak_memory() override { memory_->peak = memory_->allocated; }

  void region_begin(const std::string& name) override;
  void region_end() override;
  void print(const std::string& line) override { world_.print(line); }
  void show(const std::string& label, const Tensor& t) override;
  void check(const std::string& what, bool passed, const std::string& detail) override;
  void report_training(const TrainingStats& stats) override { world_.set_training(stats); }
  void report_pipeline(const std::vector<PipelineTask>& tasks) override { world_.add_pipeline(tasks); }
  void keep_in_trace() override { world_.keep_in_trace(rank_); }

  // Waits for everything the rank posted; called when its program returns.
  void finish();

 private:
  // Entry checks shared by every operation.
  void require(const Tensor& t, const char* op, const char* arg) const;
  // `t` must have `dtype` (kernels whose arguments have a fixed type: statistics, ids, moments).
  void require_dtype(const Tensor& t, DType dtype, const char* op, const char* arg) const;
  // `a` and `b` must share a dtype.
  void require_same_dtype(const Tensor& a, const Tensor& b, const char* op) const;
  // Shape and phantom checks that format their message only when they fail (kernels run millions of times).
  void require_same_shape(const char* op, const Tensor& a, const Tensor& b) const;
  // An in-place op on a real tensor cannot take its values from a phantom.
  void require_same_kind(const char* op, const Tensor& dst, const Tensor& src) const;
  // `t` must have the shape `want`.
  void require_shape(const Tensor& t, const Shape& want, const char* op, const char* arg) const;
  Tensor allocate(const Shape& s, DType dtype, bool phantom, const char* op);
  // Before a kernel touches `tensors`: the compute stream waits for synchronous communication and for what
  // wait() was called on, and an async operation on one of them that was not waited on is an error.
  void before_kernel(std::initializer_list<const Tensor*> tensors, const char* op);
  // The same for a kernel that only reads `tensors`: beside a send or another operation that only reads
  // one of them it may run (on a GPU, two readers of a buffer do not race).
  void before_reading(std::initializer_list<const Tensor*> tensors, const char* op);
  // c = op(a) @ op(b), or c += op(a) @ op(b) when `accumulate`: numbers and time (the arguments checked).
  void gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb, bool accumulate = false);
  // Rank::matmul_ (or matmul_add_ when `accumulate`): the arguments checked, then gemm.
  void matmul_into(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                   bool accumulate) override;
  // AdamW's checks and numbers on one tensor, for adamw_step and fused_adamw_step (`op`).
  void adamw_numbers(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                     const AdamW& h, int step, const char* op);
  // Advances the host by the launch overhead and the compute stream by the kernel's modeled time.
  void launch_kernel(const std::string& name, double flops, double bytes, DType dtype = DType::Float32);
  // A kernel over several tensors' `elements`, launched as apex's multi_tensor_apply launches it.
  void launch_multi_tensor(const std::string& name, std::int64_t elements, double flops, double bytes);
  // Attention as `kernel` computes it, one launch per kernel of the path.
  void launch_attention(const std::string& name, const AttentionShape& shape, AttentionKernel kernel,
                        bool backward, DType dtype);
  void launch_kernel_cost(const std::string& name, const KernelCost& cost);
  void validate(const CommCall& call) const;
  std::string where(const char* op) const;

  SimWorld& world_;
  int rank_;
  std::shared_ptr<MemoryAccount> memory_;  // the rank's device memory
  // now() calls in a row that found the host clock where the last one did: a rank spinning on now().
  void check_no_race(const CommCall& call) const;
  double last_now_us_ = -1;
  std::int64_t same_now_calls_ = 0;
  std::vector<std::pair<std::string, double>> regions_;
};

}  // namespace ranklab::sim
