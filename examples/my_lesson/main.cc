// A program of one's own that runs a lesson on the simulator, without the ranklab command line.
#include <cstdio>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "sim/sim_backend.h"

int main(int argc, char** argv) {
  // The lesson's options as the command line would give them; the others keep the lesson's defaults.
  const ranklab::Settings options = {{"world", argc > 1 ? argv[1] : "8"}, {"count", "1048576"}};
  ranklab::SimConfig config;
  config.profile = ranklab::load_profile("dgx-h100");
  ranklab::SimBackend sim(config);
  const ranklab::RunReport report = ranklab::run_lesson(sim, "ring_all_reduce", options);
  std::fputs(ranklab::format_summary(report).c_str(), stdout);
  return report.all_checks_passed() ? 0 : 2;
}
