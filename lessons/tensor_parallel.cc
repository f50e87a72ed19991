// Tensor parallelism, as the lecture writes it: every weight is split by columns, so a rank holds
// dim x dim/W of each layer, and every rank sees the whole batch. A rank's columns give it its part of each
// layer's output; relu works on each part alone, but the next layer needs all of it, so every layer ends
// with an all_gather. The backward mirrors it: where the forward all-gathers, the backward reduce-scatters.
//
//   ranklab run tensor_parallel --world 4
#include <fmt/format.h>

#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct TensorParallelOptions : mlp::TrainingOptions {
  bool megatron = false;  // Megatron's column-then-row pairs instead of the all_gather scheme
};

// The collectives put the ranks' pieces one after another along dimension 0, and a rank's piece of each
// layer's output is a block of columns. The lecture rearranges them with torch.cat(..., dim=1), which costs
// every rank W slices and a cat at every layer. Here the activations are kept transposed instead, one row
// per feature and one column per sample: a rank's columns of the output are then a block of rows, the
// all_gather's stacking along dimension 0 is exactly the whole output, and the reduce_scatter's split along
// dimension 0 hands each rank exactly its block. The products are the same, written for the transposes:
//
//   h^T  = relu(w^T @ x^T)          [dim/W, batch]   (w: [dim, dim/W], this rank's columns)
//   dw   = x^T @ dz                 = (x^T) @ (dz^T)^T                 [dim, dim/W]
//   dx^T = w @ dz^T                 [dim, batch], a partial sum over ranks, reduced and scattered

// h^T = relu(w^T @ x^T) for this rank's columns; `x_rows` says whether x is held as [batch, dim] (the
// samples as made) rather than transposed.
Tensor forward_columns(Rank& r, const Tensor& x, bool x_rows, const Tensor& w) {
  return r.relu(r.matmul(w, x, Trans::Yes, x_rows ? Trans::Yes : Trans::No));
}

// [dim/W, batch] on every rank -> [dim, batch]: every rank's columns of the output, transposed.
Tensor all_gather_columns(Rank& r, const TensorParallelOptions& o, const Tensor& part,
                          mlp::Traffic& traffic) {
  Tensor whole = mlp::buffer(r, o, {r.world_size() * part.size(0), part.size(1)});
  r.all_gather(whole, part);
  traffic.add(whole);
  return whole;
}

// [dim, batch] partial sums on every rank -> [dim/W, batch]: the sum over ranks of this rank's block.
Tensor reduce_scatter_columns(Rank& r, const TensorParallelOptions& o, const Tensor& whole,
                              mlp::Traffic& traffic) {
  Tensor mine = mlp::buffer(r, o, {whole.size(0) / r.world_size(), whole.size(1)});
  r.reduce_scatter(mine, whole, ReduceOp::Sum);
  traffic.add(whole);
  return mine;
}

void check_options(Rank& r, const TensorParallelOptions& o);
void print_plan(Rank& r, const TensorParallelOptions& o);
void megatron_pairs(Rank& r, const TensorParallelOptions& o);
void check_step(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, int step, double step_us,
                const Tensor& out_sum, const std::vector<Tensor>& grads, const std::vector<Tensor>& w);
void print_summary(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, double step_us,
                   double launched_us, const mlp::Traffic& traffic);

