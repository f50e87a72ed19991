// The search of `ranklab plan`: simulate the layouts candidates.h leaves, cheapest lower bound first, each
// one gpt training step with phantom tensors, until the next lower bound cannot beat the best step time
// found (the rest are pruned by the bound: none of them could win).
//
// Memory is decided by the run itself. A layout whose memory plan fits may still run out once the
// simulator allocates its transient buffers; the simulator then throws OutOfMemoryError, and the layout is
// rejected for memory with the simulator's message. So a layout the planner accepts is one the same run
// finished, and one it rejects is one the lesson or the simulator refused: `ranklab run gpt` with that
// layout runs out of memory too.
//
// Screening and confirming. Each layout is first simulated with SimConfig::symmetry set from the layout
// (the tp and dp replicas of a stage do the same work), so that one rank per pipeline stage runs instead
// of the whole world. On a machine whose fat tree hashes routes through its spines (ECMP) and splits nodes
// between leaves, that run is close to the full one but not equal to it: replicas' transfers share links
// otherwise than their images do. So the leading layouts (the first `confirm` of the ranking, and every
// layout whose screened step is within `confirm_margin` of the best) are simulated again with every rank
// running, and their full figures are what the ranking uses and prints. Should a full run come out slower
// than its screening, a layout pruned against the screened step may beat it after all: any such layout is
// screened then, and the leaders confirmed again, until neither changes.
//
// Simulations run `jobs` at a time, each on a thread of its own. The decisions are taken in the order of
// the bound as a one-at-a-time search would take them, whatever order the runs finish in, so the answer
// does not depend on `jobs`: a layout is simulated speculatively only when what is known could not prune
// it, and its result is dropped if the results before it, once in, would have.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/training.h"
#include "plan/candidates.h"
#include "sim/sim_backend.h"

namespace ranklab::plan {

// What one simulated run gave, beside its TrainingStats.
struct Simulated {
  TrainingStats stats;
  std::int64_t peak_bytes = 0;  // the largest peak over the ranks
  int peak_stage = 0;           // the pipeline stage of that rank
  // The largest part of that rank's memory at its peak: "activations 31.20 GiB" (weights, grads and
  // optimizer as the memory plan has them, which the run allocates exactly; activations the rest).
  std::string peak_part;
};

struct Result {
  Candidate candidate;
  // For Status::Simulated: the figures the ranking uses, the full run's where there is one.
  std::optional<Simulated> run;
  bool full = false;  // `run` comes from a simulation in which every rank ran
  // The symmetric screening's figures, where the layout was screened that way (kept beside a full run).
  std::optional<Simulated> screening;
  double wall_s = 0;  // what simulating it took here, its runs together (0: not simulated)
};

struct SearchOptions {
  int max_candidates = 0;  // the most layouts screened; 0: no limit
  bool symmetry = true;    // screen with SimConfig::symmetry (false: every run has every rank running)
  bool progress = true;    // a progress line on stderr when it is a terminal
  bool prune = true;       // false: simulate every layout that fits the plan (to check the bound)
  int jobs = 1;            // simulations at once, each on a thread
  // After symmetric screening, the layouts simulated again with every rank running: the first `confirm`
  // of the ranking, and every one whose screened step is within `confirm_margin` (a fraction) of the best
  // step. Unused without symmetry.
  int confirm = 1;
  double confirm_margin = 0.01;
};

struct Plan {
  Question question;
  // Every layout: the simulated ones ranked by step time (ties by name), then the others by name.
  std::vector<Result> results;
  int enumerated = 0, invalid = 0, rejected_by_plan = 0, rejected_by_run = 0, pruned = 0, unexplored = 0,
      simulated = 0;
  bool symmetric = true;  // screened with SimConfig::symmetry
  int confirmed = 0;      // simulations again with every rank running, after screening
  int jobs = 1;           // simulations at once
  int screenings = 0;     // rounds of screening (more than one when a full run let a pruned layout back in)
  double wall_s = 0;
  std::vector<const Result*> ranked() const;  // the simulated ones, best first
};

// The symmetry of a layout's world: its group order as a grid, innermost first, with the tp and dp
// dimensions replicated and pp not.
SimSymmetry symmetry_of(const Layout& l);

// Simulates one layout; a Result of status Simulated, or RejectedMemory when the run ran out of memory.
// With `symmetry`, one rank per pipeline stage runs (the result is a screening: `full` false).
// UsageError when the gpt lesson refuses the layout.
Result simulate(const Question& q, const Layout& l, bool symmetry);

Plan search(const Question& q, const SearchOptions& options);

}  // namespace ranklab::plan
