// gpt_scale: the wall time and memory of simulating one GPT training step at scale, phantom tensors.
//
//   build/bench/ranklab_gpt_scale            GPT-3 175B on 1,536 A100s (tp 8, pp 8, interleaved), then
//                                            the 1T model on 3,072 A100s with pp 64
//   build/bench/ranklab_gpt_scale 1536       only the first
//   ... --symmetric | --symmetric=tp | --full
//                                            only the symmetric run (one rank per pipeline stage, the tp
//                                            and dp replicas mirroring it), the one mirroring the tp ranks
//                                            only, or the full one; all three by default, so that their
//                                            answers can be compared
//
// Each case prints the simulated step time and MFU (what the run answers) and the simulator's own cost:
// wall and CPU seconds and the peak resident memory of a process that runs only that case.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "sim/malloc_tuning.h"
#include "sim/sim_backend.h"

namespace {

struct Case {
  std::string model;
  int layers, hidden, heads;
  std::int64_t global_batch;
  int world, tp, pp, interleave, zero;
  bool seq_parallel;
  std::string recompute;
};

// How a case is simulated: every rank, or mirroring the tp and dp replicas, or the tp ranks only.
enum class Mode { Full, MirrorTpDp, MirrorTp };

void run(const Case& k, Mode mode) {
  using namespace ranklab;
  Settings o;
  o["model"] = option_text(k.model);
  o["layers"] = option_text(k.layers);
  o["hidden"] = option_text(k.hidden);
  o["heads"] = option_text(k.heads);
  o["seq"] = option_text(2048);
  o["vocab"] = option_text(51200);
  o["global-batch"] = option_text(k.global_batch);
  o["micro-batch"] = option_text(1);
  o["world"] = option_text(k.world);
  o["tp"] = option_text(k.tp);
  o["pp"] = option_text(k.pp);
  o["interleave"] = option_text(k.interleave);
  o["zero"] = option_text(k.zero);
  o["seq-parallel"] = option_text(k.seq_parallel);
  o["recompute"] = option_text(k.recompute);
  o["steps"] = option_text(1);
  o["phantom"] = option_text(true);
  o["quiet"] = option_text(true);
  SimConfig c;
  c.profile = load_profile("dgx-a100");
  c.profile.nodes = k.world / c.profile.gpus_per_node;
  c.echo_output = false;
  c.trace_ranks = TraceRanks::parse("auto", "--trace-ranks");  // as `ranklab run gpt` keeps the timeline
  if (mode != Mode::Full) {
    c.symmetry.dims = {k.tp, k.world / (k.tp * k.pp), k.pp};  // order tp-dp-pp
    c.symmetry.replicated = {true, mode == Mode::MirrorTpDp, false};
  }
  SimBackend backend(c);
  const auto t0 = std::chrono::steady_clock::now();
  const RunReport rep = run_lesson(backend, "gpt", o);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const double cpu =
      u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
  std::printf(
      "%-11s %5d ranks %-9s  tp %d pp %d v %d dp %d zero %d%s recompute %-9s  step %9.4f s  MFU %5.1f%%  "
      "bubble %5.1f%% (formula %4.1f%%)  peak %6.1f GiB  |  wall %6.1f s  CPU %6.1f s  peak RSS %6.0f MiB\n",
      k.model.c_str(), k.world,
      mode == Mode::Full         ? "full"
      : mode == Mode::MirrorTpDp ? "sym tp-dp"
                                 : "sym tp",
      k.tp, k.pp, k.interleave, k.world / (k.tp * k.pp), k.zero, k.seq_parallel ? " sp" : "",
      k.recompute.c_str(), rep.training ? rep.training->step_time_us / 1e6 : 0.0,
      rep.training ? 100 * rep.training->mfu : 0.0, rep.training ? 100 * rep.training->bubble_fraction : 0.0,
      rep.training ? 100 * rep.training->bubble_fraction_formula : 0.0,
      rep.training ? rep.training->peak_memory_bytes / 1073741824.0 : 0.0, wall, cpu, u.ru_maxrss / 1024.0);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  ranklab::sim::tune_malloc(argv);
  std::vector<Case> cases = {
      // GPT-3 175B (Brown et al. 2020) as Megatron-LM trained it on 1,536 A100s.
      {"gpt3-175b", 96, 12288, 96, 1536, 1536, 8, 8, 2, 1, true, "none"},
      // Megatron-LM's 1T model (Narayanan et al. 2021, Table 1) on 3,072 A100s with pp 64; a global batch
      // of 384 (m = 64 micro-batches per pipeline) instead of 3,072, which keeps the simulation's own memory
      // within this machine.
      {"megatron-1t", 128, 25600, 160, 384, 3072, 8, 64, 1, 1, true, "none"},
  };
  std::vector<Mode> modes = {Mode::MirrorTpDp, Mode::MirrorTp, Mode::Full};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--symmetric") {
      modes = {Mode::MirrorTpDp};
    } else if (arg == "--symmetric=tp") {
      modes = {Mode::MirrorTp};
    } else if (arg == "--full") {
      modes = {Mode::Full};
    } else {
      const int world = std::atoi(argv[i]);
      std::erase_if(cases, [&](const Case& k) { return k.world != world; });
    }
  }
  // Each case in a process of its own, so that its peak memory is its own.
  for (const Case& k : cases) {
    for (Mode mode : modes) {
      const pid_t pid = fork();
      if (pid == 0) {
        run(k, mode);
        std::_Exit(0);
      }
      int status = 0;
      waitpid(pid, &status, 0);
    }
  }
  return 0;
}
