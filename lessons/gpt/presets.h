// Model presets: `--model NAME` fills the shape flags (and a batch) from a published configuration, and
// nothing else; flags given explicitly win.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace ranklab::gpt
