// The real backend's own CUDA kernels: everything a lesson computes that is not a matrix product (cuBLAS
// does those). Each launches on the given stream and returns at once; sizes are element counts.
//
// Tensors travel as untyped pointers with their DType: each kernel is a template over the element type
// (float, __nv_bfloat16, __half), instantiated in kernels.cu, and computes in float32 whatever it stores.
// Plain declarations, so the C++ side of the backend needs no CUDA compiler: only the .cu files do
// (kernels.cu, fp8_kernels.cu; what they share is in kernel_common.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/glu.h"
#include "common/tensor.h"

namespace ranklab::kernels {

void fill(void* out, DType t, std::int64_t n, float value, cudaStream_t s);
void arange(float* out, std::int64_t n, float start, cudaStream_t s);
// The part [start, start + length) along one dimension of the seeded normal tensor that, seen as
// [outer, size, inner], has element e = std * normal_at(seed, e) (common/random.h, as the simulator).
// randn of a whole tensor is the slice outer = inner = 1, start = 0, length = size = numel.
void randn_slice(void* out, DType t, std::int64_t outer, std::int64_t size, std::int64_t inner,
                 std::int64_t start, std::int64_t length, std::uint64_t seed, float std, cudaStream_t s);
void relu(void* out, const void* x, DType t, std::int64_t n, cudaStream_t s);
void relu_backward(void* out, const void* grad_out, const void* x, DType t, std::int64_t n, cudaStream_t s);
void add(void* out, const void* a, const void* b, DType t, std::int64_t n, cudaStream_t s);
// dst += alpha src; src may have another dtype than dst.
void axpy(void* dst, DType dst_t, const void* src, DType src_t, float alpha, std::int64_t n, cudaStream_t s);
// dst = src converted to dst's dtype (round to nearest even).
void convert(void* dst, DType dst_t, const void* src, DType src_t, std::int64_t n, cudaStream_t s);
void scale(void* t, DType dt, float factor, std::int64_t n, cudaStream_t s);
void sgd_step(void* param, DType param_t, const void* grad, DType grad_t, float lr, std::int64_t n,
              cudaStream_t s);
// AdamW with the bias corrections 1 - beta^t computed by the caller. Float32 throughout.
void adamw_step(float* param, const float* grad, float* m, float* v, float lr, float beta1, float beta2,
                float eps, float weight_decay, float bias_correction1, float bias_correction2, std::int64_t n,
                cudaStream_t s);

// Scratch doubles sum() needs: one partial per block of the first pass.
constexpr int kSumBlocks = 256;
// The squared norm of several tensors: begin zeroes the double accumulator kept after the kSumBlocks
// partial sums of `scratch` (which has kSumBlocks + 1 doubles), add adds a tensor's squares, end stores it.
void squared_norm_begin(double* scratch, cudaStream_t s);
void squared_norm_add(double* scratch, const void* x, DType t, std::int64_t n, cudaStream_t s);
void squared_norm_end(float* out, const double* scratch, cudaStream_t s);
// out[0] = the sum of x[0..n), accumulated in double in a fixed order, so it is deterministic; out has
// x's dtype.
void sum(void* out, const void* x, DType t, std::int64_t n, double* scratch, cudaStream_t s);

// ---- transformer kernels (see common/rank.h for the layouts) -------------------------------------------

// x[r, c] += bias[c]; both of dtype t.
void add_bias(void* x, const void* bias, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s);
// out[c] = sum over rows of x[r, c], float32.
void sum_rows(float* out, const void* x, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s);
// y = (x - mean) rstd gamma + beta per row; gamma and beta have dtype param_t (the interface asks for
// x's dtype; the kernel reads any).
void layernorm(void* y, float* mean, float* rstd, const void* x, DType t, const void* gamma, const void* beta,
               DType param_t, std::int64_t rows, std::int64_t cols, float eps, cudaStream_t s);
void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy, const void* x, DType t,
                        const void* gamma, DType param_t, const float* mean, const float* rstd,
                        std::int64_t rows, std::int64_t cols, cudaStream_t s);
// y = x * rstd * gamma per row, rstd = 1 / sqrt(mean(x^2) + eps); gamma has x's dtype.
void rmsnorm(void* y, float* rstd, const void* x, DType t, const void* gamma, std::int64_t rows,
             std::int64_t cols, float eps, cudaStream_t s);
void rmsnorm_backward(void* dx, float* dgamma, const void* dy, const void* x, DType t, const void* gamma,
                      const float* rstd, std::int64_t rows, std::int64_t cols, cudaStream_t s);
