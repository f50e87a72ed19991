// The real backend. Its host side (the rendezvous of rank threads, the per-rank logs and how they become a
// report) is tested everywhere; everything that needs a GPU skips itself where none is visible, and on a
// GPU checks every collective, every compute op and every lesson against the simulator's numbers for the
// same seeds, at the largest world the machine allows.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/random.h"
#include "common/report.h"
#include "real/half_convert.h"
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
  t.moe_routes = 8192, t.moe_dropped_routes = 17;
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
  EXPECT_EQ(back.training->moe_routes, 8192);
  EXPECT_EQ(back.training->moe_dropped_routes, 17);
  const RunReport r = assemble_report({l1, back}, "cuda", "dgx-h100");
  ASSERT_TRUE(r.training.has_value());
  EXPECT_EQ(r.training->model, "custom");
  EXPECT_FALSE(assemble_report({l1}, "cuda", "dgx-h100").training.has_value());
}

TEST(RankLog, PipelineTasksTravelAndReachTheReport) {
  RankLog l0 = sample_log(0, 100), l1 = sample_log(1, 100);
  l0.pipeline = {{0, 0, 0, 2, true, 1.5, 2.5}};
  l1.pipeline = {{1, 1, 1, 3, false, 3.5, 4.75}, {1, 1, 0, 0, true, 5, 6}};
  const RankLog back = deserialize(serialize(l1));
  ASSERT_EQ(back.pipeline.size(), 2u);
  EXPECT_EQ(back.pipeline[0].stage, 1);
  EXPECT_EQ(back.pipeline[0].chunk, 1);
  EXPECT_EQ(back.pipeline[0].micro_batch, 3);
  EXPECT_FALSE(back.pipeline[0].forward);
  EXPECT_DOUBLE_EQ(back.pipeline[0].end_us, 4.75);
  const RunReport r = assemble_report({back, l0}, "cuda", "dgx-h100");
  ASSERT_EQ(r.pipeline.size(), 3u);
  EXPECT_EQ(r.pipeline[0].rank, 0);  // the ranks' tasks in rank order
  EXPECT_EQ(r.pipeline[2].micro_batch, 0);
}

TEST(RankLog, TheTopologyIsEachRanksGpuInItsHost) {
  RankLog a = sample_log(0, 100), b = sample_log(1, 100), c = sample_log(2, 100);
  c.host = "other";
  const RunReport r = assemble_report({c, b, a}, "cuda", "dgx-h100");
  ASSERT_EQ(r.topology.nodes.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(r.topology.nodes[k].id, fmt::format("gpu{}", k));
    EXPECT_EQ(r.topology.nodes[k].kind, "gpu");
    EXPECT_EQ(r.topology.nodes[k].rank, k);
    EXPECT_EQ(r.topology.nodes[k].host, k / 2);  // hosts numbered in rank order
  }
  EXPECT_TRUE(r.topology.links.empty());  // the logs know nothing of the links
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
                          // Uneven splits: rank i sends (i + j) % 3 rows of 2 to rank j (none to some), and
                          // one more to itself, so that no tensor is empty.
                          const int n = r.world_size(), i = r.rank();
                          std::vector<std::int64_t> in_splits(n), out_splits(n);
                          std::int64_t in_rows = 0, out_rows = 0;
                          for (int j = 0; j < n; ++j) {
                            in_splits[j] = (i + j) % 3 + (i == j ? 1 : 0);
                            out_splits[j] = (j + i) % 3 + (i == j ? 1 : 0);
                            in_rows += in_splits[j];
                            out_rows += out_splits[j];
                          }
                          Tensor in = input(r, {in_rows, 2});
                          Tensor out = r.zeros({out_rows, 2});
                          r.all_to_all(out, in, out_splits, in_splits);
                          return r.to_host(out);
                        }),
               "uneven all_to_all");
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

// ---- 16-bit tensors and the transformer kernels, against host references ------------------------------

// Runs `fn` on one GPU.
void on_gpu(const std::function<void(Rank&)>& fn) {
  CudaBackend cuda(quiet_cuda());
  cuda.launch(1, fn);
}

// What the GPU holds for x in `t`: x rounded to nearest even.
float rounded(float x, DType t) {
  if (t == DType::BFloat16) return bf16_bits_to_float(float_to_bf16_bits(x));
  if (t == DType::Float16) return fp16_bits_to_float(float_to_fp16_bits(x));
  return x;
}
std::vector<float> rounded(std::vector<float> v, DType t) {
  for (float& x : v) x = rounded(x, t);
  return v;
}

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want, double rel, double abs,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], abs + rel * std::abs(want[i])) << what << ", element " << i;
  }
}

// A relative tolerance for one rounding to `t` plus float32 arithmetic.
double tolerance(DType t) {
  return t == DType::BFloat16 ? 1.6e-2 : t == DType::Float16 ? 2e-3 : 1e-4;
}

constexpr DType kAllTypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

TEST(CudaBackend, SixteenBitTensorsHoldRoundedValues) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    const std::vector<float> v = {0.1f, -1.2345f, 3.0e4f, 1.0e-5f, 70000.0f, -0.0f};
    for (DType t : kAllTypes) {
      const std::string name = dtype_name(t);
      Tensor x = r.from_host({2, 3}, v, t);
      EXPECT_EQ(x.dtype(), t);
      EXPECT_EQ(x.bytes(), 6 * dtype_bytes(t));
      EXPECT_EQ(r.to_host(x), rounded(v, t)) << name;
      EXPECT_EQ(r.to_host(r.full({3}, 0.1f, t)), rounded(std::vector<float>(3, 0.1f), t)) << name;
      EXPECT_EQ(r.to_host(r.zeros({3}, t)), std::vector<float>(3, 0.0f)) << name;
      // The same draws as float32, rounded once.
      EXPECT_EQ(r.to_host(r.randn({257}, 5, 0.5f, t)), rounded(r.to_host(r.randn({257}, 5, 0.5f)), t))
          << name;
      // cast and copy_ convert; add_ takes a source of another dtype.
      Tensor f = r.from_host({2, 3}, v);
      EXPECT_EQ(r.to_host(r.cast(f, t)), rounded(v, t)) << name;
      EXPECT_EQ(r.to_host(r.cast(r.cast(f, t), DType::Float32)), rounded(v, t)) << name;
      Tensor dst = r.zeros({2, 3}, t);
      r.copy_(dst, f);
      EXPECT_EQ(r.to_host(dst), rounded(v, t)) << name;
      Tensor acc = r.full({2, 3}, 1.0f);
      r.add_(acc, r.cast(f, t), 2.0f);
      std::vector<float> want(6);
      for (size_t i = 0; i < 6; ++i) want[i] = 1.0f + 2.0f * rounded(v[i], t);
      EXPECT_EQ(r.to_host(acc), want) << name;
      Tensor p = r.phantom({4, 4}, t);
      EXPECT_EQ(p.bytes(), 16 * dtype_bytes(t));
    }
  });
}

