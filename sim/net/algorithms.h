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
//              Grouped send/recv too, so on PXN's routes.
//   pairwise   all_to_all: S/n from every member to every other, as NCCL runs it: grouped send/recv, one
//              message per ordered pair, each its own flow on its own route, so that max-min sharing sees
//              which links and which pairs carry the most. Every route starts on its sender's link and
//              ends on its receiver's, so no two pairs share one and each pair stays a flow: n(n-1) flows.
//              With uneven splits likewise, each pair with its own bytes (pairwise_uneven_plan).
//
// Routes between nodes follow NCCL's PXN (2.21.5, on by default): see pxn_relays below.
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
  // PXN: relays[k][j] is the GPU whose NIC carries a send from a member on node nodes[k] to a GPU of local
  // index j on another node (pxn_relays); empty when PXN is off or the group is on one node.
  std::vector<std::vector<int>> relays;
  // The GPU whose NIC carries a send from member `src` to GPU `dst`: src itself unless PXN relays it.
  int relay(const Topology& topo, int src, int dst) const;
};
// `pxn`: whether sends between nodes may go through another GPU's NIC (NCCL_PXN_DISABLE=0, the default).
GroupLayout layout_group(const Topology& topo, const std::vector<int>& ranks, bool pxn = true);

// PXN ("PCI x NVLink"), as NCCL 2.21.5 routes a send between nodes (src/graph/search.cc,
// ncclTopoGetNetDev with NCCL_P2P_PXN_LEVEL = 2, its default; NCCL_PXN_DISABLE = 0 by default,
// src/graph/paths.cc ncclPxnDisable). A sender uses the NIC local to the communicator's GPU on its own
// node that has the receiver's device index (ncclTopoDevToRank, ncclTopoGetLocalNet); the receiver always
// receives through its own NIC (src/transport/net.cc recvSetup asks for its own rank's device). The
// sender's data reaches that NIC through the first of the communicator's GPUs the NIC is local to
// (ncclTopoGetLocalGpu), over NVLink, when that GPU is NVLink-connected to the sender and reaches the NIC
// through PCIe switches alone (PATH_NVL and PATH_PXB); it then writes into that GPU's memory and the NIC
// reads from there (src/transport/net.cc sendSetup, proxyRank). Otherwise (no NVLink, no such GPU in the
// communicator) the sender keeps its own NIC: NCCL_CROSS_NIC is 2 by default, so the receiver's rail is
// not forced (search.cc). On a rail-optimised fabric a send to local index j therefore leaves on rail j,
// the receiver's, and stays on that rail's leaf.
//
// `members`: the communicator's GPUs on one node, ascending. Returns, per local index j of a receiver on
// another node, the GPU whose NIC a sender among `members` uses, or -1 where each sender uses its own.
std::vector<int> pxn_relays(const Topology& topo, const std::vector<int>& members);

// Unit plans (payload per byte of S). `root` is a global rank (broadcast, reduce, scatter, gather).
CommPlan ring_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root);
CommPlan tree_plan(const Topology& topo, const GroupLayout& g);
CommPlan nvls_plan(const Topology& topo, const GroupLayout& g, CommOp op);
CommPlan nvls_tree_plan(const Topology& topo, const GroupLayout& g);
CommPlan direct_plan(const Topology& topo, const GroupLayout& g, CommOp op, int root);
// all_to_all: one flow per ordered pair, on its route (through its PXN relay where g has one). The plan's
// latency_us holds what the routes add to NCCL's latency: the NVLink hop to a relay when any pair has one.
CommPlan pairwise_plan(const Topology& topo, const GroupLayout& g);
// An all_to_all with uneven splits, in bytes rather than per byte of S: member i sends pair_bytes[i * n + j]
// to member j, one flow per pair that moves anything (the piece a member keeps crosses no link); routes and
// latency_us as pairwise_plan's.
CommPlan pairwise_uneven_plan(const Topology& topo, const GroupLayout& g,
                              const std::vector<std::int64_t>& pair_bytes);
// A send from src to dst through `relay`'s NIC (src itself when none); latency_us as pairwise_plan's.
CommPlan p2p_plan(const Topology& topo, int src, int dst, int relay);
// The latency the NVLink hop from a sender to its PXN relay adds: its two links' hardware latency (the
// profile's nvlink.latency_us each). NCCL's own latency model has no term for it.
double pxn_hop_latency_us(const Topology& topo);

// The unit plan of `a` for `op` (one of the above).
CommPlan unit_plan(const Topology& topo, const GroupLayout& g, CommOp op, Algorithm a, int root);

// NCCL's double binary tree over k = 0..count-1 (Sanders, Speck & Traeff, "Two-tree algorithms for full
// bandwidth broadcast, reduction and scan", Parallel Computing 2009): the parent of `k` in tree 0 or 1,
// -1 for the root. Every index is a leaf in one tree and interior in the other (for count > 2).
int dtree_parent(int k, int count, int tree);

}  // namespace ranklab::sim
