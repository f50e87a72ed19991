#include "sim/sim_rank.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/comm_checks.h"
#include "common/compute_checks.h"
#include "common/dtype_round.h"
#include "common/errors.h"
#include "common/random.h"
#include "sim/asan_fibers.h"
#include "sim/scheduler.h"

namespace ranklab::sim {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ArrayMap = Eigen::Map<Eigen::ArrayXf>;

ArrayMap array(const Tensor& t) {
  return ArrayMap(sim_data(t), t.numel());
}

constexpr double kF = sizeof(float);  // bytes per element of a float32 tensor, for the cost model

double bytes_of(const Tensor& t) {
  return static_cast<double>(t.bytes());
}

// Rounds a real tensor's values to its dtype after a kernel wrote them (a no-op for float32).
void round_to_dtype(const Tensor& t) {
  if (t.phantom()) return;
  float* d = sim_data(t);
  const std::int64_t n = t.numel();
  if (t.dtype() == DType::BFloat16) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = round_to_bfloat16(d[i]);
  } else if (t.dtype() == DType::Float16) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = round_to_float16(d[i]);
  }
}

float round_value(float x, DType dtype) {
  switch (dtype) {
    case DType::BFloat16:
      return round_to_bfloat16(x);
    case DType::Float16:
      return round_to_float16(x);
    case DType::Float32:
      break;
  }
  return x;
}

// Kernel names for the timeline, made once: a phantom step launches millions of kernels.
const std::string kFill = "fill", kArange = "arange", kRandn = "randn", kCopyH2D = "copy_h2d",
                  kMatmul = "matmul", kRelu = "relu", kReluBackward = "relu_backward", kAdd = "add",
                  kAddInPlace = "add_", kScale = "scale_", kCopy = "copy", kCast = "cast", kSum = "sum",
                  kSlice = "slice", kCat = "cat", kSgd = "sgd_step", kAdamw = "adamw_step",
                  kAddBias = "add_bias_", kSumRows = "sum_rows", kLayernorm = "layernorm",
                  kLayernormBackward = "layernorm_backward", kGelu = "gelu", kGeluBackward = "gelu_backward",
                  kDropout = "dropout", kAttention = "attention", kAttentionBackward = "attention_backward",
                  kEmbedding = "embedding", kEmbeddingBackward = "embedding_backward_", kRowMax = "row_max",
                  kSoftmaxStats = "softmax_stats", kCrossEntropyLoss = "cross_entropy_loss",
                  kCrossEntropyBackward = "cross_entropy_backward";

// A point on a rank's compute stream: when the kernels launched before it end.
class SimEvent : public EventState {
 public:
  SimEvent(int rank, double time_us) : rank(rank), time_us(time_us) {}
  int rank;
  double time_us;
};

// Splits a shape around `dim` into [outer, dim, inner] so slicing and concatenation are block copies.
void split_at(const Shape& s, int dim, std::int64_t& outer, std::int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < dim; ++i) outer *= s[i];
  for (int i = dim + 1; i < s.ndim(); ++i) inner *= s[i];
}

// The compute stream waits for `op` before its next kernel: `op` is synchronous, or wait() was called on it.
// A group's collectives run one after another on its stream, so the later of two stands for both:
// back-to-back collectives, or the buckets of a step waited on in turn, keep the list as short as the number
// of streams (at most one collective per group, which is what the search below relies on).
void compute_stream_waits_for(RankState& s, const std::shared_ptr<CommOpState>& op) {
  s.waits_deferred = false;
  if (op->op != CommOp::Send) {
    const auto same_stream = std::find_if(
        s.unfolded_waits.begin(), s.unfolded_waits.end(), [&](const std::shared_ptr<CommOpState>& other) {
          return other->op != CommOp::Send && other->group_id == op->group_id;
        });
    if (same_stream != s.unfolded_waits.end()) {
      if ((*same_stream)->seq >= op->seq) {  // a later one already stands for it
        if (!op->finished) s.folded_with.push_back(op);
        return;
      }
      if (!(*same_stream)->finished) s.folded_with.push_back(*same_stream);
      s.unfolded_waits.erase(same_stream);
    }
  }
  s.unfolded_waits.push_back(op);
}

class SimWork : public WorkState {
 public:
  SimWork(SimWorld& world, int rank, std::shared_ptr<CommOpState> op)
      : world_(world), rank_(rank), op_(std::move(op)) {}
  // As torch's work.wait() on NCCL: the compute stream waits for the operation, the host does not. The
  // rank goes on at once; its next kernel (or anything else that needs the compute stream's clock or the
  // operation's numbers) waits for the operation's end. Waiting for every bucket of a step then blocks once,
  // on the last one, instead of once per bucket.
  void wait() override {
    CommMember& m = op_->member_of(rank_);
    if (m.waited) return;
    m.waited = true;
    world_.note_waited(rank_, op_);
    compute_stream_waits_for(world_.state(rank_), op_);
  }
  bool waited() const override { return op_->member_of(rank_).waited; }
  double elapsed_us() override {
    if (!op_->finished) world_.wait_finished(rank_, op_, "Work::elapsed_us()");
    return op_->end_us - op_->start_us;
  }

 private:
  SimWorld& world_;
  int rank_;
  std::shared_ptr<CommOpState> op_;
};

// The Work of a synchronous call: complete as far as the program can tell (the compute stream waits for
// it), with the operation's time.
class SimDoneWork : public WorkState {
 public:
  SimDoneWork(SimWorld& world, int rank, std::shared_ptr<CommOpState> op)
      : world_(world), rank_(rank), op_(std::move(op)) {}
  void wait() override {}
  bool waited() const override { return true; }
  double elapsed_us() override {
    if (!op_->finished) world_.wait_finished(rank_, op_, "Work::elapsed_us()");
    return op_->end_us - op_->start_us;
  }

 private:
  SimWorld& world_;
  int rank_;
  std::shared_ptr<CommOpState> op_;
};

}  // namespace

// ---- checks and bookkeeping ------------------------------------------------------------------------

std::string SimRank::where(const char* op) const {
  return fmt::format("rank {}: {}", rank_, op);
}

