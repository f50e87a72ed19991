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
  // The Llama presets have the llama block, each from its model's config.json as Meta published it
  // (huggingface.co/meta-llama: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
  // num_key_value_heads, vocab_size, rope_theta) and its paper's context length:
  //   Llama 2 (Touvron et al. 2023, "Llama 2", Table 1 and section 2.2): context 4096, a global batch of 4M
  //   tokens (1,024 sequences); 7B with multi-head attention, 70B with 8 key-value heads.
  //   Llama 3 8B and 70B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3; the model card,
  //   github.com/meta-llama/llama3): context 8192; the paper gives no batch for them, so 1M and 4M tokens
  //   (128 and 512 sequences) are this preset's choice.
  //   Llama 3.1 405B (the same paper, Table 3 and section 3.4.1): 126 layers, 16,384 wide, 128 heads, 8
  //   key-value heads, SwiGLU 53,248, pre-trained at context 8192 with batches of 16M tokens (2,048
  //   sequences). Its rope_theta is 500,000; the long-context frequency scaling of 3.1's rope_scaling
  //   changes the numbers, not the cost, and is left out.
  // Mistral NeMo 12B (huggingface.co/mistralai, Mistral-Nemo-Base-2407 config.json): the llama block with 32
  // heads of 128 features (head_dim) beside a hidden size of 5120, 8 key-value heads, rope_theta 1e6, no
  // sliding window; it publishes no training batch: 4096 tokens and 4M a batch are this preset's choice.
  // Qwen2.5 7B and 72B (huggingface.co/Qwen, Qwen2.5-7B and Qwen2.5-72B config.json; Qwen2's modelling code
  // puts a bias on the q, k and v projections alone): 28 heads over 4 key-value heads of 128 beside 3584, and
  // 64 over 8 beside 8192, rope_theta 1e6, untied output layers. Qwen publishes no training batch: 4096
  // tokens and 4M a batch are this preset's choice.
  // The mixtures of experts, from their config.json (num_local_experts, num_experts_per_tok,
  // intermediate_size of each expert) with every layer MoE:
  //   Mixtral 8x7B and 8x22B (Jiang et al. 2024, "Mixtral of Experts"; huggingface.co/mistralai
  //   Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1): 8 experts, top 2, rope_theta 1e6. The paper gives no
  //   sequence length or batch for training: 4096 and 4M tokens (1,024 sequences) are this preset's choice.
  //   Qwen3-30B-A3B and Qwen3-235B-A22B (huggingface.co/Qwen, config.json): 128 experts, top 8, heads of 128
  //   features (head_dim) beside hidden sizes of 2048 and 4096, and an RMSNorm over each head's queries and
  //   keys (QK-norm: q_norm and k_norm in the model's code); no training batch published, so 4096 tokens
  //   and 4M a batch are this preset's choice. DeepSeek-V3 (DeepSeek-AI 2024, config.json):
  //   multi-head latent attention, an expert bias that balances the load without a loss, and a multi-token
  //   prediction head, none built: it refuses too.
  //   gpt-oss-120b and gpt-oss-20b (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", and their
  //   config.json): 36 and 24 layers of 128 and 32 experts, top 4, each 2880 wide; attention of 64 heads
  //   of 64 features over 8 key-value heads beside a hidden size of 2880, learned sinks, a 128-token
  //   sliding window in every other layer from layer 0, biases on every linear layer, the router and the
  //   experts; its gated unit clamped at 7 with quick GELU and the value offset by 1 (its model code's
  //   swiglu); rope_theta 150000. Its YaRN scaling of the rotary frequencies (factor 32 from 4096 tokens)
  //   changes the numbers, not the cost, and is left out. OpenAI publishes no training batch: 4096 tokens
  //   and 4M a batch are this preset's choice.
  static const Settings gpt_oss = {{"sliding-window", "128"},   {"sliding-window-layers", "every:2"},
                                   {"attention-sinks", "true"}, {"add-bias-linear", "true"},
                                   {"quick-geglu", "true"},     {"activation-func-clamp-value", "7"},
                                   {"glu-linear-offset", "1"}};
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
      {"llama2-7b", 32, 4096, 32, 4096, 32000, 1024,
       "Llama-2-7b config.json; Touvron et al. 2023 (4M tokens)", 32, 11008, 10000},
      {"llama2-70b", 80, 8192, 64, 4096, 32000, 1024,
       "Llama-2-70b config.json; Touvron et al. 2023 (4M tokens)", 8, 28672, 10000},
      {"llama3-8b", 32, 4096, 32, 8192, 128256, 128,
       "Meta-Llama-3-8B config.json; Dubey et al. 2024, Table 3", 8, 14336, 500000},
      {"llama3-70b", 80, 8192, 64, 8192, 128256, 512,
       "Meta-Llama-3-70B config.json; Dubey et al. 2024, Table 3", 8, 28672, 500000},
      {"llama3.1-405b", 126, 16384, 128, 8192, 128256, 2048,
       "Meta-Llama-3.1-405B config.json; Dubey et al. 2024, Table 3 (16M tokens)", 8, 53248, 500000},
      {"qwen2.5-7b", 28, 3584, 28, 4096, 152064, 1024,
       "Qwen2.5-7B config.json (4M tokens: this preset's choice)", 4, 18944, 1e6, 0, 0, "", 0, false, true},
      {"qwen2.5-72b", 80, 8192, 64, 4096, 152064, 1024,
       "Qwen2.5-72B config.json (4M tokens: this preset's choice)", 8, 29568, 1e6, 0, 0, "", 0, false, true},
      {"mixtral-8x7b", 32, 4096, 32, 4096, 32000, 1024,
       "Mixtral-8x7B-v0.1 config.json; Jiang et al. 2024 (4M tokens: this preset's choice)", 8, 14336, 1e6, 8,
       2},
      {"mixtral-8x22b", 56, 6144, 48, 4096, 32768, 1024,
       "Mixtral-8x22B-v0.1 config.json (4M tokens: this preset's choice)", 8, 16384, 1e6, 8, 2},
      {"mistral-nemo-12b", 40, 5120, 32, 4096, 131072, 1024,
       "Mistral-Nemo-Base-2407 config.json (4M tokens: this preset's choice)", 8, 14336, 1e6, 0, 0, "", 128},
      {"qwen3-30b-a3b", 48, 2048, 32, 4096, 151936, 1024,
       "Qwen3-30B-A3B config.json (4M tokens: this preset's choice)", 4, 768, 1e6, 128, 8, "", 128, true},
      {"qwen3-235b-a22b", 94, 4096, 64, 4096, 151936, 1024,
       "Qwen3-235B-A22B config.json (4M tokens: this preset's choice)", 4, 1536, 1e6, 128, 8, "", 128, true},
      {"deepseek-v3", 61, 7168, 128, 4096, 129280, 1024, "DeepSeek-V3 config.json", 128, 2048, 10000, 256, 8,
       "multi-head latent attention, the expert bias of its auxiliary-loss-free balancing and the "
       "multi-token prediction head are not built"},
      {"gpt-oss-120b", 36, 2880, 64, 4096, 201088, 1024,
       "gpt-oss-120b config.json; OpenAI 2025 model card (4M tokens: this preset's choice)", 8, 2880, 150000,
       128, 4, "", 64, false, false, gpt_oss},
      {"gpt-oss-20b", 24, 2880, 64, 4096, 201088, 1024,
       "gpt-oss-20b config.json; OpenAI 2025 model card (4M tokens: this preset's choice)", 8, 2880, 150000,
       32, 4, "", 64, false, false, gpt_oss},
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
  if (!p.missing.empty()) {
    throw UsageError(fmt::format("--model {}: {} ({}); ranklab refuses it rather than approximate it", name,
                                 p.missing, p.source));
  }
  auto text = [](std::int64_t v) { return std::to_string(v); };
  Settings out = {{"block", p.kv_heads > 0 ? "llama" : "gpt"},
                  {"layers", text(p.layers)},
                  {"hidden", text(p.hidden)},
                  {"heads", text(p.heads)},
                  {"seq", text(p.seq)},
                  {"vocab", text(p.vocab)},
                  {"global-batch", text(p.global_batch)},
                  {"micro-batch", "1"}};
  if (p.kv_heads > 0) {
    out["kv-heads"] = text(p.kv_heads);
    out["ffn-hidden"] = text(p.ffn_hidden);
    out["rope-theta"] = fmt::format("{}", p.rope_theta);
    if (p.kv_channels > 0) out["kv-channels"] = text(p.kv_channels);
    if (p.qk_layernorm) out["qk-layernorm"] = "true";
    if (p.qkv_bias) out["add-qkv-bias"] = "true";
  }
  if (p.experts > 0) {
    out["experts"] = text(p.experts);
    out["top-k"] = text(p.top_k);
  }
  for (const auto& [flag, value] : p.extra) out[flag] = value;
  return out;
}

