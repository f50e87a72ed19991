// What every lesson's check against one device shares: how far a rank's numbers are from the reference's
// (Agreement), the two ways of measuring it, recording a step's check, and the optimizer the one-device
// references train with.
//
//   - Against a rounding bound (within_bound): the reference carries, beside every number, how far a
//     float32 training may stray from it (lessons/mlp.h derives these bounds); an element further away than
//     its bound is wrong, whatever the world size, the dimensions or the optimizer.
//   - Relative to the tensor (add_relative): |got - want| over the tensor's largest |want|, against a
//     tolerance the lesson derives from its dtype and the length of its chains of operations.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/rank.h"

namespace ranklab::check {

// How far a rank's numbers are from the reference's: the worst element found, in the measure of its check
// (a fraction of the element's rounding bound, or a relative difference), and where it was.
// |got - want| / |want|, and 0 where they are equal: a loss of exactly 0 (a vocabulary of one token)
// agrees with a want of 0 instead of reading as 0/0; a got of anything else against 0 is infinitely off.
inline double relative_difference(double got, double want) {
  return got == want ? 0.0 : std::abs(got - want) / std::abs(want);
}

struct Agreement {
  double worst = 0;
  std::string where;  // that element: what it is, expected and actual with full digits

  // ---- relative differences
  // Keeps `difference` and `at` when it is the worst so far; NaN is worse than any number.
  void merge(double difference, const std::string& at);
  // Each element of `got` against `want`, relative to the largest |want| of the tensor; `cols` lays the
  // numbers out as rows to name the element ("expert 2 W1 gradient [3, 7]"). With `largest_so_far`,
  // relative to the largest |want| the tensor has had over the steps, which this updates: near a minimum a
  // gradient cancels (or a saturated softmax's vanishes) while what rounds in it does not shrink with it.
  // With `allowance`, each element may differ by that much more: what float32 can take it to where the
  // reference cannot tell which way it goes (a relu input within rounding of zero).
  void add_relative(const std::vector<float>& got, const std::vector<double>& want, const std::string& what,
                    std::int64_t cols, double* largest_so_far = nullptr,
                    const std::vector<double>* allowance = nullptr);

  // ---- against rounding bounds (within_bound)
  double max_abs = 0;  // the largest |got - want|, and the largest |want| of the same tensor: for the
  double scale = 0;    // relative difference the lessons print beside the check
  // A tensor (or the loss) whose bound reaches as far as its largest value admits numbers as large as the
  // values themselves: a wrong number may lie within it, so agreeing there proves nothing. Such tensors
  // are counted apart; the comparison decides on the others, or when anything is outside its bound.
  int tight = 0, loose = 0;   // tensors compared with a bound below their values, and the others
  double loosest = 0;         // the largest bound over the largest value, of the loosest tensor
  std::string loosest_where;  // that tensor, its largest bound and its largest value
  int undecided_steps = 0;    // counted by merge_step
  double relative() const;
  bool ok() const { return worst <= 1; }
  bool decided() const { return worst > 1 || tight > 0; }
  // Another comparison's figures into this one: its worst element if worse, its tensors counted.
  void merge(const Agreement& d);
  // Merges one step's Agreement into a run's, counting the steps that decided nothing.
  void merge_step(const Agreement& step) {
    merge(step);
    undecided_steps += step.decided() ? 0 : 1;
  }
};

// `got` against `want`, element by element, against the bound on how far float32 can take each: the
// Agreement's worst is the largest share of a bound used. `cols` lays the numbers out as rows for naming the
// worst element: "layer 2 weight [3, 7]".
Agreement within_bound(const std::vector<float>& got, const std::vector<float>& want,
                       const std::vector<float>& bound, const std::string& what, std::int64_t cols);
Agreement within_bound(double got, double want, double bound, const std::string& what);

// Records the check of one step ("<lesson> step <n>: <what> equal one device's") with its Agreement. A step
// the check cannot decide (every tensor within a bound as large as its values) is not recorded as passed:
// rank 0 prints why it was not decided instead. A decided step names the tensors it could not.
void record_step(Rank& r, const std::string& lesson, int step, const std::string& what, const Agreement& d,
                 const std::string& where = "");

// "yes (at worst 0.31 of float32's rounding bound; largest relative difference 1.2e-06)", from the worst
// of every rank's Agreement::worst and Agreement::relative().
// `decided` false: some step was not decided (Agreement::decided), and the line says so.
std::string agreement(double worst, double relative, bool decided = true);
// A step's word beside its loss: "ok", "DIFFERENT" or "not decided".
std::string verdict(const Agreement& d);

// ---- the references' optimizer

// One AdamW step of one element, in double, as Rank::adamw_step takes it on the device (Loshchilov &
// Hutter's decoupled weight decay and Kingma & Ba's bias-corrected moments, as torch.optim.AdamW): updates
// the moments `m` and `v` with the gradient `g` and returns the new weight. `c1` and `c2` are the bias
// corrections 1 - beta^step (adamw_corrections).
inline double adamw_element(double w, double g, double& m, double& v, double lr, double weight_decay,
                            const AdamW& h, double c1, double c2) {
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  return w - lr * ((m / c1) / (std::sqrt(v / c2) + h.eps) + weight_decay * w);
}
struct AdamWCorrections {
  double c1, c2;
};
inline AdamWCorrections adamw_corrections(const AdamW& h, int step) {
  return {1 - std::pow(static_cast<double>(h.beta1), step), 1 - std::pow(static_cast<double>(h.beta2), step)};
}
// A whole tensor's step: the moments start at zero when empty.
void adamw_step(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& m,
                std::vector<double>& v, double lr, double weight_decay, const AdamW& h, int step);

}  // namespace ranklab::check
