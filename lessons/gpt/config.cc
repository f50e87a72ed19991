#include "lessons/gpt/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/errors.h"
#include "lessons/gpt/presets.h"
#include "lessons/parallel/expert_parallel.h"
#include "lessons/parallel/groups.h"

namespace ranklab::gpt {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
  }
  return "?";
}

const char* cp_comm_name(CpComm m) {
  return m == CpComm::AllGather ? "all-gather" : "p2p";
}

const char* block_name(Block b) {
  return b == Block::Llama ? "llama" : "gpt";
}

std::string Config::layout() const {
  std::string s = fmt::format("tp {}{}{} x pp {}{} x dp {}, zero {}, recompute {}, {}", tp,
                              seq_parallel ? " (seq-parallel)" : "",
                              cp > 1 ? fmt::format(" x cp {} ({})", cp, cp_comm_name(cp_comm)) : "", pp,
                              v > 1 ? fmt::format(" (interleave {})", v) : "", dp, zero,
                              recompute_name(recompute), dtype_name(dtype));
  if (moe())
    s += fmt::format(", ep {} ({} expert{} each{})", ep, local_experts(), local_experts() > 1 ? "s" : "",
                     etp > 1 ? fmt::format(", split over etp {}", etp) : "");
  if (moe() && capacity_factor > 0) s += fmt::format(", capacity factor {}", capacity_factor);
  if (moe() && aux_loss_coeff > 0) s += fmt::format(", load-balancing loss {}", aux_loss_coeff);
  if (moe() && router_score == parallel::RouterScore::Sigmoid) s += ", sigmoid router";
  if (moe() && !balanced_routing()) s += fmt::format(", routing {}", routing);
  if (fp8 != parallel::Fp8Recipe::None) s += fmt::format(", fp8 GEMMs ({})", parallel::fp8_recipe_name(fp8));
  if (reduce_dtype != DType::Float32) s += fmt::format(", {} gradient reduction", dtype_name(reduce_dtype));
  if (dropout > 0) s += fmt::format(", dropout {}", dropout);
  std::vector<std::string> overlaps;
  if (overlap_grad_reduce) overlaps.push_back("grad reduce");
  if (overlap_param_gather) overlaps.push_back("param gather");
  if (tp_comm_overlap) overlaps.push_back("tp comm");
  if (async_tp_allreduce && !tp_comm_overlap) overlaps.push_back("tp backward");
  if (overlap_p2p_comm) overlaps.push_back("pp transfers");
  if (!overlaps.empty()) s += fmt::format(", overlapped {}", fmt::join(overlaps, ", "));
  if (grad_accum_fusion) s += ", fused gradient accumulation";
  if (attention == AttentionKernel::Unfused) s += ", unfused attention";
  return s;
}

int Config::windowed_layer_count() const {
  int n = 0;
  for (int layer = 0; layer < layers; ++layer) n += window(layer) > 0;
  return n;
}

int Config::moe_layer_count(int first, int count) const {
  int n = 0;
  for (int layer = first; layer < first + count; ++layer) n += moe_layer(layer);
  return n;
}

int Config::stage_layers(int stage) const {
  if (stage == 0 && first_stage_layers > 0) return first_stage_layers;
  if (stage == pp - 1 && last_stage_layers > 0) return last_stage_layers;
  const int given = (first_stage_layers > 0) + (last_stage_layers > 0);
  return (layers - first_stage_layers - last_stage_layers) / (pp - given);
}

int Config::chunk_first_layer(int virtual_stage) const {
  int first = 0;
  for (int u = 0; u < virtual_stage; ++u) first += chunk_layers(u);
  return first;
}

double Config::lr_at(int step) const {
  if (step <= lr_warmup_steps) return lr * step / (lr_warmup_steps + 1.0);
  if (lr_decay_style != LrDecay::Cosine || steps <= lr_warmup_steps + 1) return lr;
  // From lr just after warmup to min_lr at the last step (Megatron's OptimizerParamScheduler, cosine).
  const double done = static_cast<double>(step - lr_warmup_steps - 1) / (steps - lr_warmup_steps - 1);
  return min_lr + 0.5 * (lr - min_lr) * (1 + std::cos(M_PI * done));
}

std::string Config::shape() const {
  // The gated unit by its name (GEGLU with quick GELU, gpt-oss's) and its clamp and offset, where set.
  const std::string glu = fmt::format(
      "{} {}{}{}", quick_geglu ? "quick GEGLU" : "SwiGLU", ffn(),
      activation_func_clamp_value > 0 ? fmt::format(" clamped to {}", activation_func_clamp_value) : "",
      glu_linear_offset != 0 ? fmt::format(" value offset {}", glu_linear_offset) : "");
  std::string s =
      llama() ? fmt::format(
                    "llama block, {} layers, hidden {}, {} heads ({} key-value{}), {}, seq {}, vocab {}",
                    layers, hidden, heads, kv(),
                    kv_channels > 0 ? fmt::format(", {} channels each", kv_channels) : "", glu, seq, vocab) +
                    (qk_layernorm ? ", QK-norm" : "") + (attention_sinks ? ", sinks" : "") +
                    (add_bias_linear ? ", linear biases" : (add_qkv_bias ? ", qkv bias" : ""))
              : fmt::format("{} layers, hidden {}, {} heads, seq {}, vocab {}", layers, hidden, heads, seq,
                            vocab);
  if (sliding_window > 0) s += fmt::format(", window {} in layers {}", sliding_window, sliding_window_layers);
  if (moe()) {
    s += fmt::format(", {} experts of width {} (top {}{}) in layers {}", experts, moe_ffn(), top_k,
                     shared_experts > 0 ? fmt::format(", {} shared", shared_experts) : "", moe_layers);
  }
  return s;
}

