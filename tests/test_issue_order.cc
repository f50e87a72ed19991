// A rank whose communication call only marks it arrived at a collective that still waits for another
// member posts it at once, without first letting the ranks whose clocks are behind run
// (SimWorld::arrival_only). These tests check that it does, and that every time is exactly what issuing
// each call in clock order gives (SimConfig::issue_in_clock_order), on random programs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/lesson.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;

SimConfig config(bool in_clock_order, int nodes = 1, bool sm_contention = true) {
  SimConfig c = quiet_config(nodes);
  c.issue_in_clock_order = in_clock_order;
  c.sm_contention = sm_contention;
  return c;
}

// Every rank computes, then posts an asynchronous all_reduce and notes it. Rank 0 runs first and its clock
// is then ahead of the ranks that have not run: posting at once, it notes its post before they start.
std::vector<std::string> order_of_events(bool in_clock_order, bool sm_contention) {
  std::vector<std::string> events;
  SimBackend backend(config(in_clock_order, 1, sm_contention));
  backend.launch(4, [&](Rank& r) {
    events.push_back(fmt::format("{} starts", r.rank()));
    Tensor a = r.phantom({1024, 1024});
    Tensor b = r.matmul(a, a);
    Work w = r.all_reduce(b, ReduceOp::Sum, Async::Yes);
    events.push_back(fmt::format("{} posted", r.rank()));
    w.wait();
  });
  return events;
}

TEST(IssueOrder, AnArrivalIsPostedBeforeTheRanksBehindRun) {
  // With communication sharing the GPU too: the kernels after the post wait to be timed, not the post.
  for (const bool sm_contention : {false, true}) {
    const std::vector<std::string> ahead = order_of_events(false, sm_contention);
    ASSERT_GE(ahead.size(), 3u);
    EXPECT_EQ(ahead[0], "0 starts") << "sm_contention " << sm_contention;
    EXPECT_EQ(ahead[1], "0 posted") << "sm_contention " << sm_contention;
    EXPECT_EQ(ahead[2], "1 starts") << "sm_contention " << sm_contention;
  }
  // In clock order, rank 0 waits until every rank has reached the clock it posts at.
  const std::vector<std::string> in_order = order_of_events(true, true);
  ASSERT_EQ(in_order.size(), 8u);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(in_order[rank], fmt::format("{} starts", rank));
}

// Every rank posts an asynchronous all_reduce, then computes beside it and posts a second one behind that
// kernel: the kernel's time waits for the first all_reduce's start, which the other ranks decide. Rank 0
// goes on past its second post without waiting for that (the post is deferred), and notes it before any
// other rank has run; in clock order it waits.
std::vector<std::string> deferred_events(bool in_clock_order) {
  std::vector<std::string> events;
  SimBackend backend(config(in_clock_order));
  backend.launch(4, [&](Rank& r) {
    events.push_back(fmt::format("{} starts", r.rank()));
    Tensor grad = r.phantom({1024, 1024}), a = r.phantom({1024, 1024});
    Work first = r.all_reduce(grad, ReduceOp::Sum, Async::Yes);
    Tensor b = r.matmul(a, a);
    Work second = r.all_reduce(b, ReduceOp::Sum, Async::Yes);
    events.push_back(fmt::format("{} posted behind a kernel", r.rank()));
    first.wait();
    second.wait();
    r.synchronize();
  });
  return events;
}

TEST(IssueOrder, APostBehindKernelsNotYetTimedDoesNotWaitForThem) {
  const std::vector<std::string> ahead = deferred_events(false);
  ASSERT_EQ(ahead.size(), 8u);
  EXPECT_EQ(ahead[0], "0 starts");
  EXPECT_EQ(ahead[1], "0 posted behind a kernel");
  const std::vector<std::string> in_order = deferred_events(true);
  ASSERT_EQ(in_order.size(), 8u);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(in_order[rank], fmt::format("{} starts", rank));
}

