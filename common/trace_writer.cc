#include "common/trace_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>

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
enum Track { kPipeline, kCompute, kComm, kIdle, kRegions, kTracks };
constexpr const char* kTrackNames[kTracks] = {"pipeline", "compute", "comm", "idle", "regions"};
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

// A lane's track name, as both formats give it: "compute", then "compute 2".
std::string lane_name(int track, int lane) {
  return lane == 0 ? std::string(kTrackNames[track]) : fmt::format("{} {}", kTrackNames[track], lane + 1);
}

// A slice's name: a wait is named for what it waited for ("wait all_reduce").
std::string slice_name(const Slice& s) {
  return s.category == std::string_view("wait") ? "wait " + *s.name : *s.name;
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

namespace {

// What both formats draw: each traced rank's tracks, their slices in lanes, and the arrows between slices.
struct RankTracks {
  int rank = 0;
  std::array<std::vector<Slice>, kTracks> tracks;
  std::array<int, kTracks> lanes{};
};

// An arrow through slices of several ranks: a send to its receive, or a collective through its members'
// transfers (each member's transfer spans the operation's start to its end).
struct Flow {
  std::vector<const Slice*> through;
  std::vector<int> ranks;
  std::string label;
  const char* category;
};

struct TraceLayout {
  std::vector<RankTracks> ranks;  // the traced ranks, ascending
  std::vector<Flow> flows;
  std::deque<std::string> names;  // names made here (pipeline tasks), which slices point to
};

TraceLayout lay_out(const RunReport& report) {
  const int n = rank_count(report);
  static const std::string kIdleName = "idle";
  TraceLayout out;
  std::vector<int> index(n, -1);
  for (int r = 0; r < n; ++r) {
    if (!report.traces(r)) continue;
    index[r] = static_cast<int>(out.ranks.size());
    out.ranks.emplace_back().rank = r;
  }
  auto tracks_of = [&](int rank) -> std::array<std::vector<Slice>, kTracks>* {
    return rank >= 0 && rank < n && index[rank] >= 0 ? &out.ranks[index[rank]].tracks : nullptr;
  };
  for (const Span& s : report.spans) {
    auto* t = tracks_of(s.rank);
    if (t == nullptr) continue;
    switch (s.kind) {
      case SpanKind::Compute:
        (*t)[kCompute].push_back({s.start_us, s.end_us, &s.name.str(), "compute"});
        break;
      case SpanKind::Comm:
        (*t)[kComm].push_back({s.start_us, s.end_us, &s.name.str(), "comm"});
        break;
      case SpanKind::Idle:
        // The communication stream waiting for the group's late members: drawn on that stream's track.
        (*t)[kComm].push_back({s.start_us, s.end_us, &s.name.str(), "wait"});
        break;
    }
  }
  const std::vector<std::vector<TimeRange>> idle = idle_intervals(report);
  for (RankTracks& rt : out.ranks) {
    for (const TimeRange& iv : idle[rt.rank])
      rt.tracks[kIdle].push_back({iv.start_us, iv.end_us, &kIdleName, "idle"});
  }
  for (const RegionRecord& g : report.regions) {
    if (auto* t = tracks_of(g.rank)) (*t)[kRegions].push_back({g.start_us, g.end_us, &g.name, "region"});
  }
  bool interleaved = false;
  for (const PipelineTask& t : report.pipeline) interleaved = interleaved || t.chunk > 0;
  for (const PipelineTask& task : report.pipeline) {
    auto* t = tracks_of(task.rank);
    if (t == nullptr) continue;
    out.names.push_back(pipeline_task_name(task, interleaved));
    (*t)[kPipeline].push_back({task.start_us, task.end_us, &out.names.back(), "pipeline"});
  }
  // Each transfer's time beside the rank's kernels is hidden under them; the rest the rank could not hide.
  for (RankTracks& rt : out.ranks) {
    const std::vector<TimeRange> kernels = merged(rt.tracks[kCompute]);
    for (Slice& s : rt.tracks[kComm]) {
      if (s.category == std::string_view("comm")) s.hidden_us = covered_us(kernels, s.start_us, s.end_us);
    }
    for (int t = 0; t < kTracks; ++t) rt.lanes[t] = assign_lanes(rt.tracks[t], static_cast<Track>(t));
  }

  // Arrows from each send to its receive, and through each collective's traced members, bound to their
  // transfers' slices (assign_lanes left every track sorted by start, which find_comm relies on).
  for (const CollectiveRecord& c : report.collectives) {
    Flow f;
    if (c.op == CommOp::Send || c.op == CommOp::Recv) {
      int src = -1, dst = -1;
      if (!parse_p2p(c.group, src, dst) || tracks_of(src) == nullptr || tracks_of(dst) == nullptr) continue;
      for (int rank : {src, dst}) {
        const Slice* slice = find_comm((*tracks_of(rank))[kComm], c.start_us, c.end_us);
        if (slice == nullptr) break;
        f.through.push_back(slice);
        f.ranks.push_back(rank);
      }
      f.label = fmt::format("{} B", c.bytes);
      f.category = "p2p";
    } else {
      // Every member's transfer of the operation starts and ends with it.
      for (const RankTracks& rt : out.ranks) {
        const std::vector<Slice>& comm = rt.tracks[kComm];
        auto it = std::lower_bound(comm.begin(), comm.end(), c.start_us,
                                   [](const Slice& s, double t) { return s.start_us < t; });
        for (; it != comm.end() && it->start_us == c.start_us; ++it) {
          if (it->end_us == c.end_us && it->category == std::string_view("comm") &&
              *it->name == comm_op_name(c.op)) {
            f.through.push_back(&*it);
            f.ranks.push_back(rt.rank);
            break;
          }
        }
      }
      f.label = fmt::format("{} {} B", comm_op_name(c.op), c.bytes);
      f.category = "collective";
    }
    if (f.through.size() >= 2) out.flows.push_back(std::move(f));
  }
  return out;
}

}  // namespace

std::string report_to_trace_json(const RunReport& report) {
  const TraceLayout layout = lay_out(report);
  std::string out;
  out.reserve(160 * (report.spans.size() + report.regions.size()) + 4096);
  out += "{\"traceEvents\":[\n";
  bool first = true;
  auto event = [&out, &first](const std::string& text) {
    if (!first) out += ",\n";
    first = false;
    out += text;
  };

  for (const RankTracks& rt : layout.ranks) {
    const int r = rt.rank;
    event(fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"tid":0,"args":{{"name":"rank {}"}}}})", r,
                      r));
    event(fmt::format(
        R"({{"ph":"M","name":"process_sort_index","pid":{},"tid":0,"args":{{"sort_index":{}}}}})", r, r));
    for (int t = 0; t < kTracks; ++t) {
      for (int lane = 0; lane < std::min(rt.lanes[t], kLanes); ++lane) {
        const int tid = t * kLanes + lane;
        event(fmt::format(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":"{}"}}}})", r,
                          tid, lane_name(t, lane)));
        event(fmt::format(
            R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})", r, tid,
            tid));
      }
      for (const Slice& s : rt.tracks[t]) {
        const std::string name = slice_name(s);
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

  // Each end of an arrow sits inside its slice, which is what binds the arrow to it: "s" at the first, "t"
  // through the middle ones, "f" at the last.
  int flow_id = 0;
  for (const Flow& f : layout.flows) {
    ++flow_id;
    const std::string label = quoted(f.label);
    for (std::size_t i = 0; i < f.through.size(); ++i) {
      const Slice* s = f.through[i];
      const char* ph = i == 0 ? "s" : i + 1 == f.through.size() ? "f" : "t";
      event(fmt::format(R"({{"ph":"{}",{}"name":{},"cat":"{}","id":{},"pid":{},"tid":{},"ts":{}}})", ph,
                        i == 0 ? "" : R"("bp":"e",)", label, f.category, flow_id, f.ranks[i], s->tid,
                        number((s->start_us + s->end_us) / 2)));
    }
  }

  out += "\n],\n";
  out += fmt::format(R"("otherData":{{"lesson":{},"backend":{},"profile":{},"world":{},"makespan_us":{}}}}})",
                     quoted(report.lesson), quoted(report.backend), quoted(report.profile), report.world,
                     number(report.makespan_us));
  out += "\n";
  return out;
}

