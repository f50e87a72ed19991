// NetworkModel: how long communication takes and which links carry its bytes.
//
// The simulator asks the model for each operation once every member has launched it. The model answers in
// two steps, as NCCL itself works:
//   1. plan: choose the algorithm and protocol the way NCCL does (the least predicted latency + transfer
//      time, or the ones NCCL_ALGO / NCCL_PROTO force: --algo, --proto), and split the operation into
//      flows over the topology's links (sim/net/algorithms.h);
//   2. time: the plan's latency (NCCL's prediction for what it picked, times the profile's
//      nccl.latency_scale: NCCL chooses with its own model, the machine runs with its real latency) plus
//      the time its flows take sharing the links max-min fairly
//      (sim/net/max_min.h). duration_us(plan) gives the time with the machine to itself; the engine, which
//      knows what else is in flight, can share the links between plans instead.
// Every payload byte a plan moves is counted on each link it crosses (record()); the RunReport gets the
// totals per link (and so per tier: NVLink, PCIe, network).
//
// docs/model.md explains a time from end to end, with every reference.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/profile.h"
#include "common/rank.h"
#include "common/report.h"
#include "sim/net/algorithms.h"
#include "sim/net/comm_plan.h"
#include "sim/net/max_min.h"
#include "sim/net/topology.h"

namespace ranklab {
struct SimConfig;
}

namespace ranklab::sim {

// What NCCL_ALGO and NCCL_PROTO would force; "" lets the model choose. An algorithm or protocol that an
// operation cannot use on this topology is ignored for it, as NCCL falls back when a forced choice is
// unavailable.
struct NetworkOptions {
  std::string algorithm;  // ring, tree, nvls, nvls_tree
  std::string protocol;   // ll, ll128, simple
  // PXN: sends between nodes leave through the NIC of the receiver's rail, reached over NVLink
  // (sim/net/algorithms.h, pxn_relays). NCCL_PXN_DISABLE=1 turns it off; 2.21.5's default is on.
  bool pxn = true;
};

// One (algorithm, protocol) NCCL could run, with its predicted time for a message size.
struct Candidate {
  Algorithm algorithm = Algorithm::Ring;
  Protocol protocol = Protocol::Simple;
  double latency_us = 0;
  double transfer_us = 0;
  double time_us() const { return latency_us + transfer_us; }
};

class NetworkModel {
 public:
  NetworkModel(const Profile& profile, NetworkOptions options = {});
  // Not copied: it keeps a pointer into its own groups.
  NetworkModel(const NetworkModel&) = delete;
  NetworkModel& operator=(const NetworkModel&) = delete;

  const Topology& topology() const { return topo_; }
  const NetworkOptions& options() const { return options_; }

  // ---- plans ----------------------------------------------------------------------------------------
  // A collective `op` over `ranks` (global ranks, in group order) whose nccl-tests size is `bytes`; `root`
  // is a global rank for the rooted collectives. Cheap after the first call for a group: the shape of
  // every algorithm is kept per group, and a plan is that shape scaled.
  CommPlan plan_collective(CommOp op, std::int64_t bytes, const std::vector<int>& ranks, int root);
  // An all_to_all with uneven splits over `ranks`: member i sends pair_bytes[i * n + j] bytes to member j.
  // NCCL runs all_to_all as grouped send/recv, one message per pair, each with the protocol of its own
  // size; so every pair is a flow on its own path, and the operation lasts until the slowest pair's flow
  // ends under max-min sharing, plus the p2p latency. Equal splits are the even all_to_all, whose plan
  // (plan_collective) keeps the same per-link loads in one flow per link.
  CommPlan plan_all_to_all(const std::vector<int>& ranks, const std::vector<std::int64_t>& pair_bytes);
  // A send from `src` to `dst` along its route: between nodes through the PXN relay's NIC, the relay
  // chosen among the world's ranks (set_world_ranks), as NCCL does on the communicator's GPUs.
  CommPlan plan_p2p(int src, int dst, std::int64_t bytes);
  // The world: GPUs 0 .. ranks-1 (0, the default: every GPU of the topology). Sends run on its
  // communicator, so only its GPUs can relay them.
  void set_world_ranks(int ranks);
  // Every (algorithm, protocol) NCCL could use for this call, with its time, in NCCL's order; the plan
  // takes the fastest (the first of equals) among those the options allow.
  std::vector<Candidate> candidates(CommOp op, std::int64_t bytes, const std::vector<int>& ranks, int root);

