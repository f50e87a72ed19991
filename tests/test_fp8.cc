// FP8's formats and kernels: e4m3 and e5m2 round as the OCP specification says; quantize scales per tensor
// and per block; an FP8 GEMM runs at the FP8 rate and writes bf16; misuse is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype_round.h"
#include "common/errors.h"
#include "sim/compute_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

// Every finite value of an 8-bit format, from its bits: 1 sign, `exponent_bits`, `mantissa_bits`.
std::vector<double> values_of(int exponent_bits, int mantissa_bits, bool e4m3) {
  std::vector<double> out;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  for (int code = 0; code < 128; ++code) {
    const int e = code >> mantissa_bits, m = code & ((1 << mantissa_bits) - 1);
    if (e4m3 && code == 127) continue;                     // e4m3: S.1111.111 is NaN, no infinities
    if (!e4m3 && e == (1 << exponent_bits) - 1) continue;  // e5m2: infinities and NaNs
    const double frac = static_cast<double>(m) / (1 << mantissa_bits);
    out.push_back(e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1 + frac, e - bias));
  }
  return out;  // ascending
}

void expect_rounding(float (*round)(float), const std::vector<double>& values, const char* name) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float v = static_cast<float>(values[i]);
    EXPECT_EQ(round(v), v) << name << " value " << v;
    EXPECT_EQ(round(-v), -v) << name << " value " << -v;
    if (i + 1 == values.size()) break;
    // Between two neighbours: below the midpoint to the lower, above to the upper, on it to the even one
    // (the one whose code is even: index i here is the code's magnitude).
    const float mid = static_cast<float>((values[i] + values[i + 1]) / 2);  // exact in a float
    EXPECT_EQ(round(std::nextafter(mid, 0.0f)), v) << name << " below " << mid;
    EXPECT_EQ(round(std::nextafter(mid, 1e9f)), static_cast<float>(values[i + 1]))
        << name << " above " << mid;
    EXPECT_EQ(round(mid), static_cast<float>(values[i % 2 == 0 ? i : i + 1])) << name << " at " << mid;
  }
}

TEST(Fp8Rounding, EveryValueStaysAndMidpointsGoToTheEvenNeighbour) {
  const std::vector<double> e4m3 = values_of(4, 3, true), e5m2 = values_of(5, 2, false);
  EXPECT_EQ(e4m3.back(), 448.0);
  EXPECT_EQ(e5m2.back(), 57344.0);
  EXPECT_EQ(e4m3[1], std::ldexp(1.0, -9));  // the smallest subnormal
  EXPECT_EQ(e5m2[1], std::ldexp(1.0, -16));
  expect_rounding(round_to_float8_e4m3, e4m3, "e4m3");
  expect_rounding(round_to_float8_e5m2, e5m2, "e5m2");
}

