// A report keeps every rank's totals and only its traced ranks' timelines (SimConfig::trace_ranks): the
// totals must be what the whole timeline gives, to the bit, and what they cost must not grow with the run.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "common/errors.h"
#include "common/trace_ranks.h"
#include "gpt_fixture.h"

namespace ranklab {
namespace {

// tp 2, pp 2, dp 2 with interleaving, ZeRO 1 and every overlap: transfers on several streams that end out of
// order, beside kernels whose times wait for them.
Settings layered(int steps) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(8);
  o["tp"] = option_text(2);
  o["pp"] = option_text(2);
  o["interleave"] = option_text(2);
  o["zero"] = option_text(1);
  o["seq-parallel"] = option_text(true);
  o["overlap-grad-reduce"] = option_text(true);
  o["overlap-param-gather"] = option_text(true);
  o["tp-comm-overlap"] = option_text(true);
  o["global-batch"] = option_text(16);
  o["micro-batch"] = option_text(2);
  o["steps"] = option_text(steps);
  return o;
}

struct Traced {
  RunReport report;
  std::size_t held_most = 0;
};

Traced run_traced(const Settings& o, const TraceRanks& trace, int nodes = 1) {
  SimConfig c = testing::quiet_config(nodes);
  c.trace_ranks = trace;
  SimBackend backend(c);
  Traced t{run_lesson(backend, "gpt", o)};
  t.held_most = backend.timeline_held_most();
  return t;
}

// The totals of a run, taken again from its whole timeline.
RunReport summarized_again(const RunReport& rep) {
  RunReport again = rep;
  again.ranks.clear();
  for (const RankSummary& s : rep.ranks) {
    RankSummary kept;
    kept.rank = s.rank, kept.end_us = s.end_us;
    again.ranks.push_back(kept);
  }
  summarize_spans(again);
  return again;
}

TEST(ReportAtScale, TracingSomeRanksKeepsEveryRanksTotalsToTheBit) {
  const Settings o = layered(2);
  const Traced all = run_traced(o, TraceRanks{});
  const Traced some = run_traced(o, TraceRanks::parse("0,5", "--trace-ranks"));
  ASSERT_TRUE(all.report.all_checks_passed());
  ASSERT_EQ(all.report.ranks.size(), some.report.ranks.size());
  for (std::size_t r = 0; r < all.report.ranks.size(); ++r) {
    const RankSummary &a = all.report.ranks[r], &b = some.report.ranks[r];
    EXPECT_EQ(a.end_us, b.end_us) << "rank " << r;
    EXPECT_EQ(a.compute_us, b.compute_us) << "rank " << r;
    EXPECT_EQ(a.comm_us, b.comm_us) << "rank " << r;
    EXPECT_EQ(a.exposed_comm_us, b.exposed_comm_us) << "rank " << r;
    EXPECT_EQ(a.comm_wait_us, b.comm_wait_us) << "rank " << r;
    EXPECT_EQ(a.idle_us, b.idle_us) << "rank " << r;
    EXPECT_GT(a.comm_us, 0) << "rank " << r;
  }
  // The same totals the whole timeline's spans give.
  const RunReport again = summarized_again(all.report);
  for (std::size_t r = 0; r < all.report.ranks.size(); ++r) {
    EXPECT_EQ(again.ranks[r].exposed_comm_us, all.report.ranks[r].exposed_comm_us) << "rank " << r;
    EXPECT_EQ(again.ranks[r].idle_us, all.report.ranks[r].idle_us) << "rank " << r;
  }
  // Spans and regions of the traced ranks only, and every collective in the table.
  EXPECT_EQ(some.report.traced_ranks, (std::vector<int>{0, 5}));
  EXPECT_TRUE(all.report.traced_ranks.empty());
  std::set<int> span_ranks;
  for (const Span& s : some.report.spans) span_ranks.insert(s.rank);
  EXPECT_EQ(span_ranks, (std::set<int>{0, 5}));
  for (const RegionRecord& g : some.report.regions) EXPECT_TRUE(g.rank == 0 || g.rank == 5) << g.rank;
  EXPECT_LT(some.report.collectives.size(), all.report.collectives.size());
  CollectiveTally whole;
  for (const CollectiveRecord& c : all.report.collectives) whole.add(c);
  const std::vector<CollectiveTotal>& want = whole.rows();
  const std::vector<CollectiveTotal> got = collective_totals(some.report);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].count, want[i].count) << i;
    EXPECT_EQ(got[i].total_us, want[i].total_us) << i;
    EXPECT_EQ(got[i].max_us, want[i].max_us) << i;
  }
  EXPECT_EQ(format_summary(some.report), format_summary(all.report));
}

