#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/report.h"

namespace ranklab {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

Span span(int rank, SpanKind kind, double start_us, double end_us, std::string name = "k") {
  Span s;
  s.rank = rank;
  s.kind = kind;
  s.name = std::move(name);
  s.start_us = start_us;
  s.end_us = end_us;
  return s;
}

TEST(BusFactor, MatchesNcclTests) {
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::AllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::AllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::AllReduce, 1), 0.0);
  for (CommOp op :
       {CommOp::ReduceScatter, CommOp::AllGather, CommOp::AllToAll, CommOp::Scatter, CommOp::Gather}) {
    SCOPED_TRACE(comm_op_name(op));
    EXPECT_DOUBLE_EQ(bus_factor(op, 4), 0.75);
    EXPECT_DOUBLE_EQ(bus_factor(op, 8), 0.875);
  }
  for (CommOp op : {CommOp::Broadcast, CommOp::Reduce, CommOp::Send, CommOp::Recv}) {
    SCOPED_TRACE(comm_op_name(op));
    EXPECT_DOUBLE_EQ(bus_factor(op, 8), 1.0);
    EXPECT_DOUBLE_EQ(bus_factor(op, 2), 1.0);
  }
  EXPECT_DOUBLE_EQ(bus_factor(CommOp::Barrier, 8), 0.0);
  EXPECT_THROW(bus_factor(CommOp::AllReduce, 0), UsageError);
}

TEST(SpanKind, Names) {
  EXPECT_STREQ(span_kind_name(SpanKind::Compute), "compute");
  EXPECT_STREQ(span_kind_name(SpanKind::Comm), "comm");
  EXPECT_STREQ(span_kind_name(SpanKind::Idle), "idle");
}

TEST(RunReport, ChecksAndTraffic) {
  RunReport r;
  EXPECT_TRUE(r.all_checks_passed());  // nothing checked, nothing failed
  EXPECT_EQ(r.total_link_bytes(), 0);
  r.checks.push_back({0, "a", true, ""});
  r.checks.push_back({1, "a", true, ""});
  EXPECT_TRUE(r.all_checks_passed());
  r.checks.push_back({1, "b", false, "off by one"});
  EXPECT_FALSE(r.all_checks_passed());
  r.links.push_back({"nvlink gpu0->gpu1", "nvlink", 1000});
  r.links.push_back({"ib node0->node1", "network", std::int64_t{1} << 40});
  EXPECT_EQ(r.total_link_bytes(), 1000 + (std::int64_t{1} << 40));
}

TEST(RunReport, LateStartsAreSaidAndKept) {
  RunReport r;
  r.world = 1;
  EXPECT_EQ(format_summary(r).find("started in the simulator's past"), std::string::npos);
  r.late_starts = 3;
  EXPECT_NE(format_summary(r).find("3 transfers started in the simulator's past"), std::string::npos);
  EXPECT_EQ(report_from_json(report_to_json(r)).late_starts, 3);
}

TEST(SummarizeSpans, OverlapsByHand) {
  RunReport r;
  r.world = 3;
  // Rank 0 (end set by the backend to 50):
  //   compute [0,10] [5,15] [20,30]        -> union [0,15] [20,30]          = 25
  //   comm    [12,22] [25,40]              -> union                          = 25
  //   compute ∩ comm: [12,15] [20,22] [25,30]                                = 10
  //   exposed comm = 25 - 10 = 15; busy = 25 + 25 - 10 = 40; idle = 50 - 40 = 10
  //   waits [40,45] [45,47]                                                   = 7
  //   plus an empty span and a reversed one, which cover nothing.
  // Rank 1 (end not set: taken from its latest span, 9):
  //   compute [0,4]; comm [4,6]; wait [6,9] -> busy 6, exposed 2, idle 3, wait 3
  // Rank 2: no spans at all.
  r.spans = {
      span(0, SpanKind::Comm, 25, 40),    span(0, SpanKind::Compute, 20, 30),
      span(1, SpanKind::Idle, 6, 9),      span(0, SpanKind::Compute, 5, 15),
      span(0, SpanKind::Idle, 40, 45),    span(0, SpanKind::Compute, 0, 10),
      span(1, SpanKind::Comm, 4, 6),      span(0, SpanKind::Comm, 12, 22),
      span(0, SpanKind::Idle, 45, 47),    span(1, SpanKind::Compute, 0, 4),
      span(0, SpanKind::Compute, 33, 33), span(0, SpanKind::Comm, 48, 42),
  };
  // The backend filled rank 1's memory and rank 0's end, out of order; both must survive.
  RankSummary r1;
  r1.rank = 1;
  r1.peak_bytes = 123;
  r1.capacity_bytes = 1000;
  RankSummary r0;
  r0.rank = 0;
  r0.end_us = 50;
  r.ranks = {r1, r0};

  summarize_spans(r);

  ASSERT_EQ(r.ranks.size(), 3u);
  const RankSummary& a = r.ranks[0];
  EXPECT_EQ(a.rank, 0);
  EXPECT_DOUBLE_EQ(a.end_us, 50);
  EXPECT_DOUBLE_EQ(a.compute_us, 25);
  EXPECT_DOUBLE_EQ(a.comm_us, 25);
  EXPECT_DOUBLE_EQ(a.exposed_comm_us, 15);
  EXPECT_DOUBLE_EQ(a.comm_wait_us, 7);
  EXPECT_DOUBLE_EQ(a.idle_us, 10);

  const RankSummary& b = r.ranks[1];
  EXPECT_EQ(b.rank, 1);
  EXPECT_DOUBLE_EQ(b.end_us, 9);
  EXPECT_DOUBLE_EQ(b.compute_us, 4);
  EXPECT_DOUBLE_EQ(b.comm_us, 2);
  EXPECT_DOUBLE_EQ(b.exposed_comm_us, 2);
  EXPECT_DOUBLE_EQ(b.comm_wait_us, 3);
  EXPECT_DOUBLE_EQ(b.idle_us, 3);
  EXPECT_EQ(b.peak_bytes, 123);
  EXPECT_EQ(b.capacity_bytes, 1000);

  const RankSummary& c = r.ranks[2];
  EXPECT_EQ(c.rank, 2);
  EXPECT_DOUBLE_EQ(c.end_us, 0);
  EXPECT_DOUBLE_EQ(c.compute_us, 0);
  EXPECT_DOUBLE_EQ(c.idle_us, 0);

  EXPECT_DOUBLE_EQ(r.makespan_us, 50);  // was 0, so it is the latest end
}

