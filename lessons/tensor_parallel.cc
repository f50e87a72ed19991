// Tensor parallelism, as the lecture writes it: every weight is split by columns, so a rank holds
// dim x dim/W of each layer, and every rank sees the whole batch. A rank's columns give it its part of each
// layer's output; relu works on each part alone, but the next layer needs all of it, so every layer ends
// with an all_gather. The backward mirrors it: where the forward all-gathers, the backward reduce-scatters.
//
//   ranklab run tensor_parallel --world 4
#include <fmt/format.h>

#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"

namespace ranklab {
namespace {

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

struct TensorParallelOptions : mlp::TrainingOptions {
  bool megatron = false;  // Megatron's column-then-row pairs instead of the all_gather scheme
};

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

// --megatron: Megatron-LM's pairing (Shoeybi et al. 2019). Layers go in pairs: the first split by columns
// (as above), the second by rows, so the first's column block of the activation is exactly the rows the
// second's block multiplies; nothing is gathered between them. Each rank's product is then a partial sum
// of the pair's output, and one all_reduce adds them up. The backward mirrors it: one all_reduce of the
// input's gradient per pair. Two collectives per pair of layers instead of one per layer each way, and
// every one an all_reduce of [batch, dim]: what Megatron and every transformer's MLP and attention block
// use inside a node. The lecture's scheme (all_gather after each layer) is simpler to write for any layer
// and is what sequence parallelism builds on; the pairing is what is used when layers come in pairs.
void megatron_pairs(Rank& r, const TensorParallelOptions& o) {
  const int world = r.world_size(), rank = r.rank(), layers = o.layers;
  if (layers % 2 != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel --megatron: --layers {} is odd; the layers go in column-then-row pairs", layers));
  }
  const std::int64_t c = o.dim / world, first = rank * c;
  if (rank == 0) {
    r.print(fmt::format(
        "tensor_parallel --megatron: {} ranks; {}; {} pairs: a column block of {} x {}, then a row block of "
        "{} x {}, one all_reduce per pair each way",
        world, mlp::describe(o), layers / 2, o.dim, c, c, o.dim));
  }
  std::vector<Tensor> w;  // even layers: columns [first, first + c); odd layers: rows [first, first + c)
  for (int l = 0; l < layers; ++l) {
    if (l % 2 == 0) {
      w.push_back(mlp::make_weight_columns(r, o, l, first, c));
    } else {
      w.push_back(mlp::make_weight_rows(r, o, l, first, c));
    }
  }
  mlp::Optimizer opt(r, o, w);
  Tensor x = mlp::make_samples(r, o, 0, o.batch);
  Tensor dloss = mlp::loss_grad(r, o, {o.batch, o.dim}, o.batch);
  mlp::RunSummary summary(r, o, "tensor_parallel --megatron");
  mlp::Traffic traffic;
  double step_us = 0;
  for (int step = 1; step <= o.steps; ++step) {
    // The step's phases as regions; an exception (running out of memory) closes the open one.
    std::optional<Rank::Region> phase;
    r.synchronize();
    r.barrier();
    const double t0 = r.now();
    traffic = {};
    phase.emplace(&r, "forward");
    std::vector<Tensor> xs{x}, hs;  // each pair's input (whole) and its middle activation (my block)
    for (int l = 0; l < layers; l += 2) {
      hs.push_back(r.relu(r.matmul(xs.back(), w[l])));  // [batch, c]: my columns of the first layer
      Tensor partial = r.matmul(hs.back(), w[l + 1]);   // [batch, dim]: my rows' share of the second
      r.all_reduce(partial, ReduceOp::Sum);
      traffic.add(partial);
      xs.push_back(r.relu(partial));
    }
    Tensor out_sum = mlp::output_sum(r, xs.back());
    phase.reset();
    phase.emplace(&r, "backward");
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
    phase.reset();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    r.synchronize();
    step_us = r.now() - t0;
    double loss = 0;
    const auto d =
        summary.check_step(step, "loss, gradients and weight blocks", [&](const mlp::Reference& ref) {
          loss = r.to_host(out_sum)[0] / static_cast<double>(o.batch);
          check::Agreement diff = check::within_bound(loss, ref.loss(), ref.loss_bound(), "the loss");
          for (int l = 0; l < layers; ++l) {
            auto mine = [&](const std::vector<float>& m) {
              if (l % 2 == 0) return mlp::columns(m, o.dim, o.dim, first, c);
              return std::vector<float>(m.begin() + first * o.dim, m.begin() + (first + c) * o.dim);
            };
            const std::int64_t cols = l % 2 == 0 ? c : o.dim;
            diff.merge(check::within_bound(r.to_host(grads[l]), mine(ref.grad(l)), mine(ref.grad_bound(l)),
                                           fmt::format("layer {} gradient", l), cols));
            diff.merge(check::within_bound(r.to_host(w[l]), mine(ref.weight(l)), mine(ref.weight_bound(l)),
                                           fmt::format("layer {} weight", l), cols));
          }
          return diff;
        });
    if (d && rank == 0 && !o.quiet) {
      r.print(fmt::format("step {}/{}  time {}  loss {:.6f} (one device {:.6f})  {}", step, o.steps,
                          mlp::format_time(step_us), loss, summary.reference()->loss(), check::verdict(*d)));
    }
  }
  if (rank != 0) return;
  r.print(fmt::format(
      "communication per rank per step: {} all_reduce calls, {} in all (one per pair of layers forward, one "
      "per pair but the first backward), against {} collectives of the all_gather scheme",
      traffic.calls, format_bytes(traffic.bytes), 2 * layers - 1));
  if (!o.phantom) {
    r.print(
        fmt::format("rank 0's blocks equal to one device's after every step (every rank checks its own): {}",
                    summary.agreement_of_this_rank()));
  }
}

void tensor_parallel(Rank& r, const TensorParallelOptions& o) {
  // --break no-reduce-scatter: each rank keeps its block of its own partial sum, unsummed; wrong-slice: each
  // rank makes the next rank's columns of the weights.
  if (o.megatron && !o.broken.empty()) {
    throw UsageError(fmt::format(
        "tensor_parallel: --break {} breaks the all_gather scheme, not --megatron's pairs", o.broken));
  }
  const int world = r.world_size(), rank = r.rank();
  if (o.dim % world != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel: --dim {} is not divisible by --world {}: each rank holds dim/world columns of "
        "every weight; use a multiple of {} such as {}",
        o.dim, world, world, (o.dim / world + 1) * world));
  }
  if (o.megatron) {
    megatron_pairs(r, o);
    return;
  }
  const std::int64_t cols = o.dim / world, first_col = rank * cols;  // the lecture's local_num_dim
  const int layers = o.layers;

