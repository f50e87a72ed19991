// ZeRO (Rajbhandari et al. 2020), written from reduce_scatter and all_gather on the lessons' MLP. Plain
// data parallelism keeps the whole model, its gradients and the optimizer state on every one of N ranks.
// ZeRO shards them by rows, rank i owning rows [i dim/N, (i+1) dim/N) of every layer, in three stages:
//
//   ZeRO-1  optimizer state: reduce_scatter(Avg) the gradient, each rank updates its rows of a float32
//           copy of the weight (the mixed-precision "master") with its rows of Adam's moments, and an
//           all_gather puts the whole weight back together.
//   ZeRO-2  the gradients too: each layer's gradient is reduce-scattered as soon as backward makes it,
//           and only its rows are kept.
//   ZeRO-3  the weights too (FSDP): a layer's weight is all-gathered just before its forward and again
//           before its backward, and dropped after use.
//
// An all_reduce is a reduce_scatter then an all_gather, so ZeRO-1 and -2 move what plain DP moves (2Ψ per
// rank per step, Ψ the parameter count); ZeRO-3 gathers the weights twice: 3Ψ, 1.5 times DP.
// The gpt lesson's ZeRO, with mixed precision, micro-batches, padding and overlap, is lessons/parallel/zero
// (parallel::DataParallel); this lesson's memory per rank is checked against its accounting.
//
//   ranklab run zero --world 4
//   ranklab run zero --world 8 --zero 3 --optimizer sgd
#include "lessons/parallel/zero.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct ZeroOptions : mlp::TrainingOptions {
  int zero = -1;  // the stage; -1 runs all four
  ZeroOptions() {
    steps = 2;
    lr = 0.001;
    optimizer = "adamw";  // the state ZeRO-1 shards
  }
};

// One layer as a ZeRO rank holds it.
struct Layer {
  Tensor w;       // what forward and backward read: the whole weight, or (ZeRO-3) this rank's rows
  Tensor master;  // what the optimizer updates: w itself (ZeRO-0, -3), or a float32 copy of its rows
  Tensor grad;    // the whole gradient (ZeRO-0, -1), or this rank's rows of the average (ZeRO-2, -3)
};

// The bytes a rank sends in a collective, by the bandwidth-optimal (ring) algorithm the paper counts:
// reduce_scatter and all_gather send (N-1)/N of the whole tensor, all_reduce twice that.
struct Sent {
  int n = 1;
  double bytes = 0;
  void whole(const Tensor& t, int times) { bytes += times * t.bytes() * (n - 1.0) / n; }
};

struct StageResult {
  mlp::Memory held;
  double sent_bytes = 0, step_us = 0, worst = 0, relative = 0;
};

// Rows [first, first + rows) of a row-major dim x dim matrix.
std::vector<float> rows_of(const std::vector<float>& m, std::int64_t dim, std::int64_t first,
                           std::int64_t rows) {
  return {m.begin() + first * dim, m.begin() + (first + rows) * dim};
}

std::vector<Layer> make_model(Rank& r, const ZeroOptions& o, int stage, bool sharded);
mlp::Memory check_memory(Rank& r, const ZeroOptions& o, int stage, const std::vector<Layer>& model,
                         std::int64_t before);
check::Agreement check_step(Rank& r, const ZeroOptions& o, int stage, int step, double step_us,
                            mlp::Reference& ref, const Tensor& out_sum, const std::vector<Tensor>& avg,
                            const std::vector<Layer>& model);