TEST(SummarizeSpans, CommFullyHiddenAndNested) {
  RunReport r;
  r.world = 1;
  // One long compute kernel hides two comm spans, one nested in the other: no exposed comm.
  r.spans = {span(0, SpanKind::Compute, 0, 100), span(0, SpanKind::Comm, 10, 60),
             span(0, SpanKind::Comm, 20, 30), span(0, SpanKind::Comm, 60, 90)};
  r.makespan_us = 123;  // set by the backend: kept
  summarize_spans(r);
  ASSERT_EQ(r.ranks.size(), 1u);
  EXPECT_DOUBLE_EQ(r.ranks[0].compute_us, 100);
  EXPECT_DOUBLE_EQ(r.ranks[0].comm_us, 80);
  EXPECT_DOUBLE_EQ(r.ranks[0].exposed_comm_us, 0);
  EXPECT_DOUBLE_EQ(r.ranks[0].idle_us, 0);
  EXPECT_DOUBLE_EQ(r.makespan_us, 123);
}

TEST(SummarizeSpans, RejectsNegativeRank) {
  RunReport r;
  r.spans = {span(-1, SpanKind::Compute, 0, 1)};
  EXPECT_THROW(summarize_spans(r), UsageError);
}

TEST(SummarizeSpans, MillionsOfSpansStayFast) {
  // Half-overlapping compute and comm, shuffled: an O(n^2) pass would not finish within the test timeout.
  constexpr int kN = 1'000'000;
  RunReport r;
  r.world = 1;
  r.spans.reserve(2 * kN);
  for (int i = 0; i < kN; ++i) {
    r.spans.push_back(span(0, SpanKind::Compute, 2.0 * i, 2.0 * i + 1));
    r.spans.push_back(span(0, SpanKind::Comm, 2.0 * i + 0.5, 2.0 * i + 1.5));
  }
  std::shuffle(r.spans.begin(), r.spans.end(), std::mt19937(42));
  summarize_spans(r);
  const RankSummary& s = r.ranks.at(0);
  EXPECT_NEAR(s.compute_us, kN, 1e-6);
  EXPECT_NEAR(s.comm_us, kN, 1e-6);
  EXPECT_NEAR(s.exposed_comm_us, 0.5 * kN, 1e-6);
  EXPECT_DOUBLE_EQ(s.end_us, 2.0 * kN - 0.5);
  EXPECT_NEAR(s.idle_us, (2.0 * kN - 0.5) - 1.5 * kN, 1e-6);
}

RunReport sample_report() {
  RunReport r;
  r.lesson = "data_parallel";
  r.backend = "sim";
  r.profile = "dgx-h100";
  r.world = 2;
  r.makespan_us = 1500.25;
  RankSummary a;
  a.rank = 0;
  a.end_us = 1500.25;
  a.compute_us = 800.5;
  a.comm_us = 300.12;
  a.comm_wait_us = 12.0625;
  a.exposed_comm_us = 50.76;
  a.idle_us = 649;
  a.peak_bytes = std::int64_t{1} << 30;
  a.capacity_bytes = std::int64_t{80} << 30;
  RankSummary b = a;
  b.rank = 1;
  b.end_us = 1400.1;
  b.idle_us = 0.1;
  r.ranks = {a, b};
  r.spans = {span(0, SpanKind::Compute, 0.1, 800.6, "matmul"),
             span(1, SpanKind::Idle, 3, 4, "all_reduce wait"),
             span(1, SpanKind::Comm, 4, 5, "all_reduce \"quoted\" \\ \u00e9")};
  CollectiveRecord c;
  c.op = CommOp::AllReduce;
  c.group = "world";
  c.group_size = 4;
  c.bytes = std::int64_t{64} << 20;
  c.algorithm = "ring";
  c.start_us = 0;
  c.end_us = 1000;
  c.algbw_gbps = 67.108864;
  c.busbw_gbps = 100.663296;
  CollectiveRecord d = c;
  d.start_us = 2000;
  d.end_us = 5000;
  CollectiveRecord e = c;
  e.op = CommOp::AllToAll;
  e.group = "group 2 {0, 1}";
  e.group_size = 2;
  e.bytes = 1536;
  e.algorithm = "pairwise";
  e.start_us = 10;
  e.end_us = 10.5;
  r.collectives = {c, d, e};
  r.regions = {{0, "forward", 0, 700}, {1, "backward", 700, 1400.5}};
  r.checks = {{0, "params equal single-device", true, ""},
              {1, "params equal single-device", true, ""},
              {0, "loss finite", true, ""},
              {1, "loss finite", false, "loss is nan at step 3"}};
  r.links = {{"nvlink gpu0->gpu1", "nvlink", 3 << 20},
             {"nvlink gpu1->gpu0", "nvlink", 1 << 20},
             {"ib node0->node1", "network", 512}};
  r.topology.nodes = {{"gpu0", "gpu", 4, 0, 0}, {"gpu1", "gpu", 4, 1, 1}, {"spine0", "spine", 0, -1, -1}};
  r.topology.links = {{"gpu0->gpu1", "gpu0", "gpu1", "nvlink", 450},
                      {"gpu1->spine0", "gpu1", "spine0", "network", 0}};
  r.output = {"step 0 loss 2.3", "line with \"quotes\" and a tab\t"};
  return r;
}

