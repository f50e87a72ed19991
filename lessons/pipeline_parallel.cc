// Pipeline parallelism, as the lecture writes it: the layers are split across ranks, rank s holding layers
// [s * layers/W, (s+1) * layers/W). Activations go forward from stage to stage with send/recv, and their
// gradients come back the same way. While one stage works the others wait: the pipeline bubble.
// Micro-batches shrink it, and the schedule decides the order in which a stage runs them:
//
//   naive   the whole batch as one micro-batch: forward through every stage, then backward
//   gpipe   the forwards of all micro-batches, then all the backwards
//   1f1b    after a short warm-up, one forward then one backward: the same bubble as gpipe, but a stage
//           keeps the activations of at most (stages - stage) micro-batches instead of all of them
//
//   ranklab run pipeline_parallel --world 4 --schedule gpipe --micro-batches 8
//   ranklab run pipeline_parallel --world 4 --schedule 1f1b --micro-batches 8 --async-p2p
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct PipelineOptions : mlp::TrainingOptions {
  int micro_batches = 4;
  std::string schedule = "1f1b";  // naive | gpipe | 1f1b
  bool async_p2p = false;         // isend/irecv instead of send/recv
};

// ---- the schedule -----------------------------------------------------------------------------------------

struct Task {
  bool forward;
  int mb;  // the micro-batch
};

// The order in which stage `stage` of `stages` runs the forward and backward of `m` micro-batches.
std::vector<Task> schedule(const std::string& name, int stage, int stages, int m) {
  std::vector<Task> order;
  if (name != "1f1b") {  // naive (m = 1) and gpipe: every forward, then every backward
    for (int k = 0; k < m; ++k) order.push_back({true, k});
    for (int k = 0; k < m; ++k) order.push_back({false, k});
    return order;
  }
  // 1f1b: stage s runs (stages - s - 1) forwards before its first backward, which is how many the stages
  // after it need to fill the pipeline; from then on every forward is followed by a backward, which frees
  // a micro-batch's activations as soon as the next one is made.
  const int warmup = std::min(stages - stage - 1, m);
  for (int k = 0; k < warmup; ++k) order.push_back({true, k});
  for (int k = warmup; k < m; ++k) {
    order.push_back({true, k});
    order.push_back({false, k - warmup});
  }
  for (int k = m - warmup; k < m; ++k) order.push_back({false, k});
  return order;
}

// How many micro-batches' activations a stage keeps alive at once under a schedule.
int max_alive(const std::string& name, int stage, int stages, int m) {
  return name == "1f1b" ? std::min(stages - stage, m) : m;
}

// This rank's place in the pipeline.
struct StagePlan {
  int stages = 1, stage = 0;
  int m = 1;                 // micro-batches: 1 with the naive schedule
  int layers_per_stage = 1;  // the lecture's local_num_layers
  int first_layer = 0;
  std::int64_t mb = 1;  // samples per micro-batch
  int warmup = 0;       // forwards before the first backward (below)
  bool first_stage = true, last_stage = true;
  int prev = -1, next = -1;  // the neighbouring stages; -1: none
};

// ---- one stage: its layers, and the activations of the micro-batches in flight ---------------------------

struct Stage {
  Rank& r;
  std::vector<Tensor> w, grads;           // this stage's layers only; gradients add up over micro-batches
  std::vector<std::vector<Tensor>> acts;  // per micro-batch: the stage's input and each layer's output
  int alive = 0, most_alive = 0;

  Tensor forward(int k, const Tensor& x) {
    std::vector<Tensor>& a = acts[k];
    a.push_back(x);
    for (size_t l = 0; l < w.size(); ++l) a.push_back(mlp::forward_layer(r, a[l], w[l]));
    most_alive = std::max(most_alive, ++alive);
    return a.back();
  }

  Tensor backward(int k, Tensor dy) {
    std::vector<Tensor>& a = acts[k];
    for (int l = static_cast<int>(w.size()) - 1; l >= 0; --l) {
      // The first stage's first layer could skip its input gradient: nobody needs it. Computing it keeps
      // every stage's work the same, which is what the bubble formula assumes.
      mlp::LayerGrads g = mlp::backward_layer(r, a[l], a[l + 1], w[l], dy, true);
      r.add_(grads[l], g.w, 1.0f);
      dy = g.x;
    }
    a.clear();  // this micro-batch's activations are no longer needed
    --alive;
    return dy;
  }
};