void SimRank::require(const Tensor& t, const char* op, const char* arg) const {
  world_.check_thread(rank_, op);
  world_.check_aborted();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  if (t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
}

void SimRank::require_dtype(const Tensor& t, DType dtype, const char* op, const char* arg) const {
  if (t.dtype() != dtype) {
    throw UsageError(
        fmt::format("{}: '{}' is {}; it must be {}", where(op), arg, t.str(), dtype_name(dtype)));
  }
}

void SimRank::require_same_dtype(const Tensor& a, const Tensor& b, const char* op) const {
  if (a.dtype() != b.dtype()) {
    throw UsageError(
        fmt::format("{}: dtypes differ: {} and {}; cast one first", where(op), a.str(), b.str()));
  }
}

void SimRank::require_shape(const Tensor& t, const Shape& want, const char* op, const char* arg) const {
  if (t.shape() != want) {
    throw UsageError(fmt::format("{}: '{}' is {}; expected shape {}", where(op), arg, t.str(), want.str()));
  }
}

Tensor SimRank::allocate(const Shape& s, DType dtype, bool phantom, const char* op) {
  world_.check_thread(rank_, op);
  world_.check_aborted();
  MemoryAccount& m = *s_.memory;
  const std::int64_t bytes = s.numel() * dtype_bytes(dtype);
  if (m.allocated + bytes > m.capacity) {
    throw OutOfMemoryError(fmt::format(
        "{}: out of memory allocating {}{} ({}): {} already in use of the {} of a {} ({})", where(op),
        dtype_name(dtype), s.str(), format_bytes(static_cast<double>(bytes)),
        format_bytes(static_cast<double>(m.allocated)), format_bytes(static_cast<double>(m.capacity)),
        world_.profile().gpu.name, world_.profile().name));
  }
  if (!phantom && m.host && m.host->limit > 0) {
    const std::int64_t need = static_cast<std::int64_t>(sizeof(float)) * std::max<std::int64_t>(s.numel(), 1);
    if (need > m.host->limit - m.host->used) {
      throw UsageError(fmt::format(
          "{}: the simulator is out of host memory allocating {}{} ({}): the real tensors of all {} ranks "
          "already hold {} of the {} it may use on this machine; time the run with --phantom, or use fewer "
          "ranks or smaller sizes",
          where(op), dtype_name(dtype), s.str(), format_bytes(static_cast<double>(need)), world_.size(),
          format_bytes(static_cast<double>(m.host->used)), format_bytes(static_cast<double>(m.host->limit))));
    }
  }
  return Tensor(s, dtype, std::make_shared<SimStorage>(s_.memory, s.numel(), dtype, phantom));
}

void SimRank::fold_waits(const char* by) {
  if (!s_.unfolded_waits.empty()) world_.settle_compute(rank_);
  for (const auto& op : s_.unfolded_waits) {
    if (!op->finished) {
      world_.wait_finished(rank_, op, by, /*folded=*/true);
    }
    s_.compute_us = std::max(s_.compute_us, op->end_us);
  }
  s_.unfolded_waits.clear();
  s_.folded_with.clear();  // ended before those
}

void SimRank::waits_before_kernel(const char* by) {
  if (s_.unfolded_waits.empty() || s_.waits_deferred) return;
  if (world_.may_defer_waits(rank_)) {
    world_.defer_waits(rank_);  // the kernel takes them along (SimWorld::launch_kernel)
    return;
  }
  fold_waits(by);
}

void SimRank::before_reading(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    SimStorage& st = *sim_storage(*t);
    bool all_read = true;
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      if (!st.pending[i]->member_of(rank_).waited && !st.pending_reads_only[i]) all_read = false;
    }
    if (!all_read) {
      before_kernel({t}, op);
      continue;
    }
    // The readers in flight stay recorded, so that a kernel writing the buffer later is still caught.
    std::size_t kept = 0;
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      if (st.pending[i]->member_of(rank_).waited) continue;
      st.pending[kept] = st.pending[i];
      st.pending_reads_only[kept] = true;
      ++kept;
    }
    st.pending.resize(kept);
    st.pending_reads_only.resize(kept);
  }
  waits_before_kernel(op);
}

void SimRank::before_kernel(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    auto& pending = sim_storage(*t)->pending;
    for (const auto& p : pending) {
      if (!p->member_of(rank_).waited) {
        throw UsageError(fmt::format(
            "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
            "before touching the tensor (on a GPU this would be a silent race)",
            where(op), t->str(), p->label()));
      }
    }
    pending.clear();
    sim_storage(*t)->pending_reads_only.clear();
  }
  waits_before_kernel(op);
}

void SimRank::launch_kernel(const std::string& name, double flops, double bytes, DType dtype) {
  launch_kernel_cost(name, world_.compute().kernel_cost(flops, bytes, dtype));
}

void SimRank::launch_kernel_cost(const std::string& name, const KernelCost& cost) {
  waits_before_kernel(name.c_str());  // kernels that read no tensor (fills, random numbers) wait too
  s_.host_us += world_.compute().launch_us();
  // Communication this GPU runs at the same time holds some of its SMs and HBM bandwidth.
  world_.launch_kernel(rank_, name, cost);
}

// ---- tensors ---------------------------------------------------------------------------------------

Tensor SimRank::empty(const Shape& s, DType dtype) {
  Tensor t = allocate(s, dtype, false, "empty");
  // NaN makes a read of never-written memory visible in every result it touches.
  array(t).setConstant(std::numeric_limits<float>::quiet_NaN());
  return t;
}

Tensor SimRank::zeros(const Shape& s, DType dtype) {
  return full(s, 0.0f, dtype);
}

Tensor SimRank::full(const Shape& s, float value, DType dtype) {
  Tensor t = allocate(s, dtype, false, "full");
  array(t).setConstant(round_value(value, dtype));
  launch_kernel(kFill, 0, bytes_of(t), dtype);
  return t;
}

Tensor SimRank::arange(const Shape& s, float start) {
  Tensor t = allocate(s, DType::Float32, false, "arange");
  float* d = sim_data(t);
  for (std::int64_t i = 0; i < s.numel(); ++i) d[i] = start + static_cast<float>(i);
  launch_kernel(kArange, 0, kF * s.numel());
  return t;
}

Tensor SimRank::randn(const Shape& s, std::uint64_t seed, float std, DType dtype) {
  Tensor t = allocate(s, dtype, false, "randn");
  float* d = sim_data(t);
  for (std::int64_t i = 0; i < s.numel(); ++i) d[i] = std * normal_at(seed, static_cast<std::uint64_t>(i));
  round_to_dtype(t);
  launch_kernel(kRandn, 0, bytes_of(t), dtype);
  return t;
}

Tensor SimRank::randn_slice(const Shape& full, int dim, std::int64_t start, std::int64_t length,
                            std::uint64_t seed, float std, DType dtype) {
  world_.check_aborted();
  check_randn_slice(rank_, full, dim, start, length);
  Tensor t = allocate(full.with_dim(dim, length), dtype, false, "randn_slice");
  std::int64_t outer, inner;
  split_at(full, dim, outer, inner);
  float* d = sim_data(t);
  // Element (o, j, i) of the slice is element (o, start + j, i) of the full tensor.
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t j = 0; j < length; ++j) {
      const std::int64_t src = (o * full[dim] + start + j) * inner, dst = (o * length + j) * inner;
      for (std::int64_t i = 0; i < inner; ++i) {
        d[dst + i] = std * normal_at(seed, static_cast<std::uint64_t>(src + i));
      }
    }
  }
  round_to_dtype(t);
  launch_kernel(kRandn, 0, bytes_of(t), dtype);  // only the shard is generated
  return t;
}

Tensor SimRank::from_host(const Shape& s, const std::vector<float>& values, DType dtype) {
  if (static_cast<std::int64_t>(values.size()) != s.numel()) {
    throw UsageError(fmt::format("{}: {} values do not fill shape {} ({} elements)", where("from_host"),
                                 values.size(), s.str(), s.numel()));
  }
  Tensor t = allocate(s, dtype, false, "from_host");
  std::copy(values.begin(), values.end(), sim_data(t));
  round_to_dtype(t);
  launch_kernel(kCopyH2D, 0, bytes_of(t), dtype);
  return t;
}

Tensor SimRank::phantom(const Shape& s, DType dtype) {
  return allocate(s, dtype, true, "phantom");
}

