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
// Screening a step of many micro-batches. Once 1F1B's schedule (interleaved or not) is full, each further
// micro-batch adds the same forward and backward to every stage, so the step's times grow linearly with
// the micro-batches m once the schedule's communication has settled too, and 1F1B keeps no more
// micro-batches alive for a longer step: what memory grows by is the step's data. The line starts at m =
// 2 p (measured: a tiny GPT with pp 4, whose latency-bound pipeline settles last, is linear within 0.3% from
// m = 8 on and not below; Llama 3 70B with tp 8 x pp 4, plain and interleaved, from m = 4). Where m is at
// least 12 p, a screening runs steps of 2 p and 4 p micro-batches (6 p in all, half the step or less) and
// extends the line through them to m (extrapolate()); a confirmation runs the whole step.
//
// Probing before screening. The model's bound (candidates.h) charges each kernel what the compute model
// gives its shape, and the memory-bound ones their bytes at the HBM's bandwidth; the simulator charges more
// where launches, small kernels and the ones the bound leaves out (permutations, ZeRO's per-micro-batch
// copies) weigh, so on a mixture of experts a layout's bound may be half its step. Before screening a layout
// whose screening runs at least 25 micro-batches (its m, or the 6 p of one extended from two short steps;
// 25 p with interleaving), the search probes it: two symmetric steps of 2 and 3 micro-batches (2 p and 3 p)
// measure each stage's kernel time per micro-batch (measure_stage_kernels), the bound is taken again with
// it, and a layout that bound cannot let win is pruned without its screening. A probe so costs a fifth of
// the screening or less.
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

class Messenger;  // cluster.h

// What one simulated run gave, beside its TrainingStats.
struct Simulated {
  TrainingStats stats;
  std::int64_t peak_bytes = 0;  // the largest peak over the ranks
  int peak_stage = 0;           // the pipeline stage of that rank
  // The largest part of that rank's memory at its peak: "activations 31.20 GiB" (weights, grads and
  // optimizer as the memory plan has them, which the run allocates exactly; activations the rest).
  std::string peak_part;
  // 0: the whole step ran. Otherwise steps of this many micro-batches and twice as many ran, and the
  // figures are those steps' extended to the layout's micro-batches (see the top of this file).
  std::int64_t extrapolated_from = 0;
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

// A step to beat: the best simulated so far, its time and its layout's name ("": none yet). A layout can
// win only by a shorter step, or an equal one and an earlier name; its step is no shorter than its bound.
struct Cutoff {
  double us = 0;
  std::string name;
  bool beatable_by(const Candidate& k) const {
    return name.empty() || k.bound_us < us || (k.bound_us == us && k.name < name);
  }
};

struct SearchOptions {
  int max_candidates = 0;   // the most layouts screened; 0: no limit
  bool symmetry = true;     // screen with SimConfig::symmetry (false: every run has every rank running)
  bool extrapolate = true;  // screen long steps from two short ones (false: every run runs the whole step)
  bool progress = true;     // a progress line on stderr when it is a terminal
  bool prune = true;        // false: simulate every layout that fits the plan (to check the bound)
  // Probe a layout before screening it (measure_stage_kernels), where that costs a fifth of the screening
  // or less, and prune it if the bound with the kernels measured cannot beat the best so far.
  bool probe = true;
  int jobs = 1;  // simulations at once, each on a thread
  // After symmetric screening, the layouts simulated again with every rank running: the first `confirm`
  // of the ranking, and every one whose screened step is within `confirm_margin` (a fraction) of the best
  // step; none with confirm 0 (a world too large to run whole here). Unused without symmetry.
  int confirm = 1;
  double confirm_margin = 0.01;
  // Rank 0 of a job of several processes (cluster.h): the simulations go to every rank's `jobs` slots too.
  Messenger* cluster = nullptr;
};

struct Plan {
  Question question;
  // Every layout: the simulated ones ranked by step time (ties by name), then the others by name.
  std::vector<Result> results;
  int enumerated = 0, invalid = 0, rejected_by_plan = 0, rejected_by_run = 0, pruned = 0, unexplored = 0,
      simulated = 0;
  int probed = 0;           // layouts probed before their screening (measure_stage_kernels)
  int pruned_by_probe = 0;  // of the pruned, those whose bound counts what their probe measured
  bool symmetric = true;    // screened with SimConfig::symmetry
  int confirmed = 0;        // simulations again with every rank running, after screening
  int jobs = 1;             // simulations at once on each process
  int processes = 1;        // the processes of the job that ran it (cluster.h)
  int screenings = 0;       // rounds of screening (more than one when a full run let a pruned layout back in)
  double wall_s = 0;
  std::vector<const Result*> ranked() const;  // the simulated ones, best first
};

// The symmetry of a layout's world: its group order as a grid, innermost first, with the tp and dp
// dimensions replicated and pp not.
SimSymmetry symmetry_of(const Layout& l);

// Simulates one layout; a Result of status Simulated, or RejectedMemory when the run ran out of memory.
// With `symmetry`, one rank per pipeline stage runs (the result is a screening: `full` false); with
// `extrapolate` as well, a step of at least 12 p micro-batches is extended from steps of 2 p and 4 p.
// With a `cutoff` as well (its name empty when nothing is known to beat), a layout whose probe costs at
// most a fifth of its screening is probed first (measure_stage_kernels) and its bound taken with the
// kernels measured (Candidate::probed); if that bound cannot beat the cutoff, the result is PrunedBound
// and the step is not simulated. UsageError when the gpt lesson refuses the layout.
Result simulate(const Question& q, const Layout& l, bool symmetry, bool extrapolate = false,
                const std::optional<Cutoff>& cutoff = std::nullopt);

// A probe: each pipeline stage's compute-stream kernel time per micro-batch, from two symmetric steps of the
// layout of 2 u and 3 u micro-batches (u = p with interleaving, else 1): the ranks' busy time less what
// communication kernels took from it (RankSummary), the longer step's less the shorter's, over u. Every
// micro-batch runs the same kernels and contention only slows them, so a step of m micro-batches keeps
// each stage's compute stream busy at least m times as long: StepBound::us then bounds the step with what
// the simulator charges, the kernels the model's sum leaves out (permutations, casts, copies, ZeRO's
// per-micro-batch work) included. nullopt when a short step runs out of memory or the lesson refuses it.
std::optional<std::vector<double>> measure_stage_kernels(const Question& q, const Layout& l);

// The figures of a step of `m` micro-batches from those of steps of m_a and m_b > m_a of the same layout:
// every time (the step, each dimension's communicated, exposed and hidden time, and the pipeline's idle
// time, bubble x m) and the reporting rank's peak memory on the line through the two, the FLOPs and tokens
// in proportion.
TrainingStats extrapolate(const TrainingStats& a, const TrainingStats& b, std::int64_t m);

Plan search(const Question& q, const SearchOptions& options);

// A rank other than 0 of a job (cluster.h): simulates what rank 0 sends, `jobs` at once, and answers
// each, until rank 0 says to stop. A simulation that throws is answered with the error (rank 0 ends the
// plan with it); one that runs out of this host's memory is answered as rejected for memory.
void serve(const Question& q, Messenger& cluster, int jobs);

}  // namespace ranklab::plan
