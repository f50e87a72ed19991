// Rank: everything an SPMD lesson can do, named after torch.distributed.
//
// A lesson is one function `void lesson(Rank& r, const MyOptions& o)` that every rank runs. The same
// function runs on the simulator (ranks are fibers, time is virtual) and on the real backend (ranks are
// GPUs). The semantics follow CUDA + NCCL so that what a lesson teaches is true on GPUs:
//
//  - Each rank has a host clock, one compute stream and several communication streams. Compute ops are
//    kernels on the compute stream. Each group's collectives run on a stream of that group's (as each
//    torch.distributed process group has its own NCCL communicator and stream), so collectives of
//    different groups overlap; point-to-point traffic with each peer has a stream of its own. Nothing
//    blocks the host.
//  - A collective called with Async::No makes the compute stream wait for it (the host does not), as
//    torch.distributed does with NCCL. With Async::Yes it returns a Work; `wait()` makes the compute
//    stream wait. Reading a tensor whose async collective has not been waited on is an error (on a GPU
//    it would be a silent race).
//  - synchronize() moves the host to the end of its streams' work (torch.cuda.synchronize()).
//    barrier() is a host rendezvous: it does not wait for device work. So barrier() before
//    synchronize() does not line the ranks' devices up, exactly as the lecture warns: each rank's clock
//    starts (or stops) when its own device is done, not when every rank's is.
//  - now() reads the host clock in microseconds.
//
// Ranks (root, src, dst) are global ranks, as in torch.distributed, also inside a sub-group.
#pragma once

#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/glu.h"
#include "common/profile.h"
#include "common/random.h"
#include "common/tensor.h"
#include "common/training.h"

namespace ranklab {

enum class ReduceOp { Sum, Avg, Max, Min, Prod };
enum class Async { No, Yes };
enum class Trans { No, Yes };
// Which kernels compute attention (Rank::attention): one fused kernel (FlashAttention-2 and -3, cuDNN)
// whose s x s scores stay on chip, or the path of Megatron-LM's 2021-2022 runs: a batched Q K^T GEMM, a
// fused scale-mask-softmax over the scores in HBM and a batched P V GEMM, the probabilities kept for the
// backward.
enum class AttentionKernel { Flash, Unfused };

// An attention call's heads and kernels. `heads` query heads share `kv_heads` key-value heads in groups of
// heads / kv_heads (grouped-query attention, Ainslie et al. 2023; kv_heads = heads is multi-head attention,
// 0 means heads). qkv's columns hold each group's q heads, then its k, then its v, head_dim each
// (Megatron-Core's layout, so a tensor-parallel rank's groups are one contiguous block).
struct AttentionSpec {
  std::int64_t batch = 1;  // sequences per call; rows are position * batch + sample
  int heads = 1;
  int kv_heads = 0;
  bool causal = true;
  AttentionKernel kernel = AttentionKernel::Flash;
  // Sliding-window attention (Child et al. 2019; Beltagy et al. 2020; Mistral 7B; gpt-oss): a query sees
  // the `window` keys up to and including its own position, key position > query position - window.
  // 0: every earlier key. Causal attention only.
  std::int64_t window = 0;
  // Attention sinks (Xiao et al. 2023; gpt-oss's learned sinks): one logit per query head, a [heads] tensor
  // of any floating dtype, taken as one more key whose value is zero, so each query's softmax weights sum
  // to less than one. Undefined: none.
  Tensor sinks{};
  int groups() const { return kv_heads > 0 ? kv_heads : heads; }
  // The first key a query at `position` sees (the window's start; 0 without one).
  std::int64_t first_key(std::int64_t position) const {
    return window > 0 && position >= window ? position - window + 1 : 0;
  }
};

const char* reduce_op_name(ReduceOp op);

// A set of global ranks that communicate together. The default-constructed Group is the whole world.
// Sub-groups come from Rank::new_group.
class Group {
 public:
  Group() = default;  // the world
  Group(int id, std::vector<int> ranks);

  bool is_world() const { return info_ == nullptr; }
  int id() const;  // 0 for the world
  // The member ranks in order; for the world this needs its size.
  std::vector<int> ranks(int world_size) const;
  // Whether the group lists exactly `ranks`, in that order, copying nothing; false for the world, which
  // lists none.
  bool lists(const std::vector<int>& ranks) const { return info_ != nullptr && info_->ranks == ranks; }
  int size(int world_size) const;
  // Position of `global_rank` inside the group, or -1 when it is not a member.
  int index_of(int global_rank) const;
  std::string str() const;  // "world" or "group 2 {0, 1}"

