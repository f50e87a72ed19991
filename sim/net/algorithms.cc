#include "sim/net/algorithms.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/errors.h"

namespace ranklab::sim {

std::vector<int> pxn_relays(const Topology& topo, const std::vector<int>& members) {
  std::vector<int> relays(topo.gpus_per_node(), -1);
  // The relay must reach the sender over NVLink (paths[GPU][g1].type <= PATH_NVL): the NVSwitch joins
  // every GPU of a node, PCIe-only nodes have none.
  if (!topo.has_nvlink() || members.empty()) return relays;
  std::vector<int> by_local(topo.gpus_per_node(), -1);
  for (int m : members) by_local[topo.local_of(m)] = m;
  // ncclTopoGetLocalGpu: the first GPU (of the communicator, in index order) each NIC is local to.
  std::vector<int> first_on_rail(topo.nics_per_node(), -1);
  for (auto m = members.rbegin(); m != members.rend(); ++m)
    first_on_rail[topo.rail_of_nic(topo.nic_of(*m))] = *m;
  for (int j = 0; j < topo.gpus_per_node(); ++j) {
    // ncclTopoDevToRank: the communicator's GPU on this node with the receiver's device index; without
    // one, ncclTopoGetNetDev returns the sender's own NIC.
    if (by_local[j] < 0) continue;
    const int nic = topo.nic_of(by_local[j]);
    const int first = first_on_rail[topo.rail_of_nic(nic)];
    // paths[NET][n].type <= PATH_PXB: the relay reaches the NIC without crossing the CPU.
    if (topo.nic_behind_pcie_switch(first, nic)) relays[j] = first;
  }
  return relays;
}

int GroupLayout::relay(const Topology& topo, int src, int dst) const {
  if (relays.empty() || topo.node_of(src) == topo.node_of(dst)) return src;
  // nodes is ascending by node, so the node's index is found by bisection.
  const auto it =
      std::lower_bound(nodes.begin(), nodes.end(), topo.node_of(src),
                       [&](const std::vector<int>& m, int node) { return topo.node_of(m[0]) < node; });
  const int r = relays[it - nodes.begin()][topo.local_of(dst)];
  return r < 0 ? src : r;
}

double pxn_hop_latency_us(const Topology& topo) {
  if (!topo.has_nvlink()) return 0;
  return topo.latency_us(topo.gpu_to_nvswitch(0)) + topo.latency_us(topo.nvswitch_to_gpu(0));
}

GroupLayout layout_group(const Topology& topo, const std::vector<int>& ranks, bool pxn) {
  GroupLayout g;
  g.ranks = ranks;
  std::map<int, std::vector<int>> by_node;
  for (int r : ranks) {
    if (r < 0 || r >= topo.gpus()) {
      throw UsageError(fmt::format("rank {} is outside the {} GPUs of {} x {}", r, topo.gpus(), topo.nodes(),
                                   topo.profile().name));
    }
    by_node[topo.node_of(r)].push_back(r);
  }
  int fewest = static_cast<int>(ranks.size()), most = 0, fewest_nics = 1 << 30;
  for (auto& [node, members] : by_node) {
    std::sort(members.begin(), members.end());
    fewest = std::min(fewest, static_cast<int>(members.size()));
    most = std::max(most, static_cast<int>(members.size()));
    std::set<int> nics;
    for (int r : members) nics.insert(topo.nic_of(r));
    fewest_nics = std::min(fewest_nics, static_cast<int>(nics.size()));
    g.nodes.push_back(std::move(members));
  }
  if (pxn && g.nodes.size() > 1) {
    for (const std::vector<int>& members : g.nodes) g.relays.push_back(pxn_relays(topo, members));
  }
  // One channel per rail every node can reach, so each NIC carries one ring across nodes. Inside a node the
  // NVSwitch (or PCIe switch) gives every GPU the same paths, and channels change nothing.
  g.channels = g.nodes.size() > 1 ? fewest_nics : 1;

  GroupShape& s = g.shape;
  s.ranks = static_cast<int>(ranks.size());
  s.nodes = static_cast<int>(g.nodes.size());
  s.ranks_per_node = most;
  s.uniform = fewest == most;
  s.nvlink = topo.has_nvlink();
  s.nvls = topo.nvls();
  s.channels = g.channels;
  const Profile& prof = topo.profile();
  s.sm = gpu_sm(prof.gpu.name);
  s.intra_gbps = prof.has_nvlink ? prof.nvlink.gpu_bandwidth_gbps() * prof.nvlink.efficiency
                                 : prof.pcie.bandwidth_gbps * prof.pcie.efficiency;
  s.nics = g.channels;
  s.nic_gbps = prof.nic.bandwidth_gbps;
  s.nvlink_links = prof.has_nvlink ? prof.nvlink.links_per_gpu : 0;
  if (s.nodes > 1) {
    // Latency of the fabric beyond the first switch: nodes under different leaves go through spines.
    std::set<int> leaf_groups;
    for (const auto& members : g.nodes) leaf_groups.insert(topo.node_of(members[0]) / topo.nodes_per_leaf());
    const int hops = leaf_groups.size() > 1 ? (topo.fabric_tiers() == 3 ? 5 : 3) : 1;
    s.net_extra_us = (hops - 1) * topo.profile().fabric.switch_latency_us;
  }
  return g;
}

namespace {

// The members of `node_index` in the order channel `c` visits them: starting at the member whose NIC
// carries this channel into the node, so that consecutive nodes hand over on one rail.
std::vector<int> chain(const GroupLayout& g, int node_index, int c) {
  const std::vector<int>& m = g.nodes[node_index];
  const int size = static_cast<int>(m.size());
  const int step = std::max(1, size / g.channels);
  const int first = ((c * step - node_index) % size + size) % size;
  std::vector<int> order(size);
  for (int i = 0; i < size; ++i) order[i] = m[(first + i) % size];
  return order;
}

// The head of a node's chain for channel `c`: the member on that channel's rail.
int head(const GroupLayout& g, int node_index, int c) {
  const std::vector<int>& m = g.nodes[node_index];
  const int size = static_cast<int>(m.size());
  return m[(c * std::max(1, size / g.channels)) % size];
}

class PlanBuilder {
 public:
  PlanBuilder(const Topology& topo, Algorithm a) : topo_(topo) { plan_.algorithm = a; }
  // Room for `flows` flows of paths up to 8 links (the longest between nodes without a CPU hop).
  void reserve(std::size_t flows) {
    plan_.flows.mutate().reserve(flows);
    plan_.links.mutate().reserve(flows * 8);
  }
  // A flow from GPU `src` to GPU `dst` carrying `payload` (per byte of S).
  void send(int src, int dst, double payload) { send_via(src, src, dst, payload); }
  // The same through `relay`'s NIC (PXN); the plan's latency gets the NVLink hop to the relay, once: the
  // messages of one grouped send/recv travel side by side.
  void send_via(int src, int relay, int dst, double payload) {
    if (payload <= 0 || src == dst) return;
    path_.clear();
    topo_.append_path_via(src, relay, dst, path_);
    plan_.add_flow(path_, payload, payload);
    if (relay != src) plan_.latency_us = pxn_hop_latency_us(topo_);
  }
  void on_link(LinkId l, double payload, double occupy = 1.0) {
    if (payload > 0) plan_.add_flow(std::span<const LinkId>(&l, 1), payload, payload * occupy);
  }
  CommPlan take() { return std::move(plan_); }

