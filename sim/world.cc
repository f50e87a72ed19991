#include "sim/world.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <utility>

#include "common/errors.h"
#include "common/progress.h"
#include "sim/rank_faults.h"
#include "sim/reduce.h"
#include "sim/run_topology.h"
#include "sim/scheduler.h"

namespace ranklab::sim {

namespace {
std::vector<bool> runs_of(const Symmetry& symmetry, int world_size) {
  std::vector<bool> runs(world_size);
  for (int r = 0; r < world_size; ++r) runs[r] = symmetry.runs(r);
  return runs;
}
}  // namespace

SimWorld::SimWorld(const SimConfig& config, int world_size)
    : config_(config),
      compute_(config.profile.gpu),
      network_(make_network_model(config)),
      symmetry_(config.symmetry, world_size),
      scheduler_(runs_of(symmetry_, world_size)),
      operations_(world_size),
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
  scheduler_.set_stall_handler([this] { return advance_when_stalled(); });
  if (symmetry_.enabled()) {
    const Topology& topo = network_->topology();
    node_runs_.assign(static_cast<std::size_t>(topo.nodes()), 0);
    for (int r = 0; r < world_size; ++r)
      if (symmetry_.runs(r)) node_runs_[static_cast<std::size_t>(topo.node_of(r))] = 1;
  }
  report_.backend = "sim";
  report_.profile = config.profile.name;
  report_.world = world_size;
  // A mirror's timeline is its representative's: tracing it traces the representative, and tracing every
  // rank traces those that run.
  const TraceRanks& trace = config.trace_ranks;
  traced_.assign(static_cast<std::size_t>(world_size), 0);
  if (trace.keeps_every_rank(world_size)) {
    for (int r = 0; r < world_size; ++r) traced_[r] = runs(r);
  } else {
    traced_[representative(0)] = trace.mode == TraceRanks::Mode::Lesson;
    for (int r : trace.ranks) {
      if (r < world_size) traced_[representative(r)] = 1;
    }
  }
}

// ---- running ranks and failing runs ----------------------------------------------------------------

void SimWorld::run_rank(int rank, const std::function<void()>& program) {
  try {
    program();
    settle_compute(rank);  // its last kernels' times
  } catch (const RunAborted&) {
    // another rank failed first; this one just unwinds
  } catch (...) {
    scheduler_.fail(current_error_of_rank(rank));  // the same words as the real backend's
  }
  scheduler_.finish(rank);
}

void SimWorld::block_until(int rank, const std::function<bool()>& pred,
                           const std::function<std::string()>& what, const CommOpState* op) {
  scheduler_.block_until(rank, state(rank).host_us, pred, what, op);
}

void SimWorld::wait_finished(int rank, const std::shared_ptr<CommOpState>& op, const char* by, bool folded) {
  if (op->finished) {  // the common case: no callables to build
    scheduler_.check_aborted();
    return;
  }
  // The callables capture at most two pointers, which std::function keeps without allocating.
  struct Wait {
    int rank;
    const CommOpState* op;
    const char* by;
    bool folded;
  } const wait{rank, op.get(), by, folded};
  block_until(
      rank, [&wait] { return wait.op->finished; },
      [this, &wait] { return describe_wait(wait.rank, *wait.op, wait.by, wait.folded); }, op.get());
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
  return fmt::format("{} waits for {}: {}", who, op.label(), Operations::why_pending(op));
}

// ---- groups ----------------------------------------------------------------------------------------

Group SimWorld::new_group(int rank, const std::vector<int>& ranks) {
  scheduler_.check_aborted();
  return operations_.new_group(rank, ranks, symmetry_);
}

// ---- posting communication -------------------------------------------------------------------------