  // ---- traffic --------------------------------------------------------------------------------------
  // Counts a plan's payload on every link it crosses.
  void record(const CommPlan& plan);
  // record() of the plan's image `gpus` GPUs further on, for a plan inside nodes (Topology::shifted).
  void record_shifted(const CommPlan& plan, int gpus);
  // Bytes carried by each directed link so far (links that carried none are left out), in link order.
  std::vector<LinkTraffic> link_traffic() const;

 private:
  struct Shape {
    CommPlan unit;       // flows for a one-byte message; latency_us: what its routes add (PXN's hop)
    double unit_us = 0;  // their time alone, at Simple's efficiency
  };
  struct PairBytesHash {
    std::size_t operator()(const std::vector<std::int64_t>& v) const;
  };
  struct GroupEntry {
    GroupLayout layout;
    P2pComm p2p;  // what NCCL gives each peer of the group's grouped point-to-point calls
    std::unordered_map<std::uint64_t, Shape> shapes;  // by (op, algorithm, root)
    // Uneven all-to-alls' plans by their pair sizes: a tensor-parallel ring passes the same pieces around
    // millions of times, and each plan's fluid transfer time is a max-min solve. At most
    // kUnevenPlansKept; routing that varies every call (a mixture of experts) starts it over.
    std::unordered_map<std::vector<std::int64_t>, CommPlan, PairBytesHash> uneven;
  };
  static constexpr std::size_t kUnevenPlansKept = 256;
  struct RanksHash {
    std::size_t operator()(const std::vector<int>& v) const;
  };
  GroupEntry& group(const std::vector<int>& ranks);
  const Shape& shape(GroupEntry& g, CommOp op, Algorithm a, int root);
  CommPlan scaled(const Shape& s, const Candidate& c, std::int64_t bytes) const;
  double occupancy(CommOp op, const Candidate& c, const GroupShape& g, double bytes) const;
  // The candidates with their latencies only (transfer 0): cheap, no flows built.
  std::vector<Candidate> latencies(CommOp op, std::int64_t bytes, const std::vector<int>& ranks);
  // The transfer time of candidate `c`: the flows at the protocol's efficiency, at most NCCL's bandwidth
  // cap for it, at the channels of `launch` (NCCL's for this size) and through the fill and drain of its
  // pipeline.
  double transfer_of(GroupEntry& g, CommOp op, const Candidate& c, std::int64_t bytes, int root,
                     const LaunchShape& launch);

  Topology topo_;
  NetworkOptions options_;
  std::unordered_map<std::vector<int>, GroupEntry, RanksHash> groups_;
  std::vector<double> link_bytes_;  // by LinkId, allocated at the first record
  int world_ranks_ = 0;
  // The world's communicator, which sends run on: its GPUs relay between nodes (PXN) and its shape sizes
  // NCCL's point-to-point pieces. The group of every rank, found at the first send and again after
  // set_world_ranks (groups_ keeps its entries in place).
  GroupEntry* world_ = nullptr;
  GroupEntry& world();
};

// The time a plan's flows take alone on the topology's links: the busiest link's bytes over its capacity.
// For the plans of sim/net/algorithms.h this equals fluid_transfer_us, at a fraction of the cost.
double transfer_us(const Topology& topo, const CommPlan& plan);
// The same by simulating max-min sharing until the last flow finishes (sim/net/max_min.h).
double fluid_transfer_us(const Topology& topo, const CommPlan& plan);

// The flows of several plans as one FlowNetwork for the rate solver: flow i of plan p is flow
// first_flow[p] + i; links are renumbered densely, with the topology's capacities.
struct PlanFlows {
  FlowNetwork network;
  std::vector<int> first_flow;  // per plan
  std::vector<LinkId> link_of;  // network link -> topology link
  std::vector<double> bytes;    // per flow: what occupies the links
};
PlanFlows plan_flows(const Topology& topo, const std::vector<const CommPlan*>& plans);

std::unique_ptr<NetworkModel> make_network_model(const Profile& profile);
std::unique_ptr<NetworkModel> make_network_model(const SimConfig& config);

}  // namespace ranklab::sim
