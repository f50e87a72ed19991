#include "real/nccl_comm.h"

#include "real/cuda_check.h"

namespace ranklab {

namespace {
// `name` must outlive the communicator's creation, which goes on after the call returns: a literal.
ncclConfig_t non_blocking_config(const char* name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name;
  return config;
}
}  // namespace

Communicators::Communicators(int world_rank, int world_size, Watchdog* watchdog)
    : world_rank_(world_rank), world_size_(world_size), watchdog_(watchdog) {}

Communicators::~Communicators() {
  abort();
}

void Communicators::init_world(const ncclUniqueId& id) {
  ncclConfig_t config = non_blocking_config("ranklab world");
  ncclComm_t comm = nullptr;
  const ncclResult_t r =
      RANKLAB_NCCL(ncclCommInitRankConfig(&comm, world_size_, id, world_rank_, &config), comm);
  world_ = comm;
  if (r == ncclInProgress) {
    watchdog_->settle(world_,
                      "ncclCommInitRankConfig (creating the world communicator; every rank must join)");
  }
  watchdog_->watch(all());
}

void Communicators::split(int group_id, const std::vector<int>& ranks) {
  int key = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == world_rank_) key = static_cast<int>(i);
  }
  ncclConfig_t config = non_blocking_config("ranklab group");
  ncclComm_t comm = nullptr;
  // The colour only separates members from the rest: each split makes a single new group.
  const ncclResult_t r =
      RANKLAB_NCCL(ncclCommSplit(world_, key >= 0 ? 0 : NCCL_SPLIT_NOCOLOR, key, &comm, &config), world_);
  // A non-blocking split reports its progress on the parent; the child appears when it is done.
  if (r == ncclInProgress) {
    watchdog_->settle(world_,
                      "ncclCommSplit (creating a group; every rank of the world must call new_group)");
  }
  if (comm != nullptr) watchdog_->settle(comm, "ncclCommSplit (creating a group)");
  groups_[group_id] = comm;
  watchdog_->watch(all());
}

ncclComm_t Communicators::group(int group_id) const {
  auto it = groups_.find(group_id);
  return it == groups_.end() ? nullptr : it->second;
}

std::vector<ncclComm_t> Communicators::all() const {
  std::vector<ncclComm_t> comms;
  if (world_) comms.push_back(world_);
  for (const auto& [id, comm] : groups_) {
    if (comm) comms.push_back(comm);
  }
  return comms;
}

void Communicators::finalize() {
  // Children before the world they were split from.
  std::vector<ncclComm_t> order;
  for (const auto& [id, comm] : groups_) {
    if (comm) order.push_back(comm);
  }
  if (world_) order.push_back(world_);
  for (ncclComm_t comm : order) {
    if (RANKLAB_NCCL(ncclCommFinalize(comm), comm) == ncclInProgress) {
      watchdog_->settle(comm, "ncclCommFinalize (every rank must finish the run)");
    }
  }
  watchdog_->watch({});
  for (ncclComm_t comm : order) RANKLAB_NCCL(ncclCommDestroy(comm), comm);
  groups_.clear();
  world_ = nullptr;
}

void Communicators::abort() noexcept {
  for (auto& [id, comm] : groups_) {
    if (comm) ncclCommAbort(comm);
  }
  groups_.clear();
  if (world_) ncclCommAbort(world_);
  world_ = nullptr;
  if (watchdog_) watchdog_->watch({});
}

}  // namespace ranklab