// ---- the hand-overs between stages ------------------------------------------------------------------------

// The lecture's send and recv, posted as one group per hand-over (torch.distributed's batch_isend_irecv,
// NCCL's ncclGroupStart/End): a stage that hands its result to a neighbour and takes its next input from
// the same neighbour posts both at once, so neither side waits for the other to go first. With blocking
// send/recv the compute stream waits for the whole group; with --async-p2p a received tensor is waited for
// only when a task reads it, and a send not at all until the end of the step.
struct Post {
  bool send = false;
  Tensor t;
  int peer = -1;  // -1 (no neighbour there): nothing to post
};
Post send_to(int peer, const Tensor& t) {
  return {true, t, peer};
}
Post recv_from(int peer) {
  return {false, {}, peer};
}

// A tensor on its way; take() makes the compute stream wait for it.
struct Incoming {
  Tensor t;
  Work arrived;
  bool defined() const { return t.defined(); }
  Tensor take() {
    arrived.wait();
    return t;
  }
};

// One step of one stage: its hand-overs, and its tasks, marked with events on the compute stream (they cost
// no host wait, so timing the schedule does not change it).
class StageStep {
 public:
  StageStep(Rank& r, const PipelineOptions& o, const StagePlan& p, Stage& st, mlp::RunSummary& summary,
            mlp::Traffic& traffic)
      : r_(r), o_(o), p_(p), st_(st), summary_(summary), traffic_(traffic) {}

  // Posts one group; returns its received tensor, if any.
  Incoming post(const std::vector<Post>& group);
  // Micro-batch k's forward and backward on this stage, each marked as a task.
  Tensor forward(int k, const Tensor& x);
  Tensor backward(int k, const Tensor& dy);
  // Waits for every send still in flight.
  void wait_for_sends();

  std::vector<Tensor> sums;                         // the last stage: each micro-batch's output sum
  std::vector<std::pair<Event, Event>> task_marks;  // each task's start and end, in the schedule's order

 private:
  Rank& r_;
  const PipelineOptions& o_;
  const StagePlan& p_;
  Stage& st_;
  mlp::RunSummary& summary_;
  mlp::Traffic& traffic_;
  // Sends in flight, with the tensors they read (which must live until then; a backward reads the
  // activation its forward sent on).
  std::vector<std::pair<Work, Tensor>> sending_;
};

// The last step's tasks, for the printout and the report's schedule chart.
struct TaskSpan {
  float start_us, end_us;  // from the step's start
};
struct LastStep {
  double step_us = 0;
  std::vector<TaskSpan> spans;
  std::vector<PipelineTask> tasks;  // the same on the run's clock
};

StagePlan plan_of(const PipelineOptions& o, int stages, int stage);
void print_plan(Rank& r, const PipelineOptions& o, const StagePlan& p);
void record_tasks(Rank& r, const PipelineOptions& o, const StagePlan& p, const StageStep& run,
                  const Event& step_start, double step_start_us, LastStep& last);
void check_step(Rank& r, const PipelineOptions& o, const StagePlan& p, mlp::RunSummary& summary, int step,
                const Stage& st, const StageStep& run, double step_us);
void print_summary(Rank& r, const PipelineOptions& o, const StagePlan& p, mlp::RunSummary& summary,
                   const Stage& st, const LastStep& last, const mlp::Traffic& traffic);

