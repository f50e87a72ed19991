// Operations: how the members' calls become communication operations, and when an operation may run.
//
//   groups       new_group's groups, the same on every rank (id 0 is the world).
//   matching     a collective call joins its group's next operation: the key is the group and the rank's
//                count of calls on it, so the n-th call of every member meets in one CommOpState. The k-th
//                send from src to dst pairs with the k-th receive at dst from src.
//   agreement    every member's call is compared with the first one's (the operation, the element count,
//                the dtype, the reduce op, the root); an uneven all_to_all's splits pair by pair; a send's
//                size with its receive's. A mismatch is a MismatchError listing the calls.
//   order        an operation runs once every member has arrived, every member's dependencies have
//                finished (the previous operation on its stream, what its compute stream waited for) and
//                every member's ready time is known. Each operation counts its unfinished dependencies and is
//                told once per dependency that finishes, so running a world's operations costs the number of
//                dependencies, not members x dependencies.
//   completion   the transfer engine's ended transfers, turned into the operations that ended (a symmetric
//                run's operation ends with the last of its images), and what waited for them.
//
// What an operation does when it runs (its numerics, its plan on the network) and what its end means for
// the ranks (their streams, their wake-up, the report) is SimWorld's.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/rank.h"
#include "sim/comm_op.h"
#include "sim/net/transfer_engine.h"

namespace ranklab::sim {

class Symmetry;

class Operations {
 public:
  explicit Operations(int world_size);

  int world_size() const { return static_cast<int>(groups_[0].size()); }
  const std::vector<int>& world() const { return groups_[0]; }

  // ---- groups
  // `rank`'s next new_group call: the group every rank's call of that number makes, checked against the
  // earlier ranks' and, the first time, against `symmetry`.
  Group new_group(int rank, const std::vector<int>& ranks, const Symmetry& symmetry);
  // The members of `group` (global ranks); UsageError if the group is unknown.
  const std::vector<int>& members(const Group& group) const;
  // UsageError naming `rank` and `op` unless `group` is the world or exactly a group new_group made.
  void check_group(int rank, const Group& group, const char* op) const;

  // ---- matching and agreement
  // The operation `rank`'s call joins; its member is marked arrived with the call.
  std::shared_ptr<CommOpState> join(int rank, const CommCall& call);
  // Members arrived at the collective `rank`'s next call on `group` would join.
  int arrived_at_next(int rank, const Group& group) const;
  // Checks `rank`'s call against those of the members already there (after the members it stands for in a
  // symmetric run have joined too); a collective every member has joined is no longer open to calls.
  void agree(CommOpState& op, int rank);

  // ---- order
  // Member `m` of `op` cannot start before `dep` ends (nothing if `dep` is null, `op` itself or finished).
  static void depend(const std::shared_ptr<CommOpState>& op, CommMember& m,
                     const std::shared_ptr<CommOpState>& dep);
  // Whether `op` may run now: not run yet, every member arrived and ready, no dependency left.
  static bool runnable(const CommOpState& op) {
    return !op.executed && op.all_arrived() && op.unfinished_deps == 0 && op.unready == 0;
  }
  // Why `op` has not run yet: the members that have not called it, or what they still wait for.
  static std::string why_pending(const CommOpState& op);

  // ---- completion
  // The operations `ended` completes, marked finished with their end times; every operation that depended
  // on them has one unfinished dependency less per edge (all counted before any of them runs, so what
  // runs, and in what order, is as if each looked at all its dependencies).
  static std::vector<std::shared_ptr<CommOpState>> complete(const std::vector<EndedTransfer>& ended);
  // Calls run(d) for each operation d that waited for `op`, once: an operation that has ended tells its
  // dependents no more.
  template <typename F>
  static void release_dependents(CommOpState& op, F&& run) {
    std::vector<CommOpState::Dependent> dependents;
    dependents.swap(op.dependents);
    for (const auto& dep : dependents) {
      if (auto d = dep.op.lock()) run(d);
    }
  }

 private:
  std::shared_ptr<CommOpState> collective_op(int rank, const CommCall& call);
  std::shared_ptr<CommOpState> p2p_op(int rank, const CommCall& call);
  // The key of the collective `rank`'s next call on `group` joins: the group and the call's number in it.
  std::pair<int, std::uint64_t> next_collective(int rank, const Group& group) const;
  void check_agreement(CommOpState& op, int arriving_rank) const;
  // An uneven all_to_all: the arriving member's splits against those of every member already there.
  void check_splits_agree(const CommOpState& op, int arriving_rank) const;

  struct RankCalls {
    std::map<int, std::uint64_t> collective_seq;  // per group id: the number of its next call
    int groups_created = 0;
  };
  std::vector<RankCalls> calls_;          // per rank
  std::vector<std::vector<int>> groups_;  // id -> members; id 0 is the world
  // id -> whether one member alone runs and the others mirror it (a symmetric run's tensor-parallel group):
  // its collectives are complete once that member posts, and no other member looks them up.
  std::vector<char> one_runs_;
  std::map<std::pair<int, std::uint64_t>, std::shared_ptr<CommOpState>> open_collectives_;
  std::map<std::pair<int, int>, std::vector<std::shared_ptr<CommOpState>>> unmatched_p2p_;
  std::map<std::pair<int, int>, std::uint64_t> p2p_created_;  // per (src, dst)
};

}  // namespace ranklab::sim
