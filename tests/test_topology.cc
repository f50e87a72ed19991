// The modelled machine: links, their names, tiers and capacities, paths between GPUs, the size of the
// fat tree, and the double binary trees NCCL builds across nodes.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/profile.h"
#include "sim/net/algorithms.h"
#include "sim/net/topology.h"
#include "sim/run_topology.h"
#include "sim_fixture.h"

namespace ranklab::sim {
namespace {

Profile profile(const std::string& name, int nodes = 1) {
  Profile p = load_profile(name);
  p.nodes = nodes;
  return p;
}

std::vector<LinkId> path(const Topology& t, int src, int dst) {
  std::vector<LinkId> out;
  t.append_path(src, dst, out);
  return out;
}

std::vector<std::string> names(const Topology& t, const std::vector<LinkId>& links) {
  std::vector<std::string> out;
  for (LinkId l : links) out.push_back(t.link_name(l));
  return out;
}

TEST(Topology, OneDgxH100) {
  const Topology t(profile("dgx-h100"));
  EXPECT_EQ(t.gpus(), 8);
  EXPECT_TRUE(t.has_nvlink());
  EXPECT_TRUE(t.nvls());
  EXPECT_FALSE(t.has_fabric());
  // NVLink up and down per GPU, PCIe up and down per GPU, switch to CPU and back, NIC to switch and back.
  EXPECT_EQ(t.link_count(), 8u * 2 + 8 * 2 + 8 * 2 + 8 * 2);

  const LinkInfo up = t.link(t.gpu_to_nvswitch(3));
  EXPECT_EQ(up.name, "gpu3->nvswitch0");
  EXPECT_EQ(up.tier, Tier::NVLink);
  EXPECT_DOUBLE_EQ(up.line_rate_gbps, 450.0);
  EXPECT_DOUBLE_EQ(up.capacity_gbps, 450.0 * 0.824);
  EXPECT_DOUBLE_EQ(up.latency_us, 0.3);
  EXPECT_EQ(t.link_name(t.nvswitch_to_gpu(5)), "nvswitch0->gpu5");
  EXPECT_STREQ(tier_name(Tier::Network), "network");

  // Inside a node every pair goes GPU -> NVSwitch -> GPU.
  EXPECT_EQ(names(t, path(t, 2, 6)), (std::vector<std::string>{"gpu2->nvswitch0", "nvswitch0->gpu6"}));
  EXPECT_TRUE(path(t, 4, 4).empty());
  EXPECT_DOUBLE_EQ(t.path_latency_us(path(t, 2, 6)), 0.6);

  // Every link has a distinct name.
  std::set<std::string> all;
  for (LinkId l = 0; l < t.link_count(); ++l) all.insert(t.link_name(l));
  EXPECT_EQ(all.size(), t.link_count());
}

TEST(Topology, EveryLinkJoinsTwoDevices) {
  const Topology t(profile("dgx-h100", 4));
  for (LinkId l = 0; l < t.link_count(); ++l) {
    const auto [from, to] = t.ends(l);
    EXPECT_EQ(t.link_name(l), from.name() + "->" + to.name());
    EXPECT_EQ(t.leaves_gpu(l), from.kind == DeviceKind::Gpu) << t.link_name(l);
    EXPECT_EQ(t.enters_gpu(l), to.kind == DeviceKind::Gpu) << t.link_name(l);
  }
  // Without NVLink a GPU's links go to its PCIe switch.
  const Topology pcie(profile("pcie-4gpu", 2));
  int gpu_ends = 0;
  for (LinkId l = 0; l < pcie.link_count(); ++l) {
    const auto [from, to] = pcie.ends(l);
    EXPECT_EQ(pcie.leaves_gpu(l), from.kind == DeviceKind::Gpu) << pcie.link_name(l);
    EXPECT_EQ(pcie.enters_gpu(l), to.kind == DeviceKind::Gpu) << pcie.link_name(l);
    gpu_ends += pcie.leaves_gpu(l) + pcie.enters_gpu(l);
  }
  EXPECT_EQ(gpu_ends, 2 * 8);  // each of the 8 GPUs: a link to its switch and one back
  const auto [gpu, nvswitch] = t.ends(t.gpu_to_nvswitch(12));
  EXPECT_EQ(gpu.name(), "gpu12");
  EXPECT_EQ(nvswitch.name(), "nvswitch1");
  EXPECT_EQ(t.node_of(gpu), 1);
  EXPECT_EQ(t.node_of(nvswitch), 1);
  EXPECT_EQ(t.node_of(Device{DeviceKind::Nic, 17}), 2);
  EXPECT_EQ(t.node_of(Device{DeviceKind::Pcie, 9}), 1);
  EXPECT_EQ(t.node_of(Device{DeviceKind::Leaf, 0}), -1);
}

TEST(RunTopology, ThePartOfTheClusterARunUsed) {
  // 12 ranks on DGX H100s: all of node 0, half of node 1, nothing of nodes 2 and 3.
  const Topology t(profile("dgx-h100", 4));
  const RunTopology run = run_topology(t, 12);
  std::map<std::string, TopologyNode> nodes;
  for (const TopologyNode& n : run.nodes) EXPECT_TRUE(nodes.emplace(n.id, n).second) << n.id;
  // The ranks' GPUs first, in rank order, each in its server.
  for (int r = 0; r < 12; ++r) {
    EXPECT_EQ(run.nodes[r].id, fmt::format("gpu{}", r));
    EXPECT_EQ(run.nodes[r].kind, "gpu");
    EXPECT_EQ(run.nodes[r].rank, r);
    EXPECT_EQ(run.nodes[r].host, r / 8);
  }
  EXPECT_FALSE(nodes.count("gpu12"));  // no rank ran there
  EXPECT_TRUE(nodes.count("nvswitch1"));
  EXPECT_TRUE(nodes.count("nic15"));  // the whole of a server that holds a rank, idle parts too
  EXPECT_FALSE(nodes.count("nvswitch2"));
  EXPECT_FALSE(nodes.count("nic16"));
  EXPECT_EQ(nodes.at("leaf7").host, -1);  // one leaf per rail serves all four nodes
  EXPECT_EQ(nodes.at("spine0").host, -1);
  // Rows: the fabric on top, then NICs, PCIe switches, GPUs, and the NVSwitches below.
  EXPECT_LT(nodes.at("spine0").level, nodes.at("leaf0").level);
  EXPECT_LT(nodes.at("leaf0").level, nodes.at("nic0").level);
  EXPECT_LT(nodes.at("nic0").level, nodes.at("pcie0").level);
  EXPECT_LT(nodes.at("pcie0").level, nodes.at("gpu0").level);
  EXPECT_LT(nodes.at("gpu0").level, nodes.at("nvswitch0").level);
  // NVLink and GPU-PCIe for 12 GPUs, both ways; PCIe-CPU, PCIe-NIC and NIC-leaf for two servers of 8; the
  // one spine to each of 8 leaves.
  EXPECT_EQ(run.links.size(), 12u * 2 * 2 + 2 * 8 * 2 * 3 + 8 * 2);
  for (const TopologyLink& l : run.links) {
    EXPECT_TRUE(nodes.count(l.from) && nodes.count(l.to)) << l.id;
    EXPECT_EQ(l.id, l.from + "->" + l.to);
    EXPECT_GT(l.bandwidth_gbps, 0) << l.id;
  }
}

TEST(RunTopology, EveryLinkThatCarriedBytesIsInIt) {
  SimBackend backend(testing::quiet_config(2));
  const RunReport r = backend.launch(16, [](Rank& rank) {
    Tensor t = rank.full({1 << 16}, 1.0f);
    rank.all_reduce(t, ReduceOp::Sum);
    rank.synchronize();
  });
  std::set<std::string> ids;
  for (const TopologyLink& l : r.topology.links) ids.insert(l.id);
  ASSERT_FALSE(r.links.empty());
  for (const LinkTraffic& l : r.links) EXPECT_TRUE(ids.count(l.link)) << l.link;
  EXPECT_EQ(r.topology.nodes.front().id, "gpu0");
}

TEST(Topology, PcieWorkstationHasNoNvlink) {
  const Topology t(profile("pcie-4gpu", 2));
  EXPECT_FALSE(t.has_nvlink());
  EXPECT_EQ(t.nics_per_node(), 1);
  EXPECT_EQ(t.nic_of(3), 0);
  EXPECT_EQ(t.nic_of(5), 1);
  // One PCIe switch holds all four cards: GPU -> switch -> GPU.
  const std::vector<LinkId> p = path(t, 0, 3);
  EXPECT_EQ(names(t, p), (std::vector<std::string>{"gpu0->pcie0", "pcie0->gpu3"}));
  for (LinkId l : p) {
    EXPECT_EQ(t.tier(l), Tier::PCIe);
    EXPECT_DOUBLE_EQ(t.capacity_gbps(l), 31.5 * 0.76);
  }
  // Between nodes through the one NIC of each and a shared leaf.
  EXPECT_EQ(names(t, path(t, 2, 7)), (std::vector<std::string>{"gpu2->pcie0", "pcie0->nic0", "nic0->leaf0",
                                                               "leaf0->nic1", "nic1->pcie1", "pcie1->gpu7"}));
}

TEST(Topology, PathsBetweenNodesStayOnTheirRail) {
  const Topology t(profile("dgx-h100", 4));
  EXPECT_EQ(t.gpus(), 32);
  ASSERT_TRUE(t.has_fabric());
  EXPECT_EQ(t.nodes_per_leaf(), 4);  // one leaf per rail holds all four nodes
  EXPECT_EQ(t.leaves(), 8);
  EXPECT_EQ(t.fabric_tiers(), 2);
  // GPU 3 of node 0 to GPU 3 of node 2: rail 3, one leaf.
  const std::vector<LinkId> same_rail = path(t, 3, 19);
  EXPECT_EQ(names(t, same_rail),
            (std::vector<std::string>{"gpu3->pcie3", "pcie3->nic3", "nic3->leaf3", "leaf3->nic19",
                                      "nic19->pcie19", "pcie19->gpu19"}));
  EXPECT_EQ(t.switch_hops(3, 19), 1);
  // Changing rails means going through a spine.
  const std::vector<LinkId> cross = path(t, 3, 20);
  ASSERT_EQ(cross.size(), 8u);
  EXPECT_EQ(t.link_name(cross[3]).rfind("leaf3->spine", 0), 0u);
  EXPECT_EQ(t.link_name(cross[5]), "leaf4->nic20");
  EXPECT_EQ(t.switch_hops(3, 20), 3);
  EXPECT_EQ(t.tier(cross[2]), Tier::Network);
  EXPECT_EQ(t.tier(cross[1]), Tier::PCIe);
  EXPECT_DOUBLE_EQ(t.capacity_gbps(cross[2]), 50.0 * 0.94);
  // The hardware latency: PCIe hops, the NIC, the leaf, a spine and back.
  EXPECT_NEAR(t.path_latency_us(cross), 4 * 0.5 + 2 * 0.6 + 3 * 0.13, 1e-12);
}

TEST(Topology, FatTreeSizedForTheCluster) {
  // 128 DGX H100: 32 nodes per 64-port leaf, 4 leaves per rail, 32 leaves, 16 spines of 64 ports.
  const Topology t(profile("dgx-h100", 128));
  EXPECT_EQ(t.nodes_per_leaf(), 32);
  EXPECT_EQ(t.leaves(), 32);
  EXPECT_EQ(t.spines(), 16);
  EXPECT_EQ(t.uplinks_per_leaf(), 32);
  EXPECT_EQ(t.fabric_tiers(), 2);
  // Each leaf's 32 uplinks of 50 GB/s are spread over 16 spines: 100 GB/s per leaf-spine link.
  std::vector<LinkId> p = path(t, 0, 1023);  // node 0 rail 0 to node 127 rail 7
  ASSERT_EQ(p.size(), 8u);
  EXPECT_DOUBLE_EQ(t.link(p[3]).line_rate_gbps, 100.0);
  EXPECT_EQ(t.link_name(p[2]), "nic0->leaf0");
  EXPECT_EQ(t.link_name(p[5]), "leaf31->nic1023");

  // 2,048 nodes need more leaves than a spine has ports: the spine links stand for a core tier too.
  const Topology big(profile("dgx-h100", 2048));
  EXPECT_EQ(big.gpus(), 16384);
  EXPECT_EQ(big.fabric_tiers(), 3);
  EXPECT_EQ(big.switch_hops(0, 16383), 5);
  // Nothing per GPU is stored: the last link has a name like any other.
  EXPECT_EQ(big.link_name(static_cast<LinkId>(big.link_count() - 1)).rfind("spine", 0), 0u);
}

// Connections between NICs of one rail (rings, trees, and with PXN every message between nodes) spread
// over every spine, whatever the spine count: a hash whose modulo kept only its low bits put all of them
// on 2 of 16 spines.
TEST(Topology, EcmpSpreadsOneRailsConnectionsOverTheSpines) {
  for (const int radix : {64, 56, 48}) {
    // 128 DGX H100: leaves of radix / 2 nodes, so 4, 5 and 6 leaves per rail on 16, 20 and 24 spines.
    Profile p = profile("dgx-h100", 128);
    p.fabric.switch_radix = radix;
    const Topology t(p);
    ASSERT_EQ(t.fabric_tiers(), 2);
    ASSERT_GT(t.spines(), 1);
    ASSERT_GT(t.leaves() / t.nics_per_node(), 1);
    for (const int rail : {0, 5}) {
      std::vector<int> per_spine(t.spines(), 0);
      int pairs = 0;
      for (int a = 0; a < t.nodes(); ++a) {
        for (int b = 0; b < t.nodes(); ++b) {
          const int src = a * t.nics_per_node() + rail, dst = b * t.nics_per_node() + rail;
          if (t.leaf_of_nic(src) == t.leaf_of_nic(dst)) continue;
          // The route takes the hashed spine: GPU, PCIe, NIC, leaf, then leaf -> spine.
          const std::vector<LinkId> route = path(t, a * 8 + rail, b * 8 + rail);
          ASSERT_EQ(route.size(), 8u);
          const int spine = t.ecmp_spine(src, dst);
          ASSERT_EQ(route[3], t.leaf_to_spine(t.leaf_of_nic(src), spine));
          ++per_spine[spine];
          ++pairs;
        }
      }
      const double mean = static_cast<double>(pairs) / t.spines();
      for (int s = 0; s < t.spines(); ++s) {
        EXPECT_GT(per_spine[s], 0.75 * mean) << "radix " << radix << " rail " << rail << " spine " << s;
        EXPECT_LT(per_spine[s], 1.25 * mean) << "radix " << radix << " rail " << rail << " spine " << s;
      }
    }
  }
  // The two directions of a pair are two connections, hashed apart.
  const Topology t(profile("dgx-h100", 128));
  int differ = 0;
  for (int n = 32; n < 128; ++n) differ += t.ecmp_spine(0, n * 8) != t.ecmp_spine(n * 8, 0);
  EXPECT_GT(differ, 0);
}

TEST(Topology, OversubscribedLeaves) {
  Profile p = profile("dgx-h100", 64);
  p.fabric.oversubscription = 3;  // 48 ports down, 16 up
  const Topology t(p);
  EXPECT_EQ(t.nodes_per_leaf(), 48);
  EXPECT_EQ(t.uplinks_per_leaf(), 16);
}

// Nodes times GPUs past an int is refused with the product, not wrapped into a topology of no links.
TEST(Topology, MoreGpusThanAWorldHoldsIsRefused) {
  try {
    Topology t(profile("dgx-h100", 300'000'000));
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("300000000 nodes x 8 GPUs per node (dgx-h100) = 2400000000 GPUs"),
              std::string::npos)
        << e.what();
  }
}

TEST(Topology, Nvl72IsOneNvlinkDomain) {
  const Topology t(profile("gb200-nvl72"));
  EXPECT_EQ(t.gpus(), 72);
  EXPECT_EQ(names(t, path(t, 0, 71)), (std::vector<std::string>{"gpu0->nvswitch0", "nvswitch0->gpu71"}));
  EXPECT_DOUBLE_EQ(t.link(t.gpu_to_nvswitch(0)).line_rate_gbps, 900.0);
}

TEST(Topology, DoubleBinaryTree) {
  for (int count = 1; count <= 64; ++count) {
    SCOPED_TRACE(count);
    for (int tree = 0; tree < 2; ++tree) {
      // One root, and every index reaches it without a cycle.
      int roots = 0;
      for (int k = 0; k < count; ++k) {
        int hops = 0;
        for (int at = k; dtree_parent(at, count, tree) >= 0; at = dtree_parent(at, count, tree)) {
          ASSERT_LT(dtree_parent(at, count, tree), count);
          ASSERT_LT(++hops, count);
        }
        roots += dtree_parent(k, count, tree) < 0;
      }
      EXPECT_EQ(roots, 1);
    }
    if (count % 2 == 0 && count > 2) {
      // Every index is a leaf in exactly one of the two trees, so every node sends and receives
      // about the same amount in total: the point of two trees.
      std::vector<int> children[2] = {std::vector<int>(count), std::vector<int>(count)};
      for (int tree = 0; tree < 2; ++tree) {
        for (int k = 0; k < count; ++k) {
          const int p = dtree_parent(k, count, tree);
          if (p >= 0) ++children[tree][p];
        }
      }
      for (int k = 0; k < count; ++k) EXPECT_EQ((children[0][k] == 0) + (children[1][k] == 0), 1) << k;
    }
  }
}

}  // namespace
}  // namespace ranklab::sim
