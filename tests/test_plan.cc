// `ranklab plan`: the winner of a tiny question trains equal to one device; on a device made small, every
// layout the planner accepts runs the gpt lesson without running out of memory and every layout it rejects
// for memory runs out; no simulated step beats its lower bound, nor the bound a probe's short steps sharpen;
// the same question gives the same ranking; bad input is a clear UsageError; layout names read back.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/assets.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "plan/candidates.h"
#include "plan/plan_command.h"
#include "plan/plan_report.h"
#include "plan/search.h"
#include "plan_fixture.h"
#include "sim_fixture.h"

namespace ranklab::plan {
namespace {

// 4 layers, hidden 64, 4 heads, seq 16, vocab 128, global batch 16 on one dgx-h100 node (8 ranks).
Request tiny_request() {
  Request r;
  r.shape = {{"layers", "4"}, {"hidden", "64"}, {"heads", "4"},
             {"seq", "16"},   {"vocab", "128"}, {"global-batch", "16"}};
  return r;
}
Question tiny() {
  return make_question(tiny_request());
}

SearchOptions quiet() {
  SearchOptions o;
  o.progress = false;
#if defined(RANKLAB_SANITIZE)
  // Ten times slower under the sanitizers: the first layouts by bound, which is what the checks need.
  o.max_candidates = 12;
#endif
  return o;
}

// `ranklab run gpt` with the layout: every rank, the lesson's default steps.
RunReport run_gpt(const Question& q, const Layout& l, bool phantom) {
  Settings o = lesson_settings(q, l);
  o["phantom"] = option_text(phantom);
  o["steps"] = option_text(3);
  SimConfig c;
  c.profile = q.profile;
  c.echo_output = false;
  SimBackend backend(c);
  return run_lesson(backend, "gpt", o);
}

TEST(Plan, TheWinnerTrainsEqualToOneDevice) {
  const Question q = tiny();
  const Plan p = search(q, quiet());
  const std::vector<const Result*> ranked = p.ranked();
  ASSERT_FALSE(ranked.empty());
  const RunReport rep = run_gpt(q, ranked[0]->candidate.layout, false);
  int equal = 0;
  for (const CheckRecord& c : rep.checks) {
    EXPECT_TRUE(c.passed) << ranked[0]->candidate.name << ": " << c.what << ": " << c.detail;
    equal += c.passed && c.what.find("one device") != std::string::npos;
  }
  EXPECT_GE(equal, 2 * q.world()) << ranked[0]->candidate.name;
  // A layout as the table prints it.
  EXPECT_NE(format_table(p, 3).find(ranked[0]->candidate.name), std::string::npos);
}

TEST(Plan, LayersThatDoNotDivideGiveTheFirstAndLastStagesOneFewer) {
  Request r = tiny_request();
  r.shape["layers"] = option_text(6);  // on pp 4: 1 | 2 | 2 | 1
  const Question q = make_question(r);
  int uneven = 0;
  for (const Candidate& k : enumerate(q)) {
    if (k.layout.pp != 4 || k.layout.v != 1) continue;
    EXPECT_NE(k.status, Status::Invalid) << k.name << ": " << k.reason;
    if (k.layout.tp != 1 || k.layout.zero != 0 || k.layout.recompute != "none" || k.layout.micro_batch != 1)
      continue;
    ++uneven;
    EXPECT_EQ(lesson_settings(q, k.layout).at("decoder-first-pipeline-num-layers"), "1");
    EXPECT_LE(k.bound_us, run_gpt(q, k.layout, true).training->step_time_us) << k.name;
    const RunReport rep = run_gpt(q, k.layout, false);
    EXPECT_TRUE(rep.all_checks_passed()) << k.name << ": " << testing::failed_checks(rep);
  }
  EXPECT_EQ(uneven, 1);
}

TEST(Plan, NoSimulatedStepBeatsItsLowerBound) {
  const Plan p = search(tiny(), quiet());
  ASSERT_FALSE(p.ranked().empty());
  for (const Result* r : p.ranked()) {
    EXPECT_GT(r->candidate.bound_us, 0) << r->candidate.name;
    EXPECT_LE(r->candidate.bound_us, r->run->stats.step_time_us) << r->candidate.name;
  }
  EXPECT_GT(p.pruned, 0);  // the bound does its work on this question
}

// Every layout of `q` simulated (no pruning): none is faster than its bound, and the winner, with real
// numbers, passes the lesson's checks. The plan, for more.
Plan expect_bounds_hold_and_winner_passes(const Question& q) {
  SearchOptions all = quiet();
  all.prune = false;
  const Plan p = search(q, all);
  EXPECT_FALSE(p.ranked().empty());
  if (p.ranked().empty()) return p;
  for (const Result* res : p.ranked()) {
    EXPECT_LE(res->candidate.bound_us, res->run->stats.step_time_us) << res->candidate.name;
  }
  const RunReport rep = run_gpt(q, p.ranked()[0]->candidate.layout, false);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  return p;
}

// The llama block: its shapes bound every layout and its winner trains equal to one device.
TEST(Plan, TheLlamaBlocksBoundHoldsAndItsWinnerTrainsEqualToOneDevice) {
  Request r = tiny_request();
  r.shape["block"] = "llama";
  r.shape["kv-heads"] = option_text(2);
  r.shape["ffn-hidden"] = option_text(96);
  const Question q = make_question(r);
  EXPECT_NE(describe_question(q).find("llama block, 4 layers, hidden 64, 4 heads (2 key-value), SwiGLU 96"),
            std::string::npos)
      << describe_question(q);
  expect_bounds_hold_and_winner_passes(q);
}

// A mixture of experts in both blocks, every other layer MoE (the llama block's with a shared expert,
// dropped routes and its linear layers' GEMMs, the experts' among them, in FP8): layouts with each
// expert-parallel size that divides the experts and the stage's ranks, each expert whole or split over tp,
// are enumerated, none runs faster than its bound, and the winner trains equal to one device. A test per
// block keeps each well within a test's time.
void expect_expert_parallel_sizes_chosen(const char* block) {
  Request r = tiny_request();
  r.shape["block"] = block;
  r.shape["experts"] = option_text(8);
  r.shape["top-k"] = option_text(2);
  r.shape["moe-ffn-hidden"] = option_text(32);
  r.shape["moe-layers"] = "every:2";
  if (std::string(block) == "llama") {
    r.shape["shared-experts"] = option_text(1);
    r.shape["capacity-factor"] = option_text(0.75);
    r.shape["fp8-recipe"] = "current";
  }
  const Question q = make_question(r);
  if (std::string(block) == "llama") {
    EXPECT_EQ(q.fp8_recipe, "current");
  }
  std::set<int> eps;
  int split = 0;
  for (const Candidate& k : enumerate(q)) {
    if (k.status == Status::Invalid) continue;
    eps.insert(k.layout.ep);
    EXPECT_EQ(8 % k.layout.ep, 0) << k.name;
    EXPECT_TRUE(k.layout.etp == 1 || k.layout.etp == k.layout.tp) << k.name;
    if (k.layout.etp > 1) {
      ++split;
      EXPECT_NE(k.name.find(fmt::format("-etp{}", k.layout.etp)), std::string::npos) << k.name;
      EXPECT_EQ(parse_layout(k.name).etp, k.layout.etp) << k.name;
    }
  }
  EXPECT_EQ(eps, (std::set<int>{1, 2, 4, 8})) << block;
  EXPECT_GT(split, 0) << block;
  const Plan p = expect_bounds_hold_and_winner_passes(q);
  int spread = 0;
  for (const Result* res : p.ranked()) spread += res->candidate.layout.ep > 1;
  EXPECT_GT(spread, 0) << block;
}

TEST(Plan, MixtureOfExpertsLayoutsChooseTheExpertParallelSize) {
  expect_expert_parallel_sizes_chosen("gpt");
}

TEST(Plan, MixtureOfExpertsLayoutsChooseTheExpertParallelSizeWithTheLlamaBlock) {
  expect_expert_parallel_sizes_chosen("llama");
}

// ZeRO 2 and 3 over experts far wider than the model (16,384 of hidden 64) on two nodes: the experts'
// gathers and reductions over the ranks that hold them (the expert-data-parallel stream, which the bound
// counts: StepBound::expert_stream_us) weigh most in these steps. No step of the 92 such layouts is faster
// than its bound; counting the stream five times over exceeds 40 of them.
TEST(Plan, TheExpertStreamBoundIsBelowEveryStepItWeighsIn) {
  Request r = tiny_request();
  r.nodes = 2;
  r.shape["experts"] = option_text(8);
  r.shape["top-k"] = option_text(2);
  r.shape["moe-ffn-hidden"] = option_text(16384);
  const Question q = make_question(r);
  int checked = 0;
  for (const Candidate& k : enumerate(q)) {
    if (k.status != Status::Pending || k.layout.zero < 2 || k.layout.tp != 1 || k.layout.recompute != "none")
      continue;
#if defined(RANKLAB_SANITIZE)
    if (checked == 10) break;  // ten times slower under the sanitizers: the first ten
#endif
    const double step_us = run_gpt(q, k.layout, true).training->step_time_us;
    EXPECT_LE(k.bound_us, step_us) << k.name;
    ++checked;
  }
#if !defined(RANKLAB_SANITIZE)
  EXPECT_EQ(checked, 92);
#endif
}

// Full recomputation runs the forward once more, its collectives included (Model::rebuild), and the bound
// counts them again: on a machine whose NVLink is ten times slower, a full-recompute layout's bound grows
// by more than the same layout's without recomputation, where the forward has collectives the compute
// waits for (a MoE layer's all-to-alls), and selective recomputation's (attention alone) by as much as
// none's.
TEST(Plan, FullRecomputationsBoundCountsTheForwardsCollectivesAgain) {
  Request r = tiny_request();
  r.shape["experts"] = option_text(8);
  r.shape["top-k"] = option_text(2);
  r.shape["moe-layers"] = "every:2";
  const Question q = make_question(r);
  Profile slow = q.profile;
  slow.nvlink.link_bandwidth_gbps /= 10;
  StepBound fast_bound(q.profile), slow_bound(slow);
  int grew = 0, checked = 0;
  for (const Candidate& k : enumerate(q)) {
    if (k.status == Status::Invalid || k.layout.recompute != "none" || k.layout.pp != 1 || k.layout.zero > 1)
      continue;
    auto growth = [&](const char* recompute) {
      Layout l = k.layout;
      l.recompute = recompute;
      const gpt::Config c = lesson_config(q, l);
      return slow_bound.us(c) - fast_bound.us(c);
    };
    const double none = growth("none"), selective = growth("selective"), full = growth("full");
    EXPECT_NEAR(selective, none, 1e-9 * (1 + none)) << k.name;
    EXPECT_GE(full, none - 1e-9 * (1 + none)) << k.name;
    grew += full > none * (1 + 1e-6) + 1e-9;
    ++checked;
  }
  EXPECT_GT(checked, 10);
  EXPECT_GT(grew, 0);
}

// The enumeration reads the question's flags once and shares memory-plan parts between layouts: each
// layout's configuration, planned bytes and bound are what it gets alone (the lesson's reading of all its
// flags, gpt::memory_plan, a fresh bound), for a dense and a MoE question on two nodes, where the group
// orders, ZeRO stages, micro-batches, expert-parallel sizes and (tried with --try-fp8) FP8 GEMMs all vary.
TEST(Plan, EachEnumeratedLayoutIsComputedAsItWouldBeAlone) {
  for (int experts : {0, 8}) {
    Request r = tiny_request();
    r.nodes = 2;
    r.shape["global-batch"] = option_text(32);
    if (experts == 0) r.try_fp8 = "current";  // each layout in bf16 and with FP8 GEMMs
    if (experts > 0) {
      r.shape["experts"] = option_text(experts);
      r.shape["top-k"] = option_text(2);
      r.shape["moe-layers"] = "every:2";
    }
    const Question q = make_question(r);
    const std::vector<Candidate> all = enumerate(q);
    std::set<std::string> orders;
    std::set<bool> fp8;
    int checked = 0;
    for (const Candidate& k : all) {
      if (k.status == Status::Invalid) continue;
      const gpt::Config alone = gpt::for_gpu(
          gpt::resolve(gpt::options_table().read(lesson_settings(q, k.layout), "gpt"), q.world()),
          q.profile.gpu);
      EXPECT_EQ(gpt::options_table().write(lesson_config(q, k.layout)), gpt::options_table().write(alone))
          << k.name;
      std::int64_t most = 0;
      for (int s = 0; s < alone.pp; ++s) most = std::max(most, gpt::memory_plan(alone, s).total());
      EXPECT_EQ(k.planned_bytes, most) << k.name;
      EXPECT_EQ(k.bound_us, StepBound(q.profile).us(alone)) << k.name;
      orders.insert(k.layout.order);
      fp8.insert(k.layout.fp8);
      EXPECT_EQ(alone.fp8 != parallel::Fp8Recipe::None, k.layout.fp8) << k.name;
      ++checked;
    }
    EXPECT_EQ(orders.size(), 2u);
    EXPECT_EQ(fp8.size(), experts == 0 ? 2u : 1u);
    EXPECT_GT(checked, 100) << experts;
  }
}

// FP8 (--dtype fp8): every layout runs its linear GEMMs in FP8, none is faster than its bound (which takes
// the FP8 GEMMs' time), the question says so, and the winner trains within FP8's tolerance of one device.
TEST(Plan, AnFp8QuestionBoundsEveryLayoutAndItsWinnerPassesTheCheck) {
  Request r = tiny_request();
  r.shape["dtype"] = "fp8";
  const Question q = make_question(r);
  EXPECT_EQ(q.fp8_recipe, "none");  // as given; the lesson reads --dtype fp8 as the current recipe
  EXPECT_NE(describe_question(q).find("global batch 16; fp8 on 8"), std::string::npos)
      << describe_question(q);
  const Plan p = expect_bounds_hold_and_winner_passes(q);
  for (const Result* res : p.ranked()) {
    EXPECT_EQ(lesson_config(q, res->candidate.layout).fp8, parallel::Fp8Recipe::Current);
  }
}

// Two llama layers of 32 features over a 4,096-token sequence, two sequences a step, one chunk a stage: a
// question long enough for context parallelism.
Request long_sequence_request() {
  Request r;
  r.shape["block"] = "llama";
  r.shape["layers"] = option_text(2);
  r.shape["hidden"] = option_text(32);
  r.shape["heads"] = option_text(2);
  r.shape["seq"] = option_text(4096);
  r.shape["vocab"] = option_text(128);
  r.shape["global-batch"] = option_text(2);
  r.max_interleave = 1;
  return r;
}

// A long sequence: layouts with context parallelism are enumerated (a chunk of at least kMinCpChunk
// tokens) and named, none runs faster than its bound, and a simulated cp layout, with real numbers, trains
// equal to one device.
TEST(Plan, ContextParallelLayoutsAreBoundedAndTrainEqualToOneDevice) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP() << "a 4,096-token sequence with real numbers: the ordinary build runs it";
#endif
  const Question q = make_question(long_sequence_request());
  SearchOptions all = quiet();
  all.prune = false;
  const Plan p = search(q, all);
  const Result* with_cp = nullptr;
  int cp_layouts = 0;
  for (const Result& res : p.results) {
    const Layout& l = res.candidate.layout;
    EXPECT_TRUE(l.cp == 1 || l.cp == 2) << res.candidate.name;  // 4096 / (2 cp) >= 1024
    if (l.cp == 1) continue;
    ++cp_layouts;
    EXPECT_NE(res.candidate.name.find("-cp2-"), std::string::npos) << res.candidate.name;
    EXPECT_EQ(parse_layout(res.candidate.name).name(), res.candidate.name);
    if (res.candidate.status == Status::Simulated && (with_cp == nullptr || l.micro_batch == 1))
      with_cp = &res;
  }
  EXPECT_GT(cp_layouts, 0);
  for (const Result* res : p.ranked())
    EXPECT_LE(res->candidate.bound_us, res->run->stats.step_time_us) << res->candidate.name;
  ASSERT_NE(with_cp, nullptr);
  // One step: the one-device reference of a 4,096-token sequence takes seconds a step.
  Settings o = lesson_settings(q, with_cp->candidate.layout);
  o["phantom"] = option_text(false);
  SimConfig config;
  config.profile = q.profile;
  config.echo_output = false;
  SimBackend backend(config);
  const RunReport rep = run_lesson(backend, "gpt", o);
  EXPECT_TRUE(rep.all_checks_passed()) << with_cp->candidate.name << "\n" << testing::failed_checks(rep);
}

// Sliding windows in every other layer, with sinks: each windowed layer's attention is bounded by its
// window's pairs (shared over the cp ranks), so no layout, with or without context parallelism, runs faster
// than its bound, and the bound of a layout is below the same layout's without the window.
TEST(Plan, SlidingWindowLayersAreBoundedByTheirWindowsPairs) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP() << "every layout of a 4,096-token sequence simulated: the ordinary build runs it";
#endif
  Request r = long_sequence_request();
  r.shape["sliding-window"] = option_text(256);
  r.shape["sliding-window-layers"] = "every:2";
  r.shape["attention-sinks"] = option_text(true);
  const Question q = make_question(r);
  SearchOptions all = quiet();
  all.prune = false;
  const Plan p = search(q, all);
  int cp_layouts = 0;
  for (const Result* res : p.ranked()) {
    cp_layouts += res->candidate.layout.cp > 1;
    EXPECT_LE(res->candidate.bound_us, res->run->stats.step_time_us) << res->candidate.name;
  }
  EXPECT_GT(cp_layouts, 0);
  const Result& first = *p.ranked()[0];
  gpt::Config windowed = lesson_config(q, first.candidate.layout);
  gpt::Config whole = windowed;
  whole.sliding_window = 0;
  EXPECT_LT(StepBound(q.profile).us(windowed), StepBound(q.profile).us(whole));
}