TEST(ReportJson, RoundTripKeepsEveryField) {
  RunReport r = sample_report();
  r.gpus_per_node = 8;
  r.options = {{"steps", "3"}, {"lr", "0.01"}};
  r.late_starts = 7;
  r.collectives[2].bookkeeping = true;
  r.links[0].bandwidth_gbps = 450;
  std::string text = report_to_json(r);
  // Fields come in declaration order, the version first, so a person reading the file sees it at once.
  EXPECT_EQ(text.rfind("{\"schema_version\":1,\"lesson\":\"data_parallel\",", 0), 0u) << text.substr(0, 200);
  RunReport back = report_from_json(text);

  EXPECT_EQ(back.lesson, r.lesson);
  EXPECT_EQ(back.backend, r.backend);
  EXPECT_EQ(back.profile, r.profile);
  EXPECT_EQ(back.world, r.world);
  EXPECT_EQ(back.gpus_per_node, r.gpus_per_node);
  EXPECT_EQ(back.options, r.options);
  EXPECT_EQ(back.makespan_us, r.makespan_us);
  EXPECT_EQ(back.late_starts, r.late_starts);
  ASSERT_EQ(back.ranks.size(), r.ranks.size());
  for (std::size_t i = 0; i < r.ranks.size(); ++i) {
    const RankSummary &x = r.ranks[i], &y = back.ranks[i];
    EXPECT_EQ(y.rank, x.rank);
    EXPECT_EQ(y.end_us, x.end_us);  // exact: doubles must survive the text form bit for bit
    EXPECT_EQ(y.compute_us, x.compute_us);
    EXPECT_EQ(y.comm_us, x.comm_us);
    EXPECT_EQ(y.comm_wait_us, x.comm_wait_us);
    EXPECT_EQ(y.exposed_comm_us, x.exposed_comm_us);
    EXPECT_EQ(y.idle_us, x.idle_us);
    EXPECT_EQ(y.peak_bytes, x.peak_bytes);
    EXPECT_EQ(y.capacity_bytes, x.capacity_bytes);
  }
  ASSERT_EQ(back.spans.size(), r.spans.size());
  for (std::size_t i = 0; i < r.spans.size(); ++i) {
    EXPECT_EQ(back.spans[i].rank, r.spans[i].rank);
    EXPECT_EQ(back.spans[i].kind, r.spans[i].kind);
    EXPECT_EQ(back.spans[i].name, r.spans[i].name);
    EXPECT_EQ(back.spans[i].start_us, r.spans[i].start_us);
    EXPECT_EQ(back.spans[i].end_us, r.spans[i].end_us);
  }
  ASSERT_EQ(back.collectives.size(), r.collectives.size());
  for (std::size_t i = 0; i < r.collectives.size(); ++i) {
    const CollectiveRecord &x = r.collectives[i], &y = back.collectives[i];
    EXPECT_EQ(y.op, x.op);
    EXPECT_EQ(y.group, x.group);
    EXPECT_EQ(y.group_size, x.group_size);
    EXPECT_EQ(y.bytes, x.bytes);
    EXPECT_EQ(y.algorithm, x.algorithm);
    EXPECT_EQ(y.start_us, x.start_us);
    EXPECT_EQ(y.end_us, x.end_us);
    EXPECT_EQ(y.algbw_gbps, x.algbw_gbps);
    EXPECT_EQ(y.busbw_gbps, x.busbw_gbps);
    EXPECT_EQ(y.bookkeeping, x.bookkeeping);
  }
  ASSERT_EQ(back.regions.size(), r.regions.size());
  for (std::size_t i = 0; i < r.regions.size(); ++i) {
    EXPECT_EQ(back.regions[i].rank, r.regions[i].rank);
    EXPECT_EQ(back.regions[i].name, r.regions[i].name);
    EXPECT_EQ(back.regions[i].start_us, r.regions[i].start_us);
    EXPECT_EQ(back.regions[i].end_us, r.regions[i].end_us);
  }
  ASSERT_EQ(back.checks.size(), r.checks.size());
  for (std::size_t i = 0; i < r.checks.size(); ++i) {
    EXPECT_EQ(back.checks[i].rank, r.checks[i].rank);
    EXPECT_EQ(back.checks[i].what, r.checks[i].what);
    EXPECT_EQ(back.checks[i].passed, r.checks[i].passed);
    EXPECT_EQ(back.checks[i].detail, r.checks[i].detail);
  }
  ASSERT_EQ(back.links.size(), r.links.size());
  for (std::size_t i = 0; i < r.links.size(); ++i) {
    EXPECT_EQ(back.links[i].link, r.links[i].link);
    EXPECT_EQ(back.links[i].tier, r.links[i].tier);
    EXPECT_EQ(back.links[i].bytes, r.links[i].bytes);
    EXPECT_EQ(back.links[i].bandwidth_gbps, r.links[i].bandwidth_gbps);
  }
  ASSERT_EQ(back.topology.nodes.size(), r.topology.nodes.size());
  for (std::size_t i = 0; i < r.topology.nodes.size(); ++i) {
    const TopologyNode &x = r.topology.nodes[i], &y = back.topology.nodes[i];
    EXPECT_EQ(y.id, x.id);
    EXPECT_EQ(y.kind, x.kind);
    EXPECT_EQ(y.level, x.level);
    EXPECT_EQ(y.host, x.host);
    EXPECT_EQ(y.rank, x.rank);
  }
  ASSERT_EQ(back.topology.links.size(), r.topology.links.size());
  for (std::size_t i = 0; i < r.topology.links.size(); ++i) {
    const TopologyLink &x = r.topology.links[i], &y = back.topology.links[i];
    EXPECT_EQ(y.id, x.id);
    EXPECT_EQ(y.from, x.from);
    EXPECT_EQ(y.to, x.to);
    EXPECT_EQ(y.tier, x.tier);
    EXPECT_EQ(y.bandwidth_gbps, x.bandwidth_gbps);
  }
  EXPECT_EQ(back.output, r.output);

  // Writing what was read gives the same text: nothing was lost or reordered.
  EXPECT_EQ(report_to_json(back), text);
}

