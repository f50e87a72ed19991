// StackPool: the fibers' stacks, carved out of one memory mapping.
//
// Why: with a mapping per fiber, every fiber's exit unmaps its stack, and each unmap flushes the TLB of
// every core the process runs on (OpenBLAS keeps threads there). At 16,384 ranks those flushes were
// most of the simulator's wall time. One mapping per launch costs one unmap.
//
// Overflow: up to kGuardedStacks stacks, each keeps a guard page below it, so an overflow faults instead
// of corrupting its neighbour. A guard page splits the mapping in two, and Linux limits a process to
// vm.max_map_count mappings (65,530 by default), so larger worlds would need a system setting changed.
// They get no guard pages (one mapping in all) and a canary instead: the bottom bytes of each stack, which
// must still read zero (as the kernel maps them) when its fiber ends; an overwritten canary stops the run
// with a message (after flushing the output), since the neighbour's stack may be corrupt.
#pragma once

#include <boost/context/stack_context.hpp>
#include <cstddef>

namespace ranklab::sim {

class StackPool {
 public:
  // Worlds up to this many ranks get guard pages: two mappings per stack stay well below the default
  // vm.max_map_count, leaving room for the allocator's own mappings.
  static constexpr std::size_t kGuardedStacks = 16384;

  StackPool(std::size_t stacks, std::size_t stack_bytes);
  ~StackPool();
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;

  boost::context::stack_context take();
  // Checks the canary of a stack handed out by take() (nothing to check with guard pages).
  void give_back(const boost::context::stack_context& sc) const noexcept;
  bool guarded() const { return guarded_; }
  // The index of the stack (in the order take() handed them out: the rank) whose guard page holds
  // `address`, or -1. Safe in a signal handler.
  int guard_page_owner(const void* address) const noexcept;

 private:
  char* base_ = nullptr;
  bool guarded_ = true;
  std::size_t slot_bytes_ = 0;  // guard page (when guarded) + stack
  std::size_t slots_ = 0;
  std::size_t next_ = 0;
  std::size_t mapped_bytes_ = 0;
  std::size_t page_ = 0;
};

// The allocator Boost.Fiber is handed: a copyable handle on a pool that outlives the fibers.
class PooledStack {
 public:
  explicit PooledStack(StackPool& pool) : pool_(&pool) {}
  boost::context::stack_context allocate() { return pool_->take(); }
  // The pool unmaps everything at once; this only checks for an overflow.
  void deallocate(boost::context::stack_context& sc) noexcept { pool_->give_back(sc); }

 private:
  StackPool* pool_;
};

}  // namespace ranklab::sim
