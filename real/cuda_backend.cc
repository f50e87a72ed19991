// The real backend's two launchers: a thread per GPU in this process, or this process as one rank of a
// job that mpirun or srun started. Both run the same CudaRank; they differ in how ranks find each other
// (shared memory or MPI) and in who assembles the report.
#include "real/cuda_backend.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/cuda_rank.h"
#include "real/host_comm.h"
#include "real/launch_env.h"
#include "real/rank_log.h"

namespace ranklab {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for a question
    return 0;
  }
  return count;
}

bool cuda_devices_available() {
  return cuda_device_count() > 0;
}

std::string cuda_device_name() {
  if (cuda_device_count() == 0) return "";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "";
  return prop.name;
}

int cuda_launcher_world() {
  const LaunchEnv env = detect_launch_env();
  return env.under_launcher() ? env.world_size : 0;
}

namespace {

// The error a failed run reports: the first rank's own, not the RunAborted of the ranks it stopped.
class FirstError {
 public:
  void record(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool aborted = is_abort(e);
    if (!error_ || (first_is_abort_ && !aborted)) {
      error_ = e;
      first_is_abort_ = aborted;
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static bool is_abort(std::exception_ptr e) {
    try {
      std::rethrow_exception(e);
    } catch (const RunAborted&) {
      return true;
    } catch (...) {
      return false;
    }
  }
  std::mutex mutex_;
  std::exception_ptr error_;
  bool first_is_abort_ = false;
};

std::string visible_devices_note() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return v ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", v) : "";
}

RunReport launch_threads(const CudaConfig& config, int world, const std::function<void(Rank&)>& fn) {
  if (world < 1) throw UsageError(fmt::format("the world needs at least one rank; got {}", world));
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    cudaGetLastError();
    throw BackendError(
        fmt::format("the cuda backend needs a GPU and this machine shows none{} (cudaGetDeviceCount: {}); "
                    "run the lesson on "
                    "the simulator instead (--backend sim)",
                    visible_devices_note(), e == cudaSuccess ? "no devices" : cudaGetErrorString(e)));
  }
  if (world > devices) {
    throw UsageError(
        fmt::format("--world {} needs {} GPUs and this machine shows {}{}: NCCL cannot put two ranks of one "
                    "communicator on "
                    "one GPU. Use --world {} or less, several nodes under mpirun or srun, or the simulator "
                    "(--backend sim)",
                    world, world, devices, visible_devices_note(), devices));
  }

  ThreadHostWorld host_world(world);
  std::vector<RankLog> logs(static_cast<size_t>(world));
  FirstError first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      set_error_context(r, r);
      ThreadHostComm host(&host_world, r);
      std::unique_ptr<CudaRank> rank;
      try {
        RANKLAB_CUDA(cudaSetDevice(r));
        rank = std::make_unique<CudaRank>(RankSetup{r, world, r, &host, host_world.abort_flag(), &config});
        rank->connect();
        rank->start();
        fn(*rank);
        logs[static_cast<size_t>(r)] = rank->finish();
      } catch (...) {
        // A foreign exception or thrown value becomes a ProgramError naming the rank, as on the simulator.
        first.record(current_error_of_rank(r));
        // Our kernels end first, then every other rank unwinds from whatever it waits on.
        if (rank) rank->abort();
        host_world.abort();
      }
      rank.reset();
    });
  }
  for (std::thread& t : threads) t.join();
  first.rethrow();
  return assemble_report(logs, "cuda", config.profile.name);
}

RunReport launch_mpi(const CudaConfig& config, const LaunchEnv& env, int world,
                     const std::function<void(Rank&)>& fn) {
  try {
    MpiHostComm& host = MpiHostComm::instance();
    if (host.size() != env.world_size) {
      throw BackendError(fmt::format(
          "{} started {} processes but MPI sees {}: MPI did not join the launcher's job (under srun, pass "
          "--mpi=pmix, or the plugin your site uses)",
          launcher_name(env.launcher), env.world_size, host.size()));
    }
    if (world != host.size()) {
      throw UsageError(
          fmt::format("under {} the world is the job's {} processes, but the run asks for --world {}: start "
                      "{} processes, or "
                      "leave --world out",
                      launcher_name(env.launcher), host.size(), world, world));
    }
    const int devices = cuda_device_count();
    const bool one_bound = devices == 1 && std::getenv("CUDA_VISIBLE_DEVICES") != nullptr;
    const int device = pick_device(host.local_rank(), host.local_size(), devices, one_bound, host.host());
    set_error_context(host.rank(), device);
    RANKLAB_CUDA(cudaSetDevice(device));

    // Two ranks on one GPU hang NCCL or fail deep inside it; find them first, by the GPU's PCI address.
    char bus_id[64] = {};
    RANKLAB_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));
    const std::vector<std::string> gpus = host.all_gather(fmt::format("{} {}", host.host(), bus_id));
    std::map<std::string, int> owner;
    for (int r = 0; r < static_cast<int>(gpus.size()); ++r) {
      auto [it, fresh] = owner.emplace(gpus[static_cast<size_t>(r)], r);
      if (!fresh) {
        throw UsageError(fmt::format(
            "ranks {} and {} both use GPU {}: NCCL needs one GPU per rank. Give each process its own GPU "
            "(one process per GPU per node)",
            it->second, r, gpus[static_cast<size_t>(r)]));
      }
    }

    RankLog log;
    {
      CudaRank rank(RankSetup{host.rank(), world, device, &host, nullptr, &config});
      rank.connect();
      rank.start();
      fn(rank);
      log = rank.finish();
    }
    host.clear_groups();
    // Rank 0 assembles the job's report; the others keep theirs alone (owns_report() says which is which).
    const std::vector<std::string> all = host.gather(serialize(log));
    RunReport report;
    if (host.rank() == 0) {
      std::vector<RankLog> logs;
      for (const std::string& bytes : all) logs.push_back(deserialize(bytes));
      report = assemble_report(logs, "cuda", config.profile.name);
    } else {
      report = assemble_report({log}, "cuda", config.profile.name);
    }
    report.world = world;
    return report;
  } catch (...) {
    // This process is going down with an error; when it exits it takes the job with it (MPI_Abort),
    // rather than leaving the other ranks to wait for the watchdog.
    MpiHostComm::mark_failed();
    std::rethrow_exception(current_error_of_rank(env.world_rank));
  }
}

}  // namespace

CudaBackend::CudaBackend(CudaConfig config) : config_(std::move(config)) {}

RunReport CudaBackend::launch(int world, const std::function<void(Rank&)>& fn) {
  // NCCL reads these when a communicator is created, so they are set before any is (in every process of
  // a job, each of which runs this).
  const std::string algo = nccl_algo_env(config_.algorithm), proto = nccl_proto_env(config_.protocol);
  if (!algo.empty()) setenv("NCCL_ALGO", algo.c_str(), 1);
  if (!proto.empty()) setenv("NCCL_PROTO", proto.c_str(), 1);
  const LaunchEnv env = detect_launch_env();
  if (env.under_launcher()) return launch_mpi(config_, env, world, fn);
  return launch_threads(config_, world, fn);
}

bool CudaBackend::owns_report() const {
  const LaunchEnv env = detect_launch_env();
  return !env.under_launcher() || env.world_rank == 0;
}

}  // namespace ranklab
