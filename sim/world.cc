#include "sim/world.h"

#include <fmt/format.h>

#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

#include "common/errors.h"
#include "common/progress.h"
#include "sim/rank_faults.h"
#include "sim/reduce.h"
#include "sim/run_topology.h"
#include "sim/scheduler.h"

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

SimWorld::SimWorld(const SimConfig& config, int world_size)
    : config_(config),
      compute_(config.profile.gpu),
      network_(make_network_model(config)),
      symmetry_(config.symmetry, world_size),
      engine_(network_->topology()),
      contention_(config_.profile.gpu, network_->topology(), engine_),
      progress_("simulating", 0, config.progress ? stderr : nullptr) {
  // Sends run on the world's communicator: only its GPUs relay them (PXN).
  network_->set_world_ranks(world_size);
  ranks_.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    auto s = std::make_unique<RankState>();
    s->memory = std::make_shared<MemoryAccount>();
    s->memory->rank = r;
    s->memory->capacity = config.profile.hbm_capacity_bytes();
    ranks_.push_back(std::move(s));
  }
  groups_.emplace_back(world_size);  // group 0 is the world
  for (int r = 0; r < world_size; ++r) groups_[0][r] = r;
  for (int r = 0; r < world_size; ++r) {
    // Mirrors never run: they are neither live nor able to block.
    if (!runs(r)) state(r).finished = true;
  }
  live_ = symmetry_.running();
  thread_ = std::this_thread::get_id();
  report_.backend = "sim";
  report_.profile = config.profile.name;
  report_.world = world_size;
}

// ---- running ranks and failing runs ----------------------------------------------------------------

void SimWorld::run_rank(int rank, const std::function<void()>& program) {
  try {
    program();
    settle_compute(rank);  // its last kernels' times
  } catch (const RunAborted&) {
    // another rank failed first; this one just unwinds
  } catch (...) {
    fail(current_error_of_rank(rank));  // the same words as the real backend's
  }
  RankState& s = state(rank);
  s.finished = true;
  --live_;
  // The others may all be waiting for transfers only the engine can finish.
  while (live_ > 0 && blocked_ == live_ && !aborted_) {
    if (!advance_when_stalled()) declare_deadlock();
  }
}

void SimWorld::fail(std::exception_ptr error) {
  if (!error_) error_ = error;
  // Once aborted, no rank blocks again (block_until checks first), so the ranks were all woken by the
  // first failure: waking them again for every rank that fails would cost the world squared.
  if (aborted_) return;
  aborted_ = true;
  wake_all();
}

void SimWorld::check_thread(int rank, const char* op) const {
  if (std::this_thread::get_id() == thread_) return;
  // Another thread cannot block or yield a fiber, and would race with the rank's own state: the run
  // cannot go on, and an exception here would only end the thread the program started.
  die(fmt::format(
      "rank {}: {} was called from a thread the rank's program started; a rank's calls must come from the "
      "thread that runs its program (the simulator runs each rank as a fiber, and a GPU stream is not "
      "shared between threads either)",
      rank, op));
}

void SimWorld::check_aborted() const {
  if (aborted_) throw RunAborted{};
}

void SimWorld::rethrow_if_failed() const {
  if (error_) std::rethrow_exception(error_);
}

void SimWorld::wake(int rank) {
  RankState& s = state(rank);
  if (!s.blocked) return;
  s.blocked = false;
  --blocked_;
  woke_ = true;
  // A rank woken before it suspended (by the engine it was advancing itself) simply does not suspend.
  if (boost::fibers::context* fiber = std::exchange(s.suspended, nullptr)) {
    boost::fibers::context::active()->schedule(fiber);
  }
}

void SimWorld::wake_all() {
  for (int r = 0; r < size(); ++r) wake(r);
}

