// Host conversions between float and the 16-bit types of a GPU tensor, bit for bit what the device's
// __float2bfloat16 / __float2half (round to nearest, ties to even) and their inverses give.
//
// Why on the host: from_host and to_host move 16-bit tensors, and converting the values where they are
// costs one loop instead of a float32 staging buffer on the device and a kernel. Plain C++, so the
// conversions are unit-tested on machines without CUDA.
#pragma once

#include <cstdint>

#include "common/tensor.h"

namespace ranklab {

// bfloat16: float32's sign and exponent with 7 mantissa bits; a NaN stays a (quiet) NaN.
std::uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(std::uint16_t bits);
// IEEE binary16: 5 exponent bits, 10 mantissa bits, subnormals below 2^-14; beyond 65504 rounds to inf.
std::uint16_t float_to_fp16_bits(float x);
float fp16_bits_to_float(std::uint16_t bits);

// `n` floats into `out`, laid out as `dtype` (dtype_bytes(dtype) * n bytes).
void encode_values(DType dtype, const float* in, std::int64_t n, void* out);
// `n` values of `dtype` at `in` as floats (exact: every bf16 and fp16 value is a float).
void decode_values(DType dtype, const void* in, std::int64_t n, float* out);

}  // namespace ranklab