void pipeline_parallel(Rank& r, const PipelineOptions& o) {
  // --break micro-batch-mean: the last stage averages the loss over each micro-batch instead of the batch
  // (gradients micro-batches times too large); no-zero-grad: gradients accumulate across steps.
  const StagePlan p = plan_of(o, r.world_size(), r.rank());
  const int m = p.m, prev = p.prev, next = p.next;
  print_plan(r, o, p);

  Stage st{r, {}, {}, {}};
  for (int l = p.first_layer; l < p.first_layer + p.layers_per_stage; ++l) {
    st.w.push_back(mlp::make_weight(r, o, l));
    st.grads.push_back(o.phantom ? r.phantom({o.dim, o.dim}) : r.zeros({o.dim, o.dim}));
  }
  mlp::Optimizer opt(r, o, st.w);
  std::vector<Tensor> inputs;  // the first stage makes the micro-batches; the others receive them
  if (p.first_stage) {
    for (int k = 0; k < m; ++k) inputs.push_back(mlp::make_samples(r, o, k * p.mb, p.mb));
  }
  Tensor dloss;  // the last stage starts the backward: d loss / d output
  if (p.last_stage) {
    dloss = mlp::loss_grad(r, o, {p.mb, o.dim}, o.broken == "micro-batch-mean" ? p.mb : o.batch);
  }
  mlp::RunSummary summary(r, o, "pipeline_parallel");
  mlp::Traffic traffic;
  LastStep last;

  for (int step = 1; step <= o.steps; ++step) {
    if (o.broken != "no-zero-grad") {
      for (Tensor& g : st.grads) r.scale_(g, 0.0f);
    }
    TimedStep timed(r);
    const Event step_start = r.record_event();
    traffic = {};
    st.acts.assign(m, {});
    StageStep run(r, o, p, st, summary, traffic);
    auto input = [&](int k, Incoming& posted) {  // the first stage's own micro-batch, or the one posted
      return p.first_stage ? Incoming{inputs[k], Work()}
                           : (posted.defined() ? posted : run.post({recv_from(prev)}));
    };

    timed.phase("schedule");  // marks the schedule on the report's timeline
    // Warm-up: forwards only, until the stages after this one have work. With --async-p2p the next input's
    // receive is posted before this forward computes, so it travels meanwhile (warm-up and cool-down only
    // move data one way between two neighbours, so posting early cannot cross a transfer the neighbour
    // posts in the other direction).
    Incoming x;  // the next forward's input, when already posted
    for (int k = 0; k < p.warmup; ++k) {
      Incoming in = input(k, x);
      x = o.async_p2p && k + 1 < m ? run.post({recv_from(prev)}) : Incoming();
      Tensor out = run.forward(k, in.take());
      run.post({send_to(next, out)});
    }
    // Steady state: one forward, then one backward. After the forward, its activation goes to the next
    // stage in the same group as the receive of the gradient for the backward; after the backward, its
    // gradient goes to the stage before in the same group as the receive of the next forward's input.
    for (int i = 0; i < m - p.warmup; ++i) {
      const int k = p.warmup + i;
      Incoming in = input(k, x);
      x = Incoming();
      Tensor out = run.forward(k, in.take());
      Incoming dy = run.post({send_to(next, out), recv_from(next)});
      // With --async-p2p the next forward's input is posted before this backward computes. (The stage
      // before sends that activation before it receives this gradient, so the two neighbours post the
      // pair's transfers in the same order.)
      const bool early = o.async_p2p && k + 1 < m;
      if (early) x = run.post({recv_from(prev)});
      Tensor dx = run.backward(i, p.last_stage ? dloss : dy.take());
      if (early) {
        run.post({send_to(prev, dx)});
      } else {
        x = run.post({send_to(prev, dx), recv_from(k + 1 < m ? prev : -1)});
      }
    }
    // Cool-down: the backwards of the micro-batches still in flight.
    Incoming dy_next;
    for (int i = m - p.warmup; i < m; ++i) {
      Incoming dy = p.last_stage ? Incoming{dloss, Work()}
                                 : (dy_next.defined() ? dy_next : run.post({recv_from(next)}));
      dy_next = o.async_p2p && i + 1 < m && !p.last_stage ? run.post({recv_from(next)}) : Incoming();
      Tensor dx = run.backward(i, dy.take());
      run.post({send_to(prev, dx)});
    }
    run.wait_for_sends();
    // The host ran ahead of the device all along; one wait here, so that the region on the report's
    // timeline ends where the schedule's work does.
    r.synchronize();
    timed.end_phase();
    {
      auto scope = r.region("optimizer");
      opt.step(st.grads);
    }
    last.step_us = timed.finish();
    record_tasks(r, o, p, run, step_start, timed.start_us(), last);
    check_step(r, o, p, summary, step, st, run, last.step_us);
  }
  print_summary(r, o, p, summary, st, last, traffic);
}

// ---- the hand-overs and the tasks -------------------------------------------------------------------------

