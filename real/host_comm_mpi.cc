// The process-per-GPU launcher's HostComm: every rank is a process that mpirun or srun started, and the
// NCCL unique id, barriers and gathers travel over MPI. Built only where MPI is found; elsewhere
// instance() explains what is missing.
#include <fmt/format.h>

#include <cstdlib>
#include <iterator>
#include <list>
#include <utility>

#include "real/host_comm.h"

#if defined(RANKLAB_HAVE_MPI)
#include <mpi.h>
#endif

namespace ranklab {

#if defined(RANKLAB_HAVE_MPI)

bool mpi_available() {
  return true;
}

namespace {

bool g_failed = false;
bool g_we_initialised = false;

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw BackendError(fmt::format("{} failed: {}", call, text));
}

// At exit: a failed process ends the whole job, so the others do not wait on it; a finished one leaves MPI.
void finish_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || !g_we_initialised) return;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (g_failed && size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Finalize();
}

}  // namespace

struct MpiHostComm::Impl {
  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm messages = MPI_COMM_NULL;  // send and poll: apart from the collectives' traffic
  std::map<int, MPI_Comm> groups;     // MPI_COMM_NULL on ranks outside the group
  // Messages on their way out, each with the request that sends it.
  std::list<std::pair<std::string, MPI_Request>> outgoing;
  void retire_sent() {
    for (auto it = outgoing.begin(); it != outgoing.end();) {
      int done = 0;
      check_mpi(MPI_Test(&it->second, &done, MPI_STATUS_IGNORE), "MPI_Test");
      it = done ? outgoing.erase(it) : std::next(it);
    }
  }
};

MpiHostComm& MpiHostComm::instance() {
  static MpiHostComm comm;
  return comm;
}

void MpiHostComm::mark_failed() {
  g_failed = true;
}

MpiHostComm::MpiHostComm() : impl_(std::make_shared<Impl>()) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    // Only the rank's own thread calls MPI, one call at a time.
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    g_we_initialised = true;
    std::atexit(finish_mpi);
  }
  // A duplicate keeps our traffic apart from anything else in the process that uses MPI.
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->world), "MPI_Comm_dup");
  MPI_Comm_rank(impl_->world, &rank_);
  MPI_Comm_size(impl_->world, &size_);
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(impl_->world, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  MPI_Comm_rank(node, &local_rank_);
  MPI_Comm_size(node, &local_size_);
  MPI_Comm_free(&node);
  check_mpi(MPI_Comm_dup(impl_->world, &impl_->messages), "MPI_Comm_dup");
  host_ = host_name();
}

void MpiHostComm::send(int to, const std::string& bytes) {
  impl_->retire_sent();
  impl_->outgoing.emplace_back(bytes, MPI_REQUEST_NULL);
  auto& [copy, request] = impl_->outgoing.back();
  check_mpi(MPI_Isend(copy.data(), static_cast<int>(copy.size()), MPI_BYTE, to, 0, impl_->messages, &request),
            "MPI_Isend");
}

std::optional<std::pair<int, std::string>> MpiHostComm::poll() {
  impl_->retire_sent();
  int arrived = 0;
  MPI_Status status;
  check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, 0, impl_->messages, &arrived, &status), "MPI_Iprobe");
  if (!arrived) return std::nullopt;
  int count = 0;
  check_mpi(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count");
  std::string bytes(static_cast<std::size_t>(count), '\0');
  check_mpi(MPI_Recv(bytes.data(), count, MPI_BYTE, status.MPI_SOURCE, 0, impl_->messages, MPI_STATUS_IGNORE),
            "MPI_Recv");
  return std::make_pair(status.MPI_SOURCE, std::move(bytes));
}

void MpiHostComm::flush() {
  for (auto& [bytes, request] : impl_->outgoing) check_mpi(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
  impl_->outgoing.clear();
}

void MpiHostComm::add_group(int group_id, const std::vector<int>& ranks) {
  int index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) index = static_cast<int>(i);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(impl_->world, index >= 0 ? 0 : MPI_UNDEFINED, index, &comm), "MPI_Comm_split");
  auto it = impl_->groups.find(group_id);
  if (it != impl_->groups.end() && it->second != MPI_COMM_NULL) MPI_Comm_free(&it->second);
  impl_->groups[group_id] = comm;
}

