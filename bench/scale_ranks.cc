// scale_ranks: how the simulator's wall time and memory grow with the number of simulated ranks.
// For each world size it runs one phantom all_reduce (1 GiB by default) and prints the wall time and
// the process's peak resident memory so far.
//
//   build/bench/ranklab_scale 8 64 1024 16384
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/profile.h"
#include "common/rank.h"
#include "sim/sim_backend.h"

int main(int argc, char** argv) {
  std::vector<int> worlds;
  for (int i = 1; i < argc; ++i) worlds.push_back(std::atoi(argv[i]));
  if (worlds.empty()) worlds = {8, 64, 1024, 16384};
  std::printf("%8s %12s %14s %14s\n", "ranks", "wall ms", "virtual us", "peak RSS MiB");
  for (int ranks : worlds) {
    ranklab::SimConfig c;
    c.profile = ranklab::load_profile("dgx-h100");
    c.profile.nodes = (ranks + c.profile.gpus_per_node - 1) / c.profile.gpus_per_node;
    c.echo_output = false;
    ranklab::SimBackend backend(c);
    const auto t0 = std::chrono::steady_clock::now();
    ranklab::RunReport rep = backend.launch(ranks, [](ranklab::Rank& r) {
      ranklab::Tensor t = r.phantom({std::int64_t{1} << 28});
      r.all_reduce(t, ranklab::ReduceOp::Sum);
      r.synchronize();
    });
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    std::printf("%8d %12.1f %14.1f %14.1f\n", ranks, wall_ms, rep.makespan_us, u.ru_maxrss / 1024.0);
  }
  return 0;
}