namespace {
int stream_of(const CommCall& c) {
  return (c.op == CommOp::Send || c.op == CommOp::Recv) ? c.peer : collective_stream(c.group.id());
}
}  // namespace

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
  std::shared_ptr<CommOpState> op = operations_.join(rank, call);
  CommMember& m = op->member_of(rank);
  if (config_.keep_timeline) {
    m.post_seq = s.first_unfinished_post + s.unfinished_posts.size();
    s.unfinished_posts.push_back({s.host_us, false});
  }
  if (defer) {
    m.issue_ready_us = std::numeric_limits<double>::quiet_NaN();
    ++op->unready;
    s.deferred_posts.push_back({op, s.kernels_timed + s.pending_kernels.size(), s.host_us});
  } else {
    m.issue_ready_us = std::max(s.host_us, s.compute_us);
  }
  const int stream_id = stream_of(call);
  StreamState& stream = s.streams[stream_id];
  auto add_dep = [&](const std::shared_ptr<CommOpState>& dep) { Operations::depend(op, m, dep); };
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
  if (symmetry_.enabled()) symmetry_.join_mirrors(*op, rank);
  operations_.agree(*op, rank);
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
  if (Operations::runnable(*op)) execute(op);
}

void SimWorld::execute_readied(const std::shared_ptr<CommOpState>& op) {
  try_execute(op);
  if (op->executed || !op->all_arrived() || op->unready > 0) return;
  for (const CommMember& x : op->members) {
    if (runs(x.rank) && !std::isnan(state(x.rank).watched_end_us)) resettle_later(x.rank);
  }
}

CollectiveRecord SimWorld::collective_record(const CommOpState& op) {
  const int n = static_cast<int>(op.members.size());
  CollectiveRecord rec;
  rec.op = op.op;
  rec.group = group_name(op);
  rec.group_size = n;
  rec.bytes = op.op == CommOp::Send ? op.members[0].call.input.bytes() : nccl_size_bytes(op);
  rec.algorithm = op.algorithm;
  rec.start_us = op.start_us;
  rec.end_us = op.end_us;
  rec.bookkeeping = op.members[0].call.bookkeeping;
  const double t_us = op.end_us - op.start_us;
  rec.algbw_gbps = t_us > 0 ? static_cast<double>(rec.bytes) / (t_us * 1e3) : 0;
  rec.busbw_gbps = rec.algbw_gbps * bus_factor(op.op, n);
  return rec;
}

void SimWorld::on_finished(const std::vector<EndedTransfer>& engine_ended) {
  Change change(changing_);
  const std::vector<std::shared_ptr<CommOpState>> ended = Operations::complete(engine_ended);
  for (const auto& op : ended) {
    const bool p2p = op->op == CommOp::Send;
    const SpanName name = op_name(op->op);
    bool traced_member = false;  // only ranks that run are traced
    for (std::size_t i = 0; i < op->members.size(); ++i) {
      prefetch_state(*op, i + kPrefetchAhead);
      CommMember& m = op->members[i];
      if (!runs(m.rank)) continue;
      traced_member = traced_member || traced(m.rank);
      RankState& s = state(m.rank);
      const int stream =
          p2p ? (m.rank == op->ranks[0] ? op->ranks[1] : op->ranks[0]) : collective_stream(op->group_id);
      s.streams[stream].end_us = std::max(s.streams[stream].end_us, op->end_us);
      if (config_.keep_timeline) finish_post(s, m.post_seq);
      add_span(m.rank, SpanKind::Comm, name, op->start_us, op->end_us);
    }
    if (config_.keep_timeline) {
      CollectiveRecord record = collective_record(*op);
      collective_tally_.add(record);
      if (traced_member) report_.collectives.push_back(std::move(record));
    }
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
      if (!runs(m.rank)) continue;  // a mirror waits for nothing and is never woken
      if (m.call.async == Async::Yes && !m.waited) forget_unwaited(m.rank, *op, false);
      // A member waiting for another operation would only find it unfinished and block again.
      // One whose kernels this operation may have overlapped times them again (resettle), and is woken
      // only if it waited for them and they are timed.
      const RankState& ms = state(m.rank);
      const CommOpState* waited = scheduler_.waiting_op(m.rank);
      if (!ms.settling && (waited == nullptr || waited == op.get())) scheduler_.wake(m.rank);
      if (ms.settling || !ms.deferred_posts.empty()) resettle_later(m.rank);
    }
  }
  // What waited for these can run now.
  for (const auto& op : ended) {
    Operations::release_dependents(*op, [this](const std::shared_ptr<CommOpState>& d) { try_execute(d); });
  }
  change.done();
  run_resettles();
}

