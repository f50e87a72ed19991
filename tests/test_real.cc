// The real backend. Its host side (the rendezvous of rank threads, the per-rank logs and how they become a
// report) is tested everywhere; everything that needs a GPU skips itself where none is visible, and on a
// GPU checks every collective, every compute op and every lesson against the simulator's numbers for the
// same seeds, at the largest world the machine allows.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "real/host_comm.h"
#include "real/rank_log.h"
#include "sim_fixture.h"

#if defined(RANKLAB_HAVE_CUDA)
#include "real/cuda_backend.h"
#endif

namespace ranklab {
namespace {

// ---- the thread launcher's host rendezvous ------------------------------------------------------------

// Runs `fn(comm)` on `n` threads over one ThreadHostWorld.
void on_threads(int n, const std::function<void(ThreadHostComm&)>& fn) {
  ThreadHostWorld world(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&world, &fn, r] {
      ThreadHostComm comm(&world, r);
      fn(comm);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(ThreadHostComm, BroadcastAndGatherKeepRankOrder) {
  std::vector<std::string> ids(4), gathered_on_0, all_on_3;
  on_threads(4, [&](ThreadHostComm& c) {
    std::string id = c.rank() == 0 ? "the unique id" : "";
    c.broadcast(id);
    ids[c.rank()] = id;
    auto g = c.gather("r" + std::to_string(c.rank()));
    if (c.rank() == 0) gathered_on_0 = g;
    if (c.rank() != 0) {
      EXPECT_TRUE(g.empty());
    }
    auto a = c.all_gather(std::to_string(c.rank() * 10));
    if (c.rank() == 3) all_on_3 = a;
  });
  for (const auto& id : ids) EXPECT_EQ(id, "the unique id");
  EXPECT_EQ(gathered_on_0, (std::vector<std::string>{"r0", "r1", "r2", "r3"}));
  EXPECT_EQ(all_on_3, (std::vector<std::string>{"0", "10", "20", "30"}));
}

TEST(ThreadHostComm, BarrierWaitsForEveryMemberAndOnlyThem) {
  std::atomic<int> arrived{0};
  std::atomic<bool> early{false};
  on_threads(4, [&](ThreadHostComm& c) {
    c.add_group(1, {0, 1});
    c.add_group(2, {2, 3});
    if (c.rank() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ++arrived;
    c.barrier(0);
    if (arrived.load() != 4) early = true;
    c.barrier(c.rank() < 2 ? 1 : 2);  // two groups meet apart, many times over
    c.barrier(c.rank() < 2 ? 1 : 2);
  });
  EXPECT_FALSE(early);
}

TEST(ThreadHostComm, AbortWakesEveryWaitingRank) {
  ThreadHostWorld world(3);
  std::atomic<int> aborted{0};
  std::vector<std::thread> threads;
  for (int r = 1; r < 3; ++r) {
    threads.emplace_back([&, r] {
      ThreadHostComm c(&world, r);
      try {
        c.barrier(0);  // rank 0 never comes
      } catch (const RunAborted&) {
        ++aborted;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  world.abort();
  for (auto& t : threads) t.join();
  EXPECT_EQ(aborted, 2);
  ThreadHostComm late(&world, 0);
  EXPECT_THROW(late.barrier(0), RunAborted);
}

// ---- per-rank logs and the report ---------------------------------------------------------------------

RankLog sample_log(int rank, double arrive_us) {
  RankLog l;
  l.rank = rank;
  l.device = rank;
  l.host = "node";
  l.device_name = "GPU";
  l.end_us = 500 + rank;
  l.peak_bytes = 4096;
  l.capacity_bytes = 1 << 30;
  l.compute.push_back(Span{rank, SpanKind::Compute, "matmul", 0, arrive_us});
  CommTiming c;
  c.op = CommOp::AllReduce;
  c.key = "g0#0";
  c.group = "world";
  c.group_size = 2;
  c.bytes = 1'000'000;
  c.record_owner = rank == 0;
  c.start_us = arrive_us;
  c.end_us = 300;  // both members finish together
  l.comms.push_back(c);
  l.regions.push_back(RegionRecord{rank, "step", 0, 400});
  l.checks.push_back(CheckRecord{rank, "sums agree", true, ""});
  l.output.push_back(TimedLine{10.0 + rank, "line of rank " + std::to_string(rank)});
  return l;
}

TEST(RankLog, SerializationRoundTrips) {
  RankLog l = sample_log(1, 100);
  l.spans_truncated = true;
  const RankLog back = deserialize(serialize(l));
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.host, "node");
  EXPECT_TRUE(back.spans_truncated);
  ASSERT_EQ(back.comms.size(), 1u);
  EXPECT_EQ(back.comms[0].key, "g0#0");
  EXPECT_EQ(back.comms[0].bytes, 1'000'000);
  EXPECT_DOUBLE_EQ(back.comms[0].start_us, 100);
  ASSERT_EQ(back.output.size(), 1u);
  EXPECT_EQ(back.output[0].text, "line of rank 1");
  EXPECT_EQ(back.regions.at(0).rank, 1);
  EXPECT_THROW(deserialize(serialize(l).substr(0, 20)), BackendError);
  EXPECT_THROW(deserialize("garbage!"), BackendError);
}

TEST(RankLog, TrainingFiguresTravelAndReachTheReport) {
  RankLog l0 = sample_log(0, 100), l1 = sample_log(1, 100);
  EXPECT_FALSE(deserialize(serialize(l0)).training.has_value());
  TrainingStats t;
  t.model = "custom";
  t.layout = "tp 2 x dp 1";
  t.tokens_per_step = 4096;
  t.micro_batches = 4;
  t.step_time_us = 1234.5;
  t.mfu = 0.42;
  t.exposed_comm_us = {{"tp", 10.0}, {"dp", 2.5}};
  t.peak_memory_bytes = 1 << 20;
  t.activations_bytes = 1 << 10;
  l0.training = t;
  const RankLog back = deserialize(serialize(l0));
  ASSERT_TRUE(back.training.has_value());
  EXPECT_EQ(back.training->layout, "tp 2 x dp 1");
  EXPECT_EQ(back.training->tokens_per_step, 4096);
  EXPECT_EQ(back.training->micro_batches, 4);
  EXPECT_DOUBLE_EQ(back.training->step_time_us, 1234.5);
  EXPECT_DOUBLE_EQ(back.training->mfu, 0.42);
  EXPECT_EQ(back.training->exposed_comm_us, t.exposed_comm_us);
  EXPECT_EQ(back.training->peak_memory_bytes, 1 << 20);
  EXPECT_EQ(back.training->activations_bytes, 1 << 10);
  const RunReport r = assemble_report({l1, back}, "cuda", "dgx-h100");
  ASSERT_TRUE(r.training.has_value());
  EXPECT_EQ(r.training->model, "custom");
  EXPECT_FALSE(assemble_report({l1}, "cuda", "dgx-h100").training.has_value());
}

TEST(RankLog, AssemblySplitsALateMembersWaitFromTheTransfer) {
  // Rank 0 reaches the all-reduce at 100 us, rank 1 at 250 us, both finish at 300 us: the transfer took
  // 50 us and rank 0 idled 150 us waiting for rank 1.
  const RunReport r = assemble_report({sample_log(1, 250), sample_log(0, 100)}, "cuda", "dgx-h100");
  EXPECT_EQ(r.backend, "cuda");
  EXPECT_EQ(r.world, 2);
  EXPECT_EQ(r.gpus_per_node, 2);
  EXPECT_DOUBLE_EQ(r.makespan_us, 501);
  ASSERT_EQ(r.collectives.size(), 1u);
  const CollectiveRecord& c = r.collectives[0];
  EXPECT_EQ(c.algorithm, "nccl");
  EXPECT_DOUBLE_EQ(c.time_us(), 50);
  EXPECT_DOUBLE_EQ(c.algbw_gbps, 1'000'000 / 50e-6 / 1e9);
  EXPECT_DOUBLE_EQ(c.busbw_gbps, c.algbw_gbps * bus_factor(CommOp::AllReduce, 2));
  double idle0 = 0, comm0 = 0;
  for (const Span& s : r.spans) {
    if (s.rank != 0) continue;
    if (s.kind == SpanKind::Idle) idle0 += s.end_us - s.start_us;
    if (s.kind == SpanKind::Comm) comm0 += s.end_us - s.start_us;
  }
  EXPECT_DOUBLE_EQ(idle0, 150);
  EXPECT_DOUBLE_EQ(comm0, 50);
  EXPECT_EQ(r.output, (std::vector<std::string>{"line of rank 0", "line of rank 1"}));
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_EQ(r.ranks[1].peak_bytes, 4096);
  EXPECT_TRUE(r.all_checks_passed());
}

// ---- on a GPU -----------------------------------------------------------------------------------------

#if defined(RANKLAB_HAVE_CUDA)

#define REQUIRE_GPU()                                                        \
  do {                                                                       \
    if (!cuda_devices_available()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

CudaConfig quiet_cuda() {
  CudaConfig c;
  c.profile = load_profile("dgx-h100");
  c.echo_output = false;
  c.watchdog_timeout_s = 60;
  return c;
}

// The largest world up to `want` this machine runs on GPUs.
int gpu_world(int want) {
  return std::max(1, std::min(want, cuda_device_count()));
}

using Program = std::function<std::vector<float>(Rank&)>;

// What each rank returned, on both backends.
struct Both {
  std::vector<std::vector<float>> sim, cuda;
};

Both run_both(int world, const Program& fn) {
  Both b{std::vector<std::vector<float>>(world), std::vector<std::vector<float>>(world)};
  SimBackend sim(testing::quiet_config());
  sim.launch(world, [&](Rank& r) { b.sim[r.rank()] = fn(r); });
  CudaBackend cuda(quiet_cuda());
  cuda.launch(world, [&](Rank& r) { b.cuda[r.rank()] = fn(r); });
  return b;
}

// Both backends compute in float32; GEMM and reductions may sum in other orders, and the device's logf and
// cosf (in randn) may differ from the host's in the last place.
void expect_close(const Both& b, const std::string& what, double rel = 1e-5, double abs = 1e-5) {
  ASSERT_EQ(b.sim.size(), b.cuda.size()) << what;
  for (size_t r = 0; r < b.sim.size(); ++r) {
    ASSERT_EQ(b.sim[r].size(), b.cuda[r].size()) << what << ", rank " << r;
    for (size_t i = 0; i < b.sim[r].size(); ++i) {
      const double s = b.sim[r][i], c = b.cuda[r][i];
      ASSERT_NEAR(c, s, abs + rel * std::abs(s)) << what << ", rank " << r << ", element " << i;
    }
  }
}

TEST(CudaBackend, NoGpuIsAClearError) {
  if (cuda_devices_available()) GTEST_SKIP() << "this machine has a GPU";
  CudaBackend cuda(quiet_cuda());
  try {
    cuda.launch(1, [](Rank&) {});
    FAIL() << "expected an error";
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("--backend sim"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, MoreRanksThanGpusIsAClearError) {
  REQUIRE_GPU();
  CudaBackend cuda(quiet_cuda());
  try {
    cuda.launch(cuda_device_count() + 1, [](Rank&) {});
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL cannot put two ranks"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, ComputeOpsMatchTheSimulator) {
  REQUIRE_GPU();
  const Program fn = [](Rank& r) {
    std::vector<float> out;
    auto take = [&](const Tensor& t) {
      auto v = r.to_host(t);
      out.insert(out.end(), v.begin(), v.end());
    };
    const std::uint64_t seed = 100 + r.rank();
    Tensor a = r.randn({6, 5}, seed), b = r.randn({5, 7}, seed + 1), bt = r.randn({7, 5}, seed + 2);
    Tensor at = r.randn({5, 6}, seed + 3);
    take(a);
    take(r.matmul(a, b));
    take(r.matmul(a, bt, Trans::No, Trans::Yes));
    take(r.matmul(at, b, Trans::Yes, Trans::No));
    take(r.matmul(at, bt, Trans::Yes, Trans::Yes));
    Tensor x = r.randn({4, 3, 5}, seed + 4, 2.0f), g = r.randn({4, 3, 5}, seed + 5);
    take(r.relu(x));
    take(r.relu_backward(g, x));
    take(r.add(x, g));
    Tensor y = r.arange({4, 3, 5}, -7.0f);
    r.add_(y, x, 0.5f);
    r.scale_(y, -3.0f);
    take(y);
    Tensor z = r.zeros({4, 3, 5});
    r.copy_(z, y);
    take(z);
    take(r.sum(x));
    for (int dim = 0; dim < 3; ++dim) take(r.slice(x, dim, 1, 2));
    take(r.cat({r.slice(x, 1, 0, 1), g, r.slice(x, 1, 1, 2)}, 1));
    take(r.cat({x, g}, 0));
    take(r.cat({x, g}, 2));
    take(r.full({3}, 2.5f));
    take(r.from_host({2, 2}, {1, 2, 3, 4}));
    Tensor p = r.randn({64}, seed + 6), grad = r.randn({64}, seed + 7);
    r.sgd_step(p, grad, 0.1f);
    take(p);
    Tensor m = r.zeros({64}), v = r.zeros({64});
    for (int step = 1; step <= 3; ++step) r.adamw_step(p, grad, m, v, AdamW{}, step);
    take(p);
    take(m);
    take(v);
    take(r.sum(r.randn({100000}, seed + 8)));
    return out;
  };
  expect_close(run_both(gpu_world(2), fn), "compute ops", 1e-4, 1e-4);
}

// Each rank's input: distinct per rank and per element, and safe for Prod.
Tensor input(Rank& r, const Shape& s) {
  Tensor t = r.randn(s, 7 + r.rank(), 0.25f);
  Tensor ones = r.full(s, 1.0f);
  r.add_(t, ones, 1.0f);
  return t;
}

TEST(CudaBackend, EveryCollectiveMatchesTheSimulator) {
  REQUIRE_GPU();
  const int w = gpu_world(4);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod}) {
    expect_close(run_both(w,
                          [op](Rank& r) {
                            Tensor t = input(r, {3, 5});
                            r.all_reduce(t, op);
                            return r.to_host(t);
                          }),
                 std::string("all_reduce ") + reduce_op_name(op));
    expect_close(run_both(w,
                          [op](Rank& r) {
                            Tensor in = input(r, {2 * r.world_size(), 3});
                            Tensor out = r.empty({2, 3});
                            r.reduce_scatter(out, in, op);
                            return r.to_host(out);
                          }),
                 std::string("reduce_scatter ") + reduce_op_name(op));
    expect_close(run_both(w,
                          [op](Rank& r) {
                            Tensor t = input(r, {4});
                            r.reduce(t, 0, op);
                            return r.rank() == 0 ? r.to_host(t) : std::vector<float>{};
                          }),
                 std::string("reduce ") + reduce_op_name(op));
  }
  expect_close(run_both(w,
                        [](Rank& r) {
                          Tensor t = input(r, {5});
                          r.broadcast(t, r.world_size() - 1);
                          return r.to_host(t);
                        }),
               "broadcast");
  expect_close(run_both(w,
                        [](Rank& r) {
                          Tensor in = input(r, {2, 3});
                          Tensor out = r.empty({2 * r.world_size(), 3});
                          r.all_gather(out, in);
                          return r.to_host(out);
                        }),
               "all_gather");
  expect_close(run_both(w,
                        [](Rank& r) {
                          Tensor in = r.rank() == 0 ? input(r, {3 * r.world_size(), 2}) : Tensor();
                          Tensor out = r.zeros({3, 2});
                          r.scatter(out, in, 0);
                          return r.to_host(out);
                        }),
               "scatter");
  expect_close(run_both(w,
                        [](Rank& r) {
                          const int root = r.world_size() - 1;
                          Tensor in = input(r, {2, 2});
                          Tensor out = r.rank() == root ? r.zeros({2 * r.world_size(), 2}) : Tensor();
                          r.gather(out, in, root);
                          return r.rank() == root ? r.to_host(out) : std::vector<float>{};
                        }),
               "gather");
  expect_close(run_both(w,
                        [](Rank& r) {
                          Tensor in = input(r, {2 * r.world_size(), 3});
                          Tensor out = r.zeros({2 * r.world_size(), 3});
                          r.all_to_all(out, in);
                          return r.to_host(out);
                        }),
               "all_to_all");
  expect_close(run_both(w,
                        [](Rank& r) {
                          // Asynchronous: the result is there after wait().
                          Tensor t = input(r, {1000});
                          Work work = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
                          work.wait();
                          return r.to_host(t);
                        }),
               "async all_reduce");
  if (w >= 2) {
    expect_close(run_both(w,
                          [](Rank& r) {
                            // A ring: even ranks send first, odd ranks receive first, so nothing deadlocks.
                            const int n = r.world_size(), next = (r.rank() + 1) % n,
                                      prev = (r.rank() + n - 1) % n;
                            Tensor mine = input(r, {6}), got = r.zeros({6});
                            if (r.rank() % 2 == 0) {
                              r.send(mine, next);
                              r.recv(got, prev);
                            } else {
                              r.recv(got, prev);
                              r.send(mine, next);
                            }
                            return r.to_host(got);
                          }),
                 "send/recv ring");
    expect_close(run_both(w,
                          [](Rank& r) {
                            const int n = r.world_size(), next = (r.rank() + 1) % n,
                                      prev = (r.rank() + n - 1) % n;
                            Tensor mine = input(r, {6}), got = r.zeros({6});
                            Work s = r.isend(mine, next), g = r.irecv(got, prev);
                            s.wait();
                            g.wait();
                            return r.to_host(got);
                          }),
                 "isend/irecv ring");
    expect_close(run_both(w,
                          [](Rank& r) {
                            // Two sub-groups (even and odd ranks) reduce apart, then the world together.
                            std::vector<int> evens, odds;
                            for (int i = 0; i < r.world_size(); ++i) (i % 2 ? odds : evens).push_back(i);
                            Group ge = r.new_group(evens), go = r.new_group(odds);
                            Tensor t = input(r, {4});
                            r.all_reduce(t, ReduceOp::Sum, Async::No, r.rank() % 2 ? go : ge);
                            r.broadcast(t, r.rank() % 2 ? odds[0] : evens[0], Async::No,
                                        r.rank() % 2 ? go : ge);
                            r.all_reduce(t, ReduceOp::Max);
                            return r.to_host(t);
                          }),
                 "sub-groups");
  }
}

TEST(CudaBackend, ReadingAnUnwaitedAsyncResultIsAnError) {
  REQUIRE_GPU();
  CudaBackend cuda(quiet_cuda());
  cuda.launch(1, [](Rank& r) {
    Tensor t = r.arange(8);
    Work w = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
    EXPECT_FALSE(w.waited());
    EXPECT_THROW(r.to_host(t), UsageError);
    EXPECT_THROW(r.scale_(t, 2.0f), UsageError);
    w.wait();
    EXPECT_TRUE(w.waited());
    EXPECT_EQ(r.to_host(t)[3], 3.0f);
  });
}

TEST(CudaBackend, BarrierDoesNotWaitForTheDevice) {
  REQUIRE_GPU();
  CudaBackend cuda(quiet_cuda());
  double barrier_us = 0, sync_us = 0;
  cuda.launch(1, [&](Rank& r) {
    Tensor x = r.randn({4096, 4096}, 1, 0.01f);
    for (int i = 0; i < 20; ++i) x = r.matmul(x, x);  // about 2.7 TFLOP queued on the compute stream
    const double t0 = r.now();
    r.barrier();
    const double t1 = r.now();
    r.synchronize();
    const double t2 = r.now();
    barrier_us = t1 - t0;
    sync_us = t2 - t1;
  });
  // The lecture's point: barrier() returns while the kernels still run; synchronize() waits for them.
  EXPECT_GT(sync_us, 10 * barrier_us) << "barrier " << barrier_us << " us, synchronize " << sync_us << " us";
}

TEST(CudaBackend, OutOfMemoryReadsLikeTheSimulator) {
  REQUIRE_GPU();
  CudaBackend cuda(quiet_cuda());
  try {
    cuda.launch(1, [](Rank& r) { r.empty({r.memory_capacity() / 4 + 1024}); });
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0: empty: out of memory allocating float32["), std::string::npos) << what;
    EXPECT_NE(what.find("already in use of the"), std::string::npos) << what;
  }
}

TEST(CudaBackend, ReportHoldsCollectivesSpansAndMemory) {
  REQUIRE_GPU();
  const int w = gpu_world(2);
  CudaBackend cuda(quiet_cuda());
  const RunReport report = cuda.launch(w, [](Rank& r) {
    Tensor t = r.randn({1 << 20}, 3);
    r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
    r.check("ran", true, "");
  });
  EXPECT_EQ(report.backend, "cuda");
  EXPECT_EQ(report.world, w);
  ASSERT_EQ(report.collectives.size(), 1u);
  const CollectiveRecord& c = report.collectives[0];
  EXPECT_EQ(c.op, CommOp::AllReduce);
  EXPECT_EQ(c.bytes, 4 << 20);
  EXPECT_EQ(c.group_size, w);
  EXPECT_EQ(c.algorithm, "nccl");
  EXPECT_GT(c.time_us(), 0);
  EXPECT_GT(c.algbw_gbps, 0);
  bool saw_randn = false, saw_comm = false;
  for (const Span& s : report.spans) {
    saw_randn = saw_randn || (s.kind == SpanKind::Compute && s.name == "randn");
    saw_comm = saw_comm || (s.kind == SpanKind::Comm && s.name == "all_reduce");
    EXPECT_LE(s.start_us, s.end_us);
  }
  EXPECT_TRUE(saw_randn);
  EXPECT_TRUE(saw_comm);
  ASSERT_EQ(static_cast<int>(report.ranks.size()), w);
  EXPECT_GE(report.ranks[0].peak_bytes, 4 << 20);
  EXPECT_GT(report.ranks[0].capacity_bytes, report.ranks[0].peak_bytes);
  EXPECT_GT(report.makespan_us, 0);
  EXPECT_EQ(static_cast<int>(report.checks.size()), w);
}

TEST(CudaBackend, WatchdogTurnsAStuckCollectiveIntoAnError) {
  REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  CudaConfig config = quiet_cuda();
  config.watchdog_timeout_s = 2;
  CudaBackend cuda(config);
  try {
    cuda.launch(2, [](Rank& r) {
      Tensor t = r.zeros({16});
      if (r.rank() == 0) r.all_reduce(t, ReduceOp::Sum);  // rank 1 never joins
    });
    FAIL() << "expected BackendError";
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("watchdog"), std::string::npos) << e.what();
  }
}

// ---- every lesson against the simulator -----------------------------------------------------------------

// The values of every show() line, in order ("label rank1 = [1, 2]" gives 1 and 2), so the numbers of two
// runs compare while the timings they print may differ.
std::vector<std::vector<double>> shown_values(const std::vector<std::string>& lines) {
  static const std::regex shown(R"( rank\d+ = (.*)$)");
  static const std::regex number(R"([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|nan|inf)");
  std::vector<std::vector<double>> all;
  for (const std::string& line : lines) {
    std::smatch m;
    if (!std::regex_search(line, m, shown)) continue;
    std::vector<double> values;
    const std::string rest = m[1];
    for (auto it = std::sregex_iterator(rest.begin(), rest.end(), number); it != std::sregex_iterator();
         ++it) {
      const std::string s = it->str();
      values.push_back(s == "nan" ? NAN : s == "inf" ? INFINITY : std::stod(s));
    }
    all.push_back(values);
  }
  return all;
}

std::vector<std::string> lesson_names() {
  std::vector<std::string> names;
  for (const Lesson& l : lessons()) names.push_back(l.name);
  if (names.empty()) names.push_back("none");
  return names;
}

class EveryLesson : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryLesson, MatchesTheSimulator) {
  REQUIRE_GPU();
  if (GetParam() == "none") GTEST_SKIP() << "no lessons registered";
  Options o;
  o.world = gpu_world(o.world);
  o.quiet = true;
  o.count = 1 << 20;  // the benchmark's size: enough to time, quick on both backends
  SimBackend sim(testing::quiet_config());
  RunReport simulated;
  try {
    simulated = run_lesson(sim, GetParam(), o);
  } catch (const UsageError& e) {
    // A lesson that cannot run at this world (say it needs two ranks) must refuse on GPUs too.
    CudaBackend cuda(quiet_cuda());
    EXPECT_THROW(run_lesson(cuda, GetParam(), o), UsageError);
    GTEST_SKIP() << "not runnable at world " << o.world << ": " << e.what();
  }
  CudaBackend cuda(quiet_cuda());
  const RunReport real = run_lesson(cuda, GetParam(), o);
  EXPECT_TRUE(simulated.all_checks_passed());
  EXPECT_TRUE(real.all_checks_passed());
  // The same checks on the same ranks (the simulator records them in virtual-time order, the GPUs by rank).
  auto checks = [](const RunReport& report) {
    std::vector<std::pair<int, std::string>> all;
    for (const CheckRecord& c : report.checks) all.emplace_back(c.rank, c.what);
    std::sort(all.begin(), all.end());
    return all;
  };
  EXPECT_EQ(checks(real), checks(simulated));
  for (const CheckRecord& c : real.checks)
    EXPECT_TRUE(c.passed) << "rank " << c.rank << ": " << c.what << ": " << c.detail;
  const auto sim_values = shown_values(simulated.output), real_values = shown_values(real.output);
  ASSERT_EQ(real_values.size(), sim_values.size());
  for (size_t i = 0; i < sim_values.size(); ++i) {
    ASSERT_EQ(real_values[i].size(), sim_values[i].size()) << "show line " << i;
    for (size_t j = 0; j < sim_values[i].size(); ++j) {
      const double s = sim_values[i][j], c = real_values[i][j];
      if (std::isnan(s)) continue;
      EXPECT_NEAR(c, s, 1e-3 + 1e-3 * std::abs(s)) << "show line " << i << ", value " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CudaBackend, EveryLesson, ::testing::ValuesIn(lesson_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

#else

TEST(CudaBackend, NotBuilt) {
  GTEST_SKIP() << "built without the CUDA backend (RANKLAB_CUDA=OFF or no nvcc/NCCL)";
}

#endif

}  // namespace
}  // namespace ranklab
