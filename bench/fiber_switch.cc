// fiber_switch: what one fiber switch costs on this machine as the number of fibers grows, with nothing
// of the simulator around it: N fibers on the simulator's stacks (sim/stack_pool.h, 256 KiB each) that
// only yield to each other, Boost's round-robin order. A simulated rank switches at least once per
// blocking collective, so this is the floor under a large world's cost per rank and operation; what a
// run pays beyond it is the simulator's own state, evicted between two turns of the same rank
// (docs/performance.md).
//
//   build/bench/ranklab_fiber_switch [fibers ...]      (default: 512 4096 16384)
//
// Creating the fibers and touching their stacks the first time costs more than the switches; the time of
// a short run is taken from that of a longer one, so that only the switches remain.
#include <fmt/format.h>

#include <algorithm>
#include <boost/fiber/all.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "sim/stack_pool.h"

namespace {

// Seconds to run `rounds` rounds in which each of `fibers` fibers yields once.
double run_seconds(int fibers, int rounds) {
  ranklab::sim::StackPool pool(static_cast<std::size_t>(fibers), 256 * 1024);
  const auto start = std::chrono::steady_clock::now();
  std::vector<boost::fibers::fiber> all;
  all.reserve(static_cast<std::size_t>(fibers));
  for (int i = 0; i < fibers; ++i) {
    all.emplace_back(std::allocator_arg, ranklab::sim::PooledStack(pool), [rounds] {
      for (int r = 0; r < rounds; ++r) boost::this_fiber::yield();
    });
  }
  for (auto& f : all) f.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> counts;
  for (int i = 1; i < argc; ++i) counts.push_back(std::atoi(argv[i]));
  if (counts.empty()) counts = {512, 4096, 16384};
  fmt::print("{:>8} {:>14}\n", "fibers", "ns per switch");
  for (const int n : counts) {
    if (n < 1) {
      fmt::print(stderr, "fiber counts must be positive, got {}\n", n);
      return 2;
    }
    // About four million switches in the longer run whatever the count.
    const int rounds = std::max(8, (1 << 22) / n);
    const double extra_s = run_seconds(n, 2 * rounds) - run_seconds(n, rounds);
    fmt::print("{:>8} {:>14.0f}\n", n, extra_s * 1e9 / (static_cast<double>(n) * rounds));
  }
  return 0;
}
