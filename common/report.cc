#include "common/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "common/errors.h"

namespace ranklab {

using nlohmann::json;
// Written in declaration order, so schema_version comes first and a report reads like the struct.
using ordered_json = nlohmann::ordered_json;

namespace {

struct NameHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Every SpanName's text; never shrinks, so the pointers stay valid (nodes of an unordered_set do not move).
struct NameTable {
  std::mutex mutex;
  std::unordered_set<std::string, NameHash, std::equal_to<>> names;
};

NameTable& name_table() {
  static NameTable* table = new NameTable;  // never destroyed: names outlive every static report
  return *table;
}

const std::string* intern(std::string_view text) {
  NameTable& t = name_table();
  std::lock_guard lock(t.mutex);
  auto it = t.names.find(text);
  if (it == t.names.end()) it = t.names.emplace(text).first;
  return &*it;
}

}  // namespace

SpanName::SpanName() {
  static const std::string* const empty = intern("");
  text_ = empty;
}

SpanName::SpanName(std::string_view text) : text_(intern(text)) {}

const char* span_kind_name(SpanKind k) {
  switch (k) {
    case SpanKind::Compute:
      return "compute";
    case SpanKind::Comm:
      return "comm";
    case SpanKind::Idle:
      return "idle";
  }
  return "?";
}

bool RunReport::all_checks_passed() const {
  return std::all_of(checks.begin(), checks.end(), [](const CheckRecord& c) { return c.passed; });
}

std::int64_t RunReport::total_link_bytes() const {
  std::int64_t total = 0;
  for (const LinkTraffic& l : links) total += l.bytes;
  return total;
}

double bus_factor(CommOp op, int group_size) {
  if (group_size < 1) {
    throw UsageError(
        fmt::format("bus_factor({}, {}): a group has at least one rank", comm_op_name(op), group_size));
  }
  const double n = group_size;
  switch (op) {
    case CommOp::AllReduce:
      // Every element is reduced n-1 times and distributed n-1 times, spread over n links.
      return 2 * (n - 1) / n;
    case CommOp::ReduceScatter:
    case CommOp::AllGather:
    case CommOp::AllToAll:
      return (n - 1) / n;
    case CommOp::Scatter:
    case CommOp::Gather:
      // nccl-tests times these with the whole buffer as the size; the root's own 1/n never moves.
      return (n - 1) / n;
    case CommOp::Broadcast:
    case CommOp::Reduce:
    case CommOp::Send:
    case CommOp::Recv:
      // All the data passes through one rank's link, so the bus sees exactly the algorithm bandwidth.
      return 1;
    case CommOp::Barrier:
      return 0;  // moves no data
  }
  return 0;
}

// ---- per-rank totals ------------------------------------------------------------------------------------

namespace {

struct Interval {
  double start;
  double end;
};

// Sorts intervals and merges the overlapping ones in place; returns the total length of the union.
double merge_in_place(std::vector<Interval>& v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
  std::size_t out = 0;
  double total = 0;
  for (const Interval& iv : v) {
    if (!(iv.end > iv.start)) continue;  // empty or reversed spans cover nothing
    if (out > 0 && iv.start <= v[out - 1].end) {
      v[out - 1].end = std::max(v[out - 1].end, iv.end);
    } else {
      v[out++] = iv;
    }
  }
  v.resize(out);
  for (const Interval& iv : v) total += iv.end - iv.start;
  return total;
}

// Length of the intersection of two sorted, disjoint interval lists: one merge-like pass.
double overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    double lo = std::max(a[i].start, b[j].start);
    double hi = std::min(a[i].end, b[j].end);
    if (hi > lo) total += hi - lo;
    // Whichever ends first cannot overlap anything further along the other list.
    if (a[i].end < b[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

struct RankSpans {
  std::vector<Interval> compute;
  std::vector<Interval> comm;
  double wait_us = 0;
  double last_end_us = 0;
};

}  // namespace

void summarize_spans(RunReport& report) {
  int n = std::max(report.world, 0);
  for (const RankSummary& s : report.ranks) n = std::max(n, s.rank + 1);
  for (const Span& s : report.spans) {
    if (s.rank < 0) throw UsageError(fmt::format("span '{}' has rank {}", s.name, s.rank));
    n = std::max(n, s.rank + 1);
  }

  // An interval that starts inside the previous one of its list (a kernel right after the last) joins
  // it at once: merge_in_place would put both in the same merged interval anyway, so the totals are the
  // same to the bit, and a run of millions of back-to-back kernels needs a short list.
  auto add = [](std::vector<Interval>& v, const Span& s) {
    if (!(s.end_us > s.start_us)) return;  // covers nothing (merge_in_place would drop it)
    if (!v.empty() && v.back().start <= s.start_us && s.start_us <= v.back().end) {
      v.back().end = std::max(v.back().end, s.end_us);
    } else {
      v.push_back({s.start_us, s.end_us});
    }
  };
  std::vector<RankSpans> per_rank(n);
  for (const Span& s : report.spans) {
    RankSpans& r = per_rank[s.rank];
    r.last_end_us = std::max(r.last_end_us, s.end_us);
    switch (s.kind) {
      case SpanKind::Compute:
        add(r.compute, s);
        break;
      case SpanKind::Comm:
        add(r.comm, s);
        break;
      case SpanKind::Idle:
        // Waits are summed, not unioned: each is one collective's wait, and they do not overlap on one
        // stream anyway.
        r.wait_us += std::max(0.0, s.end_us - s.start_us);
        break;
    }
  }

  // One summary per rank, in rank order, keeping whatever the backend already filled in (end, memory).
  std::vector<RankSummary> summaries(n);
  for (int i = 0; i < n; ++i) summaries[i].rank = i;
  for (const RankSummary& s : report.ranks) {
    if (s.rank >= 0) summaries[s.rank] = s;
  }

  double makespan_us = 0;
  for (int i = 0; i < n; ++i) {
    RankSummary& s = summaries[i];
    RankSpans& r = per_rank[i];
    double compute_us = merge_in_place(r.compute);
    double comm_us = merge_in_place(r.comm);
    double both_us = overlap(r.compute, r.comm);
    s.compute_us = compute_us;
    s.comm_us = comm_us;
    s.comm_wait_us = r.wait_us;
    s.exposed_comm_us = comm_us - both_us;
    if (s.end_us == 0) s.end_us = r.last_end_us;
    s.idle_us = std::max(0.0, s.end_us - (compute_us + comm_us - both_us));
    makespan_us = std::max(makespan_us, s.end_us);
  }
  report.ranks = std::move(summaries);
  if (report.makespan_us == 0) report.makespan_us = makespan_us;
}

// ---- terminal summary -----------------------------------------------------------------------------------

std::string human_time(double us) {
  double a = std::fabs(us);
  if (a < 1e3) return fmt::format("{:.1f} us", us);
  if (a < 1e6) return fmt::format("{:.2f} ms", us / 1e3);
  return fmt::format("{:.3f} s", us / 1e6);
}

namespace {

std::string memory_cell(double peak, double capacity) {
  if (capacity <= 0) return format_bytes(peak);
  return fmt::format("{} / {} ({:.0f}%)", format_bytes(peak), format_bytes(capacity),
                     100.0 * peak / capacity);
}

void rank_row(std::string& out, const std::string& label, double end, double compute, double comm,
              double exposed, double wait, double idle, const std::string& memory) {
  out += fmt::format("  {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}  {}\n", label, human_time(end),
                     human_time(compute), human_time(comm), human_time(exposed), human_time(wait),
                     human_time(idle), memory);
}

void format_ranks(std::string& out, const std::vector<RankSummary>& ranks) {
  out += fmt::format("  {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}  {}\n", "rank", "end", "compute",
                     "comm", "exposed", "comm wait", "idle", "peak memory");
  // Past a screenful, per-rank rows stop being readable; min/mean/max and the slowest rank say more.
  constexpr std::size_t kMaxRows = 16;
  if (ranks.size() <= kMaxRows) {
    for (const RankSummary& r : ranks) {
      rank_row(out, std::to_string(r.rank), r.end_us, r.compute_us, r.comm_us, r.exposed_comm_us,
               r.comm_wait_us, r.idle_us,
               memory_cell(static_cast<double>(r.peak_bytes), static_cast<double>(r.capacity_bytes)));
    }
    return;
  }
  auto column = [&ranks](auto field) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0;
    for (const RankSummary& r : ranks) {
      double v = field(r);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      sum += v;
    }
    return std::make_tuple(lo, sum / static_cast<double>(ranks.size()), hi);
  };
  auto end = column([](const RankSummary& r) { return r.end_us; });
  auto compute = column([](const RankSummary& r) { return r.compute_us; });
  auto comm = column([](const RankSummary& r) { return r.comm_us; });
  auto exposed = column([](const RankSummary& r) { return r.exposed_comm_us; });
  auto wait = column([](const RankSummary& r) { return r.comm_wait_us; });
  auto idle = column([](const RankSummary& r) { return r.idle_us; });
  auto peak = column([](const RankSummary& r) { return static_cast<double>(r.peak_bytes); });
  double capacity = static_cast<double>(ranks.front().capacity_bytes);
  rank_row(out, "min", std::get<0>(end), std::get<0>(compute), std::get<0>(comm), std::get<0>(exposed),
           std::get<0>(wait), std::get<0>(idle), memory_cell(std::get<0>(peak), capacity));
  rank_row(out, "mean", std::get<1>(end), std::get<1>(compute), std::get<1>(comm), std::get<1>(exposed),
           std::get<1>(wait), std::get<1>(idle), memory_cell(std::get<1>(peak), capacity));
  rank_row(out, "max", std::get<2>(end), std::get<2>(compute), std::get<2>(comm), std::get<2>(exposed),
           std::get<2>(wait), std::get<2>(idle), memory_cell(std::get<2>(peak), capacity));
  auto slowest = std::max_element(ranks.begin(), ranks.end(), [](const RankSummary& a, const RankSummary& b) {
    return a.end_us < b.end_us;
  });
  out += fmt::format("  ({} ranks; the last to finish is rank {})\n", ranks.size(), slowest->rank);
}

void format_collectives(std::string& out, const std::vector<CollectiveRecord>& records) {
  struct Row {
    CommOp op;
    std::int64_t bytes;
    int group_size;
    std::string algorithm;
    int count = 0;
    double total_us = 0;
  };
  // Grouped in order of first appearance, which for a sweep is the order of the sweep.
  std::vector<Row> rows;
  std::map<std::tuple<int, std::int64_t, int, std::string>, std::size_t> index;
  int kept_apart = 0;
  double kept_apart_bytes = 0;
  for (const CollectiveRecord& c : records) {
    if (c.bookkeeping) {
      ++kept_apart;
      kept_apart_bytes += static_cast<double>(c.bytes);
      continue;
    }
    auto key = std::make_tuple(static_cast<int>(c.op), c.bytes, c.group_size, c.algorithm);
    auto [it, inserted] = index.try_emplace(key, rows.size());
    if (inserted) rows.push_back(Row{c.op, c.bytes, c.group_size, c.algorithm});
    Row& row = rows[it->second];
    ++row.count;
    row.total_us += c.time_us();
  }
  std::size_t op_width = 10, algo_width = 9;
  for (const Row& r : rows) {
    op_width = std::max(op_width, std::string(comm_op_name(r.op)).size());
    algo_width = std::max(algo_width, r.algorithm.size());
  }
  out += fmt::format("  {:<{}} {:>10} {:>5}  {:<{}} {:>6} {:>11} {:>12} {:>12}\n", "collective", op_width,
                     "size", "ranks", "algorithm", algo_width, "count", "mean time", "algbw", "busbw");
  for (const Row& r : rows) {
    double mean_us = r.total_us / r.count;
    // nccl-tests' definitions: algbw = size / time, busbw = algbw * bus factor.
    double algbw = mean_us > 0 ? static_cast<double>(r.bytes) / (mean_us * 1e3) : 0;
    double busbw = r.group_size >= 1 ? algbw * bus_factor(r.op, r.group_size) : 0;
    out += fmt::format("  {:<{}} {:>10} {:>5}  {:<{}} {:>6} {:>11} {:>12} {:>12}\n", comm_op_name(r.op),
                       op_width, format_bytes(static_cast<double>(r.bytes)), r.group_size, r.algorithm,
                       algo_width, r.count, human_time(mean_us), format_gbps(algbw), format_gbps(busbw));
  }
  if (kept_apart > 0) {
    out += fmt::format(
        "  (and {} collective{} of the lesson's own checks and figures, {} in all, left out of this table "
        "and of "
        "the link traffic)\n",
        kept_apart, kept_apart == 1 ? "" : "s", format_bytes(kept_apart_bytes));
  }
}

void format_checks(std::string& out, const std::vector<CheckRecord>& checks) {
  struct Row {
    std::string what;
    std::vector<int> ranks;
    std::vector<int> failed;
    std::string first_failure;
  };
  std::vector<Row> rows;
  std::map<std::string, std::size_t> index;
  for (const CheckRecord& c : checks) {
    auto [it, inserted] = index.try_emplace(c.what, rows.size());
    if (inserted) rows.push_back(Row{c.what, {}, {}, {}});
    Row& row = rows[it->second];
    row.ranks.push_back(c.rank);
    if (!c.passed) {
      if (row.failed.empty()) row.first_failure = c.detail;
      row.failed.push_back(c.rank);
    }
  }
  for (const Row& r : rows) {
    std::string who = r.ranks.size() == 1 ? fmt::format("rank {}", r.ranks.front())
                                          : fmt::format("{} ranks", r.ranks.size());
    if (r.failed.empty()) {
      out += fmt::format("  \u2713 {} ({})\n", r.what, who);
      continue;
    }
    constexpr std::size_t kMaxListed = 8;
    std::vector<int> listed(r.failed.begin(), r.failed.begin() + std::min(r.failed.size(), kMaxListed));
    std::string failed =
        fmt::format("{}{}", fmt::join(listed, ", "), r.failed.size() > kMaxListed ? ", ..." : "");
    std::string where = r.ranks.size() == 1 ? who
                                            : fmt::format("failed on {} of {}: rank{} {}", r.failed.size(),
                                                          who, r.failed.size() == 1 ? "" : "s", failed);
    out += fmt::format("  \u2717 {} ({}){}\n", r.what, where,
                       r.first_failure.empty() ? "" : ": " + r.first_failure);
  }
}

void format_traffic(std::string& out, const std::vector<LinkTraffic>& links) {
  std::vector<std::pair<std::string, std::int64_t>> tiers;
  std::int64_t total = 0;
  for (const LinkTraffic& l : links) {
    auto it = std::find_if(tiers.begin(), tiers.end(), [&l](const auto& t) { return t.first == l.tier; });
    if (it == tiers.end()) {
      tiers.emplace_back(l.tier, l.bytes);
    } else {
      it->second += l.bytes;
    }
    total += l.bytes;
  }
  std::vector<std::string> parts;
  for (const auto& [tier, bytes] : tiers)
    parts.push_back(fmt::format("{} {}", tier, format_bytes(static_cast<double>(bytes))));
  out += fmt::format("traffic: {} over {} links ({})\n", format_bytes(static_cast<double>(total)),
                     links.size(), fmt::join(parts, ", "));
}

}  // namespace

std::string format_training(const TrainingStats& t) {
  std::string out = fmt::format("training step{}{}: {}\n", t.model.empty() ? "" : " of " + t.model,
                                t.layout.empty() ? "" : ", " + t.layout, human_time(t.step_time_us));
  out += fmt::format("  {:<24}{} tokens in {} micro-batch{} per pipeline\n", "work", t.tokens_per_step,
                     t.micro_batches, t.micro_batches == 1 ? "" : "es");
  out += fmt::format("  {:<24}{:.4g} PFLOP per step; {:.1f} TFLOP/s per GPU; MFU {:.1f}%\n", "model FLOPs",
                     t.model_flops / 1e15, t.model_tflops_per_gpu, 100 * t.mfu);
  out += fmt::format("  {:<24}{:.4g} PFLOP per step; {:.1f} TFLOP/s per GPU (recomputation included)\n",
                     "hardware FLOPs", t.hardware_flops / 1e15, t.hardware_tflops_per_gpu);
  out += fmt::format("  {:<24}{:.1f}% measured, {:.1f}% by (p - 1) / (v m)\n", "pipeline bubble",
                     100 * t.bubble_fraction, 100 * t.bubble_fraction_formula);
  if (!t.exposed_comm_us.empty()) {
    std::string parts;
    for (const auto& [dim, us] : t.exposed_comm_us) {
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", dim, human_time(us));
    }
    out += fmt::format("  {:<24}{}\n", "exposed communication", parts);
  }
  out += fmt::format("  {:<24}{} = weights {} + grads {} + optimizer {} + activations {}\n", "peak memory",
                     format_bytes(static_cast<double>(t.peak_memory_bytes)),
                     format_bytes(static_cast<double>(t.weights_bytes)),
                     format_bytes(static_cast<double>(t.grads_bytes)),
                     format_bytes(static_cast<double>(t.optimizer_bytes)),
                     format_bytes(static_cast<double>(t.activations_bytes)));
  return out;
}

std::string format_summary(const RunReport& report) {
  std::string out;
  int world = report.world > 0 ? report.world : static_cast<int>(report.ranks.size());
  out += fmt::format("{} on {}{}, {} rank{}: {}\n", report.lesson.empty() ? "run" : report.lesson,
                     report.backend.empty() ? "?" : report.backend,
                     report.profile.empty() ? "" : fmt::format(" ({})", report.profile), world,
                     world == 1 ? "" : "s", human_time(report.makespan_us));
  if (report.training) {
    out += "\n";
    out += format_training(*report.training);
  }
  if (!report.ranks.empty()) {
    out += "\n";
    format_ranks(out, report.ranks);
  }
  if (!report.collectives.empty()) {
    out += "\n";
    format_collectives(out, report.collectives);
  }
  if (!report.links.empty()) {
    out += "\n";
    format_traffic(out, report.links);
  }
  if (report.late_starts > 0) {
    out += fmt::format(
        "\n{} transfer{} started in the simulator's past (a rank a barrier woke behind the present) and ran "
        "alone up to it: {} contention with transfers that had already ended is not modelled\n",
        report.late_starts, report.late_starts == 1 ? "" : "s", report.late_starts == 1 ? "its" : "their");
  }
  if (!report.checks.empty()) {
    std::size_t failed = std::count_if(report.checks.begin(), report.checks.end(),
                                       [](const CheckRecord& c) { return !c.passed; });
    out += fmt::format("\nchecks: {}\n", failed == 0
                                             ? std::string("all passed")
                                             : fmt::format("{} of {} failed", failed, report.checks.size()));
    format_checks(out, report.checks);
  }
  return out;
}

// ---- JSON -----------------------------------------------------------------------------------------------

namespace {

constexpr int kSchemaVersion = 1;

ordered_json to_json(const RankSummary& r) {
  return ordered_json{{"rank", r.rank},
                      {"end_us", r.end_us},
                      {"compute_us", r.compute_us},
                      {"comm_us", r.comm_us},
                      {"comm_wait_us", r.comm_wait_us},
                      {"exposed_comm_us", r.exposed_comm_us},
                      {"idle_us", r.idle_us},
                      {"peak_bytes", r.peak_bytes},
                      {"capacity_bytes", r.capacity_bytes}};
}

ordered_json to_json(const Span& s) {
  return ordered_json{{"rank", s.rank},
                      {"kind", span_kind_name(s.kind)},
                      {"name", s.name.str()},
                      {"start_us", s.start_us},
                      {"end_us", s.end_us}};
}

ordered_json to_json(const CollectiveRecord& c) {
  return ordered_json{{"op", comm_op_name(c.op)},
                      {"group", c.group.str()},
                      {"group_size", c.group_size},
                      {"bytes", c.bytes},
                      {"algorithm", c.algorithm.str()},
                      {"start_us", c.start_us},
                      {"end_us", c.end_us},
                      {"algbw_gbps", c.algbw_gbps},
                      {"busbw_gbps", c.busbw_gbps},
                      {"bookkeeping", c.bookkeeping}};
}

ordered_json to_json(const RegionRecord& r) {
  return ordered_json{{"rank", r.rank}, {"name", r.name}, {"start_us", r.start_us}, {"end_us", r.end_us}};
}

ordered_json to_json(const CheckRecord& c) {
  return ordered_json{{"rank", c.rank}, {"what", c.what}, {"passed", c.passed}, {"detail", c.detail}};
}

ordered_json to_json(const LinkTraffic& l) {
  return ordered_json{
      {"link", l.link}, {"tier", l.tier}, {"bytes", l.bytes}, {"bandwidth_gbps", l.bandwidth_gbps}};
}

ordered_json to_json(const TopologyNode& n) {
  return ordered_json{{"id", n.id}, {"kind", n.kind}, {"level", n.level}, {"host", n.host}, {"rank", n.rank}};
}

ordered_json to_json(const TopologyLink& l) {
  return ordered_json{
      {"id", l.id}, {"from", l.from}, {"to", l.to}, {"tier", l.tier}, {"bandwidth_gbps", l.bandwidth_gbps}};
}

ordered_json to_json(const PipelineTask& t) {
  return ordered_json{
      {"rank", t.rank},       {"stage", t.stage},       {"chunk", t.chunk},  {"micro_batch", t.micro_batch},
      {"forward", t.forward}, {"start_us", t.start_us}, {"end_us", t.end_us}};
}

// TrainingStats as JSON, written and read from this one list of its fields.
template <class Stats, class Visit>
void training_fields(Stats& t, Visit&& v) {
  v("model", t.model);
  v("layout", t.layout);
  v("tokens_per_step", t.tokens_per_step);
  v("micro_batches", t.micro_batches);
  v("step_time_us", t.step_time_us);
  v("model_flops", t.model_flops);
  v("hardware_flops", t.hardware_flops);
  v("model_tflops_per_gpu", t.model_tflops_per_gpu);
  v("hardware_tflops_per_gpu", t.hardware_tflops_per_gpu);
  v("mfu", t.mfu);
  v("bubble_fraction", t.bubble_fraction);
  v("bubble_fraction_formula", t.bubble_fraction_formula);
  v("exposed_comm_us", t.exposed_comm_us);
  v("peak_memory_bytes", t.peak_memory_bytes);
  v("weights_bytes", t.weights_bytes);
  v("grads_bytes", t.grads_bytes);
  v("optimizer_bytes", t.optimizer_bytes);
  v("activations_bytes", t.activations_bytes);
}

ordered_json to_json(const TrainingStats& t) {
  ordered_json j = ordered_json::object();
  training_fields(t, [&j](const char* key, const auto& value) { j[key] = value; });
  return j;
}

template <class T>
ordered_json array_of(const std::vector<T>& items) {
  ordered_json a = ordered_json::array();
  for (const T& item : items) a.push_back(to_json(item));
  return a;
}

template <class T>
bool in_range(std::int64_t v) {
  return v >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
         (std::numeric_limits<T>::max() >= std::numeric_limits<std::int64_t>::max() ||
          v <= static_cast<std::int64_t>(std::numeric_limits<T>::max()));
}

// Reading back: a missing field keeps its default (so older writers that lacked a field still load), but a
// field of the wrong type is an error naming where it is.
class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  template <class T>
  void get(const json& obj, const char* key, T& out) const {
    auto it = obj.find(key);
    if (it == obj.end()) return;
    try {
      if constexpr (std::is_same_v<T, double>) {
        // JSON has no NaN or infinity; nlohmann writes them as null.
        out = it->is_null() ? std::numeric_limits<double>::quiet_NaN() : it->template get<double>();
      } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        // nlohmann converts 4294967300 to an int as 4, and 2.5 as 2: only an integer in range is read.
        if (!it->is_number_integer())
          fail(fmt::format("field '{}' must be an integer, got {}", key, it->dump()));
        const bool fits = it->is_number_unsigned()
                              ? it->template get<std::uint64_t>() <=
                                    static_cast<std::uint64_t>(std::numeric_limits<T>::max())
                              : in_range<T>(it->template get<std::int64_t>());
        if (!fits) fail(fmt::format("field '{}' is out of range: {}", key, it->dump()));
        out = it->template get<T>();
      } else if constexpr (std::is_same_v<T, SpanName>) {
        out = it->template get<std::string>();
      } else {
        out = it->template get<T>();
      }
    } catch (const json::exception& e) {
      fail(fmt::format("field '{}': {}", key, e.what()));
    }
  }

