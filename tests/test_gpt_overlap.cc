// The gpt lesson's framework overlaps and fusions (--overlap-grad-reduce, --overlap-param-gather,
// --tp-comm-overlap, --async-tensor-model-parallel-allreduce, --overlap-p2p-communication,
// --gradient-accumulation-fusion, --framework):
// they change only time. With real numbers every switch on trains equal to one device; with phantom tensors a
// run moves the same bytes with each switch on and off; with free communication the overlapped step equals
// the plain one; with slow communication the overlap saves exactly the exposed time it hides; gradient
// buckets follow Megatron's rule and start in the order backward completes them; bad combinations name the
// flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "gpt_fixture.h"
#include "lessons/parallel/zero.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::expect_usage_error;

// As the command line runs it: --framework expands into its flags.
RunReport run(const Settings& o, SimConfig config) {
  config.echo_output = false;
  SimBackend backend(config);
  return run_lesson(backend, "gpt", resolve_settings(find_lesson("gpt"), o, /*lecture=*/false));
}
RunReport run(const Settings& o, int nodes = 1) {
  return run(o, testing::quiet_config(nodes));
}

Settings tiny(int world) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(world);
  return o;
}

// A phantom step big enough that communication and compute both matter: tp 2 inside a node, dp across two.
Settings phantom(int zero) {
  Settings o;
  o["world"] = option_text(16);
  o["tp"] = option_text(2);
  o["seq-parallel"] = option_text(true);
  o["zero"] = option_text(zero);
  o["layers"] = option_text(4);
  o["hidden"] = option_text(2048);
  o["heads"] = option_text(16);
  o["seq"] = option_text(2048);
  o["vocab"] = option_text(51200);
  o["global-batch"] = option_text(32);
  o["micro-batch"] = option_text(1);
  o["steps"] = option_text(2);
  o["phantom"] = option_text(true);
  o["quiet"] = option_text(true);
  return o;
}

Settings with(Settings o, const std::vector<std::string>& switches) {
  for (const std::string& s : switches) o[s] = option_text(true);
  return o;
}

const std::vector<std::string> kDpSwitches = {"overlap-grad-reduce", "overlap-param-gather"};
const std::vector<std::string> kAllSwitches = {"overlap-grad-reduce", "overlap-param-gather",
                                               "tp-comm-overlap"};

// ---- the numbers ----------------------------------------------------------------------------------------

using Combo =
    std::tuple<int, int, int, std::string>;  // tp (with sequence parallelism when 2), pp, zero, dtype

class GptOverlapEqualsOneDevice : public ::testing::TestWithParam<Combo> {};

TEST_P(GptOverlapEqualsOneDevice, EverySwitchOn) {
  const auto [tp, pp, zero, dtype] = GetParam();
  Settings o = tiny(tp * pp * 2);
  o["tp"] = option_text(tp);
  o["seq-parallel"] = option_text(tp > 1);
  o["pp"] = option_text(pp);
  o["zero"] = option_text(zero);
  o["dtype"] = option_text(dtype);
  o["ddp-bucket-size"] = option_text(5000);  // several buckets in the tiny model
  std::vector<std::string> on = {"overlap-grad-reduce"};
  if (zero > 0) on.push_back("overlap-param-gather");
  if (tp > 1) on.push_back("tp-comm-overlap");
  if (zero <= 1) on.push_back("gradient-accumulation-fusion");
  const RunReport rep = run(with(o, on));
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  EXPECT_NE(rep.training->layout.find("overlapped grad reduce"), std::string::npos) << rep.training->layout;
  EXPECT_EQ(rep.training->layout.find("fused gradient accumulation") != std::string::npos, zero <= 1)
      << rep.training->layout;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GptOverlapEqualsOneDevice,
                         ::testing::Values(Combo{2, 1, 1, "fp32"}, Combo{2, 1, 1, "bf16"},
                                           Combo{2, 2, 1, "bf16"}, Combo{1, 2, 0, "fp32"},
                                           Combo{2, 1, 2, "bf16"}, Combo{2, 1, 3, "fp32"},
                                           Combo{2, 2, 3, "bf16"}, Combo{4, 1, 0, "fp32"}));

