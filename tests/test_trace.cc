#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/report.h"
#include "common/trace_writer.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using nlohmann::json;

Span span(int rank, SpanKind kind, double start_us, double end_us, std::string name = "k") {
  return Span{rank, kind, std::move(name), start_us, end_us};
}

// Two ranks: overlapping kernels on rank 0 (they need two lanes), a wait then a transfer, a send from rank 0
// to rank 1, regions, and idle gaps.
RunReport small_report() {
  RunReport r;
  r.lesson = "hand";
  r.backend = "sim";
  r.profile = "dgx-h100";
  r.world = 2;
  r.spans = {
      span(0, SpanKind::Compute, 0, 10, "matmul"),
      span(0, SpanKind::Compute, 5, 12, "relu"),
      span(0, SpanKind::Idle, 12, 14, "all_reduce"),
      span(0, SpanKind::Comm, 14, 20, "all_reduce"),
      span(1, SpanKind::Compute, 0, 14, "matmul"),
      span(1, SpanKind::Comm, 14, 20, "all_reduce"),
      span(0, SpanKind::Comm, 25, 30, "send/recv"),
      span(1, SpanKind::Comm, 25, 30, "send/recv"),
      span(1, SpanKind::Compute, 30, 31, "a \"quoted\"\nname"),
  };
  CollectiveRecord ar;
  ar.op = CommOp::AllReduce;
  ar.group = "world";
  ar.group_size = 2;
  ar.bytes = 1024;
  ar.start_us = 14;
  ar.end_us = 20;
  CollectiveRecord p2p;
  p2p.op = CommOp::Send;
  p2p.group = "rank 0 -> rank 1";
  p2p.group_size = 2;
  p2p.bytes = 4096;
  p2p.start_us = 25;
  p2p.end_us = 30;
  r.collectives = {ar, p2p};
  r.regions = {{0, "step", 0, 30}, {0, "forward", 0, 12}, {1, "step", 0, 31}};
  r.ranks = {RankSummary{0, 32}, RankSummary{1, 31}};
  summarize_spans(r);
  return r;
}

TEST(IdleIntervals, GapsBetweenBusySpans) {
  const RunReport r = small_report();
  const auto idle = idle_intervals(r);
  ASSERT_EQ(idle.size(), 2u);
  // Rank 0 is busy [0,12] (compute), [14,20] and [25,30] (comm); the wait [12,14] is idle; it ends at 32.
  ASSERT_EQ(idle[0].size(), 3u);
  EXPECT_DOUBLE_EQ(idle[0][0].start_us, 12);
  EXPECT_DOUBLE_EQ(idle[0][0].end_us, 14);
  EXPECT_DOUBLE_EQ(idle[0][1].start_us, 20);
  EXPECT_DOUBLE_EQ(idle[0][1].end_us, 25);
  EXPECT_DOUBLE_EQ(idle[0][2].start_us, 30);
  EXPECT_DOUBLE_EQ(idle[0][2].end_us, 32);
  // The total is what the summary calls idle.
  for (int rank = 0; rank < 2; ++rank) {
    double total = 0;
    for (const TimeRange& t : idle[rank]) total += t.end_us - t.start_us;
    EXPECT_DOUBLE_EQ(total, r.ranks[rank].idle_us) << "rank " << rank;
  }
}

struct Slice {
  double ts, dur;
  std::string name, cat;
};