std::vector<float> SimRank::to_host(const Tensor& t) {
  require(t, "to_host", "t");
  if (t.phantom()) {
    throw UsageError(fmt::format("{}: {} has a shape but no values (phantom tensors only advance time)",
                                 where("to_host"), t.str()));
  }
  before_kernel({&t}, "to_host");
  fold_waits("to_host");  // the copy needs the stream's clock
  world_.settle_compute(rank_);
  s_.host_us = std::max(s_.host_us, s_.compute_us);  // a device-to-host copy waits for the stream
  return std::vector<float>(sim_data(t), sim_data(t) + t.numel());
}

// ---- compute ---------------------------------------------------------------------------------------

Tensor SimRank::matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
  require(a, "matmul", "a");
  require(b, "matmul", "b");
  if (a.ndim() != 2 || b.ndim() != 2) {
    throw UsageError(fmt::format("{}: needs 2-D tensors; got {} and {}", where("matmul"), a.str(), b.str()));
  }
  require_same_dtype(a, b, "matmul");
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = at ? a.size(1) : a.size(0), k = at ? a.size(0) : a.size(1);
  const std::int64_t kb = bt ? b.size(1) : b.size(0), n = bt ? b.size(0) : b.size(1);
  if (k != kb) {
    throw UsageError(fmt::format("{}: inner dimensions differ: {}{} @ {}{} ({} vs {})", where("matmul"),
                                 a.str(), at ? ".T" : "", b.str(), bt ? ".T" : "", k, kb));
  }
  Tensor c = allocate({m, n}, a.dtype(), a.phantom() || b.phantom(), "matmul");
  before_reading({&a, &b}, "matmul");
  if (!c.phantom()) {
    // 16-bit inputs are already rounded; the float32 product stands for the tensor cores' float32
    // accumulation, and the output is rounded once.
    MatrixMap A(sim_data(a), a.size(0), a.size(1)), B(sim_data(b), b.size(0), b.size(1)),
        C(sim_data(c), m, n);
    if (!at && !bt) C.noalias() = A * B;
    if (at && !bt) C.noalias() = A.transpose() * B;
    if (!at && bt) C.noalias() = A * B.transpose();
    if (at && bt) C.noalias() = A.transpose() * B.transpose();
    round_to_dtype(c);
  }
  launch_kernel_cost(kMatmul, world_.compute().gemm_cost(m, n, k, a.dtype()));
  return c;
}

void SimRank::require_same_shape(const char* op, const Tensor& a, const Tensor& b) const {
  if (a.shape() != b.shape())
    throw UsageError(fmt::format("{}: shapes differ: {} and {}", where(op), a.str(), b.str()));
}

Tensor SimRank::relu(const Tensor& x) {
  require(x, "relu", "x");
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "relu");
  before_kernel({&x}, "relu");
  if (!y.phantom()) array(y) = array(x).max(0.0f);
  launch_kernel(kRelu, x.numel(), 2 * bytes_of(x), x.dtype());
  return y;
}

Tensor SimRank::relu_backward(const Tensor& grad_out, const Tensor& x) {
  require(grad_out, "relu_backward", "grad_out");
  require(x, "relu_backward", "x");
  require_same_shape("relu_backward", grad_out, x);
  require_same_dtype(grad_out, x, "relu_backward");
  Tensor g = allocate(x.shape(), x.dtype(), x.phantom() || grad_out.phantom(), "relu_backward");
  before_kernel({&grad_out, &x}, "relu_backward");
  if (!g.phantom()) array(g) = (array(x) > 0.0f).select(array(grad_out), 0.0f);
  launch_kernel(kReluBackward, x.numel(), 3 * bytes_of(x), x.dtype());
  return g;
}

Tensor SimRank::add(const Tensor& a, const Tensor& b) {
  require(a, "add", "a");
  require(b, "add", "b");
  require_same_shape("add", a, b);
  require_same_dtype(a, b, "add");
  Tensor c = allocate(a.shape(), a.dtype(), a.phantom() || b.phantom(), "add");
  before_kernel({&a, &b}, "add");
  if (!c.phantom()) {
    array(c) = array(a) + array(b);
    round_to_dtype(c);
  }
  launch_kernel(kAdd, a.numel(), 3 * bytes_of(a), a.dtype());
  return c;
}

void SimRank::require_same_kind(const char* op, const Tensor& dst, const Tensor& src) const {
  if (!dst.phantom() && src.phantom()) {
    throw UsageError(fmt::format("{}: writes phantom {} into real {}; make both phantom or both real",
                                 where(op), src.str(), dst.str()));
  }
}

void SimRank::add_(const Tensor& dst, const Tensor& src, float alpha) {
  require(dst, "add_", "dst");
  require(src, "add_", "src");
  require_same_shape("add_", dst, src);
  require_same_kind("add_", dst, src);
  before_kernel({&dst, &src}, "add_");
  if (!dst.phantom()) {
    array(dst) += alpha * array(src);
    round_to_dtype(dst);
  }
  // Reads dst and src, writes dst.
  launch_kernel(kAddInPlace, 2.0 * dst.numel(), 2 * bytes_of(dst) + bytes_of(src), dst.dtype());
}

void SimRank::scale_(const Tensor& t, float factor) {
  require(t, "scale_", "t");
  before_kernel({&t}, "scale_");
  if (!t.phantom()) {
    array(t) *= factor;
    round_to_dtype(t);
  }
  launch_kernel(kScale, t.numel(), 2 * bytes_of(t), t.dtype());
}

void SimRank::copy_(const Tensor& dst, const Tensor& src) {
  require(dst, "copy_", "dst");
  require(src, "copy_", "src");
  if (dst.numel() != src.numel()) {
    throw UsageError(fmt::format("{}: {} and {} differ in size", where("copy_"), dst.str(), src.str()));
  }
  require_same_kind("copy_", dst, src);
  before_kernel({&dst, &src}, "copy_");
  if (!dst.phantom()) {
    array(dst) = array(src);
    round_to_dtype(dst);
  }
  launch_kernel(kCopy, 0, bytes_of(dst) + bytes_of(src), dst.dtype());
}

Tensor SimRank::cast(const Tensor& t, DType dtype) {
  require(t, "cast", "t");
  Tensor out = allocate(t.shape(), dtype, t.phantom(), "cast");
  before_kernel({&t}, "cast");
  if (!out.phantom()) {
    array(out) = array(t);
    round_to_dtype(out);
  }
  launch_kernel_cost(kCast, world_.compute().memory_cost(bytes_of(t) + bytes_of(out)));
  return out;
}

Tensor SimRank::sum(const Tensor& t) {
  require(t, "sum", "t");
  Tensor out = allocate(Shape{}, t.dtype(), t.phantom(), "sum");
  before_kernel({&t}, "sum");
  if (!out.phantom()) {
    // Accumulate in double so the result does not depend on how the sum is split across kernels.
    double acc = 0;
    const float* d = sim_data(t);
    for (std::int64_t i = 0; i < t.numel(); ++i) acc += d[i];
    sim_data(out)[0] = round_value(static_cast<float>(acc), t.dtype());
  }
  launch_kernel(kSum, t.numel(), bytes_of(t), t.dtype());
  return out;
}

