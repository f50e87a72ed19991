// The simulator's transformer kernels and mixed-precision operations against straightforward
// double-precision loops written here, each backward against central finite differences of those loops,
// and the timing of events, grouped point-to-point and phantoms.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype_round.h"
#include "common/errors.h"
#include "common/random.h"
#include "sim/compute_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;
using testing::run_collect;
using testing::run_error_message;
using Values = std::vector<float>;
using Doubles = std::vector<double>;

template <typename T>
T on_one_rank(const std::function<T(Rank&)>& fn) {
  return run_collect<T>(1, fn)[0];
}

Values random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  Values v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * normal_at(seed, i);
  return v;
}

Doubles to_doubles(const Values& v) {
  return Doubles(v.begin(), v.end());
}

// d/dx_j of sum_i w_i f(x)_i by central differences, in double.
Doubles fd_grad(const std::function<Doubles(const Doubles&)>& f, Doubles x, const Values& w) {
  const double h = 1e-6;
  Doubles g(x.size());
  for (std::size_t j = 0; j < x.size(); ++j) {
    const double keep = x[j];
    x[j] = keep + h;
    const Doubles up = f(x);
    x[j] = keep - h;
    const Doubles down = f(x);
    x[j] = keep;
    double l = 0;
    for (std::size_t i = 0; i < up.size(); ++i) l += w[i] * (up[i] - down[i]);
    g[j] = l / (2 * h);
  }
  return g;
}

void expect_near_all(const Values& got, const Doubles& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << what << " [" << i << "]";
  }
}

// ---- references ------------------------------------------------------------------------------------

Doubles layernorm_ref(const Doubles& x, const Doubles& gamma, const Doubles& beta, int rows, int cols,
                      double eps, Doubles* mean_out = nullptr, Doubles* rstd_out = nullptr) {
  Doubles y(x.size());
  for (int r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int c = 0; c < cols; ++c) mean += x[r * cols + c] / cols;
    for (int c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean) / cols;
    const double rstd = 1 / std::sqrt(var + eps);
    if (mean_out) mean_out->push_back(mean);
    if (rstd_out) rstd_out->push_back(rstd);
    for (int c = 0; c < cols; ++c) y[r * cols + c] = (x[r * cols + c] - mean) * rstd * gamma[c] + beta[c];
  }
  return y;
}

Doubles gelu_ref(const Doubles& x) {
  Doubles y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    y[i] = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
  }
  return y;
}

// Attention over qkv [seq * batch, heads * 3 * hd] in the interleaved layout; out [seq * batch, heads * hd].
Doubles attention_ref(const Doubles& qkv, int seq, int batch, int heads, int hd, bool causal,
                      Doubles* lse_out = nullptr) {
  const int width = heads * 3 * hd, out_w = heads * hd;
  Doubles out(static_cast<std::size_t>(seq * batch * out_w), 0.0);
  if (lse_out) lse_out->assign(static_cast<std::size_t>(batch * heads * seq), 0.0);
  auto at = [&](int pos, int b, int h, int part, int d) {
    return qkv[(pos * batch + b) * width + (h * 3 + part) * hd + d];
  };
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < seq; ++i) {
        const int keys = causal ? i + 1 : seq;
        Doubles s(keys);
        double mx = -1e300;
        for (int j = 0; j < keys; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += at(i, b, h, 0, d) * at(j, b, h, 1, d);
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int j = 0; j < keys; ++j) l += std::exp(s[j] - mx);
        if (lse_out) (*lse_out)[(b * heads + h) * seq + i] = mx + std::log(l);
        for (int j = 0; j < keys; ++j) {
          const double p = std::exp(s[j] - mx) / l;
          for (int d = 0; d < hd; ++d) out[(i * batch + b) * out_w + h * hd + d] += p * at(j, b, h, 2, d);
        }
      }
    }
  }
  return out;
}

// ---- matmul and mixed precision ----------------------------------------------------------------------

TEST(MixedPrecision, Bf16MatmulRoundsInputsAndOutputOnce) {
  const int m = 4, k = 8, n = 5;
  const Values av = random_values(m * k, 1), bv = random_values(k * n, 2);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor a = r.from_host({m, k}, av, DType::BFloat16), b = r.from_host({k, n}, bv, DType::BFloat16);
    Tensor c = r.matmul(a, b);
    EXPECT_EQ(c.dtype(), DType::BFloat16);
    return std::vector<Values>{r.to_host(a), r.to_host(b), r.to_host(c)};
  });
  for (int i = 0; i < m * k; ++i) EXPECT_EQ(got[0][i], round_to_bfloat16(av[i]));
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double want = 0;
      for (int p = 0; p < k; ++p) want += static_cast<double>(got[0][i * k + p]) * got[1][p * n + j];
      const float c = got[2][i * n + j];
      EXPECT_EQ(c, round_to_bfloat16(c)) << "the output holds bfloat16 values";
      // One rounding of a float32 accumulation: within half a bfloat16 step (2^-8 relative) and a hair.
      EXPECT_NEAR(c, want, std::abs(want) * (1.0 / 256) + 1e-6) << i << "," << j;
    }
  }
}

