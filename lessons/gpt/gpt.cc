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

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/progress.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/check.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/report.h"
#include "lessons/parallel/expert_parallel.h"
#include "lessons/parallel/exposed.h"
#include "lessons/parallel/groups.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/parallel/zero.h"

namespace ranklab {
namespace {

using gpt::Config;
using parallel::Param;

parallel::ZeroConfig zero_config(const Config& c, const parallel::Groups& groups);
parallel::ZeroConfig expert_zero_config(const Config& c, const parallel::Groups& groups);
parallel::ExpertParallel expert_parallel(Rank& r, const Config& c, const parallel::Groups& groups,
                                         parallel::ExposedComm& exposed);
std::string task_region(const parallel::Task& t, int chunks);

void gpt_lesson(Rank& r, const Config& o) {
  const Config c = gpt::for_gpu(gpt::resolve(o, r.world_size()), r.profile().gpu);
  const parallel::Layout layout{c.tp, c.pp, c.dp, c.order, c.cp, c.moe() ? c.ep : 0, c.etp};

  // The plan: every stage's memory from the configuration alone, printed and held against the device before
  // anything is allocated, so that a model too large fails at once and says what would make it fit.
  const std::vector<gpt::MemoryPlan> plans = gpt::memory_plans(c);
  if (r.rank() == 0) gpt::print_plan(r, c, layout, plans);
  gpt::check_fits(c, plans, r.memory_capacity());

  // The groups: each rank is a cell of the tp x cp x dp x pp grid. Its tp group splits every matmul pair of
  // a block, its cp group each sequence, its pp group passes activations from stage to stage, and its dp
  // group (dp x cp with context parallelism) reduces the gradients.
  const parallel::Groups groups = parallel::make_groups(r, layout);
  const parallel::Layout::Coord me = groups.me;
  // Where the user leaves the trace's ranks to the lesson: one rank per pipeline stage shows the schedule.
  if (me.tp == 0 && me.cp == 0 && me.dp == 0) r.keep_in_trace();
  parallel::ExposedComm exposed(r);  // what the compute stream waits for, per dimension, in the timed step
  parallel::TensorParallel tp{r, groups.tp, c.tp, c.seq_parallel, c.phantom, exposed};
  tp.comm_overlap = c.tp_comm_overlap;
  tp.async_backward = c.async_tp_allreduce;
  tp.ranks = groups.tp.ranks(r.world_size());
  tp.index = groups.tp.index_of(r.rank());
  std::optional<parallel::Fp8> fp8;
  if (c.fp8 != parallel::Fp8Recipe::None) {
    fp8.emplace(r, c.fp8, /*keep_weights=*/c.zero < 3, c.phantom);
    if (c.recompute == gpt::Recompute::Full) fp8->keep_scales_for_recompute();
    tp.fp8 = &*fp8;
  }
  if (c.fp8 == parallel::Fp8Recipe::Delayed && c.tp * c.cp * c.dp > 1) {
    // Delayed scaling's amaxes, reduced over the stage's ranks: one synchronous all-reduce at the end of
    // each forward and each backward pass, on the compute stream's path as TransformerEngine's is.
    const Group stage = parallel::make_stage_group(r, layout);
    fp8->reduce_amaxes = [&r, &exposed, stage](const Tensor& amaxes) {
      const Event e = exposed.before();
      exposed.after(parallel::Dim::Dp, e, r.all_reduce(amaxes, ReduceOp::Max, Async::No, stage));
    };
  }
  parallel::ContextParallel cp{r,         groups.cp,       c.cp,
                               me.cp,     groups.cp_ranks, c.cp_comm == gpt::CpComm::AllGather,
                               c.phantom, exposed,         c.broken};
  parallel::DataParallel dp(r, zero_config(c, groups), exposed);
  // With experts: each MoE layer's tokens go to the ranks of its ep group that hold their experts, and the
  // experts' gradients are reduced over the ranks that hold the same ones.
  parallel::ExpertParallel ep = expert_parallel(r, c, groups, exposed);
  if (fp8) ep.fp8 = &*fp8;
  std::optional<parallel::DataParallel> expert_dp;
  if (c.moe()) expert_dp.emplace(r, expert_zero_config(c, groups), exposed);
  // The model: this rank's chunks of it (its stage's layers, v chunks interleaved), split over tp.
  const std::int64_t before_model_bytes = r.memory_allocated();
  gpt::Model model(r, c, me.tp, me.dp, me.pp, tp, dp, me.cp, &cp, &ep, expert_dp ? &*expert_dp : nullptr);
  const std::int64_t model_bytes = r.memory_allocated() - before_model_bytes;
  const std::vector<Param*> params = model.params(), expert_params = model.expert_params();
  parallel::Pipeline pipe(r, groups.pp_ranks, me.pp, c.v, static_cast<int>(c.micro_batches()), c.phantom,
                          exposed);
  pipe.overlap_p2p = c.overlap_p2p_comm;
  gpt::OneDeviceCheck check(r, c, me);

  const AdamW hyper{static_cast<float>(c.lr), 0.9f, 0.999f, 1e-8f, 0.01f};  // lr: the schedule's, per step
  std::vector<std::int64_t> stash_measured_bytes(c.v, -1);  // what micro-batch 0 keeps in step 1, per chunk
  std::vector<std::int64_t> routed_measured_bytes(c.v, 0);  // of that, the MoE layers' routed tokens'
  gpt::StepMeasures measured;
  // The ranks of data-parallel replica 0 time their tasks and communication waits: the replicas run the
  // same schedule on the same layout, and timing one of them costs the simulation 1/dp of the events.
  const bool measures = me.dp == 0;
  // A large step simulates for minutes: rank 0 says how far it got (on a terminal only, not with --quiet).
  const std::int64_t tasks_per_step = 2 * c.micro_batches() * c.v;
  Progress progress("gpt", c.steps * tasks_per_step, stderr,
                    r.rank() == 0 && !c.quiet && Progress::on_terminal());
  std::int64_t tasks_done = 0;
  auto task_done = [&](int step) {
    progress.update(++tasks_done, fmt::format("tasks of rank 0, step {} of {}", step, c.steps));
  };
  for (int step = 1; step <= c.steps; ++step) {
    const bool timed = step == c.steps;
    if (step > 1) dp.zero_grads(params);
    if (step > 1 && expert_dp) expert_dp->zero_grads(expert_params);
    model.start_step();
    if (fp8) fp8->start_step();
    // Not TimedStep: the peak memory and the exposed waits start after the barrier, and the step is timed
    // by events on the compute stream, not by the host's clock.
    r.synchronize();
    r.barrier();
    r.reset_peak_memory();
    exposed.enable(timed && measures);
    const double start_us = r.now(), host_wait_before_us = r.host_wait_us();
    const Event start = r.record_event();
    dp.start_step();
    if (expert_dp) expert_dp->start_step();
    {
      auto region = r.region("step");
      // A task is one micro-batch through one of this rank's chunks, in 1F1B's order (parallel/pipeline.h).
      auto forward = [&](const parallel::Task& t, const Tensor& in) {
        auto scope = r.region(task_region(t, c.v));
        Tensor out = model.forward(t, in);
        if (fp8) fp8->end_pass(parallel::Fp8::Pass::Forward);
        // (The tensors themselves: memory_allocated() would also see a send finishing meanwhile.)
        if (step == 1 && t.mb == 0) {
          stash_measured_bytes[t.chunk] = model.kept_bytes(t.chunk, t.mb);
          routed_measured_bytes[t.chunk] = model.routed_bytes(t.chunk, t.mb);
        }
        task_done(step);
        return out;
      };
      auto backward = [&](const parallel::Task& t, const Tensor& dout) {
        auto scope = r.region(task_region(t, c.v));
        Tensor dx = model.backward(t, dout);
        if (fp8) fp8->end_pass(parallel::Fp8::Pass::Backward);
        task_done(step);
        return dx;
      };
      pipe.run(Shape{c.local_rows(), c.hidden}, c.dtype, forward, backward, timed && measures);
      // Then the gradients reduced over dp and AdamW on this rank's part, as the ZeRO stage says.
      auto scope = r.region("optimizer");
      dp.finish(params);
      if (expert_dp) expert_dp->finish(expert_params);
      if (c.clip_grad > 0)
        dp.clip_grads(params, c.clip_grad, expert_dp ? &*expert_dp : nullptr, expert_params);
      AdamW at = hyper;
      at.lr = static_cast<float>(c.lr_at(step));
      dp.step(params, at, step);
      if (expert_dp) expert_dp->step(expert_params, at, step);
    }
    const Event end = r.record_event();
    r.synchronize();
    if (timed) {
      measured.step_us = r.elapsed_us(start, end);
      measured.exposed_us = exposed.totals();
      measured.communicated_us = exposed.communicated_totals();
      measured.pipeline = pipe.times();
      // The schedule, task by task, for the report's chart: replica 0's ranks, which timed it.
      if (c.pp > 1 && measures) r.report_pipeline(pipe.tasks(start, start_us));
      measured.peak_bytes = r.memory_peak();
      measured.host_wait_us = r.host_wait_us() - host_wait_before_us;
      measured.moe_routes = model.routed(), measured.moe_dropped = model.dropped();
      exposed.enable(false);
    }
    check.compare_step(step, model, groups.dp_cp);
  }

  dp.finish_gathers();
  if (expert_dp) expert_dp->finish_gathers();
  gpt::check_memory_plan(r, c, me, plans[me.pp], model_bytes, stash_measured_bytes, routed_measured_bytes);
  check.record(model.has_head());
  const gpt::StepFigures figures = gpt::gather_step_figures(r, c, me, measures, measured, check);
  if (r.rank() == 0) gpt::print_summary(r, c, plans, measured, figures, check);
}

// What ZeRO needs of the layout: this rank's place in it, its groups, and the precision of the weights and
// of the gradients' reduction.
parallel::ZeroConfig zero_config(const Config& c, const parallel::Groups& groups) {
  parallel::ZeroConfig zc = gpt::zero_config(c);
  const parallel::Layout::Coord me = groups.me;
  // The gradients are reduced, and ZeRO's shards spread, over dp x cp: every cp rank holds the whole model.
  zc.tp_rank = me.tp, zc.dp_rank = groups.dp_cp_index;
  zc.tp = groups.tp, zc.dp = groups.dp_cp, zc.embedding = groups.embedding;
  zc.counts_tied = me.pp == 0;  // of the tied embedding's two copies, the first stage's
  return zc;
}

// A MoE layer's dispatch over this rank's ep group, and what it routes by.
parallel::ExpertParallel expert_parallel(Rank& r, const Config& c, const parallel::Groups& groups,
                                         parallel::ExposedComm& exposed) {
  // Each expert's weight gradient sums the tokens of its ep x etp ranks; averaged over the tp cp dp /
  // (ep etp) ranks that hold it, where the dense weights average over cp dp, it needs tp / (ep etp) more
  // (expert_parallel.h).
  const float grad_scale = static_cast<float>(c.tp) / static_cast<float>(c.ep * c.etp);
  parallel::ExpertParallel ep{r,         groups.ep,  groups.ep_ranks, groups.ep_index, c.experts, c.top_k,
                              c.llama(), grad_scale, c.phantom,       exposed,         c.broken};
  if (c.etp > 1) ep.etp = groups.etp, ep.etp_size = c.etp, ep.etp_index = groups.etp_index;
  ep.routing_model = parallel::read_routing_model(c.routing, c.experts, c.top_k);
  ep.capacity_factor = c.capacity_factor;
  ep.score = c.router_score;
  ep.glu = c.glu();
  // Each rank's micro-batch adds its term with the loss's 1 / m; the gradients' average over dp x cp and
  // sum over the tensor-parallel ranks' tokens (sequence parallelism) make it the mean over all the terms.
  ep.aux_loss_weight = c.aux_loss_coeff / static_cast<double>(c.micro_batches() * c.tp);
  if (c.broken == "moe-no-load-balancing-grad") ep.aux_loss_weight = 0;  // the loss forgotten in backward
  return ep;
}

// The experts' weights: reduced, and ZeRO's shards spread, over the ranks that hold the same experts.
parallel::ZeroConfig expert_zero_config(const Config& c, const parallel::Groups& groups) {
  parallel::ZeroConfig zc = gpt::expert_zero_config(c);
  zc.tp_rank = groups.etp_index, zc.dp_rank = groups.edp_index;
  zc.tp = groups.etp, zc.dp = groups.edp;
  return zc;
}

// A task's region names its micro-batch (and chunk, interleaved): the timeline shows the schedule.
std::string task_region(const parallel::Task& t, int chunks) {
  return chunks > 1 ? fmt::format("{} mb {} chunk {}", t.forward ? "forward" : "backward", t.mb, t.chunk)
                    : fmt::format("{} mb {}", t.forward ? "forward" : "backward", t.mb);
}

}  // namespace

RANKLAB_LESSON("gpt",
               "a GPT trained with tensor, sequence, pipeline and data parallelism, ZeRO and recompute",
               gpt_lesson, gpt::options_table());

}  // namespace ranklab
