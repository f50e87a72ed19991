#include "sim/net/topology_print.h"

#include <fmt/format.h>

#include <map>
#include <vector>

#include "common/units.h"

namespace ranklab::sim {

namespace {

struct Row {
  std::string tier, what, line_rate, sustained, latency, note;
};

std::string gbps(double v) {
  return format_gbps(v);
}
std::string us(double v) {
  return fmt::format("{:.2f} us", v);
}

// "gpu0..gpu7" for a run of device numbers.
std::string range(const char* kind, int first, int count) {
  return count == 1 ? fmt::format("{}{}", kind, first)
                    : fmt::format("{}{}..{}{}", kind, first, kind, first + count - 1);
}

}  // namespace

std::string format_topology(const Topology& topo) {
  const Profile& p = topo.profile();
  const int g = topo.gpus_per_node();
  std::string out;
  out += fmt::format("{} x {} node{}: {} GPUs ({})\n", p.name, topo.nodes(), topo.nodes() == 1 ? "" : "s",
                     topo.gpus(), p.description);
  if (!p.source_file.empty()) out += fmt::format("from {}\n", p.source_file);

  // The hierarchy, per GPU and per direction, fastest first.
  std::vector<Row> rows;
  rows.push_back(
      {"hbm", fmt::format("{} memory, {}", p.gpu.name, format_bytes(p.gpu.hbm_capacity_gib * 1073741824.0)),
       gbps(p.gpu.hbm_bandwidth_gbps), gbps(p.gpu.hbm_bandwidth_gbps * p.gpu.memory_efficiency), "-",
       "for scale: not a link"});
  if (p.has_nvlink) {
    const NvlinkSpec& nv = p.nvlink;
    rows.push_back({"nvlink",
                    fmt::format("GPU <-> {}: {} x {} GB/s {}", nv.switch_name, nv.links_per_gpu,
                                nv.link_bandwidth_gbps, nv.generation),
                    gbps(nv.gpu_bandwidth_gbps()), gbps(nv.gpu_bandwidth_gbps() * nv.efficiency),
                    us(nv.latency_us), nv.nvls ? "in-switch reduction (NVLS)" : "no in-switch reduction"});
  }
  rows.push_back(
      {"pcie", fmt::format("GPU <-> PCIe switch: {}", p.pcie.generation), gbps(p.pcie.bandwidth_gbps),
       gbps(p.pcie.bandwidth_gbps * p.pcie.efficiency), us(p.pcie.latency_us),
       fmt::format("{} GPU{} per switch", p.pcie.gpus_per_switch, p.pcie.gpus_per_switch == 1 ? "" : "s")});
  const double share = p.nic.bandwidth_gbps * p.nic.count / g;
  rows.push_back({"network", fmt::format("NIC <-> leaf: {} x {}", p.nic.count, p.nic.name),
                  gbps(p.nic.bandwidth_gbps), gbps(p.nic.bandwidth_gbps * p.nic.efficiency),
                  us(p.nic.latency_us), fmt::format("{} per GPU", gbps(share))});
  rows.push_back({"network", fmt::format("switch: {} ({})", p.fabric.switch_name, p.fabric.kind), "", "",
                  us(p.fabric.switch_latency_us), fmt::format("{} ports", p.fabric.switch_radix)});

  std::size_t w[5] = {4, 4, 9, 9, 7};
  for (const Row& r : rows) {
    w[0] = std::max(w[0], r.tier.size());
    w[1] = std::max(w[1], r.what.size());
    w[2] = std::max(w[2], r.line_rate.size());
    w[3] = std::max(w[3], r.sustained.size());
    w[4] = std::max(w[4], r.latency.size());
  }
  out +=
      "\nThe hierarchy, fastest first (one GPU, one direction; 'sustained' is what NCCL's transfers "
      "reach):\n";
  out += fmt::format("  {:<{}}  {:<{}}  {:>{}}  {:>{}}  {:>{}}\n", "tier", w[0], "link", w[1], "line rate",
                     w[2], "sustained", w[3], "latency", w[4]);
  for (const Row& r : rows) {
    out += fmt::format("  {:<{}}  {:<{}}  {:>{}}  {:>{}}  {:>{}}  {}\n", r.tier, w[0], r.what, w[1],
                       r.line_rate, w[2], r.sustained, w[3], r.latency, w[4], r.note);
  }
  const double intra = p.has_nvlink ? p.nvlink.gpu_bandwidth_gbps() : p.pcie.bandwidth_gbps;
  // HBM's figure is one total, reads and writes sharing it; a link's is per direction, and the figure
  // vendors (and the lecture's "NVLink is about 1/4 of HBM") quote for NVLink is both directions added.
  const char* link = p.has_nvlink ? "NVLink" : "PCIe";
  out += fmt::format("  HBM: {}, reads and writes together. {}: {} per direction, {} both directions.\n",
                     gbps(p.gpu.hbm_bandwidth_gbps), link, gbps(intra), gbps(2 * intra));
  out += fmt::format(
      "  HBM is {:.1f}x {} per direction, {:.1f}x counting both (NVIDIA's convention, and the lecture's "
      "\"about 4x\").\n",
      p.gpu.hbm_bandwidth_gbps / intra, link, p.gpu.hbm_bandwidth_gbps / (2 * intra));
  out += fmt::format("  {} per direction is {:.1f}x the GPU's share of the network per direction.\n", link,
                     intra / share);

  // The devices of each node (the first and last when there are many).
  out += "\nDevices:\n";
  const int per_switch = p.pcie.gpus_per_switch, switches = topo.pcie_switches_per_node(),
            nics = topo.nics_per_node();
  auto node_line = [&](int n) {
    std::string line = fmt::format("  node {}: {}", n, range("gpu", n * g, g));
    if (p.has_nvlink) line += fmt::format(" on nvswitch{}", n);
    line += fmt::format("; {} ({} GPU{} each) to cpu{}", range("pcie", n * switches, switches), per_switch,
                        per_switch == 1 ? "" : "s", n);
    line += fmt::format("; {} ({})\n", range("nic", n * nics, nics),
                        nics == 1 ? std::string("rail 0") : fmt::format("rails 0..{}", nics - 1));
    return line;
  };
  out += node_line(0);
  if (topo.nodes() > 2) out += fmt::format("  ... {} more nodes alike ...\n", topo.nodes() - 2);
  if (topo.nodes() > 1) out += node_line(topo.nodes() - 1);

  if (topo.has_fabric()) {
    auto count = [](int n, const char* one, const char* many) {
      return fmt::format("{} {}", n, n == 1 ? one : many);
    };
    out +=
        fmt::format("\nFabric: rail-optimised {} fat tree, {} tiers, NIC k of every node on rail k ({}):\n",
                    p.fabric.kind == "roce" ? "RoCE Ethernet" : "InfiniBand", topo.fabric_tiers(),
                    count(nics, "rail", "rails"));
    out +=
        fmt::format("  {} per leaf, {}, {}; each leaf has {} uplinks, {} to each spine{}\n",
                    count(topo.nodes_per_leaf(), "node", "nodes"), count(topo.leaves(), "leaf", "leaves"),
                    count(topo.spines(), "spine", "spines"), topo.uplinks_per_leaf(),
                    gbps(topo.uplinks_per_leaf() * p.nic.bandwidth_gbps / topo.spines()),
                    topo.fabric_tiers() == 3 ? " (the spine links stand for a spine and a core layer)" : "");
  } else {
    out += "\nNo fabric: one node (use --nodes N for more).\n";
  }

  std::map<Tier, std::size_t> per_tier;
  for (LinkId l = 0; l < topo.link_count(); ++l) ++per_tier[topo.tier(l)];
  out += fmt::format("\n{} directed links:", topo.link_count());
  for (const auto& [tier, count] : per_tier) out += fmt::format(" {} {},", count, tier_name(tier));
  out.back() = '\n';
  return out;
}

}  // namespace ranklab::sim
