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
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "lessons/check.h"
#include "lessons/mlp.h"

namespace ranklab {
namespace {

// Seeds: the batch is one [batch, dim] tensor; the router and each expert's two weights have their own.
constexpr std::uint64_t kTokenSeed = std::uint64_t{3} << 32;
constexpr std::uint64_t kRouterSeed = 7000;
constexpr std::uint64_t kExpertSeed = 8000;  // expert e: W1 kExpertSeed + 2e, W2 kExpertSeed + 2e + 1

struct Shape3 {
  int world = 1, experts = 1, per_rank = 1, top_k = 1;
  std::int64_t tokens = 1;  // per rank
  std::int64_t batch = 1, dim = 1, hidden = 1;
  std::int64_t capacity = 1;  // tokens an expert takes from each rank
  double skew = 0;
};

float router_std(std::int64_t dim) {
  return 1.0f / std::sqrt(static_cast<float>(dim));
}
float w1_std(std::int64_t dim) {
  return std::sqrt(2.0f / static_cast<float>(dim));  // He: keeps relu's activations steady
}
float w2_std(std::int64_t hidden) {
  return 1.0f / std::sqrt(static_cast<float>(hidden));
}

// The host's copy of a seeded weight, as Rank::randn makes it.
std::vector<double> seeded(std::int64_t n, std::uint64_t seed, float std) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = std * normal_at(seed, static_cast<std::uint64_t>(i));
  return v;
}

// ---- routing (the same code for the ranks and for the one-device reference) -------------------------------

struct Route {
  std::int64_t token = 0;  // within the rank's tokens
  int expert = 0;
  double gate = 0;  // the router's softmax probability of this expert for this token
};

struct Routing {
  std::vector<Route> routes;             // kept, by expert then token: the dispatch order
  std::vector<std::int64_t> per_expert;  // kept routes per expert
  std::int64_t dropped = 0;              // routes over an expert's capacity
  std::vector<double> probs;             // [tokens, experts], the softmax
  double closest_call = INFINITY;        // the smallest gap between a chosen and an unchosen logit
};

// `logits` [tokens, experts] row-major, the skew already added. Top-k by probability, the lower expert first
// on equal ones; capacity in GShard's priority: every token's first choice before any second choice, tokens
// in order.
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

// d loss / d logits [tokens, experts] from d loss / d gate of every kept route: the softmax's Jacobian,
// d p_e / d l_j = p_e (delta_ej - p_j). Choosing the top k is flat almost everywhere: no gradient.
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

// ---- the one-device reference --------------------------------------------------------------------------
// The same layer over the whole batch, in double precision on the host: routing in groups of one rank's
// tokens (GShard's groups: capacity is per group), then every expert on all of its tokens.
class Reference {
 public:
  Reference(const Shape3& s, const MoeOptions& o) : s_(s), o_(o) {
    x_ = seeded(s.batch * s.dim, kTokenSeed, 1.0f);
    wr_ = seeded(s.dim * s.experts, kRouterSeed, router_std(s.dim));
    for (int e = 0; e < s.experts; ++e) {
      w1_.push_back(seeded(s.dim * s.hidden, kExpertSeed + 2 * e, w1_std(s.dim)));
      w2_.push_back(seeded(s.hidden * s.dim, kExpertSeed + 2 * e + 1, w2_std(s.hidden)));
    }
    dw1_ = w1_, dw2_ = w2_;
    adam_m_.resize(2 * s.experts + 1);
    adam_v_.resize(2 * s.experts + 1);
  }

