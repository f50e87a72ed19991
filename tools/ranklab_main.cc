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
#include "common/trace_ranks.h"
#include "common/trace_writer.h"
#include "lessons/gpt/config.h"
#include "lessons/parallel/groups.h"
#include "plan/plan_command.h"
#include "real/host_comm.h"
#include "real/launch_env.h"
#include "sim/malloc_tuning.h"
#include "sim/measured_sim.h"
#include "sim/net/calibrate.h"
#include "sim/net/network_model.h"
#include "sim/net/topology.h"
#include "sim/net/topology_print.h"
#include "sim/sim_backend.h"
#include "sim/validate.h"
#include "tools/mpi_messenger.h"
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

// Options as the command line gives them: each declared flag's text, and which were given.
class FlagValues {
 public:
  // Adds `spec` to `app` as --flag, with `help` (the spec's own when empty), in CLI11's `group`.
  void add(CLI::App& app, const OptionSpec& spec, const std::string& help = "",
           const std::string& group = "") {
    const std::string name = "--" + spec.flag;
    CLI::Option* o = nullptr;
    std::string& text = text_[spec.flag];
    const std::string shown = help.empty() ? spec.help : help;
    if (spec.kind == OptionKind::Switch) {
      o = app.add_flag(name, switches_[spec.flag], shown);
    } else if (!spec.implicit.empty()) {
      o = app.add_flag(fmt::format("{}{{{}}}", name, spec.implicit), text, shown);
    } else {
      o = app.add_option(name, text, shown);
    }
    if (spec.kind == OptionKind::Integer) o->type_name("INT");
    if (spec.kind == OptionKind::Number) o->type_name("NUMBER");
    if (!group.empty()) o->group(group);
    options_[spec.flag] = o;
  }
  // The flags the command line gave, as text ("true" for a switch); every one of `only` when not empty.
  Settings given() const {
    Settings out;
    for (const auto& [flag, o] : options_) {
      if (o->count() == 0) continue;
      auto sw = switches_.find(flag);
      out[flag] = sw != switches_.end() ? (sw->second ? "true" : "false") : text_.at(flag);
    }
    return out;
  }

 private:
  std::map<std::string, CLI::Option*> options_;
  std::map<std::string, std::string> text_;
  std::map<std::string, bool> switches_;
};

// Every lesson's flags, each once, with the lessons that take it: what `ranklab run` accepts before it
// knows the lesson. A flag two lessons declare as different kinds (a switch and a value) would mean two
// things on one command line; the registry refuses that here, when the command line is built.
struct LessonFlag {
  OptionSpec spec;
  std::vector<std::string> lessons;
};
std::map<std::string, LessonFlag> lesson_flags() {
  std::map<std::string, LessonFlag> out;
  for (const Lesson& l : lessons()) {
    for (const OptionSpec& s : l.options) {
      auto [it, fresh] = out.try_emplace(s.flag, LessonFlag{s, {}});
      if (!fresh && (it->second.spec.kind == OptionKind::Switch) != (s.kind == OptionKind::Switch)) {
        throw Error(fmt::format("--{} is a switch in lesson {} but takes a value in lesson {}", s.flag,
                                it->second.lessons.front(), l.name));
      }
      if (s.help.size() < it->second.spec.help.size()) it->second.spec.help = s.help;  // the plainest says it
      it->second.lessons.push_back(l.name);
    }
  }
  return out;
}

// The lesson's options the command line gave, checked against its declarations: each flag must be one of
// the lesson's, and a flag that would be ignored beside another is refused.
Settings lesson_settings_given(const Lesson& lesson, const Settings& given) {
  for (const auto& [flag, value] : given) {
    if (lesson.option(flag) == nullptr) {
      throw UsageError(
          fmt::format("--{} is not an option of lesson {} (`ranklab run {} --help` lists its options)", flag,
                      lesson.name, lesson.name));
    }
  }
  for (const OptionSpec& s : lesson.options) {
    if (!s.ignored_with.empty() && given.count(s.flag) && given.count(s.ignored_with)) {
      throw UsageError(
          fmt::format("--{} has no effect with --{}, {}", s.flag, s.ignored_with, s.ignored_why));
    }
  }
  return given;
}

