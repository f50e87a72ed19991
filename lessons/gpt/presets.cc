#include "lessons/gpt/presets.h"

#include <fmt/format.h>

#include "common/errors.h"

namespace ranklab::gpt {

const std::vector<Preset>& presets() {
  // GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (layers, d_model, heads,
  // context 2048; batch in tokens / 2048). Where the table is inconsistent (XL: 24 heads of 128 in 2048;
  // 13B: d_model 5140) the heads are d_model / d_head and d_model 5120. Vocabulary: GPT-2's 50,257 BPE
  // tokens padded up as Megatron-LM pads it (to a multiple of 128 x tp): 51,200 divides by any tp up to 16
  // (a multiple of 1024 x 50).
  // Llama 3 8B: Meta's model card (github.com/meta-llama/llama3, MODEL_CARD.md) and Dubey et al. 2024,
  // Table 3: 32 layers, 4096, 32 heads, vocabulary 128,256, context 8192. Llama uses RMSNorm, SwiGLU
  // (14,336 wide) and grouped-query attention (8 key-value heads); this lesson's block is GPT's, so the
  // preset only fills the shape flags and the FLOPs and memory are those of a GPT of that shape. Its batch
  // (128 sequences, 1M tokens) is a choice of this preset, not of the source.
  // Llama 3 70B: the same sources: 80 layers, 8192, 64 heads (28,672-wide SwiGLU, 8 key-value heads in
  // the original); 512 sequences (4M tokens) is again this preset's choice.
  static const std::vector<Preset> all = {
      {"gpt3-125m", 12, 768, 12, 2048, 51200, 256, "Brown et al. 2020, Table 2.1 (GPT-3 Small, 0.5M tokens)"},
      {"gpt3-350m", 24, 1024, 16, 2048, 51200, 256,
       "Brown et al. 2020, Table 2.1 (GPT-3 Medium, 0.5M tokens)"},
      {"gpt3-1.3b", 24, 2048, 16, 2048, 51200, 512, "Brown et al. 2020, Table 2.1 (GPT-3 XL, 1M tokens)"},
      {"gpt3-2.7b", 32, 2560, 32, 2048, 51200, 512, "Brown et al. 2020, Table 2.1 (GPT-3 2.7B, 1M tokens)"},
      {"gpt3-6.7b", 32, 4096, 32, 2048, 51200, 1024, "Brown et al. 2020, Table 2.1 (GPT-3 6.7B, 2M tokens)"},
      {"gpt3-13b", 40, 5120, 40, 2048, 51200, 1024, "Brown et al. 2020, Table 2.1 (GPT-3 13B, 2M tokens)"},
      {"gpt3-175b", 96, 12288, 96, 2048, 51200, 1536,
       "Brown et al. 2020, Table 2.1 (GPT-3 175B; 3.2M tokens there, 1536 sequences as Megatron-LM's runs)"},
      {"megatron-1t", 128, 25600, 160, 2048, 51200, 3072,
       "Narayanan et al. 2021, Table 1 (the 1T model: 3,072 GPUs with tp 8, pp 64)"},
      {"llama3-8b", 32, 4096, 32, 8192, 128256, 128,
       "Meta Llama 3 model card; shape only (GPT block, not RMSNorm/SwiGLU/GQA)"},
      {"llama3-70b", 80, 8192, 64, 8192, 128256, 512,
       "Meta Llama 3 model card; shape only (GPT block, not RMSNorm/SwiGLU/GQA)"},
  };
  return all;
}

const Preset& find_preset(const std::string& name) {
  std::vector<std::string> names;
  for (const Preset& p : presets()) {
    if (p.name == name) return p;
    names.push_back(p.name);
  }
  throw UsageError(
      fmt::format("--model: no preset called '{}'; the presets are: {}", name, fmt::join(names, ", ")));
}

Settings preset_settings(const std::string& name) {
  if (name.empty()) return {};
  const Preset& p = find_preset(name);
  auto text = [](std::int64_t v) { return std::to_string(v); };
  return {{"layers", text(p.layers)}, {"hidden", text(p.hidden)}, {"heads", text(p.heads)},
          {"seq", text(p.seq)},       {"vocab", text(p.vocab)},   {"global-batch", text(p.global_batch)},
          {"micro-batch", "1"}};
}

const std::vector<Framework>& frameworks() {
  static const std::vector<Framework> all = {
      // Megatron-LM as Narayanan et al. 2021 ran it (SC'21; release v2.x): gradients all-reduced after the
      // backward, no distributed optimizer, blocking tensor-parallel collectives, and attention as batched
      // GEMMs around a fused scale-mask-softmax (megatron/model/fused_softmax.py; FlashAttention came in
      // 2022 and Megatron-LM took it up as --use-flash-attn in 2023).
      {"megatron-lm-2021", false, false, false, false,
       "Megatron-LM v2 (Narayanan et al. 2021): no gradient, parameter or tensor-parallel overlap; unfused "
       "attention"},
      // Korthikanti et al. 2022 (release v3.0) adds sequence parallelism and selective recompute, which
      // are layout flags here; the communication still waits, and attention is still unfused (selective
      // recompute exists because its s x s scores fill the memory).
      {"megatron-lm-2022", false, false, false, false,
       "Megatron-LM v3 (Korthikanti et al. 2022): no gradient, parameter or tensor-parallel overlap; unfused "
       "attention"},
      // Megatron-Core's performance settings, as NVIDIA's recipes set them (NeMo's
      // llm/recipes/tp_overlap_configs, Megatron-LM's --overlap-grad-reduce --overlap-param-gather
      // --tp-comm-overlap): bucketed gradient reduce-scatter during backward, parameter all-gather during
      // forward, TransformerEngine's userbuffers overlap where tp > 1 with sequence parallelism, and
      // TransformerEngine's fused attention (cuDNN / FlashAttention).
      {"megatron-core", true, true, true, true,
       "Megatron-Core (core_r0.9 and later) with --overlap-grad-reduce --overlap-param-gather "
       "--tp-comm-overlap"},
      // torchtitan's FSDP2 (docs/fsdp.md): reduce-scatter during backward and the next layer's all-gather
      // prefetched, forward and backward; asynchronous tensor parallelism off unless asked
      // (parallelism.enable_async_tensor_parallel defaults to false); attention by torch's
      // scaled_dot_product_attention, whose flash kernel it picks on these GPUs.
      {"torchtitan", true, true, false, true,
       "torchtitan with FSDP2 prefetching and overlapped reduce-scatter; async TP off (its default)"},
  };
  return all;
}

Settings framework_settings(const std::string& name) {
  if (name.empty()) return {};
  std::vector<std::string> names;
  for (const Framework& f : frameworks()) {
    if (f.name == name) {
      auto on = [](bool b) { return std::string(b ? "true" : "false"); };
      return {{"overlap-grad-reduce", on(f.overlap_grad_reduce)},
              {"overlap-param-gather", on(f.overlap_param_gather)},
              {"tp-comm-overlap", on(f.tp_comm_overlap)},
              {"attention", f.fused_attention ? "flash" : "unfused"}};
    }
    names.push_back(f.name);
  }
  throw UsageError(fmt::format("--framework: no framework called '{}'; the frameworks are: {}", name,
                               fmt::join(names, ", ")));
}

}  // namespace ranklab::gpt