TEST(GptOverlap, AsyncTensorParallelBackwardTrainsEqualToOneDevice) {
  // With and without sequence parallelism (reduce-scatter or all-reduce beside the weight gradient), with a
  // pipeline, and with the gradients summed into their buffers by the GEMMs.
  for (const auto& [tp, seq_parallel, pp] : {std::tuple{2, true, 1}, {2, false, 2}, {4, false, 1}}) {
    Settings o = tiny(tp * pp);
    o["tp"] = option_text(tp);
    o["seq-parallel"] = option_text(seq_parallel);
    o["pp"] = option_text(pp);
    o["dtype"] = option_text("bf16");
    const RunReport rep =
        run(with(o, {"async-tensor-model-parallel-allreduce", "gradient-accumulation-fusion"}));
    SCOPED_TRACE(rep.training->layout);
    EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
    EXPECT_NE(rep.training->layout.find("overlapped tp backward"), std::string::npos);
  }
}

TEST(GptOverlap, PipelineReceivesPostedEarlyTrainEqualToOneDevice) {
  for (const auto& [tp, pp, v] : {std::tuple{1, 2, 2}, {1, 4, 2}, {2, 2, 3}}) {
    Settings o = tiny(tp * pp);
    o["layers"] = option_text(pp * v);
    o["tp"] = option_text(tp);
    o["seq-parallel"] = option_text(tp > 1);
    o["pp"] = option_text(pp);
    o["interleave"] = option_text(v);
    o["global-batch"] = option_text(4 * pp);
    o["micro-batch"] = option_text(1);
    const RunReport rep = run(with(o, {"overlap-p2p-communication"}));
    SCOPED_TRACE(rep.training->layout);
    EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
    EXPECT_NE(rep.training->layout.find("pp transfers"), std::string::npos);
  }
}

// ---- the bytes ------------------------------------------------------------------------------------------

std::map<std::string, std::int64_t> bytes_per_tier(const RunReport& rep) {
  std::map<std::string, std::int64_t> out;
  for (const LinkTraffic& l : rep.links) out[l.tier] += l.bytes;
  return out;
}
// The lesson's collectives per (op, group): how many, and their bytes together.
std::map<std::pair<int, std::string>, std::pair<int, std::int64_t>> collectives(const RunReport& rep) {
  std::map<std::pair<int, std::string>, std::pair<int, std::int64_t>> out;
  for (const CollectiveRecord& c : rep.collectives) {
    if (c.bookkeeping) continue;
    auto& [count, bytes] = out[{static_cast<int>(c.op), std::string(c.group)}];
    ++count;
    bytes += c.bytes;
  }
  return out;
}

TEST(GptOverlap, EachSwitchMovesTheSameBytes) {
  for (int zero : {0, 1, 3}) {
    const RunReport plain = run(phantom(zero), 2);
    for (const std::string& s : kAllSwitches) {
      if (s == "overlap-param-gather" && zero == 0) continue;
      std::vector<std::string> on = {s};
      if (s == "overlap-param-gather" && zero < 3) on.push_back("overlap-grad-reduce");
      const RunReport rep = run(with(phantom(zero), on), 2);
      SCOPED_TRACE("zero " + std::to_string(zero) + " --" + s);
      if (s == "tp-comm-overlap") {  // the rings move the same bytes as the collectives they replace
        EXPECT_EQ(bytes_per_tier(rep), bytes_per_tier(plain));
        continue;
      }
      // The data-parallel overlaps move their collectives in time and cut a stage's reduction into buckets:
      // the same bytes, but for the distributed optimizer's padding of each bucket (to lcm(dp, 128) = 128
      // elements here) and of each parameter's start within it (to 64), float32 each.
      const auto a = collectives(rep), b = collectives(plain);
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [key, got] : a) {
        ASSERT_TRUE(b.count(key)) << key.second;
        const auto& want = b.at(key);
        const std::int64_t padding = zero == 1 ? (got.first + want.first) * (128 + 64) * 4 : 0;
        EXPECT_LE(std::abs(got.second - want.second), padding) << key.second << " op " << key.first;
      }
      const auto tiers = bytes_per_tier(rep), plain_tiers = bytes_per_tier(plain);
      for (const auto& [tier, bytes] : plain_tiers) {
        EXPECT_NEAR(static_cast<double>(tiers.at(tier)), static_cast<double>(bytes), 1e-4 * bytes) << tier;
      }
    }
  }
}

// ---- the time -------------------------------------------------------------------------------------------

// A machine on which communication costs next to nothing: links at the profile format's largest
// bandwidth, no latency but NCCL's least (a hundredth of its model's), the Simple protocol (LL and LL128
// cap a channel's rate whatever the link), and communication kernels that leave the GPU to compute.
SimConfig free_communication() {
  SimConfig c = testing::quiet_config(2);
  c.profile.nvlink.link_bandwidth_gbps = 1e6;
  c.profile.nvlink.latency_us = 0;
  c.profile.nic.bandwidth_gbps = 1e6;
  c.profile.nic.latency_us = 0;
  c.profile.pcie.bandwidth_gbps = 1e6;
  c.profile.pcie.latency_us = 0;
  c.profile.fabric.switch_latency_us = 0;
  c.profile.nccl.latency_scale = 0.01;
  c.protocol = "simple";
  c.sm_contention = false;
  return c;
}