 private:
  const Topology& topo_;
  CommPlan plan_;
  std::vector<LinkId> path_;
};

}  // namespace

int dtree_parent(int k, int count, int tree) {
  // Tree 0: the binary tree in which odd indices are leaves; k's parent flips k's lowest set bit off and
  // the next one on (or just off, past the end). 0 is the root, with one child.
  auto parent0 = [count](int r) {
    if (r == 0) return -1;
    const int bit = r & -r;
    const int up = (r ^ bit) | (bit << 1);
    return up < count ? up : (r ^ bit);
  };
  if (tree == 0 || count <= 2) return parent0(k);
  // Tree 1 turns tree 0's leaves into interior nodes: mirrored for an even count, shifted by one for odd.
  if (count % 2 == 0) {
    const int p = parent0(count - 1 - k);
    return p < 0 ? -1 : count - 1 - p;
  }
  const int p = parent0((k - 1 + count) % count);
  return p < 0 ? -1 : (p + 1) % count;
}

CommPlan ring_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root) {
  PlanBuilder b(topo, Algorithm::Ring);
  const double n = static_cast<double>(g.ranks.size());
  const int channels = g.channels;
  // Share of S every ring edge carries, per channel.
  double per_edge = 0;
  switch (op) {
    case CommOp::AllReduce:  // reduce-scatter then all-gather: 2(n-1) steps of S/n
      per_edge = 2 * (n - 1) / n;
      break;
    case CommOp::AllGather:
    case CommOp::ReduceScatter:
      per_edge = (n - 1) / n;
      break;
    case CommOp::Broadcast:
    case CommOp::Reduce:  // a pipelined chain: every byte crosses every edge but the one into (out of) root
      per_edge = 1;
      break;
    default:
      throw UsageError(fmt::format("no ring for {}", comm_op_name(op)));
  }
  per_edge /= channels;
  b.reserve(static_cast<std::size_t>(channels) * g.ranks.size());
  std::vector<int> ring;
  for (int c = 0; c < channels; ++c) {
    ring.clear();
    for (int k = 0; k < static_cast<int>(g.nodes.size()); ++k) {
      const std::vector<int> order = chain(g, k, c);
      ring.insert(ring.end(), order.begin(), order.end());
    }
    for (std::size_t i = 0; i < ring.size(); ++i) {
      const int from = ring[i], to = ring[(i + 1) % ring.size()];
      if (op == CommOp::Broadcast && to == root) continue;
      if (op == CommOp::Reduce && from == root) continue;
      b.send(from, to, per_edge);
    }
  }
  return b.take();
}

