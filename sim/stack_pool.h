// StackPool: the fibers' stacks, carved out of one memory mapping.
//
// Why: with a mapping per fiber, every fiber's exit unmaps its stack, and each unmap flushes the TLB of
// every core the process runs on (OpenBLAS keeps threads there). At 16,384 ranks those flushes were
// most of the simulator's wall time. One mapping per launch costs one unmap. Each stack keeps a guard
// page below it, so an overflow still faults instead of corrupting its neighbour.
#pragma once

#include <boost/context/stack_context.hpp>
#include <cstddef>

namespace ranklab::sim {

class StackPool {
 public:
  StackPool(std::size_t stacks, std::size_t stack_bytes);
  ~StackPool();
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;

  boost::context::stack_context take();

 private:
  char* base_ = nullptr;
  std::size_t slot_bytes_ = 0;  // guard page + stack
  std::size_t slots_ = 0;
  std::size_t next_ = 0;
  std::size_t mapped_bytes_ = 0;
};

// The allocator Boost.Fiber is handed: a copyable handle on a pool that outlives the fibers.
class PooledStack {
 public:
  explicit PooledStack(StackPool& pool) : pool_(&pool) {}
  boost::context::stack_context allocate() { return pool_->take(); }
  void deallocate(boost::context::stack_context&) noexcept {}  // the pool unmaps everything at once

 private:
  StackPool* pool_;
};

}  // namespace ranklab::sim
