// The simulator backend: every rank is a Boost.Fiber fiber on the calling thread, tensors hold real
// numbers in host memory (Eigen over float buffers, GEMM through OpenBLAS), and time is virtual: it comes
// from the profile's GPU (a roofline) and links (the network model), never from the wall clock.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/backend.h"
#include "common/profile.h"
#include "common/trace_ranks.h"

namespace ranklab {

// A world whose ranks fall into classes that do the same work: ranks that differ only along the
// replicated dimensions of a grid (tensor- and data-parallel replicas of a pipeline stage). The simulator
// then runs one rank per class, the representative (index 0 along every replicated dimension), and
// lets the others, its mirrors, take part in its communication as copies of it: each collective still
// moves what the whole group moves, and the traffic the other classes' groups would put on the network
// at the same moment (their images under the symmetry) runs beside it as flows. Times, memory and link
// traffic are those of the full run; the cost is that of one rank per class. Only phantom tensors:
// a mirror holds no numbers of its own. A mirror's pieces of an uneven all_to_all are its representative's
// moved by its distance from it in the group: what a program whose pieces depend on where their peers sit
// relative to it (a shift around a ring) does.
struct SimSymmetry {
  std::vector<int> dims;         // the world as a grid, innermost first: rank = i0 + d0 (i1 + d1 (i2 ...))
  std::vector<bool> replicated;  // per dimension: do ranks that differ only here do the same work?
  bool enabled() const { return !dims.empty(); }
};

struct SimConfig {
  Profile profile;
  // Fiber stack size. OpenBLAS and Eigen put packing buffers on the stack; 256 KiB leaves room (see
  // docs/architecture.md). Stacks are mmap'd, so untouched pages cost no memory.
  std::size_t stack_bytes = 256 * 1024;
  // Print the lesson's lines as they come (they are in the report either way).
  bool echo_output = true;
  // Force NCCL's choice, as NCCL_ALGO and NCCL_PROTO do ("" = choose; see sim/net/network_model.h).
  std::string algorithm{};
  std::string protocol{};
  // Host memory the simulator may take, in bytes: 0 reads what the machine has available at launch
  // (sim/host_memory.h); a launch whose ranks need more is refused before it starts.
  std::int64_t host_memory_bytes = 0;
  // Empty: every rank runs (the default). See SimSymmetry.
  SimSymmetry symmetry{};
  // The "[simulating] N operations" line on stderr (shown only when it is a terminal). Off where the
  // caller shows progress of its own across many runs (`ranklab plan`).
  bool progress = true;
  // The report's timeline: every kernel's and transfer's span and every collective's record. Off where the
  // caller reads only the training figures and the memory peaks (`ranklab plan`): a step of thousands of
  // micro-batches then keeps nothing per operation, and the ranks' busy times read 0.
  bool keep_timeline = true;
  // Which ranks keep their spans, regions and collective records (every rank's totals are kept either way).
  TraceRanks trace_ranks{};
  // A compute kernel that runs while communication is in flight on its GPU gets the SMs the communication
  // kernel leaves and the HBM bandwidth it leaves (docs/model.md, "Communication kernels share the GPU").
  // Off: compute runs as if the GPU were its own, as before the mechanism existed.
  bool sm_contention = true;
  // Every communication call waits for the ranks whose clocks are behind its rank's, even one that only
  // marks its rank arrived at a collective still waiting for another member (SimWorld::arrival_only), and
  // a collective posted behind kernels whose times are not known yet waits for them (no deferred posts,
  // RankState::deferred_posts), and a kernel after a collective blocks until the collective ends (no
  // SimWorld::may_defer_waits). The times and the memory are the same either way, only slower to reach at
  // scale; tests compare the two.
  bool issue_in_clock_order = false;
};

class SimBackend : public Backend {
 public:
  explicit SimBackend(SimConfig config);
  explicit SimBackend(Profile profile) : SimBackend(SimConfig{std::move(profile)}) {}
  std::string name() const override { return "sim"; }
  RunReport launch(int world, const std::function<void(Rank&)>& fn) override;
  // The simulator's own work in the last launch: how many times its ranks' fibers gave way to one another,
  // blocking on an outcome (a collective's end, a kernel's start) or yielding to ranks behind them in
  // virtual time. What a run costs in real time at scale follows it; like the virtual times, it is the
  // same in every run of the same program (bench/scale_lessons.cc prints it per rank).
  std::int64_t fiber_switches() const { return fiber_switches_; }
  // The most timeline intervals one rank held at once in the last launch (RankTimeline::held): what the
  // report's totals cost in memory, which folding keeps from growing with the run's length.
  std::size_t timeline_held_most() const { return timeline_held_most_; }

 private:
  SimConfig config_;
  std::int64_t fiber_switches_ = 0;
  std::size_t timeline_held_most_ = 0;
};

}  // namespace ranklab