  mlp::Memory plan;  // a slice of every weight; the activations are not split here (see the docs)
  plan.params = layers * mlp::f32_bytes(o.dim * cols);
  plan.grads = plan.params;
  plan.optimizer = mlp::optimizer_bytes(o, plan.params);
  plan.activations = (layers + 1) * mlp::f32_bytes(o.batch * o.dim) + layers * mlp::f32_bytes(o.batch * cols);
  if (rank == 0) {
    r.print(fmt::format("tensor_parallel: {} ranks; {}; every weight split into {} column blocks of {} x {}",
                        world, mlp::describe(o), world, o.dim, cols));
    r.print("memory per rank (every rank holds 1/world of every weight and the whole batch's activations):");
    if (!mlp::print_memory_plan(r, "every rank", plan)) {
      r.print(
          "  each rank holds 1/world of every weight: more ranks shrink it; the activations are not split "
          "here");
    }
  }

  // Each rank makes only its columns, with the numbers those columns of one device's weights hold.
  std::vector<Tensor> w;
  const std::int64_t made_col = o.broken == "wrong-slice" ? (first_col + cols) % o.dim : first_col;
  for (int l = 0; l < layers; ++l) w.push_back(mlp::make_weight_columns(r, o, l, made_col, cols));
  mlp::Optimizer opt(r, o, w);
  Tensor x = mlp::make_samples(r, o, 0, o.batch);  // every rank holds the whole batch
  // d loss / d (this rank's columns of the output), transposed
  Tensor dloss = mlp::loss_grad(r, o, {cols, o.batch}, o.batch);
  mlp::RunSummary summary(r, o, "tensor_parallel");
  mlp::Traffic traffic;
  double step_us = 0, launched_us = 0;

