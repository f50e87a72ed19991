#include "lessons/parallel/expert_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "common/errors.h"
#include "common/random.h"

namespace ranklab::parallel {

// ---- the layer --------------------------------------------------------------------------------------------

Tensor ExpertParallel::forward(const Tensor& x, const Tensor& router, const std::vector<Tensor>& w_in,
                               const std::vector<Tensor>& w_out, Kept& k, int layer, const Biases& b) {
  // 1. Route: the router's GEMM on the device, each token's top-k on the host.
  k.layer = layer;
  Tensor logits = r.matmul(x, router);
  if (b.router.defined()) r.add_bias_(logits, b.router);
  k.routing = route(logits, layer);
  // 2-5. Permute the routed rows into dispatch order, exchange the counts, send each row to its expert's
  // rank, and sort what arrives by local expert.
  plan_exchange(k);
  k.sorted = dispatch(r.gather_rows(x, k.index, Tensor()), k);
  // 6. The experts, each on its rows: a popular expert computes longer while the others wait.
  const std::int64_t h = x.size(1);
  Tensor out = buffer(r, phantom, Shape{k.sorted.size(0), h}, x.dtype());
  k.u.assign(local_experts(), Tensor());
  k.g.assign(local_experts(), Tensor());
  k.x8.assign(fp8 ? local_experts() : 0, Fp8Operand());
  k.g8.assign(fp8 ? local_experts() : 0, Fp8Operand());
  for (int le = 0; le < local_experts(); ++le) {
    if (fp8) fp8->declare(fp8_linear(layer, le, 0)), fp8->declare(fp8_linear(layer, le, 1));
    if (k.expert_rows[le] == 0) continue;
    k.u[le] =
        linear(expert_rows(k.sorted, k, le), w_in[le], fp8_linear(layer, le, 0), fp8 ? &k.x8[le] : nullptr);
    if (!b.in.empty()) r.add_bias_(k.u[le], b.in[le]);
    k.g[le] = swiglu ? r.swiglu(k.u[le], glu) : r.gelu(k.u[le]);
    linear(k.g[le], w_out[le], fp8_linear(layer, le, 1), fp8 ? &k.g8[le] : nullptr, expert_rows(out, k, le));
    // The etp members' partial outputs are summed (combine): w2's bias joins one of them.
    if (!b.out.empty() && etp_index == 0) r.add_bias_(expert_rows(out, k, le), b.out[le]);
    if (fp8) k.g[le] = Tensor();  // the FP8 copy is what the weight gradient reads
  }
  if (fp8) k.sorted = Tensor();
  // 7. Back to the ranks the rows came from, then each token's routes weighted by their gates and summed.
  k.back = combine(out, k);
  const Tensor gates = broken == "moe-combine-without-gates" ? Tensor() : k.gates;
  return r.scatter_add_rows(k.back, k.index, gates, x.size(0));
}

ExpertParallel::Grads ExpertParallel::backward(const Tensor& dy, const Tensor& x, const Tensor& router,
                                               const std::vector<Tensor>& w_in,
                                               const std::vector<Tensor>& w_out, Kept& k, const Biases& b) {
  Grads g;
  // The combine's backward: each route's output gradient is its token's, times its gate; the gate's own
  // gradient is that token's gradient dotted with the route's output.
  const Tensor dgates = r.row_dots(r.gather_rows(dy, k.index, Tensor()), k.back);
  Tensor dsorted = dispatch(r.gather_rows(dy, k.index, k.gates), k);
  // The experts' backward, each writing its input gradient in place.
  Tensor dx_sorted = buffer(r, phantom, dsorted.shape(), dsorted.dtype());
  for (int le = 0; le < local_experts(); ++le) {
    if (k.expert_rows[le] == 0) {
      g.dw_in.push_back(zeros(r, phantom, w_in[le].shape(), DType::Float32));
      g.dw_out.push_back(zeros(r, phantom, w_out[le].shape(), DType::Float32));
      if (!b.in.empty()) {
        g.db_in.push_back(zeros(r, phantom, b.in[le].shape(), DType::Float32));
        g.db_out.push_back(zeros(r, phantom, b.out[le].shape(), DType::Float32));
      }
      continue;
    }
    const Tensor dye = expert_rows(dsorted, k, le);
    if (!b.out.empty()) g.db_out.push_back(r.sum_rows(dye));
    Tensor dw, dact = linear_backward(dye, w_out[le], fp8_linear(k.layer, le, 1),
                                      fp8 ? k.g8[le].along_rows : k.g[le], dw);
    g.dw_out.push_back(dw);
    const Tensor du = swiglu ? r.swiglu_backward(dact, k.u[le], glu) : r.gelu_backward(dact, k.u[le]);
    if (!b.in.empty()) g.db_in.push_back(r.sum_rows(du));
    linear_backward(du, w_in[le], fp8_linear(k.layer, le, 0),
                    fp8 ? k.x8[le].along_rows : expert_rows(k.sorted, k, le), dw,
                    expert_rows(dx_sorted, k, le));
    g.dw_in.push_back(dw);
  }
  for (std::size_t le = 0; le < g.dw_in.size(); ++le) {
    if (grad_scale != 1) r.scale_(g.dw_in[le], grad_scale), r.scale_(g.dw_out[le], grad_scale);
  }
  for (std::size_t le = 0; le < g.db_in.size(); ++le) {
    if (grad_scale != 1) r.scale_(g.db_in[le], grad_scale), r.scale_(g.db_out[le], grad_scale);
  }
  // Back to the routes, and each token's routes summed: the input gradient through the experts.
  g.dx = r.scatter_add_rows(combine(dx_sorted, k), k.index, Tensor(), x.size(0));
  // The router: d logits on the host from the gates' gradients, then its two GEMMs.
  Tensor dlogits;
  if (phantom) {
    dlogits = r.phantom(Shape{x.size(0), experts}, x.dtype());
  } else {
    const std::vector<float> dgate_f = r.to_host(dgates);
    std::vector<double> dl =
        router_logit_grads(k.routing, std::vector<double>(dgate_f.begin(), dgate_f.end()));
    if (aux_loss_weight > 0) add_load_balancing_grads(k.routing, aux_loss_weight, dl);
    dlogits = r.from_host(Shape{x.size(0), experts}, std::vector<float>(dl.begin(), dl.end()), x.dtype());
  }
  g.drouter = r.matmul(x, dlogits, Trans::Yes, Trans::No);
  if (b.router.defined()) g.drouter_bias = r.sum_rows(dlogits);
  r.add_(g.dx, r.matmul(dlogits, router, Trans::No, Trans::Yes), 1.0f);
  return g;
}

// ---- routing, on the host ---------------------------------------------------------------------------------

std::int64_t expert_capacity(std::int64_t tokens, int experts, int top_k, double factor) {
  if (factor <= 0) return -1;
  return static_cast<std::int64_t>(std::ceil(static_cast<double>(tokens) * top_k / experts * factor));
}

Routing route_top_k(const std::vector<double>& logits, std::int64_t tokens, int experts, int top_k,
                    int experts_per_rank, std::int64_t capacity, int owner_shift, RouterScore score) {
  Routing ro;
  ro.tokens = tokens, ro.experts = experts, ro.top_k = top_k;
  ro.per_expert.assign(experts, 0);
  const int ranks = experts / experts_per_rank;
  auto owner = [&](int e) { return (e / experts_per_rank + owner_shift) % ranks; };
  struct Chosen {
    std::int64_t token;
    int expert;
    double gate, slope;
  };
  const bool sigmoid = score == RouterScore::Sigmoid;
  if (sigmoid) ro.probs_slope.resize(tokens * experts);
  std::vector<Chosen> chosen;
  chosen.reserve(tokens * top_k);
  ro.probs.resize(tokens * experts);
  ro.chosen_per_expert.assign(experts, 0);
  std::vector<int> order(experts);
  std::vector<double> s(experts);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* l = &logits[t * experts];
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
    if (top_k < experts) ro.closest_call = std::min(ro.closest_call, l[order[top_k - 1]] - l[order[top_k]]);
    // Each expert's score, the chosen ones' over their sum: the softmax over the chosen logits (the top-k
    // of the whole softmax, normalised), or their sigmoids normalised.
    for (int e = 0; e < experts; ++e)
      s[e] = sigmoid ? 1 / (1 + std::exp(-l[e])) : std::exp(l[e] - l[order[0]]);
    double sum = 0;
    for (int j = 0; j < top_k; ++j) sum += s[order[j]];
    for (int j = 0; j < top_k; ++j) {
      const int e = order[j];
      chosen.push_back({t, e, s[e] / sum, sigmoid ? 1 - s[e] : 1.0});
      ++ro.chosen_per_expert[e];
    }
    double all = 0;
    for (int e = 0; e < experts; ++e) all += s[e];
    for (int e = 0; e < experts; ++e) {
      ro.probs[t * experts + e] = s[e] / all;
      if (sigmoid) ro.probs_slope[t * experts + e] = 1 - s[e];
    }
  }
  // Over an expert's capacity, its routes of the lowest gates go (the earlier token first on equal gates).
  if (capacity >= 0) {
    std::stable_sort(chosen.begin(), chosen.end(), [&](const Chosen& a, const Chosen& b) {
      return a.expert != b.expert ? a.expert < b.expert : a.gate > b.gate;
    });
    std::vector<std::int64_t> taken(experts, 0);
    std::erase_if(chosen, [&](const Chosen& c) {
      if (taken[c.expert]++ < capacity) return false;
      ro.dropped_token.push_back(c.token);
      ro.dropped_expert.push_back(c.expert);
      ro.dropped_gate.push_back(c.gate);
      ro.dropped_slope.push_back(c.slope);
      return true;
    });
  }
  std::stable_sort(chosen.begin(), chosen.end(), [&](const Chosen& a, const Chosen& b) {
    if (owner(a.expert) != owner(b.expert)) return owner(a.expert) < owner(b.expert);
    return a.expert != b.expert ? a.expert < b.expert : a.token < b.token;
  });
  for (const Chosen& c : chosen) {
    ro.token.push_back(c.token);
    ro.expert.push_back(c.expert);
    ro.gate.push_back(c.gate);
    ro.slope.push_back(c.slope);
    ++ro.per_expert[c.expert];
  }
  return ro;
}

