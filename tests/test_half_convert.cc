// The real backend's host conversions between float and bfloat16 / float16 (real/half_convert.h): every
// 16-bit value survives the round trip, and every float rounds to its nearest 16-bit neighbour, ties to
// even, as the GPU's __float2bfloat16 and __float2half do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype_round.h"
#include "real/half_convert.h"

namespace ranklab {
namespace {

float f_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

using Encode = std::uint16_t (*)(float);
using Decode = float (*)(std::uint16_t);

void expect_round_trips(Encode enc, Decode dec) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float x = dec(bits);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(dec(enc(x)))) << b;
    } else {
      EXPECT_EQ(enc(x), bits) << "bits " << b << " value " << x;
    }
  }
}

// enc(x) decodes to a value no farther from x than either neighbour of it.
void expect_nearest(Encode enc, Decode dec, float x) {
  const std::uint16_t b = enc(x);
  const double got = dec(b);
  if (std::isinf(got)) return;  // overflow is checked on its own
  for (int step : {-1, 1}) {
    const std::uint16_t nb = static_cast<std::uint16_t>(b + step);
    const double other = dec(nb);
    if (std::isnan(other) || ((b ^ nb) & 0x8000)) continue;  // past inf or across the sign
    EXPECT_LE(std::abs(got - x), std::abs(other - x)) << "x=" << x << " bits " << b;
  }
}

TEST(HalfConvert, EveryBFloat16RoundTrips) {
  expect_round_trips(float_to_bf16_bits, bf16_bits_to_float);
}

TEST(HalfConvert, EveryFloat16RoundTrips) {
  expect_round_trips(float_to_fp16_bits, fp16_bits_to_float);
}

TEST(HalfConvert, KnownValues) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7c00);  // the tie rounds to even: inf
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: 0
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.5f, -25)), 0x0001);  // above the tie
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: even 2
  EXPECT_EQ(float_to_fp16_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::nanf("")))));
  // Ties: 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7, and goes to the even 1.
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(float_to_fp16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // The largest float rounds to bf16's inf (past the largest bf16 by more than half a unit).
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(HalfConvert, RandomFloatsRoundToTheNearest) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const float x = f_of(any(gen));
    if (std::isnan(x) || std::isinf(x)) continue;
    expect_nearest(float_to_bf16_bits, bf16_bits_to_float, x);
    if (std::abs(x) < 65504.0f) expect_nearest(float_to_fp16_bits, fp16_bits_to_float, x);
  }
  // Small magnitudes, where float16 is subnormal.
  std::uniform_real_distribution<float> tiny(-1e-4f, 1e-4f);
  for (int i = 0; i < 100000; ++i) expect_nearest(float_to_fp16_bits, fp16_bits_to_float, tiny(gen));
}

// The simulator rounds with common/dtype_round.h; both backends must hold the same numbers.
TEST(HalfConvert, AgreesWithTheSimulatorsRounding) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const float x = f_of(any(gen));
    if (std::isnan(x)) continue;
    EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(x)), round_to_bfloat16(x)) << x;
    EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(x)), round_to_float16(x)) << x;
  }
}

TEST(HalfConvert, EncodeAndDecodeWholeBuffers) {
  const std::vector<float> values = {0.0f, -1.5f, 3.14159f, 1e-6f, 70000.0f};
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float16}) {
    std::vector<unsigned char> bytes(values.size() * static_cast<size_t>(dtype_bytes(t)));
    encode_values(t, values.data(), static_cast<std::int64_t>(values.size()), bytes.data());
    std::vector<float> back(values.size());
    decode_values(t, bytes.data(), static_cast<std::int64_t>(values.size()), back.data());
    for (size_t i = 0; i < values.size(); ++i) {
      float expected = values[i];
      if (t == DType::BFloat16) expected = bf16_bits_to_float(float_to_bf16_bits(values[i]));
      if (t == DType::Float16) expected = fp16_bits_to_float(float_to_fp16_bits(values[i]));
      EXPECT_EQ(back[i], expected) << dtype_name(t) << " " << i;
    }
  }
}

}  // namespace
}  // namespace ranklab
