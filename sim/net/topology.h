// Topology: the machine a run's communication crosses, as directed links between devices, in the
// lecture's hierarchy: NVLink from each GPU to its node's NVSwitch; PCIe from each GPU and NIC to a PCIe
// switch (and from switches to the CPU); NICs to the leaf switches of a rail-optimised InfiniBand or RoCE
// fat tree, and leaves to spines.
//
// The layout follows NCCL's own model of a machine (src/graph/topo.h of NVIDIA/nccl: GPU, NVS, PCI, CPU,
// NIC and NET nodes joined by typed links with a bandwidth each). Unlike NCCL, which discovers one node's
// topology, this one describes the whole cluster, so it is kept implicit: a link is a number computed from
// what it joins, and its name, tier and bandwidth are computed from the number. Nothing is stored per
// GPU, which keeps a 16,384-GPU cluster as cheap to build as one node.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/profile.h"

namespace ranklab::sim {

// A directed link; dense numbers in [0, link_count()).
using LinkId = std::uint32_t;

// The three tiers of the lecture's hierarchy, fastest first.
enum class Tier { NVLink, PCIe, Network };
const char* tier_name(Tier t);  // "nvlink", "pcie", "network"

struct LinkInfo {
  std::string name;  // "gpu3->nvswitch0", "nic5->leaf5", ...
  Tier tier = Tier::NVLink;
  double line_rate_gbps = 0;  // on the wire, one direction
  double capacity_gbps = 0;   // what NCCL's transfers sustain: line rate x the profile's efficiency
  double latency_us = 0;      // one traversal, hardware only
};

// What a link joins. Devices are numbered per kind across the cluster: "gpu12" is GPU 4 of node 1 on
// 8-GPU nodes, "nvswitch1" that node's NVSwitch (one per node stands for all of its NVSwitch chips), "cpu1"
// its host, "leaf5" a leaf switch of the fabric.
enum class DeviceKind { Gpu, Nvswitch, Pcie, Cpu, Nic, Leaf, Spine };
const char* device_kind_name(DeviceKind k);  // "gpu", "nvswitch", "pcie", "cpu", "nic", "leaf", "spine"

struct Device {
  DeviceKind kind = DeviceKind::Gpu;
  std::int64_t index = 0;
  std::string name() const;  // "gpu3"
};

class Topology {
 public:
  // The cluster of `profile.nodes` nodes.
  explicit Topology(const Profile& profile);

  const Profile& profile() const { return profile_; }
  int nodes() const { return nodes_; }
  int gpus() const { return nodes_ * gpus_per_node_; }
  int gpus_per_node() const { return gpus_per_node_; }
  int node_of(int gpu) const { return gpu / gpus_per_node_; }
  int local_of(int gpu) const { return gpu % gpus_per_node_; }
  bool has_nvlink() const { return profile_.has_nvlink; }
  bool nvls() const { return profile_.has_nvlink && profile_.nvlink.nvls; }

  // PCIe switches, NICs and rails. NIC k of a node is that node's port on rail k.
  int pcie_switches_per_node() const { return gpus_per_node_ / profile_.pcie.gpus_per_switch; }
  int nics_per_node() const { return profile_.nic.count; }
  int nic_of(int gpu) const;  // global NIC index: node * nics_per_node + rail
  int rail_of_nic(int nic) const { return nic % nics_per_node(); }

  // The fabric (only when there is more than one node). Leaves of rail r serve nodes_per_leaf() nodes
  // each; every leaf has the same number of uplinks, spread evenly over the spines.
  bool has_fabric() const { return nodes_ > 1; }
  int nodes_per_leaf() const { return nodes_per_leaf_; }
  int leaves() const { return leaves_; }
  int spines() const { return spines_; }
  int uplinks_per_leaf() const { return uplinks_per_leaf_; }
  // 2 for leaf/spine; 3 when there are more leaves than a spine switch has ports, in which case the spine
  // links stand for a spine and core layer together (the core adds latency, not links).
  int fabric_tiers() const { return fabric_tiers_; }
  int leaf_of_nic(int nic) const;
  // Switches a byte crosses between the NICs of two GPUs on different nodes: 1 under one leaf, 3 through
  // a spine, 5 through a core.
  int switch_hops(int src_gpu, int dst_gpu) const;

  // Links.
  std::size_t link_count() const { return offsets_.back(); }
  LinkInfo link(LinkId id) const;
  std::string link_name(LinkId id) const;           // "gpu3->nvswitch0": its two devices
  std::pair<Device, Device> ends(LinkId id) const;  // from, to
  // Whether the link leaves a GPU, or arrives at one: the kinds of ends(id)'s devices, without working
  // out which devices they are (read for every flow of every collective: SimWorld::set_hbm_rates).
  bool leaves_gpu(LinkId id) const;
  bool enters_gpu(LinkId id) const;
  // The node (server) a device is part of; -1 for the fabric's switches, which the nodes share.
  int node_of(Device d) const;
  Tier tier(LinkId id) const { return kind_tier_[kind_of(id)]; }
  double capacity_gbps(LinkId id) const { return kind_capacity_[kind_of(id)]; }
  double line_rate_gbps(LinkId id) const { return kind_line_rate_[kind_of(id)]; }
  double latency_us(LinkId id) const { return kind_latency_[kind_of(id)]; }
  double path_latency_us(std::span<const LinkId> path) const;

