// The simulator's compute ops against loops written here, and the roofline time of a kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/profile.h"
#include "common/random.h"
#include "sim/compute_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;
using testing::run_collect;
using Values = std::vector<float>;

template <typename T>
T on_one_rank(const std::function<T(Rank&)>& fn) {
  return run_collect<T>(1, fn)[0];
}

TEST(Compute, MatmulWithEveryTransposeMatchesLoops) {
  const int m = 5, k = 7, n = 3;
  for (Trans ta : {Trans::No, Trans::Yes}) {
    for (Trans tb : {Trans::No, Trans::Yes}) {
      auto got = on_one_rank<std::pair<Values, Values>>([&](Rank& r) {
        Tensor a = r.randn(ta == Trans::Yes ? Shape{k, m} : Shape{m, k}, 1);
        Tensor b = r.randn(tb == Trans::Yes ? Shape{n, k} : Shape{k, n}, 2);
        Values both = r.to_host(a), bv = r.to_host(b);
        both.insert(both.end(), bv.begin(), bv.end());
        return std::make_pair(r.to_host(r.matmul(a, b, ta, tb)), both);
      });
      const float* a = got.second.data();
      const float* b = a + m * k;
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double want = 0;
          for (int p = 0; p < k; ++p) {
            const float av = ta == Trans::Yes ? a[p * m + i] : a[i * k + p];
            const float bv = tb == Trans::Yes ? b[j * k + p] : b[p * n + j];
            want += static_cast<double>(av) * bv;
          }
          EXPECT_NEAR(got.first[i * n + j], want, 1e-5)
              << "ta=" << (ta == Trans::Yes) << " tb=" << (tb == Trans::Yes);
        }
      }
    }
  }
}

TEST(Compute, MatmulAddSumsTheProductIntoAFloat32GradientWithoutRoundingItTo16Bits) {
  // Two bf16 products summed into a float32 buffer, as a weight gradient accumulates over micro-batches:
  // each product is the float32 sum of rounded inputs, kept in float32; matmul then add_ rounds each
  // product to bf16 first, which the fused sum does not.
  auto got = on_one_rank<std::array<Values, 4>>([](Rank& r) {
    Tensor x = r.cast(r.randn({6, 4}, 1), DType::BFloat16), dy = r.cast(r.randn({6, 3}, 2), DType::BFloat16);
    Tensor fused = r.zeros({4, 3});
    r.matmul_add_(fused, x, dy, Trans::Yes, Trans::No);
    r.matmul_add_(fused, x, dy, Trans::Yes, Trans::No);
    Tensor separate = r.zeros({4, 3});
    for (int i = 0; i < 2; ++i) r.add_(separate, r.matmul(x, dy, Trans::Yes, Trans::No), 1.0f);
    return std::array<Values, 4>{r.to_host(fused), r.to_host(separate), r.to_host(x), r.to_host(dy)};
  });
  const Values &fused = got[0], &separate = got[1], &x = got[2], &dy = got[3];
  bool rounding_differs = false;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) {
      double want = 0;
      for (int p = 0; p < 6; ++p) want += static_cast<double>(x[p * 4 + i]) * dy[p * 3 + j];
      EXPECT_NEAR(fused[i * 3 + j], 2 * want, 1e-5) << i << "," << j;
      rounding_differs |= fused[i * 3 + j] != separate[i * 3 + j];
    }
  }
  EXPECT_TRUE(rounding_differs) << "the separate sum should carry the bf16 rounding of each product";
}

TEST(Compute, MatmulAddReadsItsFloat32OutputAsWellAsWritingIt) {
  // A bf16 GEMM small enough to be bound by its traffic: the accumulating one moves its float32 output
  // twice (read and write) where the plain one writes a bf16 output once.
  const Profile p = quiet_config().profile;
  const std::int64_t m = 8192, n = 8192, k = 8;
  auto got = on_one_rank<std::pair<double, double>>([&](Rank& r) {
    Tensor a = r.phantom({k, m}, DType::BFloat16), b = r.phantom({k, n}, DType::BFloat16);
    Tensor out = r.phantom({m, n});
    r.synchronize();
    double t0 = r.now();
    r.matmul(a, b, Trans::Yes, Trans::No);
    r.synchronize();
    const double plain_us = r.now() - t0;
    t0 = r.now();
    r.matmul_add_(out, a, b, Trans::Yes, Trans::No);
    r.synchronize();
    return std::make_pair(plain_us, r.now() - t0);
  });
  const double per_us = p.gpu.hbm_bandwidth_gbps * 1e3 * p.gpu.memory_efficiency;
  const double inputs = 2.0 * static_cast<double>(m * k + k * n), mn = static_cast<double>(m * n);
  EXPECT_NEAR(got.first, p.gpu.launch_overhead_us + (inputs + 2 * mn) / per_us, 1e-6);
  EXPECT_NEAR(got.second, p.gpu.launch_overhead_us + (inputs + 8 * mn) / per_us, 1e-6);
}

TEST(Compute, ElementwiseOps) {
  auto got = on_one_rank<std::vector<Values>>([](Rank& r) {
    Tensor x = r.from_host({2, 3}, {-2, -1, 0, 1, 2, 3});
    Tensor g = r.full({2, 3}, 10);
    Tensor y = r.add(x, g);
    r.add_(y, x, -2.0f);  // y = x + 10 - 2x = 10 - x
    Tensor z = r.zeros({2, 3});
    r.copy_(z, x);
    r.scale_(z, 3.0f);
    return std::vector<Values>{r.to_host(r.relu(x)), r.to_host(r.relu_backward(g, x)), r.to_host(y),
                               r.to_host(z), r.to_host(r.sum(x))};
  });
  EXPECT_EQ(got[0], (Values{0, 0, 0, 1, 2, 3}));
  EXPECT_EQ(got[1], (Values{0, 0, 0, 10, 10, 10}));  // relu's gradient is 0 at and below zero
  EXPECT_EQ(got[2], (Values{12, 11, 10, 9, 8, 7}));
  EXPECT_EQ(got[3], (Values{-6, -3, 0, 3, 6, 9}));
  EXPECT_EQ(got[4], (Values{3}));
}