TEST(CudaBackend, SeededSlicesPutTogetherAreTheWholeTensor) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    const Shape full{4, 6, 5};
    for (DType t : {DType::Float32, DType::BFloat16}) {
      const std::vector<float> whole = r.to_host(r.randn(full, 11, 0.02f, t));
      for (int dim = 0; dim < 3; ++dim) {
        std::vector<Tensor> parts;
        for (std::int64_t s = 0; s < full[dim]; s += 2) {
          parts.push_back(
              r.randn_slice(full, dim, s, std::min<std::int64_t>(2, full[dim] - s), 11, 0.02f, t));
        }
        EXPECT_EQ(r.to_host(r.cat(parts, dim)), whole) << dtype_name(t) << " along " << dim;
      }
    }
    EXPECT_THROW(r.randn_slice(full, 1, 5, 2, 11, 1.0f, DType::Float32), UsageError);
    EXPECT_THROW(r.randn_slice(full, 3, 0, 1, 11, 1.0f, DType::Float32), UsageError);
  });
}

TEST(CudaBackend, SixteenBitMatmulAccumulatesInFloat32) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    const std::int64_t m = 33, k = 70, n = 17;
    for (DType t : {DType::BFloat16, DType::Float16}) {
      Tensor a = r.randn({m, k}, 1, 1.0f, t), b = r.randn({k, n}, 2, 1.0f, t),
             bt = r.randn({n, k}, 3, 1.0f, t);
      const auto ha = r.to_host(a), hb = r.to_host(b), hbt = r.to_host(bt);
      Tensor c = r.matmul(a, b), ct = r.matmul(a, bt, Trans::No, Trans::Yes);
      EXPECT_EQ(c.dtype(), t);
      std::vector<double> want(m * n), want_t(m * n);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0, st = 0;
          for (std::int64_t p = 0; p < k; ++p) {
            s += static_cast<double>(ha[i * k + p]) * hb[p * n + j];
            st += static_cast<double>(ha[i * k + p]) * hbt[j * k + p];
          }
          want[i * n + j] = s;
          want_t[i * n + j] = st;
        }
      }
      // One rounding of a sum of 70 products of unit normals (|c| ~ 8).
      expect_near_all(r.to_host(c), want, tolerance(t), 1e-2, std::string("matmul ") + dtype_name(t));
      expect_near_all(r.to_host(ct), want_t, tolerance(t), 1e-2, std::string("matmul T ") + dtype_name(t));
    }
    EXPECT_THROW(r.matmul(r.zeros({2, 2}), r.zeros({2, 2}, DType::BFloat16)), UsageError);
  });
}

// Whether the GPU takes FP8 (compute capability 8.9 on): the backend refuses it with a UsageError otherwise.
bool gpu_takes_fp8() {
  CudaBackend cuda(quiet_cuda());
  try {
    cuda.launch(1, [](Rank& r) {
      r.quantize(r.zeros({16, 16}), DType::Float8E4M3, Rank::Fp8Scaling{}, Tensor(), false, Tensor());
    });
  } catch (const UsageError& e) {
    return std::string(e.what()).find("no FP8 tensor cores") == std::string::npos;
  }
  return true;
}

// Values both backends start from bit for bit (randn's device logf may differ from the host's in the last
// place, and one place is enough to move an FP8 code): `scale` times a fixed pattern, rounded to bfloat16.
Tensor pattern(Rank& r, const Shape& s, float scale, int seed) {
  std::vector<float> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + seed);
  return r.from_host(s, v, DType::BFloat16);
}