TEST(Fp8Rounding, ValuesPastTheLargestSaturateAndNaNStays) {
  EXPECT_EQ(round_to_float8_e4m3(464.0f), 448.0f);  // would round to 480, which e4m3 does not have
  EXPECT_EQ(round_to_float8_e4m3(1e30f), 448.0f);
  EXPECT_EQ(round_to_float8_e4m3(-std::numeric_limits<float>::infinity()), -448.0f);
  EXPECT_EQ(round_to_float8_e5m2(61440.0f), 57344.0f);
  EXPECT_TRUE(std::isnan(round_to_float8_e4m3(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_to_float8_e4m3(std::ldexp(1.0f, -11)), 0.0f);  // a quarter of the smallest subnormal
}

TEST(Fp8Rounding, EveryByteDecodesToItsValueAndEncodesBack) {
  struct Format {
    const char* name;
    Float8Format format;
    std::vector<double> values;  // by code, the positive finite ones
    float (*round)(float);
  };
  for (const Format& f :
       {Format{"e4m3", float8_format(DType::Float8E4M3), values_of(4, 3, true), round_to_float8_e4m3},
        Format{"e5m2", float8_format(DType::Float8E5M2), values_of(5, 2, false), round_to_float8_e5m2}}) {
    for (int code = 0; code < 256; ++code) {
      const auto c = static_cast<std::uint8_t>(code);
      const float v = float8_value(c, f.format);
      const std::size_t magnitude = static_cast<std::size_t>(code & 0x7F);
      if (magnitude >= f.values.size()) {
        EXPECT_TRUE(std::isnan(v)) << f.name << " code " << code;
        continue;
      }
      const double want = code & 0x80 ? -f.values[magnitude] : f.values[magnitude];
      EXPECT_EQ(v, static_cast<float>(want)) << f.name << " code " << code;
      EXPECT_EQ(float8_code(v, f.format), c) << f.name << " value " << v;
      EXPECT_EQ(f.round(v), v) << f.name << " value " << v;
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(float8_value(float8_code(nan, f.format), f.format)));
  }
}

TEST(Fp8Scaling, ScalesMapTheLargestMagnitudeAndE8M0BytesHoldPowersOfTwo) {
  EXPECT_EQ(fp8_scale_for(2.0f, kFloat8E4M3Largest), 224.0f);
  for (float nothing : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::nanf("")})
    EXPECT_EQ(fp8_scale_for(nothing, kFloat8E4M3Largest), 1.0f) << nothing;
  EXPECT_EQ(fp8_scale_for(1e-45f, kFloat8E4M3Largest), std::numeric_limits<float>::max());  // clamped
  // The largest power of two not above s, as frexp finds it, over the range scales take.
  for (float s = 1.3e-36f; s < 3e38f; s *= 1.37f) {
    int exponent = 0;
    std::frexp(s, &exponent);
    EXPECT_EQ(power_of_two_below(s), std::ldexp(1.0f, exponent - 1)) << s;
  }
  EXPECT_EQ(power_of_two_below(std::numeric_limits<float>::max()), std::ldexp(1.0f, 127));
  // Every power-of-two scale's inverse round-trips through its E8M0 byte, 2^-127 (byte 0) included.
  for (int k = -126; k <= 127; ++k) {
    const float s = std::ldexp(1.0f, k);
    const std::uint8_t code = e8m0_code_of_inverse(s);
    EXPECT_EQ(code, 127 - k) << k;
    EXPECT_EQ(e8m0_value(code), std::ldexp(1.0f, -k)) << k;
  }
}

// One rank on the simulator of `profile`.
template <typename Fn>
void on_one_rank(const std::string& profile, Fn fn) {
  SimConfig config = testing::quiet_config();
  config.profile = load_profile(profile);
  SimBackend backend(config);
  backend.launch(1, [&](Rank& r) { fn(r); });
}

TEST(Fp8Kernels, PerTensorScalingReadsBackAsTheRoundedScaledValues) {
  on_one_rank("dgx-h100", [](Rank& r) {
    const std::vector<float> x = {0.5f, -3.0f, 1.1f, 0.01f, 100.0f, -0.3f};
    const Tensor t = r.from_host({2, 3}, x, DType::BFloat16);
    const Tensor amax = r.amax(t);
    EXPECT_EQ(r.to_host(amax)[0], 100.0f);
    const Tensor scale = r.fp8_scale(amax, DType::Float8E4M3);
    EXPECT_EQ(r.to_host(scale)[0], 4.48f);
    const Rank::Quantized q = r.quantize(t, DType::Float8E4M3, Rank::Fp8Scaling{}, scale, true, Tensor());
    EXPECT_EQ(q.data.dtype(), DType::Float8E4M3);
    EXPECT_EQ(q.data.bytes(), 6);
    const std::vector<float> got = r.to_host(q.data), transposed = r.to_host(q.columnwise);
    const std::vector<float> held = r.to_host(t);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float want = round_to_float8_e4m3(held[i] * 4.48f) * (1.0f / 4.48f);
      EXPECT_EQ(got[i], want) << i;
      EXPECT_EQ(transposed[i], want) << i;
    }
    EXPECT_EQ(got[4], 100.0f);  // the largest maps onto 448 exactly
  });
}

TEST(Fp8Kernels, EachBlockIsScaledByItsOwnLargestValue) {
  on_one_rank("dgx-b200", [](Rank& r) {
    // Two rows of four; blocks of 1 x 2 along the rows, and 2 x 1 for the other layout.
    const std::vector<float> x = {1.0f, 0.001f, 300.0f, 7.0f, -2.0f, 0.5f, 1e-6f, 3.0f};
    const Tensor t = r.from_host({2, 4}, x);
    for (const bool e8m0 : {false, true}) {
      const Rank::Quantized q =
          r.quantize(t, DType::Float8E4M3, Rank::Fp8Scaling{1, 2, e8m0}, Tensor(), true, Tensor());
      const std::vector<float> rows = r.to_host(q.data), cols = r.to_host(q.columnwise);
      auto expect_block = [&](const std::vector<float>& got, std::vector<int> block) {
        float amax = 0;
        for (int i : block) amax = std::max(amax, std::fabs(x[i]));
        float s = 448.0f / amax;
        if (e8m0) s = std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(s))));
        for (int i : block)
          EXPECT_EQ(got[i], round_to_float8_e4m3(x[i] * s) / s) << "e8m0 " << e8m0 << " " << i;
      };
      for (int b = 0; b < 4; ++b) expect_block(rows, {2 * b, 2 * b + 1});
      for (int c = 0; c < 4; ++c) expect_block(cols, {c, 4 + c});
      // Block scales: 4 blocks in each layout, float32 each, or one byte each in a word of four.
      EXPECT_EQ(q.scales.bytes(), e8m0 ? 4 : 16);
      EXPECT_EQ(q.columnwise_scales.bytes(), e8m0 ? 4 : 16);
    }
    // 0.001 keeps the digits its block's scale (448 / 1) gives it; under one scale for the tensor (448 / 300)
    // it would land on e4m3's smallest subnormal, 30% off.
    const Rank::Quantized q =
        r.quantize(t, DType::Float8E4M3, Rank::Fp8Scaling{1, 2, false}, Tensor(), false, Tensor());
    EXPECT_NEAR(r.to_host(q.data)[1], 0.001, 0.001 / 16);
  });
}