TEST(ReportJson, WrittenMemberByMemberAsOneDocumentWouldBe) {
  // report_to_json appends each span's text as it goes; the text is what dumping the whole document gives.
  RunReport r = sample_report();
  r.output.push_back("bad \xff byte");
  const std::string text = report_to_json(r);
  EXPECT_EQ(nlohmann::ordered_json::parse(text).dump(), text);
}

TEST(ReportJson, StreamedAsItIsMadeTheSameText) {
  // Megabytes of spans: written to the stream a megabyte at a time, between spans.
  RunReport r = sample_report();
  for (int i = 0; i < 60000; ++i) r.spans.push_back({i % 2, SpanKind::Compute, "matmul", 1.0 * i, i + 0.5});
  std::ostringstream streamed;
  write_report_json(r, streamed);
  const std::string whole = report_to_json(r);
  EXPECT_GT(whole.size(), 3u << 20);
  EXPECT_EQ(streamed.str(), whole);
}

TEST(ReportJson, ALinksIdIsWrittenOnlyWhereItIsNotFromTo) {
  RunReport r = sample_report();
  r.topology.links = {{"gpu0->gpu1", "gpu0", "gpu1", "nvlink", 450},
                      {"rail 3", "nic3", "leaf0", "network", 50}};
  const std::string text = report_to_json(r);
  EXPECT_EQ(text.find("\"id\":\"gpu0->gpu1\""), std::string::npos);
  EXPECT_NE(text.find("\"id\":\"rail 3\""), std::string::npos);
  const RunReport back = report_from_json(text);
  ASSERT_EQ(back.topology.links.size(), 2u);
  EXPECT_EQ(back.topology.links[0].id, "gpu0->gpu1");
  EXPECT_EQ(back.topology.links[1].id, "rail 3");
  EXPECT_EQ(report_to_json(back), text);
}

TEST(ReportJson, EveryCommOpAndSpanKindRoundTrips) {
  RunReport r;
  for (int i = 0; i <= static_cast<int>(CommOp::Barrier); ++i) {
    CollectiveRecord c;
    c.op = static_cast<CommOp>(i);
    r.collectives.push_back(c);
  }
  for (SpanKind k : {SpanKind::Compute, SpanKind::Comm, SpanKind::Idle}) r.spans.push_back(span(0, k, 0, 1));
  RunReport back = report_from_json(report_to_json(r));
  ASSERT_EQ(back.collectives.size(), r.collectives.size());
  for (std::size_t i = 0; i < r.collectives.size(); ++i)
    EXPECT_EQ(back.collectives[i].op, r.collectives[i].op);
  ASSERT_EQ(back.spans.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(back.spans[i].kind, r.spans[i].kind);
}

TrainingStats sample_training();

std::string message_of(const std::string& text) {
  try {
    report_from_json(text);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

// The sample report's JSON with `edit` applied to it, as text.
template <class Edit>
std::string edited(Edit edit) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(report_to_json(sample_report()));
  edit(j);
  return j.dump();
}

TEST(ReportJson, RejectsWhatItCannotRead) {
  EXPECT_EQ(message_of("not json"), "report JSON: not valid JSON");
  EXPECT_EQ(message_of("[1, 2]"), "report JSON: expected an object, got an array");
  EXPECT_TRUE(contains(message_of(R"({"lesson": "x"})"), "no schema_version"));
  EXPECT_EQ(message_of(R"({"schema_version": 2})"),
            "report JSON: schema_version: 2 is not the version this build reads (1)");
  // A schema version of 2^32 + 1 is not 1.
  EXPECT_TRUE(contains(message_of(R"({"schema_version": 4294967297})"), "schema_version: 4294967297"));

  // The document's name leads the message when the caller gives it.
  try {
    report_from_json(edited([](auto& j) { j["ranks"][1]["peak_bytes"] = "1 GiB"; }), "runs/a/report.json");
    ADD_FAILURE() << "a string for an integer was read";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "runs/a/report.json: ranks[1].peak_bytes: expected an integer, got a string (\"1 GiB\")");
  }
}

TEST(ReportJson, AValueOfTheWrongTypeIsNamedByItsPath) {
  EXPECT_EQ(message_of(edited([](auto& j) { j["world"] = "four"; })),
            "report JSON: world: expected an integer, got a string (\"four\")");
  EXPECT_EQ(message_of(edited([](auto& j) { j["ranks"] = nlohmann::ordered_json::object(); })),
            "report JSON: ranks: expected an array, got an object");
  EXPECT_EQ(message_of(edited([](auto& j) { j["ranks"][1] = 3; })),
            "report JSON: ranks[1]: expected an object, got 3");
  EXPECT_EQ(message_of(edited([](auto& j) { j["spans"][2]["start_us"] = "soon"; })),
            "report JSON: spans[2].start_us: expected a number, got a string (\"soon\")");
  EXPECT_EQ(message_of(edited([](auto& j) { j["checks"][0]["passed"] = 1; })),
            "report JSON: checks[0].passed: expected true or false, got 1");
  EXPECT_EQ(message_of(edited([](auto& j) { j["regions"][1]["name"] = nullptr; })),
            "report JSON: regions[1].name: expected a string, got null");
  EXPECT_EQ(message_of(edited([](auto& j) { j["options"]["steps"] = 3; })),
            "report JSON: options.steps: expected a string, got 3");
  EXPECT_EQ(message_of(edited([](auto& j) { j["topology"]["nodes"][1]["level"] = "top"; })),
            "report JSON: topology.nodes[1].level: expected an integer, got a string (\"top\")");
  EXPECT_EQ(message_of(edited([](auto& j) { j["topology"] = nlohmann::ordered_json::array(); })),
            "report JSON: topology: expected an object, got an array");
  EXPECT_EQ(message_of(edited([](auto& j) { j["output"][1] = false; })),
            "report JSON: output[1]: expected a string, got a boolean (false)");
  // Names that must be one of a set say which.
  std::string msg = message_of(edited([](auto& j) { j["collectives"][1]["op"] = "all_reduce_x"; }));
  EXPECT_TRUE(contains(msg, "report JSON: collectives[1].op: expected one of \"broadcast\", ")) << msg;
  EXPECT_TRUE(contains(msg, "got a string (\"all_reduce_x\")")) << msg;
  msg = message_of(edited([](auto& j) { j["spans"][0]["kind"] = "busy"; }));
  EXPECT_EQ(
      msg,
      "report JSON: spans[0].kind: expected one of \"compute\", \"comm\", \"idle\", got a string (\"busy\")");
}

TEST(ReportJson, IntegersAreNeverTruncated) {
  // nlohmann alone would read 4294967300 into an int as 4, and 2.5 as 2.
  EXPECT_EQ(message_of(edited([](auto& j) { j["world"] = 4294967300; })),
            "report JSON: world: expected an integer from -2147483648 to 2147483647, got 4294967300");
  EXPECT_EQ(message_of(edited([](auto& j) { j["world"] = 2.5; })),
            "report JSON: world: expected an integer, got 2.5");
  EXPECT_EQ(message_of(edited([](auto& j) { j["world"] = -2147483649LL; })),
            "report JSON: world: expected an integer from -2147483648 to 2147483647, got -2147483649");
  EXPECT_EQ(
      message_of(edited([](auto& j) { j["world"] = std::numeric_limits<std::uint64_t>::max(); })),
      "report JSON: world: expected an integer from -2147483648 to 2147483647, got 18446744073709551615");
  EXPECT_EQ(message_of(edited([](auto& j) { j["spans"][0]["rank"] = 4294967296; })),
            "report JSON: spans[0].rank: expected an integer from -2147483648 to 2147483647, got 4294967296");
  EXPECT_EQ(message_of(edited([](auto& j) { j["ranks"][0]["peak_bytes"] = std::uint64_t{1} << 63; })),
            "report JSON: ranks[0].peak_bytes: expected an integer from -9223372036854775808 to "
            "9223372036854775807, "
            "got 9223372036854775808");
  // The edges of a field's range are read exactly.
  RunReport r = report_from_json(edited([](auto& j) {
    j["world"] = 2147483647;
    j["ranks"][0]["peak_bytes"] = std::numeric_limits<std::int64_t>::max();
    j["ranks"][1]["peak_bytes"] = std::numeric_limits<std::int64_t>::min();
  }));
  EXPECT_EQ(r.world, 2147483647);
  EXPECT_EQ(r.ranks[0].peak_bytes, std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(r.ranks[1].peak_bytes, std::numeric_limits<std::int64_t>::min());
}

// Visits every member of every object in `j` (arrays' elements included), with its path as the reader
// names it and a way to remove it from a copy of the whole document.
template <class Visit>
void each_member(const nlohmann::ordered_json& j, const std::string& path,
                 const nlohmann::json::json_pointer& at, Visit&& visit) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string sub = path.empty() ? it.key() : path + "." + it.key();
      visit(sub, at / it.key());
      each_member(it.value(), sub, at / it.key(), visit);
    }
  } else if (j.is_array()) {
    for (std::size_t i = 0; i < j.size(); ++i)
      each_member(j[i], fmt::format("{}[{}]", path, i), at / i, visit);
  }
}

