#include "sim/operations.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "common/errors.h"
#include "sim/symmetry.h"

namespace ranklab::sim {

std::string CommOpState::label() const {
  if (op == CommOp::Send)
    return fmt::format("send/recv #{} from rank {} to rank {}", seq, ranks[0], ranks[1]);
  const CommMember* lead = nullptr;
  for (const CommMember& m : members) {
    if (m.arrived && (lead == nullptr || m.rank == first_arrived)) lead = &m;
  }
  const std::string group = lead ? lead->call.group.str() : fmt::format("group {}", group_id);
  return fmt::format("collective #{} on {} ({})", seq, group, comm_op_name(op));
}

CommMember& CommOpState::member_of(int global_rank) {
  // World collectives list every rank in order, so the member of rank r is member r.
  if (global_rank >= 0 && global_rank < static_cast<int>(members.size()) &&
      members[global_rank].rank == global_rank) {
    return members[global_rank];
  }
  for (CommMember& m : members) {
    if (m.rank == global_rank) return m;
  }
  throw UsageError(fmt::format("rank {} is not a member of {}", global_rank, label()));
}

Operations::Operations(int world_size) : calls_(world_size) {
  groups_.emplace_back(world_size);  // group 0 is the world
  for (int r = 0; r < world_size; ++r) groups_[0][r] = r;
  one_runs_.push_back(0);
}

// ---- groups ----------------------------------------------------------------------------------------

const std::vector<int>& Operations::members(const Group& group) const {
  const int id = group.id();
  if (id < 0 || id >= static_cast<int>(groups_.size())) {
    throw UsageError(fmt::format("{} was not made by new_group in this run", group.str()));
  }
  // A Group built by hand (not returned by new_group) can carry an id this run made for other ranks.
  if (!group.is_world() && group.size(world_size()) != static_cast<int>(groups_[id].size())) {
    throw UsageError(fmt::format("{} was not made by new_group in this run", group.str()));
  }
  return groups_[id];
}

void Operations::check_group(int rank, const Group& group, const char* op) const {
  const int id = group.id();
  const bool known = id >= 0 && id < static_cast<int>(groups_.size());
  if (known && (group.is_world() || group.lists(groups_[id]))) return;
  throw UsageError(fmt::format(
      "rank {}: {}: {} was not made by new_group in this run{}; use the Group new_group returns", rank, op,
      group.str(),
      known ? fmt::format(" (group {} of this run is {{{}}})", id, fmt::join(groups_[id], ", ")) : ""));
}

Group Operations::new_group(int rank, const std::vector<int>& ranks, const Symmetry& symmetry) {
  if (ranks.empty()) throw UsageError(fmt::format("rank {}: new_group: the group has no ranks", rank));
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= world_size()) {
      throw UsageError(fmt::format("rank {}: new_group({}): rank {} is outside the world of {}", rank,
                                   fmt::join(ranks, ", "), r, world_size()));
    }
    if (!seen.insert(r).second) {
      throw UsageError(
          fmt::format("rank {}: new_group({}): rank {} appears twice", rank, fmt::join(ranks, ", "), r));
    }
  }
  const int id = ++calls_[rank].groups_created;
  if (id < static_cast<int>(groups_.size())) {
    if (groups_[id] != ranks) {
      throw MismatchError(fmt::format(
          "ranks disagree on new_group call #{}: an earlier rank created {{{}}}, rank {} asks for {{{}}}; "
          "every rank must call new_group with the same ranks in the same order",
          id, fmt::join(groups_[id], ", "), rank, fmt::join(ranks, ", ")));
    }
  } else {
    symmetry.check_group(ranks);
    groups_.push_back(ranks);
    one_runs_.push_back(std::count_if(ranks.begin(), ranks.end(), [&](int r) { return symmetry.runs(r); }) ==
                        1);
  }
  return Group(id, ranks);
}

// ---- matching and agreement ----------------------------------------------------------------------