Routing route_balanced(std::int64_t tokens, int experts, int top_k) {
  Routing ro;
  ro.tokens = tokens, ro.experts = experts, ro.top_k = top_k;
  const std::int64_t routes = tokens * top_k;
  ro.per_expert.assign(experts, routes / experts);
  for (std::int64_t e = 0; e < routes % experts; ++e) ++ro.per_expert[e];
  return ro;
}

namespace {
// route_modelled's routes before the capacity.
Routing route_shares(std::int64_t tokens, int experts, int top_k, const RoutingModel& model, int layer) {
  if (model.kind == RoutingModel::Kind::Balanced) return route_balanced(tokens, experts, top_k);
  // Shares by popularity rank, capped at one route per token and expert (the excess spread over the
  // experts below the cap in proportion to their shares, until none is over).
  std::vector<double> share(experts);
  for (int i = 0; i < experts; ++i) {
    share[i] = model.kind == RoutingModel::Kind::Skew
                   ? (i == 0 ? model.value : (experts - model.value) / std::max(1, experts - 1))
                   : 1 / std::pow(i + 1.0, model.value);
  }
  const double routes = static_cast<double>(tokens) * top_k, cap = static_cast<double>(tokens);
  std::vector<double> want(experts);
  std::vector<bool> capped(experts, false);
  for (bool again = true; again;) {
    again = false;
    double free_routes = routes, free_share = 0;
    for (int i = 0; i < experts; ++i) (capped[i] ? free_routes -= cap : free_share += share[i]);
    for (int i = 0; i < experts; ++i) {
      want[i] = capped[i] ? cap : free_routes * share[i] / free_share;
      if (!capped[i] && want[i] > cap) capped[i] = again = true;
    }
  }
  // The shares go to the experts in the layer's seeded popularity order, then whole routes by largest
  // remainder. Experts whose remainders tie (skew's others all do) take the routes left evenly spread over
  // their ids, so that a rank's block of consecutive experts takes about as many as any other's: the skew
  // is the hottest expert's alone, not a few routes more on some ranks by chance.
  std::vector<int> popularity(experts);
  std::iota(popularity.begin(), popularity.end(), 0);
  std::uint64_t state = 0x726f757465ull + static_cast<std::uint64_t>(layer);  // "route"
  for (int i = experts - 1; i > 0; --i) std::swap(popularity[i], popularity[mix64(state++) % (i + 1)]);
  std::vector<double> remainder(experts);
  Routing ro;
  ro.tokens = tokens, ro.experts = experts, ro.top_k = top_k;
  ro.per_expert.assign(experts, 0);
  std::int64_t left = tokens * top_k;
  for (int i = 0; i < experts; ++i) {
    const double whole = std::floor(want[i]);
    ro.per_expert[popularity[i]] = static_cast<std::int64_t>(whole);
    remainder[popularity[i]] = want[i] - whole;
    left -= static_cast<std::int64_t>(whole);
  }
  std::vector<int> by_remainder(experts);
  std::iota(by_remainder.begin(), by_remainder.end(), 0);
  std::stable_sort(by_remainder.begin(), by_remainder.end(),
                   [&](int a, int b) { return remainder[a] > remainder[b]; });
  for (std::size_t first = 0; left > 0 && first < by_remainder.size();) {
    std::size_t end = first;
    while (end < by_remainder.size() && remainder[by_remainder[end]] == remainder[by_remainder[first]]) ++end;
    const std::int64_t n = static_cast<std::int64_t>(end - first), take = std::min(left, n);
    for (std::int64_t j = 0; j < take; ++j) ++ro.per_expert[by_remainder[first + j * n / take]];
    left -= take;
    first = end;
  }
  return ro;
}
}  // namespace

