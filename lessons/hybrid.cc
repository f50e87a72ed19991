// 2-D and 3-D parallelism: tensor parallelism inside a node, data parallelism across nodes, pipeline
// parallelism across groups of nodes, each dimension a process group from new_group
// (parallel::make_groups, the layout the gpt model uses). The MLP's layers are cut into pp stages
// (parallel::Pipeline, 1F1B); each stage's layers go in Megatron pairs over the tp ranks (the first split by
// columns, the second by rows, one all_reduce after the pair forward and one before it backward:
// parallel::TensorParallel); each (tp, pp) position is replicated dp times, one all_reduce(Avg) of its
// gradients per step.
//
// Placement follows the hardware: tensor parallelism communicates in every layer of every micro-batch, so
// its groups must sit on NVLink inside a node; data parallelism once per step; the pipeline only at stage
// boundaries. The lesson runs the layout given by --order (innermost first, Megatron's tp-dp-pp), then the
// same training with the order reversed, which puts the tp groups across nodes, and prints each layout's
// step time and the communication each dimension left exposed.
//
//   ranklab run hybrid --world 16 --nodes 2 --tp 4 --pp 2
//   ranklab run hybrid --world 32 --nodes 4 --tp 8 --pp 2 --dp 2
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/figures.h"
#include "lessons/mlp.h"
#include "lessons/parallel/groups.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/parallel/tensor_parallel.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct HybridOptions : mlp::TrainingOptions {
  int tp = 4, pp = 2;
  int dp = 0;                      // 0: world / (tp pp)
  std::string order = "tp-dp-pp";  // the process-group layout, innermost first
  int micro_batches = 4;
  HybridOptions() {
    world = 16;
    batch = 64;
    dim = 256;
    layers = 8;
    steps = 2;
  }
};

// What one rank's training of one layout gives, gathered to rank 0 after both layouts.
struct LayoutFigures {
  float step_us;                                  // the last step
  std::array<float, parallel::kDims> exposed_us;  // the communication each dimension left exposed in it
  float worst, relative;                          // the agreement with one device over every step
};

// This rank's part of the model: its stage's layers, layer first + 2i split by columns and first + 2i + 1
// by rows, so that each rank holds its columns of the one and the same rows of the other.
struct Shard {
  int layers = 1, first_layer = 0;  // the stage's layers
  std::int64_t cols = 1, col0 = 0;  // this rank's columns (or rows) of each
  std::vector<Tensor> w, grads;
};

parallel::Layout layout_of(const HybridOptions& o, int world);
Shard make_shard(Rank& r, const HybridOptions& o, const parallel::Layout& layout, const parallel::Groups& g);
check::Agreement check_step(Rank& r, const HybridOptions& o, const parallel::Layout& layout,
                            const parallel::Groups& g, const Shard& sh, const std::vector<Tensor>& sums,
                            mlp::Reference& ref, int step);
void print_summary(Rank& r, const HybridOptions& o, const std::vector<parallel::Layout>& layouts,
                   const std::vector<LayoutFigures>& mine);

