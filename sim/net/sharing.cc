#include "sim/net/sharing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "common/errors.h"

namespace ranklab::sim {

std::uint32_t SharingNetwork::add_link(double capacity_gbps) {
  if (!(capacity_gbps > 0) || !std::isfinite(capacity_gbps)) {
    throw UsageError(
        fmt::format("a link's capacity must be a positive number of GB/s, got {}", capacity_gbps));
  }
  links_.emplace_back();
  links_.back().capacity_gbps = capacity_gbps;
  shares_.emplace_back();
  link_visit_.push_back(0);
  link_dirty_.push_back(0);
  return static_cast<std::uint32_t>(links_.size() - 1);
}

void SharingNetwork::mark_dirty(std::uint32_t link) {
  batch_open_ = true;
  links_[link].dirty_batch = batch_;
  if (link_dirty_[link]) return;
  link_dirty_[link] = 1;
  dirty_.push_back(link);
}

void SharingNetwork::end_batch() {
  if (!batch_open_) return;
  batch_open_ = false;
  ++batch_;
}

std::uint32_t SharingNetwork::take_block(std::size_t length) {
  if (length < free_blocks_.size() && !free_blocks_[length].empty()) {
    const std::uint32_t block = free_blocks_[length].back();
    free_blocks_[length].pop_back();
    return block;
  }
  if (paths_.size() + 2 * length > std::numeric_limits<std::uint32_t>::max()) {
    throw UsageError(fmt::format("more flows' links in flight than the sharing network holds ({})",
                                 std::numeric_limits<std::uint32_t>::max()));
  }
  const auto block = static_cast<std::uint32_t>(paths_.size());
  paths_.resize(paths_.size() + 2 * length);
  return block;
}

SharingNetwork::FlowId SharingNetwork::add_flow(std::span<const std::uint32_t> path, std::uint32_t copies) {
  if (copies == 0) throw UsageError("a flow of no copies");
  if (path.size() > std::numeric_limits<std::uint16_t>::max()) {
    throw UsageError(fmt::format("a flow over {} links; a path may have at most {}", path.size(),
                                 std::numeric_limits<std::uint16_t>::max()));
  }
  for (std::uint32_t l : path) {
    if (l >= links_.size()) throw UsageError(fmt::format("flow over link {}, which does not exist", l));
  }
  const std::uint32_t block = take_block(path.size());
  FlowId id;
  if (!free_flows_.empty()) {
    id = free_flows_.back();
    free_flows_.pop_back();
  } else {
    id = static_cast<FlowId>(flows_.size());
    flows_.emplace_back();
  }
  // The short way of solve() holds while the flows added since the last one are all in one batch and
  // each link they cross carried none before them.
  if (fresh_flows_.empty()) fresh_batch_ = batch_;
  fresh_ = fresh_ && fresh_batch_ == batch_;
  for (std::uint32_t l : path) {
    Link& link = links_[l];
    if (link.fresh_solve == solves_) continue;
    fresh_ = fresh_ && link.flows.empty();
    link.fresh_solve = solves_;
    fresh_links_.push_back(l);
  }
  fresh_flows_.push_back(id);
  if (!path.empty()) ++added_linked_;
  FlowRec& f = flows_[id];
  f.block = block;
  f.length = static_cast<std::uint16_t>(path.size());
  f.copies = copies;
  std::copy(path.begin(), path.end(), paths_.begin() + block);
  const std::span<std::uint32_t> slot = slots(f);
  f.live = true;
  f.rate_gbps = 0;
  ++live_flows_;
  for (size_t i = 0; i < path.size(); ++i) {
    Link& link = links_[path[i]];
    slot[i] = static_cast<std::uint32_t>(link.flows.size());
    link.flows.push_back(id);
    link.copies += copies;
    mark_dirty(path[i]);
  }
  if (path.empty()) unlinked_new_.push_back(id);
  return id;
}

void SharingNetwork::remove_flow(FlowId id) {
  FlowRec& f = flows_[id];
  if (!f.live) throw UsageError(fmt::format("flow {} is not in the network", id));
  const std::span<const std::uint32_t> path = this->path(f);
  const std::span<std::uint32_t> slot_of = slots(f);
  // A flow removed where others remain changes their rates, and one added since the last solve() (its
  // links are fresh, or it crosses none and waits in unlinked_new_, below) would leave the list of added
  // flows: either way, solve() gathers the components.
  for (std::uint32_t l : path)
    fresh_ = fresh_ && links_[l].flows.size() == 1 && links_[l].fresh_solve != solves_;
  for (size_t i = 0; i < path.size(); ++i) {
    Link& link = links_[path[i]];
    const std::uint32_t slot = slot_of[i];
    const FlowId moved = link.flows.back();
    link.flows[slot] = moved;
    link.flows.pop_back();
    link.copies -= f.copies;
    if (moved != id) {
      // The moved flow's record of where it sits on this link.
      FlowRec& m = flows_[moved];
      const std::span<const std::uint32_t> mpath = this->path(m);
      for (size_t j = 0; j < mpath.size(); ++j) {
        if (mpath[j] == path[i]) {
          slots(m)[j] = slot;
          break;
        }
      }
    }
    mark_dirty(path[i]);
  }
  if (std::erase(unlinked_new_, id) > 0) fresh_ = false;
  if (f.length >= free_blocks_.size()) free_blocks_.resize(f.length + 1);
  free_blocks_[f.length].push_back(f.block);
  f.live = false;
  f.length = 0;
  --live_flows_;
  free_flows_.push_back(id);
}

bool SharingNetwork::begin_solve() {
  changed_.clear();
  component_links_.clear();
  components_.clear();
  ++visit_;
  const bool fresh = fresh_;
  fresh_ = true;
  if (++solves_ == 0) {
    // Counted round: no link may look met in the run-up to the next solve.
    for (Link& link : links_) link.fresh_solve = 0;
    solves_ = 1;
  }
  return fresh;
}

const std::vector<SharingNetwork::FlowId>& SharingNetwork::solve() {
  if (begin_solve()) {
    solve_fresh({});
    return changed_;
  }
  fresh_flows_.clear();
  added_linked_ = 0;
  fresh_links_.clear();
  // Every link and flow connected to a changed link, through flows that cross links, component by
  // component; each component remembers the last batch that changed one of its links.
  std::vector<std::uint32_t>& stack = stack_;
  stack.clear();
  for (std::uint32_t l : dirty_) {
    if (link_visit_[l] == visit_) continue;
    link_visit_[l] = visit_;
    stack.push_back(l);
    Component c{0, static_cast<std::uint32_t>(component_links_.size()), 0,
                static_cast<std::uint32_t>(changed_.size()), 0};
    while (!stack.empty()) {
      const std::uint32_t at = stack.back();
      stack.pop_back();
      component_links_.push_back(at);
      if (link_dirty_[at]) {
        link_dirty_[at] = 0;
        c.batch = std::max(c.batch, links_[at].dirty_batch);
      }
      for (FlowId f : links_[at].flows) {
        FlowRec& flow = flows_[f];
        if (flow.visit == visit_) continue;
        flow.visit = visit_;
        changed_.push_back(f);
        for (std::uint32_t m : path(flow)) {
          if (link_visit_[m] == visit_) continue;
          link_visit_[m] = visit_;
          stack.push_back(m);
        }
      }
    }
    c.end_link = static_cast<std::uint32_t>(component_links_.size());
    c.end_flow = static_cast<std::uint32_t>(changed_.size());
    components_.push_back(c);
  }
  dirty_.clear();
  end_batch();
  const bool one_batch = std::all_of(components_.begin(), components_.end(), [&](const Component& c) {
    return c.batch == components_.front().batch;
  });
  if (one_batch) {
    fill(component_links_, changed_);
  } else {
    // The components each batch was the last to touch are filled together, batch by batch.
    std::stable_sort(components_.begin(), components_.end(),
                     [](const Component& a, const Component& b) { return a.batch < b.batch; });
    for (std::size_t i = 0; i < components_.size();) {
      group_links_.clear();
      group_flows_.clear();
      std::size_t j = i;
      for (; j < components_.size() && components_[j].batch == components_[i].batch; ++j) {
        const Component& c = components_[j];
        group_links_.insert(group_links_.end(), component_links_.begin() + c.first_link,
                            component_links_.begin() + c.end_link);
        group_flows_.insert(group_flows_.end(), changed_.begin() + c.first_flow,
                            changed_.begin() + c.end_flow);
      }
      fill(group_links_, group_flows_);
      i = j;
    }
  }
  for (FlowId f : unlinked_new_) {
    flows_[f].rate_gbps = std::numeric_limits<double>::infinity();
    changed_.push_back(f);
  }
  unlinked_new_.clear();
  return changed_;
}

const std::vector<SharingNetwork::FlowId>& SharingNetwork::solve_idle_start(
    std::span<const double> rates_gbps) {
  if (!idle_start() || rates_gbps.size() != static_cast<std::size_t>(added_linked_)) {
    throw std::logic_error(fmt::format(
        "SharingNetwork::solve_idle_start: {} rates for {} flows started on {}", rates_gbps.size(),
        added_linked_, idle_start() ? "idle links" : "links that were not idle"));
  }
  begin_solve();
  solve_fresh(rates_gbps);
  return changed_;
}

void SharingNetwork::solve_fresh(std::span<const double> rates_gbps) {
  // The links the added flows cross carry only them (add_flow met each empty, and no added flow left); the
  // other dirty links were left empty by removals and share nothing. One batch changed them all, so they
  // are filled together, as the gathering would find them: component by component, in one fill.
  for (std::uint32_t l : dirty_) link_dirty_[l] = 0;
  dirty_.clear();
  end_batch();
  if (static_cast<std::size_t>(added_linked_) == fresh_flows_.size()) {
    changed_.swap(fresh_flows_);
  } else {
    for (FlowId f : fresh_flows_) {
      if (flows_[f].length > 0) changed_.push_back(f);  // over no link: solved below
    }
  }
  fresh_flows_.clear();
  added_linked_ = 0;
  if (rates_gbps.empty()) {
    for (std::uint32_t l : fresh_links_) link_visit_[l] = visit_;  // what fill takes for its links
    fill(fresh_links_, changed_);
  } else {
    for (std::size_t i = 0; i < changed_.size(); ++i) flows_[changed_[i]].rate_gbps = rates_gbps[i];
  }
  fresh_links_.clear();
  for (FlowId f : unlinked_new_) {
    flows_[f].rate_gbps = std::numeric_limits<double>::infinity();
    changed_.push_back(f);
  }
  unlinked_new_.clear();
}

void SharingNetwork::fill(std::span<const std::uint32_t> links, std::span<const FlowId> flows) {
  // Links whose last flows just left (a collective's, when it ends) have nothing to share; what fill
  // would set on them is scratch that the next fill over them sets again.
  if (flows.empty()) return;
  // A min-heap of the links' fair shares (remaining / unfixed); an entry whose version is not its link's
  // current one is stale and skipped.
  using Entry = ShareEntry;
  std::vector<Entry>& heap = heap_;
  heap.clear();
  heap.reserve(links.size());
  for (std::uint32_t l : links) {
    const Link& link = links_[l];
    LinkShare& share = shares_[l];
    share.remaining_gbps = link.capacity_gbps;
    share.unfixed = link.copies;
    ++share.version;
    if (share.unfixed > 0) heap.push_back({share.remaining_gbps / share.unfixed, l, share.version});
  }
  for (FlowId f : flows) flows_[f].fixed = false;
  // Once every flow is fixed the heap holds only links they filled or left: stop there rather than pop
  // each (a large world's collective leaves thousands).
  std::size_t unfixed_flows = flows.size();
  std::make_heap(heap.begin(), heap.end(), std::greater<>());

  auto pop = [&] {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Entry e = heap.back();
    heap.pop_back();
    return e;
  };
  auto valid = [&](const Entry& e) { return shares_[e.link].version == e.version; };
  // Past 64 pops in a row on a heap of over 1,024 entries, the rest is taken in one pass over the heap,
  // which is then built again: linear, where a pop each costs a log and a cache miss (a large world's
  // collective loads thousands of links alike, and a level leaves thousands stale).
  auto in_one_pass = [&](int& pops) { return ++pops > 64 && heap.size() > 1024; };
  auto drop_and_rebuild = [&](auto drop) {
    std::erase_if(heap, drop);
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
  };
  std::vector<std::uint32_t>& full = full_;
  std::vector<std::uint32_t>& touched = touched_;
  // A link full at this level: its entry is spent.
  auto take = [&](std::uint32_t link) {
    ++shares_[link].version;
    full.push_back(link);
  };
  while (unfixed_flows > 0) {
    int stale = 0;
    while (!heap.empty() && !valid(heap.front())) {
      if (in_one_pass(stale)) {
        drop_and_rebuild([&](const Entry& e) { return !valid(e); });
        break;
      }
      pop();
    }
    if (heap.empty()) break;
    // Every flow still unfixed gets this much from its most contended link; every link at that share
    // (within the same relative tolerance as max_min_rates) is full. The level's links are the same set
    // whether popped or taken in one pass, and nothing below depends on their order.
    const double level = std::max(heap.front().share, 0.0);
    const double limit = level * (1 + 1e-12);
    full.clear();
    int popped = 0;
    while (!heap.empty() && (!valid(heap.front()) || heap.front().share <= limit)) {
      if (in_one_pass(popped)) {
        drop_and_rebuild([&](const Entry& e) {
          if (!valid(e)) return true;
          if (e.share > limit) return false;
          take(e.link);
          return true;
        });
        break;
      }
      const Entry e = pop();
      if (valid(e)) take(e.link);
    }
    touched.clear();
    for (std::uint32_t l : full) {
      for (FlowId f : links_[l].flows) {
        FlowRec& flow = flows_[f];
        if (flow.fixed) continue;
        flow.fixed = true;
        flow.rate_gbps = level;
        --unfixed_flows;
        for (std::uint32_t m : path(flow)) {
          LinkShare& link = shares_[m];
          // Copy by copy: every flow fixed at one level takes the same `level` from a link, so the link's
          // remaining capacity after the level does not depend on the order flows are fixed in, and a
          // flow standing for k copies leaves exactly what k separate flows would.
          for (std::uint32_t k = 0; k < flow.copies; ++k) {
            link.remaining_gbps = std::max(0.0, link.remaining_gbps - level);
          }
          link.unfixed -= flow.copies;
          touched.push_back(m);
        }
      }
    }
    for (std::uint32_t m : touched) {
      if (link_visit_[m] != visit_) continue;  // already re-queued this level
      link_visit_[m] = visit_ - 1;
      LinkShare& link = shares_[m];
      ++link.version;
      if (link.unfixed > 0) {
        heap.push_back({link.remaining_gbps / link.unfixed, m, link.version});
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
    }
    for (std::uint32_t m : touched) link_visit_[m] = visit_;
  }
}

}  // namespace ranklab::sim