CommPlan tree_plan(const Topology& topo, const GroupLayout& g) {
  PlanBuilder b(topo, Algorithm::Tree);
  const int nodes = static_cast<int>(g.nodes.size());
  const double per_channel = 1.0 / g.channels;
  b.reserve(static_cast<std::size_t>(g.channels) * (2 * g.ranks.size() + 4 * nodes));
  for (int c = 0; c < g.channels; ++c) {
    // Inside each node a chain from the head: every edge carries the channel's share up (reduce) and down
    // (broadcast). Both trees of the channel share the chain.
    for (int k = 0; k < nodes; ++k) {
      const std::vector<int> order = chain(g, k, 0);
      const int h = head(g, k, c);
      const int start = static_cast<int>(std::find(order.begin(), order.end(), h) - order.begin());
      for (std::size_t i = 0; i + 1 < order.size(); ++i) {
        const int parent = order[(start + i) % order.size()], child = order[(start + i + 1) % order.size()];
        b.send(child, parent, per_channel);
        b.send(parent, child, per_channel);
      }
    }
    // Between nodes, two binary trees, each with half of the channel's share, heads talking to heads.
    for (int tree = 0; tree < 2 && nodes > 1; ++tree) {
      for (int k = 0; k < nodes; ++k) {
        const int p = dtree_parent(k, nodes, tree);
        if (p < 0) continue;
        b.send(head(g, k, c), head(g, p, c), per_channel / 2);
        b.send(head(g, p, c), head(g, k, c), per_channel / 2);
      }
    }
  }
  return b.take();
}

CommPlan nvls_plan(const Topology& topo, const GroupLayout& g, CommOp op) {
  PlanBuilder b(topo, Algorithm::Nvls);
  const double n = static_cast<double>(g.ranks.size());
  // all_reduce: the switch reads every GPU's copy of every chunk (S up) and returns each GPU its reduced
  // chunk (S/n down); each GPU stores its chunk once (S/n up) and the switch writes it to all (S down).
  double up = 1 + 1 / n, down = 1 + 1 / n;
  if (op == CommOp::AllGather) up = 1 / n, down = 1;
  if (op == CommOp::ReduceScatter) up = 1, down = 1 / n;
  for (int r : g.ranks) {
    b.on_link(topo.gpu_to_nvswitch(r), up);
    b.on_link(topo.nvswitch_to_gpu(r), down);
  }
  return b.take();
}

