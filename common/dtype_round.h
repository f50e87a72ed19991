// Rounding a float to the 16-bit floating-point types, with the result kept as a float.
//
// Why: the simulator keeps every value as a float but must hold the numbers a GPU holds, so after a
// kernel writes a bfloat16 or float16 tensor each value is rounded to the nearest value of that type,
// ties to even (IEEE 754-2008 roundTiesToEven, which is what __float2bfloat16_rn and __float2half_rn do).
// Integer arithmetic on the bits makes the result independent of the floating-point environment and
// usable in CUDA code (RANKLAB_HD, as in common/random.h).
//
// bfloat16: 1 sign, 8 exponent, 7 mantissa bits (float32's exponent range, so only the mantissa is cut).
// float16 (IEEE binary16): 1 sign, 5 exponent, 10 mantissa bits; largest finite 65504, smallest normal
// 2^-14, subnormals down to 2^-24; values from 65520 up round to infinity.
//
// The 8-bit types of FP8 training (OCP 8-bit Floating Point Specification (OFP8), rev. 1.0, 2023; the
// formats of H100's and B200's tensor cores, CUDA's __nv_fp8_e4m3 and __nv_fp8_e5m2):
//   e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite 448, smallest normal 2^-6,
//         subnormals down to 2^-9; no infinities.
//   e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; largest finite 57344, smallest normal 2^-14,
//         subnormals down to 2^-16.
// Conversions saturate: a value past the largest finite one becomes it (CUDA's __NV_SATFINITE, which
// TransformerEngine's casts use), so a scale that is too large clips rather than overflows.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"
#include "common/tensor.h"

namespace ranklab {

RANKLAB_HD inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

RANKLAB_HD inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

RANKLAB_HD inline float round_to_bfloat16(float x) {
  std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bits_float(u | 0x00400000u);  // NaN stays a (quiet) NaN
  // Add just under half of the 16 dropped bits, plus the kept lowest bit, so exact halves go to even. A
  // carry out of the mantissa bumps the exponent, and past the largest finite value that gives infinity.
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bits_float(u & 0xFFFF0000u);
}

RANKLAB_HD inline float round_to_float16(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return bits_float(u | 0x00400000u);  // NaN
  // 65520 = 65504 + half a step (2^5 / 2): the tie goes to the even neighbour, 2^16, which overflows.
  if (abs_bits >= 0x477FF000u) return bits_float(sign | 0x7F800000u);  // 0x477FF000 is 65520.0f
  const int exponent = static_cast<int>(abs_bits >> 23) - 127;
  if (exponent >= -14) {
    // Normal float16: keep 10 of float32's 23 mantissa bits.
    std::uint32_t r = abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u);
    return bits_float(sign | (r & 0xFFFFE000u));
  }
  // Subnormal float16: a multiple of 2^-24. With the implicit bit, |x| = m * 2^(exponent - 23), which is
  // m / 2^shift units of 2^-24 with shift = -(exponent + 1) >= 14.
  if (abs_bits < 0x00800000u) return bits_float(sign);  // float32 subnormals are far below 2^-25
  const std::uint32_t m = (abs_bits & 0x007FFFFFu) | 0x00800000u;
  const int shift = -(exponent + 1);
  if (shift > 25) return bits_float(sign);  // below 2^-25: rounds to zero
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // q <= 1024 units of 2^-24 is exact in a float (1024 units is the smallest normal, 2^-14).
  const float v = static_cast<float>(q) * 5.9604644775390625e-08f;  // 2^-24
  return bits_float(sign | float_bits(v));
}

// Rounds x to the nearest value of a small binary floating-point format with `mantissa_bits` stored bits,
// normal numbers from 2^min_exponent and subnormals below, ties to even, saturating at `largest`.
RANKLAB_HD inline float round_to_small_float(float x, int mantissa_bits, int min_exponent, float largest) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return bits_float(u | 0x00400000u);  // NaN
  const std::uint32_t largest_bits = float_bits(largest);
  if (abs_bits >= largest_bits) return bits_float(sign | largest_bits);  // saturate (infinity too)
  const int exponent = static_cast<int>(abs_bits >> 23) - 127;
  if (exponent >= min_exponent) {
    // Normal: keep mantissa_bits of float32's 23, as round_to_float16 does; a carry bumps the exponent.
    const int shift = 23 - mantissa_bits;
    const std::uint32_t r = abs_bits + ((1u << (shift - 1)) - 1u) + ((abs_bits >> shift) & 1u);
    const std::uint32_t rounded = r & ~((1u << shift) - 1u);
    return bits_float(sign | (rounded > largest_bits ? largest_bits : rounded));
  }
  // Subnormal: a multiple of 2^(min_exponent - mantissa_bits). |x| = m * 2^(exponent - 23) is m / 2^shift
  // such units.
  if (abs_bits < 0x00800000u) return bits_float(sign);  // float32 subnormals round to zero
  const std::uint32_t m = (abs_bits & 0x007FFFFFu) | 0x00800000u;
  const int shift = (min_exponent - mantissa_bits) - (exponent - 23);
  if (shift > 25) return bits_float(sign);  // below half the smallest subnormal
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // q units of 2^(min_exponent - mantissa_bits): a small integer times a power of two, exact in a float.
  float unit = 1.0f;
  for (int e = min_exponent - mantissa_bits; e < 0; ++e) unit *= 0.5f;
  return bits_float(sign | float_bits(static_cast<float>(q) * unit));
}