namespace {
// --dtype's names and fp8, which resolve() reads as bf16 with FP8 GEMMs.
std::vector<std::pair<std::string, DType>> with_fp8(std::vector<std::pair<std::string, DType>> dtypes) {
  dtypes.emplace_back("fp8", DType::Float8E4M3);
  return dtypes;
}

void resolve_fp8(Config& c) {
  using parallel::Fp8Recipe;
  if (is_float8(c.dtype)) {
    c.dtype = DType::BFloat16;
    if (c.fp8 == Fp8Recipe::None) c.fp8 = Fp8Recipe::Current;
  }
  if (c.fp8 != Fp8Recipe::None && c.dtype != DType::BFloat16) {
    throw UsageError(
        fmt::format("gpt: --fp8-recipe {} runs the linear layers' GEMMs in FP8 within bf16 "
                    "training; --dtype is {}: give --dtype bf16 (or fp8)",
                    parallel::fp8_recipe_name(c.fp8), dtype_name(c.dtype)));
  }
}
}  // namespace

Config for_gpu(Config c, const GpuModel& gpu) {
  c.fp8_any_layout = gpu.fp8_mx;
  if (c.fp8 == parallel::Fp8Recipe::None) return c;
  if (gpu.peak_tflops_fp8 <= 0) {
    throw UsageError(fmt::format(
        "gpt: --fp8-recipe {}: the {} has no FP8 tensor cores (its profile gives no peak_tflops_fp8); FP8 "
        "training needs Hopper (H100, H200) or Blackwell (B200, GB200): pick such a --profile, or --dtype "
        "bf16",
        parallel::fp8_recipe_name(c.fp8), gpu.name));
  }
  if (c.fp8 == parallel::Fp8Recipe::Mxfp8 && !gpu.fp8_mx) {
    throw UsageError(fmt::format(
        "gpt: --fp8-recipe mxfp8: the {}'s tensor cores do not apply MX block scales (Blackwell's do); on it "
        "use --fp8-recipe current or blockwise",
        gpu.name));
  }
  return c;
}

