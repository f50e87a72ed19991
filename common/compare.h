// compare: two reports of one lesson in one configuration (typically one simulated, one measured on GPUs)
// lined up region by region and collective by collective: both times, their ratio B/A, and how far apart
// they are overall as a geometric-mean error. `ranklab compare A.json B.json` prints it and writes
// compare.html with a plot.
//
// Items are matched by what they are, not by when they happened: a region by (rank, name, occurrence) and a
// collective by (op, bytes, group, occurrence), so a run whose clock drifts still lines up.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/backend.h"
#include "common/lesson.h"
#include "common/profile.h"
#include "common/report.h"

namespace ranklab {

// ---- the configuration a report records ------------------------------------------------------------------

// A report's options (RunReport::options) parted into the lesson's, with the report's world, and the
// backend's. UsageError for a name neither the lesson nor the backend has, or a value its declaration
// refuses: the run could not be repeated faithfully.
struct RecordedOptions {
  Settings lesson;
  BackendOptions backend;
};
RecordedOptions read_recorded_options(const RunReport& report);
// What RunReport::options holds for a run of `lesson` at its defaults (empty for a lesson this build
// does not know but for the backend's).
Settings default_options(const std::string& lesson);
// Fills what `run` knows about a run beyond the backend's report: the profile's GPUs per node, the
// backend's options beside the lesson's (RunReport::options), and each link's capacity (from the
// profile's tier of that name) where the backend left it 0.
void record_run_config(RunReport& report, const Profile& profile, const BackendOptions& backend);

// ---- comparing -------------------------------------------------------------------------------------------

enum class ItemKind { Region, Collective };

// One region or collective found in both reports.
struct ComparedItem {
  ItemKind kind = ItemKind::Region;
  std::size_t row = 0;  // index of its ComparisonRow
  std::string label;    // "rank 3 forward #2", "all_reduce 64 MiB on world #7"
  double a_us = 0;
  double b_us = 0;
};

// The items of one region name, or of one (op, bytes, group) of collectives.
struct ComparisonRow {
  ItemKind kind = ItemKind::Region;
  std::string what;  // "forward", "all_reduce 64 MiB on world"
  int count = 0;     // items matched
  double a_us = 0;   // total time in A
  double b_us = 0;   // total time in B
  double error = 0;  // geometric-mean error of its items (NaN when none could be scored)
  // Collective rows: what every item of the row moved, for bus bandwidth (nccl-tests' busbw).
  CommOp op = CommOp::AllReduce;
  std::int64_t bytes = 0;
  int group_size = 0;
  double ratio() const { return a_us > 0 ? b_us / a_us : 0; }
  // Mean bus bandwidth of the row's items in A and in B, GB/s (0 for regions).
  double a_busbw_gbps() const;
  double b_busbw_gbps() const;
};

struct Comparison {
  std::string lesson;
  int world = 0;
  std::string a_name, b_name;      // what the reports are called (file names)
  std::string a_source, b_source;  // "sim, dgx-h100"
  double a_makespan_us = 0, b_makespan_us = 0;
  std::vector<ComparisonRow> rows;  // regions first, then collectives, each in order of first appearance
  std::vector<ComparedItem> items;
  // exp(mean |log(B/A)|) - 1 over the matched items with both times positive: 0.1 means the two are 10%
  // apart on a typical item, whichever is faster. NaN when no item could be scored.
  double error = 0;
  double region_error = 0;
  double collective_error = 0;
  int scored = 0;                    // items in `error`
  int only_in_a = 0, only_in_b = 0;  // items without a partner in the other report
  int unmeasured = 0;  // matched items with no duration (a null time) in either report, left out
};

// Lines up `a` and `b`. Raises UsageError, naming both values, when they are of different lessons or world
// sizes, or (when both recorded them) were run with different options.
Comparison compare_reports(const RunReport& a, const RunReport& b, const std::string& a_name = "A",
                           const std::string& b_name = "B");

// exp(mean |log r|) - 1 over the ratios; NaN for none. Ratios that are not positive and finite are skipped.
double geomean_error(const std::vector<double>& ratios);

// The terminal table.
std::string format_comparison(const Comparison& c);
// compare.html: the table, a log-log plot of B against A (one point per item), and bus bandwidth against
// size for A and B (log-log, one line per collective and group), as nccl-tests users read a sweep.
std::string comparison_to_html(const Comparison& c);

}  // namespace ranklab