Incoming StageStep::post(const std::vector<Post>& group) {
  std::vector<Rank::P2POp> ops;
  Incoming received;
  for (const Post& p : group) {
    if (p.peer < 0 || p.peer >= p_.stages) continue;
    Tensor t = p.send ? p.t : mlp::buffer(r_, o_, {p_.mb, o_.dim});
    if (!p.send) received.t = t;
    ops.push_back({p.send ? CommOp::Send : CommOp::Recv, t, p.peer});
    traffic_.add(t);
  }
  if (ops.empty()) return received;
  std::vector<Work> works = r_.batch_isend_irecv(ops);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!o_.async_p2p) {
      works[i].wait();  // blocking: the compute stream waits for the whole group now
    } else if (ops[i].op == CommOp::Recv) {
      received.arrived = works[i];  // waited for when the task that reads it starts
    } else {
      sending_.emplace_back(works[i], ops[i].tensor);
    }
  }
  return received;
}

Tensor StageStep::forward(int k, const Tensor& x) {
  Event start = r_.record_event();
  Tensor out = st_.forward(k, x);
  if (p_.last_stage) sums.push_back(mlp::output_sum(r_, out));
  task_marks.emplace_back(start, r_.record_event());
  summary_.sample_memory();
  return out;
}

Tensor StageStep::backward(int k, const Tensor& dy) {
  for (auto& [work, t] : sending_) {
    if (t.same_storage(st_.acts[k].back())) work.wait();  // the backward reads what was sent forward
  }
  Event start = r_.record_event();
  Tensor dx = st_.backward(k, dy);
  task_marks.emplace_back(start, r_.record_event());
  summary_.sample_memory();
  return dx;
}

void StageStep::wait_for_sends() {
  for (auto& [work, tensor] : sending_) work.wait();
}

// Each task's start and end, read after the step from its events.
void record_tasks(Rank& r, const PipelineOptions& o, const StagePlan& p, const StageStep& run,
                  const Event& step_start, double step_start_us, LastStep& last) {
  last.spans.clear();
  last.tasks.clear();
  const std::vector<Task> order = schedule(o.schedule, p.stage, p.stages, p.m);
  for (size_t i = 0; i < run.task_marks.size(); ++i) {
    const double start = r.elapsed_us(step_start, run.task_marks[i].first),
                 end = r.elapsed_us(step_start, run.task_marks[i].second);
    last.spans.push_back({static_cast<float>(start), static_cast<float>(end)});
    // The step's start event was recorded at its start on the host, with the device idle: the run's clock.
    last.tasks.push_back(
        {r.rank(), p.stage, 0, order[i].mb, order[i].forward, step_start_us + start, step_start_us + end});
  }
}

// ---- checks and output --------------------------------------------------------------------------------

StagePlan plan_of(const PipelineOptions& o, int stages, int stage) {
  if (o.layers % stages != 0) {
    throw UsageError(
        fmt::format("pipeline_parallel: --layers {} is not divisible by --world {}: each stage holds "
                    "layers/world layers; use a multiple of {} such as {}",
                    o.layers, stages, stages, (o.layers / stages + 1) * stages));
  }
  StagePlan p;
  p.stages = stages;
  p.stage = stage;
  p.m = o.schedule == "naive" ? 1 : o.micro_batches;
  if (o.batch % p.m != 0) {
    throw UsageError(
        fmt::format("pipeline_parallel: --micro-batches {} does not divide --batch {}: micro-batches must be "
                    "equal; use a divisor of {}",
                    p.m, o.batch, o.batch));
  }
  p.layers_per_stage = o.layers / stages;
  p.first_layer = stage * p.layers_per_stage;
  p.mb = o.batch / p.m;
  // How many forwards a stage runs before its first backward: 1f1b, as many as the stages after it need
  // to fill the pipeline; gpipe (and naive, one micro-batch), all of them.
  p.warmup = o.schedule == "1f1b" ? std::min(stages - stage - 1, p.m) : p.m;
  p.first_stage = stage == 0;
  p.last_stage = stage == stages - 1;
  p.prev = p.first_stage ? -1 : stage - 1;
  p.next = p.last_stage ? -1 : stage + 1;
  return p;
}

