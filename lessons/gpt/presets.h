// Model presets: `--model NAME` fills the shape flags (and a batch) from a published configuration, and
// nothing else; flags given explicitly win.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/lesson.h"

namespace ranklab::gpt {

struct Preset {
  std::string name;
  int layers, hidden, heads, seq;
  std::int64_t vocab, global_batch;
  std::string source;
};
const std::vector<Preset>& presets();
// The preset called `name`, or UsageError listing them.
const Preset& find_preset(const std::string& name);

// Fills from the preset `o.model` names (none when empty) the shape flags, the global batch and a
// micro-batch of one sequence, except those `given("--layers")` (and so on) says were set explicitly.
// `ranklab run gpt --model` and `ranklab plan --model` both fill their options this way.
void apply_preset(Options& o, const std::function<bool(const std::string& flag)>& given);

}  // namespace ranklab::gpt