void tensor_parallel(Rank& r, const TensorParallelOptions& o) {
  check_options(r, o);
  if (o.megatron) {
    megatron_pairs(r, o);
    return;
  }
  const std::int64_t cols = o.dim / r.world_size(),
                     first_col = r.rank() * cols;  // the lecture's local_num_dim
  print_plan(r, o);

  // Each rank makes only its columns, with the numbers those columns of one device's weights hold.
  // --break wrong-slice: each rank makes the next rank's columns of the weights.
  std::vector<Tensor> w;
  const std::int64_t made_col = o.broken == "wrong-slice" ? (first_col + cols) % o.dim : first_col;
  for (int l = 0; l < o.layers; ++l) w.push_back(mlp::make_weight_columns(r, o, l, made_col, cols));
  mlp::Optimizer opt(r, o, w);
  Tensor x = mlp::make_samples(r, o, 0, o.batch);  // every rank holds the whole batch
  // d loss / d (this rank's columns of the output), transposed
  Tensor dloss = mlp::loss_grad(r, o, {cols, o.batch}, o.batch);
  mlp::RunSummary summary(r, o, "tensor_parallel");
  mlp::Traffic traffic;
  double step_us = 0, launched_us = 0;

  for (int step = 1; step <= o.steps; ++step) {
    TimedStep timed(r);
    traffic = {};

    // Forward: my columns of each layer's output, then everyone's, for the next layer.
    timed.phase("forward");     // the phases, named on the timeline and matched by `ranklab compare`
    std::vector<Tensor> xs{x};  // each layer's whole input: the samples, then transposed outputs
    std::vector<Tensor> hs;     // each layer's output, my columns, transposed
    for (int l = 0; l < o.layers; ++l) {
      hs.push_back(forward_columns(r, xs[l], l == 0, w[l]));   // [dim/W, batch]
      xs.push_back(all_gather_columns(r, o, hs[l], traffic));  // [dim, batch]
    }
    Tensor out_sum = mlp::output_sum(r, xs.back());  // every rank has the whole output

    // Backward. My columns' gradient needs only my columns of the output gradient; the input's gradient
    // is a sum over every rank's columns (dz @ w^T), so it is reduced, and scattered: each rank needs only
    // the columns its own previous layer produced. --break no-reduce-scatter: each rank keeps its block of
    // its own partial sum, unsummed.
    timed.phase("backward");
    std::vector<Tensor> grads(o.layers);
    Tensor dh = dloss;
    for (int l = o.layers - 1; l >= 0; --l) {
      Tensor dz = r.relu_backward(dh, hs[l]);                                       // [dim/W, batch]
      grads[l] = r.matmul(xs[l], dz, l == 0 ? Trans::Yes : Trans::No, Trans::Yes);  // local, exact
      if (l > 0 && o.broken == "no-reduce-scatter") {
        dh = r.slice(r.matmul(w[l], dz), 0, first_col, cols);
      } else if (l > 0) {
        dh = reduce_scatter_columns(r, o, r.matmul(w[l], dz), traffic);
      }
    }
    timed.end_phase();
    summary.sample_memory();  // every gradient and every activation
    xs.clear();
    hs.clear();
    dh = Tensor();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    launched_us = timed.host_us();  // the host's part: launching the step
    step_us = timed.finish();
    check_step(r, o, summary, step, step_us, out_sum, grads, w);
  }
  print_summary(r, o, summary, step_us, launched_us, traffic);
}

// --megatron: Megatron-LM's pairing (Shoeybi et al. 2019). Layers go in pairs: the first split by columns
// (as above), the second by rows, so the first's column block of the activation is exactly the rows the
// second's block multiplies; nothing is gathered between them. Each rank's product is then a partial sum
// of the pair's output, and one all_reduce adds them up. The backward mirrors it: one all_reduce of the
// input's gradient per pair. Two collectives per pair of layers instead of one per layer each way, and
// every one an all_reduce of [batch, dim]: what Megatron and every transformer's MLP and attention block
// use inside a node. The lecture's scheme (all_gather after each layer) is simpler to write for any layer
// and is what sequence parallelism builds on; the pairing is what is used when layers come in pairs.
struct MegatronPairs {
  std::vector<Tensor> w;  // even layers: columns [first, first + c); odd layers: rows [first, first + c)
  std::int64_t c = 0, first = 0;
};
MegatronPairs make_pairs(Rank& r, const TensorParallelOptions& o);
void check_pairs(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, int step, double step_us,
                 const MegatronPairs& m, const Tensor& out_sum, const std::vector<Tensor>& grads);
void print_pairs(Rank& r, const TensorParallelOptions& o, const mlp::RunSummary& summary,
                 const mlp::Traffic& traffic);

void megatron_pairs(Rank& r, const TensorParallelOptions& o) {
  const int layers = o.layers;
  MegatronPairs m = make_pairs(r, o);
  const std::vector<Tensor>& w = m.w;
  mlp::Optimizer opt(r, o, m.w);
  Tensor x = mlp::make_samples(r, o, 0, o.batch);
  Tensor dloss = mlp::loss_grad(r, o, {o.batch, o.dim}, o.batch);
  mlp::RunSummary summary(r, o, "tensor_parallel --megatron");
  mlp::Traffic traffic;
  for (int step = 1; step <= o.steps; ++step) {
    TimedStep timed(r);
    traffic = {};
    timed.phase("forward");
    std::vector<Tensor> xs{x}, hs;  // each pair's input (whole) and its middle activation (my block)
    for (int l = 0; l < layers; l += 2) {
      hs.push_back(r.relu(r.matmul(xs.back(), w[l])));  // [batch, c]: my columns of the first layer
      Tensor partial = r.matmul(hs.back(), w[l + 1]);   // [batch, dim]: my rows' share of the second
      r.all_reduce(partial, ReduceOp::Sum);
      traffic.add(partial);
      xs.push_back(r.relu(partial));
    }
    Tensor out_sum = mlp::output_sum(r, xs.back());
    timed.phase("backward");
    std::vector<Tensor> grads(layers);
    Tensor dy = dloss;
    for (int l = layers - 2; l >= 0; l -= 2) {
      const int p = l / 2;
      Tensor dz = r.relu_backward(dy, xs[p + 1]);                 // [batch, dim], the same everywhere
      grads[l + 1] = r.matmul(hs[p], dz, Trans::Yes, Trans::No);  // [c, dim]
      Tensor dh = r.relu_backward(r.matmul(dz, w[l + 1], Trans::No, Trans::Yes), hs[p]);  // [batch, c]
      grads[l] = r.matmul(xs[p], dh, Trans::Yes, Trans::No);                              // [dim, c]
      if (l == 0) break;
      dy = r.matmul(dh, w[l], Trans::No, Trans::Yes);  // [batch, dim], a partial sum over the ranks' columns
      r.all_reduce(dy, ReduceOp::Sum);
      traffic.add(dy);
    }
    timed.end_phase();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    const double step_us = timed.finish();
    check_pairs(r, o, summary, step, step_us, m, out_sum, grads);
  }
  print_pairs(r, o, summary, traffic);
}