TEST(Trace, ProcessesTracksSlicesAndFlows) {
  const RunReport r = small_report();
  const json trace = json::parse(report_to_trace_json(r));
  ASSERT_TRUE(trace.contains("traceEvents"));
  EXPECT_EQ(trace["otherData"]["lesson"], "hand");

  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<std::pair<int, int>, std::vector<Slice>> slices;
  std::map<int, std::vector<json>> flows;
  for (const json& e : trace["traceEvents"]) {
    const std::string ph = e["ph"];
    const int pid = e["pid"], tid = e["tid"];
    if (ph == "M" && e["name"] == "process_name") processes[pid] = e["args"]["name"];
    if (ph == "M" && e["name"] == "thread_name") threads[{pid, tid}] = e["args"]["name"];
    if (ph == "X") slices[{pid, tid}].push_back({e["ts"], e["dur"], e["name"], e["cat"]});
    if (ph == "s" || ph == "f") flows[e["id"]].push_back(e);
  }
  EXPECT_EQ(processes, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}}));

  std::set<std::string> rank0_tracks;
  for (const auto& [key, name] : threads) {
    if (key.first == 0) rank0_tracks.insert(name);
  }
  // The two overlapping kernels of rank 0 take two compute lanes; the nested regions two region lanes.
  EXPECT_EQ(rank0_tracks,
            (std::set<std::string>{"compute", "compute 2", "comm", "idle", "regions", "regions 2"}));

  // No two slices of one lane overlap, so every viewer draws them as they are.
  std::size_t count = 0;
  double idle0 = 0;
  for (auto& [key, list] : slices) {
    std::sort(list.begin(), list.end(), [](const Slice& a, const Slice& b) { return a.ts < b.ts; });
    for (std::size_t i = 1; i < list.size(); ++i)
      EXPECT_LE(list[i - 1].ts + list[i - 1].dur, list[i].ts + 1e-9);
    for (const Slice& s : list) {
      if (key.first == 0 && s.cat == "idle") idle0 += s.dur;
    }
    count += list.size();
  }
  // 9 spans, 3 regions, and the idle gaps: rank 0 has 3, rank 1 [20,25] and none after its end at 31.
  EXPECT_EQ(count, 9u + 3u + 3u + 1u);
  EXPECT_DOUBLE_EQ(idle0, r.ranks[0].idle_us);

  // The wait is on the comm track, named for what it waited for.
  bool wait_found = false;
  for (const auto& [key, list] : slices) {
    for (const Slice& s : list) wait_found = wait_found || (s.cat == "wait" && s.name == "wait all_reduce");
  }
  EXPECT_TRUE(wait_found);

  // Two arrows: from rank 0's send to rank 1's receive, and through the all_reduce's two transfers; each
  // end inside a comm slice of its rank.
  ASSERT_EQ(flows.size(), 2u);
  std::map<std::string, std::vector<json>> by_category;
  for (const auto& [id, ends] : flows) by_category[ends.front()["cat"]] = ends;
  ASSERT_EQ(by_category.count("p2p"), 1u);
  ASSERT_EQ(by_category.count("collective"), 1u);
  for (const auto& [category, arrow] : by_category) {
    ASSERT_EQ(arrow.size(), 2u);
    EXPECT_EQ(arrow[0]["ph"], "s");
    EXPECT_EQ(arrow[0]["pid"], 0);
    EXPECT_EQ(arrow[1]["ph"], "f");
    EXPECT_EQ(arrow[1]["pid"], 1);
    EXPECT_EQ(arrow[1]["bp"], "e");
    for (const json& end : arrow) {
      const std::vector<Slice>& lane = slices[{end["pid"].get<int>(), end["tid"].get<int>()}];
      const double ts = end["ts"];
      EXPECT_TRUE(std::any_of(lane.begin(), lane.end(), [ts](const Slice& s) {
        return s.cat == "comm" && s.ts <= ts && ts <= s.ts + s.dur;
      })) << end.dump();
    }
  }
  EXPECT_EQ(by_category["collective"][0]["name"], "all_reduce 1024 B");
}

TEST(Trace, EachTransferSaysHowMuchOfItTheKernelsHid) {
  RunReport r = small_report();
  // On rank 1 a transfer [8, 18] beside the kernel [0, 14]: 6 us hidden, 4 exposed. Rank 0's all_reduce
  // [14, 20] runs after its kernels (the lanes [0, 10] and [5, 12]): all exposed.
  r.spans.push_back(span(1, SpanKind::Comm, 8, 18, "reduce_scatter"));
  summarize_spans(r);
  const json trace = json::parse(report_to_trace_json(r));
  std::map<std::pair<int, std::string>, std::pair<double, double>> seen;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ASSERT_EQ(e.contains("args"), e["cat"] == "comm") << e.dump();
    if (e["cat"] == "comm" && e["ts"] != 25)
      seen[{e["pid"].get<int>(), e["name"].get<std::string>()}] = {e["args"]["hidden_us"],
                                                                   e["args"]["exposed_us"]};
  }
  using P = std::pair<double, double>;
  EXPECT_EQ(seen.at({1, "reduce_scatter"}), (P{6, 4}));
  EXPECT_EQ(seen.at({0, "all_reduce"}), (P{0, 6}));
  EXPECT_EQ(seen.at({1, "all_reduce"}), (P{0, 6}));
}

TEST(Trace, EmptyReportIsValidJson) {
  const json trace = json::parse(report_to_trace_json(RunReport{}));
  EXPECT_TRUE(trace["traceEvents"].is_array());
}

// A pipeline's pattern: each rank computes, then hands its activations to the next one.
void relay(Rank& r) {
  Tensor x = r.phantom({256, 256});
  for (int step = 0; step < 3; ++step) {
    if (r.rank() > 0) r.recv(x, r.rank() - 1);
    x = r.relu(r.matmul(x, x));
    if (r.rank() + 1 < r.world_size()) r.send(x, r.rank() + 1);
  }
  r.synchronize();
}

