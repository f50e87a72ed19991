// RankLog: what one rank of the real backend measured, and how the logs of every rank become the run's
// RunReport.
//
// A rank reads its CUDA events at the end of a run, into device times relative to the start event it
// recorded at launch. The logs then travel to rank 0 (shared memory or MPI, as bytes), which matches each
// collective across its members. A GPU cannot tell waiting for a late member from moving bytes inside one
// NCCL kernel, so the assembly estimates it: every member's kernel ends together, the last member to
// arrive waited for nobody, so the shortest member's duration is the transfer and the rest of each
// member's duration is idle, the bubble the simulator shows too.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/report.h"

namespace ranklab {

// One communication operation as one of its members timed it on its communication stream.
struct CommTiming {
  CommOp op = CommOp::AllReduce;
  std::string key;    // the same on every member: "g0#12" (group 0, its 12th call), "p2p 0->1 #3"
  std::string group;  // for the report: "world", "group 2 {0, 1}", "p2p 0->1"
  int group_size = 0;
  std::int64_t bytes = 0;     // nccl-tests' size of the operation
  bool record_owner = false;  // the member that writes the CollectiveRecord (the group's first)
  bool bookkeeping = false;   // issued inside Rank::bookkeeping()
  double start_us = 0;
  double end_us = 0;
};

struct TimedLine {
  double time_us = 0;  // host clock when printed, to merge the ranks' lines in order
  std::string text;
};

struct RankLog {
  int rank = 0;
  int device = 0;
  std::string host;
  std::string device_name;
  double end_us = 0;
  std::int64_t peak_bytes = 0;
  std::int64_t capacity_bytes = 0;
  bool spans_truncated = false;  // the rank stopped timing kernels after its limit
  std::vector<Span> compute;     // kind Compute
  std::vector<CommTiming> comms;
  std::vector<RegionRecord> regions;
  std::vector<CheckRecord> checks;
  std::vector<TimedLine> output;
  std::optional<TrainingStats> training;  // what Rank::report_training last handed this rank
  std::vector<PipelineTask> pipeline;     // what Rank::report_pipeline handed it
};

// Bytes that travel between processes, and back.
std::string serialize(const RankLog& log);
// Raises BackendError on bytes that serialize() did not make.
RankLog deserialize(const std::string& bytes);

// The run's report from every rank's log (in any order). Fills spans (compute, comm and idle),
// collectives, regions, checks, output, per-rank summaries and GPUs per node (the most ranks one host
// ran), the training figures of the lowest rank that reported them, every rank's pipeline tasks; `backend`
// and `profile` name the run.
RunReport assemble_report(const std::vector<RankLog>& logs, const std::string& backend,
                          const std::string& profile);

}  // namespace ranklab
