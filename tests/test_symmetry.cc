// Symmetric simulation (SimConfig::symmetry): one rank per class runs and its replicas mirror it. For
// programs that have the symmetry, every figure equals the full run's: step time to the last bit, each
// rank's busy and idle time and peak memory, and the bytes on every link (the mirrors' groups run beside
// the representatives' as images). Programs that break the symmetry are refused with what broke it.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "lessons/parallel/groups.h"
#include "sim/sim_backend.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

struct Layout {
  int tp, pp, dp, v, zero;
  bool sp;
  const char* recompute;
  const char* order;
};

// `ep` > 0: the symmetry of a skewed routing (Layout::expert_symmetry) with that expert-parallel size.
RunReport run_gpt(const Layout& l, int nodes, bool symmetric, bool mirror_dp = true, Settings o = {},
                  int ep = 0, int etp = 1) {
  o["layers"] = option_text(4);
  o["hidden"] = option_text(512);
  o["heads"] = option_text(8);
  o["seq"] = option_text(256);
  o["vocab"] = option_text(1024);
  o["global-batch"] = option_text(8 * l.dp);
  o["micro-batch"] = option_text(1);
  o["tp"] = option_text(l.tp);
  o["pp"] = option_text(l.pp);
  o["interleave"] = option_text(l.v);
  o["zero"] = option_text(l.zero);
  o["seq-parallel"] = option_text(l.sp);
  o["recompute"] = option_text(l.recompute);
  o["order"] = option_text(l.order);
  o["world"] = option_text(l.tp * l.pp * l.dp);
  o["steps"] = option_text(1);
  o["phantom"] = option_text(true);
  o["quiet"] = option_text(true);
  SimConfig c = testing::quiet_config(nodes);
  if (symmetric) {
    const parallel::Layout layout{l.tp, l.pp, l.dp, l.order, 1, ep, etp};
    const parallel::Layout::Grid g = ep > 0 ? layout.expert_symmetry() : layout.symmetry(mirror_dp);
    c.symmetry = SimSymmetry{g.sizes, g.replicated};
  }
  SimBackend backend(c);
  return run_lesson(backend, "gpt", o);
}

bool said(const RunReport& r, const std::string& text) {
  for (const std::string& line : r.output) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

// Every rank's end, busy and idle times and peak memory, and every link's bytes, the same in both runs.
void expect_same_ranks(const RunReport& full, const RunReport& sym) {
  ASSERT_EQ(full.ranks.size(), sym.ranks.size());
  for (size_t r = 0; r < full.ranks.size(); ++r) {
    const RankSummary &a = full.ranks[r], &b = sym.ranks[r];
    EXPECT_EQ(a.end_us, b.end_us) << "rank " << r;
    EXPECT_EQ(a.compute_us, b.compute_us) << "rank " << r;
    EXPECT_EQ(a.comm_us, b.comm_us) << "rank " << r;
    EXPECT_EQ(a.idle_us, b.idle_us) << "rank " << r;
    EXPECT_EQ(a.peak_bytes, b.peak_bytes) << "rank " << r;
  }
}
void expect_same_link_bytes(const RunReport& full, const RunReport& sym) {
  ASSERT_EQ(full.links.size(), sym.links.size());
  for (size_t i = 0; i < full.links.size(); ++i) {
    EXPECT_EQ(full.links[i].link, sym.links[i].link);
    EXPECT_EQ(full.links[i].bytes, sym.links[i].bytes) << full.links[i].link;
  }
}

// "tp4sp_pp2v1_dp4_zero1_none_tp_dp_pp"
std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  const Layout& l = info.param;
  std::string name = "tp" + std::to_string(l.tp) + (l.sp ? "sp" : "") + "_pp" + std::to_string(l.pp) + "v" +
                     std::to_string(l.v) + "_dp" + std::to_string(l.dp) + "_zero" + std::to_string(l.zero) +
                     "_" + l.recompute + "_" + l.order;
  for (char& c : name) c = c == '-' ? '_' : c;
  return name;
}

class SymmetricGpt : public ::testing::TestWithParam<Layout> {};