// The training under one layout: each (tp, pp) position's micro-batches through the pipeline, each layer
// pair tensor-parallel inside it, then the gradients averaged over the dp replicas.
LayoutFigures train(Rank& r, const HybridOptions& o, const parallel::Layout& layout) {
  const parallel::Groups g = parallel::make_groups(r, layout);
  const int tp = layout.tp, pp = layout.pp, dp = layout.dp, m = o.micro_batches;
  const std::int64_t local = o.batch / dp, mb = local / m;  // this dp rank's samples, and a micro-batch
  const bool last_stage = g.me.pp == pp - 1;
  parallel::ExposedComm exposed(r);
  parallel::TensorParallel tpar{r, g.tp, tp, false, false, exposed};
  Shard sh = make_shard(r, o, layout, g);
  const int per = sh.layers;
  mlp::Optimizer opt(r, o, sh.w);
  Tensor dloss = mlp::loss_grad(r, o, {mb, o.dim}, local);  // this dp rank's mean; Avg over dp: the batch's
  parallel::Pipeline pipe(r, g.pp_ranks, g.me.pp, 1, m, o.phantom, exposed);
  std::unique_ptr<mlp::Reference> ref;
  if (!o.phantom) ref = std::make_unique<mlp::Reference>(o);
  LayoutFigures last{};
  check::Agreement worst;
  for (int step = 1; step <= o.steps; ++step) {
    for (Tensor& t : sh.grads) r.scale_(t, 0.0f);
    TimedStep timed(r);
    exposed.enable(true);
    std::vector<std::vector<Tensor>> acts(m);  // per micro-batch: each layer's input, then the output
    std::vector<Tensor> sums;
    auto forward = [&](const parallel::Task& t, const Tensor& in) {
      std::vector<Tensor>& a = acts[t.mb];
      a = {g.me.pp == 0 ? mlp::make_samples(r, o, g.me.dp * local + t.mb * mb, mb) : in};
      for (int i = 0; i < per; i += 2) {
        a.push_back(mlp::forward_layer(r, a.back(), sh.w[i]));   // my columns: relu works on them alone
        Tensor z = tpar.leave(r.matmul(a.back(), sh.w[i + 1]));  // my rows: a partial sum, added over tp
        a.push_back(r.relu(z));
      }
      if (last_stage) sums.push_back(mlp::output_sum(r, a.back()));
      return last_stage ? a.back() : r.slice(a.back(), 0, 0, mb);  // a copy to send: backward reads a.back()
    };
    auto backward = [&](const parallel::Task& t, const Tensor& dy_in) {
      std::vector<Tensor>& a = acts[t.mb];
      Tensor dy = last_stage ? dloss : dy_in;
      for (int i = per - 1; i >= 0; --i) {
        const bool want_dx = i > 0 || g.me.pp > 0;
        mlp::LayerGrads lg = mlp::backward_layer(r, a[i], a[i + 1], sh.w[i], dy, want_dx);
        r.add_(sh.grads[i], lg.w, 1.0f);
        dy = lg.x;
        // A column layer's input gradient is partial: each rank saw only its columns of the output.
        // --break no-tp-backward: it is not summed over tp.
        if (i % 2 == 0 && want_dx && o.broken != "no-tp-backward") dy = tpar.enter_backward(dy);
      }
      a.clear();
      return dy;
    };
    pipe.run({mb, o.dim}, DType::Float32, forward, backward, false);
    // Data parallelism: every replica of this (tp, pp) position averages its gradients.
    const Event e = exposed.before();
    if (dp > 1) {
      for (Tensor& t : sh.grads)
        r.all_reduce(t, o.broken == "dp-sum" ? ReduceOp::Sum : ReduceOp::Avg, Async::No, g.dp);
    }
    exposed.after(parallel::Dim::Dp, e);
    opt.step(sh.grads);
    last.step_us = static_cast<float>(timed.finish());
    const std::array<double, parallel::kDims> exposed_us = exposed.totals();
    for (int d = 0; d < parallel::kDims; ++d) last.exposed_us[d] = static_cast<float>(exposed_us[d]);
    exposed.enable(false);
    if (ref) worst.merge(check_step(r, o, layout, g, sh, sums, *ref, step));
  }
  last.worst = static_cast<float>(worst.worst);
  last.relative = static_cast<float>(worst.relative());
  return last;
}

void hybrid(Rank& r, const HybridOptions& o) {
  const parallel::Layout layout = layout_of(o, r.world_size());
  // The same layout with the order reversed: the innermost dimension becomes the outermost.
  parallel::Layout wrong = layout;
  std::vector<std::string> dims = layout.dims();
  wrong.order = fmt::format("{}", fmt::join(dims.rbegin(), dims.rend(), "-"));

  const std::vector<parallel::Layout> layouts = {layout, wrong};
  std::vector<LayoutFigures> mine;
  for (const parallel::Layout& l : layouts) {
    if (r.rank() == 0) {
      r.print(fmt::format("hybrid: tp {} x dp {} x pp {} = {} ranks; {}; {} micro-batches of {}", l.tp, l.dp,
                          l.pp, r.world_size(), mlp::describe(o), o.micro_batches,
                          o.batch / l.dp / o.micro_batches));
      for (const std::string& line : parallel::describe_groups(l, r.profile().gpus_per_node)) r.print(line);
    }
    mine.push_back(train(r, o, l));
  }
  print_summary(r, o, layouts, mine);
}