TEST(Compute, SliceAndCatAlongEachDimensionOf3D) {
  for (int dim = 0; dim < 3; ++dim) {
    auto got = on_one_rank<std::pair<Values, Values>>([&](Rank& r) {
      Tensor x = r.arange({2, 3, 4}, 0.0f);
      const std::int64_t len = x.size(dim);
      Tensor a = r.slice(x, dim, 0, 1), b = r.slice(x, dim, 1, len - 1);
      return std::make_pair(r.to_host(r.cat({a, b}, dim)), r.to_host(b));
    });
    Values all(24);
    for (int i = 0; i < 24; ++i) all[i] = static_cast<float>(i);
    EXPECT_EQ(got.first, all) << "cat(slice) along " << dim;
    // The first element of the second slice is index 1 along `dim`: stride 12, 4 or 1.
    const float first = dim == 0 ? 12.f : dim == 1 ? 4.f : 1.f;
    EXPECT_EQ(got.second[0], first) << "slice along " << dim;
  }
}

TEST(Compute, OptimizerStepsFollowTheirFormulas) {
  AdamW h;
  h.lr = 0.1f;
  auto got = on_one_rank<std::pair<Values, Values>>([&](Rank& r) {
    Tensor p = r.from_host({2}, {1.0f, -2.0f}), g = r.from_host({2}, {0.5f, 0.25f});
    Tensor q = r.from_host({2}, {1.0f, -2.0f}), m = r.zeros({2}), v = r.zeros({2});
    r.sgd_step(p, g, 0.1f);
    r.adamw_step(q, g, m, v, h, 1);
    r.adamw_step(q, g, m, v, h, 2);
    return std::make_pair(r.to_host(p), r.to_host(q));
  });
  EXPECT_FLOAT_EQ(got.first[0], 1.0f - 0.1f * 0.5f);
  EXPECT_FLOAT_EQ(got.first[1], -2.0f - 0.1f * 0.25f);
  // AdamW by hand (Loshchilov & Hutter 2019, Algorithm 2) for two steps.
  const float gv[2] = {0.5f, 0.25f};
  for (int i = 0; i < 2; ++i) {
    double p = i == 0 ? 1.0 : -2.0, m = 0, v = 0;
    for (int t = 1; t <= 2; ++t) {
      m = h.beta1 * m + (1 - h.beta1) * gv[i];
      v = h.beta2 * v + (1 - h.beta2) * gv[i] * gv[i];
      const double mh = m / (1 - std::pow(h.beta1, t)), vh = v / (1 - std::pow(h.beta2, t));
      p -= h.lr * (mh / (std::sqrt(vh) + h.eps) + h.weight_decay * p);
    }
    EXPECT_NEAR(got.second[i], p, 1e-5);
  }
}

TEST(Compute, FusedAdamWIsEachPartsAdamWInOneKernel) {
  // Two parts, one without weight decay, against adamw_step on each; then the fused step's kernels.
  AdamW h;
  h.lr = 0.1f;
  h.weight_decay = 0.5f;
  auto got = on_one_rank<std::pair<Values, Values>>([&](Rank& r) {
    Tensor g = r.from_host({3}, {0.5f, 0.25f, -1.0f});
    Tensor p1 = r.from_host({3}, {1.0f, -2.0f, 3.0f}), m1 = r.zeros({3}), v1 = r.zeros({3});
    Tensor p2 = r.from_host({3}, {1.0f, -2.0f, 3.0f}), m2 = r.zeros({3}), v2 = r.zeros({3});
    Tensor q1 = r.from_host({3}, {1.0f, -2.0f, 3.0f}), n1 = r.zeros({3}), w1 = r.zeros({3});
    Tensor q2 = r.from_host({3}, {1.0f, -2.0f, 3.0f}), n2 = r.zeros({3}), w2 = r.zeros({3});
    AdamW none = h;
    none.weight_decay = 0;
    for (int t = 1; t <= 2; ++t) {
      r.adamw_step(p1, g, m1, v1, h, t);
      r.adamw_step(p2, g, m2, v2, none, t);
      r.fused_adamw_step({{q1, g, n1, w1, true}, {q2, g, n2, w2, false}}, h, t);
    }
    Values separate = r.to_host(p1), fused = r.to_host(q1);
    for (float x : r.to_host(p2)) separate.push_back(x);
    for (float x : r.to_host(q2)) fused.push_back(x);
    return std::make_pair(separate, fused);
  });
  EXPECT_EQ(got.first, got.second);
  EXPECT_NE(got.first[0], got.first[3]);  // the decay made a difference
  SimBackend backend(testing::quiet_config());
  const RunReport rep = backend.launch(1, [](Rank& r) {
    Tensor a = r.phantom({1 << 20}), b = r.phantom({1 << 20});
    r.fused_adamw_step({{a, a, a, a, true}, {b, b, b, b, false}}, AdamW{}, 1);
  });
  int fused = 0;
  for (const Span& s : rep.spans) fused += std::string(s.name) == "fused_adamw_step";
  EXPECT_EQ(fused, 1);
}

TEST(Compute, SquaredNormSumsTheSquaresOfEveryTensor) {
  const float got = on_one_rank<float>([](Rank& r) {
    Tensor a = r.from_host({3}, {1.0f, -2.0f, 3.0f}), b = r.from_host({2, 1}, {0.5f, 4.0f}, DType::BFloat16);
    return r.to_host(r.squared_norm({a, b, r.view(a, 0, {0})}))[0];
  });
  EXPECT_FLOAT_EQ(got, 1 + 4 + 9 + 0.25f + 16);
  EXPECT_FLOAT_EQ(on_one_rank<float>([](Rank& r) { return r.to_host(r.squared_norm({}))[0]; }), 0.0f);
}

