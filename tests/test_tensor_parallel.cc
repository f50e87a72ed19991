// tensor_parallel: equal to one device at every world size and with both optimizers (each rank's columns of
// the gradients and weights), one all_gather and one reduce_scatter per layer, the error for a dimension
// the world does not divide, and a model that fits where data parallelism runs out of memory.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

Options small(int world, const std::string& optimizer) {
  Options o;
  o.world = world;
  o.batch = 8;
  o.dim = 12;  // divisible by 1, 2, 3 and 4
  o.layers = 4;
  o.steps = 3;
  o.optimizer = optimizer;
  o.lr = optimizer == "adamw" ? 0.01 : 0.05;
  o.quiet = true;
  return o;
}

RunReport run(const std::string& lesson, const Options& o) {
  SimBackend backend(testing::quiet_config());
  return run_lesson(backend, lesson, o);
}

TEST(TensorParallel, EqualsOneDeviceAfterEveryStep) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(::testing::Message() << optimizer << ", world " << world);
      const Options o = small(world, optimizer);
      RunReport rep = run("tensor_parallel", o);
      EXPECT_TRUE(rep.all_checks_passed());
      int steps_checked = 0;
      for (const CheckRecord& c : rep.checks) {
        if (c.what.rfind("tensor_parallel step", 0) == 0 && c.passed) ++steps_checked;
      }
      EXPECT_EQ(steps_checked, o.steps * world);  // every rank, every step
    }
  }
}

TEST(TensorParallel, MegatronPairsEqualOneDeviceWithOneAllReducePerPairEachWay) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    for (int world : {1, 2, 3, 4, 16}) {
      SCOPED_TRACE(::testing::Message() << optimizer << ", world " << world);
      Options o = small(world, optimizer);
      o.megatron = true;
      if (world == 16) o.dim = 64;
      SimBackend backend(testing::quiet_config(world > 8 ? 2 : 1));
      RunReport rep = run_lesson(backend, "tensor_parallel", o);
      EXPECT_TRUE(rep.all_checks_passed());
      int steps_checked = 0, all_reduces = 0, others = 0;
      for (const CheckRecord& c : rep.checks)
        steps_checked += c.passed && c.what.find("--megatron step") != std::string::npos;
      for (const CollectiveRecord& c : rep.collectives) {
        if (c.op == CommOp::AllReduce && c.bytes == o.batch * o.dim * 4) {
          ++all_reduces;
        } else if (c.op != CommOp::Gather) {
          ++others;  // the lesson's own; gather is the report's bookkeeping
        }
      }
      EXPECT_EQ(steps_checked, o.steps * world);
      if (world > 1) {
        EXPECT_EQ(all_reduces, (o.layers - 1) * o.steps);  // 2 pairs: 2 forward, 1 backward
      }
      EXPECT_EQ(others, 0);
    }
  }
}

TEST(TensorParallel, AllGatherForwardReduceScatterBackwardAtEveryLayer) {
  const Options o = small(4, "sgd");
  RunReport rep = run("tensor_parallel", o);
  int gathers = 0, scatters = 0;
  for (const CollectiveRecord& c : rep.collectives) {
    if (c.op == CommOp::AllGather) ++gathers;
    if (c.op == CommOp::ReduceScatter) ++scatters;
  }
  EXPECT_EQ(gathers, o.layers * o.steps);
  EXPECT_EQ(scatters, (o.layers - 1) * o.steps);  // the first layer's input needs no gradient
}

TEST(TensorParallel, DimNotDivisibleByTheWorldIsAClearError) {
  Options o = small(4, "sgd");
  o.dim = 10;
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
  Options o;
  o.world = 8;
  o.phantom = true;
  o.optimizer = "adamw";
  o.dim = 8192;
  o.layers = 100;
  o.batch = 64;
  o.steps = 1;
  o.quiet = true;
  EXPECT_THROW(run("data_parallel", o), OutOfMemoryError);
  RunReport rep = run("tensor_parallel", o);
  const double device = static_cast<double>(rep.ranks[0].capacity_bytes);
  for (const RankSummary& s : rep.ranks) {
    EXPECT_LT(static_cast<double>(s.peak_bytes), device);
    EXPECT_GT(static_cast<double>(s.peak_bytes), 0.1 * device);  // an eighth of 100 GiB, and activations
  }
}

}  // namespace
}  // namespace ranklab