void SimWorld::block_until(int rank, const std::function<bool()>& pred,
                           const std::function<std::string()>& what) {
  RankState& s = state(rank);
  // `what` lives as long as this call: however the call ends (a deadlock or another rank's failure throws),
  // the rank's state must not keep pointing at it.
  struct Forget {
    RankState& s;
    ~Forget() { s.waiting_for = nullptr; }
  } forget{s};
  while (!pred()) {
    check_aborted();
    s.blocked = true;
    s.waiting_for = &what;
    ++blocked_;
    VirtualTimeProps& props = boost::this_fiber::properties<VirtualTimeProps>();
    props.time_us = s.host_us;
    props.stack_hint = __builtin_frame_address(0);
    // This was the last rank that could run: only the engine's next event can wake anybody, or its reaching
    // the end of a kernel that waits to know its end (settle_compute), whichever comes first.
    while (blocked_ == live_ && !aborted_) {
      if (!advance_when_stalled()) {
        declare_deadlock();
        throw RunAborted{};
      }
    }
    if (s.blocked) {
      ++fiber_switches_;
      s.suspended = boost::fibers::context::active();
      s.suspended->suspend();  // until wake() schedules it
    }
  }
  check_aborted();
}

void SimWorld::declare_deadlock() {
  std::string msg = "deadlock: every rank is waiting and none can make progress.\n";
  for (int r = 0; r < size(); ++r) {
    if (!runs(r)) continue;
    const RankState& s = state(r);
    if (s.finished) {
      msg += fmt::format("  rank {}: finished its program\n", r);
    } else if (s.blocked && s.waiting_for) {
      msg += fmt::format("  rank {}: {}\n", r, (*s.waiting_for)());
    } else {
      msg += fmt::format("  rank {}: running\n", r);
    }
  }
  fail(std::make_exception_ptr(DeadlockError(msg)));
}

void SimWorld::wait_finished(int rank, const std::shared_ptr<CommOpState>& op, const char* by, bool folded) {
  if (op->finished) {  // the common case: no callables to build
    check_aborted();
    return;
  }
  // The callables capture at most two pointers, which std::function keeps without allocating.
  struct Wait {
    int rank;
    const CommOpState* op;
    const char* by;
    bool folded;
  } const wait{rank, op.get(), by, folded};
  struct WaitingFor {
    RankState& s;
    ~WaitingFor() { s.waiting_op = nullptr; }
  } waiting{state(rank)};
  waiting.s.waiting_op = op.get();
  block_until(
      rank, [&wait] { return wait.op->finished; },
      [this, &wait] { return describe_wait(wait.rank, *wait.op, wait.by, wait.folded); });
}

std::string SimWorld::describe_wait(int rank, const CommOpState& op, const char* by, bool folded) const {
  std::string who = by;
  if (folded) {
    // What made the compute stream wait for it.
    who += fmt::format(
        " (after {} {})",
        op.member_of(rank).call.async == Async::Yes ? "wait() on an asynchronous" : "a synchronous",
        comm_op_name(op.op));
  }
  return fmt::format("{} waits for {}: {}", who, op.label(), why_pending(op));
}

