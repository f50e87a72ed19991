// Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): backward
// needs every layer's input and output, and keeping them all from the forward is what fills a GPU's memory.
// Instead, keep only the input of each segment of k layers (its checkpoint), and when backward reaches a
// segment, run the segment's forward again from the checkpoint. Memory: L + 1 activations become about
// L/k checkpoints plus the k + 1 of the segment being recomputed. Compute: one more forward of every segment
// but the last, at most a third more work, since a backward costs two forwards.
//
// The lesson trains the MLP four ways, each checked against one device every step: data parallel without
// and with checkpoints every ~sqrt(L) layers, and the pipeline (parallel::Pipeline, the 1F1B schedule the
// gpt model runs) without and with a stage as one segment, which is Megatron's full recompute: a stage keeps
// only its input for each micro-batch in flight. The gpt model's selective and full recompute live in
// lessons/gpt/model.cc.
//
//   ranklab run recompute --world 4
//   ranklab run recompute --world 4 --layers 16 --dim 512
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

// Layers [0, n) of `w`, forward and backward, keeping every activation (k = n + 1: no checkpoints) or only
// the input of each segment of k layers. The activations a forward keeps live in `acts` (acts[l]: the
// input of layer l, acts[n]: the output), undefined where not kept.
struct Segments {
  Rank& r;
  const std::vector<Tensor>& w;
  int k;
  bool recompute;
  bool broken;              // --break skip-layer: the recomputed forward skips a segment's first layer
  std::int64_t& kept_most;  // the most bytes of activations held at once, over the step
  int forwards = 0;         // layer forwards run, recomputations included

  int n() const { return static_cast<int>(w.size()); }
  void measure(const std::vector<std::vector<Tensor>*>& all) {
    std::int64_t bytes = 0;
    for (const auto* acts : all)
      for (const Tensor& t : *acts) bytes += t.defined() ? t.bytes() : 0;
    kept_most = std::max(kept_most, bytes);
  }
  Tensor forward(const Tensor& x, std::vector<Tensor>& acts, const std::vector<std::vector<Tensor>*>& all) {
    acts.assign(n() + 1, Tensor());
    acts[0] = x;
    Tensor y = x;
    for (int l = 0; l < n(); ++l) {
      y = mlp::forward_layer(r, y, w[l]);
      ++forwards;
      if (!recompute || ((l + 1) % k == 0 && l + 1 < n())) acts[l + 1] = y;  // a segment's input is kept
      measure(all);
    }
    return y;
  }
  // Adds the layers' gradients into `grads`; returns the input's gradient (undefined unless `want_dx`).
  Tensor backward(std::vector<Tensor>& acts, Tensor dy, std::vector<Tensor>& grads, bool want_dx,
                  const std::vector<std::vector<Tensor>*>& all) {
    for (int start = (n() - 1) / k * k; start >= 0; start -= k) {
      const int end = std::min(start + k, n());
      // The segment's forward again, from its checkpoint, for the outputs not held (the last one is the
      // next segment's checkpoint, still held until this segment's backward).
      for (int l = start; l < end; ++l) {
        if (acts[l + 1].defined()) continue;
        acts[l + 1] = broken && l == start ? acts[l] : mlp::forward_layer(r, acts[l], w[l]);
        ++forwards;
        measure(all);
      }
      for (int l = end - 1; l >= start; --l) {
        mlp::LayerGrads g = mlp::backward_layer(r, acts[l], acts[l + 1], w[l], dy, l > 0 || want_dx);
        r.add_(grads[l], g.w, 1.0f);
        dy = g.x;
        acts[l + 1] = Tensor();  // layer l + 1's backward, its only other reader, is done
      }
    }
    acts.clear();
    return dy;
  }
};

struct Run {
  std::string name;
  std::int64_t kept_bytes = 0;
  double step_us = 0, forwards_per_layer = 0, worst = 0, relative = 0;
};

struct RecomputeOptions : mlp::TrainingOptions {
  int micro_batches = 4;  // the pipeline's
  RecomputeOptions() {
    batch = 64;
    dim = 256;
    layers = 16;
    steps = 2;
  }
};

