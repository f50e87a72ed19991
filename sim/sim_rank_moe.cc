// SimRank's kernels of mixture-of-experts token permutation (Rank::gather_rows, scatter_add_rows, row_dots):
// Megatron-Core's and TransformerEngine's moe_permute and moe_unpermute, computed in float32 on the host
// and timed by the compute model as memory-bound kernels of the bytes they read and write.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/compute_checks.h"
#include "sim/sim_rank.h"
#include "sim/sim_rank_kernels.h"

namespace ranklab::sim {

using namespace kernels;

namespace {
const float* cdata(const Tensor& t) {
  return sim_data(t);
}

// The bytes of the routes a kernel reads: the index and, when given, the weights.
double route_bytes(const Tensor& index, const Tensor& weights) {
  return bytes_of(index) + (weights.defined() ? bytes_of(weights) : 0.0);
}
}  // namespace

Tensor SimRank::gather_rows(const Tensor& x, const Tensor& index, const Tensor& weights) {
  const char* op = "gather_rows";
  require(x, op, "x");
  require(index, op, "index");
  if (weights.defined()) require(weights, op, "weights");
  check_gather_rows(rank_, x, index, weights);
  const std::int64_t n = index.size(0), cols = x.size(1);
  const bool ph = x.phantom() || index.phantom() || (weights.defined() && weights.phantom());
  Tensor out = allocate(Shape{n, cols}, x.dtype(), ph, op);
  if (weights.defined()) {
    before_reading({&x, &index, &weights}, op);
  } else {
    before_reading({&x, &index}, op);
  }
  if (!ph) {
    const std::vector<std::int64_t> rows =
        check_route_rows(rank_, op, cdata(index), n, x.size(0), "the rows of x");
    const float *X = cdata(x), *W = weights.defined() ? cdata(weights) : nullptr;
    float* O = sim_data(out);
    for (std::int64_t i = 0; i < n; ++i) {
      const float* xr = X + rows[static_cast<std::size_t>(i)] * cols;
      float* o = O + i * cols;
      if (W != nullptr) {
        for (std::int64_t c = 0; c < cols; ++c) o[c] = xr[c] * W[i];
      } else {
        for (std::int64_t c = 0; c < cols; ++c) o[c] = xr[c];
      }
    }
    round_to_dtype(out);
  }
  // Reads the routes and one row of x a route, writes the output.
  launch_kernel_cost(kGatherRows,
                     world_.compute().memory_cost(route_bytes(index, weights) + 2 * bytes_of(out)));
  return out;
}

Tensor SimRank::scatter_add_rows(const Tensor& src, const Tensor& index, const Tensor& weights,
                                 std::int64_t rows) {
  const char* op = "scatter_add_rows";
  require(src, op, "src");
  require(index, op, "index");
  if (weights.defined()) require(weights, op, "weights");
  check_scatter_add_rows(rank_, src, index, weights, rows);
  const std::int64_t n = index.size(0), cols = src.size(1);
  const bool ph = src.phantom() || index.phantom() || (weights.defined() && weights.phantom());
  Tensor out = allocate(Shape{rows, cols}, src.dtype(), ph, op);
  if (weights.defined()) {
    before_reading({&src, &index, &weights}, op);
  } else {
    before_reading({&src, &index}, op);
  }
  if (!ph) {
    const std::vector<std::int64_t> targets =
        check_route_rows(rank_, op, cdata(index), n, rows, "the rows of the output");
    const float *S = cdata(src), *W = weights.defined() ? cdata(weights) : nullptr;
    float* O = sim_data(out);
    std::fill(O, O + out.numel(), 0.0f);
    // In the order of the routes, in float32: the CUDA kernel adds each output row's routes in that order.
    for (std::int64_t i = 0; i < n; ++i) {
      const float* s = S + i * cols;
      float* o = O + targets[static_cast<std::size_t>(i)] * cols;
      if (W != nullptr) {
        for (std::int64_t c = 0; c < cols; ++c) o[c] += s[c] * W[i];
      } else {
        for (std::int64_t c = 0; c < cols; ++c) o[c] += s[c];
      }
    }
    round_to_dtype(out);
  }
  // Reads the routes and src, writes every output row.
  launch_kernel_cost(kScatterAddRows, world_.compute().memory_cost(route_bytes(index, weights) +
                                                                   bytes_of(src) + bytes_of(out)));
  return out;
}

Tensor SimRank::row_dots(const Tensor& a, const Tensor& b) {
  const char* op = "row_dots";
  require(a, op, "a");
  require(b, op, "b");
  check_row_dots(rank_, a, b);
  const std::int64_t n = a.size(0), cols = a.size(1);
  const bool ph = a.phantom() || b.phantom();
  Tensor out = allocate(Shape{n}, DType::Float32, ph, op);
  before_reading({&a, &b}, op);
  if (!ph) {
    const float *A = cdata(a), *B = cdata(b);
    float* O = sim_data(out);
    for (std::int64_t i = 0; i < n; ++i) {
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c) dot += static_cast<double>(A[i * cols + c]) * B[i * cols + c];
      O[i] = static_cast<float>(dot);
    }
  }
  launch_kernel_cost(kRowDots, world_.compute().memory_cost(bytes_of(a) + bytes_of(b) + bytes_of(out)));
  return out;
}

}  // namespace ranklab::sim
