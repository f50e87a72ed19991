// What SimRank's kernels share (sim/sim_rank_kernels.cc, sim/sim_rank_transformer.cc): views of a tensor's
// host buffer, rounding to a dtype, the cost model's byte counts and the kernels' names on the timeline.
// Internal to the simulator's SimRank; lessons never see it.
#pragma once

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/dtype_round.h"
#include "common/tensor.h"
#include "sim/storage.h"

namespace ranklab::sim::kernels {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ArrayMap = Eigen::Map<Eigen::ArrayXf>;

inline ArrayMap array(const Tensor& t) {
  return ArrayMap(sim_data(t), t.numel());
}

constexpr double kF = sizeof(float);  // bytes per element of a float32 tensor, for the cost model

inline double bytes_of(const Tensor& t) {
  return static_cast<double>(t.bytes());
}

// Rounds a real tensor's values to its dtype after a kernel wrote them (a no-op for float32).
inline void round_to_dtype(const Tensor& t) {
  if (t.phantom()) return;
  float* d = sim_data(t);
  const std::int64_t n = t.numel();
  if (t.dtype() == DType::BFloat16) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = round_to_bfloat16(d[i]);
  } else if (t.dtype() == DType::Float16) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = round_to_float16(d[i]);
  }
}

inline float round_value(float x, DType dtype) {
  switch (dtype) {
    case DType::BFloat16:
      return round_to_bfloat16(x);
    case DType::Float16:
      return round_to_float16(x);
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      // FP8 values are written by quantize alone, with their scale (SimRank::quantize); nothing else
      // writes an FP8 tensor (common/compute_checks.h).
    case DType::Float32:
      break;
  }
  return x;
}

// Kernel names for the timeline, made once: a phantom step launches millions of kernels.
inline const std::string kFill = "fill", kArange = "arange", kRandn = "randn", kCopyH2D = "copy_h2d",
                         kMatmul = "matmul", kMatmulAdd = "matmul_add_", kRelu = "relu",
                         kReluBackward = "relu_backward", kAdd = "add", kAddInPlace = "add_",
                         kScale = "scale_", kCopy = "copy", kCast = "cast", kSum = "sum",
                         kSquaredNorm = "squared_norm", kSlice = "slice", kCat = "cat", kSgd = "sgd_step",
                         kAdamw = "adamw_step", kFusedAdamw = "fused_adamw_step", kAddBias = "add_bias_",
                         kSumRows = "sum_rows", kLayernorm = "layernorm",
                         kLayernormBackward = "layernorm_backward", kGelu = "gelu",
                         kGeluBackward = "gelu_backward", kRmsnorm = "rmsnorm",
                         kRmsnormBackward = "rmsnorm_backward", kSwiglu = "swiglu",
                         kSwigluBackward = "swiglu_backward", kRope = "rope_", kDropout = "dropout",
                         kAttention = "attention", kAttentionBackward = "attention_backward",
                         kKeyValues = "key_values", kAddKeyValues = "add_key_values_",
                         kAttentionBlock = "attention_block_", kAttentionMerge = "attention_merge",
                         kAttentionBlockBackward = "attention_block_backward_",
                         kAttentionSinks = "attention_sinks_",
                         kAttentionSinksBackward = "attention_sinks_backward", kEmbedding = "embedding",
                         kEmbeddingBackward = "embedding_backward_", kRowMax = "row_max",
                         kSoftmaxStats = "softmax_stats", kCrossEntropyLoss = "cross_entropy_loss",
                         kCrossEntropyBackward = "cross_entropy_backward", kQuantize = "quantize",
                         kAmax = "amax", kFp8Scale = "fp8_scale", kFp8DelayedUpdate = "fp8_delayed_update",
                         kGatherRows = "gather_rows", kScatterAddRows = "scatter_add_rows",
                         kRowDots = "row_dots";

// One query's attention (FlashAttention's arithmetic, in float32) over `keys` keys whose k and v lie at
// k + j * stride and v + j * stride: writes the softmax-weighted sum of the v's to `out` and returns the
// log-sum-exp of the scores scaled by `scale`. `scores` holds at least `keys` floats. A finite `sink` is
// one more logit whose value is zero (AttentionSpec::sinks). Rank::attention and the context-parallel
// blocks share it.
inline float attend_query(const float* q, const float* k, const float* v, std::int64_t stride,
                          std::int64_t keys, std::int64_t head_dim, float scale, float* scores, float* out,
                          float sink = -std::numeric_limits<float>::infinity()) {
  float mx = sink;
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* kj = k + j * stride;
    float dot = 0;
    for (std::int64_t d = 0; d < head_dim; ++d) dot += q[d] * kj[d];
    scores[j] = dot * scale;
    mx = std::max(mx, scores[j]);
  }
  float l = std::isinf(sink) ? 0.0f : std::exp(sink - mx);
  for (std::int64_t j = 0; j < keys; ++j) l += std::exp(scores[j] - mx);
  const float lse = mx + std::log(l);
  for (std::int64_t d = 0; d < head_dim; ++d) out[d] = 0;
  for (std::int64_t j = 0; j < keys; ++j) {
    const float p = std::exp(scores[j] - lse);
    const float* vj = v + j * stride;
    for (std::int64_t d = 0; d < head_dim; ++d) out[d] += p * vj[d];
  }
  return lse;
}

// Its backward from the final `lse` and `delta` = dout . out (FlashAttention-2, Algorithm 2): adds the
// query's share into dq, and into each key's dk and dv (at dk + j * stride and dv + j * stride).
inline void attend_query_backward(const float* q, const float* k, const float* v, float* dk, float* dv,
                                  std::int64_t stride, std::int64_t keys, std::int64_t head_dim, float scale,
                                  const float* dout, float lse, float delta, float* dq) {
  for (std::int64_t j = 0; j < keys; ++j) {
    const float *kj = k + j * stride, *vj = v + j * stride;
    float *dkj = dk + j * stride, *dvj = dv + j * stride;
    float dot = 0, dp = 0;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      dot += q[d] * kj[d];
      dp += dout[d] * vj[d];
    }
    const float p = std::exp(dot * scale - lse);
    const float ds = p * (dp - delta) * scale;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      dvj[d] += p * dout[d];
      dq[d] += ds * kj[d];
      dkj[d] += ds * q[d];
    }
  }
}

// Splits a shape around `dim` into [outer, dim, inner] so slicing and concatenation are block copies.
inline void split_at(const Shape& s, int dim, std::int64_t& outer, std::int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < dim; ++i) outer *= s[i];
  for (int i = dim + 1; i < s.ndim(); ++i) inner *= s[i];
}

}  // namespace ranklab::sim::kernels
