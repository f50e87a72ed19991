// NCCL's choice of algorithm, protocol and channels, worked out by hand from NCCL 2.21.5's model (and
// 2.27.7's Blackwell constants) for a table of sizes and world sizes, against the model's choice.
//
// NCCL predicts each (algorithm, protocol) as latency + bytes / algorithm bandwidth (ncclTopoGetAlgoTime)
// from the tables ncclTopoTuneModel fills (src/graph/tuning.cc), and takes the least. The figures below
// are that arithmetic done by hand, so a change to the port that moves a crossover fails here.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "common/profile.h"
#include "sim/net/algorithms.h"
#include "sim/net/nccl_tuning.h"
#include "sim/net/network_model.h"
#include "sim/net/topology.h"
#include "sim_fixture.h"

namespace ranklab::sim {
namespace {

using testing::first;

GroupShape shape_of(const char* profile, int nodes, int world) {
  Profile p = load_profile(profile);
  p.nodes = nodes;
  const Topology topo(p);
  return layout_group(topo, first(world)).shape;
}

// NCCL's algorithm bandwidth (GB/s) for a few cells of its table, by hand.
TEST(NcclModel, BandwidthTableByHand) {
  // 8x H100: NVLink 18 x 20.6 = 370.8 GB/s. Ring graph: 60 GB/s fits 6 times, duplicated to 12 x 30.
  // NVLS graph: one channel per GPU, 8 x 40 (8 x 50 = 400 would not fit).
  const GroupShape h100 = shape_of("dgx-h100", 1, 8);
  const NcclGraph ring = nccl_graph(Algorithm::Ring, h100);
  EXPECT_EQ(ring.channels, 12);
  EXPECT_DOUBLE_EQ(ring.bw_intra_gbps, 30);
  const NcclGraph nvls = nccl_graph(Algorithm::Nvls, h100);
  EXPECT_EQ(nvls.channels, 8);
  EXPECT_DOUBLE_EQ(nvls.bw_intra_gbps, 40);
  // Ring Simple: 360 x 8/14; LL: min(llMaxBw 141, 360 / 2) x 8/14; LL128: min(360 x 0.92, 12 x 36.7) x 8/14.
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::Simple, h100), 205.714, 1e-3);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::LL, h100), 80.571, 1e-3);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::LL128, h100), 189.257, 1e-3);
  // NVLS: 8 x 40 x 5/6. Tree LL128: min(360 x 0.92 x 7/9, 12 x 36.7) / 2.
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Nvls, Protocol::Simple, h100), 266.667, 1e-3);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Tree, Protocol::LL128, h100), 128.8, 1e-3);
  // All-gather's ring: 7 steps, x 8/7.
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllGather, Algorithm::Ring, Protocol::Simple, h100), 411.429, 1e-3);
  // NVLS never runs LL or LL128.
  EXPECT_EQ(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Nvls, Protocol::LL, h100), 0);

  // 8x A100: 12 x 25 x 0.8 = 240 GB/s; 40 GB/s fits 6 times, duplicated to 12 x 20. llMaxBw 87.7.
  const GroupShape a100 = shape_of("dgx-a100", 1, 8);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::LL, a100), 50.114, 1e-3);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::LL128, a100), 126.171, 1e-3);

  // 8x B200 (2.27.7): 18 x 40.1 = 721.8 GB/s; the SM100 speed array's 90 fits 8 times, duplicated to
  // 16 x 45. NVLS: 8 x 90. LL's ceiling is Blackwell's 282.
  const GroupShape b200 = shape_of("dgx-b200", 1, 8);
  EXPECT_EQ(nccl_graph(Algorithm::Ring, b200).channels, 16);
  EXPECT_DOUBLE_EQ(nccl_graph(Algorithm::Ring, b200).bw_intra_gbps, 45);
  EXPECT_DOUBLE_EQ(nccl_graph(Algorithm::Nvls, b200).bw_intra_gbps, 90);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::LL, b200), 161.143, 1e-3);
  EXPECT_EQ(nccl_nvls_channels(b200), 24);

  // 2 nodes of 8x H100 with 8 NDR NICs (50 GB/s): one channel per NIC at 48 GB/s, duplicated to 16 x 24;
  // up to two nodes the ring uses that. NVLSTree: min(40, 48) x 8 x 5/6.
  const GroupShape h100x2 = shape_of("dgx-h100", 2, 16);
  EXPECT_EQ(nccl_graph(Algorithm::Ring, h100x2).channels, 16);
  EXPECT_DOUBLE_EQ(nccl_graph(Algorithm::Ring, h100x2).bw_inter_gbps, 24);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::Ring, Protocol::Simple, h100x2), 204.8, 1e-3);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::NvlsTree, Protocol::Simple, h100x2), 266.667,
              1e-3);
  // Beyond two nodes NVLSTree's inter-node speed is halved: min(40, 24) x 8 x 5/6.
  const GroupShape h100x4 = shape_of("dgx-h100", 4, 32);
  EXPECT_NEAR(nccl_model_bw_gbps(CommOp::AllReduce, Algorithm::NvlsTree, Protocol::Simple, h100x4), 160,
              1e-3);
}

