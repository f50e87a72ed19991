// Mixture-of-experts token permutation (Rank::gather_rows, scatter_add_rows, row_dots) on the simulator
// against loops written here: float32 and bfloat16, with and without weights, no routes, repeated routes,
// the refusals of bad indices and shapes, and phantoms' shapes, memory and time. With a GPU, the CUDA
// backend's numbers against the simulator's.
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

#if defined(RANKLAB_HAVE_CUDA)
#include "real/cuda_backend.h"
#endif

namespace ranklab {
namespace {

using testing::quiet_config;
using testing::run_collect;
using Values = std::vector<float>;

Values random_values(std::size_t n, std::uint64_t seed) {
  Values v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = normal_at(seed, i);
  return v;
}

// Each value as a tensor of `dtype` holds it (from_host rounds once).
Values rounded(const Values& v, DType dtype) {
  Values out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = dtype == DType::BFloat16 ? round_to_bfloat16(v[i]) : v[i];
  }
  return out;
}

// Within a rounding of `dtype` of the exact value (a float32 sum rounded once may differ from the exact sum
// rounded once by one unit in the last place).
void expect_close(const Values& got, const std::vector<double>& want, DType dtype, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double rel = dtype == DType::BFloat16 ? 1.0 / 128 : 1e-6;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i]) + 1e-7) << what << " at " << i;
  }
}

constexpr std::int64_t kRows = 5, kCols = 7;
const std::vector<float> kIndex = {3, 0, 3, 4, 1, 1};  // token 3 and token 1 go to two experts each

// out[i] = x[index[i]] * w[i], in double from the rounded inputs.
std::vector<double> gather_ref(const Values& x, const Values& index, const Values* w, std::int64_t cols) {
  std::vector<double> out;
  for (std::size_t i = 0; i < index.size(); ++i) {
    const auto r = static_cast<std::int64_t>(index[i]);
    for (std::int64_t c = 0; c < cols; ++c) out.push_back(double(x[r * cols + c]) * (w ? (*w)[i] : 1.0));
  }
  return out;
}

std::vector<double> scatter_ref(const Values& src, const Values& index, const Values* w, std::int64_t rows,
                                std::int64_t cols) {
  std::vector<double> out(static_cast<std::size_t>(rows * cols), 0.0);
  for (std::size_t i = 0; i < index.size(); ++i) {
    const auto t = static_cast<std::int64_t>(index[i]);
    for (std::int64_t c = 0; c < cols; ++c)
      out[t * cols + c] += double(src[i * cols + c]) * (w ? (*w)[i] : 1.0);
  }
  return out;
}

TEST(MoeKernels, GatherRowsPicksEachRoutesRowTimesItsWeight) {
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const Values x = rounded(random_values(kRows * kCols, 80), dtype), w = random_values(kIndex.size(), 81);
    const std::vector<Values> got = run_collect<std::vector<Values>>(1, [&](Rank& r) {
      Tensor xt = r.from_host({kRows, kCols}, x, dtype);
      Tensor index = r.from_host({std::int64_t(kIndex.size())}, kIndex);
      Tensor plain = r.gather_rows(xt, index, Tensor{});
      Tensor weighted = r.gather_rows(xt, index, r.from_host({std::int64_t(kIndex.size())}, w));
      EXPECT_EQ(plain.shape(), (Shape{std::int64_t(kIndex.size()), kCols}));
      EXPECT_EQ(plain.dtype(), dtype);
      EXPECT_EQ(weighted.dtype(), dtype);
      return std::vector<Values>{r.to_host(plain), r.to_host(weighted)};
    })[0];
    const std::string what = dtype_name(dtype);
    const std::vector<double> plain = gather_ref(x, kIndex, nullptr, kCols);
    ASSERT_EQ(got[0].size(), plain.size());
    for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(got[0][i], plain[i]) << what << " at " << i;
    expect_close(got[1], gather_ref(x, kIndex, &w, kCols), dtype, what + " weighted");
  }
}

