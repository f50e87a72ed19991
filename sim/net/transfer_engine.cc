#include "sim/net/transfer_engine.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace ranklab::sim {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
// A flow within this fraction of its bytes of done is done, so that flows that tie end together.
constexpr double kDoneFraction = 1e-9;
// Relative resolution of the clock below which remaining time counts as none.
constexpr double kTimeResolution = 1e-12;
}  // namespace

double TransferEngine::left_now(const Running& r) const {
  return std::max(0.0, r.left_bytes - r.rate_bytes_per_us * (now_us_ - r.since_us));
}

void TransferEngine::schedule(TransferOwner owner, CommPlan plan, double start_us) {
  auto t = std::make_unique<Transfer>();
  t->owner = std::move(owner);
  t->plan = std::move(plan);
  Transfer* raw = t.get();
  raw->slot = transfers_.size();
  transfers_.push_back(std::move(t));
  ++in_flight_;
  if (start_us >= now_us_) {
    starts_.add(start_us, raw);
    return;
  }
  // A late start: run its flows alone from its start to the present, then let it join the others.
  ++late_starts_;
  TransferEngine alone(topo_);
  alone.now_us_ = start_us;
  alone.schedule(raw->owner, raw->plan, start_us);
  std::vector<EndedTransfer> ended_alone = alone.advance_to(now_us_);
  if (!ended_alone.empty()) {
    // It ended in the past, alone (the copy shares the owner); nobody has seen its end yet.
    ended_.push_back(std::move(ended_alone.front()));
    end_transfer(raw);
    return;
  }
  const Transfer& copy = *alone.transfers_.front();
  if (copy.flows_left == 0) {
    raw->flows_done_us = copy.flows_done_us;
    tails_.add(copy.flows_done_us + raw->plan.latency_us, raw);
    return;
  }
  std::vector<double> left(raw->plan.flows.size(), 0.0);
  for (const Running& r : alone.running_) {
    if (r.transfer == nullptr) continue;
    if (r.flow != kBundle) {
      left[r.flow] = alone.left_now(r);
      continue;
    }
    for (int f = 0; f < static_cast<int>(left.size()); ++f) {
      if (moves(*raw, f)) left[f] = alone.left_now(r);
    }
  }
  for (int f = 0; f < static_cast<int>(left.size()); ++f) {
    if (left[f] > 0) add_flow(raw, f, left[f]);
  }
  reshare();
}

std::uint32_t TransferEngine::net_link(LinkId link) {
  std::uint32_t& id = link_ids_[link];
  if (id == 0) {
    id = net_.add_link(topo_.capacity_gbps(link)) + 1;
    link_marks_.emplace_back();
  }
  return id - 1;
}

std::uint32_t TransferEngine::add_flow(Transfer* t, int flow, double left_bytes, bool begun) {
  const std::span<const LinkId> links = t->plan.path(t->plan.flows[flow]);
  // A bundle over any of these links no longer has them to itself: it goes on as its flows.
  for (LinkId link : links) {
    const std::uint32_t id = link_ids_[link];
    if (id != 0 && link_marks_[id - 1].bundle != 0) split_bundle(link_marks_[id - 1].bundle - 1);
  }
  path_.clear();
  begun_apart_ = begun_apart_ && begun;
  for (LinkId link : links) {
    const std::uint32_t id = net_link(link);
    path_.push_back(id);
    LinkMark& mark = link_marks_[id];
    if (mark.flush == flushes_ && mark.by != t) begun_apart_ = false;
    mark.flush = flushes_;
    mark.by = t;
  }
  return start_flow(t, flow, t->plan.bytes(t->plan.flows[flow]), left_bytes, copies(*t, flow));
}