// A block whose largest value is so small that the format's largest over it overflows a float takes the
// largest float as its scale: its zeros stay zeros (0 x infinity would be NaN) and its values round to 0.
TEST(Fp8Kernels, ATinyBlockKeepsItsZeros) {
  on_one_rank("dgx-h100", [](Rank& r) {
    const Tensor t = r.from_host({1, 4}, {0.0f, 1e-39f, 0.0f, -1e-39f});
    for (const Rank::Fp8Scaling& scaling : {Rank::Fp8Scaling{1, 4, false}, Rank::Fp8Scaling{}}) {
      const Tensor scale = scaling.per_tensor() ? r.fp8_scale(r.amax(t), DType::Float8E4M3) : Tensor();
      const std::vector<float> got =
          r.to_host(r.quantize(t, DType::Float8E4M3, scaling, scale, false, Tensor()).data);
      for (const float v : got) EXPECT_TRUE(std::isfinite(v)) << v;
      EXPECT_EQ(got[0], 0.0f);
      EXPECT_EQ(got[2], 0.0f);
    }
  });
}

// Delayed scaling's cast records the largest magnitude it reads, keeping the larger of what it held, and
// saturates what lies past its scale's range.
TEST(Fp8Kernels, ACastRecordsItsAmaxAndSaturatesPastItsScale) {
  on_one_rank("dgx-h100", [](Rank& r) {
    const Tensor amax = r.full({1}, 3.0f, DType::Float32), scale = r.full({1}, 224.0f, DType::Float32);
    const Tensor t = r.from_host({1, 4}, {0.5f, -4.0f, 1.0f, 2.0f}, DType::BFloat16);
    const std::vector<float> got =
        r.to_host(r.quantize(t, DType::Float8E4M3, Rank::Fp8Scaling{}, scale, false, amax).data);
    EXPECT_EQ(got, (std::vector<float>{0.5f, -2.0f, 1.0f, 2.0f}));  // -4 x 224 saturates at -448
    EXPECT_EQ(r.to_host(amax)[0], 4.0f);
    r.quantize(r.from_host({1, 2}, {1.0f, -0.5f}), DType::Float8E4M3, Rank::Fp8Scaling{}, scale, false, amax);
    EXPECT_EQ(r.to_host(amax)[0], 4.0f);  // a smaller tensor leaves the larger amax
  });
}

// The update folds each pass's reduced amax into the history and scales by the history's largest: a pass
// with a smaller amax keeps the scale of the larger one before it, one with none keeps the scale, and the
// oldest entry leaves after len - 1 passes.
TEST(Fp8Kernels, TheDelayedUpdateScalesByTheLargestAmaxOfItsHistory) {
  on_one_rank("dgx-h100", [](Rank& r) {
    const Tensor history = r.zeros({2}, DType::Float32), scale = r.full({1}, 1.0f, DType::Float32);
    const Tensor amax = r.zeros({1}, DType::Float32);
    auto pass = [&](float reduced) {
      r.fp8_delayed_update(r.full({1}, reduced, DType::Float32), {history}, {scale}, {amax},
                           DType::Float8E5M2, 0);
      return r.to_host(scale)[0];
    };
    EXPECT_EQ(pass(0.0f), 1.0f);          // nothing seen: the scale stays
    EXPECT_EQ(pass(4.0f), 57344.0f / 4);  // e5m2's largest over 4
    EXPECT_EQ(pass(1.0f), 57344.0f / 4);  // 4 is still in the history
    EXPECT_EQ(pass(2.0f), 57344.0f / 4);  // history {1, 4}: the newest and two earlier passes
    EXPECT_EQ(pass(0.5f), 57344.0f / 2);  // 4 has left
    EXPECT_EQ(r.to_host(history), (std::vector<float>{0.5f, 2.0f}));
    EXPECT_EQ(r.to_host(amax)[0], 0.0f);  // ready for the next pass's casts
    r.fp8_delayed_update(r.full({1}, 448.0f, DType::Float32), {history}, {scale}, {amax}, DType::Float8E4M3,
                         2);
    EXPECT_EQ(r.to_host(scale)[0], 0.25f);  // 448 / 448 / 2^2: the margin
  });
}

