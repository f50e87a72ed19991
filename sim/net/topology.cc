#include "sim/net/topology.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace ranklab::sim {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::NVLink:
      return "nvlink";
    case Tier::PCIe:
      return "pcie";
    case Tier::Network:
      return "network";
  }
  return "?";
}

Topology::Topology(const Profile& profile)
    : profile_(profile), nodes_(std::max(1, profile.nodes)), gpus_per_node_(profile.gpus_per_node) {
  const std::int64_t gpus = profile.gpus_in(nodes_);  // refused past an int, not wrapped
  const std::int64_t switches = std::int64_t{nodes_} * pcie_switches_per_node();
  const std::int64_t nics = std::int64_t{nodes_} * nics_per_node();

  // The fat tree, sized for this many nodes. A leaf gives `down` ports to nodes and the rest to spines,
  // in the profile's oversubscription ratio (1:1 is the non-blocking fabric of the DGX SuperPOD designs).
  if (has_fabric()) {
    const double o = profile_.fabric.oversubscription;
    const int radix = profile_.fabric.switch_radix;
    const int down = std::max(1, static_cast<int>(std::floor(radix * o / (1 + o))));
    nodes_per_leaf_ = std::min(nodes_, down);
    leaves_per_rail_ = (nodes_ + nodes_per_leaf_ - 1) / nodes_per_leaf_;
    leaves_ = leaves_per_rail_ * nics_per_node();
    uplinks_per_leaf_ = std::max(1, static_cast<int>(std::ceil(nodes_per_leaf_ / o)));
    // A spine switch has `radix` ports, one or more per leaf; more leaves than that need a third tier.
    if (leaves_ <= radix) {
      spines_ = std::max(1, (leaves_ * uplinks_per_leaf_ + radix - 1) / radix);
      fabric_tiers_ = 2;
    } else {
      spines_ = uplinks_per_leaf_;
      fabric_tiers_ = 3;
    }
  }

  const std::int64_t counts[kKinds] = {
      has_nvlink() ? gpus : 0,                             // kGpuToNvswitch
      has_nvlink() ? gpus : 0,                             // kNvswitchToGpu
      gpus,                                                // kGpuToPcie
      gpus,                                                // kPcieToGpu
      switches,                                            // kPcieToCpu
      switches,                                            // kCpuToPcie
      nics,                                                // kPcieToNic
      nics,                                                // kNicToPcie
      has_fabric() ? nics : 0,                             // kNicToLeaf
      has_fabric() ? nics : 0,                             // kLeafToNic
      has_fabric() ? std::int64_t{leaves_} * spines_ : 0,  // kLeafToSpine
      has_fabric() ? std::int64_t{leaves_} * spines_ : 0,  // kSpineToLeaf
  };
  offsets_[0] = 0;
  for (int k = 0; k < kKinds; ++k) offsets_[k + 1] = offsets_[k] + counts[k];
  if (offsets_[kKinds] > 0xffffffffLL) {
    throw UsageError(
        fmt::format("{} nodes of {} are more links than this model numbers", nodes_, profile_.name));
  }

  // Every link of a kind is alike, so bandwidth and latency are kept per kind.
  const NvlinkSpec& nv = profile_.nvlink;
  const PcieSpec& pcie = profile_.pcie;
  const NicSpec& nic = profile_.nic;
  const FabricSpec& fab = profile_.fabric;
  const double nvlink_gbps = nv.gpu_bandwidth_gbps();
  // A leaf spreads its uplinks evenly over the spines: each leaf-spine link stands for that many cables.
  const double spine_link_gbps = spines_ > 0 ? uplinks_per_leaf_ * nic.bandwidth_gbps / spines_ : 0;
  // A core tier (fabric_tiers_ == 3) adds two switch traversals to every path through the spines.
  const double spine_latency_us = fab.switch_latency_us * (fabric_tiers_ == 3 ? 2 : 1);
  struct KindSpec {
    Tier tier;
    double line_rate_gbps;
    double efficiency;
    double latency_us;
  };
  const KindSpec specs[kKinds] = {
      {Tier::NVLink, nvlink_gbps, nv.efficiency, nv.latency_us},
      {Tier::NVLink, nvlink_gbps, nv.efficiency, nv.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      {Tier::PCIe, pcie.bandwidth_gbps, pcie.efficiency, pcie.latency_us},
      // The NIC's own latency sits on its way out; the leaf's switching latency on the way down.
      {Tier::Network, nic.bandwidth_gbps, nic.efficiency, nic.latency_us + fab.switch_latency_us},
      {Tier::Network, nic.bandwidth_gbps, nic.efficiency, nic.latency_us},
      {Tier::Network, spine_link_gbps, nic.efficiency, spine_latency_us},
      {Tier::Network, spine_link_gbps, nic.efficiency, fab.switch_latency_us},
  };
  for (int k = 0; k < kKinds; ++k) {
    kind_tier_[k] = specs[k].tier;
    kind_line_rate_[k] = specs[k].line_rate_gbps;
    kind_capacity_[k] = specs[k].line_rate_gbps * specs[k].efficiency;
    kind_latency_[k] = specs[k].latency_us;
  }
}

int Topology::kind_of(LinkId id) const {
  // Twelve kinds: a linear scan is as fast as anything else.
  for (int k = 0; k < kKinds; ++k) {
    if (id < offsets_[k + 1]) return k;
  }
  throw UsageError(fmt::format("link {} does not exist ({} links)", id, link_count()));
}

int Topology::nic_of(int gpu) const {
  const int gpus_per_nic = gpus_per_node_ / nics_per_node();
  return node_of(gpu) * nics_per_node() + local_of(gpu) / gpus_per_nic;
}

LinkId Topology::shifted(LinkId id, int gpus) const {
  // The GPUs' links are numbered by GPU, the switches' by switch (node by node, in the GPUs' order).
  const int k = kind_of(id);
  const std::int64_t step = k == kPcieToCpu || k == kCpuToPcie ? gpus / profile_.pcie.gpus_per_switch : gpus;
  return static_cast<LinkId>(static_cast<std::int64_t>(id) + step);
}

int Topology::switch_of_gpu(int gpu) const {
  return node_of(gpu) * pcie_switches_per_node() + local_of(gpu) / profile_.pcie.gpus_per_switch;
}

int Topology::switch_of_nic(int nic) const {
  // A NIC sits on the switch of the first GPU it serves.
  const int node = nic / nics_per_node();
  const int first_gpu = node * gpus_per_node_ + rail_of_nic(nic) * (gpus_per_node_ / nics_per_node());
  return switch_of_gpu(first_gpu);
}

int Topology::leaf_of_nic(int nic) const {
  const int node = nic / nics_per_node();
  return (node / nodes_per_leaf_) * nics_per_node() + rail_of_nic(nic);
}

int Topology::switch_hops(int src_gpu, int dst_gpu) const {
  if (leaf_of_nic(nic_of(src_gpu)) == leaf_of_nic(nic_of(dst_gpu))) return 1;
  return fabric_tiers_ == 3 ? 5 : 3;
}

const char* device_kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::Gpu:
      return "gpu";
    case DeviceKind::Nvswitch:
      return "nvswitch";
    case DeviceKind::Pcie:
      return "pcie";
    case DeviceKind::Cpu:
      return "cpu";
    case DeviceKind::Nic:
      return "nic";
    case DeviceKind::Leaf:
      return "leaf";
    case DeviceKind::Spine:
      return "spine";
  }
  return "?";
}