TEST(ReportJson, AMirrorIsWrittenAsTheRankItMirrors) {
  RunReport r = sample_report();
  RankSummary mirror = r.ranks[0];
  mirror.rank = 2, mirror.mirror_of = 0;
  r.ranks.push_back(mirror);
  r.world = 3;
  const std::string text = report_to_json(r);
  EXPECT_NE(text.find("{\"rank\":2,\"mirror_of\":0}"), std::string::npos);
  const RunReport back = report_from_json(text);
  ASSERT_EQ(back.ranks.size(), 3u);
  EXPECT_EQ(back.ranks[2].end_us, r.ranks[0].end_us);
  EXPECT_EQ(back.ranks[2].peak_bytes, r.ranks[0].peak_bytes);
  EXPECT_EQ(back.ranks[2].rank, 2);
  EXPECT_EQ(report_to_json(back), text);
  // A mirror of a rank that is not in the report, or of another mirror, names the field.
  for (const char* to : {"7", "2"}) {
    std::string bad = text;
    bad.replace(bad.find("\"mirror_of\":0}"), 14, fmt::format("\"mirror_of\":{}}}", to));
    EXPECT_EQ(message_of(bad),
              fmt::format("report JSON: ranks[2].mirror_of: {} is not a rank of the report that ran", to));
  }
}

