#include "sim/net/nccl_tuning.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <span>

namespace ranklab::sim {

namespace {

int index_of(Protocol p) {
  return static_cast<int>(p);
}  // LL, LL128, Simple: NCCL's order

// Every constant below is from NVIDIA/nccl v2.21.5-1 (see nccl_tuning.h for the files).

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
    /* NVLink */ {{0.6, 1.25, 28}, {0.6, 1.9, 3.4}, 25, 25},
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

// The steps of a ring, each one hop of a chunk: 2(n-1) for all_reduce (reduce-scatter, then all-gather),
// n-1 for all_gather and reduce_scatter, n for broadcast and reduce (a pipelined chain).
int ring_steps(CommOp op, int n) {
  if (op == CommOp::AllReduce) return 2 * (n - 1);
  if (op == CommOp::AllGather || op == CommOp::ReduceScatter) return n - 1;
  return n;
}

}  // namespace

bool nccl_supports(CommOp op, Algorithm a, Protocol p, const GroupShape& g) {
  // LL128 only where NCCL enables it by default: GPUs joined by NVLink (tuning.cc enables it for
  // typeIntra <= PATH_NVB and disables it elsewhere, as untested), of compute capability 7.0, 8.0 and 9.0
  // in 2.21.5 and also 10.0 in 2.27.7: every GPU of ranklab's profiles.
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
      // The ring's steps; the ones that cross nodes pay the network's latency (nInterSteps of tuning.cc).
      const int steps = ring_steps(op, n);
      if (op == CommOp::Broadcast || op == CommOp::Reduce) {
        // A pipelined chain. NCCL's ring graphs on NVSwitch nodes and rail-aligned fabrics search with
        // sameChannels set, and tuning.cc then charges one step: hwLat of the hop kind (the network's
        // across nodes, without the fabric's latency).
        return base_us + (nodes > 1 ? hw_latency_us(kNet, a, p) : intra_us);
      }
      const int inter_steps = op == CommOp::AllReduce ? (nodes > 1 ? 2 * nodes : 0)
                              : (op == CommOp::AllGather || op == CommOp::ReduceScatter) ? nodes - 1
                                                                                         : nodes;
      if (nodes > 1) intra_us = std::max(intra_us, kNetOverheadUs * (p == Protocol::Simple ? 3 : 1));
      double us = base_us + (steps - inter_steps) * intra_us + inter_steps * inter_us;
      // "Plateau effect of ring" (ncclTopoGetAlgoTime): a multi-node Simple all_reduce with at least 64
      // bytes per channel (of comm->nChannels) and rank takes 1.4x its latency on Ampere and later.
      if (p == Protocol::Simple && nodes > 1 && op == CommOp::AllReduce &&
          bytes / (static_cast<double>(nccl_coll_channels(g)) * n) >= 64) {
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
  (void)op;
  switch (a) {
    case Algorithm::Ring:
    case Algorithm::Direct:
    case Algorithm::Pairwise:
      if (p == Protocol::LL) {
        // Half of every LL line is flag: busBw * .5, then at most llMaxBw (nccl_bus_bw_cap).
        return 0.5;
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
      return kNvlsLinkFraction;
    case Algorithm::NvlsTree:
      return 1.0;
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

namespace ranklab::sim {

namespace {

// src/include/device.h of 2.21.5.
constexpr int kSteps = 8;                   // NCCL_STEPS: buffer slots per connection
constexpr int kSimpleMaxThreads = 512;      // NCCL_SIMPLE_MAX_NTHREADS
constexpr int kLlMaxThreads = 512;          // NCCL_LL_MAX_NTHREADS
constexpr int kLl128MaxThreads = 640;       // NCCL_LL128_MAX_NTHREADS
constexpr int kMaxThreads = 640;            // NCCL_MAX_NTHREADS (NVLS, NVLSTree)
constexpr int kLlThreadThreshold = 8;       // NCCL_LL_THREAD_THRESHOLD (x nRanks for the ring)
constexpr int kLl128ThreadThreshold = 8;    // NCCL_LL128_THREAD_THRESHOLD
constexpr int kSimpleThreadThreshold = 64;  // NCCL_SIMPLE_THREAD_THRESHOLD
constexpr int kWarp = 32;
// Buffer sizes per protocol (DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE of init.cc).
constexpr double kLlBuffBytes = 8.0 * kLlMaxThreads * kSteps * 16;         // 512 KiB
constexpr double kLl128BuffBytes = 120.0 * kLl128MaxThreads * kSteps * 8;  // 4,800 KiB
constexpr double kSimpleBuffBytes = 4.0 * 1024 * 1024;
constexpr int kRingChunkSteps = kSteps / 2;     // ALLREDUCE_CHUNKSTEPS (and all_gather, reduce_scatter)
constexpr double kNvlsChunkBytes = 128 * 1024;  // NCCL_NVLS_CHUNKSIZE
constexpr int kMaxChannels = 32;                // MAXCHANNELS

// llMaxBws, perChMaxRingLL128Bws, perChMaxTreeLL128Bws and perChMaxTreeBws of tuning.cc:
// [Volta, Ampere, Hopper, Blackwell][N1, N2, N4]; the Blackwell rows (twice Hopper's) are 2.27.7's.
// Across nodes the LL row is the CPU's (Intel, row 0); ranklab assumes Intel hosts.
constexpr double kLlMaxBw[4][3] = {
    {39.0, 39.0, 20.4}, {87.7, 22.5, 19.0}, {141.0, 45.0, 35.0}, {282.0, 90.0, 70.0}};
constexpr double kPerChRingLl128Bw[4][3] = {
    {20.0, 20.0, 20.0}, {20.0, 20.0, 20.0}, {36.7, 36.7, 36.7}, {73.4, 73.4, 73.4}};
constexpr double kPerChTreeLl128Bw[4][3] = {
    {20.0, 20.0, 20.0}, {20.0, 20.0, 20.0}, {36.7, 36.7, 29.0}, {73.4, 73.4, 58.0}};
constexpr double kPerChTreeBw[4][3] = {
    {26.5, 18.5, 10.0}, {24.0, 23.6, 17.8}, {38.7, 41.4, 36.0}, {77.4, 82.8, 72.0}};

// The speed arrays of src/graph/search.cc the graph search walks down, GB/s per channel: inside a node
// (speedArrayIntra, sm90SpeedArrayIntra; sm100SpeedArrayIntra of 2.27.7) and across nodes
// (speedArrayInter, sm90SpeedArrayInter; sm100SpeedArrayInter of 2.27.7).
constexpr double kSpeedIntra[] = {40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0};
constexpr double kSm90SpeedIntra[] = {60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0};
constexpr double kSm100SpeedIntra[] = {90.0, 80.0, 70.0, 60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0};
constexpr double kSpeedInter[] = {48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0,
                                  7.0,  6.0,  5.0,  4.0,  3.0,  2.4,  1.2,  0.24, 0.12};
constexpr double kSm90SpeedInter[] = {48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5,
                                      15.0, 12.0, 6.0,  3.0,  2.4,  1.2,  0.24, 0.12};
constexpr double kSm100SpeedInter[] = {96.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0,
                                       17.5, 15.0, 12.0, 6.0,  3.0,  2.4,  1.2,  0.24, 0.12};

std::span<const double> intra_speeds(int sm) {
  if (sm >= 100) return kSm100SpeedIntra;
  if (sm >= 90) return kSm90SpeedIntra;
  return kSpeedIntra;
}
std::span<const double> inter_speeds(int sm) {
  if (sm >= 100) return kSm100SpeedInter;
  if (sm >= 90) return kSm90SpeedInter;
  return kSpeedInter;
}
// The first speed of the array no faster than `limit_gbps` (search.cc starts there), the last if none.
double first_speed_within(std::span<const double> speeds, double limit_gbps) {
  for (double s : speeds) {
    if (s <= limit_gbps + 1e-9) return s;
  }
  return speeds.back();
}

int cc_index(int sm) {
  return sm >= 100 ? 3 : sm >= 90 ? 2 : sm >= 80 ? 1 : 0;
}
int node_index(int nodes) {
  return nodes <= 2 ? nodes - 1 : 2;
}

// search.cc's last step: a graph of `found` channels at `speed` is duplicated (ncclTopoDupChannels: up to
// MAXCHANNELS/2, each copy with its share of the speed) when the speed is at least 25 GB/s.
NcclGraph duplicated(int found, double speed) {
  NcclGraph r;
  r.channels = found;
  r.bw_intra_gbps = r.bw_inter_gbps = speed;
  if (speed >= 25.0) {
    r.channels = std::min(found * 2, kMaxChannels / 2);
    r.bw_intra_gbps = r.bw_inter_gbps = speed / ((r.channels + found - 1) / found);
  }
  return r;
}

// The ring graph inside a node: the fastest speed a GPU's links can carry at least once, as many channels
// of it as fit (at most MAXCHANNELS/2), then duplicated.
NcclGraph ring_graph(const GroupShape& g) {
  const double total = std::max(g.intra_gbps, 1e-9);
  const double speed = first_speed_within(intra_speeds(g.sm), total);
  return duplicated(std::clamp(static_cast<int>(std::floor(total / speed + 1e-9)), 1, kMaxChannels / 2),
                    speed);
}

}  // namespace

int gpu_sm(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("B200") || has("B300") || has("GB200") || has("Blackwell")) return 100;
  if (has("H100") || has("H200") || has("H20") || has("H800") || has("GH200")) return 90;
  if (has("V100")) return 70;
  return 80;
}

int nccl_coll_channels(const GroupShape& g) {
  // The ring graph's channels (across nodes one per NIC, duplicated in the search only when the speed a
  // NIC carries is at least 25 GB/s: not on 200 Gb/s NICs), duplicated again in ncclTopoPostset.
  return std::min(kMaxChannels, 2 * nccl_graph(Algorithm::Ring, g).channels);
}

double nccl_ring_graph_bw(const GroupShape& g) {
  const NcclGraph r = ring_graph(g);
  return r.channels * r.bw_intra_gbps;
}

double nccl_bus_factor(CommOp op, Algorithm a, const GroupShape& g) {
  const double n = g.ranks;
  switch (a) {
    case Algorithm::Ring:
      return ring_steps(op, g.ranks) / n;
    case Algorithm::Tree:
      return 2.0;
    case Algorithm::Nvls:
    case Algorithm::NvlsTree:
      return 6.0 / 5.0;
    default:
      return 1.0;
  }
}

double nccl_bus_bw_cap(CommOp op, Algorithm a, Protocol p, const GroupShape& g) {
  const double inf = std::numeric_limits<double>::infinity();
  const int ci = cc_index(g.sm), ni = node_index(g.nodes);
  const int graph_channels = std::max(1, nccl_coll_channels(g) / 2);
  // llMaxBw: the LL row is the GPU's on one node, the CPU's (Intel assumed) across nodes.
  const double ll_max = kLlMaxBw[g.nodes == 1 ? ci : 0][ni];
  if (a == Algorithm::Ring) {
    if (p == Protocol::LL) return ll_max;
    if (p == Protocol::LL128) return graph_channels * kPerChRingLl128Bw[ci][ni];
    return inf;
  }
  if (a == Algorithm::Tree) {
    double cap = graph_channels * kPerChTreeBw[ci][ni] * 0.92;
    if (p == Protocol::LL) cap = std::min(cap, ll_max);
    return cap;
  }
  if ((a == Algorithm::Nvls || a == Algorithm::NvlsTree) && op == CommOp::AllReduce) {
    // What one NVLS channel carries: its thread block copies through the switch's buffer with a bounded
    // number of requests in flight, whatever the link's speed. ranklab's own constant, fitted to one
    // figure (docs/validation.md lists it); NVLSTree's channel carries 4/5 of it (kNvlsTreeWarpFraction).
    const double per_channel_gbps =
        kNvlsChannelAlgGbps * (a == Algorithm::NvlsTree ? kNvlsTreeWarpFraction : 1.0);
    return nccl_nvls_channels(g) * per_channel_gbps * nccl_bus_factor(op, a, g);
  }
  return inf;
}

int nccl_nvls_channels(const GroupShape& g) {
  if (g.sm >= 100) return g.nodes > 1 ? 32 : 24;  // 2.27.7
  return 16;
}

NcclGraph nccl_graph(Algorithm a, const GroupShape& g) {
  NcclGraph r;
  const bool nvls = a == Algorithm::Nvls || a == Algorithm::NvlsTree;
  const double intra = std::max(g.intra_gbps, 1e-9);
  if (nvls) {
    // search.cc: an NVLS graph has one channel per GPU of the node (each GPU a head), at the fastest speed
    // of which that many fit on a GPU's links; across nodes each head leaves through its own NIC.
    r.channels = std::max(1, g.ranks_per_node);
    r.bw_intra_gbps = r.bw_inter_gbps = first_speed_within(intra_speeds(g.sm), intra / r.channels);
    if (g.nodes > 1) r.bw_inter_gbps = first_speed_within(inter_speeds(g.sm), g.nic_gbps);
    return r;
  }
  if (g.nodes == 1) return ring_graph(g);
  // Across nodes: one channel per NIC at the fastest inter-node speed a NIC carries, the same speed inside
  // the node (sameChannels), duplicated when that speed allows (not on 200 Gb/s NICs, whose 24 GB/s does
  // not).
  const double speed = first_speed_within(inter_speeds(g.sm), std::min(g.nic_gbps, intra));
  return duplicated(std::clamp(g.nics, 1, kMaxChannels / 2), speed);
}

double nccl_model_bw_gbps(CommOp op, Algorithm a, Protocol p, const GroupShape& g) {
  if (!nccl_supports(op, a, p, g)) return 0;
  if (a != Algorithm::Ring && a != Algorithm::Tree && a != Algorithm::Nvls && a != Algorithm::NvlsTree)
    return 0;
  // ncclTopoTuneModel of tuning.cc, line by line.
  const NcclGraph graph = nccl_graph(a, g);
  const int n = g.ranks, nodes = g.nodes;
  const double ppn = static_cast<double>(n) / nodes;
  const int ci = cc_index(g.sm), ni = node_index(nodes);
  const double ll_max = kLlMaxBw[nodes == 1 ? ci : 0][ni];
  double bw = nodes <= 2 ? graph.bw_intra_gbps : graph.bw_inter_gbps;
  if (a == Algorithm::Nvls) bw = std::min(graph.bw_intra_gbps, graph.bw_inter_gbps);
  if (a == Algorithm::NvlsTree) {
    bw = std::min(graph.bw_intra_gbps, nodes <= 2 ? graph.bw_inter_gbps : graph.bw_inter_gbps / 2);
  }
  double bus = graph.channels * bw;
  if (a == Algorithm::Ring && p == Protocol::LL) bus = std::min(ll_max, bus * 0.5);
  if (a == Algorithm::Ring && p == Protocol::LL128) {
    bus = std::min(bus * (ppn < 2 ? 0.7 : 0.92), graph.channels * kPerChRingLl128Bw[ci][ni]);
  }
  if (a == Algorithm::Tree) bus = std::min(bus * 0.92, graph.channels * kPerChTreeBw[ci][ni]);
  if (a == Algorithm::Tree && p == Protocol::LL) bus = std::min(bus / 3.8, ll_max);
  if (a == Algorithm::Tree && p == Protocol::LL128) {
    bus =
        std::min(bus * (nodes == 1 ? 7.0 / 9.0 : 120.0 / 128.0), graph.channels * kPerChTreeLl128Bw[ci][ni]);
  }
  // Bus bandwidth to algorithm bandwidth: a ring's nRanks / nsteps, NVLS's 5/6, a tree's 1/2.
  if (a == Algorithm::Ring) return bus * n / ring_steps(op, n);
  if (a == Algorithm::Nvls || a == Algorithm::NvlsTree) return bus * 5.0 / 6.0;
  return bus * 0.5;
}

double nccl_model_transfer_us(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes) {
  double bw = nccl_model_bw_gbps(op, a, p, g);
  if (bw <= 0) return -1;
  if (a == Algorithm::Tree) bw *= nccl_tree_correction(p, bytes);
  return bytes / (1000 * bw);
}

LaunchShape nccl_launch(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes) {
  LaunchShape l;
  const bool nvls = a == Algorithm::Nvls || a == Algorithm::NvlsTree;
  int nc = nvls ? nccl_nvls_channels(g) : nccl_coll_channels(g);
  // comm->maxThreads (ncclTopoTuneModel): Simple rings get 256 threads when the graph is no faster than
  // PCIe (PCI_BW, 12 GB/s), else 512; LL 512; LL128 640; NVLS 640.
  int nt = nvls                                                      ? kMaxThreads
           : p == Protocol::LL                                       ? kLlMaxThreads
           : p == Protocol::LL128                                    ? kLl128MaxThreads
           : (a == Algorithm::Ring && nccl_ring_graph_bw(g) <= 12.0) ? 256
                                                                     : kSimpleMaxThreads;
  double threshold = p == Protocol::LL      ? kLlThreadThreshold
                     : p == Protocol::LL128 ? kLl128ThreadThreshold
                                            : kSimpleThreadThreshold;
  if (a == Algorithm::Ring && p == Protocol::LL) threshold *= g.ranks;
  if (!nvls) {
    // getChannnelThreadInfo: fewer channels, then fewer threads, until each thread has its share of work.
    while (bytes < static_cast<double>(nc) * nt * threshold && nc >= 2) --nc;
    while (bytes < static_cast<double>(nc) * nt * threshold && nt % 128 == 0) nt /= 2;
  }
  if (p == Protocol::Simple && a == Algorithm::Ring) nt += kWarp;
  if (p == Protocol::Simple && a == Algorithm::Tree) nt += 4 * kWarp;
  if (nt / kWarp < 3) nt = 3 * kWarp;
  l.channels = nc;
  l.threads = nt;

  // computeCollChunkInfo: the chunk each channel moves per step.
  const double buff = p == Protocol::LL      ? kLlBuffBytes
                      : p == Protocol::LL128 ? kLl128BuffBytes
                                             : kSimpleBuffBytes;
  const double step = buff / kSteps;
  const int chunk_steps = (p == Protocol::Simple && a == Algorithm::Ring) ? kRingChunkSteps : 1;
  double chunk = step * chunk_steps;
  if (p == Protocol::LL) chunk /= 2;
  if (p == Protocol::LL128) chunk = std::floor(chunk / 16) * 15;  // NCCL_LL128_LINEELEMS, DATAELEMS
  const int heads = nvls ? std::max(1, g.ranks_per_node) : 1;
  const double concurrent = static_cast<double>(nc) * heads;
  if (a == Algorithm::Nvls) {
    chunk = std::min(chunk, kNvlsChunkBytes);
    if (bytes < 64 * concurrent * chunk && chunk > 65536) chunk = 65536;
    if (bytes < 8 * concurrent * chunk && chunk > 32768) chunk = 32768;
    if (bytes < 2 * concurrent * chunk && chunk > 16384) chunk = 16384;
  } else if (a == Algorithm::NvlsTree) {
    chunk = kNvlsChunkBytes;
    if (g.nodes >= 4) chunk = std::min(chunk, 65536.0);  // NCCL_NVLSTREE_MAX_CHUNKSIZE default
    if (bytes < 32 * concurrent * chunk && chunk > 262144) chunk = 262144;
    if (bytes < 16 * concurrent * chunk && chunk > 131072) chunk = 131072;
    if (bytes < 4 * concurrent * chunk && chunk > 65536) chunk = 65536;
    if (bytes < 1 * concurrent * chunk && chunk > 32768) chunk = 32768;
  }
  l.chunk_bytes = chunk;
  l.heads = heads;
  // computeCollSteps: the ring moves nRanks chunks per loop (one per rank), NVLS one per head.
  const double per_loop = a == Algorithm::Ring ? concurrent * g.ranks * chunk : concurrent * chunk;
  l.chunks = std::max(1.0, std::ceil(bytes / per_loop));
  // Pipeline stages a chunk passes through before the next can use them, from the kernels' structure
  // (src/device/all_reduce.h): NVLS all_reduce scatters into the switch buffer, reduces and multicasts
  // there, and gathers out (3); all_gather and reduce_scatter have one copy stage besides the switch (2);
  // NVLSTree adds a network hop up and down per tree level. The stage through the switch paces a loop;
  // nccl_launch_slowdown weighs the others. Rings and trees run every step on every rank at once, so
  // NCCL's per-step latencies already hold their fill.
  if (a == Algorithm::Nvls) l.depth = op == CommOp::AllReduce ? 3 : 2;
  if (a == Algorithm::NvlsTree) {
    l.depth = 3;
    l.net_hops = 2 * log2i(g.nodes);
  }
  return l;
}

namespace {

// The part of a pipeline loop's time that one stage takes alone, at most the whole loop: the stage's
// bytes come at `stage_gbps` (its part of the plan's algorithm bandwidth) and cross a resource that
// carries `resource_gbps`.
double loop_share(double stage_gbps, double resource_gbps) {
  return std::min(1.0, stage_gbps / std::max(resource_gbps, 1e-9));
}

}  // namespace

double nccl_net_hop_weight(const GroupShape& g, double alg_gbps) {
  return loop_share(alg_gbps, 2.0 * std::max(1, g.nics) * g.nic_gbps);
}

double nccl_copy_stage_weight(const GroupShape& g, const LaunchShape& l, double alg_gbps) {
  const int heads = std::max(1, l.heads);
  return loop_share((heads - 1.0) / heads * alg_gbps, g.intra_gbps);
}

double nccl_launch_slowdown(Algorithm a, const GroupShape& g, const LaunchShape& l, double alg_gbps) {
  double f = 1.0;
  if (a == Algorithm::Ring || a == Algorithm::Tree) {
    // Bandwidth follows the channels used. ncclTopoGetAlgoTime scales it by nChannels / comm->nChannels;
    // but comm->nChannels is the graph's channels duplicated once more on the same paths (connect.cc), so
    // the graph's channels (half of them) already carry the full bandwidth, each its bwIntra. ranklab
    // scales by the graph's channels: full bandwidth down to comm->nChannels / 2 channels, then in
    // proportion (docs/model.md; docs/validation.md checks it against small-message times).
    const double graph_channels = std::max(1, nccl_coll_channels(g) / 2);
    f *= std::max(1.0, graph_channels / l.channels);
  }
  // Rings and trees have one stage and no hops: nothing is added.
  if (l.depth == 1 && l.net_hops == 0) return f;
  const double copies = (l.depth - 1) * nccl_copy_stage_weight(g, l, alg_gbps);
  const double hops = l.net_hops * nccl_net_hop_weight(g, alg_gbps);
  return f * ((l.chunks + copies + hops) / l.chunks);
}

namespace {

// NCCL rounds channel counts up to powers of two (pow2Up).
int pow2_up(int v) {
  return static_cast<int>(std::bit_ceil(static_cast<unsigned>(std::max(1, v))));
}

// The NCCL_P2P_*_CHUNKSIZE defaults (init.cc): across nodes (NET), all NVLink, otherwise (PCI).
constexpr double kP2pNetChunkBytes = 128 * 1024;
constexpr double kP2pNvlChunkBytes = 512 * 1024;
constexpr double kP2pPciChunkBytes = 128 * 1024;

}  // namespace

P2pComm nccl_p2p_comm(const GroupShape& comm) {
  const int n = std::max(1, comm.ranks);
  // ncclTopoComputeP2pChannels: comm->p2pnChannels from comm->nChannels; a peer's channels are the fewest
  // any pair of GPUs gets: 2 per NVLink link through the switch, 2 over PCIe, and across nodes 2 (halved
  // while 2 x nRanks exceeds 4 x p2pnChannels; one NIC per GPU here), all rounded up to powers of two.
  const int p2p_channels = std::min(kMaxChannels, nccl_coll_channels(comm));
  int peer_channels = comm.nvlink && comm.nvlink_links > 0 ? 2 * comm.nvlink_links : 2;
  if (comm.nodes > 1) {
    int net = 2;
    while (net * n > p2p_channels * 4 && net > 1) net /= 2;
    peer_channels = std::min(peer_channels, net);
  }
  P2pComm c;
  c.per_peer = pow2_up(std::min(p2p_channels, peer_channels));
  // scheduleP2pTasksToPlan: from a peer's channels down to what lets every peer have one of the
  // communicator's channels at once.
  const int p2p_channels_pow2 = pow2_up(p2p_channels);
  c.fewest = c.per_peer;
  while (c.fewest * n > p2p_channels_pow2 && c.fewest > 1) c.fewest /= 2;
  c.step_bytes = std::min(comm.nodes > 1 ? kP2pNetChunkBytes
                          : comm.nvlink  ? kP2pNvlChunkBytes
                                         : kP2pPciChunkBytes,
                          kSimpleBuffBytes / kSteps);
  c.min_bytes = comm.nodes > 1 ? c.step_bytes / 2 : c.step_bytes / 8;
  c.max_bytes = comm.nodes > 1 ? c.step_bytes : c.step_bytes * 32;
  return c;
}

P2pLaunch nccl_p2p_launch(const P2pComm& comm, double bytes) {
  P2pLaunch l;
  if (bytes <= 0) return l;
  // calcP2pChunkSize: a piece per channel of the fewest, more channels while a piece is over the maximum.
  int channels = comm.fewest;
  double size = std::max(comm.min_bytes, std::ceil(bytes / channels));
  while (size > comm.max_bytes && channels <= comm.per_peer / 2) {
    channels *= 2;
    size = std::ceil(bytes / channels);
  }
  size = std::ceil(size / comm.min_bytes) * comm.min_bytes;
  l.part_bytes = std::min(size, std::max(bytes, 1.0));
  l.parts = static_cast<int>(std::max(1.0, std::ceil(bytes / size)));
  l.steps = std::max(1.0, std::ceil(l.part_bytes / comm.step_bytes));
  return l;
}

double nccl_p2p_slowdown(const P2pLaunch& l, Protocol p) {
  if (p != Protocol::Simple || l.steps <= 0) return 1.0;
  return (l.steps + 1) / l.steps;
}

double nccl_loop_overhead_us(Algorithm a, const LaunchShape& l) {
  if (a != Algorithm::Nvls && a != Algorithm::NvlsTree) return 0;
  // NCCL's 5/6 is NVLS with NCCL_NVLS_CHUNKSIZE chunks, where the loops' waits are already part of it; a
  // chunk of half that size pays half a wait more per loop than the 5/6 holds, one of a quarter three
  // quarters. The first loop's waits are in NCCL's latency (hwLat), which was measured with one loop. The
  // wait is per head.
  const double per_loop_us = kNvlsLoopOverheadUs * l.heads / kNvlsLoopOverheadHeads;
  return per_loop_us * (l.chunks - 1) * std::max(0.0, 1 - l.chunk_bytes / kNvlsChunkBytes);
}

}  // namespace ranklab::sim
