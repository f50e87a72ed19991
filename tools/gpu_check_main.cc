// ranklab_gpu_check: every lesson on this machine's GPUs and on the simulator, side by side.
//
//   ranklab_gpu_check OUT_DIR [--world N] [--profile NAME] [--lesson NAME]... [--count N]
//
// Runs each lesson on the cuda backend at the largest world the machine allows (or --world), then on the
// simulator with the same options and the profile matching the GPU, and writes OUT_DIR/cuda.json and
// OUT_DIR/sim.json (one report per lesson, keyed by name) and OUT_DIR/summary.txt. Exits non-zero when a
// lesson fails or a check fails on either backend. scripts/gpu-check.sh builds and runs it.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include "common/backend.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"
#include "real/cuda_backend.h"
#include "sim/sim_backend.h"

namespace {

using namespace ranklab;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The simulator's profile for this GPU: the first profile whose name mentions the GPU's model.
std::string matching_profile(const std::string& device_name) {
  const std::vector<std::string> names = list_profiles();
  const std::string gpu = lower(device_name);
  for (const char* model : {"b200", "h200", "h100", "a100"}) {
    if (gpu.find(model) == std::string::npos) continue;
    for (const std::string& n : names) {
      if (lower(n).find(model) != std::string::npos) return n;
    }
    // An H200 is an H100 with more and faster memory: the nearest profile when there is no H200 one.
    if (std::string(model) == "h200") {
      for (const std::string& n : names) {
        if (lower(n).find("h100") != std::string::npos) return n;
      }
    }
  }
  return names.empty() ? "" : names.front();
}

struct Outcome {
  std::string json = "null";
  std::string status;  // "ok", "checks failed", or the error
  double makespan_us = 0;
  bool ok = false;
};

Outcome run(Backend& backend, const std::string& lesson, const Settings& options, bool owner) {
  Outcome o;
  try {
    RunReport report = run_lesson(backend, lesson, options);
    if (owner) o.json = report_to_json(report);
    o.makespan_us = report.makespan_us;
    o.ok = report.all_checks_passed();
    o.status = o.ok ? "ok" : "checks failed";
  } catch (const std::exception& e) {
    o.status = e.what();
  }
  return o;
}

int usage() {
  std::fprintf(
      stderr,
      "usage: ranklab_gpu_check OUT_DIR [--world N] [--profile NAME] [--lesson NAME]... [--count N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string out_dir = argv[1];
  int world = 0;
  std::string profile_name;
  std::vector<std::string> only;
  long long count = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage();
    const std::string value = argv[++i];
    if (arg == "--world") {
      world = std::atoi(value.c_str());
    } else if (arg == "--profile") {
      profile_name = value;
    } else if (arg == "--lesson") {
      only.push_back(value);
    } else if (arg == "--count") {
      count = std::atoll(value.c_str());
    } else {
      return usage();
    }
  }

  try {
    const int devices = cuda_device_count();
    const int launcher_world = cuda_launcher_world();
    if (world == 0) world = launcher_world > 0 ? launcher_world : devices;
    if (world == 0) {
      std::fprintf(stderr, "ranklab_gpu_check: no GPU is visible; nothing to compare\n");
      return 1;
    }
    if (profile_name.empty()) profile_name = matching_profile(cuda_device_name());
    Profile profile;
    if (!profile_name.empty()) profile = load_profile(profile_name);
    // Enough simulated nodes for the world (a multi-node job under mpirun).
    if (profile.gpus_per_node > 0)
      profile.nodes = std::max(1, (world + profile.gpus_per_node - 1) / profile.gpus_per_node);

    CudaBackend cuda(CudaConfig{profile});
    SimBackend sim(profile);
    const bool owner = cuda.owns_report();
    if (owner) {
      fmt::print("ranklab_gpu_check: {} GPU(s) ({}), world {}, simulator profile '{}'\n", devices,
                 cuda_device_name(), world, profile.name);
    }

    std::string cuda_json = "{", sim_json = "{", summary;
    bool all_ok = true;
    bool first = true;
    for (const Lesson& lesson : lessons()) {
      if (!only.empty() && std::find(only.begin(), only.end(), lesson.name) == only.end()) continue;
      Settings options;
      options["world"] = option_text(world);
      options["quiet"] = option_text(true);
      if (count > 0 && lesson.option("count") != nullptr) options["count"] = option_text(count);
      if (owner) fmt::print("== {} ==\n", lesson.name);
      std::fflush(stdout);
      const Outcome real = run(cuda, lesson.name, options, owner);
      // Under mpirun every process would run the simulator too; rank 0 alone does.
      Outcome simulated;
      if (owner) simulated = run(sim, lesson.name, options, true);
      const std::string line =
          fmt::format("{:<20} cuda: {:<14} {:>12.1f} us    sim: {:<14} {:>12.1f} us", lesson.name,
                      real.status, real.makespan_us, simulated.status, simulated.makespan_us);
      summary += line + "\n";
      if (owner) fmt::print("{}\n", line);
      all_ok = all_ok && real.ok && (simulated.ok || !owner);
      cuda_json += fmt::format("{}\"{}\": {}", first ? "" : ",\n", lesson.name, real.json);
      sim_json += fmt::format("{}\"{}\": {}", first ? "" : ",\n", lesson.name, simulated.json);
      first = false;
    }
    cuda_json += "}\n";
    sim_json += "}\n";
    if (owner) {
      std::ofstream(out_dir + "/cuda.json") << cuda_json;
      std::ofstream(out_dir + "/sim.json") << sim_json;
      std::ofstream(out_dir + "/summary.txt") << summary;
      fmt::print("ranklab_gpu_check: wrote {0}/cuda.json, {0}/sim.json and {0}/summary.txt: {1}\n", out_dir,
                 all_ok ? "every lesson passed on both backends" : "SOME LESSONS FAILED");
    }
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ranklab_gpu_check: %s\n", e.what());
    return 1;
  }
}
