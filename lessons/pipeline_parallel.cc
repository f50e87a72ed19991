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
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"

namespace ranklab {
namespace {

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

// ---- what rank 0 prints after the last step ---------------------------------------------------------------

// `times[s]` holds (start, end) of each task of rank s, in its schedule's order, from the step's start.
void print_gantt(Rank& r, const std::string& sched, int m, const std::vector<std::vector<float>>& times,
                 double window) {
  const int width = 96, stages = static_cast<int>(times.size());
  r.print(
      fmt::format("the schedule, {} per column: the digit k is the forward of micro-batch k, the letter "
                  "(a = 0, b = 1, ...) its backward, '.' a rank not computing: the bubble",
                  mlp::format_time(window / width)));
  for (int s = 0; s < stages; ++s) {
    std::string row(width, '.');
    std::vector<Task> order = schedule(sched, s, stages, m);
    for (size_t i = 0; i < order.size(); ++i) {
      const int c0 =
          std::clamp(static_cast<int>(std::lround(times[s][2 * i] / window * width)), 0, width - 1);
      const int c1 =
          std::clamp(static_cast<int>(std::lround(times[s][2 * i + 1] / window * width)), c0 + 1, width);
      const char c = static_cast<char>((order[i].forward ? '0' : 'a') + order[i].mb % 10);
      std::fill(row.begin() + c0, row.begin() + c1, c);
    }
    r.print(fmt::format("  rank {:<3}|{}|", s, row));
  }
  r.print(fmt::format("  {:<8}0{:>{}}", "", mlp::format_time(window), width));
}

struct PipelineOptions : mlp::TrainingOptions {
  int micro_batches = 4;
  std::string schedule = "1f1b";  // naive | gpipe | 1f1b
  bool async_p2p = false;         // isend/irecv instead of send/recv
};

void pipeline_parallel(Rank& r, const PipelineOptions& o) {
  // --break micro-batch-mean: the last stage averages the loss over each micro-batch instead of the batch
  // (gradients micro-batches times too large); no-zero-grad: gradients accumulate across steps.
  const int stages = r.world_size(), stage = r.rank();
  const std::string& sched = o.schedule;
  if (o.layers % stages != 0) {
    throw UsageError(
        fmt::format("pipeline_parallel: --layers {} is not divisible by --world {}: each stage holds "
                    "layers/world layers; use a multiple of {} such as {}",
                    o.layers, stages, stages, (o.layers / stages + 1) * stages));
  }
  const int m = sched == "naive" ? 1 : o.micro_batches;
  if (o.batch % m != 0) {
    throw UsageError(
        fmt::format("pipeline_parallel: --micro-batches {} does not divide --batch {}: micro-batches must be "
                    "equal; use a divisor of {}",
                    m, o.batch, o.batch));
  }
  const int per = o.layers / stages, first = stage * per;  // the lecture's local_num_layers
  const std::int64_t mb = o.batch / m;                     // samples per micro-batch
  const bool first_stage = stage == 0, last_stage = stage == stages - 1;

  auto plan_of = [&](int s) {  // what stage s holds at most
    mlp::Memory p;
    p.params = per * mlp::f32_bytes(o.dim * o.dim);
    p.grads = p.params;
    p.optimizer = mlp::optimizer_bytes(o, p.params);
    p.activations = max_alive(sched, s, stages, m) * (per + 1) * mlp::f32_bytes(mb * o.dim);
    return p;
  };
  if (first_stage) {
    r.print(
        fmt::format("pipeline_parallel: {} stages of {} layer{}; {}; schedule {}, {} micro-batch{} of {}, "
                    "{} send/recv",
                    stages, per, per == 1 ? "" : "s", mlp::describe(o), sched, m, m == 1 ? "" : "es", mb,
                    o.async_p2p ? "asynchronous (isend/irecv)" : "blocking"));
    r.print(
        "memory per stage (a stage holds its layers, and the activations of the micro-batches in flight):");
    bool fits = true;
    for (int s = 0; s < stages; ++s) {
      if (stages > 8 && s == 4) r.print(fmt::format("  ... ({} more stages)", stages - 8));
      if (stages > 8 && s >= 4 && s < stages - 4) continue;
      fits = mlp::print_memory_plan(r, fmt::format("stage {}", s), plan_of(s)) && fits;
    }
    if (!fits) {
      r.print(
          "  each stage holds layers/world layers: more stages shrink it, and 1f1b keeps fewer "
          "micro-batches' activations than gpipe");
    }
  }

  Stage st{r, {}, {}, {}};
  for (int l = first; l < first + per; ++l) {
    st.w.push_back(mlp::make_weight(r, o, l));
    st.grads.push_back(o.phantom ? r.phantom({o.dim, o.dim}) : r.zeros({o.dim, o.dim}));
  }
  mlp::Optimizer opt(r, o, st.w);
  std::vector<Tensor> inputs;  // the first stage makes the micro-batches; the others receive them
  if (first_stage) {
    for (int k = 0; k < m; ++k) inputs.push_back(mlp::make_samples(r, o, k * mb, mb));
  }
  Tensor dloss;  // the last stage starts the backward: d loss / d output
  if (last_stage) dloss = mlp::loss_grad(r, o, {mb, o.dim}, o.broken == "micro-batch-mean" ? mb : o.batch);
  // How many forwards a stage runs before its first backward: 1f1b, as many as the stages after it need
  // to fill the pipeline; gpipe (and naive, one micro-batch), all of them.
  const int warmup = sched == "1f1b" ? std::min(stages - stage - 1, m) : m;
  mlp::RunSummary summary(r, o, "pipeline_parallel");
  mlp::Traffic traffic;
  std::vector<float> times;         // (start, end) of each task of the last step, from the step's start
  std::vector<PipelineTask> tasks;  // the same on the run's clock, for the report's schedule chart

  for (int step = 1; step <= o.steps; ++step) {
    // The step's phases as regions; an exception (running out of memory) closes the open one.
    std::optional<Rank::Region> phase;
    if (o.broken != "no-zero-grad") {
      for (Tensor& g : st.grads) r.scale_(g, 0.0f);
    }
    r.synchronize();
    r.barrier();
    const double t0 = r.now();
    const Event step_start = r.record_event();
    traffic = {};
    st.acts.assign(m, {});
    std::vector<Tensor> sums;  // the last stage: each micro-batch's output sum, for the loss
    // Each task's start and end, as events on the compute stream: they cost no host wait, so timing the
    // schedule does not change it. Read after the step.
    std::vector<std::pair<Event, Event>> marks;
    // Sends in flight, with the tensors they read (which must live until then; a backward reads the
    // activation its forward sent on).
    std::vector<std::pair<Work, Tensor>> sending;

    // The lecture's send and recv, posted as one group per hand-over (torch.distributed's
    // batch_isend_irecv, NCCL's ncclGroupStart/End): a stage that hands its result to a neighbour and
    // takes its next input from the same neighbour posts both at once, so neither side waits for the other
    // to go first. With blocking send/recv the compute stream waits for the whole group; with --async-p2p
    // a received tensor is waited for only when a task reads it, and a send not at all until the end.
    struct Post {
      bool send = false;
      Tensor t;
      int peer = -1;
    };
    struct Incoming {  // a tensor on its way; take() makes the compute stream wait for it
      Tensor t;
      Work arrived;
      bool defined() const { return t.defined(); }
      Tensor take() {
        arrived.wait();
        return t;
      }
    };
    auto post = [&](const std::vector<Post>& group) -> Incoming {  // the received tensor, if any
      std::vector<Rank::P2POp> ops;
      Incoming received;
      for (const Post& p : group) {
        if (p.peer < 0 || p.peer >= stages) continue;
        Tensor t = p.send ? p.t : mlp::buffer(r, o, {mb, o.dim});
        if (!p.send) received.t = t;
        ops.push_back({p.send ? CommOp::Send : CommOp::Recv, t, p.peer});
        traffic.add(t);
      }
      if (ops.empty()) return received;
      std::vector<Work> works = r.batch_isend_irecv(ops);
      for (size_t i = 0; i < ops.size(); ++i) {
        if (!o.async_p2p) {
          works[i].wait();  // blocking: the compute stream waits for the whole group now
        } else if (ops[i].op == CommOp::Recv) {
          received.arrived = works[i];  // waited for when the task that reads it starts
        } else {
          sending.emplace_back(works[i], ops[i].tensor);
        }
      }
      return received;
    };
    auto forward = [&](int k, const Tensor& x) {
      Event start = r.record_event();
      Tensor out = st.forward(k, x);
      if (last_stage) sums.push_back(mlp::output_sum(r, out));
      marks.emplace_back(start, r.record_event());
      summary.sample_memory();
      return out;
    };
    auto backward = [&](int k, const Tensor& dy) {
      for (auto& [work, t] : sending) {
        if (t.same_storage(st.acts[k].back())) work.wait();  // the backward reads what was sent forward
      }
      Event start = r.record_event();
      Tensor dx = st.backward(k, dy);
      marks.emplace_back(start, r.record_event());
      summary.sample_memory();
      return dx;
    };
    const int prev = first_stage ? -1 : stage - 1, next = last_stage ? -1 : stage + 1;

    phase.emplace(&r, "schedule");  // marks the schedule on the report's timeline
    // Warm-up: forwards only, until the stages after this one have work.
    Incoming x;  // the next forward's input, when already posted
    // With --async-p2p the next input's receive is posted before this forward computes, so it travels
    // meanwhile (warm-up and cool-down only move data one way between two neighbours, so posting early
    // cannot cross a transfer the neighbour posts in the other direction).
    for (int k = 0; k < warmup; ++k) {
      Incoming in = first_stage ? Incoming{inputs[k], Work()} : (x.defined() ? x : post({{false, {}, prev}}));
      x = o.async_p2p && k + 1 < m ? post({{false, {}, prev}}) : Incoming();
      Tensor out = forward(k, in.take());
      post({{true, out, next}});
    }
    // Steady state: one forward, then one backward. After the forward, its activation goes to the next
    // stage in the same group as the receive of the gradient for the backward; after the backward, its
    // gradient goes to the stage before in the same group as the receive of the next forward's input.
    for (int i = 0; i < m - warmup; ++i) {
      const int k = warmup + i;
      Incoming in = first_stage ? Incoming{inputs[k], Work()} : (x.defined() ? x : post({{false, {}, prev}}));
      x = Incoming();
      Tensor out = forward(k, in.take());
      Incoming dy = post({{true, out, next}, {false, {}, next}});
      // With --async-p2p the next forward's input is posted before this backward computes. (The stage
      // before sends that activation before it receives this gradient, so the two neighbours post the
      // pair's transfers in the same order.)
      const bool early = o.async_p2p && k + 1 < m;
      if (early) x = post({{false, {}, prev}});
      Tensor dx = backward(i, last_stage ? dloss : dy.take());
      if (early) {
        post({{true, dx, prev}});
      } else {
        x = post({{true, dx, prev}, {false, {}, k + 1 < m ? prev : -1}});
      }
    }
    // Cool-down: the backwards of the micro-batches still in flight.
    Incoming dy_next;
    for (int i = m - warmup; i < m; ++i) {
      Incoming dy =
          last_stage ? Incoming{dloss, Work()} : (dy_next.defined() ? dy_next : post({{false, {}, next}}));
      dy_next = o.async_p2p && i + 1 < m && !last_stage ? post({{false, {}, next}}) : Incoming();
      Tensor dx = backward(i, dy.take());
      post({{true, dx, prev}});
    }
    for (auto& [work, tensor] : sending) work.wait();
    // The host ran ahead of the device all along; one wait here, so that the region on the report's
    // timeline ends where the schedule's work does.
    r.synchronize();
    phase.reset();
    {
      auto scope = r.region("optimizer");
      opt.step(st.grads);
    }
    r.synchronize();
    const double step_us = r.now() - t0;
    times.clear();
    tasks.clear();
    const std::vector<Task> order = schedule(sched, stage, stages, m);
    for (size_t i = 0; i < marks.size(); ++i) {
      const double start = r.elapsed_us(step_start, marks[i].first),
                   end = r.elapsed_us(step_start, marks[i].second);
      times.push_back(static_cast<float>(start));
      times.push_back(static_cast<float>(end));
      // The step's start event was recorded at t0 on the host, with the device idle: the run's clock.
      tasks.push_back({r.rank(), stage, 0, order[i].mb, order[i].forward, t0 + start, t0 + end});
    }

    double loss = 0;
    const auto d = summary.check_step(
        step, "every stage's gradients and weights, and the loss,",
        [&](const mlp::Reference& ref) {
          check::Agreement diff = mlp::compare_layers(r, ref, st.grads, st.w, first, 0, o.dim);
          if (last_stage) {
            for (const Tensor& s : sums) loss += r.to_host(s)[0];
            loss /= static_cast<double>(o.batch);
            diff.merge(check::within_bound(loss, ref.loss(), ref.loss_bound(), "the loss"));
          }
          return diff;
        },
        fmt::format("stage {}{}: ", stage, last_stage ? " (with the loss)" : ""));
    if (d && last_stage && !o.quiet) {
      r.print(fmt::format("step {}/{}  time {}  loss {:.6f} (one device {:.6f})  {}", step, o.steps,
                          mlp::format_time(step_us), loss, summary.reference()->loss(), check::verdict(*d)));
    }
  }

  r.report_pipeline(tasks);
  summary.begin_report();
  const int bound = max_alive(sched, stage, stages, m);
  if (sched == "1f1b") {  // at most p - stage, so never more than p, however many micro-batches
    r.check("pipeline_parallel 1f1b: a stage keeps the activations of at most p micro-batches",
            st.most_alive <= bound,
            fmt::format("stage {}: at most {} alive at once; the schedule allows p - stage = {} (p = {})",
                        stage, st.most_alive, bound, stages));
  }
  // Every stage's times and statistics to rank 0, which measures the bubble and draws the schedule.
  std::vector<float> extra = times;
  const size_t n = times.size();
  extra.push_back(static_cast<float>(st.most_alive));
  if (!summary.gather(extra)) return;

  double window = 0, bubble_sum = 0;  // every rank's clock starts the step at the same barrier
  for (int s = 0; s < stages; ++s) window = std::max<double>(window, summary.extra(s)[n - 1]);
  std::vector<std::vector<float>> task_times;
  r.print(
      "per rank, over the last step's schedule (the report below splits 'waiting' into communication "
      "and idle):");
  for (int s = 0; s < stages; ++s) {
    const std::vector<float> v = summary.extra(s);
    double busy = 0;
    for (size_t i = 0; i < n; i += 2) busy += v[i + 1] - v[i];
    bubble_sum += 1.0 - busy / window;
    task_times.emplace_back(v.begin(), v.begin() + n);
    if (o.quiet && s > 0) continue;
    r.print(
        fmt::format("  rank {:<3} compute {:>10}  waiting {:>10}  bubble {:5.1f}%  activations of at most "
                    "{} micro-batch{} alive  peak memory {}",
                    s, mlp::format_time(busy), mlp::format_time(window - busy), 100 * (1.0 - busy / window),
                    static_cast<int>(v[n]), v[n] == 1 ? "" : "es", format_bytes(summary.peak_bytes_of(s))));
  }
  r.print(
      fmt::format("bubble fraction {:.4f} measured (mean over ranks); (p-1)/(m+p-1) = {}/{} = {:.4f} "
                  "for uniform stages and free communication",
                  bubble_sum / stages, stages - 1, m + stages - 1, (stages - 1.0) / (m + stages - 1.0)));
  r.print(
      fmt::format("communication per rank per step: up to {} in {} send/recv calls (only activations and "
                  "their gradients cross stages)",
                  format_bytes(traffic.bytes), traffic.calls));
  if (!o.quiet) print_gantt(r, sched, m, task_times, window);
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