TEST(MoeKernels, ScatterAddRowsSumsEachTokensRoutes) {
  const std::int64_t rows = 7;  // rows 2, 5 and 6 get no route
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const std::int64_t n = std::int64_t(kIndex.size());
    const Values src = rounded(random_values(n * kCols, 82), dtype), w = random_values(n, 83);
    const std::vector<Values> got = run_collect<std::vector<Values>>(1, [&](Rank& r) {
      Tensor s = r.from_host({n, kCols}, src, dtype);
      Tensor index = r.from_host({n}, kIndex);
      Tensor plain = r.scatter_add_rows(s, index, Tensor{}, rows);
      Tensor weighted = r.scatter_add_rows(s, index, r.from_host({n}, w), rows);
      EXPECT_EQ(plain.shape(), (Shape{rows, kCols}));
      EXPECT_EQ(weighted.dtype(), dtype);
      return std::vector<Values>{r.to_host(plain), r.to_host(weighted)};
    })[0];
    const std::string what = dtype_name(dtype);
    expect_close(got[0], scatter_ref(src, kIndex, nullptr, rows, kCols), dtype, what);
    expect_close(got[1], scatter_ref(src, kIndex, &w, rows, kCols), dtype, what + " weighted");
    for (std::int64_t row : {2, 5, 6}) {
      for (std::int64_t c = 0; c < kCols; ++c)
        EXPECT_EQ(got[1][row * kCols + c], 0.0f) << what << " row " << row;
    }
  }
}

TEST(MoeKernels, ScatterOfGatherIsEachRowTimesItsRoutes) {
  const Values index = {3, 0, 3, 4, 3, 0};  // row 0 twice, row 3 three times, rows 1 and 2 never
  const std::vector<int> count = {2, 0, 0, 3, 1};
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const Values x = rounded(random_values(kRows * kCols, 84), dtype);
    const Values got = run_collect<Values>(1, [&](Rank& r) {
      Tensor idx = r.from_host({std::int64_t(index.size())}, index);
      Tensor routed = r.gather_rows(r.from_host({kRows, kCols}, x, dtype), idx, Tensor{});
      return r.to_host(r.scatter_add_rows(routed, idx, Tensor{}, kRows));
    })[0];
    std::vector<double> want(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) want[i] = double(x[i]) * count[i / kCols];
    expect_close(got, want, dtype, dtype_name(dtype));
  }
}

TEST(MoeKernels, RowDotsAreEachRowsDotProduct) {
  const std::int64_t n = 4, cols = 300;
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const Values a = rounded(random_values(n * cols, 85), dtype),
                 b = rounded(random_values(n * cols, 86), dtype);
    const Values got = run_collect<Values>(1, [&](Rank& r) {
      Tensor out = r.row_dots(r.from_host({n, cols}, a, dtype), r.from_host({n, cols}, b, dtype));
      EXPECT_EQ(out.shape(), (Shape{n}));
      EXPECT_EQ(out.dtype(), DType::Float32);
      return r.to_host(out);
    })[0];
    std::vector<double> want(n, 0.0);
    for (std::int64_t i = 0; i < n * cols; ++i) want[i / cols] += double(a[i]) * b[i];
    // Float32 output of exact products of rounded inputs: float32's rounding, whatever the inputs' dtype.
    expect_close(got, want, DType::Float32, dtype_name(dtype));
  }
}

TEST(MoeKernels, NoRoutesGiveEmptyRowsZerosAndNoDots) {
  const std::vector<Values> got = run_collect<std::vector<Values>>(1, [](Rank& r) {
    Tensor none = r.zeros({0}), x = r.randn({kRows, kCols}, 87, 1.0f, DType::BFloat16);
    Tensor gathered = r.gather_rows(x, none, r.zeros({0}));
    EXPECT_EQ(gathered.shape(), (Shape{0, kCols}));
    Tensor summed = r.scatter_add_rows(r.zeros({0, kCols}, DType::BFloat16), none, r.zeros({0}), kRows);
    EXPECT_EQ(summed.shape(), (Shape{kRows, kCols}));
    EXPECT_EQ(summed.dtype(), DType::BFloat16);
    Tensor dots = r.row_dots(gathered, gathered);
    EXPECT_EQ(dots.shape(), (Shape{0}));
    return std::vector<Values>{r.to_host(gathered), r.to_host(summed), r.to_host(dots)};
  })[0];
  EXPECT_TRUE(got[0].empty());
  EXPECT_EQ(got[1], Values(kRows * kCols, 0.0f));
  EXPECT_TRUE(got[2].empty());
}

// Runs `fn` on one rank; it must raise a UsageError whose message holds each of `needles`.
void expect_refused(const std::function<void(Rank&)>& fn, const std::vector<std::string>& needles) {
  SimBackend backend(quiet_config());
  std::string msg;
  EXPECT_THROW(
      {
        try {
          backend.launch(1, fn);
        } catch (const UsageError& e) {
          msg = e.what();
          throw;
        }
      },
      UsageError);
  for (const std::string& needle : needles) EXPECT_NE(msg.find(needle), std::string::npos) << msg;
}

