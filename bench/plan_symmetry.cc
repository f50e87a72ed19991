// plan_symmetry: how far `ranklab plan`'s symmetric screening is from the full run, on the layouts that
// lead the question of docs/lessons/plan.md (llama3-70b, global batch 1024, 64 dgx-h100 nodes), and what
// each run costs. The planner re-simulates the leading layouts with every rank running and re-simulates
// every layout screened within --confirm-margin of the best: this is the measurement that margin rests on.
//
//   build/bench/ranklab_plan_symmetry              the leading layouts of that question
//   build/bench/ranklab_plan_symmetry LAYOUT ...   these (named as the plan's table prints them)
//
// Per layout: the step time both ways and (full - symmetric) / symmetric, the peak memory per rank both
// ways, and the wall and CPU seconds of each run.
#include <sys/resource.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/errors.h"
#include "plan/plan_command.h"
#include "plan/search.h"
#include "sim/malloc_tuning.h"

namespace {

double cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ranklab::plan;
  ranklab::sim::tune_malloc(argv);
  Request r;
  r.shape["model"] = ranklab::option_text("llama3-70b");
  r.profile = "dgx-h100";
  r.nodes = 64;
  r.shape["global-batch"] = ranklab::option_text(1024);
  const Question q = make_question(r);
  std::vector<std::string> names(argv + 1, argv + argc);
  if (names.empty()) {
    names = {"tp4-pp4-v4-dp32-zero1-sp-mb1-none-tp-dp-pp", "tp4-pp2-v4-dp64-zero2-sp-mb1-none-tp-dp-pp",
             "tp4-pp4-v4-dp32-zero1-sp-mb1-none-tp-pp-dp", "tp4-pp4-v2-dp32-zero2-sp-mb1-none-tp-dp-pp",
             "tp4-pp4-v4-dp32-zero2-sp-mb1-none-tp-dp-pp", "tp4-pp4-v4-dp32-zero1-sp-mb1-selective-tp-dp-pp"};
  }
  std::vector<Layout> layouts;
  for (const std::string& name : names) {
    try {
      layouts.push_back(parse_layout(name));
    } catch (const ranklab::UsageError& e) {
      std::fprintf(stderr, "ranklab_plan_symmetry: its arguments are layouts: %s\n", e.what());
      return 2;
    }
  }
  std::printf("%-50s %15s %15s %10s %10s %10s  %s\n", "layout", "symmetric (us)", "full (us)", "full/sym-1",
              "peak sym", "peak full", "wall and CPU s: symmetric, full");
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const Layout& l = layouts[i];
    double wall[2], cpu[2];
    Result run[2];
    for (int full = 0; full < 2; ++full) {
      const double c0 = cpu_s();
      run[full] = simulate(q, l, full == 0);
      cpu[full] = cpu_s() - c0;
      wall[full] = run[full].wall_s;
    }
    if (!run[0].run || !run[1].run) {
      std::printf("%-50s out of memory: symmetric %s, full %s\n", name.c_str(), run[0].run ? "no" : "yes",
                  run[1].run ? "no" : "yes");
      continue;
    }
    const double s = run[0].run->stats.step_time_us, f = run[1].run->stats.step_time_us;
    std::printf("%-50s %15.3f %15.3f %+10.2e %9.2fG %9.2fG  %.1f %.1f, %.1f %.1f\n", name.c_str(), s, f,
                (f - s) / s, static_cast<double>(run[0].run->peak_bytes) / (1 << 30),
                static_cast<double>(run[1].run->peak_bytes) / (1 << 30), wall[0], cpu[0], wall[1], cpu[1]);
    std::fflush(stdout);
  }
  return 0;
}
