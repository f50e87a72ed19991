#include "common/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "common/errors.h"
#include "common/json_shape.h"
#include "common/rank_timeline.h"

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

bool RunReport::traces(int rank) const {
  return traced_ranks.empty() || std::binary_search(traced_ranks.begin(), traced_ranks.end(), rank);
}

void CollectiveTally::add(const CollectiveRecord& c) {
  auto key =
      std::make_tuple(static_cast<int>(c.op), c.bytes, c.group_size, &c.algorithm.str(), c.bookkeeping);
  auto [it, inserted] = index_.try_emplace(key, rows_.size());
  if (inserted) rows_.push_back(CollectiveTotal{c.op, c.bytes, c.group_size, c.algorithm, c.bookkeeping});
  CollectiveTotal& row = rows_[it->second];
  row.min_us = row.count == 0 ? c.time_us() : std::min(row.min_us, c.time_us());
  row.max_us = row.count == 0 ? c.time_us() : std::max(row.max_us, c.time_us());
  ++row.count;
  row.total_us += c.time_us();
}

std::string pipeline_task_name(const PipelineTask& t, bool interleaved) {
  return fmt::format("{} mb {}{}", t.forward ? "forward" : "backward", t.micro_batch,
                     interleaved ? fmt::format(" chunk {}", t.chunk) : "");
}

std::string pipeline_task_label(const PipelineTask& t, bool interleaved) {
  return fmt::format("{}{}{}", t.forward ? 'F' : 'B', t.micro_batch,
                     interleaved ? fmt::format(".{}", t.chunk) : "");
}

double CollectiveTotal::algbw_gbps() const {
  return mean_us() > 0 ? static_cast<double>(bytes) / (mean_us() * 1e3) : 0;
}

double CollectiveTotal::busbw_gbps() const {
  return group_size >= 1 ? algbw_gbps() * bus_factor(op, group_size) : 0;
}

