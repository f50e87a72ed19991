#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "common/compare.h"
#include "common/errors.h"
#include "common/measurements.h"
#include "common/replay.h"
#include "sim/measured_sim.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

// The simulated time of one collective run the way a lesson would run it.
double direct_us(CommOp op, std::int64_t bytes, int world,
                 const SimConfig& config = testing::quiet_config()) {
  SimBackend sim(config);
  RunReport r = sim.launch(world, [&](Rank& rank) {
    const std::int64_t n = bytes / 4;
    if (op == CommOp::AllReduce) {
      Tensor t = rank.phantom({n});
      rank.all_reduce(t, ReduceOp::Sum);
    } else {
      Tensor out = rank.phantom({n}), in = rank.phantom({n / world});
      rank.all_gather(out, in);
    }
    rank.synchronize();
  });
  return r.collectives.at(0).time_us();
}

TEST(Replay, SimulatesTheMeasuredCollectivesOneAtATime) {
  const RunReport measured = read_measurement_csv(
      "op,bytes,ranks,time_us\nall_reduce,1073741824,8,5000\nall_gather,67108864,8,400\nall_reduce,1024,8,"
      "20\n",
      "m.csv");
  SimBackend sim(testing::quiet_config());
  RunReport replayed = sim.launch(8, replay_program(measured));
  label_as_replay(replayed, measured);
  ASSERT_EQ(replayed.collectives.size(), 3u);
  EXPECT_EQ(replayed.lesson, measured.lesson);
  EXPECT_EQ(replayed.collectives[0].op, CommOp::AllReduce);
  EXPECT_EQ(replayed.collectives[0].bytes, 1073741824);
  EXPECT_EQ(replayed.collectives[1].op, CommOp::AllGather);
  EXPECT_EQ(replayed.collectives[1].bytes, 67108864);
  // Each runs alone: its time is what it takes by itself (to the rounding of end - start, as the second
  // starts at a later absolute time than the direct run's).
  EXPECT_DOUBLE_EQ(replayed.collectives[0].time_us(), direct_us(CommOp::AllReduce, 1073741824, 8));
  const double alone_us = direct_us(CommOp::AllGather, 67108864, 8);
  EXPECT_NEAR(replayed.collectives[1].time_us(), alone_us, 1e-12 * replayed.collectives[1].end_us);
  // And compare lines them up one to one.
  const Comparison c = compare_reports(measured, replayed);
  EXPECT_EQ(c.scored, 3);
  EXPECT_EQ(c.only_in_a + c.only_in_b, 0);
}

TEST(Replay, KeepsTheMeasuredLabels) {
  // An in-place row and a size no float32 buffer has: the replay's records carry the measured labels.
  RunReport measured =
      read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,6,2,20\nall_reduce,4096,2,25\n", "m.csv");
  measured.collectives[1].group = kInPlaceGroup;
  SimBackend sim(testing::quiet_config());
  RunReport replayed = sim.launch(2, replay_program(measured));
  label_as_replay(replayed, measured);
  ASSERT_EQ(replayed.collectives.size(), 2u);
  EXPECT_EQ(replayed.collectives[0].bytes, 6);
  EXPECT_EQ(replayed.collectives[1].group, kInPlaceGroup);
  EXPECT_EQ(compare_reports(measured, replayed).scored, 2);
}

// all_reduce_perf's output on 8 GPUs, a row of 8 B and one of 256 MiB, each thread driving `gpus_per_thread`.
// The header names no collective: the tool's name in the origin does.
std::string two_row_log(int gpus_per_thread) {
  return fmt::format(
      "# nThread 1 nGpus {} minBytes 8 maxBytes 268435456 step: 2(factor) warmup iters: 5 iters: 20 agg "
      "iters: 1 validation: 1 graph: 0\n"
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw "
      "  busbw #wrong\n"
      "           8             2     float     sum      -1    20.00    0.00    0.00      0    20.00    0.00 "
      "   0.00      0\n"
      "   268435456      67108864     float     sum      -1  1000.00  268.44  469.76      0  1000.00  268.44 "
      "469.76      0\n",
      gpus_per_thread);
}