const OptionTable<Config>& options_table() {
  using O = Config;
  const std::vector<std::pair<std::string, DType>> dtypes = {
      {"bf16", DType::BFloat16},     {"fp16", DType::Float16},    {"fp32", DType::Float32},
      {"bfloat16", DType::BFloat16}, {"float16", DType::Float16}, {"float32", DType::Float32}};
  // A laptop-sized GPT by default; --model fills the shape flags from a published model instead.
  static const OptionTable<O> table = lesson_table<O>({
      {"world", &O::world, "ranks: tp x pp x dp"},
      Option<O>("model", &O::model,
                "a preset that fills the shape flags (gpt3-175b, llama3-70b, ...; a wrong name lists them)")
          .expands(preset_settings),
      Option<O>("block", &O::block,
                "the transformer block: gpt (layernorm, GELU MLP, biases, learned positions, tied output) or "
                "llama (RMSNorm, SwiGLU, grouped-query attention, rotary positions, untied output)",
                {{"gpt", Block::Gpt}, {"llama", Block::Llama}}),
      Option<O>("layers", &O::layers, "transformer blocks")
          .at_least(1)
          .at_most(kMaxLayers,
                   "each layer is simulated kernel by kernel and its parameters held by every rank of its "
                   "stage; the deepest published models have about a hundred"),
      Option<O>("hidden", &O::hidden, "model width").at_least(1),
      Option<O>("heads", &O::heads, "attention heads (divisible by --tp)").at_least(1),
      Option<O>("kv-heads", &O::kv_heads,
                "llama: key-value heads of grouped-query attention, dividing --heads (0: --heads)")
          .at_least(0),
      Option<O>("kv-channels", &O::kv_channels,
                "llama: features per attention head, the attention heads * kv-channels wide (0: hidden / "
                "heads; Megatron's flag, head_dim in Hugging Face configs)")
          .at_least(0)
          .at_most(1 << 16, "published models have 64 to 256"),
      {"qk-layernorm", &O::qk_layernorm,
       "llama: each head's queries and keys RMS-normalised over its features, with gains shared by the "
       "heads, before the rotary embeddings (Qwen3's q_norm and k_norm; Megatron's flag)"},
      Option<O>("sliding-window", &O::sliding_window,
                "causal attention over this many keys up to each query's position, in the layers "
                "--sliding-window-layers names (Mistral 7B, gpt-oss; 0: every earlier key)")
          .at_least(0),
      Option<O>("sliding-window-layers", &O::sliding_window_layers,
                "with --sliding-window: which layers: all, every:N (layers 0, N, 2N, ...; gpt-oss: every:2) "
                "or from:N (layers N on)"),
      {"attention-sinks", &O::attention_sinks,
       "llama: a learned logit per attention head that joins each query's softmax as a key of zero value, "
       "so the weights may sum to less than one (gpt-oss's sinks)"},
      {"add-qkv-bias", &O::add_qkv_bias,
       "llama: a bias on the q, k and v projections (Qwen2; Megatron's flag)"},
      {"add-bias-linear", &O::add_bias_linear,
       "llama: a bias on every linear layer of the block: wqkv, wo, w13, w2 (Megatron's flag)"},
      {"quick-geglu", &O::quick_geglu,
       "llama: the MLP's gate through x sigmoid(1.702 x) (quick GELU) instead of SiLU (gpt-oss; Megatron's "
       "flag)"},
      Option<O>("activation-func-clamp-value", &O::activation_func_clamp_value,
                "llama: the MLP's gate clamped to at most this and its value to within it before the product "
                "(gpt-oss: 7; Megatron's flag; 0: not clamped)")
          .at_least(0),
      Option<O>("glu-linear-offset", &O::glu_linear_offset,
                "llama: added to the MLP's value before the product (gpt-oss: 1; Megatron's flag)"),
      Option<O>("ffn-hidden", &O::ffn_hidden, "llama: the SwiGLU MLP's width (0: 4 x --hidden)").at_least(0),
      Option<O>("rope-theta", &O::rope_theta, "llama: the rotary embeddings' base").above(1),
      Option<O>("seq", &O::seq, "sequence length").at_least(1),
      Option<O>("vocab", &O::vocab, "vocabulary size (divisible by --tp)").at_least(1),
      Option<O>("global-batch", &O::global_batch, "sequences per step").at_least(1),
      Option<O>("micro-batch", &O::micro_batch, "sequences per micro-batch").at_least(1),
      Option<O>("tp", &O::tp, "tensor-parallel size (Megatron's column-then-row pairs)").at_least(1),
      {"seq-parallel", &O::seq_parallel,
       "with --tp: reduce_scatter + all_gather, layernorm sharded along the sequence"},
      Option<O>("cp", &O::cp,
                "context-parallel size: each sequence split over cp ranks in 2 cp chunks, attention by "
                "exchanging keys and values (--cp-comm)")
          .at_least(1),
      Option<O>("cp-comm", &O::cp_comm,
                "with --cp: p2p (a ring of key-value exchanges overlapped with attention, Megatron-Core's "
                "default) or all-gather (keys and values gathered first, as Llama 3's training)",
                {{"p2p", CpComm::P2p}, {"all-gather", CpComm::AllGather}}),
      Option<O>("experts", &O::experts,
                "mixture of experts: each MoE layer's MLP is this many expert MLPs, each token routed to "
                "--top-k of them (0: dense)")
          .at_least(0)
          .at_most(1 << 16, "the largest published models have a few hundred experts per layer"),
      Option<O>("top-k", &O::top_k, "with --experts: the experts each token is routed to").at_least(1),
      Option<O>("moe-ffn-hidden", &O::moe_ffn_hidden,
                "with --experts: each expert MLP's width (0: the dense MLP's)")
          .at_least(0),
      Option<O>("shared-experts", &O::shared_experts,
                "with --experts and the llama block: experts every token goes through, one dense MLP of this "
                "many times --moe-ffn-hidden in each MoE layer (DeepSeek's shared experts)")
          .at_least(0)
          .at_most(1 << 16, "the published models have one or two"),
      Option<O>("moe-layers", &O::moe_layers,
                "with --experts: which layers are MoE: all, every:N (layers 0, N, 2N, ...) or from:N "
                "(layers N on)"),
      Option<O>("ep", &O::ep,
                "with --experts: expert-parallel size, the experts split over ep of the stage's tp x cp x dp "
                "ranks and tokens sent to them by all-to-all")
          .at_least(1),
      Option<O>(
          "etp", &O::etp,
          "with --experts: expert tensor-parallel size, each expert's weights split over etp ranks that "
          "gather the tokens their ep groups received (Megatron-Core's default is --tp; published MoE "
          "recipes keep 1)")
          .at_least(1),
      Option<O>("moe-router-score-function", &O::router_score,
                "with --experts: the gates, the softmax over each token's chosen logits (Mixtral, Qwen3) or "
                "their sigmoids normalised (DeepSeek-V3)",
                {{"softmax", parallel::RouterScore::Softmax}, {"sigmoid", parallel::RouterScore::Sigmoid}}),
      Option<O>(
          "moe-aux-loss-coeff", &O::aux_loss_coeff,
          "with --experts: the load-balancing loss's coefficient (Switch Transformer's; Megatron-Core's "
          "flag), 0: none")
          .at_least(0)
          .at_most(1e3, "published runs use 1e-2 to 1e-4"),
      Option<O>(
          "capacity-factor", &O::capacity_factor,
          "with --experts: each expert takes at most ceil(tokens k / experts x C) of a rank's routes, the "
          "lowest-gated over it dropped (Megatron-Core's --moe-expert-capacity-factor); unset: dropless")
          .above(0),
      Option<O>(
          "routing", &O::routing,
          "with --experts --phantom: how the tokens spread over the experts: balanced, skew:S (the hottest "
          "expert takes S times its share) or zipf:A (a Zipf law of exponent A); real numbers route by "
          "the router"),
      Option<O>("pp", &O::pp, "pipeline-parallel size (1F1B)").at_least(1),
      Option<O>("interleave", &O::v, "model chunks per pipeline rank (interleaved 1F1B)").at_least(1),
      Option<O>("decoder-first-pipeline-num-layers", &O::first_stage_layers,
                "layers of the first pipeline stage (0: as the others; Megatron-Core's flag)")
          .at_least(0),
      Option<O>("decoder-last-pipeline-num-layers", &O::last_stage_layers,
                "layers of the last pipeline stage (0: as the others; Megatron-Core's flag)")
          .at_least(0),
      Option<O>("dp", &O::dp, "data-parallel size (0: world / (tp cp pp))").at_least(0),
      Option<O>("zero", &O::zero, "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters")
          .at_least(0)
          .at_most(3),
      Option<O>("recompute", &O::recompute,
                "activation recomputation: none, selective (the attention core) or full",
                {{"none", Recompute::None}, {"selective", Recompute::Selective}, {"full", Recompute::Full}}),
      {"order", &O::order, "process-group layout, innermost first"},
      Option<O>("dtype", &O::dtype,
                "weights and activations (fp8: bf16 with the linear layers' GEMMs in FP8, --fp8-recipe)",
                with_fp8(dtypes)),
      Option<O>("fp8-recipe", &O::fp8,
                "the linear layers' GEMMs in FP8, scaled per tensor by its own largest value (current) or "
                "by the largest of its earlier passes (delayed, TransformerEngine's DelayedScaling), in "
                "DeepSeek-V3's blocks (blockwise) or in MX blocks (mxfp8, Blackwell); none: 16-bit",
                {{"none", parallel::Fp8Recipe::None},
                 {"current", parallel::Fp8Recipe::Current},
                 {"blockwise", parallel::Fp8Recipe::Blockwise},
                 {"mxfp8", parallel::Fp8Recipe::Mxfp8},
                 {"delayed", parallel::Fp8Recipe::Delayed}}),
      Option<O>("grad-reduce-dtype", &O::reduce_dtype, "dtype of the data-parallel gradient reduction",
                dtypes),
      Option<O>("dropout", &O::dropout, "dropout probability of the residual branches (GPT-2's resid_pdrop)")
          .at_least(0)
          .at_most(0.99),
      Option<O>("framework", &O::framework,
                "sets the overlap flags as a framework runs them (megatron-lm-2021, megatron-lm-2022, "
                "megatron-core, torchtitan)")
          .expands(framework_settings),
      Option<O>(
          "attention", &O::attention,
          "attention kernels: flash (one fused kernel) or unfused (batched GEMMs and a softmax over the "
          "s x s scores in HBM, as Megatron-LM's 2021-2022 runs)",
          {{"flash", AttentionKernel::Flash}, {"unfused", AttentionKernel::Unfused}}),
      {"overlap-grad-reduce", &O::overlap_grad_reduce,
       "each gradient bucket's reduction starts when backward has made it (Megatron-LM's flag)"},
      {"overlap-param-gather", &O::overlap_param_gather,
       "with --zero 1 or more: the weights' all-gathers start ahead of the forward that reads them"},
      {"tp-comm-overlap", &O::tp_comm_overlap,
       "with --seq-parallel: each all-gather + GEMM and GEMM + reduce-scatter pipelined in tp chunks"},
      {"async-tensor-model-parallel-allreduce", &O::async_tp_allreduce,
       "with --tp 2 or more: in each column-parallel layer's backward, the input gradient's all-reduce "
       "(reduce-scatter with --seq-parallel) runs beside the weight-gradient GEMM, and the input's "
       "all-gather beside the input-gradient GEMM (Megatron-LM's)"},
      {"overlap-p2p-communication", &O::overlap_p2p_comm,
       "with --interleave 2 or more: each pipeline receive is posted one task earlier, so that the transfer "
       "runs beside the task before the one that reads it (Megatron-LM's overlap_p2p_comm)"},
      {"gradient-accumulation-fusion", &O::grad_accum_fusion,
       "with --zero 0 or 1: each weight-gradient GEMM sums into the gradient buffer, with no separate add "
       "(Megatron-LM's fusion)"},
      {"ddp-bucket-size", &O::ddp_bucket_size,
       "parameters per gradient bucket with --overlap-grad-reduce; auto: Megatron's max(40M, 1M x dp)"},
      Option<O>("steps", &O::steps, "training steps, each checked against one device").at_least(1),
      Option<O>("lr", &O::lr, "AdamW's learning rate (the peak, with a schedule)").above(0),
      Option<O>("lr-decay-style", &O::lr_decay_style,
                "the learning rate after warmup: constant, or cosine to --min-lr at the last step",
                {{"constant", O::LrDecay::Constant}, {"cosine", O::LrDecay::Cosine}}),
      Option<O>("lr-warmup-steps", &O::lr_warmup_steps, "steps of linear warmup to --lr").at_least(0),
      Option<O>("min-lr", &O::min_lr, "the learning rate a cosine decay ends at").at_least(0),
      Option<O>("clip-grad", &O::clip_grad,
                "clip the gradients to this global L2 norm, summed over every shard of every parameter "
                "once (0: no clipping)")
          .at_least(0),
      {"phantom", &O::phantom, "time the step at its size without numbers (no check)"},
      break_option<O>(&O::broken,
                      {"dp-sum", "no-reduce-scatter", "no-sp-grad-sync", "dropout-row", "dropout-cp-rows",
                       "no-rope-backward", "cp-mask-every-block", "moe-wrong-expert-rank",
                       "moe-combine-without-gates", "moe-no-load-balancing-grad", "no-sinks-backward"}),
  });
  return table;
}