// Every rank gathers a layer's weights into a buffer it drops after the layer's kernel, synchronously, 8
// times; then posts three asynchronous all_reduces on buffers it drops at once, waits for the last one
// only, computes and allocates. The kernels after the gathers and the wait need not wait for those
// operations' ends, so rank 0 goes on past all of it before any other rank has run; in clock order it
// waits. The buffers count until the point where waiting would have seen the operations end (for the
// first two all_reduces too, which end before the last), so the peaks are the same either way.
struct LayersRun {
  std::vector<std::string> events;
  std::vector<std::int64_t> peak_bytes;
};

LayersRun gather_layers(bool in_clock_order) {
  LayersRun run;
  run.peak_bytes.assign(4, 0);
  SimBackend backend(config(in_clock_order));
  backend.launch(4, [&](Rank& r) {
    run.events.push_back(fmt::format("{} starts", r.rank()));
    Tensor shard = r.phantom({1 << 16}), x = r.phantom({256, 256});
    for (int layer = 0; layer < 8; ++layer) {
      Tensor full = r.phantom({4 << 16});
      r.all_gather(full, shard);
      x = r.matmul(x, x);
    }
    std::vector<Work> works;
    for (int i = 0; i < 3; ++i)
      works.push_back(r.all_reduce(r.phantom({1 << 18}), ReduceOp::Sum, Async::Yes));
    works.back().wait();
    x = r.matmul(x, x);
    Tensor activations = r.phantom({1 << 20});  // allocated after the kernel: the all_reduces are over
    run.events.push_back(fmt::format("{} past the layers", r.rank()));
    r.synchronize();
    run.peak_bytes[r.rank()] = r.memory_peak();
  });
  return run;
}

TEST(IssueOrder, AKernelAfterASynchronousCollectiveDoesNotWaitForItsEnd) {
  const LayersRun ahead = gather_layers(false), in_order = gather_layers(true);
  ASSERT_EQ(ahead.events.size(), 8u);
  EXPECT_EQ(ahead.events[0], "0 starts");
  EXPECT_EQ(ahead.events[1], "0 past the layers");
  ASSERT_EQ(in_order.events.size(), 8u);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(in_order.events[rank], fmt::format("{} starts", rank));
  EXPECT_EQ(ahead.peak_bytes, in_order.peak_bytes);
  // Not the eight gathered layers at once that a rank running ahead would hold if each gather kept its
  // buffer until it ended.
  EXPECT_LT(ahead.peak_bytes[0], 8 * 4 * (4 << 16));
}

// A random SPMD program: the same steps on every rank, with compute whose size differs by rank (so the
// ranks' clocks drift apart), collectives on the world and on two sub-groups, synchronous and not,
// point-to-point rings, waits and synchronizes.
struct Step {
  enum Kind { Compute, Collective, Ring, WaitAll, Synchronize } kind;
  CommOp op = CommOp::AllReduce;
  int group = 0;  // 0: world, 1: even ranks, 2: odd ranks
  bool async = false;
  std::int64_t numel = 0;
};

std::vector<Step> random_program(std::uint32_t seed) {
  std::mt19937 gen(seed);
  auto pick = [&](int n) { return static_cast<int>(gen() % static_cast<std::uint32_t>(n)); };
  const CommOp ops[] = {CommOp::AllReduce, CommOp::AllGather, CommOp::ReduceScatter};
  std::vector<Step> steps;
  for (int i = 0; i < 60; ++i) {
    Step s{static_cast<Step::Kind>(pick(10) < 4 ? 0 : pick(10) < 7 ? 1 : 2 + pick(3))};
    s.op = ops[pick(3)];
    s.group = pick(3);
    s.async = pick(2) == 1;
    s.numel = std::int64_t{1024} << (2 * pick(6));  // 4 KiB to 4 MiB
    steps.push_back(s);
  }
  return steps;
}

