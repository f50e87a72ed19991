// The real backend's process-per-GPU bootstrap, on the CPU: recognising mpirun and srun from the
// environment, the GPU each local rank takes, and what travels over MPI before NCCL exists (the unique
// id, barriers, gathers). CTest runs this file under `mpirun -n 2`; NCCL and CUDA are left out.
//
// Run alone, the MPI tests skip and only the environment parsing runs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <string>

#include "common/errors.h"
#include "real/host_comm.h"
#include "real/launch_env.h"

namespace ranklab {
namespace {

EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(NcclChoice, NamesAsNcclTakesThem) {
  EXPECT_EQ(nccl_algo_env(""), "");
  EXPECT_EQ(nccl_algo_env("ring"), "Ring");
  EXPECT_EQ(nccl_algo_env("tree"), "Tree");
  EXPECT_EQ(nccl_algo_env("nvls"), "NVLS");
  EXPECT_EQ(nccl_algo_env("nvls_tree"), "NVLSTree");
  EXPECT_EQ(nccl_proto_env("simple"), "Simple");
  EXPECT_EQ(nccl_proto_env("ll"), "LL");
  EXPECT_EQ(nccl_proto_env("ll128"), "LL128");
  try {
    nccl_algo_env("rings");
    FAIL() << "expected an error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--algo rings"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nvls_tree"), std::string::npos) << e.what();
  }
  EXPECT_THROW(nccl_proto_env("LL"), UsageError);
}

TEST(LaunchEnv, AloneIsNoLauncher) {
  const LaunchEnv e = detect_launch_env(fake({}));
  EXPECT_FALSE(e.under_launcher());
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.world_rank, 0);
}

TEST(LaunchEnv, ReadsOpenMpi) {
  const LaunchEnv e = detect_launch_env(fake({{"OMPI_COMM_WORLD_SIZE", "16"},
                                              {"OMPI_COMM_WORLD_RANK", "11"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}));
  EXPECT_EQ(e.launcher, Launcher::OpenMpi);
  EXPECT_EQ(e.world_size, 16);
  EXPECT_EQ(e.world_rank, 11);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.local_size, 8);
  EXPECT_EQ(e.str(), "OpenMPI rank 11 of 16 (local rank 3 of 8)");
}

TEST(LaunchEnv, ReadsSrunButNotABatchScript) {
  const LaunchEnv step = detect_launch_env(fake(
      {{"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_PROCID", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "4"}}));
  EXPECT_EQ(step.launcher, Launcher::Slurm);
  EXPECT_EQ(step.world_size, 4);
  EXPECT_EQ(step.world_rank, 2);
  EXPECT_EQ(step.local_rank, 0);
  // sbatch's script is one process even when the allocation has many tasks.
  EXPECT_FALSE(detect_launch_env(fake({{"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "7"}})).under_launcher());
}

TEST(LaunchEnv, MpirunInsideASlurmAllocationIsMpirun) {
  const LaunchEnv e = detect_launch_env(fake({{"SLURM_STEP_NUM_TASKS", "1"},
                                              {"SLURM_PROCID", "0"},
                                              {"OMPI_COMM_WORLD_SIZE", "2"},
                                              {"OMPI_COMM_WORLD_RANK", "1"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  EXPECT_EQ(e.launcher, Launcher::OpenMpi);
  EXPECT_EQ(e.world_size, 2);
}

TEST(LaunchEnv, ReadsPmi) {
  const LaunchEnv e =
      detect_launch_env(fake({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}, {"MPI_LOCALRANKID", "1"}}));
  EXPECT_EQ(e.launcher, Launcher::Pmi);
  EXPECT_EQ(e.world_rank, 1);
  EXPECT_EQ(e.local_rank, 1);
}

TEST(LaunchEnv, MalformedVariablesAreNamed) {
  try {
    detect_launch_env(fake({{"OMPI_COMM_WORLD_SIZE", "two"}, {"OMPI_COMM_WORLD_RANK", "0"}}));
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_SIZE"), std::string::npos) << e.what();
  }
  EXPECT_THROW(detect_launch_env(fake({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}})),
               UsageError);
}

TEST(PickDevice, LocalRankTakesItsGpu) {
  EXPECT_EQ(pick_device(0, 8, 8, false, "node"), 0);
  EXPECT_EQ(pick_device(5, 8, 8, false, "node"), 5);
  EXPECT_EQ(pick_device(1, 2, 8, false, "node"), 1);
}

TEST(PickDevice, OneBoundGpuPerProcessIsDeviceZero) {
  EXPECT_EQ(pick_device(3, 4, 1, true, "node"), 0);
}

TEST(PickDevice, MoreRanksThanGpusIsAClearError) {
  try {
    pick_device(1, 2, 1, false, "gpu-node-7");
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("gpu-node-7"), std::string::npos) << what;
    EXPECT_NE(what.find("one GPU"), std::string::npos) << what;
  }
  EXPECT_THROW(pick_device(0, 1, 0, false, "node"), BackendError);
}

// ---- under mpirun ----------------------------------------------------------------------------------------

class Mpi : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = detect_launch_env();
    if (!env_.under_launcher()) GTEST_SKIP() << "not started by mpirun or srun";
    if (!mpi_available()) GTEST_SKIP() << "built without MPI";
  }
  LaunchEnv env_;
};

TEST_F(Mpi, EnvironmentAgreesWithMpi) {
  MpiHostComm& comm = MpiHostComm::instance();
  EXPECT_EQ(comm.size(), env_.world_size);
  EXPECT_EQ(comm.rank(), env_.world_rank);
  // One node here: MPI's node-local communicator and the launcher's local rank must agree, since the
  // GPU is picked from them.
  EXPECT_EQ(comm.local_rank(), env_.local_rank);
  if (env_.local_size > 0) {
    EXPECT_EQ(comm.local_size(), env_.local_size);
  }
}

TEST_F(Mpi, UniqueIdReachesEveryProcess) {
  MpiHostComm& comm = MpiHostComm::instance();
  // What ncclGetUniqueId would make on rank 0: 128 bytes nobody else can guess.
  std::string id(128, '\0');
  if (comm.rank() == 0) {
    std::mt19937_64 gen(std::random_device{}() ^ static_cast<std::uint64_t>(getpid()));
    for (char& c : id) c = static_cast<char>(gen());
  }
  comm.broadcast(id);
  ASSERT_EQ(id.size(), 128u);
  const std::vector<std::string> everyone = comm.all_gather(id);
  ASSERT_EQ(static_cast<int>(everyone.size()), comm.size());
  for (const std::string& other : everyone) EXPECT_EQ(other, everyone[0]);
}

TEST_F(Mpi, EachLocalRankPicksItsOwnGpu) {
  MpiHostComm& comm = MpiHostComm::instance();
  // Pretend each node has a GPU per process; then the picks must all differ.
  const int device = pick_device(comm.local_rank(), comm.local_size(), comm.local_size(), false, comm.host());
  EXPECT_EQ(device, comm.local_rank());
  const std::vector<std::string> picks = comm.all_gather(comm.host() + " " + std::to_string(device));
  for (size_t i = 0; i < picks.size(); ++i) {
    for (size_t j = i + 1; j < picks.size(); ++j) EXPECT_NE(picks[i], picks[j]);
  }
  // With one GPU on the node and no binding, two ranks there are an error on every rank.
  if (comm.local_size() > 1) {
    EXPECT_THROW(pick_device(comm.local_rank(), comm.local_size(), 1, false, comm.host()), UsageError);
  }
}

TEST_F(Mpi, GatherKeepsRankOrder) {
  MpiHostComm& comm = MpiHostComm::instance();
  const std::vector<std::string> got = comm.gather("rank " + std::to_string(comm.rank()));
  if (comm.rank() == 0) {
    ASSERT_EQ(static_cast<int>(got.size()), comm.size());
    for (int r = 0; r < comm.size(); ++r) EXPECT_EQ(got[static_cast<size_t>(r)], "rank " + std::to_string(r));
  } else {
    EXPECT_TRUE(got.empty());
  }
}

TEST_F(Mpi, GroupBarriersInvolveOnlyMembers) {
  MpiHostComm& comm = MpiHostComm::instance();
  // Every rank creates both groups; each rank then meets only its own.
  std::vector<int> evens, odds;
  for (int r = 0; r < comm.size(); ++r) (r % 2 == 0 ? evens : odds).push_back(r);
  comm.add_group(1, evens);
  comm.add_group(2, odds);
  comm.barrier(comm.rank() % 2 == 0 ? 1 : 2);
  EXPECT_THROW(comm.barrier(comm.rank() % 2 == 0 ? 2 : 1), UsageError);
  comm.barrier(0);
  comm.clear_groups();
}

}  // namespace
}  // namespace ranklab
