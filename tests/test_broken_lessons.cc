// Each training lesson, deliberately broken with --break (Sum instead of Avg, no gradient
// reduction, a dropped reduce_scatter, a wrong slice of the weights, a per-micro-batch mean, gradients
// never zeroed, a stale ZeRO weight, a recomputed forward that skips a layer, a
// tensor-parallel input gradient never summed, an ungated combine, a router gradient not summed over the
// ranks), fails its own check against one device, and the check's detail names the tensor that differs. An
// unknown --break is a usage error.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "tests/sim_fixture.h"

namespace ranklab {
namespace {

Settings small(const std::string& lesson, const std::string& broken) {
  Settings o;
  o["world"] = option_text(4);
  o["batch"] = option_text(12);
  o["dim"] = option_text(8);
  if (lesson != "moe") o["layers"] = option_text(lesson == "pipeline_parallel" ? 8 : 4);
  o["steps"] = option_text(2);
  o["lr"] = option_text(0.05);
  o["optimizer"] = "sgd";
  o["quiet"] = option_text(true);
  o["break"] = option_text(broken);
  if (lesson == "pipeline_parallel" || lesson == "recompute") o["micro-batches"] = "4";
  if (lesson == "zero") o["zero"] = option_text(-1);  // every stage
  if (lesson == "moe") o["hidden"] = "64";
  if (lesson == "hybrid") {  // tp 2 x pp 1 x dp 2, two micro-batches of 3 samples per dp rank
    o["tp"] = option_text(2);
    o["pp"] = option_text(1);
    o["micro-batches"] = option_text(2);
  }
  return o;
}

RunReport run(const std::string& lesson, const Settings& o) {
  SimBackend backend(testing::quiet_config());
  return run_lesson(backend, lesson, o);
}

using Case = std::tuple<std::string, std::string, std::string>;  // lesson, bug, what the check names
class BrokenLesson : public ::testing::TestWithParam<Case> {};

TEST_P(BrokenLesson, FailsItsOwnCheckNamingWhatDiffers) {
  const auto& [lesson, bug, names] = GetParam();
  const RunReport rep = run(lesson, small(lesson, bug));
  EXPECT_FALSE(rep.all_checks_passed());
  bool named = false;
  std::string failed;
  for (const CheckRecord& c : rep.checks) {
    if (c.passed) continue;
    failed += c.what + ": " + c.detail + "\n";
    named = named || (c.what.find("equal one device's") != std::string::npos &&
                      c.detail.find("largest relative difference") != std::string::npos &&
                      c.detail.find(names) != std::string::npos);
  }
  EXPECT_TRUE(named) << "no failed check naming '" << names << "':\n" << failed;
}

TEST_P(BrokenLesson, TheSameLessonUnbrokenPasses) {
  const auto& [lesson, bug, names] = GetParam();
  EXPECT_TRUE(run(lesson, small(lesson, "")).all_checks_passed());
}

INSTANTIATE_TEST_SUITE_P(
    Bugs, BrokenLesson,
    ::testing::Values(Case{"data_parallel", "sum", "gradient"},
                      Case{"data_parallel", "no-all-reduce", "gradient"},
                      Case{"tensor_parallel", "no-reduce-scatter", "gradient"},
                      Case{"tensor_parallel", "wrong-slice", "layer "},
                      Case{"pipeline_parallel", "micro-batch-mean", "gradient"},
                      Case{"pipeline_parallel", "no-zero-grad", "gradient"}, Case{"zero", "sum", "gradient"},
                      Case{"zero", "no-all-gather", "gathered weight"},
                      Case{"recompute", "skip-layer", "gradient"},
                      Case{"hybrid", "no-tp-backward", "gradient"}, Case{"hybrid", "dp-sum", "gradient"},
                      Case{"moe", "no-gate", "expert"}, Case{"moe", "no-router-all-reduce", "router"}),
    [](const ::testing::TestParamInfo<Case>& i) {
      std::string n = std::get<0>(i.param) + "_" + std::get<1>(i.param);
      for (char& c : n)
        if (c == '-') c = '_';
      return n;
    });

TEST(BrokenLesson, AnUnknownBugIsAUsageErrorListingTheKnownOnes) {
  for (const std::string lesson :
       {"data_parallel", "tensor_parallel", "pipeline_parallel", "zero", "recompute", "hybrid", "moe"}) {
    try {
      run(lesson, small(lesson, "typo"));
      ADD_FAILURE() << lesson << ": no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(lesson + ": --break must be"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(got 'typo')"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace ranklab
