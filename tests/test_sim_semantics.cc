// The simulator's clocks and its answers to bad programs: the lecture's synchronize/barrier lesson,
// exact virtual times, determinism, deadlock, mismatch, exceptions, out-of-memory and bad arguments.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;
using testing::run_collect;
using testing::run_error_message;

// The message of what `fn` throws, or "" when it throws nothing.
template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// ---- clocks ----------------------------------------------------------------------------------------

// Each launch costs the host launch_overhead_us before its kernel can start: kernels shorter than that
// leave the compute stream idle for the difference each (a host-bound stream), longer ones only the first.
TEST(Clocks, TheComputeStreamWaitsForTheHostWhereKernelsAreShorterThanTheirLaunches) {
  const double launch_us = quiet_config().profile.gpu.launch_overhead_us;
  auto host_wait_us = [](std::int64_t elements) {
    return run_collect<double>(1, [&](Rank& r) {
      Tensor a = r.phantom({elements});
      r.synchronize();
      const double before_us = r.host_wait_us();
      for (int i = 0; i < 10; ++i) {
        r.scale_(a, 2.0f);
        r.synchronize();  // each alone: the stream is free when the next launch starts
      }
      return r.host_wait_us() - before_us;
    })[0];
  };
  // Each of the 10 launches finds the stream free (synchronize) and the kernel starts one launch later.
  EXPECT_DOUBLE_EQ(host_wait_us(16), 10 * launch_us);
  EXPECT_DOUBLE_EQ(host_wait_us(1 << 26), 10 * launch_us);
  // Back to back: a short kernel ends before the next launch, a long one long after it.
  auto back_to_back_wait_us = [](std::int64_t elements) {
    return run_collect<double>(1, [&](Rank& r) {
      Tensor a = r.phantom({elements});
      r.synchronize();
      const double before_us = r.host_wait_us();
      for (int i = 0; i < 10; ++i) r.scale_(a, 2.0f);
      r.synchronize();
      return r.host_wait_us() - before_us;
    })[0];
  };
  EXPECT_GT(back_to_back_wait_us(16), 9 * 0.5 * launch_us);    // a few-us kernel: most of each launch idle
  EXPECT_DOUBLE_EQ(back_to_back_wait_us(1 << 26), launch_us);  // 256 MiB passes: only the first launch
}

TEST(Clocks, BarrierBeforeSynchronizeMeasuresLessThanSynchronizeThenBarrier) {
  // Rank 1 has more device work. Timed the right way, rank 0 sees the slowest rank's end; timed with
  // the barrier first, rank 0's barrier passes before rank 1's kernels finish and it measures too little.
  auto measure = [](bool right_order) {
    return run_collect<double>(2, [&](Rank& r) {
      Tensor a = r.phantom({4096, 4096});
      r.synchronize();
      r.barrier();
      const double t0 = r.now();
      for (int i = 0; i < (r.rank() == 1 ? 8 : 1); ++i) r.matmul(a, a);
      if (right_order) {
        r.synchronize();
        r.barrier();
      } else {
        r.barrier();
        r.synchronize();
      }
      return r.now() - t0;
    });
  };
  const auto right = measure(true), wrong = measure(false);
  EXPECT_LT(wrong[0], right[0]);
  EXPECT_DOUBLE_EQ(right[0], right[1]);  // both ranks agree once they synchronize first
}

TEST(Clocks, WithoutSynchronizeOnlyTheLaunchIsTimed) {
  auto times = run_collect<std::pair<double, double>>(2, [](Rank& r) {
    Tensor t = r.phantom({256 << 20});  // 1 GiB
    const double t0 = r.now();
    r.all_reduce(t, ReduceOp::Sum);
    const double launched = r.now() - t0;
    r.synchronize();
    return std::make_pair(launched, r.now() - t0);
  });
  const Profile p = quiet_config().profile;
  EXPECT_DOUBLE_EQ(times[0].first, p.gpu.launch_overhead_us);
  EXPECT_GT(times[0].second, 100 * times[0].first);
}

