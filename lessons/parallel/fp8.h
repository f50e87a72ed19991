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
//   delayed    one scale per tensor from the largest magnitudes of earlier passes (TransformerEngine's
//              DelayedScaling, transformer_engine/common/recipe/__init__.py: margin 0, amax_history_len
//              1024, amax_compute_algo "max", HYBRID format): every linear layer's input, weight and output
//              gradient keeps an amax history; its cast uses the scale the history gave before the pass and
//              records the tensor's amax as it casts, so no amax pass and no per-cast all-reduce precede it
//              (but in a tensor's first pass, which has no history and is scaled as current scaling does).
//              Values past the scale's range saturate at the format's largest. At the end of each forward
//              pass (TransformerEngine: the exit of fp8_autocast, which Megatron-LM enters once per
//              micro-batch and model chunk) the forward tensors' amaxes of the whole rank are all-reduced
//              together over the ranks that share the tensors, and the scales updated; at the end of each
//              backward pass the output gradients' (reduce_and_update_fp8_tensors(forward=False), which the
//              first FP8 module's backward calls). Under full recomputation a layer's input is cast again in
//              the backward with the scale its forward cast used, and records no amax, as
//              TransformerEngine copies a module's scales for the recompute and restores them after
//              (FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute): the recomputed
//              activations are the forward's
// A weight is quantized once per step, at its first use, and kept for the step's other micro-batches and its
// backward, as TransformerEngine keeps its FP8 weights across micro-batches; a weight gathered for each use
// (ZeRO 3) is quantized at each. Attention, the norms, the output layer and the optimizer stay in 16 bits.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <unordered_map>
#include <utility>

#include "common/rank.h"

namespace ranklab::parallel {

enum class Fp8Recipe { None, Current, Blockwise, Mxfp8, Delayed };
const char* fp8_recipe_name(Fp8Recipe r);

// DelayedScaling's defaults (transformer_engine/common/recipe/__init__.py): the amaxes a tensor's history
// holds, the current pass's included, and the margin (the scale is divided by 2^margin).
inline constexpr int kAmaxHistoryLen = 1024;
inline constexpr int kDelayedMargin = 0;

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

// The bytes of delayed scaling's state for `linears` linear layers (0 under the other recipes): each of a
// layer's three tensors (input, weight, output gradient) keeps its amax history, the current pass's amax
// its newest entry, and its scale, float32 each.
std::int64_t fp8_scaling_bytes(Fp8Recipe recipe, std::int64_t linears);

class Fp8 {
 public:
  // `keep_weights`: a weight tensor stays the same through a step (ZeRO 0 to 2), so its FP8 copies are made
  // once and reused; otherwise (ZeRO 3 gathers each use anew) at every use.
  // `phantom`: delayed scaling's state holds no numbers (a phantom run's).
  Fp8(Rank& r, Fp8Recipe recipe, bool keep_weights, bool phantom = false);
  // Forgets the step's quantized weights: the optimizer has changed them.
  void start_step() { weights_.clear(); }
  // Delayed scaling under full recomputation: each forward cast of a linear layer's input keeps the scale it
  // used, and between begin_recompute and end_recompute the layer's casts take those back in order (the
  // layer's micro-batches recompute in the order they ran forward) and record no amax.
  void keep_scales_for_recompute() { keep_for_recompute_ = true; }
  void begin_recompute() { recomputing_ = true; }
  void end_recompute() { recomputing_ = false; }

  // Delayed scaling: the linear layer the next casts belong to (any number that names it the same way on
  // every rank that shares its tensors), whose input, weight and output gradient keep their histories.
  void select(int linear) { linear_ = linear; }
  // Delayed scaling: makes linear layer `linear`'s histories now, as its first cast would. Every rank that
  // reduces its amaxes with others must hold the same histories in the same order; a linear layer that may
  // see no rows on some ranks (an expert no token was routed to) is declared on all of them. Nothing under
  // the other recipes.
  void declare(int linear);
  // Delayed scaling, after a forward or a backward pass: the pass's amaxes of the forward's tensors (inputs
  // and weights, e4m3) or of the backward's (output gradients, e5m2), of every linear layer of the rank,
  // packed into one tensor, reduced by `reduce_amaxes` (a max over the ranks that share them) and folded
  // into the histories and scales by one kernel. Nothing under the other recipes.
  enum class Pass { Forward, Backward };
  void end_pass(Pass pass);
  std::function<void(const Tensor&)> reduce_amaxes;

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
  // One scale for the whole tensor (current and delayed scaling), not one per block.
  bool per_tensor() const;
  // Which of a linear layer's tensors a cast is of: delayed scaling keeps a history for each.
  enum class Role { Input, Weight, Gradient };
  // x quantized along its columns (blocks 1 x block, or block x block when `square`) and, with `both`, along
  // its rows too; current scaling's amax first goes through `reduce_amax` when given.
  Fp8Operand quantize(const Tensor& x, DType format, Role role, bool square, bool both,
                      const std::function<void(const Tensor&)>& reduce_amax = nullptr);
  // x in `format` for one GEMM: along its columns, or for wgrad along its rows.
  Tensor for_gemm(const Tensor& x, DType format, Role role, Use use);
  // Delayed scaling's state of one tensor: the amaxes of earlier passes (newest first), the scale they
  // gave, and the amax the current pass's casts record.
  struct History {
    Tensor earlier, scale, amax;
    bool scaled = false;  // a pass has ended since the tensor's first cast: the history gives the scale
    std::deque<Tensor> for_recompute;  // the scales of the forward casts still to be recomputed
  };
  History& history(int linear, Role role);
  Rank& r_;
  Fp8Recipe recipe_;
  bool keep_weights_ = true;
  bool any_layout_ = false;  // the GPU's FP8 GEMMs read their inputs in any layout (Blackwell)
  bool phantom_ = false;
  bool keep_for_recompute_ = false, recomputing_ = false;
  int linear_ = 0;
  // By (linear layer, role): ordered, so that every rank packs its amaxes in the same order.
  std::map<std::pair<int, Role>, History> histories_;
  // The step's quantized weights, by the weight's storage (with the weight, which keeps it alive).
  std::unordered_map<const Storage*, std::pair<Tensor, Fp8Operand>> weights_;
};

}  // namespace ranklab::parallel
