// SimRank's transformer kernels: layernorm, GELU, dropout, attention, embedding and the sharded
// cross-entropy, each computed on the host and timed by the compute model.
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
#include "sim/sim_rank_kernels.h"

namespace ranklab::sim {

using namespace kernels;  // the helpers every kernel file shares

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

Tensor SimRank::dropout(const Tensor& x, float p, std::uint64_t seed, const DropoutRows& rows) {
  require(x, "dropout", "x");
  check_dropout(rank_, x, p, rows);
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "dropout");
  before_kernel({&x}, "dropout");
  if (!y.phantom()) {
    const float* X = cdata(x);
    float* Y = sim_data(y);
    const std::int64_t n = x.size(0), cols = x.size(1);
    const float scale = 1.0f / (1.0f - p);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t row = rows.row(i);
      for (std::int64_t j = 0; j < cols; ++j) {
        Y[i * cols + j] = dropout_keeps(seed, row, j, p) ? X[i * cols + j] * scale : 0.0f;
      }
    }
    round_to_dtype(y);
  }
  launch_kernel_cost(kDropout, world_.compute().memory_cost(bytes_of(x) + bytes_of(y)));
  return y;
}

namespace {
// The shape of an attention call, from qkv [seq * batch, (heads + 2 kv_heads) * head_dim].
struct AttnDims {
  AttnDims(const Tensor& qkv, const AttentionSpec& spec)
      : seq(qkv.size(0) / spec.batch),
        batch(spec.batch),
        heads(spec.heads),
        per_group(spec.heads / spec.groups()),
        head_dim(qkv.size(1) / (spec.heads + 2 * spec.groups())),
        width(qkv.size(1)) {}
  std::int64_t seq, batch, heads, per_group, head_dim, width;
  // Column of element d of head h's q (part 0), or of the k (1) or v (2) its group shares.
  std::int64_t col(std::int64_t h, int part, std::int64_t d) const {
    const std::int64_t group = h / per_group, first = group * (per_group + 2);
    return (part == 0 ? first + h % per_group : first + per_group + part - 1) * head_dim + d;
  }
  std::int64_t row(std::int64_t pos, std::int64_t b) const { return pos * batch + b; }
  // The compute model's shape of the call.
  AttentionShape shape(const AttentionSpec& spec) const {
    AttentionShape s{batch, seq, heads, head_dim, spec.causal, 0.0f, spec.groups()};
    s.window = spec.window;
    return s;
  }
};
}  // namespace

Rank::AttentionOut SimRank::attention(const Tensor& qkv, const AttentionSpec& spec) {
  const char* op = "attention";
  require(qkv, op, "qkv");
  check_attention(rank_, op, qkv, spec);
  const std::int64_t batch = spec.batch, heads = spec.heads;
  const bool causal = spec.causal;
  const AttentionKernel kernel = spec.kernel;
  const AttnDims a(qkv, spec);
  AttentionOut o;
  o.out = allocate(Shape{qkv.size(0), a.heads * a.head_dim}, qkv.dtype(), qkv.phantom(), op);
  o.lse = allocate(Shape{batch, heads, a.seq}, DType::Float32, qkv.phantom(), op);
  const bool sinks = spec.sinks.defined();
  if (sinks) require_same_kind(op, qkv, spec.sinks);
  before_kernel({&qkv}, op);
  if (sinks) before_reading({&spec.sinks}, op);
  if (!qkv.phantom()) {
    const float* QKV = cdata(qkv);
    float *OUT = sim_data(o.out), *LSE = sim_data(o.lse);
    const std::int64_t out_w = a.heads * a.head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
    std::vector<float> s(static_cast<size_t>(a.seq));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const float sink = sinks ? cdata(spec.sinks)[h] : -std::numeric_limits<float>::infinity();
        for (std::int64_t i = 0; i < a.seq; ++i) {
          // The keys from the window's start (position 0 without one): that row is where they start.
          const std::int64_t lo = spec.first_key(i), end = causal ? i + 1 : a.seq;
          const float* first = QKV + a.row(lo, b) * a.width;
          LSE[(b * heads + h) * a.seq + i] =
              attend_query(QKV + a.row(i, b) * a.width + a.col(h, 0, 0), first + a.col(h, 1, 0),
                           first + a.col(h, 2, 0), batch * a.width, end - lo, a.head_dim, scale, s.data(),
                           OUT + a.row(i, b) * out_w + h * a.head_dim, sink);
        }
      }
    }
    round_to_dtype(o.out);
  }
  const AttentionShape shape = a.shape(spec);
  if (kernel == AttentionKernel::Unfused) {
    o.probs = allocate(Shape{batch * heads, a.seq, a.seq}, qkv.dtype(), /*phantom=*/true, op);
  }
  launch_attention(kAttention, shape, kernel, false, qkv.dtype());
  return o;
}

