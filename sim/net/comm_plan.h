// CommPlan: what one communication operation moves where, apart from how long it takes. An operation is
// an algorithm and a protocol (as NCCL picks them), a fixed latency, and a set of flows that run at the
// same time, each a path of directed links and the bytes it pushes through them.
//
// Time follows from the flows and the links' capacities: alone on the machine an operation takes its
// latency plus the time its flows need when they share links max-min fairly (sim/net/max_min.h); with other
// operations in flight they share the links with those too. Keeping the plan separate from the time is
// what lets the simulator's engine re-share bandwidth whenever a transfer starts or ends.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sim/net/topology.h"

namespace ranklab::sim {

// NCCL's algorithms (NCCL_ALGO names them the same way), plus the patterns NCCL runs as grouped
// point-to-point operations.
enum class Algorithm {
  Ring,      // a ring through every member; NCCL's default for bandwidth
  Tree,      // double binary tree across nodes, a chain inside each node (all_reduce)
  Nvls,      // in-switch reduction and multicast of NVSwitch (NVLink SHARP), inside one NVLink domain
  NvlsTree,  // NVLS inside each node, a double binary tree across nodes: the hierarchical form
  Direct,    // root to every member or back (scatter, gather), or one sender to one receiver (send/recv)
  Pairwise,  // every member to every other (all_to_all)
  Local,     // a group of one: nothing moves
};
// NCCL's protocols (NCCL_PROTO): LL sends 8-byte lines of data and flag, LL128 128-byte lines with 8 bytes
// of flag, Simple large chunks behind a memory fence. Lower latency, lower bandwidth, in that order.
enum class Protocol { LL, LL128, Simple };

const char* algorithm_name(
    Algorithm a);                       // "ring", "tree", "nvls", "nvls_tree", "direct", "pairwise", "local"
const char* protocol_name(Protocol p);  // "ll", "ll128", "simple"
// Case-insensitive, accepting NCCL's spellings too ("Ring", "NVLSTree", "LL128"); nullopt if unknown.
std::optional<Algorithm> parse_algorithm(const std::string& name);
std::optional<Protocol> parse_protocol(const std::string& name);

// A vector whose copies share one buffer until one of them changes (copy on write). Plans scaled from one
// unit plan (NetworkModel::scaled) share its paths, flows and copy counts: a world-wide collective's are
// megabytes, which copying at every call would drag through the cache only to read them once more.
template <typename T>
class SharedVector {
 public:
  const T* data() const { return v_ ? v_->data() : nullptr; }
  std::size_t size() const { return v_ ? v_->size() : 0; }
  bool empty() const { return size() == 0; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size(); }
  const T& operator[](std::size_t i) const { return (*v_)[i]; }
  friend bool operator==(const SharedVector& a, const SharedVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

  // The only way in to change it: its own buffer, copied first when another vector shares it.
  std::vector<T>& mutate() {
    if (!v_) {
      v_ = std::make_shared<std::vector<T>>();
    } else if (v_.use_count() > 1) {
      v_ = std::make_shared<std::vector<T>>(*v_);
    }
    return *v_;
  }
  void clear() { v_.reset(); }

 private:
  std::shared_ptr<std::vector<T>> v_;
};

// A flow's bytes are its record's times its plan's scale (CommPlan::bytes, CommPlan::payload_bytes): plans
// of one shape share their flows' records and differ in the scale only.
struct Flow {
  std::uint32_t first = 0;  // the path is CommPlan::links[first, first + length)
  std::uint32_t length = 0;
  double unscaled_bytes = 0;          // what occupies the links: the payload over the protocol's efficiency
  double unscaled_payload_bytes = 0;  // the data itself: what the per-link byte counters record
};

struct CommPlan {
  Algorithm algorithm = Algorithm::Local;
  Protocol protocol = Protocol::Simple;
  double latency_us = 0;   // NCCL's latency for the pick (sim/net/nccl_tuning.h) x nccl.latency_scale
  double transfer_us = 0;  // the flows alone on the machine, sharing links max-min fairly
  // Thread blocks NCCL launches on every member's GPU: one per channel, each resident on one SM for the
  // whole call (NCCL 2.21.5 src/enqueue.cc launches the kernel with a grid of nChannels blocks).
  int channels = 0;
  SharedVector<LinkId> links;  // every flow's path, back to back
  SharedVector<Flow> flows;
  // What every flow's record is multiplied by: 1 for a plan built flow by flow; the call's bytes (and the
  // protocol's occupancy) for one scaled from a unit plan (NetworkModel::scaled), whose flows it shares.
  double bytes_scale = 1;
  double payload_scale = 1;
  // Per flow, when worked out (count_copies; empty otherwise): how many of the flows it stands for in the
  // transfer engine, itself included, and 0 for a copy of an earlier one. A ring's channels cross each
  // NVLink hop side by side with the same bytes: max-min sharing gives such copies one rate, so the engine
  // shares them as one flow (sim/net/sharing.h): a large world's step has a third to a quarter as many.
  SharedVector<std::uint32_t> copies;
  // Plans of one shape (NetworkModel) share this, as do the copies of an uneven all-to-all's kept plan: the
  // rates max-min sharing gives their flows when they start on links nothing else crosses, which depend on
  // the paths and copies alone, not on the bytes. The transfer engine fills it the first time and takes the
  // rates from it after (SharingNetwork::solve_idle_start). Null for plans built one by one.
  std::shared_ptr<std::vector<double>> idle_rates_gbps;
  // Whether its flows (those count_copies counts, when worked out) form a bundle (find_bundle): alike, over
  // paths no two of which share a link and whose links have one capacity position by position. Started on
  // idle links, such flows keep one rate for as long as nothing else crosses their links, so the transfer
  // engine moves them as one flow until something does (TransferEngine::begin_flows).
  bool bundle = false;

  std::span<const LinkId> path(const Flow& f) const { return {links.data() + f.first, f.length}; }
  double bytes(const Flow& f) const { return f.unscaled_bytes * bytes_scale; }
  double payload_bytes(const Flow& f) const { return f.unscaled_payload_bytes * payload_scale; }
  void add_flow(std::span<const LinkId> path, double payload_bytes, double bytes);
  std::string name() const;  // "ring/simple"
};

// Fills plan.copies: flows with the same path, bytes and payload are copies of the first of them.
void count_copies(CommPlan& plan);
// Sets plan.bundle (see there), after count_copies: whether its counted flows, two or more, have one
// length, bytes, payload and copy count, one capacity at each position of their paths in `topology`, and no
// link in common, in all at most kMaxBundleLinks links.
void find_bundle(CommPlan& plan, const Topology& topology);
// A bundle crosses its flows' links as one flow of the sharing network: a path it holds whole.
inline constexpr std::size_t kMaxBundleLinks = 1024;

// Latency plus transfer: how long the operation takes with the machine to itself.
inline double duration_us(const CommPlan& plan) {
  return plan.latency_us + plan.transfer_us;
}

}  // namespace ranklab::sim
