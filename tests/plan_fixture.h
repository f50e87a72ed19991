// Shared by the planner's tests: questions whose kernels take the compute model's shapes (not the launch
// overhead alone) and still simulate in milliseconds.
#pragma once

#include "common/options.h"
#include "plan/plan_command.h"

namespace ranklab::testing {

// The llama block with 512 features (8 heads, 4 key-value heads, SwiGLU 1408) over sequences of 512 tokens
// and a vocabulary of 4,096, on two dgx-h100 nodes.
inline plan::Request llama512_request(int layers, int global_batch) {
  plan::Request r;
  r.shape = {{"block", "llama"}, {"layers", option_text(layers)},
             {"hidden", "512"},  {"heads", "8"},
             {"kv-heads", "4"},  {"ffn-hidden", "1408"},
             {"seq", "512"},     {"global-batch", option_text(global_batch)},
             {"vocab", "4096"}};
  r.nodes = 2;
  return r;
}

// 16 of those layers on GPUs of 0.1 GiB, so that the layouts that fit run deep pipelines of up to 64
// micro-batches: ones the search probes before screening (plan/search.h, "Probing").
inline plan::Question deep_pipeline_question() {
  plan::Request r = llama512_request(16, 64);
  r.max_interleave = 1;
  plan::Question q = plan::make_question(r);
  q.profile.gpu.hbm_capacity_gib = 0.1;
  return q;
}

}  // namespace ranklab::testing
