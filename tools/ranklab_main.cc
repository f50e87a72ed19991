// ranklab: the command line. The one place that brings lessons and backends together.
//
//   ranklab list                                  the lessons (--load LIB.so adds lessons built elsewhere)
//   ranklab run LESSON [--world N] [--profile P]  run a lesson on the simulator (or --backend cuda)
//   ranklab profiles                              the hardware profiles
//   ranklab topo [--profile P] [--nodes N]        a profile's machine: links, tiers, bandwidths, latencies
//   ranklab compare MEASURED [SIMULATED]          measured against simulated, side by side (and compare.html)
//   ranklab calibrate MEASURED --profile P -o F   fit a profile to a measurement
//   ranklab validate [DIR] [--write-doc DOC]      the model against every published sweep in DIR
//   ranklab plan --model M --nodes N              the best parallel layout of a GPT, found by simulating
#include <dlfcn.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <sstream>

#include "common/compare.h"
#include "common/errors.h"
#include "common/html_report.h"
#include "common/lesson.h"
#include "common/measurements.h"
#include "common/output_files.h"
#include "common/profile.h"
#include "common/progress.h"
#include "common/replay.h"
#include "common/report.h"
#include "common/text.h"
#include "common/trace_writer.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/presets.h"
#include "lessons/parallel/groups.h"
#include "plan/plan_command.h"
#include "real/launch_env.h"
#include "sim/malloc_tuning.h"
#include "sim/measured_sim.h"
#include "sim/net/calibrate.h"
#include "sim/net/network_model.h"
#include "sim/net/topology.h"
#include "sim/net/topology_print.h"
#include "sim/sim_backend.h"
#include "sim/validate.h"
#if defined(RANKLAB_HAVE_CUDA)
#include "real/cuda_backend.h"
#endif

#ifndef RANKLAB_VERSION
#define RANKLAB_VERSION "0.1.0"
#endif

namespace ranklab {
namespace {

// CLI11's own range checks print the whole range of a double ("not in range 0.000000 to 1797693...").
CLI::Validator at_least(double minimum) {
  return CLI::Validator(
      [minimum](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "not a number: " + text;
        if (!(v >= minimum)) return fmt::format("must be at least {}, got {}", minimum, text);
        return "";
      },
      fmt::format(">= {}", minimum));
}

// A finite number above 0: nan, inf and 0 are refused where they would silently mean nothing.
CLI::Validator positive_finite() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "not a number: " + text;
        if (!(v > 0) || !std::isfinite(v))
          return fmt::format("must be a finite number above 0, got {}", text);
        return "";
      },
      "> 0");
}

