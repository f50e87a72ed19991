#include "sim/sim_backend.h"

#include <fmt/format.h>

#include <boost/fiber/all.hpp>
#include <thread>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "common/errors.h"
#include "sim/asan_fibers.h"
#include "sim/host_memory.h"
#include "sim/malloc_tuning.h"
#include "sim/rank_faults.h"
#include "sim/scheduler.h"
#include "sim/sim_rank.h"
#include "sim/stack_pool.h"
#include "sim/world.h"

namespace ranklab {

SimBackend::SimBackend(SimConfig config) : config_(std::move(config)) {}

namespace {

#if defined(__GLIBC__) && !defined(RANKLAB_SANITIZE)
// Free bytes in glibc's arenas after a run above which they are handed back to the system (SimBackend::
// launch): a large run's hundreds of megabytes, never a small run's few.
constexpr std::size_t kTrimAboveBytes = std::size_t{64} << 20;
#endif

#if defined(RANKLAB_SANITIZE)
// AddressSanitizer does not see fiber switches: a stack that is unmapped and mapped again keeps stale
// poison. Heap stacks are unpoisoned by the sanitizer's own allocator each time, and the part an exception
// unwinds is unpoisoned when its handler begins (sim/asan_fibers.h).
struct Stacks {
  Stacks(std::size_t count, std::size_t bytes) : stacks(count, bytes) {}
  sim::AsanFiberStacks::Allocator allocator() { return stacks.allocator(); }
  const sim::StackPool* guarded() const { return nullptr; }
  sim::AsanFiberStacks stacks;
};
#else
// One mapping for every stack, each with a guard page (see sim/stack_pool.h).
struct Stacks {
  Stacks(std::size_t count, std::size_t bytes) : pool(count, bytes) {}
  sim::PooledStack allocator() { return sim::PooledStack(pool); }
  const sim::StackPool* guarded() const { return &pool; }
  sim::StackPool pool;
};
#endif

RunReport run_fibers(const SimConfig& config, int world_size, std::int64_t host_limit,
                     const std::function<void(Rank&)>& fn, std::int64_t& fiber_switches,
                     std::size_t& timeline_held_most) {
  // Must come before any other fiber operation on this thread.
  boost::fibers::use_scheduling_algorithm<sim::VirtualTimeScheduler>();
  sim::SimWorld world(config, world_size);
  RunReport report;
  {
    // One SimRank and fiber per rank that runs: all of them, or in a symmetric world the representatives.
    std::vector<std::unique_ptr<sim::SimRank>> ranks;
    ranks.reserve(world.running_ranks());
    for (int r = 0; r < world_size; ++r) {
      if (world.runs(r)) ranks.push_back(std::make_unique<sim::SimRank>(world, r));
    }
    auto host = std::make_shared<sim::HostMemory>();
    host->limit = host_limit;
    for (auto& rank : ranks) rank->set_host_memory(host);

    Stacks stacks(ranks.size(), config.stack_bytes);  // outlives the fibers below
    // A stack overflow, or exit() called by a rank, ends the run naming the rank.
    sim::RankFaultGuard faults(stacks.guarded(), config.stack_bytes);
    std::vector<boost::fibers::fiber> fibers;
    fibers.reserve(ranks.size());
    for (auto& owned : ranks) {
      sim::SimRank* rank = owned.get();
      fibers.emplace_back(std::allocator_arg, stacks.allocator(), [&world, rank, &fn] {
        world.run_rank(rank->rank(), [&] {
          fn(*rank);
          rank->finish();
        });
      });
      fibers.back().properties<sim::VirtualTimeProps>().requeue(rank->rank(), 0.0);
    }
    for (auto& f : fibers) f.join();
    fiber_switches = world.scheduler().fiber_switches();
    timeline_held_most = world.timeline_held_most();
    world.scheduler().rethrow_if_failed();
    report = world.finish_report();
  }
  // Described once the stacks are unmapped, into the memory they held.
  report.topology = world.describe_topology();
  return report;
}

}  // namespace

RunReport SimBackend::launch(int world, const std::function<void(Rank&)>& fn) {
  const Profile& p = config_.profile;
  if (world < 1) throw UsageError(fmt::format("--world must be at least 1; got {}", world));
  if (world > p.max_world()) {
    throw UsageError(
        fmt::format("--world {} is more GPUs than profile '{}' has: {} per node x {} node(s) = {}; add nodes "
                    "with --nodes {}",
                    world, p.name, p.gpus_per_node, p.nodes, p.max_world(),
                    (world + p.gpus_per_node - 1) / p.gpus_per_node));
  }
  // Refuses before anything starts when the ranks alone would not fit in the machine's memory.
  const std::int64_t host_limit = sim::host_tensor_limit(
      world, config_.stack_bytes,
      config_.host_memory_bytes > 0 ? config_.host_memory_bytes : sim::available_host_bytes());
  // The fibers run on a thread of their own, so every launch starts from a fresh fiber scheduler and
  // leaves the caller's thread as it was.
  RunReport report;
  std::exception_ptr error;
  fiber_switches_ = 0;
  timeline_held_most_ = 0;
  std::thread runner([&] {
    try {
      report = run_fibers(config_, world, host_limit, fn, fiber_switches_, timeline_held_most_);
    } catch (...) {
      error = std::current_exception();
    }
  });
  runner.join();
#if defined(__GLIBC__) && !defined(RANKLAB_SANITIZE)
  // The run's memory was freed into the runner thread's arena, which the caller's thread (writing the
  // report's files, about a third of the run's peak at 16,384 ranks) does not reuse: handed back to the
  // system, it does not add to the process's peak. (Under the sanitizers the allocator is
  // AddressSanitizer's: glibc's arenas hold nothing, and trimming them while a planner's worker thread
  // exits faults inside glibc, in mtrim or __malloc_arena_thread_freeres. So with tcmalloc, whose central
  // lists the caller's thread reuses anyway.) A small run's few megabytes stay: trimmed, the next run
  // faults its pages in again, which took a third of a planner's thousands of small runs' time.
  if (!sim::tcmalloc_serves_malloc() && mallinfo2().fordblks > kTrimAboveBytes) malloc_trim(0);
#endif
  if (error) std::rethrow_exception(error);
  return report;
}

}  // namespace ranklab