// What issuing the data-parallel collectives of one step costs the host (a launch each): the overlaps
// issue them during backward, where that time may delay the compute kernels' launches.
double dp_launches_us(const RunReport& rep, int dp, int steps) {
  int n = 0;
  for (const CollectiveRecord& c : rep.collectives) n += !c.bookkeeping && c.group_size == dp;
  return n * testing::quiet_config().profile.gpu.launch_overhead_us / steps;
}

TEST(GptOverlap, WithFreeCommunicationTheDataParallelOverlapsChangeNothing) {
  for (int zero : {0, 1, 2}) {
    const RunReport plain = run(phantom(zero), free_communication());
    const RunReport overlapped =
        run(with(phantom(zero), zero == 0 ? std::vector<std::string>{"overlap-grad-reduce"} : kDpSwitches),
            free_communication());
    SCOPED_TRACE("zero " + std::to_string(zero));
    // The overlap can hide no more than what is left of the communication (the reductions' passes over
    // HBM), and moving the launches costs the host no more than they take.
    const double left_us = plain.training->exposed_comm_us.at("dp");
    EXPECT_LE(plain.training->step_time_us - overlapped.training->step_time_us, left_us);
    EXPECT_LE(overlapped.training->step_time_us - plain.training->step_time_us, dp_launches_us(plain, 8, 2));
  }
}

TEST(GptOverlap, TheOverlapSavesWhatItHides) {
  // tp 1, pp 1: the step is its compute plus what the compute stream waits for, so what the overlap saves
  // is the data-parallel wait it takes away, and never more than there was.
  Settings o = phantom(1);
  o["tp"] = option_text(1);
  o["seq-parallel"] = option_text(false);  // dp 16
  SimConfig config = testing::quiet_config(2);
  config.sm_contention = false;
  const RunReport plain = run(o, config), overlapped = run(with(o, kDpSwitches), config);
  const double saved = plain.training->step_time_us - overlapped.training->step_time_us;
  const double hidden =
      plain.training->exposed_comm_us.at("dp") - overlapped.training->exposed_comm_us.at("dp");
  EXPECT_GT(saved, 0);
  EXPECT_LE(saved, hidden);
  EXPECT_GE(saved, hidden - dp_launches_us(plain, 16, 2));
  EXPECT_GT(overlapped.training->exposed_comm_us.at("dp"), 0);  // the last bucket has nothing to hide it
}

TEST(GptOverlap, FusedGradientAccumulationSavesTheSeparateAddsAndMovesTheSameBytes) {
  for (int zero : {0, 1}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const RunReport plain = run(phantom(zero), 2),
                    fused = run(with(phantom(zero), {"gradient-accumulation-fusion"}), 2);
    EXPECT_LT(fused.training->step_time_us, plain.training->step_time_us);
    EXPECT_EQ(collectives(fused), collectives(plain));
    EXPECT_EQ(bytes_per_tier(fused), bytes_per_tier(plain));
  }
}

TEST(GptOverlap, AsyncTensorParallelBackwardHidesItsCollectivesAndMovesTheSameBytes) {
  for (bool seq_parallel : {true, false}) {
    SCOPED_TRACE(seq_parallel ? "sequence parallel" : "all-reduce");
    Settings o = phantom(1);
    o["seq-parallel"] = option_text(seq_parallel);
    const RunReport plain = run(o, 2), async = run(with(o, {"async-tensor-model-parallel-allreduce"}), 2);
    EXPECT_EQ(collectives(async), collectives(plain));
    EXPECT_EQ(bytes_per_tier(async), bytes_per_tier(plain));
    const std::string dim = seq_parallel ? "sp" : "tp";
    const double hidden = plain.training->exposed_comm_us.at(dim) - async.training->exposed_comm_us.at(dim);
    EXPECT_GT(hidden, 0);
    EXPECT_LT(async.training->step_time_us, plain.training->step_time_us);
    // Without sequence parallelism the forward's all-reduces stay blocking: exposed time remains.
    EXPECT_GT(async.training->exposed_comm_us.at(dim), 0);
  }
}

TEST(GptOverlap, TensorParallelRingsHideTheSequenceParallelWaits) {
  const RunReport plain = run(phantom(0), 2), rings = run(with(phantom(0), {"tp-comm-overlap"}), 2);
  EXPECT_LT(rings.training->exposed_comm_us.at("sp"), plain.training->exposed_comm_us.at("sp") / 2);
}

