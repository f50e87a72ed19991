// The real backend: lessons on GPUs, with CUDA kernels, cuBLAS for matrix products and NCCL for every
// collective. This header is plain C++ (no CUDA headers), so the command line includes it anywhere.
//
// Two launchers, chosen by how the process was started:
//  - alone: `launch(world, fn)` runs one thread per GPU in this process (world up to the visible GPUs),
//    sharing the NCCL unique id in memory;
//  - under mpirun or srun: this process is one rank. The job's size is the world, rank 0's NCCL unique id
//    reaches the others over MPI, and each process takes the GPU of its local rank on its node. Only rank
//    0 assembles the whole report (owns_report()).
#pragma once

#include <string>

#include "common/backend.h"
#include "common/profile.h"

namespace ranklab {

struct CudaConfig {
  // The hardware the simulator would time this run on; the real backend only names it in the report,
  // so `compare` pairs runs (the device's own capacity and speed are what count here).
  Profile profile;
  // TF32 tensor cores for matmul (cuBLAS's CUBLAS_TF32_TENSOR_OP_MATH): faster, and about three decimal
  // digits, so numbers no longer match the simulator's float32.
  bool allow_tf32 = false;
  // A host wait on the device longer than this ends the run with an error naming the stuck collective,
  // instead of hanging (the communicators are aborted).
  double watchdog_timeout_s = 300;
  // Kernels and collectives timed per rank with CUDA events; past it a rank keeps running untimed.
  int max_timed_ops_per_rank = 200'000;
  // Print the lesson's lines as they come (they are in the report either way), as the simulator does.
  bool echo_output = true;
  // Force NCCL's algorithm and protocol ("" = NCCL chooses), in the simulator's names (--algo, --proto):
  // they become NCCL_ALGO and NCCL_PROTO before the communicators are created.
  std::string algorithm{};
  std::string protocol{};
};

// GPUs this process sees (CUDA_VISIBLE_DEVICES applies); 0 where there is no driver or device.
int cuda_device_count();
bool cuda_devices_available();
// The first GPU's name ("NVIDIA H200"), or "" where there is none.
std::string cuda_device_name();

// Under mpirun or srun: the job's process count, which is the world. 0 when this process runs alone.
int cuda_launcher_world();

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(CudaConfig config);
  explicit CudaBackend(Profile profile) : CudaBackend(CudaConfig{std::move(profile)}) {}
  std::string name() const override { return "cuda"; }
  // Alone, runs `world` threads, one per GPU; more ranks than GPUs is a UsageError. Under mpirun or srun,
  // `world` must equal the job's process count. Errors in any rank end the run and the first is rethrown;
  // under MPI a failed process also ends the job when it exits (MPI_Abort), as torchrun does.
  RunReport launch(int world, const std::function<void(Rank&)>& fn) override;
  // Whether this process holds the whole report: true alone and on rank 0 of an MPI job. Other ranks of
  // a job return a report with only their own rank's lines and checks, and should not print or write it.
  bool owns_report() const override;

 private:
  CudaConfig config_;
};

}  // namespace ranklab