RoutingModel read_routing_model(const std::string& text, int experts, int top_k) {
  RoutingModel m;
  if (text == "balanced") return m;
  const std::size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon),
                    value = colon == std::string::npos ? "" : text.substr(colon + 1);
  char* end = nullptr;
  m.value = value.empty() ? NAN : std::strtod(value.c_str(), &end);
  const bool number = !value.empty() && end != nullptr && *end == '\0' && std::isfinite(m.value);
  // Each token's k experts are distinct, so an expert takes at most every token: 1/k of the routes, E/k times
  // its even share.
  const double most = static_cast<double>(experts) / top_k;
  if (kind == "skew" && number && m.value >= 1 && m.value <= most) {
    m.kind = RoutingModel::Kind::Skew;
    return m;
  }
  if (kind == "zipf" && number && m.value >= 0 && m.value <= 16) {
    m.kind = RoutingModel::Kind::Zipf;
    return m;
  }
  throw UsageError(
      fmt::format("--routing {}: give balanced, skew:S (the hottest expert takes S times its even share, "
                  "1 <= S <= experts / top-k = {:g}) or zipf:A (the i-th most popular expert's share "
                  "proportional to 1 / i^A, 0 <= A <= 16)",
                  text, most));
}

Routing route_modelled(std::int64_t tokens, int experts, int top_k, const RoutingModel& model, int layer,
                       std::int64_t capacity) {
  Routing ro = route_shares(tokens, experts, top_k, model, layer);
  if (capacity < 0) return ro;
  for (std::int64_t& n : ro.per_expert) {
    const std::int64_t over = std::max<std::int64_t>(0, n - capacity);
    n -= over;
    ro.dropped_token.insert(ro.dropped_token.end(), over, 0);  // counted; a phantom run has no tokens to name
  }
  return ro;
}

