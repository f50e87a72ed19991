#include "lessons/parallel/fp8.h"

#include <vector>

#include "common/errors.h"
#include "lessons/parallel/exposed.h"

namespace ranklab::parallel {

namespace {
// One scale for the whole tensor, not one per block.
bool per_tensor(Fp8Recipe r) {
  return r == Fp8Recipe::Current || r == Fp8Recipe::Delayed;
}
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
  if (per_tensor(recipe)) return local.numel() * (any_layout ? 1 : 2);
  // Both layouts, each with its scales.
  const Rank::Fp8Scaling s = scaling_of(recipe, recipe == Fp8Recipe::Blockwise);
  return 2 * local.numel() + 4 * (s.scale_words(local) + s.transposed().scale_words(local));
}

std::int64_t fp8_kept_bytes(Fp8Recipe recipe, std::int64_t rows, std::int64_t cols) {
  return rows * cols + 4 * scaling_of(recipe, false).transposed().scale_words(Shape{rows, cols});
}

std::int64_t fp8_scaling_bytes(Fp8Recipe recipe, std::int64_t linears) {
  if (recipe != Fp8Recipe::Delayed) return 0;
  return linears * 3 * (kAmaxHistoryLen + 1) * 4;
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

Fp8::Fp8(Rank& r, Fp8Recipe recipe, bool keep_weights, bool phantom)
    : r_(r),
      recipe_(recipe),
      keep_weights_(keep_weights),
      any_layout_(r.profile().gpu.fp8_mx),
      phantom_(phantom) {}

bool Fp8::per_tensor() const {
  return parallel::per_tensor(recipe_);
}

DType Fp8::gradient_format() const {
  // HYBRID: gradients, whose range is wider, in e5m2 under one scale per tensor; the block recipes keep
  // e4m3, whose small blocks follow the range closely (DeepSeek-V3, section 3.3.2).
  return per_tensor() ? DType::Float8E5M2 : DType::Float8E4M3;
}

Fp8::History& Fp8::history(int linear, Role role) {
  const auto [at, made] = histories_.try_emplace({linear, role});
  if (made) {
    // TransformerEngine starts every scale at 1 and every history at 0 (its fp8_meta's initial tensors).
    History& h = at->second;
    h.earlier = zeros(r_, phantom_, Shape{kAmaxHistoryLen - 1}, DType::Float32);
    h.scale = phantom_ ? r_.phantom(Shape{1}, DType::Float32) : r_.full(Shape{1}, 1.0f, DType::Float32);
    h.amax = zeros(r_, phantom_, Shape{1}, DType::Float32);
  }
  return at->second;
}

void Fp8::declare(int linear) {
  if (recipe_ != Fp8Recipe::Delayed) return;
  for (Role role : {Role::Input, Role::Weight, Role::Gradient}) history(linear, role);
}

void Fp8::end_pass(Pass pass) {
  if (recipe_ != Fp8Recipe::Delayed) return;
  std::vector<Tensor> earlier, scales, amaxes;
  for (auto& [key, h] : histories_) {
    if ((key.second == Role::Gradient) != (pass == Pass::Backward)) continue;
    earlier.push_back(h.earlier), scales.push_back(h.scale), amaxes.push_back(h.amax);
    h.scaled = true;  // the update below gives the scale from the history
  }
  if (amaxes.empty()) return;
  // One buffer and one all-reduce for all of them, as TransformerEngine's _global_amax_reduction packs
  // its amax buffer (torch.cat) before reducing it.
  const Tensor reduced = r_.cat(amaxes, 0);
  if (reduce_amaxes) reduce_amaxes(reduced);
  const DType format = pass == Pass::Backward ? gradient_format() : DType::Float8E4M3;
  r_.fp8_delayed_update(reduced, earlier, scales, amaxes, format, kDelayedMargin);
}

Fp8Operand Fp8::quantize(const Tensor& x, DType format, Role role, bool square, bool both,
                         const std::function<void(const Tensor&)>& reduce_amax) {
  Fp8Operand o;
  if (per_tensor()) {
    // One scale: the layouts differ only in where the bytes lie, and a GPU that reads any layout needs one.
    // Delayed scaling's is the history's, the same on every rank that shares the tensor (their amaxes were
    // reduced together), so the pieces of a sequence-parallel all-gather need no all-reduce of their own;
    // the cast records the tensor's amax for the next update.
    History* h = recipe_ == Fp8Recipe::Delayed ? &history(linear_, role) : nullptr;
    Tensor scale = h != nullptr ? h->scale : Tensor(), record = h != nullptr ? h->amax : Tensor();
    // A recomputed input: its forward's scale, and no amax (the pass's amaxes are the forward's).
    const bool recomputed = h != nullptr && role == Role::Input && recomputing_;
    if (recomputed) {
      if (h->for_recompute.empty()) throw Error("Fp8: a recomputed cast with no forward cast before it");
      scale = h->for_recompute.front();
      h->for_recompute.pop_front();
      record = Tensor();
    }
    // Current scaling, and a delayed tensor's first pass, which has no history: the cast is scaled by its
    // own amax (for delayed scaling as float8_experimental's enable_amax_init does, pytorch-labs/
    // float8_experimental PR 18; TransformerEngine casts with scale 1 instead, which leaves gradients of
    // 1e-4 in e5m2's subnormals: the tiny model's first step then misses the one-device check,
    // docs/lessons/gpt.md, "FP8").
    if (!recomputed && (h == nullptr || !h->scaled)) {
      const Tensor amax = r_.amax(x);
      if (reduce_amax) reduce_amax(amax);
      const Tensor own = r_.fp8_scale(amax, format);
      if (h == nullptr) {
        scale = own;
      } else {
        r_.copy_(h->scale, own);
      }
    }
    Rank::Quantized q = r_.quantize(x, format, Rank::Fp8Scaling{}, scale, both && !any_layout_, record);
    if (h != nullptr && role == Role::Input && keep_for_recompute_ && !recomputed)
      h->for_recompute.push_back(r_.cast(scale, DType::Float32));
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

Tensor Fp8::for_gemm(const Tensor& x, DType format, Role role, Use use) {
  if (use != Use::Wgrad || per_tensor()) return quantize(x, format, role, false, false).along_cols;
  // Along the rows: the columns of x's transpose, quantized as the forward quantizes x.
  return r_.quantize(x, format, scaling_of(recipe_, false).transposed(), Tensor(), false, Tensor()).data;
}

Tensor Fp8::activation(const Tensor& x, Use use) {
  return for_gemm(x, DType::Float8E4M3, Role::Input, use);
}

Fp8Operand Fp8::input(const Tensor& x, const std::function<void(const Tensor&)>& reduce_amax) {
  return quantize(x, DType::Float8E4M3, Role::Input, false, true, reduce_amax);
}

Tensor Fp8::gradient(const Tensor& dy, Use use) {
  return for_gemm(dy, gradient_format(), Role::Gradient, use);
}

Fp8Operand Fp8::gradient(const Tensor& dy) {
  return quantize(dy, gradient_format(), Role::Gradient, false, true);
}

Fp8Operand Fp8::weight(const Tensor& w) {
  if (keep_weights_) {
    const auto kept = weights_.find(w.storage());
    if (kept != weights_.end()) return kept->second.second;
  }
  Fp8Operand q = quantize(w, DType::Float8E4M3, Role::Weight, recipe_ == Fp8Recipe::Blockwise, true);
  // The entry keeps w, so its storage (the key) is not freed and reused while the entry stands.
  if (keep_weights_) weights_.emplace(w.storage(), std::make_pair(w, q));
  return q;
}

}  // namespace ranklab::parallel
