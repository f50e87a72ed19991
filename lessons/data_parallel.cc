// Data parallelism, as the lecture writes DDP: every rank holds the whole model and trains on its own slice
// of the batch; one all_reduce(Avg) of every gradient, between backward and the optimizer step, gives every
// rank the gradient of the whole batch, so the copies of the model stay identical.
//
//   ranklab run data_parallel --world 4
//   ranklab run data_parallel --world 4 --overlap --bucket-mb 0.01
#include <fmt/format.h>

#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "lessons/mlp.h"
#include "lessons/step.h"

namespace ranklab {
namespace {

struct DataParallelOptions : mlp::TrainingOptions {
  bool overlap = false;   // all-reduce gradients in buckets during backward
  double bucket_mb = 25;  // DDP's bucket_cap_mb
};

// --overlap: DDP's trick. Backward produces the gradients from the last layer to the first; each one can
// be all-reduced while the layers before it are still in backward. Small tensors make poor transfers, so
// gradients are packed into buckets of about --bucket-mb (DDP's bucket_cap_mb) and each full bucket is
// all-reduced asynchronously. Before the optimizer step, wait() for every bucket.
class GradBuckets {
 public:
  GradBuckets(Rank& r, double bucket_mb, mlp::Traffic& traffic, ReduceOp op)
      : r_(r), cap_bytes_(bucket_mb * 1024 * 1024), traffic_(traffic), op_(op) {}

  // `layer`'s gradient, just produced by backward.
  void add(std::vector<Tensor>& grads, int layer) {
    filling_.push_back(layer);
    filling_bytes_ += grads[layer].bytes();
    if (filling_bytes_ >= cap_bytes_) launch(grads);
  }

  // All-reduces what is left in the bucket being filled.
  void launch(std::vector<Tensor>& grads) {
    if (filling_.empty()) return;
    Bucket b{filling_, {}, {}};
    if (filling_.size() == 1) {
      b.flat = grads[filling_[0]];  // one gradient: reduce it in place, no copy
    } else {
      std::vector<Tensor> parts;  // the lesson's gradients are all dim x dim: stack them along rows
      for (int l : filling_) parts.push_back(grads[l]);
      b.flat = r_.cat(parts, 0);
    }
    b.work = r_.all_reduce(b.flat, op_, Async::Yes);
    traffic_.add(b.flat);
    buckets_.push_back(std::move(b));
    filling_.clear();
    filling_bytes_ = 0;
  }

  // Waits for every bucket and puts the averaged gradients back where the optimizer finds them.
  void wait(std::vector<Tensor>& grads) {
    for (Bucket& b : buckets_) {
      b.work.wait();
      if (b.layers.size() == 1) continue;
      std::int64_t row = 0;
      for (int l : b.layers) {
        const std::int64_t rows = grads[l].size(0);
        grads[l] = r_.slice(b.flat, 0, row, rows);
        row += rows;
      }
    }
    buckets_.clear();
  }