// ---- checks and output --------------------------------------------------------------------------------

void check_options(Rank& r, const TensorParallelOptions& o) {
  if (o.megatron && !o.broken.empty()) {
    throw UsageError(fmt::format(
        "tensor_parallel: --break {} breaks the all_gather scheme, not --megatron's pairs", o.broken));
  }
  const int world = r.world_size();
  if (o.dim % world != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel: --dim {} is not divisible by --world {}: each rank holds dim/world columns of "
        "every weight; use a multiple of {} such as {}",
        o.dim, world, world, (o.dim / world + 1) * world));
  }
  if (o.megatron && o.layers % 2 != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel --megatron: --layers {} is odd; the layers go in column-then-row pairs", o.layers));
  }
}

// What every rank holds: a slice of every weight; the activations are not split here (see the docs).
void print_plan(Rank& r, const TensorParallelOptions& o) {
  const int world = r.world_size();
  const std::int64_t cols = o.dim / world;
  mlp::Memory plan;
  plan.params = o.layers * mlp::f32_bytes(o.dim * cols);
  plan.grads = plan.params;
  plan.optimizer = mlp::optimizer_bytes(o, plan.params);
  plan.activations =
      (o.layers + 1) * mlp::f32_bytes(o.batch * o.dim) + o.layers * mlp::f32_bytes(o.batch * cols);
  if (r.rank() != 0) return;
  r.print(fmt::format("tensor_parallel: {} ranks; {}; every weight split into {} column blocks of {} x {}",
                      world, mlp::describe(o), world, o.dim, cols));
  r.print("memory per rank (every rank holds 1/world of every weight and the whole batch's activations):");
  if (!mlp::print_memory_plan(r, "every rank", plan)) {
    r.print(
        "  each rank holds 1/world of every weight: more ranks shrink it; the activations are not split "
        "here");
  }
}

// The step's loss and this rank's columns of the gradients and weights against one device's; rank 0's line.
void check_step(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, int step, double step_us,
                const Tensor& out_sum, const std::vector<Tensor>& grads, const std::vector<Tensor>& w) {
  const std::int64_t cols = o.dim / r.world_size(), first_col = r.rank() * cols;
  std::string line = fmt::format("step {}/{}  time {}", step, o.steps, mlp::format_time(step_us));
  double loss = 0;
  const auto d =
      summary.check_step(step, "loss, gradients and weight columns", [&](const mlp::Reference& ref) {
        loss = r.to_host(out_sum)[0] / static_cast<double>(o.batch);
        check::Agreement diff = check::within_bound(loss, ref.loss(), ref.loss_bound(), "the loss");
        diff.merge(mlp::compare_layers(r, ref, grads, w, 0, first_col, cols));
        return diff;
      });
  if (d) {
    line += fmt::format("  loss {:.6f} (one device {:.6f})  {}", loss, summary.reference()->loss(),
                        check::verdict(*d));
  }
  if (r.rank() == 0 && !o.quiet) r.print(line);
}

void print_summary(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, double step_us,
                   double launched_us, const mlp::Traffic& traffic) {
  if (!summary.gather()) return;
  summary.print_last_step(step_us, launched_us);
  r.print(fmt::format(
      "communication per rank per step: {} collectives, {} in all ({} all_gather in the forward, {} "
      "reduce_scatter in the backward: one at every layer, in the middle of the computation, which waits "
      "for it)",
      traffic.calls, format_bytes(traffic.bytes), o.layers, o.layers - 1));
  // What data parallelism would move for the same model: every gradient, dim x dim per layer, all-reduced
  // once per step after backward (one all_reduce per layer's gradient, or per bucket).
  const double dp_bytes = static_cast<double>(o.layers) * mlp::f32_bytes(o.dim * o.dim);
  r.print(fmt::format(
      "data parallelism would all-reduce {} of gradients per step ({} x {} x {} float32), once per step and "
      "overlappable with backward. Per layer, tensor parallelism moves about 2 x batch x dim numbers and "
      "data parallelism dim x dim: tensor parallelism moves more once the batch (in a transformer, the "
      "tokens of a step: batch x sequence, often millions) exceeds half the width{}",
      format_bytes(dp_bytes), o.layers, o.dim, o.dim,
      2 * o.batch < o.dim ? fmt::format("; here batch {} < dim {} / 2, so it moves less, but still at every "
                                        "layer, on the critical path",
                                        o.batch, o.dim)
                          : ""));
  summary.print_peak_memory();
  if (summary.skipped_comparison()) return;
  summary.print_agreement(" (each rank's columns of the gradients and weights)");
}

