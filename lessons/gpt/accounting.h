// What a GPT step costs: its FLOPs, and the memory of each pipeline stage, computed from the configuration
// before anything is allocated.
//
// FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM", section 5.1). A block's forward multiplies [tokens, h] by h x 3h, h x h, h x 4h and 4h x h
// (24 B s h^2 FLOPs for B sequences of s tokens) and does attention's two s x s products per head
// (4 B s^2 h); the output layer is 2 B s h V. Backward costs twice the forward. So per step
//
//     model FLOPs = 72 B s L h^2 (1 + s / (6 h) + V / (12 h L))
//
// which is 6 N tokens plus attention (N ~ 12 L h^2 + V h). Attention is counted whole (s^2), not causal
// (s^2 / 2), as the paper does. Hardware FLOPs add what recomputation runs again: a block's forward for
// --recompute full, the attention core (4 B s^2 h per layer) for selective. The llama block counts its
// own matrices the same way: per token and layer 2 h (a + 2 g) d for wqkv with a heads and g key-value
// heads of d features, 2 a d h for wo and 6 h f for SwiGLU's three, plus 4 s h of attention, and 2 h V for
// its output layer (the embedding is a lookup).
//
// Memory per rank: parameters at 2 + 4 bytes (16-bit copy, float32 master), float32 gradients, Adam's two
// float32 moments, each sharded as ZeRO says (parallel/zero.h); activations: what each micro-batch keeps
// for its backward (model.h, stash_bytes) times the most micro-batches the schedule keeps alive, the data,
// and the largest temporaries of one task. FP8 training (--fp8-recipe) adds the linear layers' FP8 weight
// copies (parallel/fp8.h), which a step makes and keeps, or with ZeRO 3 a block's at a time, and delayed
// scaling its amax histories and scales.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lessons/gpt/config.h"
#include "lessons/parallel/zero.h"

namespace ranklab::gpt {

struct Flops {
  double model = 0, hardware = 0;
};
// With experts, a MoE layer counts its router and the top-k experts each token computes with in place of the
// dense MLP (the model FLOPs of the active parameters, as MoE runs report MFU).
Flops step_flops(const Config& c);
// The same with every layer dense.
Flops dense_step_flops(const Config& c);

struct MemoryPlan {
  std::int64_t weights = 0, grads = 0, optimizer = 0, activations = 0;
  std::int64_t fp8_weights = 0;  // the linear layers' FP8 weight copies, made in a step and kept through it
  std::int64_t fp8_scaling = 0;  // delayed scaling's amax histories and scales, kept from the first step on
  std::int64_t stash = 0;        // activations kept for backward at the schedule's most
  std::int64_t transient = 0;    // the largest temporaries of one task (part of activations)
  int most_alive = 0;            // micro-batches alive at once on the chunk that keeps the most
  std::int64_t total() const { return weights + grads + optimizer + fp8_weights + fp8_scaling + activations; }
  // What the model allocates before its first step.
  std::int64_t fixed() const { return weights + grads + optimizer; }
  // What a step holds beyond its activations.
  std::int64_t held() const { return fixed() + fp8_weights + fp8_scaling; }
  // "optimizer state (Adam m, v) 12.0 GiB"
  std::string largest() const;
};
// The ZeRO settings of a configuration, all but the ranks and groups (which the run adds).
parallel::ZeroConfig zero_config(const Config& c);
// The same for the experts' weights: every rank holds its experts whole, and their gradients are reduced
// over the tp cp dp / ep ranks that hold the same experts.
parallel::ZeroConfig expert_zero_config(const Config& c);
// The plan of pipeline rank `stage` (every tp and dp rank of a stage holds the same).
MemoryPlan memory_plan(const Config& c, int stage);
// Its weights, gradients and optimizer state, its experts' included. They depend on the parameters and on
// how ZeRO shards them, not on the micro-batches, the recomputation or the order of the groups. The experts'
// part alone depends on the experts a rank holds and on the ranks that hold the same ones, not on tp.
parallel::DataParallel::Bytes state_bytes(const Config& c, int stage);
parallel::DataParallel::Bytes expert_state_bytes(const Config& c, int stage);
parallel::DataParallel::Bytes dense_state_bytes(const Config& c, int stage);
// The plan with the stage's state_bytes given: a planner that enumerates layouts differing only in what
// the state does not depend on computes them once.
MemoryPlan memory_plan(const Config& c, int stage, const parallel::DataParallel::Bytes& state);
// Every stage's plan, stage 0 first.
std::vector<MemoryPlan> memory_plans(const Config& c);
// OutOfMemoryError when the stage that needs the most does not fit a device of `capacity_bytes`: the
// message names the stage, what it needs, its largest part and what would make it fit (memory_advice).
void check_fits(const Config& c, const std::vector<MemoryPlan>& plans, std::int64_t capacity_bytes);

// What would make a plan that does not fit smaller, starting with its largest part.
std::string memory_advice(const Config& c, const MemoryPlan& p);

}  // namespace ranklab::gpt
