#include "real/launch_env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>

#include "common/errors.h"

namespace ranklab {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None:
      return "none";
    case Launcher::OpenMpi:
      return "OpenMPI";
    case Launcher::Pmi:
      return "PMI";
    case Launcher::Slurm:
      return "SLURM";
  }
  return "?";
}

std::string LaunchEnv::str() const {
  if (!under_launcher()) return "a single process";
  std::string local = local_size > 0 ? fmt::format("local rank {} of {}", local_rank, local_size)
                                     : fmt::format("local rank {}", local_rank);
  return fmt::format("{} rank {} of {} ({})", launcher_name(launcher), world_rank, world_size, local);
}

namespace {

// A non-negative integer from variable `name`, or `fallback` when it is not set.
int read_int(const EnvLookup& env, const char* name, int fallback) {
  const char* text = env(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || value < 0 || value > 1'000'000) {
    throw UsageError(
        fmt::format("the launcher set {}='{}', which is not a process count or index", name, text));
  }
  return static_cast<int>(value);
}

bool is_set(const EnvLookup& env, const char* name) {
  return env(name) != nullptr;
}

LaunchEnv read(const EnvLookup& env, Launcher launcher, const char* size, const char* rank,
               const char* local_rank, const char* local_size) {
  LaunchEnv e;
  e.launcher = launcher;
  e.world_size = read_int(env, size, 1);
  e.world_rank = read_int(env, rank, 0);
  e.local_rank = read_int(env, local_rank, 0);
  e.local_size = local_size ? read_int(env, local_size, -1) : -1;
  if (e.world_size < 1 || e.world_rank >= e.world_size) {
    throw UsageError(fmt::format("the launcher set {}={} and {}={}: the rank must be below the size", rank,
                                 e.world_rank, size, e.world_size));
  }
  if (e.local_size > 0 && e.local_rank >= e.local_size) {
    throw UsageError(fmt::format("the launcher set {}={} and {}={}: the local rank must be below the size",
                                 local_rank, e.local_rank, local_size, e.local_size));
  }
  return e;
}

}  // namespace

LaunchEnv detect_launch_env(const EnvLookup& env) {
  // mpirun first: inside a SLURM allocation mpirun's processes also see the allocation's variables.
  if (is_set(env, "OMPI_COMM_WORLD_SIZE")) {
    return read(env, Launcher::OpenMpi, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  }
  // srun sets the step's variables; a batch script has the allocation's (SLURM_NTASKS) but is one process.
  if (is_set(env, "SLURM_STEP_NUM_TASKS") && is_set(env, "SLURM_PROCID")) {
    return read(env, Launcher::Slurm, "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", nullptr);
  }
  if (is_set(env, "PMI_SIZE") && is_set(env, "PMI_RANK")) {
    return read(env, Launcher::Pmi, "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  }
  return LaunchEnv{};
}

LaunchEnv detect_launch_env() {
  return detect_launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

int pick_device(int local_rank, int local_size, int device_count, bool one_device_per_process_bound,
                const std::string& host) {
  if (device_count <= 0) {
    throw BackendError(fmt::format("no CUDA device is visible on {}", host));
  }
  if (local_size <= device_count && local_rank < device_count) return local_rank;
  if (device_count == 1 && one_device_per_process_bound) return 0;
  throw UsageError(fmt::format(
      "{} ranks of this job run on {}, which shows {} GPU{}: NCCL cannot put two ranks of one communicator "
      "on one GPU. Start at most {} process{} per node (mpirun --map-by ppr:{}:node, or srun "
      "--ntasks-per-node={}), or use the simulator (--backend sim) for larger worlds",
      local_size, host, device_count, device_count == 1 ? "" : "s", device_count,
      device_count == 1 ? "" : "es", device_count, device_count));
}

namespace {
std::string nccl_name(const std::string& ours, const char* what,
                      std::initializer_list<std::pair<const char*, const char*>> names) {
  if (ours.empty()) return "";
  std::vector<std::string> known;
  for (const auto& [mine, nccls] : names) {
    if (ours == mine) return nccls;
    known.emplace_back(mine);
  }
  throw UsageError(fmt::format("--{} {}: NCCL has no such {}; choose one of {}", what, ours, what,
                               fmt::join(known, ", ")));
}
}  // namespace

std::string nccl_algo_env(const std::string& algo) {
  return nccl_name(algo, "algo",
                   {{"ring", "Ring"},
                    {"tree", "Tree"},
                    {"nvls", "NVLS"},
                    {"nvls_tree", "NVLSTree"},
                    {"collnet_direct", "CollnetDirect"},
                    {"collnet_chain", "CollnetChain"},
                    {"pat", "PAT"}});
}

std::string nccl_proto_env(const std::string& proto) {
  return nccl_name(proto, "proto", {{"simple", "Simple"}, {"ll", "LL"}, {"ll128", "LL128"}});
}

}  // namespace ranklab