void add_lesson_options(CLI::App& run, Options& o) {
  run.add_option("--world", o.world, "number of ranks")->check(at_least(1));
  run.add_option("--batch", o.batch, "global batch size (training lessons)");
  run.add_option("--dim", o.dim, "model width (training lessons)");
  run.add_option("--layers", o.layers, "number of layers (training lessons)");
  run.add_option("--steps", o.steps, "training steps");
  run.add_option("--lr", o.lr, "learning rate")->check(positive_finite());
  run.add_option("--optimizer", o.optimizer, "sgd or adamw")->check(CLI::IsMember({"sgd", "adamw"}));
  run.add_option("--micro-batches", o.micro_batches, "pipeline: micro-batches per batch");
  run.add_option("--schedule", o.schedule, "pipeline: naive, gpipe or 1f1b")
      ->check(CLI::IsMember({"naive", "gpipe", "1f1b"}));
  run.add_flag("--async-p2p", o.async_p2p, "pipeline: isend/irecv instead of send/recv");
  run.add_flag("--overlap", o.overlap, "data parallel: all-reduce gradients during backward");
  run.add_flag("--megatron", o.megatron, "tensor parallel: Megatron's column-then-row pairs");
  run.add_option("--bucket-mb", o.bucket_mb, "data parallel: gradient bucket size in MiB")
      ->check(positive_finite());
  run.add_flag("--phantom", o.phantom, "time the lesson without numbers (phantom tensors)");
  run.add_option("--op", o.op, "benchmark: the collective to time");
  run.add_option("--count", o.count, "benchmark: float32 elements");
  run.add_flag("--wrong-order", o.wrong_order, "benchmark: barrier before synchronize");
  run.add_flag("--sweep", o.sweep, "benchmark: sizes from 8 B up");
  run.add_flag("--quiet", o.quiet, "print less");
  run.add_option("--algo", o.algo, "force NCCL's algorithm, as NCCL_ALGO: ring, tree, nvls, nvls_tree");
  run.add_option("--proto", o.proto, "force NCCL's protocol, as NCCL_PROTO: ll, ll128, simple");
  run.add_flag("--no-sm-contention", o.no_sm_contention,
               "simulator: compute kernels do not share the GPU's SMs and HBM with communication kernels "
               "(the model before that sharing existed; docs/model.md)");
  // The gpt lesson.
  run.add_option("--model", o.model, "gpt: a preset that fills the shape flags (gpt3-175b, llama3-8b, ...)");
  run.add_option("--hidden", o.hidden, "gpt: model width");
  run.add_option("--heads", o.heads, "gpt: attention heads");
  run.add_option("--seq", o.seq, "gpt: sequence length");
  run.add_option("--vocab", o.vocab, "gpt: vocabulary size");
  run.add_option("--global-batch", o.global_batch, "gpt: sequences per step");
  run.add_option("--micro-batch", o.micro_batch, "gpt: sequences per micro-batch");
  run.add_option("--tp", o.tp, "gpt: tensor-parallel size");
  run.add_option("--pp", o.pp, "gpt: pipeline-parallel size");
  run.add_option("--dp", o.dp, "gpt: data-parallel size (default world / (tp pp))");
  run.add_option("--interleave", o.interleave, "gpt: model chunks per pipeline rank (interleaved 1F1B)");
  run.add_option("--zero", o.zero, "gpt: ZeRO stage 0, 1, 2 or 3");
  run.add_flag("--seq-parallel", o.seq_parallel, "gpt: sequence parallelism with tensor parallelism");
  run.add_option("--recompute", o.recompute, "gpt: activation recomputation: none, selective or full");
  run.add_option("--order", o.order, "gpt: process-group layout, innermost first (tp-dp-pp)");
  run.add_option("--dtype", o.dtype, "gpt: bf16, fp16 or fp32 weights and activations");
  run.add_option("--grad-reduce-dtype", o.grad_reduce_dtype,
                 "gpt: dtype of the data-parallel gradient reduction");
  run.add_option("--dropout", o.dropout,
                 "gpt: dropout probability of the residual branches (GPT-2's resid_pdrop; default 0)")
      ->check(CLI::Range(0.0, 0.99));
  run.add_flag("--symmetric{tp-dp}", o.symmetric,
               "gpt, simulator, with --phantom: run one rank per pipeline stage and let the tp and dp "
               "replicas mirror it (tp-dp, the default), or one per stage and dp replica (=tp); same "
               "memory and traffic at a fraction of the cost (docs/lessons/gpt.md says how exact)")
      ->check(CLI::IsMember({"tp", "tp-dp"}));
  // The moe lesson.
  run.add_option("--experts", o.experts, "moe: experts, a multiple of the world (expert parallelism)");
  run.add_option("--top-k", o.top_k, "moe: experts each token is routed to (1 or 2)");
  run.add_option("--capacity-factor", o.capacity_factor,
                 "moe: an expert takes at most this times an even share of each rank's tokens")
      ->check(positive_finite());
  run.add_option("--skew", o.skew, "moe: added to the router's logit of expert 0, to unbalance the load");
  run.add_option("--break", o.broken,
                 "a deliberate bug, to see the check fail (gpt: dp-sum, no-reduce-scatter, no-sp-grad-sync; "
                 "data_parallel: sum, no-all-reduce; tensor_parallel: no-reduce-scatter, wrong-slice; "
                 "pipeline_parallel: micro-batch-mean, no-zero-grad; moe: no-gate, no-router-all-reduce)")
      ->group("");
}

// --model fills the shape flags the command line left out (after the lesson's own defaults).
void apply_gpt_defaults(const CLI::App& run, const std::string& lesson, Options& o) {
  if (lesson != "gpt") return;
  gpt::apply_preset(o, [&](const std::string& flag) { return run.count(flag) > 0; });
}