// Across two nodes the tensor-parallel collectives, the sends and ZeRO's data-parallel stream are part of
// the bound: every layout simulated, none faster than its bound, and the pruned search finds the same
// winner.
TEST(Plan, TheBoundHoldsAcrossNodesAndPruningKeepsTheWinner) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP() << "hundreds of simulations: the ordinary build runs it";
#endif
  for (const char* block : {"gpt", "llama"}) {
    SCOPED_TRACE(block);
    Request r;
    r.shape["block"] = block;
    r.shape["layers"] = option_text(4);
    r.shape["hidden"] = option_text(512);
    r.shape["heads"] = option_text(8);
    if (std::string(block) == "llama") {
      r.shape["kv-heads"] = option_text(4);
      r.shape["ffn-hidden"] = option_text(1408);
    }
    r.shape["seq"] = option_text(512);
    r.shape["vocab"] = option_text(4096);
    r.shape["global-batch"] = option_text(8);
    r.nodes = 2;
    r.max_interleave = 2;
    const Question q = make_question(r);
    SearchOptions all = quiet();
    all.prune = false;
    const Plan every = search(q, all), pruned = search(q, quiet());
    ASSERT_GT(every.simulated, 100);
    for (const Result* res : every.ranked())
      EXPECT_LE(res->candidate.bound_us, res->run->stats.step_time_us) << res->candidate.name;
    EXPECT_LT(pruned.simulated, every.simulated);
    EXPECT_EQ(pruned.ranked().at(0)->candidate.name, every.ranked().at(0)->candidate.name);
  }
}