// The pairs' weight blocks, each rank making only its own; rank 0 says how they are split.
MegatronPairs make_pairs(Rank& r, const TensorParallelOptions& o) {
  const int world = r.world_size(), rank = r.rank();
  MegatronPairs m;
  m.c = o.dim / world;
  m.first = rank * m.c;
  if (rank == 0) {
    r.print(fmt::format(
        "tensor_parallel --megatron: {} ranks; {}; {} pairs: a column block of {} x {}, then a row block of "
        "{} x {}, one all_reduce per pair each way",
        world, mlp::describe(o), o.layers / 2, o.dim, m.c, m.c, o.dim));
  }
  for (int l = 0; l < o.layers; ++l) {
    if (l % 2 == 0) {
      m.w.push_back(mlp::make_weight_columns(r, o, l, m.first, m.c));
    } else {
      m.w.push_back(mlp::make_weight_rows(r, o, l, m.first, m.c));
    }
  }
  return m;
}

// The loss and this rank's blocks of each pair (columns of the first layer, rows of the second) against
// one device's; rank 0's line.
void check_pairs(Rank& r, const TensorParallelOptions& o, mlp::RunSummary& summary, int step, double step_us,
                 const MegatronPairs& m, const Tensor& out_sum, const std::vector<Tensor>& grads) {
  double loss = 0;
  const auto d =
      summary.check_step(step, "loss, gradients and weight blocks", [&](const mlp::Reference& ref) {
        loss = r.to_host(out_sum)[0] / static_cast<double>(o.batch);
        check::Agreement diff = check::within_bound(loss, ref.loss(), ref.loss_bound(), "the loss");
        for (int l = 0; l < o.layers; ++l) {
          auto mine = [&](const std::vector<float>& all) {
            if (l % 2 == 0) return mlp::columns(all, o.dim, o.dim, m.first, m.c);
            return std::vector<float>(all.begin() + m.first * o.dim, all.begin() + (m.first + m.c) * o.dim);
          };
          const std::int64_t cols = l % 2 == 0 ? m.c : o.dim;
          diff.merge(check::within_bound(r.to_host(grads[l]), mine(ref.grad(l)), mine(ref.grad_bound(l)),
                                         fmt::format("layer {} gradient", l), cols));
          diff.merge(check::within_bound(r.to_host(m.w[l]), mine(ref.weight(l)), mine(ref.weight_bound(l)),
                                         fmt::format("layer {} weight", l), cols));
        }
        return diff;
      });
  if (d && r.rank() == 0 && !o.quiet) {
    r.print(fmt::format("step {}/{}  time {}  loss {:.6f} (one device {:.6f})  {}", step, o.steps,
                        mlp::format_time(step_us), loss, summary.reference()->loss(), check::verdict(*d)));
  }
}

void print_pairs(Rank& r, const TensorParallelOptions& o, const mlp::RunSummary& summary,
                 const mlp::Traffic& traffic) {
  if (r.rank() != 0) return;
  r.print(fmt::format(
      "communication per rank per step: {} all_reduce calls, {} in all (one per pair of layers forward, one "
      "per pair but the first backward), against {} collectives of the all_gather scheme",
      traffic.calls, format_bytes(traffic.bytes), 2 * o.layers - 1));
  if (!o.phantom) {
    r.print(
        fmt::format("rank 0's blocks equal to one device's after every step (every rank checks its own): {}",
                    summary.agreement_of_this_rank()));
  }
}

}  // namespace

using O = TensorParallelOptions;
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .add({
            {"world", &O::world, "ranks: each holds dim/world columns of every weight"},
            {"megatron", &O::megatron,
             "Megatron's column-then-row pairs: one all_reduce per pair of layers each way"},
            break_option<O>(&O::broken, {"no-reduce-scatter", "wrong-slice"}),
        });
const std::vector<LectureSetting> kLecture = {{"world", "4", "each rank holds 1024 x 256 of every weight"},
                                              {"batch", "128", ""},
                                              {"dim", "1024", ""},
                                              {"layers", "4", ""}};

RANKLAB_LESSON("tensor_parallel",
               "split every weight by columns: all_gather forward, reduce_scatter backward", tensor_parallel,
               kOptions, kLecture);

}  // namespace ranklab
