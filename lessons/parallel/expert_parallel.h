// Expert parallelism: a mixture-of-experts MLP (Shazeer et al. 2017; GShard, Lepikhin et al. 2020) whose
// experts are spread over the ranks of an expert-parallel (ep) group, each token sent to its experts and
// brought back by all-to-alls, as Megatron-Core's MoELayer with its all-to-all token dispatcher does it.
//
//   logits = x @ router                        [tokens, experts]; every rank routes its own tokens
//   gates  = softmax over each token's top-k logits (= the top-k of the softmax, normalised: Mixtral, Qwen3)
//   y[t]   = sum over t's top-k experts e of gates[t, e] * expert_e(x[t])
//   expert_e(x) = act(x @ w_in[e]) @ w_out[e]  act: GELU (the gpt block) or SwiGLU (the llama block)
//
// Megatron-Core's expert grid: the ep group is ep ranks of a pipeline stage's tp x cp x dp ranks, each
// holding experts / ep experts; with sequence parallelism each tensor-parallel rank routes its own tokens.
// Routing is dropless: an expert computes every token routed to it, so the straggler expert sets the pace
// of the all-to-all after it.
//
// Expert tensor parallelism (etp > 1, Megatron-Core's --expert-tensor-parallel-size) splits each expert
// over etp ranks, w_in by columns and w_out by rows, as a dense MLP is split over tp. Each of those ranks
// belongs to its own ep group; after the all-to-all they all-gather what their ep groups received, so
// that every shard sees every token routed to its experts, and each computes its part of every row; the
// partial outputs are summed and handed back by a reduce-scatter before the all-to-all home (Megatron-Core's
// MoEAlltoAllTokenDispatcher: gather_from_sequence_parallel_region and
// reduce_scatter_to_sequence_parallel_region over the expert tp group). A member's share is as long as
// its ep group received: uneven under a skewed routing, so each member's block of the gather is padded to
// the longest, moving as many bytes as the longest member's.
//
// Gradients: an expert's weight gradient on a rank sums the contributions of every token routed to it from
// the ep x etp ranks. Averaging it over the expert-data-parallel group (the other tp cp dp / (ep etp)
// ranks, which hold the same shards) divides by tp cp dp / (ep etp) ranks where the dense weights divide by
// cp dp; `grad_scale` (tp / (ep etp)) makes up the difference.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/rank.h"
#include "lessons/parallel/exposed.h"
#include "lessons/parallel/fp8.h"

