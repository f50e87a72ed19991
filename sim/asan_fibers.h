// The sanitizer build's fiber stacks (RANKLAB_SANITIZE only).
//
// AddressSanitizer is not told about Boost.Fiber's context switches: Debian's Boost.Context is built on
// fcontext without BOOST_USE_ASAN, and the switches happen inside the compiled Boost.Fiber library, so no
// header option can annotate them. When an exception is thrown on a fiber's stack, the sanitizer's
// __cxa_throw interceptor asks to unpoison the stack below the throw, sees a stack pointer outside the
// thread's stack, and skips it ("ASan is ignoring requested __asan_handle_no_return"). The frames the
// exception unwinds keep their redzones poisoned, and the next calls that reuse that memory (the catch
// handler's own) are reported as stack-buffer-overflows.
//
// So the sanitizer build does that unpoisoning itself where it is safe and sure to come in time: when a
// handler begins (__cxa_begin_catch, which every catch calls first). Everything below the handler's frame
// on the rank's fiber stack is dead, and it is unpoisoned. The stacks are heap blocks, as
// boost::fibers::fixedsize_stack makes them, whose bounds are remembered per rank.
#pragma once

#include <boost/context/stack_context.hpp>
#include <cstddef>

namespace ranklab::sim {

// Code that runs while an exception unwinds a fiber's stack (a destructor in a cleanup, before any
// handler) can call into frames that reuse the dead ones below it, whose redzones are still poisoned: the
// sanitizer build unpoisons the calling fiber's stack below the caller here. Elsewhere it does nothing.
#if defined(RANKLAB_SANITIZE)
void unpoison_dead_stack();
#else
inline void unpoison_dead_stack() {}
#endif

// Hands out heap stacks and remembers, per rank (the order in which fibers take them), where each is. The
// record belongs to the launching thread, on which the fibers run.
class AsanFiberStacks {
 public:
  AsanFiberStacks(std::size_t count, std::size_t bytes);
  ~AsanFiberStacks();
  AsanFiberStacks(const AsanFiberStacks&) = delete;
  AsanFiberStacks& operator=(const AsanFiberStacks&) = delete;

  // The allocator Boost.Fiber is handed.
  class Allocator {
   public:
    explicit Allocator(AsanFiberStacks& owner) : owner_(&owner) {}
    boost::context::stack_context allocate();
    void deallocate(boost::context::stack_context& sc) noexcept;

   private:
    AsanFiberStacks* owner_;
  };
  Allocator allocator() { return Allocator(*this); }

 private:
  std::size_t bytes_;
};

}  // namespace ranklab::sim
