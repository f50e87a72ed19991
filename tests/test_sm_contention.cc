// Communication kernels share the GPU with compute kernels (docs/model.md, "Communication kernels share
// the GPU"): a kernel that runs while a collective is in flight on its GPU gets the SMs the collective's
// blocks leave and the HBM bandwidth its traffic leaves, over the part of the kernel that overlaps it.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "sim/compute_model.h"
#include "sim/net/network_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;

constexpr std::int64_t kArBytes = 64ll << 20;  // the all_reduce: 64 MiB of float32
constexpr std::int64_t kGemm = 8192;           // a bf16 GEMM of 8192^3: about 1.5 ms on an H100

SimConfig ring_config(bool contention) {
  SimConfig c = quiet_config();
  c.algorithm = "ring";  // a ring/simple all_reduce: its traffic through each GPU's HBM is plain to count
  c.protocol = "simple";
  c.sm_contention = contention;
  return c;
}

// What a program left on rank 0: its spans by name, and its collectives.
struct Outcome {
  std::vector<Span> kernels;  // rank 0's compute spans, in order
  std::vector<CollectiveRecord> collectives;
  double slowed_us = 0;         // rank 0's comm_slowed_compute_us in the report
  double lesson_slowed_us = 0;  // what Rank::comm_slowed_compute_us said at the end
};

Outcome run(const SimConfig& config, int world, const std::function<void(Rank&)>& fn) {
  SimBackend backend(config);
  Outcome out;
  RunReport rep = backend.launch(world, [&](Rank& r) {
    fn(r);
    if (r.rank() == 0) out.lesson_slowed_us = r.comm_slowed_compute_us();
  });
  for (const Span& s : rep.spans) {
    if (s.rank == 0 && s.kind == SpanKind::Compute) out.kernels.push_back(s);
  }
  out.collectives = rep.collectives;
  out.slowed_us = rep.ranks.at(0).comm_slowed_compute_us;
  return out;
}

const Span& kernel(const Outcome& r, const std::string& name, int nth = 0) {
  for (const Span& s : r.kernels) {
    if (s.name.str() == name && nth-- == 0) return s;
  }
  throw std::runtime_error("no kernel " + name);
}

// The all_reduce posted asynchronously, then `kernels` launched while it runs.
void beside_all_reduce(Rank& r, const std::function<void(Rank&)>& kernels) {
  Tensor grad = r.phantom({kArBytes / 4});
  Tensor a = r.phantom({kGemm, kGemm}, DType::BFloat16);
  r.synchronize();
  r.barrier();
  Work w = r.all_reduce(grad, ReduceOp::Sum, Async::Yes);
  kernels(r);
  w.wait();
  r.synchronize();
}

void gemm(Rank& r) {
  Tensor a = r.phantom({kGemm, kGemm}, DType::BFloat16);
  r.matmul(a, a);
}

TEST(SmContention, AGemmAloneTakesItsRooflineTime) {
  const Outcome alone = run(ring_config(true), 1, [](Rank& r) {
    Tensor a = r.phantom({kGemm, kGemm}, DType::BFloat16);
    r.matmul(a, a);
  });
  const sim::ComputeModel model(quiet_config().profile.gpu);
  const Span& k = kernel(alone, "matmul");
  EXPECT_EQ(k.end_us, k.start_us + model.gemm_us(kGemm, kGemm, kGemm, DType::BFloat16));
  EXPECT_EQ(alone.slowed_us, 0);
}