void SimRank::launch_attention(const std::string& name, const AttentionShape& shape, AttentionKernel kernel,
                               bool backward, DType dtype) {
  // The unfused path is several kernels, timed as one sequence; the host launches each.
  world_.advance_host(rank_, (ComputeModel::attention_kernel_count(shape, kernel, backward) - 1) *
                                 world_.compute().launch_us());
  launch_kernel_cost(name, world_.compute().attention_cost(shape, kernel, backward, dtype));
}

Tensor SimRank::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                   const Tensor& lse, const AttentionSpec& spec) {
  const char* op = "attention_backward";
  require(dout, op, "dout");
  require(qkv, op, "qkv");
  require(out, op, "out");
  require(lse, op, "lse");
  check_attention_backward(rank_, dout, qkv, out, lse, spec);
  const std::int64_t batch = spec.batch, heads = spec.heads;
  const bool causal = spec.causal;
  const AttnDims a(qkv, spec);
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
          const std::int64_t lo = spec.first_key(i), end = causal ? i + 1 : a.seq;
          const float* first = QKV + a.row(lo, b) * a.width;  // the first key's row
          float* dfirst = DQKV + a.row(lo, b) * a.width;
          attend_query_backward(q, first + a.col(h, 1, 0), first + a.col(h, 2, 0), dfirst + a.col(h, 1, 0),
                                dfirst + a.col(h, 2, 0), batch * a.width, end - lo, a.head_dim, scale, do_i,
                                lse_i, delta, dq);
        }
      }
    }
    round_to_dtype(dqkv);
  }
  launch_attention(kAttentionBackward, a.shape(spec), spec.kernel, true, qkv.dtype());
  return dqkv;
}

void SimRank::rope_(const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position, double base,
                    bool inverse) {
  const char* op = "rope_";
  require(qkv, op, "qkv");
  check_rope(rank_, qkv, spec, first_position, base);
  before_kernel({&qkv}, op);
  const AttnDims a(qkv, spec);
  if (!qkv.phantom()) {
    float* QKV = sim_data(qkv);
    const std::int64_t half = a.head_dim / 2, groups = spec.groups();
    // Each q head and each group's k, in every row.
    std::vector<std::int64_t> starts;
    for (std::int64_t h = 0; h < a.heads; ++h) starts.push_back(a.col(h, 0, 0));
    for (std::int64_t g = 0; g < groups; ++g) starts.push_back(a.col(g * a.per_group, 1, 0));
    std::vector<double> frequency(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i)
      frequency[i] = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(a.head_dim));
    for (std::int64_t r = 0; r < qkv.size(0); ++r) {
      const double pos = static_cast<double>(first_position + r / a.batch);
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = pos * frequency[i];
        const float c = static_cast<float>(std::cos(angle));
        const float sn = static_cast<float>(inverse ? -std::sin(angle) : std::sin(angle));
        for (std::int64_t start : starts) {
          float* x = QKV + r * a.width + start;
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c - x2 * sn;
          x[i + half] = x2 * c + x1 * sn;
        }
      }
    }
    round_to_dtype(qkv);
  }
  // Reads and writes the q and k columns.
  const double rotated = static_cast<double>(qkv.size(0)) * (spec.heads + spec.groups()) * a.head_dim;
  launch_kernel_cost(kRope, world_.compute().memory_cost(2 * rotated * dtype_bytes(qkv.dtype())));
}

