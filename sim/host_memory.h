// The simulator's own memory on the machine that runs it. Every rank costs a fiber stack and its state,
// and every real (not phantom) tensor holds its numbers in host memory; a large world can ask for more
// than the machine has, and the kernel's OOM killer would end the run with nothing printed. So a launch
// first estimates what its ranks need and refuses when that will not fit, and the ranks' real tensors,
// all together, may not grow past what was available at launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ranklab::sim {

// The bytes of host memory the simulator may still take: MemAvailable from /proc/meminfo, or the
// cgroup's limit less its usage where that is less (containers); -1 when neither can be read.
std::int64_t available_host_bytes();

// A rough per-rank cost of the simulator apart from its tensors: the resident part of a fiber stack (a
// rank touches a few pages of it, OpenBLAS's packing buffers more), the rank's state, its scheduler
// entry, its report records.
std::int64_t rank_host_bytes(std::size_t stack_bytes);

// What the real tensors of every rank of one launch take, and how much they may take (0: no limit).
struct HostMemory {
  std::int64_t used = 0;
  std::int64_t limit = 0;
};

// The limit for a launch of `world` ranks given `available` bytes (-1: unknown, no limit), or a
// UsageError when the ranks alone will not fit.
std::int64_t host_tensor_limit(int world, std::size_t stack_bytes, std::int64_t available);

}  // namespace ranklab::sim
