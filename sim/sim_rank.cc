#include "sim/sim_rank.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/comm_checks.h"
#include "common/errors.h"
#include "common/random.h"
#include "sim/scheduler.h"

namespace ranklab::sim {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ArrayMap = Eigen::Map<Eigen::ArrayXf>;

ArrayMap array(const Tensor& t) {
  return ArrayMap(sim_data(t), t.numel());
}

constexpr double kF = sizeof(float);  // bytes per element, for the cost model

// Splits a shape around `dim` into [outer, dim, inner] so slicing and concatenation are block copies.
void split_at(const Shape& s, int dim, std::int64_t& outer, std::int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < dim; ++i) outer *= s[i];
  for (int i = dim + 1; i < s.ndim(); ++i) inner *= s[i];
}

class SimWork : public WorkState {
 public:
  SimWork(SimWorld& world, int rank, std::shared_ptr<CommOpState> op)
      : world_(world), rank_(rank), op_(std::move(op)) {}
  void wait() override {
    CommMember& m = op_->member_of(rank_);
    if (m.waited) return;
    world_.wait_finished(rank_, op_, "wait()");
    m.waited = true;
    RankState& s = world_.state(rank_);
    s.compute_us = std::max(s.compute_us, op_->end_us);  // the compute stream waits for it
  }
  bool waited() const override { return op_->member_of(rank_).waited; }

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
  world_.check_aborted();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  if (t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
}

Tensor SimRank::allocate(const Shape& s, bool phantom, const char* op) {
  world_.check_aborted();
  MemoryAccount& m = *s_.memory;
  const std::int64_t bytes = s.numel() * dtype_bytes(DType::Float32);
  if (m.allocated + bytes > m.capacity) {
    throw OutOfMemoryError(fmt::format(
        "{}: out of memory allocating float32{} ({}): {} already in use of the {} of a {} ({})", where(op),
        s.str(), format_bytes(static_cast<double>(bytes)), format_bytes(static_cast<double>(m.allocated)),
        format_bytes(static_cast<double>(m.capacity)), world_.profile().gpu.name, world_.profile().name));
  }
  return Tensor(s, DType::Float32, std::make_shared<SimStorage>(s_.memory, s.numel(), phantom));
}

void SimRank::fold_sync_ops(const char* by) {
  for (const auto& op : s_.unfolded_sync) {
    world_.wait_finished(rank_, op, fmt::format("{} (after a synchronous {})", by, comm_op_name(op->op)));
    s_.compute_us = std::max(s_.compute_us, op->end_us);
  }
  s_.unfolded_sync.clear();
}

void SimRank::before_kernel(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    auto& pending = sim_storage(*t)->pending;
    for (const auto& p : pending) {
      if (!p->member_of(rank_).waited) {
        throw UsageError(fmt::format(
            "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
            "before touching the tensor (on a GPU this would be a silent race)",
            where(op), t->str(), p->label));
      }
    }
    pending.clear();
  }
  fold_sync_ops(op);
}

void SimRank::launch_kernel(const char* name, double flops, double bytes) {
  s_.host_us += world_.compute().launch_us();
  const double start = std::max(s_.host_us, s_.compute_us);
  s_.compute_us = start + world_.compute().kernel_us(flops, bytes, DType::Float32);
  world_.add_span(rank_, SpanKind::Compute, name, start, s_.compute_us);
}

// ---- tensors ---------------------------------------------------------------------------------------

Tensor SimRank::empty(const Shape& s) {
  Tensor t = allocate(s, false, "empty");
  // NaN makes a read of never-written memory visible in every result it touches.
  array(t).setConstant(std::numeric_limits<float>::quiet_NaN());
  return t;
}

Tensor SimRank::zeros(const Shape& s) {
  return full(s, 0.0f);
}

Tensor SimRank::full(const Shape& s, float value) {
  Tensor t = allocate(s, false, "full");
  array(t).setConstant(value);
  launch_kernel("fill", 0, kF * s.numel());
  return t;
}

Tensor SimRank::arange(const Shape& s, float start) {
  Tensor t = allocate(s, false, "arange");
  float* d = sim_data(t);
  for (std::int64_t i = 0; i < s.numel(); ++i) d[i] = start + static_cast<float>(i);
  launch_kernel("arange", 0, kF * s.numel());
  return t;
}

Tensor SimRank::randn(const Shape& s, std::uint64_t seed, float std) {
  Tensor t = allocate(s, false, "randn");
  float* d = sim_data(t);
  for (std::int64_t i = 0; i < s.numel(); ++i) d[i] = std * normal_at(seed, static_cast<std::uint64_t>(i));
  launch_kernel("randn", 0, kF * s.numel());
  return t;
}

