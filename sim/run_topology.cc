#include "sim/run_topology.h"

#include <algorithm>
#include <cstdint>
#include <unordered_set>

namespace ranklab::sim {

namespace {

// Rows of the drawing, top to bottom: the fabric, the NICs (with the CPU, the other device a PCIe switch
// reaches up to), the PCIe switches, the GPUs, and the NVSwitch below them, where NVLink keeps to itself.
int level_of(DeviceKind k) {
  switch (k) {
    case DeviceKind::Spine:
      return 0;
    case DeviceKind::Leaf:
      return 1;
    case DeviceKind::Nic:
    case DeviceKind::Cpu:
      return 2;
    case DeviceKind::Pcie:
      return 3;
    case DeviceKind::Gpu:
      return 4;
    case DeviceKind::Nvswitch:
      return 5;
  }
  return 6;
}

// Whether `d` is in the part of the cluster that `nodes_used` nodes holding `world` ranks use.
bool used(const Topology& topo, Device d, int world, int nodes_used) {
  switch (d.kind) {
    case DeviceKind::Gpu:
      return d.index < world;
    case DeviceKind::Leaf:  // a leaf serves one rail of nodes_per_leaf() consecutive nodes
      return d.index / topo.nics_per_node() * topo.nodes_per_leaf() < nodes_used;
    case DeviceKind::Spine:  // every leaf reaches every spine
      return true;
    default:
      return topo.node_of(d) < nodes_used;
  }
}

TopologyNode node_of(const Topology& topo, Device d) {
  TopologyNode n;
  n.id = d.name();
  n.kind = device_kind_name(d.kind);
  n.level = level_of(d.kind);
  n.host = topo.node_of(d);
  if (d.kind == DeviceKind::Gpu) n.rank = static_cast<int>(d.index);
  return n;
}

}  // namespace

RunTopology run_topology(const Topology& topo, int world) {
  world = std::min(world, topo.gpus());
  const int nodes_used = (world + topo.gpus_per_node() - 1) / topo.gpus_per_node();
  RunTopology out;
  // Devices seen, by kind and index: every link meets two, and naming each to look it up would build two
  // strings per link (a 16,384-rank world has hundreds of thousands of links).
  std::unordered_set<std::uint64_t> known;
  auto add_node = [&](Device d) {
    const std::uint64_t key = static_cast<std::uint64_t>(d.kind) << 56 | static_cast<std::uint64_t>(d.index);
    if (known.insert(key).second) out.nodes.push_back(node_of(topo, d));
  };
  for (int r = 0; r < world; ++r) add_node({DeviceKind::Gpu, r});
  for (LinkId l = 0; l < topo.link_count(); ++l) {
    const auto [from, to] = topo.ends(l);
    if (!used(topo, from, world, nodes_used) || !used(topo, to, world, nodes_used)) continue;
    add_node(from);
    add_node(to);
    // Named as NetworkModel::link_traffic names it, which is how the report finds each link's bytes.
    out.links.push_back(
        {topo.link_name(l), from.name(), to.name(), tier_name(topo.tier(l)), topo.line_rate_gbps(l)});
  }
  return out;
}

}  // namespace ranklab::sim
