#include "plan/search.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <thread>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/progress.h"
#include "common/report.h"
#include "lessons/gpt/accounting.h"
#include "lessons/parallel/groups.h"
#include "plan/cluster.h"

namespace ranklab::plan {

std::vector<const Result*> Plan::ranked() const {
  std::vector<const Result*> out;
  for (const Result& r : results)
    if (r.candidate.status == Status::Simulated) out.push_back(&r);
  return out;
}

SimSymmetry symmetry_of(const Layout& l) {
  const parallel::Layout::Grid grid = parallel::Layout{l.tp, l.pp, l.dp, l.order, l.cp}.symmetry();
  return SimSymmetry{grid.sizes, grid.replicated};
}

namespace {

// The largest peak over the ranks and what it is made of: the rank's stage plan for the parameters (which
// the run allocates exactly as planned), the rest of the peak activations and buffers.
Simulated read_run(const RunReport& rep, const gpt::Config& c) {
  Simulated s;
  s.stats = *rep.training;
  s.peak_bytes = s.stats.peak_memory_bytes;
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order, c.cp};
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

// The value at x of the line through (xa, ya) and (xb, yb).
double on_line(double xa, double ya, double xb, double yb, double x) {
  return yb + (yb - ya) / (xb - xa) * (x - xb);
}

}  // namespace

TrainingStats extrapolate(const TrainingStats& a, const TrainingStats& b, std::int64_t m) {
  const double ma = static_cast<double>(a.micro_batches), mb = static_cast<double>(b.micro_batches);
  auto line = [&](double ya, double yb) { return on_line(ma, ya, mb, yb, static_cast<double>(m)); };
  auto lines = [&](const std::map<std::string, double>& ya, const std::map<std::string, double>& yb) {
    std::map<std::string, double> out;
    for (const auto& [dim, y] : yb) {
      const auto it = ya.find(dim);
      out[dim] = std::max(0.0, line(it == ya.end() ? 0.0 : it->second, y));
    }
    return out;
  };
  auto bytes_line = [&](std::int64_t ya, std::int64_t yb) {
    return static_cast<std::int64_t>(line(static_cast<double>(ya), static_cast<double>(yb)));
  };
  TrainingStats t = b;
  const double more = static_cast<double>(m) / mb;  // FLOPs and tokens grow in proportion
  t.micro_batches = static_cast<int>(m);
  t.tokens_per_step = static_cast<std::int64_t>(static_cast<double>(b.tokens_per_step) * more);
  t.step_time_us = line(a.step_time_us, b.step_time_us);
  t.model_flops = b.model_flops * more;
  t.hardware_flops = b.hardware_flops * more;
  const double faster = more * b.step_time_us / t.step_time_us;  // FLOP/s against the longer run's
  t.model_tflops_per_gpu = b.model_tflops_per_gpu * faster;
  t.hardware_tflops_per_gpu = b.hardware_tflops_per_gpu * faster;
  t.mfu = b.mfu * faster;
  // The idle time is bubble x busy, and the busy time is in proportion to m.
  t.bubble_fraction =
      std::max(0.0, line(a.bubble_fraction * ma, b.bubble_fraction * mb)) / static_cast<double>(m);
  t.bubble_fraction_formula = b.bubble_fraction_formula * mb / static_cast<double>(m);
  t.exposed_comm_us = lines(a.exposed_comm_us, b.exposed_comm_us);
  t.communicated_comm_us = lines(a.communicated_comm_us, b.communicated_comm_us);
  t.hidden_comm_us = lines(a.hidden_comm_us, b.hidden_comm_us);
  t.peak_memory_bytes = bytes_line(a.peak_memory_bytes, b.peak_memory_bytes);
  t.activations_bytes = bytes_line(a.activations_bytes, b.activations_bytes);
  return t;
}

namespace {

// One run of the gpt lesson for layout `l`; OutOfMemoryError when it runs out of memory. The ranks' busy
// times (RankSummary) are kept `with_totals` (they are the timeline's).
RunReport run_lesson_step(const Question& q, const Layout& l, bool symmetry, bool with_totals = false) {
  SimConfig config;
  config.profile = q.profile;
  config.echo_output = false;
  config.progress = false;  // the search shows its own
  config.keep_timeline = with_totals;
  if (symmetry) config.symmetry = symmetry_of(l);
  SimBackend backend(config);
  RunReport rep = run_lesson(backend, "gpt", lesson_settings(q, l));
  if (!rep.training) throw Error(fmt::format("gpt {}: the run reported no training figures", l.name()));
  return rep;
}

// The same, read as a Simulated; nullopt with the simulator's message in `reason` when it ran out of memory.
std::optional<Simulated> run_step(const Question& q, const Layout& l, bool symmetry, std::string& reason) {
  try {
    return read_run(run_lesson_step(q, l, symmetry), lesson_config(q, l));
  } catch (const OutOfMemoryError& e) {
    reason = e.what();
    return std::nullopt;
  }
}

// The micro-batches a probe's two steps run 2 and 3 of: p with interleaving (its m is a multiple of p),
// else 1.
std::int64_t probe_unit(const gpt::Config& c) {
  return c.v > 1 ? c.pp : 1;
}

// The micro-batches of the shorter of the two steps a run extends its whole step from (2 p; the other runs
// 4 p), or 0 where it runs the whole step: with symmetry and extrapolation, for a step of at least 12 p.
std::int64_t extended_from(const gpt::Config& c, bool symmetry, bool extrapolate_step) {
  const std::int64_t short_m = 2 * c.pp;
  return symmetry && extrapolate_step && c.micro_batches() >= 6 * short_m ? short_m : 0;
}

// Whether probing a layout costs at most a fifth of its screening: the probe's 5 units of micro-batches
// against the screening's m, or the 6 p of the two steps it is extended from (extended_from `short_m`).
bool worth_probing(const gpt::Config& c, std::int64_t short_m) {
  const std::int64_t screened = short_m > 0 ? 3 * short_m : c.micro_batches();
  return 5 * 5 * probe_unit(c) <= screened;
}

}  // namespace

std::optional<std::vector<double>> measure_stage_kernels(const Question& q, const Layout& l) {
  const gpt::Config c = lesson_config(q, l);
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order, c.cp};
  const std::int64_t unit = probe_unit(c);
  // Each stage's kernel time: its ranks' compute-stream busy time less what communication kernels on the
  // same GPU took from it, the most of the stage's ranks that ran.
  auto kernels = [&](std::int64_t m) {
    Question shorter = q;
    shorter.global_batch = m * l.micro_batch * l.dp;
    std::vector<double> us(c.pp, 0.0);
    for (const RankSummary& r : run_lesson_step(shorter, l, true, true).ranks) {
      if (r.mirror_of >= 0) continue;
      double& stage = us[grid.coord(r.rank).pp];
      stage = std::max(stage, r.compute_us - r.comm_slowed_compute_us);
    }
    return us;
  };
  try {
    const std::vector<double> a = kernels(2 * unit), b = kernels(3 * unit);
    std::vector<double> per_micro_batch(c.pp);
    for (int s = 0; s < c.pp; ++s)
      per_micro_batch[s] = std::max(0.0, (b[s] - a[s]) / static_cast<double>(unit));
    return per_micro_batch;
  } catch (const OutOfMemoryError&) {
    return std::nullopt;  // the screening says so, with its own step
  } catch (const UsageError&) {
    return std::nullopt;  // a short step the lesson refuses where the whole one passes: screened unprobed
  }
}

