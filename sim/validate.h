// validate: the model against every published sweep in a folder (validation/ in the source tree), one
// nccl-tests log per published table. Each file names the machine that simulates it in a header line
//
//   # ranklab: --profile dgx-h100 --nodes 2 [--algo ring] [--proto simple]
//
// (the measurement's profile and nodes; the algorithm and protocol only where the measurement forced them,
// as NCCL_ALGO and NCCL_PROTO do). Each file is simulated as `ranklab compare` simulates it: nccl-tests' own
// loop replayed on the simulator (sim/measured_sim.h), so launches, latency and bandwidth show where they
// do on the machine. The result is one markdown table per file, bus bandwidth measured against simulated
// row by row, and the geometric mean of |error| over the ranges the model is held to; docs/validation.md
// holds these tables between marker comments, and `ranklab validate --write-doc` rewrites them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/report.h"

namespace ranklab {

// What a file's "# ranklab:" line asks for.
struct ValidationSetup {
  std::string profile;    // a profile name (`ranklab profiles`)
  int nodes = 1;          // nodes of that profile
  std::string algorithm;  // "" = the model chooses
  std::string protocol;   // "" = the model chooses
};

// The setup `text` (a file's contents) names in its one "# ranklab:" line. UsageError naming
// `origin`:line and what was wrong: no such line or more than one, an option ranklab does not know, a
// missing or malformed value, an unknown profile, algorithm or protocol.
ValidationSetup parse_validation_setup(const std::string& text, const std::string& origin);

// One measured size, out of place (nccl-tests' first set of columns).
struct ValidationRow {
  std::int64_t bytes = 0;
  double measured_us = 0;
  double simulated_us = 0;
  double measured_busbw_gbps = 0;   // from the measured time, as nccl-tests computes busbw
  double simulated_busbw_gbps = 0;  // the same from the simulated time
  std::string algorithm;            // the model's choice: "nvls/simple"
  // simulated / measured bus bandwidth - 1: +0.05 means the model is 5% too fast.
  double error() const { return simulated_busbw_gbps / measured_busbw_gbps - 1; }
};

struct FileValidation {
  std::string name;    // the file's name, without its folder
  std::string folder;  // the name of the folder it is in ("validation"), for the tables' captions
  ValidationSetup setup;
  CommOp op = CommOp::AllReduce;
  int ranks = 0;
  std::vector<ValidationRow> rows;  // every size from kValidationFirstRowBytes, in the file's order
  // Geometric mean of |error| over the rows in each range the model is held to; NaN where none.
  double error_mid = 0;    // 1 MiB to 16 GiB
  double error_large = 0;  // 256 MiB and above
  int rows_mid = 0, rows_large = 0;
};

// The sizes a table shows and the ranges it scores, in bytes.
inline constexpr std::int64_t kValidationFirstRowBytes = std::int64_t{32} << 10;  // 32 KiB
inline constexpr std::int64_t kValidationMidBytes = std::int64_t{1} << 20;        // 1 MiB
inline constexpr std::int64_t kValidationLargeBytes = std::int64_t{256} << 20;    // 256 MiB
inline constexpr std::int64_t kValidationLastBytes = std::int64_t{16} << 30;      // 16 GiB

// One file, read (common/measurements.h), checked against its setup (its ranks must fill the nodes asked
// for) and simulated. UsageError naming the file for anything it cannot use.
FileValidation validate_file(const std::string& path);

// Every *.log and *.csv file of `dir` (README.md and other files are skipped), in name order. UsageError
// when the folder has none.
std::vector<FileValidation> validate_dir(const std::string& dir);

// The markdown block of one file: a line saying what was simulated, the table, and the geometric means.
std::string format_file_validation(const FileValidation& v);
// The summary of all files: one row per file with its two geometric means, then both over all rows.
std::string format_validation_summary(const std::vector<FileValidation>& all);

// The marker comments of docs/validation.md: a file's block sits between "<!-- validate: NAME -->" and
// "<!-- /validate -->"; the summary's between "<!-- validate: summary -->" and the same closing marker.
inline constexpr const char* kValidationSummaryName = "summary";

// `doc` with every marked block replaced by what `all` gives for it now. UsageError naming `doc_origin`
// and line for a block that is not closed, a marker naming no validated file, or a validated file the doc
// has no marker for (say where it belongs by adding its empty pair of markers).
std::string update_validation_doc(const std::string& doc, const std::string& doc_origin,
                                  const std::vector<FileValidation>& all);

}  // namespace ranklab