TEST(MixedPrecision, KernelsWritingBf16RoundTheirResult) {
  auto got = on_one_rank<std::vector<Values>>([](Rank& r) {
    Tensor one = r.full({1}, 1.0f, DType::BFloat16);
    Tensor tiny = r.full({1}, 1.0f / 256, DType::BFloat16);  // 2^-8, exact in bfloat16
    Tensor s = r.add(one, tiny);                             // 1 + 2^-8 is a tie: rounds to 1
    Tensor t = r.full({1}, 1.0f, DType::Float16);
    r.add_(t, r.full({1}, 3.0f / 2048, DType::Float32), 1.0f);  // 1 + 3 * 2^-11 -> 1 + 2^-9 in float16
    return std::vector<Values>{r.to_host(s), r.to_host(t)};
  });
  EXPECT_EQ(got[0][0], 1.0f);
  EXPECT_EQ(got[1][0], 1.0f + 1.0f / 512);
}

TEST(MixedPrecision, CastCopyAndAddAcrossDtypes) {
  const Values v = {1.0f + 1.0f / 256 + 1.0f / 1024, -3.14159f, 65519.0f, 70000.0f};
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor x = r.from_host({4}, v);
    Tensor b = r.cast(x, DType::BFloat16);
    Tensor h = r.cast(x, DType::Float16);
    Tensor back = r.zeros({4});
    r.copy_(back, b);  // bfloat16 into float32 is exact
    Tensor master = r.full({4}, 1.0f);
    r.add_(master, b, -1.0f);  // a bf16 gradient into a float32 master weight
    EXPECT_EQ(b.dtype(), DType::BFloat16);
    EXPECT_EQ(back.dtype(), DType::Float32);
    return std::vector<Values>{r.to_host(b), r.to_host(h), r.to_host(back), r.to_host(master)};
  });
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got[0][i], round_to_bfloat16(v[i]));
    EXPECT_EQ(got[1][i], round_to_float16(v[i]));
    EXPECT_EQ(got[2][i], got[0][i]);
    EXPECT_EQ(got[3][i], 1.0f - got[0][i]);
  }
  EXPECT_EQ(got[0][0], 1.0f + 1.0f / 128);  // above the tie: rounds up
  EXPECT_EQ(got[1][2], 65504.0f);
  EXPECT_TRUE(std::isinf(got[1][3]));
}

TEST(MixedPrecision, AllReduceOfBf16RoundsTheSum) {
  auto got = run_collect<Values>(2, [](Rank& r) {
    Tensor t = r.full({1}, r.rank() == 0 ? 1.0f : 1.0f / 256, DType::BFloat16);
    r.all_reduce(t, ReduceOp::Sum);
    return r.to_host(t);
  });
  EXPECT_EQ(got[0][0], 1.0f);  // 1 + 2^-8 ties to even
  EXPECT_EQ(got[1][0], 1.0f);
}

TEST(MixedPrecision, MismatchedDtypesAreClearErrors) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    r.matmul(r.zeros({2, 3}, DType::BFloat16), r.zeros({3, 2}));
  });
  EXPECT_NE(msg.find("rank 0: matmul: dtypes differ: bfloat16[2, 3] and float32[3, 2]"), std::string::npos)
      << msg;
  const std::string adam = run_error_message(1, [](Rank& r) {
    Tensor p = r.zeros({2}, DType::BFloat16);
    r.adamw_step(p, r.zeros({2}, DType::BFloat16), r.zeros({2}), r.zeros({2}), AdamW{}, 1);
  });
  EXPECT_NE(adam.find("adamw_step: 'param' is bfloat16[2]; it must be float32"), std::string::npos) << adam;
  const std::string comm =
      run_error_message(2, [](Rank& r) { r.all_gather(r.zeros({4}, DType::BFloat16), r.zeros({2})); });
  EXPECT_NE(comm.find("does not convert dtypes"), std::string::npos) << comm;
}

// ---- seeded shards ---------------------------------------------------------------------------------

TEST(RandnSlice, EqualsTheSliceOfTheWholeTensorAlongEachDimension) {
  const Shape full{3, 4, 5};
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    for (int dim = 0; dim < 3; ++dim) {
      auto got = on_one_rank<std::pair<Values, Values>>([&](Rank& r) {
        Tensor whole = r.randn(full, 99, 0.5f, dtype);
        Tensor want = r.slice(whole, dim, 1, 2);
        Tensor part = r.randn_slice(full, dim, 1, 2, 99, 0.5f, dtype);
        EXPECT_EQ(part.shape(), full.with_dim(dim, 2));
        EXPECT_EQ(part.dtype(), dtype);
        return std::make_pair(r.to_host(part), r.to_host(want));
      });
      EXPECT_EQ(got.first, got.second) << "dim " << dim << " " << dtype_name(dtype);
    }
  }
}

