// The gpt lesson in FP8 (--fp8-recipe): it trains with each recipe within its stated tolerance of one
// device, its experts' GEMMs too, catches a broken reduction, plans the FP8 weight copies it holds, and
// refuses recipes the GPU or the run cannot take.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "gpt_fixture.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/parallel/fp8.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

Settings eight_ranks(const std::string& recipe) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(8);
  o["tp"] = option_text(2);
  o["pp"] = option_text(2);
  o["zero"] = option_text(1);
  o["seq-parallel"] = option_text(true);
  o["fp8-recipe"] = recipe;
  return o;
}

RunReport run_on(const std::string& profile, const Settings& o) {
  SimConfig config = testing::quiet_config();
  config.profile = load_profile(profile);
  SimBackend backend(config);
  return run_lesson(backend, "gpt", o);
}

TEST(GptFp8, EachRecipeTrainsWithinItsToleranceOfOneDevice) {
  for (const std::string recipe : {"current", "delayed", "blockwise"}) {
    const RunReport rep = run_on("dgx-h100", eight_ranks(recipe));
    EXPECT_TRUE(rep.all_checks_passed()) << recipe << "\n" << testing::failed_checks(rep);
  }
  Settings llama = eight_ranks("mxfp8");
  llama["block"] = "llama";
  llama["kv-heads"] = option_text(2);
  const RunReport mx = run_on("dgx-b200", llama);
  EXPECT_TRUE(mx.all_checks_passed()) << testing::failed_checks(mx);
}

TEST(GptFp8, ZeroThreeQuantizesEachGatheredWeightAndPasses) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(4);
  o["zero"] = option_text(3);
  o["dtype"] = "fp8";
  const RunReport rep = run_on("dgx-h100", o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

// A hundred steps of the lesson's defaults with FP8 GEMMs (bf16, dp 4, current scaling) train the tiny model
// near its minimum, where a layernorm gain's gradient, a sum over tokens of dy xhat with dy from an e5m2
// GEMM, mostly cancels: layer 1's ln2 gain was off by 0.64 of its largest value (tolerance 0.5), while
// against the sum of its terms' magnitudes, which set its rounding, the worst gradient is off by 0.31.
TEST(GptFp8, TrainingNearItsMinimumPassesTheCheck) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP()
      << "a hundred steps take the sanitizers' build past a test's 30 s; the ordinary build runs them";
#endif
  Settings o = testing::defaults_for_steps(100);
  o["dtype"] = option_text("fp8");
  const RunReport rep = run_on("dgx-h100", o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

// A data-parallel sum left undivided doubles the gradients: far outside FP8's tolerance.
TEST(GptFp8, ABrokenReductionFailsTheCheck) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(4);
  o["fp8-recipe"] = "current";
  o["break"] = "dp-sum";
  const RunReport rep = run_on("dgx-h100", o);
  EXPECT_FALSE(rep.all_checks_passed());
}

TEST(GptFp8, RecipesTheHardwareOrTheRunCannotTakeAreRefused) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(2);
  o["dtype"] = "fp8";
  try {
    run_on("dgx-a100", o);
    ADD_FAILURE() << "fp8 on A100 ran";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-recipe current: the A100"), std::string::npos) << e.what();
  }
  o["fp8-recipe"] = "mxfp8";
  testing::expect_usage_error(o, "--fp8-recipe mxfp8: the H100 SXM5 80GB's tensor cores do not apply MX");
  o.erase("dtype");
  o["dtype"] = "fp32";
  o["fp8-recipe"] = "current";
  testing::expect_usage_error(o, "--dtype is float32: give --dtype bf16 (or fp8)");
}