namespace ranklab::parallel {

// Each token's experts and gates, on the host (the split sizes of an uneven all_to_all have to be there;
// Megatron-Core's dispatcher copies its token counts to the host for the same reason).
struct Routing {
  std::int64_t tokens = 0;
  int experts = 0, top_k = 0;
  // The routes in the order they are dispatched: by the rank that owns the expert, then by expert, then by
  // token. Empty with phantom tensors, where only the counts are known.
  std::vector<std::int64_t> token;
  std::vector<int> expert;
  std::vector<double> gate;
  // d score / d logit over the score of each route (and dropped route, and with probs each token and expert):
  // 1 for the softmax, 1 - s for a sigmoid score s.
  std::vector<double> slope, dropped_slope, probs_slope;
  std::vector<std::int64_t> per_expert;  // routes to each expert (kept ones)
  double closest_call = INFINITY;        // the smallest gap between a chosen logit and the best unchosen one
  // With a capacity: the routes over it, dropped (the token keeps the residual for them, and their gates
  // still count in the softmax over its chosen experts), by token.
  std::vector<std::int64_t> dropped_token;
  std::vector<int> dropped_expert;
  std::vector<double> dropped_gate;
  // With real numbers: the softmax over every expert [tokens, experts], and the routes each expert was
  // chosen for (before its capacity): what the load-balancing loss weighs.
  std::vector<double> probs;
  std::vector<std::int64_t> chosen_per_expert;
  std::int64_t routes() const {  // kept
    std::int64_t n = 0;
    for (std::int64_t e : per_expert) n += e;
    return n;
  }
  std::int64_t dropped() const { return static_cast<std::int64_t>(dropped_token.size()); }
};
// An expert's capacity from a rank's `tokens`: ceil(tokens k / E x factor) routes (Switch Transformer's
// expert capacity; Megatron-Core's --moe-expert-capacity-factor, per rank before the dispatch); no limit
// for a factor of 0 (dropless).
std::int64_t expert_capacity(std::int64_t tokens, int experts, int top_k, double factor);
// How the router scores an expert: the softmax over the chosen logits (Mixtral, Qwen3), or each chosen
// logit's sigmoid over the chosen ones' sum (DeepSeek-V3; Megatron-Core's --moe-router-score-function
// sigmoid).
enum class RouterScore { Softmax, Sigmoid };
// Top-k of each row of `logits` [tokens, experts] (row-major; the lower expert first on equal logits) and
// their gates by `score`; over an expert's `capacity`, its routes of the lowest gates are dropped
// (Megatron-Core's drop policy "probs"; -1: none). The experts of ep rank d are d's block of
// `experts_per_rank`, shifted by `owner_shift` (a deliberate bug); the routes come in dispatch order.
Routing route_top_k(const std::vector<double>& logits, std::int64_t tokens, int experts, int top_k,
                    int experts_per_rank, std::int64_t capacity = -1, int owner_shift = 0,
                    RouterScore score = RouterScore::Softmax);
// Every expert the same number of routes (the first ones one more where they do not divide): the routing
// published MoE benchmarks force, and what a phantom run assumes by default.
Routing route_balanced(std::int64_t tokens, int experts, int top_k);
// How a phantom run spreads the routes over the experts (it has no logits to route by). Balanced; skew: the
// hottest expert takes `value` times its even share and the others share the rest; zipf: the expert of
// popularity rank i (from 0) takes a share proportional to 1 / (i + 1)^value. The experts' popularity
// order is a permutation seeded by the layer, so that each layer has its own hot experts; no expert takes
// more routes than there are tokens (each token's k experts are distinct), the excess going to the others.
// Routes left over from whole shares go by largest remainder, and among equal remainders evenly over the
// experts' ids, so that blocks of consecutive experts (an ep rank's) take as many as each other, give or
// take one or two.
struct RoutingModel {
  enum class Kind { Balanced, Skew, Zipf };
  Kind kind = Kind::Balanced;
  double value = 0;
};
// The model --routing names ("balanced", "skew:S", "zipf:A"); UsageError naming --routing otherwise.
RoutingModel read_routing_model(const std::string& text, int experts, int top_k);
// The routes of `tokens` tokens per expert under `model` in layer `layer` (every rank's the same), at most
// `capacity` each (-1: none), the rest counted as dropped.
Routing route_modelled(std::int64_t tokens, int experts, int top_k, const RoutingModel& model, int layer,
                       std::int64_t capacity = -1);
// The load-balancing loss of a rank's tokens (Switch Transformer, Fedus et al. 2021, section 2.2, as
// Megatron-Core's switch_load_balancing_loss_func computes it): E / (k T^2) sum over experts i of
// (sum over tokens t of p_ti) c_i, with p the softmax over every expert and c_i the routes expert i was
// chosen for; its minimum, 1, is a uniform router with an even load. Its gradient by the logits, times
// `weight`, is added into `dl` [tokens, experts]: c is a count (no gradient), so
// d / d l_tj = p_tj (g_j - sum over i of p_ti g_i) with g_i = E c_i / (k T^2).
double load_balancing_loss(const Routing& ro);
void add_load_balancing_grads(const Routing& ro, double weight, std::vector<double>& dl);

// d loss / d logits [tokens, experts] from d loss / d gate of each kept route (in the routing's order; a
// dropped route's is zero): for a token's chosen experts, gate_e slope_e (dgate_e - sum over its chosen j
// of gate_j dgate_j); zero elsewhere.
std::vector<double> router_logit_grads(const Routing& ro, const std::vector<double>& dgate);

struct ExpertParallel {
  Rank& r;
  Group group;             // the ep group
  std::vector<int> ranks;  // its global ranks, in order
  int index = 0;           // this rank's place in it
  int experts = 0, top_k = 1;
  bool swiglu = false;   // the experts' activation: SwiGLU (w_in [h, 2 f]) or GELU (w_in [h, f])
  float grad_scale = 1;  // multiplies the experts' weight gradients (tp / ep, above)
  bool phantom = false;
  ExposedComm& exposed;
  std::string broken;            // moe-wrong-expert-rank, moe-combine-without-gates
  RoutingModel routing_model{};  // a phantom run's routing
  double capacity_factor = 0;    // 0: dropless
  RouterScore score = RouterScore::Softmax;
  GluSpec glu{};  // with SwiGLU: its form (common/glu.h)
  // The load-balancing loss's weight in the training loss, for this rank's tokens of one micro-batch
  // (--moe-aux-loss-coeff over the terms the gradients' averaging adds); 0: none.
  double aux_loss_weight = 0;
  // The expert tensor-parallel group: the etp ranks that hold the shards of the same experts (above).
  Group etp{};
  int etp_size = 1, etp_index = 0;
  // The experts' GEMMs in FP8 (fp8.h), each expert's two linear layers as TransformerEngine's GroupedLinear
  // runs them: every GEMM's input, weight and output gradient quantized on its own (each its own amax
  // history under delayed scaling, by local expert, as TransformerEngine packs them by position); 16-bit
  // without. The router's GEMM stays in 16 bits.
  Fp8* fp8 = nullptr;

