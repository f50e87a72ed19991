// The GPT decoder (Radford et al. 2019; Brown et al. 2020), forward and backward written out on the Rank
// interface, with tensor (and sequence) parallelism inside each block and a model chunk per pipeline task:
//
//   x = wte[tokens] + wpe[positions]                       embedding (vocabulary split across tp)
//   for each block:
//     x = x + dropout(proj(attention(qkv(layernorm1(x)))))    column-parallel qkv, row-parallel proj
//     x = x + dropout(fc2(gelu(fc1(layernorm2(x)))))         column-parallel fc1 (4h), row-parallel fc2
//   logits = layernorm_f(x) @ wte^T                        the output layer shares the embedding
//   loss = mean cross-entropy of the next token
//
// With --block llama (Touvron et al. 2023, Dubey et al. 2024) the same frame holds Llama's block:
//
//   x = wte[tokens]                                        no learned positions
//   for each block:
//     x = x + wo(attention(rope(wqkv(rmsnorm1(x)))))       grouped-query: kv heads shared by groups of q
//     x = x + w2(swiglu(w13(rmsnorm2(x))))                 w13: the gate and up projections, fused
//   logits = rmsnorm_f(x) @ output^T                       an output layer of its own; no biases (by default)
//
// Activations are [tokens, features] with tokens in sequence-major order (row = position * batch + sample).
// Weights and activations are in the compute dtype (bf16 by default); layernorm statistics, the loss and
// every gradient the optimizer sees are float32.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "common/rank.h"
#include "lessons/gpt/config.h"
#include "lessons/parallel/context_parallel.h"
#include "lessons/parallel/expert_parallel.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/parallel/tensor_parallel.h"
#include "lessons/parallel/zero.h"

