// The model that data_parallel, tensor_parallel and pipeline_parallel train, and everything they share:
// making the numbers, the layer's forward and backward written by hand, the optimizer, the one-device
// reference each lesson is checked against, and the small pieces of bookkeeping behind their output.
//
// The model is the lecture's deep MLP: `layers` linear layers of dim x dim, each followed by relu, no bias:
//
//     x[l+1] = relu(x[l] @ W[l])          loss = sum(x[layers]) / batch
//
// The lecture's loss is the sum of the output. Dividing it by the batch makes it a mean over samples, and
// that is what makes the lecture's all_reduce(Avg) of gradients exact: the average over W ranks of each
// rank's mean over its B/W samples is the mean over all B samples, which is one device's loss.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/rank.h"
#include "common/units.h"
#include "lessons/check.h"

namespace ranklab::mlp {

// ---- options --------------------------------------------------------------------------------------------

// What every lesson that trains the MLP reads besides its own options.
struct TrainingOptions : LessonOptions {
  std::int64_t batch = 32;  // samples per step, all ranks together
  std::int64_t dim = 64;    // every layer is dim x dim
  int layers = 4;
  int steps = 3;
  double lr = 0.01;
  std::string optimizer = "sgd";  // sgd | adamw
  bool phantom = false;           // time the lesson at its size without numbers (no check)
  std::string broken;             // --break: a deliberate bug the lesson's check must catch
};

// The declarations of TrainingOptions' members for the table of a lesson whose options derive from it
// (--break excepted: each lesson declares its own bugs). A lesson declares one again to say more of it.
template <class O>
std::vector<Option<O>> training_options() {
  return {
      Option<O>("batch", &O::batch, "global batch size (samples per step, all ranks together)").at_least(1),
      Option<O>("dim", &O::dim, "model width: every layer is dim x dim").at_least(1),
      Option<O>("layers", &O::layers, "number of layers").at_least(1),
      Option<O>("steps", &O::steps, "training steps, each checked against one device").at_least(1),
      Option<O>("lr", &O::lr, "learning rate").above(0),
      Option<O>("optimizer", &O::optimizer, "the optimizer").choices({"sgd", "adamw"}),
      Option<O>("phantom", &O::phantom, "time the lesson at its size without numbers (no check)"),
  };
}

// "4 layers of 64 x 64, batch 32, sgd lr 0.01, 3 steps"
std::string describe(const TrainingOptions& o);

// ---- the numbers ------------------------------------------------------------------------------------------
// Every number is a pure function of a seed (Rank::randn is counter-based), so any rank can make any part
// of the data or the model without the others, and the one-device reference makes the same numbers.
// With --phantom these return phantom tensors: shapes and bytes, no numbers.

// Samples [first, first + count) of the batch, one row each. Sample i has its own seed, like a file a data
// loader reads, so a rank makes only the samples it trains on.
Tensor make_samples(Rank& r, const TrainingOptions& o, std::int64_t first, std::int64_t count);
// Layer `layer`'s weight, dim x dim, normal with He's standard deviation sqrt(2 / dim), which keeps the
// size of the activations steady through relu layers.
Tensor make_weight(Rank& r, const TrainingOptions& o, int layer);
// Columns [first_col, first_col + cols) of layer `layer`'s weight, dim x cols, with the same numbers as
// those columns of make_weight's; only the slice is made (on the host, then copied to the device), as a
// framework reads only its shard from a checkpoint.
Tensor make_weight_columns(Rank& r, const TrainingOptions& o, int layer, std::int64_t first_col,
                           std::int64_t cols);

// Rows [first_row, first_row + rows) of layer `layer`'s weight, rows x dim, with make_weight's numbers.
Tensor make_weight_rows(Rank& r, const TrainingOptions& o, int layer, std::int64_t first_row,
                        std::int64_t rows);

// ---- one layer, forward and backward by hand --------------------------------------------------------------

// y = relu(x @ w)
Tensor forward_layer(Rank& r, const Tensor& x, const Tensor& w);

struct LayerGrads {
  Tensor w;  // d loss / d w
  Tensor x;  // d loss / d x (undefined when not asked for)
};
// The backward of y = relu(x @ w), given dy = d loss / d y:
//   dz = dy where y > 0, else 0        (relu's output is positive exactly where its input is, so the
//                                        layer keeps only x and y for the backward, not z)
//   dw = x^T @ dz                      dx = dz @ w^T
LayerGrads backward_layer(Rank& r, const Tensor& x, const Tensor& y, const Tensor& w, const Tensor& dy,
                          bool want_dx);

// sum(y), a scalar; the lessons divide by the batch on the host when they print it.
Tensor output_sum(Rank& r, const Tensor& y);
// d loss / d y, of shape `s`, when the loss is a mean over `batch` samples: 1 / batch everywhere.
Tensor loss_grad(Rank& r, const TrainingOptions& o, const Shape& s, std::int64_t batch);
// A tensor to receive into: empty, or phantom with --phantom.
Tensor buffer(Rank& r, const TrainingOptions& o, const Shape& s);

// ---- the optimizer ----------------------------------------------------------------------------------------

// SGD or AdamW over a list of parameters (whole weights or shards). AdamW's two moment buffers are the
// optimizer state the memory table counts; they are allocated at once, so running out of memory happens
// before training rather than in the middle of a step.
class Optimizer {
 public:
  Optimizer(Rank& r, const TrainingOptions& o, std::vector<Tensor> params);
  void step(const std::vector<Tensor>& grads);
  // AdamW's two moments of each parameter, in the parameters' order (none with SGD).
  const std::vector<Tensor>& m() const { return m_; }
  const std::vector<Tensor>& v() const { return v_; }

