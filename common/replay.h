// replay: the collectives of a measured run as an SPMD program, so any backend can run them again — the
// simulator to predict what was measured (`ranklab compare nccl-tests.log`), the GPUs to measure it anew.
//
// Each collective runs alone, in the measured order, on phantom tensors of the measured size. How it is
// timed follows how it was measured:
//  - nccl-tests output: nccl-tests' own loop (NcclTestsLoop, common/measurements.h). Every size is warmed
//    up untimed; then each row is a barrier, `iters` launches back to back and a synchronize, and its time
//    is the host's time for that (a region around it) over iters, averaged over the ranks. The host's
//    launch overhead, NCCL's latency and the bandwidth all show where they do on the machine: a size whose
//    collective is shorter than a launch is timed at the launch rate.
//  - anything else (a profiler's kernels, a table by hand): each collective once, then synchronize(); its
//    time is its own, from its start to its end on the device.
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
// its size where the replay had to round it to whole elements). For nccl-tests' loop, each row's launches
// become one collective with the row's time as nccl-tests prints it, and the loops' regions are removed.
void label_as_replay(RunReport& replayed, const RunReport& measured);

}  // namespace ranklab
