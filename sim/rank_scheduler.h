// RankScheduler: which ranks run, which wait and for what, and what happens when none can run.
//
// Every rank is a fiber on one thread. A rank that needs an outcome another rank or the network has not
// produced yet blocks in block_until: its fiber suspends until something wake()s it and the condition holds.
// When every live rank is blocked, only virtual time can move things on: the scheduler calls its stall
// handler (the world moves the transfer engine to its next event, which may wake ranks). When the handler
// has nothing left to move, nothing can wake anyone: that is a deadlock, reported with what each rank
// waits for. A rank that fails ends the run: the others are woken and unwind (RunAborted).
//
// The ready fibers run in order of their virtual clocks (VirtualTimeScheduler, sim/scheduler.h); yield()
// lets ranks whose clocks are behind the caller's go first.
#pragma once

#include <boost/fiber/context.hpp>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace ranklab::sim {

struct CommOpState;

// Thrown inside a rank's fiber to unwind it after another rank failed; never escapes the launch.
struct RunAborted {};

class RankScheduler {
 public:
  // `runs[r]`: whether rank r runs a program of its own; the others (mirrors of a symmetric run) never run
  // and count as finished.
  explicit RankScheduler(const std::vector<bool>& runs);

  // What moves virtual time when every live rank is blocked; it returns false when nothing is left to move.
  void set_stall_handler(std::function<bool()> advance) { advance_when_stalled_ = std::move(advance); }

  // Blocks `rank`'s fiber until pred() holds. `host_us` is its clock, by which the fiber is queued when
  // woken; `what` describes the wait for deadlock reports; `op` is the operation it waits for, if the wait
  // is for one (an operation that ends wakes the members waiting for it, or for no operation: waiting_op).
  void block_until(int rank, double host_us, const std::function<bool()>& pred,
                   const std::function<std::string()>& what, const CommOpState* op = nullptr);
  // Makes a blocked rank runnable again (it checks its condition when it runs); nothing if it is not blocked.
  void wake(int rank);
  // Lets the ready ranks whose clocks are behind `host_us` run first.
  void yield(double host_us);
  // Whether wake() woke a blocked rank since clear_woke().
  bool woke() const { return woke_; }
  void clear_woke() { woke_ = false; }

  // The rank's program has returned (or unwound). If the others are all blocked, the stall handler runs
  // until one can go on.
  void finish(int rank);

  // The operation `rank` is blocked for (null while it waits for anything else, or does not wait).
  const CommOpState* waiting_op(int rank) const { return ranks_[rank].waiting_op; }

  // Ends the run with `error` (the first one wins): every blocked rank is woken to unwind.
  void fail(std::exception_ptr error);
  // Throws RunAborted once the run has failed.
  void check_aborted() const {
    if (aborted_) throw RunAborted{};
  }
  void rethrow_if_failed() const {
    if (error_) std::rethrow_exception(error_);
  }
  // Ends the process naming `rank` and `op` unless called on the thread that runs the fibers.
  void check_thread(int rank, const char* op) const;

  // How many times a rank gave way to another so far: each block on an outcome, each yield.
  std::int64_t fiber_switches() const { return fiber_switches_; }
  // Starts loading what waking `rank` reads, for loops over many ranks: its entry, and with `with_fiber`
  // its suspended fiber (whose address the entry holds: ask for the entry on an earlier pass).
  void prefetch(int rank, bool with_fiber) const;

 private:
  struct Waiter {
    bool runs = true;  // false for a mirror, which is finished from the start
    bool finished = false;
    bool blocked = false;
    // What it waits for, for deadlock reports: block_until's description, valid while the rank is blocked
    // (pointed to, not copied: a copy would cost an allocation per rank at every wait).
    const std::function<std::string()>* waiting_for = nullptr;
    // The rank's fiber while it is suspended in block_until; wake() hands it back to the fiber scheduler.
    // (Suspending and scheduling the fiber directly does what a fiber mutex and condition variable would,
    // without their locks: every fiber runs on one thread, and a wait happens at every rank for every
    // operation.)
    boost::fibers::context* suspended = nullptr;
    const CommOpState* waiting_op = nullptr;
  };
  bool stalled() const { return blocked_ == live_ && !aborted_; }
  void wake_all();
  void declare_deadlock();

  std::vector<Waiter> ranks_;
  std::function<bool()> advance_when_stalled_;
  int live_ = 0;
  int blocked_ = 0;
  bool woke_ = false;
  bool aborted_ = false;
  std::exception_ptr error_;
  std::int64_t fiber_switches_ = 0;
  std::thread::id thread_;
};

}  // namespace ranklab::sim
