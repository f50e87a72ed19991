// SimRank's FP8 kernels: quantizing a tensor into e4m3 or e5m2 with its scales, the per-tensor scale's two
// small kernels, and delayed scaling's update of its histories and scales (Rank's FP8 section,
// common/rank.h). The simulator keeps an FP8 tensor's elements as
// the values they stand for (the rounded number times the inverse scale), so matmul multiplies them as
// it multiplies any tensor; time and memory are charged at one byte per element.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/compute_checks.h"
#include "common/dtype_round.h"
#include "common/errors.h"
#include "sim/sim_rank.h"
#include "sim/sim_rank_kernels.h"

namespace ranklab::sim {

using namespace kernels;

namespace {

// out = x quantized with `scale` per tensor, or per block of br x bc with the block's own scale.
void quantize_values(const Tensor& x, const Tensor& out, DType format, float tensor_scale, int br, int bc,
                     bool e8m0) {
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const float* in = sim_data(x);
  float* o = sim_data(out);
  const Float8Format f = float8_format(format);
  auto quantize_block = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, float s) {
    const float inverse = 1.0f / s;
    for (std::int64_t i = r0; i < r1; ++i)
      for (std::int64_t j = c0; j < c1; ++j)
        o[i * cols + j] = round_to_float8(in[i * cols + j] * s, f) * inverse;
  };
  if (br == 0) {
    quantize_block(0, rows, 0, cols, tensor_scale);
    return;
  }
  for (std::int64_t r0 = 0; r0 < rows; r0 += br) {
    const std::int64_t r1 = std::min(rows, r0 + br);
    for (std::int64_t c0 = 0; c0 < cols; c0 += bc) {
      const std::int64_t c1 = std::min(cols, c0 + bc);
      float amax = 0;
      for (std::int64_t i = r0; i < r1; ++i)
        for (std::int64_t j = c0; j < c1; ++j) amax = std::max(amax, std::fabs(in[i * cols + j]));
      float s = fp8_scale_for(amax, f.largest);
      if (e8m0) s = power_of_two_below(s);
      quantize_block(r0, r1, c0, c1, s);
    }
  }
}

}  // namespace

Rank::Quantized SimRank::quantize(const Tensor& x, DType format, const Fp8Scaling& scaling,
                                  const Tensor& scale, bool both_layouts, const Tensor& record_amax) {
  require(x, "quantize", "x");
  if (scale.defined()) require(scale, "quantize", "scale");
  if (record_amax.defined()) require(record_amax, "quantize", "record_amax");
  check_quantize(rank_, x, format, scaling, scale, record_amax);
  world_.compute().require_fp8(scaling.e8m0);
  const bool phantom = x.phantom();
  Quantized q;
  q.data = allocate(x.shape(), format, phantom, "quantize");
  if (both_layouts) q.columnwise = allocate(x.shape(), format, phantom, "quantize");
  double scale_bytes = 0;
  if (!scaling.per_tensor()) {
    // Written: a byte (e8m0) or a float32 per block; held in float32 words.
    auto scales_of = [&](const Fp8Scaling& layout) {
      const std::int64_t blocks = layout.blocks(x.shape());
      scale_bytes += static_cast<double>(layout.e8m0 ? blocks : 4 * blocks);
      return allocate(Shape{layout.scale_words(x.shape())}, DType::Float32, phantom, "quantize");
    };
    q.scales = scales_of(scaling);
    if (both_layouts) q.columnwise_scales = scales_of(scaling.transposed());
  }
  if (record_amax.defined()) {
    before_reading({&x, &scale}, "quantize");
    before_kernel({&record_amax}, "quantize");  // written
  } else if (scale.defined()) {
    before_reading({&x, &scale}, "quantize");
  } else {
    before_reading({&x}, "quantize");
  }
  if (!phantom) {
    const float s = scale.defined() ? sim_data(scale)[0] : 1.0f;
    if (scaling.per_tensor() && !(s > 0 && std::isfinite(s))) {
      throw UsageError(
          fmt::format("{}: the scale is {}; it must be positive and finite", where("quantize"), s));
    }
    quantize_values(x, q.data, format, s, scaling.block_rows, scaling.block_cols, scaling.e8m0);
    if (both_layouts) {
      quantize_values(x, q.columnwise, format, s, scaling.block_cols, scaling.block_rows, scaling.e8m0);
    }
    for (const Tensor* t : {&q.scales, &q.columnwise_scales}) {
      if (t->defined()) array(*t).setZero();
    }
    if (record_amax.defined() && !record_amax.phantom()) {
      float& amax = sim_data(record_amax)[0];
      amax = std::max(amax, array(x).abs().maxCoeff());
    }
  }
  // The recorded amax: one float read and written (an atomic max), beside x's single read.
  const double written =
      bytes_of(q.data) * (both_layouts ? 2 : 1) + scale_bytes + (record_amax.defined() ? 2 * kF : 0);
  launch_kernel_cost(kQuantize, world_.compute().memory_cost(bytes_of(x) + written));
  return q;
}