// y[i] = silu(x[2i]) x[2i + 1] over n outputs, and its backward into dx (2n).
void swiglu(void* y, const void* x, DType t, std::int64_t n, const GluSpec& glu, cudaStream_t s);
void swiglu_backward(void* dx, const void* dy, const void* x, DType t, std::int64_t n, const GluSpec& glu,
                     cudaStream_t s);
void gelu(void* y, const void* x, DType t, std::int64_t n, cudaStream_t s);
void gelu_backward(void* dx, const void* dy, const void* x, DType t, std::int64_t n, cudaStream_t s);
// y = x * keep / (1 - p) over [rows, cols], keep = dropout_keeps(seed, global row of i, j, p): first_row + i
// for rows i below `split`, second_row + i - split from it on (Rank::DropoutRows).
void dropout(void* y, const void* x, DType t, std::int64_t rows, std::int64_t cols, float p,
             std::uint64_t seed, std::int64_t first_row, std::int64_t split, std::int64_t second_row,
             cudaStream_t s);

// The largest head_dim the attention kernels take.
constexpr int kMaxHeadDim = 512;
struct AttentionShape {
  std::int64_t seq = 0, batch = 0;
  int heads = 0, head_dim = 0;
  int kv_heads = 0;  // groups of heads / kv_heads query heads share a k and a v (common/rank.h)
  bool causal = false;
  // A causal sliding window (AttentionSpec::window): a query sees the keys whose position is above its own
  // minus `window`; 0: none.
  std::int64_t window = 0;
};
// `sinks`: null, or one logit per query head ([heads] of dtype sinks_t), each a key whose value is zero.
void attention(void* out, float* lse, const void* qkv, DType t, const void* sinks, DType sinks_t,
               const AttentionShape& a, cudaStream_t s);
// Rotary embeddings in place on qkv's q heads and each group's k (common/rank.h, Rank::rope_).
void rope(void* qkv, DType t, const AttentionShape& a, std::int64_t first_position, double base, bool inverse,
          cudaStream_t s);
// `delta` is float32 scratch of batch * heads * seq: each query's sum of d out * out.
void attention_backward(void* dqkv, float* delta, const void* dout, const void* qkv, const void* out,
                        const float* lse, DType t, const AttentionShape& a, cudaStream_t s);

// Context parallelism's attention blocks (Rank::key_values, add_key_values_, attention_block_ and its
// backward). A block takes qkv's queries [q_first, q_end) (qkv's shape is `a`) against the kv_seq keys of
// kv [kv_seq * batch, 2 * kv_heads * head_dim]; with `causal` query i sees key j when kv_position + j <=
// q_position + (i - q_first), and with a.window when the key's position is also within the query's window.
struct AttentionBlockShape {
  AttentionShape a;
  std::int64_t kv_seq = 0, q_first = 0, q_end = 0, q_position = 0, kv_position = 0;
  bool causal = false;
};
// Copies qkv's k and v columns into kv, or with `add` adds kv into them.
void key_values(void* qkv, void* kv, DType t, const AttentionShape& a, bool add, cudaStream_t s);
// Merges the block's attention into out (of dtype out_t) and lse (float32 [batch, heads, seq]).
void attention_block(void* out, DType out_t, float* lse, const void* qkv, const void* kv, DType t,
                     const AttentionBlockShape& k, cudaStream_t s);
// Adds the block's d q into dqkv's q columns and its d k, d v into dkv; dout and out are of dtype out_t;
// `delta` is float32 scratch of batch * heads * (q_end - q_first).
void attention_block_backward(void* dqkv, void* dkv, float* delta, const void* dout, const void* qkv,
                              const void* kv, const void* out, DType out_t, const float* lse, DType t,
                              const AttentionBlockShape& k, cudaStream_t s);
// Rank::attention_sinks_: merges each head's sink (sinks, [heads] of dtype sinks_t) into out (of dtype out_t,
// [seq * batch, heads * head_dim]) and lse (float32 [batch, heads, seq]) as a block of one key whose value
// is zero.
void attention_sinks(void* out, DType out_t, float* lse, const void* sinks, DType sinks_t, std::int64_t seq,
                     std::int64_t batch, int heads, std::int64_t head_dim, cudaStream_t s);
// Rank::attention_sinks_backward: dsinks (float32 [heads]) = -the sum over queries of e^(sink - lse) (dout .
// out); dout and out are of dtype out_t.
void attention_sinks_backward(float* dsinks, const void* dout, const void* out, DType out_t, const float* lse,
                              const void* sinks, DType sinks_t, std::int64_t seq, std::int64_t batch,
                              int heads, std::int64_t head_dim, cudaStream_t s);

void embedding(void* out, const float* ids, const void* table, DType t, std::int64_t rows, std::int64_t cols,
               std::int64_t shard_rows, std::int64_t vocab_start, cudaStream_t s);