TEST_P(SymmetricGpt, EqualsTheFullRun) {
  const Layout l = GetParam();
  const int world = l.tp * l.pp * l.dp;
  const int nodes = (world + 7) / 8;
  const RunReport full = run_gpt(l, nodes, false);
  const RunReport sym = run_gpt(l, nodes, true);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  EXPECT_EQ(full.training->peak_memory_bytes, sym.training->peak_memory_bytes);
  EXPECT_EQ(full.makespan_us, sym.makespan_us);
  // The means of exposed communication are sums of floats taken in another order: equal to rounding.
  for (const auto& [dim, us] : full.training->exposed_comm_us) {
    EXPECT_NEAR(us, sym.training->exposed_comm_us.at(dim), 1e-5 * us + 1e-6) << dim;
  }
  expect_same_ranks(full, sym);
  expect_same_link_bytes(full, sym);
  EXPECT_TRUE(sym.all_checks_passed());
  // (Equal here even where a pipeline send crosses rails through a spine, which the run cannot know in
  // general and so does not promise.)
  EXPECT_TRUE(said(sym, "symmetric run: " + std::to_string(l.pp) + " of " + std::to_string(world) +
                            " ranks ran, the others mirrored them"));
  // Every rank's timeline is the ranks' that ran, which the report traces; each mirror names its own.
  ASSERT_EQ(sym.traced_ranks.size(), static_cast<std::size_t>(l.pp));
  for (int rank : sym.traced_ranks) EXPECT_EQ(sym.ranks[rank].mirror_of, -1) << "rank " << rank;
  for (const RankSummary& s : sym.ranks) {
    if (s.mirror_of >= 0) {
      EXPECT_EQ(s.end_us, sym.ranks[s.mirror_of].end_us) << "rank " << s.rank;
    }
  }
}

// `experts` experts of width 256, top 2, over ep ranks.
Settings with_experts(int experts, int ep) {
  Settings moe;
  moe["experts"] = option_text(experts);
  moe["top-k"] = option_text(2);
  moe["moe-ffn-hidden"] = option_text(256);
  moe["ep"] = option_text(ep);
  return moe;
}

// Expert parallelism over part of the data-parallel ranks: the mirrors' ep groups are the blocks of ep
// consecutive ranks, not every shift of the representative's group along dp (which would count traffic
// of groups the program never makes: 15 copies of each all-to-all here instead of 1).
TEST(Symmetry, ExpertParallelGroupsWithinDataParallelRanks) {
  const Layout l{1, 1, 32, 1, 1, false, "none", "tp-dp-pp"};
  const Settings moe = with_experts(32, 16);
  const RunReport full = run_gpt(l, 4, false, true, moe);
  const RunReport sym = run_gpt(l, 4, true, true, moe);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  expect_same_link_bytes(full, sym);
  EXPECT_TRUE(said(sym, "symmetric run: 1 of 32 ranks ran, the others mirrored them"));
}

// A skewed routing: the ranks that hold a layer's hot expert compute more than the rest of their ep group,
// and only the ranks that hold the same experts mirror each other (one ep group per stage runs). Every
// rank's figures and every link's bytes equal the full run's; mirroring the whole stage would give every
// rank the representative's load, which does not hold the hot expert in every layer.
TEST(Symmetry, ASkewedRoutingMirrorsTheRanksThatHoldTheSameExperts) {
  const Layout l{2, 2, 8, 1, 1, true, "none", "tp-dp-pp"};
  Settings moe = with_experts(8, 8);
  moe["routing"] = option_text("skew:3");
  const RunReport full = run_gpt(l, 4, false, true, moe);
  const RunReport sym = run_gpt(l, 4, true, true, moe, /*ep=*/8);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  expect_same_ranks(full, sym);
  double least_compute_us = INFINITY, most_compute_us = 0;
  for (const RankSummary& a : full.ranks) {
    least_compute_us = std::min(least_compute_us, a.compute_us);
    most_compute_us = std::max(most_compute_us, a.compute_us);
  }
  EXPECT_GT(most_compute_us, least_compute_us);  // the skew makes the ranks' loads differ
  expect_same_link_bytes(full, sym);
  EXPECT_TRUE(said(sym, "symmetric run: 16 of 32 ranks ran, the others mirrored them"));
  // An ep group inside a tp block has no such split of the grid.
  EXPECT_THROW(parallel::Layout({4, 1, 2, "tp-dp-pp", 1, 2}).expert_symmetry(), UsageError);
}