TEST(Clocks, AllReduceTimeIsTheModelledNcclTimeExactly) {
  const int w = 4;
  const std::int64_t count = 100'000'000;  // the lecture's 100M float32
  auto times = run_collect<double>(w, [&](Rank& r) {
    Tensor t = r.phantom({count});
    r.synchronize();
    r.barrier();
    const double t0 = r.now();
    r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
    return r.now() - t0;
  });
  const Profile p = quiet_config().profile;
  const double bytes = 4.0 * count;
  // NCCL chooses by its own model (src/graph/tuning.cc of 2.21.5): the ring graph holds 12 channels of 30
  // GB/s, 360 GB/s of bus bandwidth, w / 2(w-1) of it algorithm bandwidth; the NVLS graph one channel per
  // GPU, 4 x 60 GB/s, x 5/6. The ring's 240 GB/s beats NVLS's 200, so NCCL runs the ring.
  const double ring_model_us = 8.4 + 2.0 * (w - 1) * 3.4 + bytes / (360.0 * w / (2.0 * (w - 1)) * 1e3);
  const double nvls_model_us = 25.0 + bytes / (4 * 60.0 * 5.0 / 6.0 * 1e3);
  ASSERT_LT(ring_model_us, nvls_model_us);
  // It runs at what NCCL's transfers sustain on one GPU's NVLink, 18 x 25 GB/s x 0.824 = 370.8 GB/s: the
  // ring with the Simple protocol, NCCL's 8.4 us base and 3.4 us per NVLink step, 2(n-1) steps; every GPU's
  // NVLink carries 2(n-1)/n of the bytes each way.
  const double nvlink_gbps = p.nvlink.gpu_bandwidth_gbps() * p.nvlink.efficiency;
  const double run_us = 8.4 + 2.0 * (w - 1) * 3.4 + 2.0 * (w - 1) / w * bytes / (nvlink_gbps * 1e3);
  EXPECT_NEAR(times[0], p.gpu.launch_overhead_us + run_us, 1e-6);
}

TEST(Clocks, AsyncCollectiveOverlapsCompute) {
  // The same compute and communication take less time when the collective is async.
  auto run = [](Async mode) {
    return run_collect<double>(2, [&](Rank& r) {
      Tensor grad = r.phantom({64 << 20});
      Tensor a = r.phantom({4096, 4096});
      Work w = r.all_reduce(grad, ReduceOp::Avg, mode);
      for (int i = 0; i < 4; ++i) r.matmul(a, a);
      w.wait();
      r.synchronize();
      return r.now();
    })[0];
  };
  EXPECT_LT(run(Async::Yes), run(Async::No));
}

// Where rank 0's first "fill" kernel (zeros) starts, and the end of each collective, in the order posted.
struct FillAfterCollectives {
  double fill_start_us = -1;
  std::vector<double> collective_end_us;
};
FillAfterCollectives fill_after(const std::function<void(Rank&)>& fn) {
  SimBackend backend(quiet_config());
  const RunReport rep = backend.launch(2, fn);
  FillAfterCollectives out;
  for (const Span& s : rep.spans) {
    if (s.rank == 0 && s.kind == SpanKind::Compute && s.name == "fill" && out.fill_start_us < 0) {
      out.fill_start_us = s.start_us;
    }
  }
  for (const CollectiveRecord& c : rep.collectives) out.collective_end_us.push_back(c.end_us);
  return out;
}

