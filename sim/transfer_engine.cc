#include "sim/transfer_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "sim/max_min.h"

namespace ranklab::sim {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
// A flow within this fraction of its bytes of done is done, so that flows that tie end together.
constexpr double kDoneFraction = 1e-9;
// Relative resolution of the clock below which remaining time counts as none.
constexpr double kTimeResolution = 1e-12;
}  // namespace

void TransferEngine::schedule(std::shared_ptr<CommOpState> op, CommPlan plan, double start_us) {
  auto t = std::make_unique<Transfer>();
  t->op = std::move(op);
  t->plan = std::move(plan);
  t->left_bytes.reserve(t->plan.flows.size());
  for (const Flow& f : t->plan.flows) t->left_bytes.push_back(f.bytes);
  Transfer* raw = t.get();
  transfers_.push_back(std::move(t));
  if (start_us >= now_us_) {
    starts_.emplace(start_us, raw);
    return;
  }
  // A late start: run its flows alone from its start to the present, then let it join the others.
  ++late_starts_;
  TransferEngine alone(topo_);
  alone.now_us_ = start_us;
  alone.transfers_.push_back(std::make_unique<Transfer>(*raw));
  Transfer* copy = alone.transfers_.back().get();
  alone.begin_flows(copy);
  alone.advance_to(now_us_);
  if (raw->op->finished) {
    // It ended in the past, alone (the copy shares the operation); nobody has seen its end yet.
    ended_.push_back(raw->op);
    transfers_.pop_back();
    return;
  }
  raw->left_bytes = copy->left_bytes;
  raw->flows_left = copy->flows_left;
  raw->flows_done_us = copy->flows_done_us;
  if (raw->flows_left == 0) {
    tails_.emplace(raw->flows_done_us + raw->plan.latency_us, raw);
    return;
  }
  for (int f = 0; f < static_cast<int>(raw->plan.flows.size()); ++f) {
    if (raw->left_bytes[f] > 0) running_.push_back({raw, f});
  }
  reshare();
}

void TransferEngine::begin_flows(Transfer* t) {
  t->flows_left = 0;
  for (int f = 0; f < static_cast<int>(t->plan.flows.size()); ++f) {
    const Flow& flow = t->plan.flows[f];
    if (flow.bytes <= 0 || flow.length == 0) {
      t->left_bytes[f] = 0;  // nothing to move, or nothing to cross: done at once
      continue;
    }
    running_.push_back({t, f});
    ++t->flows_left;
  }
  if (t->flows_left == 0) {
    t->flows_done_us = now_us_;
    tails_.emplace(now_us_ + t->plan.latency_us, t);
  }
  reshare();
}

void TransferEngine::reshare() {
  rate_bytes_per_us_.assign(running_.size(), 0);
  if (running_.empty()) return;
  // Renumber the links in use densely for the solver.
  FlowNetwork net;
  std::unordered_map<LinkId, std::uint32_t> local;
  std::vector<std::uint32_t> path;
  for (const Running& r : running_) {
    path.clear();
    for (LinkId link : r.transfer->plan.path(r.transfer->plan.flows[r.flow])) {
      auto [it, added] = local.emplace(link, 0);
      if (added) it->second = net.add_link(topo_.capacity_gbps(link));
      path.push_back(it->second);
    }
    net.add_flow(path);
  }
  const std::vector<double> rates_gbps = max_min_rates(net);
  for (size_t i = 0; i < running_.size(); ++i) rate_bytes_per_us_[i] = rates_gbps[i] * 1e3;  // GB/s -> B/us
}

void TransferEngine::progress(double dt_us) {
  if (dt_us <= 0) return;
  for (size_t i = 0; i < running_.size(); ++i) {
    double& left = running_[i].transfer->left_bytes[running_[i].flow];
    left = std::max(0.0, left - rate_bytes_per_us_[i] * dt_us);
  }
}

void TransferEngine::retire_done_flows() {
  bool changed = false;
  for (size_t i = 0; i < running_.size();) {
    Transfer* t = running_[i].transfer;
    const int f = running_[i].flow;
    // Done when within rounding of its bytes, or when what is left would take less time than the clock
    // can resolve (otherwise `now + left / rate` rounds back to `now` and time stops moving).
    const double left_us = rate_bytes_per_us_[i] > 0 ? t->left_bytes[f] / rate_bytes_per_us_[i] : INFINITY;
    if (t->left_bytes[f] <= t->plan.flows[f].bytes * kDoneFraction ||
        left_us <= kTimeResolution * std::max(1.0, now_us_)) {
      t->left_bytes[f] = 0;
      running_[i] = running_.back();
      running_.pop_back();
      rate_bytes_per_us_[i] = rate_bytes_per_us_.back();
      rate_bytes_per_us_.pop_back();
      changed = true;
      if (--t->flows_left == 0) {
        t->flows_done_us = now_us_;
        tails_.emplace(now_us_ + t->plan.latency_us, t);
      }
    } else {
      ++i;
    }
  }
  if (changed) reshare();
}

double TransferEngine::next_flow_end_us() const {
  double soonest = kInf;
  for (size_t i = 0; i < running_.size(); ++i) {
    const double rate = rate_bytes_per_us_[i];
    if (rate > 0)
      soonest = std::min(soonest, now_us_ + running_[i].transfer->left_bytes[running_[i].flow] / rate);
  }
  return soonest;
}

double TransferEngine::next_event_us() const {
  if (!ended_.empty()) return now_us_;
  double t = next_flow_end_us();
  if (!starts_.empty()) t = std::min(t, starts_.begin()->first);
  if (!tails_.empty()) t = std::min(t, tails_.begin()->first);
  return t;
}

std::vector<std::shared_ptr<CommOpState>> TransferEngine::advance_to(double t_us) {
  std::vector<std::shared_ptr<CommOpState>> ended;
  ended.swap(ended_);
  while (true) {
    double event = next_flow_end_us();
    if (!starts_.empty()) event = std::min(event, starts_.begin()->first);
    if (!tails_.empty()) event = std::min(event, tails_.begin()->first);
    if (event > t_us) break;
    progress(event - now_us_);
    now_us_ = std::max(now_us_, event);
    retire_done_flows();
    while (!tails_.empty() && tails_.begin()->first <= now_us_) {
      Transfer* t = tails_.begin()->second;
      tails_.erase(tails_.begin());
      t->op->end_us = now_us_;
      t->op->finished = true;
      ended.push_back(t->op);
      auto it =
          std::find_if(transfers_.begin(), transfers_.end(), [t](const auto& p) { return p.get() == t; });
      *it = std::move(transfers_.back());
      transfers_.pop_back();
    }
    while (!starts_.empty() && starts_.begin()->first <= now_us_) {
      Transfer* t = starts_.begin()->second;
      starts_.erase(starts_.begin());
      begin_flows(t);
    }
  }
  if (t_us > now_us_ && std::isfinite(t_us)) {
    progress(t_us - now_us_);
    now_us_ = t_us;
  }
  return ended;
}

}  // namespace ranklab::sim