// A probe measures each stage's kernels per micro-batch from two short steps (measure_stage_kernels). With
// them, every bound of a dense and a MoE question on two nodes stays below the layout's step, screened and
// with every rank running, and is at least the model's own bound; it raises some of the dense layouts' and
// most of the MoE ones'. A cutoff between the two bounds prunes a layout without its screening, and the
// search finds the same winner with and without probing.
TEST(Plan, AProbedBoundIsBelowTheStepAndPrunes) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    Request r = testing::llama512_request(4, 64);
    if (moe) {
      r.shape["experts"] = option_text(8);
      r.shape["top-k"] = option_text(2);
      r.shape["moe-ffn-hidden"] = option_text(704);
    }
    r.max_interleave = 2;
    const Question q = make_question(r);
    StepBound bound(q.profile);
    int pending = 0, checked = 0, raised = 0, pruned = 0;
    for (const Candidate& k : enumerate(q)) {
      if (k.status != Status::Pending || pending++ % 97 != 0) continue;  // every 97th layout
#if defined(RANKLAB_SANITIZE)
      if (checked == 1) break;  // ten times slower under the sanitizers
#endif
      SCOPED_TRACE(k.name);
      const std::optional<std::vector<double>> kernels = measure_stage_kernels(q, k.layout);
      ASSERT_TRUE(kernels.has_value());
      ASSERT_EQ(static_cast<int>(kernels->size()), k.layout.pp);
      const double probed_us = bound.us(lesson_config(q, k.layout), *kernels);
      EXPECT_GE(probed_us, k.bound_us);
      const Result screened = simulate(q, k.layout, true, false);
      ASSERT_EQ(screened.candidate.status, Status::Simulated) << screened.candidate.reason;
      EXPECT_FALSE(screened.candidate.probed);
      EXPECT_LE(probed_us, screened.run->stats.step_time_us);
      EXPECT_LE(probed_us, run_gpt(q, k.layout, true).training->step_time_us);
      ++checked;
      if (probed_us <= k.bound_us) continue;
      ++raised;
      // A step between the two bounds: the probe puts the layout out of its reach when it probes at all
      // (a step of 25 micro-batches or more), and a step above both leaves it to the screening.
      const Result against_between =
          simulate(q, k.layout, true, false, Cutoff{(k.bound_us + probed_us) / 2, "a"});
      const Result against_above = simulate(q, k.layout, true, false, Cutoff{2 * probed_us, "a"});
      const bool probes =
          lesson_config(q, k.layout).micro_batches() >= 25 * (k.layout.v > 1 ? k.layout.pp : 1);
      EXPECT_EQ(against_between.candidate.probed, probes);
      EXPECT_EQ(against_between.candidate.status, probes ? Status::PrunedBound : Status::Simulated);
      EXPECT_EQ(against_between.candidate.bound_us, probes ? probed_us : k.bound_us);
      EXPECT_FALSE(against_between.run.has_value() && probes);
      EXPECT_EQ(against_above.candidate.status, Status::Simulated);
      EXPECT_EQ(against_above.candidate.probed, probes);
      pruned += probes;
    }