TEST(Compute, RandnIsTheCounterBasedStream) {
  auto got = on_one_rank<Values>([](Rank& r) { return r.to_host(r.randn({3, 2}, 99, 2.0f)); });
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(got[i], 2.0f * normal_at(99, i));
}

TEST(Compute, KernelTimeIsTheRoofline) {
  // A 4096^3 matmul is compute-bound and a 64M-element add is memory-bound on any current GPU.
  const Profile p = quiet_config().profile;
  auto got = on_one_rank<std::pair<double, double>>([](Rank& r) {
    Tensor a = r.phantom({4096, 4096});
    Tensor x = r.phantom({64 << 20});
    r.synchronize();
    double t0 = r.now();
    r.matmul(a, a);
    r.synchronize();
    const double matmul_us = r.now() - t0;
    t0 = r.now();
    r.add(x, x);
    r.synchronize();
    return std::make_pair(matmul_us, r.now() - t0);
  });
  const double n = 4096;
  const double matmul_us =
      std::max(2 * n * n * n / (p.gpu.peak_tflops_fp32 * 1e6 * p.gpu.compute_efficiency),
               4 * 3 * n * n / (p.gpu.hbm_bandwidth_gbps * 1e3 * p.gpu.memory_efficiency));
  const double add_us = 3 * 4.0 * (64 << 20) / (p.gpu.hbm_bandwidth_gbps * 1e3 * p.gpu.memory_efficiency);
  EXPECT_NEAR(got.first, p.gpu.launch_overhead_us + matmul_us, 1e-6);
  EXPECT_NEAR(got.second, p.gpu.launch_overhead_us + add_us, 1e-6);
}

TEST(Compute, PhantomsFlowThroughOpsWithoutValues) {
  auto got = on_one_rank<std::string>([](Rank& r) {
    Tensor a = r.phantom({8, 8});
    Tensor b = r.relu(r.matmul(a, r.full({8, 8}, 1.0f)));
    EXPECT_TRUE(b.phantom());
    try {
      r.to_host(b);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  });
  EXPECT_NE(got.find("phantom"), std::string::npos) << got;
}

// ---- the 16-bit GEMM and attention model (docs/model.md, "Compute") --------------------------------------

sim::ComputeModel h100_model() {
  return sim::ComputeModel(quiet_config().profile.gpu);  // dgx-h100
}

TEST(ComputeModel, Float32GemmKeepsTheRoofline) {
  const sim::ComputeModel model = h100_model();
  const double m = 1000, n = 3000, k = 500;
  const double want =
      std::max(2 * m * n * k / (67.0 * 1e6 * 0.7), 4 * (m * k + k * n + m * n) / (3350.0 * 1e3 * 0.8));
  EXPECT_EQ(model.gemm_us(1000, 3000, 500, DType::Float32), want);
}

TEST(ComputeModel, Bf16GemmOfA8192CubeByHand) {
  // H100: the measured 794.5 TFLOPS at 2048 x 2048 x 13312 is the fixed 3.42 us plus the work of 128 tiles
  // of 128x256 on 128 of the 132 SMs, k / (k + 256) = 13312 / 13568, at the ceiling's share of the peak.
  const double fixed_us = 3.42, mamf_flops = 2.0 * 2048 * 2048 * 13312;
  const double work_at_peak_us = mamf_flops / (989.4 * 1e6 * (128.0 / 132) * (13312.0 / 13568));
  const double ceiling = work_at_peak_us / (mamf_flops / (794.5 * 1e6) - fixed_us);
  // 8192^3: 64 x 32 = 2048 tiles in 16 waves of 132 (2112 slots); k / (k + 256) = 8192 / 8448.
  const double rate = 989.4 * 1e6 * ceiling * (2048.0 / 2112) * (8192.0 / 8448);
  const double want = fixed_us + 2.0 * 8192 * 8192 * 8192 / rate;
  const sim::ComputeModel model = h100_model();
  EXPECT_NEAR(model.gemm_ceiling(), ceiling, 1e-12);
  EXPECT_NEAR(model.gemm_us(8192, 8192, 8192, DType::BFloat16), want, 1e-9 * want);
  EXPECT_NEAR(model.gemm_us(8192, 8192, 8192, DType::Float16), want, 1e-9 * want);  // same peak on H100
}

// A profile without gemm_ridge_flops_per_byte: the profile's one tile and its transpose, no split-K.
GpuModel shapeless_h100() {
  GpuModel gpu = quiet_config().profile.gpu;
  gpu.gemm_ridge_flops_per_byte = 0;
  return gpu;
}

TEST(ComputeModel, ShapelessProfileOneTileMoreThanAFullWaveCostsTwoWaves) {
  const sim::ComputeModel model(shapeless_h100());
  // 1536 x 2816 is 12 x 11 = 132 tiles of 128x256: one full wave on 132 SMs. 2432 x 1792 is 19 x 7 = 133.
  // Beside the waves, each GEMM takes the fixed time once.
  const double fixed_us = shapeless_h100().gemm_fixed_us;
  const double one_wave = model.gemm_us(1536, 2816, 8192, DType::BFloat16) - fixed_us;
  const double two_waves = model.gemm_us(2432, 1792, 8192, DType::BFloat16) - fixed_us;
  EXPECT_NEAR(two_waves / one_wave, 2.0, 1e-9);
  EXPECT_DOUBLE_EQ(model.gemm_quantization(1536, 2816), 1.0);
  EXPECT_NEAR(model.gemm_quantization(2432, 1792), 133.0 / 264, 1e-12);
}

TEST(ComputeModel, ShapelessProfileKeepsTheOneTileRate) {
  // fixed + flops / rate, rate = peak x ceiling x quantization x k / (k + k0), for the better orientation of
  // 128x256.
  const sim::ComputeModel model(shapeless_h100());
  EXPECT_EQ(model.gemm_candidates(512, 2688, 7168, DType::BFloat16).size(), 2u);
  for (const auto& [m, n, k] : std::vector<std::array<std::int64_t, 3>>{
           {512, 2688, 7168}, {2048, 2560, 2560}, {4096, 4096, 4096}, {100, 3000, 700}}) {
    const double rate =
        989.4e6 * model.gemm_ceiling() * model.gemm_quantization(m, n) * model.gemm_k_efficiency(k);
    const double want = shapeless_h100().gemm_fixed_us + 2.0 * m * n * k / rate;
    EXPECT_NEAR(model.gemm_cost(m, n, k, DType::BFloat16).math_us, want, 1e-9 * want) << m << "x" << n;
  }
}

TEST(ComputeModel, MoreThanAFullWaveRunsOnSmallerTiles) {
  // 133 tiles of 128x256 need two waves; 266 tiles of 128x128 need three waves of a tile half as large
  // at 0.822 of its rate: 3 / 2 / 0.822 = 1.82 times one full wave, less than 2.
  const sim::ComputeModel model = h100_model();
  const double one_wave = model.gemm_us(1536, 2816, 8192, DType::BFloat16);
  const double two_waves = model.gemm_us(2432, 1792, 8192, DType::BFloat16);
  EXPECT_LT(two_waves / one_wave, 1.9);
  EXPECT_GT(two_waves / one_wave, 1.5);
}

// A measured bf16 GEMM: TFLOP/s at m x n x k.
struct MeasuredGemm {
  std::int64_t m, n, k;
  double tflops;
};

double model_tflops(const sim::ComputeModel& model, std::int64_t m, std::int64_t n, std::int64_t k) {
  return 2.0 * m * n * k / model.gemm_us(m, n, k, DType::BFloat16) / 1e6;
}

// XLA's measured bf16 GEMM tables (validation/gemm/*-bf16-xla.csv): m, n, k and TFLOP/s per row, after
// '#' lines and a header.
std::vector<MeasuredGemm> xla_table(const std::string& file) {
  std::ifstream in(std::string(RANKLAB_SOURCE_DIR) + "/validation/gemm/" + file);
  std::vector<MeasuredGemm> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line[0] == 'm') continue;
    MeasuredGemm g{};
    char comma = 0;
    std::istringstream(line) >> g.m >> comma >> g.n >> comma >> g.k >> comma >> g.tflops;
    rows.push_back(g);
  }
  return rows;
}