// The NVLS channels' ceiling (ranklab's, not NCCL's table): 20.1 GB/s of all_reduce a channel, 4/5 of it
// for NVLSTree, whose narrowest warp group has 4 warps against NVLS's 5; in bus bandwidth (x 6/5).
TEST(NcclModel, NvlsTreeChannelsCarryFourFifthsOfNvlsOnes) {
  const GroupShape h100 = shape_of("dgx-h100", 1, 8), h100x2 = shape_of("dgx-h100", 2, 16);
  const double nvls = nccl_bus_bw_cap(CommOp::AllReduce, Algorithm::Nvls, Protocol::Simple, h100);
  const double tree = nccl_bus_bw_cap(CommOp::AllReduce, Algorithm::NvlsTree, Protocol::Simple, h100x2);
  EXPECT_NEAR(nvls, 16 * 20.1 * 6 / 5, 1e-9);
  EXPECT_NEAR(tree, 16 * 20.1 * 4 / 5 * 6 / 5, 1e-9);
  // Where it binds: two nodes of H100 peak at its 257 GB/s of algorithm bandwidth, below NVLink's 275.
  Profile p = load_profile("dgx-h100");
  p.nodes = 2;
  NetworkModel m(p);
  const std::int64_t bytes = std::int64_t{16} << 30;
  const CommPlan plan = m.plan_collective(CommOp::AllReduce, bytes, first(16), -1);
  EXPECT_EQ(plan.name(), "nvls_tree/simple");
  EXPECT_NEAR(static_cast<double>(bytes) / (plan.transfer_us * 1e3), 16 * 20.1 * 4 / 5, 1.5);
}

// NVLSTree's network hops weigh in its pipeline for the part of a loop they take: algorithm bandwidth /
// (2 x NICs x a NIC's rate), at most 1. One loop (one chunk per channel) then takes the stage that paces
// it, its two copy stages for the part of a loop each takes alone, and the weighed hops, 2 per tree level.
TEST(NcclModel, NvlsTreeHopsWeighByTheirShareOfALoop) {
  const GroupShape h100x2 = shape_of("dgx-h100", 2, 16), h100x4 = shape_of("dgx-h100", 4, 32);
  ASSERT_EQ(h100x2.nics, 8);
  EXPECT_DOUBLE_EQ(nccl_net_hop_weight(h100x2, 257.28), 257.28 / (2 * 8 * h100x2.nic_gbps));
  EXPECT_DOUBLE_EQ(nccl_net_hop_weight(h100x2, 1e6), 1.0);
  const double bytes = 4 << 20;
  const LaunchShape two =
      nccl_launch(CommOp::AllReduce, Algorithm::NvlsTree, Protocol::Simple, h100x2, bytes);
  const LaunchShape four =
      nccl_launch(CommOp::AllReduce, Algorithm::NvlsTree, Protocol::Simple, h100x4, bytes);
  EXPECT_EQ(two.depth, 3);
  EXPECT_EQ(two.net_hops, 2);
  EXPECT_EQ(four.net_hops, 4);
  ASSERT_EQ(two.chunks, 1);
  const double w = nccl_net_hop_weight(h100x2, 250);
  const double copy = nccl_copy_stage_weight(h100x2, two, 250);
  EXPECT_DOUBLE_EQ(nccl_launch_slowdown(Algorithm::NvlsTree, h100x2, two, 250), 1 + 2 * copy + 2 * w);
}

