// Mixture of experts with expert parallelism (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
// Transformer, Fedus et al. 2021). One MoE layer with a residual connection:
//
//     y = x + sum over the token's kept top-k experts e of  gate_e(x) * expert_e(x)
//     expert_e(x) = relu(x @ W1[e]) @ W2[e]          gate(x) = softmax(x @ Wr + skew on expert 0)
//     loss = sum(y) / batch
//
// The experts are spread over the ranks (experts / world on each); the router is replicated and every rank
// routes its own tokens. A step:
//   1. route: the router's logits, then on the host the softmax, each token's top-k experts, and the
//      capacity: an expert takes at most `capacity` tokens from each rank (Switch Transformer's expert
//      capacity, ceil(tokens per rank * k / experts * capacity factor)); routes over it are dropped, and
//      the token keeps only the residual for that expert.
//   2. exchange the counts: an even all_to_all of every rank's tokens per expert, so each rank knows how
//      many rows it will receive from each other rank (the split sizes have to be on the host).
//   3. dispatch: the routed tokens, sorted by expert, with an uneven all_to_all.
//   4. the experts run on what they received: as many rows as were routed to them, so a popular expert
//      computes longer while the others wait: the bubble of load imbalance.
//   5. combine: the reverse uneven all_to_all, then each token sums its experts' outputs weighted by their
//      gates.
// Backward runs the same way round: d(expert output) goes back to the experts with the dispatch's splits;
// the router's gradient is all-reduced like a data-parallel weight's.
//
// Dispatch and combine are GShard's one-hot einsums: a dispatch matrix P [routes, tokens] picks each
// route's token (P @ x), a combine matrix C [tokens, routes] holds the gates (C @ expert outputs). The
// Rank interface has no top-k kernel, so routing runs on the host: a real layer does it on the GPU, but
// it too copies the token counts to the host, which all_to_all_single's split sizes need.
//
//   ranklab run moe --world 4
//   ranklab run moe --world 4 --skew 3 --capacity-factor 4
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "lessons/check.h"
#include "lessons/figures.h"
#include "lessons/mlp.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct MoeOptions : mlp::TrainingOptions {
  int experts = 4;                // a multiple of the world: expert parallelism
  int top_k = 2;                  // experts each token is routed to
  double capacity_factor = 1.25;  // an expert takes at most this times an even share of a rank's tokens
  double skew = 0;                // added to the router's logit of expert 0
  std::int64_t hidden = 32;       // each expert's hidden width
  MoeOptions() {
    batch = 64;
    dim = 16;
    steps = 2;
    lr = 0.05;
  }
};

// The layer's sizes, the same for the ranks and for the one-device reference.
struct MoeShape {
  int world = 1, experts = 1, top_k = 1;
  int experts_per_rank = 1;
  std::int64_t tokens_per_rank = 1;
  std::int64_t batch = 1, dim = 1, hidden = 1;
  // Switch Transformer's expert capacity, per rank: ceil(tokens per rank * k / experts * capacity factor),
  // the tokens an expert takes from each rank.
  std::int64_t capacity = 1;
  double skew = 0;
};

// Seeds: the batch is one [batch, dim] tensor; the router and each expert's two weights have their own.
constexpr std::uint64_t kTokenSeed = std::uint64_t{3} << 32;
constexpr std::uint64_t kRouterSeed = 7000;
constexpr std::uint64_t kExpertSeed = 8000;  // expert e: W1 kExpertSeed + 2e, W2 kExpertSeed + 2e + 1

// ---- what the steps hand on -------------------------------------------------------------------------------

// One of a token's top-k experts, when the expert had room for it.
struct Route {
  std::int64_t token = 0;  // within the rank's tokens
  int expert = 0;
  double gate = 0;  // the router's softmax probability of this expert for this token
};

// Step 1's result, on the host.
struct Routing {
  std::vector<Route> routes;             // kept, by expert then token: the dispatch order
  std::vector<std::int64_t> per_expert;  // kept routes per expert
  std::int64_t dropped = 0;              // routes over an expert's capacity
  std::vector<double> probs;             // [tokens, experts], the softmax
  double closest_call = INFINITY;        // the smallest gap between a chosen and an unchosen logit

  std::int64_t kept() const { return std::accumulate(per_expert.begin(), per_expert.end(), std::int64_t{0}); }
};

// Step 1 on the host, from the router's logits [tokens, experts] (row-major, the skew already added): each
// token's top k experts by probability, and the capacity in GShard's priority (every token's first choice
// before any second choice). The ranks and the one-device reference run the same code.
Routing route(const std::vector<double>& logits, std::int64_t tokens, int experts, int k,
              std::int64_t capacity);
// The router's backward, on the host: d loss / d logits [tokens, experts] from d loss / d gate of every
// kept route.
std::vector<double> logit_grads(const Routing& ro, const std::vector<double>& dgate, std::int64_t tokens,
                                int experts);

// Steps 2 to 4's bookkeeping: how many rows this rank sends to each rank and receives from each, from the
// counts every rank sent it, and where each of its experts' rows lie in what it receives. The received rows
// come in source order: rank 0's for this rank's first expert, then for its second, ..., then rank 1's.
class Splits {
 public:
  Splits(const MoeShape& s, bool phantom, const Routing& ro, std::vector<float> received_counts);

  std::vector<std::int64_t> sent_rows;      // to each rank: the routes to its experts
  std::vector<std::int64_t> received_rows;  // from each rank: its routes to this rank's experts
  std::int64_t received = 0;                // all of them

  // The rows for local expert `le` from every source rank, cut from `box` (laid out as received).
  Tensor rows_for_expert(Rank& r, const Tensor& box, int le) const;
  // The experts' outputs (one tensor per local expert) put back in source order, for the return trip.
  Tensor in_source_order(Rank& r, const std::vector<Tensor>& per_expert_rows) const;

 private:
  std::int64_t rows_from(int src, int le) const {
    return static_cast<std::int64_t>(counts_[src * per_ + le]);
  }
  int world_, per_;
  std::int64_t cols_;
  bool phantom_;
  std::vector<float> counts_;            // [source rank][local expert]
  std::vector<std::int64_t> src_first_;  // where each source's rows start in the received rows
};

