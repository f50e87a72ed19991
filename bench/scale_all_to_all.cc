// scale_all_to_all: what an all_to_all over many ranks costs the simulator. For each group size it prints
// the wall time of building the plan (a fresh network model, so the group's shape is built too), of
// simulating one phantom all_to_all of 64 MiB per rank over the whole world on 8-GPU DGX H100 nodes, the
// virtual time that all_to_all takes, and the process's peak resident memory so far.
//
//   build/bench/ranklab_scale_all_to_all 64 256 1024
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "common/profile.h"
#include "common/rank.h"
#include "sim/net/network_model.h"
#include "sim/sim_backend.h"

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> worlds;
  for (int i = 1; i < argc; ++i) worlds.push_back(std::atoi(argv[i]));
  if (worlds.empty()) worlds = {64, 256, 1024};
  const std::int64_t per_rank_bytes = std::int64_t{64} << 20;
  std::printf("%8s %10s %14s %14s %14s\n", "ranks", "flows", "plan ms", "simulate ms", "virtual us");
  for (int ranks : worlds) {
    ranklab::Profile p = ranklab::load_profile("dgx-h100");
    p.nodes = (ranks + p.gpus_per_node - 1) / p.gpus_per_node;
    std::vector<int> all(ranks);
    std::iota(all.begin(), all.end(), 0);
    ranklab::sim::NetworkModel model(p);
    auto t0 = std::chrono::steady_clock::now();
    const ranklab::sim::CommPlan plan =
        model.plan_collective(ranklab::CommOp::AllToAll, per_rank_bytes, all, -1);
    const double plan_ms = ms_since(t0);

    ranklab::SimConfig c;
    c.profile = p;
    c.echo_output = false;
    ranklab::SimBackend backend(c);
    t0 = std::chrono::steady_clock::now();
    ranklab::RunReport rep = backend.launch(ranks, [&](ranklab::Rank& r) {
      const ranklab::Tensor in = r.phantom({per_rank_bytes / 4});
      const ranklab::Tensor out = r.phantom({per_rank_bytes / 4});
      r.synchronize();
      r.all_to_all(out, in);
      r.synchronize();
    });
    const double sim_ms = ms_since(t0);
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    std::printf("%8d %10zu %14.1f %14.1f %14.1f   peak RSS %.0f MiB\n", ranks, plan.flows.size(), plan_ms,
                sim_ms, rep.makespan_us, u.ru_maxrss / 1024.0);
  }
  return 0;
}
