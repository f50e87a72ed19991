// TrainingStats: what a training lesson measured over one step, as the run report's `training` object
// carries it. The lesson computes it (it alone knows the model's FLOPs and its parallel layout) and hands
// it to Rank::report_training; both backends put it in the report unchanged.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace ranklab {

struct TrainingStats {
  std::string model;   // "gpt3-175b" or "custom"
  std::string layout;  // "tp 8 (seq-parallel) x pp 8 (interleave 2) x dp 24, zero 1, recompute none"
  std::int64_t tokens_per_step = 0;
  int micro_batches = 0;  // per pipeline, per step
  double step_time_us = 0;
  // Model FLOPs per step: what the model needs (6 N tokens plus attention), whatever the run recomputes.
  double model_flops = 0;
  // Hardware FLOPs per step: what the GPUs execute, recomputation included.
  double hardware_flops = 0;
  double model_tflops_per_gpu = 0;
  double hardware_tflops_per_gpu = 0;
  double mfu = 0;  // model FLOP/s per GPU over the dtype's dense peak
  // Measured: the pipeline's idle time over its compute time (mean over ranks), the quantity that
  // (p - 1) / (v m) predicts (the idle time of 1F1B is (p - 1) micro-batch times against m of work).
  double bubble_fraction = 0;
  double bubble_fraction_formula = 0;  // (p - 1) / (v m)
  // Communication the compute stream waited for, per parallel dimension ("tp", "sp", "cp", "pp", "dp", "ep").
  std::map<std::string, double> exposed_comm_us;
  // Per dimension: the time its operations took on their streams, and of it what the compute stream did
  // not wait for (communicated - exposed, where positive).
  std::map<std::string, double> communicated_comm_us;
  std::map<std::string, double> hidden_comm_us;
  // Peak memory of the rank that reports, and its parts at that peak.
  std::int64_t peak_memory_bytes = 0;
  std::int64_t weights_bytes = 0;
  std::int64_t grads_bytes = 0;
  std::int64_t optimizer_bytes = 0;
  std::int64_t activations_bytes = 0;
  // A mixture of experts: the routes every rank's MoE layers made in the step, and of them those dropped
  // over their expert's capacity (summed over the ranks in float32: exact up to 2^24); 0 for a dense model.
  std::int64_t moe_routes = 0;
  std::int64_t moe_dropped_routes = 0;
};

// One forward or backward of a pipeline schedule, as its rank's compute stream ran it in the step the
// lesson timed, on the run's clock (the report's timeline). Each stage's rank hands its own to
// Rank::report_pipeline, so the report draws the schedule from data, not from region names: which rank is
// which stage, and when each micro-batch ran where.
struct PipelineTask {
  int rank = 0;         // the global rank that ran it
  int stage = 0;        // its pipeline stage, 0 .. p-1
  int chunk = 0;        // the model chunk of that stage, 0 .. v-1 (0 without interleaving)
  int micro_batch = 0;  // 0 .. m-1
  bool forward = true;
  double start_us = 0;
  double end_us = 0;
};

}  // namespace ranklab