void SimWorld::prefetch_state(const CommOpState& op, std::size_t member, bool with_fiber) const {
  if (member >= op.members.size()) return;
  const int rank = op.members[member].rank;
  if (!runs(rank)) return;  // a mirror's state is not looked at
  const char* bytes = reinterpret_cast<const char*>(ranks_[rank].get());
  for (std::size_t offset = 0; offset < sizeof(RankState); offset += 64) __builtin_prefetch(bytes + offset);
  // Its suspended fiber's context, which waking it reads: the scheduler's entry that holds its address was
  // asked for on the previous pass.
  scheduler_.prefetch(rank, with_fiber);
}

bool SimWorld::advance_engine(double t_us) {
  scheduler_.clear_woke();
  while (true) {
    std::vector<EndedTransfer> ended = engine_.advance_to(t_us, /*stop_at_end=*/true);
    if (ended.empty()) return false;
    on_finished(ended);  // may schedule more transfers at or before t_us
    if (scheduler_.woke()) return true;
  }
}

bool SimWorld::advance_when_stalled() {
  if (!kernel_watches_.empty() && kernel_watches_.top().at_us <= engine_.next_event_us()) {
    advance_engine(kernel_watches_.top().at_us);
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
  return operations_.arrived_at_next(rank, call.group) + 1 <
         static_cast<int>(operations_.members(call.group).size());
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
    if (!kernel_watches_.empty()) target_us = std::min(target_us, kernel_watches_.top().at_us);
    if (advance_engine(target_us)) continue;
    resettle_watched();
    if (!sched || sched->min_ready_time_us() >= s.host_us || arrival_only(rank, call)) return;
    // Ranks whose clocks are behind (some just woken by the engine) issue first.
    scheduler_.yield(s.host_us);
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
  std::optional<CommPlan> in_nodes;  // the plan, kept for the images where it stays inside nodes
  if (symmetry_.enabled()) {
    const Topology& topo = network_->topology();
    symmetry_.note_spine(plan, topo);
    if (std::all_of(plan.links.begin(), plan.links.end(), [&](LinkId l) { return topo.in_node(l); }))
      in_nodes = plan;
  }
  engine_.schedule(op, std::move(plan), start_us);
  if (symmetry_.enabled()) schedule_images(op, start_us, in_nodes ? &*in_nodes : nullptr);
  // A transfer that started late may already have ended.
  on_finished(engine_.advance_to(engine_.now_us()));
  change.done();
  run_resettles();
}

// ---- images of a symmetric run ------------------------------------------------------------------

void SimWorld::schedule_images(const std::shared_ptr<CommOpState>& of, double start_us,
                               const CommPlan* in_nodes) {
  const CommOpState& op = *of;
  const bool p2p = op.op == CommOp::Send;
  const CommCall& lead = op.members[0].call;
  const Topology& topo = network_->topology();
  // Whether `image` is the operation's ranks moved by `gpus`, into nodes where no rank runs.
  auto idle_translate = [&](const std::vector<int>& image, int& gpus) {
    gpus = image[0] - op.ranks[0];
    if (!topo.shifts_in_nodes(gpus)) return false;
    for (std::size_t i = 0; i < image.size(); ++i) {
      if (image[i] - op.ranks[i] != gpus || node_runs_[static_cast<std::size_t>(topo.node_of(image[i]))])
        return false;
    }
    return true;
  };
  // Where the root sits in the group, so that each image has the root's image.
  const int root_pos =
      p2p ? -1 : static_cast<int>(std::find(op.ranks.begin(), op.ranks.end(), lead.peer) - op.ranks.begin());
  const std::int64_t bytes = p2p ? lead.input.bytes() : nccl_size_bytes(op);
  for (const std::vector<int>& image : symmetry_.images(op)) {
    int gpus = 0;
    if (in_nodes != nullptr && idle_translate(image, gpus)) {
      if (!lead.bookkeeping) network_->record_shifted(*in_nodes, gpus);
      continue;
    }
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
