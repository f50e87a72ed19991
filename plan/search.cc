#include "plan/search.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/progress.h"
#include "common/report.h"
#include "lessons/gpt/accounting.h"
#include "lessons/parallel/groups.h"

namespace ranklab::plan {

std::vector<const Result*> Plan::ranked() const {
  std::vector<const Result*> out;
  for (const Result& r : results)
    if (r.candidate.status == Status::Simulated) out.push_back(&r);
  return out;
}

SimSymmetry symmetry_of(const Layout& l) {
  const parallel::Layout::Grid grid = parallel::Layout{l.tp, l.pp, l.dp, l.order}.symmetry();
  return SimSymmetry{grid.sizes, grid.replicated};
}

namespace {

// The largest peak over the ranks and what it is made of: the rank's stage plan for the parameters (which
// the run allocates exactly as planned), the rest of the peak activations and buffers.
Simulated read_run(const RunReport& rep, const gpt::Config& c) {
  Simulated s;
  s.stats = *rep.training;
  s.peak_bytes = s.stats.peak_memory_bytes;
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order};
  for (const RankSummary& r : rep.ranks) {
    if (r.peak_bytes > s.peak_bytes) {
      s.peak_bytes = r.peak_bytes;
      s.peak_stage = grid.coord(r.rank).pp;
    }
  }
  const gpt::MemoryPlan p = gpt::memory_plan(c, s.peak_stage);
  const std::pair<std::int64_t, const char*> parts[] = {
      {p.weights, "weights"},
      {p.grads, "grads"},
      {p.optimizer, "optimizer"},
      {std::max<std::int64_t>(0, s.peak_bytes - p.fixed()), "activations"}};
  const auto* big = std::max_element(std::begin(parts), std::end(parts),
                                     [](const auto& a, const auto& b) { return a.first < b.first; });
  s.peak_part = fmt::format("{} {}", big->second, format_bytes(static_cast<double>(big->first)));
  return s;
}

}  // namespace

Result simulate(const Question& q, const Layout& l, bool symmetry) {
  Result out;
  out.candidate.layout = l;
  out.candidate.name = l.name();
  out.candidate.capacity_bytes = q.profile.hbm_capacity_bytes();
  const Options o = lesson_options(q, l);
  const gpt::Config c = gpt::config_from(o, q.world());  // UsageError for a layout the lesson refuses
  out.candidate.bound_us = StepBound(q.profile).us(c);
  out.candidate.planned_bytes = planned_peak_bytes(c);
  SimConfig config;
  config.profile = q.profile;
  config.echo_output = false;
  if (symmetry) config.symmetry = symmetry_of(l);
  SimBackend backend(config);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const RunReport rep = run_lesson(backend, "gpt", o);
    if (!rep.training) throw Error(fmt::format("gpt {}: the run reported no training figures", l.name()));
    out.run = read_run(rep, c);
    out.candidate.status = Status::Simulated;
  } catch (const OutOfMemoryError& e) {
    out.candidate.status = Status::RejectedMemory;
    out.candidate.reason = e.what();
  }
  out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

Plan search(const Question& q, const SearchOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Plan plan;
  plan.question = q;
  std::vector<Candidate> all = enumerate(q);
  plan.enumerated = static_cast<int>(all.size());
  if (std::all_of(all.begin(), all.end(), [](const Candidate& k) { return k.status == Status::Invalid; })) {
    throw UsageError(fmt::format(
        "plan: the gpt lesson accepts none of the {} layouts of {} ranks for this question; the first, {}, "
        "because {}",
        all.size(), q.world(), all.empty() ? "" : all.front().name, all.empty() ? "" : all.front().reason));
  }
  std::vector<Result> done, pending;
  for (Candidate& k : all) {
    if (k.status == Status::Pending) {
      pending.push_back(Result{std::move(k), std::nullopt});
    } else {
      plan.invalid += k.status == Status::Invalid;
      plan.rejected_by_plan += k.status == Status::RejectedMemory;
      done.push_back(Result{std::move(k), std::nullopt});
    }
  }
  // Cheapest bound first; equal bounds by name, so that the order, and with it the answer, is the same
  // every time.
  std::sort(pending.begin(), pending.end(), [](const Result& a, const Result& b) {
    return a.candidate.bound_us != b.candidate.bound_us ? a.candidate.bound_us < b.candidate.bound_us
                                                        : a.candidate.name < b.candidate.name;
  });
  double best_us = 0;
  std::string best_name;
  Progress progress("plan: simulating layouts", static_cast<std::int64_t>(pending.size()), stderr,
                    options.progress && isatty(fileno(stderr)) == 1);
  int attempted = 0;
  for (std::size_t i = 0; i < pending.size(); ++i) {
    Candidate& k = pending[i].candidate;
    // A layout can win only by a shorter step, or by an equal one and an earlier name.
    const bool can_win = !options.prune || best_name.empty() || k.bound_us < best_us ||
                         (k.bound_us == best_us && k.name < best_name);
    if (!can_win) {
      k.status = Status::PrunedBound;
      ++plan.pruned;
      continue;
    }
    if (options.max_candidates > 0 && attempted >= options.max_candidates) {
      k.status = Status::Unexplored;
      ++plan.unexplored;
      continue;
    }
    progress.update(static_cast<std::int64_t>(i), k.name);
    ++attempted;
    Result r = simulate(q, k.layout, options.symmetry);
    r.candidate.status == Status::Simulated ? ++plan.simulated : ++plan.rejected_by_run;
    if (r.candidate.status == Status::Simulated) {
      const double t = r.run->stats.step_time_us;
      if (best_name.empty() || t < best_us || (t == best_us && r.candidate.name < best_name)) {
        best_us = t;
        best_name = r.candidate.name;
      }
    }
    pending[i] = std::move(r);
  }
  progress.finish();
  for (Result& r : pending) done.push_back(std::move(r));
  std::sort(done.begin(), done.end(), [](const Result& a, const Result& b) {
    const bool sa = a.candidate.status == Status::Simulated, sb = b.candidate.status == Status::Simulated;
    if (sa != sb) return sa;
    if (sa && a.run->stats.step_time_us != b.run->stats.step_time_us)
      return a.run->stats.step_time_us < b.run->stats.step_time_us;
    return a.candidate.name < b.candidate.name;
  });
  plan.results = std::move(done);
  plan.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace ranklab::plan
