#include "sim/measured_sim.h"

#include <fmt/format.h>

#include <memory>
#include <numeric>
#include <vector>

#include "common/compare.h"
#include "common/errors.h"
#include "common/measurements.h"
#include "common/replay.h"
#include "sim/net/network_model.h"
#include "sim/sim_backend.h"

namespace ranklab {

Options with_algorithm_names(const Options& o, const std::string& backend_name, const Profile& profile) {
  Options out = o;
  if (backend_name != "sim") return out;
  auto model = std::make_shared<sim::NetworkModel>(profile, sim::NetworkOptions{o.algo, o.proto});
  out.comm_algorithm = [model](CommOp op, std::int64_t bytes, int world, int root) {
    std::vector<int> ranks(world);
    std::iota(ranks.begin(), ranks.end(), 0);
    return model->plan_collective(op, bytes, ranks, root).name();
  };
  return out;
}

RunReport simulate_measured(const RunReport& measured, const Profile& profile, const std::string& algorithm,
                            const std::string& protocol) {
  SimConfig config{profile};
  config.echo_output = false;  // the lesson's lines were printed when it was measured
  if (measured.backend == "cuda" || measured.backend == "sim") {
    if (measured.options.empty()) {
      throw UsageError(
          fmt::format("the report of {} records no lesson options, so its run cannot be simulated "
                      "again; write it with `ranklab run --report` of this version",
                      measured.lesson));
    }
    const Options o = options_from_record(measured.options, measured.world);
    find_lesson(measured.lesson);
    config.algorithm = o.algo;
    config.protocol = o.proto;
    config.sm_contention = !o.no_sm_contention;
    SimBackend sim(config);
    RunReport simulated = run_lesson(sim, measured.lesson, with_algorithm_names(o, "sim", profile));
    record_run_config(simulated, profile, o);
    return simulated;
  }
  config.algorithm = algorithm;
  config.protocol = protocol;
  // nccl-tests -g N: one thread launches the collective of each of its N GPUs in every iteration, one
  // after the other, so each GPU's next launch comes N launches later. Every simulated rank has a host of
  // its own, so each pays the launches of its thread's N GPUs: the loop runs at the rate the thread does
  // (the 35 us a row that one thread driving 8 H100s measures at small sizes, docs/validation.md).
  if (const std::optional<NcclTestsLoop> loop = nccl_tests_loop(measured)) {
    config.profile.gpu.launch_overhead_us *= loop->gpus_per_thread;
  }
  SimBackend sim(config);
  RunReport simulated = sim.launch(measured.world, replay_program(measured));
  label_as_replay(simulated, measured);
  simulated.profile = profile.name;
  return simulated;
}

}  // namespace ranklab