// This rank's weights.
struct Weights {
  Tensor router;               // [dim, experts], the same on every rank
  std::vector<Tensor> w1, w2;  // this rank's experts: [dim, hidden] and [hidden, dim]
  // In the order of the gradients the step makes: each expert's W1 and W2, then the router.
  std::vector<Tensor> params() const;
};

// One expert's weight gradients.
struct ExpertGrads {
  Tensor w1, w2;
};

// GShard's one-hot einsums as matrices: P [routes, tokens] picks each route's token, C [tokens, routes]
// holds each route's gate.
struct DispatchCombine {
  Tensor P, C;
};

// The last step's figures, for the printout after the training.
struct LastStep {
  double step_us = 0, experts_us = 0;    // the step, and this rank's experts in it (forward + backward)
  std::int64_t dropped = 0, routed = 0;  // this rank's routes over capacity, and all of them
  std::vector<std::int64_t> received;    // the rows each of this rank's experts computed
  void record_load(const Routing& ro, std::int64_t routes, const std::vector<Tensor>& expert_rows) {
    dropped = ro.dropped;
    routed = routes;
    received.clear();
    for (const Tensor& rows : expert_rows) received.push_back(rows.size(0));
  }
};

MoeShape shape_of(const MoeOptions& o, int world);
Weights make_weights(Rank& r, const MoeOptions& o, const MoeShape& s);
Tensor skew_bias(Rank& r, const MoeOptions& o, const MoeShape& s);
Routing route_on_host(Rank& r, const MoeOptions& o, const MoeShape& s, const Tensor& logits);
DispatchCombine dispatch_combine(Rank& r, const MoeOptions& o, const Routing& ro, std::int64_t tokens);
ExpertGrads expert_backward(Rank& r, const MoeOptions& o, const MoeShape& s, const Tensor& xe,
                            const Tensor& h, const Tensor& w2, const Tensor& dout);
Tensor router_logit_grads(Rank& r, const MoeOptions& o, const MoeShape& s, const Routing& ro,
                          const Tensor& back, const Tensor& ones);
void print_plan(Rank& r, const MoeOptions& o, const MoeShape& s);
std::string step_line(int step, int steps, const LastStep& last);
void print_summary(Rank& r, const MoeOptions& o, const MoeShape& s, const LastStep& last, double worst);

// The check against one device: every step, the same layer over the whole batch on the host (below).
class Reference;
class StepCheck {
 public:
  StepCheck(Rank& r, const MoeOptions& o, const MoeShape& s);  // checks nothing with --phantom
  ~StepCheck();
  // After step `step`: the reference's step, then this rank's loss, gradients and weights against it; the
  // words the step's line ends with. The reference then takes the run's weights and moments, so that its
  // next step starts where the run's does: training amplifies differences, and a correct float32 run drifts
  // from the exact trajectory step by step (past the tolerance within some fifty steps), while from the
  // same start one step differs by its roundings only.
  std::string after_step(int step, const Tensor& y_sum, const std::vector<Tensor>& grads, const Weights& w,
                         const mlp::Optimizer& opt);
  double worst() const { return worst_; }  // the largest relative difference of every step so far

 private:
  // The run's weights and moments, whole on every rank, in the reference's flat layout.
  std::vector<float> gather_state(const Weights& w, const mlp::Optimizer& opt);

  Rank& r_;
  MoeShape s_;
  std::unique_ptr<Reference> ref_;
  double worst_ = 0;
  // Each gradient's largest |value| over the steps, in the optimizer's order
  // (check::Agreement::add_relative).
  std::vector<double> largest_grad_;
};

