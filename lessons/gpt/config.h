// The GPT lesson's options: the model's shape, the parallel layout and the precision, each declared once
// in the lesson's table (options_table), and checked against each other and the world (resolve), with every
// error naming the option and saying what would fix it.
#pragma once

#include <cstdint>
#include <string>

#include "common/lesson.h"
#include "common/rank.h"
#include "common/tensor.h"
#include "lessons/parallel/expert_parallel.h"
#include "lessons/parallel/fp8.h"

namespace ranklab::gpt {

enum class Recompute { None, Selective, Full };
const char* recompute_name(Recompute r);

// The transformer block. gpt: GPT-2/3's (Radford et al. 2019): layernorm, multi-head attention, a 4h GELU
// MLP, biases, learned positions, the output layer tied to the embedding. llama: Llama's (Touvron et al.
// 2023; Dubey et al. 2024): RMSNorm, grouped-query attention (--kv-heads) with rotary positions, a SwiGLU
// MLP (--ffn-hidden), no biases (unless --add-qkv-bias or --add-bias-linear), an output layer of its own.
enum class Block { Gpt, Llama };
const char* block_name(Block b);

// How context parallelism's ranks share keys and values: a ring of point-to-point exchanges overlapped with
// the attention of the block at hand (Megatron-Core's and TransformerEngine's default, "p2p"), or all of
// them all-gathered before attention and the gradients reduce-scattered after (Llama 3's training, Dubey
// et al. 2024, section 3.3.2: "all-gather").
enum class CpComm { P2p, AllGather };
const char* cp_comm_name(CpComm m);

// Caps on the counts that scale the simulation's work, far above any published run (each error says so).
constexpr std::int64_t kMaxLayers = 4096;
constexpr std::int64_t kMaxMicroBatches = 65536;  // per pipeline and step

struct Config : LessonOptions {
  std::string model;  // the preset that filled the shape ("gpt3-175b"), or "" for none
  Block block = Block::Gpt;
  int layers = 2, hidden = 64, heads = 4, seq = 16;
  int kv_heads = 0;             // llama: key-value heads (0: --heads)
  int kv_channels = 0;          // llama: features per attention head (0: hidden / heads)
  bool qk_layernorm = false;    // llama: each head's q and k RMS-normalised before the rotation (Qwen3)
  std::int64_t ffn_hidden = 0;  // llama: SwiGLU's width (0: 4 hidden, as GPT's MLP)
  double rope_theta = 10000;    // llama: the rotary embeddings' base
  // Sliding-window attention (AttentionSpec::window) in the layers sliding_window_layers names: "all",
  // "every:N" (layers 0, N, 2N, ...: gpt-oss's alternation with N = 2, its layer 0 windowed) or "from:N";
  // resolve() reads it into window_first, window_every. 0: every layer attends to every earlier key.
  std::int64_t sliding_window = 0;
  std::string sliding_window_layers = "all";
  int window_first = 0, window_every = 1;
  // llama: a learned logit per attention head that joins each query's softmax as a key whose value is zero
  // (gpt-oss's sinks; AttentionSpec::sinks).
  bool attention_sinks = false;
  // llama: the gated unit's form (common/glu.h), as Megatron-Core names it: the gate's activation
  // x sigmoid(1.702 x) instead of SiLU, its inputs clamped (0: not), the value offset. gpt-oss: all three,
  // with 7 and 1.
  bool quick_geglu = false;
  // llama: biases on wqkv (Qwen2's; Megatron's --add-qkv-bias), or on all four linear layers (gpt-oss's
  // attention; Megatron's --add-bias-linear, whose default is on and which Llama recipes turn off).
  bool add_qkv_bias = false, add_bias_linear = false;
  double activation_func_clamp_value = 0;
  double glu_linear_offset = 0;
  std::int64_t vocab = 128, global_batch = 8, micro_batch = 2;
  int tp = 1, pp = 1, dp = 0;  // dp 0: world / (tp cp pp), which resolve() sets
  // Context parallelism: each sequence split into 2 cp chunks, rank i holding chunks i and 2 cp - 1 - i so
  // that causal attention's work balances (Megatron-Core, TransformerEngine).
  int cp = 1;
  CpComm cp_comm = CpComm::P2p;
  // Mixture of experts (lessons/parallel/expert_parallel.h): with experts > 0 the MLP of every MoE layer is
  // `experts` MLPs of width moe_ffn() of which each token takes top_k, spread over ep ranks of the stage's
  // tp x cp x dp ranks, each expert's weights split over etp of them (Megatron-Core's expert grid).
  int experts = 0, top_k = 2;
  std::int64_t moe_ffn_hidden = 0;  // each expert's MLP width (0: as the dense MLP's)
  // Shared experts (DeepSeek-MoE, Dai et al. 2024; Qwen2-MoE): a MoE layer also runs every token through
  // one dense MLP of shared_experts x moe_ffn() (the llama block's, tensor-parallel as a dense layer's).
  int shared_experts = 0;
  // Which layers are MoE: "all", "every:N" (layers 0, N, 2N, ..., Megatron-Core's --moe-layer-freq) or
  // "from:N" (layers N on: DeepSeek-V3's first dense layers); resolve() reads it into moe_first, moe_every.
  std::string moe_layers = "all";
  int moe_first = 0, moe_every = 1;
  int ep = 1;
  // Expert tensor parallelism: each expert's w_in split by columns and w_out by rows over etp ranks, which
  // gather the tokens their ep groups received (Megatron-Core's --expert-tensor-parallel-size). 1 keeps the
  // experts whole, as published MoE recipes do; Megatron-Core's own default is the dense tp.
  int etp = 1;
  double capacity_factor = 0;  // an expert's capacity per rank (parallel::expert_capacity); 0: dropless
  // The load-balancing loss's coefficient (parallel::load_balancing_loss), added to the training loss as the
  // mean over each rank's tokens of a micro-batch in every MoE layer; 0: none.
  double aux_loss_coeff = 0;
  parallel::RouterScore router_score = parallel::RouterScore::Softmax;
  // How a phantom run routes (parallel::RoutingModel): "balanced", "skew:S" or "zipf:A".
  std::string routing = "balanced";
  int v = 1;  // model chunks per pipeline rank (--interleave)
  // The first and the last pipeline stage's layers (Megatron-Core's --decoder-first-pipeline-num-layers and
  // --decoder-last-pipeline-num-layers; 0: as many as the others); the other stages split the rest evenly.
  // Llama 3 405B's 126 layers ran on 16 stages with one fewer on the first and the last (Dubey et al. 2024,
  // section 3.3.2), whose embedding and output layer take the place of a layer's time and memory.
  int first_stage_layers = 0, last_stage_layers = 0;
  int zero = 0;
  bool seq_parallel = false;
  Recompute recompute = Recompute::None;
  DType dtype = DType::BFloat16, reduce_dtype = DType::Float32;
  // The linear layers' GEMMs in FP8 (lessons/parallel/fp8.h); --dtype fp8 is bf16 with the current recipe.
  parallel::Fp8Recipe fp8 = parallel::Fp8Recipe::None;
  bool fp8_any_layout = false;  // the GPU's FP8 GEMMs read any layout (Blackwell): set by for_gpu
  std::string order = "tp-dp-pp";
  bool phantom = false;
  int steps = 3;
  double lr = 1e-3;
  // The training recipe: the learning rate warmed up linearly over lr_warmup_steps, then constant or
  // decayed along a cosine to min_lr at the last step (Megatron's --lr-decay-style); gradients clipped to a
  // global L2 norm of clip_grad (0: not clipped; Megatron's and torchtitan's runs use 1.0).
  enum class LrDecay { Constant, Cosine };
  LrDecay lr_decay_style = LrDecay::Constant;
  int lr_warmup_steps = 0;
  double min_lr = 0;
  double clip_grad = 0;
  float dropout = 0;  // of the residual branches (--dropout)
  // The overlaps production frameworks use (Megatron-LM's flags), all off in the plain schedule; --framework
  // sets them as a framework's release does.
  std::string framework;  // the preset that set them, or ""
  AttentionKernel attention = AttentionKernel::Flash;
  bool overlap_grad_reduce = false, overlap_param_gather = false, tp_comm_overlap = false;
  bool grad_accum_fusion = false;        // weight-gradient GEMMs sum into the float32 gradients (zero 0, 1)
  bool async_tp_allreduce = false;       // column-parallel backward: collectives beside the GEMMs (tp > 1)
  bool overlap_p2p_comm = false;         // pipeline receives posted a task earlier (interleaved, v > 1)
  std::string ddp_bucket_size = "auto";  // parameters per bucket, or Megatron's rule
  std::int64_t bucket_params = 0;        // what resolve() read from it; 0: Megatron's rule
  std::string broken;