// exp(mean |log(model / measured)|) - 1 over the rows, and the largest |log| as a factor.
std::pair<double, double> gemm_errors(const sim::ComputeModel& model, const std::vector<MeasuredGemm>& rows) {
  double sum = 0, worst = 0;
  for (const MeasuredGemm& g : rows) {
    const double e = std::fabs(std::log(model_tflops(model, g.m, g.n, g.k) / g.tflops));
    sum += e;
    worst = std::max(worst, e);
  }
  return {std::exp(sum / static_cast<double>(rows.size())) - 1, std::exp(worst)};
}

TEST(ComputeModel, GemmsByShapeMatchXlasMeasuredTables) {
  // Of each table's 125 GEMMs (256 to 4096 on each side) only 256 x 256 x 256 went into the profile (its
  // fixed time); the rest check the model. Without the fixed time, the small GEMMs ran several times faster
  // in the model than measured.
  struct Case {
    const char* profile;
    const char* file;
    double gmean, worst_factor;
  };
  for (const Case& c : {Case{"dgx-h100", "h100-bf16-xla.csv", 0.10, 1.35},
                        Case{"dgx-b200", "b200-bf16-xla.csv", 0.14, 1.75}}) {
    SCOPED_TRACE(c.profile);
    const std::vector<MeasuredGemm> rows = xla_table(c.file);
    ASSERT_EQ(rows.size(), 125u);
    GpuModel gpu = load_profile(c.profile).gpu;
    const sim::ComputeModel model(gpu);
    EXPECT_NEAR(model_tflops(model, 256, 256, 256) / rows.front().tflops, 1.0, 0.01);  // 256^3, the first row
    const auto [gmean, worst] = gemm_errors(model, rows);
    EXPECT_LE(gmean, c.gmean);
    EXPECT_LE(worst, c.worst_factor);
    gpu.gemm_fixed_us = 0;
    EXPECT_GT(gemm_errors(sim::ComputeModel(gpu), rows).first, 0.5);
  }
}

TEST(ComputeModel, ATensorParallelChunkOfH100GemmKeepsMostOfTheLargeGemmRate) {
  // XLA's table measures 512 x 2048 x 4096 at 430.5 / 783.3 = 0.55 of 4096^3's rate and 512 x 4096 x 4096
  // at 0.82; 512 x 2688 x 7168 has more columns and a longer k than the first.
  const sim::ComputeModel model = h100_model();
  const double fraction = model_tflops(model, 512, 2688, 7168) / model_tflops(model, 4096, 4096, 4096);
  EXPECT_GE(fraction, 430.5 / 783.3);
  EXPECT_LE(fraction, 1.0);
}

TEST(ComputeModel, MoreRowsNeverTakeLessTime) {
  for (const std::string& name :
       {std::string("dgx-h100"), std::string("dgx-a100"), std::string("dgx-b200")}) {
    const sim::ComputeModel model(load_profile(name).gpu);
    for (const auto& [n, k] : std::vector<std::pair<std::int64_t, std::int64_t>>{
             {2688, 7168}, {7168, 896}, {2560, 2560}, {10240, 2560}, {64, 4096}}) {
      double previous_us = 0;
      for (std::int64_t m = 16; m <= 8192; m += 16) {
        const double us = model.gemm_us(m, n, k, DType::BFloat16);
        EXPECT_GE(us, previous_us) << name << " " << m << "x" << n << "x" << k;
        previous_us = us;
      }
    }
  }
}

