// data_parallel: equal to one device at every world size and with both optimizers, identical weights on
// every rank, the lecture's constraints on the batch, --overlap hiding communication, and the memory wall.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

Settings small(int world, const std::string& optimizer) {
  Settings o;
  o["world"] = option_text(world);
  o["batch"] = option_text(12);  // divisible by 1, 2, 3 and 4
  o["dim"] = option_text(8);
  o["layers"] = option_text(4);
  o["steps"] = option_text(3);
  o["optimizer"] = option_text(optimizer);
  o["lr"] = option_text(optimizer == "adamw" ? 0.01 : 0.05);
  o["quiet"] = option_text(true);
  return o;
}

RunReport run(const Settings& o, const std::string& profile = "dgx-h100") {
  SimConfig c = testing::quiet_config();
  c.profile = load_profile(profile);
  c.echo_output = false;
  SimBackend backend(c);
  return run_lesson(backend, "data_parallel", o);
}

// How many of the report's checks start with `prefix`, and whether all of those passed.
int passed_checks(const RunReport& rep, const std::string& prefix) {
  int n = 0;
  for (const CheckRecord& c : rep.checks) {
    if (c.what.rfind(prefix, 0) == 0) n += c.passed ? 1 : -1000;
  }
  return n;
}

std::string error_of(const Settings& o) {
  try {
    run(o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(DataParallel, EqualsOneDeviceAfterEveryStep) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    for (int world : {1, 2, 3, 4}) {
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << optimizer << ", world " << world << (overlap ? ", overlap" : ""));
        Settings o = small(world, optimizer);
        o["overlap"] = option_text(overlap);
        o["bucket-mb"] = option_text(0.0003);  // about one 8 x 8 gradient: several buckets
        RunReport rep = run(o);
        EXPECT_TRUE(rep.all_checks_passed());
        // Every rank checks loss, gradients and weights after each step.
        EXPECT_EQ(passed_checks(rep, "data_parallel step"), testing::number(o, "steps") * world);
        EXPECT_EQ(passed_checks(rep, "data_parallel: the weights are identical on every rank"), 1);
      }
    }
  }
}

TEST(DataParallel, TheComparisonIsReal) {
  // The loss printed for one device is the one the lesson's ranks reach.
  RunReport rep = run(small(4, "sgd"));
  bool found = false;
  for (const std::string& line : rep.output) {
    if (line.find("equal to one device over the full batch after every step: yes") != std::string::npos)
      found = true;
  }
  EXPECT_TRUE(found);
  // And the data is split: each rank's all_reduce carries whole gradients, one per layer and step.
  int all_reduces = 0;
  for (const CollectiveRecord& c : rep.collectives) {
    if (c.op == CommOp::AllReduce && c.bytes == 8 * 8 * 4) ++all_reduces;
  }
  EXPECT_EQ(all_reduces, 4 * 3);
}

TEST(DataParallel, BatchSmallerThanTheWorldIsAClearError) {
  Settings o = small(4, "sgd");
  o["batch"] = option_text(2);
  const std::string msg = error_of(o);
  EXPECT_NE(msg.find("--batch 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--world 4"), std::string::npos) << msg;
}

TEST(DataParallel, BatchNotDivisibleByTheWorldIsAClearError) {
  Settings o = small(4, "sgd");
  o["batch"] = option_text(10);
  const std::string msg = error_of(o);
  EXPECT_NE(msg.find("--batch 10"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not divisible by --world 4"), std::string::npos) << msg;
}

TEST(DataParallel, OverlapHidesCommunication) {
  // PCIe links and big gradients: the all_reduces take a good part of the step, but less than backward
  // (enough samples per rank), so there is compute to hide them under.
  Settings o;
  o["world"] = option_text(4);
  o["phantom"] = option_text(true);
  o["dim"] = option_text(4096);
  o["layers"] = option_text(8);
  o["batch"] = option_text(4096);
  o["steps"] = option_text(1);
  o["quiet"] = option_text(true);
  RunReport plain = run(o, "pcie-4gpu");
  o["overlap"] = option_text(true);
  RunReport overlapped = run(o, "pcie-4gpu");
  for (int r = 0; r < 4; ++r) {
    const RankSummary& p = plain.ranks[r];
    const RankSummary& v = overlapped.ranks[r];
    // Without overlap every all_reduce comes after backward: nothing is hidden.
    EXPECT_NEAR(p.exposed_comm_us, p.comm_us, 0.05 * p.comm_us);
    // With it, most of the communication runs under backward, and less of it is exposed.
    EXPECT_LT(v.exposed_comm_us, 0.5 * v.comm_us);
    EXPECT_LT(v.exposed_comm_us, p.exposed_comm_us);
  }
}

TEST(DataParallel, AModelLargerThanOneDeviceRunsOutOfMemoryOnEveryWorldSize) {
  // AdamW's four floats per parameter; 100 layers of 8192 x 8192 is 100 GiB on every rank.
  Settings o;
  o["phantom"] = option_text(true);
  o["optimizer"] = option_text("adamw");
  o["dim"] = option_text(8192);
  o["layers"] = option_text(100);
  o["batch"] = option_text(64);
  o["steps"] = option_text(1);
  o["quiet"] = option_text(true);
  for (int world : {1, 8}) {
    o["world"] = option_text(world);
    try {
      run(o);
      ADD_FAILURE() << "expected to run out of memory at world " << world;
    } catch (const OutOfMemoryError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("out of memory"), std::string::npos) << msg;
    }
  }
}

// A world of 1,024 ranks, overlapping all_reduces sharing links: two runs give the same report, to the
// bit, whatever order the fibers happened to run in.
TEST(DataParallel, TwoRunsOf1024RanksGiveIdenticalReports) {
  Settings o;
  o["world"] = option_text(1024);
  o["phantom"] = option_text(true);
  o["dim"] = option_text(1024);
  o["layers"] = option_text(4);
  o["batch"] = option_text(8 * 1024);
  o["steps"] = option_text(2);
  o["overlap"] = option_text(true);
  o["quiet"] = option_text(true);
  auto once = [&] {
    SimConfig c = testing::quiet_config();
    c.profile = load_profile("dgx-h100");
    c.profile.nodes = 128;
    c.echo_output = false;
    SimBackend backend(c);
    return report_to_json(run_lesson(backend, "data_parallel", o));
  };
  const std::string a = once(), b = once();
  EXPECT_GT(a.size(), 1000u);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace ranklab