// --symmetric: the gpt layout's grid, its tp (and dp) dimensions replicated (parallel::Layout::symmetry).
SimSymmetry symmetry_of(const std::string& lesson, const Options& o) {
  if (lesson != "gpt") throw UsageError("--symmetric: only the gpt lesson has a layout to mirror");
  if (!o.phantom) {
    throw UsageError(
        "--symmetric needs --phantom: mirrored ranks hold no numbers of their own, so a real run would train "
        "every replica on the same data");
  }
  const gpt::Config c = gpt::config_from(o, o.world);
  const parallel::Layout::Grid grid =
      parallel::Layout{c.tp, c.pp, c.dp, c.order}.symmetry(/*mirror_dp=*/o.symmetric == "tp-dp");
  return SimSymmetry{grid.sizes, grid.replicated};
}

std::unique_ptr<Backend> make_backend(const std::string& lesson, const std::string& name,
                                      const Profile& profile, const Options& o, int stack_kib) {
  if (name == "sim") {
    SimConfig config{profile};
    config.stack_bytes = static_cast<std::size_t>(stack_kib) * 1024;
    config.algorithm = o.algo;
    config.protocol = o.proto;
    config.sm_contention = !o.no_sm_contention;
    if (!o.symmetric.empty()) config.symmetry = symmetry_of(lesson, o);
    return std::make_unique<SimBackend>(config);
  }
  if (name == "cuda") {
#if defined(RANKLAB_HAVE_CUDA)
    CudaConfig config;
    config.profile = profile;  // names the run in the report; the GPU's numbers are measured
    config.algorithm = o.algo;
    config.protocol = o.proto;
    return std::make_unique<CudaBackend>(config);
#else
    throw UsageError(
        "this build of ranklab has no CUDA backend; configure with -DRANKLAB_CUDA=ON on a machine with nvcc "
        "and "
        "NCCL");
#endif
  }
  throw UsageError(fmt::format("unknown backend '{}'; choose sim or cuda", name));
}

// The nodes a run uses: --nodes when given, else the profile's own `nodes`; the two must not disagree.
// `world` (0: any) must need the last of them, or --nodes asked for nodes the run would leave empty.
void apply_nodes(Profile& profile, const std::optional<int>& cli_nodes, int world) {
  if (cli_nodes) {
    if (!profile.nodes_at.empty() && *cli_nodes != profile.nodes) {
      throw UsageError(fmt::format("--nodes {} contradicts the profile's 'nodes = {}' ({}); drop one of them",
                                   *cli_nodes, profile.nodes, profile.nodes_at));
    }
    profile.nodes = *cli_nodes;
  }
  const std::int64_t filled = (std::int64_t{world} + profile.gpus_per_node - 1) / profile.gpus_per_node;
  if (world > 0 && filled < profile.nodes) {
    throw UsageError(fmt::format(
        "{} nodes of {} GPUs, but --world {} fills only {}: give --world {} to {} to use {} nodes{}",
        profile.nodes, profile.gpus_per_node, world, filled,
        std::int64_t{profile.gpus_per_node} * (profile.nodes - 1) + 1,
        std::int64_t{profile.gpus_per_node} * profile.nodes, profile.nodes,
        cli_nodes ? ", or drop --nodes" : fmt::format(" (the profile sets nodes at {})", profile.nodes_at)));
  }
}

int topo_command(const std::string& profile_name, const std::optional<int>& nodes) {
  Profile profile = load_profile(profile_name);
  apply_nodes(profile, nodes, 0);
  std::fputs(sim::format_topology(sim::Topology(profile)).c_str(), stdout);
  return 0;
}

