// replay: the collectives of a measured run as an SPMD program, so any backend can run them again — the
// simulator to predict what was measured (`ranklab compare nccl-tests.log`), the GPUs to measure it anew.
//
// Each collective runs alone, in the measured order, on phantom tensors of the measured size, with
// synchronize() after it, as nccl-tests times one operation at a time.
#pragma once

#include <functional>

#include "common/rank.h"
#include "common/report.h"

namespace ranklab {

// The program. UsageError when a collective is of a group other than the whole world (a profiled run's
// sub-groups are not known well enough to rebuild), or of an operation replay cannot run.
std::function<void(Rank&)> replay_program(const RunReport& measured);

// The report of running replay_program(measured), made comparable with `measured`: the same lesson name,
// and each collective labelled as its measured counterpart (its group name, such as an in-place run's, and
// its size where the replay had to round it to whole elements).
void label_as_replay(RunReport& replayed, const RunReport& measured);

}  // namespace ranklab