std::string SimWorld::why_pending(const CommOpState& op) const {
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

// ---- groups ----------------------------------------------------------------------------------------

const std::vector<int>& SimWorld::members(const Group& group) const {
  const int id = group.id();
  if (id < 0 || id >= static_cast<int>(groups_.size())) {
    throw UsageError(fmt::format("{} was not made by new_group in this run", group.str()));
  }
  // A Group built by hand (not returned by new_group) can carry an id this run made for other ranks.
  if (!group.is_world() && group.size(size()) != static_cast<int>(groups_[id].size())) {
    throw UsageError(fmt::format("{} was not made by new_group in this run", group.str()));
  }
  return groups_[id];
}

void SimWorld::check_group(int rank, const Group& group, const char* op) const {
  const int id = group.id();
  const bool known = id >= 0 && id < static_cast<int>(groups_.size());
  if (known && (group.is_world() || group.ranks(size()) == groups_[id])) return;
  throw UsageError(fmt::format(
      "rank {}: {}: {} was not made by new_group in this run{}; use the Group new_group returns", rank, op,
      group.str(),
      known ? fmt::format(" (group {} of this run is {{{}}})", id, fmt::join(groups_[id], ", ")) : ""));
}

Group SimWorld::new_group(int rank, const std::vector<int>& ranks) {
  check_aborted();
  if (ranks.empty()) throw UsageError(fmt::format("rank {}: new_group: the group has no ranks", rank));
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size()) {
      throw UsageError(fmt::format("rank {}: new_group({}): rank {} is outside the world of {}", rank,
                                   fmt::join(ranks, ", "), r, size()));
    }
    if (!seen.insert(r).second) {
      throw UsageError(
          fmt::format("rank {}: new_group({}): rank {} appears twice", rank, fmt::join(ranks, ", "), r));
    }
  }
  RankState& s = state(rank);
  const int id = ++s.groups_created;
  if (id < static_cast<int>(groups_.size())) {
    if (groups_[id] != ranks) {
      throw MismatchError(fmt::format(
          "ranks disagree on new_group call #{}: an earlier rank created {{{}}}, rank {} asks for {{{}}}; "
          "every rank must call new_group with the same ranks in the same order",
          id, fmt::join(groups_[id], ", "), rank, fmt::join(ranks, ", ")));
    }
  } else {
    symmetry_.check_group(ranks);
    groups_.push_back(ranks);
  }
  return Group(id, ranks);
}

// ---- posting communication -------------------------------------------------------------------------

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

int stream_of(const CommCall& c) {
  return (c.op == CommOp::Send || c.op == CommOp::Recv) ? c.peer : collective_stream(c.group.id());
}

}  // namespace

