// scale_lessons: how the simulator's wall time and memory grow with the world, on whole training steps.
//
// Each case runs in a child process of its own, so the peak resident memory printed is that run's alone.
// Cases (phantom tensors, dgx-h100 nodes of 8 GPUs, W = the world size):
//   dp        data_parallel --dim 8192 --layers 16 --batch 8W          (synchronous all_reduce)
//   dp-overlap  the same with --overlap
//   tp        tensor_parallel --dim 16384 --layers 16 --batch 1024
//   pp        pipeline_parallel --dim 8192 --layers W --micro-batches 8
//   benchmark benchmark --count 1048576 (the reduce_scatter's W x count input fits a device at 4,096)
//   sends     every rank posts isend to the next rank and irecv from the previous one, W transfers in
//             flight at once, then waits for them all
//   allreduce one 1 GiB all_reduce
//
//   build/bench/ranklab_scale_lessons [--repeat N] [case ...] -- 512 1024 4096
// Without cases, every case runs; without sizes, 512 and 1024. With --repeat N each case and size runs N
// times, one after the other, and the fastest run's times are printed (the peak memory is the largest):
// on a machine shared with other work, the fastest run is the one the others disturbed least, and a
// 512-rank run's fraction of a second moves the most. The last column, the times per rank that ranks gave
// way to one another (SimBackend::fiber_switches), does not move between runs: at thousands of ranks each
// switch costs a cache refill of the rank's state, so it tells where seconds go without their noise.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/rank.h"
#include "sim/malloc_tuning.h"
#include "sim/sim_backend.h"

