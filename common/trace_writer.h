// The run as a Chrome trace (the Trace Event Format, "JSON Object Format"), which Perfetto
// (ui.perfetto.dev) and chrome://tracing open: one process per rank, and in each a track for compute, one
// for communication (transfers and the waits before them), one for idle time (neither stream busy: the
// bubble) and one for the lesson's regions. Sends are joined to their receives by flow arrows.
#pragma once

#include <string>
#include <vector>

#include "common/report.h"

namespace ranklab {

struct TimeRange {
  double start_us = 0;
  double end_us = 0;
};

// For each rank below report.ranks.size() (or world), the intervals of [0, the rank's end] in which
// neither a compute nor a comm span is busy; their total is RankSummary::idle_us. None for a rank whose
// timeline the report did not keep (RunReport::traces).
std::vector<std::vector<TimeRange>> idle_intervals(const RunReport& report);

// The trace as one JSON object. Timestamps are the report's microseconds, as the format expects.
std::string report_to_trace_json(const RunReport& report);

// The same trace in Perfetto's protobuf format (a Trace message: track descriptors, then each slice's begin
// and end as TrackEvents, names interned, arrows as flow ids), which ui.perfetto.dev and trace_processor
// read; a fraction of the JSON's size. A process track per traced rank (pid = rank + 1), and under it a track
// per stream lane as in the JSON trace. Timestamps in nanoseconds.
std::string report_to_perfetto(const RunReport& report);

}  // namespace ranklab
