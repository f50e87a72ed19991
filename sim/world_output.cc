// SimWorld's host rendezvous (barrier(), show()) and what the run leaves: printed lines, spans, and
// the report.
#include <fmt/format.h>

#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

#include "common/errors.h"
#include "common/progress.h"
#include "sim/rank_faults.h"
#include "sim/reduce.h"
#include "sim/run_topology.h"
#include "sim/scheduler.h"
#include "sim/world.h"

namespace ranklab::sim {

// ---- host rendezvous: barrier and show -------------------------------------------------------------

SimWorld::HostRendezvous& SimWorld::host_rendezvous(const std::string& key, int expected) {
  HostRendezvous& h = host_rendezvous_[key];
  h.expected = expected;
  if (h.payload.empty()) h.payload.resize(size());
  return h;
}

void SimWorld::barrier(int rank, const Group& group) {
  const std::vector<int>& group_ranks = operations_.members(group);
  RankState& s = state(rank);
  const std::uint64_t seq = s.barrier_seq[group.id()]++;
  const std::string key = fmt::format("barrier {} {}", group.id(), seq);
  const int expected = static_cast<int>(
      std::count_if(group_ranks.begin(), group_ranks.end(), [this](int r) { return runs(r); }));
  HostRendezvous& h = host_rendezvous(key, expected);
  ++h.arrived;
  h.latest_host_us = std::max(h.latest_host_us, s.host_us);
  if (h.arrived == h.expected) {
    for (int r : group_ranks) {
      if (runs(r)) scheduler_.wake(r);
    }
  }
  block_until(
      rank, [&] { return h.arrived == h.expected; },
      [&h, &group, seq] {
        return fmt::format("barrier #{} on {}: {} of {} ranks have arrived", seq, group.str(), h.arrived,
                           h.expected);
      });
  s.host_us = std::max(s.host_us, h.latest_host_us + profile().barrier_latency_us);
}

void SimWorld::show(int rank, const std::string& label, const std::string& values) {
  RankState& s = state(rank);
  const std::uint64_t seq = s.shows++;
  HostRendezvous& h = host_rendezvous(fmt::format("show {}", seq), symmetry_.running());
  if (h.arrived == 0) {
    h.label = label;
    h.first_rank = rank;
  } else if (label != h.label) {
    // Printing every rank's values under the first rank's label would present them as the same thing.
    throw MismatchError(
        fmt::format("ranks disagree on show() call #{}: rank {} shows \"{}\", rank {} shows \"{}\"", seq,
                    h.first_rank, h.label, rank, label));
  }
  h.payload[rank] = values;
  ++h.arrived;
  if (h.arrived == h.expected) {
    const std::string pad(h.label.size(), ' ');
    for (int r = 0; r < size(); ++r) {
      if (runs(r)) print(fmt::format("{} rank{} = {}", r == 0 ? h.label : pad, r, h.payload[r]));
    }
    for (int r = 0; r < size(); ++r) scheduler_.wake(r);
  }
  block_until(
      rank, [&] { return h.arrived == h.expected; },
      [&h, label] {
        return fmt::format("show(\"{}\"): {} of {} ranks have called it", label, h.arrived, h.expected);
      });
}

// ---- report ----------------------------------------------------------------------------------------

void SimWorld::print(const std::string& line) {
  report_.output.push_back(line);
  if (config_.echo_output) {
    Progress::erase_shown();
    std::fputs(line.c_str(), stdout);
    std::fputc('\n', stdout);
    // A run that aborts (out of memory in a huge world, a fiber stack overflow) must not lose what it
    // printed; stdout is block-buffered when it is a file or a pipe.
    std::fflush(stdout);
  }
}

SpanName SimWorld::op_name(CommOp op) {
  const auto at = static_cast<std::size_t>(op);
  if (at >= op_names_.size()) op_names_.resize(at + 1);
  if (op_names_[at].empty()) op_names_[at] = op == CommOp::Send ? "send/recv" : comm_op_name(op);
  return op_names_[at];
}

SpanName SimWorld::group_name(const CommOpState& op) {
  if (op.op == CommOp::Send) {
    auto [it, inserted] = pair_names_.try_emplace(std::make_pair(op.ranks[0], op.ranks[1]));
    if (inserted) it->second = fmt::format("rank {} -> rank {}", op.ranks[0], op.ranks[1]);
    return it->second;
  }
  const auto at = static_cast<std::size_t>(op.group_id);
  if (at >= group_names_.size()) group_names_.resize(at + 1);
  if (group_names_[at].empty()) group_names_[at] = op.members[0].call.group.str();
  return group_names_[at];
}

SpanName SimWorld::plan_name(const CommPlan& plan) {
  constexpr std::size_t kProtocols = 3;  // LL, LL128, Simple
  const std::size_t at =
      static_cast<std::size_t>(plan.algorithm) * kProtocols + static_cast<std::size_t>(plan.protocol);
  if (at >= plan_names_.size()) plan_names_.resize(at + 1);
  if (plan_names_[at].empty()) plan_names_[at] = plan.name();
  return plan_names_[at];
}

double SimWorld::timeline_watermark(const RankState& s) {
  const double w = std::min(s.host_us, s.compute_us);
  return s.unfinished_posts.empty() ? w : std::min(w, s.unfinished_posts.front().host_us);
}

void SimWorld::finish_post(RankState& s, std::uint64_t seq) {
  s.unfinished_posts[seq - s.first_unfinished_post].finished = true;
  std::size_t done = 0;
  while (done < s.unfinished_posts.size() && s.unfinished_posts[done].finished) ++done;
  s.unfinished_posts.pop_front(done);
  s.first_unfinished_post += done;
}

void SimWorld::add_span(int rank, SpanKind kind, SpanName name, double start_us, double end_us) {
  if (end_us <= start_us || !config_.keep_timeline) return;
  RankState& s = state(rank);
  s.timeline.add(kind, start_us, end_us);
  if (s.timeline.held() >= s.timeline_fold_at) {
    s.timeline.fold(timeline_watermark(s));
    s.timeline_held_most = std::max(s.timeline_held_most, s.timeline.held());
    // Folded again once it has doubled: constant time per span however many stay held.
    s.timeline_fold_at = std::max<std::size_t>(64, 2 * s.timeline.held());
  }
  if (traced(rank)) report_.spans.push_back({rank, kind, name, start_us, end_us});
}

void SimWorld::add_region(int rank, const std::string& name, double start_us, double end_us) {
  if (traced(rank)) report_.regions.push_back({rank, name, start_us, end_us});
}

void SimWorld::keep_in_trace(int rank) {
  if (config_.trace_ranks.mode == TraceRanks::Mode::Lesson) traced_[representative(rank)] = 1;
}

std::size_t SimWorld::timeline_held_most() const {
  std::size_t most = 0;
  for (const auto& s : ranks_) most = std::max({most, s->timeline_held_most, s->timeline.held()});
  return most;
}

void SimWorld::add_check(int rank, const std::string& what, bool passed, const std::string& detail) {
  report_.checks.push_back({rank, what, passed, detail});
}

RunReport SimWorld::finish_report() {
  if (symmetry_.enabled()) {
    print(fmt::format(
        "symmetric run: {} of {} ranks ran, the others mirrored them{}", symmetry_.running(), size(),
        symmetry_.spine_crossed()
            ? "; traffic crossed the fabric's spines, whose hashed routes and leaf boundaries need not map "
              "onto each other as the ranks do: each operation waited for its slowest replica, which errs "
              "long where replicas that seldom meet are slow at different times (mirroring dp replicas "
              "errs most; docs/lessons/gpt.md; run without the symmetry for the exact figures)"
            : "; every figure is the full run's"));
  }
  report_.ranks.clear();
  report_.makespan_us = 0;
  for (int r = 0; r < size(); ++r) {
    const RankState& s = state(representative(r));
    RankSummary sum;
    sum.rank = r;
    sum.end_us = s.host_us;
    sum.comm_slowed_compute_us = s.comm_slowed_compute_us;
    sum.host_wait_us = s.host_wait_us;
    sum.peak_bytes = s.memory->peak;
    sum.capacity_bytes = s.memory->capacity;
    if (runs(r)) s.timeline.summarize(sum);
    report_.ranks.push_back(sum);
    report_.makespan_us = std::max(report_.makespan_us, s.host_us);
  }
  progress_.finish();
  if (report_.makespan_us == 0) {
    for (const RankSummary& s : report_.ranks) report_.makespan_us = std::max(report_.makespan_us, s.end_us);
  }
  report_.links = network_->link_traffic();
  report_.late_starts = engine_.late_starts();
  report_.collective_totals = collective_tally_.take();
  if (config_.keep_timeline) {
    std::vector<ActivityBins> bins(static_cast<std::size_t>(size()));
    std::vector<const ActivityBins*> per_rank(static_cast<std::size_t>(size()), nullptr);
    for (int r = 0; r < size(); ++r) {
      if (runs(r)) per_rank[r] = &(bins[r] = state(r).timeline.activity());
    }
    report_.activity = activity_strip(per_rank, report_.makespan_us);
  }
  for (int r = 0; r < size(); ++r) {
    if (traced(r)) report_.traced_ranks.push_back(r);
  }
  if (static_cast<int>(report_.traced_ranks.size()) == size()) report_.traced_ranks.clear();  // every rank
  // A mirror's figures are its representative's.
  if (symmetry_.enabled()) {
    for (int r = 0; r < size(); ++r) {
      if (runs(r)) continue;
      report_.ranks[r] = report_.ranks[symmetry_.representative(r)];
      report_.ranks[r].rank = r;
      report_.ranks[r].mirror_of = symmetry_.representative(r);
    }
  }
  return std::move(report_);
}

RunTopology SimWorld::describe_topology() const {
  return run_topology(network_->topology(), size());
}

}  // namespace ranklab::sim