// Experts' GEMMs in FP8, each expert's linear layers quantized on their own: every recipe on ep 2
// (Blackwell's MXFP8 with the llama block), and delayed scaling beside tp 2, sp, pp 2, etp 2, shared experts
// and ZeRO 1, where the ranks of a stage reduce their experts' amaxes by position (an expert that receives no
// rows on one rank still has its histories there). However FP8 is asked for, the memory plan holds.
TEST(GptFp8, ExpertsTrainInFp8WithinTheToleranceOfOneDevice) {
#if defined(RANKLAB_SANITIZE)
  GTEST_SKIP() << "every recipe on experts takes the sanitizers' build past a test's 30 s on a slow VM; the "
                  "ordinary build runs them";
#endif
  auto experts = [](int world, int ep, const std::string& recipe) {
    Settings o = testing::tiny_gpt();
    o["world"] = option_text(world);
    o["experts"] = option_text(4);
    o["top-k"] = option_text(2);
    o["ep"] = option_text(ep);
    o["fp8-recipe"] = recipe;
    return o;
  };
  for (const std::string recipe : {"current", "delayed", "blockwise"}) {
    const RunReport rep = run_on("dgx-h100", experts(4, 2, recipe));
    EXPECT_TRUE(rep.all_checks_passed()) << recipe << "\n" << testing::failed_checks(rep);
  }
  Settings mx = experts(4, 2, "mxfp8");
  mx["block"] = "llama";
  mx["kv-heads"] = option_text(2);
  const RunReport blackwell = run_on("dgx-b200", mx);
  EXPECT_TRUE(blackwell.all_checks_passed()) << testing::failed_checks(blackwell);
  Settings all = experts(8, 2, "delayed");
  all.merge(Settings{{"block", "llama"},
                     {"kv-heads", "2"},
                     {"tp", "2"},
                     {"seq-parallel", "true"},
                     {"pp", "2"},
                     {"etp", "2"},
                     {"shared-experts", "1"},
                     {"zero", "1"}});
  const RunReport together = run_on("dgx-h100", all);
  EXPECT_TRUE(together.all_checks_passed()) << testing::failed_checks(together);
  Settings dtype = experts(4, 2, "current");
  dtype.erase("fp8-recipe");
  dtype["dtype"] = "fp8";
  const RunReport by_dtype = run_on("dgx-h100", dtype);
  EXPECT_TRUE(by_dtype.all_checks_passed()) << testing::failed_checks(by_dtype);
}

// Delayed scaling casts a pass's tensors with the scale the earlier passes' amaxes gave: the second pass's
// input, twice the first's, saturates at the first's largest value (scaled by its own, as current scaling
// would, it would keep its -4), and the third pass, whose history holds 4, keeps it. A backward pass's
// update leaves the forward's tensors as they are.
TEST(GptFp8, DelayedScalingScalesEachPassByTheEarlierPassesAmaxes) {
  SimConfig config = testing::quiet_config();
  SimBackend backend(config);
  backend.launch(1, [](Rank& r) {
    parallel::Fp8 fp8(r, parallel::Fp8Recipe::Delayed, /*keep_weights=*/true);
    fp8.select(7);
    const std::vector<float> x = {0.5f, -2.0f, 1.0f, 0.25f}, twice = {1.0f, -4.0f, 2.0f, 0.5f};
    auto cast = [&](const std::vector<float>& v) {
      return r.to_host(fp8.activation(r.from_host({2, 2}, v, DType::BFloat16), parallel::Fp8::Use::Forward));
    };
    EXPECT_EQ(cast(x), x);  // the first pass: scaled by its own amax, 2 (448 / 2 = 224 keeps every value)
    fp8.end_pass(parallel::Fp8::Pass::Forward);
    fp8.end_pass(parallel::Fp8::Pass::Backward);
    EXPECT_EQ(cast(twice), (std::vector<float>{1.0f, -2.0f, 2.0f, 0.5f}));
    fp8.end_pass(parallel::Fp8::Pass::Forward);
    EXPECT_EQ(cast(twice), twice);
  });
}

// Under full recomputation a layer's input is cast again with the scale its forward cast used, in the order
// the micro-batches ran: two forward casts of an input (the second, twice the first, saturating at the
// first's largest value), then their recomputes, which give the forwards' values although the history now
// holds 4 (by which the second would keep its -4). A recompute with no forward cast left is an error.
TEST(GptFp8, ARecomputedCastTakesItsForwardsScale) {
  SimConfig config = testing::quiet_config();
  SimBackend backend(config);
  backend.launch(1, [](Rank& r) {
    parallel::Fp8 fp8(r, parallel::Fp8Recipe::Delayed, /*keep_weights=*/true);
    fp8.keep_scales_for_recompute();
    fp8.select(3);
    const std::vector<float> x = {0.5f, -2.0f, 1.0f, 0.25f}, twice = {1.0f, -4.0f, 2.0f, 0.5f},
                             eight = {2.0f, -8.0f, 4.0f, 1.0f};
    auto cast = [&](const std::vector<float>& v) {
      return r.to_host(fp8.input(r.from_host({2, 2}, v, DType::BFloat16), nullptr).along_cols);
    };
    EXPECT_EQ(cast(x), x);
    fp8.end_pass(parallel::Fp8::Pass::Forward);
    const std::vector<float> saturated = {1.0f, -2.0f, 2.0f, 0.5f};
    EXPECT_EQ(cast(twice), saturated);
    fp8.end_pass(parallel::Fp8::Pass::Forward);
    fp8.begin_recompute();
    EXPECT_EQ(cast(x), x);
    EXPECT_EQ(cast(twice), saturated);
    EXPECT_THROW(cast(eight), Error);
    fp8.end_recompute();
    EXPECT_EQ(cast(eight), (std::vector<float>{2.0f, -4.0f, 4.0f, 1.0f}));  // the history's scale again
  });
}