TEST(ComputeModel, TheGemmRunsAsTheFastestCandidate) {
  const sim::ComputeModel model = h100_model();
  for (const auto& [m, n, k] : std::vector<std::array<std::int64_t, 3>>{
           {512, 2688, 7168}, {4096, 2688, 7168}, {512, 7168, 896}, {2048, 2560, 2560}, {256, 256, 4096}}) {
    const std::vector<sim::GemmCandidate> all = model.gemm_candidates(m, n, k, DType::BFloat16);
    ASSERT_GT(all.size(), 2u);
    const double us = model.gemm_cost(m, n, k, DType::BFloat16).math_us;
    double fastest_us = all[0].us;
    for (const sim::GemmCandidate& c : all) fastest_us = std::min(fastest_us, c.us);
    EXPECT_EQ(us, fastest_us) << m << "x" << n << "x" << k;
  }
}

TEST(ComputeModel, SplitKOnlyWhenTheTilesDoNotFillTheSms) {
  const sim::ComputeModel model = h100_model();
  for (const auto& [m, n, k] : std::vector<std::array<std::int64_t, 3>>{{512, 2688, 7168},
                                                                        {4096, 2688, 7168},
                                                                        {1536, 2816, 8192},
                                                                        {256, 4096, 4096},
                                                                        {8192, 8192, 8192}}) {
    const std::vector<sim::GemmCandidate> all = model.gemm_candidates(m, n, k, DType::BFloat16);
    for (const sim::GemmCandidate& c : all) {
      if (c.splits == 1) continue;
      const std::int64_t tiles = ((m + c.tile_m - 1) / c.tile_m) * ((n + c.tile_n - 1) / c.tile_n);
      EXPECT_LE(tiles * c.splits, 132) << c.tile_m << "x" << c.tile_n << "/" << c.splits;
    }
  }
  // 512 x 2688: 44 tiles of 128x256 in a third of a wave; split three ways they fill the SMs.
  const std::vector<sim::GemmCandidate> all = model.gemm_candidates(512, 2688, 7168, DType::BFloat16);
  const auto fastest =
      *std::min_element(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.us < b.us; });
  EXPECT_GT(fastest.splits, 1);
  // 1536 x 2816 fills every SM with 128x256 tiles: nothing splits.
  for (const sim::GemmCandidate& c : model.gemm_candidates(1536, 2816, 8192, DType::BFloat16)) {
    if (c.tile_m * c.tile_n >= 128 * 256) {
      EXPECT_EQ(c.splits, 1);
    }
  }
}

TEST(ComputeModel, SmallerTilesRunAtTheirOperandIntensityBelowTheRidge) {
  const sim::ComputeModel model = h100_model();
  // bf16: 128x256 does 85.3 flops per operand byte, above the ridge 77.8; 128x128 64, 128x64 42.7.
  EXPECT_DOUBLE_EQ(model.gemm_tile_efficiency(128, 256, DType::BFloat16), 1.0);
  EXPECT_DOUBLE_EQ(model.gemm_tile_efficiency(256, 128, DType::BFloat16), 1.0);
  EXPECT_NEAR(model.gemm_tile_efficiency(128, 128, DType::BFloat16), 64 / 77.8, 1e-12);
  EXPECT_NEAR(model.gemm_tile_efficiency(128, 64, DType::BFloat16), (2.0 * 128 * 64 / (192 * 2)) / 77.8,
              1e-12);
}

TEST(ComputeModel, SmallKAndSmallNAreLessEfficient) {
  const sim::ComputeModel model = h100_model();
  double previous_tflops = 0;
  for (std::int64_t k = 64; k <= 16384; k *= 2) {
    const double tflops = 2.0 * 8192 * 8192 * k / model.gemm_us(8192, 8192, k, DType::BFloat16) / 1e6;
    EXPECT_GT(tflops, previous_tflops) << "k = " << k;
    EXPECT_GT(model.gemm_k_efficiency(k), model.gemm_k_efficiency(k / 2));
    previous_tflops = tflops;
  }
  // A 64-row GEMM fills half of every 128-row tile.
  EXPECT_LT(model.gemm_quantization(64, 32768), 0.51);
}

TEST(ComputeModel, Bf16GemmIsMuchFasterThanFloat32) {
  const sim::ComputeModel model = h100_model();
  EXPECT_LT(model.gemm_us(8192, 8192, 8192, DType::BFloat16) * 8,
            model.gemm_us(8192, 8192, 8192, DType::Float32));
}

TEST(ComputeModel, EveryShippedProfileReproducesItsMeasuredGemm) {
  for (const std::string& name : list_profiles()) {
    const GpuModel gpu = load_profile(name).gpu;
    ASSERT_GT(gpu.sm_count, 0) << name;
    const sim::ComputeModel model(gpu);
    EXPECT_GT(model.gemm_ceiling(), 0.5) << name;
    EXPECT_LE(model.gemm_ceiling(), 1.0) << name;
    const double m = gpu.gemm_mamf_m, n = gpu.gemm_mamf_n, k = gpu.gemm_mamf_k;
    const double tflops = 2 * m * n * k /
                          model.gemm_us(gpu.gemm_mamf_m, gpu.gemm_mamf_n, gpu.gemm_mamf_k, DType::BFloat16) /
                          1e6;
    EXPECT_NEAR(tflops, gpu.gemm_mamf_tflops, 1e-6 * gpu.gemm_mamf_tflops) << name;
  }
}

// H100 with the flat fractions only (no attention shape model).
sim::ComputeModel h100_flat_attention() {
  GpuModel gpu = load_profile("dgx-h100").gpu;
  gpu.attention_fwd_shape = {};
  gpu.attention_bwd_shape = {};
  return sim::ComputeModel(gpu);
}
double flash_us(const sim::ComputeModel& m, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d,
                bool causal, bool backward) {
  return m.attention_us(sim::AttentionShape{b, s, h, d, causal, 0}, AttentionKernel::Flash, backward,
                        DType::BFloat16);
}