Tensor SimRank::from_host(const Shape& s, const std::vector<float>& values) {
  if (static_cast<std::int64_t>(values.size()) != s.numel()) {
    throw UsageError(fmt::format("{}: {} values do not fill shape {} ({} elements)", where("from_host"),
                                 values.size(), s.str(), s.numel()));
  }
  Tensor t = allocate(s, false, "from_host");
  std::copy(values.begin(), values.end(), sim_data(t));
  launch_kernel("copy_h2d", 0, kF * s.numel());
  return t;
}

Tensor SimRank::phantom(const Shape& s) {
  return allocate(s, true, "phantom");
}

std::vector<float> SimRank::to_host(const Tensor& t) {
  require(t, "to_host", "t");
  if (t.phantom()) {
    throw UsageError(fmt::format("{}: {} has a shape but no values (phantom tensors only advance time)",
                                 where("to_host"), t.str()));
  }
  before_kernel({&t}, "to_host");
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
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = at ? a.size(1) : a.size(0), k = at ? a.size(0) : a.size(1);
  const std::int64_t kb = bt ? b.size(1) : b.size(0), n = bt ? b.size(0) : b.size(1);
  if (k != kb) {
    throw UsageError(fmt::format("{}: inner dimensions differ: {}{} @ {}{} ({} vs {})", where("matmul"),
                                 a.str(), at ? ".T" : "", b.str(), bt ? ".T" : "", k, kb));
  }
  Tensor c = allocate({m, n}, a.phantom() || b.phantom(), "matmul");
  before_kernel({&a, &b}, "matmul");
  if (!c.phantom()) {
    MatrixMap A(sim_data(a), a.size(0), a.size(1)), B(sim_data(b), b.size(0), b.size(1)),
        C(sim_data(c), m, n);
    if (!at && !bt) C.noalias() = A * B;
    if (at && !bt) C.noalias() = A.transpose() * B;
    if (!at && bt) C.noalias() = A * B.transpose();
    if (at && bt) C.noalias() = A.transpose() * B.transpose();
  }
  launch_kernel("matmul", 2.0 * m * n * k, kF * (m * k + k * n + m * n));
  return c;
}

namespace {
void require_same_shape(const std::string& where, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape())
    throw UsageError(fmt::format("{}: shapes differ: {} and {}", where, a.str(), b.str()));
}
}  // namespace

Tensor SimRank::relu(const Tensor& x) {
  require(x, "relu", "x");
  Tensor y = allocate(x.shape(), x.phantom(), "relu");
  before_kernel({&x}, "relu");
  if (!y.phantom()) array(y) = array(x).max(0.0f);
  launch_kernel("relu", x.numel(), 2 * kF * x.numel());
  return y;
}

Tensor SimRank::relu_backward(const Tensor& grad_out, const Tensor& x) {
  require(grad_out, "relu_backward", "grad_out");
  require(x, "relu_backward", "x");
  require_same_shape(where("relu_backward"), grad_out, x);
  Tensor g = allocate(x.shape(), x.phantom() || grad_out.phantom(), "relu_backward");
  before_kernel({&grad_out, &x}, "relu_backward");
  if (!g.phantom()) array(g) = (array(x) > 0.0f).select(array(grad_out), 0.0f);
  launch_kernel("relu_backward", x.numel(), 3 * kF * x.numel());
  return g;
}

Tensor SimRank::add(const Tensor& a, const Tensor& b) {
  require(a, "add", "a");
  require(b, "add", "b");
  require_same_shape(where("add"), a, b);
  Tensor c = allocate(a.shape(), a.phantom() || b.phantom(), "add");
  before_kernel({&a, &b}, "add");
  if (!c.phantom()) array(c) = array(a) + array(b);
  launch_kernel("add", a.numel(), 3 * kF * a.numel());
  return c;
}

namespace {
// An in-place op on a real tensor cannot take its values from a phantom.
void require_same_kind(const std::string& where, const Tensor& dst, const Tensor& src) {
  if (!dst.phantom() && src.phantom()) {
    throw UsageError(fmt::format("{}: writes phantom {} into real {}; make both phantom or both real", where,
                                 src.str(), dst.str()));
  }
}
}  // namespace

void SimRank::add_(const Tensor& dst, const Tensor& src, float alpha) {
  require(dst, "add_", "dst");
  require(src, "add_", "src");
  require_same_shape(where("add_"), dst, src);
  require_same_kind(where("add_"), dst, src);
  before_kernel({&dst, &src}, "add_");
  if (!dst.phantom()) array(dst) += alpha * array(src);
  launch_kernel("add_", 2.0 * dst.numel(), 3 * kF * dst.numel());
}