namespace {
// a x b, or UsageError naming the product when a 64-bit count cannot hold it.
std::int64_t product(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw UsageError(fmt::format("gpt: {} = {} x {} is more than a 64-bit count holds", what, a, b));
  }
  return out;
}

// The sizes the lesson multiplies, each within a 64-bit count.
void check_products(const Config& c) {
  product(c.micro_batch, c.dp, "--micro-batch x dp");
  product(c.global_batch, c.seq, "--global-batch x --seq (tokens per step)");
  product(c.micro_batch, c.seq, "--micro-batch x --seq (tokens per micro-batch)");
  product(product(c.micro_batch, c.seq, "--micro-batch x --seq"), c.seq,
          "--micro-batch x --seq x --seq (attention scores)");
  product(c.vocab, c.hidden, "--vocab x --hidden (the embedding)");
  product(product(product(12, c.hidden, "12 x --hidden"), c.hidden, "12 x --hidden^2"), c.layers,
          "12 x --hidden^2 x --layers (the blocks' parameters)");
  product(product(product(3, c.ffn(), "3 x --ffn-hidden"), c.hidden, "3 x --ffn-hidden x --hidden"), c.layers,
          "3 x --ffn-hidden x --hidden x --layers (the MLPs' parameters)");
}

// Context parallelism against the sequence and what splits it.
void resolve_context(const Config& c) {
  if (c.cp == 1) return;
  if (c.seq % (2 * std::int64_t{c.cp}) != 0) {
    throw UsageError(fmt::format(
        "gpt: --seq {} is not divisible by 2 x --cp {} = {}: each sequence is cut into 2 cp chunks, rank i "
        "holding chunks i and 2 cp - 1 - i so that causal attention's work balances",
        c.seq, c.cp, 2 * std::int64_t{c.cp}));
  }
  if (c.attention != AttentionKernel::Flash) {
    throw UsageError(
        "gpt: --cp computes attention block by block in fused kernels that merge by their log-sum-exps; "
        "--attention unfused keeps the whole s x s scores, which context parallelism exists to avoid");
  }
}