// wait() makes the compute stream wait (torch's work.wait() on NCCL), not the host: the next kernel starts
// when the operation ends, even one that reads no tensor, and waiting for a later collective of the group
// covers an earlier one, not the other way round.
TEST(Clocks, TheComputeStreamWaitsForWhatWaitWasCalledOnAndNoMore) {
  auto two_buckets = [](bool wait_first, bool wait_second) {
    return fill_after([=](Rank& r) {
      Tensor a = r.phantom({16 << 20}), b = r.phantom({16 << 20});
      Work first = r.all_reduce(a, ReduceOp::Sum, Async::Yes);
      Work second = r.all_reduce(b, ReduceOp::Sum, Async::Yes);
      const double host_us = r.now();
      if (wait_second) second.wait();
      if (wait_first) first.wait();
      EXPECT_EQ(r.now(), host_us) << "wait() does not hold the host";
      Tensor z = r.zeros({4});
      r.synchronize();
    });
  };
  const FillAfterCollectives first = two_buckets(true, false);
  ASSERT_EQ(first.collective_end_us.size(), 2u);
  EXPECT_LT(first.collective_end_us[0], first.collective_end_us[1]);
  EXPECT_DOUBLE_EQ(first.fill_start_us, first.collective_end_us[0]);
  // Waited for in reverse order: the earlier must not replace the later.
  const FillAfterCollectives both = two_buckets(true, true);
  EXPECT_DOUBLE_EQ(both.fill_start_us, both.collective_end_us[1]);
  const FillAfterCollectives none = two_buckets(false, false);
  EXPECT_LT(none.fill_start_us, none.collective_end_us[0]);
}

TEST(Clocks, AKernelAfterASynchronousCollectiveStartsAtItsEnd) {
  const FillAfterCollectives sync = fill_after([](Rank& r) {
    Tensor a = r.phantom({16 << 20});
    r.all_reduce(a, ReduceOp::Sum);
    Tensor z = r.zeros({4});
    r.synchronize();
  });
  ASSERT_EQ(sync.collective_end_us.size(), 1u);
  EXPECT_DOUBLE_EQ(sync.fill_start_us, sync.collective_end_us[0]);
}

TEST(Clocks, ReportSplitsComputeCommAndIdle) {
  SimBackend backend(quiet_config());
  RunReport rep = backend.launch(2, [](Rank& r) {
    Tensor a = r.phantom({2048, 2048});
    if (r.rank() == 1) r.matmul(a, a);  // rank 0 waits for rank 1 at the all_reduce
    Tensor g = r.phantom({1 << 20});
    r.all_reduce(g, ReduceOp::Sum);
    r.synchronize();
  });
  ASSERT_EQ(rep.ranks.size(), 2u);
  EXPECT_EQ(rep.ranks[0].compute_us, 0);
  EXPECT_GT(rep.ranks[1].compute_us, 0);
  EXPECT_GT(rep.ranks[0].comm_wait_us, 0);  // the bubble: waiting for the late member
  EXPECT_EQ(rep.ranks[1].comm_wait_us, 0);
  EXPECT_DOUBLE_EQ(rep.ranks[0].comm_us, rep.ranks[1].comm_us);
  ASSERT_EQ(rep.collectives.size(), 1u);
  EXPECT_EQ(rep.collectives[0].bytes, 4 << 20);
  // nccl-tests' all_reduce bus factor 2(n-1)/n is exactly 1 for two ranks.
  EXPECT_DOUBLE_EQ(rep.collectives[0].busbw_gbps, rep.collectives[0].algbw_gbps);
}

TEST(Clocks, BookkeepingTakesItsTimeButStaysOutOfTheTables) {
  SimBackend backend(quiet_config());
  RunReport rep = backend.launch(2, [](Rank& r) {
    Tensor g = r.phantom({1 << 20});
    r.all_reduce(g, ReduceOp::Sum);  // the lesson's work
    {
      auto scope = r.bookkeeping("check");
      Tensor c = r.phantom({1 << 18});
      r.all_reduce(c, ReduceOp::Sum);  // its check: 1 MiB
    }
    r.synchronize();
  });
  ASSERT_EQ(rep.collectives.size(), 2u);
  EXPECT_FALSE(rep.collectives[0].bookkeeping);
  EXPECT_TRUE(rep.collectives[1].bookkeeping);
  EXPECT_GT(rep.collectives[1].time_us(), 0);  // it ran and took its time
  // Only the work's 4 MiB is on the links: in a ring of two each rank sends 2(n-1)/n = 1 times it, over two
  // links (to the NVSwitch and from it); the check's 1 MiB would add a quarter.
  EXPECT_EQ(rep.total_link_bytes(), 2 * 2 * (4 << 20));
  const std::string summary = format_summary(rep);
  EXPECT_NE(summary.find("(and 1 collective of the lesson's own checks and figures, 1 MiB in all, left out"),
            std::string::npos)
      << summary;
  // The flag survives the report file.
  EXPECT_TRUE(report_from_json(report_to_json(rep)).collectives[1].bookkeeping);
}