TEST(ReportJson, EveryRequiredFieldIsRequiredAndEveryOptionalOneIsNot) {
  RunReport full = sample_report();
  full.training = sample_training();
  full.pipeline = {{0, 0, 0, 0, true, 10, 20.25}};
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(report_to_json(full));
  // What reports written before these fields existed lack (docs/report.md), and map entries.
  auto optional = [](const std::string& path) {
    const std::string leaf = path.substr(path.find_last_of(".]") + 1);
    return path == "gpus_per_node" || path == "options" || path == "late_starts" || path == "topology" ||
           path == "training" || path == "pipeline" || path == "traced_ranks" ||
           path == "collective_totals" || path.rfind("options.", 0) == 0 ||
           path.rfind("training.exposed_comm_us.", 0) == 0 || path == "training.communicated_comm_us" ||
           path == "training.hidden_comm_us" || path.rfind("training.communicated_comm_us.", 0) == 0 ||
           path.rfind("training.hidden_comm_us.", 0) == 0 || path == "training.moe_routes" ||
           path == "training.moe_dropped_routes" ||
           (path.rfind("collectives[", 0) == 0 && leaf == "bookkeeping") || path == "activity" ||
           (path.rfind("ranks[", 0) == 0 &&
            (leaf == "comm_slowed_compute_us" || leaf == "host_wait_us" || leaf == "mirror_of")) ||
           (path.rfind("links[", 0) == 0 && leaf == "bandwidth_gbps");
  };
  int required = 0, optional_seen = 0;
  each_member(j, "", nlohmann::json::json_pointer(), [&](const std::string& path, const auto& pointer) {
    nlohmann::ordered_json less = j;
    less.at(pointer.parent_pointer()).erase(pointer.back());
    const std::string msg = message_of(less.dump());
    if (path == "schema_version") {
      EXPECT_TRUE(contains(msg, "no schema_version")) << msg;
    } else if (optional(path)) {
      ++optional_seen;
      EXPECT_EQ(msg, "(no error)") << path;
    } else {
      ++required;
      EXPECT_EQ(msg, "report JSON: " + path + ": required field is missing");
    }
  });
  EXPECT_GT(required, 100);
  EXPECT_GE(optional_seen, 10);
}

// A report as the first writer of schema version 1 wrote it: before options, gpus_per_node, late_starts,
// the links' bandwidth, bookkeeping collectives, the topology, training and pipeline existed.
constexpr const char* kFirstReport = R"({"schema_version":1,"lesson":"collectives","backend":"sim",
"profile":"dgx-h100","world":2,"makespan_us":237.6,
"ranks":[{"rank":0,"end_us":237.6,"compute_us":4.3e-05,"comm_us":105.6,"comm_wait_us":0.0,
"exposed_comm_us":105.6,"idle_us":132.0,"peak_bytes":28,"capacity_bytes":85469849190},
{"rank":1,"end_us":237.6,"compute_us":3.7e-05,"comm_us":105.6,"comm_wait_us":28.0,
"exposed_comm_us":105.6,"idle_us":132.0,"peak_bytes":28,"capacity_bytes":85469849190}],
"spans":[{"rank":0,"kind":"compute","name":"arange","start_us":4.0,"end_us":4.000003},
{"rank":1,"kind":"idle","name":"scatter","start_us":23.8,"end_us":27.8}],
"collectives":[{"op":"broadcast","group":"world","group_size":2,"bytes":8,"algorithm":"ring/ll",
"start_us":8.0,"end_us":15.8,"algbw_gbps":0.0010256,"busbw_gbps":0.0010256}],
"regions":[],
"checks":[{"rank":0,"what":"broadcast copies rank 0's tensor to every rank","passed":true,"detail":""}],
"links":[{"link":"gpu0->nvswitch0","tier":"nvlink","bytes":60}],
"output":["Collectives on 2 ranks."]})";

TEST(ReportJson, ReportsFromBeforeTheOptionalFieldsStillLoad) {
  const RunReport r = report_from_json(kFirstReport);
  EXPECT_EQ(r.lesson, "collectives");
  EXPECT_EQ(r.world, 2);
  EXPECT_EQ(r.gpus_per_node, 0);
  EXPECT_TRUE(r.options.empty());
  EXPECT_EQ(r.late_starts, 0);
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_EQ(r.ranks[1].comm_wait_us, 28.0);
  EXPECT_EQ(r.ranks[1].capacity_bytes, 85469849190);
  ASSERT_EQ(r.spans.size(), 2u);
  EXPECT_EQ(r.spans[1].kind, SpanKind::Idle);
  ASSERT_EQ(r.collectives.size(), 1u);
  EXPECT_EQ(r.collectives[0].op, CommOp::Broadcast);
  EXPECT_FALSE(r.collectives[0].bookkeeping);
  ASSERT_EQ(r.links.size(), 1u);
  EXPECT_EQ(r.links[0].bytes, 60);
  EXPECT_EQ(r.links[0].bandwidth_gbps, 0);
  EXPECT_TRUE(r.topology.empty());
  EXPECT_FALSE(r.training.has_value());
  EXPECT_TRUE(r.pipeline.empty());
  EXPECT_EQ(r.output, std::vector<std::string>{"Collectives on 2 ranks."});
  // Written again, it has today's form: the fields it lacked, at their defaults.
  const std::string again = report_to_json(r);
  EXPECT_TRUE(contains(again, "\"gpus_per_node\":0,\"options\":{},\"makespan_us\":237.6,\"late_starts\":0,"))
      << again.substr(0, 200);
  EXPECT_TRUE(contains(again, "\"bookkeeping\":false"));
  EXPECT_TRUE(contains(again, "\"topology\":{\"nodes\":[],\"links\":[]}"));
}

TEST(ReportJson, FieldsItDoesNotKnowAreIgnored) {
  // A later writer may add fields (docs/report.md): a reader that does not know them skips them.
  const RunReport r = report_from_json(edited([](auto& j) {
    j["ranks"][0]["energy_joules"] = "unknown";
    j["future"] = nlohmann::ordered_json::array({1, 2});
  }));
  EXPECT_EQ(report_to_json(r), report_to_json(sample_report()));
}

TrainingStats sample_training() {
  TrainingStats t;
  t.model = "gpt3-175b";
  t.layout = "tp 8 x pp 8 (interleave 2) x dp 24, zero 1";
  t.tokens_per_step = 3'145'728;
  t.micro_batches = 64;
  t.step_time_us = 12.5e6;
  t.model_flops = 3.3e18;
  t.hardware_flops = 4.4e18;
  t.model_tflops_per_gpu = 171.9;
  t.hardware_tflops_per_gpu = 229.2;
  t.mfu = 0.551;
  t.bubble_fraction = 0.061;
  t.bubble_fraction_formula = 0.0547;
  t.exposed_comm_us = {{"dp", 1250.0}, {"pp", 310.5}, {"tp", 80000.0}};
  t.communicated_comm_us = {{"dp", 2500.0}, {"pp", 400.0}, {"tp", 90000.0}};
  t.hidden_comm_us = {{"dp", 1250.0}, {"pp", 89.5}, {"tp", 10000.0}};
  t.peak_memory_bytes = 60'000'000'000;
  t.weights_bytes = 12'000'000'000;
  t.grads_bytes = 8'000'000'000;
  t.optimizer_bytes = 4'000'000'000;
  t.activations_bytes = 36'000'000'000;
  return t;
}