namespace {

// What every member of a collective must agree on: the operation, the element count NCCL would be
// given, the reduce op and root where they matter, and whether the tensors hold numbers. Compared field by
// field: every member of every collective is checked, and formatting it would cost two strings each.
struct Signature {
  CommOp op;
  bool uneven;
  std::int64_t numel;  // uneven all_to_all: the elements of a row (the row counts are checked pair by pair)
  DType dtype;
  int reduce;  // -1 where the op does not reduce
  int root;    // -1 where the op has no root
  bool phantom;
  bool operator==(const Signature&) const = default;
};

Signature signature(const CommCall& c) {
  const Tensor& t =
      (c.op == CommOp::Scatter || c.op == CommOp::Recv || c.op == CommOp::ReduceScatter) ? c.output : c.input;
  Signature s{c.op, c.uneven(), c.uneven() ? t.shape().with_dim(0, 1).numel() : t.numel(), t.dtype(), -1,
              -1,   t.phantom()};
  if (c.op == CommOp::AllReduce || c.op == CommOp::Reduce || c.op == CommOp::ReduceScatter) {
    s.reduce = static_cast<int>(c.reduce);
  }
  if (c.op == CommOp::Broadcast || c.op == CommOp::Reduce || c.op == CommOp::Scatter ||
      c.op == CommOp::Gather) {
    s.root = c.peer;
  }
  return s;
}
}  // namespace

void Operations::check_agreement(CommOpState& op, int arriving_rank) const {
  // Every member is compared with the first one to arrive.
  const CommMember& mine = op.member_of(arriving_rank);
  if (op.first_arrived < 0) {
    op.first_arrived = arriving_rank;
    return;
  }
  if (signature(op.member_of(op.first_arrived).call) == signature(mine.call)) return;
  std::string msg = fmt::format("ranks disagree on {}:\n", op.label());
  for (const CommMember& m : op.members) {
    msg += m.arrived ? fmt::format("  rank {}: {}\n", m.rank, m.call.describe())
                     : fmt::format("  rank {}: has not called it yet\n", m.rank);
  }
  throw MismatchError(msg);
}

void Operations::check_splits_agree(const CommOpState& op, int arriving_rank) const {
  // What i sends to j is what j expects from i, for every pair that has both arrived.
  const int n = static_cast<int>(op.members.size());
  const int me =
      static_cast<int>(std::find(op.ranks.begin(), op.ranks.end(), arriving_rank) - op.ranks.begin());
  const CommCall& mine = op.members[me].call;
  for (int j = 0; j < n; ++j) {
    const CommMember& other = op.members[j];
    if (!other.arrived) continue;
    const CommCall& theirs = other.call;
    for (const auto& [src, dst, sent, expected] :
         {std::tuple{arriving_rank, other.rank, mine.input_splits[j], theirs.output_splits[me]},
          std::tuple{other.rank, arriving_rank, theirs.input_splits[me], mine.output_splits[j]}}) {
      if (sent == expected) continue;
      throw MismatchError(fmt::format(
          "ranks disagree on {}: rank {} sends {} rows to rank {}, but rank {} expects {} rows from rank {} "
          "(in_splits of each member must match out_splits of the receiver)\n  rank {}: {}\n  rank {}: {}",
          op.label(), src, sent, dst, dst, expected, src, arriving_rank, mine.describe(), other.rank,
          theirs.describe()));
    }
  }
}

std::pair<int, std::uint64_t> Operations::next_collective(int rank, const Group& group) const {
  const auto& seqs = calls_[rank].collective_seq;
  const auto seq = seqs.find(group.id());
  return {group.id(), seq == seqs.end() ? 0 : seq->second};
}

std::shared_ptr<CommOpState> Operations::collective_op(int rank, const CommCall& call) {
  const auto key = next_collective(rank, call.group);
  const auto [gid, seq] = key;
  calls_[rank].collective_seq[gid] = seq + 1;
  if (!one_runs_[gid]) {
    auto it = open_collectives_.find(key);
    if (it != open_collectives_.end()) return it->second;
  }
  auto op = std::make_shared<CommOpState>();
  op->op = call.op;
  op->group_id = gid;
  op->seq = seq;
  op->ranks = members(call.group);
  op->members.resize(op->ranks.size());
  for (size_t i = 0; i < op->ranks.size(); ++i) op->members[i].rank = op->ranks[i];
  if (!one_runs_[gid]) open_collectives_.emplace(key, op);
  return op;
}

std::shared_ptr<CommOpState> Operations::p2p_op(int rank, const CommCall& call) {
  const bool sending = call.op == CommOp::Send;
  const int src = sending ? rank : call.peer, dst = sending ? call.peer : rank;
  auto& queue = unmatched_p2p_[{src, dst}];
  // The k-th send from src to dst pairs with the k-th receive at dst from src.
  if (!queue.empty() && queue.front()->members[sending ? 0 : 1].arrived == false) {
    auto op = queue.front();
    queue.erase(queue.begin());
    return op;
  }
  const std::uint64_t seq = p2p_created_[{src, dst}]++;
  auto op = std::make_shared<CommOpState>();
  op->op = CommOp::Send;
  op->seq = seq;
  op->ranks = {src, dst};
  op->members.resize(2);
  op->members[0].rank = src;
  op->members[1].rank = dst;
  queue.push_back(op);
  return op;
}