  const json& array(const json& obj, const char* key) const {
    static const json empty = json::array();
    auto it = obj.find(key);
    if (it == obj.end()) return empty;
    if (!it->is_array()) fail(fmt::format("field '{}' must be an array", key));
    return *it;
  }

  [[noreturn]] void fail(const std::string& message) const {
    throw UsageError(fmt::format("report JSON, {}: {}", where_, message));
  }

 private:
  std::string where_;
};

void check_object(const json& j, const Reader& r) {
  if (!j.is_object()) r.fail("expected an object");
}

CommOp parse_op(const std::string& name, const Reader& r) {
  for (int i = 0; i <= static_cast<int>(CommOp::Barrier); ++i) {
    if (name == comm_op_name(static_cast<CommOp>(i))) return static_cast<CommOp>(i);
  }
  r.fail(fmt::format("unknown op '{}'", name));
}

bool parse_kind(const std::string& name, SpanKind& out) {
  for (SpanKind k : {SpanKind::Compute, SpanKind::Comm, SpanKind::Idle}) {
    if (name == span_kind_name(k)) {
      out = k;
      return true;
    }
  }
  return false;
}

// Reads every element of `key` with `read(element, reader)`; the reader names the element only when
// something is wrong, so millions of spans cost no string formatting. `parent` names the object that holds
// the array when it is not the top level ("topology" for "topology.nodes[2]").
template <class T, class F>
std::vector<T> read_array(const json& root, const char* key, F read, const std::string& parent = "") {
  const json& a = Reader(parent.empty() ? "top level" : parent).array(root, key);
  const std::string path = parent.empty() ? key : parent + "." + key;
  auto where = [&path](std::size_t i) { return Reader(fmt::format("{}[{}]", path, i)); };
  std::vector<T> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const json& e = a[i];
    if (!e.is_object()) where(i).fail("expected an object");
    out.push_back(read(e, [&where, i]() { return where(i); }));
  }
  return out;
}