Tensor SimRank::amax(const Tensor& x) {
  require(x, "amax", "x");
  check_float8_use(rank_, "amax", x, "x");
  Tensor out = allocate(Shape{1}, DType::Float32, x.phantom(), "amax");
  before_reading({&x}, "amax");
  if (!out.phantom()) sim_data(out)[0] = array(x).abs().maxCoeff();
  launch_kernel_cost(kAmax, world_.compute().memory_cost(bytes_of(x) + kF));
  return out;
}

Tensor SimRank::fp8_scale(const Tensor& amax, DType format) {
  require(amax, "fp8_scale", "amax");
  require_dtype(amax, DType::Float32, "fp8_scale", "amax");
  if (amax.shape() != Shape{1}) {
    throw UsageError(fmt::format("{}: 'amax' is {}; expected shape [1]", where("fp8_scale"), amax.str()));
  }
  if (!is_float8(format)) {
    throw UsageError(fmt::format("{}: the format must be float8_e4m3 or float8_e5m2; got {}",
                                 where("fp8_scale"), dtype_name(format)));
  }
  Tensor out = allocate(Shape{1}, DType::Float32, amax.phantom(), "fp8_scale");
  before_reading({&amax}, "fp8_scale");
  if (!out.phantom()) {
    sim_data(out)[0] = fp8_scale_for(sim_data(amax)[0], float8_format(format).largest);
  }
  launch_kernel_cost(kFp8Scale, world_.compute().memory_cost(2 * kF));
  return out;
}

void SimRank::fp8_delayed_update(const Tensor& reduced, const std::vector<Tensor>& histories,
                                 const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes,
                                 DType format, int margin) {
  require(reduced, "fp8_delayed_update", "reduced");
  for (const auto* list : {&histories, &scales, &amaxes}) {
    for (const Tensor& t : *list) require(t, "fp8_delayed_update", "state");
  }
  check_fp8_delayed_update(rank_, reduced, histories, scales, amaxes, format, margin);
  before_reading({&reduced}, "fp8_delayed_update");
  for (const auto* list : {&histories, &scales, &amaxes}) {
    for (const Tensor& t : *list) before_kernel({&t}, "fp8_delayed_update");
  }
  double bytes = bytes_of(reduced);
  const float big = std::ldexp(float8_format(format).largest, -margin);
  for (std::size_t i = 0; i < histories.size(); ++i) {
    // The history read for its largest and written back one place on; the scale and the amax written.
    bytes += 2 * bytes_of(histories[i]) + 2 * kF;
    if (reduced.phantom() || histories[i].phantom()) continue;
    const float newest = sim_data(reduced)[i];
    float* h = sim_data(histories[i]);
    const std::int64_t len = histories[i].size(0);
    float most = newest;
    for (std::int64_t j = 0; j < len; ++j) most = std::max(most, h[j]);
    // TransformerEngine keeps the scale where the amax is 0 (nothing seen yet) or not finite.
    if (most > 0 && std::isfinite(most)) sim_data(scales[i])[0] = fp8_scale_for(most, big);
    // Newest first: the oldest entry leaves, the pass's amax enters at the front.
    if (len > 0) {
      std::copy_backward(h, h + len - 1, h + len);
      h[0] = newest;
    }
    sim_data(amaxes[i])[0] = 0;
  }
  launch_kernel_cost(kFp8DelayedUpdate, world_.compute().memory_cost(bytes));
}

}  // namespace ranklab::sim
