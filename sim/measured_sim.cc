#include "sim/measured_sim.h"

#include <fmt/format.h>

#include "common/compare.h"
#include "common/errors.h"
#include "common/measurements.h"
#include "common/replay.h"
#include "sim/sim_backend.h"

namespace ranklab {

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
    const RecordedOptions recorded = read_recorded_options(measured);
    config.algorithm = recorded.backend.algo;
    config.protocol = recorded.backend.proto;
    config.sm_contention = !recorded.backend.no_sm_contention;
    SimBackend sim(config);
    Settings lesson = recorded.lesson;
    lesson["quiet"] = "true";
    RunReport simulated = run_lesson(sim, measured.lesson, lesson);
    record_run_config(simulated, profile, recorded.backend);
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
