// Benchmarks of the simulator itself (wall time, not virtual time):
//  - a phantom all_reduce across many simulated ranks: the cost of fibers plus the network model;
//  - the simulator's GEMM (Eigen over OpenBLAS) against OpenBLAS sgemm called directly;
//  - `ranklab run benchmark --sweep`: nccl-tests' 30 sizes of all_reduce on 8 ranks, whole.
// Run: build/bench/ranklab_bench   (or `make bench`)
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <vector>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/rank.h"
#include "sim/sim_backend.h"

namespace {

ranklab::SimConfig config_for(int ranks) {
  ranklab::SimConfig c;
  c.profile = ranklab::load_profile("dgx-h100");
  c.profile.nodes = (ranks + c.profile.gpus_per_node - 1) / c.profile.gpus_per_node;
  c.echo_output = false;
  return c;
}

// One 1 GiB phantom all_reduce per iteration across state.range(0) ranks, launch to report.
void BM_PhantomAllReduce1GiB(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  ranklab::SimBackend backend(config_for(ranks));
  for (auto _ : state) {
    ranklab::RunReport rep = backend.launch(ranks, [](ranklab::Rank& r) {
      ranklab::Tensor t = r.phantom({std::int64_t{1} << 28});  // 2^28 float32 = 1 GiB
      r.all_reduce(t, ranklab::ReduceOp::Sum);
      r.synchronize();
    });
    benchmark::DoNotOptimize(rep.makespan_us);
  }
  state.counters["ranks"] = ranks;
}
BENCHMARK(BM_PhantomAllReduce1GiB)->Arg(8)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond);

// The benchmark lesson's --sweep on state.range(0) ranks of one DGX H100, as `ranklab run benchmark --world
// 8 --sweep --quiet` runs it: the lesson's numerics check, then 30 sizes of all_reduce from 8 B to 16 GiB.
void BM_BenchmarkSweep(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  for (auto _ : state) {
    ranklab::SimBackend backend(config_for(ranks));
    const ranklab::Settings o = {{"world", std::to_string(ranks)}, {"sweep", "true"}, {"quiet", "true"}};
    ranklab::RunReport rep = ranklab::run_lesson(backend, "benchmark", o);
    benchmark::DoNotOptimize(rep.makespan_us);
  }
}
BENCHMARK(BM_BenchmarkSweep)->Arg(8)->Unit(benchmark::kMillisecond);

// The simulator's matmul on one rank, timed around the call alone (the fibers' start-up is left out).
void BM_SimMatmul(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  ranklab::SimBackend backend(config_for(1));
  for (auto _ : state) {
    double seconds = 0;
    backend.launch(1, [&](ranklab::Rank& r) {
      ranklab::Tensor a = r.full({n, n}, 1.0f), b = r.full({n, n}, 0.5f);
      const auto t0 = std::chrono::steady_clock::now();
      ranklab::Tensor c = r.matmul(a, b);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    state.SetIterationTime(seconds);
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n * n * n * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SimMatmul)->Arg(1024)->Unit(benchmark::kMillisecond)->UseManualTime();

void BM_OpenBlasSgemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n * n * n * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_OpenBlasSgemm)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
