// NCCL's tuning model: which algorithms and protocols a collective may use, what each costs in latency,
// and what fraction of a link's bandwidth each protocol delivers. The constants and formulas are those of
// src/graph/tuning.cc of NVIDIA/nccl (the version with NVLS and NVLSTree, NCCL 2.19-2.21), cited one by
// one in nccl_tuning.cc; ranklab's own part is only how they are applied to flows over links.
//
// NCCL picks, for each call, the (algorithm, protocol) with the least predicted time, latency + bytes /
// bandwidth; ranklab predicts the bandwidth part from the flows of the plan on the modelled links instead
// of from NCCL's per-channel bandwidth table, and keeps NCCL's latencies.
#pragma once

#include "common/rank.h"
#include "sim/comm_plan.h"

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
};

// Whether NCCL would run `op` with algorithm `a` and protocol `p` on this group.
bool nccl_supports(CommOp op, Algorithm a, Protocol p, const GroupShape& g);

// NCCL's predicted latency in microseconds of `op` with (a, p) on this group for a message of `bytes`.
double nccl_latency_us(CommOp op, Algorithm a, Protocol p, const GroupShape& g, double bytes);

// The fraction of a link's sustained bandwidth that (a, p) turns into moved data, relative to the Simple
// protocol on a ring: each flow of the plan occupies its links for payload / this.
double nccl_bandwidth_factor(CommOp op, Algorithm a, Protocol p, const GroupShape& g);

// NCCL's size-dependent correction of tree bandwidth for medium messages (treeCorrectionFactor).
double nccl_tree_correction(Protocol p, double bytes);

// NCCL sends point-to-point messages up to this size with the LL protocol (NCCL_P2P_LL_THRESHOLD).
constexpr double kP2pLlThresholdBytes = 16384;

}  // namespace ranklab::sim