// A set of layers as --moe-layers and --sliding-window-layers name them: its first and its stride.
struct LayerSet {
  int first = 0, every = 1;
};
LayerSet read_layer_set(const std::string& flag, const std::string& spec, const char* every_example,
                        const char* from_example) {
  auto number = [&](const std::string& text) {
    OptionSpec o;
    o.flag = flag;
    o.kind = OptionKind::Integer;
    o.min = 0;
    o.max = kMaxLayers;
    return static_cast<int>(read_integer(o, text, "gpt", 0, kMaxLayers));
  };
  if (spec == "all") return {};
  if (spec.rfind("every:", 0) == 0) {
    const int every = number(spec.substr(6));
    if (every < 1) throw UsageError(fmt::format("gpt: --{} every:N needs N of 1 or more", flag));
    return {0, every};
  }
  if (spec.rfind("from:", 0) == 0) return {number(spec.substr(5)), 1};
  throw UsageError(
      fmt::format("gpt: --{} {}: give all, every:N (layers 0, N, 2N, ...{}) or from:N (layers N "
                  "on{})",
                  flag, spec, every_example, from_example));
}

// --moe-layers into moe_first and moe_every.
void read_moe_layers(Config& c) {
  const LayerSet s = read_layer_set("moe-layers", c.moe_layers, ", as Megatron-Core's --moe-layer-freq",
                                    ", as DeepSeek-V3's first dense layers");
  c.moe_first = s.first, c.moe_every = s.every;
}

// --sliding-window-layers into window_first and window_every; the window against the attention it needs.
// Without a window the layers name nothing, as --moe-layers without experts (so that --sliding-window 0
// turns a preset's windows off).
void resolve_window(Config& c) {
  if (c.sliding_window == 0) return;
  const LayerSet s =
      read_layer_set("sliding-window-layers", c.sliding_window_layers, "; gpt-oss: every:2", "");
  c.window_first = s.first, c.window_every = s.every;
  if (c.windowed_layer_count() == 0) {
    throw UsageError(fmt::format("gpt: --sliding-window-layers {} windows none of the {} layers",
                                 c.sliding_window_layers, c.layers));
  }
  if (c.attention != AttentionKernel::Flash) {
    throw UsageError(
        "gpt: --sliding-window runs in the fused attention kernels (FlashAttention-2 and -3 take a window); "
        "--attention unfused is the path of the runs before sliding windows");
  }
}

// Mixture of experts against the layout: the experts split evenly over ep ranks of a stage's
// tp x cp x dp ranks, each token's top-k among them.
void resolve_experts(Config& c) {
  if (!c.moe()) {
    if (c.ep > 1) throw UsageError(fmt::format("gpt: --ep {} splits experts; it needs --experts", c.ep));
    if (c.etp > 1) throw UsageError(fmt::format("gpt: --etp {} splits experts; it needs --experts", c.etp));
    if (!c.balanced_routing())
      throw UsageError("gpt: --routing spreads tokens over experts; it needs --experts");
    if (c.capacity_factor > 0)
      throw UsageError("gpt: --capacity-factor caps each expert; it needs --experts");
    if (c.shared_experts > 0) throw UsageError("gpt: --shared-experts are a MoE layer's; it needs --experts");
    if (c.aux_loss_coeff > 0)
      throw UsageError("gpt: --moe-aux-loss-coeff balances a router's load; it needs --experts");
    return;
  }
  read_moe_layers(c);
  if (c.moe_layer_count() == 0) {
    throw UsageError(
        fmt::format("gpt: --moe-layers {} makes none of the {} layers MoE", c.moe_layers, c.layers));
  }
  if (c.top_k > c.experts) {
    throw UsageError(
        fmt::format("gpt: --top-k {} is more than --experts {}: each token takes top-k distinct "
                    "experts",
                    c.top_k, c.experts));
  }
  if (c.shared_experts > 0 && !c.llama()) {
    throw UsageError(
        fmt::format("gpt: --shared-experts {}: the shared experts are the llama block's SwiGLU "
                    "MLP; give --block llama",
                    c.shared_experts));
  }
  if (c.shared_experts * c.moe_ffn() % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --shared-experts {} x --moe-ffn-hidden {} = {} is not divisible by --tp {}: the "
                    "shared experts' "
                    "MLP is split over tp as a dense one",
                    c.shared_experts, c.moe_ffn(), c.shared_experts * c.moe_ffn(), c.tp));
  }
  if (c.experts % c.ep != 0) {
    throw UsageError(
        fmt::format("gpt: --ep {} does not divide --experts {}: each expert-parallel rank holds "
                    "experts / ep of them",
                    c.ep, c.experts));
  }
  const std::int64_t stage_ranks = std::int64_t{c.tp} * c.cp * c.dp;
  if (stage_ranks % c.ep != 0) {
    throw UsageError(fmt::format(
        "gpt: --ep {} does not divide the {} ranks of a pipeline stage (tp {} x cp {} x dp {}): the experts "
        "are split over ep of them and their gradients reduced over the rest",
        c.ep, stage_ranks, c.tp, c.cp, c.dp));
  }
  if (stage_ranks % (std::int64_t{c.ep} * c.etp) != 0) {
    throw UsageError(fmt::format(
        "gpt: --etp {} x --ep {} does not divide the {} ranks of a pipeline stage (tp {} x cp {} x dp {}): "
        "each expert's shards are spread over etp ranks of every ep group's lane",
        c.etp, c.ep, stage_ranks, c.tp, c.cp, c.dp));
  }
  if (c.moe_ffn() % c.etp != 0) {
    throw UsageError(fmt::format(
        "gpt: --etp {} does not divide --moe-ffn-hidden {}: each expert's MLP is split over etp ranks", c.etp,
        c.moe_ffn()));
  }
  parallel::read_routing_model(c.routing, c.experts, c.top_k);  // UsageError naming --routing
  if (!c.balanced_routing() && !c.phantom) {
    throw UsageError(fmt::format(
        "gpt: --routing {}: with real numbers each token goes where the router sends it; a routing model is "
        "for --phantom runs, which have no logits",
        c.routing));
  }
  if (c.tp > 1 && !c.seq_parallel) {
    throw UsageError(
        "gpt: --experts with --tp 2 or more needs --seq-parallel: each tensor-parallel rank routes its own "
        "tokens (Megatron-Core requires the same)");
  }
}

