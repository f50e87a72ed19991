// The one-device reference for the GPT lesson: the same model trained on the whole global batch in plain
// C++ on the host, in double precision, with AdamW. It shares no code with the lesson's forward and
// backward (only the data and the initial values, which define the problem), so a wrong backward, a
// missing reduction or a mis-sliced shard all show up as a difference.
//
// Its own layout is the obvious one: row = sample * seq + position, qkv columns per head as the lesson's.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lessons/gpt/config.h"

namespace ranklab::gpt {

class Reference {
 public:
  // The training's state, every parameter of the full model in index() order: its values and Adam's two
  // moments.
  struct State {
    std::vector<std::vector<double>> w, m, v;
    bool operator==(const State&) const = default;
  };

  // A MoE model's routing as the run chose it: per layer every token's top-k experts (row-major, tokens in
  // the reference's order, k each); empty for a dense layer.
  using Routes = std::vector<std::vector<int>>;
  // How the run's routing agrees with the reference's own top-k. A route is a discrete choice: where two
  // experts' logits lie within the run's rounding of each other, either is right, and a 16-bit run often
  // takes the other one (a close call). A choice outside that bound is a wrong route (decisive).
  struct RoutingAgreement {
    std::int64_t tokens = 0, close_calls = 0, decisive = 0;
    std::string where;  // the worst wrong route, or the closest call
  };

  explicit Reference(const Config& c);
  // The reference for `c`'s model, data and optimizer, shared by the ranks of a run (made on first use).
  static std::shared_ptr<Reference> get(const Config& c);

  // Step `step` (from 1) from `from`, the run's state after step - 1 as the ranks hold it together (nullptr
  // at step 1: the initial values, which the run starts from too). Each step is checked from the run's own
  // state, not from the reference's previous step: training amplifies differences, and a correct 16-bit
  // run drifts from an exact trajectory step by step, while from the same start one step differs by its
  // roundings only. Every rank asks for the same step from the same state; it is computed once.
  // With `routes`, the MoE layers send each token to the run's experts (its gates the reference's own
  // softmax over them), so that a close call the run took the other way does not make every gradient
  // downstream differ; routing() says whether the run's choices are the reference's.
  void step(int step, const State* from, const Routes* routes = nullptr);
  const RoutingAgreement& routing() const { return routing_; }
  // Of the last step: the most the run's rounding of what goes into a softmax (each attention score, from
  // its rounded query and key; each logit, from the rounded final norm and output weight) can move it, 2 u
  // times the sum of its products' magnitudes. A softmax weight moves by up to e^shift with it, and the
  // terms of the gradients downstream with it: past what the gradient tolerance allows, no bound on their
  // rounding judges them (OneDeviceCheck then leaves the step unjudged and says so).
  double softmax_shift() const { return softmax_shift_; }
  // The mean over the step's tokens, before its update, of every step so far.
  double loss(int step) const { return losses_[step - 1]; }
  // Of the last step; kind: a BlockParam or LlamaParam, or kMostBlockParams + an OtherParam (then layer is
  // -1). Full tensors, row-major: the gradient, the values the step started from, and the values after its
  // update.
  const std::vector<double>& grad(int kind, int layer) const { return grads_[index(kind, layer)]; }
  // Beside each gradient element, the sum of the magnitudes of the terms the backward added into it (over
  // tokens, experts' routes and micro-batches: sum_t |x_t dy_t| for dW = X^T dY, sum_t |dy_t xhat_t| for a
  // norm's gain, sum_t |dy_t| for a bias), scaled by the clipping as the gradient is. A sum rounded in any
  // order, or of terms each rounded relatively, is off by at most a multiple of the unit roundoff of this.
  const std::vector<double>& grad_magnitude(int kind, int layer) const {
    return grad_magnitudes_[index(kind, layer)];
  }
  const std::vector<double>& before(int kind, int layer) const { return from_.w[index(kind, layer)]; }
  const std::vector<double>& weight(int kind, int layer) const { return after_.w[index(kind, layer)]; }
  // Adam's moments the step started from (the run's, after step - 1; zero at step 1).
  const std::vector<double>& m_before(int kind, int layer) const { return from_.m[index(kind, layer)]; }
  const std::vector<double>& v_before(int kind, int layer) const { return from_.v[index(kind, layer)]; }

  int index(int kind, int layer) const;
  int params() const { return static_cast<int>(initial_.w.size()); }
  std::int64_t numel(int index) const { return static_cast<std::int64_t>(initial_.w[index].size()); }

 private:
  Config c_;
  State initial_, from_, after_;
  int step_ = 0;  // the step from_, after_ and grads_ are of
  std::vector<std::vector<double>> grads_, grad_magnitudes_;
  std::vector<double> losses_;
  Routes routes_;
  RoutingAgreement routing_;
  double softmax_shift_ = 0;
  std::mutex mu_;
};

}  // namespace ranklab::gpt
