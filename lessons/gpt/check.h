// The GPT lesson's checks: every step's gradients, weight updates and loss against the one-device
// reference (reference.h), and what the run allocates against the memory plan made before it (accounting.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/rank.h"
#include "lessons/check.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/reference.h"
#include "lessons/parallel/groups.h"
#include "lessons/parallel/zero.h"

namespace ranklab::gpt {

// How close to the double-precision reference a run must come, per dtype. float32 keeps about 7 digits;
// the sums of a step (over tokens, features and micro-batches, in another order than the reference's) lose
// a few, and a bias gradient, a column sum that mostly cancels, loses more (4e-4 of its largest element
// with 8 layers on one device). bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%) and every
// activation and weight copy is rounded to it, so a gradient is good to a few percent and Adam's update,
// which divides by the gradient's size, can flip sign where a gradient is near zero. float16 has 11 bits.
// Gradients: largest error over the largest sum of an element's terms' magnitudes the tensor has had so far
// (Reference::grad_magnitude: sum_t |x_t dy_t| for dW = X^T dY, sum_t |dy_t xhat_t| for a norm's gain,
// sum_t |dy_t| for a bias). A gradient element sums a term per token; each term is rounded relatively (its
// operands are, in 16 or 8 bits) and the sum adds a rounding per addition, so the error is a multiple of the
// unit roundoff times that sum, not of the element's value: where the terms cancel (a bias's column, a
// layernorm gain's sum of dy xhat) the value can be far smaller than its error. Against the largest value,
// 100 steps with fp8 GEMMs read 0.64 at layer 1's ln2 gain; against the terms, 0.31. Over the tests' layouts
// (3 steps) the measure is at most 1.4e-6 in float32, 1.7e-3 in float16, 0.063 in bfloat16 and 0.09 with fp8
// GEMMs; the broken variants (--break) read 0.15 or more in float32 and 3 with fp8 GEMMs (dp-sum).
// Weights: the error of the step's update relative to the update, root of summed squares over the rank's
// parameters, against AdamW's step (in double) from the gradient the run holds: the gradient's own error is
// the gradient check's, and Adam, dividing by the gradient's size, would turn it into a full-size update
// where a gradient is rounding noise. Loss: error over the largest loss so far. The bounds stand above what
// correct runs read (the figures here), with the most room in float32, where every deliberate bug of --break
// reads 0.15 or more; bfloat16's 0.15 is over twice the most a correct run reads (0.063, also after a
// hundred steps), under what its breaks read (dropout-cp-rows 0.23, dropout-row 0.28). With FP8 GEMMs no
// bound on these measures separates every break from a correct run: a correct hundred steps read up to
// 0.31, and no-rope-backward (llama) and dropout-row read 0.48 and 0.30, so those two are caught in 16 and
// 32 bits only (separating them needs the rounding carried through the backward, not a sum per gradient).
// FP8 GEMMs (--fp8-recipe) round their inputs to 3 mantissa bits (e4m3, relative rounding 2^-4 = 6%) or 2
// (e5m2, 12.5%): over the layouts of the tests the gradients come within 0.09 of their terms' magnitudes
// (0.31 after a hundred steps) and the updates within 0.03 of the largest update (every recipe); the
// bounds are 0.5 and 0.7. Over the tests' layouts float32 updates come within 6e-6, bfloat16's within 0.03.
// What they name is in `name`.
struct Tolerance {
  double loss, grad, weight;
  std::string name;  // "bfloat16", "bfloat16 with fp8 GEMMs (current)"
};
Tolerance tolerance(const Config& c);
// A step is judged while the largest move of a softmax's inputs under the run's rounding
// (Reference::softmax_shift), which moves a softmax weight by up to e^shift - 1 ~ shift of itself and the
// gradient terms downstream with it, stays within this many times the gradient tolerance: the bound is a
// worst case, which rounding in practice reaches a fraction of. Correct runs of the tiny model over 100
// steps read at most 0.05 at the default learning rate and 0.21 at lr 0.01 in bf16 (tolerance 0.15), and
// pass; in fp16 (tolerance 0.05) at lr 0.03 the gradients first missed the tolerance at step 31, at a shift
// of about 0.19, and in bf16 at lr 0.03 at step 32, at 1.7.
inline constexpr double kSoftmaxShiftPerTolerance = 2.0;

// A rank's comparison with one device over the run. With phantom tensors there are no numbers to compare:
// it has no reference, compares nothing and records nothing.
class OneDeviceCheck {
 public:
  OneDeviceCheck(Rank& r, const Config& c, const parallel::Layout::Coord& me);
  bool compares() const { return ref_ != nullptr; }
  const Reference& reference() const { return *ref_; }

  // After step `step`: the rank's gradients and weights against the reference's, and on the last stage the
  // loss, summed over `dp_group` (one all_reduce).
  void compare_step(int step, Model& model, Group dp_group);
  // The three checks, each with the worst step.
  void record(bool has_head) const;

  // The worst over the steps of each kind of comparison; "every tensor equal" while nothing differs.
  check::Agreement grad, weight, loss;
  std::vector<double> losses;  // each step's, on the ranks that hold the head
  // A MoE model's routing against one device's over the steps (Reference::RoutingAgreement), summed over
  // the steps; the worst wrong route, or a close call.
  std::int64_t routed_tokens = 0, close_calls = 0, wrong_routes = 0;
  std::string routing_where;

 private:
  Rank& r_;
  const Config& c_;
  parallel::Layout::Coord me_;
  // The run's state after a step, whole on every rank: what the reference's next step starts from.
  Reference::State gather_state(Model& model);
  // Every MoE layer's routing of this step, whole on every rank (an all_reduce over the world).
  Reference::Routes gather_routes(Model& model);

  std::shared_ptr<Reference> ref_;
  Reference::State state_;
  // Near a minimum a gradient cancels and the loss falls, while what rounds does not shrink with them: the
  // terms a gradient sums, and the logits, which grow as the model grows confident. A gradient's error is
  // measured against the largest sum of an element's terms' magnitudes its tensor (or part of the fused qkv)
  // has had so far, the loss's against the largest loss so far, as a step's update is against the largest
  // update so far.
  std::map<std::tuple<int, int, int>, double> largest_grad_;  // by kind, layer and qkv part
  double largest_loss_ = 0;
  // Steps whose softmaxes the run's precision cannot resolve (Reference::softmax_shift above
  // kSoftmaxShiftPerTolerance times the gradient tolerance): how many, the first, and the largest shift.
  int unjudged_steps_ = 0, first_unjudged_ = 0;
  double largest_shift_ = 0;
  double largest_update_ =
      0;  // the largest squared norm of a step's update so far, over the rank's parameters
};

// The parameters (and data) a stage allocates, and what a micro-batch keeps for its backward on each of
// the rank's chunks (`stash_measured_bytes`, measured on step 1's micro-batch 0, of which the MoE layers'
// routed tokens take `routed_measured_bytes`), equal what `plan` says.
void check_memory_plan(Rank& r, const Config& c, const parallel::Layout::Coord& me, const MemoryPlan& plan,
                       std::int64_t model_bytes, const std::vector<std::int64_t>& stash_measured_bytes,
                       const std::vector<std::int64_t>& routed_measured_bytes);

}  // namespace ranklab::gpt