TEST(MoeKernels, IndicesThatAreNotRowsAreRefusedNamingThePositionAndValue) {
  expect_refused(
      [](Rank& r) {
        r.gather_rows(r.zeros({kRows, kCols}), r.from_host({3}, {0, 5, 1}), Tensor{});
      },
      {"rank 0: gather_rows: index[1] is 5; a route's row must be an integer in [0, 5) (the rows of x)"});
  expect_refused(
      [](Rank& r) {
        r.gather_rows(r.zeros({kRows, kCols}), r.from_host({2}, {0, -1}), Tensor{});
      },
      {"rank 0: gather_rows: index[1] is -1"});
  expect_refused(
      [](Rank& r) {
        r.scatter_add_rows(r.zeros({3, kCols}), r.from_host({3}, {0, 1, 1.5f}), Tensor{}, 4);
      },
      {"rank 0: scatter_add_rows: index[2] is 1.5; a route's row must be an integer in [0, 4)"});
  expect_refused(
      [](Rank& r) {
        r.scatter_add_rows(r.zeros({2, kCols}), r.from_host({2}, {4, 0}), Tensor{}, 4);
      },
      {"rank 0: scatter_add_rows: index[0] is 4"});
}

TEST(MoeKernels, MismatchedShapesAndTypesAreRefusedNamingTheOp) {
  expect_refused([](Rank& r) { r.gather_rows(r.zeros({kCols}), r.zeros({2}), Tensor{}); },
                 {"rank 0: gather_rows: 'x' must be 2-D [rows, cols]; got float32[7]"});
  expect_refused(
      [](Rank& r) {
        r.gather_rows(r.zeros({kRows, kCols}), r.zeros({2}, DType::BFloat16), Tensor{});
      },
      {"rank 0: gather_rows: 'index' is bfloat16[2]; it must be float32"});
  expect_refused(
      [](Rank& r) {
        r.gather_rows(r.zeros({kRows, kCols}), r.zeros({2}), r.zeros({3}));
      },
      {"rank 0: gather_rows: 'weights' is float32[3]; expected shape [2]"});
  expect_refused(
      [](Rank& r) {
        r.scatter_add_rows(r.zeros({3, kCols}), r.zeros({2}), Tensor{}, 4);
      },
      {"rank 0: scatter_add_rows: 'src' is float32[3, 7] and 'index' is float32[2]"});
  expect_refused(
      [](Rank& r) {
        r.scatter_add_rows(r.zeros({2, kCols}), r.zeros({2}), r.zeros({2}, DType::Float16), 4);
      },
      {"rank 0: scatter_add_rows: 'weights' is float16[2]; it must be float32"});
  expect_refused(
      [](Rank& r) {
        r.scatter_add_rows(r.zeros({2, kCols}), r.zeros({2}), Tensor{}, -1);
      },
      {"rank 0: scatter_add_rows: rows -1 is negative"});
  expect_refused(
      [](Rank& r) {
        r.row_dots(r.zeros({4, 6}), r.zeros({4, 5}));
      },
      {"rank 0: row_dots: 'b' is float32[4, 5]; expected shape [4, 6] (the shape of a)"});
  expect_refused(
      [](Rank& r) {
        r.row_dots(r.zeros({4, 6}), r.zeros({4, 6}, DType::BFloat16));
      },
      {"rank 0: row_dots: dtypes differ"});
}

