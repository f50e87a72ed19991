// The gated linear unit of the llama block's MLP and its experts (Rank::swiglu), in the forms published
// models use, and its derivative: one text for both backends.
//
//   y = act(gate) * (value + offset),  act(a) = a * sigmoid(alpha * a)
//
// with, when `limit` > 0, the gate clamped to at most `limit` and the value to [-limit, limit] first.
// SwiGLU (Shazeer 2020; Llama, Mixtral, Qwen, DeepSeek) is alpha 1 (SiLU), no clamp, no offset. gpt-oss
// (OpenAI 2025, its model code's swiglu) is alpha 1.702 (quick GELU, Hendrycks & Gimpel 2016), limit 7 and
// offset 1; Megatron-Core names them --quick-geglu, --activation-func-clamp-value and --glu-linear-offset.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace ranklab {

struct GluSpec {
  float alpha = 1;   // the gate's sigmoid slope: 1 SiLU, 1.702 quick GELU
  float limit = 0;   // > 0: the clamp of the gate (above) and of the value (both sides)
  float offset = 0;  // added to the (clamped) value
};

namespace glu {

RANKLAB_HD inline float sigmoid(float a) {
  return 1.0f / (1.0f + expf(-a));
}
RANKLAB_HD inline float gate_of(float a, const GluSpec& s) {
  return s.limit > 0 && a > s.limit ? s.limit : a;
}
RANKLAB_HD inline float value_of(float b, const GluSpec& s) {
  if (s.limit <= 0) return b;
  return b > s.limit ? s.limit : (b < -s.limit ? -s.limit : b);
}

// y for gate a and value b.
RANKLAB_HD inline float forward(float a, float b, const GluSpec& s) {
  const float g = gate_of(a, s);
  return g * sigmoid(s.alpha * g) * (value_of(b, s) + s.offset);
}

// d a and d b from d y. A clamped input passes no gradient where its clamp holds it (torch.clamp's
// backward: the gradient passes at the bound itself).
RANKLAB_HD inline void backward(float a, float b, float dy, const GluSpec& s, float* da, float* db) {
  const float g = gate_of(a, s), sg = sigmoid(s.alpha * g);
  const bool gate_free = !(s.limit > 0 && a > s.limit);
  const bool value_free = !(s.limit > 0 && (b > s.limit || b < -s.limit));
  // d act / d g = sigmoid(alpha g) (1 + alpha g (1 - sigmoid(alpha g))).
  *da = gate_free ? dy * (value_of(b, s) + s.offset) * sg * (1.0f + s.alpha * g * (1.0f - sg)) : 0.0f;
  *db = value_free ? dy * g * sg : 0.0f;
}

}  // namespace glu
}  // namespace ranklab
