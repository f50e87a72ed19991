// SimRank's tensors and kernels: real numerics on the host (Eigen, GEMM through OpenBLAS), each kernel
// timed by the compute model and launched on the rank's compute stream (SimRank::launch_kernel_cost).
#include "sim/sim_rank_kernels.h"

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
#include "sim/sim_rank.h"

namespace ranklab::sim {

using namespace kernels;  // the helpers every kernel file shares

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
  world_.scheduler().check_aborted();
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

Tensor SimRank::view(const Tensor& base, std::int64_t offset, const Shape& shape) {
  require(base, "view", "base");
  check_view(rank_, base, offset, shape);
  return Tensor(shape, base.dtype(), std::make_shared<SimStorage>(base, offset, shape.numel()));
}

// ---- compute ---------------------------------------------------------------------------------------

void SimRank::gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb, bool accumulate) {
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = c.size(0), n = c.size(1), k = at ? a.size(0) : a.size(1);
  before_reading({&a, &b}, "matmul");
  if (!c.phantom()) {
    // 16-bit inputs are already rounded; the float32 product (and sum) stands for the tensor cores' float32
    // accumulation, and the output is rounded once.
    MatrixMap A(sim_data(a), a.size(0), a.size(1)), B(sim_data(b), b.size(0), b.size(1)),
        C(sim_data(c), m, n);
    auto store = [&](const auto& product) {
      if (accumulate) {
        C.noalias() += product;
      } else {
        C.noalias() = product;
      }
    };
    if (!at && !bt) store(A * B);
    if (at && !bt) store(A.transpose() * B);
    if (!at && bt) store(A * B.transpose());
    if (at && bt) store(A.transpose() * B.transpose());
    round_to_dtype(c);
  }
  const ComputeModel& model = world_.compute();
  launch_kernel_cost(accumulate ? kMatmulAdd : kMatmul,
                     accumulate ? model.gemm_accumulate_cost(m, n, k, a.dtype(), c.dtype())
                                : model.gemm_cost(m, n, k, a.dtype()));
}

Tensor SimRank::matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
  require(a, "matmul", "a");
  require(b, "matmul", "b");
  const Shape s = check_matmul(rank_, "matmul", a, b, ta, tb);
  Tensor c = allocate(s, gemm_output(a.dtype()), a.phantom() || b.phantom(), "matmul");
  gemm(c, a, b, ta, tb);
  return c;
}

void SimRank::matmul_into(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                          bool accumulate) {
  const char* op = accumulate ? "matmul_add_" : "matmul_";
  require(a, op, "a");
  require(b, op, "b");
  require(out, op, "out");
  check_matmul_out(rank_, out, a, b, ta, tb, accumulate);
  before_kernel({&out}, op);
  gemm(out, a, b, ta, tb, accumulate);
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
  if (is_float8(dst.dtype()) && src.dtype() != dst.dtype()) {
    throw UsageError(fmt::format("{}: copies {} into {}: quantize scales a tensor into FP8", where("copy_"),
                                 src.str(), dst.str()));
  }
  before_kernel({&dst, &src}, "copy_");
  if (!dst.phantom()) {
    array(dst) = array(src);
    round_to_dtype(dst);
  }
  launch_kernel(kCopy, 0, bytes_of(dst) + bytes_of(src), dst.dtype());
}