// FP8 on the GPU holds the simulator's numbers: the codes and scales of each recipe's casts, cuBLASLt's FP8
// GEMM (every dimension a multiple of 16) and the float32 path (other shapes, block scales) giving its
// products, delayed scaling's update, and the scales travelling with all_gather, all_to_all and copy_.
TEST(CudaBackend, Fp8MatchesTheSimulator) {
  REQUIRE_GPU();
  if (!gpu_takes_fp8()) GTEST_SKIP() << "this GPU has no FP8 tensor cores";
  const DType e4m3 = DType::Float8E4M3, e5m2 = DType::Float8E5M2;
  const Program fn = [&](Rank& r) {
    std::vector<float> out;
    auto take = [&](const Tensor& t) {
      auto v = r.to_host(t);
      out.insert(out.end(), v.begin(), v.end());
    };
    const int n = r.world_size(), me = r.rank();
    const Tensor x = pattern(r, {32, 256}, 3.0f, me), w = pattern(r, {256, 48}, 0.05f, 7);
    // Current scaling, recording the amax as delayed scaling's casts do.
    const Tensor recorded = r.zeros({1});
    const Tensor sx = r.fp8_scale(r.amax(x), e4m3), sw = r.fp8_scale(r.amax(w), e4m3);
    const Rank::Quantized qx = r.quantize(x, e4m3, {}, sx, true, recorded);
    const Rank::Quantized qw = r.quantize(w, e4m3, {}, sw, true, Tensor());
    for (const Tensor& t : {qx.data, qx.columnwise, recorded, sx, qw.data}) take(t);
    take(r.matmul(qx.data, qw.data));
    take(r.matmul(qx.data, qx.columnwise, Trans::No, Trans::Yes));
    take(r.matmul(qx.data, qx.columnwise, Trans::Yes, Trans::No));
    Tensor sum = r.full({32, 48}, 1.0f);
    r.matmul_add_(sum, qx.data, qw.data, Trans::No, Trans::No);
    take(sum);
    take(r.matmul(r.view(qx.data, 0, Shape{30, 256}), qw.data));  // 30 rows: the float32 path
    const Tensor dy = pattern(r, {32, 48}, 1e-3f, 11 + me);
    const Rank::Quantized qdy = r.quantize(dy, e5m2, {}, r.fp8_scale(r.amax(dy), e5m2), false, Tensor());
    take(qdy.data);
    take(r.matmul(qdy.data, qw.data, Trans::No, Trans::Yes));
    // Blockwise: 1 x 128 activations, 128 x 128 weights.
    const Rank::Quantized bx = r.quantize(x, e4m3, {1, 128}, Tensor(), true, Tensor());
    const Rank::Quantized bw = r.quantize(w, e4m3, {128, 128}, Tensor(), true, Tensor());
    for (const Tensor& t : {bx.data, bx.columnwise, bw.data}) take(t);
    take(r.matmul(bx.data, bw.columnwise));
    // Scales that travel: one per tensor, shared by every rank (the amax reduced first), and 1 x 128 blocks.
    const Tensor shared_amax = r.amax(x);
    r.all_reduce(shared_amax, ReduceOp::Max);
    const Rank::Quantized qs = r.quantize(x, e4m3, {}, r.fp8_scale(shared_amax, e4m3), false, Tensor());
    for (const Tensor& piece : {qs.data, bx.data}) {
      const Tensor gathered = r.empty({32 * n, 256}, e4m3);
      r.all_gather(gathered, piece);
      take(gathered);
      // A shift around the ring, as tensor parallelism's overlapped GEMMs pass pieces on.
      std::vector<std::int64_t> to(n, 0), from(n, 0);
      to[(me + 1) % n] = 32;
      from[(me + n - 1) % n] = 32;
      const Tensor shifted = r.empty({32, 256}, e4m3);
      r.all_to_all(shifted, piece, from, to);
      take(shifted);
      const Tensor buffer = r.empty({64, 256}, e4m3);
      r.copy_(r.view(buffer, 32 * 256, Shape{32, 256}), piece);
      r.copy_(r.view(buffer, 0, Shape{32, 256}), shifted);
      take(buffer);
      take(r.matmul(r.view(buffer, 0, Shape{32, 256}), piece, Trans::No, Trans::Yes));
    }
    // Delayed scaling's update: the pass's amax joins the history, the scale follows the largest.
    const Tensor history = r.from_host({3}, {1.0f, 4.0f, 2.0f}), scale = r.full({1}, 1.0f);
    const Tensor amax = r.full({1}, 3.0f), reduced = r.from_host({1}, {5.0f + me});
    r.fp8_delayed_update(reduced, {history}, {scale}, {amax}, e4m3, 1);
    for (const Tensor& t : {history, scale, amax}) take(t);
    return out;
  };
  // Casts and moves give the same bytes; GEMMs sum in other orders and round once to bfloat16.
  expect_close(run_both(gpu_world(2), fn), "fp8", 8e-3, 1e-4);
}