// Delayed scaling's casts read no amax pass before them: after the first step (whose first pass scales each
// tensor by its own amax) no amax or fp8_scale kernel runs and no per-cast all-reduce, where current scaling
// runs one of each for every cast and one all-reduce per gathered input. Each forward pass ends with one
// all-reduce of the forward tensors' amaxes and each backward pass with one of the gradients', and one update
// kernel after each; the casts are as many, and the step is faster.
TEST(GptFp8, DelayedScalingCastsWithoutAnAmaxPass) {
  struct Counts {
    std::map<std::string, int> kernels;  // rank 0's, in the timed step
    std::map<std::pair<CommOp, std::int64_t>, int> collectives;
    std::map<std::int64_t, int> stage_all_reduces;  // by bytes: over all 4 ranks (the amaxes' group)
    double step_us = 0;
  };
  auto run = [](const std::string& recipe, int steps) {
    Settings o = testing::tiny_gpt();
    o["world"] = option_text(4);
    o["tp"] = option_text(2);
    o["seq-parallel"] = option_text(true);
    o["phantom"] = option_text(true);
    o["steps"] = option_text(steps);
    o["fp8-recipe"] = recipe;
    const RunReport rep = run_on("dgx-h100", o);
    Counts c;
    c.step_us = rep.training->step_time_us;
    double step_start_us = 0;  // the last step's: the timed one
    for (const RegionRecord& g : rep.regions) {
      if (g.rank == 0 && g.name == "step") step_start_us = std::max(step_start_us, g.start_us);
    }
    for (const Span& s : rep.spans) {
      if (s.rank == 0 && s.kind == SpanKind::Compute && s.start_us >= step_start_us)
        ++c.kernels[s.name.str()];
    }
    for (const CollectiveRecord& r : rep.collectives) {
      if (r.bookkeeping || r.start_us < step_start_us) continue;
      ++c.collectives[{r.op, r.bytes}];
      if (r.op == CommOp::AllReduce && r.group_size == 4) ++c.stage_all_reduces[r.bytes];
    }
    return c;
  };
  const Counts current = run("current", 2), delayed = run("delayed", 2);
  // tiny: 4 layers; a global batch of 8 in micro-batches of 2 over dp 2.
  const int layers = 4, micro_batches = 2, linears = 4;
  EXPECT_GT(current.kernels.at("amax"), 0);
  EXPECT_EQ(current.kernels.at("amax"), current.kernels.at("fp8_scale"));
  EXPECT_EQ(delayed.kernels.count("amax"), 0u);
  EXPECT_EQ(delayed.kernels.count("fp8_scale"), 0u);
  EXPECT_EQ(delayed.kernels.at("quantize"), current.kernels.at("quantize"));
  EXPECT_EQ(delayed.kernels.at("fp8_delayed_update"), 2 * micro_batches);
  // The amaxes of a pass: every layer's linears' inputs and weights forward, output gradients backward.
  EXPECT_EQ(delayed.stage_all_reduces, (std::map<std::int64_t, int>{{4 * 2 * layers * linears, micro_batches},
                                                                    {4 * layers * linears, micro_batches}}));
  EXPECT_TRUE(current.stage_all_reduces.empty());
  EXPECT_EQ(delayed.collectives.count({CommOp::AllReduce, 4}), 0u);
  EXPECT_GT(current.collectives.at({CommOp::AllReduce, 4}), 0);
  EXPECT_LT(delayed.step_us, current.step_us);
}

