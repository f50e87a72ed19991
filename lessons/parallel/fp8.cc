#include "lessons/parallel/fp8.h"

namespace ranklab::parallel {

namespace {
// DeepSeek-V3's block (section 3.3.1: 1 x 128 tiles of activations, 128 x 128 blocks of weights) and the OCP
// Microscaling specification's (v1.0, 2023: 32 elements share a scale).
constexpr int kDeepSeekBlock = 128;
constexpr int kMxBlock = 32;

std::int64_t blocks_of(const Shape& s, std::int64_t block_rows, std::int64_t block_cols) {
  return ((s[0] + block_rows - 1) / block_rows) * ((s[1] + block_cols - 1) / block_cols);
}
}  // namespace

std::int64_t fp8_weight_bytes(Fp8Recipe recipe, const Shape& local, bool any_layout) {
  if (recipe == Fp8Recipe::None) return 0;
  if (recipe == Fp8Recipe::Current) return local.numel() * (any_layout ? 1 : 2);
  // Both layouts, each with its scales in float32 words (Rank::Quantized): 4 bytes a block, or for MX's
  // E8M0 scales one byte a block, four to a word.
  const std::int64_t rows_block = recipe == Fp8Recipe::Blockwise ? kDeepSeekBlock : 1;
  const std::int64_t cols_block = recipe == Fp8Recipe::Blockwise ? kDeepSeekBlock : kMxBlock;
  auto scale_bytes = [&](std::int64_t blocks) {
    return recipe == Fp8Recipe::Mxfp8 ? (blocks + 3) / 4 * 4 : 4 * blocks;
  };
  return 2 * local.numel() + scale_bytes(blocks_of(local, rows_block, cols_block)) +
         scale_bytes(blocks_of(local, cols_block, rows_block));
}

std::int64_t fp8_kept_bytes(Fp8Recipe recipe, std::int64_t rows, std::int64_t cols) {
  if (recipe == Fp8Recipe::Current || recipe == Fp8Recipe::None) return rows * cols;
  const std::int64_t block = recipe == Fp8Recipe::Blockwise ? kDeepSeekBlock : kMxBlock;
  const std::int64_t blocks = blocks_of(Shape{rows, cols}, block, 1);
  return rows * cols + (recipe == Fp8Recipe::Mxfp8 ? (blocks + 3) / 4 * 4 : 4 * blocks);
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

int Fp8::block() const {
  return recipe_ == Fp8Recipe::Mxfp8 ? kMxBlock : kDeepSeekBlock;
}

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
    Rank::Quantized q =
        r_.quantize(x, format, Rank::Fp8Scaling{}, r_.fp8_scale(amax, format), both && !any_layout_);
    o.along_cols = q.data;
    o.along_rows = q.columnwise.defined() ? q.columnwise : q.data;
    return o;
  }
  const Rank::Fp8Scaling blocks{square ? block() : 1, block(), recipe_ == Fp8Recipe::Mxfp8};
  Rank::Quantized q = r_.quantize(x, format, blocks, Tensor(), both);
  o.along_cols = q.data;
  o.cols_scales = q.scales;
  o.along_rows = q.columnwise;
  o.rows_scales = q.columnwise_scales;
  return o;
}

Tensor Fp8::quantize_along_rows(const Tensor& x, DType format) {
  if (recipe_ == Fp8Recipe::Current) return quantize(x, format, false, false).along_cols;
  return r_.quantize(x, format, Rank::Fp8Scaling{block(), 1, recipe_ == Fp8Recipe::Mxfp8}, Tensor(), false)
      .data;
}

Tensor Fp8::activation(const Tensor& x, Use use) {
  if (use == Use::Wgrad) return quantize_along_rows(x, DType::Float8E4M3);
  return quantize(x, DType::Float8E4M3, false, false).along_cols;
}

Fp8Operand Fp8::input(const Tensor& x, const std::function<void(const Tensor&)>& reduce_amax) {
  return quantize(x, DType::Float8E4M3, false, true, reduce_amax);
}

Tensor Fp8::gradient(const Tensor& dy, Use use) {
  if (use == Use::Wgrad) return quantize_along_rows(dy, gradient_format());
  return quantize(dy, gradient_format(), false, false).along_cols;
}

Fp8Operand Fp8::gradient(const Tensor& dy) {
  return quantize(dy, gradient_format(), false, true);
}

Fp8Operand Fp8::weight(const Tensor& w) {
  if (keep_weights_) {
    for (const auto& [t, q] : weights_) {
      if (t.same_storage(w)) return q;
    }
  }
  Fp8Operand q = quantize(w, DType::Float8E4M3, recipe_ == Fp8Recipe::Blockwise, true);
  if (keep_weights_) weights_.emplace_back(w, q);
  return q;
}

}  // namespace ranklab::parallel
