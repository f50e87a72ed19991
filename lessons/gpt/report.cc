#include "lessons/gpt/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/report.h"
#include "common/training.h"
#include "lessons/gpt/model.h"

namespace ranklab::gpt {

namespace {

// A struct of floats (SummedFigures, LargestFigures) appended to a tensor's floats, and read back from them.
template <class F>
void append(std::vector<float>& out, const F& f) {
  static_assert(std::is_trivially_copyable_v<F> && sizeof(F) % sizeof(float) == 0, "floats only");
  const size_t at = out.size();
  out.resize(at + sizeof(F) / sizeof(float));
  std::memcpy(out.data() + at, &f, sizeof(F));
}
template <class F>
F read(const std::vector<float>& in, size_t at) {
  static_assert(std::is_trivially_copyable_v<F> && sizeof(F) % sizeof(float) == 0, "floats only");
  F f;
  std::memcpy(static_cast<void*>(&f), in.data() + at, sizeof(F));
  return f;
}

// Stages 0, 1, the last two, and a line for those between when there are more than 4.
template <class Line>
void each_shown_stage(Rank& r, int stages, const std::string& indent, const Line& line) {
  for (int s = 0; s < stages; ++s) {
    if (stages > 4 && s == 2) r.print(fmt::format("{}... ({} more stages)", indent, stages - 4));
    if (stages > 4 && s >= 2 && s < stages - 2) continue;
    line(s);
  }
}

// The model's parameters: "175B", "1.3B", "85.3M"; with experts also the active ones, "46.7B (12.9B
// active)".
std::string parameters(const Config& c) {
  auto count = [](double n) {
    return n >= 1e9   ? fmt::format("{:.3g}B", n / 1e9)
           : n >= 1e6 ? fmt::format("{:.3g}M", n / 1e6)
                      : fmt::format("{:.0f}", n);
  };
  const std::string all = count(static_cast<double>(parameter_count(c)));
  if (!c.moe()) return all;
  return fmt::format("{} ({} active)", all, count(static_cast<double>(active_parameter_count(c))));
}

// The device's dense peak for the run's dtype; 0 when the profile has none. FP8 runs are measured against
// the 16-bit peak too, as torchtitan reports its float8 runs' MFU, so that MFU compares precisions; the
// printout adds the fraction of the FP8 peak.
double peak_tflops(Rank& r, const Config& c) {
  return c.dtype == DType::Float32 ? r.profile().gpu.peak_tflops_fp32 : r.profile().gpu.peak_tflops_bf16;
}

// ", 52.1% of the FP8 dense peak" for an FP8 run, else "".
std::string fp8_fraction(Rank& r, const Config& c, double model_tflops) {
  const double fp8_peak = r.profile().gpu.peak_tflops_fp8;
  if (c.fp8 == parallel::Fp8Recipe::None || fp8_peak <= 0) return "";
  return fmt::format(", {:.1f}% of the FP8 dense peak", 100 * model_tflops / fp8_peak);
}

// The pipeline's idle time over its compute time: the schedule's span over the mean busy time.
double bubble(const StepFigures& f) {
  const double busy = f.mean.busy_us, window = f.most.window_us;
  // (The figures are float32 sums over the ranks: a window that holds no bubble can come out a rounding
  // below the busy time.)
  return busy > 0 ? std::max(0.0, (window - busy) / busy) : 0;
}

// The report's record of the run: its rate, its bubble, its exposed communication and rank 0's memory.
TrainingStats training_stats(Rank& r, const Config& c, const std::vector<MemoryPlan>& plans,
                             const StepMeasures& mine, const StepFigures& f) {
  const Flops flops = step_flops(c);
  const double peak = peak_tflops(r, c), step_us = mine.step_us;
  const int w = r.world_size();
  TrainingStats st;
  st.model = c.model_name();
  st.layout = c.layout();
  st.tokens_per_step = c.tokens_per_step();
  st.micro_batches = static_cast<int>(c.micro_batches());
  st.step_time_us = step_us;
  st.model_flops = flops.model;
  st.hardware_flops = flops.hardware;
  st.model_tflops_per_gpu = flops.model / (step_us * 1e-6) / w / 1e12;
  st.hardware_tflops_per_gpu = flops.hardware / (step_us * 1e-6) / w / 1e12;
  st.mfu = peak > 0 ? st.model_tflops_per_gpu / peak : 0;
  st.bubble_fraction = bubble(f);
  st.bubble_fraction_formula = (c.pp - 1.0) / (c.v * static_cast<double>(c.micro_batches()));
  for (int d = 0; d < parallel::kDims; ++d) {
    const char* dim = parallel::kDimNames[d];
    st.exposed_comm_us[dim] = f.mean.exposed_us[d];
    st.communicated_comm_us[dim] = f.mean.communicated_us[d];
    st.hidden_comm_us[dim] = std::max(0.0f, f.mean.communicated_us[d] - f.mean.exposed_us[d]);
  }
  st.peak_memory_bytes = mine.peak_bytes;
  st.weights_bytes = plans[0].weights;
  st.grads_bytes = plans[0].grads;
  st.optimizer_bytes = plans[0].optimizer;
  st.activations_bytes = mine.peak_bytes - plans[0].held();
  st.moe_routes = static_cast<std::int64_t>(f.mean.moe_routes);
  st.moe_dropped_routes = static_cast<std::int64_t>(f.mean.moe_dropped);
  return st;
}

}  // namespace

void print_plan(Rank& r, const Config& c, const parallel::Layout& layout,
                const std::vector<MemoryPlan>& plans) {
  const Flops flops = step_flops(c);
  r.print(fmt::format("gpt{}: {}; {} parameters", c.model.empty() ? "" : " " + c.model, c.shape(),
                      parameters(c)));
  r.print(fmt::format(
      "  global batch {} x seq {} = {} tokens per step; micro-batch {}: m = {} micro-batches per "
      "pipeline; {} steps of AdamW lr {}",
      c.global_batch, c.seq, c.tokens_per_step(), c.micro_batch, c.micro_batches(), c.steps, c.lr));
  r.print(fmt::format("layout: {} on {} ranks", c.layout(), r.world_size()));
  if (!c.quiet) {
    for (const std::string& line : parallel::describe_groups(layout, r.profile().gpus_per_node))
      r.print(line);
  }
  std::string formula = c.llama() ? "6 B s (L (h (a + 2 g) d + a d h + 3 h f + 2 s a d) + h V)"
                                  : "72 B s L h^2 (1 + s/(6h) + V/(12hL))";
  if (c.moe()) {
    formula += fmt::format(" (in its {} MoE layers h E + {} k h f_e in place of {})", c.moe_layer_count(),
                           c.llama() ? 3 : 2, c.llama() ? "3 h f" : "8 h^2");
  }
  if (c.sliding_window > 0) {
    formula += fmt::format(" (in its {} windowed layers the window's {} keys in place of s)",
                           c.windowed_layer_count(), std::min<std::int64_t>(c.sliding_window, c.seq));
  }
  r.print(fmt::format("FLOPs per step: model {} = {:.4g} PFLOP; hardware (with recompute {}) {:.4g} PFLOP",
                      formula, flops.model / 1e15, recompute_name(c.recompute), flops.hardware / 1e15));
  r.print(fmt::format("memory per rank, estimated before allocating (device {}):",
                      format_bytes(r.memory_capacity())));
  each_shown_stage(r, c.pp, "  ", [&](int s) {
    const MemoryPlan& p = plans[s];
    r.print(fmt::format(
        "  stage {:<3} weights {:>10}  grads {:>10}  optimizer {:>10}{}{}  activations {:>10} "
        "({} micro-batch{} alive)  total {:>10}",
        s, format_bytes(p.weights), format_bytes(p.grads), format_bytes(p.optimizer),
        p.fp8_weights > 0 ? fmt::format("  fp8 weights {:>10}", format_bytes(p.fp8_weights)) : "",
        p.fp8_scaling > 0 ? fmt::format("  amax histories {:>10}", format_bytes(p.fp8_scaling)) : "",
        format_bytes(p.activations), p.most_alive, p.most_alive == 1 ? "" : "es", format_bytes(p.total())));
  });
}

StepFigures gather_step_figures(Rank& r, const Config& c, const parallel::Layout::Coord& me, bool measures,
                                const StepMeasures& mine, const OneDeviceCheck& check) {
  auto gathering = r.bookkeeping("figures");  // collectives for the printout, not the training step
  SummedFigures summed;
  for (int d = 0; d < parallel::kDims; ++d) {
    summed.exposed_us[d] = static_cast<float>(mine.exposed_us[d]);
    summed.communicated_us[d] = static_cast<float>(mine.communicated_us[d]);
  }
  summed.busy_us = static_cast<float>(mine.pipeline.busy_us);
  summed.window_us = static_cast<float>(mine.pipeline.window_us);
  summed.measuring_ranks = measures ? 1.0f : 0.0f;
  summed.moe_routes = static_cast<float>(mine.moe_routes);
  summed.moe_dropped = static_cast<float>(mine.moe_dropped);
  std::vector<float> sums;
  append(sums, summed);
  Tensor sum = r.from_host({static_cast<std::int64_t>(sums.size())}, sums);
  r.all_reduce(sum, ReduceOp::Sum);

  // The largest: each stage's peak over its ranks (with experts, the rank of the busiest expert's), each
  // step's loss, then LargestFigures.
  std::vector<float> maxima(c.pp + c.steps, 0.0f);
  maxima[me.pp] = static_cast<float>(mine.peak_bytes);
  if (me.tp == 0 && me.dp == 0) {
    for (size_t i = 0; i < check.losses.size(); ++i) maxima[c.pp + i] = static_cast<float>(check.losses[i]);
  }
  const LargestFigures largest{static_cast<float>(mine.pipeline.window_us),
                               static_cast<float>(check.grad.worst), static_cast<float>(check.weight.worst),
                               static_cast<float>(check.loss.worst)};
  append(maxima, largest);
  Tensor max = r.from_host({static_cast<std::int64_t>(maxima.size())}, maxima);
  r.all_reduce(max, ReduceOp::Max);

  StepFigures f;
  f.mean = read<SummedFigures>(r.to_host(sum), 0);
  const float measured = f.mean.measuring_ranks;
  for (float& e : f.mean.exposed_us) e /= measured;
  for (float& e : f.mean.communicated_us) e /= measured;
  f.mean.busy_us /= measured;
  f.mean.window_us /= measured;
  f.mean.measuring_ranks /= measured;
  const std::vector<float> most = r.to_host(max);
  f.stage_peak_bytes.assign(most.begin(), most.begin() + c.pp);
  if (check.compares()) f.losses.assign(most.begin() + c.pp, most.begin() + c.pp + c.steps);
  f.most = read<LargestFigures>(most, c.pp + c.steps);
  return f;
}

void print_summary(Rank& r, const Config& c, const std::vector<MemoryPlan>& plans, const StepMeasures& mine,
                   const StepFigures& f, const OneDeviceCheck& check) {
  const TrainingStats st = training_stats(r, c, plans, mine, f);
  r.report_training(st);
  for (size_t s = 0; s < f.losses.size(); ++s) {
    r.print(fmt::format("step {}/{}  loss {:.6f} (one device {:.6f})", s + 1, c.steps, f.losses[s],
                        check.reference().loss(static_cast<int>(s) + 1)));
  }
  const double step_us = mine.step_us, peak = peak_tflops(r, c);
  r.print(fmt::format("step time {} (the last step, events on rank 0's compute stream); {:.0f} tokens/s",
                      human_time(step_us), c.tokens_per_step() / (step_us * 1e-6)));
  r.print(fmt::format("  model {:.1f} TFLOP/s per GPU, hardware {:.1f}; MFU {}", st.model_tflops_per_gpu,
                      st.hardware_tflops_per_gpu,
                      peak > 0
                          ? fmt::format("{:.1f}% of {:.0f} TFLOP/s ({} dense peak){}", 100 * st.mfu, peak,
                                        dtype_name(c.dtype), fp8_fraction(r, c, st.model_tflops_per_gpu))
                          : std::string("unknown (no peak for this device)")));
  if (c.pp > 1) {
    r.print(fmt::format(
        "  pipeline bubble: idle {:.1f}% of the compute time measured (the schedule's span over "
        "the mean busy time of replica 0's ranks); (p-1)/(v m) = "
        "{}/({} x {}) = {:.1f}% for uniform stages and free communication",
        100 * st.bubble_fraction, c.pp - 1, c.v, c.micro_batches(), 100 * st.bubble_fraction_formula));
  }
  const auto& exposed = f.mean.exposed_us;
  auto at = [&](parallel::Dim d) { return human_time(exposed[static_cast<int>(d)]); };
  r.print(
      fmt::format("  exposed communication (the compute stream waiting, mean per rank of replica 0): tp {}  "
                  "sp {}  {}{}pp {} "
                  "(receives include the bubble)  dp {}",
                  at(parallel::Dim::Tp), at(parallel::Dim::Sp),
                  c.cp > 1 ? fmt::format("cp {}  ", at(parallel::Dim::Cp)) : "",
                  c.moe() ? fmt::format("ep {}  ", at(parallel::Dim::Ep)) : "", at(parallel::Dim::Pp),
                  at(parallel::Dim::Dp)));
  std::string parts;
  for (int d = 0; d < parallel::kDims; ++d) {
    if (f.mean.communicated_us[d] == 0) continue;
    const char* dim = parallel::kDimNames[d];
    parts += fmt::format("{}{} {} ({} hidden)", parts.empty() ? "" : "  ", dim,
                         human_time(st.communicated_comm_us.at(dim)), human_time(st.hidden_comm_us.at(dim)));
  }
  if (!parts.empty())
    r.print("  communicated (the operations' own time, mean per rank of replica 0): " + parts);
  if (mine.host_wait_us > 0) {
    r.print(fmt::format(
        "  waiting for the host: rank 0's compute stream stood idle {} ({:.1f}% of the step) until the "
        "host had launched its next kernel{}",
        human_time(mine.host_wait_us), 100 * mine.host_wait_us / step_us,
        mine.host_wait_us > 0.5 * step_us ? ": most of the step, which is host-bound" : ""));
  }
  if (c.moe() && c.capacity_factor > 0) {
    r.print(fmt::format(
        "  dropped over capacity (factor {}): {} of {} routes ({:.2f}%), passed on by the residual "
        "alone",
        c.capacity_factor, st.moe_dropped_routes, st.moe_routes,
        st.moe_routes > 0 ? 100.0 * st.moe_dropped_routes / st.moe_routes : 0.0));
  }
  r.print("  peak memory per stage, measured (planned):");
  each_shown_stage(r, c.pp, "    ", [&](int s) {
    const float peak_bytes = f.stage_peak_bytes[s];
    r.print(fmt::format(
        "    stage {:<3} {:>10} ({:>10}): weights {}, grads {}, optimizer {}, {}{}activations {}", s,
        format_bytes(peak_bytes), format_bytes(plans[s].total()), format_bytes(plans[s].weights),
        format_bytes(plans[s].grads), format_bytes(plans[s].optimizer),
        plans[s].fp8_weights > 0 ? fmt::format("fp8 weights {}, ", format_bytes(plans[s].fp8_weights)) : "",
        plans[s].fp8_scaling > 0 ? fmt::format("amax histories {}, ", format_bytes(plans[s].fp8_scaling))
                                 : "",
        format_bytes(peak_bytes - plans[s].held())));
  });
  if (!check.compares()) {
    r.print("phantom tensors hold no numbers: the comparison with one device was skipped");
    return;
  }
  const Tolerance tol = tolerance(c);
  const LargestFigures& d = f.most;
  const bool ok =
      d.grad_difference <= tol.grad && d.weight_difference <= tol.weight && d.loss_difference <= tol.loss;
  r.print(fmt::format(
      "equal to one device (double precision) after every step: {} (largest relative differences: "
      "gradients {:.2e}, weight updates {:.2e}, loss {:.2e}; tolerances for {}: {:.2g}, {:.2g}, {:.2g})",
      ok ? "yes" : "NO", d.grad_difference, d.weight_difference, d.loss_difference, tol.name, tol.grad,
      tol.weight, tol.loss));
}

}  // namespace ranklab::gpt