void moe(Rank& r, const MoeOptions& o) {
  const MoeShape s = shape_of(o, r.world_size());
  const std::int64_t T = s.tokens_per_rank, D = s.dim;
  const int E = s.experts, per = s.experts_per_rank;
  print_plan(r, o, s);

  // This rank's tokens, the replicated router, and its experts.
  Tensor x = o.phantom ? r.phantom({T, D})
                       : r.randn_slice({s.batch, D}, 0, r.rank() * T, T, kTokenSeed, 1.0f, DType::Float32);
  const Weights w = make_weights(r, o, s);
  mlp::Optimizer opt(r, o, w.params());
  Tensor bias = skew_bias(r, o, s);
  Tensor dy = mlp::loss_grad(r, o, {T, D}, s.batch);                   // d loss / d y = 1 / batch everywhere
  Tensor ones = o.phantom ? r.phantom({D, 1}) : r.full({D, 1}, 1.0f);  // row sums, as a matmul
  StepCheck check(r, o, s);
  LastStep last;

  for (int step = 1; step <= o.steps; ++step) {
    TimedStep timed(r);
    // 1. Route: the router's logits on the device; the top-k and the capacity on the host.
    timed.phase("route");
    Tensor logits = r.matmul(x, w.router);
    r.add_bias_(logits, bias);
    const Routing ro = route_on_host(r, o, s, logits);
    const std::int64_t R = ro.kept();  // the rows this rank dispatches

    // 2. Exchange the counts: piece d of what this rank sends is its counts for rank d's experts.
    Tensor sent_counts = r.from_host({E}, std::vector<float>(ro.per_expert.begin(), ro.per_expert.end()));
    Tensor got_counts = r.zeros({E});
    r.all_to_all(got_counts, sent_counts);
    const Splits splits(s, o.phantom, ro, r.to_host(got_counts));

    // 3. Dispatch: P @ x is the routed tokens sorted by expert; an uneven all_to_all takes them there.
    timed.phase("dispatch");
    const DispatchCombine m = dispatch_combine(r, o, ro, T);
    // With phantom tensors the one-hot product would cost routes x tokens x dim, far more than the gather
    // kernel a large model uses; the permutation is timed as a copy of the routed rows instead.
    Tensor sorted = o.phantom ? r.cast(r.phantom({R, D}), DType::Float32)
                    : R > 0   ? r.matmul(m.P, x)
                              : r.zeros({0, D});
    Tensor inbox = mlp::buffer(r, o, {splits.received, D});
    r.all_to_all(inbox, sorted, splits.received_rows, splits.sent_rows);

    // 4. The experts, each on the rows routed to it from every rank: a popular one computes longer.
    timed.phase("experts");
    const Event experts_begin = r.record_event();
    std::vector<Tensor> xe(per), h(per), out(per);
    for (int le = 0; le < per; ++le) {
      xe[le] = splits.rows_for_expert(r, inbox, le);
      if (xe[le].size(0) == 0) {
        out[le] = xe[le];  // an expert that received no rows sends none back
        continue;
      }
      h[le] = r.relu(r.matmul(xe[le], w.w1[le]));
      out[le] = r.matmul(h[le], w.w2[le]);
    }
    Tensor outbox = splits.in_source_order(r, out);
    const Event experts_end = r.record_event();

    // 5. Combine: the reverse all_to_all, then y = x + C @ (expert outputs).
    timed.phase("combine");
    Tensor back = mlp::buffer(r, o, {R, D});
    r.all_to_all(back, outbox, splits.sent_rows, splits.received_rows);
    Tensor y = o.phantom ? r.add(x, r.cast(r.phantom({T, D}), DType::Float32))
               : R > 0   ? r.add(x, r.matmul(m.C, back))
                         : x;
    Tensor y_sum = r.sum(y);

    // Backward: d back = C^T @ d y goes to the experts as the dispatch went (x is data: no gradient).
    timed.phase("backward");
    Tensor dback = o.phantom ? r.cast(r.phantom({R, D}), DType::Float32)
                   : R > 0   ? r.matmul(m.C, dy, Trans::Yes, Trans::No)
                             : sorted;
    Tensor dinbox = mlp::buffer(r, o, {splits.received, D});
    r.all_to_all(dinbox, dback, splits.received_rows, splits.sent_rows);
    const Event experts_bwd_begin = r.record_event();
    std::vector<Tensor> grads;  // each expert's d W1 and d W2, then the router's
    for (int le = 0; le < per; ++le) {
      const ExpertGrads g =
          expert_backward(r, o, s, xe[le], h[le], w.w2[le], splits.rows_for_expert(r, dinbox, le));
      grads.push_back(g.w1);
      grads.push_back(g.w2);
    }
    const Event experts_bwd_end = r.record_event();
    // The router's gradient is summed over the ranks, as a data-parallel weight's.
    Tensor dlogits = router_logit_grads(r, o, s, ro, back, ones);
    Tensor dwr = r.matmul(x, dlogits, Trans::Yes, Trans::No);
    if (o.broken != "no-router-all-reduce") r.all_reduce(dwr, ReduceOp::Sum);
    grads.push_back(dwr);
    timed.end_phase();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    last.step_us = timed.finish();
    last.experts_us =
        r.elapsed_us(experts_begin, experts_end) + r.elapsed_us(experts_bwd_begin, experts_bwd_end);
    last.record_load(ro, T * s.top_k, xe);

    const std::string verdict = check.after_step(step, y_sum, grads, w, opt);
    if (r.rank() == 0 && !o.quiet) r.print(step_line(step, o.steps, last) + verdict);
  }
  print_summary(r, o, s, last, check.worst());
}

// ---- the lesson's steps, on the host and on the device ----------------------------------------------------

float router_std(std::int64_t dim) {
  return 1.0f / std::sqrt(static_cast<float>(dim));
}
float w1_std(std::int64_t dim) {
  return std::sqrt(2.0f / static_cast<float>(dim));  // He: keeps relu's activations steady
}
float w2_std(std::int64_t hidden) {
  return 1.0f / std::sqrt(static_cast<float>(hidden));
}

Weights make_weights(Rank& r, const MoeOptions& o, const MoeShape& s) {
  const std::int64_t D = s.dim, H = s.hidden;
  Weights w;
  w.router = o.phantom ? r.phantom({D, s.experts}) : r.randn({D, s.experts}, kRouterSeed, router_std(D));
  for (int le = 0; le < s.experts_per_rank; ++le) {
    const int e = r.rank() * s.experts_per_rank + le;
    w.w1.push_back(o.phantom ? r.phantom({D, H}) : r.randn({D, H}, kExpertSeed + 2 * e, w1_std(D)));
    w.w2.push_back(o.phantom ? r.phantom({H, D}) : r.randn({H, D}, kExpertSeed + 2 * e + 1, w2_std(H)));
  }
  return w;
}

std::vector<Tensor> Weights::params() const {
  std::vector<Tensor> params;
  for (std::size_t le = 0; le < w1.size(); ++le) params.push_back(w1[le]), params.push_back(w2[le]);
  params.push_back(router);
  return params;
}

// The router's skew, added to expert 0's logit.
Tensor skew_bias(Rank& r, const MoeOptions& o, const MoeShape& s) {
  std::vector<float> bias(s.experts, 0.0f);
  bias[0] = static_cast<float>(s.skew);
  return o.phantom ? r.phantom({s.experts}) : r.from_host({s.experts}, bias);
}

// Top-k by probability, the lower expert first on equal ones; capacity in GShard's priority: every token's
// first choice before any second choice, tokens in order.
Routing route(const std::vector<double>& logits, std::int64_t tokens, int experts, int k,
              std::int64_t capacity) {
  Routing out;
  out.per_expert.assign(experts, 0);
  out.probs.resize(logits.size());
  std::vector<std::vector<int>> choice(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* l = &logits[t * experts];
    const double top = *std::max_element(l, l + experts);
    double sum = 0;
    for (int e = 0; e < experts; ++e) sum += std::exp(l[e] - top);
    for (int e = 0; e < experts; ++e) out.probs[t * experts + e] = std::exp(l[e] - top) / sum;
    std::vector<int> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
    choice[t].assign(order.begin(), order.begin() + k);
    if (k < experts) out.closest_call = std::min(out.closest_call, l[order[k - 1]] - l[order[k]]);
  }
  std::vector<std::int64_t> taken(experts, 0);
  std::vector<Route> kept;
  for (int slot = 0; slot < k; ++slot) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      const int e = choice[t][slot];
      if (taken[e] >= capacity) {
        ++out.dropped;
        continue;
      }
      ++taken[e];
      kept.push_back({t, e, out.probs[t * experts + e]});
    }
  }
  std::sort(kept.begin(), kept.end(), [](const Route& a, const Route& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.token < b.token;
  });
  out.routes = std::move(kept);
  out.per_expert = taken;
  return out;
}