#if !defined(RANKLAB_SANITIZE)
    EXPECT_GT(checked, 2);
    EXPECT_GT(raised, 0);
    if (moe) {
      EXPECT_GT(2 * raised, checked);
      EXPECT_GT(pruned, 0);
    }
#else
    EXPECT_EQ(checked, 1);
    static_cast<void>(raised + pruned);
#endif
  }
}

// A deep model on a device made small, so that its layouts run deep pipelines (deep_pipeline_question): the
// search probes some of them and prunes one by what it measured; it screens fewer than without probing
// and finds the same winner, and the probes change nothing with more jobs.
TEST(Plan, ProbingPrunesInTheSearchAndKeepsTheWinner) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP() << "three searches of a few dozen simulations: the ordinary build runs it";
#endif
  const Question q = testing::deep_pipeline_question();
  SearchOptions o = quiet(), plain = quiet(), two = quiet();
  plain.probe = false;
  two.jobs = 2;
  const Plan probing = search(q, o), not_probing = search(q, plain);
  EXPECT_GT(probing.probed, 0);
  EXPECT_GT(probing.pruned_by_probe, 0);
  EXPECT_EQ(not_probing.probed, 0);
  EXPECT_LT(probing.simulated, not_probing.simulated);
  ASSERT_FALSE(probing.ranked().empty());
  EXPECT_EQ(probing.ranked()[0]->candidate.name, not_probing.ranked().at(0)->candidate.name);
  for (const Result& res : probing.results) {
    if (res.candidate.status != Status::Simulated) continue;
    EXPECT_LE(res.candidate.bound_us, res.run->stats.step_time_us) << res.candidate.name;
  }
  const Plan in_two = search(q, two);
  EXPECT_EQ(in_two.probed, probing.probed);
  EXPECT_EQ(in_two.pruned_by_probe, probing.pruned_by_probe);
  EXPECT_EQ(format_table(in_two, 10), format_table(probing, 10));
}

