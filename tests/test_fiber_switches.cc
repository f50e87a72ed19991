// The simulator's own work: how many times its ranks' fibers give way to one another
// (SimBackend::fiber_switches). At thousands of ranks each switch brings a rank's state back from beyond
// the cache, so a step's cost in real time follows the count; these tests pin what the count must not do.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/lesson.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;

struct BucketRun {
  std::int64_t switches = 0;
  double makespan_us = 0;
};

// Every rank computes a gradient and all-reduces it asynchronously, 16 times, as data parallelism's
// buckets do; then waits for every bucket or for the last one only, and steps.
BucketRun buckets(bool wait_for_every_bucket, bool sm_contention) {
  SimConfig config = quiet_config();
  config.sm_contention = sm_contention;
  SimBackend backend(config);
  const RunReport rep = backend.launch(8, [&](Rank& r) {
    Tensor a = r.phantom({2048, 2048});
    std::vector<Work> works;
    for (int i = 0; i < 16; ++i) {
      Tensor grad = r.matmul(a, a);
      works.push_back(r.all_reduce(grad, ReduceOp::Avg, Async::Yes));
    }
    if (wait_for_every_bucket) {
      for (Work& w : works) w.wait();
    } else {
      works.back().wait();
    }
    r.matmul(a, a);  // the optimizer's first kernel
    r.synchronize();
  });
  return {backend.fiber_switches(), rep.makespan_us};
}

// wait() makes the compute stream wait; waiting for a later bucket of the same group covers the earlier
// ones. So waiting for all 16 costs no more switches than waiting for the last, and gives the same times.
// Without communication sharing the GPU the ranks post all 16 at once and reach their waits with every
// bucket still in flight: a wait() that blocked would switch 112 times here against 7.
TEST(FiberSwitches, WaitingForEveryBucketCostsNoMoreThanWaitingForTheLast) {
  for (const bool sm_contention : {false, true}) {
    const BucketRun every = buckets(true, sm_contention), last = buckets(false, sm_contention);
    EXPECT_GT(last.switches, 0);
    EXPECT_EQ(every.switches, last.switches) << "sm_contention " << sm_contention;
    EXPECT_EQ(every.makespan_us, last.makespan_us) << "sm_contention " << sm_contention;
  }
}

// With communication sharing the GPU, each gradient kernel overlaps the buckets before it, whose starts the
// other ranks decide, and each bucket is posted behind such a kernel. The posts are deferred instead of
// waiting for those times: the ranks still run through all 16 without blocking, and switch at most twice
// as often as without the sharing. (A post that waited for its kernels switched 224 times here against 7.)
TEST(FiberSwitches, PostsBehindKernelsNotYetTimedDoNotBlock) {
  const BucketRun shared = buckets(false, true), alone = buckets(false, false);
  EXPECT_GT(shared.makespan_us, alone.makespan_us);  // the sharing is there: the kernels were slowed
  EXPECT_LE(shared.switches, 2 * alone.switches);
}

// Tensor parallelism's pattern: every layer a kernel, then a synchronous all_reduce of its output, which
// the next kernel reads. The ranks do not block at those kernels (the numbers of phantom tensors are never
// needed, only the all_reduce's end, which the kernel waits for on the stream): each runs its 16 layers
// through and blocks once, at synchronize(). (Blocking at each kernel switched 112 times here against 7.)
TEST(FiberSwitches, KernelsAfterSynchronousCollectivesDoNotBlock) {
  SimBackend backend(quiet_config());
  backend.launch(8, [](Rank& r) {
    Tensor x = r.phantom({1024, 1024});
    for (int layer = 0; layer < 16; ++layer) {
      x = r.matmul(x, x);
      r.all_reduce(x, ReduceOp::Sum);
    }
    r.matmul(x, x);
    r.synchronize();
  });
  EXPECT_LE(backend.fiber_switches(), 8);
}

TEST(FiberSwitches, TheSameProgramSwitchesTheSameNumberOfTimes) {
  auto dp_overlap = [] {
    SimBackend backend(quiet_config());
    Settings o;
    o["world"] = option_text(8);
    o["overlap"] = option_text(true);
    o["bucket-mb"] = option_text(0.01);
    o["quiet"] = option_text(true);
    run_lesson(backend, "data_parallel", o);
    return backend.fiber_switches();
  };
  const std::int64_t first = dp_overlap();
  EXPECT_GT(first, 0);
  EXPECT_EQ(dp_overlap(), first);
}

}  // namespace
}  // namespace ranklab