// Pipeline stages on two nodes, interleaved: receives posted a task early move the same bytes, and the
// transfers they hide shorten the step.
TEST(GptOverlap, PipelineReceivesPostedEarlyHideTransfersAndMoveTheSameBytes) {
  Settings o = phantom(1);
  o["pp"] = option_text(2);
  o["interleave"] = option_text(2);
  const RunReport plain = run(o, 2), early = run(with(o, {"overlap-p2p-communication"}), 2);
  EXPECT_EQ(collectives(early), collectives(plain));
  EXPECT_EQ(bytes_per_tier(early), bytes_per_tier(plain));
  EXPECT_LT(early.training->exposed_comm_us.at("pp"), plain.training->exposed_comm_us.at("pp"));
  EXPECT_LT(early.training->step_time_us, plain.training->step_time_us);
}

// ---- the buckets ----------------------------------------------------------------------------------------

TEST(GptOverlap, BucketsFollowMegatronsRule) {
  EXPECT_EQ(parallel::default_bucket_params(8), 40'000'000);
  EXPECT_EQ(parallel::default_bucket_params(40), 40'000'000);
  EXPECT_EQ(parallel::default_bucket_params(64), 64'000'000);
}

TEST(GptOverlap, BucketsStartInTheOrderBackwardCompletesThem) {
  // One parameter per bucket (--ddp-bucket-size 1), zero 0, one micro-batch per step: the all-reduces
  // start as backward reaches each parameter, from the final layernorm (hidden floats) to the word
  // embedding (vocab x hidden floats), which the embedding's backward completes last.
  Settings o = tiny(2);
  o["global-batch"] = option_text(4);
  o["ddp-bucket-size"] = option_text(1);
  o["steps"] = option_text(1);
  const RunReport rep = run(with(o, {"overlap-grad-reduce"}));
  ASSERT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  std::vector<const CollectiveRecord*> reduces;
  for (const CollectiveRecord& c : rep.collectives) {
    if (!c.bookkeeping && c.op == CommOp::AllReduce && c.group_size == 2) reduces.push_back(&c);
  }
  ASSERT_EQ(reduces.size(), 4u * 12 + 4);  // every parameter once
  for (std::size_t i = 1; i < reduces.size(); ++i) EXPECT_LE(reduces[i - 1]->start_us, reduces[i]->start_us);
  EXPECT_EQ(reduces.front()->bytes, 64 * 4);                   // the final layernorm's beta
  EXPECT_EQ(reduces.back()->bytes, 128 * 64 * 4);              // the word embedding
  EXPECT_EQ(reduces[reduces.size() - 2]->bytes, 16 * 64 * 4);  // the position embedding before it
}

// ---- the attention kernel -------------------------------------------------------------------------------

TEST(GptAttention, UnfusedTrainsTheSameAndKeepsItsScores) {
  for (const std::string recompute : {"none", "selective"}) {
    Settings o = tiny(4);
    o["tp"] = option_text(2);
    o["recompute"] = option_text(recompute);
    o["attention"] = option_text("unfused");
    const RunReport rep = run(o);  // its memory checks hold the stash to the plan, scores included
    EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
    EXPECT_NE(rep.training->layout.find("unfused attention"), std::string::npos);
  }
  // At size: the s x s scores in HBM take time and memory that the fused kernel does not.
  Settings o = phantom(0);
  const RunReport flash = run(o, 2);
  o["attention"] = option_text("unfused");
  const RunReport unfused = run(o, 2);
  EXPECT_GT(unfused.training->step_time_us, flash.training->step_time_us);
  // A micro-batch's scores: 16 / 2 heads x 2048^2 x 2 bytes per layer, kept for every micro-batch in flight.
  EXPECT_GE(unfused.training->peak_memory_bytes - flash.training->peak_memory_bytes,
            std::int64_t{8} * 2048 * 2048 * 2);
}

// ---- the presets and bad input --------------------------------------------------------------------------

