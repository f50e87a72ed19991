// What the GPT lesson prints and reports: before the run, the configuration and the memory plan; after it,
// the timed step's figures, gathered from every rank to rank 0.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "common/rank.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/check.h"
#include "lessons/gpt/config.h"
#include "lessons/parallel/exposed.h"
#include "lessons/parallel/groups.h"
#include "lessons/parallel/pipeline.h"

namespace ranklab::gpt {

// Rank 0's lines before the run: the model and its batch, the layout and its groups, a step's FLOPs and
// every stage's memory plan.
void print_plan(Rank& r, const Config& c, const parallel::Layout& layout,
                const std::vector<MemoryPlan>& plans);

// What a rank measured in the timed step (the last).
struct StepMeasures {
  double step_us = 0;                                     // by events on the rank's compute stream
  std::array<double, parallel::kDims> exposed_us{};       // the compute stream waiting, per dimension
  std::array<double, parallel::kDims> communicated_us{};  // the dimension's operations' own time
  parallel::PipelineTimes pipeline;                       // its tasks' busy time and the schedule's span
  std::int64_t peak_bytes = 0;                            // the rank's peak memory during the step
  double host_wait_us = 0;  // the compute stream idle for the host's next launch (Rank::host_wait_us)
  std::int64_t moe_routes = 0, moe_dropped = 0;  // this rank's MoE layers' routes, and those dropped
};

// The figures summed over the world. Only the ranks that measure (replica 0's) contribute, and each counts
// itself in measuring_ranks: over it, the sums are means over those ranks, however many there are (in a
// symmetric simulation the mirrors of replica 0 contribute its figures once more each).
struct SummedFigures {
  std::array<float, parallel::kDims> exposed_us{};
  std::array<float, parallel::kDims> communicated_us{};
  float busy_us = 0;
  float window_us = 0;  // travels with the others; the printout takes the largest (LargestFigures)
  float measuring_ranks = 0;
  float moe_routes = 0, moe_dropped = 0;  // every rank's (not only those that measure), not divided
};
// The figures whose largest over the world rank 0 prints.
struct LargestFigures {
  float window_us = 0;  // the pipeline's: the schedule ends when the last rank's does
  // The worst relative differences from one device over the steps (0 without a reference).
  float grad_difference = 0, weight_difference = 0, loss_difference = 0;
};
// What rank 0 prints after the run.
struct StepFigures {
  SummedFigures mean;  // the sums divided by the measuring ranks
  LargestFigures most;
  std::vector<float> stage_peak_bytes;  // each stage's peak memory, from its rank with tp 0 and dp 0
  std::vector<float> losses;            // each step's loss, from the last stage (none without a reference)
};

// Every rank calls it together: one all_reduce of Sum and one of Max, in the bookkeeping region "figures".
// `measures`: this rank timed its tasks and waits.
StepFigures gather_step_figures(Rank& r, const Config& c, const parallel::Layout::Coord& me, bool measures,
                                const StepMeasures& mine, const OneDeviceCheck& check);

// Rank 0's report of the run (Rank::report_training) and its lines after it: the losses beside one device's,
// the step's time and FLOP/s, the bubble, the exposed communication, each stage's peak memory against its
// plan and the comparison with one device.
void print_summary(Rank& r, const Config& c, const std::vector<MemoryPlan>& plans, const StepMeasures& mine,
                   const StepFigures& f, const OneDeviceCheck& check);

}  // namespace ranklab::gpt
