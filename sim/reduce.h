// The numerics of communication: what each member's output holds once an operation executes. Done in
// one place, in member order, so results are deterministic and the same on every run.
#pragma once

#include <cstdint>

#include "sim/comm_op.h"

namespace ranklab::sim {

// The `size` nccl-tests reports for a collective (doc/PERFORMANCE.md of NVIDIA/nccl-tests): the
// buffer size for all_reduce, broadcast and reduce; the total gathered or scattered size otherwise.
std::int64_t nccl_size_bytes(const CommOpState& op);

// Writes every member's output. Phantom tensors carry no numbers, so nothing is done for them.
void run_numerics(CommOpState& op);

}  // namespace ranklab::sim