TEST(ReportJson, PipelineTasksRoundTripAndAreOptional) {
  RunReport r;
  r.world = 2;
  EXPECT_EQ(report_to_json(r).find("\"pipeline\""), std::string::npos);  // absent without a pipeline
  r.pipeline = {{0, 0, 0, 0, true, 10, 20.25}, {1, 1, 1, 3, false, 30.5, 41}};
  const std::string text = report_to_json(r);
  const RunReport back = report_from_json(text);
  ASSERT_EQ(back.pipeline.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const PipelineTask &x = r.pipeline[i], &y = back.pipeline[i];
    EXPECT_EQ(y.rank, x.rank);
    EXPECT_EQ(y.stage, x.stage);
    EXPECT_EQ(y.chunk, x.chunk);
    EXPECT_EQ(y.micro_batch, x.micro_batch);
    EXPECT_EQ(y.forward, x.forward);
    EXPECT_EQ(y.start_us, x.start_us);
    EXPECT_EQ(y.end_us, x.end_us);
  }
  EXPECT_EQ(report_to_json(back), text);
}

TEST(ReportJson, TrainingRoundTripsAndIsOptional) {
  RunReport r;
  r.world = 2;
  EXPECT_EQ(report_to_json(r).find("\"training\""), std::string::npos);  // absent when not trained
  EXPECT_FALSE(report_from_json(report_to_json(r)).training.has_value());

  r.training = sample_training();
  const RunReport back = report_from_json(report_to_json(r));
  ASSERT_TRUE(back.training.has_value());
  const TrainingStats& t = *back.training;
  const TrainingStats want = sample_training();
  EXPECT_EQ(t.model, want.model);
  EXPECT_EQ(t.layout, want.layout);
  EXPECT_EQ(t.tokens_per_step, want.tokens_per_step);
  EXPECT_EQ(t.micro_batches, want.micro_batches);
  EXPECT_EQ(t.step_time_us, want.step_time_us);
  EXPECT_EQ(t.model_flops, want.model_flops);
  EXPECT_EQ(t.hardware_flops, want.hardware_flops);
  EXPECT_EQ(t.model_tflops_per_gpu, want.model_tflops_per_gpu);
  EXPECT_EQ(t.hardware_tflops_per_gpu, want.hardware_tflops_per_gpu);
  EXPECT_EQ(t.mfu, want.mfu);
  EXPECT_EQ(t.bubble_fraction, want.bubble_fraction);
  EXPECT_EQ(t.bubble_fraction_formula, want.bubble_fraction_formula);
  EXPECT_EQ(t.exposed_comm_us, want.exposed_comm_us);
  EXPECT_EQ(t.communicated_comm_us, want.communicated_comm_us);
  EXPECT_EQ(t.hidden_comm_us, want.hidden_comm_us);
  EXPECT_EQ(t.peak_memory_bytes, want.peak_memory_bytes);
  EXPECT_EQ(t.weights_bytes, want.weights_bytes);
  EXPECT_EQ(t.grads_bytes, want.grads_bytes);
  EXPECT_EQ(t.optimizer_bytes, want.optimizer_bytes);
  EXPECT_EQ(t.activations_bytes, want.activations_bytes);
}

TEST(ReportJson, TrainingOfTheWrongShapeIsNamed) {
  auto with_training = [](auto edit) {
    return edited([&](auto& j) {
      j["training"] = nlohmann::ordered_json::parse(report_to_json([] {
        RunReport r = sample_report();
        r.training = sample_training();
        return r;
      }()))["training"];
      edit(j["training"]);
    });
  };
  EXPECT_EQ(message_of(edited([](auto& j) { j["training"] = {1}; })),
            "report JSON: training: expected an object, got an array");
  EXPECT_EQ(message_of(with_training([](auto& t) { t["mfu"] = "high"; })),
            "report JSON: training.mfu: expected a number, got a string (\"high\")");
  EXPECT_EQ(message_of(with_training([](auto& t) { t["exposed_comm_us"]["tp"] = "x"; })),
            "report JSON: training.exposed_comm_us.tp: expected a number, got a string (\"x\")");
  // A map's key that is not a plain name is quoted in the path.
  EXPECT_EQ(message_of(with_training([](auto& t) { t["exposed_comm_us"]["t p"] = true; })),
            "report JSON: training.exposed_comm_us.\"t p\": expected a number, got a boolean (true)");
  EXPECT_EQ(message_of(with_training([](auto& t) { t.erase("micro_batches"); })),
            "report JSON: training.micro_batches: required field is missing");
  // null is no training, as the writer leaves it out.
  EXPECT_FALSE(report_from_json(edited([](auto& j) { j["training"] = nullptr; })).training.has_value());
}

TEST(FormatSummary, TrainingFiguresComeFirst) {
  RunReport r;
  r.lesson = "gpt";
  r.world = 1536;
  r.training = sample_training();
  const std::string s = format_summary(r);
  EXPECT_TRUE(contains(s, "training step of gpt3-175b, tp 8 x pp 8 (interleave 2) x dp 24, zero 1: 12.500 s"))
      << s;
  EXPECT_TRUE(contains(s, "MFU 55.1%")) << s;
  EXPECT_TRUE(contains(s, "171.9 TFLOP/s per GPU")) << s;
  EXPECT_TRUE(contains(s, "6.1% measured, 5.5% by (p - 1) / (v m)")) << s;
  EXPECT_TRUE(contains(s, "dp 1.25 ms, pp 310.5 us, tp 80.00 ms")) << s;
  EXPECT_TRUE(contains(s, "3145728 tokens in 64 micro-batches")) << s;
  EXPECT_TRUE(contains(s, "activations")) << s;
  EXPECT_FALSE(contains(format_summary(RunReport{}), "training step")) << "only when a lesson reported one";
}

