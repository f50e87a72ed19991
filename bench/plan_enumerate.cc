// plan_enumerate: what `ranklab plan` spends before it simulates anything. For every layout it enumerates
// it resolves the lesson's configuration, plans its memory stage by stage and bounds its step
// (plan/candidates.cc); a question on a large cluster has tens of thousands of layouts.
//
//   build/bench/ranklab_plan_enumerate [--benchmark_filter=...]
//
// Reports the wall time of one enumeration and, as counters, the layouts and the layouts enumerated per
// second.
#include <benchmark/benchmark.h>

#include <string>

#include "plan/candidates.h"
#include "plan/plan_command.h"

namespace {

void enumerate_question(benchmark::State& state, const std::string& model, int nodes) {
  using namespace ranklab::plan;
  Request r;
  r.shape["model"] = ranklab::option_text(model);
  r.profile = "dgx-h100";
  r.nodes = nodes;
  const Question q = make_question(r);
  std::size_t layouts = 0;
  for (auto _ : state) {
    const std::vector<Candidate> all = enumerate(q);
    layouts = all.size();
    benchmark::DoNotOptimize(all.data());
  }
  state.counters["layouts"] = static_cast<double>(layouts);
  state.counters["layouts_per_s"] =
      benchmark::Counter(static_cast<double>(layouts), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK_CAPTURE(enumerate_question, llama3_70b_8_nodes, "llama3-70b", 8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(enumerate_question, llama3_70b_64_nodes, "llama3-70b", 64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(enumerate_question, qwen3_30b_a3b_8_nodes, "qwen3-30b-a3b", 8)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(enumerate_question, qwen3_235b_a22b_32_nodes, "qwen3-235b-a22b", 32)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