std::string Device::name() const {
  return fmt::format("{}{}", device_kind_name(kind), index);
}

std::pair<Device, Device> Topology::ends(LinkId id) const {
  const int k = kind_of(id);
  const std::int64_t i = id - offsets_[k];
  const int gpu = static_cast<int>(i), nic = static_cast<int>(i);
  using K = DeviceKind;
  // The kinds come in pairs, a direction and its reverse (kGpuToNvswitch, kNvswitchToGpu, ...).
  auto joins = [k](Device a, Device b) { return k % 2 == 0 ? std::pair{a, b} : std::pair{b, a}; };
  switch (k) {
    case kGpuToNvswitch:
    case kNvswitchToGpu:
      return joins({K::Gpu, i}, {K::Nvswitch, node_of(gpu)});
    case kGpuToPcie:
    case kPcieToGpu:
      return joins({K::Gpu, i}, {K::Pcie, switch_of_gpu(gpu)});
    case kPcieToCpu:
    case kCpuToPcie:
      return joins({K::Pcie, i}, {K::Cpu, i / pcie_switches_per_node()});
    case kPcieToNic:
    case kNicToPcie:
      return joins({K::Pcie, switch_of_nic(nic)}, {K::Nic, i});
    case kNicToLeaf:
    case kLeafToNic:
      return joins({K::Nic, i}, {K::Leaf, leaf_of_nic(nic)});
    case kLeafToSpine:
    case kSpineToLeaf:
      return joins({K::Leaf, i / spines_}, {K::Spine, i % spines_});
  }
  throw UsageError(fmt::format("link {} does not exist ({} links)", id, link_count()));
}

bool Topology::leaves_gpu(LinkId id) const {
  const int k = kind_of(id);
  return k == kGpuToNvswitch || k == kGpuToPcie;
}

bool Topology::enters_gpu(LinkId id) const {
  const int k = kind_of(id);
  return k == kNvswitchToGpu || k == kPcieToGpu;
}