TEST(SmContention, AGemmBesideAnAllReduceLosesTheSmsOfItsChannelsWhileTheyOverlap) {
  const Outcome on = run(ring_config(true), 2, [](Rank& r) { beside_all_reduce(r, gemm); });
  const Profile p = quiet_config().profile;
  const sim::ComputeModel model(p.gpu);
  const sim::KernelCost cost = model.gemm_cost(kGemm, kGemm, kGemm, DType::BFloat16);
  sim::NetworkModel net(p, {"ring", "simple"});
  const sim::CommPlan plan = net.plan_collective(CommOp::AllReduce, kArBytes, {0, 1}, -1);
  ASSERT_EQ(plan.algorithm, sim::Algorithm::Ring);
  const int channels = plan.channels;
  ASSERT_GT(channels, 0);
  ASSERT_EQ(p.gpu.sm_count, 132);  // H100 SXM5: 132 SMs (profiles/dgx-h100.toml cites NVIDIA's data)

  ASSERT_EQ(on.collectives.size(), 1u);
  const double ar_start_us = on.collectives[0].start_us, ar_end_us = on.collectives[0].end_us;
  const Span& k = kernel(on, "matmul");
  // The kernel starts one launch after the all_reduce and outlasts it.
  EXPECT_EQ(k.start_us, ar_start_us + p.gpu.launch_overhead_us);
  ASSERT_LT(ar_end_us, k.start_us + cost.us());
  // The ring reads what each GPU sends (its 64 MiB), writes what it receives (64 MiB) and reads the GPU's
  // own piece each received one is added to (64 MiB): 3 x 64 MiB over the operation's time.
  const double hbm_share =
      1.0 - 3.0 * kArBytes / (ar_end_us - ar_start_us) / (p.gpu.hbm_bandwidth_gbps * 1e3);
  const double sm_share = (132.0 - channels) / 132.0;
  // The GEMM is bound by its arithmetic, and stays so with the HBM it has left.
  ASSERT_GT(cost.math_us / sm_share, cost.memory_us / hbm_share);
  // Over the overlap it runs at (132 - channels) / 132 of its speed, then at full speed.
  const double overlap_us = ar_end_us - k.start_us;
  const double expected_end_us = ar_end_us + (cost.us() - overlap_us * sm_share);
  EXPECT_NEAR(k.end_us, expected_end_us, 1e-9 * expected_end_us);
  EXPECT_NEAR(on.slowed_us, overlap_us * channels / 132.0, 1e-6);
  EXPECT_EQ(on.lesson_slowed_us, on.slowed_us);
}

TEST(SmContention, AMemoryBoundKernelBesideAnAllReduceLosesTheHbmItsTrafficTakes) {
  constexpr std::int64_t kCount = 1ll << 28;  // float32: 1 GiB each, an add moving 3 GiB
  auto add = [](Rank& r) {
    Tensor x = r.phantom({kCount}), y = r.phantom({kCount});
    r.add(x, y);
  };
  const Outcome on = run(ring_config(true), 2, [&](Rank& r) { beside_all_reduce(r, add); });
  const Profile p = quiet_config().profile;
  const sim::ComputeModel model(p.gpu);
  const sim::KernelCost cost = model.kernel_cost(kCount, 3.0 * 4 * kCount, DType::Float32);
  sim::NetworkModel net(p, {"ring", "simple"});
  const int channels = net.plan_collective(CommOp::AllReduce, kArBytes, {0, 1}, -1).channels;
  const double ar_start_us = on.collectives.at(0).start_us, ar_end_us = on.collectives.at(0).end_us;
  const Span& k = kernel(on, "add");
  ASSERT_LT(ar_end_us, k.start_us + cost.us());
  const double hbm_share =
      1.0 - 3.0 * kArBytes / (ar_end_us - ar_start_us) / (p.gpu.hbm_bandwidth_gbps * 1e3);
  const double sm_share = (132.0 - channels) / 132.0;
  ASSERT_LT(cost.math_us / sm_share, cost.memory_us / hbm_share);  // bound by memory, and more so beside it
  const double overlap_us = ar_end_us - k.start_us;
  const double expected_end_us = ar_end_us + (cost.us() - overlap_us * hbm_share);
  EXPECT_NEAR(k.end_us, expected_end_us, 1e-9 * expected_end_us);
}

TEST(SmContention, AKernelThatStartsAfterTheCollectiveEndedIsNotSlowed) {
  // Two GEMMs: the first overlaps the all_reduce and is slowed; the second starts after it has ended.
  auto two = [](Rank& r) {
    gemm(r);
    gemm(r);
  };
  const Outcome on = run(ring_config(true), 2, [&](Rank& r) { beside_all_reduce(r, two); });
  const Outcome off = run(ring_config(false), 2, [&](Rank& r) { beside_all_reduce(r, two); });
  const Span& first = kernel(on, "matmul", 0);
  const Span& second = kernel(on, "matmul", 1);
  ASSERT_GT(second.start_us, on.collectives.at(0).end_us);
  EXPECT_GT(first.end_us - first.start_us,
            kernel(off, "matmul", 0).end_us - kernel(off, "matmul", 0).start_us);
  // The same length as with the mechanism off, to the bit.
  const Span& second_off = kernel(off, "matmul", 1);
  EXPECT_EQ(second.end_us - second.start_us, second_off.end_us - second_off.start_us);
}