TEST(CudaBackend, Fp8MisuseIsAClearError) {
  REQUIRE_GPU();
  if (!gpu_takes_fp8()) GTEST_SKIP() << "this GPU has no FP8 tensor cores";
  on_gpu([](Rank& r) {
    const Tensor x = r.full({16, 16}, 1.0f, DType::BFloat16);
    const Rank::Quantized q = r.quantize(x, DType::Float8E4M3, {}, Tensor(), false, Tensor());
    auto message = [&](const std::function<void()>& f) {
      try {
        f();
      } catch (const UsageError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_NE(message([&] { r.add(q.data, q.data); }).find("FP8 tensors go only into"), std::string::npos);
    EXPECT_NE(message([&] { r.all_reduce(q.data, ReduceOp::Sum); }).find("FP8"), std::string::npos);
    EXPECT_NE(message([&] { r.cast(x, DType::Float8E4M3); }).find("quantize scales"), std::string::npos);
    // FP8 bytes nothing scaled: an empty tensor never written.
    EXPECT_NE(message([&] {
                r.to_host(r.empty({4, 4}, DType::Float8E4M3));
              }).find("nothing scaled"),
              std::string::npos);
    const Rank::Quantized b = r.quantize(x, DType::Float8E4M3, {1, 8}, Tensor(), false, Tensor());
    EXPECT_NE(message([&] {
                r.to_host(r.view(b.data, 4, Shape{2, 6}));
              }).find("not whole rows"),
              std::string::npos);
  });
}

TEST(CudaBackend, BiasLayerNormAndGeluMatchHostReferences) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    const std::int64_t rows = 7, cols = 300;
    for (DType t : kAllTypes) {
      const std::string name = dtype_name(t);
      const double tol = tolerance(t);
      Tensor x = r.randn({rows, cols}, 21, 2.0f, t), bias = r.randn({cols}, 22, 1.0f, t);
      const auto hx = r.to_host(x), hbias = r.to_host(bias);
      // add_bias_ and sum_rows.
      Tensor xb = r.cast(x, t);
      r.add_bias_(xb, bias);
      std::vector<double> want(rows * cols), col_sums(cols, 0.0);
      for (std::int64_t i = 0; i < rows * cols; ++i) {
        want[i] = rounded(hx[i] + hbias[i % cols], t);
        col_sums[i % cols] += hx[i];
      }
      expect_near_all(r.to_host(xb), want, 0, 0, "add_bias_ " + name);
      Tensor sums = r.sum_rows(x);
      EXPECT_EQ(sums.dtype(), DType::Float32);
      expect_near_all(r.to_host(sums), col_sums, 1e-5, 1e-4, "sum_rows " + name);

      // Layer norm, with gamma and beta of x's dtype.
      Tensor gamma = r.randn({cols}, 23, 1.0f, t), beta = r.randn({cols}, 24, 1.0f, t);
      const auto hg = r.to_host(gamma), hb = r.to_host(beta);
      const float eps = 1e-5f;
      auto ln = r.layernorm(x, gamma, beta, eps);
      Tensor dy = r.randn({rows, cols}, 25, 1.0f, t);
      const auto hdy = r.to_host(dy);
      auto grads = r.layernorm_backward(dy, x, gamma, ln.mean, ln.rstd);
      std::vector<double> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols), dg(cols, 0.0),
          db(cols, 0.0);
      for (std::int64_t i = 0; i < rows; ++i) {
        double s = 0, sq = 0;
        for (std::int64_t c = 0; c < cols; ++c) s += hx[i * cols + c];
        mean[i] = s / cols;
        for (std::int64_t c = 0; c < cols; ++c) sq += std::pow(hx[i * cols + c] - mean[i], 2);
        rstd[i] = 1.0 / std::sqrt(sq / cols + eps);
        double mg = 0, mgx = 0;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xhat = (hx[i * cols + c] - mean[i]) * rstd[i];
          y[i * cols + c] = xhat * hg[c] + hb[c];
          const double g = hdy[i * cols + c] * hg[c];
          mg += g / cols;
          mgx += g * xhat / cols;
          dg[c] += hdy[i * cols + c] * xhat;
          db[c] += hdy[i * cols + c];
        }
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xhat = (hx[i * cols + c] - mean[i]) * rstd[i];
          dx[i * cols + c] = rstd[i] * (hdy[i * cols + c] * hg[c] - mg - xhat * mgx);
        }
      }
      expect_near_all(r.to_host(ln.mean), mean, 1e-5, 1e-5, "layernorm mean " + name);
      expect_near_all(r.to_host(ln.rstd), rstd, 1e-4, 1e-5, "layernorm rstd " + name);
      expect_near_all(r.to_host(ln.y), y, tol, 1e-3, "layernorm y " + name);
      expect_near_all(r.to_host(grads.dx), dx, tol, 2e-3, "layernorm dx " + name);
      expect_near_all(r.to_host(grads.dgamma), dg, 1e-4, 1e-3, "layernorm dgamma " + name);
      expect_near_all(r.to_host(grads.dbeta), db, 1e-4, 1e-3, "layernorm dbeta " + name);

      // GELU, tanh approximation.
      Tensor gy = r.gelu(x), gdx = r.gelu_backward(dy, x);
      std::vector<double> wy(rows * cols), wdx(rows * cols);
      for (std::int64_t i = 0; i < rows * cols; ++i) {
        const double v = hx[i], k = std::sqrt(2.0 / 3.14159265358979323846),
                     u = k * (v + 0.044715 * v * v * v);
        const double th = std::tanh(u);
        wy[i] = 0.5 * v * (1 + th);
        wdx[i] = hdy[i] * (0.5 * (1 + th) + 0.5 * v * (1 - th * th) * k * (1 + 3 * 0.044715 * v * v));
      }
      expect_near_all(r.to_host(gy), wy, tol, 1e-4, "gelu " + name);
      expect_near_all(r.to_host(gdx), wdx, tol, 1e-4, "gelu_backward " + name);

      // Dropout: the same mask as the host's rule, the kept elements scaled by 1 / (1 - p).
      Tensor dy_ = r.dropout(x, 0.3f, 5, 7);
      std::vector<double> wd(rows * cols);
      for (std::int64_t i = 0; i < rows * cols; ++i)
        wd[i] = dropout_keeps(5, 7 + i / cols, i % cols, 0.3f) ? hx[i] / (1.0 - 0.3f) : 0.0;
      expect_near_all(r.to_host(dy_), wd, tol, 1e-4, "dropout " + name);
    }
    // The parameters share x's dtype, as every kernel's inputs do.
    Tensor x = r.randn({3, 64}, 31, 1.0f, DType::BFloat16);
    EXPECT_THROW(r.layernorm(x, r.full({64}, 1.0f), r.zeros({64}), 1e-5f), UsageError);
    EXPECT_THROW(r.layernorm(x, r.full({63}, 1.0f, DType::BFloat16), r.zeros({63}, DType::BFloat16), 1e-5f),
                 UsageError);
  });
}

// Attention on the host, in double: out, lse and the gradient of qkv for d out.
struct AttentionRef {
  std::vector<double> out, lse, dqkv;
};
AttentionRef attention_ref(const std::vector<float>& qkv, const std::vector<float>& dout, std::int64_t seq,
                           std::int64_t batch, int heads, int d, bool causal) {
  const std::int64_t ld = static_cast<std::int64_t>(heads) * 3 * d, od = static_cast<std::int64_t>(heads) * d;
  AttentionRef r{std::vector<double>(seq * batch * od), std::vector<double>(batch * heads * seq),
                 std::vector<double>(qkv.size(), 0.0)};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto at = [&](std::int64_t pos, std::int64_t b, int h, int part, int k) {
    return (pos * batch + b) * ld + (static_cast<std::int64_t>(h) * 3 + part) * d + k;
  };
  for (std::int64_t b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      std::vector<std::vector<double>> p(seq, std::vector<double>(seq, 0.0));
      for (std::int64_t i = 0; i < seq; ++i) {
        const std::int64_t keys = causal ? i + 1 : seq;
        double mx = -1e300;
        std::vector<double> s(keys);
        for (std::int64_t j = 0; j < keys; ++j) {
          double dot = 0;
          for (int k = 0; k < d; ++k)
            dot += static_cast<double>(qkv[at(i, b, h, 0, k)]) * qkv[at(j, b, h, 1, k)];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < keys; ++j) sum += std::exp(s[j] - mx);
        r.lse[(b * heads + h) * seq + i] = mx + std::log(sum);
        for (std::int64_t j = 0; j < keys; ++j) p[i][j] = std::exp(s[j] - mx) / sum;
        for (int k = 0; k < d; ++k) {
          double o = 0;
          for (std::int64_t j = 0; j < keys; ++j) o += p[i][j] * qkv[at(j, b, h, 2, k)];
          r.out[(i * batch + b) * od + h * d + k] = o;
        }
      }
      // dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q.
      for (std::int64_t i = 0; i < seq; ++i) {
        std::vector<double> dp(seq, 0.0);
        double rowsum = 0;
        for (std::int64_t j = 0; j < seq; ++j) {
          for (int k = 0; k < d; ++k)
            dp[j] += dout[(i * batch + b) * od + h * d + k] * qkv[at(j, b, h, 2, k)];
          rowsum += p[i][j] * dp[j];
        }
        for (std::int64_t j = 0; j < seq; ++j) {
          const double ds = p[i][j] * (dp[j] - rowsum);
          for (int k = 0; k < d; ++k) {
            r.dqkv[at(j, b, h, 2, k)] += p[i][j] * dout[(i * batch + b) * od + h * d + k];
            r.dqkv[at(i, b, h, 0, k)] += scale * ds * qkv[at(j, b, h, 1, k)];
            r.dqkv[at(j, b, h, 1, k)] += scale * ds * qkv[at(i, b, h, 0, k)];
          }
        }
      }
    }
  }
  return r;
}

