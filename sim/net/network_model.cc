#include "sim/net/network_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/errors.h"
#include "sim/net/nccl_tuning.h"
#include "sim/sim_backend.h"

namespace ranklab::sim {

namespace {

// NCCL's order of algorithms and protocols: on equal predicted times the first one wins, as in NCCL's
// selection loop.
constexpr Algorithm kAlgorithms[] = {Algorithm::Tree,     Algorithm::Ring,   Algorithm::Nvls,
                                     Algorithm::NvlsTree, Algorithm::Direct, Algorithm::Pairwise};
constexpr Protocol kProtocols[] = {Protocol::LL, Protocol::LL128, Protocol::Simple};

std::uint64_t shape_key(CommOp op, Algorithm a, int root) {
  return (static_cast<std::uint64_t>(op) << 48) | (static_cast<std::uint64_t>(a) << 40) |
         static_cast<std::uint32_t>(root + 1);
}

bool rooted(CommOp op) {
  return op == CommOp::Broadcast || op == CommOp::Reduce || op == CommOp::Scatter || op == CommOp::Gather;
}

// Grouped point-to-point (scatter, gather, all_to_all, send/recv) picks its protocol per message the way
// NCCL's p2p path does: LL up to NCCL_P2P_LL_THRESHOLD, Simple above.
Protocol p2p_protocol(double per_peer_bytes) {
  return per_peer_bytes <= kP2pLlThresholdBytes ? Protocol::LL : Protocol::Simple;
}

}  // namespace

NetworkModel::NetworkModel(const Profile& profile, NetworkOptions options)
    : topo_(profile), options_(std::move(options)) {
  if (!options_.algorithm.empty() && !parse_algorithm(options_.algorithm)) {
    throw UsageError(
        fmt::format("unknown algorithm '{}'; NCCL's are ring, tree, nvls and nvls_tree", options_.algorithm));
  }
  if (!options_.protocol.empty() && !parse_protocol(options_.protocol)) {
    throw UsageError(
        fmt::format("unknown protocol '{}'; NCCL's are ll, ll128 and simple", options_.protocol));
  }
}

std::size_t NetworkModel::PairBytesHash::operator()(const std::vector<std::int64_t>& v) const {
  // FNV-1a over the sizes.
  std::uint64_t h = 1469598103934665603ull;
  for (std::int64_t b : v) {
    h ^= static_cast<std::uint64_t>(b);
    h *= 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

std::size_t NetworkModel::RanksHash::operator()(const std::vector<int>& v) const {
  // FNV-1a over the ranks.
  std::uint64_t h = 1469598103934665603ull;
  for (int r : v) {
    h ^= static_cast<std::uint32_t>(r);
    h *= 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

NetworkModel::GroupEntry& NetworkModel::group(const std::vector<int>& ranks) {
  auto it = groups_.find(ranks);
  if (it != groups_.end()) return it->second;
  GroupEntry e;
  e.layout = layout_group(topo_, ranks, options_.pxn);
  e.p2p = nccl_p2p_comm(e.layout.shape);
  return groups_.emplace(ranks, std::move(e)).first->second;
}

const NetworkModel::Shape& NetworkModel::shape(GroupEntry& g, CommOp op, Algorithm a, int root) {
  const std::uint64_t key = shape_key(op, a, rooted(op) ? root : -1);
  auto it = g.shapes.find(key);
  if (it != g.shapes.end()) return it->second;
  Shape s;
  s.unit = unit_plan(topo_, g.layout, op, a, root);
  s.unit_us = transfer_us(topo_, s.unit);
  count_copies(s.unit);
  find_bundle(s.unit, topo_);
  s.unit.idle_rates_gbps = std::make_shared<std::vector<double>>();
  return g.shapes.emplace(key, std::move(s)).first->second;
}

double NetworkModel::occupancy(CommOp op, const Candidate& c, const GroupShape& g, double bytes) const {
  double f = nccl_bandwidth_factor(op, c.algorithm, c.protocol, g);
  if (c.algorithm == Algorithm::Tree) f *= nccl_tree_correction(c.protocol, bytes);
  return f;
}

std::vector<Candidate> NetworkModel::candidates(CommOp op, std::int64_t bytes, const std::vector<int>& ranks,
                                                int root) {
  std::vector<Candidate> out = latencies(op, bytes, ranks);
  if (out.front().algorithm == Algorithm::Local) return out;
  GroupEntry& g = group(ranks);
  for (Candidate& c : out) {
    const LaunchShape l =
        nccl_launch(op, c.algorithm, c.protocol, g.layout.shape, static_cast<double>(bytes));
    c.transfer_us = transfer_of(g, op, c, bytes, root, l);
  }
  return out;
}

std::vector<Candidate> NetworkModel::latencies(CommOp op, std::int64_t bytes, const std::vector<int>& ranks) {
  std::vector<Candidate> out;
  if (ranks.size() <= 1 || bytes <= 0) {
    out.push_back({Algorithm::Local, Protocol::Simple, 0, 0});
    return out;
  }
  const GroupShape& gs = group(ranks).layout.shape;
  const double s = static_cast<double>(bytes);
  const double per_peer = s / static_cast<double>(ranks.size());
  for (Algorithm a : kAlgorithms) {
    for (Protocol p : kProtocols) {
      if (!nccl_supports(op, a, p, gs)) continue;
      if ((a == Algorithm::Direct || a == Algorithm::Pairwise) && p != p2p_protocol(per_peer)) continue;
      out.push_back({a, p, nccl_latency_us(op, a, p, gs, s), 0});
    }
  }
  if (out.empty()) {
    throw UsageError(fmt::format("{} over {} ranks has no algorithm on {}", comm_op_name(op), ranks.size(),
                                 topo_.profile().name));
  }
  return out;
}

double NetworkModel::transfer_of(GroupEntry& g, CommOp op, const Candidate& c, std::int64_t bytes, int root,
                                 const LaunchShape& launch) {
  const double s = static_cast<double>(bytes);
  const GroupShape& gs = g.layout.shape;
  double us = s * shape(g, op, c.algorithm, root).unit_us / occupancy(op, c, gs, s);
  const double cap_gbps = nccl_bus_bw_cap(op, c.algorithm, c.protocol, gs);
  if (std::isfinite(cap_gbps)) us = std::max(us, s * nccl_bus_factor(op, c.algorithm, gs) / (cap_gbps * 1e3));
  const double alg_gbps = us > 0 ? s / (us * 1e3) : 0;
  // Grouped point-to-point (all_to_all's pairs, scatter's and gather's pieces): each peer's piece runs
  // through the two-stage pipeline of NCCL's send and receive.
  if (c.algorithm == Algorithm::Pairwise || c.algorithm == Algorithm::Direct)
    us *= nccl_p2p_slowdown(nccl_p2p_launch(g.p2p, s / std::max(1, gs.ranks)), c.protocol);
  return us * nccl_launch_slowdown(c.algorithm, gs, launch, alg_gbps) +
         nccl_loop_overhead_us(c.algorithm, launch);
}

CommPlan NetworkModel::scaled(const Shape& s, const Candidate& c, std::int64_t bytes) const {
  CommPlan plan;
  plan.algorithm = c.algorithm;
  plan.protocol = c.protocol;
  // NCCL chose with its predicted latency; the machine runs with its own (NcclSpec::latency_scale). The
  // routes may add a hop NCCL's model does not see (PXN's NVLink hop; 0 for every other plan).
  plan.latency_us = c.latency_us * topo_.profile().nccl.latency_scale + s.unit.latency_us;
  plan.transfer_us = c.transfer_us;
  // The unit plan's paths and flows, shared: a world-wide collective's are megabytes.
  plan.links = s.unit.links;
  plan.flows = s.unit.flows;
  plan.copies = s.unit.copies;
  plan.idle_rates_gbps = s.unit.idle_rates_gbps;
  plan.bundle = s.unit.bundle;
  const double b = static_cast<double>(bytes);
  // Every flow's occupancy grows by the same factor, so the plan's time scales with it exactly. A unit
  // plan may already occupy some links for more than their payload (NVLSTree's NVLink flows).
  const double occupy = c.transfer_us > 0 && s.unit_us > 0 ? c.transfer_us / (b * s.unit_us) : 1.0;
  // A unit plan is built at scale 1 (CommPlan::add_flow), so these are exactly b and b x occupy, and a
  // flow's bytes are its unit record x b (x occupy), rounded once.
  plan.payload_scale = s.unit.payload_scale * b;
  plan.bytes_scale = s.unit.bytes_scale * (b * occupy);
  return plan;
}

CommPlan NetworkModel::plan_collective(CommOp op, std::int64_t bytes, const std::vector<int>& ranks,
                                       int root) {
  std::vector<Candidate> all = latencies(op, bytes, ranks);
  if (all.front().algorithm == Algorithm::Local) return CommPlan{};
  // NCCL_ALGO / NCCL_PROTO: keep the forced ones when this call can use them at all.
  const std::optional<Algorithm> forced_a = parse_algorithm(options_.algorithm);
  const std::optional<Protocol> forced_p = parse_protocol(options_.protocol);
  auto allowed = [&](const Candidate& c, bool check_a, bool check_p) {
    return (!check_a || !forced_a || c.algorithm == *forced_a) &&
           (!check_p || !forced_p || c.protocol == *forced_p);
  };
  const bool check_a =
      std::any_of(all.begin(), all.end(), [&](const Candidate& c) { return allowed(c, true, false); });
  const bool check_p =
      std::any_of(all.begin(), all.end(), [&](const Candidate& c) { return allowed(c, check_a, true); });
  std::erase_if(all, [&](const Candidate& c) { return !allowed(c, check_a, check_p); });
  // NCCL's choice: the least time by NCCL's own model (each candidate's latency, which it was listed
  // with, + nccl_model_transfer_us), the first of equals in its order. The machine then runs the choice at
  // the speed of its flows over the links.
  GroupEntry& g = group(ranks);
  const GroupShape& gs = g.layout.shape;
  const double s = static_cast<double>(bytes);
  std::size_t best = 0;
  double best_us = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < all.size(); ++i) {
    const double transfer_us = nccl_model_transfer_us(op, all[i].algorithm, all[i].protocol, gs, s);
    if (transfer_us < 0) continue;
    const double us = all[i].latency_us + transfer_us;
    if (us < best_us) {
      best = i;
      best_us = us;
    }
  }
  Candidate chosen = all[best];
  const LaunchShape launch = nccl_launch(op, chosen.algorithm, chosen.protocol, gs, s);
  chosen.transfer_us = transfer_of(g, op, chosen, bytes, root, launch);
  CommPlan plan = scaled(shape(g, op, chosen.algorithm, root), chosen, bytes);
  plan.channels = launch.channels;
  return plan;
}

CommPlan NetworkModel::plan_all_to_all(const std::vector<int>& ranks,
                                       const std::vector<std::int64_t>& pair_bytes) {
  const std::size_t n = ranks.size();
  if (pair_bytes.size() != n * n) {
    throw UsageError(
        fmt::format("all_to_all over {} ranks needs {} pair sizes; got {}", n, n * n, pair_bytes.size()));
  }
  // What crosses between members: the piece a member keeps moves no bytes over a link.
  std::int64_t largest = 0, smallest = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      largest = std::max(largest, pair_bytes[i * n + j]);
      smallest = std::min(smallest, pair_bytes[i * n + j]);
    }
  }
  if (n <= 1 || largest <= 0) return CommPlan{};
  // Every pair equal: the even all_to_all of n pieces that size.
  if (smallest == largest)
    return plan_collective(CommOp::AllToAll, largest * static_cast<std::int64_t>(n), ranks, -1);

  GroupEntry& g = group(ranks);
  if (const auto known = g.uneven.find(pair_bytes); known != g.uneven.end()) return known->second;
  const GroupShape& gs = g.layout.shape;
  CommPlan plan = pairwise_uneven_plan(topo_, g.layout, pair_bytes);
  // Each message runs at its own protocol's efficiency (LL up to NCCL_P2P_LL_THRESHOLD, Simple above) and
  // through the pipeline of its pieces (nccl_p2p_slowdown). The plan is at scale 1: its flows' records are
  // their bytes.
  for (Flow& f : plan.flows.mutate()) {
    const Protocol p = p2p_protocol(f.unscaled_payload_bytes);
    f.unscaled_bytes = f.unscaled_payload_bytes /
                       nccl_bandwidth_factor(CommOp::AllToAll, Algorithm::Pairwise, p, gs) *
                       nccl_p2p_slowdown(nccl_p2p_launch(g.p2p, f.unscaled_payload_bytes), p);
  }
  // The kernel's latency is that of the largest message's protocol: the pair that ends last.
  plan.protocol = p2p_protocol(static_cast<double>(largest));
  std::int64_t total = 0;
  for (std::int64_t b : pair_bytes) total += b;
  // The routes' own latency (PXN's NVLink hop, pairwise_uneven_plan) after NCCL's, which the machine runs
  // at its own scale as every other plan does (NcclSpec::latency_scale).
  plan.latency_us =
      nccl_latency_us(CommOp::AllToAll, Algorithm::Pairwise, plan.protocol, gs, static_cast<double>(total)) *
          topo_.profile().nccl.latency_scale +
      plan.latency_us;
  plan.transfer_us = fluid_transfer_us(topo_, plan);
  plan.channels =
      nccl_launch(CommOp::AllToAll, Algorithm::Pairwise, plan.protocol, gs, static_cast<double>(total))
          .channels;
  find_bundle(plan, topo_);
  // The rates its flows get on idle links, kept with it as with every plan of a group's shape.
  plan.idle_rates_gbps = std::make_shared<std::vector<double>>();
  if (g.uneven.size() >= kUnevenPlansKept) g.uneven.clear();
  g.uneven.emplace(pair_bytes, plan);
  return plan;
}

CommPlan NetworkModel::plan_p2p(int src, int dst, std::int64_t bytes) {
  if (src == dst || bytes <= 0) return CommPlan{};
  for (int r : {src, dst}) {
    if (r < 0 || r >= topo_.gpus()) {
      throw UsageError(fmt::format("send from rank {} to rank {}: rank {} is outside the {} GPUs of {} x {}",
                                   src, dst, r, topo_.gpus(), topo_.nodes(), topo_.profile().name));
    }
  }
  // Sends run on the world's communicator: its GPUs relay them between nodes (PXN), and its shape sizes
  // NCCL's pieces.
  const GroupEntry& w = world();
  CommPlan plan = p2p_plan(topo_, src, dst, w.layout.relay(topo_, src, dst));
  GroupShape gs;
  gs.ranks = 2;
  gs.nodes = topo_.node_of(src) == topo_.node_of(dst) ? 1 : 2;
  gs.ranks_per_node = gs.nodes == 1 ? 2 : 1;
  gs.nvlink = topo_.has_nvlink();
  if (gs.nodes > 1)
    gs.net_extra_us = (topo_.switch_hops(src, dst) - 1) * topo_.profile().fabric.switch_latency_us;
  const double b = static_cast<double>(bytes);
  Protocol p = p2p_protocol(b);
  if (std::optional<Protocol> forced = parse_protocol(options_.protocol)) {
    if (nccl_supports(CommOp::AllReduce, Algorithm::Ring, *forced, gs)) p = *forced;
  }
  plan.protocol = p;
  // NCCL's latency as the machine runs it, then the route's own (PXN's NVLink hop, p2p_plan).
  plan.latency_us =
      nccl_latency_us(CommOp::Send, Algorithm::Direct, p, gs, b) * topo_.profile().nccl.latency_scale +
      plan.latency_us;
  // The channels: one per piece NCCL cuts the message into; the protocol's efficiency, and the fill of
  // each piece's pipeline.
  const P2pLaunch pieces = nccl_p2p_launch(w.p2p, b);
  plan.channels = pieces.parts;
  const double occupy =
      nccl_p2p_slowdown(pieces, p) / nccl_bandwidth_factor(CommOp::Send, Algorithm::Direct, p, gs);
  // A plan of its own, at scale 1: its records become the bytes (payload x b, then x occupy, as rounded).
  for (Flow& f : plan.flows.mutate()) {
    f.unscaled_payload_bytes *= b;
    f.unscaled_bytes = f.unscaled_payload_bytes * occupy;
  }
  plan.transfer_us = transfer_us(topo_, plan);
  return plan;
}

NetworkModel::GroupEntry& NetworkModel::world() {
  if (world_ == nullptr) {
    const int size = world_ranks_ > 0 ? std::min(world_ranks_, topo_.gpus()) : topo_.gpus();
    std::vector<int> all(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) all[static_cast<std::size_t>(r)] = r;
    world_ = &group(all);
  }
  return *world_;
}

void NetworkModel::set_world_ranks(int ranks) {
  if (ranks < 0 || ranks > topo_.gpus()) {
    throw UsageError(fmt::format("a world of {} ranks does not fit the {} GPUs of {} x {}", ranks,
                                 topo_.gpus(), topo_.nodes(), topo_.profile().name));
  }
  world_ranks_ = ranks;
  world_ = nullptr;
}

void NetworkModel::record(const CommPlan& plan) {
  if (plan.flows.empty()) return;
  if (link_bytes_.empty()) link_bytes_.assign(topo_.link_count(), 0.0);
  for (const Flow& f : plan.flows) {
    const double payload_bytes = plan.payload_bytes(f);
    for (LinkId l : plan.path(f)) link_bytes_[l] += payload_bytes;
  }
}

void NetworkModel::record_shifted(const CommPlan& plan, int gpus) {
  if (plan.flows.empty()) return;
  if (link_bytes_.empty()) link_bytes_.assign(topo_.link_count(), 0.0);
  for (const Flow& f : plan.flows) {
    const double payload_bytes = plan.payload_bytes(f);
    for (LinkId l : plan.path(f)) link_bytes_[topo_.shifted(l, gpus)] += payload_bytes;
  }
}

std::vector<LinkTraffic> NetworkModel::link_traffic() const {
  std::vector<LinkTraffic> out;
  for (std::size_t l = 0; l < link_bytes_.size(); ++l) {
    if (link_bytes_[l] <= 0) continue;
    const LinkId id = static_cast<LinkId>(l);
    LinkTraffic t;
    t.link = topo_.link_name(id);
    t.tier = tier_name(topo_.tier(id));
    t.bytes = static_cast<std::int64_t>(std::llround(link_bytes_[l]));
    t.bandwidth_gbps = topo_.line_rate_gbps(id);
    out.push_back(std::move(t));
  }
  return out;
}

PlanFlows plan_flows(const Topology& topo, const std::vector<const CommPlan*>& plans) {
  PlanFlows out;
  std::unordered_map<LinkId, std::uint32_t> index;
  std::vector<std::uint32_t> path;
  for (const CommPlan* plan : plans) {
    out.first_flow.push_back(out.network.flows());
    for (const Flow& f : plan->flows) {
      path.clear();
      for (LinkId l : plan->path(f)) {
        auto [it, added] = index.try_emplace(l, 0);
        if (added) {
          it->second = out.network.add_link(topo.capacity_gbps(l));
          out.link_of.push_back(l);
        }
        path.push_back(it->second);
      }
      out.network.add_flow(path);
      out.bytes.push_back(plan->bytes(f));
    }
  }
  return out;
}

double transfer_us(const Topology& topo, const CommPlan& plan) {
  if (plan.flows.empty()) return 0;
  if (plan.flows.size() == 1) {
    const Flow& f = plan.flows[0];
    double slowest_gbps = std::numeric_limits<double>::infinity();
    for (LinkId l : plan.path(f)) slowest_gbps = std::min(slowest_gbps, topo.capacity_gbps(l));
    return f.length == 0 ? 0 : plan.bytes(f) / (slowest_gbps * 1e3);
  }
  // The busiest link's time: the bytes all flows put on it over its capacity. Every algorithm here loads
  // its links so that the busiest one stays busy to the end under max-min sharing, so this is exactly the
  // plan's fluid finish time (fluid_finish_us; tests/test_network_model.cc checks they agree) at a
  // fraction of its cost. Scratch space per thread: the simulator runs every rank on one thread.
  thread_local std::vector<double> load;
  thread_local std::vector<LinkId> touched;
  if (load.size() < topo.link_count()) load.assign(topo.link_count(), 0.0);
  touched.clear();
  for (const Flow& f : plan.flows) {
    for (LinkId l : plan.path(f)) {
      if (load[l] == 0) touched.push_back(l);
      load[l] += plan.bytes(f);
    }
  }
  double busiest_us = 0;
  for (LinkId l : touched) {
    busiest_us = std::max(busiest_us, load[l] / (topo.capacity_gbps(l) * 1e3));
    load[l] = 0;
  }
  return busiest_us;
}

double fluid_transfer_us(const Topology& topo, const CommPlan& plan) {
  if (plan.flows.empty()) return 0;
  const PlanFlows pf = plan_flows(topo, {&plan});
  const std::vector<double> finish = fluid_finish_us(pf.network, pf.bytes);
  return *std::max_element(finish.begin(), finish.end());
}

std::unique_ptr<NetworkModel> make_network_model(const Profile& profile) {
  return std::make_unique<NetworkModel>(profile);
}

std::unique_ptr<NetworkModel> make_network_model(const SimConfig& config) {
  return std::make_unique<NetworkModel>(config.profile, NetworkOptions{config.algorithm, config.protocol});
}

}  // namespace ranklab::sim