TEST(Trace, SimulatedSendsHaveArrows) {
  SimBackend backend(testing::quiet_config());
  const RunReport r = backend.launch(4, relay);
  const json trace = json::parse(report_to_trace_json(r));
  std::set<int> pids;
  std::map<int, std::pair<int, int>> arrows;  // id -> (from rank, to rank)
  for (const json& e : trace["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    if (e["ph"] == "s") arrows[e["id"]].first = e["pid"];
    if (e["ph"] == "f") arrows[e["id"]].second = e["pid"];
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1, 2, 3}));
  int p2p = 0;
  for (const CollectiveRecord& c : r.collectives) p2p += c.op == CommOp::Send;
  EXPECT_EQ(p2p, 3 * 3);
  ASSERT_EQ(arrows.size(), static_cast<std::size_t>(p2p));
  for (const auto& [id, ends] : arrows) EXPECT_EQ(ends.second, ends.first + 1) << "arrow " << id;
}

// ---- Perfetto's protobuf trace ----------------------------------------------------------------------------

// Protobuf's wire format read back: each field of a message as (number, varint or bytes).
struct Field {
  int number;
  std::uint64_t value = 0;  // varint and fixed64
  std::string bytes;        // length-delimited
};

std::vector<Field> decode(std::string_view m) {
  std::vector<Field> out;
  std::size_t i = 0;
  auto varint = [&] {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (i >= m.size()) throw std::runtime_error("truncated varint");
      const auto byte = static_cast<unsigned char>(m[i++]);
      v |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return v;
    }
  };
  while (i < m.size()) {
    const std::uint64_t key = varint();
    Field f{static_cast<int>(key >> 3), 0, {}};
    switch (key & 7) {
      case 0:
        f.value = varint();
        break;
      case 1:
        if (i + 8 > m.size()) throw std::runtime_error("truncated fixed64");
        std::memcpy(&f.value, m.data() + i, 8);
        i += 8;
        break;
      case 2: {
        const std::uint64_t n = varint();
        if (i + n > m.size()) throw std::runtime_error("truncated bytes");
        f.bytes = std::string(m.substr(i, n));
        i += n;
        break;
      }
      default:
        throw std::runtime_error("unexpected wire type");
    }
    out.push_back(std::move(f));
  }
  return out;
}

// A slice as both traces describe it: its rank's process, its track, its name and category, and its times in
// nanoseconds.
using TraceSlice = std::tuple<std::string, std::string, std::string, std::string, std::int64_t, std::int64_t>;
struct Decoded {
  std::multiset<TraceSlice> slices;
  std::multiset<std::vector<std::pair<std::string, std::string>>> flows;  // (process, track) along each arrow
  std::map<std::string, double> annotations;                              // "process/name/key" -> value
};

Decoded from_perfetto(const std::string& trace) {
  struct Track {
    std::string name;
    std::uint64_t parent = 0;
  };
  std::map<std::uint64_t, Track> tracks;
  std::map<std::uint64_t, std::string> names, categories;
  std::map<std::uint64_t, std::vector<std::pair<TraceSlice, std::vector<std::uint64_t>>>> open;  // per track
  std::map<std::uint64_t, std::vector<std::pair<std::string, std::string>>> flows;
  Decoded out;
  auto where = [&](std::uint64_t uuid) {
    return std::pair{tracks.at(tracks.at(uuid).parent).name, tracks.at(uuid).name};
  };
  for (const Field& packet : decode(trace)) {
    EXPECT_EQ(packet.number, 1);
    std::uint64_t ts = 0;
    std::vector<Field> event;
    for (const Field& f : decode(packet.bytes)) {
      if (f.number == 8) ts = f.value;
      if (f.number == 11) event = decode(f.bytes);
      if (f.number == 12) {
        for (const Field& entry : decode(f.bytes)) {
          std::uint64_t iid = 0;
          std::string text;
          for (const Field& g : decode(entry.bytes)) (g.number == 1 ? iid = g.value : (text = g.bytes, 0));
          (entry.number == 2 ? names : categories)[iid] = text;
        }
      }
      if (f.number == 60) {
        Track t;
        std::uint64_t uuid = 0;
        for (const Field& g : decode(f.bytes)) {
          if (g.number == 1) uuid = g.value;
          if (g.number == 2) t.name = g.bytes;
          if (g.number == 5) t.parent = g.value;
          if (g.number == 3) {
            for (const Field& h : decode(g.bytes)) {
              if (h.number == 6) t.name = h.bytes;
            }
          }
        }
        tracks[uuid] = t;
      }
    }
    if (event.empty()) continue;
    std::uint64_t type = 0, track = 0, name = 0, category = 0;
    std::vector<std::uint64_t> flow_ids;
    std::map<std::string, double> annotations;
    for (const Field& f : event) {
      if (f.number == 9) type = f.value;
      if (f.number == 11) track = f.value;
      if (f.number == 10) name = f.value;
      if (f.number == 3) category = f.value;
      if (f.number == 47 || f.number == 48) flow_ids.push_back(f.value);
      if (f.number == 4) {
        std::string key;
        double value = 0;
        for (const Field& g : decode(f.bytes)) {
          if (g.number == 10) key = g.bytes;
          if (g.number == 5) std::memcpy(&value, &g.value, sizeof value);
        }
        annotations[key] = value;
      }
    }
    const auto [process, track_name] = where(track);
    if (type == 1) {
      TraceSlice s{
          process, track_name, names.at(name), categories.at(category), static_cast<std::int64_t>(ts), 0};
      for (const auto& [key, value] : annotations)
        out.annotations[process + "/" + names.at(name) + "/" + key] = value;
      for (std::uint64_t id : flow_ids) flows[id].push_back({process, track_name});
      open[track].push_back({s, flow_ids});
    } else {
      EXPECT_EQ(type, 2u);
      EXPECT_FALSE(open[track].empty());
      TraceSlice s = open[track].back().first;
      std::get<5>(s) = static_cast<std::int64_t>(ts);
      open[track].pop_back();
      out.slices.insert(s);
    }
  }
  for (const auto& [track, still] : open) EXPECT_TRUE(still.empty()) << "a slice never ended";
  for (const auto& [id, path] : flows) out.flows.insert(path);
  return out;
}