// Step 1 after the router's logits. With phantom tensors there are no logits: the load follows the skew's
// softmax instead.
Routing route_on_host(Rank& r, const MoeOptions& o, const MoeShape& s, const Tensor& logits) {
  const std::int64_t T = s.tokens_per_rank;
  const int E = s.experts;
  Routing ro;
  if (o.phantom) {
    const double p0 = std::exp(o.skew) / (std::exp(o.skew) + (E - 1));
    ro.per_expert.assign(E, 0);
    for (int e = 0; e < E; ++e) {
      const double share = e == 0 ? p0 : (1 - p0) / std::max(1, E - 1);
      const auto want = std::min<std::int64_t>(T, std::llround(share * static_cast<double>(T * s.top_k)));
      ro.per_expert[e] = std::min(want, s.capacity);
      ro.dropped += want - ro.per_expert[e];
    }
    r.synchronize();  // the host waits for the router, as it would to read the counts
    return ro;
  }
  const std::vector<float> lf = r.to_host(logits);
  return route(std::vector<double>(lf.begin(), lf.end()), T, E, s.top_k, s.capacity);
}

Splits::Splits(const MoeShape& s, bool phantom, const Routing& ro, std::vector<float> received_counts)
    : sent_rows(s.world, 0),
      received_rows(s.world, 0),
      world_(s.world),
      per_(s.experts_per_rank),
      cols_(s.dim),
      phantom_(phantom),
      counts_(std::move(received_counts)),
      src_first_(s.world, 0) {
  for (int d = 0; d < world_; ++d) {
    for (int le = 0; le < per_; ++le) sent_rows[d] += ro.per_expert[d * per_ + le];
  }
  for (int src = 0; src < world_; ++src) {
    for (int le = 0; le < per_; ++le) received_rows[src] += rows_from(src, le);
  }
  received = std::accumulate(received_rows.begin(), received_rows.end(), std::int64_t{0});
  for (int src = 1; src < world_; ++src) src_first_[src] = src_first_[src - 1] + received_rows[src - 1];
}

// Rows [first, first + count) of a tensor.
struct Cut {
  Tensor t;
  std::int64_t first = 0, count = 0;
};

// The cuts put together, in order; empty ones are skipped.
Tensor rows_of(Rank& r, const std::vector<Cut>& cuts, std::int64_t cols, bool phantom) {
  std::vector<Tensor> pieces;
  for (const Cut& c : cuts) {
    if (c.count == 0) continue;
    pieces.push_back(c.first == 0 && c.count == c.t.size(0) ? c.t : r.slice(c.t, 0, c.first, c.count));
  }
  if (pieces.empty()) return phantom ? r.phantom({0, cols}) : r.zeros({0, cols});
  return pieces.size() == 1 ? pieces[0] : r.cat(pieces, 0);
}

Tensor Splits::rows_for_expert(Rank& r, const Tensor& box, int le) const {
  std::vector<Cut> cuts;
  for (int src = 0; src < world_; ++src) {
    std::int64_t first = src_first_[src];
    for (int l = 0; l < le; ++l) first += rows_from(src, l);
    cuts.push_back({box, first, rows_from(src, le)});
  }
  return rows_of(r, cuts, cols_, phantom_);
}

Tensor Splits::in_source_order(Rank& r, const std::vector<Tensor>& per_expert_rows) const {
  std::vector<std::int64_t> at(per_, 0);
  std::vector<Cut> cuts;
  for (int src = 0; src < world_; ++src) {
    for (int le = 0; le < per_; ++le) {
      cuts.push_back({per_expert_rows[le], at[le], rows_from(src, le)});
      at[le] += rows_from(src, le);
    }
  }
  return rows_of(r, cuts, cols_, phantom_);
}

// P and C from the kept routes; --break no-gate puts 1 in C instead of the gates.
DispatchCombine dispatch_combine(Rank& r, const MoeOptions& o, const Routing& ro, std::int64_t tokens) {
  const std::int64_t R = ro.kept(), T = tokens;
  if (o.phantom) return {r.phantom({R, T}), r.phantom({T, R})};
  const bool gated = o.broken != "no-gate";
  std::vector<float> p(static_cast<std::size_t>(R * T), 0.0f), c(static_cast<std::size_t>(T * R), 0.0f);
  for (std::int64_t i = 0; i < R; ++i) {
    p[i * T + ro.routes[i].token] = 1.0f;
    c[ro.routes[i].token * R + i] = gated ? static_cast<float>(ro.routes[i].gate) : 1.0f;
  }
  return {r.from_host({R, T}, p), r.from_host({T, R}, c)};
}

// The backward of out = relu(xe @ W1) @ W2 (h its hidden activations), given d out for its rows; an expert
// that received no rows has zero gradients.
ExpertGrads expert_backward(Rank& r, const MoeOptions& o, const MoeShape& s, const Tensor& xe,
                            const Tensor& h, const Tensor& w2, const Tensor& dout) {
  const std::int64_t D = s.dim, H = s.hidden;
  if (dout.size(0) == 0) {
    Tensor dw1 = o.phantom ? r.phantom({D, H}) : r.zeros({D, H});
    return {dw1, o.phantom ? r.phantom({H, D}) : r.zeros({H, D})};
  }
  Tensor dw2 = r.matmul(h, dout, Trans::Yes, Trans::No);
  Tensor dz = r.relu_backward(r.matmul(dout, w2, Trans::No, Trans::Yes), h);
  return {r.matmul(xe, dz, Trans::Yes, Trans::No), dw2};
}