TEST(RandnSlice, CostsOnlyTheShard) {
  auto us = on_one_rank<Doubles>([](Rank& r) {
    Doubles t;
    for (int which = 0; which < 3; ++which) {
      r.synchronize();
      Event a = r.record_event();
      if (which == 0) r.randn_slice({2048, 2048}, 0, 512, 512, 5, 1.0f, DType::BFloat16);
      if (which == 1) r.randn({512, 2048}, 5, 1.0f, DType::BFloat16);
      if (which == 2) r.randn({2048, 2048}, 5, 1.0f, DType::BFloat16);
      Event b = r.record_event();
      t.push_back(r.elapsed_us(a, b));
    }
    return t;
  });
  EXPECT_NEAR(us[0], us[1], 1e-9 * us[1]);  // differences of clock readings: equal up to rounding
  EXPECT_LT(us[0], us[2]);
}

TEST(RandnSlice, RejectsARangeOutsideTheShape) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    r.randn_slice({4, 6}, 1, 4, 3, 1, 1.0f, DType::Float32);
  });
  EXPECT_NE(msg.find("rank 0: randn_slice: [4, 7) is outside dimension 1 of shape [4, 6]"), std::string::npos)
      << msg;
}

// ---- bias, layernorm, gelu ---------------------------------------------------------------------------

TEST(Kernels, AddBiasAndSumRows) {
  const Values x = random_values(12, 3), bias = {1, -2, 3, 0.5f};
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor t = r.from_host({3, 4}, x);
    r.add_bias_(t, r.from_host({4}, bias));
    Tensor s = r.sum_rows(r.from_host({3, 4}, x, DType::BFloat16));
    EXPECT_EQ(s.dtype(), DType::Float32);
    return std::vector<Values>{r.to_host(t), r.to_host(s)};
  });
  for (int i = 0; i < 12; ++i) EXPECT_FLOAT_EQ(got[0][i], x[i] + bias[i % 4]);
  for (int c = 0; c < 4; ++c) {
    double want = 0;
    for (int r = 0; r < 3; ++r) want += round_to_bfloat16(x[r * 4 + c]);
    EXPECT_NEAR(got[1][c], want, 1e-6);
  }
}

TEST(Kernels, LayerNormForwardAndBackward) {
  const int rows = 3, cols = 5;
  const float eps = 1e-5f;
  const Values x = random_values(rows * cols, 10, 2.0f), gamma = random_values(cols, 11),
               beta = random_values(cols, 12), w = random_values(rows * cols, 13);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({rows, cols}, x), g = r.from_host({cols}, gamma), b = r.from_host({cols}, beta);
    Rank::LayerNormOut o = r.layernorm(xt, g, b, eps);
    Rank::LayerNormGrads d = r.layernorm_backward(r.from_host({rows, cols}, w), xt, g, o.mean, o.rstd);
    return std::vector<Values>{r.to_host(o.y),  r.to_host(o.mean),   r.to_host(o.rstd),
                               r.to_host(d.dx), r.to_host(d.dgamma), r.to_host(d.dbeta)};
  });
  Doubles mean, rstd;
  const Doubles xd = to_doubles(x), gd = to_doubles(gamma), bd = to_doubles(beta);
  expect_near_all(got[0], layernorm_ref(xd, gd, bd, rows, cols, eps, &mean, &rstd), 1e-5, "y");
  expect_near_all(got[1], mean, 1e-6, "mean");
  expect_near_all(got[2], rstd, 1e-5, "rstd");
  expect_near_all(got[3],
                  fd_grad([&](const Doubles& v) { return layernorm_ref(v, gd, bd, rows, cols, eps); }, xd, w),
                  1e-4, "dx");
  expect_near_all(got[4],
                  fd_grad([&](const Doubles& v) { return layernorm_ref(xd, v, bd, rows, cols, eps); }, gd, w),
                  1e-4, "dgamma");
  expect_near_all(got[5],
                  fd_grad([&](const Doubles& v) { return layernorm_ref(xd, gd, v, rows, cols, eps); }, bd, w),
                  1e-4, "dbeta");
}

TEST(Kernels, GeluForwardAndBackward) {
  const Values x = random_values(16, 20, 2.0f), w = random_values(16, 21);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({4, 4}, x);
    return std::vector<Values>{r.to_host(r.gelu(xt)), r.to_host(r.gelu_backward(r.from_host({4, 4}, w), xt))};
  });
  expect_near_all(got[0], gelu_ref(to_doubles(x)), 1e-6, "gelu");
  expect_near_all(got[1], fd_grad(gelu_ref, to_doubles(x), w), 1e-5, "gelu_backward");
}

