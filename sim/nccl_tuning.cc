#include "sim/nccl_tuning.h"

#include <algorithm>
#include <cmath>

namespace ranklab::sim {

namespace {

int index_of(Protocol p) {
  return static_cast<int>(p);
}  // LL, LL128, Simple: NCCL's order

// baseLat of src/graph/tuning.cc: the fixed cost of a kernel, per algorithm, for LL, LL128 and Simple.
// NVLS and NVLSTree have none beyond their per-hop latencies.
constexpr double kBaseLatencyUs[2][3] = {
    {6.8, 14.0, 0},    // Tree
    {6.6, 14.0, 8.4},  // Ring
};

// hwLat of src/graph/tuning.cc: the latency of one step over a hop of each kind, per algorithm and
// protocol. Tree/Simple is large because it stands for the latency of a whole pipeline chunk.
enum Hw { kNvlink, kPci, kNet };
struct HwLatency {
  double tree[3], ring[3], nvls_simple, nvls_tree_simple;
};
constexpr HwLatency kHwLatencyUs[3] = {
    /* NVLink */ {{0.6, 1.25, 28}, {0.6, 1.9, 3.4}, 23, 23},
    /* PCI    */ {{1.0, 1.9, 28}, {1.0, 2.5, 5.7}, 0, 0},
    /* NET    */ {{5.0, 8.5, 28}, {2.7, 4.0, 14.0}, 18, 14},
};

// getNetOverhead of src/graph/tuning.cc: 1 us of proxy work per network step on Intel hosts, three times
// that for Simple. A ring that crosses nodes pays at least this on every step.
constexpr double kNetOverheadUs = 1.0;

double hw_latency_us(Hw hw, Algorithm a, Protocol p) {
  const HwLatency& t = kHwLatencyUs[hw];
  switch (a) {
    case Algorithm::Tree:
      return t.tree[index_of(p)];
    case Algorithm::Nvls:
      return t.nvls_simple;
    case Algorithm::NvlsTree:
      return t.nvls_tree_simple;
    default:
      return t.ring[index_of(p)];
  }
}

double base_latency_us(Algorithm a, Protocol p) {
  switch (a) {
    case Algorithm::Tree:
      return kBaseLatencyUs[0][index_of(p)];
    case Algorithm::Nvls:
    case Algorithm::NvlsTree:
      return 0;
    default:
      return kBaseLatencyUs[1][index_of(p)];
  }
}

// log2i of NCCL: floor(log2(n)), 0 for n <= 1.
int log2i(int n) {
  int l = 0;
  while (n > 1) {
    n >>= 1;
    ++l;
  }
  return l;
}

}  // namespace

bool nccl_supports(CommOp op, Algorithm a, Protocol p, const GroupShape& g) {
  // LL128 only where NCCL enables it by default: GPUs joined by NVLink (tuning.cc enables it for
  // typeIntra <= PATH_NVB and disables it elsewhere, as untested).
  if (p == Protocol::LL128 && !g.nvlink) return false;
  const bool reduce_like = op == CommOp::AllReduce;
  switch (a) {
    case Algorithm::Ring:
      return op == CommOp::AllReduce || op == CommOp::AllGather || op == CommOp::ReduceScatter ||
             op == CommOp::Broadcast || op == CommOp::Reduce;
    case Algorithm::Tree:
      return reduce_like;
    case Algorithm::Nvls:
      // NVLS runs Simple only, needs the switch, and (without a SHARP-capable network, CollNet) one node.
      return p == Protocol::Simple && g.nvls && g.nodes == 1 && g.ranks >= 2 &&
             (op == CommOp::AllReduce || op == CommOp::AllGather || op == CommOp::ReduceScatter);
    case Algorithm::NvlsTree:
      // NVLS inside each node and a tree across: all_reduce over several nodes, the same share of each.
      return p == Protocol::Simple && g.nvls && g.nodes > 1 && g.uniform && g.ranks_per_node >= 2 &&
             reduce_like;
    case Algorithm::Direct:
      return op == CommOp::Scatter || op == CommOp::Gather || op == CommOp::Send || op == CommOp::Recv;
    case Algorithm::Pairwise:
      return op == CommOp::AllToAll;
    case Algorithm::Local:
      return g.ranks <= 1;
  }
  return false;
}

double nccl_latency_us(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes) {
  const int n = g.ranks, nodes = g.nodes;
  if (a == Algorithm::Local) return 0;
  const Hw intra_hw = g.nvlink ? kNvlink : kPci;
  double intra_us = hw_latency_us(intra_hw, a, p);
  // NCCL adds the network's own latency (graphs->latencyInter) to a network step, twice for Simple (the
  // flush); ranklab's is the fabric beyond one switch, from the profile.
  double inter_us = hw_latency_us(kNet, a, p) + g.net_extra_us * (p == Protocol::Simple ? 2 : 1);
  const double base_us = base_latency_us(a, p);

  switch (a) {
    case Algorithm::Ring: {
      // Steps of a ring: 2(n-1) for all_reduce, n-1 for all_gather and reduce_scatter, n otherwise; the
      // ones that cross nodes pay the network's latency (nInterSteps of tuning.cc).
      const int steps = op == CommOp::AllReduce                                    ? 2 * (n - 1)
                        : (op == CommOp::AllGather || op == CommOp::ReduceScatter) ? n - 1
                                                                                   : n;
      if (op == CommOp::Broadcast || op == CommOp::Reduce) {
        // A pipelined chain: every hop pays one step (tuning.cc, the not-sameChannels branch).
        return base_us + steps * (nodes > 1 ? hw_latency_us(kNet, a, p) : intra_us);
      }
      const int inter_steps = op == CommOp::AllReduce ? (nodes > 1 ? 2 * nodes : 0)
                              : (op == CommOp::AllGather || op == CommOp::ReduceScatter) ? nodes - 1
                                                                                         : nodes;
      if (nodes > 1) intra_us = std::max(intra_us, kNetOverheadUs * (p == Protocol::Simple ? 3 : 1));
      double us = base_us + (steps - inter_steps) * intra_us + inter_steps * inter_us;
      // "Plateau effect of ring" (ncclTopoGetAlgoTime): a multi-node Simple all_reduce with at least 64
      // bytes per channel and rank takes 1.4x its latency on Ampere and later.
      if (p == Protocol::Simple && nodes > 1 && op == CommOp::AllReduce && bytes / (g.channels * n) >= 64) {
        us *= 1.4;
      }
      return us;
    }
    case Algorithm::Tree:
      // Up the chain and the tree, then down again.
      return base_us + 2 * ((g.ranks_per_node - 1) * intra_us + log2i(nodes) * inter_us);
    case Algorithm::Nvls:
      return intra_us + (nodes > 1 ? inter_us : 0);
    case Algorithm::NvlsTree:
      return base_us + intra_us + 2 * log2i(nodes) * inter_us;
    case Algorithm::Direct:
    case Algorithm::Pairwise:
      // Grouped point-to-point: one kernel, one step over the slowest hop taken.
      return base_latency_us(Algorithm::Ring, p) + (nodes > 1 ? inter_us : intra_us);
    case Algorithm::Local:
      break;
  }
  return 0;
}

double nccl_bandwidth_factor(CommOp op, Algorithm a, Protocol p, const GroupShape& g) {
  // The refinements of ncclTopoTuneModel, as ratios to Simple on a ring.
  switch (a) {
    case Algorithm::Ring:
    case Algorithm::Direct:
    case Algorithm::Pairwise:
      if (p == Protocol::LL) {
        // Half of every LL line is flag, and the receiver polls: a quarter of the bandwidth for reductions
        // and across nodes, a third otherwise.
        return (g.nodes > 1 || op == CommOp::AllReduce || op == CommOp::Reduce) ? 1.0 / 4.0 : 1.0 / 3.0;
      }
      if (p == Protocol::LL128) {
        // 120 of 128 bytes are data; less with one GPU per node, where the NIC and the GPU share a path.
        return g.ranks_per_node < 2 ? 0.7 : 0.92;
      }
      return 1.0;
    case Algorithm::Tree: {
      double f = 0.92;
      if (p == Protocol::LL) f *= 1.0 / 3.8;
      if (p == Protocol::LL128) f *= g.nodes == 1 ? 7.0 / 9.0 : 120.0 / 128.0;
      return f;
    }
    case Algorithm::Nvls:
    case Algorithm::NvlsTree:
      // tuning.cc converts NVLS bus bandwidth to algorithm bandwidth with 5/6; on 8x H100 that reproduces
      // the published ~480 GB/s NVLS bus bandwidth from NVLink's sustained 370 GB/s (docs/validation.md).
      return 5.0 / 6.0;
    case Algorithm::Local:
      return 1.0;
  }
  return 1.0;
}

double nccl_tree_correction(Protocol p, double bytes) {
  // treeCorrectionFactor of src/graph/tuning.cc, indexed by log2(bytes / 64) from 64 B to 256 MiB: trees
  // do worse than their model at medium sizes.
  static constexpr double kFactor[3][23] = {
      {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0},
      {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0},
      {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9},
  };
  const double units = std::floor(bytes / 64);
  const int log_size = units >= 1 ? static_cast<int>(std::floor(std::log2(units))) : 0;
  if (log_size >= 23) return 1.0;
  return kFactor[index_of(p)][log_size];
}

}  // namespace ranklab::sim