void SimWorld::check_agreement(CommOpState& op, int arriving_rank) const {
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

void SimWorld::check_splits_agree(const CommOpState& op, int arriving_rank) const {
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

std::pair<int, std::uint64_t> SimWorld::next_collective(int rank, const Group& group) const {
  const auto& seqs = ranks_[rank]->collective_seq;
  const auto seq = seqs.find(group.id());
  return {group.id(), seq == seqs.end() ? 0 : seq->second};
}

std::shared_ptr<CommOpState> SimWorld::collective_op(int rank, const CommCall& call) {
  const auto key = next_collective(rank, call.group);
  const auto [gid, seq] = key;
  state(rank).collective_seq[gid] = seq + 1;
  auto it = open_collectives_.find(key);
  if (it != open_collectives_.end()) return it->second;
  auto op = std::make_shared<CommOpState>();
  op->op = call.op;
  op->group_id = gid;
  op->seq = seq;
  op->ranks = members(call.group);
  op->members.resize(op->ranks.size());
  for (size_t i = 0; i < op->ranks.size(); ++i) op->members[i].rank = op->ranks[i];
  open_collectives_.emplace(key, op);
  return op;
}

std::shared_ptr<CommOpState> SimWorld::p2p_op(int rank, const CommCall& call) {
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

std::shared_ptr<CommOpState> SimWorld::post(int rank, const CommCall& call) {
  const bool p2p = call.op == CommOp::Send || call.op == CommOp::Recv;
  RankState& s = state(rank);
  // The operation waits for the compute stream's kernels. A collective whose kernels before it cannot be
  // timed yet is posted without their end: the rank goes on, and the member becomes ready when the world
  // times them (try_settle). Waiting here would cost every rank a fiber switch per bucket of an
  // overlapped backward pass. (Not in symmetric runs, where the post also stands for other members, nor
  // for point-to-point calls; nor when calls go in clock order, the reference the tests compare with.)
  const bool may_defer = !p2p && !symmetry_.enabled() && !config_.issue_in_clock_order;
  bool defer = false;
  double kernels_end_us = 0;
  if (!s.deferred_posts.empty() && may_defer) {
    // The world times the kernels again whenever what they overlap changes (resettle): nothing new to
    // learn here.
    defer = true;
  } else if (!s.pending_kernels.empty()) {
    defer = !try_settle(rank, kernels_end_us) && may_defer;
    if (!defer) settle_compute(rank);
  }
  std::shared_ptr<CommOpState> op = p2p ? p2p_op(rank, call) : collective_op(rank, call);

  CommMember& m = op->member_of(rank);
  m.arrived = true;
  m.call = call;
  if (defer) {
    m.issue_ready_us = std::numeric_limits<double>::quiet_NaN();
    ++op->unready;
    s.deferred_posts.push_back({op, s.kernels_timed + s.pending_kernels.size(), s.host_us});
  } else {
    m.issue_ready_us = std::max(s.host_us, s.compute_us);
  }
  const int stream_id = stream_of(call);
  StreamState& stream = s.streams[stream_id];
  auto add_dep = [&](const std::shared_ptr<CommOpState>& dep) {
    if (dep && dep != op && !dep->finished) {
      m.deps.push_back(dep);
      if (dep->dependents.empty() || dep->dependents.back().raw != op.get() ||
          dep->dependents.back().op.expired()) {
        dep->dependents.push_back({op, op.get(), 0});
      }
      ++dep->dependents.back().edges;
      ++op->unfinished_deps;
    }
  };
  if (s.p2p_group != 0) {
    if (stream.group != s.p2p_group) {
      stream.group = s.p2p_group;
      stream.before_group = stream.last;
    }
    add_dep(stream.before_group);
  } else {
    add_dep(stream.last);
  }
  // What the compute stream waits for (synchronous operations, and what wait() was called on): the NCCL
  // stream waits for the compute stream before a collective.
  for (const auto& waited : s.unfolded_waits) {
    // One on this stream ends no later than the stream's last operation before this one, which is a
    // dependency already: leaving it out changes no time, and keeps back-to-back synchronous collectives
    // from each depending on all the earlier ones.
    if (waited != stream.last && stream_of(*waited, rank) == stream_id) continue;
    add_dep(waited);
  }
  stream.last = op;
  ++op->arrived;
  // What synchronize() waits for. An operation that has finished, and that this rank need not mark as
  // waited on (it was synchronous, or wait() was called), needs nothing from it: dropping those as the list
  // doubles keeps a step that never synchronizes from holding every operation it posted.
  if (s.outstanding.size() >= s.outstanding_prune_at) {
    std::erase_if(s.outstanding, [rank](const std::shared_ptr<CommOpState>& o) {
      if (!o->finished) return false;
      const CommMember& m = o->member_of(rank);
      return m.call.async == Async::No || m.waited;
    });
    s.outstanding_prune_at = std::max<std::size_t>(64, 2 * s.outstanding.size());
  }
  s.outstanding.push_back(op);
  if (config_.sm_contention) s.beside_ops.push_back(op);
  if (symmetry_.enabled()) {
    if (p2p && !runs(call.peer)) {
      throw UsageError(fmt::format(
          "rank {}: {} with rank {}, which mirrors rank {} in this symmetric run: point-to-point traffic "
          "between classes breaks the symmetry (SimConfig::symmetry)",
          rank, comm_op_name(call.op), call.peer, representative(call.peer)));
    }
    // The members this rank stands for take part as copies of it: same call, same moment. They wait for
    // nothing of their own, so the operation starts when the representatives are ready, as it would with
    // every member running the same program.
    if (!p2p) {
      const int n = static_cast<int>(op->ranks.size());
      const bool uneven_all_to_all = call.op == CommOp::AllToAll && call.uneven();
      const int mine =
          uneven_all_to_all
              ? static_cast<int>(std::find(op->ranks.begin(), op->ranks.end(), rank) - op->ranks.begin())
              : 0;
      for (int i = 0; i < n; ++i) {  // members are indexed like ranks
        CommMember& x = op->members[i];
        if (x.arrived || symmetry_.representative(x.rank) != rank) continue;
        x.arrived = true;
        x.call = call;
        // An uneven all_to_all's pieces, as the mirror's copy of the program makes them: where they go
        // relative to its own place in the group (a ring shift sends to the next member, whichever it is).
        if (uneven_all_to_all) {
          const int shift = ((i - mine) % n + n) % n;
          auto rotate = [&](std::vector<std::int64_t>& v) {
            if (!v.empty()) std::rotate(v.rbegin(), v.rbegin() + shift, v.rend());
          };
          rotate(x.call.input_splits);
          rotate(x.call.output_splits);
        }
        x.issue_ready_us = m.issue_ready_us;
        ++op->arrived;
      }
    }
  }

  if (p2p) {
    // Sender and receiver must agree on the size.
    const CommMember& other = op->members[call.op == CommOp::Send ? 1 : 0];
    if (other.arrived) {
      const Tensor& sent = op->members[0].call.input;
      const Tensor& into = op->members[1].call.output;
      if (sent.numel() != into.numel() || sent.phantom() != into.phantom()) {
        throw MismatchError(fmt::format("{}: rank {} sends {} but rank {} receives into {}", op->label(),
                                        op->ranks[0], sent.str(), op->ranks[1], into.str()));
      }
    }
  } else {
    check_agreement(*op, rank);
    if (call.op == CommOp::AllToAll && call.uneven()) check_splits_agree(*op, rank);
    if (op->all_arrived()) open_collectives_.erase({op->group_id, op->seq});
  }
  execute_readied(op);
  // The engine must not pass the kernels this member waits for.
  if (defer && std::isnan(s.watched_end_us) && std::isfinite(kernels_end_us)) {
    watch_kernel_end(rank, kernels_end_us);
  }
  run_resettles();
  return op;
}

// ---- executing -------------------------------------------------------------------------------------

void SimWorld::try_execute(const std::shared_ptr<CommOpState>& op) {
  if (op->executed || !op->all_arrived() || op->unfinished_deps > 0 || op->unready > 0) return;
  execute(op);
}

void SimWorld::execute_readied(const std::shared_ptr<CommOpState>& op) {
  try_execute(op);
  if (op->executed || !op->all_arrived() || op->unready > 0) return;
  for (const CommMember& x : op->members) {
    if (runs(x.rank) && !std::isnan(state(x.rank).watched_end_us)) resettle_later(x.rank);
  }
}

void SimWorld::on_finished(const std::vector<EndedTransfer>& engine_ended) {
  Change change(changing_);
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
  // Every operation that waited for these has one unfinished dependency less per edge. All of them are
  // counted before any dependent runs, so what runs, and in what order, is as if each dependent looked
  // at all its dependencies.
  for (const auto& op : ended) {
    for (const auto& dep : op->dependents) {
      if (auto d = dep.op.lock()) d->unfinished_deps -= dep.edges;
    }
  }
  for (const auto& op : ended) {
    const bool p2p = op->op == CommOp::Send;
    const SpanName name = op_name(op->op);
    for (std::size_t i = 0; i < op->members.size(); ++i) {
      prefetch_state(*op, i + kPrefetchAhead);
      CommMember& m = op->members[i];
      if (!runs(m.rank)) continue;
      RankState& s = state(m.rank);
      const int stream =
          p2p ? (m.rank == op->ranks[0] ? op->ranks[1] : op->ranks[0]) : collective_stream(op->group_id);
      s.streams[stream].end_us = std::max(s.streams[stream].end_us, op->end_us);
      add_span(m.rank, SpanKind::Comm, name, op->start_us, op->end_us);
    }
    const int n = static_cast<int>(op->members.size());
    CollectiveRecord rec;
    rec.op = op->op;
    rec.group = group_name(*op);
    rec.group_size = n;
    rec.bytes = p2p ? op->members[0].call.input.bytes() : nccl_size_bytes(*op);
    rec.algorithm = op->algorithm;
    rec.start_us = op->start_us;
    rec.end_us = op->end_us;
    rec.bookkeeping = op->members[0].call.bookkeeping;
    const double t_us = op->end_us - op->start_us;
    rec.algbw_gbps = t_us > 0 ? static_cast<double>(rec.bytes) / (t_us * 1e3) : 0;
    rec.busbw_gbps = rec.algbw_gbps * bus_factor(op->op, n);
    report_.collectives.push_back(rec);
    if (size() >= 256) {
      if (progress_detail_.empty()) progress_detail_ = fmt::format("operations, {} ranks", size());
      progress_.update(++finished_ops_, progress_detail_);
    }
    for (std::size_t i = 0; i < op->members.size(); ++i) {
      prefetch_state(*op, i + kPrefetchAhead, /*with_fiber=*/true);
      CommMember& m = op->members[i];
      // A finished operation needs neither its dependencies nor its buffers: letting go of them frees
      // the tensors it moved (and the chain of earlier operations each one would otherwise keep alive).
      m.deps.clear();
      m.call.input = Tensor();
      m.call.output = Tensor();
      if (m.call.async == Async::Yes && !m.waited && runs(m.rank)) forget_unwaited(m.rank, *op, false);
      // A member waiting for another operation would only find it unfinished and block again.
      // One whose kernels this operation may have overlapped times them again (resettle), and is woken
      // only if it waited for them and they are timed.
      const RankState& ms = state(m.rank);
      const CommOpState* waited = ms.waiting_op;
      if (!ms.settling && (waited == nullptr || waited == op.get())) wake(m.rank);
      if (ms.settling || !ms.deferred_posts.empty()) resettle_later(m.rank);
    }
  }
  // What waited for these can run now.
  for (const auto& op : ended) {
    std::vector<CommOpState::Dependent> dependents;
    dependents.swap(op->dependents);
    for (const auto& dep : dependents) {
      if (auto d = dep.op.lock()) try_execute(d);
    }
  }
  change.done();
  run_resettles();
}

void SimWorld::prefetch_state(const CommOpState& op, std::size_t member, bool with_fiber) const {
  if (member >= op.members.size()) return;
  const RankState* s = ranks_[op.members[member].rank].get();
  const char* bytes = reinterpret_cast<const char*>(s);
  for (std::size_t offset = 0; offset < sizeof(RankState); offset += 64) __builtin_prefetch(bytes + offset);
  // Its suspended fiber's context, which waking it reads: loaded already, as the state of a member a few
  // places back was fetched on the previous pass.
  if (with_fiber && s->suspended != nullptr) __builtin_prefetch(s->suspended);
}

bool SimWorld::advance_engine(double t_us) {
  woke_ = false;
  while (true) {
    std::vector<EndedTransfer> ended = engine_.advance_to(t_us, /*stop_at_end=*/true);
    if (ended.empty()) return false;
    on_finished(ended);  // may schedule more transfers at or before t_us
    if (woke_) return true;
  }
}

bool SimWorld::advance_when_stalled() {
  if (!kernel_watches_.empty() && kernel_watches_.begin()->first <= engine_.next_event_us()) {
    advance_engine(kernel_watches_.begin()->first);
    resettle_watched();
    return true;
  }
  return advance_engine_one_event();
}

bool SimWorld::advance_engine_one_event() {
  const double t = engine_.next_event_us();
  if (!std::isfinite(t)) return false;
  advance_engine(t);
  return true;
}

bool SimWorld::arrival_only(int rank, const CommCall& call) const {
  if (config_.issue_in_clock_order || call.op == CommOp::Send || call.op == CommOp::Recv ||
      symmetry_.enabled()) {
    return false;
  }
  const auto open = open_collectives_.find(next_collective(rank, call.group));
  const int arrived = open == open_collectives_.end() ? 0 : open->second->arrived;
  return arrived + 1 < static_cast<int>(members(call.group).size());
}

void SimWorld::before_issue(int rank, const CommCall& call) {
  RankState& s = state(rank);
  VirtualTimeScheduler* sched = VirtualTimeScheduler::current();
  const double issue_us = std::max(s.host_us, s.compute_us);
  while (true) {
    const double earliest_other = sched ? sched->min_ready_time_us() : INFINITY;
    // A rank an ending woke joins the ready ranks with its clock: look again before going further. A rank
    // waiting to know its kernel's end issues nothing before that end: the engine stops there for it.
    double target_us = std::min(issue_us, earliest_other);
    if (!kernel_watches_.empty()) target_us = std::min(target_us, kernel_watches_.begin()->first);
    if (advance_engine(target_us)) continue;
    resettle_watched();
    if (!sched || sched->min_ready_time_us() >= s.host_us || arrival_only(rank, call)) return;
    // Ranks whose clocks are behind (some just woken by the engine) issue first.
    VirtualTimeProps& props = boost::this_fiber::properties<VirtualTimeProps>();
    props.time_us = s.host_us;
    props.stack_hint = __builtin_frame_address(0);
    ++fiber_switches_;
    boost::this_fiber::yield();
    check_aborted();
  }
}

void SimWorld::execute(const std::shared_ptr<CommOpState>& op) {
  Change change(changing_);
  double start_us = 0;
  for (CommMember& m : op->members) {
    m.ready_us = m.issue_ready_us;
    for (const auto& dep : m.deps) m.ready_us = std::max(m.ready_us, dep->end_us);
    start_us = std::max(start_us, m.ready_us);
  }
  const bool p2p = op->op == CommOp::Send;
  const CommCall& lead = op->members[0].call;
  CommPlan plan = p2p ? network_->plan_p2p(op->ranks[0], op->ranks[1], lead.input.bytes())
                  : uneven_all_to_all(*op)
                      ? network_->plan_all_to_all(op->ranks, all_to_all_pair_bytes(*op))
                      : network_->plan_collective(op->op, nccl_size_bytes(*op), op->ranks, lead.peer);
  // The lesson's bookkeeping (Rank::bookkeeping) takes its time but stays out of the link traffic.
  if (!lead.bookkeeping) network_->record(plan);
  op->algorithm = plan_name(plan);
  if (config_.sm_contention) contention_.set_hbm_rates(*op, plan);
  op->start_us = start_us;
  op->executed = true;
  run_numerics(*op);
  const SpanName name = op_name(op->op);
  for (const CommMember& m : op->members) {
    if (!runs(m.rank)) continue;
    add_span(m.rank, SpanKind::Idle, name, m.ready_us, op->start_us);
    // A member waiting to know its kernel's end learns this operation's start.
    if (!std::isnan(state(m.rank).watched_end_us)) resettle_later(m.rank);
  }
  if (symmetry_.enabled()) symmetry_.note_spine(plan, network_->topology());
  engine_.schedule(op, std::move(plan), start_us);
  if (symmetry_.enabled()) schedule_images(op, start_us);
  // A transfer that started late may already have ended.
  on_finished(engine_.advance_to(engine_.now_us()));
  change.done();
  run_resettles();
}

// ---- images of a symmetric run ------------------------------------------------------------------

void SimWorld::schedule_images(const std::shared_ptr<CommOpState>& of, double start_us) {
  const CommOpState& op = *of;
  const bool p2p = op.op == CommOp::Send;
  const CommCall& lead = op.members[0].call;
  // Where the root sits in the group, so that each image has the root's image.
  const int root_pos =
      p2p ? -1 : static_cast<int>(std::find(op.ranks.begin(), op.ranks.end(), lead.peer) - op.ranks.begin());
  const std::int64_t bytes = p2p ? lead.input.bytes() : nccl_size_bytes(op);
  for (const std::vector<int>& image : symmetry_.images(op)) {
    const int root = root_pos >= 0 && root_pos < static_cast<int>(image.size()) ? image[root_pos] : lead.peer;
    CommPlan plan = p2p                     ? network_->plan_p2p(image[0], image[1], bytes)
                    : uneven_all_to_all(op) ? network_->plan_all_to_all(image, all_to_all_pair_bytes(op))
                                            : network_->plan_collective(op.op, bytes, image, root);
    if (!lead.bookkeeping) network_->record(plan);
    symmetry_.note_spine(plan, network_->topology());
    auto shadow = std::make_shared<CommOpState>();
    shadow->op = op.op;
    shadow->image = true;
    shadow->executed = true;
    shadow->start_us = start_us;
    shadow->image_of = of;
    ++of->transfers_left;
    engine_.schedule(std::move(shadow), std::move(plan), start_us);
  }
}

}  // namespace ranklab::sim