RunReport run_program(const std::vector<Step>& steps, std::uint32_t seed, bool in_clock_order, int world,
                      int nodes, bool sm_contention) {
  SimBackend backend(config(in_clock_order, nodes, sm_contention));
  return backend.launch(world, [&](Rank& r) {
    const int w = r.world_size();
    std::vector<int> evens, odds;
    for (int i = 0; i < w; ++i) (i % 2 == 0 ? evens : odds).push_back(i);
    const Group groups[] = {Group(), r.new_group(evens), r.new_group(odds)};
    const bool even = r.rank() % 2 == 0;
    std::vector<Work> pending;
    std::vector<Tensor> keep;  // buffers of calls not yet waited on
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      switch (s.kind) {
        case Step::Compute: {
          const std::int64_t n = 256 * (1 + (seed + 7 * r.rank() + 3 * i) % 5);
          Tensor a = r.phantom({n, n});
          keep.push_back(r.matmul(a, a));
          break;
        }
        case Step::Collective: {
          if (s.group != 0 && even != (s.group == 1)) break;  // not a member
          const int n = s.group == 0 ? w : static_cast<int>((s.group == 1 ? evens : odds).size());
          Tensor small = r.phantom({s.numel});
          Tensor large = r.phantom({s.numel * n});
          const Async a = s.async ? Async::Yes : Async::No;
          Work work = s.op == CommOp::AllReduce ? r.all_reduce(small, ReduceOp::Sum, a, groups[s.group])
                      : s.op == CommOp::AllGather
                          ? r.all_gather(large, small, a, groups[s.group])
                          : r.reduce_scatter(small, large, ReduceOp::Sum, a, groups[s.group]);
          keep.push_back(small);
          keep.push_back(large);
          if (s.async) pending.push_back(std::move(work));
          break;
        }
        case Step::Ring: {
          Tensor out = r.phantom({s.numel}), in = r.phantom({s.numel});
          const std::vector<Rank::P2POp> ring = {{CommOp::Send, out, (r.rank() + 1) % w},
                                                 {CommOp::Recv, in, (r.rank() + w - 1) % w}};
          for (Work& work : r.batch_isend_irecv(ring)) {
            pending.push_back(std::move(work));
          }
          keep.push_back(out);
          keep.push_back(in);
          break;
        }
        case Step::WaitAll:
        case Step::Synchronize:
          for (Work& work : pending) work.wait();
          pending.clear();
          keep.clear();
          if (s.kind == Step::Synchronize) r.synchronize();
          break;
      }
    }
    for (Work& work : pending) work.wait();
    r.synchronize();
  });
}