  void step() {
    const std::int64_t T = s_.tokens, D = s_.dim, H = s_.hidden, E = s_.experts;
    for (auto& g : dw1_) std::fill(g.begin(), g.end(), 0.0);
    for (auto& g : dw2_) std::fill(g.begin(), g.end(), 0.0);
    dwr_.assign(static_cast<std::size_t>(D * E), 0.0);
    loss_ = 0;
    per_expert_.assign(E, 0);
    dropped_ = 0;
    const double dy = 1.0 / static_cast<double>(s_.batch);
    for (int g = 0; g < s_.world; ++g) {
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
      dropped_ += ro.dropped;
      for (std::int64_t e = 0; e < E; ++e) per_expert_[e] += ro.per_expert[e];
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t c = 0; c < D; ++c) loss_ += x[t * D + c] * dy;
      }
      std::vector<double> dgate(ro.routes.size());
      for (std::size_t i = 0; i < ro.routes.size(); ++i) {
        const Route& r = ro.routes[i];
        const double* xt = &x[r.token * D];
        const std::vector<double>&w1 = w1_[r.expert], &w2 = w2_[r.expert];
        std::vector<double> h(static_cast<std::size_t>(H)), out(static_cast<std::size_t>(D), 0.0);
        for (std::int64_t j = 0; j < H; ++j) {
          double acc = 0;
          for (std::int64_t c = 0; c < D; ++c) acc += xt[c] * w1[c * H + j];
          h[j] = std::max(acc, 0.0);
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
          if (h[j] > 0) {
            for (std::int64_t c = 0; c < D; ++c) dh[j] += dout * w2[j * D + c];
          }
        }
        for (std::int64_t c = 0; c < D; ++c) {
          for (std::int64_t j = 0; j < H; ++j) dw1_[r.expert][c * H + j] += xt[c] * dh[j];
        }
      }
      const std::vector<double> dl = logit_grads(ro, dgate, T, static_cast<int>(E));
      for (std::int64_t c = 0; c < D; ++c) {
        for (std::int64_t t = 0; t < T; ++t) {
          for (std::int64_t e = 0; e < E; ++e) dwr_[c * E + e] += x[t * D + c] * dl[t * E + e];
        }
      }
    }
    ++t_;
    for (int e = 0; e < s_.experts; ++e) {
      update(w1_[e], dw1_[e], 2 * e);
      update(w2_[e], dw2_[e], 2 * e + 1);
    }
    update(wr_, dwr_, 2 * s_.experts);
  }

  double loss() const { return loss_; }
  const std::vector<double>& w1(int e) const { return w1_[e]; }
  const std::vector<double>& w2(int e) const { return w2_[e]; }
  const std::vector<double>& dw1(int e) const { return dw1_[e]; }
  const std::vector<double>& dw2(int e) const { return dw2_[e]; }
  const std::vector<double>& wr() const { return wr_; }
  const std::vector<double>& dwr() const { return dwr_; }
  const std::vector<std::int64_t>& per_expert() const { return per_expert_; }
  std::int64_t dropped() const { return dropped_; }

 private:
  // SGD or AdamW, as Rank::sgd_step and Rank::adamw_step compute them (a float32 learning rate).
  void update(std::vector<double>& p, const std::vector<double>& g, int slot) {
    if (o_.optimizer != "adamw") {
      for (std::size_t i = 0; i < p.size(); ++i) p[i] -= o_.lr * g[i];
      return;
    }
    const AdamW h;
    check::adamw_step(p, g, adam_m_[slot], adam_v_[slot], static_cast<float>(o_.lr), h.weight_decay, h, t_);
  }

  Shape3 s_;
  MoeOptions o_;
  std::vector<double> x_, wr_, dwr_;
  std::vector<std::vector<double>> w1_, w2_, dw1_, dw2_, adam_m_, adam_v_;
  double loss_ = 0;
  std::vector<std::int64_t> per_expert_;
  std::int64_t dropped_ = 0;
  int t_ = 0;
};

// float32 forward and backward of this layer against double: a few units of float32's 6e-8 per operation
// in a chain of a few dozen; 1e-4 leaves room and still catches any wrong term (a missing gate, a gradient
// not summed over ranks are 1e-1 or more).
constexpr double kTolerance = 1e-4;

// ---- the lesson -----------------------------------------------------------------------------------------

