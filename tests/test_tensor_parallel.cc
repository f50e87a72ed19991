// tensor_parallel: equal to one device at every world size and with both optimizers (each rank's columns of
// the gradients and weights), one all_gather and one reduce_scatter per layer, the error for a dimension
// the world does not divide, and a model that fits where data parallelism runs out of memory.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "lessons/parallel/exposed.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

Settings small(int world, const std::string& optimizer) {
  Settings o;
  o["world"] = option_text(world);
  o["batch"] = option_text(8);
  o["dim"] = option_text(12);  // divisible by 1, 2, 3 and 4
  o["layers"] = option_text(4);
  o["steps"] = option_text(3);
  o["optimizer"] = option_text(optimizer);
  o["lr"] = option_text(optimizer == "adamw" ? 0.01 : 0.05);
  o["quiet"] = option_text(true);
  return o;
}

RunReport run(const std::string& lesson, const Settings& o) {
  SimBackend backend(testing::quiet_config());
  return run_lesson(backend, lesson, o);
}

TEST(TensorParallel, EqualsOneDeviceAfterEveryStep) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(::testing::Message() << optimizer << ", world " << world);
      const Settings o = small(world, optimizer);
      RunReport rep = run("tensor_parallel", o);
      EXPECT_TRUE(rep.all_checks_passed());
      int steps_checked = 0;
      for (const CheckRecord& c : rep.checks) {
        if (c.what.rfind("tensor_parallel step", 0) == 0 && c.passed) ++steps_checked;
      }
      EXPECT_EQ(steps_checked, testing::number(o, "steps") * world);  // every rank, every step
    }
  }
}

TEST(TensorParallel, MegatronPairsEqualOneDeviceWithOneAllReducePerPairEachWay) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    for (int world : {1, 2, 3, 4, 16}) {
      SCOPED_TRACE(::testing::Message() << optimizer << ", world " << world);
      Settings o = small(world, optimizer);
      o["megatron"] = option_text(true);
      if (world == 16) o["dim"] = option_text(64);
      SimBackend backend(testing::quiet_config(world > 8 ? 2 : 1));
      RunReport rep = run_lesson(backend, "tensor_parallel", o);
      EXPECT_TRUE(rep.all_checks_passed());
      int steps_checked = 0, all_reduces = 0, others = 0;
      for (const CheckRecord& c : rep.checks)
        steps_checked += c.passed && c.what.find("--megatron step") != std::string::npos;
      for (const CollectiveRecord& c : rep.collectives) {
        if (c.op == CommOp::AllReduce &&
            c.bytes == testing::number(o, "batch") * testing::number(o, "dim") * 4) {
          ++all_reduces;
        } else if (c.op != CommOp::Gather) {
          ++others;  // the lesson's own; gather is the report's bookkeeping
        }
      }
      EXPECT_EQ(steps_checked, testing::number(o, "steps") * world);
      if (world > 1) {
        EXPECT_EQ(all_reduces, (testing::number(o, "layers") - 1) *
                                   testing::number(o, "steps"));  // 2 pairs: 2 forward, 1 backward
      }
      EXPECT_EQ(others, 0);
    }
  }
}

TEST(TensorParallel, AllGatherForwardReduceScatterBackwardAtEveryLayer) {
  const Settings o = small(4, "sgd");
  RunReport rep = run("tensor_parallel", o);
  int gathers = 0, scatters = 0;
  for (const CollectiveRecord& c : rep.collectives) {
    if (c.op == CommOp::AllGather) ++gathers;
    if (c.op == CommOp::ReduceScatter) ++scatters;
  }
  EXPECT_EQ(gathers, testing::number(o, "layers") * testing::number(o, "steps"));
  EXPECT_EQ(scatters, (testing::number(o, "layers") - 1) *
                          testing::number(o, "steps"));  // the first layer's input needs no gradient
}

TEST(TensorParallel, DimNotDivisibleByTheWorldIsAClearError) {
  Settings o = small(4, "sgd");
  o["dim"] = option_text(10);
  try {
    run("tensor_parallel", o);
    ADD_FAILURE() << "expected a UsageError";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--dim 10 is not divisible by --world 4"), std::string::npos) << msg;
  }
}

TEST(TensorParallel, FitsWhereDataParallelismRunsOutOfMemory) {
  // 100 layers of 8192 x 8192 with AdamW: 100 GiB of weights, gradients and moments, more than an H100.
  Settings o;
  o["world"] = option_text(8);
  o["phantom"] = option_text(true);
  o["optimizer"] = option_text("adamw");
  o["dim"] = option_text(8192);
  o["layers"] = option_text(100);
  o["batch"] = option_text(64);
  o["steps"] = option_text(1);
  o["quiet"] = option_text(true);
  EXPECT_THROW(run("data_parallel", o), OutOfMemoryError);
  RunReport rep = run("tensor_parallel", o);
  const double device = static_cast<double>(rep.ranks[0].capacity_bytes);
  for (const RankSummary& s : rep.ranks) {
    EXPECT_LT(static_cast<double>(s.peak_bytes), device);
    EXPECT_GT(static_cast<double>(s.peak_bytes), 0.1 * device);  // an eighth of 100 GiB, and activations
  }
}

// A step of many operations keeps only those not ended yet, and counts every one's time.
TEST(ExposedComm, FoldsEndedOperationsIntoTheTotalsAsTheStepGoes) {
  constexpr int kOperations = 5000;
  SimBackend backend(testing::quiet_config());
  std::vector<double> summed(2, 0), counted(2, 0), waited(2, 0), exposed_us(2, 0);
  std::vector<std::size_t> kept(2, 0);
  backend.launch(2, [&](Rank& r) {
    parallel::ExposedComm exposed(r);
    exposed.enable(true);
    Tensor t = r.phantom(Shape{1 << 16}, DType::BFloat16);
    Tensor w_gemm = r.phantom(Shape{256, 256}, DType::BFloat16);
    for (int i = 0; i < kOperations; ++i) {
      Work w = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
      exposed.communicated(parallel::Dim::Dp, w);
      if (i % 2 == 0) r.matmul(w_gemm, w_gemm);  // some of the transfer hidden, some not
      const Event before = r.record_event();
      exposed.wait(parallel::Dim::Dp, w);
      const Event after = r.record_event();
      summed[r.rank()] += w.elapsed_us();
      waited[r.rank()] += r.elapsed_us(before, after);
    }
    kept[r.rank()] = exposed.kept();
    counted[r.rank()] = exposed.communicated_totals()[static_cast<int>(parallel::Dim::Dp)];
    exposed_us[r.rank()] = exposed.totals()[static_cast<int>(parallel::Dim::Dp)];
  });
  for (int rank : {0, 1}) {
    EXPECT_LT(kept[rank], 2 * 2048u) << "rank " << rank;
    EXPECT_GT(summed[rank], 0);
    EXPECT_NEAR(counted[rank], summed[rank], 1e-9 * summed[rank]) << "rank " << rank;
    EXPECT_GT(waited[rank], 0);
    EXPECT_NEAR(exposed_us[rank], waited[rank], 1e-9 * waited[rank]) << "rank " << rank;
  }
}

}  // namespace
}  // namespace ranklab