// What each stage will hold at most, on rank 0.
void print_plan(Rank& r, const PipelineOptions& o, const StagePlan& p) {
  if (!p.first_stage) return;
  const int stages = p.stages, per = p.layers_per_stage, m = p.m;
  auto memory_of = [&](int s) {
    mlp::Memory mem;
    mem.params = per * mlp::f32_bytes(o.dim * o.dim);
    mem.grads = mem.params;
    mem.optimizer = mlp::optimizer_bytes(o, mem.params);
    mem.activations = max_alive(o.schedule, s, stages, m) * (per + 1) * mlp::f32_bytes(p.mb * o.dim);
    return mem;
  };
  r.print(
      fmt::format("pipeline_parallel: {} stages of {} layer{}; {}; schedule {}, {} micro-batch{} of {}, "
                  "{} send/recv",
                  stages, per, per == 1 ? "" : "s", mlp::describe(o), o.schedule, m, m == 1 ? "" : "es", p.mb,
                  o.async_p2p ? "asynchronous (isend/irecv)" : "blocking"));
  r.print("memory per stage (a stage holds its layers, and the activations of the micro-batches in flight):");
  bool fits = true;
  for (int s = 0; s < stages; ++s) {
    if (stages > 8 && s == 4) r.print(fmt::format("  ... ({} more stages)", stages - 8));
    if (stages > 8 && s >= 4 && s < stages - 4) continue;
    fits = mlp::print_memory_plan(r, fmt::format("stage {}", s), memory_of(s)) && fits;
  }
  if (!fits) {
    r.print(
        "  each stage holds layers/world layers: more stages shrink it, and 1f1b keeps fewer "
        "micro-batches' activations than gpipe");
  }
}

// The step's gradients and weights (and on the last stage the loss) against one device's; the last stage
// prints the step's line.
void check_step(Rank& r, const PipelineOptions& o, const StagePlan& p, mlp::RunSummary& summary, int step,
                const Stage& st, const StageStep& run, double step_us) {
  double loss = 0;
  const auto d = summary.check_step(
      step, "every stage's gradients and weights, and the loss,",
      [&](const mlp::Reference& ref) {
        check::Agreement diff = mlp::compare_layers(r, ref, st.grads, st.w, p.first_layer, 0, o.dim);
        if (p.last_stage) {
          for (const Tensor& s : run.sums) loss += r.to_host(s)[0];
          loss /= static_cast<double>(o.batch);
          diff.merge(check::within_bound(loss, ref.loss(), ref.loss_bound(), "the loss"));
        }
        return diff;
      },
      fmt::format("stage {}{}: ", p.stage, p.last_stage ? " (with the loss)" : ""));
  if (d && p.last_stage && !o.quiet) {
    r.print(fmt::format("step {}/{}  time {}  loss {:.6f} (one device {:.6f})  {}", step, o.steps,
                        mlp::format_time(step_us), loss, summary.reference()->loss(), check::verdict(*d)));
  }
}

// What each stage sends rank 0 after the training, after RunSummary's own figures: its last step's tasks,
// then the most micro-batches it kept alive.
struct StageFigures {
  std::vector<TaskSpan> spans;
  float most_alive = 0;

  std::vector<float> floats() const {
    std::vector<float> v;
    for (const TaskSpan& t : spans) v.push_back(t.start_us), v.push_back(t.end_us);
    v.push_back(most_alive);
    return v;
  }
  static StageFigures from(const std::vector<float>& v) {
    StageFigures f;
    for (size_t i = 0; i + 1 < v.size(); i += 2) f.spans.push_back({v[i], v[i + 1]});
    f.most_alive = v.back();
    return f;
  }
};

// `spans[s]`: the tasks of rank s, in its schedule's order.
void print_gantt(Rank& r, const std::string& sched, int m, const std::vector<std::vector<TaskSpan>>& spans,
                 double window) {
  const int width = 96, stages = static_cast<int>(spans.size());
  r.print(
      fmt::format("the schedule, {} per column: the digit k is the forward of micro-batch k, the letter "
                  "(a = 0, b = 1, ...) its backward, '.' a rank not computing: the bubble",
                  mlp::format_time(window / width)));
  for (int s = 0; s < stages; ++s) {
    std::string row(width, '.');
    std::vector<Task> order = schedule(sched, s, stages, m);
    for (size_t i = 0; i < order.size(); ++i) {
      const int c0 =
          std::clamp(static_cast<int>(std::lround(spans[s][i].start_us / window * width)), 0, width - 1);
      const int c1 =
          std::clamp(static_cast<int>(std::lround(spans[s][i].end_us / window * width)), c0 + 1, width);
      const char c = static_cast<char>((order[i].forward ? '0' : 'a') + order[i].mb % 10);
      std::fill(row.begin() + c0, row.begin() + c1, c);
    }
    r.print(fmt::format("  rank {:<3}|{}|", s, row));
  }
  r.print(fmt::format("  {:<8}0{:>{}}", "", mlp::format_time(window), width));
}

