// One rank's NCCL communicators: the world, and one per sub-group (Rank::new_group), made by splitting
// the world. All are non-blocking (ncclConfig_t::blocking = 0): a call that would wait for other ranks
// (creating, splitting, connecting peers on first use) returns ncclInProgress and the watchdog polls it,
// so a rank whose peers never arrive ends with an error rather than a hang.
#pragma once

#include <nccl.h>

#include <map>
#include <string>
#include <vector>

#include "real/watchdog.h"

namespace ranklab {

class Communicators {
 public:
  Communicators(int world_rank, int world_size, Watchdog* watchdog);
  // Aborts whatever was not finalised.
  ~Communicators();
  Communicators(const Communicators&) = delete;
  Communicators& operator=(const Communicators&) = delete;

  // Every rank calls this with rank 0's id; returns when the world communicator is ready.
  void init_world(const ncclUniqueId& id);
  // Every rank of the world calls this for each new group, in the same order; members get a communicator
  // whose ranks follow the order of `ranks`.
  void split(int group_id, const std::vector<int>& ranks);

  ncclComm_t world() const { return world_; }
  // The group's communicator, or null on a rank outside the group.
  ncclComm_t group(int group_id) const;
  std::vector<ncclComm_t> all() const;

  // The end of a good run: flushes and frees every communicator (every rank must call it).
  void finalize();
  // The end of a failed run: ends the communicators' kernels at once (ncclCommAbort).
  void abort() noexcept;

 private:
  int world_rank_;
  int world_size_;
  Watchdog* watchdog_;
  ncclComm_t world_ = nullptr;
  std::map<int, ncclComm_t> groups_;
};

}  // namespace ranklab