int run_command(const std::string& lesson, const std::string& backend_name, const std::string& profile_name,
                const std::optional<int>& nodes, const std::string& report_dir, const Options& options,
                int stack_kib) {
  Profile profile = load_profile(profile_name);
  apply_nodes(profile, nodes, options.world);
  find_lesson(lesson);                                      // fail before launching when the name is wrong
  if (!report_dir.empty()) prepare_report_dir(report_dir);  // before the run, not after it
  Options o = options;
  o.peak_tflops_16bit = profile.gpu.peak_tflops_bf16;
  o.peak_tflops_fp32 = profile.gpu.peak_tflops_fp32;
  o.gpus_per_node = profile.gpus_per_node;
  std::unique_ptr<Backend> backend = make_backend(lesson, backend_name, profile, o, stack_kib);
  // The first line says what the times below are: the model's for a profile's hardware, or measured.
  if (backend_name == "sim") {
    std::printf("%s: simulated time on %d x %s (%s, %d node%s)\n", lesson.c_str(), o.world,
                profile.gpu.name.c_str(), profile.name.c_str(), profile.nodes, profile.nodes == 1 ? "" : "s");
  } else {
    std::printf("%s: measured time on %d GPU%s of this machine (%s backend)\n", lesson.c_str(), o.world,
                o.world == 1 ? "" : "s", backend_name.c_str());
  }
  RunReport report = run_lesson(*backend, lesson, with_algorithm_names(o, backend_name, profile));
  if (!backend->owns_report()) return report.all_checks_passed() ? 0 : 2;  // another process reports
  record_run_config(report, profile, o);
  const std::string summary = format_summary(report);
  if (!o.quiet) std::fputs(("\n" + summary).c_str(), stdout);
  if (!report_dir.empty()) {
    write_file(std::filesystem::path(report_dir) / "summary.txt", summary);
    write_file(std::filesystem::path(report_dir) / "report.json", report_to_json(report));
    write_file(std::filesystem::path(report_dir) / "trace.json", report_to_trace_json(report));
    write_file(std::filesystem::path(report_dir) / "report.html", report_to_html(report));
    std::string shown = report_dir;
    while (shown.size() > 1 && shown.back() == '/') shown.pop_back();
    std::printf("report written to %s%s\n", shown.c_str(), shown == "/" ? "" : "/");
  }
  if (!report.all_checks_passed()) {
    std::fprintf(stderr, "ranklab: %s: a check failed (see CHECK FAILED above)\n", lesson.c_str());
    return 2;
  }
  return 0;
}

RunReport read_report(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw UsageError(fmt::format("cannot read report '{}'", path));
  return report_from_json(text.str(), path);
}

// The profile a measurement is simulated with: the one asked for; else the profile its report names; else
// the one whose GPU the measurement names (nccl-tests prints each device's name). Says which, and why.
Profile measurement_profile(const RunReport& measured, const std::string& asked) {
  std::string name = asked, why = "as asked with --profile";
  if (name.empty() && !measured.profile.empty()) {
    const std::vector<std::string> known = list_profiles();
    if (std::find(known.begin(), known.end(), measured.profile) != known.end()) {
      name = measured.profile;
      why = "the profile the measured report names";
    } else if (!(name = profile_for_gpu(measured.profile)).empty()) {
      why = fmt::format("its GPU, {}, is the {} of this profile", measured.profile,
                        load_profile(name).gpu.name);
    }
  }
  if (name.empty()) {
    throw UsageError(fmt::format(
        "the measurement does not say which GPUs it ran on{}; name the profile to "
        "simulate with --profile (see `ranklab profiles`)",
        measured.profile.empty() ? "" : fmt::format(" in a way ranklab knows ('{}')", measured.profile)));
  }
  Profile profile = load_profile(name);
  profile.nodes = std::max(1, (measured.world + profile.gpus_per_node - 1) / profile.gpus_per_node);
  std::printf("simulating with profile '%s' (%s), %d node%s\n", profile.name.c_str(), why.c_str(),
              profile.nodes, profile.nodes == 1 ? "" : "s");
  return profile;
}

std::optional<CommOp> op_named(const std::string& name) {
  if (name.empty()) return std::nullopt;
  for (int i = 0; i < static_cast<int>(CommOp::Barrier); ++i) {
    if (name == comm_op_name(static_cast<CommOp>(i))) return static_cast<CommOp>(i);
  }
  throw UsageError(
      fmt::format("--op {}: not a collective (all_reduce, all_gather, reduce_scatter, all_to_all, "
                  "broadcast, reduce, gather, scatter, send)",
                  name));
}