// The block's own flags, each refused where the block has nothing it sets.
void resolve_block(const Config& c) {
  if (!c.llama()) {
    if (c.kv_heads > 0 && c.kv_heads != c.heads) {
      throw UsageError(
          fmt::format("gpt: --kv-heads {}: the gpt block's attention gives every head its own keys and "
                      "values; grouped-query attention is the llama block's (--block llama)",
                      c.kv_heads));
    }
    if (c.kv_channels > 0 && c.kv_channels * std::int64_t{c.heads} != c.hidden) {
      throw UsageError(
          fmt::format("gpt: --kv-channels {}: the gpt block's heads split --hidden {} into --heads {}; heads "
                      "of a width of their own are the llama block's (--block llama)",
                      c.kv_channels, c.hidden, c.heads));
    }
    if (c.qk_layernorm) {
      throw UsageError(
          "gpt: --qk-layernorm: the gpt block's attention has no norm of its queries and keys; QK-norm is "
          "the "
          "llama block's (--block llama)");
    }
    if (c.attention_sinks) {
      throw UsageError(
          "gpt: --attention-sinks: the gpt block's attention has no sinks; they are the llama block's "
          "(--block llama)");
    }
    if (c.add_qkv_bias || c.add_bias_linear) {
      throw UsageError(
          "gpt: --add-qkv-bias and --add-bias-linear give the llama block biases; the gpt block has them "
          "always");
    }
    if (!c.plain_swiglu()) {
      throw UsageError(
          "gpt: --quick-geglu, --activation-func-clamp-value and --glu-linear-offset shape a gated unit; the "
          "gpt block's MLP is GELU (the llama block's is gated: --block llama)");
    }
    if (c.ffn_hidden > 0 && c.ffn_hidden != 4 * std::int64_t{c.hidden}) {
      throw UsageError(
          fmt::format("gpt: --ffn-hidden {}: the gpt block's MLP is 4 x --hidden = {} wide; a width of its "
                      "own is the llama block's (--block llama)",
                      c.ffn_hidden, 4 * std::int64_t{c.hidden}));
    }
    return;
  }
  if (c.kv_heads > c.heads || c.heads % c.kv() != 0) {
    throw UsageError(
        fmt::format("gpt: --kv-heads {} does not divide --heads {}: each key-value head serves a group of "
                    "heads / kv-heads query heads",
                    c.kv(), c.heads));
  }
  if (c.kv() % c.tp != 0) {
    throw UsageError(fmt::format(
        "gpt: --kv-heads {} is not divisible by --tp {}: tensor parallelism gives each rank whole groups of "
        "query heads with their key-value head (copying key-value heads across ranks, as Megatron-Core does "
        "when tp exceeds them, is not built)",
        c.kv(), c.tp));
  }
  if (c.ffn() % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --ffn-hidden {} is not divisible by --tp {}: each rank holds ffn/tp of the SwiGLU "
                    "MLP's columns",
                    c.ffn(), c.tp));
  }
  if (c.head_dim() % 2 != 0) {
    throw UsageError(
        c.kv_channels > 0
            ? fmt::format("gpt: --kv-channels {} is odd; rotary embeddings rotate pairs of a head's features",
                          c.kv_channels)
            : fmt::format("gpt: --hidden {} / --heads {} = {} features per head is odd; rotary embeddings "
                          "rotate pairs of them",
                          c.hidden, c.heads, c.head_dim()));
  }
}

}  // namespace

int one_fewer_at_the_ends(int layers, int pp) {
  if (pp <= 2 || layers % pp == 0 || (std::int64_t{layers} + 2) % pp != 0) return 0;
  return static_cast<int>((std::int64_t{layers} + 2) / pp - 1);
}