double load_balancing_loss(const Routing& ro) {
  const double T = static_cast<double>(ro.tokens), E = ro.experts;
  double sum = 0;
  for (std::int64_t t = 0; t < ro.tokens; ++t)
    for (int i = 0; i < ro.experts; ++i)
      sum += ro.probs[t * ro.experts + i] * static_cast<double>(ro.chosen_per_expert[i]);
  return E / (ro.top_k * T * T) * sum;
}

void add_load_balancing_grads(const Routing& ro, double weight, std::vector<double>& dl) {
  const double T = static_cast<double>(ro.tokens), E = ro.experts;
  std::vector<double> g(ro.experts);
  for (int i = 0; i < ro.experts; ++i)
    g[i] = E * static_cast<double>(ro.chosen_per_expert[i]) / (ro.top_k * T * T);
  for (std::int64_t t = 0; t < ro.tokens; ++t) {
    const double* p = &ro.probs[t * ro.experts];
    double mean = 0;
    for (int i = 0; i < ro.experts; ++i) mean += p[i] * g[i];
    for (int j = 0; j < ro.experts; ++j) {
      const double slope = ro.probs_slope.empty() ? 1.0 : ro.probs_slope[t * ro.experts + j];
      dl[t * ro.experts + j] += weight * p[j] * slope * (g[j] - mean);
    }
  }
}