TEST(GptOverlap, AFrameworkSetsItsFlagsAndExplicitFlagsWin) {
  Settings o = tiny(4);
  o["tp"] = option_text(2);
  o["seq-parallel"] = option_text(true);
  o["zero"] = option_text(1);
  o["framework"] = option_text("megatron-core");
  const RunReport core = run(o);
  EXPECT_NE(core.training->layout.find("overlapped grad reduce, param gather, tp comm"), std::string::npos)
      << core.training->layout;
  o["tp-comm-overlap"] = option_text(false);
  const RunReport no_tp = run(o);
  EXPECT_NE(no_tp.training->layout.find("overlapped grad reduce, param gather"), std::string::npos);
  EXPECT_EQ(no_tp.training->layout.find("tp comm"), std::string::npos);
  EXPECT_EQ(core.training->layout.find("unfused attention"), std::string::npos);
  o["framework"] = option_text("megatron-lm-2021");
  o.erase("tp-comm-overlap");
  const RunReport v2 = run(o);
  EXPECT_NE(v2.training->layout.find("unfused attention"), std::string::npos) << v2.training->layout;
  EXPECT_EQ(v2.training->layout.find("overlapped"), std::string::npos) << v2.training->layout;
  EXPECT_EQ(v2.training->layout.find("fused gradient accumulation"), std::string::npos);
  o["framework"] = option_text("megatron-lm-2022");
  const RunReport v3 = run(o);
  EXPECT_NE(v3.training->layout.find("fused gradient accumulation"), std::string::npos);
  EXPECT_NE(v3.training->layout.find("overlapped tp backward"), std::string::npos) << v3.training->layout;
  o["framework"] = option_text("torchtitan");
  const RunReport titan = run(o);
  EXPECT_EQ(titan.training->layout.find("fused gradient accumulation"), std::string::npos);
  EXPECT_EQ(titan.training->layout.find("tp backward"), std::string::npos) << titan.training->layout;
  // Megatron-Core's column-parallel backward is asynchronous wherever the userbuffers' rings do not apply.
  o["framework"] = option_text("megatron-core");
  o["seq-parallel"] = option_text(false);
  EXPECT_NE(run(o).training->layout.find("overlapped grad reduce, param gather, tp backward"),
            std::string::npos);
  // Where the layout has nothing to overlap, the framework's switch does not apply: tp 1, zero 0; and
  // with zero 3 there is no gradient buffer of the step to fuse into.
  Settings plain = tiny(2);
  plain["framework"] = option_text("megatron-core");
  EXPECT_TRUE(run(plain).all_checks_passed());
  plain["zero"] = option_text(3);
  const RunReport fsdp = run(plain);
  EXPECT_TRUE(fsdp.all_checks_passed()) << testing::failed_checks(fsdp);
  EXPECT_EQ(fsdp.training->layout.find("fused gradient accumulation"), std::string::npos);
  // Megatron-Core posts the pipeline's receives early with the interleaved schedule only.
  Settings piped = tiny(2);
  piped["pp"] = option_text(2);
  piped["framework"] = option_text("megatron-core");
  EXPECT_EQ(run(piped).training->layout.find("pp transfers"), std::string::npos);
  piped["interleave"] = option_text(2);
  EXPECT_NE(run(piped).training->layout.find("pp transfers"), std::string::npos);
  piped["framework"] = option_text("torchtitan");
  EXPECT_EQ(run(piped).training->layout.find("pp transfers"), std::string::npos);
}

TEST(GptOverlap, BadCombinationsNameTheFlag) {
  Settings o = tiny(2);
  o["ddp-bucket-size"] = option_text(0);
  expect_usage_error(o, "--ddp-bucket-size");
  o["ddp-bucket-size"] = option_text("nan");
  expect_usage_error(o, "--ddp-bucket-size");
  o["ddp-bucket-size"] = option_text(-4);
  expect_usage_error(o, "--ddp-bucket-size");
  o = tiny(2);
  o["tp-comm-overlap"] = option_text(true);
  expect_usage_error(o, "--tp-comm-overlap");
  o = tiny(2);
  o["tp"] = option_text(2);
  o["tp-comm-overlap"] = option_text(true);
  expect_usage_error(o, "needs --seq-parallel");
  o = tiny(2);
  o["overlap-param-gather"] = option_text(true);
  expect_usage_error(o, "needs --zero 1 or more");
  o["zero"] = option_text(1);
  expect_usage_error(o, "needs --overlap-grad-reduce");
  o = tiny(2);
  o["framework"] = option_text("deepspeed");
  expect_usage_error(o, "--framework: no framework called 'deepspeed'");
  o = tiny(2);
  o["zero"] = option_text(2);
  o["gradient-accumulation-fusion"] = option_text(true);
  expect_usage_error(o, "--gradient-accumulation-fusion");
  o = tiny(2);
  o["async-tensor-model-parallel-allreduce"] = option_text(true);
  expect_usage_error(o, "--async-tensor-model-parallel-allreduce");
  o = tiny(2);
  o["pp"] = option_text(2);
  o["overlap-p2p-communication"] = option_text(true);
  expect_usage_error(o, "--overlap-p2p-communication");
}

}  // namespace
}  // namespace ranklab
