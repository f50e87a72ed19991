// Lessons and their registry. A lesson is one SPMD function; it registers itself with RANKLAB_LESSON
// so that `ranklab list` and `ranklab run NAME` find it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/rank.h"

namespace ranklab {

// Every knob a lesson may read. The command line sets them (`ranklab run --help` lists them); each
// lesson validates the ones it uses and names the option in its error.
struct Options {
  int world = 4;
  std::int64_t batch = 32;
  std::int64_t dim = 64;
  int layers = 4;
  int steps = 3;
  double lr = 0.01;
  std::string optimizer = "sgd";  // sgd | adamw
  int micro_batches = 4;
  std::string schedule = "1f1b";     // naive | gpipe | 1f1b
  bool async_p2p = false;            // pipeline: isend/irecv instead of send/recv
  bool overlap = false;              // data parallel: all-reduce gradients during backward
  bool megatron = false;             // tensor parallel: column-then-row pairs, one all_reduce each
  double bucket_mb = 25;             // data parallel: gradient bucket size
  bool phantom = false;              // time the lesson at its size without numbers
  std::string op = "all_reduce";     // benchmark: which collective
  std::int64_t count = 100'000'000;  // benchmark: float32 elements
  bool wrong_order = false;          // benchmark: barrier before synchronize
  bool sweep = false;                // benchmark: sizes from 8 B up
  std::string algo{};                // force NCCL's algorithm, as NCCL_ALGO (simulator)
  std::string proto{};               // force NCCL's protocol, as NCCL_PROTO (simulator)
  // Simulator: compute kernels run as if communication kernels took none of the GPU's SMs and HBM.
  bool no_sm_contention = false;
  // The algorithm/protocol the backend runs a collective of the whole world with ("ring/simple"), when it
  // can say: the simulator can, NCCL does not report it. Unset: unknown.
  std::function<std::string(CommOp op, std::int64_t bytes, int world, int root)> comm_algorithm{};
  bool quiet = false;  // fewer lines of output

  // The gpt lesson: the model's shape (--layers above is shared), its parallel layout and precision.
  std::string model{};  // the preset that filled the shape ("gpt3-175b"), or empty
  std::int64_t hidden = 64;
  int heads = 4;
  int seq = 16;
  std::int64_t vocab = 128;
  std::int64_t global_batch = 8;
  std::int64_t micro_batch = 2;
  int tp = 1, pp = 1;
  int dp = 0;  // 0: world / (tp pp)
  int interleave = 1;
  int zero = 0;
  bool seq_parallel = false;
  std::string recompute = "none";  // none | selective | full
  std::string order = "tp-dp-pp";  // process-group layout, innermost first
  std::string dtype = "bf16";      // bf16 | fp16 | fp32
  std::string grad_reduce_dtype = "fp32";
  double dropout = 0;  // gpt: probability of dropping an element of a residual branch
  // gpt on the simulator: which replicas mirror a representative instead of running ("" none, "tp" the
  // tensor-parallel ranks of each (stage, dp replica), "tp-dp" also the dp replicas: one rank per stage).
  std::string symmetric;
  // The moe lesson: experts over the world, each token routed to its top_k of them, at most
  // capacity_factor times an even share per expert, and a router biased towards expert 0 by `skew`.
  int experts = 4;
  int top_k = 2;
  double capacity_factor = 1.25;
  double skew = 0;
  std::string broken{};  // a deliberate bug the tests use to see the lesson's check fail
  // The hardware, from the profile, for MFU and for saying whether a tp group fits in a node (0: unknown).
  double peak_tflops_16bit = 0, peak_tflops_fp32 = 0;
  int gpus_per_node = 0;
};

using LessonFn = std::function<void(Rank&, const Options&)>;

// One option a lesson reads: its name as the command line spells it without the dashes ("batch",
// "world"), its value for this lesson as typed ("128"; "true" for a flag), and one line on what it does.
struct LessonOption {
  std::string name;
  std::string value;
  std::string help;
};

struct Lesson {
  std::string name;
  std::string summary;
  LessonFn fn;
  // What `ranklab run NAME --help` lists, with the defaults `run` gives this lesson.
  std::vector<LessonOption> options{};
  // What --lecture sets: the lecture's own setup of this lesson.
  std::vector<LessonOption> lecture{};
};

// Registers at static-initialisation time; returns true so it can initialise a namespace-scope bool.
bool register_lesson(Lesson lesson);
// Lessons in registration order of the tour (collectives first), then by name.
std::vector<Lesson> lessons();
// The lesson called `name`, or UsageError listing the ones there are.
const Lesson& find_lesson(const std::string& name);

class Backend;
struct RunReport;
// Runs lesson `name` on `backend` with `options.world` ranks and names the lesson in the report.
RunReport run_lesson(Backend& backend, const std::string& name, const Options& options);

#define RANKLAB_LESSON(name, summary, fn) \
  static const bool ranklab_lesson_registered_##fn = ::ranklab::register_lesson({name, summary, fn})
// The same, with the lesson's options (std::vector<LessonOption>) and the lecture's setup.
#define RANKLAB_LESSON_WITH_OPTIONS(name, summary, fn, options, lecture) \
  static const bool ranklab_lesson_registered_##fn =                     \
      ::ranklab::register_lesson({name, summary, fn, options, lecture})

// `given` with the lesson's defaults for every option the command line did not set (`set` holds the
// names it did), and with --lecture the lecture's setup over those defaults. UsageError for a value that
// does not parse.
Options with_lesson_defaults(const Lesson& lesson, const Options& given, const std::vector<std::string>& set,
                             bool lecture);
// What `ranklab run NAME --help` prints.
std::string lesson_help(const Lesson& lesson);

}  // namespace ranklab