void embedding_backward(float* dtable, const void* dy, DType t, const float* ids, std::int64_t rows,
                        std::int64_t cols, std::int64_t shard_rows, std::int64_t vocab_start, cudaStream_t s);

void row_max(float* out, const void* logits, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s);
void softmax_stats(float* out, const void* logits, DType t, const float* row_max, const float* targets,
                   std::int64_t rows, std::int64_t cols, std::int64_t vocab_start, cudaStream_t s);
void cross_entropy_loss(float* out, const float* row_max, const float* stats, std::int64_t rows,
                        cudaStream_t s);
void cross_entropy_backward(void* dlogits, const void* logits, DType t, const float* row_max,
                            const float* stats, const float* targets, std::int64_t rows, std::int64_t cols,
                            std::int64_t vocab_start, float scale, cudaStream_t s);

// ---- mixture-of-experts permutation (common/rank.h, Rank::gather_rows) ------------------------------------

// out[i, c] = x[index[i], c], times weights[i] unless weights is null, over n routes; a route whose index
// is not one of x's x_rows rows reads zeros.
void gather_rows(void* out, const void* x, DType t, const float* index, const float* weights, std::int64_t n,
                 std::int64_t x_rows, std::int64_t cols, cudaStream_t s);
// out[r, c] = the sum over k in [offsets[r], offsets[r + 1]) of src[routes[k], c], times weights[routes[k]]
// unless weights is null, in float32 in the order of k: the routes grouped by output row (a CSR of rows + 1
// offsets), which the caller builds. No atomics: the same sums on every run.
void scatter_add_rows(void* out, const void* src, DType t, const std::int64_t* offsets,
                      const std::int64_t* routes, const float* weights, std::int64_t rows, std::int64_t cols,
                      cudaStream_t s);
// out[i] = the sum over c of a[i, c] b[i, c], float32 (summed in double).
void row_dots(float* out, const void* a, const void* b, DType t, std::int64_t n, std::int64_t cols,
              cudaStream_t s);

// ---- FP8 (real/fp8_kernels.cu) ---------------------------------------------------------------------------
// An FP8 tensor's bytes are float8_code's (common/dtype_round.h); its scales say what they stand for. Per
// tensor: one float32 scale_inv (1 / scale) on the device. Per block of block_rows x block_cols over a
// [rows, cols] tensor, row-major over the blocks: a float32 1 / scale each, or with e8m0 one byte each, the
// exponent of 1 / scale biased by 127 (the OCP Microscaling formats' E8M0).
struct Fp8Blocks {
  int rows = 0, cols = 0;  // 0 x 0: per tensor
  bool e8m0 = false;
  bool per_tensor() const { return rows == 0; }
};
// x [rows, cols] quantized into `out`: per tensor with *scale (1 when null), writing 1 / scale into
// scale_inv and, when record_amax is given, raising it to x's largest magnitude (an atomic max); per block
// with each block's own scale, written into `scales`. As the simulator's quantize (sim/sim_rank_fp8.cc).
void fp8_quantize(std::uint8_t* out, const void* x, DType x_t, std::int64_t rows, std::int64_t cols,
                  DType format, const Fp8Blocks& blocks, const float* scale, float* scale_inv, void* scales,
                  float* record_amax, cudaStream_t s);
// out [rows, cols] float32 = the values an FP8 tensor's codes stand for. Its rows are rows first_row on of
// the tensor its scales cover (a view's), whose rows hold scale_row_blocks blocks each.
void fp8_dequantize(float* out, const std::uint8_t* codes, std::int64_t rows, std::int64_t cols, DType format,
                    const Fp8Blocks& blocks, const void* scales, std::int64_t first_row,
                    std::int64_t scale_row_blocks, cudaStream_t s);
// out [cols, rows] = in [rows, cols], one byte each: the k-major copy an FP8 GEMM reads.
void transpose_bytes(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows, std::int64_t cols,
                     cudaStream_t s);
// out [1] = the largest magnitude of x's n elements.
void amax(float* out, const void* x, DType t, std::int64_t n, cudaStream_t s);
// out [1] = largest / amax, or 1 where amax is 0 or not finite, at most the largest float.
void fp8_scale(float* out, const float* amax, float largest, cudaStream_t s);
// Delayed scaling's update of one tensor (Rank::fp8_delayed_update): `reduced` its amax of the pass,
// history [len] the earlier ones, newest first; `largest` is the format's divided by 2^margin.
void fp8_delayed_update(float* history, std::int64_t len, float* scale, float* amax, const float* reduced,
                        float largest, cudaStream_t s);

}  // namespace ranklab::kernels