TEST(Plan, AcceptedLayoutsFitAndRejectedOnesRunOutOfMemory) {
  Question q = tiny();
  // 0.94 MiB: the tiny model's layouts need from 0.6 to 4 MiB by the memory plan, and the simulated peak is
  // up to 25 KiB above the plan (tp2-pp2-dp2-zero2-mb4-full's, 0.95 MiB), so some fit, some are over by the
  // plan and some only when run.
  q.profile.gpu.hbm_capacity_gib = 0.94 / 1024;
  SearchOptions o = quiet();
  const Plan p = search(q, o);
  int accepted = 0, rejected_by_plan = 0, rejected_by_run = 0;
#if defined(RANKLAB_SANITIZE)
  int seen = 0;
#endif
  for (const Result& r : p.results) {
    const Status s = r.candidate.status;
    if (s != Status::Simulated && s != Status::RejectedMemory) continue;
#if defined(RANKLAB_SANITIZE)
    if (seen++ % 8 != 0) continue;  // an eighth of them, under the sanitizers
#endif
    if (s == Status::Simulated) {
      ++accepted;
      EXPECT_NO_THROW(run_gpt(q, r.candidate.layout, true)) << r.candidate.name;
      EXPECT_LE(r.run->peak_bytes, q.profile.hbm_capacity_bytes()) << r.candidate.name;
    } else {
      (r.candidate.reason.find("memory plan") != std::string::npos ? rejected_by_plan : rejected_by_run)++;
      EXPECT_THROW(run_gpt(q, r.candidate.layout, true), OutOfMemoryError) << r.candidate.name;
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected_by_plan, 0);
#if !defined(RANKLAB_SANITIZE)
  EXPECT_GT(rejected_by_run, 0);
#endif
}

TEST(Plan, TheSameQuestionGivesTheSameRanking) {
  const Question q = tiny();
  const Plan a = search(q, quiet()), b = search(q, quiet());
  ASSERT_EQ(a.results.size(), b.results.size());
  for (std::size_t i = 0; i < a.results.size(); ++i) {
    EXPECT_EQ(a.results[i].candidate.name, b.results[i].candidate.name) << i;
    EXPECT_EQ(a.results[i].candidate.status, b.results[i].candidate.status) << i;
    if (a.results[i].run && b.results[i].run) {
      EXPECT_EQ(a.results[i].run->stats.step_time_us, b.results[i].run->stats.step_time_us) << i;
    }
  }
  EXPECT_EQ(format_table(a, 10), format_table(b, 10));
}

// 2 layers, hidden 512, 2 heads, seq 512, vocab 4096, global batch 32 on four nodes (32 ranks) whose fat
// tree has leaves of two nodes and a spine tier with a quarter of the leaves' bandwidth: data-parallel
// traffic crosses the spines, where ECMP's hashed routes make the replicas' transfers differ.
Question across_spines() {
  Request r;
  r.shape["layers"] = option_text(2);
  r.shape["hidden"] = option_text(512);
  r.shape["heads"] = option_text(2);
  r.shape["seq"] = option_text(512);
  r.shape["vocab"] = option_text(4096);
  r.shape["global-batch"] = option_text(32);
  r.nodes = 4;
  r.max_interleave = 1;
  Question q = make_question(r);
  q.profile.fabric.switch_radix = 4;
  q.profile.fabric.oversubscription = 4;
  return q;
}

// One step of `ranklab run gpt` with the layout, as the planner runs it (phantom tensors), with every rank
// running or one per pipeline stage.
TrainingStats one_step(const Question& q, const Layout& l, bool symmetric) {
  SimConfig c;
  c.profile = q.profile;
  c.echo_output = false;
  if (symmetric) c.symmetry = symmetry_of(l);
  SimBackend backend(c);
  return *run_lesson(backend, "gpt", lesson_settings(q, l)).training;
}

// --confirm 0 takes the screenings as the answer: no layout runs again, not even the best.
TEST(Plan, ConfirmingNoneRunsNothingAgain) {
  SearchOptions o = quiet();
  o.confirm = 0;
  const Plan p = search(tiny(), o);
  ASSERT_FALSE(p.ranked().empty());
  EXPECT_EQ(p.confirmed, 0);
  for (const Result* r : p.ranked()) EXPECT_FALSE(r->full) << r->candidate.name;
}

// The leading rows are full runs: their figures are `run gpt`'s without the symmetry (here equal to the
// screening's, since a symmetric operation waits for its replicas' copies; they need not be in general);
// the rows after them are labelled as the screening's.
TEST(Plan, TheLeadingRowsAreFullRunsEqualToRunGpt) {
  const Question q = across_spines();
  SearchOptions o = quiet();
  o.confirm = 2;
  const Plan p = search(q, o);
  const std::vector<const Result*> ranked = p.ranked();
  ASSERT_GE(ranked.size(), 3u);
  EXPECT_GE(p.confirmed, 2);
  for (int i = 0; i < 2; ++i) {
    const Result& r = *ranked[i];
    ASSERT_TRUE(r.full) << r.candidate.name;
    ASSERT_TRUE(r.screening.has_value()) << r.candidate.name;
    EXPECT_EQ(r.run->stats.step_time_us, one_step(q, r.candidate.layout, false).step_time_us)
        << r.candidate.name;
    EXPECT_EQ(r.screening->stats.step_time_us, one_step(q, r.candidate.layout, true).step_time_us)
        << r.candidate.name;
  }
  // Below the confirmed ones, unless close to the best, the screening's figures, and said so.
  const Result& third = *ranked[2];
  if (third.screening->stats.step_time_us > ranked[0]->run->stats.step_time_us * (1 + o.confirm_margin)) {
    EXPECT_FALSE(third.full);
    EXPECT_EQ(third.run->stats.step_time_us, third.screening->stats.step_time_us);
  }
  const std::string table = format_table(p, 3);
  EXPECT_NE(table.find(ranked[0]->candidate.name + "  "), std::string::npos);
  EXPECT_NE(table.find(" full "), std::string::npos);
  EXPECT_NE(plan_to_json(p).find("\"simulation\": \"full\""), std::string::npos);
  // No screened layout outside the confirmed set could beat the winner: none screened faster than it.
  for (const Result* r : ranked) {
    if (!r->full) {
      EXPECT_GE(r->screening->stats.step_time_us, ranked[0]->run->stats.step_time_us);
    }
  }
}

// Simulations at once change the time taken, not the answer: the same statuses, step times and table as
// one at a time, with and without a limit on the simulations.
// A screening of a long step extends steps of 2 p and 4 p micro-batches to m; what it gives is the whole
// step's, plain and interleaved, with the memory of the whole step. On a model whose micro-batches take
// milliseconds every figure is; on a tiny one, whose pipeline is bound by the transfers' latency and settles
// later, the step is and the exposed times are not.
TEST(Plan, ALongStepScreenedFromTwoShortOnesIsTheWholeStep) {
  Request r = tiny_request();
  r.shape["layers"] = option_text(8);
  r.shape["hidden"] = option_text(2048);
  r.shape["heads"] = option_text(16);
  r.shape["seq"] = option_text(1024);
  r.shape["vocab"] = option_text(32768);
  r.shape["global-batch"] = option_text(96);  // m = 48 with dp 2: 12 p with pp 4
  for (const bool tiny_model : {false, true}) {
    const Question q = tiny_model ? [] {
      Question t = tiny();
      t.global_batch = 96;
      return t;
    }()
                                  : make_question(r);
    for (const Layout& l : {Layout{1, 4, 1, 2, 1, false, 1, "none", "tp-dp-pp"},
                            Layout{2, 2, 2, 2, 1, true, 1, "none", "tp-dp-pp"}}) {
      SCOPED_TRACE(l.name() + (tiny_model ? ", tiny model" : ""));
      const Result whole = simulate(q, l, true, false), screened = simulate(q, l, true, true);
      ASSERT_EQ(whole.candidate.status, Status::Simulated) << whole.candidate.reason;
      ASSERT_EQ(screened.candidate.status, Status::Simulated) << screened.candidate.reason;
      EXPECT_EQ(whole.run->extrapolated_from, 0);
      EXPECT_EQ(screened.run->extrapolated_from, 2 * l.pp);
      const TrainingStats &w = whole.run->stats, &s = screened.run->stats;
      EXPECT_EQ(s.micro_batches, w.micro_batches);
      EXPECT_EQ(s.tokens_per_step, w.tokens_per_step);
      EXPECT_NEAR(s.step_time_us, w.step_time_us, 2e-3 * w.step_time_us);
      EXPECT_NEAR(s.mfu, w.mfu, 2e-3 * w.mfu);
      if (tiny_model) continue;
      EXPECT_NEAR(s.bubble_fraction, w.bubble_fraction, 0.002);
      for (const auto& [dim, us] : w.exposed_comm_us)
        EXPECT_NEAR(s.exposed_comm_us.at(dim), us, 2e-3 * w.step_time_us) << dim;
      EXPECT_NEAR(static_cast<double>(screened.run->peak_bytes), static_cast<double>(whole.run->peak_bytes),
                  1e-4 * static_cast<double>(whole.run->peak_bytes));
    }
  }
}

TEST(Plan, JobsDoNotChangeTheAnswer) {
  for (const bool limited : {false, true}) {
    const Question q = limited ? tiny() : across_spines();
    SearchOptions one = quiet(), four = quiet();
    if (limited) one.max_candidates = four.max_candidates = 7;
    one.jobs = 1;
    four.jobs = 4;
    const Plan a = search(q, one), b = search(q, four);
    ASSERT_EQ(a.results.size(), b.results.size());
    for (std::size_t i = 0; i < a.results.size(); ++i) {
      const Result &x = a.results[i], &y = b.results[i];
      EXPECT_EQ(x.candidate.name, y.candidate.name) << i;
      EXPECT_EQ(x.candidate.status, y.candidate.status) << x.candidate.name;
      EXPECT_EQ(x.full, y.full) << x.candidate.name;
      if (x.run && y.run) {
        EXPECT_EQ(x.run->stats.step_time_us, y.run->stats.step_time_us) << x.candidate.name;
      }
    }
    EXPECT_EQ(a.simulated, b.simulated);
    EXPECT_EQ(a.pruned, b.pruned);
    EXPECT_EQ(a.probed, b.probed);
    EXPECT_EQ(a.pruned_by_probe, b.pruned_by_probe);
    EXPECT_EQ(a.unexplored, b.unexplored);
    EXPECT_EQ(a.confirmed, b.confirmed);
    EXPECT_EQ(format_table(a, 10), format_table(b, 10));
    if (limited) {
      EXPECT_EQ(a.simulated + a.rejected_by_run, 7);
    }
  }
}

void expect_usage_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a UsageError mentioning " << needle;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Plan, BadInputIsAClearUsageError) {
  Request r;
  r.shape["model"] = option_text("gpt5");
  expect_usage_error([&] { make_question(r); }, "no preset called 'gpt5'");
  r = Request{};
  r.top = 0;
  expect_usage_error([&] { make_question(r); }, "--top must be at least 1 (got 0)");
  r = Request{};
  r.shape["hidden"] = option_text(65);
  expect_usage_error([&] { make_question(r); }, "--hidden 65 is not divisible by --heads 4");
  r = Request{};
  r.shape["experts"] = option_text(4);
  r.shape["top-k"] = option_text(5);
  expect_usage_error([&] { make_question(r); }, "--top-k 5");
  r = Request{};
  r.shape["routing"] = "skew:2";  // how a phantom run routes is not part of the shape
  expect_usage_error([&] { make_question(r); }, "plan: --routing is not part of a shape");
  r = Request{};
  r.profile = "no-such-profile";
  EXPECT_THROW(make_question(r), ProfileError);
  r = Request{};
  r.nodes = 1'000'000'000;  // 8 x 10^9 GPUs: the product wrapped to a negative world
  expect_usage_error([&] { make_question(r); },
                     "--nodes 1000000000: 1000000000 nodes x 8 GPUs per node (dgx-h100) = 8000000000");
  // 2 heads and 2 layers on 8 ranks leave dp at 2 or more, and 3 sequences divide among none of them.
  r = Request{};
  r.shape["layers"] = option_text(2);
  r.shape["heads"] = option_text(2);
  r.shape["global-batch"] = option_text(3);
  const Question q = make_question(r);
  expect_usage_error([&] { search(q, quiet()); }, "the gpt lesson accepts none of the");
  expect_usage_error([&] { search(q, quiet()); }, "--global-batch 3 is not divisible");
  expect_usage_error([] { parse_layout("tp4-pp2"); }, "too few parts");
  expect_usage_error([] { parse_layout("tp4-pp2-v1-dp1-zero0-mb1-some-tp-dp-pp"); },
                     "none, selective or full");
  // FP8 tried on a GPU without FP8 tensor cores, or on a question already in FP8.
  r = Request{};
  r.profile = "dgx-a100";
  r.try_fp8 = "current";
  expect_usage_error([&] { make_question(r); },
                     "plan: --try-fp8 current: gpt: --fp8-recipe current: the A100");
  r = Request{};
  r.try_fp8 = "current";
  r.shape["dtype"] = "fp8";
  expect_usage_error([&] { make_question(r); }, "the question is already fp8");
  r = Request{};
  r.explain = "tp1-pp2-v1-dp4-zero1-mb4-none-fp8-tp-dp-pp";
  expect_usage_error([&] { plan_command(r, nullptr); }, "is one of a question asked with --try-fp8 RECIPE");
  r = Request{};
  r.try_fp8 = "fp4";
  expect_usage_error([&] { make_question(r); }, "plan: --try-fp8 fp4: gpt: --fp8-recipe must be");
}

