// NCCL's tuning model: which algorithms and protocols a collective may use, what each costs in latency,
// what fraction of a link's bandwidth each protocol delivers, how many channels and threads a call gets
// and how its chunks flow through the pipeline.
//
// WHICH RELEASE: every constant and formula here is ported from NVIDIA/nccl at tag v2.21.5-1 (NCCL 2.21.5),
// except what that release cannot know: Blackwell (compute capability 10.0) arrived in NCCL 2.25, so the
// Blackwell rows of the tables, the SM100 speed array, the Blackwell NVLS channel counts and LL128's
// enabling on Blackwell come from tag v2.27.7-1 (NCCL 2.27.7), each marked "2.27.7" where it is used.
// Nothing else of 2.27.7 (its PAT algorithm, its changed tree latencies) is ported: a B200 runs 2.21.5's
// model with 2.27.7's Blackwell constants. The files of 2.21.5:
//   src/graph/tuning.cc   baseLat, hwLat, llMaxBws, perChMaxRingLL128Bws, perChMaxTreeBws, the protocol
//                         refinements of ncclTopoTuneModel, treeCorrectionFactor, ncclTopoGetAlgoTime,
//                         getNetOverhead, NCCL_NTHREADS defaults, threadThresholds
//   src/enqueue.cc        getChannnelThreadInfo (channels and threads by size), computeCollChunkInfo
//                         (chunk sizes per algorithm and protocol), computeCollSteps (steps per chunk),
//                         scheduleP2pTasksToPlan and calcP2pChunkSize (a peer's pieces)
//   src/graph/paths.cc    ncclTopoComputeP2pChannels (a peer's channels)
//   src/init.cc           NCCL_P2P_NET_CHUNKSIZE, NCCL_P2P_NVL_CHUNKSIZE, NCCL_P2P_PCI_CHUNKSIZE
//   src/device/all_reduce.h  the warps of NVLS's and NVLSTree's groups (kNvlsTreeWarpFraction)
//   src/include/device.h  NCCL_STEPS, NCCL_*_MAX_NTHREADS, NCCL_*_THREAD_THRESHOLD, buffer sizes
//   src/graph/search.cc   the speed arrays and channel duplication that give comm->nChannels
//   src/graph/connect.cc  the second duplication of channels (ncclTopoPostset)
//   src/transport/nvls.cc NCCL_NVLS_NCHANNELS (16) and NCCL_NVLS_CHUNKSIZE (128 KiB)
// nccl_tuning.cc cites each one where it is used. ranklab's own part is how they are applied to flows
// over links, the pipeline of NVLS (the stages of its kernel, each weighed by the rate of what it crosses)
// and of a point-to-point piece, and the two fitted NVLS constants (kNvlsChannelAlgGbps,
// kNvlsLoopOverheadUs), each said where it is used.
//
// NCCL picks, for each call, the (algorithm, protocol) with the least predicted time, latency + bytes /
// bandwidth; ranklab predicts the bandwidth part from the flows of the plan on the modelled links instead
// of from NCCL's per-channel bandwidth table, and keeps NCCL's latencies and its caps.
#pragma once

#include <string>

#include "common/rank.h"
#include "sim/net/comm_plan.h"

