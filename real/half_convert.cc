#include "real/half_convert.h"

#include <fmt/format.h>

#include <cstring>

#include "common/errors.h"

namespace ranklab {

namespace {

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

float float_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// `value >> shift` rounded to nearest, ties to the even result (shift >= 1).
std::uint32_t shift_round_even(std::uint32_t value, int shift) {
  const std::uint32_t q = value >> shift;
  const std::uint32_t rem = value & ((1u << shift) - 1);
  const std::uint32_t half = 1u << (shift - 1);
  return (rem > half || (rem == half && (q & 1u))) ? q + 1 : q;
}

}  // namespace

std::uint16_t float_to_bf16_bits(float x) {
  const std::uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // NaN
  // Rounding the low 16 bits away may carry into the exponent, up to inf: that is the correct rounding.
  return static_cast<std::uint16_t>(shift_round_even(u, 16));
}

float bf16_bits_to_float(std::uint16_t bits) {
  return float_of(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_fp16_bits(float x) {
  const std::uint32_t u = bits_of(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN
  // 65520 is halfway between 65504 (the largest half) and 2^16, and rounds to the even one: inf.
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a >= 0x38800000u) {
    // Normal: rebias the exponent from 127 to 15 and round the mantissa from 23 to 10 bits; a carry out
    // of the mantissa correctly bumps the exponent.
    return sign | static_cast<std::uint16_t>(shift_round_even(a - 0x38000000u, 13));
  }
  if (a <= 0x33000000u) return sign;  // at most 2^-25, half the smallest subnormal: ties to even, 0
  // Subnormal: the value is m * 2^(e - 150) and the result counts units of 2^-24.
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const int e = static_cast<int>(a >> 23);
  return sign | static_cast<std::uint16_t>(shift_round_even(m, 126 - e));
}

float fp16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  const std::uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf or NaN
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f);
  return sign ? -magnitude : magnitude;
}

void encode_values(DType dtype, const float* in, std::int64_t n, void* out) {
  switch (dtype) {
    case DType::Float32:
      if (n > 0) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::BFloat16: {
      auto* o = static_cast<std::uint16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) o[i] = float_to_bf16_bits(in[i]);
      return;
    }
    case DType::Float16: {
      auto* o = static_cast<std::uint16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) o[i] = float_to_fp16_bits(in[i]);
      return;
    }
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      break;
  }
  throw UsageError(fmt::format("{} values are FP8 codes with scales: quantize makes them, to_host reads them",
                               dtype_name(dtype)));
}

void decode_values(DType dtype, const void* in, std::int64_t n, float* out) {
  switch (dtype) {
    case DType::Float32:
      if (n > 0) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::BFloat16: {
      const auto* p = static_cast<const std::uint16_t*>(in);
      for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(p[i]);
      return;
    }
    case DType::Float16: {
      const auto* p = static_cast<const std::uint16_t*>(in);
      for (std::int64_t i = 0; i < n; ++i) out[i] = fp16_bits_to_float(p[i]);
      return;
    }
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      break;
  }
  throw UsageError(fmt::format("{} values are FP8 codes with scales: quantize makes them, to_host reads them",
                               dtype_name(dtype)));
}

}  // namespace ranklab