// The same with each expert split over etp 2 (the tp groups): an ep group is every other rank of 8, and
// the ep x etp blocks of 8 ranks that hold the experts between them run, one per stage.
TEST(Symmetry, ASkewedRoutingWithExpertTensorParallelismMirrorsTheSameShards) {
  const Layout l{2, 2, 8, 1, 1, true, "none", "tp-dp-pp"};
  Settings moe = with_experts(8, 4);
  moe["etp"] = option_text(2);
  moe["routing"] = option_text("skew:3");
  const RunReport full = run_gpt(l, 4, false, true, moe);
  const RunReport sym = run_gpt(l, 4, true, true, moe, /*ep=*/4, /*etp=*/2);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  expect_same_ranks(full, sym);
  expect_same_link_bytes(full, sym);
  EXPECT_TRUE(said(sym, "symmetric run: 16 of 32 ranks ran, the others mirrored them"));
}

// Past one leaf of the fabric the replicas'' routes through the spines are not images of the
// representatives' (ECMP hashes each pair of NICs, and a stage's replicas straddle leaf boundaries
// differently), and the run says that it is then not promised exact.
TEST(Symmetry, SaysWhenTrafficCrossesTheSpines) {
  const RunReport sym = run_gpt(Layout{8, 2, 17, 1, 1, false, "none", "tp-dp-pp"}, 34, true);
  EXPECT_TRUE(said(sym,
                   "symmetric run: 2 of 272 ranks ran, the others mirrored them; traffic crossed the "
                   "fabric's spines"));
}

// Where a replica's transfers are slower than its representative's (its pipeline sends cross a spine, the
// representative's stay under one leaf), the representative's operation ends when the slowest image
// has: the replicas meet again at their next collective, so the slowest decides when they go on. On
// these layouts, whose stages straddle leaves of 20 nodes, that makes the step the full run's to the last
// bit (taking the representative's own end instead was up to 0.09% short).
class SymmetricAcrossLeaves : public ::testing::TestWithParam<Layout> {};

TEST_P(SymmetricAcrossLeaves, StepEqualsTheFullRun) {
  const Layout l = GetParam();
  const int nodes = l.tp * l.pp * l.dp / 8;
  const RunReport full = run_gpt(l, nodes, false);
  const RunReport sym = run_gpt(l, nodes, true);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  EXPECT_EQ(full.makespan_us, sym.makespan_us);
}

// Mirroring the tp ranks only: one rank per stage and dp replica runs.
TEST(Symmetry, MirroringTensorParallelRanksOnly) {
  const Layout l{8, 2, 17, 1, 1, false, "none", "tp-dp-pp"};
  const RunReport full = run_gpt(l, 34, false);
  const RunReport sym = run_gpt(l, 34, true, /*mirror_dp=*/false);
  ASSERT_TRUE(full.training && sym.training);
  EXPECT_EQ(full.training->step_time_us, sym.training->step_time_us);
  EXPECT_TRUE(said(sym, "symmetric run: 34 of 272 ranks ran, the others mirrored them"));
}

INSTANTIATE_TEST_SUITE_P(Layouts, SymmetricAcrossLeaves,
                         ::testing::Values(Layout{8, 2, 17, 1, 1, false, "none", "tp-dp-pp"},
                                           Layout{8, 2, 12, 2, 1, true, "none", "tp-dp-pp"},
                                           Layout{4, 2, 24, 2, 2, true, "none", "tp-dp-pp"},
                                           Layout{8, 2, 24, 1, 1, false, "none", "tp-pp-dp"}),
                         layout_name);