  for (int step = 1; step <= o.steps; ++step) {
    // The step's phases as regions; an exception (running out of memory) closes the open one.
    std::optional<Rank::Region> phase;
    r.synchronize();
    r.barrier();
    const double t0 = r.now();
    traffic = {};

    // Forward: my columns of each layer's output, then everyone's, for the next layer.
    phase.emplace(&r, "forward");  // the phases, named on the timeline and matched by `ranklab compare`
    std::vector<Tensor> xs{x};     // each layer's whole input: the samples, then transposed outputs
    std::vector<Tensor> hs;        // each layer's output, my columns, transposed
    for (int l = 0; l < layers; ++l) {
      hs.push_back(forward_columns(r, xs[l], l == 0, w[l]));   // [dim/W, batch]
      xs.push_back(all_gather_columns(r, o, hs[l], traffic));  // [dim, batch]
    }
    Tensor out_sum = mlp::output_sum(r, xs.back());  // every rank has the whole output
    phase.reset();

    // Backward. My columns' gradient needs only my columns of the output gradient; the input's gradient
    // is a sum over every rank's columns (dz @ w^T), so it is reduced, and scattered: each rank needs only
    // the columns its own previous layer produced.
    phase.emplace(&r, "backward");
    std::vector<Tensor> grads(layers);
    Tensor dh = dloss;
    for (int l = layers - 1; l >= 0; --l) {
      Tensor dz = r.relu_backward(dh, hs[l]);                                       // [dim/W, batch]
      grads[l] = r.matmul(xs[l], dz, l == 0 ? Trans::Yes : Trans::No, Trans::Yes);  // local, exact
      if (l > 0 && o.broken == "no-reduce-scatter") {
        dh = r.slice(r.matmul(w[l], dz), 0, first_col, cols);
      } else if (l > 0) {
        dh = reduce_scatter_columns(r, o, r.matmul(w[l], dz), traffic);
      }
    }
    phase.reset();
    summary.sample_memory();  // every gradient and every activation
    xs.clear();
    hs.clear();
    dh = Tensor();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    launched_us = r.now() - t0;  // the host's part: launching the step
    r.synchronize();
    step_us = r.now() - t0;

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
    if (rank == 0 && !o.quiet) r.print(line);
  }

  if (!summary.gather()) return;
  summary.print_last_step(step_us, launched_us);
  r.print(fmt::format(
      "communication per rank per step: {} collectives, {} in all ({} all_gather in the forward, {} "
      "reduce_scatter in the backward: one at every layer, in the middle of the computation, which waits "
      "for it)",
      traffic.calls, format_bytes(traffic.bytes), layers, layers - 1));
  // What data parallelism would move for the same model: every gradient, dim x dim per layer, all-reduced
  // once per step after backward (one all_reduce per layer's gradient, or per bucket).
  const double dp_bytes = static_cast<double>(layers) * mlp::f32_bytes(o.dim * o.dim);
  r.print(fmt::format(
      "data parallelism would all-reduce {} of gradients per step ({} x {} x {} float32), once per step and "
      "overlappable with backward. Per layer, tensor parallelism moves about 2 x batch x dim numbers and "
      "data parallelism dim x dim: tensor parallelism moves more once the batch (in a transformer, the "
      "tokens of a step: batch x sequence, often millions) exceeds half the width{}",
      format_bytes(dp_bytes), layers, o.dim, o.dim,
      2 * o.batch < o.dim ? fmt::format("; here batch {} < dim {} / 2, so it moves less, but still at every "
                                        "layer, on the critical path",
                                        o.batch, o.dim)
                          : ""));
  summary.print_peak_memory();
  if (summary.skipped_comparison()) return;
  summary.print_agreement(" (each rank's columns of the gradients and weights)");
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