namespace ranklab::gpt {

// The parameters of a block, in this order.
enum BlockParam {
  kLn1G,
  kLn1B,
  kQkvW,
  kQkvB,
  kProjW,
  kProjB,
  kLn2G,
  kLn2B,
  kFc1W,
  kFc1B,
  kFc2W,
  kFc2B,
  kBlockParams
};
// The llama block's parameters, in this order. wqkv's columns hold each key-value group's q heads, then
// its k and v (Rank::attention's layout); w13's are the gate and up projections' columns in adjacent pairs
// (Rank::swiglu's layout). Both keep a tensor-parallel rank's block of columns whole groups and pairs.
// kQNorm and kKNorm: QK-norm's gains (--qk-layernorm), only with it; kSinks: the attention sinks' logits
// (--attention-sinks), only with them; the linear layers' biases only with --add-qkv-bias (wqkv's) or
// --add-bias-linear (all four).
enum LlamaParam {
  kNorm1,
  kWqkv,
  kWo,
  kNorm2,
  kW13,
  kW2,
  kQNorm,
  kKNorm,
  kSinks,
  kBqkv,
  kBo,
  kB13,
  kB2,
  kLlamaParams
};
// The longer of the two blocks' lists.
constexpr int kMostBlockParams =
    int{kLlamaParams} > int{kBlockParams} ? int{kLlamaParams} : int{kBlockParams};
// The parameters of the configuration's block: kBlockParams or kLlamaParams.
int block_params(const Config& c);
// Whether layer `layer` has its block's parameter `which`: a MoE layer's dense MLP only with shared experts,
// QK-norm's gains, the sinks and the llama block's biases only when asked for. Without a layer: whether a
// layer with its dense MLP has it.
bool has_block_param(const Config& c, int layer, int which);
bool has_block_param(const Config& c, int which);
// A block parameter's initial values and how tensor parallelism splits them (`which` a BlockParam or a
// LlamaParam, as the block is). The gpt block's qkv columns are per head (q, k, v of head 0, then of head
// 1, ...), so a column block is whole heads. Unnamed (`named` false), it is the same but for its name: the
// memory accounting of every layout `plan` enumerates needs shapes only, and a large mixture of experts has
// tens of thousands of expert weights to name.
parallel::ParamSpec block_spec(const Config& c, int layer, int which, bool named = true);
// The embedding, the final norm (gamma, and beta for the gpt block) and the llama block's output layer.
enum OtherParam { kWte, kWpe, kLnfG, kLnfB, kOutput, kOtherParams };
parallel::ParamSpec other_spec(const Config& c, OtherParam which);
// Whether the block has `which`: the gpt block has no output layer of its own, the llama block no
// positions and no final beta.
bool has_other(const Config& c, OtherParam which);
// A MoE layer (Config::moe_layer) has no MLP of its own (the gpt block's fc1 and fc2 weights and biases, the
// llama block's w13 and w2); in their place its router [hidden, experts] and each expert's two weights
// (fc1 [hidden, f] and fc2 [f, hidden], or w13 [hidden, 2 f] and w2 [f, hidden]; f the expert's width, no
// biases), of the kinds below.
constexpr int kRouterKind = kMostBlockParams + int{kOtherParams};
inline int expert_kind(int expert, int which) {  // which: 0 the input weight, 1 the output weight
  return kRouterKind + 1 + 2 * expert + which;
}
// The expert and which of its weights an expert kind is (expert_kind's inverse).
struct ExpertWeight {
  int expert, which;
};
inline ExpertWeight expert_weight(int kind) {
  return {(kind - kRouterKind - 1) / 2, (kind - kRouterKind - 1) % 2};
}
// With --add-bias-linear (gpt-oss) a MoE layer's router has a bias [experts] and each expert one on each
// weight's output ([2 f] after w13, [hidden] after w2), of the kinds after the experts' weights.
inline int router_bias_kind(const Config& c) {
  return expert_kind(c.experts, 0);
}
inline int expert_bias_kind(const Config& c, int expert, int which) {
  return router_bias_kind(c) + 1 + 2 * expert + which;
}
inline bool is_expert_bias_kind(const Config& c, int kind) {
  return kind > router_bias_kind(c);
}
inline ExpertWeight expert_bias(const Config& c, int kind) {
  return {(kind - router_bias_kind(c) - 1) / 2, (kind - router_bias_kind(c) - 1) % 2};
}
// The kinds of a MoE layer's parameters: the router, the experts' weights, and with biases theirs.
inline int moe_kinds(const Config& c) {
  return (1 + 2 * c.experts) * (c.add_bias_linear ? 2 : 1);
}
// Whether a block parameter is the MLP's, which a MoE layer replaces.
bool is_mlp_param(const Config& c, int which);
// A parameter of the model: its kind (a block's parameter, kMostBlockParams + an OtherParam, or a MoE
// layer's) and its layer (-1 for the embeddings, the final norm and the output layer).
struct ParamId {
  int kind;
  int layer;
};
parallel::ParamSpec param_spec(const Config& c, ParamId id, bool named = true);
// Pipeline rank `stage`'s parameters in the order a step's backward makes their gradients final: the
// data-parallel buckets follow it. The experts' weights are not among them: expert_backward_order gives
// those of the experts an ep rank (`ep_index`) holds, reduced over their own group.
std::vector<ParamId> backward_order(const Config& c, int stage);
std::vector<ParamId> expert_backward_order(const Config& c, int stage, int ep_index);
// The number of parameters of the model (the word embedding counted once), and of those a token computes
// with (a MoE layer's router and top-k experts): the two differ only with experts.
std::int64_t parameter_count(const Config& c);
std::int64_t active_parameter_count(const Config& c);

// The training data: token `pos` of sample `sample` (each sample has seq + 1 tokens; the targets are the
// inputs shifted by one). A pure function, so any rank makes the samples it trains on.
std::int64_t token(const Config& c, std::int64_t sample, std::int64_t pos);

// The seed of the residual dropout at `site` (0 after attention, 1 after the MLP) of `layer` in training
// step `step` (from 1). The mask of an element follows from it and the element's row in the global batch
// (dropout_row), so the lesson and the one-device reference drop the same elements.
std::uint64_t dropout_seed(int step, int layer, int site);
// The row of the global batch that row `row` of micro-batch `mb` (of all micro-batches, in the order the
// data-parallel ranks take the samples) is: micro-batches' rows are sequence-major (position * micro_batch +
// sample), over the whole sequence whatever part of it a context-parallel rank holds.
inline std::int64_t dropout_row(const Config& c, std::int64_t mb, std::int64_t row) {
  return mb * c.seq * c.micro_batch + row;
}

// The bytes a model chunk keeps per micro-batch for its backward (the pre-flight estimate and the check of
// what the run allocates both use it): `layers` blocks from `first_layer` on (whose MoE layers keep what
// their experts need), and the output layer's with `head`.
std::int64_t stash_bytes(const Config& c, int layers, bool embedding, bool head, int first_layer = 0);
// Of that, what a MoE layer's routed tokens take (the rows it dispatched, received and computed on) when
// every expert gets the same share of them: a run's own routing decides how many there are.
std::int64_t routed_stash_bytes(const Config& c);

class Model {
 public:
  // With context parallelism (c.cp > 1), `cp` computes attention over the group's chunks and `cp_rank`
  // says which chunks of each sequence this rank holds.
  // With experts (c.moe()), `ep` dispatches the tokens of the MoE layers and `expert_dp` reduces and updates
  // the weights of the experts this rank holds.
  Model(Rank& r, const Config& c, int tp_rank, int dp_rank, int pp_rank, parallel::TensorParallel& tp,
        parallel::DataParallel& dp, int cp_rank = 0, parallel::ContextParallel* cp = nullptr,
        parallel::ExpertParallel* ep = nullptr, parallel::DataParallel* expert_dp = nullptr);