void SimRank::scale_(const Tensor& t, float factor) {
  require(t, "scale_", "t");
  before_kernel({&t}, "scale_");
  if (!t.phantom()) array(t) *= factor;
  launch_kernel("scale_", t.numel(), 2 * kF * t.numel());
}

void SimRank::copy_(const Tensor& dst, const Tensor& src) {
  require(dst, "copy_", "dst");
  require(src, "copy_", "src");
  if (dst.numel() != src.numel()) {
    throw UsageError(fmt::format("{}: {} and {} differ in size", where("copy_"), dst.str(), src.str()));
  }
  require_same_kind(where("copy_"), dst, src);
  before_kernel({&dst, &src}, "copy_");
  if (!dst.phantom()) array(dst) = array(src);
  launch_kernel("copy", 0, 2 * kF * dst.numel());
}

Tensor SimRank::sum(const Tensor& t) {
  require(t, "sum", "t");
  Tensor out = allocate(Shape{}, t.phantom(), "sum");
  before_kernel({&t}, "sum");
  if (!out.phantom()) {
    // Accumulate in double so the result does not depend on how the sum is split across kernels.
    double acc = 0;
    const float* d = sim_data(t);
    for (std::int64_t i = 0; i < t.numel(); ++i) acc += d[i];
    sim_data(out)[0] = static_cast<float>(acc);
  }
  launch_kernel("sum", t.numel(), kF * t.numel());
  return out;
}

Tensor SimRank::slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) {
  require(t, "slice", "t");
  if (dim < 0 || dim >= t.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("slice"), dim, t.str()));
  }
  if (start < 0 || length < 0 || start + length > t.size(dim)) {
    throw UsageError(fmt::format("{}: [{}, {}) is outside dimension {} of {} (size {})", where("slice"),
                                 start, start + length, dim, t.str(), t.size(dim)));
  }
  Tensor out = allocate(t.shape().with_dim(dim, length), t.phantom(), "slice");
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
  launch_kernel("slice", 0, 2 * kF * out.numel());
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
    total += parts[i].size(dim);
    phantom = phantom || parts[i].phantom();
  }
  Tensor out = allocate(first.shape().with_dim(dim, total), phantom, "cat");
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
  launch_kernel("cat", 0, 2 * kF * out.numel());
  return out;
}

void SimRank::sgd_step(const Tensor& param, const Tensor& grad, float lr) {
  require(param, "sgd_step", "param");
  require(grad, "sgd_step", "grad");
  require_same_shape(where("sgd_step"), param, grad);
  require_same_kind(where("sgd_step"), param, grad);
  before_kernel({&param, &grad}, "sgd_step");
  if (!param.phantom()) array(param) -= lr * array(grad);
  launch_kernel("sgd_step", 2.0 * param.numel(), 3 * kF * param.numel());
}

void SimRank::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         const AdamW& h, int step) {
  require(param, "adamw_step", "param");
  require(grad, "adamw_step", "grad");
  require(m, "adamw_step", "m");
  require(v, "adamw_step", "v");
  require_same_shape(where("adamw_step"), param, grad);
  require_same_shape(where("adamw_step"), param, m);
  require_same_shape(where("adamw_step"), param, v);
  require_same_kind(where("adamw_step"), param, grad);
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
  launch_kernel("adamw_step", 12.0 * param.numel(), 7 * kF * param.numel());
}

// ---- communication ---------------------------------------------------------------------------------

void SimRank::validate(const CommCall& call) const {
  world_.members(call.group);  // a group this run never made is an error of its own
  check_comm_call(call, rank_, world_.size(),
                  [&](const Tensor& t, const char* arg) { require(t, comm_op_name(call.op), arg); });
}

Work SimRank::communicate(const CommCall& call) {
  world_.check_aborted();
  validate(call);
  if (call.op == CommOp::Barrier) {
    world_.barrier(rank_, call.group);
    return Work();
  }
  s_.host_us += world_.compute().launch_us();
  world_.before_issue(rank_);
  std::shared_ptr<CommOpState> op = world_.post(rank_, call);
  if (call.async == Async::No) {
    s_.unfolded_sync.push_back(op);
    return Work();
  }
  for (const Tensor* t : {&call.input, &call.output}) {
    if (t->defined()) sim_storage(*t)->pending.push_back(op);
  }
  return Work(std::make_shared<SimWork>(world_, rank_, op));
}

// ---- time, regions, output -------------------------------------------------------------------------

void SimRank::synchronize() {
  world_.check_aborted();
  fold_sync_ops("synchronize()");
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
  world_.check_aborted();
  return s_.host_us;
}

void SimRank::region_begin(const std::string& name) {
  regions_.emplace_back(name, s_.host_us);
}

void SimRank::region_end() {
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