namespace {
// The layers of each pipeline stage: the first's and the last's as given, the rest split evenly, each
// stage's split evenly among its chunks (Megatron-Core's get_num_layers_to_build requires the same).
void resolve_stages(const Config& c) {
  const int first = c.first_stage_layers, last = c.last_stage_layers;
  const int given = (first > 0) + (last > 0);
  if (given == 0) {
    if (c.layers % (std::int64_t{c.pp} * c.v) == 0) return;
    std::string hint;
    if (const int ends = one_fewer_at_the_ends(c.layers, c.pp); c.v == 1 && ends > 0) {
      hint = fmt::format(
          " (Llama 3 405B's training gave the first and last stages one layer fewer: "
          "--decoder-first-pipeline-num-layers {0} --decoder-last-pipeline-num-layers {0})",
          ends);
    }
    throw UsageError(fmt::format(
        "gpt: --layers {} is not divisible by --pp {} x --interleave {} = {}: every model chunk holds the "
        "same number of layers, unless --decoder-first-pipeline-num-layers and "
        "--decoder-last-pipeline-num-layers set the first and last stages'{}",
        c.layers, c.pp, c.v, std::int64_t{c.pp} * c.v, hint));
  }
  const char* flag = first > 0 ? "--decoder-first-pipeline-num-layers" : "--decoder-last-pipeline-num-layers";
  if (c.pp == 1) {
    throw UsageError(fmt::format("gpt: {} sets a pipeline stage's layers; it needs --pp 2 or more", flag));
  }
  const std::int64_t rest = std::int64_t{c.layers} - first - last;
  const int others = c.pp - given;
  if (others == 0 && rest != 0) {
    throw UsageError(
        fmt::format("gpt: with --pp 2 the first and the last stage are all the stages: "
                    "--decoder-first-pipeline-num-layers "
                    "{} and --decoder-last-pipeline-num-layers {} must add up to --layers {}",
                    first, last, c.layers));
  }
  if (rest < others) {
    throw UsageError(fmt::format(
        "gpt: --decoder-first-pipeline-num-layers {} and --decoder-last-pipeline-num-layers {} take {} of "
        "--layers {}, leaving {} for the other {} stages; each needs at least one",
        first, last, std::int64_t{first} + last, c.layers, std::max<std::int64_t>(rest, 0), others));
  }
  if (others > 0 && rest % others != 0) {
    throw UsageError(
        fmt::format("gpt: the {} layers that --decoder-first-pipeline-num-layers {} and "
                    "--decoder-last-pipeline-num-layers "
                    "{} leave of --layers {} do not divide among the other {} stages",
                    rest, first, last, c.layers, others));
  }
  for (int stage = 0; stage < c.pp; ++stage) {
    if (c.stage_layers(stage) % c.v != 0) {
      throw UsageError(fmt::format(
          "gpt: pipeline stage {} holds {} layers, not divisible by --interleave {}: each of its chunks "
          "holds the same number of layers",
          stage, c.stage_layers(stage), c.v));
    }
  }
}

// The overlap flags checked against the layout. A framework's tp-comm-overlap, asynchronous tensor-parallel
// backward and gradient-accumulation fusion apply where the layout has what they work on (tp > 1, with
// sequence parallelism for the first; a gradient buffer of the whole step); asked for alone, they must.
void resolve_overlaps(Config& c) {
  if (c.ddp_bucket_size != "auto") {
    OptionSpec spec;
    spec.flag = "ddp-bucket-size";
    spec.kind = OptionKind::Integer;
    spec.min = 1;
    spec.max = 1e12;  // a trillion parameters
    c.bucket_params =
        read_integer(spec, c.ddp_bucket_size, "gpt", 1, std::numeric_limits<std::int64_t>::max());
  }
  // A framework's switch is dropped where the layout has nothing for it to work on; given alone, it is
  // refused with `why`.
  auto only_where = [&c](bool& on, bool applies, const char* why) {
    if (!on || applies) return;
    if (c.framework.empty()) throw UsageError(why);
    on = false;
  };
  only_where(
      c.overlap_param_gather, c.zero > 0,
      "gpt: --overlap-param-gather overlaps the all-gather of the weights the sharded optimizer updated; "
      "it needs --zero 1 or more (with --zero 0 every rank updates all of its weights)");
  if (c.overlap_param_gather && c.zero <= 2 && !c.overlap_grad_reduce) {
    throw UsageError(
        "gpt: --overlap-param-gather with --zero 1 or 2 gathers the weights bucket by bucket; it needs "
        "--overlap-grad-reduce, which makes the buckets (Megatron-LM requires the same)");
  }
  only_where(c.tp_comm_overlap, c.tp > 1 && c.seq_parallel,
             c.tp == 1
                 ? "gpt: --tp-comm-overlap pipelines tensor-parallel communication with the GEMMs; with "
                   "--tp 1 there is none: give --tp 2 or more with --seq-parallel"
                 : "gpt: --tp-comm-overlap splits the sequence-parallel all-gathers and reduce-scatters "
                   "into chunks; it needs --seq-parallel (TransformerEngine's overlap requires it too)");
  only_where(
      c.async_tp_allreduce, c.tp > 1,
      "gpt: --async-tensor-model-parallel-allreduce runs the tensor-parallel backward's collectives beside "
      "its GEMMs; with --tp 1 there are none: give --tp 2 or more");
  only_where(c.overlap_p2p_comm, c.pp > 1 && c.v > 1,
             "gpt: --overlap-p2p-communication posts the interleaved schedule's pipeline receives a task "
             "early; it needs --pp 2 or more with --interleave 2 or more (Megatron-LM turns it off without "
             "the interleaved schedule)");
  only_where(c.grad_accum_fusion, c.zero <= 1 || c.dp * c.cp == 1,
             "gpt: --gradient-accumulation-fusion sums each weight gradient into the step's gradient buffer; "
             "with --zero 2 or 3 each micro-batch's gradient is reduce-scattered instead, so there is none: "
             "give --zero 0 or 1");
}
}  // namespace