  Tensor forward(const parallel::Task& t, const Tensor& in);
  Tensor backward(const parallel::Task& t, const Tensor& dout);

  // The parameters the data-parallel group reduces (all but the experts'), and the experts'.
  std::vector<parallel::Param*> params();
  std::vector<parallel::Param*> expert_params();
  // The parameters in the order a step's backward makes their gradients final: the data-parallel buckets.
  std::vector<parallel::Param*> params_in_backward_order();
  // Parameters for the check against the reference: (kind, layer), the parameter and the group that
  // reduces and updates it.
  struct Named {
    int kind;
    int layer;
    parallel::Param* p;
    const parallel::DataParallel* dp;
  };
  std::vector<Named> named_params();

  bool has_head() const;
  // The bytes of what a chunk keeps for the backward of a micro-batch after its forward.
  std::int64_t kept_bytes(int chunk, int mb) const;
  // Of that, what the MoE layers keep of their routed tokens (routed_stash_bytes).
  std::int64_t routed_bytes(int chunk, int mb) const;
  // Sum over this step's micro-batches of the loss summed over their tokens (float32 scalar, last stage).
  Tensor loss_sum;
  void start_step();
  // With real numbers, each MoE layer's routing in this step: for every token this rank routed (its row in
  // the one-device reference's order, sample * seq + position), its top-k experts in ascending order, one
  // dropped over its capacity as -1 - e.
  using TokenExperts = std::vector<std::pair<std::int64_t, std::vector<int>>>;
  const std::map<int, TokenExperts>& routes() const { return routes_; }
  // The routes this rank's MoE layers made in this step's forwards, and of them those over capacity.
  std::int64_t routed() const { return routed_; }
  std::int64_t dropped() const { return dropped_; }

 private:
  struct Block {
    int layer = 0;
    std::array<parallel::Param, kMostBlockParams> p;
    // A MoE layer's router and this rank's experts (expert le's input weight experts[2 le], output weight
    // experts[2 le + 1]); with --add-bias-linear their biases, laid out alike.
    parallel::Param router, router_bias;
    std::vector<parallel::Param> experts, expert_biases;
    bool moe = false;
  };
  struct Chunk {
    std::vector<Block> blocks;
    bool embedding = false, head = false;
  };
  // What a block keeps for its backward. Full recompute keeps only x; selective drops the attention core.
  // With FP8 the linear layers' inputs y1, y2 and g are their FP8 copies for the weight gradient (with
  // their block scales), and proj's (wo's) input has one of its own, out8, beside the attention's out.
  struct BlockActs {
    Tensor x, mean1, rstd1, y1, qkv, out, lse, probs, x1, mean2, rstd2, y2, u, g;
    Tensor q_pre, k_pre, rstd_q, rstd_k;  // QK-norm's inputs and statistics
    Tensor y1_scales, y2_scales, g_scales, out8, out8_scales;
    parallel::ExpertParallel::Kept moe;  // a MoE layer's routing and its experts' activations
    // A MoE layer's input in 16 bits where y2 is the shared experts' FP8 copy of it: the router's weight
    // gradient reads it.
    Tensor router_x;
  };
  struct HeadActs {
    Tensor x, mean, rstd, y, logits, row_max, stats;
  };
  struct Stash {
    std::vector<BlockActs> blocks;
    HeadActs head;
  };
  // A block's weights as its GEMMs read them (zero 3: gathered).
  struct Weights {
    std::array<Tensor, kMostBlockParams> dense;
    Tensor router;
    std::vector<Tensor> w_in, w_out;          // a MoE layer's experts
    parallel::ExpertParallel::Biases biases;  // with --add-bias-linear
    const Tensor& operator[](int k) const { return dense[k]; }
  };
  struct GatheredBlock {
    parallel::DataParallel::GatheredUnit dense, experts;
    bool moe = false;  // a MoE layer
    int layer = 0;
  };