  int size() const { return static_cast<int>(ranks.size()); }
  int local_experts() const { return experts / size(); }

  // What a layer's forward keeps for its backward.
  struct Kept {
    int layer = 0;
    Routing routing;
    Tensor index, gates;       // each route's token row and gate, in dispatch order
    Tensor sorted;             // the received rows, by local expert: the experts' inputs (16-bit only)
    Tensor back;               // the experts' outputs of this rank's routes, before the gates
    std::vector<Tensor> u, g;  // each local expert's w_in output and its activation (16-bit only)
    // With FP8: each local expert's two GEMM inputs as its weight gradients read them (along their rows),
    // kept in place of `sorted` and `g`.
    std::vector<Fp8Operand> x8, g8;
    std::vector<std::int64_t> sent_rows, received_rows;  // per ep rank
    std::int64_t member_rows = 0;  // with etp: each etp member's block of the gather, padded to the longest
    Tensor sort, unsort;           // the permutations between source (gathered) and expert order
    std::vector<std::int64_t> expert_first, expert_rows;  // each local expert's rows in `sorted`
    std::int64_t received() const {                       // the rows this rank's ep group sent it
      std::int64_t n = 0;
      for (std::int64_t rows : received_rows) n += rows;
      return n;
    }
  };
  // gpt-oss's biases, where a layer has them: the router's [experts], added to its logits, and each local
  // expert's on its w_in output ([2 f] or [f]; with etp this member's columns) and on its w_out output ([h],
  // inside the expert, so that the gate weighs it; with etp added by member 0 before the members' partial
  // outputs are summed, and its gradient, from the output gradient every member holds whole, the same on
  // each).
  struct Biases {
    Tensor router;
    std::vector<Tensor> in, out;
  };
  // y [tokens, h] (the MoE MLP's output, x's dtype) from x [tokens, h]; w_in and w_out hold this rank's
  // experts in order; `layer` seeds a phantom run's routing model.
  Tensor forward(const Tensor& x, const Tensor& router, const std::vector<Tensor>& w_in,
                 const std::vector<Tensor>& w_out, Kept& kept, int layer = 0, const Biases& biases = {});
  struct Grads {
    Tensor dx, drouter, drouter_bias;
    std::vector<Tensor> dw_in, dw_out;  // scaled by grad_scale
    std::vector<Tensor> db_in, db_out;  // with biases; scaled by grad_scale
  };
  Grads backward(const Tensor& dy, const Tensor& x, const Tensor& router, const std::vector<Tensor>& w_in,
                 const std::vector<Tensor>& w_out, Kept& kept, const Biases& biases = {});

 private:
  Routing route(const Tensor& logits, int layer);
  // The routes' rows gathered (with `gates`: weighted) in dispatch order, sent to the experts' ranks, and
  // sorted by local expert; the reverse trip of expert-ordered rows back into route order.
  Tensor dispatch(const Tensor& rows, const Kept& k);
  Tensor combine(const Tensor& sorted_rows, const Kept& k);
  // The splits and permutations of the all-to-alls, from this rank's routing and the counts every rank of the
  // group sends it (exchanged here), and with etp the counts its etp members received (gathered here).
  void plan_exchange(Kept& k);
  Tensor expert_rows(const Tensor& sorted, const Kept& k, int le) const;
  // An expert's linear layer: x @ w (into `out` when given), in FP8 with the input's copy for the weight
  // gradient kept in `keep`; and its backward, dw = x^T dy from the kept input, returning dy w^T (into
  // `dx_out` when given).
  Tensor linear(const Tensor& x, const Tensor& w, int id, Fp8Operand* keep, const Tensor& out = Tensor());
  Tensor linear_backward(const Tensor& dy, const Tensor& w, int id, const Tensor& x_kept, Tensor& dw,
                         const Tensor& dx_out = Tensor());
  // Delayed scaling's name for local expert `le`'s linear layer `which` (0: w_in, 1: w_out) of `layer`:
  // negative, apart from the dense layers' (Model::fp8_linear).
  int fp8_linear(int layer, int le, int which) const {
    return -1 - 2 * (layer * local_experts() + le) - which;
  }
};

}  // namespace ranklab::parallel
