// Shared by the gpt lesson's tests: its tiny model, and a run of it on a quiet simulator.
#pragma once

#include "common/lesson.h"
#include "common/options.h"
#include "common/report.h"
#include "sim_fixture.h"

namespace ranklab::testing {

// 4 layers, hidden 64, 4 heads, seq 16, vocab 128, global batch 8 in micro-batches of 2, 3 steps.
inline Settings tiny_gpt() {
  Settings o;
  o["layers"] = option_text(4);
  o["hidden"] = option_text(64);
  o["heads"] = option_text(4);
  o["seq"] = option_text(16);
  o["vocab"] = option_text(128);
  o["global-batch"] = option_text(8);
  o["micro-batch"] = option_text(2);
  o["steps"] = option_text(3);
  o["quiet"] = option_text(true);
  return o;
}

// The tiny model with the llama block: its 4 heads share 2 key-value heads, SwiGLU 96.
inline Settings tiny_llama() {
  Settings o = tiny_gpt();
  o["block"] = "llama";
  o["kv-heads"] = option_text(2);
  o["ffn-hidden"] = option_text(96);
  return o;
}

// The lesson's defaults on 4 ranks (dp 4) for `steps` steps: long enough to train the tiny model near its
// minimum, where gradients cancel while their roundings do not shrink.
inline Settings defaults_for_steps(int steps) {
  Settings o;
  o["world"] = option_text(4);
  o["steps"] = option_text(steps);
  o["quiet"] = option_text(true);
  return o;
}

// The gpt lesson with `o` as given (no --framework expansion) on a quiet simulator of `nodes` nodes.
inline RunReport run_gpt(const Settings& o, int nodes = 1) {
  SimBackend backend(quiet_config(nodes));
  return run_lesson(backend, "gpt", o);
}

}  // namespace ranklab::testing