Tensor SimRank::slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) {
  require(t, "slice", "t");
  if (dim < 0 || dim >= t.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("slice"), dim, t.str()));
  }
  if (start < 0 || length < 0 || start > t.size(dim) - length) {  // no overflow near INT64_MAX
    throw UsageError(fmt::format("{}: {} elements from {} are outside dimension {} of {} (size {})",
                                 where("slice"), length, start, dim, t.str(), t.size(dim)));
  }
  Tensor out = allocate(t.shape().with_dim(dim, length), t.dtype(), t.phantom(), "slice");
  before_kernel({&t}, "slice");
  if (!out.phantom()) {
    std::int64_t outer, inner;
    split_at(t.shape(), dim, outer, inner);
    const float* src = sim_data(t);
    float* dst = sim_data(out);
    for (std::int64_t o = 0; o < outer; ++o) {
      std::memcpy(dst + o * length * inner, src + (o * t.size(dim) + start) * inner,
                  static_cast<size_t>(length * inner) * sizeof(float));
    }
  }
  launch_kernel(kSlice, 0, 2 * bytes_of(out), out.dtype());
  return out;
}

Tensor SimRank::cat(const std::vector<Tensor>& parts, int dim) {
  if (parts.empty()) throw UsageError(fmt::format("{}: nothing to concatenate", where("cat")));
  const Tensor& first = parts[0];
  require(first, "cat", "parts[0]");
  if (dim < 0 || dim >= first.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("cat"), dim, first.str()));
  }
  std::int64_t total = 0;
  bool phantom = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    require(parts[i], "cat", "parts[i]");
    if (parts[i].shape().with_dim(dim, 0) != first.shape().with_dim(dim, 0)) {
      throw UsageError(
          fmt::format("{}: parts[{}] is {} but parts[0] is {}; they may differ only in dimension {}",
                      where("cat"), i, parts[i].str(), first.str(), dim));
    }
    require_same_dtype(first, parts[i], "cat");
    total += parts[i].size(dim);
    phantom = phantom || parts[i].phantom();
  }
  Tensor out = allocate(first.shape().with_dim(dim, total), first.dtype(), phantom, "cat");
  for (const Tensor& p : parts) before_kernel({&p}, "cat");
  if (!out.phantom()) {
    std::int64_t outer, inner;
    split_at(out.shape(), dim, outer, inner);
    float* dst = sim_data(out);
    std::int64_t offset = 0;
    for (const Tensor& p : parts) {
      const std::int64_t len = p.size(dim);
      for (std::int64_t o = 0; o < outer; ++o) {
        std::memcpy(dst + (o * total + offset) * inner, sim_data(p) + o * len * inner,
                    static_cast<size_t>(len * inner) * sizeof(float));
      }
      offset += len;
    }
  }
  launch_kernel(kCat, 0, 2 * bytes_of(out), out.dtype());
  return out;
}

void SimRank::sgd_step(const Tensor& param, const Tensor& grad, float lr) {
  require(param, "sgd_step", "param");
  require(grad, "sgd_step", "grad");
  require_same_shape("sgd_step", param, grad);
  require_same_kind("sgd_step", param, grad);
  before_kernel({&param, &grad}, "sgd_step");
  if (!param.phantom()) {
    array(param) -= lr * array(grad);
    round_to_dtype(param);
  }
  launch_kernel(kSgd, 2.0 * param.numel(), 2 * bytes_of(param) + bytes_of(grad), param.dtype());
}

void SimRank::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         const AdamW& h, int step) {
  require(param, "adamw_step", "param");
  require(grad, "adamw_step", "grad");
  require(m, "adamw_step", "m");
  require(v, "adamw_step", "v");
  require_same_shape("adamw_step", param, grad);
  require_same_shape("adamw_step", param, m);
  require_same_shape("adamw_step", param, v);
  require_same_kind("adamw_step", param, grad);
  require_dtype(param, DType::Float32, "adamw_step", "param");
  require_dtype(grad, DType::Float32, "adamw_step", "grad");
  require_dtype(m, DType::Float32, "adamw_step", "m");
  require_dtype(v, DType::Float32, "adamw_step", "v");
  if (step < 1) throw UsageError(fmt::format("{}: step counts from 1; got {}", where("adamw_step"), step));
  before_kernel({&param, &grad, &m, &v}, "adamw_step");
  if (!param.phantom()) {
    auto p = array(param), g = array(grad), mm = array(m), vv = array(v);
    mm = h.beta1 * mm + (1 - h.beta1) * g;
    vv = h.beta2 * vv + (1 - h.beta2) * g.square();
    const float c1 = 1 - std::pow(h.beta1, static_cast<float>(step));
    const float c2 = 1 - std::pow(h.beta2, static_cast<float>(step));
    p -= h.lr * ((mm / c1) / ((vv / c2).sqrt() + h.eps) + h.weight_decay * p);
  }
  launch_kernel(kAdamw, 12.0 * param.numel(), 7 * kF * param.numel());
}

// ---- transformer kernels ---------------------------------------------------------------------------

namespace {
const float* cdata(const Tensor& t) {
  return sim_data(t);
}
// A token id stored as a float, as an integer; ids are exact up to 2^24.
std::int64_t id_at(const float* ids, std::int64_t row) {
  return static_cast<std::int64_t>(ids[row]);
}
}  // namespace

void SimRank::add_bias_(const Tensor& x, const Tensor& bias) {
  require(x, "add_bias_", "x");
  require(bias, "add_bias_", "bias");
  if (x.ndim() != 2) {
    throw UsageError(fmt::format("{}: 'x' must be 2-D [rows, cols]; got {}", where("add_bias_"), x.str()));
  }
  require_shape(bias, Shape{x.size(1)}, "add_bias_", "bias");
  require_same_dtype(x, bias, "add_bias_");
  require_same_kind("add_bias_", x, bias);
  before_kernel({&x, &bias}, "add_bias_");
  if (!x.phantom()) {
    MatrixMap X(sim_data(x), x.size(0), x.size(1));
    X.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(cdata(bias), x.size(1));
    round_to_dtype(x);
  }
  launch_kernel_cost(kAddBias, world_.compute().memory_cost(2 * bytes_of(x) + bytes_of(bias)));
}

Tensor SimRank::sum_rows(const Tensor& x) {
  require(x, "sum_rows", "x");
  if (x.ndim() != 2) {
    throw UsageError(fmt::format("{}: 'x' must be 2-D [rows, cols]; got {}", where("sum_rows"), x.str()));
  }
  const std::int64_t rows = x.size(0), cols = x.size(1);
  Tensor out = allocate(Shape{cols}, DType::Float32, x.phantom(), "sum_rows");
  before_kernel({&x}, "sum_rows");
  if (!out.phantom()) {
    std::vector<double> acc(static_cast<size_t>(cols), 0.0);
    const float* d = cdata(x);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) acc[c] += d[r * cols + c];
    }
    for (std::int64_t c = 0; c < cols; ++c) sim_data(out)[c] = static_cast<float>(acc[c]);
  }
  launch_kernel_cost(kSumRows, world_.compute().memory_cost(bytes_of(x) + bytes_of(out)));
  return out;
}

