#include "lessons/parallel/fp8.h"

namespace ranklab::parallel {

namespace {
// DeepSeek-V3's block (section 3.3.1: 1 x 128 tiles of activations, 128 x 128 blocks of weights) and the OCP
// Microscaling specification's (v1.0, 2023: 32 elements share a scale).
constexpr int kDeepSeekBlock = 128;
constexpr int kMxBlock = 32;

// How `recipe` scales a tensor along its columns: per tensor, or in blocks along the rows' length (square
// ones for blockwise weights). Along the rows: its transposed().
Rank::Fp8Scaling scaling_of(Fp8Recipe recipe, bool square) {
  switch (recipe) {
    case Fp8Recipe::Blockwise:
      return {square ? kDeepSeekBlock : 1, kDeepSeekBlock, false};
    case Fp8Recipe::Mxfp8:
      return {1, kMxBlock, true};
    default:
      return {};
  }
}
}  // namespace

std::int64_t fp8_weight_bytes(Fp8Recipe recipe, const Shape& local, bool any_layout) {
  if (recipe == Fp8Recipe::None) return 0;
  if (recipe == Fp8Recipe::Current) return local.numel() * (any_layout ? 1 : 2);
  // Both layouts, each with its scales.
  const Rank::Fp8Scaling s = scaling_of(recipe, recipe == Fp8Recipe::Blockwise);
  return 2 * local.numel() + 4 * (s.scale_words(local) + s.transposed().scale_words(local));
}

std::int64_t fp8_kept_bytes(Fp8Recipe recipe, std::int64_t rows, std::int64_t cols) {
  return rows * cols + 4 * scaling_of(recipe, false).transposed().scale_words(Shape{rows, cols});
}

const char* fp8_recipe_name(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::None:
      return "none";
    case Fp8Recipe::Current:
      return "current";
    case Fp8Recipe::Blockwise:
      return "blockwise";
    case Fp8Recipe::Mxfp8:
      return "mxfp8";
    case Fp8Recipe::Delayed:
      return "delayed";
  }
  return "?";
}

Fp8::Fp8(Rank& r, Fp8Recipe recipe, bool keep_weights)
    : r_(r), recipe_(recipe), keep_weights_(keep_weights), any_layout_(r.profile().gpu.fp8_mx) {}

DType Fp8::gradient_format() const {
  // HYBRID: gradients, whose range is wider, in e5m2 under one scale per tensor; the block recipes keep
  // e4m3, whose small blocks follow the range closely (DeepSeek-V3, section 3.3.2).
  return recipe_ == Fp8Recipe::Current ? DType::Float8E5M2 : DType::Float8E4M3;
}

Fp8Operand Fp8::quantize(const Tensor& x, DType format, bool square, bool both,
                         const std::function<void(const Tensor&)>& reduce_amax) {
  Fp8Operand o;
  if (recipe_ == Fp8Recipe::Current) {
    // One scale: the layouts differ only in where the bytes lie, and a GPU that reads any layout needs one.
    const Tensor amax = r_.amax(x);
    if (reduce_amax) reduce_amax(amax);
    Rank::Quantized q = r_.quantize(x, format, Rank::Fp8Scaling{}, r_.fp8_scale(amax, format),
                                    both && !any_layout_, Tensor());
    o.along_cols = q.data;
    o.along_rows = q.columnwise.defined() ? q.columnwise : q.data;
    return o;
  }
  Rank::Quantized q = r_.quantize(x, format, scaling_of(recipe_, square), Tensor(), both, Tensor());
  o.along_cols = q.data;
  o.cols_scales = q.scales;
  o.along_rows = q.columnwise;
  o.rows_scales = q.columnwise_scales;
  return o;
}

Tensor Fp8::for_gemm(const Tensor& x, DType format, Use use) {
  if (use != Use::Wgrad || recipe_ == Fp8Recipe::Current) return quantize(x, format, false, false).along_cols;
  // Along the rows: the columns of x's transpose, quantized as the forward quantizes x.
  return r_.quantize(x, format, scaling_of(recipe_, false).transposed(), Tensor(), false, Tensor()).data;
}

Tensor Fp8::activation(const Tensor& x, Use use) {
  return for_gemm(x, DType::Float8E4M3, use);
}

Fp8Operand Fp8::input(const Tensor& x, const std::function<void(const Tensor&)>& reduce_amax) {
  return quantize(x, DType::Float8E4M3, false, true, reduce_amax);
}

Tensor Fp8::gradient(const Tensor& dy, Use use) {
  return for_gemm(dy, gradient_format(), use);
}

Fp8Operand Fp8::gradient(const Tensor& dy) {
  return quantize(dy, gradient_format(), false, true);
}

Fp8Operand Fp8::weight(const Tensor& w) {
  if (keep_weights_) {
    const auto kept = weights_.find(w.storage());
    if (kept != weights_.end()) return kept->second.second;
  }
  Fp8Operand q = quantize(w, DType::Float8E4M3, recipe_ == Fp8Recipe::Blockwise, true);
  // The entry keeps w, so its storage (the key) is not freed and reused while the entry stands.
  if (keep_weights_) weights_.emplace(w.storage(), std::make_pair(w, q));
  return q;
}

}  // namespace ranklab::parallel