// Dropout keeps an element exactly when dropout_keeps says, scales it by exactly 1 / (1 - p) (in float32),
// makes a row's mask from its global row alone (so a block of rows with its first_row is the same block of
// the whole, and two runs of rows are the blocks of the whole they name), and is the identity at p = 0.
TEST(Kernels, DropoutMasksByGlobalRow) {
  const std::int64_t rows = 16, cols = 32;
  const float p = 0.25f;
  const std::uint64_t seed = 77;
  const Values x = random_values(rows * cols, 22, 1.0f);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({rows, cols}, x);
    return std::vector<Values>{r.to_host(r.dropout(xt, p, seed, 100)),
                               r.to_host(r.dropout(r.slice(xt, 0, 4, 8), p, seed, 104)),
                               r.to_host(r.dropout(xt, 0.0f, seed, 100)),
                               // rows 0-5 as rows 110-115 of the whole, rows 6-15 as its rows 100-109
                               r.to_host(r.dropout(r.cat({r.slice(xt, 0, 10, 6), r.slice(xt, 0, 0, 10)}, 0),
                                                   p, seed, Rank::DropoutRows(110, 6, 100)))};
  });
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const bool keep = dropout_keeps(seed, 100 + i, j, p);
      kept += keep ? 1 : 0;
      EXPECT_EQ(got[0][i * cols + j], keep ? x[i * cols + j] * (1.0f / (1.0f - p)) : 0.0f) << i << ", " << j;
    }
  }
  // About 1 - p of them (512 elements: 3 standard deviations is 30).
  EXPECT_NEAR(static_cast<double>(kept), (1 - p) * rows * cols, 30.0);
  EXPECT_EQ(got[1], Values(got[0].begin() + 4 * cols, got[0].begin() + 12 * cols));
  EXPECT_EQ(got[2], x);
  Values two_runs(got[0].begin() + 10 * cols, got[0].end());
  two_runs.insert(two_runs.end(), got[0].begin(), got[0].begin() + 10 * cols);
  EXPECT_EQ(got[3], two_runs);
}

// ---- attention -------------------------------------------------------------------------------------

struct AttnCase {
  int seq, batch, heads, hd;
  bool causal;
};

TEST(Attention, ForwardAndBackwardMatchTheReference) {
  for (const AttnCase& c :
       {AttnCase{4, 2, 3, 2, true}, AttnCase{4, 2, 3, 2, false}, AttnCase{5, 1, 2, 4, true}}) {
    const int rows = c.seq * c.batch, width = c.heads * 3 * c.hd, out_w = c.heads * c.hd;
    const Values qkv = random_values(rows * width, 30), w = random_values(rows * out_w, 31);
    auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
      Tensor x = r.from_host({rows, width}, qkv);
      Rank::AttentionOut o = r.attention(x, c.batch, c.heads, c.causal);
      EXPECT_EQ(o.out.shape(), (Shape{rows, out_w}));
      EXPECT_EQ(o.lse.shape(), (Shape{c.batch, c.heads, c.seq}));
      Tensor d =
          r.attention_backward(r.from_host({rows, out_w}, w), x, o.out, o.lse, c.batch, c.heads, c.causal);
      return std::vector<Values>{r.to_host(o.out), r.to_host(o.lse), r.to_host(d)};
    });
    const std::string what =
        fmt::format("seq {} batch {} heads {} hd {} causal {}", c.seq, c.batch, c.heads, c.hd, c.causal);
    Doubles lse;
    const Doubles xd = to_doubles(qkv);
    expect_near_all(got[0], attention_ref(xd, c.seq, c.batch, c.heads, c.hd, c.causal, &lse), 1e-5,
                    "out " + what);
    expect_near_all(got[1], lse, 1e-5, "lse " + what);
    expect_near_all(
        got[2],
        fd_grad([&](const Doubles& v) { return attention_ref(v, c.seq, c.batch, c.heads, c.hd, c.causal); },
                xd, w),
        1e-4, "dqkv " + what);
  }
}

// Grouped-query attention is multi-head attention whose heads of a group read the same k and v: its
// numbers are those of the multi-head call on qkv with each group's k and v copied to each of its heads.
Doubles expand_groups(const Doubles& qkv, int rows, int heads, int groups, int hd) {
  const int per = heads / groups, width = (heads + 2 * groups) * hd;
  Doubles out(static_cast<std::size_t>(rows * heads * 3 * hd));
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const int g = h / per, first = g * (per + 2);
      for (int part = 0; part < 3; ++part) {
        const int from = part == 0 ? first + h % per : first + per + part - 1;
        for (int d = 0; d < hd; ++d) {
          out[(r * heads + h) * 3 * hd + part * hd + d] = qkv[r * width + from * hd + d];
        }
      }
    }
  }
  return out;
}