// Phantom inputs give phantom outputs of the right shapes, with their memory, in the compute model's time for
// the bytes each kernel moves.
TEST(MoeKernels, PhantomsTakeTheComputeModelsTimeForTheirBytes) {
  const std::int64_t tokens = 4096, n = 8192, cols = 2048;
  struct Got {
    double gather_us = 0, scatter_us = 0, dots_us = 0;
    std::int64_t gather_bytes = 0, scatter_bytes = 0, dots_bytes = 0;
  };
  const Got got = run_collect<Got>(1, [&](Rank& r) {
    Tensor x = r.phantom({tokens, cols}, DType::BFloat16), index = r.phantom({n}), weights = r.phantom({n});
    Got g;
    auto timed = [&](const std::function<Tensor()>& fn, double& us, std::int64_t& bytes) {
      r.synchronize();
      const std::int64_t before = r.memory_allocated();
      Event a = r.record_event();
      Tensor out = fn();
      Event b = r.record_event();
      us = r.elapsed_us(a, b);
      bytes = r.memory_allocated() - before;
      EXPECT_TRUE(out.phantom());
      return out;
    };
    Tensor routed = timed([&] { return r.gather_rows(x, index, weights); }, g.gather_us, g.gather_bytes);
    EXPECT_EQ(routed.shape(), (Shape{n, cols}));
    EXPECT_EQ(routed.dtype(), DType::BFloat16);
    Tensor combined = timed([&] { return r.scatter_add_rows(routed, index, weights, tokens); }, g.scatter_us,
                            g.scatter_bytes);
    EXPECT_EQ(combined.shape(), (Shape{tokens, cols}));
    EXPECT_EQ(combined.dtype(), DType::BFloat16);
    Tensor dots = timed([&] { return r.row_dots(routed, routed); }, g.dots_us, g.dots_bytes);
    EXPECT_EQ(dots.shape(), (Shape{n}));
    EXPECT_EQ(dots.dtype(), DType::Float32);
    // A real tensor with a phantom index still gives a phantom.
    EXPECT_TRUE(r.gather_rows(r.zeros({4, 4}), r.phantom({2}), Tensor{}).phantom());
    return g;
  })[0];
  const sim::ComputeModel model(quiet_config().profile.gpu);
  const double routes = 2.0 * 4 * n, routed = 2.0 * n * cols, combined = 2.0 * tokens * cols;
  EXPECT_DOUBLE_EQ(got.gather_us, model.launch_us() + model.memory_us(routes + 2 * routed));
  EXPECT_DOUBLE_EQ(got.scatter_us, model.launch_us() + model.memory_us(routes + routed + combined));
  EXPECT_DOUBLE_EQ(got.dots_us, model.launch_us() + model.memory_us(2 * routed + 4.0 * n));
  EXPECT_EQ(got.gather_bytes, std::int64_t(routed));
  EXPECT_EQ(got.scatter_bytes, std::int64_t(combined));
  EXPECT_EQ(got.dots_bytes, 4 * n);
}

#if defined(RANKLAB_HAVE_CUDA)
// The CUDA kernels against the simulator from the same seeded inputs (the scatter's sums in the same
// order, so float32 agrees to the last place but for the products' rounding).
TEST(MoeKernels, CudaMatchesTheSimulator) {
  if (!cuda_devices_available()) GTEST_SKIP() << "no CUDA device visible";
  const std::int64_t tokens = 300, cols = 260, k = 2, n = tokens * k;
  Values index(n);
  for (std::int64_t i = 0; i < n; ++i) index[i] = float((i * 7919) % tokens);  // each token twice
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    auto program = [&](Rank& r) {
      Values all;
      auto keep = [&](const Tensor& t) {
        const Values v = r.to_host(t);
        all.insert(all.end(), v.begin(), v.end());
      };
      Tensor x = r.randn({tokens, cols}, 90, 1.0f, dtype), idx = r.from_host({n}, index);
      Tensor w = r.from_host({n}, random_values(n, 91));
      Tensor routed = r.gather_rows(x, idx, w);
      keep(routed), keep(r.gather_rows(x, idx, Tensor{}));
      keep(r.scatter_add_rows(routed, idx, w, tokens + 3)),
          keep(r.scatter_add_rows(routed, idx, Tensor{}, tokens));
      keep(r.row_dots(routed, r.randn({n, cols}, 92, 1.0f, dtype)));
      keep(r.scatter_add_rows(r.zeros({0, cols}, dtype), r.zeros({0}), Tensor{}, 4));
      return all;
    };
    Values sim, cuda;
    SimBackend(quiet_config()).launch(1, [&](Rank& r) { sim = program(r); });
    CudaConfig c;
    c.profile = load_profile("dgx-h100");
    c.echo_output = false;
    CudaBackend(c).launch(1, [&](Rank& r) { cuda = program(r); });
    ASSERT_EQ(sim.size(), cuda.size());
    const double tol = dtype == DType::Float32 ? 1e-5 : 1.0 / 128;
    for (std::size_t i = 0; i < sim.size(); ++i) {
      ASSERT_NEAR(cuda[i], sim[i], tol * (1 + std::abs(sim[i]))) << dtype_name(dtype) << " element " << i;
    }
  }
}
#endif

}  // namespace
}  // namespace ranklab