TEST(SmContention, SwitchedOffEveryKernelTakesItsTimeAloneAndTheCommunicationIsUnchanged) {
  const Outcome on = run(ring_config(true), 2, [](Rank& r) { beside_all_reduce(r, gemm); });
  const Outcome off = run(ring_config(false), 2, [](Rank& r) { beside_all_reduce(r, gemm); });
  const sim::ComputeModel model(quiet_config().profile.gpu);
  const Span& k = kernel(off, "matmul");
  EXPECT_EQ(k.end_us, k.start_us + model.gemm_us(kGemm, kGemm, kGemm, DType::BFloat16));
  EXPECT_EQ(off.slowed_us, 0);
  // Compute is slowed by communication; communication is not slowed by compute (docs/model.md).
  ASSERT_EQ(on.collectives.size(), off.collectives.size());
  EXPECT_EQ(on.collectives[0].start_us, off.collectives[0].start_us);
  EXPECT_EQ(on.collectives[0].end_us, off.collectives[0].end_us);
}

TEST(SmContention, AKernelLaunchedBeforeTheCollectiveIsPostedIsNotSlowed) {
  // The collective waits for the compute stream (it was posted after the kernel), so they never overlap.
  auto program = [](Rank& r) {
    Tensor grad = r.phantom({kArBytes / 4});
    gemm(r);
    Work w = r.all_reduce(grad, ReduceOp::Sum, Async::Yes);
    w.wait();
    r.synchronize();
  };
  const Outcome on = run(ring_config(true), 2, program);
  const Outcome off = run(ring_config(false), 2, program);
  EXPECT_EQ(kernel(on, "matmul").end_us, kernel(off, "matmul").end_us);
  EXPECT_EQ(on.collectives.at(0).end_us, off.collectives.at(0).end_us);
  EXPECT_EQ(on.slowed_us, 0);
}

TEST(SmContention, RanksWhoseCollectivesOverlapDifferentlyAreDeterministic) {
  // Four ranks, two groups, kernels and asynchronous collectives interleaved unevenly.
  auto program = [](Rank& r) {
    Group low = r.new_group({0, 1});
    Group high = r.new_group({2, 3});
    const Group pair = r.rank() < 2 ? low : high;
    std::vector<Work> works;
    for (int i = 0; i < 3; ++i) {
      Tensor g = r.phantom({(r.rank() / 2 + 1) * (kArBytes / 16)});
      Tensor w = r.phantom({kArBytes / 8});
      works.push_back(r.all_reduce(g, ReduceOp::Sum, Async::Yes, pair));
      for (int j = 0; j <= (r.rank() + i) % 3; ++j) gemm(r);
      works.push_back(r.all_reduce(w, ReduceOp::Sum, Async::Yes));
    }
    for (Work& x : works) x.wait();
    r.synchronize();
  };
  const Outcome a = run(ring_config(true), 4, program);
  const Outcome b = run(ring_config(true), 4, program);
  ASSERT_EQ(a.kernels.size(), b.kernels.size());
  for (std::size_t i = 0; i < a.kernels.size(); ++i) {
    EXPECT_EQ(a.kernels[i].start_us, b.kernels[i].start_us);
    EXPECT_EQ(a.kernels[i].end_us, b.kernels[i].end_us);
  }
  ASSERT_EQ(a.collectives.size(), b.collectives.size());
  for (std::size_t i = 0; i < a.collectives.size(); ++i)
    EXPECT_EQ(a.collectives[i].end_us, b.collectives[i].end_us);
  EXPECT_GT(a.slowed_us, 0);
  EXPECT_EQ(a.slowed_us, b.slowed_us);
}

}  // namespace
}  // namespace ranklab