 private:
  struct Bucket {
    std::vector<int> layers;
    Tensor flat;
    Work work;
  };
  Rank& r_;
  double cap_bytes_;
  mlp::Traffic& traffic_;
  ReduceOp op_;
  std::vector<int> filling_;
  double filling_bytes_ = 0;
  std::vector<Bucket> buckets_;
};

// What a step took: the whole of it, the host's part (launching it), the communication left after backward,
// and the compute time lost to the all_reduce kernels running beside it.
struct StepTimes {
  double step_us = 0, launched_us = 0, exposed_us = 0, slowed_us = 0;
};

std::int64_t samples_per_rank(const DataParallelOptions& o, int world);
void print_plan(Rank& r, const DataParallelOptions& o);
void check_step(Rank& r, const DataParallelOptions& o, mlp::RunSummary& summary, int step,
                const Tensor& out_sum, const std::vector<Tensor>& grads, const std::vector<Tensor>& w,
                const std::string& line);
void print_summary(Rank& r, const DataParallelOptions& o, mlp::RunSummary& summary, const StepTimes& t,
                   const mlp::Traffic& traffic, const std::vector<Tensor>& w);

void data_parallel(Rank& r, const DataParallelOptions& o) {
  // --break sum: Sum instead of Avg (every gradient world times too large); no-all-reduce: none at all.
  const ReduceOp grad_op = o.broken == "sum" ? ReduceOp::Sum : ReduceOp::Avg;
  const bool reduce_grads = o.broken != "no-all-reduce";
  const std::int64_t local = samples_per_rank(o, r.world_size());  // the lecture's local_batch_size
  print_plan(r, o);

  // The same seeds on every rank make the same weights, which is what the lecture's broadcast of rank 0's
  // weights would do. The data is another matter: each rank makes only its own samples.
  std::vector<Tensor> w;
  for (int l = 0; l < o.layers; ++l) w.push_back(mlp::make_weight(r, o, l));
  mlp::Optimizer opt(r, o, w);
  Tensor x = mlp::make_samples(r, o, r.rank() * local, local);
  // This rank's loss is the mean over its samples; all_reduce(Avg) of the gradients then averages the
  // ranks' means, which is the mean over the whole batch.
  Tensor dloss = mlp::loss_grad(r, o, {local, o.dim}, local);
  mlp::RunSummary summary(r, o, "data_parallel");
  mlp::Traffic traffic;
  StepTimes t;

  for (int step = 1; step <= o.steps; ++step) {
    TimedStep timed(r);
    const double slowed_before_us = r.comm_slowed_compute_us();
    traffic = {};

    // Forward on this rank's samples, keeping each layer's output for the backward.
    timed.phase("forward");  // the phases, named on the timeline and matched by `ranklab compare`
    std::vector<Tensor> acts{x};
    for (int l = 0; l < o.layers; ++l) acts.push_back(mlp::forward_layer(r, acts[l], w[l]));
    Tensor out_sum = mlp::output_sum(r, acts.back());

    // Backward, from the last layer to the first.
    timed.phase("backward");
    std::vector<Tensor> grads(o.layers);
    GradBuckets buckets(r, o.bucket_mb, traffic, grad_op);
    Tensor dy = dloss;
    for (int l = o.layers - 1; l >= 0; --l) {
      mlp::LayerGrads g = mlp::backward_layer(r, acts[l], acts[l + 1], w[l], dy, l > 0);
      grads[l] = g.w;
      dy = g.x;
      if (o.overlap && reduce_grads) buckets.add(grads, l);  // starts its all_reduce while backward goes on
    }
    timed.end_phase();
    summary.sample_memory();  // every gradient and every activation
    acts.clear();
    dy = Tensor();
    buckets.launch(grads);
    const Event backward_done = r.record_event();  // events: timing the step does not disturb it

    // The one line that makes it data parallel.
    timed.phase("gradient all_reduce");
    if (o.overlap) {
      buckets.wait(grads);
    } else if (reduce_grads) {
      for (Tensor& g : grads) {
        r.all_reduce(g, grad_op);
        traffic.add(g);
      }
    }
    timed.end_phase();
    const Event reduced = r.record_event();
    {
      auto scope = r.region("optimizer");
      opt.step(grads);
    }
    t.launched_us = timed.host_us();
    t.step_us = timed.finish();
    t.slowed_us = r.comm_slowed_compute_us() - slowed_before_us;
    t.exposed_us = r.elapsed_us(backward_done, reduced);

    // The check against one device (after the timed step, so it does not count in it).
    check_step(r, o, summary, step, out_sum, grads, w,
               fmt::format("step {}/{}  time {}  communication after backward {}", step, o.steps,
                           mlp::format_time(t.step_us), mlp::format_time(t.exposed_us)));
  }
  print_summary(r, o, summary, t, traffic, w);
}

// ---- checks and output --------------------------------------------------------------------------------

// The lecture's constraints: every rank needs at least one sample, and equal slices need a batch that is
// a multiple of the world size (otherwise the batch would be padded).
std::int64_t samples_per_rank(const DataParallelOptions& o, int world) {
  if (o.batch < world) {
    throw UsageError(fmt::format(
        "data_parallel: --batch {} is smaller than --world {}: every rank needs at least one sample", o.batch,
        world));
  }
  if (o.batch % world != 0) {
    throw UsageError(fmt::format(
        "data_parallel: --batch {} is not divisible by --world {}: the ranks would get unequal slices; use a "
        "multiple of {} such as {} or {}",
        o.batch, world, world, o.batch / world * world, (o.batch / world + 1) * world));
  }
  return o.batch / world;
}

// What every rank holds (the same: the whole model, and activations of its own samples), on rank 0.
void print_plan(Rank& r, const DataParallelOptions& o) {
  const int world = r.world_size();
  const std::int64_t local = o.batch / world;
  mlp::Memory plan;
  plan.params = o.layers * mlp::f32_bytes(o.dim * o.dim);
  plan.grads = plan.params;
  plan.optimizer = mlp::optimizer_bytes(o, plan.params);
  plan.activations = (o.layers + 1) * mlp::f32_bytes(local * o.dim);
  if (r.rank() != 0) return;
  r.print(fmt::format(
      "data_parallel: {} ranks; {}; {} samples per rank{}", world, mlp::describe(o), local,
      o.overlap ? fmt::format("; gradients all-reduced during backward in buckets of {} MiB", o.bucket_mb)
                : ""));
  r.print("memory per rank (every rank holds the whole model):");
  if (!mlp::print_memory_plan(r, "every rank", plan)) {
    r.print(
        "  data parallelism keeps the whole model, its gradients and optimizer state on every rank, "
        "so more ranks do not help; tensor_parallel and pipeline_parallel split the model across ranks");
  }
}

// The step's loss, gradients and weights against one device's, and rank 0's line for the step (`line`, with
// the loss and the verdict added unless --phantom).
void check_step(Rank& r, const DataParallelOptions& o, mlp::RunSummary& summary, int step,
                const Tensor& out_sum, const std::vector<Tensor>& grads, const std::vector<Tensor>& w,
                const std::string& line) {
  const std::int64_t local = o.batch / r.world_size();
  double loss_all = 0;
  const auto d = summary.check_step(step, "loss, gradients and weights", [&](const mlp::Reference& ref) {
    const double mine = r.to_host(out_sum)[0] / static_cast<double>(local);
    Tensor loss = r.from_host({1}, {static_cast<float>(mine)});
    r.all_reduce(loss, ReduceOp::Avg);  // to print the loss of the whole batch
    loss_all = r.to_host(loss)[0];
    check::Agreement diff = check::within_bound(loss_all, ref.loss(), ref.loss_bound(), "the loss");
    diff.merge(mlp::compare_layers(r, ref, grads, w, 0, 0, o.dim));
    return diff;
  });
  std::string shown = line;
  if (d) {
    shown += fmt::format("  loss {:.6f} (one device {:.6f})  {}", loss_all, summary.reference()->loss(),
                         check::verdict(*d));
  }
  if (r.rank() == 0 && !o.quiet) r.print(shown);
}

// Every rank's statistics to rank 0, after the training so it does not disturb the timing; rank 0 prints.
void print_summary(Rank& r, const DataParallelOptions& o, mlp::RunSummary& summary, const StepTimes& t,
                   const mlp::Traffic& traffic, const std::vector<Tensor>& w) {
  if (!summary.gather({}, &w)) return;
  // Overlap is not free: the all_reduce's kernels hold SMs and HBM bandwidth the backward's kernels
  // then run without.
  summary.print_last_step(
      t.step_us, t.launched_us,
      fmt::format(
          " ({} of it communication after backward, not hidden by compute{})", mlp::format_time(t.exposed_us),
          o.overlap
              ? fmt::format("; compute slowed by communication beside it: {}", mlp::format_time(t.slowed_us))
              : ""));
  r.print(fmt::format(
      "communication per rank per step: {} all_reduce call{}, {} in all ({}: the lecture's one gradient "
      "synchronisation per step, after backward)",
      traffic.calls, traffic.calls == 1 ? "" : "s", format_bytes(traffic.bytes),
      o.overlap ? "one per bucket of gradients" : "one per layer's gradient"));
  summary.print_peak_memory();
  if (summary.skipped_comparison()) return;
  summary.check_identical_weights();
  summary.print_agreement();
}

}  // namespace

using O = DataParallelOptions;
const OptionTable<O> kOptions =
    OptionTable<O>(mlp::training_options<O>())
        .add({
            {"world", &O::world, "ranks: each trains on batch/world samples"},
            {"overlap", &O::overlap, "all-reduce gradients in buckets during backward (DDP)"},
            // A bucket must hold something: 0 or a negative size would make a
            // bucket per gradient or none.
            Option<O>("bucket-mb", &O::bucket_mb,
                      "with --overlap: gradient bucket size (DDP's bucket_cap_mb)")
                .unit("MiB")
                .above(0)
                .at_most(1024 * 1024),
            break_option<O>(&O::broken, {"sum", "no-all-reduce"}),
        });
const std::vector<LectureSetting> kLecture = {
    {"world", "4", ""}, {"batch", "128", ""}, {"dim", "1024", ""}, {"layers", "4", ""}};

RANKLAB_LESSON("data_parallel",
               "split the batch, all_reduce(Avg) the gradients; --overlap hides it in backward",
               data_parallel, kOptions, kLecture);

}  // namespace ranklab
