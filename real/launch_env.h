// How this process was started: alone (the thread-per-GPU launcher) or as one rank of a job that mpirun or
// srun started (the process-per-GPU launcher), and which GPU a process of such a job takes.
//
// Everything here reads the environment only, before MPI or CUDA are touched, so it is the same on every
// machine and the MPI bootstrap test runs it without a GPU.
#pragma once

#include <functional>
#include <string>

namespace ranklab {

enum class Launcher { None, OpenMpi, Pmi, Slurm };
const char* launcher_name(Launcher l);

struct LaunchEnv {
  Launcher launcher = Launcher::None;
  int world_rank = 0;
  int world_size = 1;
  int local_rank = 0;   // position among the job's processes on this node
  int local_size = -1;  // processes of the job on this node; -1 when the launcher does not say
  bool under_launcher() const { return launcher != Launcher::None; }
  std::string str() const;  // "OpenMPI rank 1 of 2 (local rank 1 of 2)"
};

// Looks a variable up; returns null when it is not set. The default reads the process environment.
using EnvLookup = std::function<const char*(const char*)>;

// Recognises, in this order: OpenMPI's mpirun (OMPI_COMM_WORLD_*), SLURM's srun (SLURM_STEP_NUM_TASKS,
// SLURM_PROCID, SLURM_LOCALID; a batch script alone sets none of the step's variables), and PMI launchers
// such as MPICH's Hydra (PMI_SIZE, PMI_RANK, MPI_LOCALRANKID). A variable that is set but malformed or
// out of range raises UsageError naming it.
LaunchEnv detect_launch_env(const EnvLookup& env);
LaunchEnv detect_launch_env();

// The GPU a process takes: its local rank, when the node shows at least as many GPUs as the job has
// processes there. A launcher that binds one GPU per process (srun --gpus-per-task=1, or
// CUDA_VISIBLE_DEVICES set per rank) leaves each process one visible device: then it is device 0.
// Anything else puts two ranks on one GPU, which NCCL does not allow: UsageError saying so.
int pick_device(int local_rank, int local_size, int device_count, bool one_device_per_process_bound,
                const std::string& host);

// NCCL's name for ranklab's algorithm and protocol names (--algo, --proto), as NCCL_ALGO and NCCL_PROTO
// take them (NCCL's docs, "Environment Variables"): ring -> Ring, tree -> Tree, nvls -> NVLS,
// nvls_tree -> NVLSTree, collnet_direct -> CollnetDirect, collnet_chain -> CollnetChain, pat -> PAT;
// simple -> Simple, ll -> LL, ll128 -> LL128. "" maps to "" (NCCL chooses). UsageError for anything else.
std::string nccl_algo_env(const std::string& algo);
std::string nccl_proto_env(const std::string& proto);

}  // namespace ranklab