std::vector<double> router_logit_grads(const Routing& ro, const std::vector<double>& dgate) {
  std::vector<double> dl(ro.tokens * ro.experts, 0.0), weighted(ro.tokens, 0.0);
  for (std::size_t i = 0; i < ro.token.size(); ++i) weighted[ro.token[i]] += ro.gate[i] * dgate[i];
  for (std::size_t i = 0; i < ro.token.size(); ++i) {
    dl[ro.token[i] * ro.experts + ro.expert[i]] =
        ro.gate[i] * ro.slope[i] * (dgate[i] - weighted[ro.token[i]]);
  }
  // A dropped route's gate has no gradient of its own, but its score is in the token's normalisation.
  for (std::size_t i = 0; i < ro.dropped_token.size(); ++i) {
    const std::int64_t t = ro.dropped_token[i];
    dl[t * ro.experts + ro.dropped_expert[i]] = -ro.dropped_gate[i] * ro.dropped_slope[i] * weighted[t];
  }
  return dl;
}

// ---- the exchange's bookkeeping ---------------------------------------------------------------------------

Routing ExpertParallel::route(const Tensor& logits, int layer) {
  const std::int64_t tokens = logits.size(0);
  const std::int64_t capacity = expert_capacity(tokens, experts, top_k, capacity_factor);
  if (phantom) {
    r.synchronize();  // the host waits for the router, as it would to read the counts
    return route_modelled(tokens, experts, top_k, routing_model, layer, capacity);
  }
  const std::vector<float> lf = r.to_host(logits);
  const int shift = broken == "moe-wrong-expert-rank" && size() > 1 ? 1 : 0;
  return route_top_k(std::vector<double>(lf.begin(), lf.end()), tokens, experts, top_k, local_experts(),
                     capacity, shift, score);
}