inline constexpr float kFloat8E4M3Largest = 448.0f;
inline constexpr float kFloat8E5M2Largest = 57344.0f;

// An 8-bit format: its stored mantissa bits, its exponent bias (the smallest normal is 2^(1 - bias)) and its
// largest finite value.
struct Float8Format {
  int mantissa_bits;
  int bias;
  float largest;
};
// Float8E4M3's or Float8E5M2's.
RANKLAB_HD inline Float8Format float8_format(DType format) {
  return format == DType::Float8E5M2 ? Float8Format{2, 15, kFloat8E5M2Largest}
                                     : Float8Format{3, 7, kFloat8E4M3Largest};
}

RANKLAB_HD inline float round_to_float8(float x, const Float8Format& f) {
  return round_to_small_float(x, f.mantissa_bits, 1 - f.bias, f.largest);
}
RANKLAB_HD inline float round_to_float8_e4m3(float x) {
  return round_to_float8(x, float8_format(DType::Float8E4M3));
}
RANKLAB_HD inline float round_to_float8_e5m2(float x) {
  return round_to_float8(x, float8_format(DType::Float8E5M2));
}

// FP8 scaling (common/rank.h, Rank::Fp8Scaling), one text for both backends' casts.
//
// The scale that maps `amax` onto the format's largest value: 1 where there is nothing to scale (0, NaN or
// not finite), and at most the largest float where amax is so small that largest / amax overflows (as
// TransformerEngine clamps it), so that a block of zeros stays zeros (0 x infinity would be NaN).
inline constexpr float kLargestFloat = 3.40282347e38f;
RANKLAB_HD inline float fp8_scale_for(float amax, float largest) {
  if (!(amax > 0) || !(amax <= kLargestFloat)) return 1.0f;
  const float s = largest / amax;
  return s <= kLargestFloat ? s : kLargestFloat;
}
// The largest power of two not above s (positive, normal: every scale fp8_scale_for gives is, as amax is at
// most the largest float): an E8M0 scale, which keeps every element of its block at or below the largest.
RANKLAB_HD inline float power_of_two_below(float s) {
  return bits_float(float_bits(s) & 0xFF800000u);
}
// The E8M0 byte (OCP Microscaling: a biased exponent, 2^(code - 127)) of 1 / s for s a power of two from
// power_of_two_below, and the value a byte stands for.
RANKLAB_HD inline std::uint8_t e8m0_code_of_inverse(float s) {
  return static_cast<std::uint8_t>(254u - (float_bits(s) >> 23));
}
RANKLAB_HD inline float e8m0_value(std::uint8_t code) {
  return code == 0 ? bits_float(0x00400000u) : bits_float(static_cast<std::uint32_t>(code) << 23);
}

// The byte an 8-bit format stores for a value it holds (one round_to_float8 returned): the sign, the biased
// exponent and the mantissa bits, as OFP8 lays them out; subnormals have exponent field 0. NaN is S.1111.111
// in both formats. The CUDA backend's FP8 tensors hold these bytes.
RANKLAB_HD inline std::uint8_t float8_code(float v, const Float8Format& f) {
  const int mantissa_bits = f.mantissa_bits, bias = f.bias;
  const std::uint32_t u = float_bits(v);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<std::uint8_t>(sign | 0x7Fu);
  if (abs_bits < 0x00800000u) return static_cast<std::uint8_t>(sign);  // zero
  const int exponent = static_cast<int>(abs_bits >> 23) - 127;
  if (exponent >= 1 - bias) {
    const std::uint32_t mantissa = (abs_bits & 0x007FFFFFu) >> (23 - mantissa_bits);
    return static_cast<std::uint8_t>(sign | (static_cast<std::uint32_t>(exponent + bias) << mantissa_bits) |
                                     mantissa);
  }
  // Subnormal: v = q units of 2^(1 - bias - mantissa_bits), q below 2^mantissa_bits.
  const std::uint32_t m = (abs_bits & 0x007FFFFFu) | 0x00800000u;
  const int shift = (1 - bias - mantissa_bits) - (exponent - 23);
  return static_cast<std::uint8_t>(sign | (m >> shift));
}

// The value of a stored byte (float8_code's inverse); NaN for the NaN codes (and e5m2's infinities).
RANKLAB_HD inline float float8_value(std::uint8_t code, const Float8Format& f) {
  const int mantissa_bits = f.mantissa_bits, bias = f.bias;
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const int exponent_bits = 7 - mantissa_bits;
  const std::uint32_t e = (code >> mantissa_bits) & ((1u << exponent_bits) - 1u);
  const std::uint32_t m = code & ((1u << mantissa_bits) - 1u);
  const bool e4m3 = mantissa_bits == 3;
  if ((e4m3 && (code & 0x7Fu) == 0x7Fu) || (!e4m3 && e == (1u << exponent_bits) - 1u))
    return bits_float(sign | 0x7FC00000u);
  if (e == 0) {
    float unit = 1.0f;  // 2^(1 - bias - mantissa_bits)
    for (int k = 1 - bias - mantissa_bits; k < 0; ++k) unit *= 0.5f;
    return bits_float(sign | float_bits(static_cast<float>(m) * unit));
  }
  const std::uint32_t biased = e - static_cast<std::uint32_t>(bias) + 127u;
  return bits_float(sign | (biased << 23) | (m << (23 - mantissa_bits)));
}

}  // namespace ranklab
