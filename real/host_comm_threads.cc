// The thread-per-GPU launcher's HostComm: every rank is a thread of this process, so the NCCL unique id,
// barriers and gathers go through shared memory under one mutex.
#include <fmt/format.h>
#include <unistd.h>

#include "real/host_comm.h"

namespace ranklab {

namespace {
// Gathers and broadcasts rendezvous on their own group, so that a lesson's barrier() never pairs up with
// the launcher's exchanges.
constexpr int kExchangeGroup = -1;
}  // namespace

ThreadHostWorld::ThreadHostWorld(int size) : size_(size), slots_(size) {
  groups_[0].members = size;
  groups_[kExchangeGroup].members = size;
}

void ThreadHostWorld::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = true;
  cv_.notify_all();
}

void ThreadHostWorld::arrive(int group_id, const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted_) throw RunAborted(fmt::format("{} abandoned: another rank failed", what));
  auto it = groups_.find(group_id);
  if (it == groups_.end()) {
    throw UsageError(fmt::format("{} on group {}, which no rank created", what, group_id));
  }
  Rendezvous& g = it->second;
  const std::uint64_t generation = g.generation;
  if (++g.arrived == g.members) {
    g.arrived = 0;
    ++g.generation;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return g.generation != generation || aborted_; });
  if (g.generation == generation) throw RunAborted(fmt::format("{} abandoned: another rank failed", what));
}

void ThreadHostComm::add_group(int group_id, const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(world_->mutex_);
  // Every rank calls this; the first one creates the rendezvous.
  auto [it, created] = world_->groups_.try_emplace(group_id);
  if (created) it->second.members = static_cast<int>(ranks.size());
}

void ThreadHostComm::barrier(int group_id) {
  world_->arrive(group_id, "barrier");
}

void ThreadHostComm::broadcast(std::string& bytes) {
  if (rank_ == 0) {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    world_->slots_[0] = bytes;
  }
  world_->arrive(kExchangeGroup, "broadcast");
  if (rank_ != 0) {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    bytes = world_->slots_[0];
  }
  // Nobody may write the slots again before every rank has read them.
  world_->arrive(kExchangeGroup, "broadcast");
}

std::vector<std::string> ThreadHostComm::gather(const std::string& mine) {
  std::vector<std::string> all = all_gather(mine);
  if (rank_ != 0) all.clear();
  return all;
}

std::vector<std::string> ThreadHostComm::all_gather(const std::string& mine) {
  {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    world_->slots_[rank_] = mine;
  }
  world_->arrive(kExchangeGroup, "gather");
  std::vector<std::string> all;
  {
    std::lock_guard<std::mutex> lock(world_->mutex_);
    all = world_->slots_;
  }
  world_->arrive(kExchangeGroup, "gather");
  return all;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "this host";
  return name;
}

}  // namespace ranklab