// ---- checks and output --------------------------------------------------------------------------------

parallel::Layout layout_of(const HybridOptions& o, int world) {
  parallel::validate_order(o.order);
  if (world % (o.tp * o.pp) != 0 || (o.dp > 0 && o.dp * o.tp * o.pp != world)) {
    throw UsageError(
        fmt::format("hybrid: --tp {} x --pp {} x --dp {} must be --world {} (--dp 0: world / (tp pp))", o.tp,
                    o.pp, o.dp, world));
  }
  parallel::Layout layout;
  layout.tp = o.tp;
  layout.pp = o.pp;
  layout.dp = world / (o.tp * o.pp);
  layout.order = o.order;
  if (o.dim % o.tp != 0) {
    throw UsageError(fmt::format("hybrid: --dim {} must divide by --tp {}", o.dim, o.tp));
  }
  if (o.layers % (2 * o.pp) != 0) {
    throw UsageError(
        fmt::format("hybrid: --layers {} must divide by 2 x --pp {}: each stage holds whole column-row pairs",
                    o.layers, o.pp));
  }
  if (o.batch % (layout.dp * o.micro_batches) != 0) {
    throw UsageError(fmt::format("hybrid: --batch {} must divide by dp {} x --micro-batches {}", o.batch,
                                 layout.dp, o.micro_batches));
  }
  return layout;
}

Shard make_shard(Rank& r, const HybridOptions& o, const parallel::Layout& layout, const parallel::Groups& g) {
  Shard sh;
  sh.layers = o.layers / layout.pp;
  sh.first_layer = g.me.pp * sh.layers;
  sh.cols = o.dim / layout.tp;
  sh.col0 = g.me.tp * sh.cols;
  for (int i = 0; i < sh.layers; ++i) {
    const int l = sh.first_layer + i;
    sh.w.push_back(i % 2 == 0 ? mlp::make_weight_columns(r, o, l, sh.col0, sh.cols)
                              : mlp::make_weight_rows(r, o, l, sh.col0, sh.cols));
    sh.grads.push_back(o.phantom ? r.phantom(sh.w.back().shape()) : r.zeros(sh.w.back().shape()));
  }
  return sh;
}

// After a step: the reference's step, then my columns (or rows) of each of my stage's layers against it,
// and on the last stage the loss; recorded as the step's check.
check::Agreement check_step(Rank& r, const HybridOptions& o, const parallel::Layout& layout,
                            const parallel::Groups& g, const Shard& sh, const std::vector<Tensor>& sums,
                            mlp::Reference& ref, int step) {
  ref.step();
  check::Agreement d;
  for (int i = 0; i < sh.layers; ++i) {
    const int l = sh.first_layer + i;
    auto want = [&](const std::vector<float>& full) {
      return i % 2 == 0 ? mlp::columns(full, o.dim, o.dim, sh.col0, sh.cols)
                        : std::vector<float>(full.begin() + sh.col0 * o.dim,
                                             full.begin() + (sh.col0 + sh.cols) * o.dim);
    };
    const std::int64_t width = i % 2 == 0 ? sh.cols : o.dim;
    d.merge(check::within_bound(r.to_host(sh.grads[i]), want(ref.grad(l)), want(ref.grad_bound(l)),
                                fmt::format("layer {} gradient", l), width));
    d.merge(check::within_bound(r.to_host(sh.w[i]), want(ref.weight(l)), want(ref.weight_bound(l)),
                                fmt::format("layer {} weight", l), width));
  }
  if (g.me.pp == layout.pp - 1) {  // the loss: this dp rank's micro-batches, averaged over dp
    double mine = 0;
    for (const Tensor& s : sums) mine += r.to_host(s)[0];
    const std::int64_t local = o.batch / layout.dp;
    Tensor loss = r.from_host({1}, {static_cast<float>(mine / static_cast<double>(local))});
    auto check = r.bookkeeping("check");
    if (layout.dp > 1) r.all_reduce(loss, ReduceOp::Avg, Async::No, g.dp);
    d.merge(check::within_bound(r.to_host(loss)[0], ref.loss(), ref.loss_bound(), "the loss"));
  }
  check::record_step(r, fmt::format("hybrid {}", layout.order), step,
                     "every rank's shard of gradients and weights", d,
                     fmt::format("rank {} (tp {} dp {} pp {}): ", r.rank(), g.me.tp, g.me.dp, g.me.pp));
  return d;
}

