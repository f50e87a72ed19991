// The GPT lesson: a GPT decoder trained with every parallelism Megatron-LM combines, each a switch.
//
//   ranklab run gpt --world 8 --tp 2 --pp 2 --zero 1                      tiny, checked against one device
//   ranklab run gpt --model gpt3-175b --profile dgx-a100 --nodes 192 --world 1536 --tp 8 --pp 8
//       --interleave 2 --micro-batch 1 --phantom                           what a 175B step costs
//
// What each rank does in a step: its pipeline schedule of forward and backward tasks (parallel/pipeline.h),
// each task one micro-batch through one model chunk (model.h) whose blocks split every matmul pair over the
// tp group (parallel/tensor_parallel.h); then the data-parallel gradient reduction and the optimizer as the
// ZeRO stage says (parallel/zero.h). With real numbers, every step's loss, gradients and weights are checked
// against a one-device double-precision reference (reference.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/check.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/reference.h"
#include "lessons/parallel/groups.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/parallel/zero.h"

namespace ranklab {
namespace {

using gpt::Config;
using parallel::Param;

void gpt_lesson(Rank& r, const Config& o) {
  const Config c = gpt::resolve(o, r.world_size());
  const bool root = r.rank() == 0;
  const std::int64_t m = c.micro_batches();
  const parallel::Layout layout{c.tp, c.pp, c.dp, c.order};
  const gpt::Flops flops = gpt::step_flops(c);
  const gpt::Tolerance tol = gpt::tolerance(c.dtype);

  // ---- the plan, before anything is allocated ------------------------------------------------------------
  std::vector<gpt::MemoryPlan> plans;
  int worst_stage = 0;
  for (int s = 0; s < c.pp; ++s) {
    plans.push_back(gpt::memory_plan(c, s));
    if (plans[s].total() > plans[worst_stage].total()) worst_stage = s;
  }
  if (root) {
    const double n = static_cast<double>(gpt::parameter_count(c));
    const std::string count = n >= 1e9   ? fmt::format("{:.3g}B", n / 1e9)
                              : n >= 1e6 ? fmt::format("{:.3g}M", n / 1e6)
                                         : fmt::format("{:.0f}", n);
    r.print(fmt::format("gpt{}: {}; {} parameters", c.model.empty() ? "" : " " + c.model, c.shape(), count));
    r.print(fmt::format(
        "  global batch {} x seq {} = {} tokens per step; micro-batch {}: m = {} micro-batches per "
        "pipeline; {} steps of AdamW lr {}",
        c.global_batch, c.seq, c.tokens_per_step(), c.micro_batch, m, c.steps, c.lr));
    r.print(fmt::format("layout: {} on {} ranks", c.layout(), r.world_size()));
    if (!o.quiet) {
      for (const std::string& line : parallel::describe_groups(layout, r.profile().gpus_per_node))
        r.print(line);
    }
    r.print(
        fmt::format("FLOPs per step: model 72 B s L h^2 (1 + s/(6h) + V/(12hL)) = {:.4g} PFLOP; hardware "
                    "(with recompute {}) {:.4g} PFLOP",
                    flops.model / 1e15, gpt::recompute_name(c.recompute), flops.hardware / 1e15));
    r.print(fmt::format("memory per rank, estimated before allocating (device {}):",
                        format_bytes(r.memory_capacity())));
    for (int s = 0; s < c.pp; ++s) {
      if (c.pp > 4 && s == 2) r.print(fmt::format("  ... ({} more stages)", c.pp - 4));
      if (c.pp > 4 && s >= 2 && s < c.pp - 2) continue;
      const gpt::MemoryPlan& p = plans[s];
      r.print(fmt::format(
          "  stage {:<3} weights {:>10}  grads {:>10}  optimizer {:>10}  activations {:>10} "
          "({} micro-batch{} alive)  total {:>10}",
          s, format_bytes(p.weights), format_bytes(p.grads), format_bytes(p.optimizer),
          format_bytes(p.activations), p.most_alive, p.most_alive == 1 ? "" : "es", format_bytes(p.total())));
    }
  }
  const gpt::MemoryPlan& worst = plans[worst_stage];
  if (worst.total() > r.memory_capacity()) {
    throw OutOfMemoryError(
        fmt::format("gpt: out of memory: pipeline stage {} needs {} per GPU and the device holds {}; the "
                    "largest part is {}. "
                    "To fit: {}",
                    worst_stage, format_bytes(worst.total()), format_bytes(r.memory_capacity()),
                    worst.largest(), gpt::memory_advice(c, worst)));
  }

  // ---- the ranks' groups, the model, the schedule --------------------------------------------------------
  const parallel::Groups groups = parallel::make_groups(r, layout);
  const parallel::Layout::Coord me = groups.me;
  parallel::ExposedComm exposed(r);
  parallel::TensorParallel tp{r, groups.tp, c.tp, c.seq_parallel, c.phantom, exposed};
  parallel::ZeroConfig zc;
  zc.stage = c.zero;
  zc.dtype = c.dtype;
  zc.reduce_dtype = c.reduce_dtype;
  zc.phantom = c.phantom;
  zc.tp_rank = me.tp, zc.tp_size = c.tp, zc.dp_rank = me.dp, zc.dp_size = c.dp;
  zc.tp = groups.tp, zc.dp = groups.dp, zc.embedding = groups.embedding;
  zc.seq_parallel = c.seq_parallel;
  zc.embedding_group = c.pp > 1;
  zc.broken = c.broken;
  parallel::DataParallel dp(r, zc, exposed);
  const std::int64_t before_model = r.memory_allocated();
  gpt::Model model(r, c, me.tp, me.dp, me.pp, tp, dp);
  const std::int64_t model_bytes = r.memory_allocated() - before_model;
  std::vector<Param*> params = model.params();
  parallel::Pipeline pipe(r, groups.pp_ranks, me.pp, c.v, static_cast<int>(m), c.phantom, exposed);
  gpt::OneDeviceCheck check(r, c, me);

  // What the run allocates against the plan: the parameters (and data) exactly, and what one micro-batch
  // keeps for its backward.
  const gpt::MemoryPlan& mine = plans[me.pp];
  std::vector<std::int64_t> stash_measured(c.v, -1);
  const AdamW hyper{static_cast<float>(c.lr), 0.9f, 0.999f, 1e-8f, 0.01f};

  double step_us = 0;
  std::array<double, parallel::kDims> exposed_us{};
  parallel::PipelineTimes ptimes;
  std::int64_t peak = 0;
  // The ranks of data-parallel replica 0 time their tasks and communication waits: the replicas run the
  // same schedule on the same layout, and timing one of them costs the simulation 1/dp of the events.
  const bool measures = me.dp == 0;
  for (int step = 1; step <= c.steps; ++step) {
    const bool timed = step == c.steps;
    if (step > 1) dp.zero_grads(params);
    model.start_step();
    r.synchronize();
    r.barrier();
    r.reset_peak_memory();
    exposed.enable(timed && measures);
    const double start_us = r.now();
    const Event start = r.record_event();
    {
      auto region = r.region("step");
      // Each task's region names its micro-batch (and chunk, interleaved): the timeline shows the schedule.
      auto task_name = [&](const parallel::Task& t) {
        return c.v > 1 ? fmt::format("{} mb {} chunk {}", t.forward ? "forward" : "backward", t.mb, t.chunk)
                       : fmt::format("{} mb {}", t.forward ? "forward" : "backward", t.mb);
      };
      auto forward = [&](const parallel::Task& t, const Tensor& in) {
        auto scope = r.region(task_name(t));
        Tensor out = model.forward(t, in);
        // (The tensors themselves: memory_allocated() would also see a send finishing meanwhile.)
        if (step == 1 && t.mb == 0) stash_measured[t.chunk] = model.kept_bytes(t.chunk, t.mb);
        return out;
      };
      auto backward = [&](const parallel::Task& t, const Tensor& dout) {
        auto scope = r.region(task_name(t));
        return model.backward(t, dout);
      };
      pipe.run(Shape{c.local_rows(), c.hidden}, c.dtype, forward, backward, timed && measures);
      auto scope = r.region("optimizer");
      dp.finish(params);
      dp.step(params, hyper, step);
    }
    const Event end = r.record_event();
    r.synchronize();
    if (timed) {
      step_us = r.elapsed_us(start, end);
      exposed_us = exposed.totals();
      ptimes = pipe.times();
      // The schedule, task by task, for the report's chart: replica 0's ranks, which timed it.
      if (c.pp > 1 && measures) r.report_pipeline(pipe.tasks(start, start_us));
      peak = r.memory_peak();
      exposed.enable(false);
    }

    check.compare_step(step, model, dp, groups.dp);
  }
  gpt::check_memory_plan(r, c, me, mine, model_bytes, stash_measured);
  check.record(model.has_head());

  // ---- the figures, gathered to rank 0 --------------------------------------------------------------------
  // Means over the ranks of replica 0: exposed communication per dimension, the pipeline's busy and idle
  // time.
  const int w = r.world_size();
  // The last element counts the ranks that measured, so the mean holds however many ranks contribute
  // (in a symmetric simulation the mirrors of replica 0 contribute its figures once more each).
  const int nmax = c.pp + c.steps + 4;
  std::vector<float> avg, mx;
  {
    auto gathering = r.bookkeeping("figures");  // collectives for the printout, not the training step
    std::vector<float> sums(parallel::kDims + 3);
    for (int d = 0; d < parallel::kDims; ++d) sums[d] = static_cast<float>(exposed_us[d]);
    sums[parallel::kDims] = static_cast<float>(ptimes.busy_us);
    sums[parallel::kDims + 1] = static_cast<float>(ptimes.window_us);
    sums[parallel::kDims + 2] = measures ? 1.0f : 0.0f;
    Tensor mean = r.from_host({static_cast<std::int64_t>(sums.size())}, sums);
    r.all_reduce(mean, ReduceOp::Sum);
    // Maxima: each stage's peak (from the rank with tp 0, dp 0 of the stage), the losses, the pipeline's
    // window, the worst differences.
    std::vector<float> maxes(nmax, 0.0f);
    if (me.tp == 0 && me.dp == 0) {
      maxes[me.pp] = static_cast<float>(peak);
      for (size_t i = 0; i < check.losses.size(); ++i) maxes[c.pp + i] = static_cast<float>(check.losses[i]);
    }
    // The pipeline's window is the longest of the ranks': the schedule ends when the last rank's does.
    maxes[nmax - 4] = static_cast<float>(ptimes.window_us);
    maxes[nmax - 3] = static_cast<float>(check.grad.worst);
    maxes[nmax - 2] = static_cast<float>(check.weight.worst);
    maxes[nmax - 1] = static_cast<float>(check.loss.worst);
    Tensor most = r.from_host({nmax}, maxes);
    r.all_reduce(most, ReduceOp::Max);
    avg = r.to_host(mean);
    const float measured = avg.back();  // the ranks of replica 0, tp x pp
    for (float& a : avg) a /= measured;
    mx = r.to_host(most);
  }
  if (!root) return;

  const double busy = avg[parallel::kDims], window = mx[nmax - 4];
  const double bubble = busy > 0 ? (window - busy) / busy : 0;
  const double formula = (c.pp - 1.0) / (c.v * static_cast<double>(m));
  const double peak_tflops =
      c.dtype == DType::Float32 ? r.profile().gpu.peak_tflops_fp32 : r.profile().gpu.peak_tflops_bf16;
  TrainingStats st;
  st.model = c.model_name();
  st.layout = c.layout();
  st.tokens_per_step = c.tokens_per_step();
  st.micro_batches = static_cast<int>(m);
  st.step_time_us = step_us;
  st.model_flops = flops.model;
  st.hardware_flops = flops.hardware;
  st.model_tflops_per_gpu = flops.model / (step_us * 1e-6) / w / 1e12;
  st.hardware_tflops_per_gpu = flops.hardware / (step_us * 1e-6) / w / 1e12;
  st.mfu = peak_tflops > 0 ? st.model_tflops_per_gpu / peak_tflops : 0;
  st.bubble_fraction = bubble;
  st.bubble_fraction_formula = formula;
  for (int d = 0; d < parallel::kDims; ++d) st.exposed_comm_us[parallel::kDimNames[d]] = avg[d];
  st.peak_memory_bytes = peak;
  st.weights_bytes = plans[0].weights;
  st.grads_bytes = plans[0].grads;
  st.optimizer_bytes = plans[0].optimizer;
  st.activations_bytes = peak - plans[0].fixed();
  r.report_training(st);

  for (int s = 0; s < c.steps && check.compares(); ++s) {
    r.print(fmt::format("step {}/{}  loss {:.6f} (one device {:.6f})", s + 1, c.steps, mx[c.pp + s],
                        check.reference().loss(s + 1)));
  }
  r.print(fmt::format("step time {} (the last step, events on rank 0's compute stream); {:.0f} tokens/s",
                      human_time(step_us), c.tokens_per_step() / (step_us * 1e-6)));
  r.print(fmt::format("  model {:.1f} TFLOP/s per GPU, hardware {:.1f}; MFU {}", st.model_tflops_per_gpu,
                      st.hardware_tflops_per_gpu,
                      peak_tflops > 0 ? fmt::format("{:.1f}% of {:.0f} TFLOP/s ({} dense peak)", 100 * st.mfu,
                                                    peak_tflops, dtype_name(c.dtype))
                                      : std::string("unknown (no peak for this device)")));
  if (c.pp > 1) {
    r.print(
        fmt::format("  pipeline bubble: idle {:.1f}% of the compute time measured (the schedule's span over "
                    "the mean busy time of replica 0's ranks); (p-1)/(v m) = "
                    "{}/({} x {}) = {:.1f}% for uniform stages and free communication",
                    100 * bubble, c.pp - 1, c.v, m, 100 * formula));
  }
  r.print(fmt::format(
      "  exposed communication (the compute stream waiting, mean per rank of replica 0): tp {}  sp {}  pp {} "
      "(receives include the bubble)  dp {}",
      human_time(avg[0]), human_time(avg[1]), human_time(avg[2]), human_time(avg[3])));
  r.print("  peak memory per stage, measured (planned):");
  for (int s = 0; s < c.pp; ++s) {
    if (c.pp > 4 && s == 2) r.print(fmt::format("    ... ({} more stages)", c.pp - 4));
    if (c.pp > 4 && s >= 2 && s < c.pp - 2) continue;
    r.print(fmt::format("    stage {:<3} {:>10} ({:>10}): weights {}, grads {}, optimizer {}, activations {}",
                        s, format_bytes(mx[s]), format_bytes(plans[s].total()),
                        format_bytes(plans[s].weights), format_bytes(plans[s].grads),
                        format_bytes(plans[s].optimizer), format_bytes(mx[s] - plans[s].fixed())));
  }
  if (!check.compares()) {
    r.print("phantom tensors hold no numbers: the comparison with one device was skipped");
    return;
  }
  const bool ok = mx[nmax - 3] <= tol.grad && mx[nmax - 2] <= tol.weight && mx[nmax - 1] <= tol.loss;
  r.print(fmt::format(
      "equal to one device (double precision) after every step: {} (largest relative differences: "
      "gradients {:.2e}, weight updates {:.2e}, loss {:.2e}; tolerances for {}: {:.2g}, {:.2g}, {:.2g})",
      ok ? "yes" : "NO", mx[nmax - 3], mx[nmax - 2], mx[nmax - 1], dtype_name(c.dtype), tol.grad, tol.weight,
      tol.loss));
}

}  // namespace

RANKLAB_LESSON("gpt",
               "a GPT trained with tensor, sequence, pipeline and data parallelism, ZeRO and recompute",
               gpt_lesson, gpt::options_table());

}  // namespace ranklab
