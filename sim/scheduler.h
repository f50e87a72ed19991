// VirtualTimeScheduler: a Boost.Fiber scheduling algorithm that runs the ready fiber with the smallest
// virtual time first (ties broken by rank, then by arrival), so ranks issue communication in time order
// (SimWorld::arrival_only says which calls need not) and every run of a lesson interleaves its fibers the
// same way.
#pragma once

#include <boost/fiber/algo/algorithm.hpp>
#include <boost/fiber/context.hpp>
#include <boost/fiber/properties.hpp>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace ranklab::sim {

class VirtualTimeProps : public boost::fibers::fiber_properties {
 public:
  explicit VirtualTimeProps(boost::fibers::context* ctx) : fiber_properties(ctx) {}
  // The fiber's host clock; only read while the fiber waits in the ready queue. Fibers that are not
  // ranks (the launching fiber, Boost's dispatcher) stay at infinity: they run when no rank can.
  double time_us = std::numeric_limits<double>::infinity();
  int rank = -1;  // -1 for fibers that are not ranks

  // Where the fiber's stack was when it last suspended itself (the simulator sets it before a rank blocks or
  // yields); null when unknown. The scheduler fetches that part of the stack into the cache while the
  // fiber before it runs: with thousands of ranks, every switch would otherwise wait for memory.
  const void* stack_hint = nullptr;

  // Sets both and moves the fiber to its new place if it is waiting in the ready queue. (Boost's own
  // notify() only reaches algorithms that queue fibers on Boost's intrusive ready list.)
  void requeue(int new_rank, double new_time_us);

 private:
  friend class VirtualTimeScheduler;
  std::uint64_t arrival_ = 0;
  // The fiber's number in the scheduler's table of heap places, given at its first awakening.
  std::uint32_t slot_ = kNoSlot;
  static constexpr std::uint32_t kNoSlot = static_cast<std::uint32_t>(-1);
};

class VirtualTimeScheduler : public boost::fibers::algo::algorithm_with_properties<VirtualTimeProps> {
 public:
  VirtualTimeScheduler();
  ~VirtualTimeScheduler() override;

  void awakened(boost::fibers::context* ctx, VirtualTimeProps& props) noexcept override;
  boost::fibers::context* pick_next() noexcept override;
  bool has_ready_fibers() const noexcept override { return !ready_.empty(); }
  void property_change(boost::fibers::context* ctx, VirtualTimeProps& props) noexcept override;
  void suspend_until(std::chrono::steady_clock::time_point const& when) noexcept override;
  void notify() noexcept override;

  // The smallest virtual time among ready fibers (infinity when none is ready).
  double min_ready_time_us() const;
  // The scheduler installed on this thread, or null.
  static VirtualTimeScheduler* current();

 private:
  // The ready fibers as a binary min-heap on (time, rank, arrival); arrivals are unique, so the order is
  // total and the same as a sorted set's. Each fiber's place in the heap is kept in a table indexed by its
  // slot, so a fiber whose clock changes while it waits moves up or down in place. (The table is dense:
  // keeping the place in each fiber's properties cost a cache miss per level of every sift.)
  struct Entry {
    double time_us;
    std::uint64_t arrival;
    boost::fibers::context* ctx;
    const void* stack_hint;
    int rank;
    std::uint32_t slot;
  };
  static bool before(const Entry& a, const Entry& b) {
    if (a.time_us != b.time_us) return a.time_us < b.time_us;
    if (a.rank != b.rank) return a.rank < b.rank;
    return a.arrival < b.arrival;
  }
  void place(std::size_t i, const Entry& e) {
    ready_[i] = e;
    heap_place_[e.slot] = i;
  }
  void sift_up(std::size_t i);
  void sift_down(std::size_t i);
  // Starts loading what the fiber at the top of the heap will touch first when it runs.
  void prefetch_next() const;
  std::vector<Entry> ready_;
  static constexpr std::size_t kNotQueued = static_cast<std::size_t>(-1);
  std::vector<std::size_t> heap_place_;  // per slot: its index in ready_, or kNotQueued
  std::uint64_t next_arrival_ = 0;
  std::mutex mutex_;
  std::condition_variable wakeup_;
  bool flag_ = false;
};

}  // namespace ranklab::sim