// --model fills the shape the flags leave, as `ranklab run gpt --model` does; a flag given wins.
TEST(Plan, APresetFillsWhatTheFlagsLeave) {
  Request r;
  r.shape["model"] = option_text("llama3-70b");
  r.shape["seq"] = option_text(4096);
  const Question q = make_question(r);
  EXPECT_EQ(q.model, "llama3-70b");
  EXPECT_EQ(q.layers, 80);
  EXPECT_EQ(q.hidden, 8192);
  EXPECT_EQ(q.heads, 64);
  EXPECT_EQ(q.vocab, 128256);
  EXPECT_EQ(q.global_batch, 512);
  EXPECT_EQ(q.seq, 4096);
  EXPECT_EQ(make_question(Request{}).model, "custom");
}

TEST(Plan, LayoutNamesReadBack) {
  for (const Layout& l : {Layout{4, 8, 2, 16, 1, true, 1, "selective", "tp-dp-pp"},
                          Layout{1, 1, 1, 8, 0, false, 4, "none", "tp-pp-dp"},
                          Layout{2, 2, 1, 4, 1, true, 1, "none", "tp-dp-pp", 2, 8},
                          Layout{2, 2, 1, 4, 1, true, 1, "full", "tp-pp-dp", 1, 1, true}}) {
    const Layout back = parse_layout(l.name());
    EXPECT_EQ(back.name(), l.name());
  }
  EXPECT_EQ(Layout({4, 8, 2, 16, 1, true, 1, "selective", "tp-dp-pp"}).name(),
            "tp4-pp8-v2-dp16-zero1-sp-mb1-selective-tp-dp-pp");
  EXPECT_EQ(Layout({2, 2, 1, 4, 1, true, 1, "none", "tp-dp-pp", 2, 8}).name(),
            "tp2-cp2-pp2-v1-dp4-ep8-zero1-sp-mb1-none-tp-dp-pp");
  EXPECT_EQ(Layout({2, 2, 1, 4, 1, true, 1, "full", "tp-pp-dp", 1, 1, true}).name(),
            "tp2-pp2-v1-dp4-zero1-sp-mb1-full-fp8-tp-pp-dp");
}