// Every rank's figures of both layouts to rank 0 (one gather), which prints each layout's slowest rank.
void print_summary(Rank& r, const HybridOptions& o, const std::vector<parallel::Layout>& layouts,
                   const std::vector<LayoutFigures>& mine) {
  const std::vector<LayoutFigures> all = gather_figures(r, mine);  // rank k's layout i at k * layouts + i
  if (r.rank() != 0) return;
  const std::size_t n = layouts.size();
  constexpr int kTp = static_cast<int>(parallel::Dim::Tp), kPp = static_cast<int>(parallel::Dim::Pp),
                kDp = static_cast<int>(parallel::Dim::Dp);
  double used = 0, rel = 0, first_step_us = 0, first_tp_us = 0;
  r.print("the step, and the communication each dimension left exposed (the slowest rank):");
  for (std::size_t i = 0; i < n; ++i) {
    double step_us = 0;
    std::array<double, parallel::kDims> exposed_us{};
    for (std::size_t at = i; at < all.size(); at += n) {
      const LayoutFigures& f = all[at];
      step_us = std::max<double>(step_us, f.step_us);
      for (int d = 0; d < parallel::kDims; ++d)
        exposed_us[d] = std::max<double>(exposed_us[d], f.exposed_us[d]);
      used = std::max<double>(used, f.worst);
      rel = std::max<double>(rel, f.relative);
    }
    r.print(fmt::format("  order {:<9} step {:>9}   exposed: tp {:>9}  pp {:>9}  dp {:>9}{}",
                        layouts[i].order, mlp::format_time(step_us), mlp::format_time(exposed_us[kTp]),
                        mlp::format_time(exposed_us[kPp]), mlp::format_time(exposed_us[kDp]),
                        i == 0 ? ""
                               : fmt::format("   reversed: step x{:.2f}, exposed tp x{:.2f}",
                                             first_step_us > 0 ? step_us / first_step_us : 1.0,
                                             first_tp_us > 0 ? exposed_us[kTp] / first_tp_us : 1.0)));
    if (i == 0) first_step_us = step_us, first_tp_us = exposed_us[kTp];
  }
  r.print(
      "  tp all-reduces twice per pair and micro-batch, in forward and backward: across nodes each waits on "
      "the "
      "network; pp sends once per stage boundary and micro-batch (its exposure includes the bubble); dp once "
      "per step");
  if (o.phantom) {
    r.print("phantom tensors hold no numbers: the comparison with one device was skipped");
    return;
  }
  r.print(fmt::format("equal to one device over the full batch after every step, both layouts: {}",
                      check::agreement(used, rel)));
}

}  // namespace

using O = HybridOptions;
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .add({
            {"world", &O::world, "ranks: tp x dp x pp (with --nodes, e.g. 2 nodes of 8 GPUs)"},
            Option<O>("tp", &O::tp, "tensor-parallel ranks: each layer pair split over them").at_least(1),
            Option<O>("pp", &O::pp, "pipeline stages: each holds layers/pp layers").at_least(1),
            Option<O>("dp", &O::dp, "data-parallel replicas (0: world / (tp pp))").at_least(0),
            {"order", &O::order, "process-group layout, innermost first; the lesson also runs it reversed"},
            Option<O>("layers", &O::layers, "number of layers (a multiple of 2 pp)").at_least(1),
            Option<O>("micro-batches", &O::micro_batches, "micro-batches per dp rank's batch").at_least(1),
            break_option<O>(&O::broken, {"no-tp-backward", "dp-sum"}),
        });

RANKLAB_LESSON("hybrid", "TP in a node, DP across nodes, PP across groups: and the layout reversed", hybrid,
               kOptions);

}  // namespace ranklab