Rank::LayerNormOut SimRank::layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
  const char* op = "layernorm";
  require(x, op, "x");
  require(gamma, op, "gamma");
  require(beta, op, "beta");
  check_layernorm(rank_, x, gamma, beta, eps);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = x.phantom() || gamma.phantom() || beta.phantom();
  LayerNormOut o;
  o.y = allocate(x.shape(), x.dtype(), ph, op);
  o.mean = allocate(Shape{rows}, DType::Float32, ph, op);
  o.rstd = allocate(Shape{rows}, DType::Float32, ph, op);
  before_kernel({&x, &gamma, &beta}, op);
  if (!ph) {
    const float *X = cdata(x), *G = cdata(gamma), *B = cdata(beta);
    float *Y = sim_data(o.y), *M = sim_data(o.mean), *R = sim_data(o.rstd);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = X + r * cols;
      double s = 0;
      for (std::int64_t c = 0; c < cols; ++c) s += xr[c];
      const double mean = s / static_cast<double>(cols);
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) ss += (xr[c] - mean) * (xr[c] - mean);
      const double var = ss / static_cast<double>(cols);  // biased, as torch.nn.LayerNorm
      const float rstd = static_cast<float>(1.0 / std::sqrt(var + eps));
      M[r] = static_cast<float>(mean);
      R[r] = rstd;
      for (std::int64_t c = 0; c < cols; ++c) Y[r * cols + c] = (xr[c] - M[r]) * rstd * G[c] + B[c];
    }
    round_to_dtype(o.y);
  }
  // Reads x, gamma and beta, writes y, mean and rstd.
  launch_kernel_cost(kLayernorm,
                     world_.compute().memory_cost(bytes_of(x) + bytes_of(gamma) + bytes_of(beta) +
                                                  bytes_of(o.y) + bytes_of(o.mean) + bytes_of(o.rstd)));
  return o;
}

Rank::LayerNormGrads SimRank::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                 const Tensor& mean, const Tensor& rstd) {
  const char* op = "layernorm_backward";
  require(dy, op, "dy");
  require(x, op, "x");
  require(gamma, op, "gamma");
  require(mean, op, "mean");
  require(rstd, op, "rstd");
  check_layernorm_backward(rank_, dy, x, gamma, mean, rstd);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = dy.phantom() || x.phantom() || gamma.phantom() || mean.phantom() || rstd.phantom();
  LayerNormGrads g;
  g.dx = allocate(x.shape(), x.dtype(), ph, op);
  g.dgamma = allocate(Shape{cols}, DType::Float32, ph, op);
  g.dbeta = allocate(Shape{cols}, DType::Float32, ph, op);
  before_kernel({&dy, &x, &gamma, &mean, &rstd}, op);
  if (!ph) {
    const float *DY = cdata(dy), *X = cdata(x), *G = cdata(gamma), *M = cdata(mean), *R = cdata(rstd);
    float* DX = sim_data(g.dx);
    std::vector<double> dgamma(static_cast<size_t>(cols), 0.0), dbeta(static_cast<size_t>(cols), 0.0);
    std::vector<float> xhat(static_cast<size_t>(cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      // dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy gamma.
      double sum_dxhat = 0, sum_dxhat_xhat = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = r * cols + c;
        xhat[c] = (X[i] - M[r]) * R[r];
        const double dxhat = static_cast<double>(DY[i]) * G[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat[c];
        dgamma[c] += static_cast<double>(DY[i]) * xhat[c];
        dbeta[c] += DY[i];
      }
      const double n = static_cast<double>(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = r * cols + c;
        const double dxhat = static_cast<double>(DY[i]) * G[c];
        DX[i] = static_cast<float>(R[r] * (dxhat - sum_dxhat / n - xhat[c] * sum_dxhat_xhat / n));
      }
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      sim_data(g.dgamma)[c] = static_cast<float>(dgamma[c]);
      sim_data(g.dbeta)[c] = static_cast<float>(dbeta[c]);
    }
    round_to_dtype(g.dx);
  }
  launch_kernel_cost(
      kLayernormBackward,
      world_.compute().memory_cost(bytes_of(dy) + bytes_of(x) + bytes_of(gamma) + bytes_of(mean) +
                                   bytes_of(rstd) + bytes_of(g.dx) + bytes_of(g.dgamma) + bytes_of(g.dbeta)));
  return g;
}

namespace {
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;            // GPT-2's constant (Hendrycks & Gimpel 2016)
}  // namespace

Tensor SimRank::gelu(const Tensor& x) {
  require(x, "gelu", "x");
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "gelu");
  before_kernel({&x}, "gelu");
  if (!y.phantom()) {
    const float* X = cdata(x);
    float* Y = sim_data(y);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float v = X[i];
      Y[i] = 0.5f * v * (1.0f + std::tanh(kGeluC * (v + kGeluA * v * v * v)));
    }
    round_to_dtype(y);
  }
  launch_kernel_cost(kGelu, world_.compute().memory_cost(bytes_of(x) + bytes_of(y)));
  return y;
}

Tensor SimRank::gelu_backward(const Tensor& dy, const Tensor& x) {
  require(dy, "gelu_backward", "dy");
  require(x, "gelu_backward", "x");
  check_gelu_backward(rank_, dy, x);
  Tensor dx = allocate(x.shape(), x.dtype(), x.phantom() || dy.phantom(), "gelu_backward");
  before_kernel({&dy, &x}, "gelu_backward");
  if (!dx.phantom()) {
    const float *X = cdata(x), *DY = cdata(dy);
    float* DX = sim_data(dx);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float v = X[i];
      const float t = std::tanh(kGeluC * (v + kGeluA * v * v * v));
      const float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * v * v);
      DX[i] = DY[i] * d;
    }
    round_to_dtype(dx);
  }
  launch_kernel_cost(kGeluBackward, world_.compute().memory_cost(bytes_of(dy) + bytes_of(x) + bytes_of(dx)));
  return dx;
}

Tensor SimRank::dropout(const Tensor& x, float p, std::uint64_t seed, std::int64_t first_row) {
  require(x, "dropout", "x");
  check_dropout(rank_, x, p, first_row);
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "dropout");
  before_kernel({&x}, "dropout");
  if (!y.phantom()) {
    const float* X = cdata(x);
    float* Y = sim_data(y);
    const std::int64_t rows = x.size(0), cols = x.size(1);
    const float scale = 1.0f / (1.0f - p);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        Y[i * cols + j] = dropout_keeps(seed, first_row + i, j, p) ? X[i * cols + j] * scale : 0.0f;
      }
    }
    round_to_dtype(y);
  }
  launch_kernel_cost(kDropout, world_.compute().memory_cost(bytes_of(x) + bytes_of(y)));
  return y;
}

namespace {
// The shape of an attention call, from qkv [seq * batch, heads * 3 * head_dim].
struct AttnDims {
  std::int64_t seq, batch, heads, head_dim, width;  // width: heads * 3 * head_dim
  // Column of element d of head h's q (part 0), k (1) or v (2).
  std::int64_t col(std::int64_t h, int part, std::int64_t d) const { return (h * 3 + part) * head_dim + d; }
  std::int64_t row(std::int64_t pos, std::int64_t b) const { return pos * batch + b; }
};
}  // namespace