TEST(Fp8Kernels, AnFp8GemmRunsAtTheFp8RateAndWritesBfloat16) {
  on_one_rank("dgx-h100", [](Rank& r) {
    const sim::ComputeModel model(r.profile().gpu);
    auto time_of = [&](const Tensor& a, const Tensor& b) {
      const Event start = r.record_event();
      const Tensor c = r.matmul(a, b);
      const Event end = r.record_event();
      EXPECT_EQ(c.dtype(), DType::BFloat16);
      return r.elapsed_us(start, end);
    };
    const Tensor x = r.phantom({8192, 8192}, DType::BFloat16);
    const Tensor x8 = r.phantom({8192, 8192}, DType::Float8E4M3);
    const double bf16_us = time_of(x, x), fp8_us = time_of(x8, x8);
    // (Each interval also holds the host's launch of its one kernel.)
    EXPECT_NEAR(
        bf16_us - fp8_us,
        model.gemm_us(8192, 8192, 8192, DType::BFloat16) - model.gemm_us(8192, 8192, 8192, DType::Float8E4M3),
        1e-9);
    EXPECT_LT(fp8_us, 0.55 * bf16_us);
    EXPECT_GT(fp8_us, 0.45 * bf16_us);
  });
}

TEST(ComputeModel, TheFp8CeilingReproducesTheMeasuredFp8Gemm) {
  const sim::ComputeModel model(load_profile("dgx-b200").gpu);
  const double flops = 2.0 * 4096 * 4096 * 4096;
  EXPECT_NEAR(flops / model.gemm_us(4096, 4096, 4096, DType::Float8E4M3) / 1e6, 2765.0, 1e-6);
  EXPECT_LE(model.gemm_ceiling(DType::Float8E4M3), 1.0);
  // An 8-bit k-block holds twice the elements of a 16-bit one: the same fill and drain in time.
  EXPECT_EQ(model.gemm_k_overhead(DType::Float8E4M3), 2 * model.gemm_k_overhead(DType::BFloat16));
  // Without a measured FP8 GEMM the 16-bit ceiling applies.
  const sim::ComputeModel h100(load_profile("dgx-h100").gpu);
  EXPECT_EQ(h100.gemm_ceiling(DType::Float8E4M3), h100.gemm_ceiling(DType::BFloat16));
}

std::string error_of(const std::string& profile, const std::function<void(Rank&)>& fn) {
  try {
    on_one_rank(profile, fn);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(Fp8Kernels, MisuseIsRefusedWithTheReason) {
  auto has = [](const std::string& message, const std::string& needle) {
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  };
  has(error_of("dgx-h100",
               [](Rank& r) {
                 r.cast(r.zeros({2, 2}), DType::Float8E4M3);
               }),
      "cast makes no float8_e4m3 tensor: quantize scales a tensor into FP8");
  auto fp8 = [](Rank& r, DType format) {
    const Tensor x = r.full({2, 2}, 1.0f, DType::BFloat16);
    return r.quantize(x, format, Rank::Fp8Scaling{}, r.fp8_scale(r.amax(x), format), false, Tensor()).data;
  };
  has(error_of("dgx-h100", [&](Rank& r) { r.add(fp8(r, DType::Float8E4M3), fp8(r, DType::Float8E4M3)); }),
      "FP8 tensors go only into matmul");
  has(error_of("dgx-h100",
               [&](Rank& r) {
                 r.matmul(fp8(r, DType::Float8E4M3), r.zeros({2, 2}, DType::BFloat16));
               }),
      "an FP8 GEMM takes two FP8 inputs");
  has(error_of("dgx-h100", [&](Rank& r) { r.matmul(fp8(r, DType::Float8E5M2), fp8(r, DType::Float8E5M2)); }),
      "no FP8 GEMM multiplies e5m2 by e5m2");
  has(error_of("dgx-h100", [&](Rank& r) { r.all_reduce(fp8(r, DType::Float8E4M3), ReduceOp::Sum); }),
      "communication that does not add them up");
  has(error_of("dgx-h100",
               [&](Rank& r) {
                 r.copy_(fp8(r, DType::Float8E4M3), r.zeros({2, 2}, DType::BFloat16));
               }),
      "quantize scales a tensor into FP8");
  has(error_of("dgx-a100", [&](Rank& r) { fp8(r, DType::Float8E4M3); }), "has no FP8 tensor cores");
  has(error_of("dgx-h100",
               [](Rank& r) {
                 r.quantize(r.zeros({2, 64}), DType::Float8E4M3, Rank::Fp8Scaling{1, 32, true}, Tensor(),
                            false, Tensor());
               }),
      "do not apply MX block scales");
}

}  // namespace
}  // namespace ranklab