void MpiHostComm::clear_groups() {
  for (auto& [id, comm] : impl_->groups) {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  impl_->groups.clear();
}

void MpiHostComm::barrier(int group_id) {
  MPI_Comm comm = impl_->world;
  if (group_id != 0) {
    auto it = impl_->groups.find(group_id);
    if (it == impl_->groups.end() || it->second == MPI_COMM_NULL) {
      throw UsageError(
          fmt::format("rank {}: barrier on group {}, which this rank is not a member of", rank_, group_id));
    }
    comm = it->second;
  }
  check_mpi(MPI_Barrier(comm), "MPI_Barrier");
}

void MpiHostComm::broadcast(std::string& bytes) {
  long long size = static_cast<long long>(bytes.size());
  check_mpi(MPI_Bcast(&size, 1, MPI_LONG_LONG, 0, impl_->world), "MPI_Bcast");
  bytes.resize(static_cast<size_t>(size));
  check_mpi(MPI_Bcast(bytes.data(), static_cast<int>(size), MPI_BYTE, 0, impl_->world), "MPI_Bcast");
}

namespace {
// Offsets of each rank's piece in a concatenation of `sizes`.
std::vector<int> displacements(const std::vector<int>& sizes) {
  std::vector<int> d(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) d[i] = d[i - 1] + sizes[i - 1];
  return d;
}

std::vector<std::string> split(const std::string& all, const std::vector<int>& sizes) {
  std::vector<std::string> parts;
  size_t at = 0;
  for (int s : sizes) {
    parts.push_back(all.substr(at, static_cast<size_t>(s)));
    at += static_cast<size_t>(s);
  }
  return parts;
}
}  // namespace

std::vector<std::string> MpiHostComm::gather(const std::string& mine) {
  int size = static_cast<int>(mine.size());
  std::vector<int> sizes(rank_ == 0 ? size_ : 0);
  check_mpi(MPI_Gather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, impl_->world), "MPI_Gather");
  std::vector<int> offsets = displacements(sizes);
  std::string all;
  if (rank_ == 0) all.resize(static_cast<size_t>(offsets.empty() ? 0 : offsets.back() + sizes.back()));
  check_mpi(MPI_Gatherv(mine.data(), size, MPI_BYTE, all.data(), sizes.data(), offsets.data(), MPI_BYTE, 0,
                        impl_->world),
            "MPI_Gatherv");
  if (rank_ != 0) return {};
  return split(all, sizes);
}

std::vector<std::string> MpiHostComm::all_gather(const std::string& mine) {
  int size = static_cast<int>(mine.size());
  std::vector<int> sizes(size_);
  check_mpi(MPI_Allgather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, impl_->world), "MPI_Allgather");
  std::vector<int> offsets = displacements(sizes);
  std::string all(static_cast<size_t>(offsets.back() + sizes.back()), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), size, MPI_BYTE, all.data(), sizes.data(), offsets.data(), MPI_BYTE,
                           impl_->world),
            "MPI_Allgatherv");
  return split(all, sizes);
}

#else  // no MPI in this build

bool mpi_available() {
  return false;
}

struct MpiHostComm::Impl {};

MpiHostComm& MpiHostComm::instance() {
  throw BackendError(
      "this process was started by mpirun or srun, but ranklab was built without MPI: install an MPI "
      "(libopenmpi-dev on Debian and Ubuntu) and build again");
}
void MpiHostComm::mark_failed() {}
MpiHostComm::MpiHostComm() {}
void MpiHostComm::add_group(int, const std::vector<int>&) {}
void MpiHostComm::clear_groups() {}
void MpiHostComm::send(int, const std::string&) {}
std::optional<std::pair<int, std::string>> MpiHostComm::poll() {
  return std::nullopt;
}
void MpiHostComm::flush() {}
void MpiHostComm::barrier(int) {}
void MpiHostComm::broadcast(std::string&) {}
std::vector<std::string> MpiHostComm::gather(const std::string&) {
  return {};
}
std::vector<std::string> MpiHostComm::all_gather(const std::string&) {
  return {};
}

#endif

}  // namespace ranklab
