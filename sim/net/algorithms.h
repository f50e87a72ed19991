// Algorithms: how each collective algorithm of NCCL moves data over the topology, as flows.
//
// Every function here returns the plan of a *unit* message (nccl-tests size S = 1 byte): each flow's
// payload is the share of S it carries. Plans scale linearly with S, so the network model builds one per
// group and algorithm and multiplies. Latency and protocol are filled in by the network model from
// NCCL's tuning (sim/net/nccl_tuning.h).
//
// What crosses which link, per algorithm (n members, m per node, C channels):
//   ring       a ring through every member; all_reduce sends 2(n-1)/n of S over every ring edge,
//              all_gather and reduce_scatter (n-1)/n, broadcast and reduce S over every edge but one.
//              Across nodes, C rings run side by side, each leaving a node through a different NIC (rail),
//              each with S/C of the data: NCCL's channels.
//   tree       all_reduce as NCCL's double binary tree: each node's members in a chain, each carrying S
//              up (reduce) and down (broadcast); between nodes two binary trees, each with half of S.
//   nvls       NVSwitch reduces in the switch: for all_reduce every GPU sends S (1 + 1/n) up to the switch
//              and receives as much (reduce-scatter by multimem loads, all-gather by multimem stores).
//   nvls_tree  NVLS inside each node, then member j of every node all-reduces its S/m over a double binary
//              tree on rail j, then NVLS again.
//   direct     scatter and gather: S/n between the root and each member; send/recv: S from one to one.
//   pairwise   all_to_all: S/n from every member to every other, as NCCL runs it: grouped send/recv, one
//              message per ordered pair, each its own flow on its own route, so that max-min sharing sees
//              which links and which pairs carry the most. Every route starts on its sender's link and
//              ends on its receiver's, so no two pairs share one and each pair stays a flow: n(n-1) flows.
//              With uneven splits likewise, each pair with its own bytes (pairwise_uneven_plan).
#pragma once

#include <cstdint>
#include <vector>

#include "common/rank.h"
#include "sim/net/comm_plan.h"
#include "sim/net/nccl_tuning.h"
#include "sim/net/topology.h"

namespace ranklab::sim {

// Where a group's members are.
struct GroupLayout {
  std::vector<int> ranks;               // global GPU of each member, in group order
  std::vector<std::vector<int>> nodes;  // the members on each node they use, GPUs ascending; nodes ascending
  int channels = 1;                     // rings (or trees) side by side: NICs each node's members reach
  GroupShape shape;                     // what NCCL's tuning needs to know
};
GroupLayout layout_group(const Topology& topo, const std::vector<int>& ranks);

// Unit plans (payload per byte of S). `root` is a global rank (broadcast, reduce, scatter, gather).
CommPlan ring_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root);
CommPlan tree_plan(const Topology& topo, const GroupLayout& g);
CommPlan nvls_plan(const Topology& topo, const GroupLayout& g, CommOp op);
CommPlan nvls_tree_plan(const Topology& topo, const GroupLayout& g);
CommPlan direct_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root);
CommPlan pairwise_plan(const Topology& topo, const GroupLayout& g);
// An all_to_all with uneven splits, in bytes rather than per byte of S: member i sends pair_bytes[i * n + j]
// to member j, one flow per pair that moves anything (the piece a member keeps crosses no link).
CommPlan pairwise_uneven_plan(const Topology& topo, const GroupLayout& g,
                              const std::vector<std::int64_t>& pair_bytes);
CommPlan p2p_plan(const Topology& topo, int src, int dst);

// The unit plan of `a` for `op` (one of the above).
CommPlan unit_plan(const Topology& topo, const GroupLayout& g, CommOp op, Algorithm a, int root);

// NCCL's double binary tree over k = 0..count-1 (Sanders, Speck & Traeff, "Two-tree algorithms for full
// bandwidth broadcast, reduction and scan", Parallel Computing 2009): the parent of `k` in tree 0 or 1,
// -1 for the root. Every index is a leaf in one tree and interior in the other (for count > 2).
int dtree_parent(int k, int count, int tree);

}  // namespace ranklab::sim