Rank::AttentionOut SimRank::attention(const Tensor& qkv, std::int64_t batch, int heads, bool causal,
                                      AttentionKernel kernel) {
  const char* op = "attention";
  require(qkv, op, "qkv");
  check_attention(rank_, op, qkv, batch, heads);
  const AttnDims a{qkv.size(0) / batch, batch, heads, qkv.size(1) / (3 * heads), qkv.size(1)};
  AttentionOut o;
  o.out = allocate(Shape{qkv.size(0), a.heads * a.head_dim}, qkv.dtype(), qkv.phantom(), op);
  o.lse = allocate(Shape{batch, heads, a.seq}, DType::Float32, qkv.phantom(), op);
  before_kernel({&qkv}, op);
  if (!qkv.phantom()) {
    const float* QKV = cdata(qkv);
    float *OUT = sim_data(o.out), *LSE = sim_data(o.lse);
    const std::int64_t out_w = a.heads * a.head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
    std::vector<float> s(static_cast<size_t>(a.seq));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t i = 0; i < a.seq; ++i) {
          const float* q = QKV + a.row(i, b) * a.width + a.col(h, 0, 0);
          const std::int64_t keys = causal ? i + 1 : a.seq;
          float mx = -std::numeric_limits<float>::infinity();
          for (std::int64_t j = 0; j < keys; ++j) {
            const float* k = QKV + a.row(j, b) * a.width + a.col(h, 1, 0);
            float dot = 0;
            for (std::int64_t d = 0; d < a.head_dim; ++d) dot += q[d] * k[d];
            s[j] = dot * scale;
            mx = std::max(mx, s[j]);
          }
          float l = 0;
          for (std::int64_t j = 0; j < keys; ++j) l += std::exp(s[j] - mx);
          const float lse = mx + std::log(l);
          LSE[(b * heads + h) * a.seq + i] = lse;
          float* out = OUT + a.row(i, b) * out_w + h * a.head_dim;
          for (std::int64_t d = 0; d < a.head_dim; ++d) out[d] = 0;
          for (std::int64_t j = 0; j < keys; ++j) {
            const float p = std::exp(s[j] - lse);
            const float* v = QKV + a.row(j, b) * a.width + a.col(h, 2, 0);
            for (std::int64_t d = 0; d < a.head_dim; ++d) out[d] += p * v[d];
          }
        }
      }
    }
    round_to_dtype(o.out);
  }
  const AttentionShape shape{batch, a.seq, heads, a.head_dim, causal, 0.0f};
  if (kernel == AttentionKernel::Unfused) {
    o.probs = allocate(Shape{batch * heads, a.seq, a.seq}, qkv.dtype(), /*phantom=*/true, op);
  }
  launch_attention(kAttention, shape, kernel, false, qkv.dtype());
  return o;
}

void SimRank::launch_attention(const std::string& name, const AttentionShape& shape, AttentionKernel kernel,
                               bool backward, DType dtype) {
  // The unfused path is several kernels, timed as one sequence; the host launches each.
  s_.host_us +=
      (ComputeModel::attention_kernel_count(shape, kernel, backward) - 1) * world_.compute().launch_us();
  launch_kernel_cost(name, world_.compute().attention_cost(shape, kernel, backward, dtype));
}

Tensor SimRank::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                   const Tensor& lse, std::int64_t batch, int heads, bool causal,
                                   AttentionKernel kernel) {
  const char* op = "attention_backward";
  require(dout, op, "dout");
  require(qkv, op, "qkv");
  require(out, op, "out");
  require(lse, op, "lse");
  check_attention_backward(rank_, dout, qkv, out, lse, batch, heads);
  const AttnDims a{qkv.size(0) / batch, batch, heads, qkv.size(1) / (3 * heads), qkv.size(1)};
  const std::int64_t out_w = a.heads * a.head_dim;
  const bool ph = dout.phantom() || qkv.phantom() || out.phantom() || lse.phantom();
  Tensor dqkv = allocate(qkv.shape(), qkv.dtype(), ph, op);
  before_kernel({&dout, &qkv, &out, &lse}, op);
  if (!ph) {
    const float *QKV = cdata(qkv), *OUT = cdata(out), *DOUT = cdata(dout), *LSE = cdata(lse);
    float* DQKV = sim_data(dqkv);
    std::fill(DQKV, DQKV + dqkv.numel(), 0.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t i = 0; i < a.seq; ++i) {
          const float* q = QKV + a.row(i, b) * a.width + a.col(h, 0, 0);
          const float* o_i = OUT + a.row(i, b) * out_w + h * a.head_dim;
          const float* do_i = DOUT + a.row(i, b) * out_w + h * a.head_dim;
          float* dq = DQKV + a.row(i, b) * a.width + a.col(h, 0, 0);
          const float lse_i = LSE[(b * heads + h) * a.seq + i];
          float delta = 0;  // D_i = dout_i . out_i (FlashAttention-2, Algorithm 2)
          for (std::int64_t d = 0; d < a.head_dim; ++d) delta += do_i[d] * o_i[d];
          const std::int64_t keys = causal ? i + 1 : a.seq;
          for (std::int64_t j = 0; j < keys; ++j) {
            const float* k = QKV + a.row(j, b) * a.width + a.col(h, 1, 0);
            const float* v = QKV + a.row(j, b) * a.width + a.col(h, 2, 0);
            float* dk = DQKV + a.row(j, b) * a.width + a.col(h, 1, 0);
            float* dv = DQKV + a.row(j, b) * a.width + a.col(h, 2, 0);
            float dot = 0, dp = 0;
            for (std::int64_t d = 0; d < a.head_dim; ++d) {
              dot += q[d] * k[d];
              dp += do_i[d] * v[d];
            }
            const float p = std::exp(dot * scale - lse_i);
            const float ds = p * (dp - delta) * scale;
            for (std::int64_t d = 0; d < a.head_dim; ++d) {
              dv[d] += p * do_i[d];
              dq[d] += ds * k[d];
              dk[d] += ds * q[d];
            }
          }
        }
      }
    }
    round_to_dtype(dqkv);
  }
  launch_attention(kAttentionBackward, AttentionShape{batch, a.seq, heads, a.head_dim, causal, 0.0f}, kernel,
                   true, qkv.dtype());
  return dqkv;
}

namespace {
// Token ids must be non-negative integers (a float holds them exactly up to 2^24).
void check_ids(const std::string& where, const Tensor& ids) {
  const float* d = sim_data(ids);
  for (std::int64_t i = 0; i < ids.numel(); ++i) {
    if (!(d[i] >= 0) || d[i] != std::floor(d[i]) || d[i] > 16777216.0f) {
      throw UsageError(
          fmt::format("{}: id {} at row {} is not a token id (an integer in [0, 2^24])", where, d[i], i));
    }
  }
}
}  // namespace

Tensor SimRank::embedding(const Tensor& ids, const Tensor& table, std::int64_t vocab_start) {
  const char* op = "embedding";
  require(ids, op, "ids");
  require(table, op, "table");
  check_embedding(rank_, ids, table, vocab_start);
  const std::int64_t rows = ids.size(0), vrows = table.size(0), dim = table.size(1);
  Tensor out = allocate(Shape{rows, dim}, table.dtype(), ids.phantom() || table.phantom(), op);
  before_kernel({&ids, &table}, op);
  if (!out.phantom()) {
    check_ids(where(op), ids);
    const float *I = cdata(ids), *T = cdata(table);
    float* O = sim_data(out);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t local = id_at(I, r) - vocab_start;
      for (std::int64_t c = 0; c < dim; ++c)
        O[r * dim + c] = local >= 0 && local < vrows ? T[local * dim + c] : 0.0f;
    }
  }
  // Reads the ids and one table row per token, writes the output.
  launch_kernel_cost(kEmbedding, world_.compute().memory_cost(bytes_of(ids) + 2 * bytes_of(out)));
  return out;
}

