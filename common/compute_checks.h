// The argument checks of compute operations that both backends make the same way: shapes, dtypes and
// scalar arguments. (Whether a tensor is defined, belongs to the rank and, on GPUs, has device memory is
// each backend's own `require`, called first.) One function per operation, so a mistake reads the same on
// the simulator and on GPUs, as communication's check_comm_call does (common/comm_checks.h). Each raises
// UsageError "rank R: op: what is wrong".
#pragma once

#include <cstdint>
#include <vector>

#include "common/rank.h"
#include "common/tensor.h"

namespace ranklab {

// Rank::view: [offset, offset + shape.numel()) must lie within base's elements.
void check_view(int rank, const Tensor& base, std::int64_t offset, const Shape& shape);
// Rank::matmul (`op`) and the product's shape: a and b 2-D, of one dtype, their inner dimensions equal.
Shape check_matmul(int rank, const char* op, const Tensor& a, const Tensor& b, Trans ta, Trans tb);
// Rank::matmul_, or matmul_add_ when `accumulate`: the product's checks, and `out` of its shape and dtype
// (accumulating, float32 too), real unless a and b are phantoms.
void check_matmul_out(int rank, const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                      bool accumulate);
// Every kernel but matmul refuses an FP8 input (`arg` of `op`).
void check_float8_use(int rank, const char* op, const Tensor& t, const char* arg);
// Whether `op` takes FP8 tensors: matmul, copies, to_host, views, and the communication that moves values
// without adding them up.
bool takes_float8(const char* op);
void check_quantize(int rank, const Tensor& x, DType format, const Rank::Fp8Scaling& scaling,
                    const Tensor& scale, const Tensor& record_amax);
// Rank::fp8_delayed_update: one history, scale and amax per element of `reduced`, each float32 of its shape.
void check_fp8_delayed_update(int rank, const Tensor& reduced, const std::vector<Tensor>& histories,
                              const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes,
                              DType format, int margin);
void check_randn_slice(int rank, const Shape& full, int dim, std::int64_t start, std::int64_t length);
void check_layernorm(int rank, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps);
void check_layernorm_backward(int rank, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                              const Tensor& mean, const Tensor& rstd);
void check_gelu_backward(int rank, const Tensor& dy, const Tensor& x);
void check_rmsnorm(int rank, const Tensor& x, const Tensor& gamma, float eps);
void check_rmsnorm_backward(int rank, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                            const Tensor& rstd);
void check_swiglu(int rank, const Tensor& x);
void check_swiglu_backward(int rank, const Tensor& dy, const Tensor& x);
void check_dropout(int rank, const Tensor& x, float p, const Rank::DropoutRows& rows);

// The shape of an attention call, from qkv [seq * batch, (heads + 2 kv_heads) * head_dim].
struct AttentionDims {
  std::int64_t seq = 0, head_dim = 0;
};
// `op` is "attention", "attention_backward" or "rope_".
AttentionDims check_attention(int rank, const char* op, const Tensor& qkv, const AttentionSpec& spec);
// spec.sinks: defined, [heads], not FP8.
void check_sinks(int rank, const char* op, const AttentionSpec& spec);
// attention_sinks_ and its backward: the sinks, and out and lse of one attention's queries.
void check_attention_sinks(int rank, const char* op, const Tensor& out, const Tensor& lse,
                           const AttentionSpec& spec);
AttentionDims check_attention_backward(int rank, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                       const Tensor& lse, const AttentionSpec& spec);
// Context parallelism's kernels (Rank::key_values, add_key_values_, attention_block_ and its backward): kv
// [kv_seq * batch, 2 * groups * head_dim] of qkv's head_dim and dtype, the block's queries within qkv's.
AttentionDims check_key_values(int rank, const char* op, const Tensor& qkv, const Tensor& kv,
                               const AttentionSpec& spec);
// The block's query positions [first, end) of qkv's, checked with the accumulator (out, lse) of `op`; the
// spec must ask for the fused kernels, which are what context-parallel blocks run in.
struct BlockRange {
  std::int64_t first = 0, end = 0;
};
BlockRange check_attention_block(int rank, const char* op, const Tensor& qkv, const Tensor& kv,
                                 const Tensor& out, const Tensor& lse, const AttentionSpec& spec,
                                 const Rank::AttentionBlock& block);
AttentionDims check_rope(int rank, const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position,
                         double base);

// Mixture-of-experts permutation (Rank::gather_rows, scatter_add_rows, row_dots): x and src 2-D, index a
// float32 [n], weights (when defined) a float32 [n], src's rows index's length, rows not negative; a and b
// of one shape and dtype. No FP8 tensor (check_float8_use).
void check_gather_rows(int rank, const Tensor& x, const Tensor& index, const Tensor& weights);
void check_scatter_add_rows(int rank, const Tensor& src, const Tensor& index, const Tensor& weights,
                            std::int64_t rows);
void check_row_dots(int rank, const Tensor& a, const Tensor& b);
// The n values of a real index (on the host) as row numbers: each must be an integer in [0, rows); `what`
// says whose rows they are ("the rows of x"). The error names the position and the value.
std::vector<std::int64_t> check_route_rows(int rank, const char* op, const float* index, std::int64_t n,
                                           std::int64_t rows, const char* what);

void check_embedding(int rank, const Tensor& ids, const Tensor& table, std::int64_t vocab_start);
void check_embedding_backward(int rank, const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                              std::int64_t vocab_start);
void check_row_max(int rank, const Tensor& logits);
void check_softmax_stats(int rank, const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                         std::int64_t vocab_start);
void check_cross_entropy_loss(int rank, const Tensor& row_max, const Tensor& stats);
void check_cross_entropy_backward(int rank, const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                  const Tensor& targets, std::int64_t vocab_start);

}  // namespace ranklab