// Data parallelism across nodes (the images share the network), tensor parallelism with and without
// sequence parallelism, interleaved pipelines, every ZeRO stage, and the group order that puts dp inside.
// Where a tp group fills a node, its images lie in nodes where no rank runs and only count their traffic.
INSTANTIATE_TEST_SUITE_P(Layouts, SymmetricGpt,
                         ::testing::Values(Layout{4, 2, 4, 1, 1, true, "none", "tp-dp-pp"},
                                           Layout{8, 2, 4, 1, 1, true, "none", "tp-dp-pp"},
                                           Layout{2, 2, 4, 2, 0, false, "selective", "tp-dp-pp"},
                                           Layout{2, 2, 4, 1, 2, true, "full", "tp-dp-pp"},
                                           Layout{4, 1, 4, 1, 3, false, "none", "tp-dp-pp"},
                                           Layout{2, 2, 4, 1, 1, false, "none", "tp-pp-dp"},
                                           Layout{1, 4, 4, 1, 0, false, "none", "dp-tp-pp"}),
                         layout_name);

SimConfig symmetric_config(std::vector<int> dims, std::vector<bool> replicated, int nodes = 1) {
  SimConfig c = testing::quiet_config(nodes);
  c.symmetry = SimSymmetry{std::move(dims), std::move(replicated)};
  return c;
}

TEST(Symmetry, OnlyRepresentativesRun) {
  // 2 x 4 x 2, the first and last dimensions replicated: 4 classes of 4 ranks.
  SimBackend backend(symmetric_config({2, 4, 2}, {true, false, true}, 2));
  std::atomic<int> ran{0};
  std::vector<int> who;
  const RunReport rep = backend.launch(16, [&](Rank& r) {
    ++ran;
    who.push_back(r.rank());
    Tensor t = r.full({8}, 1.0f);
    r.all_reduce(t, ReduceOp::Sum);
    // The mirrors take part as copies of their representative: the sum counts every rank.
    r.check("world sum", r.to_host(t)[0] == 16.0f, "");
  });
  EXPECT_EQ(ran.load(), 4);
  EXPECT_EQ(who, (std::vector<int>{0, 2, 4, 6}));
  EXPECT_TRUE(rep.all_checks_passed());
  ASSERT_EQ(rep.ranks.size(), 16u);
  EXPECT_EQ(rep.ranks[15].end_us, rep.ranks[6].end_us);  // rank 15 mirrors rank 6
  EXPECT_TRUE(said(rep,
                   "symmetric run: 4 of 16 ranks ran, the others mirrored them; every figure is the full "
                   "run's"));
}

TEST(Symmetry, AGroupWithoutItsRepresentativeIsRefused) {
  // Ranks 0..3 as 2 x 2, the first dimension replicated: rank 1 mirrors 0 and rank 3 mirrors 2.
  SimBackend backend(symmetric_config({2, 2}, {true, false}));
  try {
    backend.launch(4, [](Rank& r) { r.new_group({1, 2}); });
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("group {1, 2} holds rank 1 but not rank 0, which it mirrors"),
              std::string::npos)
        << e.what();
  }
}

// Shifted along the replicated dimension, the group {0, 1, 2} of four ranks overlaps itself: its ranks
// cannot be cut into groups like it, so no rank could hold the third rank's place in each.
TEST(Symmetry, AGroupWhoseCopiesOverlapItIsRefused) {
  SimBackend backend(symmetric_config({4}, {true}));
  try {
    backend.launch(4, [](Rank& r) {
      Group g = r.new_group({0, 1, 2});
      Tensor t = r.zeros({4});
      r.all_reduce(t, ReduceOp::Sum, Async::No, g);
    });
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the copies of group {0, 1, 2} along the replicated dimensions "
                                         "overlap it without tiling the ranks (rank 3 is in none)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Symmetry, SendingToAMirrorIsRefused) {
  SimBackend backend(symmetric_config({2, 2}, {true, false}));
  try {
    backend.launch(4, [](Rank& r) {
      Tensor t = r.zeros({4});
      if (r.rank() == 0) r.send(t, 1);
    });
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0: send with rank 1, which mirrors rank 0"), std::string::npos)
        << e.what();
  }
}

TEST(Symmetry, AGridThatIsNotTheWorldIsRefused) {
  SimBackend backend(symmetric_config({2, 3}, {true, false}));
  try {
    backend.launch(8, [](Rank&) {});
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(
        std::string(e.what()).find("the grid {2 x 3} (2 replicated flags) does not describe a world of 8"),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ranklab
