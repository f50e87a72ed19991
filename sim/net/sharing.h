// SharingNetwork: max-min fair rates (sim/net/max_min.h) kept up to date as flows come and go.
//
// Why: the transfer engine changes the set of flows in flight at every start and end. Solving the whole
// network again each time costs the size of everything in flight, so a run with T concurrent transfers
// costs T^2; a training step of W ranks, W^2. A flow's max-min rate depends only on the flows it is
// connected to through shared links, so a change needs only its connected component solved again. This
// is SimGrid's lmm solver's "selective update" (Casanova et al., "Versatile, scalable, and accurate
// simulation of distributed applications and platforms", JPDC 2014): modified constraints are marked, and
// only the variables and constraints reachable from them are recomputed. The algorithm on a component is
// the same progressive filling as max_min_rates (Bertsekas & Gallager, "Data Networks", 2nd ed., 6.5.2),
// with the contended links in a heap instead of scanned at every level.
//
// A collective that starts on idle links (as one does after another in a training step) is a component of
// its own, made of the flows just added: solve() then shares them without gathering it.
//
// Links and flows keep their ids for as long as they exist, so the engine need not renumber anything.
// max_min_rates stays the reference: tests compare the two on random flow sets. They agree exactly except
// where two components' bottleneck shares differ by less than the solvers' tie tolerance (1e-12 relative):
// the full solver then fixes both at one level, the incremental one each at its own.
#pragma once

#include <algorithm>
#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <span>
#include <vector>

namespace ranklab::sim {

class SharingNetwork {
 public:
  using FlowId = std::uint32_t;

  // Adds a link of `capacity_gbps` (GB/s) and returns its id: 0, 1, 2, ...
  std::uint32_t add_link(double capacity_gbps);
  int links() const { return static_cast<int>(links_.size()); }

  // Adds a flow over `links` (ids from add_link, none twice) and returns its id; ids of removed flows are
  // reused. Its rate is known after the next solve(). A flow over no link is not limited: +infinity.
  //
  // `copies` > 1 adds that many flows at once that share one path and always one rate (a ring's channels
  // through one NVLink hop): rate_gbps is each copy's, and every rate equals, bit for bit, what that many
  // separate flows would get (see fill), at the cost of one.
  FlowId add_flow(std::span<const std::uint32_t> links, std::uint32_t copies = 1);
  void remove_flow(FlowId flow);
  // The flow's rate in GB/s as of the last solve().
  double rate_gbps(FlowId flow) const { return flows_[flow].rate_gbps; }
  // The links the flow crosses, as add_flow took them.
  std::span<const std::uint32_t> path(FlowId flow) const { return path(flows_[flow]); }
  // Whether any flow crosses the link.
  bool carries_flows(std::uint32_t link) const { return !links_[link].flows.empty(); }
  int flows() const { return live_flows_; }

  // Shares the links again where flows were added or removed since the last call. Returns the flows whose
  // rates were computed again (every flow of a touched component, new flows included), each once.
  //
  // Changes may be grouped into batches with end_batch(); solve() then gives the rates that solving after
  // every batch would have given: each touched component is shared as of the last batch that touched it,
  // together with the other components that batch left touched (a batch's components are filled
  // together, as one solve() would). Components a later batch touched again are not solved twice. The one
  // difference: when a later batch touches some but not all of the components an earlier one touched,
  // those left are filled without the others, so where their shares differ by less than the tie tolerance
  // from the others' they keep their own (as the incremental solver does anyway; see above).
  const std::vector<FlowId>& solve();
  // Whether every change since the last solve() added flows, in one batch, onto links that carried no
  // other flow (removals that left their links empty aside): the added flows over links are then a set of
  // components of their own, whose rates depend on nothing else. `added_linked_flows` counts them.
  bool idle_start() const { return fresh_ && added_linked_ > 0; }
  int added_linked_flows() const { return added_linked_; }
  // solve() after an idle_start(), with the added flows' rates given, in the order they were added: those
  // an earlier solve() gave the same flows over the same links, when they too started on idle links (the
  // transfer engine keeps them per plan). std::logic_error unless idle_start() and one rate per flow.
  const std::vector<FlowId>& solve_idle_start(std::span<const double> rates_gbps);
  // Closes the current batch of changes (see solve()); cheap, and a no-op when nothing changed.
  void end_batch();

