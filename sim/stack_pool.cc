#include "sim/stack_pool.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "common/errors.h"
#include "sim/rank_faults.h"

namespace ranklab::sim {

namespace {
// The canary: this many bytes at the bottom of an unguarded stack, which must still read zero when its
// fiber ends. The kernel hands out zeroed pages, so the canary costs nothing to lay: writing a pattern
// instead made every stack's lowest page resident, a quarter of the memory of a 65,536-rank run.
constexpr std::size_t kCanaryBytes = 64;
}  // namespace

StackPool::StackPool(std::size_t stacks, std::size_t stack_bytes)
    : guarded_(stacks <= kGuardedStacks), slots_(stacks) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  page_ = page;
  const std::size_t rounded = (stack_bytes + page - 1) / page * page;
  slot_bytes_ = rounded + (guarded_ ? page : 0);
  mapped_bytes_ = slot_bytes_ * stacks;
  // MAP_NORESERVE: untouched stack pages cost nothing, so a large world fits in a laptop's memory.
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    throw Error(fmt::format("cannot reserve {} fiber stacks of {} KiB ({} MiB of address space)", stacks,
                            stack_bytes / 1024, mapped_bytes_ >> 20));
  }
  base_ = static_cast<char*>(p);
  for (std::size_t i = 0; guarded_ && i < stacks; ++i) {
    // The lowest page of each slot is the guard: stacks grow down into it.
    if (mprotect(base_ + i * slot_bytes_, page, PROT_NONE) != 0) {
      munmap(base_, mapped_bytes_);
      throw Error(
          fmt::format("cannot protect the guard page of fiber stack {} (vm.max_map_count too low for {} "
                      "ranks?)",
                      i, stacks));
    }
  }
}

StackPool::~StackPool() {
  if (base_) munmap(base_, mapped_bytes_);
}

boost::context::stack_context StackPool::take() {
  if (next_ == slots_) throw std::bad_alloc();
  boost::context::stack_context sc;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  sc.size = slot_bytes_ - (guarded_ ? page : 0);
  sc.sp = base_ + (next_ + 1) * slot_bytes_;  // the top: stacks grow down
  ++next_;
  return sc;
}

int StackPool::guard_page_owner(const void* address) const noexcept {
  if (!guarded_ || base_ == nullptr) return -1;
  const auto a = reinterpret_cast<std::uintptr_t>(address), b = reinterpret_cast<std::uintptr_t>(base_);
  if (a < b || a >= b + next_ * slot_bytes_) return -1;
  if ((a - b) % slot_bytes_ >= page_) return -1;  // inside a stack, not its guard
  return static_cast<int>((a - b) / slot_bytes_);
}

void StackPool::give_back(const boost::context::stack_context& sc) const noexcept {
  if (guarded_) return;
  const auto* bottom = static_cast<const unsigned char*>(sc.sp) - sc.size;
  for (std::size_t i = 0; i < kCanaryBytes; ++i) {
    if (bottom[i] == 0) continue;
    const int rank = static_cast<int>((reinterpret_cast<const char*>(bottom) - base_) / slot_bytes_);
    die(stack_overflow_message(rank, sc.size) +
        fmt::format(" (above {} ranks stacks have no guard pages, so the overflow was found when the rank "
                    "ended and may have corrupted its neighbour)",
                    kGuardedStacks));
  }
}

}  // namespace ranklab::sim