void ExpertParallel::plan_exchange(Kept& k) {
  const Routing& ro = k.routing;
  const int ranks = size(), per = local_experts();
  const int shift = broken == "moe-wrong-expert-rank" && ranks > 1 ? 1 : 0;
  // This rank's routes per destination rank and local expert (the dispatch order's blocks).
  std::vector<float> sent_counts(ranks * per, 0.0f);
  for (int e = 0; e < experts; ++e)
    sent_counts[((e / per + shift) % ranks) * per + e % per] += ro.per_expert[e];
  k.sent_rows.assign(ranks, 0);
  for (int d = 0; d < ranks; ++d)
    for (int le = 0; le < per; ++le) k.sent_rows[d] += static_cast<std::int64_t>(sent_counts[d * per + le]);
  // The counts every rank sends this one: exchanged (an even all_to_all), then read on the host. A phantom
  // run's routing is balanced, every rank's the same as this one's.
  std::vector<float> counts;  // [source rank][local expert]
  if (ranks > 1) {
    Tensor sent = phantom ? r.phantom(Shape{ranks * per}, DType::Float32)
                          : r.from_host(Shape{ranks * per}, sent_counts);
    Tensor got = buffer(r, phantom, Shape{ranks * per}, DType::Float32);
    const Event e = exposed.before();
    exposed.after(Dim::Ep, e, r.all_to_all(got, sent, Async::No, group));
    counts = phantom ? std::vector<float>() : r.to_host(got);
  }
  if (counts.empty()) {
    counts.resize(ranks * per);
    for (int src = 0; src < ranks; ++src)
      for (int le = 0; le < per; ++le) counts[src * per + le] = sent_counts[index * per + le];
  }
  // With etp: the counts of every member of the etp group, gathered ([member][source rank][local expert]);
  // the gathered rows are each member's received rows in turn, each block padded to the longest.
  const int members = etp_size;
  if (members > 1) {
    Tensor mine =
        phantom ? r.phantom(Shape{ranks * per}, DType::Float32) : r.from_host(Shape{ranks * per}, counts);
    Tensor all = buffer(r, phantom, Shape{members * ranks * per}, DType::Float32);
    const Event e = exposed.before();
    exposed.after(Dim::Ep, e, r.all_gather(all, mine, Async::No, etp));
    if (phantom) {  // every member's routing is this one's
      std::vector<float> same;
      for (int m = 0; m < members; ++m) same.insert(same.end(), counts.begin(), counts.end());
      counts = std::move(same);
    } else {
      counts = r.to_host(all);
    }
  }
  auto count = [&](int m, int src, int le) {
    return static_cast<std::int64_t>(counts[(static_cast<std::size_t>(m) * ranks + src) * per + le]);
  };
  std::vector<std::int64_t> member_total(members, 0);
  for (int m = 0; m < members; ++m)
    for (int src = 0; src < ranks; ++src)
      for (int le = 0; le < per; ++le) member_total[m] += count(m, src, le);
  k.received_rows.assign(ranks, 0);
  for (int src = 0; src < ranks; ++src)
    for (int le = 0; le < per; ++le) k.received_rows[src] += count(members > 1 ? etp_index : 0, src, le);
  k.member_rows = *std::max_element(member_total.begin(), member_total.end());
  // Each local expert's rows once sorted: by expert, then by member, then by source rank.
  k.expert_first.assign(per, 0);
  k.expert_rows.assign(per, 0);
  for (int le = 0; le < per; ++le) {
    for (int m = 0; m < members; ++m)
      for (int src = 0; src < ranks; ++src) k.expert_rows[le] += count(m, src, le);
    if (le + 1 < per) k.expert_first[le + 1] = k.expert_first[le] + k.expert_rows[le];
  }
  const std::int64_t routes = ro.routes(), gathered = members * k.member_rows;
  std::int64_t sorted_rows = 0;
  for (std::int64_t n : member_total) sorted_rows += n;
  if (phantom) {
    k.index = r.phantom(Shape{routes}, DType::Float32);
    k.gates = r.phantom(Shape{routes}, DType::Float32);
    k.sort = r.phantom(Shape{sorted_rows}, DType::Float32);
    k.unsort = r.phantom(Shape{gathered}, DType::Float32);
    return;
  }
  k.index = r.from_host(Shape{routes}, std::vector<float>(ro.token.begin(), ro.token.end()));
  k.gates = r.from_host(Shape{routes}, std::vector<float>(ro.gate.begin(), ro.gate.end()));
  // The sort: sorted row i is gathered row sort[i]; the unsort is its inverse, a padding row reading row 0
  // (its sum is never read).
  std::vector<float> sort(sorted_rows), unsort(gathered, 0.0f);
  std::int64_t at = 0;
  for (int le = 0; le < per; ++le) {
    for (int m = 0; m < members; ++m) {
      std::int64_t first = m * k.member_rows;  // this member's block: by source rank, then local expert
      for (int src = 0; src < ranks; ++src) {
        std::int64_t from = first;
        for (int l = 0; l < le; ++l) from += count(m, src, l);
        for (std::int64_t j = 0; j < count(m, src, le); ++j, ++at) {
          sort[at] = static_cast<float>(from + j);
          unsort[from + j] = static_cast<float>(at);
        }
        for (int l = 0; l < per; ++l) first += count(m, src, l);
      }
    }
  }
  k.sort = r.from_host(Shape{sorted_rows}, sort);
  k.unsort = r.from_host(Shape{gathered}, unsort);
}

