// The checks every backend makes on one rank's communication call before it goes anywhere: the rank
// belongs to the group, the root or peer is valid, and the tensors have the shapes the operation needs.
// One function, so the same mistake reads the same on the simulator and on GPUs.
#pragma once

#include <functional>

#include "common/rank.h"

namespace ranklab {

// `require(t, arg)` checks a tensor the call uses (defined, made by this rank); each backend brings its
// own. Raises UsageError naming the rank, the operation and what is wrong.
void check_comm_call(const CommCall& call, int rank, int world_size,
                     const std::function<void(const Tensor& t, const char* arg)>& require);

}  // namespace ranklab