StageResult train(Rank& r, const ZeroOptions& o, int stage) {
  const int world = r.world_size(), rank = r.rank(), layers = o.layers;
  const std::int64_t local = o.batch / world, rows = o.dim / world;
  // --break sum: the gradient summed over ranks, not averaged; no-all-gather: ZeRO-1 and -2 never put the
  // weight back together, so the rows other ranks updated stay stale.
  const ReduceOp op = o.broken == "sum" ? ReduceOp::Sum : ReduceOp::Avg;
  const bool sharded = stage >= 1 && world > 1;
  Sent sent{world};

  // The model state, made from the seeds: every rank makes only what it keeps.
  const std::int64_t before = r.memory_allocated();
  std::vector<Layer> model = make_model(r, o, stage, sharded);
  std::vector<Tensor> masters;
  for (const Layer& s : model) masters.push_back(s.master);
  mlp::Optimizer opt(r, o, masters);  // Adam's two moments, shaped like the masters
  StageResult res;
  res.held = check_memory(r, o, stage, model, before);

  // The whole weight of layer l, as forward and backward read it: ZeRO-3 gathers it from every rank.
  auto weight = [&](int l) {
    if (stage < 3 || !sharded) return model[l].w;
    Tensor whole = r.empty({o.dim, o.dim});
    r.all_gather(whole, model[l].w);
    sent.whole(whole, 1);
    return whole;
  };

  Tensor x = mlp::make_samples(r, o, rank * local, local);
  Tensor dloss = mlp::loss_grad(r, o, {local, o.dim}, local);  // this rank's mean; Avg makes the batch's
  mlp::Reference ref(o);
  check::Agreement worst;
  for (int step = 1; step <= o.steps; ++step) {
    TimedStep timed(r);
    sent.bytes = 0;
    std::vector<Tensor> acts{x};
    for (int l = 0; l < layers; ++l) acts.push_back(mlp::forward_layer(r, acts[l], weight(l)));
    Tensor out_sum = mlp::output_sum(r, acts.back());

    std::vector<Tensor> avg(layers);  // this rank's rows of the averaged gradient (whole for ZeRO-0)
    Tensor dy = dloss;
    for (int l = layers - 1; l >= 0; --l) {
      mlp::LayerGrads g = mlp::backward_layer(r, acts[l], acts[l + 1], weight(l), dy, l > 0);
      dy = g.x;
      if (stage >= 2 && sharded) {  // ZeRO-2, -3: reduce-scatter now, keep only the rows
        r.reduce_scatter(model[l].grad, g.w, op);
        sent.whole(g.w, 1);
        avg[l] = model[l].grad;
      } else {
        model[l].grad = g.w;
      }
    }
    acts.clear();
    for (int l = 0; l < layers; ++l) {
      if (stage == 0 || !sharded) {  // plain DP
        if (world > 1) r.all_reduce(model[l].grad, op);
        sent.whole(model[l].grad, 2);
        avg[l] = model[l].grad;
      } else if (stage == 1) {  // the whole gradient was kept; its rows of the average go to the optimizer
        avg[l] = r.empty({rows, o.dim});
        r.reduce_scatter(avg[l], model[l].grad, op);
        sent.whole(model[l].grad, 1);
      }
    }
    opt.step(avg);
    if ((stage == 1 || stage == 2) && sharded && o.broken != "no-all-gather") {
      for (Layer& s : model) {  // every rank's updated rows make the whole weight again
        r.all_gather(s.w, s.master);
        sent.whole(s.w, 1);
      }
    }
    res.step_us = timed.finish();
    res.sent_bytes = sent.bytes;
    worst.merge(check_step(r, o, stage, step, res.step_us, ref, out_sum, avg, model));
  }
  res.worst = worst.worst;
  res.relative = worst.relative();
  return res;
}

// ---- the model's state and the checks -------------------------------------------------------------------

// Every layer as the stage keeps it on this rank: the whole weight or (ZeRO-3) its rows, a float32 master
// of its rows where the update is split off (ZeRO-1, -2), and the gradient whole or (ZeRO-2, -3) its rows.
std::vector<Layer> make_model(Rank& r, const ZeroOptions& o, int stage, bool sharded) {
  const std::int64_t rows = o.dim / r.world_size(), first = r.rank() * rows;
  std::vector<Layer> model(o.layers);
  for (int l = 0; l < o.layers; ++l) {
    Layer& s = model[l];
    s.w = stage == 3 && sharded ? mlp::make_weight_rows(r, o, l, first, rows) : mlp::make_weight(r, o, l);
    s.master = stage == 0 || stage == 3 || !sharded ? s.w : mlp::make_weight_rows(r, o, l, first, rows);
    s.grad = r.zeros({stage >= 2 && sharded ? rows : o.dim, o.dim});
  }
  return model;
}