// Data parallel: every rank the whole model and batch/world samples; all_reduce(Avg) of the gradients.
Run data_parallel(Rank& r, const RecomputeOptions& o, bool recompute, int k) {
  const int world = r.world_size(), rank = r.rank();
  const std::int64_t local = o.batch / world;
  std::vector<Tensor> w, grads;
  for (int l = 0; l < o.layers; ++l) {
    w.push_back(mlp::make_weight(r, o, l));
    grads.push_back(r.zeros({o.dim, o.dim}));
  }
  mlp::Optimizer opt(r, o, w);
  Tensor x = mlp::make_samples(r, o, rank * local, local);
  Tensor dloss = mlp::loss_grad(r, o, {local, o.dim}, local);
  mlp::Reference ref(o);
  Run run{recompute ? fmt::format("data parallel, checkpoint every {} layer{}", k, k == 1 ? "" : "s")
                    : "data parallel, keep every activation"};
  check::Agreement worst;
  for (int step = 1; step <= o.steps; ++step) {
    for (Tensor& g : grads) r.scale_(g, 0.0f);
    TimedStep timed(r);
    std::int64_t kept = 0;
    Segments seg{r, w, recompute ? k : o.layers + 1, recompute, o.broken == "skip-layer", kept};
    std::vector<Tensor> acts;
    const std::vector<std::vector<Tensor>*> all{&acts};
    Tensor out_sum = mlp::output_sum(r, seg.forward(x, acts, all));
    seg.backward(acts, dloss, grads, false, all);
    for (Tensor& g : grads) r.all_reduce(g, ReduceOp::Avg);
    opt.step(grads);
    run.step_us = timed.finish();
    run.kept_bytes = kept;
    run.forwards_per_layer = seg.forwards / static_cast<double>(o.layers);

    auto check = r.bookkeeping("check");
    ref.step();
    Tensor loss = r.from_host({1}, {static_cast<float>(r.to_host(out_sum)[0] / static_cast<double>(local))});
    r.all_reduce(loss, ReduceOp::Avg);
    check::Agreement d = check::within_bound(r.to_host(loss)[0], ref.loss(), ref.loss_bound(), "the loss");
    d.merge(mlp::compare_layers(r, ref, grads, w, 0, 0, o.dim));
    worst.merge(d);
    check::record_step(r, fmt::format("recompute, {}", run.name), step, "loss, gradients and weights", d);
  }
  run.worst = worst.worst;
  run.relative = worst.relative();
  return run;
}

// The pipeline: stage s holds layers [s L/W, (s+1) L/W); parallel::Pipeline runs the 1F1B schedule over
// --micro-batches and calls back for each task's forward and backward.
Run pipeline(Rank& r, const RecomputeOptions& o, bool recompute) {
  const int stages = r.world_size(), stage = r.rank(), per = o.layers / stages, first = stage * per;
  const int m = o.micro_batches;
  const std::int64_t mb = o.batch / m;
  std::vector<Tensor> w, grads;
  for (int l = first; l < first + per; ++l) {
    w.push_back(mlp::make_weight(r, o, l));
    grads.push_back(r.zeros({o.dim, o.dim}));
  }
  mlp::Optimizer opt(r, o, w);
  Tensor dloss = mlp::loss_grad(r, o, {mb, o.dim}, o.batch);
  std::vector<int> ranks(stages);
  for (int s = 0; s < stages; ++s) ranks[s] = s;
  parallel::ExposedComm exposed(r);
  parallel::Pipeline pipe(r, ranks, stage, 1, m, false, exposed);
  mlp::Reference ref(o);
  Run run{recompute ? "pipeline 1f1b, recompute each stage" : "pipeline 1f1b, keep every activation"};
  check::Agreement worst;
  for (int step = 1; step <= o.steps; ++step) {
    for (Tensor& g : grads) r.scale_(g, 0.0f);
    TimedStep timed(r);
    std::int64_t kept = 0;
    Segments seg{r, w, recompute ? per : per + 1, recompute, o.broken == "skip-layer", kept};
    std::vector<std::vector<Tensor>> acts(m);
    std::vector<std::vector<Tensor>*> all;
    for (auto& a : acts) all.push_back(&a);
    std::vector<Tensor> sums;
    auto forward = [&](const parallel::Task& t, const Tensor& in) {
      Tensor x = stage == 0 ? mlp::make_samples(r, o, t.mb * mb, mb) : in;
      Tensor y = seg.forward(x, acts[t.mb], all);
      if (stage == stages - 1) {
        sums.push_back(mlp::output_sum(r, y));
        return y;
      }
      // The send reads its tensor until the next stage takes it, and backward may read the kept output
      // meanwhile: send a copy (in both runs, so that their times compare).
      return r.slice(y, 0, 0, mb);
    };
    auto backward = [&](const parallel::Task& t, const Tensor& dy) {
      return seg.backward(acts[t.mb], stage == stages - 1 ? dloss : dy, grads, stage > 0, all);
    };
    pipe.run({mb, o.dim}, DType::Float32, forward, backward, false);
    opt.step(grads);
    run.step_us = timed.finish();
    run.kept_bytes = kept;
    run.forwards_per_layer = seg.forwards / static_cast<double>(per * m);

    ref.step();
    check::Agreement d = mlp::compare_layers(r, ref, grads, w, first, 0, o.dim);
    if (stage == stages - 1) {
      double loss = 0;
      for (const Tensor& s : sums) loss += r.to_host(s)[0];
      d.merge(
          check::within_bound(loss / static_cast<double>(o.batch), ref.loss(), ref.loss_bound(), "the loss"));
    }
    worst.merge(d);
    check::record_step(r, fmt::format("recompute, {}", run.name), step, "every stage's gradients and weights",
                       d, fmt::format("stage {}: ", stage));
  }
  run.worst = worst.worst;
  run.relative = worst.relative();
  return run;
}

