// The layouts `ranklab plan` considers for one question (a GPT shape, a batch, a cluster), and what can be
// said about each before simulating it: whether the gpt lesson accepts it at all, whether its memory plan
// fits the device, and a lower bound on its step time.
//
// Nothing here re-derives the lesson's rules. A layout is valid when gpt::resolve accepts it (its
// UsageError is kept as the reason), and it is over memory when the lesson's own memory plan
// (gpt::memory_plan) exceeds the device on some stage: the lesson refuses exactly those before allocating,
// with an OutOfMemoryError, so a layout rejected here runs out of memory in `ranklab run gpt` too. Whether
// the rest fit is for the simulation to say (the plan leaves out transient buffers; see search.h).
//
// The lower bound on the step time is what the busiest pipeline stage does in a row on its compute stream:
// its GEMMs and attention, each at the time the simulator's compute model charges for its shape on the
// profile's GPU, its memory-bound kernels (layernorms, bias and residual adds, GELU, the softmax's passes
// over the logits, gradient accumulation) each at no less than its bytes at the HBM's bandwidth, and the
// tensor-parallel collectives the compute stream waits for (Megatron's f and g block unless
// --tp-comm-overlap pipelines them with the GEMMs, which the bound then takes as tp GEMMs), each at the
// time the network model gives it with the machine to itself; plus the pipeline's fill and drain (the
// first micro-batch's forward through the stages before it, and the last one's backward through them after
// it, with their sends), then rank 0's optimizer step. A MoE layer counts its router's and its local
// experts' GEMMs on balanced routes and, where those divide evenly, its all-to-alls (and with expert tensor
// parallelism its gathers and reduce-scatters) alone on the machine.
// With ZeRO 2 or 3 the step is also no shorter than the data-parallel group's stream (which runs the
// gathers and reduce-scatters every task issues one after another) up to the stage's last task, then that
// task's backward, the drain and the optimizer; with experts, than that of the expert-data-parallel group,
// which gathers and reduces the experts (the dense stream is then left out). Full recomputation adds the
// forward again to each backward, its collectives included. The rest of the data-parallel communication
// and the embedding's kernels are left out, so no simulated step can be faster; search.h uses the bound to
// simulate the cheapest layouts first and to skip those that cannot beat the best found. Given each
// stage's kernel time per micro-batch as a short run measured it (search.h, "Probing"), the bound takes
// that, with the stage's blocking collectives at their time alone, where it exceeds the model's sum.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common/lesson.h"
#include "common/profile.h"
#include "lessons/gpt/config.h"
#include "lessons/parallel/zero.h"

namespace ranklab::sim {
class ComputeModel;
class NetworkModel;
}  // namespace ranklab::sim

namespace ranklab::plan {

// What is asked: a model shape and batch on `profile.nodes` nodes of a profile.
struct Question {
  std::string model = "custom";  // the preset that filled the shape, or "custom"
  int layers = 2, hidden = 64, heads = 4, seq = 16;
  std::int64_t vocab = 128, global_batch = 8;
  std::string dtype = "bf16";
  std::string fp8_recipe = "none";  // gpt's --fp8-recipe: the linear layers' GEMMs in FP8
  // With the 16-bit dtype, every layout also tried with its linear layers' GEMMs in FP8 by this recipe
  // (Layout::fp8); "": not tried.
  std::string try_fp8;
  // A mixture of experts' (0: dense): its layouts also choose the expert-parallel size, with the routing
  // balanced as published benchmarks force it.
  int experts = 0;
  // The shape's other flags (the block, its heads' and MLP's widths, the experts' routing: shape_flags()),
  // as the gpt lesson writes them; the planner passes them on.
  Settings shape;
  // The framework whose overlaps the layouts run with (gpt's --framework).
  std::string framework = "megatron-core";
  Profile profile;  // with `nodes` set
  bool tp_across_nodes = false;
  int max_interleave = 4;  // the most model chunks per pipeline rank tried

  int world() const { return profile.max_world(); }
};

// One parallel layout. Its name is the one string the table, plan.json and --explain share:
// "tp4-pp8-v2-dp16-zero1-sp-mb1-selective-tp-dp-pp" (sp only when sequence parallelism is on), with
// "-cp2" after the tp part when there is context parallelism (its ring: the framework's default exchange),
// "-ep8" after the dp part when experts are spread over ranks (and "-etp2" after it when each expert is split
// over ranks), and "-fp8" after the recompute part when the linear layers' GEMMs run in FP8
// (Question::try_fp8).
struct Layout {
  int tp = 1, pp = 1, v = 1, dp = 1, zero = 0;
  bool sp = false;
  int micro_batch = 1;
  std::string recompute = "none";
  std::string order = "tp-dp-pp";
  int cp = 1;
  int ep = 1;
  bool fp8 = false;
  int etp = 1;
  std::string name() const;
};
// The layout a name spells; UsageError saying what is wrong with it.
Layout parse_layout(const std::string& name);

// The gpt lesson's options for a layout of the question: phantom tensors, one step, quiet; the lesson's
// defaults for the rest. Where the layers do not divide among pp stages but two more would, the first and
// last stages hold one layer fewer than the others (Llama 3 405B's split).
Settings lesson_settings(const Question& q, const Layout& l);
// Those options read and checked by the lesson (gpt::resolve): UsageError for a layout it refuses.
gpt::Config lesson_config(const Question& q, const Layout& l);
// The same for many layouts of one question, its flags read once.
class LessonConfigs {
 public:
  explicit LessonConfigs(const Question& q);
  gpt::Config of(const Layout& l) const;

