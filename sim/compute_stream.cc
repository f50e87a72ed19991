// SimWorld's side of each rank's compute stream: kernels timed under the communication beside them
// (ContentionModel), the waits a kernel takes along instead of blocking, and the kernels whose times wait
// for the engine (try_settle, resettle, settle_compute).
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
#include "sim/world.h"

namespace ranklab::sim {

// ---- communication kernels beside compute kernels --------------------------------------------------

double SimWorld::contended_end_us(int rank, std::size_t kernel, double start_us, const KernelCost& cost,
                                  bool& known, bool& started) {
  const RankState& s = state(rank);
  // Without sm_contention, always.
  if (s.beside_ops.empty())
    return contention_.kernel_end_us(s.beside_ops.end(), s.beside_ops.end(), start_us, cost, known, started);
  // The deferred posts behind this kernel wait for it (the NCCL stream waits for the compute stream), so
  // they cannot overlap it. They are the last of beside_ops: a rank posts nothing else while it has
  // deferred posts, and only finished operations leave the list.
  const auto first_behind = std::upper_bound(
      s.deferred_posts.begin(), s.deferred_posts.end(), s.kernels_timed + kernel,
      [](std::uint64_t k, const RankState::DeferredPost& d) { return k < d.kernels_before; });
  const std::size_t behind = static_cast<std::size_t>(s.deferred_posts.end() - first_behind);
  return contention_.kernel_end_us(s.beside_ops.begin(),
                                   s.beside_ops.end() - static_cast<std::ptrdiff_t>(behind), start_us, cost,
                                   known, started);
}

void SimWorld::resettle_watched() {
  while (!kernel_watches_.empty() && kernel_watches_.top().at_us <= engine_.now_us()) {
    const int rank = static_cast<int>(kernel_watches_.top().flow);
    kernel_watches_.pop();
    state(rank).watched_end_us = std::numeric_limits<double>::quiet_NaN();
    resettle(rank);
  }
}

void SimWorld::watch_kernel_end(int rank, double end_us) {
  RankState& s = state(rank);
  if (s.watched_end_us == end_us) return;
  clear_kernel_watch(rank);
  s.watched_end_us = end_us;
  kernel_watches_.set(static_cast<std::uint32_t>(rank), end_us);
}

void SimWorld::clear_kernel_watch(int rank) {
  RankState& s = state(rank);
  if (std::isnan(s.watched_end_us)) return;
  kernel_watches_.erase(static_cast<std::uint32_t>(rank));
  s.watched_end_us = std::numeric_limits<double>::quiet_NaN();
}

void SimWorld::resettle(int rank) {
  RankState& s = state(rank);
  double end_us = 0;
  if (try_settle(rank, end_us)) {
    clear_kernel_watch(rank);
    if (s.settling) scheduler_.wake(rank);
  } else if ((s.settling || !s.deferred_posts.empty()) && std::isfinite(end_us)) {
    watch_kernel_end(rank, end_us);
  } else {
    // Nothing to watch, or the kernel waits for an operation to end: the engine reaches that end before
    // the kernel's, and the operation's ending times the rank's kernels again (on_finished).
    clear_kernel_watch(rank);
  }
}

void SimWorld::resettle_later(int rank) {
  // Once per rank until it runs: a rank that is a member of several operations ending together would
  // otherwise be timed again once per operation, each pass repeating the first.
  RankState& s = state(rank);
  if (s.resettle_queued) return;
  s.resettle_queued = true;
  resettles_.push_back(rank);
}

void SimWorld::run_resettles() {
  // Not half way through a change: operations about to start would be missing from what the engine
  // holds. Nor inside the loop below, which takes what its own calls add.
  if (changing_ > 0 || running_resettles_) return;
  running_resettles_ = true;
  for (std::size_t i = 0; i < resettles_.size(); ++i) {
    state(resettles_[i]).resettle_queued = false;  // what changes from here on queues it again
    resettle(resettles_[i]);
  }
  resettles_.clear();
  running_resettles_ = false;
}

// ---- the host clock and the compute stream's waits ------------------------------------------------

void SimWorld::host_waits_until(int rank, double t_us) {
  RankState& s = state(rank);
  s.host_us = std::max(s.host_us, t_us);
}

double SimWorld::stream_time_us(int rank, const char* by) {
  fold_waits(rank, by);
  settle_compute(rank);
  const RankState& s = state(rank);
  return std::max(s.host_us, s.compute_us);
}

void SimWorld::host_waits_for_stream(int rank, const char* by) {
  host_waits_until(rank, stream_time_us(rank, by));
}

void SimWorld::synchronize(int rank) {
  RankState& s = state(rank);
  fold_waits(rank, "synchronize()");
  settle_compute(rank);  // while the operations its kernels overlap are still listed
  for (const auto& op : s.outstanding) {
    wait_finished(rank, op, "synchronize()");
    op->member_of(rank).waited = true;  // the device is idle: nothing is in flight any more
  }
  s.outstanding.clear();
  double t = std::max(s.host_us, s.compute_us);
  for (const auto& [key, stream] : s.streams) t = std::max(t, stream.end_us);
  s.host_us = t;
}

// Back-to-back collectives, or the buckets of a step waited on in turn, keep the list as short as the number
// of streams (at most one collective per group, which is what the search below relies on).
void SimWorld::stream_waits_for(int rank, const std::shared_ptr<CommOpState>& op) {
  RankState& s = state(rank);
  s.waits_deferred = false;
  if (op->op != CommOp::Send) {
    const auto same_stream = std::find_if(
        s.unfolded_waits.begin(), s.unfolded_waits.end(), [&](const std::shared_ptr<CommOpState>& other) {
          return other->op != CommOp::Send && other->group_id == op->group_id;
        });
    if (same_stream != s.unfolded_waits.end()) {
      if ((*same_stream)->seq >= op->seq) {  // a later one already stands for it
        if (!op->finished) s.folded_with.push_back(op);
        return;
      }
      if (!(*same_stream)->finished) s.folded_with.push_back(*same_stream);
      s.unfolded_waits.erase(same_stream);
    }
  }
  s.unfolded_waits.push_back(op);
}

void SimWorld::fold_waits(int rank, const char* by) {
  RankState& s = state(rank);
  if (!s.unfolded_waits.empty()) settle_compute(rank);
  for (const auto& op : s.unfolded_waits) {
    if (!op->finished) {
      wait_finished(rank, op, by, /*folded=*/true);
    }
    s.compute_us = std::max(s.compute_us, op->end_us);
  }
  s.unfolded_waits.clear();
  s.folded_with.clear();  // ended before those
}

void SimWorld::waits_before_kernel(int rank, const char* by) {
  const RankState& s = state(rank);
  if (s.unfolded_waits.empty() || s.waits_deferred) return;
  if (may_defer_waits(rank)) {
    defer_waits(rank);  // the kernel takes them along (launch_kernel)
    return;
  }
  fold_waits(rank, by);
}

void SimWorld::begin_p2p_group(int rank) {
  RankState& s = state(rank);
  s.p2p_group = ++s.p2p_groups_posted;
}

void SimWorld::note_async_posted(int rank, const std::shared_ptr<CommOpState>& op) {
  if (op->finished) return;
  RankState& s = state(rank);
  s.streams[stream_of(*op, rank)].unwaited.push_back(op);
  ++s.async_in_flight;
  s.waits_deferred = false;  // the next kernel may have to block now
}

void SimWorld::note_waited(int rank, const std::shared_ptr<CommOpState>& op) {
  forget_unwaited(rank, *op, true);
}

void SimWorld::forget_unwaited(int rank, const CommOpState& op, bool waited) {
  RankState& s = state(rank);
  std::vector<std::shared_ptr<CommOpState>>& unwaited = s.streams[stream_of(op, rank)].unwaited;
  const auto it = std::find_if(unwaited.begin(), unwaited.end(),
                               [&op](const std::shared_ptr<CommOpState>& o) { return o.get() == &op; });
  if (it == unwaited.end()) return;  // a wait() for a later one covered it
  // Waiting for a collective waits for the ones before it on its group's stream: blocking for it would
  // have seen them end too. (Not so for point-to-point operations, which a batch posts side by side.)
  const auto from = waited && op.op != CommOp::Send ? unwaited.begin() : it;
  s.folded_with.insert(s.folded_with.end(), from, it);
  s.async_in_flight -= static_cast<int>(it - from) + 1;
  unwaited.erase(from, it + 1);
}

bool SimWorld::may_defer_waits(int rank) const {
  const RankState& s = *ranks_[rank];
  if (symmetry_.enabled() || config_.issue_in_clock_order || s.async_in_flight > 0) return false;
  // Only the ends may be missing: what an operation brings may be read by the kernel, and is let go of
  // (defer_waits) for the ones these stand for too.
  auto numbers_done = [rank](const std::shared_ptr<CommOpState>& op) {
    if (op->finished || op->executed) return true;
    const CommCall& call = op->member_of(rank).call;
    return (!call.input.defined() || call.input.phantom()) &&
           (!call.output.defined() || call.output.phantom());
  };
  const auto unfinished = std::count_if(s.unfolded_waits.begin(), s.unfolded_waits.end(),
                                        [](const std::shared_ptr<CommOpState>& op) { return !op->finished; });
  return unfinished <= 1 && std::all_of(s.unfolded_waits.begin(), s.unfolded_waits.end(), numbers_done) &&
         std::all_of(s.folded_with.begin(), s.folded_with.end(), numbers_done);
}

void SimWorld::defer_waits(int rank) {
  RankState& s = state(rank);
  auto hand_over = [&](const std::shared_ptr<CommOpState>& op) {
    if (op->finished) return;  // it let go of its tensors when it finished
    if (!s.uncharged) {
      auto account = std::make_shared<MemoryAccount>();
      account->rank = rank;
      s.uncharged = std::make_shared<SimStorage>(std::move(account), 0, DType::Float32, /*phantom=*/true);
    }
    CommCall& call = op->member_of(rank).call;
    for (Tensor* t : {&call.input, &call.output}) {
      if (t->defined() && t->storage() != s.uncharged.get()) *t = Tensor(t->shape(), t->dtype(), s.uncharged);
    }
  };
  std::for_each(s.unfolded_waits.begin(), s.unfolded_waits.end(), hand_over);
  std::for_each(s.folded_with.begin(), s.folded_with.end(), hand_over);
  s.folded_with.clear();
  s.waits_deferred = true;
}

void SimWorld::launch_kernel(int rank, SpanName name, const KernelCost& cost) {
  RankState& s = state(rank);
  // What the compute stream waits for and the rank did not block for (may_defer_waits): folded into the
  // stream's clock when it is known, else the kernel takes it along.
  double after_us = 0;
  std::shared_ptr<CommOpState> after;
  for (auto& op : s.unfolded_waits) {
    if (op->finished) {
      after_us = std::max(after_us, op->end_us);
    } else {
      // may_defer_waits let one through at most; else the rank blocked until they ended (fold_waits).
      if (after) throw std::logic_error("launch_kernel: a kernel waits for two unfinished operations");
      after = std::move(op);
    }
  }
  s.unfolded_waits.clear();
  if (!after && s.pending_kernels.empty()) s.compute_us = std::max(s.compute_us, after_us);
  const double start_us = std::max(s.host_us, s.compute_us);
  if (!s.beside_ops.empty()) {
    // No kernel from now on starts before the compute stream's clock (nor before this one, when none
    // waits): what ended by then is over for good.
    drop_ops_over(s, s.pending_kernels.empty() ? start_us : s.compute_us);
  }
  if (s.pending_kernels.empty() && s.beside_ops.empty() && !after) {
    s.host_wait_us += start_us - s.compute_us;  // the stream was free from compute_us on
    s.compute_us = start_us + cost.us();
    add_span(rank, SpanKind::Compute, name, start_us, s.compute_us);
    return;
  }
  s.pending_kernels.push_back({name, cost, s.host_us, after_us, std::move(after)});
  // At once when nothing it overlaps is still to be known. Behind kernels that could not be timed, it
  // waits with them: trying every launch again would cost the square of the kernels waiting.
  double end_us = 0;
  if (s.pending_kernels.size() == 1) try_settle(rank, end_us);
}

void SimWorld::drop_ops_over(RankState& s, double from_us) {
  auto over = [from_us](const std::shared_ptr<CommOpState>& op) {
    return op->finished && op->end_us <= from_us;
  };
  // From the front, where they mostly are; the whole list as it doubles, for those behind one still on.
  s.beside_ops.pop_front(static_cast<std::size_t>(
      std::find_if_not(s.beside_ops.begin(), s.beside_ops.end(), over) - s.beside_ops.begin()));
  if (s.beside_ops.size() >= s.beside_ops_prune_at) {
    s.beside_ops.erase_if(over);
    s.beside_ops_prune_at = std::max<std::size_t>(16, 2 * s.beside_ops.size());
  }
}

double SimWorld::kernel_start_us(const RankState::PendingKernel& kernel, double stream_us) {
  const double start_us = std::max({kernel.host_us, stream_us, kernel.after_us});
  if (!kernel.after) return start_us;
  return kernel.after->finished ? std::max(start_us, kernel.after->end_us)
                                : std::numeric_limits<double>::infinity();
}

bool SimWorld::try_settle(int rank, double& end_us) {
  RankState& s = state(rank);
  bool known = true, started = true, settling = true;
  double t_us = s.compute_us;
  std::size_t settled = 0;  // the kernels, from the first, whose times are final
  std::size_t waiting = 0;  // the first deferred post the kernels timed so far do not ready
  const std::uint64_t base = s.kernels_timed;  // the first pending kernel's number: pending_ends_us_[0]
  pending_ends_us_.clear();
  for (std::size_t i = 0; i < s.pending_kernels.size(); ++i) {
    const RankState::PendingKernel& k = s.pending_kernels[i];
    const double start_us = kernel_start_us(k, t_us);
    if (std::isinf(start_us)) break;  // it waits for an operation that has not ended, as every later one
    bool k_known = false, k_started = false;
    t_us = contended_end_us(rank, i, start_us, k.cost, k_known, k_started);
    known = known && k_known;
    started = started && k_started;
    pending_ends_us_.push_back(t_us);
    // Once a kernel's end is not final, no later one's is; the engine's stop is then the end of the
    // last kernel before the first deferred post still waiting, and nothing after it is needed.
    settling = settling && contention_.settled(known, started, t_us);
    if (settling) {
      settled = i + 1;
      continue;
    }
    while (waiting < s.deferred_posts.size() && s.deferred_posts[waiting].kernels_before - base <= settled)
      ++waiting;
    if (waiting < s.deferred_posts.size() && i + 1 >= s.deferred_posts[waiting].kernels_before - base) break;
  }
  t_us = s.compute_us;
  for (std::size_t i = 0; i < settled; ++i) {
    const RankState::PendingKernel& k = s.pending_kernels[i];
    const double start_us = kernel_start_us(k, t_us);
    // Idle for the host where its launch came after everything else the kernel waited for.
    const double ready_us = std::max({t_us, k.after_us, k.after ? k.after->end_us : 0.0});
    s.host_wait_us += std::max(0.0, k.host_us - ready_us);
    t_us = pending_ends_us_[i];
    add_span(rank, SpanKind::Compute, k.name, start_us, t_us);
    s.comm_slowed_compute_us += t_us - (start_us + k.cost.us());
  }
  s.compute_us = t_us;
  s.pending_kernels.pop_front(settled);
  s.kernels_timed += settled;
  drop_ops_over(s, s.compute_us);  // no kernel left starts before the stream's clock
  // The deferred posts behind the kernels timed now are ready at the end of the last kernel before them.
  std::vector<std::shared_ptr<CommOpState>> readied;
  std::size_t ready = 0;
  for (; ready < s.deferred_posts.size() && s.deferred_posts[ready].kernels_before <= s.kernels_timed;
       ++ready) {
    RankState::DeferredPost& d = s.deferred_posts[ready];
    d.op->member_of(rank).issue_ready_us = std::max(d.host_us, pending_ends_us_[d.kernels_before - base - 1]);
    --d.op->unready;
    readied.push_back(std::move(d.op));
  }
  s.deferred_posts.pop_front(ready);
  // Where the engine must stop for this rank: the end of the last kernel the first deferred post waits for
  // (it starts no earlier), or else, for settle_compute, that of the last kernel. Infinite when that
  // kernel comes after one that waits for an operation to end (the loop above stopped there).
  const std::size_t stop = !s.deferred_posts.empty() ? s.deferred_posts.front().kernels_before - base
                                                     : settled + s.pending_kernels.size();
  end_us = stop == 0                         ? s.compute_us
           : stop <= pending_ends_us_.size() ? pending_ends_us_[stop - 1]
                                             : std::numeric_limits<double>::infinity();
  for (const auto& op : readied) execute_readied(op);
  return s.pending_kernels.empty();
}

void SimWorld::settle_compute(int rank) {
  RankState& s = state(rank);
  if (s.pending_kernels.empty()) return;
  struct Settling {
    RankState& s;
    ~Settling() { s.settling = false; }
  } settling{s};
  s.settling = true;
  // The world times the kernels again as the engine moves (resettle) and wakes the rank once they are. The
  // callables capture one pointer, which std::function keeps without allocating.
  struct Context {
    SimWorld* world;
    int rank;
    RankState* s;
  } const ctx{this, rank, &s};
  block_until(
      rank,
      [&ctx] {
        ctx.world->resettle(ctx.rank);
        return ctx.s->pending_kernels.empty();
      },
      [&ctx] {
        // A kernel that waits for an operation to end waits for what that operation waits for.
        for (const RankState::PendingKernel& k : ctx.s->pending_kernels) {
          if (k.after && !k.after->finished)
            return ctx.world->describe_wait(ctx.rank, *k.after, k.name.c_str(), /*folded=*/true);
        }
        return fmt::format("the times of {} kernel(s) that communication in flight may slow",
                           ctx.s->pending_kernels.size());
      });
}

}  // namespace ranklab::sim