RunTopology read_topology(const json& topology) {
  RunTopology t;
  t.nodes = read_array<TopologyNode>(
      topology, "nodes",
      [](const json& e, auto reader) {
        Reader r = reader();
        TopologyNode n;
        r.get(e, "id", n.id);
        r.get(e, "kind", n.kind);
        r.get(e, "level", n.level);
        r.get(e, "host", n.host);
        r.get(e, "rank", n.rank);
        return n;
      },
      "topology");
  t.links = read_array<TopologyLink>(
      topology, "links",
      [](const json& e, auto reader) {
        Reader r = reader();
        TopologyLink l;
        r.get(e, "id", l.id);
        r.get(e, "from", l.from);
        r.get(e, "to", l.to);
        r.get(e, "tier", l.tier);
        r.get(e, "bandwidth_gbps", l.bandwidth_gbps);
        return l;
      },
      "topology");
  return t;
}

}  // namespace

std::string report_to_json(const RunReport& report) {
  ordered_json j = {
      {"schema_version", kSchemaVersion},
      {"lesson", report.lesson},
      {"backend", report.backend},
      {"profile", report.profile},
      {"world", report.world},
      {"gpus_per_node", report.gpus_per_node},
      {"options", report.options},
      {"makespan_us", report.makespan_us},
      {"late_starts", report.late_starts},
      {"ranks", array_of(report.ranks)},
      {"spans", array_of(report.spans)},
      {"collectives", array_of(report.collectives)},
      {"regions", array_of(report.regions)},
      {"checks", array_of(report.checks)},
      {"links", array_of(report.links)},
      {"topology",
       ordered_json{{"nodes", array_of(report.topology.nodes)}, {"links", array_of(report.topology.links)}}},
      {"output", report.output},
  };
  if (report.training) j["training"] = to_json(*report.training);
  if (!report.pipeline.empty()) j["pipeline"] = array_of(report.pipeline);
  // A lesson's printed output may hold bytes that are not UTF-8; replace them rather than fail the write.
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

RunReport report_from_json(const std::string& text) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  Reader top("top level");
  if (root.is_discarded()) throw UsageError("report JSON: not valid JSON");
  check_object(root, top);
  auto version = root.find("schema_version");
  if (version == root.end()) top.fail("no schema_version; this is not a ranklab report");
  if (!version->is_number_integer() || version->get<std::int64_t>() != kSchemaVersion) {
    top.fail(fmt::format("schema_version {} is not the version this build reads ({})", version->dump(),
                         kSchemaVersion));
  }

  RunReport report;
  top.get(root, "lesson", report.lesson);
  top.get(root, "backend", report.backend);
  top.get(root, "profile", report.profile);
  top.get(root, "world", report.world);
  top.get(root, "gpus_per_node", report.gpus_per_node);
  top.get(root, "options", report.options);
  top.get(root, "makespan_us", report.makespan_us);
  top.get(root, "late_starts", report.late_starts);

  report.ranks = read_array<RankSummary>(root, "ranks", [](const json& e, auto reader) {
    Reader r = reader();
    RankSummary s;
    r.get(e, "rank", s.rank);
    r.get(e, "end_us", s.end_us);
    r.get(e, "compute_us", s.compute_us);
    r.get(e, "comm_us", s.comm_us);
    r.get(e, "comm_wait_us", s.comm_wait_us);
    r.get(e, "exposed_comm_us", s.exposed_comm_us);
    r.get(e, "idle_us", s.idle_us);
    r.get(e, "peak_bytes", s.peak_bytes);
    r.get(e, "capacity_bytes", s.capacity_bytes);
    return s;
  });
  report.spans = read_array<Span>(root, "spans", [](const json& e, auto reader) {
    Span s;
    // Spans can number in the millions: read them without building a Reader unless one fails.
    auto rank = e.find("rank"), kind = e.find("kind"), name = e.find("name"), start = e.find("start_us"),
         end = e.find("end_us");
    bool fast = rank != e.end() && rank->is_number_integer() && in_range<int>(rank->get<std::int64_t>()) &&
                kind != e.end() && kind->is_string() && name != e.end() && name->is_string() &&
                start != e.end() && start->is_number() && end != e.end() && end->is_number();
    if (fast && parse_kind(kind->get_ref<const std::string&>(), s.kind)) {
      s.rank = rank->get<int>();
      s.name = name->get_ref<const std::string&>();
      s.start_us = start->get<double>();
      s.end_us = end->get<double>();
      return s;
    }
    Reader r = reader();
    std::string kind_name = span_kind_name(s.kind);
    r.get(e, "rank", s.rank);
    r.get(e, "kind", kind_name);
    if (!parse_kind(kind_name, s.kind)) r.fail(fmt::format("unknown span kind '{}'", kind_name));
    r.get(e, "name", s.name);
    r.get(e, "start_us", s.start_us);
    r.get(e, "end_us", s.end_us);
    return s;
  });
  report.collectives = read_array<CollectiveRecord>(root, "collectives", [](const json& e, auto reader) {
    Reader r = reader();
    CollectiveRecord c;
    std::string op = comm_op_name(c.op);
    r.get(e, "op", op);
    c.op = parse_op(op, r);
    r.get(e, "group", c.group);
    r.get(e, "group_size", c.group_size);
    r.get(e, "bytes", c.bytes);
    r.get(e, "algorithm", c.algorithm);
    r.get(e, "start_us", c.start_us);
    r.get(e, "end_us", c.end_us);
    r.get(e, "algbw_gbps", c.algbw_gbps);
    r.get(e, "busbw_gbps", c.busbw_gbps);
    r.get(e, "bookkeeping", c.bookkeeping);  // absent in reports written before it existed: false
    return c;
  });
  report.regions = read_array<RegionRecord>(root, "regions", [](const json& e, auto reader) {
    Reader r = reader();
    RegionRecord g;
    r.get(e, "rank", g.rank);
    r.get(e, "name", g.name);
    r.get(e, "start_us", g.start_us);
    r.get(e, "end_us", g.end_us);
    return g;
  });
  report.checks = read_array<CheckRecord>(root, "checks", [](const json& e, auto reader) {
    Reader r = reader();
    CheckRecord c;
    r.get(e, "rank", c.rank);
    r.get(e, "what", c.what);
    r.get(e, "passed", c.passed);
    r.get(e, "detail", c.detail);
    return c;
  });
  report.links = read_array<LinkTraffic>(root, "links", [](const json& e, auto reader) {
    Reader r = reader();
    LinkTraffic l;
    r.get(e, "link", l.link);
    r.get(e, "tier", l.tier);
    r.get(e, "bytes", l.bytes);
    r.get(e, "bandwidth_gbps", l.bandwidth_gbps);
    return l;
  });
  if (auto it = root.find("topology"); it != root.end() && !it->is_null()) {
    check_object(*it, Reader("topology"));
    report.topology = read_topology(*it);
  }
  top.get(root, "output", report.output);
  if (auto it = root.find("training"); it != root.end() && !it->is_null()) {
    Reader r("training");
    check_object(*it, r);
    TrainingStats t;
    training_fields(t, [&](const char* key, auto& value) { r.get(*it, key, value); });
    report.training = t;
  }
  report.pipeline = read_array<PipelineTask>(root, "pipeline", [](const json& e, auto reader) {
    Reader r = reader();
    PipelineTask t;
    r.get(e, "rank", t.rank);
    r.get(e, "stage", t.stage);
    r.get(e, "chunk", t.chunk);
    r.get(e, "micro_batch", t.micro_batch);
    r.get(e, "forward", t.forward);
    r.get(e, "start_us", t.start_us);
    r.get(e, "end_us", t.end_us);
    return t;
  });
  return report;
}

}  // namespace ranklab
