// FP8 training as TransformerEngine runs a linear layer (Micikevicius et al. 2022, "FP8 Formats for Deep
// Learning"; NVIDIA TransformerEngine's recipes): each of the layer's three GEMMs takes its two inputs in
// an 8-bit format, scaled into the format's range, and multiplies them at twice the 16-bit tensor-core rate.
//
//   forward  y  = x  @ W      x and W in e4m3          (contraction over x's columns, W's rows)
//   dgrad    dx = dy @ W^T    dy in e5m2 or e4m3, W    (over dy's columns, W's columns)
//   wgrad    dW = x^T @ dy                             (over the tokens: x's and dy's rows)
//
// A scale applies to the elements a GEMM sums together, so a block-scaled tensor is quantized along the
// dimension its GEMM contracts: x along its columns for the forward and along its rows for wgrad, W along
// its rows for the forward and along its columns for dgrad. Per-tensor scaling has one scale either way;
// Hopper's FP8 GEMMs read both inputs k-major, so the copy a GEMM reads transposed is written too
// (Blackwell's read any layout). The recipes:
//   current    one scale per tensor from the tensor's own largest magnitude (an amax pass, then the cast);
//              e4m3 forward, e5m2 gradients (TransformerEngine's Float8CurrentScaling, HYBRID format)
//   blockwise  DeepSeek-V3's (DeepSeek-AI 2024, section 3.3): 1 x 128 blocks of activations and gradients,
//              128 x 128 of weights, every tensor in e4m3, float32 scales (Float8BlockScaling)
//   mxfp8      the OCP Microscaling format: 1 x 32 blocks with power-of-two scales, e4m3, Blackwell only
//              (MXFP8BlockScaling)
// A weight is quantized once per step, at its first use, and kept for the step's other micro-batches and its
// backward, as TransformerEngine keeps its FP8 weights across micro-batches; a weight gathered for each use
// (ZeRO 3) is quantized at each. Attention, the norms, the output layer and the optimizer stay in 16 bits.
#pragma once

#include <functional>
#include <unordered_map>
#include <utility>

#include "common/rank.h"

namespace ranklab::parallel {

// Delayed: TransformerEngine's DelayedScaling (each tensor's scale from an amax history of earlier steps),
// which the lesson names and refuses: it is not built.
enum class Fp8Recipe { None, Current, Blockwise, Mxfp8, Delayed };
const char* fp8_recipe_name(Fp8Recipe r);

// One tensor's FP8 copies, each with its scales along the dimension a GEMM contracts, and the block scales'
// memory of each.
struct Fp8Operand {
  Tensor along_cols;  // for a GEMM summing over its columns (x and dy in forward and dgrad, W in dgrad)
  Tensor along_rows;  // for a GEMM summing over its rows (x and dy in wgrad, W in forward)
  Tensor cols_scales, rows_scales;
};

// The bytes of a weight's FP8 copies as Fp8::weight makes them: one copy per layout the GPU needs (one for
// per-tensor scaling on a GPU that reads any layout, else two) and the block scales' memory.
std::int64_t fp8_weight_bytes(Fp8Recipe recipe, const Shape& local, bool any_layout);

// The bytes of what a linear layer keeps of its [rows, cols] input in FP8 (TensorParallel::Kept): the
// input quantized along its rows, and that layout's block scales.
std::int64_t fp8_kept_bytes(Fp8Recipe recipe, std::int64_t rows, std::int64_t cols);

class Fp8 {
 public:
  // `keep_weights`: a weight tensor stays the same through a step (ZeRO 0 to 2), so its FP8 copies are made
  // once and reused; otherwise (ZeRO 3 gathers each use anew) at every use.
  Fp8(Rank& r, Fp8Recipe recipe, bool keep_weights);
  // Forgets the step's quantized weights: the optimizer has changed them.
  void start_step() { weights_.clear(); }

  // Which GEMM an activation or an output gradient goes into: the forward and dgrad sum over its columns,
  // wgrad over its rows.
  enum class Use { Forward, Dgrad, Wgrad };
  Tensor activation(const Tensor& x, Use use);
  // A linear layer's input for its forward and its weight gradient, in one pass: what the layer keeps for
  // its backward is along_rows, in one byte an element instead of two, as TransformerEngine keeps it.
  // `reduce_amax`, when given, makes the per-tensor largest value the group's (an all-reduce of its max):
  // the pieces a sequence-parallel all-gather puts together then share their scale, as one GEMM input must.
  Fp8Operand input(const Tensor& x, const std::function<void(const Tensor&)>& reduce_amax);
  Tensor gradient(const Tensor& dy, Use use);
  // An output gradient for dgrad and wgrad both, in one pass.
  Fp8Operand gradient(const Tensor& dy);
  // A weight, for the forward (along_rows) and dgrad (along_cols).
  Fp8Operand weight(const Tensor& w);

 private:
  DType gradient_format() const;
  // x quantized along its columns (blocks 1 x block, or block x block when `square`) and, with `both`, along
  // its rows too; per-tensor scaling's amax first goes through `reduce_amax` when given.
  Fp8Operand quantize(const Tensor& x, DType format, bool square, bool both,
                      const std::function<void(const Tensor&)>& reduce_amax = nullptr);
  // x in `format` for one GEMM: along its columns, or for wgrad along its rows.
  Tensor for_gemm(const Tensor& x, DType format, Use use);
  Rank& r_;
  Fp8Recipe recipe_;
  bool keep_weights_ = true;
  bool any_layout_ = false;  // the GPU's FP8 GEMMs read their inputs in any layout (Blackwell)
  // The step's quantized weights, by the weight's storage (with the weight, which keeps it alive).
  std::unordered_map<const Storage*, std::pair<Tensor, Fp8Operand>> weights_;
};

}  // namespace ranklab::parallel
