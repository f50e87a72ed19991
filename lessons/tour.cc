// The tour: the lecture in one run. Collectives, then measuring them, then the three ways of splitting
// training across ranks, then why they exist: a model that does not fit one device.
//
//   ranklab run tour --world 4        (what `make demo` runs)
#include <fmt/format.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"

namespace ranklab {
namespace {

// The words the tour's output uses, each explained once, just before the section whose output first
// prints it: a reader meets the definition and then the word, never a list of words to remember first.
struct Term {
  const char* word;
  const char* meaning;
};
const std::vector<Term> kTerms = {
    {"ring/ll, nvls/simple",
     "the algorithm and protocol NCCL picks for a collective. ring passes pieces from GPU to GPU around a "
     "ring; tree goes up and down a tree; nvls lets the NVSwitch add the pieces itself. simple moves big "
     "chunks; ll (low latency) and ll128 trade bandwidth for latency on small messages."},
    {"algbw, busbw",
     "algorithm bandwidth is size / time. Bus bandwidth scales it by what each rank's link must carry for "
     "that collective (2(W-1)/W for all_reduce), so it compares with the link's speed whatever the algorithm "
     "or the world size (nccl-tests' definition)."},
    {"launch overhead",
     "a kernel costs the host time to launch it (the profile's launch_overhead_us, a few microseconds). "
     "When kernels are shorter than that, the GPU waits for the host and a step's time is launch time, not "
     "compute."},
    {"phantom tensors",
     "tensors with a shape and no numbers: the lesson is timed at a size this machine could not hold, and "
     "its check against one device is skipped."},
    {"bubble", "the time a pipeline stage has nothing to compute while it waits for another stage."},
    {"comm, comm wait, exposed, idle",
     "in the report: comm is time the communication streams move data; comm wait, time a collective waits "
     "for its last member to arrive; exposed, communication the compute stream had to wait for (not hidden "
     "under compute); idle, neither stream busy."},
};

// Prints the meaning of each of `words` not explained yet in this run (on rank 0).
class Glossary {
 public:
  void explain(Rank& r, const std::vector<std::string>& words) {
    for (const std::string& w : words) {
      if (!said_.insert(w).second || r.rank() != 0) continue;
      for (const Term& t : kTerms) {
        if (w == t.word) r.print(fmt::format("  [{}] {}", t.word, t.meaning));
      }
    }
  }