std::shared_ptr<CommOpState> Operations::join(int rank, const CommCall& call) {
  const bool p2p = call.op == CommOp::Send || call.op == CommOp::Recv;
  std::shared_ptr<CommOpState> op = p2p ? p2p_op(rank, call) : collective_op(rank, call);
  CommMember& m = op->member_of(rank);
  m.arrived = true;
  m.call = call;
  ++op->arrived;
  return op;
}

int Operations::arrived_at_next(int rank, const Group& group) const {
  const auto open = open_collectives_.find(next_collective(rank, group));
  return open == open_collectives_.end() ? 0 : open->second->arrived;
}

void Operations::agree(CommOpState& op, int rank) {
  if (op.op == CommOp::Send) {
    // Sender and receiver must agree on the size.
    const CommMember& other = op.members[rank == op.ranks[0] ? 1 : 0];
    if (other.arrived) {
      const Tensor& sent = op.members[0].call.input;
      const Tensor& into = op.members[1].call.output;
      if (sent.numel() != into.numel() || sent.phantom() != into.phantom()) {
        throw MismatchError(fmt::format("{}: rank {} sends {} but rank {} receives into {}", op.label(),
                                        op.ranks[0], sent.str(), op.ranks[1], into.str()));
      }
    }
    return;
  }
  check_agreement(op, rank);
  const CommCall& call = op.member_of(rank).call;
  if (call.op == CommOp::AllToAll && call.uneven()) check_splits_agree(op, rank);
  if (op.all_arrived() && !one_runs_[op.group_id]) open_collectives_.erase({op.group_id, op.seq});
}

// ---- order and completion --------------------------------------------------------------------------

void Operations::depend(const std::shared_ptr<CommOpState>& op, CommMember& m,
                        const std::shared_ptr<CommOpState>& dep) {
  if (!dep || dep == op || dep->finished) return;
  m.deps.push_back(dep);
  if (dep->dependents.empty() || dep->dependents.back().raw != op.get() ||
      dep->dependents.back().op.expired()) {
    dep->dependents.push_back({op, op.get(), 0});
  }
  ++dep->dependents.back().edges;
  ++op->unfinished_deps;
}

std::string Operations::why_pending(const CommOpState& op) {
  std::vector<std::string> reasons;
  for (const CommMember& m : op.members) {
    if (!m.arrived) {
      reasons.push_back(fmt::format("rank {} has not called it", m.rank));
      continue;
    }
    for (const auto& dep : m.deps) {
      if (!dep->finished) {
        reasons.push_back(fmt::format("rank {} must first finish {}", m.rank, dep->label()));
        break;
      }
    }
    if (std::isnan(m.issue_ready_us)) {
      reasons.push_back(fmt::format("rank {} must first time the kernels before it", m.rank));
    }
  }
  if (reasons.empty()) return "ready to run";
  return fmt::format("{}", fmt::join(reasons, "; "));
}

std::vector<std::shared_ptr<CommOpState>> Operations::complete(
    const std::vector<EndedTransfer>& engine_ended) {
  // The engine hands out transfers, each owned by the operation (or image) that scheduled it; an operation
  // ends when its own and (in a symmetric run) all its images' have ended, at the latest of them.
  std::vector<std::shared_ptr<CommOpState>> ended;
  ended.reserve(engine_ended.size());
  for (const EndedTransfer& e : engine_ended) {
    CommOpState& transfer = *static_cast<CommOpState*>(e.owner.get());
    transfer.end_us = e.end_us;
    CommOpState& op = transfer.image ? *transfer.image_of : transfer;
    op.end_us = std::max(op.end_us, transfer.end_us);
    if (--op.transfers_left > 0) continue;
    op.finished = true;
    ended.push_back(transfer.image ? transfer.image_of : std::static_pointer_cast<CommOpState>(e.owner));
  }
  for (const auto& op : ended) {
    for (const auto& dep : op->dependents) {
      if (auto d = dep.op.lock()) d->unfinished_deps -= dep.edges;
    }
  }
  return ended;
}

}  // namespace ranklab::sim