// ---- determinism -----------------------------------------------------------------------------------

TEST(Determinism, TwoRunsGiveIdenticalNumbersAndTimes) {
  auto once = [] {
    SimBackend backend(quiet_config());
    Settings o;
    o["world"] = option_text(4);
    return run_lesson(backend, "collectives", o);
  };
  const RunReport a = once(), b = once();
  EXPECT_EQ(a.output, b.output);
  ASSERT_EQ(a.spans.size(), b.spans.size());
  for (size_t i = 0; i < a.spans.size(); ++i) {
    EXPECT_EQ(a.spans[i].rank, b.spans[i].rank);
    EXPECT_EQ(a.spans[i].start_us, b.spans[i].start_us);
    EXPECT_EQ(a.spans[i].end_us, b.spans[i].end_us);
  }
  EXPECT_EQ(a.makespan_us, b.makespan_us);
  EXPECT_TRUE(a.all_checks_passed());
}

// ---- faults ----------------------------------------------------------------------------------------

TEST(Faults, EveryRankInRecvIsADeadlockNamingEachRank) {
  const std::string msg = run_error_message(3, [](Rank& r) {
    Tensor t = r.zeros({2});
    r.recv(t, (r.rank() + 1) % 3);
    r.to_host(t);
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(msg.find("rank " + std::to_string(rank) + ": to_host"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string((rank + 1) % 3) + " has not called it"), std::string::npos)
        << msg;
  }
}

TEST(Faults, ARankThatSkipsACollectiveIsNamed) {
  const std::string msg = run_error_message(4, [](Rank& r) {
    Tensor t = r.zeros({2});
    if (r.rank() != 3) r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 3 has not called it"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 3: finished its program"), std::string::npos) << msg;
}

TEST(Faults, AWaitedCollectiveARankSkipsIsNamedAtTheNextKernel) {
  const std::string msg = run_error_message(4, [](Rank& r) {
    Tensor t = r.phantom({1024});
    if (r.rank() != 3) r.all_reduce(t, ReduceOp::Sum, Async::Yes).wait();
    r.relu(t);
    r.synchronize();
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0: relu (after wait() on an asynchronous all_reduce) waits for"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rank 3 has not called it"), std::string::npos) << msg;
}

// The kernel after a synchronous collective need not block for it, but the wait is still the kernel's.
TEST(Faults, ASynchronousCollectiveARankSkipsIsNamedAtTheKernelAfterIt) {
  const std::string msg = run_error_message(4, [](Rank& r) {
    Tensor t = r.phantom({1024});
    if (r.rank() != 3) r.all_reduce(t, ReduceOp::Sum);
    r.relu(t);
    r.synchronize();
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0: relu (after a synchronous all_reduce) waits for"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 3 has not called it"), std::string::npos) << msg;
}

TEST(Faults, BlockingSendsFacingEachOtherDeadlockAsOnNccl) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    Tensor out = r.zeros({2}), in = r.zeros({2});
    const int peer = 1 - r.rank();
    r.send(out, peer);
    r.recv(in, peer);
    r.synchronize();
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("must first finish send/recv"), std::string::npos) << msg;
}

TEST(Faults, BarrierThatOneRankNeverReachesIsADeadlock) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    if (r.rank() == 0) r.barrier();
  });
  EXPECT_NE(msg.find("barrier #0 on world: 1 of 2 ranks have arrived"), std::string::npos) << msg;
}

