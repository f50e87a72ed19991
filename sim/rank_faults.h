// What ends a simulated run from inside a rank without an exception: a fiber stack overflow (a fault in
// a guard page), a rank calling exit(), a rank's call made from a thread of its own. Each ends the
// process with a message naming the rank, after flushing what the run printed, instead of a bare
// SIGSEGV, a process that never ends or a bad_cast.
#pragma once

#include <cstddef>
#include <string>

namespace ranklab::sim {

class StackPool;

// While one exists, on the thread that runs the fibers: a SIGSEGV in one of `pool`'s guard pages (null:
// no guard pages) names the rank whose stack overflowed, and exit() called by a rank names the rank.
class RankFaultGuard {
 public:
  RankFaultGuard(const StackPool* pool, std::size_t stack_bytes);
  ~RankFaultGuard();
  RankFaultGuard(const RankFaultGuard&) = delete;
  RankFaultGuard& operator=(const RankFaultGuard&) = delete;
};

// The rank whose fiber runs on this thread now, or -1.
int running_rank();
void set_running_rank(int rank);

// Flushes stdout, prints "ranklab: error: MESSAGE" on stderr and ends the process with status 1.
[[noreturn]] void die(const std::string& message);

// The message a stack overflow of `rank` ends the run with.
std::string stack_overflow_message(int rank, std::size_t stack_bytes);

}  // namespace ranklab::sim
