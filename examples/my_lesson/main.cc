// A program of one's own that runs a lesson on the simulator, without the ranklab command line.
#include <cstdio>
#include <cstdlib>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "sim/sim_backend.h"

int main(int argc, char** argv) {
  ranklab::Options o;
  o.world = argc > 1 ? std::atoi(argv[1]) : 8;
  o.count = 1 << 20;
  ranklab::SimConfig config;
  config.profile = ranklab::load_profile("dgx-h100");
  ranklab::SimBackend sim(config);
  const ranklab::RunReport report = ranklab::run_lesson(sim, "ring_all_reduce", o);
  std::fputs(ranklab::format_summary(report).c_str(), stdout);
  return report.all_checks_passed() ? 0 : 2;
}