namespace ranklab::sim {

// Where a group's members sit, as far as NCCL's model cares.
struct GroupShape {
  int ranks = 1;            // members
  int nodes = 1;            // nodes the members are on
  int ranks_per_node = 1;   // members per node (the most on any node)
  bool nvlink = false;      // the hop inside a node is NVLink (else PCIe)
  bool nvls = false;        // the NVSwitch reduces in the switch
  bool uniform = true;      // every node holds the same number of members
  int channels = 1;         // parallel rings or trees the plan uses
  double net_extra_us = 0;  // fabric latency beyond one switch hop, added to each network step
  int sm = 80;              // compute capability x 10 of the GPUs (70, 80, 90, 100)
  double intra_gbps = 0;    // what NCCL sustains from one GPU into the node: NVLink (or PCIe), per direction
  int nics = 1;             // NICs every node's members reach (several nodes)
  int nvlink_links = 0;     // NVLink links of a GPU (0 without NVLink)
  double nic_gbps = 0;      // one NIC's line rate, as NCCL reads it (its speed in Mb/s / 8000)
};

// The compute capability (x 10) of a GPU by its name: A100 80, H100/H200/H20/H800 90, B200/GB200 100.
int gpu_sm(const std::string& gpu_name);

// comm->nChannels of NCCL for a group: the ring graph's channels, duplicated twice (search.cc, connect.cc).
int nccl_coll_channels(const GroupShape& g);
// The ring graph's bus bandwidth in NCCL's model (graph nChannels x bwIntra), GB/s.
double nccl_ring_graph_bw(const GroupShape& g);
// comm->nvlsChannels: 16 on Hopper (NCCL_NVLS_NCHANNELS of 2.21.5); on Blackwell 24 inside one node and 32
// across nodes (NVLS_NCHANNELS_SM100_NVL and NVLS_NCHANNELS_SM100, src/transport/nvls.cc of 2.27.7).
int nccl_nvls_channels(const GroupShape& g);

// What NCCL launches for one call: channels (blocks), threads per block, the chunk size each channel moves
// per step, and how many chunks each channel handles one after another (loops of the pipeline).
struct LaunchShape {
  int channels = 1;
  int threads = 0;
  double chunk_bytes = 0;
  double chunks = 1;  // per channel, in sequence (at least 1)
  int depth = 1;      // pipeline stages a chunk passes through: the one that paces a loop, and copies
  int net_hops = 0;   // NVLSTree: the network hops a chunk takes besides, up and down each tree level
  int heads = 1;      // NVLS and NVLSTree: the heads a loop's chunks go to, one per GPU of the node
};
// getChannnelThreadInfo and computeCollChunkInfo of src/enqueue.cc for a call of `bytes` (nccl-tests size)
// that runs (a, p).
LaunchShape nccl_launch(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes);

// The fraction of the full-channel transfer time that the launch adds: comm->nChannels / channels for
// rings and trees (NCCL scales bandwidth with the channels used, ncclTopoGetAlgoTime), times the pipeline's
// fill and drain (chunks + the other stages) / chunks. One stage, the one that reduces or multicasts
// through the switch, sets the pace of a loop; the copy stages around it and NVLSTree's network hops each
// count for the part of a loop's time they take alone (nccl_copy_stage_weight, nccl_net_hop_weight), given
// the plan's algorithm bandwidth `alg_gbps`.
double nccl_launch_slowdown(Algorithm a, const GroupShape& g, const LaunchShape& l, double alg_gbps);
// How long one of NVLS's copy stages takes alone, as a fraction of a loop of its pipeline (at most 1): the
// scatter group copies the loop's chunk for every other head out over NVLink, and the gather group copies
// every other head's chunk in (all_reduce.h of 2.21.5), each at what NCCL sustains over the GPU's NVLink,
// while a loop moves heads x chunk bytes of the message at the plan's algorithm bandwidth. So the fraction
// is (heads - 1) / heads x alg_gbps / the NVLink rate: 7/8 x 274 / 371 = 0.65 on 8x H100, 7/8 x 482 / 722
// = 0.58 on 8x B200, from the rates alone.
double nccl_copy_stage_weight(const GroupShape& g, const LaunchShape& l, double alg_gbps);
// How long one of NVLSTree's network hops takes, as a fraction of a loop of its pipeline (at most 1): a loop
// moves channels x heads x chunk bytes of the message at the plan's algorithm bandwidth; a hop sends, from
// each NIC, the chunks of the half of the channels whose tree sends that way from this node. So the
// fraction is alg_gbps / (2 x NICs x a NIC's rate): 257 / (2 x 8 x 50) = 0.32 on 2x8 H100, where NVLink
// and the channels bound the loop; 0.47 on 2x8 B200, whose NICs bound it.
double nccl_net_hop_weight(const GroupShape& g, double alg_gbps);

// What one loop of an NVLS channel costs beyond moving its bytes, in microseconds, with 8 heads: at every
// loop the kernel's scatter and gather warp groups wait for the heads' flags across the switch and then
// copy the loop's chunk of each head in turn, one copy after another (the loop over peers of
// ScatterGatherOp, src/device/prims_simple.h, which NCCL 2.21.5's NVLS all_reduce runs through
// prims.scatter and prims.gather): a fixed cost per head's copy, however small the chunk. A loop of h heads
// pays h / kNvlsLoopOverheadHeads of it: a GB200 NVL72 rack's 72 heads nine times as much. NCCL picks smaller
// chunks for smaller calls (computeCollChunkInfo: 64 KiB below 1 GiB on 8x H100, 32 KiB below 64 MiB), so the
// same wait is spread over fewer bytes; this is why NVLS's bus bandwidth steps up where the chunk doubles (8x
// H100: 437 GB/s at 512 MiB, 466 GB/s at 1 GiB [dgxc-benchmarking]; 8x B200: 722 and 816 GB/s at 1 and 2
// GiB). Fitted, by least squares on the log of bus bandwidth, to the NVLS rows of one sweep: 8x H100 (8
// heads), validation/h100x8-all_reduce-dgxc-benchmarking.log (docs/validation.md lists it as fitted), with
// the pipeline's copy stages weighed by nccl_copy_stage_weight (it was 2.3 while each stage counted for a
// whole loop).
constexpr double kNvlsLoopOverheadUs = 5.7;
// The heads of the sweep kNvlsLoopOverheadUs is fitted to.
constexpr int kNvlsLoopOverheadHeads = 8;
// The time an NVLS or NVLSTree launch spends in its loops' waits beyond what NCCL's 5/6 holds (see
// kNvlsLoopOverheadUs); 0 for other algorithms.
double nccl_loop_overhead_us(Algorithm a, const LaunchShape& l);

// The algorithm bandwidth one NVLS channel sustains on an all_reduce, GB/s: NVLS needs its 16 channels
// to reach NVLink 4's peak, and on NVLink 5 its 24 channels, not the links, bound it. Fitted to one
// figure: 8x B300 (NVLink 5) reaching 845 GB/s of NVLS bus bandwidth, NVIDIA/nccl issue 2140 (845 / (2 x
// 7/8) / 24 channels). It does not bind on Hopper (16 x 20.1 = 322 GB/s, above NVLink 4's 275).
constexpr double kNvlsChannelAlgGbps = 20.1;

// What an NVLSTree channel carries of what an NVLS channel does: the channel is as fast as its narrowest
// warp group. NVLS's all_reduce kernel on one node gives the group that reduces and multicasts through the
// switch 5 of its 20 warps; NVLSTree's gives the group that receives from the network and multicasts 4, on
// every node that has a parent in the channel's tree, and each channel has such a node (all_reduce.h of
// NCCL 2.21.5: bcastWarps 4, reduceWarps 5). Taken from the source, not fitted: it binds on 2x8 H100
// (16 x 20.1 x 4/5 = 257 GB/s of algorithm bandwidth, below NVLink's 275), not where the NICs bind first.
constexpr double kNvlsTreeWarpFraction = 4.0 / 5.0;

// NCCL's per-protocol bandwidth ceilings (llMaxBw, perChMaxRingLL128Bw, perChMaxTreeBw x channels), and
// the NVLS channels' (kNvlsChannelAlgGbps; x kNvlsTreeWarpFraction for NVLSTree), as bus bandwidth in
// GB/s; infinity where none applies.
double nccl_bus_bw_cap(CommOp op, Algorithm a, Protocol p, const GroupShape& g);
// Bus bytes per byte of nccl-tests size in NCCL's conversion (ring nsteps / nRanks, tree 2, NVLS 6/5).
double nccl_bus_factor(CommOp op, Algorithm a, const GroupShape& g);

// Whether NCCL would run `op` with algorithm `a` and protocol `p` on this group.
bool nccl_supports(CommOp op, Algorithm a, Protocol p, const GroupShape& g);

// NCCL's predicted latency in microseconds of `op` with (a, p) on this group for a message of `bytes`.
double nccl_latency_us(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes);

// What NVLS moves through the switch of a link's sustained bandwidth: tuning.cc converts NVLS bus
// bandwidth to algorithm bandwidth with 5/6; on 8x H100 that reproduces the published ~480 GB/s NVLS bus
// bandwidth from NVLink's sustained 370 GB/s (docs/validation.md). NVLSTree's plan applies it to its NVLink
// flows only (its network part is a tree of sends).
constexpr double kNvlsLinkFraction = 5.0 / 6.0;

// The fraction of a link's sustained bandwidth that (a, p) turns into moved data, relative to the Simple
// protocol on a ring: each flow of the plan occupies its links for payload / this. NVLSTree's is 1: its
// plan holds NVLS's fraction on the NVLink flows.
double nccl_bandwidth_factor(CommOp op, Algorithm a, Protocol p, const GroupShape& g);

// NCCL's size-dependent correction of tree bandwidth for medium messages (treeCorrectionFactor).
double nccl_tree_correction(Protocol p, double bytes);

// ---- NCCL's own prediction: what it chooses by --------------------------------------------------------
// NCCL picks (algorithm, protocol) by its model, not by what the machine will do. ranklab chooses the same
// way, from the tables below, and then times the choice with its flows over the links.

// A graph of NCCL's topology search (src/graph/search.cc): its channels and the bandwidth each carries
// inside a node and across nodes, GB/s (graph->nChannels, bwIntra, bwInter).
struct NcclGraph {
  int channels = 1;
  double bw_intra_gbps = 0;
  double bw_inter_gbps = 0;
};
// The graph NCCL searches for algorithm `a` (ring and tree share the ring's on these topologies; NVLS and
// NVLSTree have one channel per GPU of the node).
NcclGraph nccl_graph(Algorithm a, const GroupShape& g);
// comm->bandwidths[op][a][p] of ncclTopoTuneModel: NCCL's algorithm bandwidth, GB/s; 0 where NCCL would not
// run (a, p).
double nccl_model_bw_gbps(CommOp op, Algorithm a, Protocol p, const GroupShape& g);
// ncclTopoGetAlgoTime's bytes / bandwidth, with the tree's size correction; negative where NCCL would not
// run (a, p). NCCL's predicted time is nccl_latency_us (which holds the ring's plateau) plus this.
double nccl_model_transfer_us(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes);

// NCCL sends point-to-point messages up to this size with the LL protocol (NCCL_P2P_LL_THRESHOLD).
constexpr double kP2pLlThresholdBytes = 16384;

// What a communicator of the shape `comm` gives every peer of a grouped point-to-point call, whatever its
// size (ncclTopoComputeP2pChannels of src/graph/paths.cc, scheduleP2pTasksToPlan of src/enqueue.cc, the
// NCCL_P2P_*_CHUNKSIZE defaults of src/init.cc; 2.21.5).
struct P2pComm {
  int per_peer = 1;       // comm->p2pnChannelsPerPeer: the most channels a peer's message may use
  int fewest = 1;         // what every peer gets at least: all peers at once fill the channels
  double step_bytes = 0;  // comm->p2pChunkSize: what one step moves through the peer's buffer
  double min_bytes = 0;   // the smallest piece
  double max_bytes = 0;   // the largest piece while channels can still double
};
P2pComm nccl_p2p_comm(const GroupShape& comm);
// How NCCL cuts one peer's message of `bytes` into pieces (calcP2pChunkSize of src/enqueue.cc).
struct P2pLaunch {
  int parts = 0;          // pieces of the message, each a work element on its own channel
  double part_bytes = 0;  // the size of a piece (the last may be smaller)
  double steps = 0;  // steps of one piece of comm->p2pChunkSize, one after another (0 for an empty message)
};
P2pLaunch nccl_p2p_launch(const P2pComm& comm, double bytes);
// The fill and drain of a piece's pipeline, as a factor on its bandwidth time: a step is copied into the
// peer's buffer by the sender's thread block and out of it by the receiver's, two stages, so K steps take
// K + 1 step times. LL (up to NCCL_P2P_LL_THRESHOLD) flags every line and streams: 1.
double nccl_p2p_slowdown(const P2pLaunch& l, Protocol p);

}  // namespace ranklab::sim