// d p_e / d l_j = p_e (delta_ej - p_j), the softmax's Jacobian. Choosing the top k is flat almost
// everywhere: no gradient.
std::vector<double> logit_grads(const Routing& ro, const std::vector<double>& dgate, std::int64_t tokens,
                                int experts) {
  std::vector<double> d(static_cast<std::size_t>(tokens * experts), 0.0);
  for (std::size_t i = 0; i < ro.routes.size(); ++i) {
    const Route& r = ro.routes[i];
    const double* p = &ro.probs[r.token * experts];
    for (int j = 0; j < experts; ++j) {
      d[r.token * experts + j] += dgate[i] * p[r.expert] * ((j == r.expert ? 1.0 : 0.0) - p[j]);
    }
  }
  return d;
}

// d loss / d logits [tokens, experts] on the device. d gate of each route is <d y, its expert's output> =
// (its output's row sum, `back` @ ones) / batch; the softmax's Jacobian, on the host where the routing is,
// gives d logits.
Tensor router_logit_grads(Rank& r, const MoeOptions& o, const MoeShape& s, const Routing& ro,
                          const Tensor& back, const Tensor& ones) {
  const std::int64_t R = ro.kept(), T = s.tokens_per_rank;
  if (o.phantom) {
    Tensor dlogits = r.phantom({T, s.experts});
    if (R > 0) r.matmul(back, ones);
    r.synchronize();  // the host waits for the gates' gradients
    return dlogits;
  }
  std::vector<double> dgate(static_cast<std::size_t>(R), 0.0);
  if (R > 0) {
    const std::vector<float> row_sums = r.to_host(r.matmul(back, ones));
    for (std::int64_t i = 0; i < R; ++i) dgate[i] = row_sums[i] / static_cast<double>(s.batch);
  }
  const std::vector<double> dl = logit_grads(ro, dgate, T, s.experts);
  return r.from_host({T, s.experts}, std::vector<float>(dl.begin(), dl.end()));
}

// ---- checks and output --------------------------------------------------------------------------------

MoeShape shape_of(const MoeOptions& o, int world) {
  auto fail = [](const std::string& why) { throw UsageError("moe: " + why); };
  if (o.experts < world || o.experts % world != 0) {
    fail(fmt::format(
        "--experts {} must be a multiple of --world {}: every rank holds the same number of experts",
        o.experts, world));
  }
  if (o.top_k > o.experts) fail(fmt::format("--top-k {} is more than --experts {}", o.top_k, o.experts));
  if (o.batch % world != 0) {
    fail(fmt::format("--batch {} must be a multiple of --world {}: every rank routes batch/world tokens",
                     o.batch, world));
  }
  MoeShape s;
  s.world = world;
  s.experts = o.experts;
  s.experts_per_rank = o.experts / world;
  s.top_k = o.top_k;
  s.batch = o.batch;
  s.tokens_per_rank = o.batch / world;
  s.dim = o.dim;
  s.hidden = o.hidden;
  s.skew = o.skew;
  s.capacity = static_cast<std::int64_t>(
      std::ceil(static_cast<double>(s.tokens_per_rank * s.top_k) / s.experts * o.capacity_factor - 1e-9));
  return s;
}

void print_plan(Rank& r, const MoeOptions& o, const MoeShape& s) {
  if (r.rank() != 0) return;
  r.print(fmt::format(
      "moe: {} ranks, {} experts ({} per rank), top-{} routing; {} tokens per rank; experts {} -> {} -> {}; "
      "capacity {} tokens per expert from each rank (factor {}){}",
      s.world, s.experts, s.experts_per_rank, s.top_k, s.tokens_per_rank, s.dim, s.hidden, s.dim, s.capacity,
      o.capacity_factor, o.skew != 0 ? fmt::format("; router skewed by {} towards expert 0", o.skew) : ""));
}

// "step 1/2  time 1.2 ms  this rank's experts 300 us"; the check's verdict follows it.
std::string step_line(int step, int steps, const LastStep& last) {
  return fmt::format("step {}/{}  time {}  this rank's experts {}", step, steps,
                     mlp::format_time(last.step_us), mlp::format_time(last.experts_us));
}

// float32 forward and backward of this layer against double: a few units of float32's 6e-8 per operation
// in a chain of a few dozen; 1e-4 leaves room and still catches any wrong term (a missing gate, a gradient
// not summed over ranks are 1e-1 or more).
constexpr double kTolerance = 1e-4;

// Whether float32 may put a relu input on either side of zero: its exact value `acc` is a sum of `terms`
// products whose magnitudes add to `magnitude`, which float32 computes within (terms + 2) units of
// rounding of that magnitude (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 3.1: a dot
// product of n terms within n u of the sum of magnitudes; two more for the float32 copies of x and W1).
bool relu_undecided(double acc, double magnitude, std::int64_t terms) {
  constexpr double kUnit = 0x1p-24;  // float32's unit roundoff
  return std::fabs(acc) <= static_cast<double>(terms + 2) * kUnit * magnitude;
}

// The same layer over the whole batch, in double precision on the host: routing in groups of one rank's
// tokens (GShard's groups: capacity is per group), then every expert on all of its tokens.
class Reference {
 public:
  Reference(const MoeShape& s, const MoeOptions& o);
  void step();  // one step on the full batch: loss, gradients, then the optimizer
  // The state the next step starts from, as one flat list: the parameters in the optimizer's slots (each
  // expert's W1 and W2, then the router), then with AdamW their first moments, then their second.
  std::int64_t state_size() const;
  std::int64_t slot_offset(int slot) const;
  void start_from(const std::vector<float>& state);

  double loss() const { return loss_; }  // of the last step, before its update
  const std::vector<double>& w1(int e) const { return w1_[e]; }
  const std::vector<double>& w2(int e) const { return w2_[e]; }
  const std::vector<double>& dw1(int e) const { return dw1_[e]; }
  // How far float32 may take each element of dw1 and of w1 (after the update) beyond its rounding: a relu
  // input within float32's error of zero may fall on either side of it, and its unit's gradient is then
  // taken or not (relu_undecided). Zero where every unit is decided.
  const std::vector<double>& dw1_allowance(int e) const { return dw1_allow_[e]; }
  const std::vector<double>& w1_allowance(int e) const { return w1_allow_[e]; }
  const std::vector<double>& dw2(int e) const { return dw2_[e]; }
  const std::vector<double>& wr() const { return wr_; }
  const std::vector<double>& dwr() const { return dwr_; }