TEST(Attention, GroupedQueryAttentionSharesEachGroupsKeysAndValues) {
  for (const AttnCase& c : {AttnCase{4, 2, 4, 2, true}, AttnCase{3, 1, 6, 4, false}}) {
    for (int groups : {1, 2}) {
      const int rows = c.seq * c.batch, width = (c.heads + 2 * groups) * c.hd, out_w = c.heads * c.hd;
      const Values qkv = random_values(rows * width, 40), w = random_values(rows * out_w, 41);
      const AttentionSpec spec{c.batch, c.heads, groups, c.causal};
      auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
        Tensor x = r.from_host({rows, width}, qkv);
        Rank::AttentionOut o = r.attention(x, spec);
        Tensor d = r.attention_backward(r.from_host({rows, out_w}, w), x, o.out, o.lse, spec);
        return std::vector<Values>{r.to_host(o.out), r.to_host(d)};
      });
      const std::string what = fmt::format("{} heads in {} groups, causal {}", c.heads, groups, c.causal);
      auto ref = [&](const Doubles& v) {
        return attention_ref(expand_groups(v, rows, c.heads, groups, c.hd), c.seq, c.batch, c.heads, c.hd,
                             c.causal);
      };
      const Doubles xd = to_doubles(qkv);
      expect_near_all(got[0], ref(xd), 1e-5, "out " + what);
      expect_near_all(got[1], fd_grad(ref, xd, w), 1e-4, "dqkv " + what);
    }
  }
}

Doubles rope_ref(const Doubles& qkv, int rows, int batch, int heads, int groups, int hd, int first,
                 double base) {
  const int per = heads / groups, width = (heads + 2 * groups) * hd, half = hd / 2;
  Doubles out = qkv;
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per + 1; ++j) {  // the group's q heads and its k
        const int col = (g * (per + 2) + j) * hd;
        for (int i = 0; i < half; ++i) {
          const double a = (first + r / batch) * std::pow(base, -2.0 * i / hd);
          const double x1 = qkv[r * width + col + i], x2 = qkv[r * width + col + i + half];
          out[r * width + col + i] = x1 * std::cos(a) - x2 * std::sin(a);
          out[r * width + col + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
      }
    }
  }
  return out;
}

TEST(Kernels, RotaryEmbeddingsRotateQAndKAndInvertTheirGradient) {
  const int seq = 3, batch = 2, heads = 4, groups = 2, hd = 4, rows = seq * batch;
  const int width = (heads + 2 * groups) * hd, first = 5;
  const double base = 10000;
  const Values qkv = random_values(rows * width, 50), w = random_values(rows * width, 51);
  const AttentionSpec spec{batch, heads, groups, true};
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor x = r.from_host({rows, width}, qkv), g = r.from_host({rows, width}, w);
    r.rope_(x, spec, first, base, false);
    r.rope_(g, spec, first, base, true);  // the backward: the gradient rotated back
    Tensor back = r.from_host({rows, width}, r.to_host(x));
    r.rope_(back, spec, first, base, true);
    return std::vector<Values>{r.to_host(x), r.to_host(g), r.to_host(back)};
  });
  const Doubles xd = to_doubles(qkv);
  auto ref = [&](const Doubles& v) { return rope_ref(v, rows, batch, heads, groups, hd, first, base); };
  expect_near_all(got[0], ref(xd), 1e-5, "rope");
  expect_near_all(got[1], fd_grad(ref, xd, w), 1e-4, "rope's backward");
  expect_near_all(got[2], xd, 1e-5, "rope then its inverse");
}

Doubles rmsnorm_ref(const Doubles& x, const Doubles& gamma, int rows, int cols, double eps) {
  Doubles y(x.size());
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
    const double rstd = 1 / std::sqrt(ss / cols + eps);
    for (int c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * rstd * gamma[c];
  }
  return y;
}

TEST(Kernels, RmsNormForwardAndBackward) {
  const int rows = 3, cols = 5;
  const float eps = 1e-5f;
  const Values x = random_values(rows * cols, 60, 2.0f), gamma = random_values(cols, 61),
               w = random_values(rows * cols, 62);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({rows, cols}, x), g = r.from_host({cols}, gamma);
    Rank::RmsNormOut o = r.rmsnorm(xt, g, eps);
    Rank::RmsNormGrads d = r.rmsnorm_backward(r.from_host({rows, cols}, w), xt, g, o.rstd);
    return std::vector<Values>{r.to_host(o.y), r.to_host(d.dx), r.to_host(d.dgamma)};
  });
  const Doubles xd = to_doubles(x), gd = to_doubles(gamma);
  expect_near_all(got[0], rmsnorm_ref(xd, gd, rows, cols, eps), 1e-5, "y");
  expect_near_all(got[1],
                  fd_grad([&](const Doubles& v) { return rmsnorm_ref(v, gd, rows, cols, eps); }, xd, w), 1e-4,
                  "dx");
  expect_near_all(got[2],
                  fd_grad([&](const Doubles& v) { return rmsnorm_ref(xd, v, rows, cols, eps); }, gd, w), 1e-4,
                  "dgamma");
}

Doubles swiglu_ref(const Doubles& x) {
  Doubles y(x.size() / 2);
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double a = x[2 * i], b = x[2 * i + 1];
    y[i] = a / (1 + std::exp(-a)) * b;
  }
  return y;
}