void SimRank::embedding_backward_(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                                  std::int64_t vocab_start) {
  const char* op = "embedding_backward_";
  require(dtable, op, "dtable");
  require(dy, op, "dy");
  require(ids, op, "ids");
  check_embedding_backward(rank_, dtable, dy, ids, vocab_start);
  require_same_kind(op, dtable, dy);
  require_same_kind(op, dtable, ids);
  before_kernel({&dtable, &dy, &ids}, op);
  const std::int64_t rows = ids.size(0), vrows = dtable.size(0), dim = dtable.size(1);
  if (!dtable.phantom()) {
    check_ids(where(op), ids);
    const float *I = cdata(ids), *DY = cdata(dy);
    float* DT = sim_data(dtable);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t local = id_at(I, r) - vocab_start;
      if (local < 0 || local >= vrows) continue;
      for (std::int64_t c = 0; c < dim; ++c) DT[local * dim + c] += DY[r * dim + c];
    }
  }
  // Reads the ids and dy, and reads and writes one float32 table row per token.
  launch_kernel_cost(
      kEmbeddingBackward,
      world_.compute().memory_cost(bytes_of(ids) + bytes_of(dy) + 2 * kF * static_cast<double>(rows * dim)));
}

Tensor SimRank::row_max(const Tensor& logits) {
  require(logits, "row_max", "logits");
  check_row_max(rank_, logits);
  const std::int64_t rows = logits.size(0), cols = logits.size(1);
  Tensor out = allocate(Shape{rows}, DType::Float32, logits.phantom(), "row_max");
  before_kernel({&logits}, "row_max");
  if (!out.phantom()) {
    const float* L = cdata(logits);
    for (std::int64_t r = 0; r < rows; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t c = 0; c < cols; ++c) mx = std::max(mx, L[r * cols + c]);
      sim_data(out)[r] = mx;
    }
  }
  launch_kernel_cost(kRowMax, world_.compute().memory_cost(bytes_of(logits) + bytes_of(out)));
  return out;
}

Tensor SimRank::softmax_stats(const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                              std::int64_t vocab_start) {
  const char* op = "softmax_stats";
  require(logits, op, "logits");
  require(row_max, op, "row_max");
  require(targets, op, "targets");
  check_softmax_stats(rank_, logits, row_max, targets, vocab_start);
  const std::int64_t rows = logits.size(0), cols = logits.size(1);
  const bool ph = logits.phantom() || row_max.phantom() || targets.phantom();
  Tensor out = allocate(Shape{rows, 2}, DType::Float32, ph, op);
  before_kernel({&logits, &row_max, &targets}, op);
  if (!ph) {
    check_ids(where(op), targets);
    const float *L = cdata(logits), *M = cdata(row_max), *T = cdata(targets);
    float* O = sim_data(out);
    for (std::int64_t r = 0; r < rows; ++r) {
      float s = 0;
      for (std::int64_t c = 0; c < cols; ++c) s += std::exp(L[r * cols + c] - M[r]);
      const std::int64_t local = id_at(T, r) - vocab_start;
      O[2 * r] = s;
      O[2 * r + 1] = local >= 0 && local < cols ? L[r * cols + local] : 0.0f;
    }
  }
  launch_kernel_cost(kSoftmaxStats, world_.compute().memory_cost(bytes_of(logits) + bytes_of(row_max) +
                                                                 bytes_of(targets) + bytes_of(out)));
  return out;
}

Tensor SimRank::cross_entropy_loss(const Tensor& row_max, const Tensor& stats) {
  const char* op = "cross_entropy_loss";
  require(row_max, op, "row_max");
  require(stats, op, "stats");
  check_cross_entropy_loss(rank_, row_max, stats);
  const std::int64_t rows = row_max.size(0);
  const bool ph = row_max.phantom() || stats.phantom();
  Tensor out = allocate(Shape{}, DType::Float32, ph, op);
  before_kernel({&row_max, &stats}, op);
  if (!ph) {
    const float *M = cdata(row_max), *S = cdata(stats);
    double loss = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      loss += std::log(static_cast<double>(S[2 * r])) + M[r] - S[2 * r + 1];
    sim_data(out)[0] = static_cast<float>(loss);
  }
  launch_kernel_cost(kCrossEntropyLoss,
                     world_.compute().memory_cost(bytes_of(row_max) + bytes_of(stats) + kF));
  return out;
}

Tensor SimRank::cross_entropy_backward(const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                       const Tensor& targets, std::int64_t vocab_start, float scale) {
  const char* op = "cross_entropy_backward";
  require(logits, op, "logits");
  require(row_max, op, "row_max");
  require(stats, op, "stats");
  require(targets, op, "targets");
  check_cross_entropy_backward(rank_, logits, row_max, stats, targets, vocab_start);
  const std::int64_t rows = logits.size(0), cols = logits.size(1);
  const bool ph = logits.phantom() || row_max.phantom() || stats.phantom() || targets.phantom();
  Tensor d = allocate(logits.shape(), logits.dtype(), ph, op);
  before_kernel({&logits, &row_max, &stats, &targets}, op);
  if (!ph) {
    check_ids(where(op), targets);
    const float *L = cdata(logits), *M = cdata(row_max), *S = cdata(stats), *T = cdata(targets);
    float* D = sim_data(d);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t local = id_at(T, r) - vocab_start;
      for (std::int64_t c = 0; c < cols; ++c) {
        const float p = std::exp(L[r * cols + c] - M[r]) / S[2 * r];
        D[r * cols + c] = scale * (p - (c == local ? 1.0f : 0.0f));
      }
    }
    round_to_dtype(d);
  }
  launch_kernel_cost(kCrossEntropyBackward,
                     world_.compute().memory_cost(bytes_of(logits) + bytes_of(row_max) + bytes_of(stats) +
                                                  bytes_of(targets) + bytes_of(d)));
  return d;
}

// ---- communication ---------------------------------------------------------------------------------

void SimRank::validate(const CommCall& call) const {
  world_.check_group(rank_, call.group, comm_op_name(call.op));  // before anything indexes by it
  check_comm_call(call, rank_, world_.size(),
                  [&](const Tensor& t, const char* arg) { require(t, comm_op_name(call.op), arg); });
  if (call.input.defined() && call.output.defined() && call.input.dtype() != call.output.dtype()) {
    throw UsageError(fmt::format("{}: 'in' is {} but 'out' is {}; communication does not convert dtypes",
                                 where(comm_op_name(call.op)), call.input.str(), call.output.str()));
  }
}

namespace {
// Whether `call` only reads `t`: a send, or the input of an out-of-place collective.
bool only_reads(const CommCall& call, const Tensor& t) {
  if (call.op == CommOp::Send) return true;
  const bool out_of_place = call.op == CommOp::AllGather || call.op == CommOp::ReduceScatter ||
                            call.op == CommOp::AllToAll || call.op == CommOp::Scatter ||
                            call.op == CommOp::Gather;
  return out_of_place && call.input.defined() && t.storage() == call.input.storage() &&
         (!call.output.defined() || call.output.storage() != call.input.storage());
}
}  // namespace