  // The learning rate of training step `step` (from 1), as the recipe says.
  double lr_at(int step) const;
  // The preset's name, or "custom".
  std::string model_name() const { return model.empty() ? "custom" : model; }
  std::int64_t micro_batches() const { return global_batch / (micro_batch * dp); }  // m, per pipeline
  int stage_layers(int stage) const;  // the layers of pipeline stage `stage`, all its chunks
  int chunk_layers(int virtual_stage) const { return stage_layers(virtual_stage % pp) / v; }
  int chunk_first_layer(int virtual_stage) const;  // the index of its first layer
  int head_dim() const { return kv_channels > 0 ? kv_channels : hidden / heads; }
  bool llama() const { return block == Block::Llama; }
  int kv() const { return kv_heads > 0 ? kv_heads : heads; }  // key-value heads
  std::int64_t ffn() const { return ffn_hidden > 0 ? ffn_hidden : 4 * std::int64_t{hidden}; }  // MLP width
  bool moe() const { return experts > 0; }
  GluSpec glu() const {
    return GluSpec{quick_geglu ? 1.702f : 1.0f, static_cast<float>(activation_func_clamp_value),
                   static_cast<float>(glu_linear_offset)};
  }
  bool plain_swiglu() const {
    return !quick_geglu && activation_func_clamp_value == 0 && glu_linear_offset == 0;
  }
  // The sliding window of layer `layer`'s attention, 0 for none.
  std::int64_t window(int layer) const {
    return sliding_window > 0 && layer >= window_first && (layer - window_first) % window_every == 0
               ? sliding_window
               : 0;
  }
  int windowed_layer_count() const;
  bool balanced_routing() const { return routing == "balanced"; }
  bool moe_layer(int layer) const {
    return experts > 0 && layer >= moe_first && (layer - moe_first) % moe_every == 0;
  }
  // The MoE layers of the model, or of the `count` layers from `first` on.
  int moe_layer_count() const { return moe_layer_count(0, layers); }
  int moe_layer_count(int first, int count) const;
  std::int64_t moe_ffn() const { return moe_ffn_hidden > 0 ? moe_ffn_hidden : ffn(); }
  // The width of layer `layer`'s dense MLP: ffn(), or in a MoE layer its shared experts' (0: none).
  std::int64_t dense_ffn(int layer) const { return moe_layer(layer) ? shared_experts * moe_ffn() : ffn(); }
  bool has_dense_mlp(int layer) const { return dense_ffn(layer) > 0; }
  int local_experts() const { return experts / ep; }  // the experts each rank of an ep group holds
  std::int64_t cp_seq() const { return seq / cp; }    // positions of a sequence a context-parallel rank holds
  std::int64_t cp_chunk() const { return seq / (2 * cp); }  // positions in each of its two chunks
  // The position in the sequence of a context-parallel rank's local position `local`.
  std::int64_t cp_position(int cp_rank, std::int64_t local) const {
    if (cp == 1) return local;
    const std::int64_t chunk = cp_chunk();
    return local < chunk ? cp_rank * chunk + local : (2 * cp - 1 - cp_rank) * chunk + local - chunk;
  }
  std::int64_t rows() const { return cp_seq() * micro_batch; }  // a rank's tokens of a micro-batch
  // Rows a rank holds between tensor-parallel pairs: all of them, or 1/tp with sequence parallelism.
  std::int64_t local_rows() const { return seq_parallel ? rows() / tp : rows(); }
  std::int64_t tokens_per_step() const { return global_batch * seq; }
  // "tp 8 (seq-parallel) x pp 8 (interleave 2) x dp 24, zero 1, recompute none, bf16" (with "cp 2 (p2p)"
  // after tp when there is context parallelism)
  std::string layout() const;
  // "96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200" (llama: with its key-value heads and MLP)
  std::string shape() const;
};

// The lesson's table: the command line's flags, help and the report's record of a run.
const OptionTable<Config>& options_table();
// `c` checked against a world of `world` ranks, with dp set when it was 0; UsageError naming the options.
Config resolve(Config c, int world);

// c on `gpu`: UsageError unless the GPU runs c's FP8 recipe (FP8 tensor cores, and for mxfp8 ones that apply
// MX scales); records what the memory plan needs to know of it.
Config for_gpu(Config c, const GpuModel& gpu);

// Llama 3 405B's pipeline split (Dubey et al. 2024, section 3.3.2: 126 layers on 16 stages), for `layers`
// that do not divide among `pp` stages but two more would: the first and the last stage one layer fewer
// than the others, whose count it returns; 0 where it does not apply.
int one_fewer_at_the_ends(int layers, int pp);

}  // namespace ranklab::gpt