// `files`: a measurement (one file, or one profiler trace per rank), then optionally the simulated report to
// hold it against; without one, the measured collectives are simulated here.
int compare_command(std::vector<std::string> files, const std::string& profile_name, const std::string& op,
                    const std::string& html_path) {
  std::string simulated_path;
  if (files.size() >= 2) {
    std::ifstream last(files.back(), std::ios::binary);
    std::ostringstream text;
    text << last.rdbuf();
    if (detect_measurement_format(text.str(), files.back()) == MeasurementFormat::Report) {
      simulated_path = files.back();
      files.pop_back();
    }
  }
  const RunReport measured = read_measurements(files, op_named(op));
  const std::string measured_name = files.size() == 1 ? files[0] : fmt::format("{} traces", files.size());
  RunReport simulated;
  std::string simulated_name = simulated_path;
  if (!simulated_path.empty()) {
    simulated = read_report(simulated_path);
  } else {
    if (measured.backend == "sim") {
      throw UsageError(
          fmt::format("{} is already simulated; give a measured report beside it", measured_name));
    }
    simulated = simulate_measured(measured, measurement_profile(measured, profile_name));
    simulated_name = fmt::format("simulated ({})", simulated.profile);
  }
  const Comparison c = compare_reports(measured, simulated, measured_name, simulated_name);
  std::fputs(format_comparison(c).c_str(), stdout);
  if (!html_path.empty()) {
    write_file(html_path, comparison_to_html(c));
    std::printf("comparison written to %s\n", html_path.c_str());
  }
  return 0;
}

// Every published sweep of `dir` (validation/ by default) simulated and scored: one table per file, then
// the summary. With `doc_path`, the tables are written into that file's marked blocks instead
// (docs/validation.md; scripts/update-validation.sh).
int validate_command(const std::string& dir, const std::string& doc_path) {
  const std::vector<FileValidation> all = validate_dir(dir);
  if (!doc_path.empty()) {
    write_file(doc_path, update_validation_doc(read_text_file(doc_path), doc_path, all));
    std::printf("%zu validation tables written into %s\n", all.size(), doc_path.c_str());
    return 0;
  }
  for (const FileValidation& v : all)
    std::printf("## %s\n\n%s\n", v.name.c_str(), format_file_validation(v).c_str());
  std::printf("## All files\n\n%s", format_validation_summary(all).c_str());
  return 0;
}

// Fits `profile_name` to a measured report by simulating the measured run again (same lesson, options and
// world), and writes the fitted profile as a copy of the original file with the fitted values changed.
int calibrate_command(const std::vector<std::string>& measured_paths, const std::string& profile_name,
                      const std::string& op, const std::string& out_path) {
  const RunReport measured = read_measurements(measured_paths, op_named(op));
  const std::string measured_path =
      measured_paths.size() == 1 ? measured_paths[0] : fmt::format("{} traces", measured_paths.size());
  Profile profile = measurement_profile(measured, profile_name);
  std::ifstream original_file(profile.source_file, std::ios::binary);
  std::ostringstream original;
  original << original_file.rdbuf();

  int simulations = 0;
  Progress progress("calibrate: simulating " + measured.lesson, kCalibrationSimulations);
  const Simulate simulate = [&](const Profile& p) {
    progress.update(++simulations, "runs");
    return simulate_measured(measured, p);
  };
  const Calibration c = calibrate(measured, profile, simulate);
  progress.finish();

  char date[16];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(date, sizeof date, "%Y-%m-%d", &utc);
  const std::string name = std::filesystem::path(out_path).stem().string();
  write_file(out_path, fitted_profile_text(original.str(), c, name, measured_path, date));
  std::printf("%s on %d ranks against profile '%s': ", measured.lesson.c_str(), measured.world,
              profile.name.c_str());
  std::fputs(format_calibration(c).c_str(), stdout);
  // The fit scores collectives and kernels; `compare` scores collectives and regions. Print compare's
  // figure too, before and after, so the two commands can be read against each other.
  const double compare_before = compare_reports(measured, simulate_measured(measured, profile)).error;
  const double compare_after = compare_reports(measured, simulate_measured(measured, c.profile)).error;
  std::printf("compare's geometric-mean error (collectives and regions): %.1f%% -> %.1f%%\n",
              100 * compare_before, 100 * compare_after);
  std::printf("fitted profile written to %s\n", out_path.c_str());
  return 0;
}