TEST(CudaBackend, AttentionMatchesAHostReference) {
  REQUIRE_GPU();
  struct Case {
    std::int64_t seq, batch;
    int heads, head_dim;
  };
  // Small; more keys than one tile (128); a head_dim over the block's 128 threads.
  const Case cases[] = {{5, 2, 3, 8}, {150, 1, 1, 16}, {6, 2, 1, 130}};
  on_gpu([&](Rank& r) {
    for (const Case& c : cases) {
      for (bool causal : {false, true}) {
        for (DType t : {DType::Float32, DType::BFloat16}) {
          const std::string what =
              fmt::format("attention seq {} batch {} heads {} head_dim {}{} {}", c.seq, c.batch, c.heads,
                          c.head_dim, causal ? " causal" : "", dtype_name(t));
          const std::int64_t rows = c.seq * c.batch;
          Tensor qkv = r.randn({rows, static_cast<std::int64_t>(c.heads) * 3 * c.head_dim}, 41, 1.0f, t);
          Tensor dout = r.randn({rows, static_cast<std::int64_t>(c.heads) * c.head_dim}, 42, 1.0f, t);
          auto fwd = r.attention(qkv, c.batch, c.heads, causal);
          Tensor dqkv = r.attention_backward(dout, qkv, fwd.out, fwd.lse, c.batch, c.heads, causal);
          const AttentionRef want =
              attention_ref(r.to_host(qkv), r.to_host(dout), c.seq, c.batch, c.heads, c.head_dim, causal);
          EXPECT_EQ(fwd.lse.shape(), (Shape{c.batch, c.heads, c.seq})) << what;
          const double tol = t == DType::Float32 ? 1e-4 : 3e-2;
          expect_near_all(r.to_host(fwd.out), want.out, tol, tol, what + " out");
          expect_near_all(r.to_host(fwd.lse), want.lse, 1e-4, 1e-4, what + " lse");
          // The backward recomputes from the rounded out, so 16-bit gradients carry that rounding too.
          expect_near_all(r.to_host(dqkv), want.dqkv, tol, 2 * tol, what + " dqkv");
        }
      }
    }
    EXPECT_THROW(r.attention(r.zeros({10, 3 * 2 * 4}), 3, 2, true), UsageError);  // 10 rows, batch 3
    EXPECT_THROW(r.attention(r.zeros({10, 20}), 2, 3, true), UsageError);         // 20 not 3 * heads * d
  });
}

// Appends x's values to `all`: a test's program returns everything it computed, in one vector.
void append_host(Rank& r, const Tensor& x, std::vector<float>& all) {
  const std::vector<float> v = r.to_host(x);
  all.insert(all.end(), v.begin(), v.end());
}

TEST(CudaBackend, LlamaKernelsMatchTheSimulator) {
  REQUIRE_GPU();
  // RMSNorm, SwiGLU, rotary embeddings and grouped-query attention (a head_dim over the block's 128 threads,
  // more keys than one tile), forward and backward, on both backends from the same seeded inputs.
  for (DType t : {DType::Float32, DType::BFloat16}) {
    const Both b = run_both(1, [t](Rank& r) {
      std::vector<float> all;
      auto keep = [&](const Tensor& x) { append_host(r, x, all); };
      Tensor x = r.randn({6, 136}, 51, 1.0f, t), g = r.randn({136}, 52, 1.0f, t),
             dy = r.randn({6, 136}, 53, 1.0f, t);
      Rank::RmsNormOut n = r.rmsnorm(x, g, 1e-5f);
      Rank::RmsNormGrads dn = r.rmsnorm_backward(dy, x, g, n.rstd);
      keep(n.y), keep(n.rstd), keep(dn.dx), keep(dn.dgamma);
      keep(r.squared_norm({x, dy, r.randn({300}, 58, 1.0f, t)}));
      Tensor u = r.randn({6, 136}, 54, 1.0f, t);
      keep(r.swiglu(u)), keep(r.swiglu_backward(r.randn({6, 68}, 55, 1.0f, t), u));
      const GluSpec oss{1.702f, 0.5f, 1.0f};  // gpt-oss's form, its clamps at 0.5 to hold some inputs
      keep(r.swiglu(u, oss)), keep(r.swiglu_backward(r.randn({6, 68}, 59, 1.0f, t), u, oss));
      for (const AttentionSpec& spec : {AttentionSpec{2, 4, 2, true}, AttentionSpec{1, 3, 1, false}}) {
        const std::int64_t seq = spec.batch == 2 ? 70 : 140, hd = 130, rows = seq * spec.batch;
        Tensor qkv = r.randn({rows, (spec.heads + 2 * spec.groups()) * hd}, 56, 1.0f, t);
        r.rope_(qkv, spec, 3, 500000.0, false);
        keep(qkv);
        Rank::AttentionOut o = r.attention(qkv, spec);
        Tensor d =
            r.attention_backward(r.randn({rows, spec.heads * hd}, 57, 1.0f, t), qkv, o.out, o.lse, spec);
        r.rope_(d, spec, 3, 500000.0, true);
        keep(o.out), keep(o.lse), keep(d);
      }
      return all;
    });
    const double tol = t == DType::Float32 ? 1e-4 : 5e-2;
    expect_close(b, std::string("llama kernels ") + dtype_name(t), tol, tol);
  }
}