const std::vector<Framework>& frameworks() {
  static const std::vector<Framework> all = {
      // Megatron-LM as Narayanan et al. 2021 ran it (SC'21; release v2.x): gradients all-reduced after the
      // backward, no distributed optimizer, blocking tensor-parallel collectives, and attention as batched
      // GEMMs around a fused scale-mask-softmax (megatron/model/fused_softmax.py; FlashAttention came in
      // 2022 and Megatron-LM took it up as --use-flash-attn in 2023). Each weight gradient is a GEMM's
      // output added to the float32 gradient by a separate kernel: gradient-accumulation fusion came in
      // February 2022 (Megatron-LM commit 83b1e42, "gradient accumulation fusion"), and the column-parallel
      // backward's asynchronous all-reduce in September 2021 (commit cf7efd4, on by default from 3f65246).
      {"megatron-lm-2021", false, false, false, false, false, false, false,
       "Megatron-LM v2 (Narayanan et al. 2021): no gradient, parameter or tensor-parallel overlap; unfused "
       "attention"},
      // Korthikanti et al. 2022 (release v3.0) adds sequence parallelism and selective recompute, which
      // are layout flags here; the communication still waits, and attention is still unfused (selective
      // recompute exists because its s x s scores fill the memory). The weight-gradient GEMMs sum into the
      // float32 gradients (gradient-accumulation fusion, on by default since February 2022:
      // --no-gradient-accumulation-fusion turns it off). The column-parallel backward's collectives run
      // beside its GEMMs (--no-async-tensor-model-parallel-allreduce turns the all-reduce's off; with
      // sequence parallelism the all-gather and reduce-scatter always do, commit 02bb1f5).
      {"megatron-lm-2022", false, false, false, false, true, true, false,
       "Megatron-LM v3 (Korthikanti et al. 2022): no gradient or parameter overlap; the tensor-parallel "
       "backward's collectives beside its GEMMs; unfused attention; gradient-accumulation fusion"},
      // Megatron-Core's performance settings, as NVIDIA's recipes set them (NeMo's
      // llm/recipes/tp_overlap_configs, Megatron-LM's --overlap-grad-reduce --overlap-param-gather
      // --tp-comm-overlap): bucketed gradient reduce-scatter during backward, parameter all-gather during
      // forward, TransformerEngine's userbuffers overlap where tp > 1 with sequence parallelism, and
      // TransformerEngine's fused attention (cuDNN / FlashAttention), and gradient-accumulation fusion
      // (Megatron-Core's default, TransformerEngine's fuse_wgrad_accumulation); where the userbuffers do not
      // apply, the column-parallel backward's collectives beside its GEMMs (TransformerEngine's Linear and
      // Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication both do). With the interleaved
      // schedule, each pipeline receive posted a task early (overlap_p2p_comm: added in Megatron-LM commit
      // f9283c5, May 2023, on by default since 4eeff55, October 2023; --no-overlap-p2p-communication turns
      // it off, and Megatron-LM turns it off without interleaving).
      {"megatron-core", true, true, true, true, true, true, true,
       "Megatron-Core (core_r0.9 and later) with --overlap-grad-reduce --overlap-param-gather "
       "--tp-comm-overlap, gradient-accumulation fusion and, interleaved, --overlap-p2p-communication"},
      // torchtitan's FSDP2 (docs/fsdp.md): reduce-scatter during backward and the next layer's all-gather
      // prefetched, forward and backward; asynchronous tensor parallelism off unless asked
      // (parallelism.enable_async_tensor_parallel defaults to false); attention by torch's
      // scaled_dot_product_attention, whose flash kernel it picks on these GPUs. Autograd makes each weight
      // gradient a tensor of its own: no gradient-accumulation fusion; and autograd reduces a column-parallel
      // layer's input gradient after its node has made both gradients. Its pipeline schedules
      // (torch.distributed.pipelining) post a stage's receives for its next action and wait for them
      // before it: no receive a task early.
      {"torchtitan", true, true, false, true, false, false, false,
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
              {"attention", f.fused_attention ? "flash" : "unfused"},
              {"gradient-accumulation-fusion", on(f.grad_accum_fusion)},
              {"async-tensor-model-parallel-allreduce", on(f.async_tp_allreduce)},
              {"overlap-p2p-communication", on(f.overlap_p2p_comm)}};
    }
    names.push_back(f.name);
  }
  throw UsageError(fmt::format("--framework: no framework called '{}'; the frameworks are: {}", name,
                               fmt::join(names, ", ")));
}

}  // namespace ranklab::gpt
