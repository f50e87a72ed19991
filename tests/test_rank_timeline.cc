// RankTimeline folds what no later span can touch into running totals: the totals must be the whole
// union's to the bit, while the intervals it holds stay few however long the timeline grows.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/rank_timeline.h"

namespace ranklab {
namespace {

struct Timed {
  SpanKind kind;
  double start_us, end_us;
};

// A rank's spans as a backend hands them over: compute back to back with gaps, transfers on two streams
// that overlap it and each other, finishing out of order, and waits before some of them. `watermark` is
// where the next span may start at the earliest, as the backend would know it.
std::vector<std::pair<Timed, double>> random_timeline(int spans, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> len(0.5, 20), gap(0, 6);
  std::vector<std::pair<Timed, double>> out;
  double compute_us = 0, comm_us[2] = {0, 0};
  for (int i = 0; i < spans; ++i) {
    const int what = static_cast<int>(rng() % 4);
    double start = 0, end = 0;
    SpanKind kind = SpanKind::Compute;
    if (what <= 1) {
      start = compute_us + (rng() % 3 == 0 ? gap(rng) : 0.0);
      end = compute_us = start + len(rng);
    } else {
      double& stream = comm_us[what - 2];
      start = std::max(stream, compute_us - len(rng)) + gap(rng);
      end = stream = start + len(rng);
      kind = rng() % 5 == 0 ? SpanKind::Idle : SpanKind::Comm;
    }
    out.push_back({{kind, start, end}, 0});
  }
  // The watermark after each span: no later span starts before it.
  double earliest = 1e300;
  for (std::size_t i = out.size(); i-- > 0;) {
    out[i].second = earliest;
    earliest = std::min(earliest, out[i].first.start_us);
  }
  return out;
}

TEST(RankTimeline, FoldingKeepsTheWholeUnionsTotalsToTheBit) {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    const auto spans = random_timeline(5000, seed);
    RankTimeline whole, folded;
    std::size_t most_held = 0;
    for (const auto& [s, watermark] : spans) {
      whole.add(s.kind, s.start_us, s.end_us);
      folded.add(s.kind, s.start_us, s.end_us);
      if (folded.held() >= 8) folded.fold(watermark);
      most_held = std::max(most_held, folded.held());
    }
    RankSummary a, b;
    whole.summarize(a);
    folded.summarize(b);
    EXPECT_EQ(a.compute_us, b.compute_us) << "seed " << seed;
    EXPECT_EQ(a.comm_us, b.comm_us) << "seed " << seed;
    EXPECT_EQ(a.exposed_comm_us, b.exposed_comm_us) << "seed " << seed;
    EXPECT_EQ(a.comm_wait_us, b.comm_wait_us) << "seed " << seed;
    EXPECT_EQ(a.idle_us, b.idle_us) << "seed " << seed;
    EXPECT_EQ(a.end_us, b.end_us) << "seed " << seed;
    EXPECT_GT(whole.held(), 500u);
    EXPECT_LT(most_held, 100u) << "seed " << seed;
  }
}

TEST(RankTimeline, AWatermarkThatALaterSpanBreaksIsWhatFoldingTrusts) {
  // Folding past a span still to come loses its overlap with what was folded: the totals then differ,
  // which is why a backend folds only at a watermark it knows.
  RankTimeline t, whole;
  for (RankTimeline* x : {&t, &whole}) x->add(SpanKind::Compute, 0, 10);
  t.fold(20);
  for (RankTimeline* x : {&t, &whole}) x->add(SpanKind::Comm, 5, 15);
  RankSummary a, b;
  whole.summarize(a);
  t.summarize(b);
  EXPECT_EQ(a.exposed_comm_us, 5);
  EXPECT_EQ(b.exposed_comm_us, 10);
}

TEST(RankTimeline, TouchingSpansAreOneInterval) {
  RankTimeline t;
  t.add(SpanKind::Compute, 0, 1);
  t.add(SpanKind::Compute, 2, 3);
  t.add(SpanKind::Compute, 1, 2);
  EXPECT_EQ(t.held(), 1u);
  t.add(SpanKind::Comm, 0.5, 2.5);
  RankSummary s;
  t.summarize(s);
  EXPECT_EQ(s.compute_us, 3);
  EXPECT_EQ(s.exposed_comm_us, 0);
  EXPECT_EQ(s.idle_us, 0);
}

TEST(ActivityBins, EveryRankOnOneAxisBinByBin) {
  // Rank 0 computes [0, 32], communicates [16, 64] (exposed from 32), waits [64, 96]; rank 1 computes
  // [0, 120] and mirrors nothing; the run ends at 128: 64 bins of 2 us.
  RankTimeline a, b;
  a.add(SpanKind::Compute, 0, 32);
  a.add(SpanKind::Comm, 16, 64);
  a.fold(40);  // what is folded and what is held both reach the bins
  a.add(SpanKind::Idle, 64, 96);
  b.add(SpanKind::Compute, 0, 120);
  const ActivityBins bins_a = a.activity(), bins_b = b.activity();
  const ActivityStrip strip = activity_strip({&bins_a, &bins_b, nullptr}, 128);
  EXPECT_EQ(strip.bin_us, 2);
  EXPECT_EQ(strip.bins, ActivityBins::kBins);
  ASSERT_EQ(strip.ranks.size(), 3u);
  auto cell = [&](int rank, int bin) { return strip.ranks[rank].substr(3 * bin, 3); };
  EXPECT_EQ(cell(0, 0), "900");   // computing
  EXPECT_EQ(cell(0, 10), "900");  // communicating under the compute
  EXPECT_EQ(cell(0, 20), "090");  // communication beyond it
  EXPECT_EQ(cell(0, 35), "009");  // waiting
  EXPECT_EQ(cell(0, 60), "000");  // idle
  EXPECT_EQ(cell(1, 59), "900");
  EXPECT_EQ(cell(1, 60), "000");
  EXPECT_TRUE(strip.ranks[2].empty());  // a mirror's row is its representative's
}

}  // namespace
}  // namespace ranklab