TEST(Plan, SymmetryFollowsTheGroupOrder) {
  const SimSymmetry a = symmetry_of(Layout{4, 8, 1, 16, 1, true, 1, "none", "tp-dp-pp"});
  EXPECT_EQ(a.dims, (std::vector<int>{4, 16, 8}));
  EXPECT_EQ(a.replicated, (std::vector<bool>{true, true, false}));
  const SimSymmetry b = symmetry_of(Layout{4, 8, 1, 16, 1, true, 1, "none", "tp-pp-dp"});
  EXPECT_EQ(b.dims, (std::vector<int>{4, 8, 16}));
  EXPECT_EQ(b.replicated, (std::vector<bool>{true, false, true}));
}

TEST(Plan, ReportsNameEveryLayoutAndTheWinner) {
  const Plan p = search(tiny(), quiet());
  const std::string json = plan_to_json(p), html = plan_to_html(p);
  const std::string winner = p.ranked().at(0)->candidate.name;
  EXPECT_NE(json.find("\"winner\": \"" + winner + "\""), std::string::npos);
  for (const char* status : {"\"simulated\"", "\"invalid\"", "\"pruned-bound\""})
    EXPECT_NE(json.find(status), std::string::npos) << status;
  EXPECT_NE(html.find("<svg id=\"scatter\""), std::string::npos);
  EXPECT_NE(html.find(assets::page_css), std::string::npos);  // the pages' shared stylesheet, inline
  EXPECT_NE(html.find("id=\"winner\""), std::string::npos);
  EXPECT_NE(html.find(winner), std::string::npos);
  const std::vector<const Result*> r = p.ranked();
  ASSERT_GE(r.size(), 2u);
  EXPECT_NE(why_line(*r[0], *r[1]).find(winner), std::string::npos);
  EXPECT_NE(format_explain(*r[1], *r[0]).find("where the step's time goes"), std::string::npos);
}

}  // namespace
}  // namespace ranklab::plan
