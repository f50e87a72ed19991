// TransferEngine: communication in flight, in virtual time, with links shared between transfers.
//
// Each operation the simulator executes becomes a transfer: its plan's flows start at the operation's
// start time and share every link they cross max-min fairly with every other flow in flight at that
// moment (sim/net/sharing.h); when its last flow is done, the plan's latency follows, and then the operation
// has ended. Whenever flows start or finish, the rates of the flows they share links with are shared
// again, so an end time is provisional until the engine reaches it. The simulator moves the engine forward
// only to times that no rank can issue work before (sim/world.cc), so a transfer that starts at t sees
// every transfer that started before t.
//
// Time is event-driven: events are flow ends, transfer starts and latency tails, each in a heap. Moving to
// a time before the next event moves the clock only (the simulator does that before every rank's every
// communication call, so it must cost nothing). A flow's remaining bytes are brought up to date only when
// its rate changes; all changes at one timestamp are shared again once.
//
// A transfer whose plan is a bundle (CommPlan::bundle: alike flows over paths with no link in common, as a
// ring's steps are) and that starts on idle links moves as one flow of the sharing network over all its
// flows' links: each of them would get the one rate it gets, and end when it ends. When another flow comes
// onto any of those links, the bundle goes on as its flows, each with what the bundle had left and at its
// rate, and the sharing gives each its own from there: rates, ends and bytes are those the flows would
// have had one by one. A tensor-parallel step of a large world is mostly such transfers, and one flow
// instead of eight takes most of the engine's cost per transfer with it.
//
// A transfer whose start lies before the engine's present (possible when a host rendezvous wakes a rank
// whose clock is behind) is progressed alone up to the present and then joins the others: its contention
// with transfers that already ended is not modelled. The engine counts such late starts.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "sim/net/comm_plan.h"
#include "sim/net/flow_heap.h"
#include "sim/net/sharing.h"
#include "sim/net/topology.h"

namespace ranklab::sim {

// Whoever a transfer moves bytes for: the engine holds it while the transfer is in flight and hands it back,
// untouched, when the transfer ends. Opaque to the network model, which needs to know nothing of the
// operations the simulator builds on it (sim/comm_op.h); the simulator knows what it scheduled.
using TransferOwner = std::shared_ptr<void>;

// A transfer that has ended: its owner and when.
struct EndedTransfer {
  TransferOwner owner;
  double end_us = 0;
};

class TransferEngine {
 public:
  explicit TransferEngine(const Topology& topology) : topo_(topology), link_ids_(topology.link_count(), 0) {}

  double now_us() const { return now_us_; }
  // `owner` moves `plan` from `start_us` on.
  void schedule(TransferOwner owner, CommPlan plan, double start_us);
  // When the next start or end happens (+infinity when nothing is in flight).
  double next_event_us();
  // Processes every start and end up to `t_us` and moves the present there (never backwards). Returns the
  // transfers that ended, in the order they ended (the simulator decides when an operation has finished:
  // SimWorld::on_finished). With `stop_at_end`, stops at the first moment a transfer ends instead (the
  // present is then that moment), so that whoever waited for it can act before anything later happens.
  std::vector<EndedTransfer> advance_to(double t_us, bool stop_at_end = false);
  long late_starts() const { return late_starts_; }

 private:
  struct Transfer {
    TransferOwner owner;
    CommPlan plan;
    int flows_left = 0;
    double flows_done_us = -1;  // when the last flow finished; then the latency runs
    std::size_t slot = 0;       // its place in transfers_
  };
  // One flow in flight, indexed by its id in the sharing network.
  static constexpr int kBundle = -1;
  struct Running {
    Transfer* transfer = nullptr;  // null: the id is free
    int flow = 0;                  // in its plan; kBundle: every flow of it (CommPlan::bundle)
    double left_bytes = 0;         // at since_us
    double rate_bytes_per_us = 0;
    double since_us = 0;
    double end_us = 0;  // when it ends at its current rate
    // When it counts as done: within rounding of its end (see flush), or its end once it was found not done
    // at that time.
    double retire_us = 0;
    // What it may have left and count as done (a fraction of its plan's bytes), kept here so that sharing
    // again and retiring need not look into the transfer's plan.
    double done_bytes = 0;
  };
  void begin_flows(Transfer* t);
  // Adds `flow` of `t` (and the copies it stands for: CommPlan::copies) with `left_bytes` each and returns
  // its id; `begun`: from begin_flows, which notes the transfer in begun_. A bundle over any of its links
  // is split first.
  std::uint32_t add_flow(Transfer* t, int flow, double left_bytes, bool begun = false);
  // The sharing network's id of topology link `link`, added the first time it is met.
  std::uint32_t net_link(LinkId link);
  // Adds `t`'s bundle as one flow when every link it crosses is idle; returns whether it did.
  bool begin_bundle(Transfer* t);
  // Adds flow `flow` of `t` (kBundle: its bundle) over path_ (sharing network links), standing for `copies`
  // flows of `bytes` each with `left_bytes` left to move; returns its id.
  std::uint32_t start_flow(Transfer* t, int flow, double bytes, double left_bytes, std::uint32_t copies);
  // Replaces bundle `id` by its flows, each where the bundle was: bytes left, rate and end.
  void split_bundle(std::uint32_t id);
  // Whether flow `f` of `t`'s plan moves anything itself: it has bytes, a path, and is no copy of another.
  static bool moves(const Transfer& t, int f) {
    const Flow& flow = t.plan.flows[f];
    return t.plan.bytes(flow) > 0 && flow.length > 0 && copies(t, f) > 0;
  }
  // How many flows of its plan `flow` stands for: 0 for a copy of another.
  static std::uint32_t copies(const Transfer& t, int flow) {
    return t.plan.copies.empty() ? 1 : t.plan.copies[flow];
  }
  // Takes a flow out of the sharing network and the running list; the caller has taken it out of the end
  // heap.
  void end_flow(std::uint32_t id);
  // Marks the end of a batch of starts and ends at the present. The links are shared again (flush) only
  // when the engine next needs a flow's end, so that the transfers the simulator starts one by one at one
  // moment cost one sharing, not one each; the rates are those sharing after every batch would give
  // (SharingNetwork::solve).
  void reshare();
  // Shares the links again where flows started or ended, and updates the flows whose rates changed.
  void flush();
  // Retires flows that are done at the present; a transfer with no flow left starts its latency tail.
  void retire_done_flows();
  double next_flow_end_us();
  // A flow's bytes left at the present.
  double left_now(const Running& r) const;
  void end_transfer(Transfer* t);