// NVLS's scatter and gather stages weigh for the part of a loop they take alone: each copies the chunks of
// the other heads over the GPU's NVLink (what NCCL sustains there: 18 x 20.6 GB/s on H100), while a loop
// moves all heads' chunks at the algorithm bandwidth. 8x H100 at NVLS's 274 GB/s: 7/8 x 274 / 370.8. At
// most 1: a copy stage never takes longer than the loop it is part of. all_gather and reduce_scatter have
// one copy stage, all_reduce two; rings and trees none.
TEST(NcclModel, NvlsCopyStagesWeighByTheirShareOfALoop) {
  const GroupShape h100 = shape_of("dgx-h100", 1, 8);
  const double kib = 1024, mib = 1024 * kib;
  const LaunchShape ar = nccl_launch(CommOp::AllReduce, Algorithm::Nvls, Protocol::Simple, h100, 2 * mib);
  const LaunchShape ag = nccl_launch(CommOp::AllGather, Algorithm::Nvls, Protocol::Simple, h100, 2 * mib);
  ASSERT_EQ(ar.heads, 8);
  ASSERT_EQ(ar.depth, 3);
  ASSERT_EQ(ag.depth, 2);
  EXPECT_NEAR(h100.intra_gbps, 18 * 20.6, 0.01);
  const double copy = nccl_copy_stage_weight(h100, ar, 274.0);
  EXPECT_DOUBLE_EQ(copy, 7.0 / 8.0 * 274.0 / h100.intra_gbps);
  EXPECT_DOUBLE_EQ(nccl_copy_stage_weight(h100, ar, 1e6), 1.0);
  // 2 MiB on 8x H100 is one loop of 16 KiB chunks on each of the 16 channels.
  ASSERT_EQ(ar.chunks, 1);
  ASSERT_EQ(ar.chunk_bytes, 16 * kib);
  EXPECT_DOUBLE_EQ(nccl_launch_slowdown(Algorithm::Nvls, h100, ar, 274.0), 1 + 2 * copy);
  EXPECT_DOUBLE_EQ(nccl_launch_slowdown(Algorithm::Nvls, h100, ag, 274.0), (ag.chunks + copy) / ag.chunks);
  const LaunchShape ring = nccl_launch(CommOp::AllReduce, Algorithm::Ring, Protocol::Simple, h100, 2 * mib);
  EXPECT_EQ(ring.depth, 1);
}

// NCCL 2.21.5's pieces of one peer's message, by hand (ncclTopoComputeP2pChannels, scheduleP2pTasksToPlan,
// calcP2pChunkSize). 8x H100: comm->nChannels 24, so p2pnChannels 32; a peer's channels min(24, 2 x 18
// NVLink links), rounded up to 32; the fewest, 32 halved until 8 ranks x them fit 32: 4. Steps of 512 KiB
// (NCCL_P2P_NVL_CHUNKSIZE), pieces of at least 64 KiB and at most 16 MiB while channels can double. Across
// 2x8 H100: a peer gets 2 channels (the NICs'), steps of 128 KiB and pieces of at most 128 KiB while they
// can double, which they cannot beyond 2.
TEST(NcclModel, PointToPointPiecesFollowNccl2215) {
  const GroupShape h100 = shape_of("dgx-h100", 1, 8), h100x2 = shape_of("dgx-h100", 2, 16);
  struct Case {
    const GroupShape& comm;
    double bytes;
    int parts;
    double part_bytes, steps;
  };
  const double kib = 1024, mib = 1024 * kib;
  const std::vector<Case> cases = {
      {h100, 64 * kib, 1, 64 * kib, 1},      // one piece of the 64 KiB minimum
      {h100, 1 * mib, 4, 256 * kib, 1},      // the fewest channels, a piece each
      {h100, 64 * mib, 4, 16 * mib, 32},     // 4 pieces at the 16 MiB maximum
      {h100, 128 * mib, 8, 16 * mib, 32},    // over it: the channels double
      {h100, 1024 * mib, 32, 32 * mib, 64},  // all 32 channels, pieces past the maximum
      {h100x2, 1 * mib, 2, 512 * kib, 4},    // across nodes: the 2 channels of a peer
      {h100x2, 64 * mib, 2, 32 * mib, 256},
  };
  for (const Case& c : cases) {
    const P2pLaunch l = nccl_p2p_launch(nccl_p2p_comm(c.comm), c.bytes);
    EXPECT_EQ(l.parts, c.parts) << c.bytes;
    EXPECT_EQ(l.part_bytes, c.part_bytes) << c.bytes;
    EXPECT_EQ(l.steps, c.steps) << c.bytes;
    EXPECT_DOUBLE_EQ(nccl_p2p_slowdown(l, Protocol::Simple), (c.steps + 1) / c.steps);
  }
  // LL streams line by line: no fill.
  EXPECT_EQ(nccl_p2p_slowdown(nccl_p2p_launch(nccl_p2p_comm(h100), 8 * kib), Protocol::LL), 1.0);
}

struct Choice {
  const char* profile;
  int nodes, world;
  CommOp op;
  std::int64_t bytes;
  const char* chosen;  // algorithm/protocol
  int channels;        // NCCL's launch for it (getChannnelThreadInfo)
};