// What the rank holds, by kind, since `before`; checked against the production accounting
// (parallel::DataParallel::bytes), which must say the same for the same shapes.
mlp::Memory check_memory(Rank& r, const ZeroOptions& o, int stage, const std::vector<Layer>& model,
                         std::int64_t before) {
  mlp::Memory held;
  held.params = model[0].w.bytes() + (model[0].master.same_storage(model[0].w) ? 0 : model[0].master.bytes());
  held.params *= o.layers;
  held.grads = o.layers * model[0].grad.bytes();
  held.optimizer = r.memory_allocated() - before - held.params - held.grads;
  parallel::ZeroConfig zc;
  zc.stage = stage;
  zc.dtype = DType::Float32;
  zc.dp_rank = r.rank();
  zc.dp_size = r.world_size();
  parallel::ParamSpec spec;
  spec.full = {o.dim, o.dim};
  const parallel::DataParallel::Bytes per_layer =
      parallel::DataParallel::bytes(parallel::local_size(spec, 1), zc);
  const std::int64_t expected =
      o.layers * (per_layer.weights + per_layer.grads + (o.optimizer == "adamw" ? per_layer.optimizer : 0));
  r.check(fmt::format("zero stage {}: the memory a rank holds equals parallel/zero's accounting", stage),
          r.memory_allocated() - before == expected,
          fmt::format("rank {}: holds {} bytes, parallel::DataParallel::bytes says {}", r.rank(),
                      r.memory_allocated() - before, expected));
  return held;
}

// The check against one device, after the timed step: this rank's rows of every gradient and weight, and
// the gathered whole weights the next forward reads; rank 0's line for the step.
check::Agreement check_step(Rank& r, const ZeroOptions& o, int stage, int step, double step_us,
                            mlp::Reference& ref, const Tensor& out_sum, const std::vector<Tensor>& avg,
                            const std::vector<Layer>& model) {
  const std::int64_t local = o.batch / r.world_size(), rows = o.dim / r.world_size(), first = r.rank() * rows;
  auto check = r.bookkeeping("check");
  ref.step();
  Tensor loss = r.from_host({1}, {static_cast<float>(r.to_host(out_sum)[0] / static_cast<double>(local))});
  r.all_reduce(loss, ReduceOp::Avg);
  const double loss_all = r.to_host(loss)[0];
  check::Agreement d = check::within_bound(loss_all, ref.loss(), ref.loss_bound(), "the loss");
  for (int l = 0; l < o.layers; ++l) {
    const bool whole_grad = avg[l].size(0) == o.dim, whole_master = model[l].master.size(0) == o.dim;
    auto want = [&](const std::vector<float>& m, bool whole) {
      return whole ? m : rows_of(m, o.dim, first, rows);
    };
    d.merge(check::within_bound(r.to_host(avg[l]), want(ref.grad(l), whole_grad),
                                want(ref.grad_bound(l), whole_grad), fmt::format("layer {} gradient", l),
                                o.dim));
    d.merge(check::within_bound(r.to_host(model[l].master), want(ref.weight(l), whole_master),
                                want(ref.weight_bound(l), whole_master), fmt::format("layer {} weight", l),
                                o.dim));
    if (stage == 1 || stage == 2) {  // the gathered whole weight, which the next forward reads
      d.merge(check::within_bound(r.to_host(model[l].w), ref.weight(l), ref.weight_bound(l),
                                  fmt::format("layer {} gathered weight", l), o.dim));
    }
  }
  check::record_step(r, fmt::format("zero stage {}", stage), step, "loss, gradients and weights", d);
  if (r.rank() == 0 && !o.quiet) {
    r.print(fmt::format("  ZeRO-{} step {}/{}  time {}  loss {:.6f} (one device {:.6f})  {}", stage, step,
                        o.steps, mlp::format_time(step_us), loss_all, ref.loss(), check::verdict(d)));
  }
  return d;
}