Tensor ExpertParallel::dispatch(const Tensor& rows, const Kept& k) {
  if (size() == 1 && etp_size == 1) return rows;  // the routes are already in expert order
  const std::int64_t cols = rows.size(1), received = k.received();
  // With etp, what this rank receives lands in its padded block of the gather.
  const Tensor block = etp_size > 1 ? buffer(r, phantom, Shape{k.member_rows, cols}, rows.dtype()) : Tensor();
  Tensor got = rows;  // ep 1: this rank's own routes, in expert order
  if (size() > 1) {
    got = etp_size > 1 ? r.view(block, 0, Shape{received, cols})
                       : buffer(r, phantom, Shape{received, cols}, rows.dtype());
    const Event e = exposed.before();
    exposed.after(Dim::Ep, e, r.all_to_all(got, rows, k.received_rows, k.sent_rows, Async::No, group));
  } else if (etp_size > 1) {
    r.copy_(r.view(block, 0, Shape{received, cols}), rows);
  }
  if (etp_size > 1) {
    got = buffer(r, phantom, Shape{etp_size * k.member_rows, cols}, rows.dtype());
    const Event e = exposed.before();
    exposed.after(Dim::Ep, e, r.all_gather(got, block, Async::No, etp));
  }
  return r.gather_rows(got, k.sort, Tensor());
}

Tensor ExpertParallel::combine(const Tensor& sorted_rows, const Kept& k) {
  if (size() == 1 && etp_size == 1) return sorted_rows;
  const std::int64_t cols = sorted_rows.size(1), received = k.received();
  Tensor by_source = r.gather_rows(sorted_rows, k.unsort, Tensor());
  if (etp_size > 1) {  // the shards' partial outputs summed, each member keeping its own block
    Tensor block = buffer(r, phantom, Shape{k.member_rows, cols}, sorted_rows.dtype());
    const Event e = exposed.before();
    exposed.after(Dim::Ep, e, r.reduce_scatter(block, by_source, ReduceOp::Sum, Async::No, etp));
    by_source = received == k.member_rows ? block : r.view(block, 0, Shape{received, cols});
  }
  if (size() == 1) return by_source;
  Tensor back = buffer(r, phantom, Shape{k.routing.routes(), cols}, sorted_rows.dtype());
  const Event e = exposed.before();
  exposed.after(Dim::Ep, e, r.all_to_all(back, by_source, k.sent_rows, k.received_rows, Async::No, group));
  return back;
}

Tensor ExpertParallel::linear(const Tensor& x, const Tensor& w, int id, Fp8Operand* keep, const Tensor& out) {
  Tensor a = x, b = w;
  if (fp8) {
    fp8->select(id);
    *keep = fp8->input(x, nullptr);
    a = keep->along_cols;
    b = fp8->weight(w).along_rows;
    keep->along_cols = keep->cols_scales = Tensor();  // only the weight gradient's layout is kept
  }
  if (!out.defined()) return r.matmul(a, b);
  r.matmul_(out, a, b, Trans::No, Trans::No);
  return out;
}

Tensor ExpertParallel::linear_backward(const Tensor& dy, const Tensor& w, int id, const Tensor& x_kept,
                                       Tensor& dw, const Tensor& dx_out) {
  Tensor dy_cols = dy, dy_rows = dy, b = w;
  if (fp8) {
    fp8->select(id);
    const Fp8Operand q = fp8->gradient(dy);
    dy_cols = q.along_cols, dy_rows = q.along_rows;
    b = fp8->weight(w).along_cols;
  }
  dw = r.matmul(x_kept, dy_rows, Trans::Yes, Trans::No);
  if (!dx_out.defined()) return r.matmul(dy_cols, b, Trans::No, Trans::Yes);
  r.matmul_(dx_out, dy_cols, b, Trans::No, Trans::Yes);
  return dx_out;
}

Tensor ExpertParallel::expert_rows(const Tensor& sorted, const Kept& k, int le) const {
  const std::int64_t cols = sorted.size(1);
  return r.view(sorted, k.expert_first[le] * cols, Shape{k.expert_rows[le], cols});
}

}  // namespace ranklab::parallel
