// The network model: the max-min rate solver, the bytes every algorithm puts on every link (worked out by
// hand), NCCL's choice of algorithm and protocol, bandwidth sharing, and the published numbers the model
// must reproduce (docs/validation.md).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "sim/net/max_min.h"
#include "sim/net/network_model.h"
#include "sim/net/transfer_engine.h"
#include "sim_fixture.h"

namespace ranklab::sim {
namespace {

Profile profile(const std::string& name, int nodes = 1) {
  Profile p = load_profile(name);
  p.nodes = nodes;
  return p;
}

using testing::first;

// Per-link bytes after recording one plan, by link name.
std::map<std::string, double> traffic(NetworkModel& m, const CommPlan& plan) {
  m.record(plan);
  std::map<std::string, double> out;
  for (const LinkTraffic& t : m.link_traffic()) out[t.link] = static_cast<double>(t.bytes);
  return out;
}

double busbw_gbps(CommOp op, double bytes, int n, double time_us) {
  return bytes / (time_us * 1e3) * bus_factor(op, n);
}

// ---- the rate solver -------------------------------------------------------------------------------

TEST(MaxMin, TwoFlowsOnOneLinkGetHalfEach) {
  FlowNetwork net;
  const std::uint32_t l = net.add_link(100);
  net.add_flow(std::vector<std::uint32_t>{l});
  net.add_flow(std::vector<std::uint32_t>{l});
  EXPECT_EQ(max_min_rates(net), (std::vector<double>{50, 50}));
}

TEST(MaxMin, DisjointFlowsGetTheirWholeLink) {
  FlowNetwork net;
  const std::uint32_t a = net.add_link(100), b = net.add_link(40);
  net.add_flow(std::vector<std::uint32_t>{a});
  net.add_flow(std::vector<std::uint32_t>{b});
  EXPECT_EQ(max_min_rates(net), (std::vector<double>{100, 40}));
}

TEST(MaxMin, AFlowHeldBackElsewhereLeavesTheRestToOthers) {
  // Flow 0 crosses a 10 GB/s link and a 100 GB/s one; flow 1 only the 100. Flow 0 is stuck at 10, and
  // max-min gives flow 1 everything else rather than an "equal" 50.
  FlowNetwork net;
  const std::uint32_t narrow = net.add_link(10), wide = net.add_link(100);
  net.add_flow(std::vector<std::uint32_t>{narrow, wide});
  net.add_flow(std::vector<std::uint32_t>{wide});
  const std::vector<double> r = max_min_rates(net);
  EXPECT_DOUBLE_EQ(r[0], 10);
  EXPECT_DOUBLE_EQ(r[1], 90);
}

TEST(MaxMin, TheTextbookExample) {
  // Bertsekas & Gallager's kind of example: links of 1 and 2; flow 0 crosses both, flow 1 the first,
  // flow 2 the second. The first link is the bottleneck of flows 0 and 1 (1/2 each); flow 2 gets 2 - 1/2.
  FlowNetwork net;
  const std::uint32_t a = net.add_link(1), b = net.add_link(2);
  net.add_flow(std::vector<std::uint32_t>{a, b});
  net.add_flow(std::vector<std::uint32_t>{a});
  net.add_flow(std::vector<std::uint32_t>{b});
  EXPECT_EQ(max_min_rates(net), (std::vector<double>{0.5, 0.5, 1.5}));
}

TEST(MaxMin, InactiveAndLinklessFlows) {
  FlowNetwork net;
  const std::uint32_t l = net.add_link(90);
  for (int i = 0; i < 3; ++i) net.add_flow(std::vector<std::uint32_t>{l});
  net.add_flow(std::vector<std::uint32_t>{});
  const std::vector<bool> active = {true, false, true, true};
  const std::vector<double> r = max_min_rates(net, &active);
  EXPECT_DOUBLE_EQ(r[0], 45);
  EXPECT_DOUBLE_EQ(r[1], 0);
  EXPECT_DOUBLE_EQ(r[2], 45);
  EXPECT_EQ(r[3], std::numeric_limits<double>::infinity());
}

TEST(MaxMin, FluidFinishTimesReshareWhenAFlowEnds) {
  // 1,000 and 2,000 bytes on one 1 GB/s link (1,000 bytes per microsecond): both at half rate until the
  // first is done at 2 us, then the second alone: 1,000 bytes left, done at 3 us.
  FlowNetwork net;
  const std::uint32_t l = net.add_link(1);
  net.add_flow(std::vector<std::uint32_t>{l});
  net.add_flow(std::vector<std::uint32_t>{l});
  const std::vector<double> bytes = {1000, 2000};
  const std::vector<double> t = fluid_finish_us(net, bytes);
  EXPECT_DOUBLE_EQ(t[0], 2);
  EXPECT_DOUBLE_EQ(t[1], 3);
}

// ---- bytes per link, by hand ---------------------------------------------------------------------

class RingBytes : public ::testing::Test {
 protected:
  // Four GPUs of one DGX H100, NCCL forced to the ring as NCCL_ALGO=Ring would.
  NetworkModel model{profile("dgx-h100"), NetworkOptions{"ring", "simple"}};
  const std::int64_t s = 1 << 20;  // 1 MiB, the nccl-tests size
  const std::vector<int> ranks = first(4);
};

TEST_F(RingBytes, AllReduce) {
  // Reduce-scatter then all-gather: 2(n-1) = 6 steps of S/n = 1/4 MiB over every ring edge, and every edge
  // is one GPU's NVLink up to the switch and another's down from it.
  const CommPlan plan = model.plan_collective(CommOp::AllReduce, s, ranks, -1);
  EXPECT_EQ(plan.name(), "ring/simple");
  const auto t = traffic(model, plan);
  EXPECT_EQ(t.size(), 8u);
  for (int g = 0; g < 4; ++g) {
    EXPECT_DOUBLE_EQ(t.at("gpu" + std::to_string(g) + "->nvswitch0"), 6 * s / 4.0);
    EXPECT_DOUBLE_EQ(t.at("nvswitch0->gpu" + std::to_string(g)), 6 * s / 4.0);
  }
}

TEST_F(RingBytes, AllGatherAndReduceScatter) {
  // n-1 = 3 steps of S/n: three quarters of S on every edge. S is the whole gathered (or scattered) buffer.
  for (CommOp op : {CommOp::AllGather, CommOp::ReduceScatter}) {
    NetworkModel m(profile("dgx-h100"), NetworkOptions{"ring", ""});
    const auto t = traffic(m, m.plan_collective(op, s, ranks, -1));
    for (int g = 0; g < 4; ++g) {
      EXPECT_DOUBLE_EQ(t.at("gpu" + std::to_string(g) + "->nvswitch0"), 3 * s / 4.0) << comm_op_name(op);
      EXPECT_DOUBLE_EQ(t.at("nvswitch0->gpu" + std::to_string(g)), 3 * s / 4.0) << comm_op_name(op);
    }
  }
}

TEST_F(RingBytes, Broadcast) {
  // A pipelined chain 0 -> 1 -> 2 -> 3: every GPU but the last forwards all of S; nothing returns to 0.
  const auto t = traffic(model, model.plan_collective(CommOp::Broadcast, s, ranks, 0));
  EXPECT_EQ(t.size(), 6u);
  for (int g : {0, 1, 2}) EXPECT_DOUBLE_EQ(t.at("gpu" + std::to_string(g) + "->nvswitch0"), s);
  for (int g : {1, 2, 3}) EXPECT_DOUBLE_EQ(t.at("nvswitch0->gpu" + std::to_string(g)), s);
  EXPECT_EQ(t.count("gpu3->nvswitch0"), 0u);
  EXPECT_EQ(t.count("nvswitch0->gpu0"), 0u);
}

TEST(LinkBytes, RingAcrossTwoPcieNodes) {
  // Two pcie-4gpu nodes, one NIC each, so one ring (one channel): 0 1 2 3 | 7 4 5 6, entering node 1 at
  // GPU 7 and leaving from GPU 6. all_reduce over 8 ranks puts 2(8-1)/8 = 1.75 S on every edge.
  NetworkModel m(profile("pcie-4gpu", 2), NetworkOptions{"ring", ""});
  const double s = 1 << 20;
  const CommPlan plan = m.plan_collective(CommOp::AllReduce, 1 << 20, first(8), -1);
  const auto t = traffic(m, plan);
  const double edge = 1.75 * s;
  // Out of node 0 from GPU 3 and out of node 1 from GPU 6: each NIC sends one edge and receives one.
  for (const char* l : {"nic0->leaf0", "leaf0->nic1", "nic1->leaf0", "leaf0->nic0"})
    EXPECT_DOUBLE_EQ(t.at(l), edge) << l;
  EXPECT_DOUBLE_EQ(t.at("pcie0->nic0"), edge);
  EXPECT_DOUBLE_EQ(t.at("gpu3->pcie0"), edge);
  EXPECT_DOUBLE_EQ(t.at("pcie1->gpu7"), edge);
  // Per tier: 2 network edges x 2 fabric links; 6 edges inside nodes x 2 PCIe links + 2 network edges x 4.
  std::map<std::string, double> tiers;
  for (const LinkTraffic& l : m.link_traffic()) tiers[l.tier] += static_cast<double>(l.bytes);
  EXPECT_DOUBLE_EQ(tiers["network"], 4 * edge);
  EXPECT_DOUBLE_EQ(tiers["pcie"], 20 * edge);
  EXPECT_EQ(tiers.count("nvlink"), 0u);
}

TEST(LinkBytes, NvlsAndPairwise) {
  NetworkModel m(profile("dgx-h100"), NetworkOptions{"nvls", ""});
  const double s = 1 << 20;
  // NVLS all_reduce: S (1 + 1/n) each way on every GPU's NVLink.
  const auto t = traffic(m, m.plan_collective(CommOp::AllReduce, 1 << 20, first(8), -1));
  EXPECT_DOUBLE_EQ(t.at("gpu5->nvswitch0"), s * 9 / 8);
  EXPECT_DOUBLE_EQ(t.at("nvswitch0->gpu5"), s * 9 / 8);
  // all_to_all: every GPU sends S/n to each of the n-1 others.
  NetworkModel a(profile("dgx-h100"));
  const CommPlan plan = a.plan_collective(CommOp::AllToAll, 1 << 20, first(4), -1);
  EXPECT_EQ(plan.algorithm, Algorithm::Pairwise);
  const auto u = traffic(a, plan);
  EXPECT_DOUBLE_EQ(u.at("gpu0->nvswitch0"), 3 * s / 4);
  EXPECT_DOUBLE_EQ(u.at("nvswitch0->gpu3"), 3 * s / 4);
}

TEST(LinkBytes, AllToAllIsOneFlowPerPairOnItsPath) {
  // 8x H100, S = 8 MiB: every GPU sends S/8 to each of the 7 others, each pair its own flow over its two
  // NVLink links. Every link carries 7 S/8, the per-link loads of the plan that kept one flow per link.
  NetworkModel m(profile("dgx-h100"));
  const double s = 8 << 20;
  const CommPlan plan = m.plan_collective(CommOp::AllToAll, 8 << 20, first(8), -1);
  ASSERT_EQ(plan.flows.size(), 8u * 7u);
  const Topology& topo = m.topology();
  std::size_t f = 0;
  for (int src = 0; src < 8; ++src) {
    for (int dst = 0; dst < 8; ++dst) {
      if (src == dst) continue;
      const std::span<const LinkId> path = plan.path(plan.flows[f]);
      ASSERT_EQ(path.size(), 2u);
      EXPECT_EQ(path[0], topo.gpu_to_nvswitch(src));
      EXPECT_EQ(path[1], topo.nvswitch_to_gpu(dst));
      EXPECT_EQ(plan.payload_bytes(plan.flows[f]), s / 8);
      ++f;
    }
  }
  const auto t = traffic(m, plan);
  for (const auto& [link, bytes] : t) EXPECT_EQ(bytes, 7 * s / 8) << link;
  EXPECT_EQ(t.size(), 16u);
  // Alone: 7 S/8 over NVLink's sustained 450 x 0.824 GB/s (Simple), through NCCL's point-to-point
  // pipeline: each peer's 1 MiB goes as 4 pieces of 256 KiB (4 channels a peer on 8 ranks), one 512 KiB
  // step each, copied into the peer's buffer and out of it: twice the bandwidth time.
  EXPECT_EQ(plan.protocol, Protocol::Simple);
  const P2pLaunch piece = nccl_p2p_launch(nccl_p2p_comm(layout_group(topo, first(8)).shape), s / 8);
  EXPECT_EQ(piece.parts, 4);
  EXPECT_EQ(piece.part_bytes, 256 * 1024);
  EXPECT_EQ(piece.steps, 1);
  EXPECT_DOUBLE_EQ(plan.transfer_us, 2 * 7 * s / 8 / (450 * 0.824 * 1e3));
}

TEST(Sharing, AnAllToAllSharesALinkAsOneFlowPerPair) {
  // An all_to_all over GPUs 0-3 and a send from GPU 0 to GPU 1 at once. gpu0->nvswitch0 carries the
  // all_to_all's three messages from GPU 0 and the send; nvswitch0->gpu1 its three messages to GPU 1 and
  // the send. Max-min gives each of the four flows a quarter of the link: the send gets 370.8 / 4 GB/s
  // (one flow per link would have given it half).
  NetworkModel m(profile("dgx-h100"));
  const CommPlan a2a = m.plan_collective(CommOp::AllToAll, 64 << 20, first(4), -1);
  const CommPlan send = m.plan_p2p(0, 1, 64 << 20);
  const PlanFlows pf = plan_flows(m.topology(), {&a2a, &send});
  const std::vector<double> rates = max_min_rates(pf.network);
  EXPECT_DOUBLE_EQ(rates[pf.first_flow[1]], 450 * 0.824 / 4);
  // The all_to_all's flow from GPU 1 to GPU 0 (its fourth) shares both its links with two others of its
  // own and none with the send: a third.
  EXPECT_DOUBLE_EQ(rates[pf.first_flow[0] + 3], 450 * 0.824 / 3);
}

TEST(LinkBytes, UnevenAllToAllPutsEachPairsBytesOnItsPath) {
  // Two nodes of 8: rank 0 sends 3 MiB to rank 1 (NVLink) and 1 MiB to rank 9 (the network); rank 9 sends
  // 2 MiB to rank 0. Everyone else sends nothing.
  NetworkModel m(profile("dgx-h100", 2));
  const std::vector<int> ranks = {0, 1, 9};
  const std::int64_t mib = 1 << 20;
  const std::vector<std::int64_t> pairs = {0, 3 * mib, mib, 0, 0, 0, 2 * mib, 0, 0};
  const CommPlan plan = m.plan_all_to_all(ranks, pairs);
  EXPECT_EQ(plan.algorithm, Algorithm::Pairwise);
  EXPECT_EQ(plan.flows.size(), 3u);  // one per pair that moves anything
  EXPECT_EQ(plan.protocol, Protocol::Simple);
  const auto t = traffic(m, plan);
  // 0 -> 9 goes by PXN: rank 9 is GPU 1 of its node, so rank 0 hands it over NVLink to rank 1, whose NIC
  // is on rail 1, rank 9's rail: it stays under leaf 1. Rank 9 has no member of the group on its node
  // with GPU 0's index, so 9 -> 0 leaves through its own NIC and crosses the spine to rail 0.
  EXPECT_DOUBLE_EQ(t.at("gpu0->nvswitch0"), 4.0 * mib);  // 3 MiB to rank 1, 1 MiB on its way to rank 9
  EXPECT_DOUBLE_EQ(t.at("nvswitch0->gpu1"), 4.0 * mib);
  EXPECT_DOUBLE_EQ(t.at("nic1->leaf1"), 1.0 * mib);  // 0 -> 9
  EXPECT_EQ(t.count("nic0->leaf0"), 0u);
  EXPECT_DOUBLE_EQ(t.at("nic9->leaf1"), 2.0 * mib);  // 9 -> 0
  EXPECT_DOUBLE_EQ(t.at("spine0->leaf0"), 2.0 * mib);
  EXPECT_EQ(t.count("spine0->leaf1"), 0u);
  // Alone on the machine the flows share no link but rank 0's own, so the slowest pair's path sets the time:
  // max-min sharing as the engine runs it.
  EXPECT_NEAR(plan.transfer_us, fluid_transfer_us(m.topology(), plan), 1e-9 * plan.transfer_us);
  EXPECT_GT(plan.latency_us, 0);
}

TEST(LinkBytes, AnAllToAllWithEqualPairsIsTheEvenOne) {
  NetworkModel m(profile("dgx-h100", 2));
  const std::vector<int> all = first(16);
  for (const std::int64_t piece : {std::int64_t{1000}, std::int64_t{1} << 22}) {
    std::vector<std::int64_t> pairs(16 * 16, piece);
    const CommPlan even = m.plan_collective(CommOp::AllToAll, piece * 16, all, -1);
    const CommPlan split = m.plan_all_to_all(all, pairs);
    EXPECT_EQ(duration_us(split), duration_us(even));
    EXPECT_EQ(split.protocol, even.protocol);
    // The same loads as n^2 flows of their own: the same time under max-min sharing.
    pairs[1] += 1;  // no longer equal: built pair by pair
    const CommPlan per_pair = m.plan_all_to_all(all, pairs);
    EXPECT_EQ(per_pair.flows.size(), 16u * 15u);
    EXPECT_NEAR(per_pair.transfer_us, even.transfer_us, 1e-3 * even.transfer_us) << piece;
    EXPECT_EQ(per_pair.latency_us, even.latency_us);
  }
}

// ---- PXN: sends between nodes leave on the receiver's rail ---------------------------------------------

NetworkOptions without_pxn() {
  NetworkOptions o;
  o.pxn = false;  // NCCL_PXN_DISABLE=1
  return o;
}

double spine_bytes(const std::map<std::string, double>& t) {
  double sum = 0;
  for (const auto& [link, bytes] : t) {
    if (link.find("spine") != std::string::npos) sum += bytes;
  }
  return sum;
}

TEST(Pxn, AllToAllOnTwoNodesByHand) {
  // 2 x 8 H100, all_to_all of S = 16 MiB: 1 MiB from every GPU to each of the 15 others. Rail k's leaf
  // holds NIC k of both nodes; one spine joins the leaves.
  const double mib = 1 << 20, s = 16 * mib;
  NetworkModel on(profile("dgx-h100", 2)), off(profile("dgx-h100", 2), without_pxn());
  const CommPlan with = on.plan_collective(CommOp::AllToAll, 16 << 20, first(16), -1);
  const CommPlan without = off.plan_collective(CommOp::AllToAll, 16 << 20, first(16), -1);
  ASSERT_EQ(with.flows.size(), 16u * 15u);
  ASSERT_EQ(without.flows.size(), 16u * 15u);
  const auto a = traffic(on, with), b = traffic(off, without);
  // Each NIC sends 8 MiB either way: without PXN GPU k's own messages to node 1, with PXN every message
  // of node 0 to GPU k of node 1. Each PCIe link from GPU to switch carries the same.
  for (const char* l : {"nic0->leaf0", "nic5->leaf5", "leaf5->nic13", "gpu5->pcie5", "pcie13->gpu13"}) {
    EXPECT_EQ(a.at(l), s / 2) << l;
    EXPECT_EQ(b.at(l), s / 2) << l;
  }
  // NVLink: 7 MiB to the other GPUs of the node; with PXN also the 7 MiB a GPU hands to the 7 others on
  // their way to their rails (out), and the 7 MiB the others hand it for its rail (in).
  for (const char* l : {"gpu0->nvswitch0", "nvswitch0->gpu5", "gpu13->nvswitch1"}) {
    EXPECT_EQ(a.at(l), 14 * mib) << l;
    EXPECT_EQ(b.at(l), 7 * mib) << l;
  }
  // The spine: without PXN every message between GPUs of different indices crosses it, 7 of each GPU's 8
  // messages to the other node, 2 x 8 x 7 MiB up and as much down; with PXN none.
  EXPECT_EQ(spine_bytes(b), 2 * 2 * 8 * 7 * mib);
  EXPECT_EQ(spine_bytes(a), 0);
  // Alone on the machine: the NICs are the busiest links either way, 8 MiB at 50 x 0.94 GB/s (the spine
  // link, 2 x 50 x 0.94 GB/s, carries 14 MiB without PXN). Across nodes NCCL gives a peer 2 channels and
  // 128 KiB steps: each 1 MiB message goes as 2 pieces of 4 steps, 5/4 of their bandwidth time with the
  // pipeline's fill. PXN adds its NVLink hop, 2 x 0.3 us.
  EXPECT_EQ(with.protocol, Protocol::Simple);
  const P2pLaunch piece = nccl_p2p_launch(nccl_p2p_comm(layout_group(on.topology(), first(16)).shape), mib);
  EXPECT_EQ(piece.parts, 2);
  EXPECT_EQ(piece.steps, 4);
  EXPECT_DOUBLE_EQ(with.transfer_us, 1.25 * s / 2 / (50 * 0.94 * 1e3));
  EXPECT_EQ(with.transfer_us, without.transfer_us);
  EXPECT_EQ(with.latency_us, without.latency_us + 0.3 + 0.3);
  EXPECT_NEAR(fluid_transfer_us(on.topology(), with), with.transfer_us, 1e-9 * with.transfer_us);
}

TEST(Pxn, KeepsAllToAllOnItsRailAndOffTheSpine) {
  // `ranklab topo --profile dgx-h100 --nodes 4`: a leaf per rail, 4 nodes under it, one spine. With PXN an
  // all_to_all's messages leave on the receiver's rail and never reach the spine.
  NetworkModel on(profile("dgx-h100", 4)), off(profile("dgx-h100", 4), without_pxn());
  const CommPlan with = on.plan_collective(CommOp::AllToAll, 32 << 20, first(32), -1);
  for (const Flow& f : with.flows) {
    for (LinkId l : with.path(f)) ASSERT_FALSE(on.topology().is_spine_link(l)) << on.topology().link_name(l);
  }
  const auto b = traffic(off, off.plan_collective(CommOp::AllToAll, 32 << 20, first(32), -1));
  // Without: 32 GPUs x 3 other nodes x 7 GPUs of other indices, 1 MiB each, up and down.
  EXPECT_EQ(spine_bytes(b), 2.0 * 32 * 3 * 7 * (1 << 20));
}

TEST(Pxn, ChangesNothingInsideANode) {
  // One node: the plan with PXN is the plan without, flow for flow.
  NetworkModel on(profile("dgx-h100")), off(profile("dgx-h100"), without_pxn());
  const CommPlan a = on.plan_collective(CommOp::AllToAll, 8 << 20, first(8), -1);
  const CommPlan b = off.plan_collective(CommOp::AllToAll, 8 << 20, first(8), -1);
  EXPECT_EQ(a.links, b.links);
  ASSERT_EQ(a.flows.size(), b.flows.size());
  for (std::size_t i = 0; i < a.flows.size(); ++i) EXPECT_EQ(a.bytes(a.flows[i]), b.bytes(b.flows[i]));
  EXPECT_EQ(a.latency_us, b.latency_us);
  EXPECT_EQ(a.transfer_us, b.transfer_us);
}

TEST(Pxn, NeedsNvlink) {
  // PCIe-only nodes: no GPU relays another's messages (NCCL's PXN wants PATH_NVL between them).
  NetworkModel on(profile("pcie-4gpu", 2)), off(profile("pcie-4gpu", 2), without_pxn());
  const CommPlan a = on.plan_collective(CommOp::AllToAll, 8 << 20, first(8), -1);
  const CommPlan b = off.plan_collective(CommOp::AllToAll, 8 << 20, first(8), -1);
  EXPECT_EQ(a.links, b.links);
  EXPECT_EQ(duration_us(a), duration_us(b));
}

TEST(Pxn, AnUnevenAllToAllPutsTheHeavyPairOnItsRail) {
  // 2 x 8 H100: every pair sends 1 KiB, but rank 0 sends 64 MiB to rank 13 (GPU 5 of node 1). The heavy
  // message crosses to GPU 5 over NVLink and leaves through NIC 5 with the 7 KiB the other GPUs of node 0
  // send to rank 13; NIC 0 carries only the 8 KiB bound for rank 8.
  NetworkModel m(profile("dgx-h100", 2));
  const double kib = 1024, heavy = 64 << 20;
  std::vector<std::int64_t> pairs(16 * 16, 1024);
  for (int i = 0; i < 16; ++i) pairs[i * 16 + i] = 0;
  pairs[0 * 16 + 13] = 64 << 20;
  const CommPlan plan = m.plan_all_to_all(first(16), pairs);
  ASSERT_EQ(plan.flows.size(), 16u * 15u);
  const Topology& topo = m.topology();
  const Flow& f = plan.flows[12];  // rank 0's 13th message: to rank 13
  EXPECT_EQ(plan.payload_bytes(f), heavy);
  const std::vector<LinkId> route(plan.path(f).begin(), plan.path(f).end());
  std::vector<std::string> names;
  for (LinkId l : route) names.push_back(topo.link_name(l));
  EXPECT_EQ(names,
            (std::vector<std::string>{"gpu0->nvswitch0", "nvswitch0->gpu5", "gpu5->pcie5", "pcie5->nic5",
                                      "nic5->leaf5", "leaf5->nic13", "nic13->pcie13", "pcie13->gpu13"}));
  const auto t = traffic(m, plan);
  EXPECT_EQ(t.at("nic5->leaf5"), heavy + 7 * kib);
  EXPECT_EQ(t.at("nic0->leaf0"), 8 * kib);
  // Alone: NIC 5 is busy to the end, with the heavy message (Simple: 2 pieces of 256 steps of 128 KiB,
  // 257/256 with the pipeline's fill) and seven of 1 KiB at LL's half efficiency (no fill): (64 MiB x
  // 257/256 + 7 x 2 KiB) at 47 GB/s.
  EXPECT_NEAR(plan.transfer_us, (heavy * 257 / 256 + 14 * kib) / (50 * 0.94 * 1e3), 1e-9 * plan.transfer_us);
}

TEST(Pxn, ScatterSpreadsOverTheRails) {
  // Scatter is grouped send/recv as well. 2 x 8 H100, S = 16 MiB from GPU 0: 1 MiB to each of the 15
  // others. With PXN the pieces for node 1 leave through the NIC of their rail, one each, handed over
  // NVLink: GPU 0's NVLink carries 7 MiB to node 0's GPUs and 7 MiB to relay, and is the busiest link
  // (14 MiB at 450 x 0.824 GB/s). Without PXN NIC 0 carries all 8 MiB (at 50 x 0.94 GB/s).
  NetworkModel on(profile("dgx-h100", 2)), off(profile("dgx-h100", 2), without_pxn());
  const CommPlan with = on.plan_collective(CommOp::Scatter, 16 << 20, first(16), 0);
  const CommPlan without = off.plan_collective(CommOp::Scatter, 16 << 20, first(16), 0);
  ASSERT_EQ(with.algorithm, Algorithm::Direct);
  const double mib = 1 << 20;
  const auto a = traffic(on, with), b = traffic(off, without);
  for (int k = 0; k < 8; ++k) EXPECT_EQ(a.at(fmt::format("nic{}->leaf{}", k, k)), mib) << k;
  EXPECT_EQ(a.at("gpu0->nvswitch0"), 14 * mib);
  EXPECT_EQ(b.at("nic0->leaf0"), 8 * mib);
  EXPECT_EQ(b.at("gpu0->nvswitch0"), 7 * mib);
  // Each 1 MiB piece goes as 2 parts of 4 steps of 128 KiB (across nodes): 5/4 with the pipeline's fill.
  EXPECT_DOUBLE_EQ(with.transfer_us, 1.25 * 14 * mib / (450 * 0.824 * 1e3));
  EXPECT_DOUBLE_EQ(without.transfer_us, 1.25 * 8 * mib / (50 * 0.94 * 1e3));
  EXPECT_EQ(with.latency_us, without.latency_us + 0.3 + 0.3);
}

TEST(Pxn, SendsBetweenNodesTooWithinTheWorld) {
  // A send from GPU 0 to GPU 9 (GPU 1 of node 1) goes over NVLink to GPU 1 and out of NIC 1.
  NetworkModel m(profile("dgx-h100", 2)), off(profile("dgx-h100", 2), without_pxn());
  const CommPlan send = m.plan_p2p(0, 9, 64 << 20), direct = off.plan_p2p(0, 9, 64 << 20);
  const auto t = traffic(m, send);
  EXPECT_EQ(t.at("gpu0->nvswitch0"), 64 << 20);
  EXPECT_EQ(t.at("nvswitch0->gpu1"), 64 << 20);
  EXPECT_EQ(t.at("nic1->leaf1"), 64 << 20);
  EXPECT_EQ(t.count("nic0->leaf0"), 0u);
  EXPECT_EQ(spine_bytes(t), 0);
  EXPECT_EQ(send.latency_us, direct.latency_us + 0.3 + 0.3);
  EXPECT_EQ(send.transfer_us, direct.transfer_us);  // the NIC is the bottleneck either way
  // In a world of 12 ranks node 1 holds GPUs 8-11 only: GPU 8 sending to GPU 5 has no GPU 13 in the
  // world to relay through, and uses its own NIC.
  NetworkModel twelve(profile("dgx-h100", 2));
  twelve.set_world_ranks(12);
  const auto u = traffic(twelve, twelve.plan_p2p(8, 5, 1 << 20));
  EXPECT_EQ(u.at("nic8->leaf0"), 1 << 20);
  EXPECT_EQ(u.count("gpu8->nvswitch1"), 0u);
  EXPECT_THROW(twelve.set_world_ranks(17), UsageError);
}

// The simulator's send from rank 8 to rank 5 on 2 x 8 H100: with 16 ranks GPU 13 relays it, with 12 (node 1
// holds ranks 8-11 only) it leaves through rank 8's own NIC. Returns the time rank 5 waits for it.
double simulated_send_us(int world) {
  auto times = ranklab::testing::run_collect<double>(
      world,
      [](Rank& r) {
        Tensor t = r.phantom({1 << 18});  // 1 MiB
        r.synchronize();
        const double t0 = r.now();
        if (r.rank() == 8) r.send(t, 5);
        if (r.rank() == 5) r.recv(t, 8);
        r.synchronize();
        return r.now() - t0;
      },
      2);
  return times[5];
}

TEST(Pxn, TheSimulatorRelaysSendsThroughTheWorldsGpusOnly) {
  NetworkModel sixteen(profile("dgx-h100", 2)), twelve(profile("dgx-h100", 2));
  twelve.set_world_ranks(12);
  const CommPlan relayed = sixteen.plan_p2p(8, 5, 1 << 20), own = twelve.plan_p2p(8, 5, 1 << 20);
  EXPECT_EQ(relayed.latency_us, own.latency_us + 0.3 + 0.3);
  EXPECT_EQ(relayed.transfer_us, own.transfer_us);
  // The simulated send takes the plan's time plus what both runs add alike (the kernel launches).
  EXPECT_NEAR(simulated_send_us(16) - simulated_send_us(12), 0.6, 1e-9);
}

TEST(LinkBytes, SendFollowsThePathBetweenTheGpus) {
  NetworkModel m(profile("dgx-h100", 2));
  const CommPlan inside = m.plan_p2p(1, 6, 1000);
  ASSERT_EQ(inside.flows.size(), 1u);
  EXPECT_EQ(inside.path(inside.flows[0]).size(), 2u);
  EXPECT_EQ(inside.protocol, Protocol::LL);  // up to 16 KiB, as NCCL_P2P_LL_THRESHOLD
  const CommPlan across = m.plan_p2p(1, 9, 64 << 20);
  EXPECT_EQ(across.protocol, Protocol::Simple);
  const auto t = traffic(m, across);
  EXPECT_DOUBLE_EQ(t.at("nic1->leaf1"), 64 << 20);
  EXPECT_DOUBLE_EQ(t.at("pcie9->gpu9"), 64 << 20);
  // 64 MiB through a 50 GB/s NIC at 94%: the NIC is the bottleneck. NCCL cuts it into 2 pieces of 256
  // steps of 128 KiB: 257/256 with the pipeline's fill.
  EXPECT_NEAR(across.transfer_us, (64 << 20) / (47.0 * 1e3) * 257 / 256, 1e-9);
}

TEST(LinkBytes, EveryPlanOfAGroupOfOneMovesNothing) {
  NetworkModel m(profile("dgx-h100"));
  const CommPlan plan = m.plan_collective(CommOp::AllReduce, 1 << 20, {3}, -1);
  EXPECT_EQ(plan.name(), "local");
  EXPECT_EQ(duration_us(plan), 0);
  EXPECT_TRUE(plan.flows.empty());
}

// ---- NCCL's choice -------------------------------------------------------------------------------

TEST(Choice, SmallMessagesTakeLowLatencyLargeOnesBandwidth) {
  NetworkModel m(profile("dgx-h100"));
  const std::vector<int> eight = first(8);
  const CommPlan tiny = m.plan_collective(CommOp::AllReduce, 8, eight, -1);
  EXPECT_EQ(tiny.protocol, Protocol::LL);
  EXPECT_GT(tiny.latency_us, 50 * tiny.transfer_us);  // latency-bound
  const CommPlan big = m.plan_collective(CommOp::AllReduce, std::int64_t{1} << 30, eight, -1);
  EXPECT_EQ(big.name(), "nvls/simple");             // in-switch reduction on Hopper
  EXPECT_GT(big.transfer_us, 50 * big.latency_us);  // bandwidth-bound
  // all_gather has no tree: LL for a few bytes, Simple for a gigabyte.
  EXPECT_EQ(m.plan_collective(CommOp::AllGather, 64, eight, -1).name(), "ring/ll");
  EXPECT_EQ(m.plan_collective(CommOp::AllGather, std::int64_t{1} << 30, eight, -1).name(), "ring/simple");

  // Across nodes small all_reduces take the tree (log-depth latency), large ones a bandwidth algorithm.
  NetworkModel c(profile("dgx-h100", 16));
  const std::vector<int> all = first(128);
  EXPECT_EQ(c.plan_collective(CommOp::AllReduce, 8, all, -1).name(), "tree/ll");
  const CommPlan large = c.plan_collective(CommOp::AllReduce, std::int64_t{4} << 30, all, -1);
  EXPECT_NE(large.protocol, Protocol::LL);
  EXPECT_GT(large.transfer_us, 10 * large.latency_us);

  // Without NVLink there is neither LL128 nor NVLS.
  NetworkModel w(profile("pcie-4gpu"));
  for (const Candidate& cand : w.candidates(CommOp::AllReduce, 1 << 20, first(4), -1)) {
    EXPECT_NE(cand.protocol, Protocol::LL128);
    EXPECT_NE(cand.algorithm, Algorithm::Nvls);
  }
}

TEST(Choice, ForcedAsNcclAlgoAndNcclProto) {
  NetworkModel m(profile("dgx-h100"), NetworkOptions{"Ring", "LL128"});
  EXPECT_EQ(m.plan_collective(CommOp::AllReduce, std::int64_t{1} << 30, first(8), -1).name(), "ring/ll128");
  // A forced algorithm an operation cannot use is ignored for it, as NCCL falls back.
  NetworkModel n(profile("dgx-h100"), NetworkOptions{"nvls", ""});
  EXPECT_EQ(n.plan_collective(CommOp::Broadcast, 1 << 20, first(8), 0).algorithm, Algorithm::Ring);
  EXPECT_THROW(NetworkModel(profile("dgx-h100"), NetworkOptions{"rings", ""}), ranklab::UsageError);
  EXPECT_THROW(NetworkModel(profile("dgx-h100"), NetworkOptions{"", "ll64"}), ranklab::UsageError);
}

TEST(Choice, LatencyScaleChangesTheLatencyNotThePick) {
  // NCCL picks with its predicted latencies; nccl.latency_scale is how the machine's real ones differ.
  Profile slow = profile("dgx-h100", 2);
  slow.nccl.latency_scale = 3;
  NetworkModel base(profile("dgx-h100", 2)), scaled(slow);
  const std::vector<int> all = first(16);
  for (std::int64_t bytes : {std::int64_t{8}, std::int64_t{1} << 16, std::int64_t{1} << 22}) {
    SCOPED_TRACE(bytes);
    for (CommOp op : {CommOp::AllReduce, CommOp::AllGather, CommOp::Broadcast}) {
      const int root = op == CommOp::Broadcast ? 0 : -1;
      const CommPlan a = base.plan_collective(op, bytes, all, root);
      const CommPlan b = scaled.plan_collective(op, bytes, all, root);
      EXPECT_EQ(a.name(), b.name());
      EXPECT_DOUBLE_EQ(b.latency_us, 3 * a.latency_us);
      EXPECT_DOUBLE_EQ(b.transfer_us, a.transfer_us);
    }
    // An uneven all_to_all inside a node (no relay, so its whole latency is NCCL's).
    std::vector<std::int64_t> pairs(64, bytes);
    pairs[1] = 3 * bytes;
    const CommPlan u = base.plan_all_to_all(first(8), pairs), v = scaled.plan_all_to_all(first(8), pairs);
    EXPECT_DOUBLE_EQ(v.latency_us, 3 * u.latency_us);
    EXPECT_DOUBLE_EQ(v.transfer_us, u.transfer_us);
    // Point-to-point inside a node and across nodes.
    for (int dst : {1, 8}) {
      const CommPlan a = base.plan_p2p(0, dst, bytes), b = scaled.plan_p2p(0, dst, bytes);
      EXPECT_EQ(a.protocol, b.protocol);
      EXPECT_DOUBLE_EQ(b.latency_us, 3 * a.latency_us);
      EXPECT_DOUBLE_EQ(b.transfer_us, a.transfer_us);
    }
  }
}

// ---- sharing -------------------------------------------------------------------------------------

// The time until the last flow of each plan is done, all plans starting together and sharing links.
std::vector<double> together_us(const Topology& topo, const std::vector<const CommPlan*>& plans) {
  const PlanFlows pf = plan_flows(topo, plans);
  const std::vector<double> finish = fluid_finish_us(pf.network, pf.bytes);
  std::vector<double> out;
  for (std::size_t p = 0; p < plans.size(); ++p) {
    double last = 0;
    for (std::size_t f = 0; f < plans[p]->flows.size(); ++f)
      last = std::max(last, finish[pf.first_flow[p] + f]);
    out.push_back(last);
  }
  return out;
}

TEST(Sharing, TwoAllReducesOnTheSameLinksTakeTwiceAsLong) {
  NetworkModel m(profile("dgx-h100"), NetworkOptions{"ring", "simple"});
  const CommPlan a = m.plan_collective(CommOp::AllReduce, std::int64_t{256} << 20, first(8), -1);
  const CommPlan b = a;
  const std::vector<double> both = together_us(m.topology(), {&a, &b});
  EXPECT_NEAR(both[0], 2 * a.transfer_us, 1e-9 * a.transfer_us);
  EXPECT_NEAR(both[1], 2 * a.transfer_us, 1e-9 * a.transfer_us);
}

TEST(Sharing, OnDisjointLinksTheyDoNot) {
  // GPUs 0-3 and 4-7 of one node use different NVLink ports: no link in common.
  NetworkModel m(profile("dgx-h100"), NetworkOptions{"ring", "simple"});
  const CommPlan a = m.plan_collective(CommOp::AllReduce, std::int64_t{256} << 20, {0, 1, 2, 3}, -1);
  const CommPlan b = m.plan_collective(CommOp::AllReduce, std::int64_t{256} << 20, {4, 5, 6, 7}, -1);
  const std::vector<double> both = together_us(m.topology(), {&a, &b});
  EXPECT_NEAR(both[0], a.transfer_us, 1e-9 * a.transfer_us);
  EXPECT_NEAR(both[1], b.transfer_us, 1e-9 * b.transfer_us);
}

TEST(Sharing, AlonePlansTakeTheirBusiestLinksTime) {
  // transfer_us (the busiest link) and the fluid simulation of max-min sharing agree for every algorithm.
  for (int nodes : {1, 2, 4}) {
    NetworkModel m(profile("dgx-h100", nodes));
    const std::vector<int> all = first(8 * nodes);
    ASSERT_EQ(m.topology().spines(), nodes > 1 ? 1 : 0);
    for (const Candidate& c : m.candidates(CommOp::AllReduce, 1 << 26, all, -1)) {
      NetworkModel forced(profile("dgx-h100", nodes),
                          NetworkOptions{algorithm_name(c.algorithm), protocol_name(c.protocol)});
      const CommPlan plan = forced.plan_collective(CommOp::AllReduce, 1 << 26, all, -1);
      EXPECT_NEAR(fluid_transfer_us(m.topology(), plan), plan.transfer_us, 1e-9 * plan.transfer_us)
          << plan.name();
    }
    const CommPlan a2a = m.plan_collective(CommOp::AllToAll, 1 << 26, all, -1);
    EXPECT_NEAR(fluid_transfer_us(m.topology(), a2a), a2a.transfer_us, 1e-9 * a2a.transfer_us);
  }
  // all_to_all's pairs through several spines, which ECMP's hash loads unevenly: leaves of 16 ports give
  // 8 nodes per leaf, so 16 nodes need two leaves per rail: 16 leaves of 8 uplinks on 8 spines.
  Profile p = profile("dgx-h100", 16);
  p.fabric.switch_radix = 16;
  NetworkModel m(p);
  ASSERT_EQ(m.topology().spines(), 8);
  const CommPlan a2a = m.plan_collective(CommOp::AllToAll, 1 << 26, first(128), -1);
  EXPECT_NEAR(fluid_transfer_us(m.topology(), a2a), a2a.transfer_us, 1e-9 * a2a.transfer_us);
}

// ---- fidelity (docs/validation.md) ------------------------------------------------------------------

TEST(Fidelity, EightH100RingAndNvlsBusBandwidth) {
  // nccl-tests on 8x H100: ~365-370 GB/s with NCCL_ALGO=Ring and ~480 GB/s with NVLS, for large sizes
  // (NVIDIA/nccl issue 1455, NVIDIA/nccl-tests issue 212). Within 10% at 4 GiB.
  const std::int64_t s = std::int64_t{4} << 30;
  NetworkModel ring(profile("dgx-h100"), NetworkOptions{"ring", ""});
  const CommPlan r = ring.plan_collective(CommOp::AllReduce, s, first(8), -1);
  EXPECT_NEAR(busbw_gbps(CommOp::AllReduce, s, 8, duration_us(r)), 367.5, 36.75);
  NetworkModel nccl(profile("dgx-h100"));
  const CommPlan n = nccl.plan_collective(CommOp::AllReduce, s, first(8), -1);
  EXPECT_EQ(n.algorithm, Algorithm::Nvls);
  EXPECT_NEAR(busbw_gbps(CommOp::AllReduce, s, 8, duration_us(n)), 480, 48);
}

TEST(Fidelity, TheLecturesAllReduceOfFourHundredMegabytes) {
  // The lecture: all_reduce of 100M float32 on 4 GPUs takes about 1.6 ms. Timed as the lecture does,
  // through the simulator: synchronize, barrier, all_reduce, synchronize.
  auto times = ranklab::testing::run_collect<double>(4, [](Rank& r) {
    Tensor t = r.phantom({100'000'000});
    r.synchronize();
    r.barrier();
    const double t0 = r.now();
    r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
    return r.now() - t0;
  });
  EXPECT_NEAR(times[0], 1600, 400);
}

// ---- the benchmark lesson ------------------------------------------------------------------------

RunReport run_benchmark(const Settings& o) {
  SimBackend backend(ranklab::testing::quiet_config());
  return run_lesson(backend, "benchmark", o);
}

bool has_line(const RunReport& r, const std::string& text) {
  for (const std::string& line : r.output) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(BenchmarkLesson, TheLecturesMeasurement) {
  Settings o;
  o["world"] = option_text(4);
  const RunReport r = run_benchmark(o);
  EXPECT_TRUE(r.all_checks_passed());
  ASSERT_EQ(r.checks.size(), 4u);  // every rank checks the numerics of a small all_reduce of real numbers
  EXPECT_TRUE(has_line(r, "all_reduce of 381 MiB"));
  EXPECT_TRUE(has_line(r, "duration 1.656 ms"));  // ends with a barrier too, as the lecture times it
  EXPECT_TRUE(has_line(r, "busbw = algbw x 2(W-1)/W"));
  EXPECT_TRUE(has_line(r, "reduce_scatter of 1.49 GiB"));
  EXPECT_TRUE(has_line(r, "the lecture's text: 2 x size x (W-1)/W / (W x duration)"));
  // The lecture's reduce_scatter code counts the output: busbw / W, printed as such.
  EXPECT_TRUE(has_line(r, "the lecture's code: output bytes x (W-1) / (W x duration)"));
  EXPECT_TRUE(
      has_line(r, "(= busbw / W: it counts the output, size / W, where nccl-tests counts the input)"));
}

TEST(BenchmarkLesson, WrongOrderMakesRanksDisagree) {
  Settings o;
  o["world"] = option_text(4);
  o["wrong-order"] = option_text(true);
  const RunReport r = run_benchmark(o);
  // Rank 0 also times the slower ranks' extra work; rank 3, the slowest, times the collective alone.
  EXPECT_TRUE(has_line(r, "all_reduce measured (ms) by rank0 = [2.75]"));
  EXPECT_TRUE(has_line(r, "rank3 = [1.651]"));
}

TEST(BenchmarkLesson, SweepPrintsNcclTestsTable) {
  Settings o;
  o["world"] = option_text(8);
  o["sweep"] = option_text(true);
  o["op"] = option_text("all_gather");
  const RunReport r = run_benchmark(o);
  int rows = 0;
  for (const std::string& line : r.output) rows += line.find(" float ") != std::string::npos;
  EXPECT_EQ(rows, 30);  // 32 B (8 floats, one per rank) to 16 GiB
  EXPECT_TRUE(has_line(r, "   17179869184    4294967296     float   none    -1"));
  // Each row names the algorithm the simulator ran it with: the network model's choice for the world.
  NetworkModel model(load_profile("dgx-h100"));
  for (const std::int64_t bytes : {std::int64_t{256}, std::int64_t{1} << 34}) {
    const std::string name = model.plan_collective(CommOp::AllGather, bytes, first(8), -1).name();
    bool found = false;
    for (const std::string& line : r.output) {
      if (line.rfind(fmt::format("  {:>12} ", bytes), 0) == 0) {
        found = true;
        EXPECT_EQ(line.substr(line.size() - name.size() - 2), "  " + name) << line;
      }
    }
    EXPECT_TRUE(found) << bytes;
  }
  o["op"] = option_text("all_reduces");
  EXPECT_THROW(run_benchmark(o), ranklab::UsageError);
}

// ---- copies: flows the transfer engine shares as one -----------------------------------------------

// Across two nodes a ring's channels and a tree's two trees cross each NVLink hop side by side with the
// same bytes: those flows are copies of the first, and every flow is either counted once or a copy of an
// earlier one with the same path and bytes.
TEST(Copies, ChannelsThroughOneHopAreCountedOnTheFirst) {
  for (const char* algorithm : {"ring", "tree", "nvls_tree"}) {
    NetworkModel m(profile("dgx-h100", 2), NetworkOptions{algorithm, "simple"});
    const CommPlan plan = m.plan_collective(CommOp::AllReduce, 1 << 30, first(16), -1);
    ASSERT_EQ(plan.copies.size(), plan.flows.size()) << algorithm;
    std::uint32_t total = 0, most = 0;
    for (std::size_t i = 0; i < plan.flows.size(); ++i) {
      total += plan.copies[i];
      most = std::max(most, plan.copies[i]);
      const Flow& f = plan.flows[i];
      const std::span<const LinkId> path = plan.path(f);
      // The first flow with this path and these bytes stands for it (and is itself counted).
      std::size_t original = i;
      for (std::size_t j = 0; j < i && original == i; ++j) {
        const Flow& g = plan.flows[j];
        const std::span<const LinkId> other = plan.path(g);
        if (plan.bytes(g) == plan.bytes(f) && plan.payload_bytes(g) == plan.payload_bytes(f) &&
            std::equal(path.begin(), path.end(), other.begin(), other.end()))
          original = j;
      }
      if (original == i) {
        EXPECT_GE(plan.copies[i], 1u) << algorithm << " flow " << i;
      } else {
        EXPECT_EQ(plan.copies[i], 0u) << algorithm << " flow " << i << " copies flow " << original;
      }
    }
    EXPECT_EQ(total, plan.flows.size()) << algorithm;
    EXPECT_GT(most, 1u) << algorithm << ": no flow has a copy, so the test shows nothing";
  }
}

// Runs `transfers` (each a plan and when it starts) in one engine to the end; returns when each ended.
std::vector<double> end_times_us(const Topology& topo, std::vector<std::pair<CommPlan, double>> transfers) {
  TransferEngine engine(topo);
  std::vector<TransferOwner> owners;
  for (auto& [plan, start_us] : transfers) {
    owners.push_back(std::make_shared<int>(0));
    engine.schedule(owners.back(), std::move(plan), start_us);
  }
  std::vector<double> ends_us(owners.size());
  for (const EndedTransfer& e : engine.advance_to(std::numeric_limits<double>::infinity())) {
    ends_us[std::find(owners.begin(), owners.end(), e.owner) - owners.begin()] = e.end_us;
  }
  return ends_us;
}

// The engine sharing copies as one flow ends every transfer at the same time, to the bit, as sharing
// each flow of the plan on its own: a ring all_reduce on one node (its channels through each NVLink hop
// are copies), with a send between two of its GPUs and a second all_reduce starting while it runs, and
// the same across two nodes.
TEST(Copies, TheEngineEndsTransfersExactlyAsWithEveryFlowApart) {
  for (int nodes : {1, 2}) {
    NetworkModel m(profile("dgx-h100", nodes), NetworkOptions{"ring", "simple"});
    const std::vector<int> ranks = first(8 * nodes);
    std::vector<std::pair<CommPlan, double>> plans;  // and when each starts
    plans.emplace_back(m.plan_collective(CommOp::AllReduce, 1 << 30, ranks, -1), 0);
    plans.emplace_back(m.plan_p2p(0, 1, 256 << 20), 100);
    plans.emplace_back(m.plan_collective(CommOp::AllReduce, 96 << 20, ranks, -1), 2000);
    ASSERT_FALSE(plans[0].first.copies.empty());
    std::vector<std::pair<CommPlan, double>> without = plans;
    for (auto& [plan, start_us] : without) plan.copies.clear();
    const std::vector<double> apart = end_times_us(m.topology(), without),
                              copied = end_times_us(m.topology(), plans);
    for (std::size_t i = 0; i < plans.size(); ++i) {
      EXPECT_GT(apart[i], plans[i].second) << nodes << " nodes, transfer " << i;
      EXPECT_EQ(copied[i], apart[i]) << nodes << " nodes, transfer " << i;
    }
  }
}

// A collective that starts on links nothing else crosses gets the rates max-min sharing gave its plan's
// flows the first time (CommPlan::idle_rates_gbps, kept per shape): the same, bit for bit, as sharing
// them again. One that starts beside another is shared with it.
TEST(IdleRates, ATransferAloneOnIdleLinksRunsAtItsShapesKeptRates) {
  NetworkModel m(profile("dgx-h100", 2));
  const std::vector<int> world = first(16);
  const CommPlan reduce = m.plan_collective(CommOp::AllReduce, 64 << 20, world, -1);
  const CommPlan gather = m.plan_collective(CommOp::AllGather, 32 << 20, world, -1);
  const CommPlan bigger = m.plan_collective(CommOp::AllReduce, 256 << 20, world, -1);  // reduce's shape
  const CommPlan node = m.plan_collective(CommOp::AllReduce, 64 << 20, first(8), -1);
  ASSERT_TRUE(reduce.idle_rates_gbps && reduce.idle_rates_gbps == bigger.idle_rates_gbps);
  ASSERT_NE(reduce.idle_rates_gbps, gather.idle_rates_gbps);
  // One after another, each alone, then reduce and node together (they share NVLink ports); with the
  // shapes' kept rates, or with every transfer shared afresh (a cell of its own, empty).
  const std::vector<std::pair<const CommPlan*, double>> schedule = {
      {&reduce, 0},    {&gather, 500},  {&bigger, 1000}, {&gather, 3000},
      {&reduce, 3500}, {&reduce, 4500}, {&node, 4500}};
  std::vector<std::pair<CommPlan, double>> shared, own;
  for (const auto& [plan, start_us] : schedule) {
    shared.emplace_back(*plan, start_us);
    own.emplace_back(*plan, start_us);
    own.back().first.idle_rates_gbps = std::make_shared<std::vector<double>>();
  }
  const std::vector<double> afresh = end_times_us(m.topology(), own),
                            kept = end_times_us(m.topology(), shared);
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    EXPECT_EQ(kept[i], afresh[i]) << "transfer " << i;
    if (i + 2 < schedule.size()) {
      EXPECT_LT(kept[i], schedule[i + 1].second) << "transfer " << i << " is over before the next starts";
    }
  }
  EXPECT_GT(kept[5] - 4500, kept[0] * 1.05) << "reduce shared with the node's all_reduce";
  EXPECT_EQ(reduce.idle_rates_gbps->size(),
            static_cast<std::size_t>(std::count_if(reduce.copies.begin(), reduce.copies.end(),
                                                   [](std::uint32_t c) { return c > 0; })));

  // The kept rates are what the engine runs such a transfer at: halved, it takes twice as long to move
  // its bytes.
  const double moving_us = kept[1] - 500 - gather.latency_us;
  for (double& r : *gather.idle_rates_gbps) r /= 2;
  TransferEngine again(m.topology());
  again.schedule(std::make_shared<int>(0), gather, 0);
  const std::vector<EndedTransfer> ended = again.advance_to(std::numeric_limits<double>::infinity());
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_NEAR(ended[0].end_us - gather.latency_us, 2 * moving_us, 1e-9 * moving_us);
}

// ---- bundles: alike flows on disjoint paths the engine moves as one ------------------------------------

// The pairs of a shift around `n` ranks: each sends `bytes` to the one `step` places on (a tensor-parallel
// ring's step: 1; the other way round: n - 1).
std::vector<std::int64_t> shift_pairs(int n, std::int64_t bytes, int step = 1) {
  std::vector<std::int64_t> pairs(static_cast<std::size_t>(n) * n, 0);
  for (int i = 0; i < n; ++i) pairs[static_cast<std::size_t>(i) * n + (i + step) % n] = bytes;
  return pairs;
}

// A ring inside a node and a shift around it are bundles; an all_to_all whose flows share links, an
// uneven one, and a ring whose steps cross nodes on other paths than inside them are not.
TEST(Bundles, AreAlikeFlowsWithNoLinkInCommon) {
  NetworkModel m(profile("dgx-h100", 2), NetworkOptions{"ring", "simple"});
  EXPECT_TRUE(m.plan_collective(CommOp::AllReduce, 1 << 30, first(8), -1).bundle);
  EXPECT_TRUE(m.plan_collective(CommOp::AllGather, 1 << 30, first(8), -1).bundle);
  EXPECT_TRUE(m.plan_all_to_all(first(8), shift_pairs(8, 1 << 20)).bundle);
  EXPECT_FALSE(m.plan_collective(CommOp::AllReduce, 1 << 30, first(16), -1).bundle);
  EXPECT_FALSE(m.plan_collective(CommOp::AllToAll, 1 << 30, first(8), -1).bundle);
  std::vector<std::int64_t> uneven = shift_pairs(8, 1 << 20);
  uneven[1] = 2 << 20;
  EXPECT_FALSE(m.plan_all_to_all(first(8), uneven).bundle);
  EXPECT_FALSE(m.plan_p2p(0, 1, 1 << 20).bundle);
}

// The engine moving a bundle as one flow ends every transfer at the same time, to the bit, as moving each
// of its flows on its own: rings and shifts alone, beside each other on disjoint links, and with a send,
// another ring or a shift the other way coming onto their links while they run (the bundle then goes on as
// its flows); and a bundle that starts in the engine's past.
TEST(Bundles, TheEngineEndsTransfersExactlyAsWithEveryFlowApart) {
  NetworkModel m(profile("dgx-h100", 2), NetworkOptions{"ring", "simple"});
  std::vector<int> second(8);
  std::iota(second.begin(), second.end(), 8);
  const CommPlan ring = m.plan_collective(CommOp::AllReduce, 1 << 30, first(8), -1);
  const double ring_alone_us = end_times_us(m.topology(), {{ring, 0}})[0];
  std::vector<std::pair<CommPlan, double>> plans;  // and when each starts
  plans.emplace_back(ring, 0);
  plans.emplace_back(m.plan_collective(CommOp::AllReduce, 1 << 30, second, -1), 0);
  plans.emplace_back(m.plan_p2p(0, 1, 1 << 30), 100);
  // When the first ring's flows that the send left alone are done, on the links of one of them.
  plans.emplace_back(m.plan_p2p(4, 5, 64 << 20), 1.1 * ring_alone_us);
  plans.emplace_back(m.plan_all_to_all(second, shift_pairs(8, 64 << 20)), 200);
  plans.emplace_back(m.plan_all_to_all(second, shift_pairs(8, 64 << 20, 7)), 250);
  plans.emplace_back(m.plan_collective(CommOp::AllGather, 96 << 20, first(8), -1), 2000);
  plans.emplace_back(m.plan_all_to_all(first(8), shift_pairs(8, 32 << 20)), 3 * ring_alone_us);
  plans.emplace_back(m.plan_all_to_all(second, shift_pairs(8, 32 << 20)), 3 * ring_alone_us);
  std::vector<std::pair<CommPlan, double>> without = plans;
  int bundles = 0;
  for (auto& [plan, start_us] : without) {
    bundles += plan.bundle;
    plan.bundle = false;
  }
  ASSERT_GE(bundles, 6);
  const std::vector<double> apart = end_times_us(m.topology(), without),
                            bundled = end_times_us(m.topology(), plans);
  for (std::size_t i = 0; i < plans.size(); ++i) {
    EXPECT_GT(apart[i], plans[i].second) << "transfer " << i;
    EXPECT_EQ(bundled[i], apart[i]) << "transfer " << i;
  }
  // The send slowed the first ring and the shifts the second: the test splits bundles.
  EXPECT_GT(apart[0], 1.1 * ring_alone_us);
  EXPECT_GT(apart[1], ring_alone_us);

  // Started in the past: moved alone up to the present, then with the rest.
  auto late = [&](bool bundle) {
    TransferEngine engine(m.topology());
    CommPlan ring = m.plan_collective(CommOp::AllReduce, 1 << 30, first(8), -1),
             send = m.plan_p2p(2, 3, 1 << 30);
    ring.bundle = bundle;
    engine.schedule(std::make_shared<int>(0), send, 0);
    engine.advance_to(1000);
    engine.schedule(std::make_shared<int>(1), ring, 500);
    EXPECT_EQ(engine.late_starts(), 1);
    std::vector<double> ends;
    for (const EndedTransfer& e : engine.advance_to(std::numeric_limits<double>::infinity()))
      ends.push_back(e.end_us);
    return ends;
  };
  EXPECT_EQ(late(true), late(false));
}

// The same on random schedules: rings, shifts either way and sends inside and across two nodes, of random
// sizes at random times, bundled and apart. Bundles split and start on idle links many times over.
TEST(Bundles, RandomSchedulesEndAsWithEveryFlowApart) {
  NetworkModel m(profile("dgx-h100", 2), NetworkOptions{"ring", "simple"});
  std::vector<int> second(8);
  std::iota(second.begin(), second.end(), 8);
  std::mt19937 rng(7);
  auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  int bundled_plans = 0;
  for (int schedule = 0; schedule < 40; ++schedule) {
    std::vector<std::pair<CommPlan, double>> plans;
    double start_us = 0;
    for (int i = 0; i < 24; ++i) {
      const std::int64_t bytes = std::int64_t{1} << (16 + pick(14));  // 64 KiB to 512 MiB
      const std::vector<int>& group = pick(2) == 0 ? first(8) : second;
      switch (pick(5)) {
        case 0:
          plans.emplace_back(
              m.plan_collective(pick(2) ? CommOp::AllReduce : CommOp::AllGather, bytes, group, -1), start_us);
          break;
        case 1:
        case 2: {
          const int step = pick(2) ? 1 : 7;  // to the next, or to the previous
          plans.emplace_back(m.plan_all_to_all(group, shift_pairs(8, bytes, step)), start_us);
          break;
        }
        default: {
          const int src = pick(16);
          plans.emplace_back(m.plan_p2p(src, (src + 1 + pick(15)) % 16, bytes), start_us);
        }
      }
      bundled_plans += plans.back().first.bundle;
      start_us += pick(3) == 0 ? 0.0 : std::uniform_real_distribution<double>(0, 500)(rng);
    }
    std::vector<std::pair<CommPlan, double>> without = plans;
    for (auto& [plan, at_us] : without) plan.bundle = false;
    EXPECT_EQ(end_times_us(m.topology(), plans), end_times_us(m.topology(), without))
        << "schedule " << schedule;
  }
  EXPECT_GT(bundled_plans, 300);
}

}  // namespace
}  // namespace ranklab::sim
