// Measurements made outside ranklab, read into a RunReport so that `compare` and `calibrate` treat them
// like any other run:
//
//  - nccl-tests output, as every `*_perf` tool prints it (NVIDIA/nccl-tests, src/common.cu): one row per
//    size with out-of-place and in-place times. The tools print no operation name, so it comes from the
//    caller, from the command line or tool name in the log, or from the ratio busbw / algbw, which is
//    each operation's bus factor (doc/PERFORMANCE.md of nccl-tests);
//  - a PyTorch profiler (Kineto) trace per rank: NCCL kernels become collectives (sized from the
//    "In msg nelems" / "dtype" / "Group size" arguments PyTorch records, or from the kernel name), and
//    every other GPU kernel becomes a compute region;
//  - a CSV of timings typed by hand: `op,bytes,ranks,time_us`, or of bandwidths as benchmark summaries
//    publish them (`busbw_gbps` or `algbw_gbps` in place of `time_us`).
//
// Every reader names the file and line (or trace event) of anything it cannot use.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/report.h"

namespace ranklab {

// The group name of a collective run in place (output buffer = input buffer), as nccl-tests' second set
// of columns measures it.
extern const char* const kInPlaceGroup;

enum class MeasurementFormat { Report, NcclTests, Csv, Kineto };
const char* measurement_format_name(MeasurementFormat f);

// What a file holds, from its first bytes: report.json, a Kineto trace, nccl-tests output, or CSV.
// UsageError naming the file when it is none of them.
MeasurementFormat detect_measurement_format(const std::string& text, const std::string& origin);

// The collective a measurement of unknown operation ran. An operation named on the command line wins,
// then one named in the log ("all_reduce_perf") or in its file name.
std::optional<CommOp> comm_op_from_text(const std::string& text);

// How nccl-tests times a row (BenchTime and TimeTest in src/common.cu of NVIDIA/nccl-tests): first
// `warmup_iters` untimed launches of every size, then, per size and placement, a barrier, `iters` launches
// back to back and one stream synchronize, timed on the host clock; the time printed is that elapsed time
// divided by iters, averaged over the ranks. So a size whose collective takes less than the host's launch
// overhead is timed at the launch rate, as a real training step would be.
struct NcclTestsLoop {
  int warmup_iters = 5;  // nccl-tests' default, -w 5
  int iters = 20;        // nccl-tests' default, -n 20
  // GPUs one thread drives (-g, "nGpus" in the header). Every launch of the loop is then one
  // ncclGroupStart, a call per GPU and ncclGroupEnd from that thread (startColl in src/common.cu), so the
  // thread launches the kernels of all its GPUs, one after the other, in every iteration.
  int gpus_per_thread = 1;
};

// nccl-tests output. `op` when known; otherwise inferred as above (UsageError when it cannot be).
// The report has one collective per size and placement, in the order nccl-tests ran them: out-of-place on
// group "world", then in-place on group kInPlaceGroup; world and GPU come from the "# Using devices" lines.
// The loop's counts come from the header ("nGpus 8 ... warmup iters: 5 iters: 20"), else nccl-tests'
// defaults, and are kept in the report's options "warmup_iters", "iters" and "gpus_per_thread".
RunReport read_nccl_tests(const std::string& text, const std::string& origin, std::optional<CommOp> op);

// The timing loop of a report read_nccl_tests made; nullopt for any other report (its times are each
// collective's own, as a profiler or a hand-made table gives them).
std::optional<NcclTestsLoop> nccl_tests_loop(const RunReport& r);

// `op,bytes,ranks,time_us` with a header line; op is a ranklab name (all_reduce) or an nccl-tests one
// (allreduce). Every row must have the same number of ranks. In place of time_us a table may give
// busbw_gbps or algbw_gbps, nccl-tests' bandwidths (doc/PERFORMANCE.md): the time is bytes / algbw, and
// algbw is busbw over the operation's bus factor. A comment line before the header,
// "# nccl-tests loop: nGpus 8 warmup iters: 5 iters: 40" (the words of nccl-tests' own header), says the
// rows are one nccl-tests run's, timed by its loop (NcclTestsLoop): the report is then an nccl-tests
// report of its one collective, replayed as one.
RunReport read_measurement_csv(const std::string& text, const std::string& origin);

// One Kineto trace per rank (Chrome trace JSON with "traceEvents"), given as (origin, text) in rank order
// unless the traces name their rank ("distributedInfo": {"rank": r}). Collectives whose group is larger
// than the traces given are an error: a comparison per rank needs every rank's trace.
RunReport read_kineto_traces(const std::vector<std::pair<std::string, std::string>>& traces);

// Any of the above from files: one path, or one Kineto trace per rank.
RunReport read_measurements(const std::vector<std::string>& paths, std::optional<CommOp> op);

}  // namespace ranklab