// After the training: the schedule for the report, 1f1b's bound on the activations, and on rank 0 every
// stage's compute and waiting, the bubble against its formula, and the schedule drawn.
void print_summary(Rank& r, const PipelineOptions& o, const StagePlan& p, mlp::RunSummary& summary,
                   const Stage& st, const LastStep& last, const mlp::Traffic& traffic) {
  const int stages = p.stages, m = p.m;
  r.report_pipeline(last.tasks);
  summary.begin_report();
  const int bound = max_alive(o.schedule, p.stage, stages, m);
  if (o.schedule == "1f1b") {  // at most p - stage, so never more than p, however many micro-batches
    r.check("pipeline_parallel 1f1b: a stage keeps the activations of at most p micro-batches",
            st.most_alive <= bound,
            fmt::format("stage {}: at most {} alive at once; the schedule allows p - stage = {} (p = {})",
                        p.stage, st.most_alive, bound, stages));
  }
  if (!summary.gather(StageFigures{last.spans, static_cast<float>(st.most_alive)}.floats())) return;

  std::vector<StageFigures> all;
  double window = 0, bubble_sum = 0;  // every rank's clock starts the step at the same barrier
  for (int s = 0; s < stages; ++s) {
    all.push_back(StageFigures::from(summary.extra(s)));
    window = std::max<double>(window, all[s].spans.back().end_us);
  }
  std::vector<std::vector<TaskSpan>> spans;
  r.print(
      "per rank, over the last step's schedule (the report below splits 'waiting' into communication "
      "and idle):");
  for (int s = 0; s < stages; ++s) {
    double busy = 0;
    for (const TaskSpan& t : all[s].spans) busy += t.end_us - t.start_us;
    bubble_sum += 1.0 - busy / window;
    spans.push_back(all[s].spans);
    if (o.quiet && s > 0) continue;
    r.print(
        fmt::format("  rank {:<3} compute {:>10}  waiting {:>10}  bubble {:5.1f}%  activations of at most "
                    "{} micro-batch{} alive  peak memory {}",
                    s, mlp::format_time(busy), mlp::format_time(window - busy), 100 * (1.0 - busy / window),
                    static_cast<int>(all[s].most_alive), all[s].most_alive == 1 ? "" : "es",
                    format_bytes(summary.peak_bytes_of(s))));
  }
  r.print(
      fmt::format("bubble fraction {:.4f} measured (mean over ranks); (p-1)/(m+p-1) = {}/{} = {:.4f} "
                  "for uniform stages and free communication",
                  bubble_sum / stages, stages - 1, m + stages - 1, (stages - 1.0) / (m + stages - 1.0)));
  r.print(
      fmt::format("communication per rank per step: up to {} in {} send/recv calls (only activations and "
                  "their gradients cross stages)",
                  format_bytes(traffic.bytes), traffic.calls));
  if (!o.quiet) print_gantt(r, o.schedule, m, spans, window);
  if (summary.skipped_comparison()) return;
  summary.print_agreement(" (each stage's layers)");
}

}  // namespace

using O = PipelineOptions;
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .add({
            {"world", &O::world, "ranks: pipeline stages, each holding layers/world layers"},
            Option<O>("micro-batches", &O::micro_batches, "micro-batches per batch (must divide it)")
                .at_least(1),
            Option<O>("schedule", &O::schedule, "the pipeline's schedule")
                .choices({"naive", "gpipe", "1f1b"}),
            {"async-p2p", &O::async_p2p, "isend/irecv instead of blocking send/recv"},
            break_option<O>(&O::broken, {"micro-batch-mean", "no-zero-grad"}),
        });
const std::vector<LectureSetting> kLecture = {
    {"world", "2", "the lecture's code is forward only; the lesson also runs the backward, to train"},
    {"layers", "4", ""},
    {"micro-batches", "4", ""},
    {"batch", "128", ""},
    {"dim", "1024", ""}};

RANKLAB_LESSON("pipeline_parallel", "split the layers into stages: send/recv, micro-batches, the bubble",
               pipeline_parallel, kOptions, kLecture);

}  // namespace ranklab