// Context parallelism's blocks, each of `own` (qkv's own keys, key_values) or `other` keys, merged into a
// float32 accumulator from zeros and -infinity.
using Blocks = std::vector<std::pair<Tensor, Rank::AttentionBlock>>;
Rank::AttentionOut merge_blocks(Rank& r, const Tensor& qkv, const AttentionSpec& spec, const Blocks& blocks) {
  const std::int64_t rows = qkv.size(0), hd = qkv.size(1) / (spec.heads + 2 * spec.groups());
  Rank::AttentionOut acc{r.zeros({rows, spec.heads * hd}), r.full({spec.batch, spec.heads, rows / spec.batch},
                                                                  -std::numeric_limits<float>::infinity())};
  for (const auto& [keys, block] : blocks) r.attention_block_(acc, qkv, keys, spec, block);
  return acc;
}
// Each block's backward from the final out and lse, the key gradients of `own` added back into d qkv;
// keeps `other`'s key gradients, then d qkv.
void blocks_backward(Rank& r, const Tensor& qkv, const Tensor& own, const Tensor& other, const Tensor& out,
                     const Tensor& lse, const Tensor& dout, const AttentionSpec& spec, const Blocks& blocks,
                     const std::function<void(const Tensor&)>& keep) {
  const DType t = qkv.dtype();
  const Tensor dqkv = r.zeros(qkv.shape(), t), down = r.zeros(own.shape(), t),
               dother = r.zeros(other.shape(), t);
  for (const auto& [keys, block] : blocks) {
    r.attention_block_backward_(dqkv, keys.same_storage(own) ? down : dother, dout, qkv, keys, out, lse, spec,
                                block);
  }
  keep(dother);
  r.add_key_values_(dqkv, down, spec);
  keep(dqkv);
}

TEST(CudaBackend, ContextParallelBlocksMatchTheSimulator) {
  REQUIRE_GPU();
  // Ring attention's kernels (lessons/parallel/context_parallel.cc): a rank's queries against blocks of keys
  // (its own under the mask, another chunk's whole, half of its queries against a chunk with positions,
  // queries that see none of a block), merged into float32 accumulators, then each block's backward and the
  // key gradients added back; grouped-query heads of a head_dim over the kernels' 128 threads.
  for (DType t : {DType::Float32, DType::BFloat16}) {
    const Both b = run_both(1, [t](Rank& r) {
      std::vector<float> all;
      auto keep = [&](const Tensor& x) { append_host(r, x, all); };
      const AttentionSpec spec{2, 4, 2, true};
      const std::int64_t seq = 140, half = seq / 2, hd = 130, rows = seq * spec.batch;
      const Tensor qkv = r.randn({rows, (spec.heads + 2 * spec.groups()) * hd}, 61, 1.0f, t);
      const Tensor own = r.key_values(qkv, spec);
      const Tensor other = r.randn({half * spec.batch, 2 * spec.groups() * hd}, 62, 1.0f, t);
      keep(own);
      const Blocks blocks = {
          {own, {0, -1, true, 0, 0}},
          {other, {0, -1, false, 0, 0}},
          {other, {half, half, true, 100, 95}},
          {other, {0, 10, true, 0, 5}},  // queries 0 to 4 see none of it
      };
      const Rank::AttentionOut acc = merge_blocks(r, qkv, spec, blocks);
      keep(acc.out), keep(acc.lse);
      const Tensor out = r.cast(acc.out, t), dout = r.randn(out.shape(), 63, 1.0f, t);
      blocks_backward(r, qkv, own, other, out, acc.lse, dout, spec, blocks, keep);
      return all;
    });
    const double tol = t == DType::Float32 ? 1e-4 : 5e-2;
    expect_close(b, std::string("context-parallel blocks ") + dtype_name(t), tol, tol);
  }
}

TEST(CudaBackend, SlidingWindowAndSinksMatchTheSimulator) {
  REQUIRE_GPU();
  // Sliding windows and attention sinks (AttentionSpec::window, sinks): the whole attention with either or
  // both, forward and backward, and the sinks' gradient; then context-parallel blocks under a window (a
  // rank's own keys, a chunk whose window starts inside it, queries that see none of a block, a block none
  // of whose queries reach), the sinks merged after them, and the backward of each. Grouped-query heads of a
  // head_dim over the kernels' 128 threads; windows over one tile of keys, so the key loops start past 0.
  // The sinks are of another dtype than qkv, which the kernels read as they are.
  for (DType t : {DType::Float32, DType::BFloat16}) {
    const Both b = run_both(1, [t](Rank& r) {
      std::vector<float> all;
      auto keep = [&](const Tensor& x) { append_host(r, x, all); };
      const std::int64_t hd = 130;
      const Tensor sinks = r.randn({4}, 71, 1.0f, t == DType::Float32 ? DType::BFloat16 : DType::Float32);
      struct Case {
        std::int64_t seq, window;
        bool sinks;
      };
      for (const Case& c : {Case{200, 150, false}, Case{140, 0, true}, Case{140, 7, true}}) {
        AttentionSpec spec{2, 4, 2, true};
        spec.window = c.window;
        if (c.sinks) spec.sinks = sinks;
        const std::int64_t rows = c.seq * spec.batch;
        const Tensor qkv = r.randn({rows, (spec.heads + 2 * spec.groups()) * hd}, 72, 1.0f, t);
        const Rank::AttentionOut o = r.attention(qkv, spec);
        const Tensor dout = r.randn(o.out.shape(), 73, 1.0f, t);
        keep(o.out), keep(o.lse), keep(r.attention_backward(dout, qkv, o.out, o.lse, spec));
        if (c.sinks) keep(r.attention_sinks_backward(dout, o.out, o.lse, spec));
      }

      AttentionSpec spec{2, 4, 2, true};
      spec.window = 40;
      AttentionSpec with_sinks = spec;
      with_sinks.sinks = sinks;
      const std::int64_t seq = 140, half = seq / 2, rows = seq * spec.batch;
      const Tensor qkv = r.randn({rows, (spec.heads + 2 * spec.groups()) * hd}, 74, 1.0f, t);
      const Tensor own = r.key_values(qkv, spec);
      const Tensor other = r.randn({half * spec.batch, 2 * spec.groups() * hd}, 75, 1.0f, t);
      const Blocks blocks = {
          {own, {0, -1, true, 0, 0}},
          // Query i (position 100 + i) sees positions 61 + i to 100 + i of the keys' 60 to 129: from query 30
          // on fewer than the window, from 69 on none.
          {other, {0, -1, true, 100, 60}},
          {other, {0, 10, true, 0, 5}},          // queries 0 to 4 see none of it
          {other, {half, half, true, 300, 95}},  // every key is before every query's window
      };
      Rank::AttentionOut acc = merge_blocks(r, qkv, spec, blocks);
      EXPECT_THROW(r.attention_block_(acc, qkv, own, with_sinks, blocks[0].second), UsageError);
      r.attention_sinks_(acc, with_sinks);
      keep(acc.out), keep(acc.lse);
      // Queries that saw no key at all: the sink alone, out 0.
      Rank::AttentionOut lone = merge_blocks(r, qkv, spec, {blocks[2]});
      r.attention_sinks_(lone, with_sinks);
      keep(lone.out), keep(lone.lse);

      const Tensor out = r.cast(acc.out, t), dout = r.randn(out.shape(), 76, 1.0f, t);
      blocks_backward(r, qkv, own, other, out, acc.lse, dout, spec, blocks, keep);
      keep(r.attention_sinks_backward(dout, out, acc.lse, with_sinks));
      return all;
    });
    const double tol = t == DType::Float32 ? 1e-4 : 5e-2;
    expect_close(b, std::string("sliding window and sinks ") + dtype_name(t), tol, tol);
  }
}