TEST(Replay, TimesNcclTestsOutputAsNcclTestsDoes) {
  // all_reduce_perf's rows are the host's time for 20 launches and a synchronize, over 20. With a launch
  // overhead between the two sizes' collective times, the small one is timed at the launch rate and the
  // large one at its own.
  const std::string log = two_row_log(1);
  const RunReport measured = read_nccl_tests(log, "all_reduce_perf.log", std::nullopt);
  ASSERT_EQ(measured.world, 8);
  SimConfig config = testing::quiet_config();
  const double small_us = direct_us(CommOp::AllReduce, 8, 8, config);
  const double large_us = direct_us(CommOp::AllReduce, 268435456, 8, config);
  config.profile.gpu.launch_overhead_us = 3 * small_us;
  ASSERT_LT(config.profile.gpu.launch_overhead_us, large_us);
  const double launch_us = config.profile.gpu.launch_overhead_us;
  SimBackend sim(config);
  RunReport replayed = sim.launch(8, replay_program(measured));
  label_as_replay(replayed, measured);
  ASSERT_EQ(replayed.collectives.size(), 4u);
  EXPECT_TRUE(replayed.regions.empty());  // the loops' regions are the replay's, not the measurement's
  // The last of 20 launches leaves the host at 20 launches, and its collective follows.
  EXPECT_NEAR(replayed.collectives[0].time_us(), launch_us + small_us / 20, 1e-9 * launch_us);
  EXPECT_EQ(replayed.collectives[1].group, kInPlaceGroup);
  EXPECT_NEAR(replayed.collectives[1].time_us(), launch_us + small_us / 20, 1e-9 * launch_us);
  // The first launch delays the first of 20 collectives that then run back to back.
  EXPECT_NEAR(replayed.collectives[2].time_us(), large_us + launch_us / 20, 1e-9 * large_us);
  EXPECT_EQ(replayed.collectives[2].bytes, 268435456);
  EXPECT_FALSE(replayed.collectives[2].algorithm.empty());
  // compare lines the rows up one to one.
  const Comparison c = compare_reports(measured, replayed);
  EXPECT_EQ(c.scored, 4);
  EXPECT_EQ(c.only_in_a + c.only_in_b, 0);
}

TEST(Replay, OneThreadDrivingEightGpusLaunchesForAllOfThem) {
  // With -g 8 every iteration is one thread's eight launches, one per GPU (startColl of nccl-tests), so
  // the small row is timed at an eighth of the launch rate of -g 1. The large row is still the
  // collective's own time.
  Profile profile = testing::quiet_config().profile;
  const double small_us = direct_us(CommOp::AllReduce, 8, 8);
  const double large_us = direct_us(CommOp::AllReduce, 268435456, 8);
  profile.gpu.launch_overhead_us = 3 * small_us;
  const double launch_us = profile.gpu.launch_overhead_us;
  ASSERT_LT(8 * launch_us, large_us);
  const RunReport one =
      simulate_measured(read_nccl_tests(two_row_log(1), "all_reduce_perf.g1.log", std::nullopt), profile);
  const RunReport eight =
      simulate_measured(read_nccl_tests(two_row_log(8), "all_reduce_perf.g8.log", std::nullopt), profile);
  ASSERT_EQ(one.collectives.size(), 4u);
  ASSERT_EQ(eight.collectives.size(), 4u);
  EXPECT_NEAR(one.collectives[0].time_us(), launch_us + small_us / 20, 1e-9 * launch_us);
  EXPECT_NEAR(eight.collectives[0].time_us(), 8 * launch_us + small_us / 20, 1e-9 * launch_us);
  EXPECT_NEAR(eight.collectives[1].time_us(), 8 * launch_us + small_us / 20, 1e-9 * launch_us);
  // The first of the loop's eight launches delays the first collective; the rest run back to back.
  EXPECT_NEAR(eight.collectives[2].time_us(), large_us + 8 * launch_us / 20, 1e-9 * large_us);
}

TEST(Replay, RefusesWhatItCannotRebuild) {
  RunReport measured = read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,4096,8,20\n", "m.csv");
  measured.collectives[0].group_size = 4;
  measured.collectives[0].group = "group of 4";
  try {
    replay_program(measured);
    FAIL() << "expected an error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce of 4 ranks in a run of 8"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ranklab