// Crossovers by hand (times in us, bandwidths in GB/s = 1000 bytes/us):
//  8x H100 all_reduce: ring LL 15.0 + S/80.57 against NVLS 25 + S/266.67 cross at S = 1.15 MB.
//  8x H100 all_gather: ring LL 10.8 + S/161.1, LL128 27.3 + S/378.5, Simple 32.2 + S/411.4 (NVLS's 266.7
//    never wins): LL to 4.6 MB, LL128 to 23 MB, then Simple.
//  4x H100 all_reduce: ring Simple 12 x 30 x 4/6 = 240 beats NVLS's 4 channels x 60 x 5/6 = 200.
//  8x A100 all_reduce: ring LL 15.0 + S/50.11 against LL128 40.6 + S/126.2 cross at 2.13 MB, LL128
//    against Simple 56 + S/137.1 at 24 MB.
//  2x 8 H100 all_reduce: tree LL128 (48.5 us, 165.6 x treeCorrection 0.6 at 256 KiB) beats tree LL (25.2
//    us, 19.5 x 0.4) and NVLSTree (53 + S/266.7); NVLSTree from 1 MiB on.
//  2x 8 A100 all_reduce, 1 GiB: the ring's 192 x 16/30 = 102.4 beats the tree's 176.6 / 2 = 88.3. Its 8
//    channels (one per 200 Gb/s NIC, at 24 GB/s) are not duplicated in the search (under 25 GB/s), only in
//    ncclTopoPostset: comm->nChannels is 16.
//  4x 8 H100 all_reduce, NCCL's predicted times (us): at 8 MiB tree LL128 122 against NVLSTree 133 and ring
//    LL128 195; at 64 MiB NVLSTree 500 against tree LL128 516 (its size correction 0.9) and ring LL128 517;
//    at 128 MiB tree LL128 876 (correction 1.0) against ring LL128 885; at 256 MiB ring LL128 1621 against
//    tree LL128 1686. NVLSTree's network bandwidth is halved beyond two nodes, so it wins only where the
//    tree's correction holds the tree back.
const std::vector<Choice> kChoices = {
    {"dgx-h100", 1, 8, CommOp::AllReduce, 8, "ring/ll", 1},
    {"dgx-h100", 1, 8, CommOp::AllReduce, 1 << 20, "ring/ll", 24},
    {"dgx-h100", 1, 8, CommOp::AllReduce, 2 << 20, "nvls/simple", 16},
    {"dgx-h100", 1, 8, CommOp::AllReduce, std::int64_t{4} << 30, "nvls/simple", 16},
    {"dgx-h100", 1, 8, CommOp::AllGather, 4 << 20, "ring/ll", 24},
    {"dgx-h100", 1, 8, CommOp::AllGather, 8 << 20, "ring/ll128", 24},
    {"dgx-h100", 1, 8, CommOp::AllGather, 16 << 20, "ring/ll128", 24},
    {"dgx-h100", 1, 8, CommOp::AllGather, 32 << 20, "ring/simple", 24},
    {"dgx-h100", 1, 4, CommOp::AllReduce, 400 << 20, "ring/simple", 24},
    {"dgx-a100", 1, 8, CommOp::AllReduce, 2 << 20, "ring/ll", 24},
    {"dgx-a100", 1, 8, CommOp::AllReduce, 4 << 20, "ring/ll128", 24},
    {"dgx-a100", 1, 8, CommOp::AllReduce, 16 << 20, "ring/ll128", 24},
    {"dgx-a100", 1, 8, CommOp::AllReduce, 32 << 20, "ring/simple", 24},
    {"dgx-h100", 2, 16, CommOp::AllReduce, 8, "tree/ll", 1},
    {"dgx-h100", 2, 16, CommOp::AllReduce, 256 << 10, "tree/ll128", 32},
    {"dgx-h100", 2, 16, CommOp::AllReduce, 1 << 20, "nvls_tree/simple", 16},
    {"dgx-a100", 2, 16, CommOp::AllReduce, 1 << 30, "ring/simple", 16},
    {"dgx-h100", 4, 32, CommOp::AllReduce, 8 << 20, "tree/ll128", 32},
    {"dgx-h100", 4, 32, CommOp::AllReduce, 64 << 20, "nvls_tree/simple", 16},
    {"dgx-h100", 4, 32, CommOp::AllReduce, 128 << 20, "tree/ll128", 32},
    {"dgx-h100", 4, 32, CommOp::AllReduce, 256 << 20, "ring/ll128", 32},
};

TEST(NcclModel, ChoiceFollowsNcclsTuning) {
  for (const Choice& c : kChoices) {
    Profile p = load_profile(c.profile);
    p.nodes = c.nodes;
    NetworkModel m(p);
    const std::string what = std::string(c.profile) + " x" + std::to_string(c.nodes) + " " +
                             comm_op_name(c.op) + " " + std::to_string(c.bytes);
    const CommPlan plan = m.plan_collective(c.op, c.bytes, first(c.world), -1);
    EXPECT_EQ(plan.name(), c.chosen) << what;
    const GroupShape s = layout_group(m.topology(), first(c.world)).shape;
    const LaunchShape l = nccl_launch(c.op, plan.algorithm, plan.protocol, s, static_cast<double>(c.bytes));
    EXPECT_EQ(l.channels, c.channels) << what;
  }
}

}  // namespace
}  // namespace ranklab::sim