// Communication on a buffer that an Async::Yes operation not yet waited on still uses runs on another
// stream on a GPU: unless both only read it, the two race.
void SimRank::check_no_race(const CommCall& call) const {
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    const SimStorage& st = *sim_storage(*t);
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      const auto& p = st.pending[i];
      if (p->member_of(rank_).waited || (st.pending_reads_only[i] && only_reads(call, *t))) continue;
      throw UsageError(fmt::format(
          "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
          "first (on a GPU the two would race on different streams)",
          where(comm_op_name(call.op)), t->str(), p->label()));
    }
  }
}

Work SimRank::communicate(const CommCall& call) {
  world_.check_thread(rank_, comm_op_name(call.op));
  world_.check_aborted();
  validate(call);
  check_no_race(call);
  if (call.op == CommOp::Barrier) {
    world_.barrier(rank_, call.group);
    return Work();
  }
  s_.host_us += world_.compute().launch_us();
  world_.before_issue(rank_, call);
  std::shared_ptr<CommOpState> op = world_.post(rank_, call);
  if (call.async == Async::No) {
    compute_stream_waits_for(s_, op);  // the compute stream waits for it; the host goes on
    return Work(std::make_shared<SimDoneWork>(world_, rank_, op));
  }
  world_.note_async_posted(rank_, op);
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    sim_storage(*t)->pending.push_back(op);
    sim_storage(*t)->pending_reads_only.push_back(only_reads(call, *t));
  }
  return Work(std::make_shared<SimWork>(world_, rank_, op));
}

std::vector<Work> SimRank::batch_isend_irecv(const std::vector<P2POp>& ops) {
  world_.check_aborted();
  // Every operation is checked before any is posted, so a bad one leaves nothing half issued.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].op != CommOp::Send && ops[i].op != CommOp::Recv) {
      throw UsageError(fmt::format("{}: ops[{}] is {}; only send and recv can be batched",
                                   where("batch_isend_irecv"), i, comm_op_name(ops[i].op)));
    }
  }
  // Each is posted asynchronously, in order, as one group: none waits for another on its stream, so two
  // ranks that both send first and then receive cannot deadlock (NCCL's ncclGroupStart/End).
  std::vector<Work> works;
  works.reserve(ops.size());
  struct GroupScope {
    RankState& s;
    ~GroupScope() { s.p2p_group = 0; }
  } scope{s_};
  s_.p2p_group = ++s_.p2p_groups_posted;
  for (const P2POp& p : ops) {
    works.push_back(p.op == CommOp::Send ? send(p.tensor, p.peer, Async::Yes)
                                         : recv(p.tensor, p.peer, Async::Yes));
  }
  return works;
}

// ---- time, regions, output -------------------------------------------------------------------------

void SimRank::synchronize() {
  world_.check_thread(rank_, "synchronize()");
  world_.check_aborted();
  fold_waits("synchronize()");
  world_.settle_compute(rank_);  // while the operations its kernels overlap are still listed
  for (const auto& op : s_.outstanding) {
    world_.wait_finished(rank_, op, "synchronize()");
    op->member_of(rank_).waited = true;  // the device is idle: nothing is in flight any more
  }
  s_.outstanding.clear();
  double t = std::max(s_.host_us, s_.compute_us);
  for (const auto& [key, stream] : s_.streams) t = std::max(t, stream.end_us);
  s_.host_us = t;
}

double SimRank::now() {
  world_.check_thread(rank_, "now()");
  world_.check_aborted();
  // The host clock moves only with the rank's own calls, so a loop waiting on now() would never end.
  constexpr std::int64_t kSpinLimit = 10'000'000;
  if (s_.host_us != last_now_us_) {
    last_now_us_ = s_.host_us;
    same_now_calls_ = 0;
  } else if (++same_now_calls_ >= kSpinLimit) {
    throw UsageError(fmt::format(
        "{}: returned the same time ({} us) {} times in a row; the simulated host clock moves only with "
        "the rank's own calls (kernels, communication, synchronize()), so a loop that waits for time to "
        "pass never ends",
        where("now()"), s_.host_us, kSpinLimit));
  }
  return s_.host_us;
}

Event SimRank::record_event() {
  world_.check_aborted();
  // The stream reaches the marker when its earlier kernels (and any synchronous collective it waits
  // for) are done, and not before the host enqueues it.
  fold_waits("record_event");
  world_.settle_compute(rank_);
  return Event(std::make_shared<SimEvent>(rank_, std::max(s_.host_us, s_.compute_us)));
}

double SimRank::elapsed_us(const Event& start, const Event& end) {
  world_.check_aborted();
  const SimEvent* e[2] = {nullptr, nullptr};
  const Event* ev[2] = {&start, &end};
  const char* names[2] = {"start", "end"};
  for (int i = 0; i < 2; ++i) {
    if (!ev[i]->defined()) {
      throw UsageError(fmt::format("{}: '{}' is an undefined event; make it with record_event()",
                                   where("elapsed_us"), names[i]));
    }
    e[i] = dynamic_cast<const SimEvent*>(ev[i]->state());
    if (e[i] == nullptr || e[i]->rank != rank_) {
      throw UsageError(
          fmt::format("{}: '{}' was recorded by {}; a rank can only time its own events", where("elapsed_us"),
                      names[i], e[i] ? fmt::format("rank {}", e[i]->rank) : std::string("another backend")));
    }
  }
  s_.host_us = std::max(s_.host_us, e[1]->time_us);  // cudaEventSynchronize on `end`
  return e[1]->time_us - e[0]->time_us;
}

void SimRank::region_begin(const std::string& name) {
  regions_.emplace_back(name, s_.host_us);
}

void SimRank::region_end() {
  // Regions end in destructors, also while an out-of-memory error unwinds the rank's stack.
  unpoison_dead_stack();
  if (regions_.empty()) throw UsageError(where("region_end") + ": no region is open");
  world_.add_region(rank_, regions_.back().first, regions_.back().second, s_.host_us);
  regions_.pop_back();
}

void SimRank::show(const std::string& label, const Tensor& t) {
  require(t, "show", "t");
  std::string values;
  if (t.phantom()) {
    values = fmt::format("<{}>", t.str());
  } else {
    // Out of band: wait for the numbers without moving the host clock (unlike to_host).
    before_kernel({&t}, "show");
    values = format_values(t.shape(), std::vector<float>(sim_data(t), sim_data(t) + t.numel()));
  }
  world_.show(rank_, label, values);
}

void SimRank::check(const std::string& what, bool passed, const std::string& detail) {
  world_.add_check(rank_, what, passed, detail);
  if (!passed) {
    world_.print(fmt::format("CHECK FAILED on rank {}: {} ({})", rank_, what, detail));
  } else if (rank_ == 0) {
    world_.print(fmt::format("check passed: {}{}{}", what, detail.empty() ? "" : " — ", detail));
  }
}

void SimRank::finish() {
  if (!regions_.empty()) {
    throw UsageError(fmt::format("{}: region '{}' was never closed", where("finish"), regions_.back().first));
  }
  synchronize();
}

}  // namespace ranklab::sim