// Loads lesson libraries built outside the tree (examples/my_lesson): each registers its lessons when it is
// loaded, with the executable's registry, whose symbols it resolves against.
void load_lessons(const std::vector<std::string>& libraries) {
  for (const std::string& path : libraries) {
    const std::size_t before = lessons().size();
    // A bare name would be searched for on the library path; a lesson library is a file the user names.
    const std::string file = path.find('/') == std::string::npos ? "./" + path : path;
    if (dlopen(file.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      throw UsageError(fmt::format("--load {}: {}", path, dlerror()));
    }
    if (lessons().size() == before) {
      throw UsageError(
          fmt::format("--load {}: the library registers no lesson (RANKLAB_LESSON in a .cc file "
                      "of the library registers one; see docs/writing-a-lesson.md)",
                      path));
    }
  }
}

// Flags that would be silently ignored or contradict the way the run is launched.
void check_run_flags(const CLI::App& run, const std::string& backend, const Options& o) {
  if (o.sweep && run.count("--count") > 0) {
    throw UsageError("--count has no effect with --sweep, which times every size from 8 B to 16 GiB");
  }
  const LaunchEnv launch = detect_launch_env();
  if (backend == "sim" && launch.under_launcher() && launch.world_size > 1) {
    throw UsageError(fmt::format(
        "this process is {} of a job started by a launcher, but the simulator (--backend sim) simulates the "
        "whole world in one process: every process would run it all. Run it once without the launcher, or "
        "use --backend cuda",
        launch.str()));
  }
}

// Output that could not be written (a full disk, a closed pipe) fails the run instead of exiting 0.
int finish_output(int status) {
  errno = 0;
  const bool flush_failed = std::fflush(stdout) != 0;
  if (flush_failed || std::ferror(stdout)) {
    std::fprintf(stderr, "ranklab: error: cannot write the output: %s\n",
                 flush_failed && errno != 0 ? std::strerror(errno) : "a write to standard output failed");
    return status == 0 ? 1 : status;
  }
  return status;
}

}  // namespace

int main_of(int argc, char** argv);

}  // namespace ranklab

int main(int argc, char** argv) {
  ranklab::sim::tune_malloc(argv);
  return ranklab::finish_output(ranklab::main_of(argc, argv));
}