// --symmetric: the gpt layout's grid, its tp (and dp) dimensions replicated (parallel::Layout::symmetry).
SimSymmetry symmetry_of(const std::string& lesson, const Settings& settings, const std::string& mode) {
  if (lesson != "gpt") throw UsageError("--symmetric: only the gpt lesson has a layout to mirror");
  const gpt::Config o = gpt::options_table().read(settings, "gpt");
  if (!o.phantom) {
    throw UsageError(
        "--symmetric needs --phantom: mirrored ranks hold no numbers of their own, so a real run would train "
        "every replica on the same data");
  }
  const gpt::Config c = gpt::resolve(o, o.world);
  const parallel::Layout layout{c.tp, c.pp, c.dp, c.order, c.cp, c.ep, c.etp};
  // With a skewed routing the ranks that hold the hot experts do more work than the others of their ep
  // group: only the ranks that hold the same experts mirror each other, whatever the mode.
  const parallel::Layout::Grid grid = c.moe() && !c.balanced_routing()
                                          ? layout.expert_symmetry()
                                          : layout.symmetry(/*mirror_dp=*/mode == "tp-dp");
  return SimSymmetry{grid.sizes, grid.replicated};
}

std::unique_ptr<Backend> make_backend(const std::string& lesson, const std::string& name,
                                      const Profile& profile, const BackendOptions& b,
                                      const Settings& settings, int stack_kib) {
  if (name == "sim") {
    SimConfig config{profile};
    config.stack_bytes = static_cast<std::size_t>(stack_kib) * 1024;
    config.algorithm = b.algo;
    config.protocol = b.proto;
    config.sm_contention = !b.no_sm_contention;
    config.trace_ranks = TraceRanks::parse(b.trace_ranks, "--trace-ranks");
    if (!b.symmetric.empty()) config.symmetry = symmetry_of(lesson, settings, b.symmetric);
    return std::make_unique<SimBackend>(config);
  }
  if (name == "cuda") {
    if (!b.symmetric.empty() || b.no_sm_contention) {
      throw UsageError(
          fmt::format("--{} is a setting of the simulator's model; --backend cuda runs every rank on a GPU "
                      "and measures it",
                      b.symmetric.empty() ? "no-sm-contention" : "symmetric"));
    }
#if defined(RANKLAB_HAVE_CUDA)
    CudaConfig config;
    config.profile = profile;  // names the run in the report; the GPU's numbers are measured
    config.algorithm = b.algo;
    config.protocol = b.proto;
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

int run_command(const std::string& lesson_name, const std::string& backend_name,
                const std::string& profile_name, const std::optional<int>& nodes,
                const std::string& report_dir, bool force, const Settings& settings,
                const BackendOptions& backend_options, int stack_kib) {
  Profile profile = load_profile(profile_name);
  const Lesson& lesson = find_lesson(lesson_name);
  const PreparedLesson prepared = lesson.prepare(settings);  // bad options fail before anything is launched
  apply_nodes(profile, nodes, prepared.world);
  const TraceRanks trace = TraceRanks::parse(backend_options.trace_ranks, "--trace-ranks");
  trace.check(prepared.world, "--trace-ranks");
  std::unique_ptr<Backend> backend =
      make_backend(lesson_name, backend_name, profile, backend_options, settings, stack_kib);
  // Checked before the run, not after it, by the process that writes it; written at the run's end.
  std::optional<ReportFolder> folder;
  const bool perfetto = backend_options.trace_format == "perfetto";
  const std::string trace_file = perfetto ? "trace.perfetto-trace" : "trace.json";
  if (!report_dir.empty() && backend->owns_report())
    folder.emplace("--report", report_dir,
                   std::vector<std::string>{"summary.txt", "report.json", trace_file, "report.html"}, force);
  // The first line says what the times below are: the model's for a profile's hardware, or measured.
  if (backend_name == "sim") {
    std::printf("%s: simulated time on %d x %s (%s, %d node%s)\n", lesson_name.c_str(), prepared.world,
                profile.gpu.name.c_str(), profile.name.c_str(), profile.nodes, profile.nodes == 1 ? "" : "s");
  } else {
    std::printf("%s: measured time on %d GPU%s of this machine (%s backend)\n", lesson_name.c_str(),
                prepared.world, prepared.world == 1 ? "" : "s", backend_name.c_str());
  }
  RunReport report = run_lesson(*backend, lesson_name, settings);
  if (!backend->owns_report()) return report.all_checks_passed() ? 0 : 2;  // another process reports
  record_run_config(report, profile, backend_options);
  if (backend_name != "sim") keep_traced_only(report, trace);  // the simulator keeps only these as it runs
  const std::string summary = format_summary(report);
  const auto quiet = settings.find("quiet");
  if (quiet == settings.end() || quiet->second != "true") std::fputs(("\n" + summary).c_str(), stdout);
  if (!report_dir.empty()) {
    folder->write("summary.txt", summary);
    folder->write("report.json", [&report](std::ostream& f) { write_report_json(report, f); });
    folder->write(trace_file, perfetto ? report_to_perfetto(report) : report_to_trace_json(report));
    folder->write("report.html", report_to_html(report));
    folder->commit();
    std::string shown = report_dir;
    while (shown.size() > 1 && shown.back() == '/') shown.pop_back();
    std::printf("report written to %s%s\n", shown.c_str(), shown == "/" ? "" : "/");
  }
  if (!report.all_checks_passed()) {
    std::fprintf(stderr, "ranklab: %s: a check failed (see CHECK FAILED above)\n", lesson_name.c_str());
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
                    const std::string& html_path, bool force) {
  if (!html_path.empty()) refuse_input_as_output("--html", html_path, files);
  if (!html_path.empty() && !force && !written_by_ranklab(html_path)) {
    throw UsageError(fmt::format(
        "--html {}: that is not a page ranklab wrote; give --force to replace it, or another path",
        html_path));
  }
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
  std::vector<std::string> inputs = measured_paths;
  inputs.push_back(profile.source_file);
  refuse_input_as_output("-o", out_path, inputs);
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
    if (!std::filesystem::is_regular_file(path))
      throw UsageError(fmt::format("--load {}: no such file", path));
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

// The libraries `--load` names (before the subcommand): loaded before the command line is built, so that
// their lessons' options are flags of `ranklab run`.
std::vector<std::string> libraries_to_load(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc && argv[i][0] == '-'; ++i) {
    const std::string arg = argv[i];
    if (arg == "--load" && i + 1 < argc) {
      out.push_back(argv[++i]);
    } else if (arg.rfind("--load=", 0) == 0) {
      out.push_back(arg.substr(7));
    }
  }
  return out;
}

// A launch that would simulate the whole world in every process of a launcher's job.
void check_launch(const std::string& backend) {
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

// `ranklab plan`, across the job's processes when a launcher started several (plan/cluster.h). A process
// that fails marks the job failed, so that its exit aborts the others rather than leaving them waiting.
int plan_across_launch(const plan::Request& request) {
  const LaunchEnv launch = detect_launch_env();
  if (!launch.under_launcher() || launch.world_size == 1) return plan::plan_command(request);
  if (!mpi_available()) {
    throw UsageError(fmt::format(
        "plan: this process is {} of a job started by a launcher, and ranklab was built without MPI, which "
        "spreads a plan over the job: install an MPI (libopenmpi-dev on Debian and Ubuntu) and build again, "
        "or "
        "run the plan once without the launcher",
        launch.str()));
  }
  MpiMessenger cluster;
  try {
    return plan::plan_command(request, &cluster);
  } catch (...) {
    MpiHostComm::mark_failed();
    throw;
  }
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

  std::map<std::string, LessonFlag> all_lesson_flags;
  try {
    load_lessons(libraries_to_load(argc, argv));
    all_lesson_flags = lesson_flags();
  } catch (const Error& e) {
    std::fprintf(stderr, "ranklab: error: %s\n", e.what());
    return 1;
  }
  std::vector<std::string> lesson_libraries;  // loaded above
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
  run->add_option("lesson", lesson, "the lesson (see `ranklab list`)")->required();
  run->add_option("--backend", backend, "sim or cuda")->check(CLI::IsMember({"sim", "cuda"}));
  run->add_option("--profile", profile, "hardware profile name or .toml file (see `ranklab profiles`)");
  run->add_option("--nodes", nodes, "nodes of the profile to use")->check(at_least(1));
  run->add_option(
      "--report", report_dir,
      "write summary.txt, report.json, the trace (--trace-format) and report.html to this folder");
  bool force = false;
  run->add_flag("--force", force, "with --report: replace files in the folder that ranklab did not write");
  FlagValues backend_flags, run_lesson_flags;
  for (const OptionSpec& spec : backend_options().specs()) backend_flags.add(*run, spec);
  // Every lesson's options; `ranklab run LESSON --help` lists one lesson's, with its defaults and ranges.
  const std::size_t lesson_count = lessons().size();
  for (const auto& [flag, f] : all_lesson_flags) {
    const std::string who =
        f.lessons.size() == lesson_count ? "every lesson" : fmt::format("{}", fmt::join(f.lessons, ", "));
    std::string help = f.spec.help;
    if (flag == "break") {
      std::vector<std::string> bugs;
      for (const Lesson& l : lessons()) {
        if (const OptionSpec* b = l.option("break"))
          bugs.push_back(fmt::format("{}: {}", l.name, fmt::join(b->choices, ", ")));
      }
      help += fmt::format(" ({})", fmt::join(bugs, "; "));
    } else {
      help += fmt::format(" [{}]", who);
    }
    run_lesson_flags.add(*run, f.spec, help,
                         "Lesson options (`ranklab run LESSON --help`: a lesson's own, with its defaults)");
  }
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
  bool compare_force = false;
  compare->add_flag("--force", compare_force, "replace the --html file though ranklab did not write it");

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
  FlagValues plan_shape_flags, plan_flags;
  for (const std::string& flag : plan::shape_flags()) {
    for (const OptionSpec& spec : gpt::options_table().specs()) {
      if (spec.flag == flag) plan_shape_flags.add(*plan, spec);
    }
  }
  for (const OptionSpec& spec : plan::request_options().specs()) plan_flags.add(*plan, spec);

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
  std::optional<int> launcher_world;  // under mpirun or srun with --backend cuda: the launcher's world
#if defined(RANKLAB_HAVE_CUDA)
  // Under mpirun or srun each process is one rank: the launcher says how many there are.
  if (run->parsed() && backend == "cuda" && run->count("--world") == 0 && cuda_launcher_world() > 0) {
    launcher_world = cuda_launcher_world();
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
    if (run->parsed()) check_launch(backend);
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
      plan::Request request = plan::request_options().read(plan_flags.given(), "plan");
      request.shape = plan_shape_flags.given();
      return plan_across_launch(request);
    }
    if (compare->parsed())
      return compare_command(compare_files, compare_profile, compare_op, compare_html, compare_force);
    if (validate->parsed()) return validate_command(validate_dir_path, validate_doc);
    if (calibrate->parsed()) {
      return calibrate_command(measured_paths, calibrate_profile, calibrate_op, fitted_path);
    }
    // The lesson's defaults, with --lecture the lecture's setup, and what --model and the like expand to,
    // under what the command line gives.
    const Lesson& chosen = find_lesson(lesson);
    Settings given = lesson_settings_given(chosen, run_lesson_flags.given());
    if (launcher_world) given["world"] = std::to_string(*launcher_world);
    const BackendOptions backend_options_given = backend_options().read(backend_flags.given(), "");
    return run_command(lesson, backend, profile,
                       run->count("--nodes") ? std::optional<int>(nodes) : std::nullopt, report_dir, force,
                       resolve_settings(chosen, given, lecture), backend_options_given, stack_kib);
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