 private:
  Rank& r_;
  std::vector<Tensor> params_, m_, v_;
  bool adamw_;
  AdamW hyper_;
  int t_ = 0;
};

// ---- the one-device reference -----------------------------------------------------------------------------

// Training the same model over the full batch on one device, in plain C++ on the host. It costs the lesson
// no simulated time and no device memory (so neither the timeline nor the memory table is disturbed), and
// it shares no code with the lessons' forward and backward, so a wrong backward fails the check too.
// Sums are taken in double precision: the reference is more exact than float32, and the check's tolerance
// measures how far the distributed float32 training strays from it.
//
// Every rank of a run checks itself against the same reference, so it is computed once per run, not once
// per rank: the ranks' Reference objects made with the same options share one training, and each step's
// results are kept until no rank needs them. The sharing is safe across threads (the CUDA backend runs one
// thread per GPU).
class Reference {
 public:
  explicit Reference(const TrainingOptions& o);
  ~Reference();
  Reference(const Reference&) = delete;
  Reference& operator=(const Reference&) = delete;
  void step();  // one step on the full batch: loss, gradients, then the optimizer

  std::int64_t dim() const { return dim_; }
  double loss() const;  // of the last step, before its update
  // Row-major dim x dim values: the gradient of the last step, and the weight after it.
  const std::vector<float>& grad(int layer) const;
  const std::vector<float>& weight(int layer) const;
  // How far a float32 training can be from each of those numbers, element by element: the bound the
  // reference carries beside its numbers (mlp.cc derives it). A distributed run further away than that
  // is wrong, whatever the world size, the dimensions or the optimizer.
  double loss_bound() const;
  const std::vector<float>& grad_bound(int layer) const;
  const std::vector<float>& weight_bound(int layer) const;

  struct Shared;  // the one training all ranks' references read
  struct Result;  // one step's loss, gradients and weights

 private:
  std::int64_t dim_;
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<const Result> now_;  // the state after this rank's last step()
  int t_ = 0;
};

// Columns [first, first + count) of a row-major rows x cols matrix.
std::vector<float> columns(const std::vector<float>& m, std::int64_t rows, std::int64_t cols,
                           std::int64_t first, std::int64_t count);

// After a step: this rank's gradients and weights of layers first_layer, first_layer + 1, ... against the
// reference's, or against their columns [first_col, first_col + cols) when the rank holds a column slice.
check::Agreement compare_layers(Rank& r, const Reference& ref, const std::vector<Tensor>& grads,
                                const std::vector<Tensor>& weights, int first_layer, std::int64_t first_col,
                                std::int64_t cols);
// A hash of tensors' bytes, as four 16-bit pieces (exact in float32, so a float tensor can carry them to
// another rank): equal hashes mean, with overwhelming probability, the same bits.
std::vector<float> fingerprint(const std::vector<std::vector<float>>& tensors);

// ---- bookkeeping for the output ---------------------------------------------------------------------------

// This lesson's peak memory. The device's high-water mark (Rank::memory_peak) covers the whole run, so
// when a lesson runs after others (the tour) the mark may be theirs; then the lesson reports the most it
// was seen holding at the points where it calls sample().
class PeakMemory {
 public:
  explicit PeakMemory(Rank& r) : r_(r), before_(r.memory_peak()) {}
  void sample() { seen_ = std::max(seen_, r_.memory_allocated()); }
  std::int64_t bytes() const { return r_.memory_peak() > before_ ? r_.memory_peak() : seen_; }