bool TransferEngine::begin_bundle(Transfer* t) {
  const CommPlan& plan = t->plan;
  int first = -1;
  path_.clear();
  for (int f = 0; f < static_cast<int>(plan.flows.size()); ++f) {
    if (!moves(*t, f)) continue;
    if (first < 0) first = f;
    for (LinkId link : plan.path(plan.flows[f])) {
      const std::uint32_t id = net_link(link);
      if (net_.carries_flows(id)) return false;
      path_.push_back(id);
    }
  }
  if (first < 0) return false;
  // Idle links: no other transfer crosses them, and none begun since the last sharing did (its flows would
  // be there), so the marks need no look.
  const double bytes = plan.bytes(plan.flows[first]);  // each flow's: they are alike (find_bundle)
  const std::uint32_t id = start_flow(t, kBundle, bytes, bytes, copies(*t, first));
  for (std::uint32_t link : path_) link_marks_[link] = {flushes_, t, id + 1};
  return true;
}

std::uint32_t TransferEngine::start_flow(Transfer* t, int flow, double bytes, double left_bytes,
                                         std::uint32_t copies) {
  const std::uint32_t id = net_.add_flow(path_, copies);
  if (id >= running_.size()) running_.resize(id + 1);
  Running& r = running_[id];
  r.transfer = t;
  r.flow = flow;
  r.left_bytes = left_bytes;
  r.rate_bytes_per_us = 0;
  r.since_us = now_us_;
  r.end_us = kInf;
  r.done_bytes = bytes * kDoneFraction;
  ++t->flows_left;
  // Flows retire in the order the engine has always used: that of a list of running flows, appended to
  // at the end and closed up by moving its last entry into the gap (see retire_done_flows).
  if (id >= position_.size()) position_.resize(id + 1);
  position_[id] = order_.size();
  order_.push_back(id);
  return id;
}

void TransferEngine::split_bundle(std::uint32_t id) {
  const Running was = running_[id];
  Transfer* t = was.transfer;
  ends_.erase(id);
  end_flow(id);
  --t->flows_left;
  for (int f = 0; f < static_cast<int>(t->plan.flows.size()); ++f) {
    if (!moves(*t, f)) continue;
    const std::uint32_t flow = add_flow(t, f, was.left_bytes);
    // Where the bundle was, so that a flow the newcomer leaves alone keeps its rate and its end exactly.
    Running& r = running_[flow];
    r.rate_bytes_per_us = was.rate_bytes_per_us;
    r.since_us = was.since_us;
    r.end_us = was.end_us;
    r.retire_us = was.retire_us;
    if (std::isfinite(r.end_us)) ends_.set(flow, r.end_us);
  }
}

void TransferEngine::begin_flows(Transfer* t) {
  t->flows_left = 0;
  if (t->plan.bundle && begin_bundle(t)) {
    begun_.emplace_back(t, 1);
    return;
  }
  for (int f = 0; f < static_cast<int>(t->plan.flows.size()); ++f) {
    // Nothing to move, or nothing to cross: done at once; or it moves with the flow it is a copy of.
    if (!moves(*t, f)) continue;
    add_flow(t, f, t->plan.bytes(t->plan.flows[f]), /*begun=*/true);  // all of it is left when it starts
  }
  if (t->flows_left > 0) begun_.emplace_back(t, t->flows_left);
  if (t->flows_left == 0) {
    t->flows_done_us = now_us_;
    tails_.add(now_us_ + t->plan.latency_us, t);
  }
}

void TransferEngine::end_flow(std::uint32_t id) {
  Running& r = running_[id];
  if (r.flow == kBundle) {
    for (std::uint32_t link : net_.path(id)) link_marks_[link].bundle = 0;
  }
  net_.remove_flow(id);
  r.transfer = nullptr;
  const std::size_t at = position_[id];
  const std::uint32_t last = order_.back();
  order_[at] = last;
  position_[last] = at;
  order_.pop_back();
}

void TransferEngine::reshare() {
  net_.end_batch();
  unshared_ = true;
}