 private:
  // A link's record, one cache line: a collective of a large world touches tens of thousands of links per
  // solve, more than the cache holds, so each costs a miss, and a second line for its flows would cost
  // another. Links carry few distinct flows (a ring's channels through a hop are one flow of copies), so
  // up to three are kept in the record itself.
  struct alignas(64) Link {
    double capacity_gbps = 0;
    boost::container::small_vector<FlowId, 3> flows;  // the flows crossing it, in no particular order
    std::uint32_t copies = 0;                         // their copies: how many flows share it
    std::uint32_t dirty_batch = 0;                    // the last batch that changed its flows, while dirty
    // The solve() (solves_) before which add_flow last met it. While fresh_ holds it was empty then, so
    // until that solve it carries only flows added since the previous one.
    std::uint32_t fresh_solve = 0;
  };
  static_assert(sizeof(Link) == 64, "a link's record is one cache line");
  // The solver's scratch per link, meaningful during solve() only, kept apart from the records so that the
  // passes that read only these read a dense array.
  struct LinkShare {
    double remaining_gbps = 0;
    std::uint32_t unfixed = 0;
    std::uint32_t version = 0;  // heap entries with an older version are stale
  };
  // A flow's record: 24 bytes, so that the flows of a component the size of a large world stay in cache
  // while it is shared again. Its path, and per path link where the flow sits in that link's `flows`, are
  // a block of `paths_`: [path..., slots...]. Blocks are reused by length (paths take a few lengths only).
  struct FlowRec {
    double rate_gbps = 0;
    std::uint32_t visit = 0;
    std::uint32_t block = 0;  // where its path starts in paths_
    std::uint32_t copies = 1;
    std::uint16_t length = 0;
    bool live = false;
    bool fixed = false;
  };
  std::span<const std::uint32_t> path(const FlowRec& f) const { return {paths_.data() + f.block, f.length}; }
  std::span<std::uint32_t> slots(const FlowRec& f) { return {paths_.data() + f.block + f.length, f.length}; }
  // A block for a path of `length` links (and their slots).
  std::uint32_t take_block(std::size_t length);

  void mark_dirty(std::uint32_t link);
  // What every solve starts with: scratch cleared, counters moved on. Returns whether the changes since
  // the last solve allow the short way (fresh_).
  bool begin_solve();
  // solve()'s short way, when every flow added since the last solve() went onto links that carried no
  // other flow and nothing else changed (fresh_): the touched components are then exactly the added flows
  // and their links, known without gathering them.
  // With `rates_gbps` empty it fills the flows; else it takes their rates from there (solve_idle_start).
  void solve_fresh(std::span<const double> rates_gbps);
  // Progressive filling over `links` and the flows crossing them (`flows`), which are whole components.
  void fill(std::span<const std::uint32_t> links, std::span<const FlowId> flows);

  std::vector<Link> links_;
  std::vector<LinkShare> shares_;
  // Per link, the solve() that put it in its component: read for every link of every flow's path while a
  // component is gathered, so it is an array of its own.
  std::vector<std::uint32_t> link_visit_;
  std::vector<FlowRec> flows_;
  std::vector<std::uint32_t> paths_;
  std::vector<std::vector<std::uint32_t>> free_blocks_;  // by path length
  std::vector<FlowId> free_flows_;
  int live_flows_ = 0;
  std::vector<std::uint32_t> dirty_;
  // Per link, whether it is in dirty_: apart from the records, so that a solve that needs nothing else of
  // the links it clears (solve_idle_start) reads a dense array instead of a cache line per link.
  std::vector<char> link_dirty_;
  std::uint32_t batch_ = 0;           // the batch changes now belong to
  bool batch_open_ = false;           // whether the current batch has changes
  std::vector<FlowId> unlinked_new_;  // added flows over no link: solved trivially
  std::uint32_t visit_ = 0;
  // Since the last solve(): whether every change was a flow added onto links that carried no flow then
  // (or a flow removed leaving its links empty), in one batch; the flows added, in order, and the links
  // they cross; their batch.
  bool fresh_ = true;
  std::vector<FlowId> fresh_flows_;
  int added_linked_ = 0;                    // of fresh_flows_, those over links
  std::vector<std::uint32_t> fresh_links_;  // the links add_flow met, in the order it met them
  std::uint32_t fresh_batch_ = 0;
  std::uint32_t solves_ = 1;  // solve() calls so far, plus 1: Link::fresh_solve of the next one
  std::vector<std::uint32_t> component_links_;
  std::vector<FlowId> changed_;
  // Scratch of solve() and fill(), kept between calls so that a solve allocates nothing.
  struct ShareEntry {
    double share;
    std::uint32_t link, version;
    bool operator>(const ShareEntry& o) const {
      return share > o.share || (share == o.share && link > o.link);
    }
  };
  std::vector<ShareEntry> heap_;
  std::vector<std::uint32_t> stack_, full_, touched_;
  // A touched component: its links and flows are ranges of component_links_ and changed_.
  struct Component {
    std::uint32_t batch;
    std::uint32_t first_link, end_link, first_flow, end_flow;
  };
  std::vector<Component> components_;
  std::vector<std::uint32_t> group_links_;
  std::vector<FlowId> group_flows_;
};

}  // namespace ranklab::sim