Rank::RmsNormOut SimRank::rmsnorm(const Tensor& x, const Tensor& gamma, float eps) {
  const char* op = "rmsnorm";
  require(x, op, "x");
  require(gamma, op, "gamma");
  check_rmsnorm(rank_, x, gamma, eps);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = x.phantom() || gamma.phantom();
  RmsNormOut o;
  o.y = allocate(x.shape(), x.dtype(), ph, op);
  o.rstd = allocate(Shape{rows}, DType::Float32, ph, op);
  before_kernel({&x, &gamma}, op);
  if (!ph) {
    const float *X = cdata(x), *G = cdata(gamma);
    float *Y = sim_data(o.y), *R = sim_data(o.rstd);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = X + r * cols;
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
      const float rstd = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(cols) + eps));
      R[r] = rstd;
      for (std::int64_t c = 0; c < cols; ++c) Y[r * cols + c] = xr[c] * rstd * G[c];
    }
    round_to_dtype(o.y);
  }
  launch_kernel_cost(kRmsnorm, world_.compute().memory_cost(bytes_of(x) + bytes_of(gamma) + bytes_of(o.y) +
                                                            bytes_of(o.rstd)));
  return o;
}

Rank::RmsNormGrads SimRank::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  require(dy, op, "dy");
  require(x, op, "x");
  require(gamma, op, "gamma");
  require(rstd, op, "rstd");
  check_rmsnorm_backward(rank_, dy, x, gamma, rstd);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = dy.phantom() || x.phantom() || gamma.phantom() || rstd.phantom();
  RmsNormGrads g;
  g.dx = allocate(x.shape(), x.dtype(), ph, op);
  g.dgamma = allocate(Shape{cols}, DType::Float32, ph, op);
  before_kernel({&dy, &x, &gamma, &rstd}, op);
  if (!ph) {
    const float *DY = cdata(dy), *X = cdata(x), *G = cdata(gamma), *R = cdata(rstd);
    float* DX = sim_data(g.dx);
    std::vector<double> dgamma(static_cast<size_t>(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      // y = xhat gamma with xhat = x rstd: dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy gamma.
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = r * cols + c;
        const double xhat = static_cast<double>(X[i]) * R[r];
        dot += static_cast<double>(DY[i]) * G[c] * xhat;
        dgamma[c] += static_cast<double>(DY[i]) * xhat;
      }
      const double mean = dot / static_cast<double>(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = r * cols + c;
        const double xhat = static_cast<double>(X[i]) * R[r];
        DX[i] = static_cast<float>(R[r] * (static_cast<double>(DY[i]) * G[c] - xhat * mean));
      }
    }
    for (std::int64_t c = 0; c < cols; ++c) sim_data(g.dgamma)[c] = static_cast<float>(dgamma[c]);
    round_to_dtype(g.dx);
  }
  launch_kernel_cost(kRmsnormBackward,
                     world_.compute().memory_cost(bytes_of(dy) + bytes_of(x) + bytes_of(gamma) +
                                                  bytes_of(rstd) + bytes_of(g.dx) + bytes_of(g.dgamma)));
  return g;
}

Tensor SimRank::swiglu(const Tensor& x, const GluSpec& glu) {
  const char* op = "swiglu";
  require(x, op, "x");
  check_swiglu(rank_, x);
  const std::int64_t rows = x.size(0), f = x.size(1) / 2;
  Tensor y = allocate(Shape{rows, f}, x.dtype(), x.phantom(), op);
  before_kernel({&x}, op);
  if (!y.phantom()) {
    const float* X = cdata(x);
    float* Y = sim_data(y);
    for (std::int64_t i = 0; i < rows * f; ++i) Y[i] = glu::forward(X[2 * i], X[2 * i + 1], glu);
    round_to_dtype(y);
  }
  launch_kernel_cost(kSwiglu, world_.compute().memory_cost(bytes_of(x) + bytes_of(y)));
  return y;
}

Tensor SimRank::swiglu_backward(const Tensor& dy, const Tensor& x, const GluSpec& glu) {
  const char* op = "swiglu_backward";
  require(dy, op, "dy");
  require(x, op, "x");
  check_swiglu_backward(rank_, dy, x);
  Tensor dx = allocate(x.shape(), x.dtype(), x.phantom() || dy.phantom(), op);
  before_kernel({&dy, &x}, op);
  if (!dx.phantom()) {
    const float *X = cdata(x), *DY = cdata(dy);
    float* DX = sim_data(dx);
    for (std::int64_t i = 0; i < dy.numel(); ++i)
      glu::backward(X[2 * i], X[2 * i + 1], DY[i], glu, &DX[2 * i], &DX[2 * i + 1]);
    round_to_dtype(dx);
  }
  launch_kernel_cost(kSwigluBackward,
                     world_.compute().memory_cost(bytes_of(dy) + bytes_of(x) + bytes_of(dx)));
  return dx;
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

}  // namespace ranklab::sim