void TransferEngine::flush() {
  if (!unshared_) return;
  unshared_ = false;
  fresh_ends_.clear();
  // Transfers that start on idle links, no two over one link, get the rates their plans' flows got the
  // last time they did; the first time, they are shared and kept.
  const bool apart = begun_apart_ && !begun_.empty() && net_.idle_start();
  bool known = apart;
  begun_rates_.clear();
  for (std::size_t i = 0; known && i < begun_.size(); ++i) {
    const auto& [t, flows] = begun_[i];
    const std::vector<double>* rates = t->plan.idle_rates_gbps.get();
    known = rates != nullptr && rates->size() == static_cast<std::size_t>(flows);
    if (known) begun_rates_.insert(begun_rates_.end(), rates->begin(), rates->end());
  }
  const std::vector<SharingNetwork::FlowId>& changed =
      known ? net_.solve_idle_start(begun_rates_) : net_.solve();
  if (apart && !known) {
    // The flows come back in the order they were added: transfer by transfer.
    std::size_t at = 0;
    for (const auto& [t, flows] : begun_) {
      if (at + static_cast<std::size_t>(flows) > changed.size()) break;
      if (std::vector<double>* rates = t->plan.idle_rates_gbps.get(); rates != nullptr) {
        rates->clear();
        for (int f = 0; f < flows; ++f) rates->push_back(net_.rate_gbps(changed[at + f]));
      }
      at += static_cast<std::size_t>(flows);
    }
  }
  begun_.clear();
  begun_apart_ = true;
  ++flushes_;
  for (SharingNetwork::FlowId id : changed) {
    Running& r = running_[id];
    const double rate_bytes_per_us = net_.rate_gbps(id) * 1e3;  // GB/s -> B/us
    // A flow of a shared-again component whose rate came out the same keeps its end, and its places in
    // the heaps: a large component's flows are mostly held by links the change did not reach.
    if (rate_bytes_per_us == r.rate_bytes_per_us && r.rate_bytes_per_us > 0) continue;
    r.left_bytes = left_now(r);
    r.since_us = now_us_;
    r.rate_bytes_per_us = rate_bytes_per_us;
    if (!(r.rate_bytes_per_us > 0)) {
      r.end_us = kInf;
      ends_.erase(id);
      continue;
    }
    r.end_us = now_us_ + r.left_bytes / r.rate_bytes_per_us;
    // Done once within kDoneFraction of its bytes, or when the time left is below the clock's resolution
    // (otherwise `now + left / rate` rounds back to `now` and time stops moving).
    r.retire_us = std::min(r.end_us - r.done_bytes / r.rate_bytes_per_us,
                           r.end_us - kTimeResolution * std::max(1.0, r.end_us));
    retire_lead_us_ = std::max(retire_lead_us_, r.end_us - r.retire_us);
    fresh_ends_.push_back({r.end_us, id});
  }
  ends_.set_all(fresh_ends_);
}

