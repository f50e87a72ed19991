// ranklab: the command line. The one place that brings lessons and backends together.
//
//   ranklab list                                  the lessons
//   ranklab run LESSON [--world N] [--profile P]  run a lesson on the simulator (or --backend cuda)
//   ranklab profiles                              the hardware profiles
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "sim/sim_backend.h"

namespace ranklab {
namespace {

void add_lesson_options(CLI::App& run, Options& o) {
  run.add_option("--world", o.world, "number of ranks")->check(CLI::PositiveNumber);
  run.add_option("--batch", o.batch, "global batch size (training lessons)");
  run.add_option("--dim", o.dim, "model width (training lessons)");
  run.add_option("--layers", o.layers, "number of layers (training lessons)");
  run.add_option("--steps", o.steps, "training steps");
  run.add_option("--lr", o.lr, "learning rate");
  run.add_option("--optimizer", o.optimizer, "sgd or adamw")->check(CLI::IsMember({"sgd", "adamw"}));
  run.add_option("--micro-batches", o.micro_batches, "pipeline: micro-batches per batch");
  run.add_option("--schedule", o.schedule, "pipeline: naive, gpipe or 1f1b")
      ->check(CLI::IsMember({"naive", "gpipe", "1f1b"}));
  run.add_flag("--async-p2p", o.async_p2p, "pipeline: isend/irecv instead of send/recv");
  run.add_flag("--overlap", o.overlap, "data parallel: all-reduce gradients during backward");
  run.add_option("--bucket-mb", o.bucket_mb, "data parallel: gradient bucket size in MiB");
  run.add_flag("--phantom", o.phantom, "time the lesson without numbers (phantom tensors)");
  run.add_option("--op", o.op, "benchmark: the collective to time");
  run.add_option("--count", o.count, "benchmark: float32 elements");
  run.add_flag("--wrong-order", o.wrong_order, "benchmark: barrier before synchronize");
  run.add_flag("--sweep", o.sweep, "benchmark: sizes from 8 B up");
  run.add_flag("--quiet", o.quiet, "print less");
}

std::unique_ptr<Backend> make_backend(const std::string& name, const Profile& profile) {
  if (name == "sim") return std::make_unique<SimBackend>(profile);
  if (name == "cuda") {
    throw UsageError(
        "this build of ranklab has no CUDA backend; configure with -DRANKLAB_CUDA=ON on a machine with nvcc and "
        "NCCL");
  }
  throw UsageError(fmt::format("unknown backend '{}'; choose sim or cuda", name));
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) throw UsageError(fmt::format("cannot write {}", path.string()));
}

int run_command(const std::string& lesson, const std::string& backend_name, const std::string& profile_name,
                int nodes, const std::string& report_dir, const Options& o) {
  Profile profile = load_profile(profile_name);
  profile.nodes = nodes;
  find_lesson(lesson);  // fail before launching when the name is wrong
  std::unique_ptr<Backend> backend = make_backend(backend_name, profile);
  RunReport report = run_lesson(*backend, lesson, o);
  const std::string summary = format_summary(report);
  if (!o.quiet) std::fputs(("\n" + summary).c_str(), stdout);
  if (!report_dir.empty()) {
    std::filesystem::create_directories(report_dir);
    write_file(std::filesystem::path(report_dir) / "summary.txt", summary);
    write_file(std::filesystem::path(report_dir) / "report.json", report_to_json(report));
    std::printf("report written to %s/\n", report_dir.c_str());
  }
  if (!report.all_checks_passed()) {
    std::fprintf(stderr, "ranklab: %s: a check failed (see CHECK FAILED above)\n", lesson.c_str());
    return 2;
  }
  return 0;
}

}  // namespace
}  // namespace ranklab

int main(int argc, char** argv) {
  using namespace ranklab;
  CLI::App app{"ranklab: distributed training from collectives to pipelines, simulated or on GPUs"};
  app.require_subcommand(1);

  CLI::App* list = app.add_subcommand("list", "list the lessons");
  CLI::App* profiles = app.add_subcommand("profiles", "list the hardware profiles");

  CLI::App* run = app.add_subcommand("run", "run a lesson");
  std::string lesson, backend = "sim", profile = "dgx-h100", report_dir;
  int nodes = 1;
  Options options;
  run->add_option("lesson", lesson, "the lesson (see `ranklab list`)")->required();
  run->add_option("--backend", backend, "sim or cuda")->check(CLI::IsMember({"sim", "cuda"}));
  run->add_option("--profile", profile, "hardware profile name or .toml file (see `ranklab profiles`)");
  run->add_option("--nodes", nodes, "nodes of the profile to use")->check(CLI::PositiveNumber);
  run->add_option("--report", report_dir, "write summary.txt and report.json to this folder");
  add_lesson_options(*run, options);

  CLI11_PARSE(app, argc, argv);
  try {
    if (list->parsed()) {
      for (const Lesson& l : lessons()) std::printf("  %-20s %s\n", l.name.c_str(), l.summary.c_str());
      return 0;
    }
    if (profiles->parsed()) {
      for (const std::string& name : list_profiles()) {
        const Profile p = load_profile(name);
        std::printf("  %-16s %s\n", name.c_str(), p.description.c_str());
      }
      return 0;
    }
    return run_command(lesson, backend, profile, nodes, report_dir, options);
  } catch (const Error& e) {
    std::fprintf(stderr, "ranklab: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ranklab: internal error: %s\n", e.what());
    return 3;
  }
}
