// Backend: the SPMD spawn of the lecture. launch() runs `fn` once per rank and returns what happened.
#pragma once

#include <functional>
#include <string>

#include "common/options.h"
#include "common/rank.h"
#include "common/report.h"

namespace ranklab {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Runs fn on `world` ranks. Errors in any rank end the run: the first error is rethrown after every
  // rank has unwound. The report is returned even when a lesson's check failed (see all_checks_passed).
  virtual RunReport launch(int world, const std::function<void(Rank&)>& fn) = 0;
  // Whether this process holds the whole report. Under mpirun each process runs one rank and only one
  // of them assembles the report; the others print and write nothing.
  virtual bool owns_report() const { return true; }
};

// What a run asks of its backend besides the lesson: NCCL's choice, forced as NCCL_ALGO and NCCL_PROTO
// force it (both backends), and the simulator's switches of its model. `ranklab run` reads them from
// its flags into the backend's configuration (SimConfig, CudaConfig); a report records them beside the
// lesson's options, so that a replay configures its simulator the same way.
struct BackendOptions {
  std::string algo;
  std::string proto;
  bool no_sm_contention = false;
  // gpt on the simulator, with --phantom: which replicas mirror a representative instead of running ("":
  // none, "tp": the tensor-parallel ranks of each (stage, dp replica), "tp-dp": one rank per stage).
  std::string symmetric;
  // Which ranks the report keeps span by span (TraceRanks::parse): what --trace-ranks says.
  std::string trace_ranks = "auto";
  // The trace's format: "perfetto" (trace.perfetto-trace) or "json" (trace.json, Chrome's format).
  std::string trace_format = "perfetto";
};
const OptionTable<BackendOptions>& backend_options();

}  // namespace ranklab