TEST(Kernels, SwiGluForwardAndBackward) {
  const Values x = random_values(24, 70, 2.0f), w = random_values(12, 71);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({4, 6}, x);
    return std::vector<Values>{r.to_host(r.swiglu(xt)),
                               r.to_host(r.swiglu_backward(r.from_host({4, 3}, w), xt))};
  });
  expect_near_all(got[0], swiglu_ref(to_doubles(x)), 1e-6, "swiglu");
  expect_near_all(got[1], fd_grad(swiglu_ref, to_doubles(x), w), 1e-5, "swiglu_backward");
}

// gpt-oss's gated unit (common/glu.h): quick GELU of the gate clamped to at most 0.5 (7 in the model; the
// inputs here are of order 2, so both clamps hold some), times the value clamped to [-0.5, 0.5] plus 1. A
// clamped input passes no gradient: the finite differences see it flat there.
TEST(Kernels, ClampedQuickGegluWithAnOffsetForwardAndBackward) {
  const GluSpec oss{1.702f, 0.5f, 1.0f};
  auto ref = [](const Doubles& x) {
    Doubles y(x.size() / 2);
    for (std::size_t i = 0; i < y.size(); ++i) {
      const double a = std::min(x[2 * i], 0.5), b = std::clamp(x[2 * i + 1], -0.5, 0.5);
      y[i] = a / (1 + std::exp(-1.702 * a)) * (b + 1);
    }
    return y;
  };
  const Values x = random_values(48, 72, 2.0f), w = random_values(24, 73);
  int clamped = 0;
  for (float v : x) clamped += std::fabs(v) > 0.5f;
  EXPECT_GT(clamped, 10);
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    Tensor xt = r.from_host({4, 12}, x);
    return std::vector<Values>{r.to_host(r.swiglu(xt, oss)),
                               r.to_host(r.swiglu_backward(r.from_host({4, 6}, w), xt, oss))};
  });
  expect_near_all(got[0], ref(to_doubles(x)), 1e-6, "forward");
  expect_near_all(got[1], fd_grad(ref, to_doubles(x), w), 1e-5, "backward");
}

TEST(Attention, EachHeadReadsItsOwnInterleavedQKV) {
  const int seq = 3, batch = 2, heads = 2, hd = 2, width = heads * 3 * hd, rows = seq * batch;
  Values qkv = random_values(rows * width, 40);
  // Head h's values are the constant 10 + h: whatever the probabilities, its output is that constant.
  for (int row = 0; row < rows; ++row) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < hd; ++d) qkv[row * width + (h * 3 + 2) * hd + d] = 10.0f + h;
    }
  }
  // Swapping the heads' column blocks swaps their outputs.
  Values swapped = qkv;
  for (int row = 0; row < rows; ++row) {
    for (int col = 0; col < 3 * hd; ++col)
      std::swap(swapped[row * width + col], swapped[row * width + 3 * hd + col]);
  }
  Values random = random_values(rows * width, 41), random_swapped = random;
  for (int row = 0; row < rows; ++row) {
    for (int col = 0; col < 3 * hd; ++col) {
      std::swap(random_swapped[row * width + col], random_swapped[row * width + 3 * hd + col]);
    }
  }
  auto got = on_one_rank<std::vector<Values>>([&](Rank& r) {
    auto run = [&](const Values& v) {
      return r.to_host(r.attention(r.from_host({rows, width}, v), batch, heads, true).out);
    };
    return std::vector<Values>{run(qkv), run(random), run(random_swapped)};
  });
  for (int row = 0; row < rows; ++row) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < hd; ++d) EXPECT_FLOAT_EQ(got[0][row * heads * hd + h * hd + d], 10.0f + h);
    }
    for (int d = 0; d < hd; ++d) {
      EXPECT_EQ(got[1][row * heads * hd + d], got[2][row * heads * hd + hd + d]);
      EXPECT_EQ(got[1][row * heads * hd + hd + d], got[2][row * heads * hd + d]);
    }
  }
}

TEST(Attention, CausalFirstPositionIsItsOwnValuePerSample) {
  const int seq = 3, batch = 2, heads = 1, hd = 2, width = 3 * hd, rows = seq * batch;
  const Values qkv = random_values(rows * width, 50);
  auto out = on_one_rank<Values>([&](Rank& r) {
    return r.to_host(r.attention(r.from_host({rows, width}, qkv), batch, heads, true).out);
  });
  // Rows are position-major: row b is position 0 of sample b, which attends only to itself.
  for (int b = 0; b < batch; ++b) {
    for (int d = 0; d < hd; ++d) EXPECT_FLOAT_EQ(out[b * hd + d], qkv[b * width + 2 * hd + d]);
  }
}

