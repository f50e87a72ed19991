// The one-device reference for the GPT lesson: the same model trained on the whole global batch in plain
// C++ on the host, in double precision, with AdamW. It shares no code with the lesson's forward and
// backward (only the data and the initial values, which define the problem), so a wrong backward, a
// missing reduction or a mis-sliced shard all show up as a difference.
//
// Its own layout is the obvious one: row = sample * seq + position, qkv columns per head as the lesson's.
// It is computed once per run, for every step, and shared by all ranks of a simulated run.
#pragma once

#include <memory>
#include <vector>

#include "lessons/gpt/config.h"

namespace ranklab::gpt {

class Reference {
 public:
  explicit Reference(const Config& c);
  // The reference for `c`'s model, data and optimizer, made on first use.
  static std::shared_ptr<const Reference> get(const Config& c);

  double loss(int step) const { return loss_[step - 1]; }  // mean over the step's tokens, before its update
  // kind: a BlockParam, or kBlockParams + an OtherParam (then layer is -1). Full tensors, row-major.
  const std::vector<double>& grad(int step, int kind, int layer) const;
  // After the step's update; step 0: the initial values.
  const std::vector<double>& weight(int step, int kind, int layer) const;

 private:
  int index(int kind, int layer) const;
  Config c_;
  std::vector<double> loss_;
  std::vector<std::vector<std::vector<double>>> grads_, weights_;  // [step][param]
};

}  // namespace ranklab::gpt