TEST(FormatSummary, ShowsTheNumbers) {
  std::string s = format_summary(sample_report());
  SCOPED_TRACE(s);
  EXPECT_TRUE(contains(s, "data_parallel on sim (dgx-h100), 2 ranks: 1.50 ms"));
  // Per-rank rows: end, compute, comm, exposed, wait, idle, memory.
  EXPECT_TRUE(contains(s, "1.50 ms"));
  EXPECT_TRUE(contains(s, "1.40 ms"));
  EXPECT_TRUE(contains(s, "800.5 us"));
  EXPECT_TRUE(contains(s, "300.1 us"));
  EXPECT_TRUE(contains(s, "50.8 us"));
  EXPECT_TRUE(contains(s, "12.1 us"));
  EXPECT_TRUE(contains(s, "649.0 us"));
  EXPECT_TRUE(contains(s, "1 GiB / 80 GiB (1%)"));
  // The two 64 MiB all_reduces are one row: mean 2 ms; algbw = 64 MiB / 2 ms = 33.6 GB/s; busbw x 1.5.
  EXPECT_TRUE(contains(s, "all_reduce"));
  EXPECT_TRUE(contains(s, "64 MiB"));
  EXPECT_TRUE(contains(s, "2.00 ms"));
  EXPECT_TRUE(contains(s, "33.6 GB/s"));
  EXPECT_TRUE(contains(s, "50.3 GB/s"));
  // all_to_all of 1.5 KiB over 2 ranks in 0.5 us: algbw 3.1 GB/s, busbw half of it.
  EXPECT_TRUE(contains(s, "1.50 KiB"));
  EXPECT_TRUE(contains(s, "0.5 us"));
  EXPECT_TRUE(contains(s, "3.1 GB/s"));
  EXPECT_TRUE(contains(s, "1.5 GB/s"));
  EXPECT_TRUE(contains(s, "pairwise"));
  // Traffic by tier.
  EXPECT_TRUE(contains(s, "nvlink 4 MiB"));
  EXPECT_TRUE(contains(s, "network 512 B"));
  // Checks aggregated across ranks.
  EXPECT_TRUE(contains(s, "\u2713 params equal single-device (2 ranks)"));
  EXPECT_TRUE(contains(s, "\u2717 loss finite (failed on 1 of 2 ranks: rank 1): loss is nan at step 3"));
  EXPECT_TRUE(contains(s, "1 of 4 failed"));
  EXPECT_FALSE(contains(s, "\u2713 loss finite"));
}

TEST(FormatSummary, SmallMessagesAndOddSizes) {
  RunReport r;
  r.world = 4;
  CollectiveRecord c;
  c.op = CommOp::AllReduce;
  c.group_size = 4;
  c.bytes = 16;
  c.algorithm = "ring";
  c.start_us = 10;
  c.end_us = 13.6;
  r.collectives = {c};
  RankSummary s;
  s.peak_bytes = 300 * 1024 + 512;  // 300.5 KiB: three significant digits
  s.capacity_bytes = static_cast<std::int64_t>(79.6 * 1073741824.0);
  r.ranks = {s};
  std::string out = format_summary(r);
  // 16 B in 3.6 us: algbw 4.4 MB/s, busbw 1.5x that.
  EXPECT_TRUE(contains(out, "4.4 MB/s")) << out;
  EXPECT_TRUE(contains(out, "6.7 MB/s")) << out;
  EXPECT_TRUE(contains(out, "3.6 us")) << out;
  EXPECT_TRUE(contains(out, "16 B")) << out;
  EXPECT_TRUE(contains(out, "300 KiB / 79.6 GiB (0%)")) << out;
}

TEST(FormatSummary, CheckMadeByOneRank) {
  RunReport r;
  r.world = 2;
  r.checks = {{1, "gathered rows in rank order", false, "row 3 holds rank 2's data"},
              {0, "root sees the sum", true, ""}};
  std::string s = format_summary(r);
  EXPECT_TRUE(contains(s, "\u2717 gathered rows in rank order (rank 1): row 3 holds rank 2's data")) << s;
  EXPECT_TRUE(contains(s, "\u2713 root sees the sum (rank 0)")) << s;
  EXPECT_TRUE(contains(s, "1 of 2 failed")) << s;
}

TEST(FormatSummary, ManyRanksAreSummarisedNotListed) {
  RunReport r;
  r.lesson = "tour";
  r.backend = "sim";
  r.world = 20;
  for (int i = 0; i < 20; ++i) {
    RankSummary s;
    s.rank = i;
    s.end_us = i == 7 ? 900 : 100 + i;  // rank 7 is the straggler
    s.compute_us = 10 * i;
    r.ranks.push_back(s);
  }
  r.makespan_us = 900;
  std::string s = format_summary(r);
  SCOPED_TRACE(s);
  EXPECT_TRUE(contains(s, "min"));
  EXPECT_TRUE(contains(s, "mean"));
  EXPECT_TRUE(contains(s, "max"));
  EXPECT_TRUE(contains(s, "190.0 us"));  // the largest compute
  EXPECT_TRUE(contains(s, "95.0 us"));   // the mean compute
  EXPECT_TRUE(contains(s, "the last to finish is rank 7"));
  EXPECT_FALSE(contains(s, "    19 "));  // no per-rank row
  EXPECT_LT(std::count(s.begin(), s.end(), '\n'), 12);
}

}  // namespace
}  // namespace ranklab