TEST(ComputeModel, CausalAttentionByHandAndQuadraticInSequence) {
  const sim::ComputeModel model = h100_flat_attention();
  // 4 b s^2 d h / 2 forward at FlashAttention-3's 75% of 989.4 TFLOPS; backward 2.5x at 65%.
  const double flops = 4.0 * 2 * 2048 * 2048 * 64 * 16 / 2;
  EXPECT_DOUBLE_EQ(flash_us(model, 2, 2048, 16, 64, true, false), flops / (989.4e6 * 0.75));
  EXPECT_DOUBLE_EQ(flash_us(model, 2, 2048, 16, 64, true, true), 2.5 * flops / (989.4e6 * 0.65));
  EXPECT_DOUBLE_EQ(flash_us(model, 2, 2048, 16, 64, false, false), 2 * flops / (989.4e6 * 0.75));
  const double s4k = flash_us(model, 1, 4096, 32, 128, true, false);
  const double s8k = flash_us(model, 1, 8192, 32, 128, true, false);
  EXPECT_DOUBLE_EQ(s8k / s4k, 4.0);
}

TEST(ComputeModel, MemoryBoundKernelsRunAtHbmBandwidth) {
  const sim::ComputeModel model = h100_model();
  EXPECT_DOUBLE_EQ(model.memory_us(3350.0 * 0.8 * 1e3), 1.0);  // a microsecond's worth of bytes
  // A bf16 layernorm of 4096 x 4096 moves half the bytes of a float32 one.
  const double bf16 = run_collect<double>(1, [](Rank& r) {
    Tensor x = r.phantom({4096, 4096}, DType::BFloat16), g = r.phantom({4096}, DType::BFloat16);
    r.synchronize();
    Event a = r.record_event();
    r.layernorm(x, g, g, 1e-5f);
    return r.elapsed_us(a, r.record_event());
  })[0];
  const double bytes = 2.0 * 4096 * 4096 * 2 + 2 * 4096 * 2 + 2 * 4096 * 4;
  EXPECT_NEAR(bf16, model.launch_us() + bytes / (3350.0 * 0.8 * 1e3), 1e-9);
}

// ---- attention by kernel kind and by shape (docs/model.md, "Compute") ----------------------------------

sim::ComputeModel profile_model(const std::string& name) {
  return sim::ComputeModel(load_profile(name).gpu);
}

using sim::AttentionKernel;
using sim::AttentionShape;

// A GPT-3 2.7B-like layer on one GPU: 32 heads of 80, sequence 2048, one sequence.
AttentionShape gpt3_2p7b(bool causal, float dropout) {
  return {1, 2048, 32, 80, causal, dropout};
}

double fwd_bwd_us(const sim::ComputeModel& model, const AttentionShape& a, AttentionKernel kernel) {
  return model.attention_us(a, kernel, false, DType::BFloat16) +
         model.attention_us(a, kernel, true, DType::BFloat16);
}

TEST(AttentionKernels, UnfusedIsSlowerThanFlashAtSeq2048Hidden2048OnA100) {
  const sim::ComputeModel model = profile_model("dgx-a100");
  const AttentionShape a{4, 2048, 16, 128, true, 0.1f};  // hidden 2048
  EXPECT_GT(model.attention_us(a, AttentionKernel::Unfused, false, DType::BFloat16),
            1.5 * model.attention_us(a, AttentionKernel::Flash, false, DType::BFloat16));
  EXPECT_GT(model.attention_us(a, AttentionKernel::Unfused, true, DType::BFloat16),
            1.5 * model.attention_us(a, AttentionKernel::Flash, true, DType::BFloat16));
}

TEST(AttentionKernels, UnfusedGrowsAsSeqSquaredAndFlashPerTokenAsSeq) {
  for (const std::string& name : {std::string("dgx-a100"), std::string("dgx-h100")}) {
    const sim::ComputeModel model = profile_model(name);
    // Long enough that both GEMMs fill whole waves and the shape factors have settled.
    const AttentionShape s8k{1, 8192, 32, 128, true, 0.1f}, s16k{1, 16384, 32, 128, true, 0.1f};
    const double unfused =
        fwd_bwd_us(model, s16k, AttentionKernel::Unfused) / fwd_bwd_us(model, s8k, AttentionKernel::Unfused);
    EXPECT_NEAR(unfused, 4.0, 0.1) << name;
    // Flash's time per token doubles with the sequence, up to its efficiency's slow rise.
    const double flash_per_token = (fwd_bwd_us(model, s16k, AttentionKernel::Flash) / 16384) /
                                   (fwd_bwd_us(model, s8k, AttentionKernel::Flash) / 8192);
    EXPECT_GT(flash_per_token, 1.9) << name;
    EXPECT_LE(flash_per_token, 2.0) << name;
  }
}

TEST(AttentionKernels, UnfusedMemoryPassesAreBytesOverHbm) {
  const sim::ComputeModel model = profile_model("dgx-a100");
  const GpuModel gpu = load_profile("dgx-a100").gpu;
  const AttentionShape a{2, 1024, 8, 64, true, 0.1f};
  const double scores = 2.0 * 8 * 1024 * 1024, rate = gpu.hbm_bandwidth_gbps * 1e3 * gpu.memory_efficiency;
  const std::vector<sim::KernelCost> fwd =
      model.attention_kernels(a, AttentionKernel::Unfused, false, DType::BFloat16);
  ASSERT_EQ(fwd.size(), 4u);
  EXPECT_EQ(fwd[1].math_us, 0);
  EXPECT_DOUBLE_EQ(fwd[1].memory_us, 2 * 2 * scores / rate);        // softmax: read and write, 2 bytes each
  EXPECT_DOUBLE_EQ(fwd[2].memory_us, (2 * 2 + 1) * scores / rate);  // dropout: read, write, 1-byte mask
  const std::vector<sim::KernelCost> bwd =
      model.attention_kernels(a, AttentionKernel::Unfused, true, DType::BFloat16);
  ASSERT_EQ(bwd.size(), 6u);
  EXPECT_DOUBLE_EQ(bwd[2].memory_us, (2 * 2 + 1) * scores / rate);  // dropout backward
  EXPECT_DOUBLE_EQ(bwd[3].memory_us, 3 * 2 * scores / rate);        // softmax backward: dP, P in; dS out
  // The GEMMs are the batched GEMM model's, with b h entries sharing the waves.
  EXPECT_DOUBLE_EQ(fwd[0].us(), model.batched_gemm_cost(16, 1024, 1024, 64, DType::BFloat16).us());
  EXPECT_DOUBLE_EQ(fwd[3].us(), model.batched_gemm_cost(16, 1024, 64, 1024, DType::BFloat16).us());
  // The sum: every kernel's time, and their HBM times.
  const sim::KernelCost sum = model.attention_cost(a, AttentionKernel::Unfused, false, DType::BFloat16);
  double total = 0, memory = 0;
  for (const sim::KernelCost& k : fwd) total += k.us(), memory += k.memory_us;
  EXPECT_DOUBLE_EQ(sum.us(), total);
  EXPECT_DOUBLE_EQ(sum.memory_us, memory);
}