int ranklab::main_of(int argc, char** argv) {
  using namespace ranklab;
  CLI::App app{"ranklab: distributed training from collectives to pipelines, simulated or on GPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ranklab ") + RANKLAB_VERSION);

  std::vector<std::string> lesson_libraries;
  app.add_option("--load", lesson_libraries,
                 "a lesson library built outside the tree (.so) whose lessons `list` and `run` then know; "
                 "repeat for several")
      ->check(CLI::ExistingFile);
  CLI::App* list = app.add_subcommand("list", "list the lessons");
  CLI::App* profiles = app.add_subcommand("profiles", "list the hardware profiles");

  CLI::App* topo =
      app.add_subcommand("topo", "print a profile's machine as the lecture's hierarchy of links");
  std::string topo_profile = "dgx-h100";
  int topo_nodes = 1;
  topo->add_option("--profile", topo_profile, "hardware profile name or .toml file (see `ranklab profiles`)");
  topo->add_option("--nodes", topo_nodes, "nodes of the profile")->check(at_least(1));

  CLI::App* run = app.add_subcommand("run", "run a lesson");
  std::string lesson, backend = "sim", profile = "dgx-h100", report_dir;
  int nodes = 1;
  int stack_kib = 256;
  Options options;
  run->add_option("lesson", lesson, "the lesson (see `ranklab list`)")->required();
  run->add_option("--backend", backend, "sim or cuda")->check(CLI::IsMember({"sim", "cuda"}));
  run->add_option("--profile", profile, "hardware profile name or .toml file (see `ranklab profiles`)");
  run->add_option("--nodes", nodes, "nodes of the profile to use")->check(at_least(1));
  run->add_option("--report", report_dir,
                  "write summary.txt, report.json, trace.json (Perfetto) and report.html to this folder");
  add_lesson_options(*run, options);
  run->add_option("--stack-kib", stack_kib, "simulator: each rank's stack in KiB (default 256)")
      ->check(CLI::Range(64, 1 << 20));
  bool lecture = false;
  run->add_flag("--lecture", lecture, "the lecture's own setup of the lesson (`ranklab run LESSON --help`)");

  CLI::App* validate = app.add_subcommand(
      "validate", "the model against published nccl-tests sweeps: one error table per file of a folder");
  std::string validate_dir_path = "validation", validate_doc;
  validate->add_option("dir", validate_dir_path,
                       "the folder of sweeps, each with its '# ranklab: --profile P --nodes N' line "
                       "(default: validation)");
  validate->add_option(
      "--write-doc", validate_doc,
      "write the tables into this markdown file's marked blocks (docs/validation.md) instead "
      "of printing them");

  CLI::App* compare = app.add_subcommand(
      "compare",
      "a measurement against the simulator: a report.json, nccl-tests output, profiler traces or CSV");
  std::vector<std::string> compare_files;
  std::string compare_html = "compare.html", compare_profile, compare_op;
  compare
      ->add_option(
          "files", compare_files,
          "MEASURED [SIMULATED]: report.json, an nccl-tests log, a CSV (op,bytes,ranks,time_us) or one "
          "PyTorch profiler trace per rank; then optionally the simulated report.json (without it, the "
          "measured collectives are simulated with --profile)")
      ->required()
      ->check(CLI::ExistingFile);
  compare->add_option(
      "--profile", compare_profile,
      "the profile to simulate with (default: the one the measurement names or whose GPU it names)");
  compare->add_option("--op", compare_op,
                      "the collective an nccl-tests log measured, when it cannot be told");
  compare->add_option("--html", compare_html, "write the comparison with its plot here (\"\" for none)");

  CLI::App* calibrate = app.add_subcommand("calibrate", "fit a profile to a measurement");
  std::vector<std::string> measured_paths;
  std::string calibrate_profile, calibrate_op, fitted_path;
  calibrate
      ->add_option(
          "measured", measured_paths,
          "report.json of a measured run, an nccl-tests log, a CSV, or profiler traces (one per rank)")
      ->required()
      ->check(CLI::ExistingFile);
  calibrate->add_option(
      "--profile", calibrate_profile,
      "the profile to start from (default: the one the measurement names or whose GPU it names)");
  calibrate->add_option("--op", calibrate_op,
                        "the collective an nccl-tests log measured, when it cannot be told");
  calibrate->add_option("-o,--output", fitted_path, "where to write the fitted profile (.toml)")->required();

  CLI::App* plan = app.add_subcommand(
      "plan", "the best parallel layout for a GPT on a cluster, found by simulating the candidates");
  plan::Request plan_request;
  int plan_layers = 0, plan_heads = 0, plan_seq = 0;
  std::int64_t plan_hidden = 0, plan_vocab = 0, plan_global_batch = 0;
  plan->add_option("--model", plan_request.model,
                   "a preset that fills the shape (gpt3-175b, llama3-70b, ...)");
  plan->add_option("--layers", plan_layers, "transformer blocks");
  plan->add_option("--hidden", plan_hidden, "model width");
  plan->add_option("--heads", plan_heads, "attention heads");
  plan->add_option("--seq", plan_seq, "sequence length");
  plan->add_option("--vocab", plan_vocab, "vocabulary size");
  plan->add_option("--global-batch", plan_global_batch, "sequences per step");
  plan->add_option("--dtype", plan_request.dtype, "bf16, fp16 or fp32 weights and activations");
  plan->add_option("--profile", plan_request.profile,
                   "hardware profile name or .toml file (see `ranklab profiles`)");
  plan->add_option("--nodes", plan_request.nodes, "nodes of the profile: the world is all of their GPUs");
  plan->add_option("--top", plan_request.top, "how many layouts the table shows (default 10)");
  plan->add_flag("--tp-across-nodes", plan_request.tp_across_nodes,
                 "also try tensor-parallel groups larger than a node");
  plan->add_option("--max-interleave", plan_request.max_interleave,
                   "the most model chunks per pipeline rank tried (default 4)");
  plan->add_option("--max-candidates", plan_request.max_candidates,
                   "simulate at most this many layouts (default 0: as many as the bound leaves)");
  bool plan_no_symmetry = false;
  plan->add_flag("--no-symmetry", plan_no_symmetry,
                 "simulate every rank, not one per class of identical ranks (slower; for checking)");
  plan->add_option("--jobs", plan_request.jobs,
                   "simulations at once, each on a thread (default 0: one per core); the answer is the same");
  plan->add_option("--confirm", plan_request.confirm,
                   "the leading layouts simulated again with every rank running after screening (default 1)");
  plan->add_option("--confirm-margin", plan_request.confirm_margin,
                   "and every layout whose screened step is within this fraction of the best (default 0.01)");
  plan->add_option("--report", plan_request.report_dir, "write plan.json and plan.html to this folder");
  plan->add_option("--explain", plan_request.explain,
                   "a layout as the table prints it: where its time goes against the winner's");

  // `ranklab run LESSON --help`: the lesson's own options and defaults.
  if (argc >= 4 && std::string(argv[1]) == "run" && argv[2][0] != '-') {
    for (int i = 3; i < argc; ++i) {
      if (std::string(argv[i]) != "--help" && std::string(argv[i]) != "-h") continue;
      try {
        std::fputs(lesson_help(find_lesson(argv[2])).c_str(), stdout);
        return 0;
      } catch (const Error& e) {
        std::fprintf(stderr, "ranklab: error: %s\n", e.what());
        return 1;
      }
    }
  }
  CLI11_PARSE(app, argc, argv);