TEST(Faults, MismatchedSizesNameEveryRank) {
  // Rank 3 computes first, so in virtual-time order it is the last to call the all_reduce: rank 1's
  // disagreement is caught before rank 3 arrives.
  const std::string msg = run_error_message(4, [](Rank& r) {
    Tensor t = r.zeros({r.rank() == 1 ? 8 : 4});
    if (r.rank() == 3) r.matmul(r.phantom({1024, 1024}), r.phantom({1024, 1024}));
    r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
  });
  EXPECT_NE(msg.find("ranks disagree"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0: all_reduce(float32[4], Sum)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1: all_reduce(float32[8], Sum)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 3: has not called it yet"), std::string::npos) << msg;
}

TEST(Faults, MismatchedOperationRootAndReduceOp) {
  EXPECT_NE(run_error_message(2,
                              [](Rank& r) {
                                Tensor t = r.zeros({4});
                                r.rank() == 0 ? r.all_reduce(t, ReduceOp::Sum) : r.broadcast(t, 0);
                              })
                .find("ranks disagree"),
            std::string::npos);
  EXPECT_NE(run_error_message(2,
                              [](Rank& r) {
                                Tensor t = r.zeros({4});
                                r.broadcast(t, r.rank());
                              })
                .find("root="),
            std::string::npos);
  EXPECT_NE(run_error_message(2,
                              [](Rank& r) {
                                Tensor t = r.zeros({4});
                                r.all_reduce(t, r.rank() == 0 ? ReduceOp::Sum : ReduceOp::Max);
                              })
                .find("Max"),
            std::string::npos);
}

TEST(Faults, SendAndRecvOfDifferentSizes) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    if (r.rank() == 0) r.send(r.zeros({4}), 1);
    if (r.rank() == 1) r.recv(r.zeros({5}), 0);
  });
  EXPECT_NE(msg.find("rank 0 sends float32[4] but rank 1 receives into float32[5]"), std::string::npos)
      << msg;
}

TEST(Faults, AnExceptionInOneRankEndsTheRunWithItsMessage) {
  const std::string msg = run_error_message(4, [](Rank& r) {
    Tensor t = r.zeros({4});
    if (r.rank() == 2) throw std::runtime_error("rank 2 gave up");
    r.all_reduce(t, ReduceOp::Sum);  // the others wait here for rank 2 and must be unwound
    r.to_host(t);
  });
  EXPECT_EQ(msg, "rank 2 threw std::runtime_error: rank 2 gave up");
}

TEST(Faults, OutOfMemoryNamesRankRequestAndCapacity) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    std::vector<Tensor> held;
    if (r.rank() == 1) {
      for (int i = 0; i < 100; ++i) held.push_back(r.phantom({std::int64_t{1} << 30}));  // 4 GiB each
    }
  });
  EXPECT_NE(msg.find("rank 1: phantom: out of memory allocating float32[1073741824] (4 GiB)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("H100"), std::string::npos) << msg;
}

TEST(Faults, ReadingATensorBeforeWaitingOnItsAsyncCollective) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    Tensor t = r.zeros({4});
    Work w = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
    r.scale_(t, 2.0f);
    w.wait();
  });
  EXPECT_NE(msg.find("not waited on"), std::string::npos) << msg;
  EXPECT_NE(msg.find("scale_"), std::string::npos) << msg;
}

TEST(Faults, BadArgumentsAreClearErrors) {
  SimBackend backend(quiet_config());
  EXPECT_NE(error_of<UsageError>([&] { backend.launch(0, [](Rank&) {}); }).find("--world"),
            std::string::npos);
  EXPECT_NE(error_of<UsageError>([&] { backend.launch(9, [](Rank&) {}); }).find("--nodes 2"),
            std::string::npos);
  EXPECT_NE(
      run_error_message(2, [](Rank& r) { r.broadcast(r.zeros({2}), 5); }).find("root 5 is not a member"),
      std::string::npos);
  EXPECT_NE(run_error_message(2, [](Rank& r) { r.send(r.zeros({2}), r.rank()); }).find("this rank itself"),
            std::string::npos);
  EXPECT_NE(run_error_message(2, [](Rank& r) { r.all_gather(r.zeros({3}), r.zeros({2})); })
                .find("must have 2 times its first dimension"),
            std::string::npos);
  EXPECT_NE(run_error_message(2,
                              [](Rank& r) {
                                r.matmul(r.zeros({2, 3}), r.zeros({2, 3}));
                              })
                .find("inner dimensions differ"),
            std::string::npos);
  EXPECT_NE(run_error_message(2,
                              [](Rank& r) {
                                Group g = r.new_group({0});
                                r.all_reduce(r.zeros({1}), ReduceOp::Sum, Async::No, g);
                              })
                .find("rank 1 is not a member"),
            std::string::npos);
  EXPECT_NE(
      run_error_message(2, [](Rank& r) { r.new_group({r.rank()}); }).find("same ranks in the same order"),
      std::string::npos);
}