TEST(AttentionKernels, DropoutAddsOnePassEachWayAndTheCausalMaskSavesNothingUnfused) {
  const sim::ComputeModel model = profile_model("dgx-h100");
  const AttentionShape with = gpt3_2p7b(true, 0.1f), without = gpt3_2p7b(true, 0), full = gpt3_2p7b(false, 0);
  EXPECT_EQ(sim::ComputeModel::attention_kernel_count(with, AttentionKernel::Unfused, false), 4);
  EXPECT_EQ(sim::ComputeModel::attention_kernel_count(without, AttentionKernel::Unfused, false), 3);
  EXPECT_EQ(sim::ComputeModel::attention_kernel_count(with, AttentionKernel::Unfused, true), 6);
  EXPECT_EQ(sim::ComputeModel::attention_kernel_count(without, AttentionKernel::Unfused, true), 5);
  EXPECT_EQ(sim::ComputeModel::attention_kernel_count(with, AttentionKernel::Flash, true), 1);
  for (bool backward : {false, true}) {
    EXPECT_EQ(model.attention_kernels(with, AttentionKernel::Unfused, backward, DType::BFloat16).size(),
              static_cast<std::size_t>(
                  sim::ComputeModel::attention_kernel_count(with, AttentionKernel::Unfused, backward)));
    EXPECT_GT(model.attention_us(with, AttentionKernel::Unfused, backward, DType::BFloat16),
              model.attention_us(without, AttentionKernel::Unfused, backward, DType::BFloat16));
    EXPECT_DOUBLE_EQ(model.attention_us(without, AttentionKernel::Unfused, backward, DType::BFloat16),
                     model.attention_us(full, AttentionKernel::Unfused, backward, DType::BFloat16));
  }
}

TEST(AttentionKernels, UnfusedKeptBytesAreKorthikantisFiveAs2b) {
  // Korthikanti et al. 2022, section 4.1: 5 a s^2 b bytes in 16-bit with dropout.
  const std::int64_t a = 32, s = 2048, b = 2;
  EXPECT_EQ(sim::ComputeModel::unfused_attention_kept_bytes({b, s, a, 80, true, 0.1f}, DType::BFloat16),
            5 * a * s * s * b);
  EXPECT_EQ(sim::ComputeModel::unfused_attention_kept_bytes({b, s, a, 80, true, 0}, DType::BFloat16),
            2 * a * s * s * b);
  EXPECT_EQ(sim::ComputeModel::unfused_attention_kept_bytes({b, s, a, 80, true, 0.1f}, DType::Float32),
            9 * a * s * s * b);
}