 private:
  const Question& q_;
  gpt::Config question_;
  std::string refused_;  // why the question's own flags were refused, for every layout
};

enum class Status {
  Invalid,         // the gpt lesson's checks refuse it
  RejectedMemory,  // over the device's memory: the lesson's plan, or the simulated run
  PrunedBound,     // its lower bound on the step time cannot beat the best simulated
  Unexplored,      // left over when --max-candidates simulations were done
  Simulated,
  Pending,  // not yet decided (during the search)
};
const char* status_name(Status s);

struct Candidate {
  Layout layout;
  std::string name;
  Status status = Status::Pending;
  std::string reason;               // why invalid or out of memory
  double bound_us = 0;              // lower bound on the step time
  bool probed = false;              // bound_us counts the kernels a probe measured (search.h)
  std::int64_t planned_bytes = 0;   // the memory plan's largest stage total
  std::int64_t capacity_bytes = 0;  // the device's
};

// Each pipeline stage's weights, gradients and optimizer state (gpt::state_bytes) of the configurations a
// planner enumerates, each part computed once for what it depends on: the dense part for the parameters'
// split and sharding, the experts' for the experts a rank holds and the ranks that shard them. A question
// on a cluster has tens of thousands of layouts, most of them sharing both.
class StageStates {
 public:
  // Stage 0 first.
  const std::vector<parallel::DataParallel::Bytes>& of(const gpt::Config& c);

 private:
  using Stages = std::vector<parallel::DataParallel::Bytes>;
  std::map<std::tuple<int, int, int, int, int, int, bool, int, int>, Stages> states_;
  std::map<std::tuple<int, int, int, int, int, int, bool>, Stages> dense_;
  std::map<std::tuple<int, int, int, int, int, int>, Stages> experts_;
};

// The lower bound described above, with the profile's compute and network models built once.
class StepBound {
 public:
  explicit StepBound(const Profile& profile);
  ~StepBound();
  StepBound(const StepBound&) = delete;
  StepBound& operator=(const StepBound&) = delete;
  // For a valid configuration on the profile's nodes. With `stage_kernels_us` (one per pipeline stage),
  // each stage's compute-stream kernels per micro-batch as a short run of the layout measured them, taken
  // where they exceed the model's sum (see measure_stage_kernels in search.h).
  double us(const gpt::Config& c, std::span<const double> stage_kernels_us = {});
  // The stage states the bound reads its optimizer's bytes from, for the memory plans to share.
  StageStates& states() { return states_; }

 private:
  // One collective over `ranks` (or a send from the first to the second), alone on the machine.
  double comm_us(CommOp op, std::int64_t bytes, const std::vector<int>& ranks);
  // What ZeRO 2 and 3 keep a stage's data-parallel stream busy with before the stage's last task.
  double zero_stream_us(const gpt::Config& c, int stage);
  // The same for the experts' units on their expert-data-parallel group's stream.
  double expert_stream_us(const gpt::Config& c, int stage);
  Profile profile_;
  std::unique_ptr<sim::ComputeModel> compute_;
  std::unique_ptr<sim::NetworkModel> network_;
  std::map<std::tuple<int, std::int64_t, std::vector<int>>, double> comm_;
  StageStates states_;
};

// Every layout of the question, in a fixed order: tp (within a node unless tp_across_nodes), cp where the
// sequence splits into 2 cp chunks of at least kMinCpChunk tokens, pp dividing the layers, with experts ep
// dividing them and the stage's tp x cp x dp ranks and each expert whole or split over the tp size (etp 1
// or tp, where ep x etp divides the stage's ranks), interleaving v up
// to max_interleave where the chunks are whole, ZeRO 0-3 (only 0 without data parallelism, where there is
// nothing to shard), sequence parallelism with tp > 1, micro-batches of 1, 2 and 4, recompute none, selective
// and full, and the group orders tp-dp-pp and, where it places groups on nodes differently (more than one
// node, tp smaller than a node), tp-pp-dp, each in the question's precision and, with try_fp8, with FP8
// GEMMs too. Each is marked Invalid or RejectedMemory where that is known, Pending with its bound otherwise.
std::vector<Candidate> enumerate(const Question& q);
// The shortest chunk of a sequence context parallelism is tried with. Below it a ring step's attention is
// a block of fewer than 1,024 queries and keys, where the fused kernels run at under two thirds of their
// long-sequence rate (docs/model.md, "Fused attention by shape": seq_half 207-420 on H100) while the
// exchanges stay as many: layouts whose sequences are that short gain nothing from it that dp does not.
constexpr std::int64_t kMinCpChunk = 1024;

// The largest total of the memory plan over the pipeline stages: what the lesson checks against the device
// before allocating.
std::int64_t planned_peak_bytes(const gpt::Config& c);

}  // namespace ranklab::plan