  const Topology& topo_;
  double now_us_ = 0;
  SharingNetwork net_;
  // Topology link -> sharing network link + 1 (0: not added yet), one per topology link.
  std::vector<std::uint32_t> link_ids_;
  std::vector<std::uint32_t> path_;  // scratch
  std::vector<Running> running_;
  // The running flows as a list: retirement at one moment follows its order (see retire_done_flows).
  std::vector<std::uint32_t> order_;
  std::vector<std::size_t> position_;  // per flow id: where it is in order_
  std::vector<char> retiring_;         // per flow id: scratch of retire_done_flows
  // More scratch of retire_done_flows, kept so that it allocates nothing.
  std::vector<std::uint32_t> done_;
  std::vector<FlowHeap::Entry> again_;
  std::vector<std::pair<std::size_t, std::uint32_t>> pending_;
  std::vector<FlowHeap::Entry> fresh_ends_;           // scratch of flush
  std::vector<std::unique_ptr<Transfer>> transfers_;  // owned; freed when they end
  int in_flight_ = 0;
  bool unshared_ = false;  // batches wait for flush()
  // Since the last flush(): the transfers whose begin_flows added flows, in that order, each with how many;
  // and whether they added every flow added, no two over one link. Each is then a set of components of
  // its own when they start on idle links (SharingNetwork::idle_start), and its plan's idle rates serve.
  std::vector<std::pair<Transfer*, int>> begun_;
  bool begun_apart_ = true;
  // Per sharing network link: the flush() before which a begun transfer last crossed it, and which one;
  // the bundle crossing it (its flow id + 1), which is then the only flow there, or 0.
  struct LinkMark {
    std::uint64_t flush = 0;
    const Transfer* by = nullptr;
    std::uint32_t bundle = 0;
  };
  std::vector<LinkMark> link_marks_;
  std::uint64_t flushes_ = 1;
  std::vector<double> begun_rates_;  // scratch of flush
  // Transfers by a time, earliest first and, at one time, in the order they were added (as a multimap
  // keeps them), in a binary heap: a step adds and takes millions, and a tree's node each would be as
  // many allocations.
  class TimedQueue {
   public:
    bool empty() const { return heap_.empty(); }
    double first_us() const { return heap_.front().at_us; }
    void add(double at_us, Transfer* t) {
      heap_.push_back({at_us, added_++, t});
      std::push_heap(heap_.begin(), heap_.end(), Entry::later);
    }
    Transfer* take_first() {
      std::pop_heap(heap_.begin(), heap_.end(), Entry::later);
      Transfer* t = heap_.back().transfer;
      heap_.pop_back();
      return t;
    }

   private:
    struct Entry {
      double at_us;
      std::uint64_t order;
      Transfer* transfer;
      static bool later(const Entry& a, const Entry& b) {
        return a.at_us > b.at_us || (a.at_us == b.at_us && a.order > b.order);
      }
    };
    std::vector<Entry> heap_;
    std::uint64_t added_ = 0;
  };
  TimedQueue starts_;  // future starts
  TimedQueue tails_;   // transfers whose flows are done: end time
  // The running flows by when each ends, and the most any of them counts as done before its end: a flow
  // done at t ends before t + the lead.
  FlowHeap ends_;
  double retire_lead_us_ = 0;
  std::vector<EndedTransfer> ended_;  // finished but not yet handed out
  long late_starts_ = 0;
};

}  // namespace ranklab::sim