TEST(Attention, BadShapesNameRankOperationAndShape) {
  const std::string msg = run_error_message(1, [](Rank& r) { r.attention(r.zeros({6, 10}), 2, 2, true); });
  EXPECT_NE(
      msg.find(
          "rank 0: attention: qkv must be [seq * batch, (heads + 2 kv_heads) * head_dim]; got float32[6, "
          "10]"),
      std::string::npos)
      << msg;
}

TEST(Attention, PhantomAdvancesTimeByTheModel) {
  const std::int64_t seq = 2048, batch = 2, heads = 16, hd = 64;
  auto got = on_one_rank<Doubles>([&](Rank& r) {
    Tensor qkv = r.phantom({seq * batch, heads * 3 * hd}, DType::BFloat16);
    r.synchronize();
    Event a = r.record_event();
    Rank::AttentionOut o = r.attention(qkv, batch, static_cast<int>(heads), true);
    Event b = r.record_event();
    EXPECT_TRUE(o.out.phantom());
    EXPECT_EQ(o.out.dtype(), DType::BFloat16);
    EXPECT_EQ(o.lse.dtype(), DType::Float32);
    return Doubles{r.elapsed_us(a, b)};
  });
  const sim::ComputeModel model(quiet_config().profile.gpu);
  EXPECT_DOUBLE_EQ(got[0],
                   model.launch_us() + model.attention_us(sim::AttentionShape{batch, seq, heads, hd, true, 0},
                                                          AttentionKernel::Flash, false, DType::BFloat16));
}

// ---- embedding and cross-entropy ---------------------------------------------------------------------

TEST(Embedding, VocabParallelShardsSumToTheFullLookupAndBackwardAccumulates) {
  const int vocab = 6, dim = 3, rows = 5;
  const Values table = random_values(vocab * dim, 60), ids = {0, 5, 2, 2, 3},
               dy = random_values(rows * dim, 61);
  auto got = run_collect<std::vector<Values>>(2, [&](Rank& r) {
    const int start = r.rank() * 3;
    Tensor shard =
        r.from_host({3, dim}, Values(table.begin() + start * dim, table.begin() + (start + 3) * dim));
    Tensor idt = r.from_host({rows}, ids);
    Tensor out = r.embedding(idt, shard, start);
    Tensor local = r.cast(out, DType::Float32);  // a copy, before the all_reduce sums the shards
    r.all_reduce(out, ReduceOp::Sum);
    Tensor dtable = r.zeros({3, dim});
    r.embedding_backward_(dtable, r.from_host({rows, dim}, dy), idt, start);
    return std::vector<Values>{r.to_host(local), r.to_host(out), r.to_host(dtable)};
  });
  for (int row = 0; row < rows; ++row) {
    const int id = static_cast<int>(ids[row]);
    for (int c = 0; c < dim; ++c) {
      EXPECT_EQ(got[0][1][row * dim + c], table[id * dim + c]);
      EXPECT_EQ(got[id / 3][0][row * dim + c], table[id * dim + c]);
      EXPECT_EQ(got[1 - id / 3][0][row * dim + c], 0.0f) << "ids outside the shard give zeros";
    }
  }
  for (int v = 0; v < vocab; ++v) {
    for (int c = 0; c < dim; ++c) {
      double want = 0;
      for (int row = 0; row < rows; ++row) {
        if (static_cast<int>(ids[row]) == v) want += dy[row * dim + c];
      }
      EXPECT_NEAR(got[v / 3][2][(v % 3) * dim + c], want, 1e-6) << "token " << v;
    }
  }
}

// Sum over rows of log(sum exp(logits)) - logits[target], in double.
Doubles ce_ref(const Doubles& logits, const Values& targets, int rows, int vocab) {
  double loss = 0;
  for (int r = 0; r < rows; ++r) {
    double mx = -1e300, s = 0;
    for (int c = 0; c < vocab; ++c) mx = std::max(mx, logits[r * vocab + c]);
    for (int c = 0; c < vocab; ++c) s += std::exp(logits[r * vocab + c] - mx);
    loss += std::log(s) + mx - logits[r * vocab + static_cast<int>(targets[r])];
  }
  return {loss};
}