 private:
  struct Info {
    int id;
    std::vector<int> ranks;
  };
  std::shared_ptr<const Info> info_;
};

// An operation in flight. Async collectives return one; wait() makes the compute stream wait for it.
// A Work from a synchronous call is already complete.
class WorkState {
 public:
  virtual ~WorkState() = default;
  virtual void wait() = 0;
  virtual bool waited() const = 0;
  // Device time the operation took on its stream, from its start to its end, in microseconds (events
  // around it on its stream, cudaEventElapsedTime); the host waits for its end.
  virtual double elapsed_us() = 0;
  // The same time where the operation has already ended and reading it makes nothing wait (the device
  // reached its end event); nullopt otherwise. A long step folds its finished operations' times as it goes
  // instead of keeping every operation alive to read at its end.
  virtual std::optional<double> elapsed_us_if_ended() = 0;
};

// A recorded point on a rank's compute stream; see Rank::record_event.
class EventState {
 public:
  virtual ~EventState() = default;
};
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<EventState> s) : state_(std::move(s)) {}
  bool defined() const { return state_ != nullptr; }
  EventState* state() const { return state_.get(); }

 private:
  std::shared_ptr<EventState> state_;
};

class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<WorkState> s) : state_(std::move(s)) {}
  void wait() {
    if (state_) state_->wait();
  }
  bool waited() const { return !state_ || state_->waited(); }
  // See WorkState::elapsed_us; 0 for a Work that stands for no operation (a barrier's).
  double elapsed_us() { return state_ ? state_->elapsed_us() : 0; }
  std::optional<double> elapsed_us_if_ended() {
    return state_ ? state_->elapsed_us_if_ended() : std::optional<double>(0.0);
  }

 private:
  std::shared_ptr<WorkState> state_;
};

// Hyper-parameters of AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019).
struct AdamW {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// The kinds of communication, shared by both backends and by the run report.
enum class CommOp {
  Broadcast,
  Scatter,
  Gather,
  Reduce,
  AllGather,
  ReduceScatter,
  AllReduce,
  AllToAll,
  Send,
  Recv,
  Barrier,
};
const char* comm_op_name(CommOp op);

// One communication call as a rank made it. Both backends receive every collective through this one
// record, which is also what the simulator compares across ranks to catch mismatches.
struct CommCall {
  CommOp op = CommOp::AllReduce;
  Tensor input;   // what this rank contributes (undefined where the op takes none on this rank)
  Tensor output;  // where this rank's result goes (may be the same tensor as input)
  ReduceOp reduce = ReduceOp::Sum;
  int peer = -1;  // root for rooted collectives, dst for send, src for recv (global ranks)
  Group group;
  Async async = Async::No;
  // Issued inside Rank::bookkeeping(): the lesson's own checks and figures, not the work it teaches. The
  // report keeps such operations out of its collectives table and its link traffic.
  bool bookkeeping = false;
  // all_to_all with uneven splits (torch's all_to_all_single): rows of `input` sent to each member and
  // rows of `output` received from each, in member order. Both empty: even splits. Up to 8 members' are
  // kept inside the call (a tensor-parallel ring's steps are such calls, each copied for every mirror of a
  // symmetric run): copying a call then allocates nothing.
  using Splits = boost::container::small_vector<std::int64_t, 8>;
  Splits input_splits;
  Splits output_splits;
  bool uneven() const { return !input_splits.empty() || !output_splits.empty(); }
  std::string describe() const;  // "all_reduce(float32[4], Sum) on world"
};

class Rank {
 public:
  virtual ~Rank() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // ---- tensors --------------------------------------------------------------------------------------
  // Factories take the element type last; without it they make float32 tensors.
  virtual Tensor empty(const Shape& s, DType dtype) = 0;  // contents unspecified (the simulator: NaN)
  virtual Tensor zeros(const Shape& s, DType dtype) = 0;
  virtual Tensor full(const Shape& s, float value, DType dtype) = 0;
  Tensor empty(const Shape& s) { return empty(s, DType::Float32); }
  Tensor zeros(const Shape& s) { return zeros(s, DType::Float32); }
  Tensor full(const Shape& s, float value) { return full(s, value, DType::Float32); }
  // 0, 1, ..., numel-1 laid out in `s`, plus `start`.
  virtual Tensor arange(const Shape& s, float start) = 0;
  Tensor arange(std::int64_t n) { return arange(Shape{n}, 0.0f); }
  // Normal(0, std^2) numbers from a counter-based generator: element i of seed s is the same number on
  // every backend and every world size (then rounded to `dtype`).
  virtual Tensor randn(const Shape& s, std::uint64_t seed, float std, DType dtype) = 0;
  Tensor randn(const Shape& s, std::uint64_t seed, float std) { return randn(s, seed, std, DType::Float32); }
  Tensor randn(const Shape& s, std::uint64_t seed) { return randn(s, seed, 1.0f, DType::Float32); }
  // The part [start, start + length) along `dim` of randn(full, seed, std, dtype), made without making
  // the rest: a rank creates only its own shard of a seeded weight, and the shards of all ranks put
  // together are exactly the whole tensor.
  virtual Tensor randn_slice(const Shape& full, int dim, std::int64_t start, std::int64_t length,
                             std::uint64_t seed, float std, DType dtype) = 0;
  virtual Tensor from_host(const Shape& s, const std::vector<float>& values, DType dtype) = 0;
  Tensor from_host(const Shape& s, const std::vector<float>& values) {
    return from_host(s, values, DType::Float32);
  }
  // A tensor with a shape and no bytes: operations on it only advance time. Its memory is accounted.
  virtual Tensor phantom(const Shape& s, DType dtype) = 0;
  Tensor phantom(const Shape& s) { return phantom(s, DType::Float32); }
  // Copies a tensor to the host as floats (waits for the work that writes it).
  virtual std::vector<float> to_host(const Tensor& t) = 0;
  // A tensor that is part of `base`'s memory, not a copy: its shape.numel() elements are base's elements
  // [offset, offset + numel) in order (torch's base.view(-1)[offset:offset + numel].view(shape)), of base's
  // dtype. Writing either writes both. It takes no memory of its own and keeps base's alive; making it runs
  // no kernel. Flat buffers are built with it: Megatron's gradient buckets (each parameter's gradient a view
  // of its bucket, reduced in one collective), the pieces of a gathered tensor received in place.
  virtual Tensor view(const Tensor& base, std::int64_t offset, const Shape& shape) = 0;

