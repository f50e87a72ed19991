// CommOpState: one communication operation as the simulator tracks it, from the first member's call
// to its execution (numerics done, start and end times known).
#pragma once

#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/rank.h"
#include "common/report.h"

namespace ranklab::sim {

struct CommOpState;

// What one member brought to the operation.
struct CommMember {
  int rank = -1;  // global rank
  bool arrived = false;
  CommCall call;
  double issue_ready_us = 0;  // host launch time and compute-stream time at issue
  // Operations that must finish before this member's part can start: the previous operation on the
  // same stream, and synchronous operations the compute stream was still waiting for at issue. Seldom more
  // than two, kept inside the member: a list of their own for every member of every operation would be as
  // many allocations, and freeing thousands at once when a large collective ends is what slows malloc.
  boost::container::small_vector<std::shared_ptr<CommOpState>, 2> deps;
  bool waited = false;         // for async calls: wait() has been called
  double ready_us = 0;         // when this member was ready (set at execution)
  std::uint64_t post_seq = 0;  // its place among its rank's posts (RankState::unfinished_posts)
};

struct CommOpState {
  CommOp op = CommOp::AllReduce;
  int group_id = 0;  // collectives: the group and the call's number in it
  std::uint64_t seq = 0;
  std::vector<int> ranks;           // global ranks in group order (src, dst for point-to-point)
  std::vector<CommMember> members;  // indexed like `ranks`
  int arrived = 0;
  int first_arrived = -1;  // the rank every later member is checked against
  // In a symmetric run: the traffic of another class's group, run beside an operation for its effect on
  // the links alone (no members, no numerics, nothing waits for it).
  bool image = false;
  // An image's operation, which ends for its members only when its images have ended too: the mirrors
  // in them are the same ranks' replicas, and the slowest of a class decides when the class goes on.
  std::shared_ptr<CommOpState> image_of;
  // Transfers not ended yet: its own and its images'. end_us is the latest that has ended.
  int transfers_left = 1;
  bool executed = false;  // started: numerics done, start_us known
  bool finished = false;  // ended: end_us is final
  SpanName algorithm;     // what the network model chose, "ring/simple"
  int channels = 0;       // NCCL's thread blocks on each member's GPU, one SM each (CommPlan::channels)
  // HBM traffic the operation puts on each member's GPU while it runs, bytes per microsecond (set at
  // execution; SimWorld::launch_kernel).
  double hbm_bytes_per_us = 0;
  double start_us = 0;
  double end_us = 0;
  // Operations whose members depend on this one, once per dependency; each is told once when this one
  // finishes, so running everything costs the number of dependencies, not members x dependencies.
  // Edges from one operation come one after another as its members post, so they are kept as one entry
  // with a count.
  struct Dependent {
    std::weak_ptr<CommOpState> op;
    const CommOpState* raw = nullptr;  // to recognise the same operation without locking `op`
    int edges = 0;
  };
  std::vector<Dependent> dependents;
  int unfinished_deps = 0;  // the members' dependencies (counted per member) that have not finished
  // Members posted while kernels before them were still to be timed: their ready time waits for those
  // kernels' ends (RankState::deferred_posts), and the operation cannot start before it is known.
  int unready = 0;

  // "collective #3 on world (all_reduce)", for messages (formatted only when one is needed).
  std::string label() const;
  CommMember& member_of(int global_rank);
  const CommMember& member_of(int global_rank) const {
    return const_cast<CommOpState*>(this)->member_of(global_rank);
  }
  bool all_arrived() const { return arrived == static_cast<int>(members.size()); }
};

}  // namespace ranklab::sim
