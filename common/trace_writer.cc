#include "common/trace_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>

namespace ranklab {

namespace {

// A JSON string literal. Names come from lessons and may hold anything, bytes that are not UTF-8 included.
std::string quoted(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Shortest text that reads back as the same double; JSON has no infinity or NaN, so those become 0.
std::string number(double v) {
  if (!std::isfinite(v)) return "0";
  return fmt::format("{}", v);
}

int rank_count(const RunReport& report) {
  int n = std::max(report.world, static_cast<int>(report.ranks.size()));
  for (const Span& s : report.spans) n = std::max(n, s.rank + 1);
  for (const RegionRecord& r : report.regions) n = std::max(n, r.rank + 1);
  return n;
}

// The tracks of one rank, in the order they are drawn. Each may need several lanes (threads), because the
// format draws slices of one thread as a stack and overlapping slices that do not nest would be misdrawn.
enum Track { kCompute, kComm, kIdle, kRegions, kTracks };
constexpr const char* kTrackNames[kTracks] = {"compute", "comm", "idle", "regions"};
// Thread ids: track * kLanes + lane, so every lane of every track has its own id.
constexpr int kLanes = 1000;

struct Slice {
  double start_us;
  double end_us;
  const std::string* name;  // points into the report, or at a constant
  const char* category;
  int tid = 0;
  double hidden_us = -1;  // a transfer: how much of it ran beside the rank's kernels (-1: not a transfer)
};

// The union of a track's slices as sorted disjoint ranges.
std::vector<TimeRange> merged(std::vector<Slice> slices) {
  std::sort(slices.begin(), slices.end(),
            [](const Slice& a, const Slice& b) { return a.start_us < b.start_us; });
  std::vector<TimeRange> out;
  for (const Slice& s : slices) {
    if (!out.empty() && s.start_us <= out.back().end_us) {
      out.back().end_us = std::max(out.back().end_us, s.end_us);
    } else {
      out.push_back({s.start_us, s.end_us});
    }
  }
  return out;
}

// How much of [start, end] the sorted disjoint ranges cover.
double covered_us(const std::vector<TimeRange>& ranges, double start_us, double end_us) {
  auto it = std::lower_bound(ranges.begin(), ranges.end(), start_us,
                             [](const TimeRange& r, double t) { return r.end_us <= t; });
  double covered = 0;
  for (; it != ranges.end() && it->start_us < end_us; ++it)
    covered += std::min(end_us, it->end_us) - std::max(start_us, it->start_us);
  return covered;
}

// Greedy interval partitioning: each slice goes to the first lane free at its start. Sorted by start, this
// uses as few lanes as the deepest overlap needs.
int assign_lanes(std::vector<Slice>& slices, Track track) {
  std::stable_sort(slices.begin(), slices.end(), [](const Slice& a, const Slice& b) {
    return a.start_us != b.start_us ? a.start_us < b.start_us : a.end_us > b.end_us;
  });
  std::vector<double> lane_end;
  for (Slice& s : slices) {
    std::size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > s.start_us) ++lane;
    if (lane == lane_end.size()) lane_end.push_back(s.end_us);
    lane_end[lane] = s.end_us;
    s.tid = track * kLanes + static_cast<int>(std::min<std::size_t>(lane, kLanes - 1));
  }
  return static_cast<int>(lane_end.size());
}

// "rank 3 -> rank 5" (the simulator's group of a send/recv) or "3 -> 5": the two ranks, or false.
bool parse_p2p(const std::string& group, int& src, int& dst) {
  const std::size_t arrow = group.find("->");
  if (arrow == std::string::npos) return false;
  const std::size_t src_end = group.find_last_of("0123456789", arrow);
  const std::size_t dst_begin = group.find_first_of("0123456789", arrow);
  if (src_end == std::string::npos || dst_begin == std::string::npos) return false;
  std::size_t src_begin = group.find_last_not_of("0123456789", src_end);
  src_begin = src_begin == std::string::npos ? 0 : src_begin + 1;
  const char* text = group.data();
  return std::from_chars(text + src_begin, text + src_end + 1, src).ec == std::errc() &&
         std::from_chars(text + dst_begin, text + group.size(), dst).ec == std::errc();
}

// The comm slice of `rank` that best covers [start, end]: the one overlapping it most.
const Slice* find_comm(const std::vector<Slice>& comm, double start_us, double end_us) {
  const double slack = 1e-6 * std::max(std::fabs(end_us), 1.0);
  auto it = std::lower_bound(comm.begin(), comm.end(), start_us - slack,
                             [](const Slice& s, double t) { return s.start_us < t; });
  const Slice* best = nullptr;
  double best_overlap = -1;
  for (; it != comm.end() && it->start_us <= end_us + slack; ++it) {
    if (it->category != std::string_view("comm")) continue;
    double overlap = std::min(end_us, it->end_us) - std::max(start_us, it->start_us);
    if (overlap > best_overlap) {
      best_overlap = overlap;
      best = &*it;
    }
  }
  return best;
}

}  // namespace

std::vector<std::vector<TimeRange>> idle_intervals(const RunReport& report) {
  const int n = rank_count(report);
  std::vector<std::vector<TimeRange>> busy(n), idle(n);
  std::vector<double> end(n, 0.0);
  for (const Span& s : report.spans) {
    if (s.rank < 0) continue;
    end[s.rank] = std::max(end[s.rank], s.end_us);
    // Waiting for a late member is idle time, as RankSummary counts it.
    if (s.kind != SpanKind::Idle && s.end_us > s.start_us) busy[s.rank].push_back({s.start_us, s.end_us});
  }
  for (const RankSummary& r : report.ranks) {
    if (r.rank >= 0 && r.rank < n && r.end_us > 0) end[r.rank] = r.end_us;
  }
  for (int r = 0; r < n; ++r) {
    if (!report.traces(r)) continue;  // its timeline was not kept: nothing to say when it was idle
    std::vector<TimeRange>& b = busy[r];
    std::sort(b.begin(), b.end(),
              [](const TimeRange& x, const TimeRange& y) { return x.start_us < y.start_us; });
    double covered = 0;  // everything before this is busy or already listed
    for (const TimeRange& iv : b) {
      if (iv.start_us > covered) idle[r].push_back({covered, std::min(iv.start_us, end[r])});
      covered = std::max(covered, iv.end_us);
      if (covered >= end[r]) break;
    }
    if (end[r] > covered) idle[r].push_back({covered, end[r]});
    std::erase_if(idle[r], [](const TimeRange& iv) { return !(iv.end_us > iv.start_us); });
  }
  return idle;
}

std::string report_to_trace_json(const RunReport& report) {
  const int n = rank_count(report);
  static const std::string kIdleName = "idle";

  // Every slice, per rank and track.
  std::vector<std::array<std::vector<Slice>, kTracks>> tracks(n);
  for (const Span& s : report.spans) {
    if (s.rank < 0) continue;
    switch (s.kind) {
      case SpanKind::Compute:
        tracks[s.rank][kCompute].push_back({s.start_us, s.end_us, &s.name.str(), "compute"});
        break;
      case SpanKind::Comm:
        tracks[s.rank][kComm].push_back({s.start_us, s.end_us, &s.name.str(), "comm"});
        break;
      case SpanKind::Idle:
        // The communication stream waiting for the group's late members: drawn on that stream's track.
        tracks[s.rank][kComm].push_back({s.start_us, s.end_us, &s.name.str(), "wait"});
        break;
    }
  }
  const std::vector<std::vector<TimeRange>> idle = idle_intervals(report);
  for (int r = 0; r < n; ++r) {
    for (const TimeRange& iv : idle[r])
      tracks[r][kIdle].push_back({iv.start_us, iv.end_us, &kIdleName, "idle"});
  }
  for (const RegionRecord& g : report.regions) {
    if (g.rank >= 0) tracks[g.rank][kRegions].push_back({g.start_us, g.end_us, &g.name, "region"});
  }
  // Each transfer's time beside the rank's kernels is hidden under them; the rest the rank could not hide.
  for (int r = 0; r < n; ++r) {
    const std::vector<TimeRange> kernels = merged(tracks[r][kCompute]);
    for (Slice& s : tracks[r][kComm]) {
      if (s.category == std::string_view("comm")) s.hidden_us = covered_us(kernels, s.start_us, s.end_us);
    }
  }

  std::string out;
  out.reserve(160 * (report.spans.size() + report.regions.size()) + 4096);
  out += "{\"traceEvents\":[\n";
  bool first = true;
  auto event = [&out, &first](const std::string& text) {
    if (!first) out += ",\n";
    first = false;
    out += text;
  };

  for (int r = 0; r < n; ++r) {
    if (!report.traces(r)) continue;
    event(fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"tid":0,"args":{{"name":"rank {}"}}}})", r,
                      r));
    event(fmt::format(
        R"({{"ph":"M","name":"process_sort_index","pid":{},"tid":0,"args":{{"sort_index":{}}}}})", r, r));
    for (int t = 0; t < kTracks; ++t) {
      std::vector<Slice>& slices = tracks[r][t];
      const int lanes = assign_lanes(slices, static_cast<Track>(t));
      for (int lane = 0; lane < std::min(lanes, kLanes); ++lane) {
        const int tid = t * kLanes + lane;
        std::string name = lane == 0 ? kTrackNames[t] : fmt::format("{} {}", kTrackNames[t], lane + 1);
        event(fmt::format(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":"{}"}}}})", r,
                          tid, name));
        event(fmt::format(
            R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})", r, tid,
            tid));
      }
      for (const Slice& s : slices) {
        const std::string name = s.category == std::string_view("wait") ? "wait " + *s.name : *s.name;
        const double dur_us = s.end_us - s.start_us;
        const std::string args =
            s.hidden_us < 0 ? std::string()
                            : fmt::format(R"(,"args":{{"hidden_us":{},"exposed_us":{}}})",
                                          number(s.hidden_us), number(std::max(0.0, dur_us - s.hidden_us)));
        event(fmt::format(R"({{"ph":"X","name":{},"cat":"{}","pid":{},"tid":{},"ts":{},"dur":{}{}}})",
                          quoted(name), s.category, r, s.tid, number(s.start_us), number(dur_us), args));
      }
    }
  }

  // Flow arrows from each send to its receive, bound to the two transfers' slices (assign_lanes left every
  // track sorted by start, which find_comm relies on).
  int flow_id = 0;
  for (const CollectiveRecord& c : report.collectives) {
    if (c.op != CommOp::Send && c.op != CommOp::Recv) continue;
    int src = -1, dst = -1;
    if (!parse_p2p(c.group, src, dst) || src < 0 || dst < 0 || src >= n || dst >= n) continue;
    const Slice* from = find_comm(tracks[src][kComm], c.start_us, c.end_us);
    const Slice* to = find_comm(tracks[dst][kComm], c.start_us, c.end_us);
    if (from == nullptr || to == nullptr) continue;
    // Each end sits inside its slice, which is what binds the arrow to it.
    const double from_us = (from->start_us + from->end_us) / 2, to_us = (to->start_us + to->end_us) / 2;
    ++flow_id;
    const std::string label = quoted(fmt::format("{} B", c.bytes));
    event(fmt::format(R"({{"ph":"s","name":{},"cat":"p2p","id":{},"pid":{},"tid":{},"ts":{}}})", label,
                      flow_id, src, from->tid, number(from_us)));
    event(fmt::format(R"({{"ph":"f","bp":"e","name":{},"cat":"p2p","id":{},"pid":{},"tid":{},"ts":{}}})",
                      label, flow_id, dst, to->tid, number(to_us)));
  }

  out += "\n],\n";
  out += fmt::format(R"("otherData":{{"lesson":{},"backend":{},"profile":{},"world":{},"makespan_us":{}}}}})",
                     quoted(report.lesson), quoted(report.backend), quoted(report.profile), report.world,
                     number(report.makespan_us));
  out += "\n";
  return out;
}

}  // namespace ranklab
