// Model presets: `--model NAME` fills the shape flags (and a batch) from a published configuration, and
// nothing else; flags given explicitly win.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/lesson.h"

namespace ranklab::gpt {

struct Preset {
  std::string name;
  int layers, hidden, heads, seq;
  std::int64_t vocab, global_batch;
  std::string source;
  // The llama block's own (left at 0 for a GPT block).
  int kv_heads = 0;
  std::int64_t ffn_hidden = 0;
  double rope_theta = 0;
  // A mixture of experts' (0 experts: dense): every layer MoE, each expert ffn_hidden wide.
  int experts = 0, top_k = 0;
  // Why the preset cannot be run as published, where ranklab lacks a part of the model: the preset refuses
  // with this instead of approximating it.
  std::string missing = {};
  int kv_channels = 0;        // the llama block's features per head where they are not hidden / heads
  bool qk_layernorm = false;  // the llama block's QK-norm
  bool qkv_bias = false;      // the llama block's bias on wqkv (Qwen2)
  Settings extra = {};        // further flags, as the command line spells them (gpt-oss's attention and MLP)
};
const std::vector<Preset>& presets();
// The preset called `name`, or UsageError listing them.
const Preset& find_preset(const std::string& name);

// What `--model NAME` sets: the shape flags, the global batch and a micro-batch of one sequence, as the
// command line would spell them (none for ""); UsageError for a name that is no preset. The gpt lesson's
// table declares it as what --model expands to, so that flags given explicitly win, for `ranklab run gpt`
// and `ranklab plan` alike.
Settings preset_settings(const std::string& name);

// Framework presets: `--framework NAME` sets the overlap flags as a framework's release runs them, and
// nothing else; flags given explicitly win.
struct Framework {
  std::string name;
  bool overlap_grad_reduce, overlap_param_gather, tp_comm_overlap;
  bool fused_attention;
  bool grad_accum_fusion;
  bool async_tp_allreduce;
  bool overlap_p2p_comm;
  std::string source;
};
const std::vector<Framework>& frameworks();
// What `--framework NAME` sets (none for ""); UsageError listing the frameworks for another name.
Settings framework_settings(const std::string& name);

}  // namespace ranklab::gpt