namespace {

using namespace ranklab;

SimConfig config_for(int world) {
  SimConfig c;
  c.profile = load_profile("dgx-h100");
  c.profile.nodes = (world + c.profile.gpus_per_node - 1) / c.profile.gpus_per_node;
  c.echo_output = false;
  return c;
}

// What a case's run answers (its makespan) and what it cost the simulator in switches between ranks
// (SimBackend::fiber_switches), per rank: unlike seconds, the same in every run.
struct CaseResult {
  double makespan_us = -1;
  double switches_per_rank = 0;
};

CaseResult result_of(const SimBackend& backend, const RunReport& report, int ranks) {
  return {report.makespan_us, static_cast<double>(backend.fiber_switches()) / ranks};
}

CaseResult run_lesson_case(const std::string& lesson, Settings o, int world) {
  o["world"] = option_text(world);
  // Phantom tensors, for the lessons that take real numbers otherwise (the benchmark times phantoms anyway).
  if (find_lesson(lesson).option("phantom") != nullptr) o["phantom"] = option_text(true);
  o["quiet"] = option_text(true);
  SimBackend backend(config_for(world));
  const RunReport report = run_lesson(backend, lesson, o);
  return result_of(backend, report, world);
}

CaseResult launch_case(int world, const std::function<void(Rank&)>& program) {
  SimBackend backend(config_for(world));
  const RunReport report = backend.launch(world, program);
  return result_of(backend, report, world);
}

// What each case runs.
const std::map<std::string, std::function<CaseResult(int)>>& cases() {
  static const std::map<std::string, std::function<CaseResult(int)>> all = {
      {"dp",
       [](int w) {
         Settings o;
         o["dim"] = option_text(8192);
         o["layers"] = option_text(16);
         o["batch"] = option_text(8 * static_cast<std::int64_t>(w));
         return run_lesson_case("data_parallel", o, w);
       }},
      {"dp-overlap",
       [](int w) {
         Settings o;
         o["dim"] = option_text(8192);
         o["layers"] = option_text(16);
         o["batch"] = option_text(8 * static_cast<std::int64_t>(w));
         o["overlap"] = option_text(true);
         return run_lesson_case("data_parallel", o, w);
       }},
      {"tp",
       [](int w) {
         Settings o;
         o["dim"] = option_text(16384);
         o["layers"] = option_text(16);
         o["batch"] = option_text(1024);
         return run_lesson_case("tensor_parallel", o, w);
       }},
      {"pp",
       [](int w) {
         Settings o;
         o["dim"] = option_text(8192);
         o["layers"] = option_text(w);
         o["micro-batches"] = option_text(8);
         return run_lesson_case("pipeline_parallel", o, w);
       }},
      {"benchmark",
       [](int w) {
         // 4 MiB: reduce_scatter's input is W x count per rank, which must fit a device at 4,096 ranks.
         Settings o;
         o["count"] = option_text(std::int64_t{1} << 20);
         return run_lesson_case("benchmark", o, w);
       }},
      {"sends",
       [](int w) {
         return launch_case(w, [](Rank& r) {
           const int n = r.world_size(), me = r.rank();
           Tensor out = r.phantom({1 << 20}), in = r.phantom({1 << 20});
           Work s = r.send(out, (me + 1) % n, Async::Yes);
           Work v = r.recv(in, (me + n - 1) % n, Async::Yes);
           s.wait();
           v.wait();
           r.synchronize();
         });
       }},
      {"b2b",
       [](int n) {
         // Here the size is not the world: 8 ranks post n synchronous all_reduces back to back and
         // synchronize once, so n operations wait in line on one stream.
         return launch_case(8, [n](Rank& r) {
           Tensor t = r.phantom({1 << 20});
           for (int i = 0; i < n; ++i) r.all_reduce(t, ReduceOp::Sum);
           r.synchronize();
         });
       }},
      {"allreduce",
       [](int w) {
         return launch_case(w, [](Rank& r) {
           Tensor t = r.phantom({std::int64_t{1} << 28});
           r.all_reduce(t, ReduceOp::Sum);
           r.synchronize();
         });
       }},
  };
  return all;
}

// One run of a case in a child process of its own, so that its peak resident memory is its alone.
struct ChildRun {
  double wall_s = 0, cpu_s = 0, peak_rss_mib = 0;
  CaseResult result;
  bool ok = false;
};

ChildRun run_in_child(const std::string& name, int w) {
  ChildRun run;
  int pipe_fd[2];
  if (pipe(pipe_fd) != 0) return run;
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fd[0]);
    CaseResult result;
    try {
      result = cases().at(name)(w);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s at %d ranks: %s\n", name.c_str(), w, e.what());
    }
    if (write(pipe_fd[1], &result, sizeof result) != sizeof result) _exit(1);
    _exit(result.makespan_us < 0 ? 1 : 0);
  }
  close(pipe_fd[1]);
  if (read(pipe_fd[0], &run.result, sizeof run.result) != sizeof run.result) run.result = CaseResult{};
  close(pipe_fd[0]);
  int status = 0;
  rusage usage{};
  wait4(child, &status, 0, &usage);
  run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.cpu_s = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
              static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  run.peak_rss_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;
  run.ok = status == 0;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  ranklab::sim::tune_malloc(argv);
  std::vector<std::string> names;
  std::vector<int> worlds;
  int repeat = 1;
  bool sizes = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      sizes = true;
    } else if (!sizes && std::strcmp(argv[i], "--repeat") == 0) {
      repeat = i + 1 < argc ? std::atoi(argv[++i]) : 0;
      if (repeat < 1) {
        std::fprintf(stderr, "--repeat takes a number of runs, 1 or more\n");
        return 1;
      }
    } else if (sizes) {
      worlds.push_back(std::atoi(argv[i]));
    } else {
      if (!cases().contains(argv[i])) {
        std::fprintf(stderr, "unknown case '%s'; cases:", argv[i]);
        for (const auto& [name, fn] : cases()) std::fprintf(stderr, " %s", name.c_str());
        std::fprintf(stderr, "\n");
        return 1;
      }
      names.push_back(argv[i]);
    }
  }
  if (names.empty()) {
    for (const auto& [name, fn] : cases()) names.push_back(name);
  }
  if (worlds.empty()) worlds = {512, 1024};
  // CPU time is printed next to wall time: on a machine shared with other work it is the steadier one. It
  // has three decimals: the small worlds take a few hundredths of a second, and their ratios need them.
  std::printf("%-11s %8s %10s %10s %14s %12s %15s\n", "case", "ranks", "wall s", "cpu s", "virtual us",
              "peak RSS MiB", "switches/rank");
  std::fflush(stdout);
  for (const std::string& name : names) {
    for (int w : worlds) {
      ChildRun best = run_in_child(name, w);
      bool same_virtual_time = true;
      for (int k = 1; k < repeat; ++k) {
        const ChildRun again = run_in_child(name, w);
        best.ok = best.ok && again.ok;
        same_virtual_time = same_virtual_time && again.result.makespan_us == best.result.makespan_us &&
                            again.result.switches_per_rank == best.result.switches_per_rank;
        best.wall_s = std::min(best.wall_s, again.wall_s);
        best.cpu_s = std::min(best.cpu_s, again.cpu_s);
        best.peak_rss_mib = std::max(best.peak_rss_mib, again.peak_rss_mib);
      }
      std::printf("%-11s %8d %10.2f %10.3f %14.1f %12.1f %15.1f%s%s\n", name.c_str(), w, best.wall_s,
                  best.cpu_s, best.result.makespan_us, best.peak_rss_mib, best.result.switches_per_rank,
                  best.ok ? "" : "  (failed)",
                  same_virtual_time ? "" : "  (virtual times or switches differ between runs)");
      std::fflush(stdout);
    }
  }
  return 0;
}