Decoded from_json(const std::string& text) {
  const json trace = json::parse(text);
  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<int, std::vector<std::pair<std::string, std::string>>> flows;
  Decoded out;
  for (const json& e : trace["traceEvents"]) {
    const int pid = e["pid"], tid = e["tid"];
    if (e["ph"] == "M" && e["name"] == "process_name") processes[pid] = e["args"]["name"];
    if (e["ph"] == "M" && e["name"] == "thread_name") threads[{pid, tid}] = e["args"]["name"];
  }
  auto ns = [](double us) { return static_cast<std::int64_t>(std::llround(us * 1e3)); };
  for (const json& e : trace["traceEvents"]) {
    const int pid = e["pid"], tid = e["tid"];
    if (e["ph"] == "X") {
      out.slices.insert({processes.at(pid), threads.at({pid, tid}), e["name"], e["cat"], ns(e["ts"]),
                         ns(e["ts"].get<double>() + e["dur"].get<double>())});
      if (e.contains("args")) {
        for (const auto& [key, value] : e["args"].items())
          out.annotations[processes.at(pid) + "/" + e["name"].get<std::string>() + "/" + key] = value;
      }
    }
    if (e["ph"] == "s" || e["ph"] == "t" || e["ph"] == "f")
      flows[e["id"]].push_back({processes.at(pid), threads.at({pid, tid})});
  }
  for (const auto& [id, path] : flows) out.flows.insert(path);
  return out;
}

void expect_same_trace(const RunReport& r) {
  const Decoded proto = from_perfetto(report_to_perfetto(r)), json_trace = from_json(report_to_trace_json(r));
  EXPECT_FALSE(proto.slices.empty());
  EXPECT_EQ(proto.slices, json_trace.slices);
  EXPECT_EQ(proto.flows, json_trace.flows);
  EXPECT_EQ(proto.annotations, json_trace.annotations);
}

TEST(PerfettoTrace, HoldsTheTracksSlicesAndArrowsOfTheJsonTrace) {
  RunReport r = small_report();
  r.pipeline = {{0, 0, 0, 3, true, 0, 9}, {1, 1, 0, 3, true, 9, 14}};
  expect_same_trace(r);
  const Decoded d = from_perfetto(report_to_perfetto(r));
  EXPECT_EQ(d.flows.size(), 2u);
  EXPECT_EQ(d.slices.count({"rank 1", "pipeline", "forward mb 3", "pipeline", 9000, 14000}), 1u);
}

TEST(PerfettoTrace, OfASimulatedRunAndOfItsTracedRanksOnly) {
  SimBackend backend(testing::quiet_config());
  RunReport r = backend.launch(4, relay);
  expect_same_trace(r);
  r.traced_ranks = {1, 2};
  expect_same_trace(r);
  std::set<std::string> processes;
  for (const TraceSlice& s : from_perfetto(report_to_perfetto(r)).slices) processes.insert(std::get<0>(s));
  EXPECT_EQ(processes, (std::set<std::string>{"rank 1", "rank 2"}));
}

TEST(PerfettoTrace, IsSmallerThanTheJson) {
  SimBackend backend(testing::quiet_config());
  const RunReport r = backend.launch(4, relay);
  EXPECT_LT(3 * report_to_perfetto(r).size(), report_to_trace_json(r).size());
}

}  // namespace
}  // namespace ranklab