Config resolve(Config c, int world) {
  c.world = world;
  parallel::validate_order(c.order);
  if (c.kv_channels == 0 && c.hidden % c.heads != 0) {
    throw UsageError(
        fmt::format("gpt: --hidden {} is not divisible by --heads {}: every head has hidden/heads "
                    "features (or --kv-channels, with the llama block)",
                    c.hidden, c.heads));
  }
  // In 64 bits: --tp, --cp and --pp may each be up to 2^31.
  const std::int64_t model_ranks = product(product(c.tp, c.cp, "--tp x --cp"), c.pp, "--tp x --cp x --pp");
  const std::string model_sizes = c.cp > 1 ? fmt::format("--tp {} x --cp {} x --pp {}", c.tp, c.cp, c.pp)
                                           : fmt::format("--tp {} x --pp {}", c.tp, c.pp);
  if (c.dp > 0) {
    if (product(model_ranks, c.dp, "--tp x --cp x --pp x --dp") != world) {
      throw UsageError(
          fmt::format("gpt: --world {} is not {} x --dp {} = {}; leave out --dp to get world / "
                      "(tp{} pp)",
                      world, model_sizes, c.dp, model_ranks * c.dp, c.cp > 1 ? " cp" : ""));
    }
  } else {
    if (world % model_ranks != 0) {
      throw UsageError(fmt::format(
          "gpt: --world {} is not divisible by {} = {}: data parallelism replicates groups of {} ranks",
          world, model_sizes, model_ranks, c.cp > 1 ? "tp x cp x pp" : "tp x pp"));
    }
    c.dp = static_cast<int>(world / model_ranks);
  }
  resolve_fp8(c);  // --dtype fp8 is bf16 with FP8 GEMMs before anything asks which GEMMs are FP8
  resolve_context(c);
  resolve_experts(c);
  resolve_window(c);
  check_products(c);
  resolve_block(c);
  if (c.heads % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --heads {} is not divisible by --tp {}: tensor parallelism gives each "
                    "rank whole attention heads",
                    c.heads, c.tp));
  }
  if (c.vocab % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --vocab {} is not divisible by --tp {}: each rank holds vocab/tp rows of "
                    "the embedding; pad it as Megatron does, to a multiple of 128 x tp = {}",
                    c.vocab, c.tp, (c.vocab + 128 * c.tp - 1) / (128 * c.tp) * 128 * c.tp));
  }
  if (c.seq_parallel && c.tp == 1) {
    throw UsageError(
        "gpt: --seq-parallel splits the sequence across the tensor-parallel ranks; it needs --tp 2 "
        "or more");
  }
  if (c.seq_parallel && c.rows() % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --seq {}{} x --micro-batch {} tokens do not divide among --tp {} ranks "
                    "(--seq-parallel)",
                    c.seq, c.cp > 1 ? fmt::format(" / --cp {}", c.cp) : "", c.micro_batch, c.tp));
  }
  if (!c.phantom && !c.llama() && c.dtype != DType::Float32 && c.hidden < 3) {
    throw UsageError(fmt::format(
        "gpt: --hidden {}: a layernorm over fewer than 3 features makes every row the same values "
        "whatever it held (0, or -1 and 1), so the gradients are {}'s rounding noise, which AdamW turns "
        "into full-size updates that the one-device check cannot match; give --hidden 3 or more, --dtype "
        "fp32, or --phantom",
        c.hidden, dtype_name(c.dtype)));
  }
  resolve_overlaps(c);
  if (c.v > 1 && c.pp == 1) {
    throw UsageError(
        "gpt: --interleave gives each pipeline rank several model chunks; it needs --pp 2 or more");
  }
  resolve_stages(c);
  if (c.global_batch % (c.micro_batch * c.dp) != 0) {
    throw UsageError(
        fmt::format("gpt: --global-batch {} is not divisible by --micro-batch {} x dp {} = {}: each "
                    "data-parallel pipeline runs global / (micro x dp) whole micro-batches",
                    c.global_batch, c.micro_batch, c.dp, c.micro_batch * c.dp));
  }
  const std::int64_t m = c.micro_batches();
  if (m > kMaxMicroBatches) {
    throw UsageError(fmt::format(
        "gpt: m = global / (micro x dp) = {} / ({} x {}) = {} micro-batches per pipeline, more than the {} "
        "this lesson takes: each is simulated task by task, kernel by kernel, every step (the largest "
        "published steps run hundreds per pipeline; `ranklab plan` screens long steps from two short ones)",
        c.global_batch, c.micro_batch, c.dp, m, kMaxMicroBatches));
  }
  if (c.v > 1 && m % c.pp != 0) {
    throw UsageError(fmt::format(
        "gpt: --interleave {} needs the micro-batches per pipeline, m = global / (micro x dp) = {} / ({} x "
        "{}) = "
        "{}, to be a multiple of --pp {}: the interleaved schedule sends micro-batches through the chunks in "
        "groups of pp, so that a rank starts chunk c of a group just as the previous rank finishes it "
        "(Megatron requires the same); try --global-batch {}",
        c.v, c.global_batch, c.micro_batch, c.dp, m, c.pp, (m / c.pp + 1) * c.pp * c.micro_batch * c.dp));
  }
  return c;
}

}  // namespace ranklab::gpt