CommPlan nvls_tree_plan(const Topology& topo, const GroupLayout& g) {
  PlanBuilder b(topo, Algorithm::NvlsTree);
  const int nodes = static_cast<int>(g.nodes.size());
  const int m = static_cast<int>(g.nodes[0].size());
  // NVLS reduce-scatter and all-gather inside each node: S (1 + 1/m) each way on every GPU's NVLink, at
  // NVLS's 5/6 of the link (kNvlsLinkFraction).
  const double nvls_occupy = 1.0 / kNvlsLinkFraction;
  for (int r : g.ranks) {
    b.on_link(topo.gpu_to_nvswitch(r), 1 + 1.0 / m, nvls_occupy);
    b.on_link(topo.nvswitch_to_gpu(r), 1 + 1.0 / m, nvls_occupy);
  }
  // Member j of every node owns S/m and all-reduces it with member j of the other nodes, over its rail.
  // That part is a tree of point-to-point sends through the NICs, at the Simple protocol's full rate: the
  // 5/6 is the switch's, not the network's.
  for (int j = 0; j < m; ++j) {
    for (int tree = 0; tree < 2; ++tree) {
      for (int k = 0; k < nodes; ++k) {
        const int p = dtree_parent(k, nodes, tree);
        if (p < 0) continue;
        b.send(g.nodes[k][j], g.nodes[p][j], 0.5 / m);
        b.send(g.nodes[p][j], g.nodes[k][j], 0.5 / m);
      }
    }
  }
  return b.take();
}

CommPlan direct_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root) {
  PlanBuilder b(topo, Algorithm::Direct);
  const double piece = 1.0 / static_cast<double>(g.ranks.size());
  for (int r : g.ranks) {
    if (r == root) continue;
    // Grouped send/recv, so between nodes PXN's routes.
    op == CommOp::Scatter ? b.send_via(root, g.relay(topo, root, r), r, piece)
                          : b.send_via(r, g.relay(topo, r, root), root, piece);
  }
  return b.take();
}

CommPlan pairwise_plan(const Topology& topo, const GroupLayout& g) {
  PlanBuilder b(topo, Algorithm::Pairwise);
  const std::size_t n = g.ranks.size();
  const double piece = 1.0 / static_cast<double>(n);  // every member sends S/n to every other
  b.reserve(n * (n - 1));
  for (int src : g.ranks) {
    for (int dst : g.ranks) b.send_via(src, g.relay(topo, src, dst), dst, piece);
  }
  return b.take();
}

CommPlan pairwise_uneven_plan(const Topology& topo, const GroupLayout& g,
                              const std::vector<std::int64_t>& pair_bytes) {
  PlanBuilder b(topo, Algorithm::Pairwise);
  const std::size_t n = g.ranks.size();
  b.reserve(n * (n - 1));
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      const int src = g.ranks[i], dst = g.ranks[j];
      b.send_via(src, g.relay(topo, src, dst), dst, static_cast<double>(pair_bytes[i * n + j]));
    }
  }
  return b.take();
}

CommPlan p2p_plan(const Topology& topo, int src, int dst, int relay) {
  PlanBuilder b(topo, Algorithm::Direct);
  b.send_via(src, relay, dst, 1.0);
  return b.take();
}

CommPlan unit_plan(const Topology& topo, const GroupLayout& g, CommOp op, Algorithm a, int root) {
  switch (a) {
    case Algorithm::Ring:
      return ring_plan(topo, g, op, root);
    case Algorithm::Tree:
      return tree_plan(topo, g);
    case Algorithm::Nvls:
      return nvls_plan(topo, g, op);
    case Algorithm::NvlsTree:
      return nvls_tree_plan(topo, g);
    case Algorithm::Direct:
      return direct_plan(topo, g, op, root);
    case Algorithm::Pairwise:
      return pairwise_plan(topo, g);
    case Algorithm::Local:
      break;
  }
  CommPlan local;
  local.algorithm = Algorithm::Local;
  return local;
}

}  // namespace ranklab::sim
