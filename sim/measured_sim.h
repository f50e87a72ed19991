// A measured run simulated again: what `ranklab compare`, `calibrate` and `validate` hold a measurement
// against. A ranklab report is run again as the lesson it ran, with its recorded options; anything else
// (nccl-tests output, a profiler's trace, a hand-made table) as its collectives, replayed in the measured
// order and timed as they were measured (common/replay.h).
#pragma once

#include <string>

#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"

namespace ranklab {

// `measured` simulated on `profile` (its `nodes` as set). `algorithm` and `protocol` force NCCL's choice
// for replayed collectives, as NCCL_ALGO and NCCL_PROTO did where a measurement was made under them ("" =
// the model chooses); a ranklab report keeps the choice its options record. UsageError for a ranklab
// report that records no options.
RunReport simulate_measured(const RunReport& measured, const Profile& profile,
                            const std::string& algorithm = "", const std::string& protocol = "");

}  // namespace ranklab
