// The simulator backend: every rank is a Boost.Fiber fiber on the calling thread, tensors hold real
// numbers in host memory (Eigen over float buffers, GEMM through OpenBLAS), and time is virtual: it comes
// from the profile's GPU (a roofline) and links (the network model), never from the wall clock.
#pragma once

#include <memory>

#include "common/backend.h"
#include "common/profile.h"

namespace ranklab {

struct SimConfig {
  Profile profile;
  // Fiber stack size. OpenBLAS and Eigen put packing buffers on the stack; 256 KiB leaves room (see
  // docs/architecture.md). Stacks are mmap'd, so untouched pages cost no memory.
  std::size_t stack_bytes = 256 * 1024;
  // Print the lesson's lines as they come (they are in the report either way).
  bool echo_output = true;
  // Force NCCL's choice, as NCCL_ALGO and NCCL_PROTO do ("" = choose; see sim/network_model.h).
  std::string algorithm{};
  std::string protocol{};
  // Host memory the simulator may take, in bytes: 0 reads what the machine has available at launch
  // (sim/host_memory.h); a launch whose ranks need more is refused before it starts.
  std::int64_t host_memory_bytes = 0;
};

class SimBackend : public Backend {
 public:
  explicit SimBackend(SimConfig config);
  explicit SimBackend(Profile profile) : SimBackend(SimConfig{std::move(profile)}) {}
  std::string name() const override { return "sim"; }
  RunReport launch(int world, const std::function<void(Rank&)>& fn) override;

 private:
  SimConfig config_;
};

}  // namespace ranklab