void TransferEngine::retire_done_flows() {
  // The flows that count as done now, and those that looked close but are not (rounding): they are due
  // again at their end. A flow done now ends within the largest lead after now, so the end heap's entries
  // up to twice that (rounding) hold every one; those not due go back as they were.
  std::vector<std::uint32_t>& done = done_;
  std::vector<FlowHeap::Entry>& again = again_;
  done.clear();
  again.clear();
  ends_.take_due(now_us_ + 2 * retire_lead_us_, [&](const FlowHeap::Entry& d) {
    Running& r = running_[d.flow];
    if (r.retire_us > now_us_) {
      again.push_back(d);
      return;
    }
    const double left = left_now(r);
    const double left_us = r.rate_bytes_per_us > 0 ? left / r.rate_bytes_per_us : kInf;
    if (left <= r.done_bytes || left_us <= kTimeResolution * std::max(1.0, now_us_) || now_us_ >= r.end_us) {
      done.push_back(d.flow);
    } else {
      r.retire_us = r.end_us;
      again.push_back(d);
    }
  });
  for (const FlowHeap::Entry& d : again) ends_.set(d.flow, d.at_us);
  if (done.empty()) return;
  // Retire them in the order of the running list: lowest position first; the entry moved into a gap is
  // looked at next (it is then the lowest).
  std::vector<char>& is_done = retiring_;  // all zero between calls
  is_done.resize(running_.size(), 0);
  for (std::uint32_t id : done) is_done[id] = 1;
  auto retire_at = [&](std::size_t at) {
    while (at < order_.size() && is_done[order_[at]]) {
      const std::uint32_t id = order_[at];
      is_done[id] = 0;
      Transfer* t = running_[id].transfer;
      end_flow(id);
      if (--t->flows_left == 0) {
        t->flows_done_us = now_us_;
        tails_.add(now_us_ + t->plan.latency_us, t);
      }
    }
  };
  if (done.size() * 8 >= order_.size()) {
    for (std::size_t at = 0; at < order_.size(); ++at) retire_at(at);
    if (order_.empty()) retire_lead_us_ = 0;
    return;
  }
  std::vector<std::pair<std::size_t, std::uint32_t>>& pending = pending_;
  pending.clear();
  for (std::uint32_t id : done) pending.emplace_back(position_[id], id);
  std::sort(pending.begin(), pending.end());
  // An entry whose flow is no longer at its position was moved into a gap and retired there already.
  for (const auto& [at, id] : pending) {
    if (is_done[id] && position_[id] == at) retire_at(at);
  }
  if (order_.empty()) retire_lead_us_ = 0;
}

double TransferEngine::next_flow_end_us() {
  flush();
  return ends_.empty() ? kInf : ends_.top().at_us;
}

double TransferEngine::next_event_us() {
  if (!ended_.empty()) return now_us_;
  double t = next_flow_end_us();
  if (!starts_.empty()) t = std::min(t, starts_.first_us());
  if (!tails_.empty()) t = std::min(t, tails_.first_us());
  return t;
}

void TransferEngine::end_transfer(Transfer* t) {
  const std::size_t at = t->slot;
  if (at + 1 != transfers_.size()) {
    transfers_.back()->slot = at;
    transfers_[at] = std::move(transfers_.back());
  }
  transfers_.pop_back();
  --in_flight_;
}

std::vector<EndedTransfer> TransferEngine::advance_to(double t_us, bool stop_at_end) {
  std::vector<EndedTransfer> ended;
  ended.swap(ended_);
  while (true) {
    if (stop_at_end && !ended.empty()) return ended;
    // Moving to the present needs no sharing: flows end after it. (A flow whose time left is below the
    // clock's resolution after the sharing is then retired at the same time by the next move.)
    double event = unshared_ && t_us <= now_us_ ? kInf : next_flow_end_us();
    if (!starts_.empty()) event = std::min(event, starts_.first_us());
    if (!tails_.empty()) event = std::min(event, tails_.first_us());
    if (event > t_us || std::isinf(event)) break;  // nothing due before t_us, or nothing in flight
    now_us_ = std::max(now_us_, event);
    retire_done_flows();
    // Everything else due now, then one sharing for all of it.
    while (true) {
      bool any = false;
      while (!tails_.empty() && tails_.first_us() <= now_us_) {
        Transfer* t = tails_.take_first();
        ended.push_back({t->owner, now_us_});
        end_transfer(t);
        any = true;
      }
      while (!starts_.empty() && starts_.first_us() <= now_us_) {
        Transfer* t = starts_.take_first();
        begin_flows(t);
        any = true;
      }
      if (!any) break;
    }
    reshare();
  }
  // Before the next event nothing changes rate: the clock moves, and the flows' bytes are brought up to
  // date when their rates next change.
  if (t_us > now_us_ && std::isfinite(t_us)) now_us_ = t_us;
  return ended;
}

}  // namespace ranklab::sim
