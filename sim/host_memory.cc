#include "sim/host_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "common/errors.h"
#include "common/tensor.h"

namespace ranklab::sim {

namespace {

// A number in a cgroup file, or -1 ("max", missing, unreadable).
std::int64_t read_cgroup(const char* path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    return std::stoll(word);
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::int64_t available_host_bytes() {
  std::int64_t available = -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream words(line);
    std::string key;
    std::int64_t kib = 0;
    if (words >> key >> kib && key == "MemAvailable:") {
      available = kib * 1024;
      break;
    }
  }
  const std::int64_t max = read_cgroup("/sys/fs/cgroup/memory.max");
  const std::int64_t current = read_cgroup("/sys/fs/cgroup/memory.current");
  if (max > 0 && current >= 0) {
    const std::int64_t left = std::max<std::int64_t>(0, max - current);
    available = available < 0 ? left : std::min(available, left);
  }
  return available;
}

std::int64_t rank_host_bytes(std::size_t stack_bytes) {
  // A quarter of the stack resident (measured: a lesson's rank touches 20-60 KiB of 256 KiB), and about
  // 16 KiB of state, scheduling and report records.
  return static_cast<std::int64_t>(stack_bytes / 4) + 16 * 1024;
}

std::int64_t host_tensor_limit(int world, std::size_t stack_bytes, std::int64_t available) {
  if (available < 0) return 0;
  // Leave a tenth of what is available to everything else (the allocator's slack, the report's output).
  const std::int64_t usable = available / 10 * 9;
  const std::int64_t ranks = static_cast<std::int64_t>(world) * rank_host_bytes(stack_bytes);
  if (ranks > usable) {
    throw UsageError(fmt::format(
        "--world {}: the simulator needs about {} of host memory for its ranks alone (about {} each: a fiber "
        "stack and its state), more than the {} this machine has available; run at most {} ranks",
        world, format_bytes(static_cast<double>(ranks)),
        format_bytes(static_cast<double>(rank_host_bytes(stack_bytes))),
        format_bytes(static_cast<double>(available)), usable / rank_host_bytes(stack_bytes)));
  }
  return std::max<std::int64_t>(1, usable - ranks);
}

}  // namespace ranklab::sim
