// The numerics of communication: what each member's output holds once an operation executes. Done in
// one place, in member order, so results are deterministic and the same on every run.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/comm_op.h"

namespace ranklab::sim {

// The `size` nccl-tests reports for a collective (doc/PERFORMANCE.md of NVIDIA/nccl-tests): the
// buffer size for all_reduce, broadcast and reduce; the total gathered or scattered size otherwise.
// For all_to_all that is the bytes each rank sends (its whole input, the piece to itself included); with
// uneven splits ranks send different amounts, and the size is the largest of them, the busiest sender's.
std::int64_t nccl_size_bytes(const CommOpState& op);

// Whether `op` is an all_to_all with uneven splits.
bool uneven_all_to_all(const CommOpState& op);
// The bytes member i sends to member j of an uneven all_to_all, at [i * n + j] (n members).
std::vector<std::int64_t> all_to_all_pair_bytes(const CommOpState& op);

// Writes every member's output. Phantom tensors carry no numbers, so nothing is done for them.
void run_numerics(CommOpState& op);

}  // namespace ranklab::sim