TEST(Memory, AllocatedAndPeakFollowTensorLifetimes) {
  auto got = run_collect<std::vector<std::int64_t>>(1, [](Rank& r) {
    std::vector<std::int64_t> v;
    {
      Tensor a = r.zeros({256});
      Tensor b = r.phantom({1024});
      v.push_back(r.memory_allocated());
    }
    v.push_back(r.memory_allocated());
    v.push_back(r.memory_peak());
    v.push_back(r.memory_capacity());
    return v;
  });
  EXPECT_EQ(got[0][0], 4 * (256 + 1024));
  EXPECT_EQ(got[0][1], 0);
  EXPECT_EQ(got[0][2], 4 * (256 + 1024));
  EXPECT_EQ(got[0][3], quiet_config().profile.hbm_capacity_bytes());
}

}  // namespace
}  // namespace ranklab

namespace ranklab {
namespace {

TEST(Memory, CommunicatedTensorsAreFreedOnceTheirOperationsFinish) {
  auto left = testing::run_collect<std::int64_t>(2, [](Rank& r) {
    for (int i = 0; i < 8; ++i) {
      Tensor t = r.phantom({16 << 20});
      if (r.rank() == 0) r.send(t, 1);
      if (r.rank() == 1) r.recv(t, 0);
      Tensor g = r.phantom({1 << 20});
      r.all_reduce(g, ReduceOp::Sum, Async::Yes).wait();
    }
    r.synchronize();
    return r.memory_allocated();
  });
  EXPECT_EQ(left[0], 0);
  EXPECT_EQ(left[1], 0);
}

// Without the timeline (SimConfig::keep_timeline, as `plan` runs) a run keeps no span and no collective
// record, and its clocks, memory peaks and results are the same.
TEST(Timeline, LeftOutItChangesNeitherTimeNorMemory) {
  auto run = [](bool keep) {
    SimConfig c = quiet_config();
    c.keep_timeline = keep;
    SimBackend backend(c);
    return backend.launch(4, [](Rank& r) {
      Tensor a = r.phantom(Shape{1 << 20}, DType::BFloat16);
      Tensor w = r.phantom(Shape{1024, 1024}, DType::BFloat16);
      for (int i = 0; i < 8; ++i) {
        Work w_reduce = r.all_reduce(a, ReduceOp::Sum, Async::Yes);
        Tensor y = r.matmul(r.phantom(Shape{1024, 1024}, DType::BFloat16), w);
        w_reduce.wait();
      }
      r.synchronize();
    });
  };
  const RunReport with = run(true), without = run(false);
  EXPECT_FALSE(with.spans.empty());
  EXPECT_FALSE(with.collectives.empty());
  EXPECT_TRUE(without.spans.empty());
  EXPECT_TRUE(without.collectives.empty());
  EXPECT_EQ(without.makespan_us, with.makespan_us);
  ASSERT_EQ(without.ranks.size(), with.ranks.size());
  for (std::size_t r = 0; r < with.ranks.size(); ++r) {
    EXPECT_EQ(without.ranks[r].end_us, with.ranks[r].end_us) << "rank " << r;
    EXPECT_EQ(without.ranks[r].peak_bytes, with.ranks[r].peak_bytes) << "rank " << r;
  }
  EXPECT_EQ(without.total_link_bytes(), with.total_link_bytes());
}

}  // namespace
}  // namespace ranklab