 private:
  Rank& r_;
  std::int64_t before_, seen_ = 0;
};

// The bytes a rank hands to communication, counted as the lesson calls it.
struct Traffic {
  int calls = 0;
  std::int64_t bytes = 0;
  void add(const Tensor& t) {
    ++calls;
    bytes += t.bytes();
  }
};

// What a rank holds, by kind, in bytes.
struct Memory {
  std::int64_t params = 0, grads = 0, optimizer = 0, activations = 0;
  std::int64_t total() const { return params + grads + optimizer + activations; }
};
// "params 64 KiB  grads 64 KiB  optimizer 0 B  activations 40 KiB  total 168 KiB"
std::string format_memory(const Memory& m);
// The bytes of a float32 tensor of `n` elements.
inline std::int64_t f32_bytes(std::int64_t n) {
  return 4 * n;
}
// Optimizer state for `param_bytes` of parameters: AdamW keeps two moments, SGD nothing.
std::int64_t optimizer_bytes(const TrainingOptions& o, std::int64_t param_bytes);

// When the host was still launching the step's kernels almost until the device finished them (`launched_us`
// of `step_us`), the device spent the step waiting for launches, not computing: a line that says so, and
// what makes compute visible. Empty otherwise.
std::string launch_note(double launched_us, double step_us);

// "12.3 us", "4.56 ms", "1.23 s"
std::string format_time(double us);

// Every rank's `mine` (the same length on every rank), gathered to rank 0 with one gather; other ranks
// get an empty result. It is real communication: the lessons call it after their timed steps.
std::vector<std::vector<float>> gather_to_root(Rank& r, const std::vector<float>& mine);

// Prints what a rank will hold and how much of its device that is; when it is more than the device
// holds, says so and returns false. The lesson then goes on, and the device runs out of memory.
bool print_memory_plan(Rank& r, const std::string& who, const Memory& m);

// ---- what every training lesson does besides its idea
// ------------------------------------------------------

// The check against one device and the figures printed after the training, which every training lesson
// shares. A rank makes one at the start; it checks each timed step against the one-device reference
// (check_step), then gathers every rank's figures to rank 0 (gather) for the lines printed at the end.
class RunSummary {
 public:
  // `lesson` names the checks: "<lesson> step <n>: ...".
  RunSummary(Rank& r, const TrainingOptions& o, std::string lesson);
  ~RunSummary();
  RunSummary(const RunSummary&) = delete;
  RunSummary& operator=(const RunSummary&) = delete;

  // The reference, or null with --phantom (phantom tensors hold no numbers to compare).
  const Reference* reference() const { return ref_.get(); }
  // Records this rank's memory now (PeakMemory::sample).
  void sample_memory() { peak_.sample(); }

  // After a timed step: one step of the reference, then `compare` (this rank's numbers against it), both as
  // bookkeeping that the step's timing and the report's communication leave out; the difference is
  // recorded as the step's check (mlp::check_step) and returned. Nothing with --phantom.
  std::optional<check::Agreement> check_step(int step, const std::string& what,
                                             const std::function<check::Agreement(const Reference&)>& compare,
                                             const std::string& where = "");
  // This rank's difference over every step so far.
  const check::Agreement& diff() const { return worst_; }
  // agreement() of this rank's steps alone.
  std::string agreement_of_this_rank() const;

  // Opens the bookkeeping region of the report; gather() opens it if this has not. It stays open until the
  // summary goes: the report's figures are the lesson's bookkeeping, not its work.
  void begin_report();
  // Every rank's peak memory, differences and `extra` (the same length on every rank), and with `weights`
  // (not with --phantom) a fingerprint of them, gathered to rank 0 with one gather, after the training so
  // it does not disturb the timing. True on rank 0, which then reads the figures below.
  bool gather(const std::vector<float>& extra = {}, const std::vector<Tensor>* weights = nullptr);
  double peak_bytes() const { return peak_bytes_; }  // the busiest rank's
  double peak_bytes_of(int rank) const { return all_[rank][0]; }
  // Rank `rank`'s `extra`.
  std::vector<float> extra(int rank) const;

  // Rank 0, after gather(). "last step: <time><detail>", and the launch note when launches dominated.
  void print_last_step(double step_us, double launched_us, const std::string& detail = "") const;
  // "measured peak memory of the busiest rank: ..."
  void print_peak_memory() const;
  // With --phantom: says that the comparison was skipped, and returns true.
  bool skipped_comparison() const;
  // Checks that every rank's weights have the same fingerprint, and prints whether they do.
  void check_identical_weights() const;
  // "equal to one device over the full batch after every step<what>: yes (...)", over every rank.
  void print_agreement(const std::string& what = "") const;

 private:
  Rank& r_;
  const TrainingOptions& o_;
  std::string lesson_;
  PeakMemory peak_;
  std::unique_ptr<Reference> ref_;
  check::Agreement worst_;
  std::unique_ptr<Rank::Region> report_;
  std::vector<std::vector<float>> all_;  // rank 0: every rank's gathered figures
  double peak_bytes_ = 0, relative_ = 0, used_ = 0;
  bool identical_ = true;
  std::size_t extra_ = 0;
};

}  // namespace ranklab::mlp