// ---- Perfetto's protobuf trace ----------------------------------------------------------------------------

namespace {

// Protobuf's wire format, written by hand for the handful of messages a trace needs
// (protos/perfetto/trace/trace.proto, trace_packet.proto, track_event/track_event.proto and
// track_event/track_descriptor.proto of google/perfetto).
class Proto {
 public:
  void varint(int field, std::uint64_t v) {
    key(field, 0);
    raw_varint(v);
  }
  void fixed64(int field, std::uint64_t v) {
    key(field, 1);
    for (int i = 0; i < 8; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void float64(int field, double v) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    fixed64(field, bits);
  }
  void bytes(int field, std::string_view v) {
    key(field, 2);
    raw_varint(v.size());
    out_ += v;
  }
  void message(int field, const Proto& m) { bytes(field, m.out_); }
  const std::string& str() const { return out_; }

 private:
  void key(int field, int wire_type) { raw_varint((static_cast<std::uint64_t>(field) << 3) | wire_type); }
  void raw_varint(std::uint64_t v) {
    while (v >= 0x80) {
      out_ += static_cast<char>((v & 0x7f) | 0x80);
      v >>= 7;
    }
    out_ += static_cast<char>(v);
  }
  std::string out_;
};

// Field numbers, named as the .proto files name them.
namespace pf {
constexpr int kTracePacket = 1;  // Trace.packet
// TracePacket
constexpr int kTimestamp = 8, kSequenceId = 10, kTrackEvent = 11, kInternedData = 12, kSequenceFlags = 13,
              kTrackDescriptor = 60;
constexpr int kIncrementalStateCleared = 1, kNeedsIncrementalState = 2;  // SequenceFlags
// TrackDescriptor, ProcessDescriptor
constexpr int kUuid = 1, kName = 2, kProcess = 3, kParentUuid = 5, kSiblingOrderRank = 12;
constexpr int kPid = 1, kProcessName = 6;
// TrackEvent
constexpr int kCategoryIids = 3, kDebugAnnotations = 4, kType = 9, kNameIid = 10, kTrackUuid = 11,
              kFlowIds = 47, kTerminatingFlowIds = 48;
constexpr int kSliceBegin = 1, kSliceEnd = 2;  // TrackEvent.Type
// DebugAnnotation
constexpr int kDoubleValue = 5, kAnnotationName = 10;
// InternedData and its EventCategory and EventName
constexpr int kEventCategories = 1, kEventNames = 2, kIid = 1, kInternedName = 2;
}  // namespace pf

// The run's track; a rank's tracks are above it.
constexpr std::uint64_t kRunTrack = 1;

// A track's id: rank + 1 above 20 bits (0 is no track), its lane's thread id below them.
std::uint64_t track_uuid(int rank, int tid) {
  return (static_cast<std::uint64_t>(rank) + 1) << 20 | static_cast<std::uint64_t>(tid + 1);
}
std::uint64_t process_uuid(int rank) {
  return (static_cast<std::uint64_t>(rank) + 1) << 20;
}

std::uint64_t ns(double us) {
  return us > 0 && std::isfinite(us) ? static_cast<std::uint64_t>(std::llround(us * 1e3)) : 0;
}

}  // namespace

std::string report_to_perfetto(const RunReport& report) {
  const TraceLayout layout = lay_out(report);
  std::string out;
  constexpr std::uint64_t kSequence = 1;
  auto packet = [&out](const Proto& p) {
    Proto wrapped;
    wrapped.message(pf::kTracePacket, p);
    out += wrapped.str();
  };
  // Names and categories are interned: each text is sent once, then referred to by number.
  std::map<std::string, std::uint64_t, std::less<>> name_iids, category_iids;
  bool first = true;
  auto intern = [](std::map<std::string, std::uint64_t, std::less<>>& table, const std::string& text,
                   Proto& interned, int field) {
    auto [it, inserted] = table.try_emplace(text, table.size() + 1);
    if (inserted) {
      Proto entry;
      entry.varint(pf::kIid, it->second);
      entry.bytes(pf::kInternedName, text);
      interned.message(field, entry);
    }
    return it->second;
  };

  // First the run's own track, which names it (and marks the file as ranklab's: written_by_ranklab).
  {
    Proto run, p;
    run.varint(pf::kUuid, kRunTrack);
    run.bytes(pf::kName,
              fmt::format("ranklab: {} on {}{}, {} rank{}, {}", report.lesson.empty() ? "run" : report.lesson,
                          report.backend, report.profile.empty() ? "" : " (" + report.profile + ")",
                          report.world, report.world == 1 ? "" : "s", human_time(report.makespan_us)));
    p.message(pf::kTrackDescriptor, run);
    packet(p);
  }
  for (const RankTracks& rt : layout.ranks) {
    Proto process, descriptor, p;
    process.varint(pf::kPid, static_cast<std::uint64_t>(rt.rank) + 1);  // pid 0 is the kernel's
    process.bytes(pf::kProcessName, fmt::format("rank {}", rt.rank));
    descriptor.varint(pf::kUuid, process_uuid(rt.rank));
    descriptor.message(pf::kProcess, process);
    p.message(pf::kTrackDescriptor, descriptor);
    packet(p);
    for (int t = 0; t < kTracks; ++t) {
      for (int lane = 0; lane < std::min(rt.lanes[t], kLanes); ++lane) {
        const int tid = t * kLanes + lane;
        Proto track, q;
        track.varint(pf::kUuid, track_uuid(rt.rank, tid));
        track.varint(pf::kParentUuid, process_uuid(rt.rank));
        track.bytes(pf::kName, lane_name(t, lane));
        track.varint(pf::kSiblingOrderRank, static_cast<std::uint64_t>(tid));
        q.message(pf::kTrackDescriptor, track);
        packet(q);
      }
    }
  }

  // Which flows leave or end at each slice.
  std::map<const Slice*, std::vector<std::pair<std::uint64_t, bool>>> flows_at;  // (id, terminating)
  for (std::size_t i = 0; i < layout.flows.size(); ++i) {
    const Flow& f = layout.flows[i];
    for (std::size_t k = 0; k < f.through.size(); ++k)
      flows_at[f.through[k]].push_back({i + 1, k + 1 == f.through.size()});
  }

  for (const RankTracks& rt : layout.ranks) {
    for (int t = 0; t < kTracks; ++t) {
      for (const Slice& s : rt.tracks[t]) {
        const std::uint64_t track = track_uuid(rt.rank, s.tid);
        Proto interned, begin, p;
        begin.varint(pf::kType, pf::kSliceBegin);
        begin.varint(pf::kTrackUuid, track);
        begin.varint(pf::kNameIid, intern(name_iids, slice_name(s), interned, pf::kEventNames));
        begin.varint(pf::kCategoryIids, intern(category_iids, s.category, interned, pf::kEventCategories));
        if (s.hidden_us >= 0) {
          const double exposed_us = std::max(0.0, s.end_us - s.start_us - s.hidden_us);
          for (const auto& [key, value] :
               {std::pair{"hidden_us", s.hidden_us}, std::pair{"exposed_us", exposed_us}}) {
            Proto annotation;
            annotation.bytes(pf::kAnnotationName, key);
            annotation.float64(pf::kDoubleValue, value);
            begin.message(pf::kDebugAnnotations, annotation);
          }
        }
        if (auto it = flows_at.find(&s); it != flows_at.end()) {
          for (const auto& [id, terminating] : it->second)
            begin.fixed64(terminating ? pf::kTerminatingFlowIds : pf::kFlowIds, id);
        }
        p.varint(pf::kTimestamp, ns(s.start_us));
        p.message(pf::kTrackEvent, begin);
        if (!interned.str().empty()) p.message(pf::kInternedData, interned);
        p.varint(pf::kSequenceId, kSequence);
        p.varint(pf::kSequenceFlags, first ? pf::kIncrementalStateCleared | pf::kNeedsIncrementalState
                                           : pf::kNeedsIncrementalState);
        first = false;
        packet(p);
        Proto end, e;
        end.varint(pf::kType, pf::kSliceEnd);
        end.varint(pf::kTrackUuid, track);
        e.varint(pf::kTimestamp, ns(s.end_us));
        e.message(pf::kTrackEvent, end);
        e.varint(pf::kSequenceId, kSequence);
        packet(e);
      }
    }
  }
  return out;
}

}  // namespace ranklab