void recompute(Rank& r, const RecomputeOptions& o) {
  const int world = r.world_size();
  if (o.batch % world != 0) {
    throw UsageError(fmt::format("recompute: --batch {} is not divisible by --world {}", o.batch, world));
  }
  if (o.layers % world != 0) {
    throw UsageError(
        fmt::format("recompute: --layers {} is not divisible by --world {}: each pipeline stage holds "
                    "layers/world layers",
                    o.layers, world));
  }
  if (o.batch % o.micro_batches != 0) {
    throw UsageError(
        fmt::format("recompute: --micro-batches {} must divide --batch {}", o.micro_batches, o.batch));
  }
  // Segments of about sqrt(L) layers: L/k checkpoints plus k recomputed activations is least there.
  const int k = std::max(1, static_cast<int>(std::lround(std::sqrt(o.layers))));
  if (r.rank() == 0) {
    r.print(fmt::format(
        "recompute: {} ranks; {}; the pipeline: {} stages of {} layers, {} micro-batches of {}", world,
        mlp::describe(o), world, o.layers / world, o.micro_batches, o.batch / o.micro_batches));
  }
  std::vector<Run> runs = {data_parallel(r, o, false, k), data_parallel(r, o, true, k), pipeline(r, o, false),
                           pipeline(r, o, true)};

  // The busiest rank's activations (the pipeline's first stage keeps the most micro-batches), and the
  // worst agreement of any rank.
  std::vector<float> mine;
  for (const Run& run : runs) {
    mine.push_back(static_cast<float>(run.kept_bytes));
    mine.push_back(static_cast<float>(run.worst));
    mine.push_back(static_cast<float>(run.relative));
  }
  auto all = mlp::gather_to_root(r, mine);
  if (r.rank() != 0) return;
  double used = 0, rel = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    for (const auto& v : all) {
      runs[i].kept_bytes = std::max<std::int64_t>(runs[i].kept_bytes, static_cast<std::int64_t>(v[3 * i]));
      used = std::max<double>(used, v[3 * i + 1]);
      rel = std::max<double>(rel, v[3 * i + 2]);
    }
  }
  const int per = o.layers / world, in_flight = std::min(world, o.micro_batches);
  r.print(
      "activations kept for backward (the busiest rank's most at once), the step's time, and layer forwards "
      "run per layer (recomputation included):");
  for (size_t i = 0; i < runs.size(); i += 2) {
    const Run &off = runs[i], &on = runs[i + 1];
    for (const Run* run : {&off, &on}) {
      r.print(fmt::format("  {:<40} activations {:>10}  step {:>9}  forwards per layer {:.2f}", run->name,
                          format_bytes(run->kept_bytes), mlp::format_time(run->step_us),
                          run->forwards_per_layer));
    }
    // The formula, in activation slices (one micro-batch's rows of one layer): data parallel keeps L + 1
    // without checkpoints, ceil(L/k) checkpoints plus the k outputs of the segment being recomputed with
    // them; a pipeline stage keeps per + 1 for each micro-batch in flight (1F1B: at most p on the first
    // stage), or only their inputs plus the one stage being recomputed.
    const bool dp = i == 0;
    const int n = dp ? o.layers : per, seg = dp ? k : per, mbs = dp ? 1 : in_flight;
    const int kept_off = mbs * (n + 1), kept_on = mbs * ((n + seg - 1) / seg) + seg;
    r.print(fmt::format(
        "    memory x{:.2f} measured, formula {} = {} -> {} slices = x{:.2f};  time x{:.2f} measured, "
        "compute +{:.0f}% from the extra forwards (a backward costs two forwards)",
        off.kept_bytes > 0 ? static_cast<double>(on.kept_bytes) / off.kept_bytes : 1.0,
        dp ? "L+1 -> ceil(L/k) + k" : "m'(L/p + 1) -> m' + L/p", kept_off, kept_on,
        static_cast<double>(kept_on) / kept_off, off.step_us > 0 ? on.step_us / off.step_us : 1.0,
        100 * (on.forwards_per_layer - 1) / 3));
  }
  r.print(fmt::format("equal to one device over the full batch after every step, all four ways: {}",
                      check::agreement(used, rel)));
}

}  // namespace

using O = RecomputeOptions;
// No --phantom: the lesson checks every step against one device.
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .remove("phantom")
        .add({
            {"world", &O::world, "ranks: data-parallel replicas, then pipeline stages"},
            Option<O>("layers", &O::layers, "number of layers (a multiple of --world)").at_least(1),
            Option<O>("micro-batches", &O::micro_batches,
                      "the pipeline's micro-batches per batch (must divide it)")
                .at_least(1),
            break_option<O>(&O::broken, {"skip-layer"}),
        });
const std::vector<LectureSetting> kLecture = {{"world", "2", ""},
                                              {"layers", "4", ""},
                                              {"micro-batches", "4", ""},
                                              {"batch", "128", ""},
                                              {"dim", "1024", ""}};

RANKLAB_LESSON("recompute", "activation checkpointing on DP and on the pipeline: memory saved, compute added",
               recompute, kOptions, kLecture);

}  // namespace ranklab