TEST(CudaBackend, VocabParallelEmbeddingAndCrossEntropyMatchHostReferences) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    const std::int64_t vocab = 10, cols = 4, rows = 6, half = vocab / 2;
    const std::vector<float> ids = {0, 7, 3, 7, 9, 5};
    Tensor tids = r.from_host({rows}, ids);
    for (DType t : {DType::Float32, DType::BFloat16}) {
      const std::string name = dtype_name(t);
      Tensor table = r.randn({vocab, cols}, 51, 1.0f, t);
      const auto ht = r.to_host(table);
      // Two shards of the table on one rank: their lookups sum to the full lookup.
      Tensor lo = r.slice(table, 0, 0, half), hi = r.slice(table, 0, half, half);
      Tensor sum = r.cast(r.embedding(tids, lo, 0), DType::Float32);
      r.add_(sum, r.embedding(tids, hi, half), 1.0f);
      std::vector<double> want(rows * cols);
      for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t c = 0; c < cols; ++c)
          want[i * cols + c] = ht[static_cast<std::int64_t>(ids[i]) * cols + c];
      }
      expect_near_all(r.to_host(sum), want, 0, 0, "embedding " + name);
      // Backward into the upper shard: rows with ids 7 (twice), 9 and 5 land there.
      Tensor dy = r.randn({rows, cols}, 52, 1.0f, t);
      const auto hdy = r.to_host(dy);
      Tensor dtable = r.zeros({half, cols});
      r.embedding_backward_(dtable, dy, tids, half);
      std::vector<double> dwant(half * cols, 0.0);
      for (std::int64_t i = 0; i < rows; ++i) {
        const auto local = static_cast<std::int64_t>(ids[i]) - half;
        if (local < 0) continue;
        for (std::int64_t c = 0; c < cols; ++c) dwant[local * cols + c] += hdy[i * cols + c];
      }
      expect_near_all(r.to_host(dtable), dwant, 1e-6, 1e-6, "embedding_backward_ " + name);

      // Cross-entropy with the vocabulary in two shards, the all_reduces done by hand.
      Tensor logits = r.randn({rows, vocab}, 53, 3.0f, t);
      const auto hl = r.to_host(logits);
      Tensor l0 = r.slice(logits, 1, 0, half), l1 = r.slice(logits, 1, half, half);
      const auto m0 = r.to_host(r.row_max(l0)), m1 = r.to_host(r.row_max(l1));
      std::vector<float> mx(rows);
      for (std::int64_t i = 0; i < rows; ++i) mx[i] = std::max(m0[i], m1[i]);
      Tensor tmax = r.from_host({rows}, mx);
      Tensor stats = r.softmax_stats(l0, tmax, tids, 0);
      r.add_(stats, r.softmax_stats(l1, tmax, tids, half), 1.0f);
      Tensor loss = r.cross_entropy_loss(tmax, stats);
      const float scale = 1.0f / rows;
      Tensor d0 = r.cross_entropy_backward(l0, tmax, stats, tids, 0, scale);
      Tensor d1 = r.cross_entropy_backward(l1, tmax, stats, tids, half, scale);
      EXPECT_EQ(d0.dtype(), t);
      double total = 0;
      std::vector<double> dwant0(rows * half), dwant1(rows * half);
      for (std::int64_t i = 0; i < rows; ++i) {
        double m = -1e300, s = 0;
        for (std::int64_t c = 0; c < vocab; ++c) m = std::max<double>(m, hl[i * vocab + c]);
        for (std::int64_t c = 0; c < vocab; ++c) s += std::exp(hl[i * vocab + c] - m);
        const auto target = static_cast<std::int64_t>(ids[i]);
        total += std::log(s) + m - hl[i * vocab + target];
        for (std::int64_t c = 0; c < vocab; ++c) {
          const double g = scale * (std::exp(hl[i * vocab + c] - m) / s - (c == target ? 1.0 : 0.0));
          (c < half ? dwant0 : dwant1)[i * half + c % half] = g;
        }
      }
      expect_near_all(r.to_host(loss), {total}, 1e-5, 1e-4, "cross_entropy_loss " + name);
      expect_near_all(r.to_host(d0), dwant0, tolerance(t), 1e-4, "cross_entropy_backward shard 0 " + name);
      expect_near_all(r.to_host(d1), dwant1, tolerance(t), 1e-4, "cross_entropy_backward shard 1 " + name);
    }
    EXPECT_THROW(r.embedding(r.from_host({2}, {0, 1}, DType::BFloat16), r.zeros({4, 2}), 0), UsageError);
  });
}