void zero(Rank& r, const ZeroOptions& o) {
  const int world = r.world_size();
  if (o.batch % world != 0) {
    throw UsageError(
        fmt::format("zero: --batch {} is not divisible by --world {}: every rank trains on "
                    "batch/world samples",
                    o.batch, world));
  }
  if (o.dim % world != 0) {
    throw UsageError(
        fmt::format("zero: --dim {} is not divisible by --world {}: each rank owns dim/world rows "
                    "of every layer",
                    o.dim, world));
  }
  const std::int64_t psi = o.layers * o.dim * o.dim;  // Ψ, the parameters
  const bool adam = o.optimizer == "adamw";
  if (r.rank() == 0) {
    r.print(fmt::format("zero: {} data-parallel ranks; {}; Ψ = {} parameters, float32", world,
                        mlp::describe(o), psi));
  }

  std::vector<int> stages;
  for (int s = 0; s <= 3; ++s) {
    if (o.zero == -1 || o.zero == s) stages.push_back(s);
  }
  std::vector<StageResult> results;
  for (int s : stages) results.push_back(train(r, o, s));

  double used = 0, rel = 0;
  for (const StageResult& res : results) used = std::max(used, res.worst), rel = std::max(rel, res.relative);
  auto all = mlp::gather_to_root(r, {static_cast<float>(used), static_cast<float>(rel)});
  for (const auto& v : all) used = std::max<double>(used, v[0]), rel = std::max<double>(rel, v[1]);
  if (r.rank() != 0) return;

  // The paper's formula for mixed-precision Adam is (2 + 2 + K)Ψ with K = 12 (float32 master 4 + moments 8),
  // each stage dividing more of it by N. In float32 the weight is its own master until ZeRO-1 splits the
  // update off: weights 4Ψ (+ a 4Ψ/N master at ZeRO-1, -2), gradients 4Ψ, Adam 8Ψ.
  const char* formulas[] = {
      adam ? "4Ψ + 4Ψ + 8Ψ" : "4Ψ + 4Ψ", adam ? "(4 + 4/N)Ψ + 4Ψ + 8Ψ/N" : "(4 + 4/N)Ψ + 4Ψ",
      adam ? "(4 + 4/N)Ψ + 4Ψ/N + 8Ψ/N" : "(4 + 4/N)Ψ + 4Ψ/N", adam ? "4Ψ/N + 4Ψ/N + 8Ψ/N" : "4Ψ/N + 4Ψ/N"};
  const double n = world, f[] = {adam ? 16.0 : 8.0, 8 + 4 / n + (adam ? 8 / n : 0),
                                 4 + 8 / n + (adam ? 8 / n : 0), (adam ? 16 : 8) / n};
  r.print(fmt::format("memory per rank (N = {}): weights, gradients, {} state", world, o.optimizer));
  for (size_t i = 0; i < stages.size(); ++i) {
    const int s = stages[i];
    const mlp::Memory& m = results[i].held;
    r.print(
        fmt::format("  ZeRO-{}  weights {:>9}  grads {:>9}  optimizer {:>9}  total {:>9}   formula {} = {}",
                    s, format_bytes(m.params), format_bytes(m.grads), format_bytes(m.optimizer),
                    format_bytes(m.total()), formulas[s], format_bytes(f[s] * psi)));
  }
  const double dp_bytes = 2 * 4.0 * psi * (n - 1) / n;
  r.print(
      "communication per rank per step (counted from the collectives called; ring: each rank sends (N-1)/N "
      "of a reduce_scatter's input or an all_gather's output, twice that for an all_reduce)");
  for (size_t i = 0; i < stages.size(); ++i) {
    const int s = stages[i];
    const int k = s == 3 ? 3 : 2;
    r.print(fmt::format("  ZeRO-{}  sent {}  formula {}Ψ(N-1)/N x 4 bytes = {}  {:.2f}x plain DP  step {}", s,
                        format_bytes(results[i].sent_bytes), k, format_bytes(k * 4.0 * psi * (n - 1) / n),
                        dp_bytes > 0 ? results[i].sent_bytes / dp_bytes : 1.0,
                        mlp::format_time(results[i].step_us)));
  }
  r.print(fmt::format("equal to one device over the full batch after every step, every stage: {}",
                      check::agreement(used, rel)));
}

}  // namespace

using O = ZeroOptions;
// No --phantom: the lesson checks every step against one device.
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .remove("phantom")
        .add({
            {"world", &O::world, "data-parallel ranks, each owning dim/world rows of every layer"},
            Option<O>("zero", &O::zero, "ZeRO stage 0, 1, 2 or 3; -1 runs all four, side by side")
                .at_least(-1)
                .at_most(3),
            Option<O>("optimizer", &O::optimizer, "adamw (the state ZeRO-1 shards) or sgd")
                .choices({"sgd", "adamw"}),
            break_option<O>(&O::broken, {"sum", "no-all-gather"}),
        });
const std::vector<LectureSetting> kLecture = {
    {"world", "4", ""}, {"batch", "128", ""}, {"dim", "1024", ""}, {"layers", "4", ""}};

RANKLAB_LESSON("zero", "ZeRO-1/2/3 from reduce_scatter and all_gather: memory and traffic per rank", zero,
               kOptions, kLecture);

}  // namespace ranklab