// Every span and collective with its times, in one order: the report lists them in the order the
// simulator recorded them, which depends on the order the ranks ran in.
using TimedRow = std::tuple<int, double, double, int, std::string>;
std::vector<TimedRow> timed_rows(const RunReport& report) {
  std::vector<TimedRow> rows;
  for (const Span& s : report.spans) {
    rows.emplace_back(s.rank, s.start_us, s.end_us, static_cast<int>(s.kind), s.name.str());
  }
  for (const CollectiveRecord& c : report.collectives) {
    rows.emplace_back(-1, c.start_us, c.end_us, static_cast<int>(c.op), c.group.str());
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

void expect_same_times(const RunReport& a, const RunReport& b, const std::string& what) {
  EXPECT_EQ(a.makespan_us, b.makespan_us) << what;
  const std::vector<TimedRow> rows_a = timed_rows(a), rows_b = timed_rows(b);
  ASSERT_EQ(rows_a.size(), rows_b.size()) << what;
  for (std::size_t i = 0; i < rows_a.size(); ++i) {
    const auto& [rank, start_us, end_us, kind, name] = rows_a[i];
    EXPECT_EQ(rows_a[i], rows_b[i]) << what << ": rank " << rank << " " << name << " " << start_us << " - "
                                    << end_us << " against rank " << std::get<0>(rows_b[i]) << " "
                                    << std::get<4>(rows_b[i]) << " " << std::get<1>(rows_b[i]) << " - "
                                    << std::get<2>(rows_b[i]);
  }
}

TEST(IssueOrder, RandomProgramsTakeTheTimesOfIssuingInClockOrder) {
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    const std::vector<Step> steps = random_program(seed);
    const int nodes = seed % 3 == 0 ? 2 : 1;
    const int world = 8 * nodes;
    // With communication sharing the GPU, posts behind kernels not yet timed are deferred as well.
    const bool sm_contention = seed % 2 == 0;
    const RunReport ahead = run_program(steps, seed, false, world, nodes, sm_contention);
    const RunReport in_order = run_program(steps, seed, true, world, nodes, sm_contention);
    EXPECT_GT(ahead.collectives.size(), 15u) << "seed " << seed;
    expect_same_times(ahead, in_order,
                      fmt::format("seed {} on {} node(s), sm contention {}", seed, nodes, sm_contention));
  }
}

TEST(IssueOrder, LessonsTakeTheTimesOfIssuingInClockOrder) {
  for (const char* lesson : {"data_parallel", "tensor_parallel", "pipeline_parallel", "benchmark"}) {
    auto run = [&](bool in_clock_order) {
      SimBackend backend(config(in_clock_order));
      Settings o;
      o["world"] = option_text(8);
      if (std::string(lesson) != "benchmark") o["layers"] = option_text(8);
      if (std::string(lesson) == "data_parallel") o["overlap"] = option_text(true);
      return run_lesson(backend, lesson, o);
    };
    expect_same_times(run(false), run(true), lesson);
  }
}

// Rank 0 posts X (with rank 2, which posts it late), launches a short kernel beside it, posts P (with rank
// 1) behind that kernel and waits at a barrier with rank 2. The kernel's time needs X's start, so P is
// deferred, and P's start is the kernel's end, long before X starts. Meanwhile ranks 1 and 2 run an
// all_reduce of their own and synchronize: with every rank blocked, the engine must stop at rank 0's
// kernel to start P there, not run on to the end of the ranks' all_reduce.
RunReport run_deferred_past_a_block(bool in_clock_order) {
  SimBackend backend(config(in_clock_order));
  return backend.launch(3, [&](Rank& r) {
    const Group x_group = r.new_group({0, 2}), p_group = r.new_group({0, 1}), other = r.new_group({1, 2});
    Tensor x = r.phantom({1 << 24}), p = r.phantom({1 << 20}), small = r.phantom({64, 64});
    if (r.rank() == 0) {
      Work wx = r.all_reduce(x, ReduceOp::Sum, Async::Yes, x_group);
      r.matmul(small, small);
      Work wp = r.all_reduce(p, ReduceOp::Sum, Async::Yes, p_group);
      r.barrier(x_group);
      wx.wait();
      wp.wait();
    } else if (r.rank() == 1) {
      Work wp = r.all_reduce(p, ReduceOp::Sum, Async::Yes, p_group);
      r.all_reduce(x, ReduceOp::Sum, Async::No, other);
      r.synchronize();
      wp.wait();
    } else {
      r.all_reduce(x, ReduceOp::Sum, Async::No, other);
      r.synchronize();
      r.barrier(x_group);
      r.all_reduce(x, ReduceOp::Sum, Async::Yes, x_group).wait();
    }
    r.synchronize();
  });
}

TEST(IssueOrder, ADeferredPostHoldsTheEngineAtTheKernelsBeforeIt) {
  const RunReport deferred = run_deferred_past_a_block(false), in_order = run_deferred_past_a_block(true);
  expect_same_times(deferred, in_order, "a deferred post behind a barrier");
}

}  // namespace
}  // namespace ranklab