TEST(AttentionKernels, BatchedGemmTilesShareTheWaves) {
  // The one-tile model (no ridge intensity), where the waves can be counted by hand.
  GpuModel one_tile = load_profile("dgx-h100").gpu;
  one_tile.gemm_ridge_flops_per_byte = 0;
  const sim::ComputeModel model(one_tile);
  // One 1024 x 1024 output is 8 x 4 = 32 tiles of 128x256 on 132 SMs; 33 of them are 1056 tiles, 8 full
  // waves.
  EXPECT_NEAR(model.gemm_quantization(1024, 1024), 32.0 / 132, 1e-12);
  EXPECT_NEAR(model.gemm_quantization(1024, 1024, 33), 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(model.batched_gemm_cost(1, 1000, 3000, 500, DType::BFloat16).us(),
                   model.gemm_us(1000, 3000, 500, DType::BFloat16));
  // One kernel: the fixed time once, the 33 GEMMs' tiles in waves together.
  const double fixed_us = one_tile.gemm_fixed_us;
  EXPECT_NEAR(model.batched_gemm_cost(33, 1024, 1024, 512, DType::BFloat16).us() - fixed_us,
              33 * (model.gemm_us(1024, 1024, 512, DType::BFloat16) - fixed_us) * (32.0 / 132), 1e-9);
  // With every tile shape and split-K, a batch is never slower than its GEMMs one after another.
  const sim::ComputeModel shapes = profile_model("dgx-h100");
  EXPECT_LE(shapes.batched_gemm_cost(33, 1024, 1024, 512, DType::BFloat16).us(),
            33 * shapes.gemm_us(1024, 1024, 512, DType::BFloat16));
}

TEST(AttentionShapeModel, EfficiencyRisesWithSeqAndStaysBelowTheCeiling) {
  for (const std::string& name : list_profiles()) {
    const GpuModel gpu = load_profile(name).gpu;
    if (!gpu.attention_fwd_shape.enabled()) continue;
    const sim::ComputeModel model(gpu);
    for (bool backward : {false, true}) {
      const double ceiling = (backward ? gpu.attention_bwd_shape : gpu.attention_fwd_shape).ceiling;
      for (std::int64_t hd : {64, 80, 128}) {
        for (bool causal : {false, true}) {
          double previous = 0;
          for (std::int64_t s = 256; s <= 65536; s *= 2) {
            const double e = model.flash_attention_efficiency({1, s, 16, hd, causal, 0}, backward);
            EXPECT_GT(e, previous) << name << " s=" << s << " hd=" << hd;
            EXPECT_LT(e, ceiling) << name << " s=" << s << " hd=" << hd;
            previous = e;
          }
        }
        // Causal and a smaller head dim cost efficiency.
        EXPECT_LT(model.flash_attention_efficiency({1, 2048, 16, hd, true, 0}, backward),
                  model.flash_attention_efficiency({1, 2048, 16, hd, false, 0}, backward));
      }
      EXPECT_LT(model.flash_attention_efficiency({1, 2048, 16, 64, false, 0}, backward),
                model.flash_attention_efficiency({1, 2048, 16, 128, false, 0}, backward));
    }
  }
}

TEST(AttentionShapeModel, H100ReproducesTheFlashAttention3BarsItCameFrom) {
  // FlashAttention-3 paper, Figure 5, head dim 128 non-causal: 467 TFLOPS at 512, 648 at 16k, and within
  // 6% of the bars between (565, 625, 638, 646).
  const sim::ComputeModel model = h100_model();
  const double bars[] = {467, 565, 625, 638, 646, 648};
  int i = 0;
  for (std::int64_t s = 512; s <= 16384; s *= 2, ++i) {
    const double tflops = model.flash_attention_efficiency({1, s, 16, 128, false, 0}, false) * 989.4;
    EXPECT_NEAR(tflops / bars[i], 1.0, i == 0 || i == 5 ? 0.002 : 0.06) << "s=" << s;
  }
  // The time is the flops at that rate.
  const AttentionShape a{8, 2048, 16, 128, false, 0};
  const double flops = 4.0 * 8 * 2048 * 2048 * 16 * 128;
  EXPECT_DOUBLE_EQ(model.attention_us(a, AttentionKernel::Flash, false, DType::BFloat16),
                   flops / (989.4e6 * model.flash_attention_efficiency(a, false)));
}

TEST(AttentionShapeModel, ProfileWithoutShapeDataKeepsTheFlatFractions) {
  const std::string text = R"(
name = "flat"
gpus_per_node = 1
barrier_latency_us = 1
[gpu]
name = "G"
peak_tflops_fp32 = 10
peak_tflops_tf32 = 100
peak_tflops_bf16 = 200
hbm_bandwidth_gbps = 1000
hbm_capacity_gib = 10
launch_overhead_us = 1
attention_fwd_efficiency = 0.5
attention_bwd_efficiency = 0.4
[pcie]
generation = "x"
bandwidth_gbps = 10
latency_us = 1
[nic]
name = "n"
count = 1
bandwidth_gbps = 10
latency_us = 1
[fabric]
kind = "infiniband"
switch = "s"
switch_radix = 8
switch_latency_us = 0.1
)";
  const sim::ComputeModel model(parse_profile(text, "flat.toml").gpu);
  for (bool causal : {false, true}) {
    for (bool backward : {false, true}) {
      const AttentionShape a{2, 512, 8, 64, causal, 0};
      EXPECT_EQ(model.flash_attention_efficiency(a, backward), backward ? 0.4 : 0.5);
    }
  }
}

TEST(AttentionShapeModel, ProfileErrorsNameTheFileAndLine) {
  const std::string base = R"(
name = "p"
gpus_per_node = 1
barrier_latency_us = 1
[pcie]
generation = "x"
bandwidth_gbps = 10
latency_us = 1
[nic]
name = "n"
count = 1
bandwidth_gbps = 10
latency_us = 1
[fabric]
kind = "infiniband"
switch = "s"
switch_radix = 8
switch_latency_us = 0.1
[gpu]
name = "G"
peak_tflops_fp32 = 10
peak_tflops_tf32 = 100
peak_tflops_bf16 = 200
hbm_bandwidth_gbps = 1000
hbm_capacity_gib = 10
launch_overhead_us = 1
)";
  auto error = [&](const std::string& extra) {
    try {
      parse_profile(base + extra, "p.toml");
    } catch (const ProfileError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error("attention_fwd_seq_half = 100\n")
                .find("p.toml:27: 'gpu.attention_fwd_seq_half' needs "
                      "'gpu.attention_fwd_ceiling'"),
            std::string::npos)
      << error("attention_fwd_seq_half = 100\n");
  EXPECT_NE(
      error("attention_bwd_ceiling = 1.5\n").find("p.toml:27: 'gpu.attention_bwd_ceiling' must be in (0, 1]"),
      std::string::npos)
      << error("attention_bwd_ceiling = 1.5\n");
  EXPECT_NE(error("attention_fwd_ceiling = 0.5\nattention_fwd_causal_tokens = -1\n")
                .find("p.toml:28: 'gpu.attention_fwd_causal_tokens' must be at least 0"),
            std::string::npos);
  EXPECT_EQ(error("attention_fwd_ceiling = 0.5\nattention_fwd_seq_half = 100\n"), "");
}

TEST(AttentionShapeModel, Gpt3TwoPointSevenBLayerFlashAgainstUnfused) {
  // Batch 1, seq 2048, 32 heads of 80, bf16, attention dropout 0.1 for the unfused path.
  for (const std::string& name : {std::string("dgx-a100"), std::string("dgx-h100")}) {
    const sim::ComputeModel model = profile_model(name);
    const double flash = fwd_bwd_us(model, gpt3_2p7b(true, 0), AttentionKernel::Flash);
    const double unfused = fwd_bwd_us(model, gpt3_2p7b(true, 0.1f), AttentionKernel::Unfused);
    GpuModel flat_gpu = load_profile(name).gpu;
    flat_gpu.attention_fwd_shape = {};
    flat_gpu.attention_bwd_shape = {};
    const sim::ComputeModel flat_model(flat_gpu);
    const double flat = fwd_bwd_us(flat_model, gpt3_2p7b(true, 0), AttentionKernel::Flash);
    EXPECT_GT(flash, flat) << name;  // the shape model is slower than the flat best-case fractions here
    EXPECT_GT(unfused, 2 * flash) << name;
  }
}
}  // namespace
}  // namespace ranklab