  // `layer` and `mb` (this rank's micro-batch) place the block's dropout masks.
  Tensor block_forward(const Weights& w, const Tensor& x, BlockActs& keep, bool full, int layer, int mb);
  Tensor block_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dx2, int mb);
  // The llama block's, as block_forward's and block_backward's.
  Tensor llama_forward(const Weights& w, const Tensor& x, BlockActs& keep, bool full, int layer, int mb);
  // What the recompute mode dropped from `a`, made again before the block's backward: selective, the
  // attention core from qkv; full, the block's whole forward from its input, its communication included,
  // whose FP8 casts take the scales of the forward they repeat (Fp8::begin_recompute).
  void rebuild(const Weights& w, BlockActs& a, int layer, int mb);
  Tensor llama_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dx2, int mb);
  // A MoE layer's MLP: y2 [local rows, h] through the router and the experts, and its backward, which adds
  // the gradients of the router and of the experts and returns the gradient of y2.
  // `record`: keep the routing for routes() (not when full recomputation runs the forward again).
  Tensor moe_forward(const Weights& w, const Tensor& y2, parallel::ExpertParallel::Kept& k, int layer, int mb,
                     bool record);
  Tensor moe_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dout);
  // Keeps what the linear layers' backward takes of their inputs (TensorParallel::Kept).
  static void keep_inputs(BlockActs& a, const parallel::TensorParallel::Kept& y1,
                          const parallel::TensorParallel::Kept& out, const parallel::TensorParallel::Kept& y2,
                          const parallel::TensorParallel::Kept& g);
  // The attention of this rank's heads in layer `layer`: Rank::attention's spec, with the layer's window and
  // its sinks (w's, with --attention-sinks).
  AttentionSpec attention_spec(const Weights& w, int layer) const;
  // Attention of qkv's rows and its backward: one call, or context parallelism's exchange. The backward
  // adds the sinks' gradient.
  Rank::AttentionOut attend(const Tensor& qkv, const Weights& w, int layer);
  Tensor attend_backward(Block& b, const Weights& w, const Tensor& dout, const BlockActs& a);
  // QK-norm (--qk-layernorm): each head's query and key RMS-normalised over its features, before the
  // rotation; the backward adds the gains' gradients and returns qkv's.
  Tensor qk_norm(const Tensor& qkv, const Weights& w, BlockActs& a);
  // qkv's (or its gradient's) queries as rows of a head's features and its keys as rows of a group's
  // (copies), and qkv as rows of a group's q, k and v; joined back into qkv's layout with new q and k and
  // the same v.
  struct QkvRows {
    Tensor q, k, rows;
    Shape shape;
  };
  QkvRows split_qkv(const Tensor& qkv);
  Tensor join_qkv(const Tensor& q, const Tensor& k, const QkvRows& from);
  Tensor qk_norm_backward(Block& b, const Tensor& dqkv, const Weights& w, const BlockActs& a);
  // Rotary embeddings of qkv's rows by their positions in the sequence (inverse: the backward).
  void rotate(const Tensor& qkv, bool inverse);
  // The residual branch's dropout (GPT-2's resid_pdrop; nothing when --dropout is 0). The backward is the
  // same call on the gradient: the same mask and scale.
  Tensor residual_dropout(const Tensor& branch, int layer, int site, int mb);
  // With FP8: the linear layer of weight `weight` in `layer` is the one the next casts belong to (delayed
  // scaling keeps its tensors' histories by it).
  void fp8_linear(int layer, int weight);
  Tensor embed_forward(int mb);
  void embed_backward(int mb, const Tensor& dx, bool last);
  void head_forward(int mb, const Tensor& x, HeadActs& h);
  Tensor head_backward(int mb, HeadActs& h, bool last);
  // A block's parameters, in the order zero 2 and 3 hold them in the block's unit: those the data-parallel
  // group reduces, and its experts'.
  std::vector<parallel::Param*> block_param_list(Block& b) const;
  std::vector<parallel::Param*> expert_param_list(Block& b);
  GatheredBlock gather(Block& b);
  parallel::Param& param(ParamId id);
  Weights get(GatheredBlock& g);

  Rank& r_;
  Config c_;
  int tp_rank_, dp_rank_, pp_rank_, cp_rank_;
  parallel::TensorParallel& tp_;
  parallel::DataParallel& dp_;
  parallel::ContextParallel* cp_;  // null without context parallelism
  parallel::ExpertParallel* ep_;
  parallel::DataParallel* expert_dp_;  // null without experts
  std::vector<Chunk> chunks_;
  bool embedding_ = false, head_ = false;      // this rank holds the embedding, the output layer
  parallel::Param wte_, wpe_, lnf_g_, lnf_b_;  // wte: the embedding's copy or the head's (or both, pp = 1)
  parallel::Param output_;                     // the llama block's output layer
  std::vector<Tensor> ids_, pos_ids_, targets_;
  std::vector<std::vector<Stash>> stash_;  // [chunk][micro-batch]
  std::int64_t vocab_start_ = 0;
  int step_ = 0;                        // the training step under way, from 1
  std::map<int, TokenExperts> routes_;  // by layer
  std::int64_t routed_ = 0, dropped_ = 0;
};

}  // namespace ranklab::gpt