Tensor SimRank::cast(const Tensor& t, DType dtype) {
  require(t, "cast", "t");
  if (is_float8(dtype)) {
    throw UsageError(fmt::format("{}: cast makes no {} tensor: quantize scales a tensor into FP8",
                                 where("cast"), dtype_name(dtype)));
  }
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

Tensor SimRank::squared_norm(const std::vector<Tensor>& ts) {
  bool phantom = false;
  double bytes = 0;
  std::int64_t n = 0;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    require(ts[i], "squared_norm", "ts[i]");
    phantom = phantom || ts[i].phantom();
    bytes += bytes_of(ts[i]);
    n += ts[i].numel();
  }
  Tensor out = allocate(Shape{}, DType::Float32, phantom, "squared_norm");
  for (const Tensor& t : ts) before_reading({&t}, "squared_norm");
  if (!out.phantom()) {
    double acc = 0;
    for (const Tensor& t : ts) {
      const float* d = sim_data(t);
      for (std::int64_t i = 0; i < t.numel(); ++i) acc += static_cast<double>(d[i]) * d[i];
    }
    sim_data(out)[0] = static_cast<float>(acc);
  }
  launch_multi_tensor(kSquaredNorm, n, 2.0 * static_cast<double>(n), bytes);  // one pass over every element
  return out;
}

void SimRank::launch_multi_tensor(const std::string& name, std::int64_t elements, double flops,
                                  double bytes) {
  // apex's multi_tensor_apply launches one kernel per 320 blocks of 65,536 elements
  // (csrc/multi_tensor_apply.cuh, depth_to_max_blocks; multi_tensor_apply.py, chunk size 2048 x 32): the host
  // pays each launch, and the kernels stream the elements as one.
  constexpr std::int64_t kElementsPerLaunch = std::int64_t{320} * 65536;
  const std::int64_t launches =
      std::max<std::int64_t>(1, (elements + kElementsPerLaunch - 1) / kElementsPerLaunch);
  world_.advance_host(rank_, static_cast<double>(launches - 1) * world_.compute().launch_us());
  launch_kernel(name, flops, bytes);
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

// AdamW per element: 12 flops, and 7 float32 numbers moved (master, gradient, m and v read; master, m and v
// written).
constexpr double kAdamwFlops = 12, kAdamwBytes = 7 * kF;

void SimRank::adamw_numbers(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                            const AdamW& h, int step, const char* op) {
  require(param, op, "param");
  require(grad, op, "grad");
  require(m, op, "m");
  require(v, op, "v");
  require_same_shape(op, param, grad);
  require_same_shape(op, param, m);
  require_same_shape(op, param, v);
  require_same_kind(op, param, grad);
  require_dtype(param, DType::Float32, op, "param");
  require_dtype(grad, DType::Float32, op, "grad");
  require_dtype(m, DType::Float32, op, "m");
  require_dtype(v, DType::Float32, op, "v");
  if (step < 1) throw UsageError(fmt::format("{}: step counts from 1; got {}", where(op), step));
  before_kernel({&param, &grad, &m, &v}, op);
  if (!param.phantom()) {
    auto p = array(param), g = array(grad), mm = array(m), vv = array(v);
    mm = h.beta1 * mm + (1 - h.beta1) * g;
    vv = h.beta2 * vv + (1 - h.beta2) * g.square();
    const float c1 = 1 - std::pow(h.beta1, static_cast<float>(step));
    const float c2 = 1 - std::pow(h.beta2, static_cast<float>(step));
    p -= h.lr * ((mm / c1) / ((vv / c2).sqrt() + h.eps) + h.weight_decay * p);
  }
}

void SimRank::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         const AdamW& h, int step) {
  adamw_numbers(param, grad, m, v, h, step, "adamw_step");
  launch_kernel(kAdamw, kAdamwFlops * param.numel(), kAdamwBytes * param.numel());
}

void SimRank::fused_adamw_step(const std::vector<AdamWPart>& parts, const AdamW& h, int step) {
  std::int64_t n = 0;
  for (const AdamWPart& part : parts) {
    AdamW hp = h;
    if (!part.decay) hp.weight_decay = 0;
    adamw_numbers(part.param, part.grad, part.m, part.v, hp, step, "fused_adamw_step");
    n += part.param.numel();
  }
  if (parts.empty()) return;
  launch_multi_tensor(kFusedAdamw, n, kAdamwFlops * static_cast<double>(n),
                      kAdamwBytes * static_cast<double>(n));
}

}  // namespace ranklab::sim