TEST(ReportAtScale, ATransferInFlightHoldsBackTheFold) {
  // A long all_reduce in flight under hundreds of launch-bound kernels: its span comes when it ends, and
  // starts before them all. Folding the kernels before it came would lose their overlap with it.
  SimBackend backend(testing::quiet_config());
  const RunReport rep = backend.launch(2, [](Rank& r) {
    const Tensor big = r.phantom(Shape{1 << 28}, DType::BFloat16);
    const Tensor x = r.phantom(Shape{256}, DType::Float32);
    for (int step = 0; step < 3; ++step) {
      Work w = r.all_reduce(big, ReduceOp::Sum, Async::Yes);
      for (int i = 0; i < 400; ++i) r.add_(x, x, 1.0f);
      w.wait();
    }
    r.synchronize();
  });
  const RunReport again = summarized_again(rep);
  for (std::size_t r = 0; r < rep.ranks.size(); ++r) {
    EXPECT_GT(rep.ranks[r].comm_us - rep.ranks[r].exposed_comm_us, 0) << "rank " << r;
    EXPECT_EQ(again.ranks[r].exposed_comm_us, rep.ranks[r].exposed_comm_us) << "rank " << r;
    EXPECT_EQ(again.ranks[r].idle_us, rep.ranks[r].idle_us) << "rank " << r;
  }
  EXPECT_GT(backend.timeline_held_most(), 64u);
}

TEST(ReportAtScale, WhatTheTotalsHoldDoesNotGrowWithTheRun) {
  const TraceRanks none = TraceRanks::parse("0", "--trace-ranks");
  const Traced short_run = run_traced(layered(1), none), long_run = run_traced(layered(6), none);
  std::size_t short_spans = 0, long_spans = 0;
  for (const Span& s : short_run.report.spans) short_spans += s.rank == 0;
  for (const Span& s : long_run.report.spans) long_spans += s.rank == 0;
  EXPECT_GT(long_spans, 5 * short_spans);
  // Folded as the run goes: a rank holds what is still open, about a micro-batch's spans, however many
  // steps run (without folding it would hold every interval of its timeline, thousands).
  EXPECT_LE(long_run.held_most, 2 * short_run.held_most);
  EXPECT_LT(long_run.held_most, long_spans / 10);
}

TEST(ReportAtScale, TheLessonChoosesOneRankPerPipelineStage) {
  Settings o = layered(1);
  o["world"] = option_text(32);
  o["tp"] = option_text(2);
  o["pp"] = option_text(2);
  o["global-batch"] = option_text(64);
  const Traced t = run_traced(o, TraceRanks::parse("auto", "--trace-ranks"), /*nodes=*/4);
  // tp-dp-pp order: stage 1 starts at rank 16.
  EXPECT_EQ(t.report.traced_ranks, (std::vector<int>{0, 16}));
  // A small world keeps every rank.
  EXPECT_TRUE(run_traced(layered(1), TraceRanks::parse("auto", "--trace-ranks")).report.traced_ranks.empty());
}

template <class F>
void expect_refused(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; wanted an error with " << needle;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TraceRanksSpec, ReadsListsRangesAndRefusesWhatIsNotARank) {
  EXPECT_EQ(TraceRanks::parse("all", "--trace-ranks").mode, TraceRanks::Mode::All);
  EXPECT_EQ(TraceRanks::parse("auto", "--trace-ranks").mode, TraceRanks::Mode::Lesson);
  EXPECT_EQ(TraceRanks::parse("7,0-2,2", "--trace-ranks").ranks, (std::vector<int>{0, 1, 2, 7}));
  for (const char* bad :
       {"", "x", "1,", "-1", "3-1", "1-", "0-99999999", "0-600000,0-600000", "2.5", "99999999999"}) {
    expect_refused([&] { TraceRanks::parse(bad, "--trace-ranks"); }, "--trace-ranks");
  }
  expect_refused([] { TraceRanks::parse("0,8", "--trace-ranks").check(8, "--trace-ranks"); },
                 "--trace-ranks: rank 8 is not one of the run's 8 ranks");
}

}  // namespace
}  // namespace ranklab
