#include "sim/rank_scheduler.h"

#include <fmt/format.h>

#include <boost/fiber/operations.hpp>
#include <utility>

#include "common/errors.h"
#include "sim/rank_faults.h"
#include "sim/scheduler.h"

namespace ranklab::sim {

RankScheduler::RankScheduler(const std::vector<bool>& runs) : ranks_(runs.size()) {
  for (std::size_t r = 0; r < runs.size(); ++r) {
    ranks_[r].runs = runs[r];
    ranks_[r].finished = !runs[r];  // mirrors are neither live nor able to block
    if (runs[r]) ++live_;
  }
  thread_ = std::this_thread::get_id();
}

void RankScheduler::block_until(int rank, double host_us, const std::function<bool()>& pred,
                                const std::function<std::string()>& what, const CommOpState* op) {
  Waiter& w = ranks_[rank];
  // `what` lives as long as this call: however the call ends (a deadlock or another rank's failure throws),
  // the rank's entry must not keep pointing at it.
  struct Forget {
    Waiter& w;
    ~Forget() {
      w.waiting_for = nullptr;
      w.waiting_op = nullptr;
    }
  } forget{w};
  w.waiting_op = op;
  while (!pred()) {
    check_aborted();
    w.blocked = true;
    w.waiting_for = &what;
    ++blocked_;
    VirtualTimeProps& props = boost::this_fiber::properties<VirtualTimeProps>();
    props.time_us = host_us;
    props.stack_hint = __builtin_frame_address(0);
    // This was the last rank that could run: only virtual time moving on can wake anybody.
    while (stalled()) {
      if (!advance_when_stalled_()) {
        declare_deadlock();
        throw RunAborted{};
      }
    }
    if (w.blocked) {
      ++fiber_switches_;
      w.suspended = boost::fibers::context::active();
      w.suspended->suspend();  // until wake() schedules it
    }
  }
  check_aborted();
}

void RankScheduler::wake(int rank) {
  Waiter& w = ranks_[rank];
  if (!w.blocked) return;
  w.blocked = false;
  --blocked_;
  woke_ = true;
  // A rank woken before it suspended (by the engine it was advancing itself) simply does not suspend.
  if (boost::fibers::context* fiber = std::exchange(w.suspended, nullptr)) {
    boost::fibers::context::active()->schedule(fiber);
  }
}

void RankScheduler::wake_all() {
  for (std::size_t r = 0; r < ranks_.size(); ++r) wake(static_cast<int>(r));
}

void RankScheduler::yield(double host_us) {
  VirtualTimeProps& props = boost::this_fiber::properties<VirtualTimeProps>();
  props.time_us = host_us;
  props.stack_hint = __builtin_frame_address(0);
  ++fiber_switches_;
  boost::this_fiber::yield();
  check_aborted();
}

void RankScheduler::finish(int rank) {
  ranks_[rank].finished = true;
  --live_;
  // The others may all be waiting for transfers only the engine can finish.
  while (live_ > 0 && stalled()) {
    if (!advance_when_stalled_()) declare_deadlock();
  }
}

void RankScheduler::fail(std::exception_ptr error) {
  if (!error_) error_ = error;
  // Once aborted, no rank blocks again (block_until checks first), so the ranks were all woken by the
  // first failure: waking them again for every rank that fails would cost the world squared.
  if (aborted_) return;
  aborted_ = true;
  wake_all();
}

void RankScheduler::declare_deadlock() {
  std::string msg = "deadlock: every rank is waiting and none can make progress.\n";
  for (std::size_t r = 0; r < ranks_.size(); ++r) {
    const Waiter& w = ranks_[r];
    if (!w.runs) continue;
    if (w.finished) {
      msg += fmt::format("  rank {}: finished its program\n", r);
    } else if (w.blocked && w.waiting_for) {
      msg += fmt::format("  rank {}: {}\n", r, (*w.waiting_for)());
    } else {
      msg += fmt::format("  rank {}: running\n", r);
    }
  }
  fail(std::make_exception_ptr(DeadlockError(msg)));
}

void RankScheduler::check_thread(int rank, const char* op) const {
  if (std::this_thread::get_id() == thread_) return;
  // Another thread cannot block or yield a fiber, and would race with the rank's own state: the run
  // cannot go on, and an exception here would only end the thread the program started.
  die(fmt::format(
      "rank {}: {} was called from a thread the rank's program started; a rank's calls must come from the "
      "thread that runs its program (the simulator runs each rank as a fiber, and a GPU stream is not "
      "shared between threads either)",
      rank, op));
}

void RankScheduler::prefetch(int rank, bool with_fiber) const {
  const Waiter& w = ranks_[rank];
  if (!with_fiber) {
    __builtin_prefetch(&w);
  } else if (w.suspended != nullptr) {
    __builtin_prefetch(w.suspended);
  }
}

}  // namespace ranklab::sim