// With sequence parallelism a column-parallel layer's input is gathered as FP8 pieces: the all-gathers of
// the forward (and the backward's gathers of the kept inputs) move half the bytes, and the pieces' largest
// values are all-reduced (max) over tp, one 4-byte all-reduce per gathered input.
TEST(GptFp8, SequenceParallelGathersMoveFp8) {
  auto totals = [](const std::string& recipe) {
    Settings o = testing::tiny_gpt();
    o["world"] = option_text(2);
    o["tp"] = option_text(2);
    o["seq-parallel"] = option_text(true);
    o["phantom"] = option_text(true);
    o["steps"] = option_text(1);
    o["fp8-recipe"] = recipe;
    const RunReport rep = run_on("dgx-h100", o);
    std::map<std::pair<CommOp, std::int64_t>, int> count;
    for (const CollectiveRecord& c : rep.collectives) {
      if (!c.bookkeeping) ++count[{c.op, c.bytes}];
    }
    return count;
  };
  const auto bf16 = totals("none"), fp8 = totals("current");
  // tiny: micro-batches of 2 x 16 rows, hidden 64; the layer inputs gathered are [32, 64].
  const std::int64_t whole_bf16 = 32 * 64 * 2, whole_fp8 = 32 * 64;
  const int layers = 4, micro_batches = 4, per_layer = 2;  // qkv's input and fc1's
  EXPECT_EQ(fp8.at({CommOp::AllGather, whole_fp8}),
            2 * layers * micro_batches * per_layer);  // forward, backward
  EXPECT_EQ(fp8.at({CommOp::AllReduce, 4}), layers * micro_batches * per_layer);
  EXPECT_EQ(fp8.count({CommOp::AllReduce, 4}) + bf16.count({CommOp::AllReduce, 4}), 1);
  // bf16 gathers those inputs, and both gather the row-parallel layers' output gradients, at two bytes.
  EXPECT_EQ(bf16.at({CommOp::AllGather, whole_bf16}) - fp8.at({CommOp::AllGather, whole_bf16}),
            2 * layers * micro_batches * per_layer);
}

// The plan holds each linear weight's FP8 copies: both layouts on Hopper, one under per-tensor scaling on
// Blackwell, whose FP8 GEMMs read any layout.
TEST(GptFp8, TheMemoryPlanHoldsTheWeightsFp8Copies) {
  gpt::Config c = gpt::resolve(gpt::options_table().read(eight_ranks("current"), "gpt"), 8);
  // A gpt block's linear weights, split by tp 2: h x 3h, h x h, h x 4h, 4h x h of hidden 64; 2 layers a
  // stage.
  const std::int64_t per_layer = 64 * 3 * 64 / 2 + 64 * 64 / 2 + 64 * 4 * 64 / 2 + 4 * 64 * 64 / 2;
  const gpt::Config hopper = gpt::for_gpu(c, load_profile("dgx-h100").gpu);
  EXPECT_EQ(gpt::memory_plan(hopper, 0).fp8_weights, 2 * 2 * per_layer);
  const gpt::Config blackwell = gpt::for_gpu(c, load_profile("dgx-b200").gpu);
  EXPECT_EQ(gpt::memory_plan(blackwell, 0).fp8_weights, 2 * per_layer);
  // A micro-batch keeps the inputs of qkv and fc1 (its local rows, 1/tp with sequence parallelism) and of
  // fc2 (every row, 4h / tp features) in one byte an element instead of two, and proj's input once more.
  const std::int64_t rows = 16 * 2, local = rows / 2, h = 64, hl = 32;
  const std::int64_t fp8_layer = gpt::stash_bytes(hopper, 1, false, false);
  c.fp8 = parallel::Fp8Recipe::None;
  EXPECT_EQ(gpt::memory_plan(c, 0).fp8_weights, 0);
  EXPECT_EQ(gpt::stash_bytes(c, 1, false, false) - fp8_layer, 2 * local * h + rows * 4 * hl - rows * hl);
}

// With experts, a MoE layer's FP8 copies are its attention's and each local expert's, split over etp: here 8
// experts of width 96 over ep 2 and etp 2, 4 a rank, each [64, 96 / 2] and [96 / 2, 64], in place of the
// dense MLP's; and delayed scaling's histories count each expert's two linear layers.
TEST(GptFp8, TheMemoryPlanHoldsTheExpertsFp8Copies) {
  Settings o = eight_ranks("delayed");
  o["experts"] = option_text(8);
  o["top-k"] = option_text(2);
  o["moe-ffn-hidden"] = option_text(96);
  o["ep"] = option_text(2);
  o["etp"] = option_text(2);
  const gpt::Config c =
      gpt::for_gpu(gpt::resolve(gpt::options_table().read(o, "gpt"), 8), load_profile("dgx-h100").gpu);
  const std::int64_t attention = 64 * 3 * 64 / 2 + 64 * 64 / 2, experts = 4 * (64 * 96 / 2 + 96 / 2 * 64);
  const gpt::MemoryPlan plan = gpt::memory_plan(c, 0);
  EXPECT_EQ(plan.fp8_weights, 2 * 2 * (attention + experts));  // two layers, both layouts (Hopper)
  EXPECT_EQ(plan.fp8_scaling, parallel::fp8_scaling_bytes(parallel::Fp8Recipe::Delayed, 2 * (2 + 2 * 4)));
}

}  // namespace
}  // namespace ranklab