#if defined(RANKLAB_HAVE_CUDA)
  // Under mpirun or srun each process is one rank: the launcher says how many there are.
  if (run->parsed() && backend == "cuda" && run->count("--world") == 0 && cuda_launcher_world() > 0) {
    options.world = cuda_launcher_world();
  }
  // On GPUs the profile only names what the run is to be compared with: by default the one of this GPU.
  if (run->parsed() && backend == "cuda" && run->count("--profile") == 0) {
    const std::string gpu = cuda_device_name();
    const std::string found = gpu.empty() ? "" : profile_for_gpu(gpu);
    if (!found.empty()) {
      profile = found;
      std::printf("ranklab: running on %s; the report names profile '%s', whose GPU it is\n", gpu.c_str(),
                  found.c_str());
    } else {
      std::printf(
          "ranklab: running on %s, which no profile describes; the report names '%s' (choose one with "
          "--profile)\n",
          gpu.empty() ? "an unknown GPU" : gpu.c_str(), profile.c_str());
    }
  }
#endif
  try {
    load_lessons(lesson_libraries);
    if (run->parsed()) check_run_flags(*run, backend, options);
    if (list->parsed()) {
      for (const Lesson& l : lessons()) std::printf("  %-20s %s\n", l.name.c_str(), l.summary.c_str());
      return 0;
    }
    if (profiles->parsed()) {
      for (const std::string& name : list_profiles()) {
        const Profile p = load_profile(name);
        std::printf("  %-16s %s\n", name.c_str(), p.description.c_str());
      }
      // Where they came from, first match first ($RANKLAB_PROFILE_DIR adds directories in front).
      std::printf("\nsearched, in order: %s\n", fmt::format("{}", fmt::join(profile_dirs(), ", ")).c_str());
      return 0;
    }
    if (topo->parsed()) {
      return topo_command(topo_profile,
                          topo->count("--nodes") ? std::optional<int>(topo_nodes) : std::nullopt);
    }
    if (plan->parsed()) {
      if (plan->count("--layers")) plan_request.layers = plan_layers;
      if (plan->count("--hidden")) plan_request.hidden = plan_hidden;
      if (plan->count("--heads")) plan_request.heads = plan_heads;
      if (plan->count("--seq")) plan_request.seq = plan_seq;
      if (plan->count("--vocab")) plan_request.vocab = plan_vocab;
      if (plan->count("--global-batch")) plan_request.global_batch = plan_global_batch;
      plan_request.symmetry = !plan_no_symmetry;
      return plan::plan_command(plan_request);
    }
    if (compare->parsed()) return compare_command(compare_files, compare_profile, compare_op, compare_html);
    if (validate->parsed()) return validate_command(validate_dir_path, validate_doc);
    if (calibrate->parsed()) {
      return calibrate_command(measured_paths, calibrate_profile, calibrate_op, fitted_path);
    }
    // The lesson's defaults (and with --lecture the lecture's setup) for what the command line left unset.
    const Lesson& chosen = find_lesson(lesson);
    std::vector<std::string> set;
    for (const auto* list : {&chosen.options, &chosen.lecture}) {
      for (const LessonOption& opt : *list) {
        if (run->count("--" + opt.name) > 0) set.push_back(opt.name);
      }
    }
    options = with_lesson_defaults(chosen, options, set, lecture);
    apply_gpt_defaults(*run, lesson, options);
    return run_command(lesson, backend, profile,
                       run->count("--nodes") ? std::optional<int>(nodes) : std::nullopt, report_dir, options,
                       stack_kib);
  } catch (const Error& e) {
    std::fprintf(stderr, "ranklab: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(
        stderr,
        "ranklab: error: out of host memory: the run needs more memory than this machine could give it; "
        "run fewer ranks, smaller sizes, or time it with --phantom\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ranklab: internal error: %s\n", e.what());
    return 3;
  }
}