std::string Topology::link_name(LinkId id) const {
  const auto [from, to] = ends(id);
  return from.name() + "->" + to.name();
}

int Topology::node_of(Device d) const {
  const int i = static_cast<int>(d.index);
  switch (d.kind) {
    case DeviceKind::Gpu:
      return node_of(i);
    case DeviceKind::Nvswitch:
    case DeviceKind::Cpu:
      return i;
    case DeviceKind::Pcie:
      return i / pcie_switches_per_node();
    case DeviceKind::Nic:
      return i / nics_per_node();
    case DeviceKind::Leaf:
    case DeviceKind::Spine:
      return -1;
  }
  return -1;
}

LinkInfo Topology::link(LinkId id) const {
  const int k = kind_of(id);
  return {link_name(id), kind_tier_[k], kind_line_rate_[k], kind_capacity_[k], kind_latency_[k]};
}

double Topology::path_latency_us(std::span<const LinkId> path) const {
  double us = 0;
  for (LinkId l : path) us += latency_us(l);
  return us;
}

void Topology::append_pcie(int from_switch, int to_switch, std::vector<LinkId>& out) const {
  if (from_switch == to_switch) return;
  out.push_back(id(kPcieToCpu, from_switch));
  out.push_back(id(kCpuToPcie, to_switch));
}

int Topology::ecmp_spine(int src_nic, int dst_nic) const {
  // ECMP: one spine per connection, a fixed function of its two ends, as a switch hashes a connection's
  // header. The two NIC indices are mixed by splitmix64's finaliser (Steele, Lea and Flood, "Fast
  // splittable pseudorandom number generators", OOPSLA 2014; the constants of Vigna's splitmix64.c),
  // in which every input bit changes every output bit, so NICs that differ only in their high bits (one
  // rail's NICs are 8 apart) still spread. The top 32 bits are then scaled to [0, spines) by a multiply
  // and shift (Lemire, "A fast alternative to the modulo reduction", 2016): uniform for any spine count,
  // where a modulo of a multiplicative hash keeps only its low bits.
  std::uint64_t z = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(src_nic)) << 32) |
                    static_cast<std::uint32_t>(dst_nic);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<int>(((z >> 32) * static_cast<std::uint64_t>(spines_)) >> 32);
}

void Topology::append_path(int src, int dst, std::vector<LinkId>& out) const {
  if (src == dst) return;
  if (node_of(src) == node_of(dst)) {
    const int src_switch = switch_of_gpu(src), dst_switch = switch_of_gpu(dst);
    if (has_nvlink()) {
      out.push_back(id(kGpuToNvswitch, src));
      out.push_back(id(kNvswitchToGpu, dst));
    } else {
      out.push_back(id(kGpuToPcie, src));
      append_pcie(src_switch, dst_switch, out);
      out.push_back(id(kPcieToGpu, dst));
    }
    return;
  }
  append_to_leaf(src, out);
  const int src_nic = nic_of(src), dst_nic = nic_of(dst);
  const int src_leaf = leaf_of_nic(src_nic), dst_leaf = leaf_of_nic(dst_nic);
  if (src_leaf != dst_leaf) {
    const int spine = ecmp_spine(src_nic, dst_nic);
    out.push_back(leaf_to_spine(src_leaf, spine));
    out.push_back(spine_to_leaf(spine, dst_leaf));
  }
  append_from_leaf(dst, out);
}

void Topology::append_path_via(int src, int relay, int dst, std::vector<LinkId>& out) const {
  if (relay == src) return append_path(src, dst, out);
  if (!has_nvlink() || node_of(relay) != node_of(src)) {
    throw UsageError(fmt::format(
        "gpu{} cannot relay for gpu{}: only a GPU of the same node, reached over NVLink, can", relay, src));
  }
  out.push_back(id(kGpuToNvswitch, src));
  out.push_back(id(kNvswitchToGpu, relay));
  append_path(relay, dst, out);
}

void Topology::append_to_leaf(int gpu, std::vector<LinkId>& out) const {
  // Up to the NIC over PCIe (GPUDirect RDMA: the NIC reads GPU memory without the CPU's memory).
  const int nic = nic_of(gpu);
  out.push_back(id(kGpuToPcie, gpu));
  append_pcie(switch_of_gpu(gpu), switch_of_nic(nic), out);
  out.push_back(id(kPcieToNic, nic));
  out.push_back(id(kNicToLeaf, nic));
}

void Topology::append_from_leaf(int gpu, std::vector<LinkId>& out) const {
  const int nic = nic_of(gpu);
  out.push_back(id(kLeafToNic, nic));
  out.push_back(id(kNicToPcie, nic));
  append_pcie(switch_of_nic(nic), switch_of_gpu(gpu), out);
  out.push_back(id(kPcieToGpu, gpu));
}

}  // namespace ranklab::sim