  // Appends the links from GPU `src` to GPU `dst` to `out` (nothing when src == dst): NVLink through the
  // NVSwitch inside a node (PCIe when the node has no NVLink), and GPU -> PCIe -> NIC -> leaf [-> spine
  // -> leaf] -> NIC -> PCIe -> GPU between nodes. Spine choice is a fixed hash of the two NICs, as ECMP
  // routing picks one path per connection.
  void append_path(int src, int dst, std::vector<LinkId>& out) const;
  // The same through GPU `relay` of src's node (PXN, sim/net/algorithms.h): NVLink src -> NVSwitch ->
  // relay, then relay's path to dst through relay's NIC. A relay equal to src is the direct path.
  void append_path_via(int src, int relay, int dst, std::vector<LinkId>& out) const;
  // Whether `gpu` reaches NIC `nic` through PCIe switches alone, without crossing the CPU (NCCL's path
  // type PATH_PXB or closer, src/graph/topo.h of 2.21.5).
  bool nic_behind_pcie_switch(int gpu, int nic) const { return switch_of_gpu(gpu) == switch_of_nic(nic); }
  // The two NVLink links of a GPU (has_nvlink() only): what in-switch reduction (NVLS) uses.
  LinkId gpu_to_nvswitch(int gpu) const { return id(kGpuToNvswitch, gpu); }
  LinkId nvswitch_to_gpu(int gpu) const { return id(kNvswitchToGpu, gpu); }
  // The halves of a path between nodes (has_fabric() only): GPU -> ... -> NIC -> leaf, and leaf -> NIC
  // -> ... -> GPU; and the links between a leaf and a spine.
  void append_to_leaf(int gpu, std::vector<LinkId>& out) const;
  void append_from_leaf(int gpu, std::vector<LinkId>& out) const;
  LinkId leaf_to_spine(int leaf, int spine) const {
    return id(kLeafToSpine, std::int64_t{leaf} * spines_ + spine);
  }
  LinkId spine_to_leaf(int spine, int leaf) const {
    return id(kSpineToLeaf, std::int64_t{leaf} * spines_ + spine);
  }
  // The spine, in [0, spines()), that ECMP gives the connection from NIC `src_nic` to NIC `dst_nic` on
  // different leaves: a fixed hash of the two, uniform over the spines for any spine count.
  int ecmp_spine(int src_nic, int dst_nic) const;
  // Whether `id` joins a leaf and a spine: traffic between leaves, routed by a hash of its endpoints.
  bool is_spine_link(LinkId id) const {
    return id >= offsets_[kLeafToSpine] && id < offsets_[kSpineToLeaf + 1];
  }
  // Whether `id` lies inside one node, short of its NICs: NVLink, a GPU's PCIe link, or a PCIe switch's
  // link to the CPU.
  bool in_node(LinkId id) const { return id < offsets_[kCpuToPcie + 1]; }
  // The same in-node link `gpus` GPUs further on, `gpus` a multiple of the GPUs per PCIe switch: where a
  // translation of the ranks by `gpus` takes it.
  LinkId shifted(LinkId id, int gpus) const;
  // Whether shifted() applies to a translation by `gpus`.
  bool shifts_in_nodes(int gpus) const { return gpus % profile_.pcie.gpus_per_switch == 0; }

 private:
  enum Kind {
    kGpuToNvswitch,
    kNvswitchToGpu,
    kGpuToPcie,
    kPcieToGpu,
    kPcieToCpu,
    kCpuToPcie,
    kPcieToNic,
    kNicToPcie,
    kNicToLeaf,
    kLeafToNic,
    kLeafToSpine,
    kSpineToLeaf,
    kKinds
  };
  LinkId id(Kind k, std::int64_t index) const { return static_cast<LinkId>(offsets_[k] + index); }
  int kind_of(LinkId id) const;
  int switch_of_gpu(int gpu) const;  // global PCIe switch index
  int switch_of_nic(int nic) const;
  // GPU (or NIC) -> PCIe switch of `to_switch`, through the CPU when the switches differ.
  void append_pcie(int from_switch, int to_switch, std::vector<LinkId>& out) const;

  Profile profile_;
  int nodes_ = 1;
  int gpus_per_node_ = 1;
  int nodes_per_leaf_ = 1;
  int leaves_per_rail_ = 0;
  int leaves_ = 0;
  int spines_ = 0;
  int uplinks_per_leaf_ = 0;
  int fabric_tiers_ = 0;
  std::array<std::int64_t, kKinds + 1> offsets_{};
  std::array<Tier, kKinds> kind_tier_{};
  std::array<double, kKinds> kind_line_rate_{};
  std::array<double, kKinds> kind_capacity_{};
  std::array<double, kKinds> kind_latency_{};
};

}  // namespace ranklab::sim