 private:
  // One group's routes through their experts, forward and backward: adds to the loss and to the experts'
  // gradients, and returns d loss / d gate of every route.
  std::vector<double> experts(const double* x, const Routing& ro, double dy);
  void update(std::vector<double>& p, const std::vector<double>& g, int slot);
  // The update's spread over gradients within `allow` of `g`, element by element, before update(p, g).
  std::vector<double> update_spread(const std::vector<double>& p, const std::vector<double>& g,
                                    const std::vector<double>& allow, int slot) const;

  MoeShape s_;
  MoeOptions o_;
  std::vector<double> x_, wr_, dwr_;
  std::vector<std::vector<double>> w1_, w2_, dw1_, dw2_, adam_m_, adam_v_, dw1_allow_, w1_allow_;
  double loss_ = 0;
  int t_ = 0;
};

StepCheck::StepCheck(Rank& r, const MoeOptions& o, const MoeShape& s) : r_(r), s_(s) {
  if (!o.phantom) ref_ = std::make_unique<Reference>(s, o);
  largest_grad_.assign(2 * s.experts_per_rank + 1, 0.0);
}
StepCheck::~StepCheck() = default;

std::vector<float> StepCheck::gather_state(const Weights& w, const mlp::Optimizer& opt) {
  // Each rank writes its experts' slots (rank 0 the replicated router too) and leaves the rest zero; a sum
  // over the world puts the whole state on every rank. float32 values and zeros add exactly.
  const std::int64_t size = ref_->state_size();
  const std::int64_t params = ref_->slot_offset(2 * s_.experts) + s_.dim * s_.experts;
  std::vector<float> mine(static_cast<std::size_t>(size), 0.0f);
  const std::vector<Tensor> held = w.params();  // the optimizer's order: each expert's W1 and W2, the router
  auto put = [&](int which, int slot, const Tensor& t) {
    const std::vector<float> values = r_.to_host(t);
    std::copy(values.begin(), values.end(), mine.begin() + which * params + ref_->slot_offset(slot));
  };
  for (int i = 0; i < static_cast<int>(held.size()); ++i) {
    const bool router = i == static_cast<int>(held.size()) - 1;
    if (router && r_.rank() != 0) continue;
    const int slot = router ? 2 * s_.experts : 2 * r_.rank() * s_.experts_per_rank + i;
    put(0, slot, held[i]);
    if (opt.m().empty()) continue;
    put(1, slot, opt.m()[i]);
    put(2, slot, opt.v()[i]);
  }
  Tensor all = r_.from_host(Shape{size}, mine);
  r_.all_reduce(all, ReduceOp::Sum);
  return r_.to_host(all);
}

std::string StepCheck::after_step(int step, const Tensor& y_sum, const std::vector<Tensor>& grads,
                                  const Weights& w, const mlp::Optimizer& opt) {
  if (!ref_) return "";
  auto scope = r_.bookkeeping("reference");
  ref_->step();
  const std::int64_t D = s_.dim, H = s_.hidden;
  Tensor loss = r_.from_host({1}, {r_.to_host(y_sum)[0] / static_cast<float>(s_.batch)});
  r_.all_reduce(loss, ReduceOp::Sum);
  const double loss_all = r_.to_host(loss)[0];
  check::Agreement a;
  a.add_relative({static_cast<float>(loss_all)}, {ref_->loss()}, "the loss", 1);
  for (int le = 0; le < s_.experts_per_rank; ++le) {
    const int e = r_.rank() * s_.experts_per_rank + le;
    a.add_relative(r_.to_host(grads[2 * le]), ref_->dw1(e), fmt::format("expert {} W1 gradient", e), H,
                   &largest_grad_[2 * le], &ref_->dw1_allowance(e));
    a.add_relative(r_.to_host(grads[2 * le + 1]), ref_->dw2(e), fmt::format("expert {} W2 gradient", e), D,
                   &largest_grad_[2 * le + 1]);
    a.add_relative(r_.to_host(w.w1[le]), ref_->w1(e), fmt::format("expert {} W1", e), H, nullptr,
                   &ref_->w1_allowance(e));
    a.add_relative(r_.to_host(w.w2[le]), ref_->w2(e), fmt::format("expert {} W2", e), D);
  }
  a.add_relative(r_.to_host(grads.back()), ref_->dwr(), "router gradient", s_.experts,
                 &largest_grad_[2 * s_.experts_per_rank]);
  a.add_relative(r_.to_host(w.router), ref_->wr(), "router weight", s_.experts);
  const bool ok = a.worst <= kTolerance;
  r_.check(fmt::format("moe step {}: loss, expert and router gradients and weights equal one device's", step),
           ok,
           fmt::format("{}largest relative difference {:.2g} (tolerance {:.0e})",
                       a.where.empty() ? "" : a.where + "; ", a.worst, kTolerance));
  if (a.worst > worst_) worst_ = a.worst;
  ref_->start_from(gather_state(w, opt));
  return fmt::format("  loss {:.6f} (one device {:.6f})  {}", loss_all, ref_->loss(),
                     ok ? "ok" : "DIFFERENT");
}

// What each rank sends rank 0 after the training: its last step's expert time and routes, and its worst
// difference from one device; the rows each of its experts computed follow them.
struct RankFigures {
  float experts_us, dropped, routed, worst;
};