// Rows [first, first + count) of every part, cut from `parts` and put together; empty parts are skipped.
Tensor rows_of(Rank& r, const std::vector<std::pair<Tensor, std::pair<std::int64_t, std::int64_t>>>& cuts,
               std::int64_t cols, bool phantom) {
  std::vector<Tensor> pieces;
  for (const auto& [t, range] : cuts) {
    if (range.second == 0) continue;
    pieces.push_back(
        range.first == 0 && range.second == t.size(0) ? t : r.slice(t, 0, range.first, range.second));
  }
  if (pieces.empty()) return phantom ? r.phantom({0, cols}) : r.zeros({0, cols});
  return pieces.size() == 1 ? pieces[0] : r.cat(pieces, 0);
}

void moe(Rank& r, const MoeOptions& o) {
  const int world = r.world_size(), rank = r.rank();
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

  Shape3 s;
  s.world = world;
  s.experts = o.experts;
  s.per_rank = o.experts / world;
  s.top_k = o.top_k;
  s.batch = o.batch;
  s.tokens = o.batch / world;
  s.dim = o.dim;
  s.hidden = o.hidden;
  s.skew = o.skew;
  // Switch Transformer's expert capacity, per rank: (tokens per rank / experts) * k * capacity factor.
  s.capacity = static_cast<std::int64_t>(
      std::ceil(static_cast<double>(s.tokens * s.top_k) / s.experts * o.capacity_factor - 1e-9));
  const std::int64_t T = s.tokens, D = s.dim, H = s.hidden;
  const int E = s.experts, per = s.per_rank;
  const bool gated = o.broken != "no-gate";

  if (rank == 0) {
    r.print(
        fmt::format("moe: {} ranks, {} experts ({} per rank), top-{} routing; {} tokens per rank; experts {} "
                    "-> {} -> {}; "
                    "capacity {} tokens per expert from each rank (factor {}){}",
                    world, E, per, s.top_k, T, D, H, D, s.capacity, o.capacity_factor,
                    o.skew != 0 ? fmt::format("; router skewed by {} towards expert 0", o.skew) : ""));
  }

  // This rank's tokens, the replicated router, and its experts.
  Tensor x = o.phantom ? r.phantom({T, D})
                       : r.randn_slice({s.batch, D}, 0, rank * T, T, kTokenSeed, 1.0f, DType::Float32);
  Tensor wr = o.phantom ? r.phantom({D, E}) : r.randn({D, E}, kRouterSeed, router_std(D));
  std::vector<Tensor> w1, w2;
  for (int le = 0; le < per; ++le) {
    const int e = rank * per + le;
    w1.push_back(o.phantom ? r.phantom({D, H}) : r.randn({D, H}, kExpertSeed + 2 * e, w1_std(D)));
    w2.push_back(o.phantom ? r.phantom({H, D}) : r.randn({H, D}, kExpertSeed + 2 * e + 1, w2_std(H)));
  }
  std::vector<Tensor> params;
  for (int le = 0; le < per; ++le) params.push_back(w1[le]), params.push_back(w2[le]);
  params.push_back(wr);
  mlp::Optimizer opt(r, o, params);
  std::vector<float> skew_bias(E, 0.0f);
  skew_bias[0] = static_cast<float>(o.skew);
  Tensor bias = o.phantom ? r.phantom({E}) : r.from_host({E}, skew_bias);
  Tensor dy = mlp::loss_grad(r, o, {T, D}, s.batch);
  Tensor ones = o.phantom ? r.phantom({D, 1}) : r.full({D, 1}, 1.0f);
  std::optional<Reference> ref;
  if (!o.phantom) ref.emplace(s, o);

  double step_us = 0, experts_us = 0, worst = 0;
  std::vector<std::int64_t> received_per_expert(per, 0);
  std::int64_t dropped = 0, routed = 0;
  std::string worst_where;
  for (int step = 1; step <= o.steps; ++step) {
    std::optional<Rank::Region> phase;
    r.synchronize();
    r.barrier();
    const double t0 = r.now();

    // 1. Route. With phantom tensors there are no logits: the load follows the skew's softmax instead.
    phase.emplace(&r, "route");
    Tensor logits = r.matmul(x, wr);
    r.add_bias_(logits, bias);
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
    } else {
      const std::vector<float> lf = r.to_host(logits);
      ro = route(std::vector<double>(lf.begin(), lf.end()), T, E, s.top_k, s.capacity);
    }
    const std::int64_t R = std::accumulate(ro.per_expert.begin(), ro.per_expert.end(), std::int64_t{0});
    dropped = ro.dropped;
    routed = T * s.top_k;

    // 2. Exchange the counts: piece d of what this rank sends is its counts for rank d's experts.
    std::vector<float> counts(ro.per_expert.begin(), ro.per_expert.end());
    Tensor sent_counts = r.from_host({E}, counts);
    Tensor got_counts = r.zeros({E});
    r.all_to_all(got_counts, sent_counts);
    const std::vector<float> got = r.to_host(got_counts);  // [source rank][local expert]
    auto from = [&](int src, int le) { return static_cast<std::int64_t>(got[src * per + le]); };
    std::vector<std::int64_t> in_splits(world, 0), out_splits(world, 0);
    for (int d = 0; d < world; ++d) {
      for (int le = 0; le < per; ++le) in_splits[d] += ro.per_expert[d * per + le];
    }
    for (int src = 0; src < world; ++src) {
      for (int le = 0; le < per; ++le) out_splits[src] += from(src, le);
    }
    const std::int64_t received = std::accumulate(out_splits.begin(), out_splits.end(), std::int64_t{0});
    phase.reset();

    // 3. Dispatch: P [routes, tokens] one-hot, so P @ x is the routed tokens sorted by expert.
    phase.emplace(&r, "dispatch");
    Tensor P, C;  // C [tokens, routes]: the gates
    if (o.phantom) {
      P = r.phantom({R, T});
      C = r.phantom({T, R});
    } else {
      std::vector<float> p(static_cast<std::size_t>(R * T), 0.0f), c(static_cast<std::size_t>(T * R), 0.0f);
      for (std::int64_t i = 0; i < R; ++i) {
        p[i * T + ro.routes[i].token] = 1.0f;
        c[ro.routes[i].token * R + i] = gated ? static_cast<float>(ro.routes[i].gate) : 1.0f;
      }
      P = r.from_host({R, T}, p);
      C = r.from_host({T, R}, c);
    }
    // With phantom tensors the one-hot product would cost routes x tokens x dim, far more than the gather
    // kernel a large model uses; the permutation is timed as a copy of the routed rows instead.
    Tensor sorted = o.phantom ? r.cast(r.phantom({R, D}), DType::Float32)
                    : R > 0   ? r.matmul(P, x)
                              : r.zeros({0, D});
    Tensor inbox = mlp::buffer(r, o, {received, D});
    r.all_to_all(inbox, sorted, out_splits, in_splits);
    phase.reset();

    // 4. The experts, each on its rows: from every source rank, the rows for this expert.
    std::vector<std::int64_t> src_first(world, 0);  // where each source's rows start in the inbox
    for (int src = 1; src < world; ++src) src_first[src] = src_first[src - 1] + out_splits[src - 1];
    auto expert_rows = [&](const Tensor& box, int le) {
      std::vector<std::pair<Tensor, std::pair<std::int64_t, std::int64_t>>> cuts;
      for (int src = 0; src < world; ++src) {
        std::int64_t first = src_first[src];
        for (int l = 0; l < le; ++l) first += from(src, l);
        cuts.push_back({box, {first, from(src, le)}});
      }
      return rows_of(r, cuts, D, o.phantom);
    };
    // Back to source order: for every source rank, each local expert's rows from it.
    auto by_source = [&](const std::vector<Tensor>& per_expert_rows) {
      std::vector<std::int64_t> at(per, 0);
      std::vector<std::pair<Tensor, std::pair<std::int64_t, std::int64_t>>> cuts;
      for (int src = 0; src < world; ++src) {
        for (int le = 0; le < per; ++le) {
          cuts.push_back({per_expert_rows[le], {at[le], from(src, le)}});
          at[le] += from(src, le);
        }
      }
      return rows_of(r, cuts, D, o.phantom);
    };
    phase.emplace(&r, "experts");
    const Event experts_begin = r.record_event();
    std::vector<Tensor> xe(per), h(per), out(per);
    for (int le = 0; le < per; ++le) {
      xe[le] = expert_rows(inbox, le);
      received_per_expert[le] = xe[le].size(0);
      if (xe[le].size(0) == 0) {
        out[le] = xe[le];
        continue;
      }
      h[le] = r.relu(r.matmul(xe[le], w1[le]));
      out[le] = r.matmul(h[le], w2[le]);
    }
    Tensor outbox = by_source(out);
    const Event experts_end = r.record_event();
    phase.reset();

    // 5. Combine: the reverse all_to_all, then y = x + C @ (expert outputs).
    phase.emplace(&r, "combine");
    Tensor back = mlp::buffer(r, o, {R, D});
    r.all_to_all(back, outbox, in_splits, out_splits);
    Tensor y = o.phantom ? r.add(x, r.cast(r.phantom({T, D}), DType::Float32))
               : R > 0   ? r.add(x, r.matmul(C, back))
                         : x;
    Tensor y_sum = r.sum(y);
    phase.reset();

    // Backward. d y = 1 / batch everywhere; d back = C^T @ d y goes to the experts as the dispatch went.
    phase.emplace(&r, "backward");
    Tensor dback = o.phantom ? r.cast(r.phantom({R, D}), DType::Float32)
                   : R > 0   ? r.matmul(C, dy, Trans::Yes, Trans::No)
                             : sorted;
    Tensor dinbox = mlp::buffer(r, o, {received, D});
    r.all_to_all(dinbox, dback, out_splits, in_splits);
    const Event experts_bwd_begin = r.record_event();
    std::vector<Tensor> grads;
    for (int le = 0; le < per; ++le) {
      Tensor dout = expert_rows(dinbox, le);
      if (dout.size(0) == 0) {
        grads.push_back(o.phantom ? r.phantom({D, H}) : r.zeros({D, H}));
        grads.push_back(o.phantom ? r.phantom({H, D}) : r.zeros({H, D}));
        continue;
      }
      Tensor dw2 = r.matmul(h[le], dout, Trans::Yes, Trans::No);
      Tensor dz = r.relu_backward(r.matmul(dout, w2[le], Trans::No, Trans::Yes), h[le]);
      Tensor dw1 = r.matmul(xe[le], dz, Trans::Yes, Trans::No);
      grads.push_back(dw1);
      grads.push_back(dw2);
    }
    const Event experts_bwd_end = r.record_event();
    // The router: d gate of each route is <d y, its expert's output> = (its output's row sum) / batch; the
    // softmax's Jacobian (on the host, where the routing is) gives d logits; d Wr = x^T @ d logits, summed
    // over the ranks as a data-parallel gradient.
    Tensor dlogits;
    if (o.phantom) {
      dlogits = r.phantom({T, E});
      if (R > 0) r.matmul(back, ones);
      r.synchronize();  // the host waits for the gates' gradients
    } else {
      std::vector<double> dgate(static_cast<std::size_t>(R), 0.0);
      if (R > 0) {
        const std::vector<float> row_sums = r.to_host(r.matmul(back, ones));
        for (std::int64_t i = 0; i < R; ++i) dgate[i] = row_sums[i] / static_cast<double>(s.batch);
      }
      const std::vector<double> dl = logit_grads(ro, dgate, T, E);
      dlogits = r.from_host({T, E}, std::vector<float>(dl.begin(), dl.end()));
    }
    Tensor dwr = r.matmul(x, dlogits, Trans::Yes, Trans::No);
    if (o.broken != "no-router-all-reduce") r.all_reduce(dwr, ReduceOp::Sum);
    grads.push_back(dwr);
    phase.reset();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    r.synchronize();
    step_us = r.now() - t0;
    experts_us = r.elapsed_us(experts_begin, experts_end) + r.elapsed_us(experts_bwd_begin, experts_bwd_end);

    std::string line = fmt::format("step {}/{}  time {}  this rank's experts {}", step, o.steps,
                                   mlp::format_time(step_us), mlp::format_time(experts_us));
    if (ref) {
      auto scope = r.bookkeeping("reference");
      ref->step();
      Tensor loss = r.from_host({1}, {r.to_host(y_sum)[0] / static_cast<float>(s.batch)});
      r.all_reduce(loss, ReduceOp::Sum);
      const double loss_all = r.to_host(loss)[0];
      check::Agreement a;
      a.add_relative({static_cast<float>(loss_all)}, {ref->loss()}, "the loss", 1);
      for (int le = 0; le < per; ++le) {
        const int e = rank * per + le;
        a.add_relative(r.to_host(grads[2 * le]), ref->dw1(e), fmt::format("expert {} W1 gradient", e), H);
        a.add_relative(r.to_host(grads[2 * le + 1]), ref->dw2(e), fmt::format("expert {} W2 gradient", e), D);
        a.add_relative(r.to_host(w1[le]), ref->w1(e), fmt::format("expert {} W1", e), H);
        a.add_relative(r.to_host(w2[le]), ref->w2(e), fmt::format("expert {} W2", e), D);
      }
      a.add_relative(r.to_host(dwr), ref->dwr(), "router gradient", E);
      a.add_relative(r.to_host(wr), ref->wr(), "router weight", E);
      const bool ok = a.worst <= kTolerance;
      r.check(
          fmt::format("moe step {}: loss, expert and router gradients and weights equal one device's", step),
          ok,
          fmt::format("{}largest relative difference {:.2g} (tolerance {:.0e})",
                      a.where.empty() ? "" : a.where + "; ", a.worst, kTolerance));
      if (a.worst > worst) worst = a.worst, worst_where = a.where;
      line += fmt::format("  loss {:.6f} (one device {:.6f})  {}", loss_all, ref->loss(),
                          ok ? "ok" : "DIFFERENT");
    }
    if (rank == 0 && !o.quiet) r.print(line);
  }

  // Every rank's load and times to rank 0, after the training so it does not disturb the timing.
  auto scope = r.region("report");
  std::vector<float> stats = {static_cast<float>(experts_us), static_cast<float>(dropped),
                              static_cast<float>(routed), static_cast<float>(worst)};
  for (int le = 0; le < per; ++le) stats.push_back(static_cast<float>(received_per_expert[le]));
  const auto all = mlp::gather_to_root(r, stats);
  if (rank != 0) return;
  double mean_us = 0, max_us = 0, total_dropped = 0, total_routed = 0, used = 0;
  std::vector<std::string> load, times;
  for (int src = 0; src < world; ++src) {
    mean_us += all[src][0] / world;
    max_us = std::max<double>(max_us, all[src][0]);
    total_dropped += all[src][1];
    total_routed += all[src][2];
    used = std::max<double>(used, all[src][3]);
    for (int le = 0; le < per; ++le)
      load.push_back(fmt::format("expert{} {}", src * per + le, all[src][4 + le]));
  }
  for (int src = 0; src < world; ++src) {
    times.push_back(fmt::format("rank{} {} ({:.2f}x)", src, mlp::format_time(all[src][0]),
                                mean_us > 0 ? all[src][0] / mean_us : 0.0));
  }
  r.print(fmt::format("tokens per expert (the load, last step): {}", fmt::join(load, "  ")));
  r.print(fmt::format("dropped: {} of {} routes over capacity ({:.1f}%), passed on by the residual alone",
                      total_dropped, total_routed,
                      total_routed > 0 ? 100 * total_dropped / total_routed : 0.0));
  r.print(fmt::format("expert compute per rank (forward + backward, last step): {}; mean {}",
                      fmt::join(times, "  "), mlp::format_time(mean_us)));
  double least_us = max_us;
  for (const auto& st : all) least_us = std::min<double>(least_us, st[0]);
  r.print(
      fmt::format("load imbalance: the busiest rank's experts take {:.2f}x the mean; the least busy rank "
                  "waits {} per step "
                  "for them (idle before the combine all_to_all on the timeline)",
                  mean_us > 0 ? max_us / mean_us : 0.0, mlp::format_time(max_us - least_us)));
  r.print(fmt::format("last step: {}", mlp::format_time(step_us)));
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