TEST(CudaBackend, EventsTimeTheComputeStream) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    Tensor x = r.randn({2048, 2048}, 1, 0.01f);
    Event start = r.record_event();
    for (int i = 0; i < 5; ++i) x = r.matmul(x, x);
    Event end = r.record_event();
    const double us = r.elapsed_us(start, end);
    EXPECT_GT(us, 0.0);
    EXPECT_LT(us, 60e6);
    EXPECT_GE(r.elapsed_us(start, start), 0.0);
    EXPECT_THROW(r.elapsed_us(Event(), end), UsageError);
  });
}

TEST(CudaBackend, PeakMemoryStartsOverOnReset) {
  REQUIRE_GPU();
  on_gpu([](Rank& r) {
    Tensor keep = r.zeros({1024}, DType::BFloat16);
    { Tensor big = r.zeros({1 << 20}); }
    EXPECT_GE(r.memory_peak(), (4 << 20) + 2048);
    r.reset_peak_memory();
    EXPECT_EQ(r.memory_peak(), r.memory_allocated());
    EXPECT_EQ(r.memory_allocated(), 2048);
  });
}

TEST(CudaBackend, TrainingFiguresReachTheReport) {
  REQUIRE_GPU();
  CudaBackend cuda(quiet_cuda());
  const RunReport report = cuda.launch(1, [](Rank& r) {
    TrainingStats s;
    s.model = "custom";
    s.step_time_us = 10;
    r.report_training(s);
    s.step_time_us = 20;  // a later call replaces an earlier one
    r.report_training(s);
  });
  ASSERT_TRUE(report.training.has_value());
  EXPECT_EQ(report.training->step_time_us, 20);
}

TEST(CudaBackend, SixteenBitCollectivesAndBatchedPointToPoint) {
  REQUIRE_GPU();
  const int w = gpu_world(2);
  CudaBackend cuda(quiet_cuda());
  std::vector<std::vector<float>> sums(w), got(w);
  const RunReport report = cuda.launch(w, [&](Rank& r) {
    Tensor t = r.full({1000}, 0.5f + r.rank(), DType::BFloat16);
    r.all_reduce(t, ReduceOp::Sum);
    sums[r.rank()] = r.to_host(t);
    if (w < 2) return;
    // Both ranks send first: only the grouped posting lets them meet.
    const int peer = 1 - r.rank();
    Tensor out = r.full({64}, 10.0f * r.rank(), DType::Float16), in = r.zeros({64}, DType::Float16);
    std::vector<Work> works = r.batch_isend_irecv({{CommOp::Send, out, peer}, {CommOp::Recv, in, peer}});
    EXPECT_EQ(works.size(), 2u);
    EXPECT_THROW(r.to_host(in), UsageError);  // not waited on yet
    for (Work& wk : works) wk.wait();
    got[r.rank()] = r.to_host(in);
  });
  float want = 0;
  for (int i = 0; i < w; ++i) want += 0.5f + i;
  for (int i = 0; i < w; ++i) EXPECT_EQ(sums[i], std::vector<float>(1000, want)) << "rank " << i;
  auto reduce = std::find_if(report.collectives.begin(), report.collectives.end(),
                             [](const CollectiveRecord& c) { return c.op == CommOp::AllReduce; });
  ASSERT_NE(reduce, report.collectives.end());
  EXPECT_EQ(reduce->bytes, 2000);  // 1000 bfloat16 values
  if (w < 2) GTEST_SKIP() << "batch_isend_irecv needs two GPUs";
  EXPECT_EQ(got[0], std::vector<float>(64, 10.0f));
  EXPECT_EQ(got[1], std::vector<float>(64, 0.0f));
}

TEST(CudaBackend, ViewsMatchTheSimulator) {
  REQUIRE_GPU();
  const int w = gpu_world(2);
  // Writes through views of one buffer, and NCCL's in-place all-gather and reduce-scatter on them.
  const Both b = run_both(w, [w](Rank& r) {
    const std::int64_t n = 5;
    Tensor gathered = r.full({w * n}, -3.0f, DType::BFloat16);
    Tensor mine = r.view(gathered, r.rank() * n, {n});
    r.copy_(mine, r.arange(Shape{n}, 10.0f * r.rank()));
    r.all_gather(gathered, mine);
    Tensor grads = r.arange(Shape{w * n}, 1.0f + r.rank());
    Tensor shard = r.view(grads, r.rank() * n, {n});
    r.reduce_scatter(shard, grads, ReduceOp::Sum);
    r.scale_(r.view(grads, 0, {2, 2}), 0.5f);
    r.matmul_(r.view(gathered, 0, {1, 2}), r.view(gathered, 2, {1, 2}),
              r.full({2, 2}, 0.25f, DType::BFloat16), Trans::No,
              Trans::No);  // a product into a view of another part of the same buffer
    // bf16 products summed into a float32 gradient (gradient-accumulation fusion).
    Tensor main_grad = r.full({2, 2}, 0.5f);
    r.matmul_add_(main_grad, r.view(gathered, 0, {2, 2}), r.full({2, 2}, 0.25f, DType::BFloat16), Trans::Yes,
                  Trans::No);
    r.matmul_add_(main_grad, r.view(gathered, 4, {2, 2}), r.view(gathered, 0, {2, 2}), Trans::No, Trans::No);

    std::vector<float> out = r.to_host(gathered);
    const std::vector<float> g = r.to_host(grads), mg = r.to_host(main_grad);
    out.insert(out.end(), g.begin(), g.end());
    out.insert(out.end(), mg.begin(), mg.end());
    return out;
  });
  expect_close(b, "views");
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
  Settings o;
  o["world"] = option_text(gpu_world(testing::number(o, "world")));
  o["quiet"] = option_text(true);
  o["count"] = option_text(1 << 20);  // the benchmark's size: enough to time, quick on both backends
  SimBackend sim(testing::quiet_config());
  RunReport simulated;
  try {
    simulated = run_lesson(sim, GetParam(), o);
  } catch (const UsageError& e) {
    // A lesson that cannot run at this world (say it needs two ranks) must refuse on GPUs too.
    CudaBackend cuda(quiet_cuda());
    EXPECT_THROW(run_lesson(cuda, GetParam(), o), UsageError);
    GTEST_SKIP() << "not runnable at world " << testing::number(o, "world") << ": " << e.what();
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