 private:
  std::set<std::string> said_;
};

// Runs one lesson inside the tour, with a heading, a short explanation and the new words its output uses,
// on every rank. The lesson takes those of `settings` it has options for: the tour describes one model for
// every lesson of a section.
void section(Rank& r, const std::string& lesson, const Settings& settings,
             const std::vector<std::string>& text, Glossary& glossary,
             const std::vector<std::string>& words = {}) {
  r.synchronize();  // the sections follow each other; none overlaps the one before
  r.barrier();
  if (r.rank() == 0) {
    r.print("");
    r.print(fmt::format("==== {} ====", lesson));
    for (const std::string& line : text) r.print(line);
  }
  glossary.explain(r, words);
  if (r.rank() == 0) r.print("");
  for (const Lesson& l : lessons()) {
    if (l.name != lesson) continue;
    Settings taken{{"world", std::to_string(r.world_size())}};
    for (const auto& [flag, value] : settings) {
      if (l.option(flag) != nullptr) taken[flag] = value;
    }
    l.prepare(taken).program(r);
    return;
  }
  if (r.rank() == 0) r.print(fmt::format("(this build has no lesson '{}': skipped)", lesson));
}

// The smallest multiple of `w` that is at least `n`.
std::int64_t multiple_of(std::int64_t n, std::int64_t w) {
  return (n + w - 1) / w * w;
}

// A size as an option's text.
std::string text(std::int64_t v) {
  return std::to_string(v);
}

// The small model of the tour's first sections: sizes every lesson accepts at `w` ranks.
Settings small_model(int w, bool quiet) {
  // Sizes every lesson accepts at this world size: the batch and the dimension are multiples of it, and
  // the pipeline's layers too. Data and tensor parallelism keep 4 layers at any world size: a deep net
  // trained with plain SGD at these sizes becomes chaotic (a relu input within rounding of zero decides
  // whether a gradient flows), and then no float32 run, on one device or many, follows exact arithmetic.
  return {
      {"batch", text(multiple_of(32, 4 * w))},  // and of 4, for the pipeline's four micro-batches
      {"dim", text(multiple_of(64, w))},
      {"layers", "4"},
      {"steps", "3"},
      {"micro-batches", "4"},
      {"count", "1000000"},  // the benchmark's collective: 3.81 MiB
      {"quiet", quiet ? "true" : "false"},
  };
}

// Collectives, and measuring them.
void the_primitives(Rank& r, const Settings& o, Glossary& glossary) {
  section(
      r, "collectives", o,
      {"The primitives. Every rank runs the same program on its own data; a collective is a call every rank "
       "makes, and what each one gets back is defined by all of them."},
      glossary);
  section(
      r, "benchmark", o,
      {"Measuring a collective: synchronize first, then barrier, then read the clock (and the same to stop "
       "it). barrier() does not wait for the device, so the other order lines up only the hosts, and a "
       "rank that was ready early also times the wait for the others. Bandwidth is bytes over time, and "
       "the bus bandwidth compares algorithms fairly."},
      glossary, {"ring/ll, nvls/simple", "algbw, busbw"});
}

// Data parallelism on the small model, then timed on a large one without and with --overlap.
void splitting_the_batch(Rank& r, const Settings& o, Glossary& glossary) {
  const int w = r.world_size();
  section(
      r, "data_parallel", o,
      {"Data parallelism: every rank holds the whole model and trains on batch/world samples. One "
       "all_reduce(Avg) of the gradients after backward makes every rank take the same step, so the result "
       "is one device's training over the whole batch, which the lesson checks after every step."},
      glossary, {"launch overhead"});
  Settings big = o;  // a model large enough for the gradients' all_reduce to take time
  big["phantom"] = "true";
  big["dim"] = text(multiple_of(8192, w));
  big["layers"] = "8";
  big["batch"] = text(multiple_of(1024, w));
  big["steps"] = "1";
  big["quiet"] = "true";
  section(
      r, "data_parallel", big,
      {fmt::format("The same with {} layers of {} x {} (phantom tensors: shapes and time, no numbers), first "
                   "with the all_reduce after backward...",
                   big["layers"], big["dim"], big["dim"])},
      glossary, {"phantom tensors"});
  big["overlap"] = "true";
  section(
      r, "data_parallel", big,
      {"...then with --overlap: each bucket of gradients is all-reduced while backward computes the layers "
       "before it. Compare the communication left after backward."},
      glossary);
}

// Tensor parallelism, then the pipeline on real numbers and timed, with GPipe and 1F1B.
void splitting_the_model(Rank& r, const Settings& o, Glossary& glossary) {
  const int w = r.world_size();
  section(
      r, "tensor_parallel", o,
      {"Tensor parallelism: every weight is split by columns. Each layer's output is all-gathered in the "
       "forward and its gradient reduce-scattered in the backward: communication at every layer, which is "
       "why it stays inside a node's fast links."},
      glossary);
  Settings pipe = o;
  pipe["layers"] = text(multiple_of(4, w));
  pipe["schedule"] = "gpipe";
  pipe["quiet"] = "true";
  section(
      r, "pipeline_parallel", pipe,
      {"Pipeline parallelism: the layers are split into stages that pass activations forward and gradients "
       "back with send/recv. First on real numbers, checked against one device..."},
      glossary, {"bubble"});
  // At the sizes above a task is as short as launching its kernels; the bubble needs tasks that compute.
  pipe["phantom"] = "true";
  pipe["quiet"] = "false";
  pipe["steps"] = "1";
  pipe["dim"] = text(multiple_of(4096, w));
  pipe["layers"] = text(4 * w);  // four layers a stage: tasks long against the transfers between them
  pipe["micro-batches"] = "8";
  pipe["batch"] = "1024";
  section(
      r, "pipeline_parallel", pipe,
      {fmt::format("...then timed at {} layers of {} x {} (phantom tensors). GPipe runs every micro-batch's "
                   "forward, then every backward; the dots in the chart are the bubble, (p-1)/(m+p-1) of "
                   "the time when stages are uniform and communication is free.",
                   pipe["layers"], pipe["dim"], pipe["dim"])},
      glossary);
  pipe["schedule"] = "1f1b";
  section(
      r, "pipeline_parallel", pipe,
      {"1F1B: the same bubble, but once the pipeline is full a stage alternates forward and backward, so it "
       "keeps at most p micro-batches of activations instead of all m."},
      glossary);
}

// Why the strategies exist: a model that does not fit one device, on each of them.
void a_model_larger_than_one_device(Rank& r, const Settings& o, Glossary& glossary) {
  const int w = r.world_size();
  Settings huge = o;
  const std::int64_t huge_dim = multiple_of(8192, w);
  // AdamW holds four floats per parameter (weight, gradient, two moments): enough layers for 1.2 devices.
  const double per_layer = 16.0 * static_cast<double>(huge_dim) * static_cast<double>(huge_dim);
  const double layers = std::ceil(1.2 * static_cast<double>(r.memory_capacity()) / per_layer);
  const std::int64_t huge_layers = multiple_of(static_cast<std::int64_t>(layers), w);
  huge["phantom"] = "true";
  huge["optimizer"] = "adamw";
  huge["steps"] = "1";
  huge["quiet"] = "true";
  huge["batch"] = text(multiple_of(64, 4 * w));
  huge["micro-batches"] = "4";
  huge["dim"] = text(huge_dim);
  huge["layers"] = text(huge_layers);
  if (r.rank() == 0) {
    r.print("");
    r.print("==== a model larger than one device ====");
    r.print(fmt::format(
        "{} layers of {} x {} with AdamW need {} for weights, gradients and optimizer state; one "
        "device holds {}.",
        huge_layers, huge_dim, huge_dim, format_bytes(per_layer * static_cast<double>(huge_layers)),
        format_bytes(static_cast<double>(r.memory_capacity()))));
  }
  try {
    section(r, "data_parallel", huge, {"Data parallelism keeps all of it on every rank:"}, glossary);
  } catch (const OutOfMemoryError& e) {
    if (r.rank() == 0) {
      r.print("out of memory, as expected:");
      r.print(e.what());
    }
  }
  section(r, "tensor_parallel", huge,
          {fmt::format("Tensor parallelism keeps 1/{} of every weight on each rank:", w)}, glossary);
  section(r, "pipeline_parallel", huge,
          {fmt::format("Pipeline parallelism keeps 1/{} of the layers on each rank:", w)}, glossary);
}

void tour(Rank& r, const LessonOptions& given) {
  const int w = r.world_size();
  const Settings o = small_model(w, given.quiet);
  if (r.rank() == 0) {
    r.print(
        fmt::format("The tour: {} ranks, one program (SPMD). Every lesson below is a short file in lessons/; "
                    "docs/lessons/ explains each.",
                    w));
  }
  Glossary glossary;
  the_primitives(r, o, glossary);
  splitting_the_batch(r, o, glossary);
  splitting_the_model(r, o, glossary);
  r.synchronize();
  r.barrier();
  if (w == 1) {
    if (r.rank() == 0) r.print("\n(with --world 2 or more the tour ends by growing a model past one device)");
    glossary.explain(r, {"comm, comm wait, exposed, idle"});  // the report's columns, printed next
    return;
  }
  a_model_larger_than_one_device(r, o, glossary);
  r.synchronize();
  r.barrier();
  if (r.rank() == 0) {
    r.print("");
    r.print(
        "The end of the tour. The report below shows each rank's compute, communication and idle time, the "
        "collectives and the traffic on every link; `ranklab run NAME --help` lists each lesson's options.");
  }
  glossary.explain(r, {"comm, comm wait, exposed, idle"});
}

}  // namespace

const OptionTable<LessonOptions> kOptions = {
    {"world", &LessonOptions::world, "ranks; the tour picks every lesson's sizes to fit them"}};

RANKLAB_LESSON("tour",
               "the lecture in one run: collectives, benchmark, data, tensor and pipeline parallelism", tour,
               kOptions);

}  // namespace ranklab
