#include "sim/asan_fibers.h"

#if defined(RANKLAB_SANITIZE)

#include <dlfcn.h>
#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <vector>

namespace ranklab::sim {

namespace {

struct Bounds {
  char* low = nullptr;
  char* high = nullptr;
};
// Per launching thread: every fiber's stack, sorted by address when `sorted` says so.
thread_local std::vector<Bounds> tl_stacks;
thread_local bool tl_sorted = true;

// Unpoisons the dead part of the fiber stack `frame` is on: everything below `frame`. (The stack is found
// by address, not by the running rank, which the scheduler sets only when it picks a fiber.)
bool unpoison_below(char* frame) {
  if (tl_stacks.empty()) return false;
  if (!tl_sorted) {
    std::sort(tl_stacks.begin(), tl_stacks.end(),
              [](const Bounds& a, const Bounds& b) { return a.low < b.low; });
    tl_sorted = true;
  }
  auto it = std::upper_bound(tl_stacks.begin(), tl_stacks.end(), frame,
                             [](char* f, const Bounds& b) { return f < b.low; });
  if (it == tl_stacks.begin()) return false;
  --it;
  if (frame <= it->low || frame > it->high) return false;  // not on a fiber's stack
  __asan_unpoison_memory_region(it->low, static_cast<std::size_t>(frame - it->low));
  return true;
}

}  // namespace

__attribute__((noinline)) void unpoison_dead_stack() {
  unpoison_below(static_cast<char*>(__builtin_frame_address(0)));
}

AsanFiberStacks::AsanFiberStacks(std::size_t count, std::size_t bytes) : bytes_(bytes) {
  tl_stacks.clear();
  tl_stacks.reserve(count);
}

AsanFiberStacks::~AsanFiberStacks() {
  tl_stacks.clear();
}

boost::context::stack_context AsanFiberStacks::Allocator::allocate() {
  void* p = std::malloc(owner_->bytes_);
  if (p == nullptr) throw std::bad_alloc();
  boost::context::stack_context sc;
  sc.size = owner_->bytes_;
  sc.sp = static_cast<char*>(p) + owner_->bytes_;  // stacks grow down
  tl_stacks.push_back({static_cast<char*>(p), static_cast<char*>(sc.sp)});
  tl_sorted = false;
  return sc;
}

void AsanFiberStacks::Allocator::deallocate(boost::context::stack_context& sc) noexcept {
  std::free(static_cast<char*>(sc.sp) - sc.size);
}

}  // namespace ranklab::sim

// Instrumented code calls this before anything that does not return: a throw, and the _Unwind_Resume that
// ends every cleanup (destructors) an exception runs on its way up. On a fiber's stack it unpoisons the
// dead frames below the caller, which is what the sanitizer's own would do if it knew the fiber's stack;
// elsewhere (a thread's own stack) it is the sanitizer's. The executable's definition comes before the
// sanitizer runtime's.
extern "C" void __asan_handle_no_return(void) {
  if (ranklab::sim::unpoison_below(static_cast<char*>(__builtin_frame_address(0)))) return;
  using Fn = void (*)();
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "__asan_handle_no_return"));
  if (real != nullptr) real();
}

// Every catch handler calls this first: the frames the exception unwound are dead.
extern "C" void* __cxa_begin_catch(void* exception) noexcept {
  using Fn = void* (*)(void*) noexcept;
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "__cxa_begin_catch"));
  ranklab::sim::unpoison_below(static_cast<char*>(__builtin_frame_address(0)));
  return real(exception);
}

#endif
