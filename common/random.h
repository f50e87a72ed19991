// A counter-based normal generator: element `i` of stream `seed` is a pure function of (seed, i).
//
// Why counter-based: both backends, every world size and every slicing of a tensor must draw the same
// numbers, so no generator state may travel between calls. The simulator calls this on the host and
// the real backend in a CUDA kernel (hence RANKLAB_HD).
//
// The mixer is the 64-bit finaliser of SplitMix64 (Steele, Lea & Flood, "Fast Splittable Pseudorandom
// Number Generators", OOPSLA 2014); two independent words feed a Box-Muller transform.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace ranklab {

RANKLAB_HD inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform float in (0, 1] from the top 24 bits of a word (never 0, so log() below is finite).
RANKLAB_HD inline float uniform_open(std::uint64_t word) {
  return (static_cast<float>(word >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

// Whether dropout with probability p keeps element (row, col) under `seed`: a counter-based draw, so any
// device that holds the element decides the same way, in any order.
RANKLAB_HD inline bool dropout_keeps(std::uint64_t seed, std::int64_t row, std::int64_t col, float p) {
  const std::uint64_t key = mix64(mix64(seed ^ 0x64726F706F7574ull) + static_cast<std::uint64_t>(row));
  return uniform_open(mix64(key + static_cast<std::uint64_t>(col))) > p;
}

// The global row of a tensor's row `i` whose rows are one run from `first_row`, or two: from row `split` on
// they continue from `second_row` (a context-parallel rank's two chunks of the sequence; Rank::DropoutRows).
RANKLAB_HD inline std::int64_t row_of_runs(std::int64_t i, std::int64_t first_row, std::int64_t split,
                                           std::int64_t second_row) {
  return i < split ? first_row + i : second_row + (i - split);
}

// Standard normal number `index` of stream `seed`.
RANKLAB_HD inline float normal_at(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t key = mix64(seed ^ 0x5DEECE66Dull);
  const std::uint64_t w1 = mix64(key + 2 * index);
  const std::uint64_t w2 = mix64(key + 2 * index + 1);
  const float u1 = uniform_open(w1);
  const float u2 = uniform_open(w2);
  const float two_pi = 6.28318530717958647692f;
  return sqrtf(-2.0f * logf(u1)) * cosf(two_pi * u2);
}

}  // namespace ranklab