std::vector<CollectiveTotal> collective_totals(const RunReport& report) {
  if (!report.collective_totals.empty()) return report.collective_totals;
  CollectiveTally tally;
  for (const CollectiveRecord& c : report.collectives) tally.add(c);
  return tally.take();
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

void summarize_spans(RunReport& report) {
  int n = std::max(report.world, 0);
  for (const RankSummary& s : report.ranks) n = std::max(n, s.rank + 1);
  for (const Span& s : report.spans) {
    if (s.rank < 0) throw UsageError(fmt::format("span '{}' has rank {}", s.name, s.rank));
    n = std::max(n, s.rank + 1);
  }

  // In time order, which RankTimeline takes in constant time per span.
  std::vector<const Span*> ordered;
  ordered.reserve(report.spans.size());
  for (const Span& s : report.spans) ordered.push_back(&s);
  std::sort(ordered.begin(), ordered.end(), [](const Span* a, const Span* b) {
    return std::tie(a->rank, a->start_us) < std::tie(b->rank, b->start_us);
  });
  std::vector<RankTimeline> per_rank(n);
  for (const Span* s : ordered) per_rank[s->rank].add(s->kind, s->start_us, s->end_us);

  // One summary per rank, in rank order, keeping whatever the backend already filled in (end, memory).
  std::vector<RankSummary> summaries(n);
  for (int i = 0; i < n; ++i) summaries[i].rank = i;
  for (const RankSummary& s : report.ranks) {
    if (s.rank >= 0) summaries[s.rank] = s;
  }

  double makespan_us = 0;
  for (int i = 0; i < n; ++i) {
    RankSummary& s = summaries[i];
    per_rank[i].summarize(s);
    makespan_us = std::max(makespan_us, s.end_us);
  }
  report.ranks = std::move(summaries);
  if (report.makespan_us == 0) report.makespan_us = makespan_us;
  if (report.activity.ranks.empty() && !report.spans.empty()) {
    std::vector<ActivityBins> bins;
    bins.reserve(per_rank.size());
    std::vector<const ActivityBins*> pointers;
    for (const RankTimeline& t : per_rank) pointers.push_back(&bins.emplace_back(t.activity()));
    report.activity = activity_strip(pointers, report.makespan_us);
  }
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

void format_collectives(std::string& out, const std::vector<CollectiveTotal>& totals) {
  std::vector<CollectiveTotal> rows;
  std::int64_t kept_apart = 0;
  double kept_apart_bytes = 0;
  for (const CollectiveTotal& c : totals) {
    if (c.bookkeeping) {
      kept_apart += c.count;
      kept_apart_bytes += static_cast<double>(c.bytes) * static_cast<double>(c.count);
    } else {
      rows.push_back(c);
    }
  }
  std::size_t op_width = 10, algo_width = 9;
  for (const CollectiveTotal& r : rows) {
    op_width = std::max(op_width, std::string(comm_op_name(r.op)).size());
    algo_width = std::max(algo_width, r.algorithm.size());
  }
  out += fmt::format("  {:<{}} {:>10} {:>5}  {:<{}} {:>6} {:>11} {:>12} {:>12}\n", "collective", op_width,
                     "size", "ranks", "algorithm", algo_width, "count", "mean time", "algbw", "busbw");
  for (const CollectiveTotal& r : rows) {
    out += fmt::format("  {:<{}} {:>10} {:>5}  {:<{}} {:>6} {:>11} {:>12} {:>12}\n", comm_op_name(r.op),
                       op_width, format_bytes(static_cast<double>(r.bytes)), r.group_size, r.algorithm,
                       algo_width, r.count, human_time(r.mean_us()), format_gbps(r.algbw_gbps()),
                       format_gbps(r.busbw_gbps()));
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
  if (!t.communicated_comm_us.empty()) {
    std::string parts;
    for (const auto& [dim, us] : t.communicated_comm_us) {
      const auto hidden = t.hidden_comm_us.find(dim);
      parts += fmt::format("{}{} {} ({} hidden)", parts.empty() ? "" : ", ", dim, human_time(us),
                           human_time(hidden == t.hidden_comm_us.end() ? 0.0 : hidden->second));
    }
    out += fmt::format("  {:<24}{}\n", "communicated", parts);
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
  // The simulator's per-rank figures of lost time: the rank with the most, where any rank has some.
  auto most = [&](double RankSummary::*figure, const char* what) {
    const auto top =
        std::max_element(report.ranks.begin(), report.ranks.end(),
                         [&](const RankSummary& a, const RankSummary& b) { return a.*figure < b.*figure; });
    if (top != report.ranks.end() && (*top).*figure > 0)
      out += fmt::format("{}: {} on rank {}, the most\n", what, human_time((*top).*figure), top->rank);
  };
  most(&RankSummary::comm_slowed_compute_us,
       "compute slowed by communication kernels on the same GPU (their SMs and HBM traffic)");
  most(&RankSummary::host_wait_us,
       "compute stream idle until the host had launched its next kernel (part of its idle time)");
  if (!report.collectives.empty() || !report.collective_totals.empty()) {
    out += "\n";
    format_collectives(out, collective_totals(report));
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

// Every struct of the report described once, fields in the order they are written; the writer and the
// reader are both made from these (common/json_shape.h). A field that reports written before it existed
// lack is optional: the reader leaves it at its default. Specialised here only: nothing else reads or
// writes these structs as JSON.
namespace json_shape {

template <>
struct Codec<SpanName> {
  static nlohmann::ordered_json write(const SpanName& n) { return n.str(); }
  static void read(const nlohmann::json& j, SpanName& out, const Path& path) {
    if (!j.is_string()) path.fail(fmt::format("expected a string, got {}", describe(j)));
    out = j.get_ref<const std::string&>();
  }
};

template <>
struct Codec<SpanKind> {
  static constexpr SpanKind kValues[] = {SpanKind::Compute, SpanKind::Comm, SpanKind::Idle};
  static nlohmann::ordered_json write(SpanKind k) { return span_kind_name(k); }
  static void read(const nlohmann::json& j, SpanKind& out, const Path& path) {
    read_name(j, out, path, kValues, span_kind_name);
  }
};

template <>
struct Codec<CommOp> {
  static constexpr CommOp kValues[] = {CommOp::Broadcast, CommOp::Scatter,   CommOp::Gather,
                                       CommOp::Reduce,    CommOp::AllGather, CommOp::ReduceScatter,
                                       CommOp::AllReduce, CommOp::AllToAll,  CommOp::Send,
                                       CommOp::Recv,      CommOp::Barrier};
  static_assert(std::size(kValues) == static_cast<std::size_t>(CommOp::Barrier) + 1, "every op has a name");
  static nlohmann::ordered_json write(CommOp op) { return comm_op_name(op); }
  static void read(const nlohmann::json& j, CommOp& out, const Path& path) {
    read_name(j, out, path, kValues, comm_op_name);
  }
};

template <>
struct Shape<RankSummary> {
  static constexpr auto fields = std::tuple{
      required("rank", &RankSummary::rank),
      required("end_us", &RankSummary::end_us),
      required("compute_us", &RankSummary::compute_us),
      required("comm_us", &RankSummary::comm_us),
      required("comm_wait_us", &RankSummary::comm_wait_us),
      required("exposed_comm_us", &RankSummary::exposed_comm_us),
      required("idle_us", &RankSummary::idle_us),
      required("peak_bytes", &RankSummary::peak_bytes),
      required("capacity_bytes", &RankSummary::capacity_bytes),
      optional("comm_slowed_compute_us", &RankSummary::comm_slowed_compute_us),
      optional("host_wait_us", &RankSummary::host_wait_us),
      optional("mirror_of", &RankSummary::mirror_of),  // -1 (ran) in reports from before it existed
  };
};

template <>
struct Shape<Span> {
  static constexpr auto fields = std::tuple{
      required("rank", &Span::rank),         required("kind", &Span::kind),     required("name", &Span::name),
      required("start_us", &Span::start_us), required("end_us", &Span::end_us),
  };
};

// A mirror of a symmetric run is written as its rank and the rank it mirrors, whose figures are its own
// (report_from_json copies them back): a 16,384-rank report would otherwise repeat 128 ranks' figures 128
// times each.
template <>
struct Codec<RankSummary> {
  static nlohmann::ordered_json write(const RankSummary& s) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    if (s.mirror_of >= 0) {
      j["rank"] = s.rank;
      j["mirror_of"] = s.mirror_of;
    } else {
      write_fields(s, j);
    }
    return j;
  }
  static void read(const nlohmann::json& j, RankSummary& out, const Path& path) {
    if (j.is_object() && !j.contains("end_us") && j.contains("mirror_of")) {
      if (!j.contains("rank")) Path(path, "rank").fail("required field is missing");
      json_shape::read(j.at("rank"), out.rank, Path(path, "rank"));
      json_shape::read(j.at("mirror_of"), out.mirror_of, Path(path, "mirror_of"));
      if (out.mirror_of < 0) Path(path, "end_us").fail("required field is missing");
      return;
    }
    read_fields(j, out, path);
  }
};

template <>
struct Shape<CollectiveRecord> {
  static constexpr auto fields = std::tuple{
      required("op", &CollectiveRecord::op),
      required("group", &CollectiveRecord::group),
      required("group_size", &CollectiveRecord::group_size),
      required("bytes", &CollectiveRecord::bytes),
      required("algorithm", &CollectiveRecord::algorithm),
      required("start_us", &CollectiveRecord::start_us),
      required("end_us", &CollectiveRecord::end_us),
      required("algbw_gbps", &CollectiveRecord::algbw_gbps),
      required("busbw_gbps", &CollectiveRecord::busbw_gbps),
      optional("bookkeeping", &CollectiveRecord::bookkeeping),  // false in reports from before it existed
  };
};

template <>
struct Shape<CollectiveTotal> {
  static constexpr auto fields = std::tuple{
      required("op", &CollectiveTotal::op),
      required("bytes", &CollectiveTotal::bytes),
      required("group_size", &CollectiveTotal::group_size),
      required("algorithm", &CollectiveTotal::algorithm),
      required("bookkeeping", &CollectiveTotal::bookkeeping),
      required("count", &CollectiveTotal::count),
      required("total_us", &CollectiveTotal::total_us),
      required("min_us", &CollectiveTotal::min_us),
      required("max_us", &CollectiveTotal::max_us),
  };
};

template <>
struct Shape<ActivityStrip> {
  static constexpr auto fields = std::tuple{
      required("bin_us", &ActivityStrip::bin_us),
      required("bins", &ActivityStrip::bins),
      required("ranks", &ActivityStrip::ranks),
  };
};

template <>
struct Shape<RegionRecord> {
  static constexpr auto fields = std::tuple{
      required("rank", &RegionRecord::rank),
      required("name", &RegionRecord::name),
      required("start_us", &RegionRecord::start_us),
      required("end_us", &RegionRecord::end_us),
  };
};

template <>
struct Shape<CheckRecord> {
  static constexpr auto fields = std::tuple{
      required("rank", &CheckRecord::rank),
      required("what", &CheckRecord::what),
      required("passed", &CheckRecord::passed),
      required("detail", &CheckRecord::detail),
  };
};

template <>
struct Shape<LinkTraffic> {
  static constexpr auto fields = std::tuple{
      required("link", &LinkTraffic::link), required("tier", &LinkTraffic::tier),
      required("bytes", &LinkTraffic::bytes),
      optional("bandwidth_gbps", &LinkTraffic::bandwidth_gbps),  // 0 (unknown) in the first reports
  };
};

template <>
struct Shape<TopologyNode> {
  static constexpr auto fields = std::tuple{
      required("id", &TopologyNode::id),       required("kind", &TopologyNode::kind),
      required("level", &TopologyNode::level), required("host", &TopologyNode::host),
      required("rank", &TopologyNode::rank),
  };
};

// A link's "id" is written only where it is not "from->to", which it is for every link the simulator
// describes: a 16,384-rank machine's quarter of a million links would otherwise spell each name twice.
template <>
struct Codec<TopologyLink> {
  static nlohmann::ordered_json write(const TopologyLink& l) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    if (l.id != l.from + "->" + l.to) j["id"] = l.id;
    j["from"] = l.from;
    j["to"] = l.to;
    j["tier"] = l.tier;
    j["bandwidth_gbps"] = json_shape::write(l.bandwidth_gbps);
    return j;
  }
  static void read(const nlohmann::json& j, TopologyLink& out, const Path& path) {
    if (!j.is_object()) path.fail(fmt::format("expected an object, got {}", describe(j)));
    auto field = [&](const char* key, auto& member, bool required) {
      const auto it = j.find(key);
      if (it != j.end()) {
        json_shape::read(*it, member, Path(path, key));
      } else if (required) {
        Path(path, key).fail("required field is missing");
      }
    };
    field("from", out.from, true);
    field("to", out.to, true);
    field("tier", out.tier, true);
    field("bandwidth_gbps", out.bandwidth_gbps, true);
    out.id = out.from + "->" + out.to;
    field("id", out.id, false);
  }
};

template <>
struct Shape<RunTopology> {
  static constexpr auto fields = std::tuple{
      required("nodes", &RunTopology::nodes),
      required("links", &RunTopology::links),
  };
};

template <>
struct Shape<PipelineTask> {
  static constexpr auto fields = std::tuple{
      required("rank", &PipelineTask::rank),       required("stage", &PipelineTask::stage),
      required("chunk", &PipelineTask::chunk),     required("micro_batch", &PipelineTask::micro_batch),
      required("forward", &PipelineTask::forward), required("start_us", &PipelineTask::start_us),
      required("end_us", &PipelineTask::end_us),
  };
};

template <>
struct Shape<TrainingStats> {
  static constexpr auto fields = std::tuple{
      required("model", &TrainingStats::model),
      required("layout", &TrainingStats::layout),
      required("tokens_per_step", &TrainingStats::tokens_per_step),
      required("micro_batches", &TrainingStats::micro_batches),
      required("step_time_us", &TrainingStats::step_time_us),
      required("model_flops", &TrainingStats::model_flops),
      required("hardware_flops", &TrainingStats::hardware_flops),
      required("model_tflops_per_gpu", &TrainingStats::model_tflops_per_gpu),
      required("hardware_tflops_per_gpu", &TrainingStats::hardware_tflops_per_gpu),
      required("mfu", &TrainingStats::mfu),
      required("bubble_fraction", &TrainingStats::bubble_fraction),
      required("bubble_fraction_formula", &TrainingStats::bubble_fraction_formula),
      required("exposed_comm_us", &TrainingStats::exposed_comm_us),
      optional("communicated_comm_us", &TrainingStats::communicated_comm_us),
      optional("hidden_comm_us", &TrainingStats::hidden_comm_us),
      required("peak_memory_bytes", &TrainingStats::peak_memory_bytes),
      required("weights_bytes", &TrainingStats::weights_bytes),
      required("grads_bytes", &TrainingStats::grads_bytes),
      required("optimizer_bytes", &TrainingStats::optimizer_bytes),
      required("activations_bytes", &TrainingStats::activations_bytes),
      optional("moe_routes", &TrainingStats::moe_routes),
      optional("moe_dropped_routes", &TrainingStats::moe_dropped_routes),
  };
};

// After schema_version, which report_to_json writes first and report_from_json checks before the rest.
// The optional fields came after the first reports: a report without them loads with their defaults.
template <>
struct Shape<RunReport> {
  static constexpr auto fields = std::tuple{
      required("lesson", &RunReport::lesson),
      required("backend", &RunReport::backend),
      required("profile", &RunReport::profile),
      required("world", &RunReport::world),
      optional("gpus_per_node", &RunReport::gpus_per_node),
      optional("options", &RunReport::options),
      required("makespan_us", &RunReport::makespan_us),
      optional("late_starts", &RunReport::late_starts),
      required("ranks", &RunReport::ranks),
      optional("traced_ranks", &RunReport::traced_ranks),  // every rank's, in reports from before it existed
      required("spans", &RunReport::spans),
      required("collectives", &RunReport::collectives),
      optional("collective_totals", &RunReport::collective_totals),
      optional("activity", &RunReport::activity),
      required("regions", &RunReport::regions),
      required("checks", &RunReport::checks),
      required("links", &RunReport::links),
      optional("topology", &RunReport::topology),
      required("output", &RunReport::output),
      optional("training", &RunReport::training, Write::WhenSet),  // only from a training lesson
      optional("pipeline", &RunReport::pipeline, Write::WhenSet),  // only from a pipeline-parallel lesson
  };
};

}  // namespace json_shape

namespace {

constexpr int kSchemaVersion = 1;

}  // namespace

namespace {

// The report's text appended to `out`, schema_version first; `flush` as json_shape::append_fields takes it.
// A lesson's printed output may hold bytes that are not UTF-8; they are replaced rather than fail the write.
void append_report(const RunReport& report, std::string& out,
                   const std::function<void(std::string&)>& flush) {
  out += fmt::format("{{\"schema_version\":{}", kSchemaVersion);
  json_shape::append_fields(report, out, flush);
  out += '}';
}

}  // namespace

std::string report_to_json(const RunReport& report) {
  std::string out;
  append_report(report, out, {});
  return out;
}

void write_report_json(const RunReport& report, std::ostream& out) {
  std::string buffer;
  append_report(report, buffer, [&out](std::string& text) {
    out << text;
    text.clear();
  });
  out << buffer;
}

RunReport report_from_json(const std::string& text, std::string_view document) {
  const json_shape::Path top(document);
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) top.fail("not valid JSON");
  if (!root.is_object()) top.fail(fmt::format("expected an object, got {}", json_shape::describe(root)));
  auto version = root.find("schema_version");
  if (version == root.end()) top.fail("no schema_version; this is not a ranklab report");
  if (!version->is_number_integer() || version->get<std::int64_t>() != kSchemaVersion) {
    json_shape::Path(top, "schema_version")
        .fail(fmt::format("{} is not the version this build reads ({})", version->dump(), kSchemaVersion));
  }
  RunReport report;
  json_shape::read_fields(root, report, top);
  // A mirror's figures are its representative's (Codec<RankSummary>).
  for (std::size_t i = 0; i < report.ranks.size(); ++i) {
    RankSummary& s = report.ranks[i];
    if (s.mirror_of < 0) continue;
    const json_shape::Path ranks(top, "ranks"), at(ranks, i);
    if (static_cast<std::size_t>(s.mirror_of) >= report.ranks.size() ||
        report.ranks[static_cast<std::size_t>(s.mirror_of)].mirror_of >= 0) {
      json_shape::Path(at, "mirror_of")
          .fail(fmt::format("{} is not a rank of the report that ran", s.mirror_of));
    }
    const int rank = s.rank, mirror_of = s.mirror_of;
    s = report.ranks[static_cast<std::size_t>(mirror_of)];
    s.rank = rank, s.mirror_of = mirror_of;
  }
  return report;
}

std::string training_to_json(const TrainingStats& stats) {
  return json_shape::write(stats).dump();
}

TrainingStats training_from_json(const std::string& text, std::string_view document) {
  const json_shape::Path top(document);
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) top.fail("not valid JSON");
  TrainingStats stats;
  json_shape::read(root, stats, top);
  return stats;
}

}  // namespace ranklab