  // ---- compute (kernels on the compute stream) ------------------------------------------------------
  // Unless said otherwise, a kernel's inputs share one dtype and its output has that dtype; arithmetic
  // is done in float32 and the result rounded to the output's type, as GPU kernels do.
  //
  // op(a) @ op(b) for 2-D tensors, where op transposes when asked. 16-bit inputs run on tensor cores
  // with float32 accumulation (cuBLAS's CUBLAS_COMPUTE_32F), and the product is rounded once. FP8 inputs
  // (from quantize; e4m3 and e5m2 mixed, not e5m2 with e5m2, as cuBLASLt allows) give a bfloat16 product.
  virtual Tensor matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) = 0;
  Tensor matmul(const Tensor& a, const Tensor& b) { return matmul(a, b, Trans::No, Trans::No); }
  // The same product written into `out` (cuBLAS's C with beta 0), which may be a view: a GEMM whose output is
  // part of a larger buffer, as TransformerEngine's overlapped GEMMs write each chunk in place.
  void matmul_(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
    matmul_into(out, a, b, ta, tb, false);
  }
  // out += op(a) @ op(b) (cuBLAS's C with beta 1): a weight gradient summed into its gradient buffer by the
  // GEMM that computes it, as Megatron-LM's gradient-accumulation fusion does (wgrad_gemm_accum_fp32).
  // `out` has a's dtype or is float32 under 16-bit inputs; then the float32 sum is never rounded to 16 bits.
  void matmul_add_(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
    matmul_into(out, a, b, ta, tb, true);
  }
  virtual Tensor relu(const Tensor& x) = 0;
  // grad_out where x > 0, else 0: the backward of relu given its input x.
  virtual Tensor relu_backward(const Tensor& grad_out, const Tensor& x) = 0;
  virtual Tensor add(const Tensor& a, const Tensor& b) = 0;
  // dst += alpha * src. `src` may have another dtype than `dst` (a bf16 gradient into a float32 one).
  virtual void add_(const Tensor& dst, const Tensor& src, float alpha) = 0;
  virtual void scale_(const Tensor& t, float factor) = 0;
  // dst = src, converting to dst's dtype (float32 master weights into their bf16 copy, and back).
  virtual void copy_(const Tensor& dst, const Tensor& src) = 0;
  // A new tensor of `dtype` with t's values.
  virtual Tensor cast(const Tensor& t, DType dtype) = 0;
  virtual Tensor sum(const Tensor& t) = 0;  // a scalar (shape [])
  // The sum of the squares of every element of every tensor, a float32 scalar accumulated in double: the
  // squared L2 norm of them all, one kernel as apex's multi_tensor_l2norm computes it for gradient
  // clipping.
  virtual Tensor squared_norm(const std::vector<Tensor>& ts) = 0;
  // A copy of `length` entries of `t` along `dim` starting at `start`.
  virtual Tensor slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) = 0;
  virtual Tensor cat(const std::vector<Tensor>& parts, int dim) = 0;
  virtual void sgd_step(const Tensor& param, const Tensor& grad, float lr) = 0;
  // One AdamW step; `m` and `v` are the moment buffers, `step` counts from 1. Param, grad and moments
  // are float32 (mixed precision keeps the optimizer in float32).
  virtual void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          const AdamW& h, int step) = 0;
  // One AdamW step on several tensors at once, as the frameworks' optimizers run it: apex's and
  // TransformerEngine's FusedAdam over a parameter group's tensors (multi_tensor_apply). Each part's numbers
  // are adamw_step's, with h.weight_decay where `decay` is set and none where it is not.
  struct AdamWPart {
    Tensor param, grad, m, v;
    bool decay = true;
  };
  virtual void fused_adamw_step(const std::vector<AdamWPart>& parts, const AdamW& h, int step) = 0;

  // ---- transformer kernels ----------------------------------------------------------------------------
  // Activations are 2-D, one row per token, rows in sequence-major order: row = position * batch + sample
  // (Megatron-LM's [s, b, h] layout), so a contiguous block of rows is a contiguous block of positions —
  // what sequence parallelism shards and what a pipeline stage receives.

  // x + bias broadcast over rows, in place: x [rows, cols], bias [cols].
  virtual void add_bias_(const Tensor& x, const Tensor& bias) = 0;
  // Column sums of x [rows, cols] as a float32 [cols] tensor: the gradient of a bias.
  virtual Tensor sum_rows(const Tensor& x) = 0;

  // Layer normalisation over each row (Ba, Kiros & Hinton 2016): y = (x - mean) * rstd * gamma + beta,
  // rstd = 1 / sqrt(var + eps). gamma and beta are [cols]; mean and rstd are float32 [rows], kept for
  // the backward.
  struct LayerNormOut {
    Tensor y, mean, rstd;
  };
  virtual LayerNormOut layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) = 0;
  struct LayerNormGrads {
    Tensor dx;             // like x
    Tensor dgamma, dbeta;  // float32 [cols]
  };
  virtual LayerNormGrads layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                            const Tensor& mean, const Tensor& rstd) = 0;

  // RMSNorm (Zhang & Sennrich 2019) over the columns of each row: y = x * rstd * gamma with
  // rstd = 1 / sqrt(mean(x^2) + eps), as Llama normalises. rstd is float32 [rows], kept for the backward.
  struct RmsNormOut {
    Tensor y, rstd;
  };
  virtual RmsNormOut rmsnorm(const Tensor& x, const Tensor& gamma, float eps) = 0;
  struct RmsNormGrads {
    Tensor dx;      // like x
    Tensor dgamma;  // float32 [cols]
  };
  virtual RmsNormGrads rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const Tensor& rstd) = 0;

  // SwiGLU (Shazeer 2020) of a [rows, 2 f] tensor whose columns 2j and 2j + 1 are the gate and the value
  // of output column j: y[:, j] = silu(x[:, 2j]) * x[:, 2j + 1], silu(a) = a / (1 + exp(-a)); `glu` gives
  // the other forms published models use (common/glu.h: gpt-oss's clamped quick GELU with an offset). The
  // pairs are adjacent so that any block of whole pairs, a tensor-parallel rank's columns of the fused
  // gate-and-up projection, holds gates and values that belong together.
  virtual Tensor swiglu(const Tensor& x, const GluSpec& glu) = 0;
  // d x ([rows, 2 f]) from d y.
  virtual Tensor swiglu_backward(const Tensor& dy, const Tensor& x, const GluSpec& glu) = 0;
  Tensor swiglu(const Tensor& x) { return swiglu(x, GluSpec{}); }
  Tensor swiglu_backward(const Tensor& dy, const Tensor& x) { return swiglu_backward(dy, x, GluSpec{}); }

  // GELU, tanh approximation as GPT-2 uses it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  virtual Tensor gelu(const Tensor& x) = 0;
  virtual Tensor gelu_backward(const Tensor& dy, const Tensor& x) = 0;

  // Inverted dropout (Srivastava et al. 2014) of a [rows, cols] tensor: each element is zeroed with
  // probability p and the others are scaled by 1 / (1 - p). Whether element (i, j) is kept is a hash of
  // (seed, first_row + i, j) (dropout_keeps in common/random.h), not a draw from a stream: every rank that
  // holds a row makes the same mask for it whatever the layout, and the backward is the same call on the
  // output's gradient, which regenerates the mask instead of keeping it. `rows` says which global row each
  // of x's rows is: one run of consecutive rows, or two (a context-parallel rank's two chunks).
  struct DropoutRows {
    std::int64_t first_row = 0;  // the global row of x's row 0
    // From x's row `split` on, the rows are second_row, second_row + 1, ... (at or past x's rows: one run).
    std::int64_t split = std::numeric_limits<std::int64_t>::max();
    std::int64_t second_row = 0;
    // One run from first_row, as most callers give it.
    DropoutRows(std::int64_t first = 0) : first_row(first) {}  // NOLINT(google-explicit-constructor)
    DropoutRows(std::int64_t first, std::int64_t at, std::int64_t second)
        : first_row(first), split(at), second_row(second) {}
    std::int64_t row(std::int64_t i) const { return row_of_runs(i, first_row, split, second_row); }
  };
  virtual Tensor dropout(const Tensor& x, float p, std::uint64_t seed, const DropoutRows& rows) = 0;

  // Scaled dot-product attention computed FlashAttention-style (Dao et al. 2022): one pass over keys
  // with an online softmax, never materialising the seq x seq scores, so its memory is O(seq).
  //   qkv  [seq * batch, (heads + 2 kv_heads) * head_dim]: each group's q heads, k and v (AttentionSpec);
  //   out  [seq * batch, heads * head_dim], column = head * head_dim + d;
  //   lse  float32 [batch, heads, seq]: each query's log-sum-exp of scaled scores, for the backward.
  // Scores are scaled by 1 / sqrt(head_dim); `causal` masks keys after the query's position, spec.window
  // those before its window; spec.sinks join each query's softmax.
  // `kernel` says how a GPU computes it: the numbers are the same, the time and the memory are not. With
  // AttentionKernel::Unfused the result also holds the probabilities the unfused backward reads, a
  // phantom [batch * heads, seq, seq] tensor of qkv's dtype: their memory is real, their numbers are
  // recomputed from lse.
  struct AttentionOut {
    Tensor out, lse;
    Tensor probs{};  // AttentionKernel::Unfused only
  };
  virtual AttentionOut attention(const Tensor& qkv, const AttentionSpec& spec) = 0;
  // d qkv (like qkv) from d out, recomputing the probabilities from lse (FlashAttention's backward).
  virtual Tensor attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                    const Tensor& lse, const AttentionSpec& spec) = 0;
  // Multi-head attention: every head its own k and v.
  AttentionOut attention(const Tensor& qkv, std::int64_t batch, int heads, bool causal,
                         AttentionKernel kernel = AttentionKernel::Flash) {
    return attention(qkv, AttentionSpec{batch, heads, heads, causal, kernel});
  }
  Tensor attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                            std::int64_t batch, int heads, bool causal,
                            AttentionKernel kernel = AttentionKernel::Flash) {
    return attention_backward(dout, qkv, out, lse, AttentionSpec{batch, heads, heads, causal, kernel});
  }
  // Rotary position embeddings (Su et al. 2021, RoFormer), in place on qkv's q and k heads (laid out as
  // attention takes them): in each head the pairs (d, d + head_dim / 2) are rotated by position * base^(-2d /
  // head_dim), the "rotate half" form of GPT-NeoX, Llama's Hugging Face weights and Megatron-Core. A row's
  // position is first_position + row / batch. `inverse` rotates back: the backward of a rotation on its
  // output's gradient.
  virtual void rope_(const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position, double base,
                     bool inverse) = 0;

  // Context parallelism's attention (ring attention, Liu et al. 2023; Megatron-Core's and TransformerEngine's
  // context parallelism): a rank's queries attend to keys and values other ranks hold, one block of them at
  // a time, and each block's result merges into the running one by their log-sum-exps, as FlashAttention's
  // online softmax merges key blocks inside its kernel.
  //   kv [kv_seq * batch, 2 * groups * head_dim]: each key-value group's k, then its v (key_values).
  // key_values copies qkv's k and v columns into that layout; add_key_values_ adds a kv-shaped gradient
  // into the k and v columns of a qkv-shaped one.
  virtual Tensor key_values(const Tensor& qkv, const AttentionSpec& spec) = 0;
  virtual void add_key_values_(const Tensor& dqkv, const Tensor& dkv, const AttentionSpec& spec) = 0;
  // Which queries of qkv one block takes (positions q_first to q_first + q_count - 1; -1: to the end) and,
  // with `causal`, the positions the mask compares: key j of kv is seen by the block's query i when
  // kv_position + j <= q_position + i (FlashAttention's bottom-right mask when kv is longer), where
  // q_position is query q_first's position. With spec.window the window compares the same positions, so a
  // block under a window is causal. A block takes no spec.sinks: attention_sinks_ merges them once.
  struct AttentionBlock {
    std::int64_t q_first = 0, q_count = -1;
    bool causal = false;
    std::int64_t q_position = 0, kv_position = 0;
  };
  // Merges the block's attention into `acc`: out [seq * batch, heads * head_dim] (any floating dtype; a
  // float32 one keeps the merges exact) and lse float32 [batch, heads, seq], both over all of qkv's
  // queries, starting from zeros and -infinity. Two kernels on a GPU: the block's attention, then the
  // correction that merges it.
  virtual void attention_block_(AttentionOut& acc, const Tensor& qkv, const Tensor& kv,
                                const AttentionSpec& spec, const AttentionBlock& block) = 0;
  // The block's backward from the final out and lse of qkv's queries: adds d q into the q columns of dqkv
  // (like qkv) and d k, d v into dkv (like kv).
  virtual void attention_block_backward_(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout,
                                         const Tensor& qkv, const Tensor& kv, const Tensor& out,
                                         const Tensor& lse, const AttentionSpec& spec,
                                         const AttentionBlock& block) = 0;
  // The sinks of spec.sinks merged into a result as one more block (a key of logit sinks[h] per head whose
  // value is zero): lse = log(e^lse + e^sink), out scaled by e^(old lse - new lse). Context parallelism runs
  // its blocks without sinks and merges them once; Rank::attention takes them in its kernel.
  virtual void attention_sinks_(AttentionOut& acc, const AttentionSpec& spec) = 0;
  // d sinks, float32 [heads], from the final out and lse of the queries (whole or merged):
  // d sink_h = -sum over queries of e^(sink_h - lse) (dout . out), the sink's probability times delta.
  // The queries' and keys' gradients need nothing more: delta = dout . out already holds the sink's share.
  virtual Tensor attention_sinks_backward(const Tensor& dout, const Tensor& out, const Tensor& lse,
                                          const AttentionSpec& spec) = 0;

  // ---- mixture of experts -----------------------------------------------------------------------------
  // The token permutation of a mixture-of-experts layer (docs/lessons/moe.md), as Megatron-Core's and
  // TransformerEngine's moe_permute and moe_unpermute kernels compute it: the router sends each token to its
  // experts; the dispatch gathers each route's row into its expert's order, and the combine adds each token's
  // expert outputs back into the token's row, weighted by the router's probabilities.
  //   index    float32 [n]: row numbers (exact up to 2^24), one a route;
  //   weights  float32 [n], one a route, or an undefined Tensor for none.
  // n may be 0 (an expert or a rank that receives no tokens). Arithmetic is float32, rounded once to the
  // output's dtype (float32, bfloat16 or float16). On the simulator an index that is not an integer in range
  // is an error naming its position; on GPUs it is not checked by gather_rows (such a route reads zeros).

  // out [n, cols] of x's dtype: out[i] = x[index[i]], times weights[i] when weights is defined (moe_permute;
  // also the combine's backward).
  virtual Tensor gather_rows(const Tensor& x, const Tensor& index, const Tensor& weights) = 0;
  // out [rows, cols] of src's dtype: out[t] = the sum over the i with index[i] == t of src[i], times
  // weights[i] when weights is defined, added in float32 in the order of i and rounded once; a row no route
  // names is zero. src is [n, cols]. The combine (moe_unpermute) and gather_rows' backward. Deterministic:
  // no atomics, the same sums on every run.
  virtual Tensor scatter_add_rows(const Tensor& src, const Tensor& index, const Tensor& weights,
                                  std::int64_t rows) = 0;
  // float32 [n]: the sum over j of a[i, j] * b[i, j] (summed in double, rounded once), for a and b [n, cols]
  // of one dtype: the gradient of each route's gate weight (the combine's output gradient dotted with the
  // expert's output).
  virtual Tensor row_dots(const Tensor& a, const Tensor& b) = 0;

  // Embedding lookup, vocabulary-parallel (Megatron's VocabParallelEmbedding): `table` holds rows
  // [vocab_start, vocab_start + table rows) of the vocabulary; `ids` is a float32 [rows] tensor of token
  // ids (exact up to 2^24). Rows whose id falls outside this shard are zero, so a sum over the shards
  // (an all_reduce) gives the full lookup. Output has table's dtype.
  virtual Tensor embedding(const Tensor& ids, const Tensor& table, std::int64_t vocab_start) = 0;
  // dtable[id - vocab_start] += dy[row] for every row whose id is in the shard. dtable is float32.
  virtual void embedding_backward_(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                                   std::int64_t vocab_start) = 0;

  // Cross-entropy over a vocabulary split across ranks (Megatron's vocab-parallel cross-entropy), in three
  // kernels with an all_reduce between each: logits [rows, shard] hold the columns [vocab_start,
  // vocab_start + shard) of the full logits; targets is a float32 [rows] tensor of token ids.
  //   row_max:        float32 [rows], the largest logit of each row in this shard (all_reduce Max);
  //   softmax_stats:  float32 [rows, 2]: sum of exp(logit - max) over the shard, and the target's logit
  //                   when the target is in the shard, else 0 (all_reduce Sum);
  //   cross_entropy_loss: float32 scalar, sum over rows of log(sum exp) + max - target logit;
  //   cross_entropy_backward: d logits = scale * (softmax - onehot(target)), logits' dtype.
  virtual Tensor row_max(const Tensor& logits) = 0;
  virtual Tensor softmax_stats(const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                               std::int64_t vocab_start) = 0;
  virtual Tensor cross_entropy_loss(const Tensor& row_max, const Tensor& stats) = 0;
  virtual Tensor cross_entropy_backward(const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                        const Tensor& targets, std::int64_t vocab_start, float scale) = 0;

  // ---- FP8 (docs/lessons/gpt.md, "FP8") ---------------------------------------------------------------
  // FP8 training scales each GEMM input into an 8-bit format's range and rounds it there; the GEMM reads
  // the 8-bit numbers at the FP8 tensor-core rate and applies the scales to its float32 sums. How a tensor
  // is scaled: per tensor, by one scale the caller gives (a float32 [1] tensor on the device, as
  // TransformerEngine keeps it: current scaling's fp8_scale(amax(x))); or per block of block_rows x
  // block_cols elements, each by its own largest magnitude, computed in the quantizing kernel and kept as a
  // float32 per block (DeepSeek-V3's 1 x 128 activation and 128 x 128 weight blocks) or, with `e8m0`, as a
  // power of two in one byte per block (the OCP Microscaling formats' 1 x 32 blocks, MXFP8). A block's scale
  // is the format's largest value over the block's largest magnitude; e8m0 rounds it down to a power of two,
  // so no element saturates.
  struct Fp8Scaling {
    int block_rows = 0, block_cols = 0;  // 0 x 0: per tensor
    bool e8m0 = false;
    bool per_tensor() const { return block_rows == 0 && block_cols == 0; }
    // The other layout's: blocks of block_cols x block_rows.
    Fp8Scaling transposed() const { return {block_cols, block_rows, e8m0}; }
    // The blocks of a [rows, cols] tensor (0 per tensor; partial blocks at the edges count whole), and the
    // float32 words their scales take (Quantized's scales: one a block, or with e8m0 one a four blocks).
    std::int64_t blocks(const Shape& s) const {
      return per_tensor() ? 0
                          : ((s[0] + block_rows - 1) / block_rows) * ((s[1] + block_cols - 1) / block_cols);
    }
    std::int64_t scale_words(const Shape& s) const { return e8m0 ? (blocks(s) + 3) / 4 : blocks(s); }
  };
  struct Quantized {
    Tensor data;        // x in `format`: its elements read as the values the stored numbers stand for
    Tensor columnwise;  // with both layouts: x quantized for use transposed (blocks block_cols x block_rows)
    // Each layout's block scales, for their memory: float32 words (e8m0 scales four bytes to a word).
    Tensor scales, columnwise_scales;
  };
  // x [rows, cols] (16-bit or float32) in `format` (Float8E4M3 or Float8E5M2), saturating at its largest
  // finite value. `both_layouts`: also `columnwise`, as TransformerEngine's cast-transpose writes the copy a
  // Hopper FP8 GEMM reads transposed, in the same pass. `record_amax` (float32 [1], per-tensor scaling
  // only), when given, becomes the larger of itself and x's largest magnitude, found by the cast as it
  // reads x: delayed scaling's amax, which needs no pass over x of its own (TransformerEngine's cast
  // kernels update the tensor's amax with an atomic max).
  virtual Quantized quantize(const Tensor& x, DType format, const Fp8Scaling& scaling, const Tensor& scale,
                             bool both_layouts, const Tensor& record_amax) = 0;
  // The largest magnitude of x's elements: float32 [1].
  virtual Tensor amax(const Tensor& x) = 0;
  // `format`'s largest value over amax (float32 [1]), or 1 where amax is 0, and at most the largest float:
  // the per-tensor scale that maps the largest element onto the format's largest value.
  virtual Tensor fp8_scale(const Tensor& amax, DType format) = 0;
  // Delayed scaling's update after a pass, for n tensors in one kernel (TransformerEngine's
  // fused_amax_and_scale_update_after_reduction, transformer_engine/common/recipe/delayed_scaling.cu, with
  // amax_compute_algo "max"): reduced (float32 [n]) holds each tensor's largest magnitude of the pass, as
  // the ranks that share the tensor reduced it. For tensor i it joins histories[i] (float32 [len - 1], the
  // earlier passes', newest first), whose oldest entry leaves; scales[i] (float32 [1]) becomes `format`'s
  // largest value / max(reduced[i], history) / 2^margin, or stays as it is where that largest is 0 or not
  // finite; and amaxes[i] (float32 [1], what the casts of the next pass record into) returns to 0.
  virtual void fp8_delayed_update(const Tensor& reduced, const std::vector<Tensor>& histories,
                                  const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes,
                                  DType format, int margin) = 0;

  // ---- communication --------------------------------------------------------------------------------
  // Every backend implements this one entry; the named calls below build the record.
  virtual Work communicate(const CommCall& call) = 0;

  Work broadcast(const Tensor& t, int root, Async a = Async::No, Group g = {});
  // `in` (significant on root only) is split along dim 0 into one piece per member.
  Work scatter(const Tensor& out, const Tensor& in, int root, Async a = Async::No, Group g = {});
  // Every member's `in` concatenated along dim 0 into `out` on root (ignored elsewhere).
  Work gather(const Tensor& out, const Tensor& in, int root, Async a = Async::No, Group g = {});
  Work reduce(const Tensor& t, int root, ReduceOp op, Async a = Async::No, Group g = {});
  Work all_gather(const Tensor& out, const Tensor& in, Async a = Async::No, Group g = {});
  Work reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, Async a = Async::No, Group g = {});
  Work all_reduce(const Tensor& t, ReduceOp op, Async a = Async::No, Group g = {});
  // `in` split along dim 0: piece i goes to member i, and `out` holds piece r of every member in order.
  Work all_to_all(const Tensor& out, const Tensor& in, Async a = Async::No, Group g = {});
  // Uneven splits, as torch's all_to_all_single(out, in, output_split_sizes, input_split_sizes): the first
  // in_splits[0] rows of `in` go to member 0, the next in_splits[1] to member 1, and so on; `out` holds
  // out_splits[j] rows from member j, in member order. What member i sends to j must be what j expects
  // from i. Rows are along dim 0; the other dimensions of `in` and `out` must agree.
  Work all_to_all(const Tensor& out, const Tensor& in, const std::vector<std::int64_t>& out_splits,
                  const std::vector<std::int64_t>& in_splits, Async a = Async::No, Group g = {});
  Work send(const Tensor& t, int dst, Async a = Async::No);
  Work recv(const Tensor& t, int src, Async a = Async::No);
  Work isend(const Tensor& t, int dst) { return send(t, dst, Async::Yes); }
  Work irecv(const Tensor& t, int src) { return recv(t, src, Async::Yes); }
  // Point-to-point operations posted together (torch.distributed.batch_isend_irecv; NCCL runs them in
  // one ncclGroupStart/End), so two ranks that each send to the other first cannot deadlock. One Work
  // per operation, in order.
  struct P2POp {
    CommOp op = CommOp::Send;  // Send or Recv
    Tensor tensor;
    int peer = -1;  // global rank
  };
  virtual std::vector<Work> batch_isend_irecv(const std::vector<P2POp>& ops) = 0;
  // A host rendezvous of the group's members. It does not wait for device work.
  void barrier(Group g = {});

  // Every rank of the world must call new_group with the same ranks in the same order, as in
  // torch.distributed; a rank outside `ranks` gets a group it cannot use.
  virtual Group new_group(const std::vector<int>& ranks) = 0;

  // ---- time -----------------------------------------------------------------------------------------
  virtual void synchronize() = 0;  // the host waits for every stream of the rank
  virtual double now() = 0;        // host clock, microseconds since launch
  // A marker on the compute stream (cudaEventRecord): it completes when the kernels launched before it
  // have. Recording does not block the host, so a lesson can time its phases without synchronising.
  virtual Event record_event() = 0;
  // Device time from `start` to `end` in microseconds (cudaEventElapsedTime); the host waits for `end`
  // to complete (cudaEventSynchronize).
  virtual double elapsed_us(const Event& start, const Event& end) = 0;
  // The same where `end` has completed by now (cudaEventQuery), waiting for nothing; nullopt otherwise.
  virtual std::optional<double> elapsed_us_if_ended(const Event& start, const Event& end) = 0;
  // Device time this rank's compute kernels have lost so far to communication kernels running beside
  // them on the GPU, microseconds: the simulator's model of their shared SMs and HBM (docs/model.md). A
  // real GPU does not report it: 0 there.
  virtual double comm_slowed_compute_us() { return 0; }
  // Device time this rank's compute stream has stood idle so far with nothing to run but the next kernel
  // the host was still launching (each launch costs the host `launch_overhead_us`): where kernels are
  // shorter than their launches the step is host-bound, and this is the time it loses. The simulator's; a
  // real GPU does not report it: 0 there.
  virtual double host_wait_us() { return 0; }

  // ---- the hardware ---------------------------------------------------------------------------------
  // The machine this rank's time is modelled on (the simulator) or that the run names to be compared
  // with (the real backend): its GPU's peak rates, its GPUs per node.
  virtual const Profile& profile() const = 0;
  // The algorithm and protocol ("ring/simple") this backend runs a collective `op` of `bytes` over the
  // whole world with (root `root` for the rooted ones), as NCCL would choose them; "" where the backend
  // cannot say (NCCL does not report its choice).
  virtual std::string collective_algorithm(CommOp /*op*/, std::int64_t /*bytes*/, int /*root*/) { return ""; }

  // ---- memory ---------------------------------------------------------------------------------------
  virtual std::int64_t memory_allocated() const = 0;  // bytes held by live tensors of this rank
  virtual std::int64_t memory_peak() const = 0;
  virtual std::int64_t memory_capacity() const = 0;  // the device's memory, from the profile
  // Starts the peak over again from what is allocated now (torch.cuda.reset_peak_memory_stats).
  virtual void reset_peak_memory() = 0;

  // ---- output and the run report --------------------------------------------------------------------
  // A named span of host time in the report: `auto scope = r.region("forward");`.
  class Region {
   public:
    Region(Rank* r, std::string name);
    ~Region();
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;

   private:
    friend class Rank;
    Region(Rank* r, std::string name, bool bookkeeping);
    Rank* rank_;
    bool bookkeeping_ = false;
  };
  Region region(std::string name) { return Region(this, std::move(name)); }
  // A region whose communication is the lesson's bookkeeping: comparing with a reference, gathering the
  // figures it prints. Its collectives still run and take their time, but the report leaves them out of
  // the tables that describe the lesson's communication (collectives, link traffic) and counts them apart.
  Region bookkeeping(std::string name) { return Region(this, std::move(name), true); }
  virtual void region_begin(const std::string& name) = 0;
  virtual void region_end() = 0;

  // A line of the lesson's output (every rank may print; lines carry no rank prefix).
  virtual void print(const std::string& line) = 0;
  // Every rank of the world calls this together: prints `label rankI = [..]` for each rank in order.
  // It is out of band: it costs no time and does not appear in the report's communication.
  virtual void show(const std::string& label, const Tensor& t) = 0;
  // Records a numerical check of the lesson; a failed check fails the run after it ends.
  virtual void check(const std::string& what, bool passed, const std::string& detail) = 0;
  // A training lesson's figures for the step it timed (the report's `training` object). Rank 0 calls it;
  // a later call replaces an earlier one.
  virtual void report_training(const TrainingStats& stats) = 0;
  // This rank's tasks of a pipeline schedule (the step it timed), for the report's schedule chart. Each
  // rank that runs a stage reports its own; the report keeps them all.
  virtual void report_pipeline(const std::vector<PipelineTask>& tasks) = 0;
  // Asks the report to keep this rank's timeline where the user left the choice of ranks to the lesson
  // (--trace-ranks auto): a large run's lesson marks the ranks that show its schedule, one per pipeline
  // stage. Called before the rank's first kernel; a backend that keeps every rank's timeline ignores it.
  virtual void keep_in_trace() {}

 protected:
  // matmul_, or matmul_add_ when `accumulate`: the one entry each backend implements.
  virtual void matmul_into(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                           bool accumulate) = 0;

 private:
  // communicate() with the call marked as bookkeeping when a bookkeeping region is open.
  Work issue(CommCall call);
  int bookkeeping_depth_ = 0;
};

}  // namespace ranklab