Result simulate(const Question& q, const Layout& l, bool symmetry, bool extrapolate_step,
                const std::optional<Cutoff>& cutoff) {
  Result out;
  out.candidate.layout = l;
  out.candidate.name = l.name();
  out.candidate.capacity_bytes = q.profile.hbm_capacity_bytes();
  const gpt::Config c = lesson_config(q, l);  // UsageError for a layout the lesson refuses
  StepBound bound(q.profile);
  out.candidate.bound_us = bound.us(c);
  out.candidate.planned_bytes = planned_peak_bytes(c);
  const std::int64_t m = c.micro_batches(), short_m = extended_from(c, symmetry, extrapolate_step);
  const auto t0 = std::chrono::steady_clock::now();
  if (cutoff && symmetry && worth_probing(c, short_m)) {
    // An empty cutoff (nothing simulated yet) probes and screens.
    if (const std::optional<std::vector<double>> kernels = measure_stage_kernels(q, l)) {
      out.candidate.bound_us = std::max(out.candidate.bound_us, bound.us(c, *kernels));
      out.candidate.probed = true;
      if (!cutoff->beatable_by(out.candidate)) {
        out.candidate.status = Status::PrunedBound;
        out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return out;
      }
    }
  }
  std::optional<Simulated> run;
  if (short_m > 0) {
    Question shorter = q;
    shorter.global_batch = short_m * l.micro_batch * l.dp;
    std::optional<Simulated> a = run_step(shorter, l, symmetry, out.candidate.reason);
    shorter.global_batch *= 2;
    if (a) run = run_step(shorter, l, symmetry, out.candidate.reason);
    if (run) {
      // What grows with m past 2 p is the step's data (its tokens), on the same line as the times.
      const std::int64_t a_bytes = a->peak_bytes, b_bytes = run->peak_bytes;
      run->peak_bytes = static_cast<std::int64_t>(
          on_line(static_cast<double>(short_m), static_cast<double>(a_bytes),
                  static_cast<double>(2 * short_m), static_cast<double>(b_bytes), static_cast<double>(m)));
      run->stats = extrapolate(a->stats, run->stats, m);
      run->extrapolated_from = short_m;
      if (run->peak_bytes > out.candidate.capacity_bytes) {
        out.candidate.reason = fmt::format(
            "steps of {} and {} micro-batches peak at {} and {}: the step of {} at {}, over the {} of a GPU",
            short_m, 2 * short_m, format_bytes(static_cast<double>(a_bytes)),
            format_bytes(static_cast<double>(b_bytes)), m, format_bytes(static_cast<double>(run->peak_bytes)),
            format_bytes(static_cast<double>(out.candidate.capacity_bytes)));
        run.reset();
      }
    }
  } else {
    run = run_step(q, l, symmetry, out.candidate.reason);
  }
  if (run) {
    out.run = std::move(run);
    out.full = !symmetry;
    if (symmetry) out.screening = out.run;
    out.candidate.status = Status::Simulated;
  } else {
    out.candidate.status = Status::RejectedMemory;
  }
  out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

namespace {

// One simulation: a layout, screened (with the world's symmetry, and long steps extended) or in full.
struct Task {
  Layout layout;
  bool symmetry = true, extrapolate = false;
  std::optional<Cutoff> cutoff;  // probe first, and screen only what may beat it
};

// Simulations at most `jobs` at once on threads of this process, and with a cluster `jobs` more on each of
// its other ranks, each known by the id its caller gives it.
class Pool {
 public:
  // `here` names this process in a message ("" alone; " (rank 2, node17)" in a job).
  Pool(const Question& q, int jobs, Messenger* cluster, std::string here = "")
      : q_(q),
        per_rank_(std::max(1, jobs)),
        cluster_(cluster),
        here_(std::move(here)),
        busy_(cluster ? cluster->size() : 1, 0) {}
  ~Pool() {
    for (auto& [id, job] : jobs_) job.thread.join();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  bool has_room() const {
    return std::any_of(busy_.begin(), busy_.end(), [&](int b) { return b < per_rank_; });
  }
  bool running(std::size_t id) const { return jobs_.count(id) > 0 || remote_.count(id) > 0; }
  bool empty() const { return jobs_.empty() && remote_.empty(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [id, job] : jobs_) out.push_back(job.name);
    for (const auto& [id, job] : remote_) out.push_back(job.name);
    return out;
  }

  // On the rank with the most free slots (this one first).
  void start(std::size_t id, const Task& task) {
    const int on = static_cast<int>(std::min_element(busy_.begin(), busy_.end()) - busy_.begin());
    ++busy_[on];
    const std::string name = task.layout.name();
    if (on > 0) {
      Message m;
      m.kind = Message::Kind::Task;
      m.id = id;
      m.layout = name;
      m.symmetry = task.symmetry;
      m.extrapolate = task.extrapolate;
      m.cutoff = task.cutoff;
      cluster_->send(on, encode(m));
      remote_[id] = Remote{name, on, std::nullopt};
      return;
    }
    Job& job = jobs_[id];
    job.name = name;
    job.thread = std::thread([this, &job, task] {
      std::optional<Result> r;
      std::exception_ptr error;
      try {
        r = simulate(q_, task.layout, task.symmetry, task.extrapolate, task.cutoff);
      } catch (const std::bad_alloc&) {
        // This host, not the simulated device, ran out: the layout is reported so, and the search goes on.
        r.emplace();
        r->candidate.layout = task.layout;
        r->candidate.name = task.layout.name();
        r->candidate.status = Status::RejectedMemory;
        r->candidate.reason = "the simulation ran out of this host's memory" + here_;
      } catch (...) {
        error = std::current_exception();
      }
      const std::lock_guard lock(mutex_);
      job.result = std::move(r);
      job.error = error;
      job.done = true;
      finished_.notify_all();
    });
  }

  // The ids of the jobs done, for take(): blocks until there is one, or with `timeout` at most that long.
  std::vector<std::size_t> wait_done(std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point until = Clock::now() + timeout.value_or(std::chrono::hours(24 * 365));
    while (true) {
      std::vector<std::size_t> done;
      read_replies();
      for (const auto& [id, job] : remote_)
        if (job.reply) done.push_back(id);
      std::unique_lock lock(mutex_);
      auto local_done = [&] {
        return std::any_of(jobs_.begin(), jobs_.end(), [](const auto& j) { return j.second.done; });
      };
      if (done.empty() && Clock::now() < until) {
        // With jobs on other ranks, wake now and then to read their answers.
        const Clock::time_point wake =
            remote_.empty() ? until : std::min(until, Clock::now() + std::chrono::milliseconds(2));
        finished_.wait_until(lock, wake, local_done);
      }
      for (const auto& [id, job] : jobs_)
        if (job.done) done.push_back(id);
      if (!done.empty() || Clock::now() >= until) return done;
    }
  }

  // A finished job's result; what it threw is thrown here, a remote one's error as a ProgramError naming
  // its rank and layout.
  Result take(std::size_t id) {
    if (const auto r = remote_.find(id); r != remote_.end()) {
      Remote job = std::move(r->second);
      remote_.erase(r);
      --busy_[job.rank];
      if (job.reply->kind == Message::Kind::Error) {
        throw ProgramError(fmt::format("plan: rank {} ({}) failed simulating {}: {}", job.rank,
                                       job.reply->host, job.name, job.reply->error));
      }
      return std::move(*job.reply->result);
    }
    const auto it = jobs_.find(id);
    it->second.thread.join();
    Job job = std::move(it->second);
    jobs_.erase(it);
    --busy_[0];
    if (job.error) std::rethrow_exception(job.error);
    return std::move(*job.result);
  }

 private:
  // The answers that have come in from other ranks, each to its job.
  void read_replies() {
    if (cluster_ == nullptr) return;
    while (std::optional<std::pair<int, std::string>> in = cluster_->poll()) {
      Message m = decode(in->second, in->first);
      const auto it = remote_.find(m.id);
      if (it == remote_.end() || it->second.rank != in->first || m.kind == Message::Kind::Task) {
        throw ProgramError(fmt::format("plan: rank {} sent a {} for task {}, which it was not given",
                                       in->first, m.kind == Message::Kind::Task ? "task" : "result", m.id));
      }
      it->second.reply = std::move(m);
    }
  }

  struct Job {
    std::string name;
    std::thread thread;
    bool done = false;  // under mutex_
    std::optional<Result> result;
    std::exception_ptr error;
  };
  struct Remote {
    std::string name;
    int rank = 0;
    std::optional<Message> reply;
  };
  const Question& q_;
  int per_rank_;
  Messenger* cluster_;
  std::string here_;
  std::vector<int> busy_;            // jobs running on each rank
  std::map<std::size_t, Job> jobs_;  // a map: a job stays where its thread writes to it
  std::map<std::size_t, Remote> remote_;
  std::mutex mutex_;
  std::condition_variable finished_;
};

// The best simulated step so far; ties go to the earlier name.
struct Best : Cutoff {
  void offer(const Result& r) {
    if (r.candidate.status != Status::Simulated) return;
    const double t = r.run->stats.step_time_us;
    if (name.empty() || t < us || (t == us && r.candidate.name < name)) {
      us = t;
      name = r.candidate.name;
    }
  }
};

bool ranks_before(const Result& a, const Result& b) {
  const double ta = a.run->stats.step_time_us, tb = b.run->stats.step_time_us;
  return ta != tb ? ta < tb : a.candidate.name < b.candidate.name;
}

class Search {
 public:
  Search(const Question& q, const SearchOptions& o, std::vector<Result>& pending, Plan& plan)
      : options_(o),
        pending_(pending),
        plan_(plan),
        pool_(q, o.jobs, o.cluster,
              o.cluster ? fmt::format(" (rank 0, {})", o.cluster->host()) : std::string()),
        progress_("plan", static_cast<std::int64_t>(pending.size()), stderr,
                  o.progress && isatty(fileno(stderr)) == 1) {}

  void run() {
    std::vector<std::size_t> order(pending_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    while (true) {
      ++plan_.screenings;
      screen(order);
      if (!options_.symmetry) break;
      confirm();
      if (!options_.prune) break;
      // A full run slower than its screening raises the best step: what was pruned against the screened
      // step may win now.
      const Best best = best_now();
      order.clear();
      for (std::size_t i = 0; i < pending_.size(); ++i) {
        Candidate& k = pending_[i].candidate;
        if (k.status != Status::PrunedBound || !best.beatable_by(k)) continue;
        k.status = Status::Pending;
        --plan_.pruned;
        order.push_back(i);
      }
      if (order.empty()) break;
    }
    progress_.finish();
  }

 private:
  Best best_now() const {
    Best b;
    for (const Result& r : pending_) b.offer(r);
    return b;
  }

  void show(const char* phase) {
    if (!progress_.enabled()) return;
    const Best b = best_now();
    std::string detail = fmt::format("{}: {} simulated, {} out of memory, {} pruned", phase, plan_.simulated,
                                     plan_.rejected_by_run, plan_.pruned);
    if (!b.name.empty()) detail += fmt::format("; best {} {}", human_time(b.us), b.name);
    const std::vector<std::string> now = pool_.names();
    if (now.size() == 1) detail += fmt::format("; running {}", now[0]);
    if (now.size() > 1) detail += fmt::format("; {} running", now.size());
    // What is left, at most: the layouts not decided that the best so far cannot prune, each at the mean
    // time of the simulations done, over the slots of every process.
    double simulated_s = 0;
    int simulations = 0, open = 0;
    for (const Result& r : pending_) {
      if (r.wall_s > 0) simulated_s += r.wall_s, ++simulations;
      open += r.candidate.status == Status::Pending && b.beatable_by(r.candidate);
    }
    const int slots = options_.jobs * (options_.cluster != nullptr ? options_.cluster->size() : 1);
    if (simulations > 0 && open > 0) {
      detail += fmt::format("; at most {} left", human_time(1e6 * open * simulated_s / simulations / slots));
    }
    progress_.update(decided_, detail);
  }

  // Decides `order` (indices of pending_, cheapest bound first) as a one-at-a-time search would, running
  // up to `jobs` screenings at once.
  void screen(const std::vector<std::size_t>& order) {
    Best best = best_now();
    std::map<std::size_t, Result> finished;  // by position in `order`, not yet decided
    std::set<std::size_t> dropped;           // positions decided without their run, which is still going
    // What is known of the layouts before `pos`: decided ones, and runs finished ahead of their turn.
    auto known_before = [&](std::size_t pos) {
      Best b = best;
      for (const auto& [p, r] : finished)
        if (p < pos) b.offer(r);
      return b;
    };
    // A layout not probed yet is probed first (where that is worth it), its screening skipped if the bound
    // then cannot beat what is known before it: what is known at its turn can only be better (the best
    // only falls), so such a layout is pruned at its turn whatever ran when.
    auto start = [&](std::size_t pos) {
      const Candidate& k = pending_[order[pos]].candidate;
      std::optional<Cutoff> cutoff;
      if (options_.probe && options_.prune && !k.probed) cutoff = known_before(pos);
      pool_.start(pos, Task{k.layout, options_.symmetry, options_.extrapolate, cutoff});
    };
    auto drop = [&](std::size_t pos) {
      finished.erase(pos);
      if (pool_.running(pos)) dropped.insert(pos);
    };
    const int most = options_.max_candidates;
    std::size_t next = 0, commit = 0;
    while (commit < order.size()) {
      // Start, in order, what may be needed, while there is room: not what the results known before it
      // already prune (those before it can only lower the best), nor what --max-candidates would leave
      // with every run ahead of it counted (it is started at its turn if some of those were not needed).
      while (pool_.has_room() && next < order.size()) {
        const std::size_t pos = next++;
        if (options_.prune && !known_before(pos).beatable_by(pending_[order[pos]].candidate)) continue;
        int ahead = static_cast<int>(finished.size());
        for (std::size_t p = commit; p < pos; ++p) ahead += pool_.running(p) && dropped.count(p) == 0;
        if (most > 0 && attempted_ + ahead >= most) continue;
        start(pos);
      }
      // Decide, in order, as far as the results allow.
      while (commit < order.size()) {
        const std::size_t pos = commit;
        Result& slot = pending_[order[pos]];
        Candidate& k = slot.candidate;
        const auto it = finished.find(pos);
        // What a probe measured counts only for a layout the model's bound leaves, as it would had the
        // layouts run one at a time.
        const bool probed_now = options_.prune && best.beatable_by(k) && it != finished.end() &&
                                it->second.candidate.probed && !k.probed;
        if (probed_now) {
          k.bound_us = std::max(k.bound_us, it->second.candidate.bound_us);
          k.probed = true;
          ++plan_.probed;
        }
        if (options_.prune && !best.beatable_by(k)) {
          k.status = Status::PrunedBound;
          ++plan_.pruned;
          if (probed_now) {
            ++plan_.pruned_by_probe;
            slot.wall_s = it->second.wall_s;  // the probe's (or the screening's that ran ahead of its turn)
          }
        } else if (most > 0 && attempted_ >= most) {
          k.status = Status::Unexplored;
          ++plan_.unexplored;
        } else if (it != finished.end() && it->second.candidate.status == Status::PrunedBound) {
          // Probed out against a best that the results before it did not lower after all: screened now.
          finished.erase(it);
          continue;
        } else if (it != finished.end()) {
          accept(slot, std::move(it->second));
          finished.erase(it);
          best.offer(slot);
        } else {
          if (!pool_.running(pos)) {
            if (!pool_.has_room()) break;
            start(pos);
          }
          break;  // its run is not in yet
        }
        drop(pos);
        ++commit;
        ++decided_;
      }
      show("screening");
      if (commit == order.size()) break;
      for (const std::size_t pos : pool_.wait_done()) {
        Result r = pool_.take(pos);
        if (dropped.erase(pos) == 0) finished.emplace(pos, std::move(r));
      }
    }
    // Runs left going for layouts decided without them.
    while (!dropped.empty()) {
      for (const std::size_t pos : pool_.wait_done()) {
        pool_.take(pos);
        dropped.erase(pos);
      }
    }
  }

  void accept(Result& slot, Result r) {
    ++attempted_;
    // (A run the host's memory cut short knows only its layout: the bound stays the one it was tried by.)
    r.candidate.bound_us = slot.candidate.bound_us;
    r.candidate.probed = slot.candidate.probed;
    r.candidate.planned_bytes = slot.candidate.planned_bytes;
    r.candidate.capacity_bytes = slot.candidate.capacity_bytes;
    r.candidate.status == Status::Simulated ? ++plan_.simulated : ++plan_.rejected_by_run;
    slot = std::move(r);
  }

  // Simulates the leading layouts again with every rank running, until the leaders are all full runs.
  void confirm() {
    if (options_.confirm == 0) return;  // the screenings are the answer
    while (true) {
      std::vector<std::size_t> ranked;
      for (std::size_t i = 0; i < pending_.size(); ++i)
        if (pending_[i].candidate.status == Status::Simulated) ranked.push_back(i);
      if (ranked.empty()) return;
      std::sort(ranked.begin(), ranked.end(),
                [&](std::size_t a, std::size_t b) { return ranks_before(pending_[a], pending_[b]); });
      const double best_us = pending_[ranked[0]].run->stats.step_time_us;
      std::vector<std::size_t> todo;
      for (std::size_t n = 0; n < ranked.size(); ++n) {
        const Result& r = pending_[ranked[n]];
        if (r.full) continue;
        const bool leading = static_cast<int>(n) < options_.confirm;
        const bool close = r.screening->stats.step_time_us <= best_us * (1 + options_.confirm_margin);
        if (leading || close) todo.push_back(ranked[n]);
      }
      if (todo.empty()) return;
      std::map<std::size_t, Result> done;
      std::size_t next = 0;
      while (done.size() < todo.size()) {
        while (pool_.has_room() && next < todo.size()) {
          const std::size_t i = todo[next++];
          pool_.start(i, Task{pending_[i].candidate.layout, false, false, std::nullopt});
        }
        show("confirming with every rank running");
        for (const std::size_t i : pool_.wait_done()) done.emplace(i, pool_.take(i));
      }
      for (auto& [i, r] : done) {
        Result& slot = pending_[i];
        ++plan_.confirmed;
        slot.wall_s += r.wall_s;
        if (r.candidate.status == Status::Simulated) {
          slot.run = std::move(r.run);
          slot.full = true;
        } else {
          // Memory does not depend on the symmetry (tests/test_symmetry.cc); should the full run still run
          // out, the layout is rejected as `run gpt` would reject it.
          slot.run.reset();
          slot.candidate.status = Status::RejectedMemory;
          slot.candidate.reason = "with every rank running: " + r.candidate.reason;
          --plan_.simulated;
          ++plan_.rejected_by_run;
        }
      }
    }
  }

  const SearchOptions& options_;
  std::vector<Result>& pending_;
  Plan& plan_;
  Pool pool_;
  Progress progress_;
  int attempted_ = 0;         // layouts screened (simulated or out of memory)
  std::int64_t decided_ = 0;  // for the progress line
};

}  // namespace

Plan search(const Question& q, const SearchOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Plan plan;
  plan.question = q;
  plan.jobs = std::max(1, options.jobs);
  plan.symmetric = options.symmetry;
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
    Result r;
    r.candidate = std::move(k);
    if (r.candidate.status == Status::Pending) {
      pending.push_back(std::move(r));
    } else {
      plan.invalid += r.candidate.status == Status::Invalid;
      plan.rejected_by_plan += r.candidate.status == Status::RejectedMemory;
      done.push_back(std::move(r));
    }
  }
  // Cheapest bound first; equal bounds by name, so that the order, and with it the answer, is the same
  // every time.
  std::sort(pending.begin(), pending.end(), [](const Result& a, const Result& b) {
    return a.candidate.bound_us != b.candidate.bound_us ? a.candidate.bound_us < b.candidate.bound_us
                                                        : a.candidate.name < b.candidate.name;
  });
  if (options.cluster != nullptr) plan.processes = options.cluster->size();
  Search(q, options, pending, plan).run();
  if (options.cluster != nullptr) {
    Message stop;
    stop.kind = Message::Kind::Stop;
    for (int rank = 1; rank < options.cluster->size(); ++rank) options.cluster->send(rank, encode(stop));
  }
  for (Result& r : pending) done.push_back(std::move(r));
  std::sort(done.begin(), done.end(), [](const Result& a, const Result& b) {
    const bool sa = a.candidate.status == Status::Simulated, sb = b.candidate.status == Status::Simulated;
    if (sa != sb) return sa;
    if (sa) return ranks_before(a, b);
    return a.candidate.name < b.candidate.name;
  });
  plan.results = std::move(done);
  plan.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

void serve(const Question& q, Messenger& cluster, int jobs) {
  Pool pool(q, jobs, nullptr, fmt::format(" (rank {}, {})", cluster.rank(), cluster.host()));
  // A test's hook: the rank it names fails every task it is given, as a crashing simulation would.
  const char* planted = std::getenv("RANKLAB_PLAN_FAIL_ON_RANK");
  const bool fail = planted != nullptr && std::string(planted) == std::to_string(cluster.rank());
  auto answer = [&](Message m) { cluster.send(0, encode(m)); };
  bool stop = false;
  while (true) {
    while (std::optional<std::pair<int, std::string>> in = cluster.poll()) {
      Message m = decode(in->second, in->first);
      if (m.kind == Message::Kind::Stop) {
        stop = true;
      } else if (m.kind != Message::Kind::Task || in->first != 0) {
        throw ProgramError(fmt::format("plan: rank {} got a message it does not take from rank {}",
                                       cluster.rank(), in->first));
      } else if (fail) {
        Message e;
        e.kind = Message::Kind::Error;
        e.id = m.id;
        e.error = "a failure planted by RANKLAB_PLAN_FAIL_ON_RANK";
        e.host = cluster.host();
        answer(e);
      } else {
        pool.start(m.id, Task{parse_layout(m.layout), m.symmetry, m.extrapolate, m.cutoff});
      }
    }
    for (const std::size_t id : pool.wait_done(std::chrono::milliseconds(2))) {
      Message reply;
      reply.id = id;
      try {
        reply.result = pool.take(id);
        reply.kind = Message::Kind::Result;
      } catch (const std::exception& e) {
        reply.kind = Message::Kind::Error;
        reply.error = e.what();
        reply.host = cluster.host();
      }
      answer(std::move(reply));
    }
    if (stop && pool.empty()) return;
  }
}

}  // namespace ranklab::plan