// Every rank's load and times to rank 0, after the training so it does not disturb the timing.
void print_summary(Rank& r, const MoeOptions& o, const MoeShape& s, const LastStep& last, double worst) {
  auto scope = r.region("report");
  const RankFigures mine{static_cast<float>(last.experts_us), static_cast<float>(last.dropped),
                         static_cast<float>(last.routed), static_cast<float>(worst)};
  const auto all = gather_figures(r, mine, std::vector<float>(last.received.begin(), last.received.end()));
  if (r.rank() != 0) return;
  const int world = s.world, per = s.experts_per_rank;
  double mean_us = 0, max_us = 0, total_dropped = 0, total_routed = 0, used = 0;
  std::vector<std::string> load, times;
  for (int src = 0; src < world; ++src) {
    const RankFigures& f = all[src].figures;
    mean_us += f.experts_us / world;
    max_us = std::max<double>(max_us, f.experts_us);
    total_dropped += f.dropped;
    total_routed += f.routed;
    used = std::max<double>(used, f.worst);
    for (int le = 0; le < per; ++le)
      load.push_back(fmt::format("expert{} {}", src * per + le, all[src].list[le]));
  }
  for (int src = 0; src < world; ++src) {
    const float us = all[src].figures.experts_us;
    times.push_back(
        fmt::format("rank{} {} ({:.2f}x)", src, mlp::format_time(us), mean_us > 0 ? us / mean_us : 0.0));
  }
  r.print(fmt::format("tokens per expert (the load, last step): {}", fmt::join(load, "  ")));
  r.print(fmt::format("dropped: {} of {} routes over capacity ({:.1f}%), passed on by the residual alone",
                      total_dropped, total_routed,
                      total_routed > 0 ? 100 * total_dropped / total_routed : 0.0));
  r.print(fmt::format("expert compute per rank (forward + backward, last step): {}; mean {}",
                      fmt::join(times, "  "), mlp::format_time(mean_us)));
  double least_us = max_us;
  for (const auto& f : all) least_us = std::min<double>(least_us, f.figures.experts_us);
  r.print(
      fmt::format("load imbalance: the busiest rank's experts take {:.2f}x the mean; the least busy rank "
                  "waits {} per step "
                  "for them (idle before the combine all_to_all on the timeline)",
                  mean_us > 0 ? max_us / mean_us : 0.0, mlp::format_time(max_us - least_us)));
  r.print(fmt::format("last step: {}", mlp::format_time(last.step_us)));
  if (o.phantom) {
    r.print(
        "phantom tensors hold no numbers: the load follows the skew's softmax, and the comparison with one "
        "device was skipped");
    return;
  }
  r.print(
      fmt::format("equal to one device over the full batch after every step: {} (largest relative difference "
                  "{:.2g})",
                  used <= kTolerance ? "yes" : "NO", used));
}

// ---- the one-device reference --------------------------------------------------------------------------

// The host's copy of a seeded weight, as Rank::randn makes it.
std::vector<double> seeded(std::int64_t n, std::uint64_t seed, float std) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = std * normal_at(seed, static_cast<std::uint64_t>(i));
  return v;
}

Reference::Reference(const MoeShape& s, const MoeOptions& o) : s_(s), o_(o) {
  x_ = seeded(s.batch * s.dim, kTokenSeed, 1.0f);
  wr_ = seeded(s.dim * s.experts, kRouterSeed, router_std(s.dim));
  for (int e = 0; e < s.experts; ++e) {
    w1_.push_back(seeded(s.dim * s.hidden, kExpertSeed + 2 * e, w1_std(s.dim)));
    w2_.push_back(seeded(s.hidden * s.dim, kExpertSeed + 2 * e + 1, w2_std(s.hidden)));
  }
  dw1_ = w1_, dw2_ = w2_, dw1_allow_ = w1_, w1_allow_ = w1_;
  adam_m_.resize(2 * s.experts + 1);
  adam_v_.resize(2 * s.experts + 1);
}

std::int64_t Reference::slot_offset(int slot) const {
  return std::min(slot, 2 * s_.experts) * s_.dim * s_.hidden;
}

std::int64_t Reference::state_size() const {
  const std::int64_t params = slot_offset(2 * s_.experts) + s_.dim * s_.experts;
  return o_.optimizer == "adamw" ? 3 * params : params;
}

void Reference::start_from(const std::vector<float>& state) {
  const int slots = 2 * s_.experts + 1;
  const std::int64_t params = slot_offset(2 * s_.experts) + s_.dim * s_.experts;
  auto part = [&](int which, int slot, std::vector<double>& out) {
    const std::int64_t n = (slot == slots - 1 ? s_.dim * s_.experts : s_.dim * s_.hidden);
    const float* first = state.data() + which * params + slot_offset(slot);
    out.assign(first, first + n);
  };
  for (int e = 0; e < s_.experts; ++e) part(0, 2 * e, w1_[e]), part(0, 2 * e + 1, w2_[e]);
  part(0, slots - 1, wr_);
  if (o_.optimizer != "adamw") return;
  for (int slot = 0; slot < slots; ++slot) part(1, slot, adam_m_[slot]), part(2, slot, adam_v_[slot]);
}

void Reference::step() {
  const std::int64_t T = s_.tokens_per_rank, D = s_.dim, E = s_.experts;
  for (auto& g : dw1_) std::fill(g.begin(), g.end(), 0.0);
  for (auto& g : dw1_allow_) std::fill(g.begin(), g.end(), 0.0);
  for (auto& g : dw2_) std::fill(g.begin(), g.end(), 0.0);
  dwr_.assign(static_cast<std::size_t>(D * E), 0.0);
  loss_ = 0;
  const double dy = 1.0 / static_cast<double>(s_.batch);
  for (int g = 0; g < s_.world; ++g) {  // one group per rank
    const double* x = &x_[g * T * D];
    std::vector<double> logits(static_cast<std::size_t>(T * E), 0.0);
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t e = 0; e < E; ++e) {
        double acc = e == 0 ? s_.skew : 0.0;
        for (std::int64_t c = 0; c < D; ++c) acc += x[t * D + c] * wr_[c * E + e];
        logits[t * E + e] = acc;
      }
    }
    const Routing ro = route(logits, T, static_cast<int>(E), s_.top_k, s_.capacity);
    for (std::int64_t t = 0; t < T; ++t) {  // the residual
      for (std::int64_t c = 0; c < D; ++c) loss_ += x[t * D + c] * dy;
    }
    const std::vector<double> dgate = experts(x, ro, dy);
    const std::vector<double> dl = logit_grads(ro, dgate, T, static_cast<int>(E));
    for (std::int64_t c = 0; c < D; ++c) {
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t e = 0; e < E; ++e) dwr_[c * E + e] += x[t * D + c] * dl[t * E + e];
      }
    }
  }
  ++t_;
  for (int e = 0; e < s_.experts; ++e) {
    w1_allow_[e] = update_spread(w1_[e], dw1_[e], dw1_allow_[e], 2 * e);
    update(w1_[e], dw1_[e], 2 * e);
    update(w2_[e], dw2_[e], 2 * e + 1);
  }
  update(wr_, dwr_, 2 * s_.experts);
}