TEST(CrossEntropy, VocabParallelLossAndGradientMatchTheReference) {
  const int rows = 3, vocab = 8, shard = 4;
  const Values logits = random_values(rows * vocab, 70, 3.0f), targets = {1, 6, 4};
  const float scale = 0.5f;
  auto got = run_collect<std::vector<Values>>(2, [&](Rank& r) {
    const int start = r.rank() * shard;
    Values mine(rows * shard);
    for (int row = 0; row < rows; ++row) {
      for (int c = 0; c < shard; ++c) mine[row * shard + c] = logits[row * vocab + start + c];
    }
    Tensor l = r.from_host({rows, shard}, mine), t = r.from_host({rows}, targets);
    Tensor mx = r.row_max(l);
    r.all_reduce(mx, ReduceOp::Max);
    Tensor stats = r.softmax_stats(l, mx, t, start);
    r.all_reduce(stats, ReduceOp::Sum);
    Tensor loss = r.cross_entropy_loss(mx, stats);
    Tensor d = r.cross_entropy_backward(l, mx, stats, t, start, scale);
    return std::vector<Values>{r.to_host(loss), r.to_host(d)};
  });
  const Doubles want = ce_ref(to_doubles(logits), targets, rows, vocab);
  EXPECT_NEAR(got[0][0][0], want[0], 1e-5 * std::abs(want[0]));
  EXPECT_EQ(got[0][0], got[1][0]);
  const Doubles grad = fd_grad([&](const Doubles& v) { return ce_ref(v, targets, rows, vocab); },
                               to_doubles(logits), Values{scale});
  for (int row = 0; row < rows; ++row) {
    for (int c = 0; c < vocab; ++c) {
      EXPECT_NEAR(got[c / shard][1][row * shard + c % shard], grad[row * vocab + c], 1e-5) << row << "," << c;
    }
  }
}

// ---- events, grouped point-to-point, memory, report ----------------------------------------------------

TEST(Events, MeasureAKernelsModeledTimeExactly) {
  const std::int64_t m = 4096, n = 4096, k = 4096;
  auto got = on_one_rank<Doubles>([&](Rank& r) {
    Tensor a = r.phantom({m, k}, DType::BFloat16), b = r.phantom({k, n}, DType::BFloat16);
    r.matmul(a, b);  // keeps the stream busy, so the next marker is reached when this kernel ends
    const double host_before = r.now();
    Event start = r.record_event();
    const double host_after = r.now();
    r.matmul(a, b);
    Event end = r.record_event();
    const double elapsed = r.elapsed_us(start, end);
    return Doubles{host_after - host_before, elapsed, r.now()};
  });
  const sim::ComputeModel model(quiet_config().profile.gpu);
  const double gemm = model.gemm_us(m, n, k, DType::BFloat16);
  EXPECT_EQ(got[0], 0.0) << "recording does not block the host";
  EXPECT_DOUBLE_EQ(got[1], gemm);
  EXPECT_GE(got[2], model.launch_us() + 2 * gemm) << "elapsed_us waits for the end event";
}

TEST(Events, UndefinedEventIsAnError) {
  const std::string msg = run_error_message(1, [](Rank& r) { r.elapsed_us(Event(), r.record_event()); });
  EXPECT_NE(msg.find("rank 0: elapsed_us: 'start' is an undefined event"), std::string::npos) << msg;
}

TEST(BatchIsendIrecv, BothRanksSendingFirstCompletes) {
  auto got = run_collect<Values>(2, [](Rank& r) {
    const int peer = 1 - r.rank();
    Tensor out = r.full({3}, static_cast<float>(r.rank() + 1)), in = r.zeros({3});
    std::vector<Work> w = r.batch_isend_irecv({{CommOp::Send, out, peer}, {CommOp::Recv, in, peer}});
    EXPECT_EQ(w.size(), 2u);
    for (Work& x : w) x.wait();
    return r.to_host(in);
  });
  EXPECT_EQ(got[0], (Values{2, 2, 2}));
  EXPECT_EQ(got[1], (Values{1, 1, 1}));
}

TEST(BatchIsendIrecv, OnlySendAndRecvCanBeBatched) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    r.batch_isend_irecv({{CommOp::AllReduce, r.zeros({1}), 1 - r.rank()}});
  });
  EXPECT_NE(msg.find("batch_isend_irecv: ops[0] is all_reduce; only send and recv can be batched"),
            std::string::npos)
      << msg;
}

TEST(Memory, ResetPeakStartsFromWhatIsAllocated) {
  auto got = on_one_rank<std::vector<std::int64_t>>([](Rank& r) {
    Tensor keep = r.phantom({100}, DType::BFloat16);
    { Tensor big = r.phantom({1000}); }
    const std::int64_t before = r.memory_peak();
    r.reset_peak_memory();
    const std::int64_t after = r.memory_peak();
    Tensor more = r.phantom({10}, DType::Float16);
    return std::vector<std::int64_t>{before, after, r.memory_peak()};
  });
  EXPECT_EQ(got[0], 200 + 4000);
  EXPECT_EQ(got[1], 200);
  EXPECT_EQ(got[2], 220);
}

TEST(Report, TrainingStatsReachTheRunReport) {
  SimBackend backend(quiet_config());
  RunReport report = backend.launch(2, [](Rank& r) {
    TrainingStats s;
    s.model = "custom";
    s.step_time_us = 1234.5;
    s.exposed_comm_us["tp"] = 7;
    if (r.rank() == 0) r.report_training(s);
  });
  ASSERT_TRUE(report.training.has_value());
  EXPECT_EQ(report.training->model, "custom");
  EXPECT_EQ(report.training->step_time_us, 1234.5);
  EXPECT_EQ(report.training->exposed_comm_us.at("tp"), 7);
}

}  // namespace
}  // namespace ranklab