std::vector<double> Reference::experts(const double* x, const Routing& ro, double dy) {
  const std::int64_t D = s_.dim, H = s_.hidden;
  std::vector<double> dgate(ro.routes.size());
  for (std::size_t i = 0; i < ro.routes.size(); ++i) {
    const Route& r = ro.routes[i];
    const double* xt = &x[r.token * D];
    const std::vector<double>&w1 = w1_[r.expert], &w2 = w2_[r.expert];
    std::vector<double> h(static_cast<std::size_t>(H)), out(static_cast<std::size_t>(D), 0.0);
    std::vector<char> undecided(static_cast<std::size_t>(H), 0);
    for (std::int64_t j = 0; j < H; ++j) {
      double acc = 0, magnitude = 0;
      for (std::int64_t c = 0; c < D; ++c) {
        acc += xt[c] * w1[c * H + j];
        magnitude += std::fabs(xt[c] * w1[c * H + j]);
      }
      h[j] = std::max(acc, 0.0);
      undecided[j] = relu_undecided(acc, magnitude, D);
    }
    for (std::int64_t c = 0; c < D; ++c) {
      for (std::int64_t j = 0; j < H; ++j) out[c] += h[j] * w2[j * D + c];
    }
    const double gate = r.gate;
    double out_sum = 0;
    for (std::int64_t c = 0; c < D; ++c) out_sum += out[c];
    loss_ += gate * out_sum * dy;
    dgate[i] = out_sum * dy;
    // The expert's backward with d out = gate * dy in every column.
    const double dout = gate * dy;
    std::vector<double> dh(static_cast<std::size_t>(H), 0.0);
    for (std::int64_t j = 0; j < H; ++j) {
      for (std::int64_t c = 0; c < D; ++c) dw2_[r.expert][j * D + c] += h[j] * dout;
      if (h[j] > 0 || undecided[j]) {
        for (std::int64_t c = 0; c < D; ++c) dh[j] += dout * w2[j * D + c];
      }
    }
    for (std::int64_t c = 0; c < D; ++c) {
      for (std::int64_t j = 0; j < H; ++j) {
        if (undecided[j]) {
          dw1_allow_[r.expert][c * H + j] += std::fabs(xt[c] * dh[j]);
        } else {
          dw1_[r.expert][c * H + j] += xt[c] * dh[j];
        }
      }
    }
  }
  return dgate;
}

std::vector<double> Reference::update_spread(const std::vector<double>& p, const std::vector<double>& g,
                                             const std::vector<double>& allow, int slot) const {
  std::vector<double> spread(p.size(), 0.0);
  const AdamW h;
  const check::AdamWCorrections c = check::adamw_corrections(h, t_);
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (allow[i] == 0) continue;
    if (o_.optimizer != "adamw") {
      spread[i] = static_cast<float>(o_.lr) * allow[i];
      continue;
    }
    // Over so small an interval AdamW's step is close to linear in the gradient: its ends bound it.
    auto step_with = [&](double gi) {
      double m = adam_m_[slot].empty() ? 0 : adam_m_[slot][i],
             v = adam_v_[slot].empty() ? 0 : adam_v_[slot][i];
      return check::adamw_element(p[i], gi, m, v, static_cast<float>(o_.lr), h.weight_decay, h, c.c1, c.c2);
    };
    const double at = step_with(g[i]);
    spread[i] =
        std::max(std::fabs(step_with(g[i] - allow[i]) - at), std::fabs(step_with(g[i] + allow[i]) - at));
  }
  return spread;
}

// SGD or AdamW, as Rank::sgd_step and Rank::adamw_step compute them (a float32 learning rate).
void Reference::update(std::vector<double>& p, const std::vector<double>& g, int slot) {
  if (o_.optimizer != "adamw") {
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= o_.lr * g[i];
    return;
  }
  const AdamW h;
  check::adamw_step(p, g, adam_m_[slot], adam_v_[slot], static_cast<float>(o_.lr), h.weight_decay, h, t_);
}

}  // namespace

using O = MoeOptions;
// One layer of experts: no --layers.
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .remove("layers")
        .add({
            {"world", &O::world, "ranks: experts are spread over them (expert parallelism)"},
            Option<O>("experts", &O::experts, "experts, a multiple of --world").at_least(1),
            Option<O>("top-k", &O::top_k, "experts per token (1: Switch Transformer, 2: GShard)")
                .at_least(1)
                .at_most(2),
            Option<O>("capacity-factor", &O::capacity_factor,
                      "an expert takes at most this times an even share of each rank's tokens")
                .above(0),
            // A bias of 100 already sends every token to expert 0 (e^100 against the other logits' e^0).
            Option<O>("skew", &O::skew, "added to the router's logit of expert 0: an unbalanced load")
                .at_least(-100)
                .at_most(100),
            Option<O>("batch", &O::batch, "tokens per step, all ranks together").at_least(1),
            Option<O>("dim", &O::dim, "model width: experts map dim -> hidden -> dim").at_least(1),
            Option<O>("hidden", &O::hidden, "each expert's hidden width").at_least(1),
            break_option<O>(&O::broken, {"no-gate", "no-router-all-reduce"}),
        });

RANKLAB_LESSON("moe",
               "mixture of experts: top-k routing, uneven all_to_all dispatch and combine, load imbalance as "
               "bubble",
               moe, kOptions);

}  // namespace ranklab
