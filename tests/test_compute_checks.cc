// The argument checks of compute operations both backends share (common/compute_checks.h), through the
// simulator: each bad call is a UsageError naming the rank, the operation and the argument.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/errors.h"
#include "common/rank.h"
#include "sim/sim_backend.h"
#include "tests/sim_fixture.h"

namespace ranklab {
namespace {

// The message of the UsageError rank 1 of 2 raises running `fn`.
std::string error_of(const std::function<void(Rank&)>& fn) {
  SimBackend backend(testing::quiet_config());
  try {
    backend.launch(2, [&](Rank& r) {
      if (r.rank() == 1) fn(r);
    });
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

#define EXPECT_ERROR(call, text)                                      \
  do {                                                                \
    const std::string msg = error_of([&](Rank& r) { (void)(call); }); \
    EXPECT_NE(msg.find(text), std::string::npos) << msg;              \
  } while (0)

TEST(ComputeChecks, RandnSlice) {
  EXPECT_ERROR(r.randn_slice({4, 6}, 2, 0, 1, 1, 1.0f, DType::Float32),
               "rank 1: randn_slice: dimension 2 is out of range for shape [4, 6]");
  EXPECT_ERROR(r.randn_slice({4, 6}, 1, 4, 3, 1, 1.0f, DType::Float32),
               "rank 1: randn_slice: [4, 7) is outside dimension 1 of shape [4, 6] (size 6)");
  EXPECT_ERROR(r.randn_slice({4, 6}, 0, -1, 1, 1, 1.0f, DType::Float32), "[-1, 0) is outside dimension 0");
}

TEST(ComputeChecks, Matmul) {
  EXPECT_ERROR(r.matmul(r.zeros({6}), r.zeros({6, 2})),
               "rank 1: matmul: needs 2-D tensors; got float32[6] and float32[6, 2]");
  EXPECT_ERROR(r.matmul(r.zeros({2, 3}), r.zeros({2, 3}), Trans::No, Trans::No),
               "rank 1: matmul: inner dimensions differ: float32[2, 3] @ float32[2, 3] (3 vs 2)");
  EXPECT_ERROR(r.matmul(r.zeros({2, 3}), r.zeros({3, 2}, DType::BFloat16)), "rank 1: matmul: dtypes differ");
}

TEST(ComputeChecks, MatmulInto) {
  EXPECT_ERROR(r.matmul_(r.zeros({2, 3}), r.zeros({2, 4}), r.zeros({4, 2}), Trans::No, Trans::No),
               "rank 1: matmul_: 'out' is float32[2, 3]; expected shape [2, 2] (the product)");
  EXPECT_ERROR(
      r.matmul_(r.zeros({2, 2}, DType::BFloat16), r.zeros({2, 4}), r.zeros({4, 2}), Trans::No, Trans::No),
      "rank 1: matmul_: 'out' is bfloat16[2, 2]; it must be float32");
  EXPECT_ERROR(r.matmul_(r.zeros({2, 2}), r.phantom({2, 4}), r.zeros({4, 2}), Trans::No, Trans::No),
               "rank 1: matmul_: writes phantom");
  EXPECT_ERROR(r.matmul_(r.zeros({2, 2}), r.zeros({2, 4}), r.zeros({3, 2}), Trans::No, Trans::No),
               "rank 1: matmul_: inner dimensions differ");
}

TEST(ComputeChecks, MatmulAdd) {
  EXPECT_ERROR(r.matmul_add_(r.zeros({2, 2}, DType::Float16), r.zeros({2, 4}, DType::BFloat16),
                             r.zeros({4, 2}, DType::BFloat16), Trans::No, Trans::No),
               "rank 1: matmul_add_: 'out' is float16[2, 2]; it must be bfloat16 or float32");
  EXPECT_ERROR(r.matmul_add_(r.zeros({3, 2}), r.zeros({2, 4}), r.zeros({4, 2}), Trans::No, Trans::No),
               "rank 1: matmul_add_: 'out' is float32[3, 2]; expected shape [2, 2] (the product)");
  EXPECT_ERROR(r.matmul_add_(r.zeros({2, 2}), r.zeros({2, 4}), r.phantom({4, 2}), Trans::No, Trans::No),
               "rank 1: matmul_add_: writes phantom");
}

TEST(ComputeChecks, Layernorm) {
  EXPECT_ERROR(r.layernorm(r.zeros({4}), r.zeros({4}), r.zeros({4}), 1e-5f),
               "rank 1: layernorm: 'x' must be 2-D [rows, cols]; got float32[4]");
  EXPECT_ERROR(r.layernorm(r.zeros({2, 4}), r.zeros({3}), r.zeros({4}), 1e-5f),
               "rank 1: layernorm: 'gamma' is float32[3]; expected shape [4] (the columns of x)");
  EXPECT_ERROR(r.layernorm(r.zeros({2, 4}), r.zeros({4}, DType::BFloat16), r.zeros({4}), 1e-5f),
               "rank 1: layernorm: dtypes differ: float32[2, 4] and bfloat16[4]");
  EXPECT_ERROR(r.layernorm(r.zeros({2, 4}), r.zeros({4}), r.zeros({4}), -1.0f),
               "rank 1: layernorm: eps must be >= 0; got -1");
}

TEST(ComputeChecks, LayernormBackward) {
  auto x = [](Rank& r) { return r.zeros({2, 4}); };
  EXPECT_ERROR(r.layernorm_backward(r.zeros({2, 3}), x(r), r.zeros({4}), r.zeros({2}), r.zeros({2})),
               "rank 1: layernorm_backward: 'dy' is float32[2, 3]; expected shape [2, 4] (the shape of x)");
  EXPECT_ERROR(r.layernorm_backward(x(r), x(r), r.zeros({4}), r.zeros({3}), r.zeros({2})),
               "'mean' is float32[3]; expected shape [2] (the rows of x)");
  EXPECT_ERROR(r.layernorm_backward(x(r), x(r), r.zeros({4}), r.zeros({2}), r.zeros({2}, DType::BFloat16)),
               "rank 1: layernorm_backward: 'rstd' is bfloat16[2]; it must be float32");
}

TEST(ComputeChecks, GeluBackward) {
  EXPECT_ERROR(r.gelu_backward(r.zeros({3}), r.zeros({4})),
               "rank 1: gelu_backward: 'dy' is float32[3]; expected shape [4] (the shape of x)");
  EXPECT_ERROR(r.gelu_backward(r.zeros({4}, DType::BFloat16), r.zeros({4})),
               "rank 1: gelu_backward: dtypes differ");
}

TEST(ComputeChecks, Dropout) {
  EXPECT_ERROR(r.dropout(r.zeros({4}), 0.1f, 1, 0),
               "rank 1: dropout: x must be [rows, cols]; got float32[4]");
  EXPECT_ERROR(r.dropout(r.zeros({2, 2}), 1.0f, 1, 0),
               "rank 1: dropout: p must be at least 0 and below 1; got 1");
  EXPECT_ERROR(r.dropout(r.zeros({2, 2}), 0.1f, 1, -3),
               "rank 1: dropout: first_row must not be negative; got -3");
}

TEST(ComputeChecks, Attention) {
  EXPECT_ERROR(
      r.attention(r.zeros({6, 10}), 2, 1, true),
      "rank 1: attention: qkv must be [seq * batch, (heads + 2 kv_heads) * head_dim]; got float32[6, 10] "
      "with batch 2, 1 heads and 1 key-value heads");
  EXPECT_ERROR(r.attention(r.zeros({6, 12}), 0, 1, true), "with batch 0, 1 heads");
  EXPECT_ERROR(r.attention(r.zeros({6, 12}), AttentionSpec{2, 4, 3, true}),
               "rank 1: attention: 4 heads cannot share 3 key-value heads");
  // Grouped: 4 heads sharing 2 kv heads take (4 + 2 * 2) head_dim columns.
  EXPECT_ERROR(r.attention(r.zeros({6, 12}), AttentionSpec{2, 4, 2, true}), "qkv must be");
  EXPECT_ERROR(r.rope_(r.zeros({6, 3}), AttentionSpec{2, 1, 1, true}, 0, 10000, false),
               "rank 1: rope_: head_dim 1 is odd");
  EXPECT_ERROR(r.rope_(r.zeros({6, 12}), AttentionSpec{2, 1, 1, true}, -1, 10000, false),
               "first_position must be >= 0");
  EXPECT_ERROR(r.rope_(r.zeros({6, 12}), AttentionSpec{2, 1, 1, true}, 0, 1.0, false), "base must be");
  EXPECT_ERROR(r.attention(r.zeros({6, 12}), 4, 1, true), "rank 1: attention: qkv must be");
  // qkv [seq 3 * batch 2, 2 heads * 3 * head_dim 2]: out is [6, 4], lse [2, 2, 3].
  EXPECT_ERROR(
      r.attention_backward(r.zeros({6, 4}), r.zeros({6, 12}), r.zeros({6, 5}), r.zeros({2, 2, 3}), 2, 2,
                           true),
      "rank 1: attention_backward: 'out' is float32[6, 5]; expected shape [6, 4] (attention's output");
  EXPECT_ERROR(r.attention_backward(r.zeros({6, 4}), r.zeros({6, 12}), r.zeros({6, 4}), r.zeros({2, 3, 2}), 2,
                                    2, true),
               "'lse' is float32[2, 3, 2]; expected shape [2, 2, 3] ([batch, heads, seq])");
  EXPECT_ERROR(r.attention_backward(r.zeros({6, 4}), r.zeros({6, 12}), r.zeros({6, 4}, DType::BFloat16),
                                    r.zeros({2, 2, 3}), 2, 2, true),
               "rank 1: attention_backward: dtypes differ");
}

TEST(ComputeChecks, RmsNormAndSwiGlu) {
  EXPECT_ERROR(r.rmsnorm(r.zeros({4, 6}), r.zeros({5}), 1e-5f),
               "rank 1: rmsnorm: 'gamma' is float32[5]; expected shape [6] (the columns of x)");
  EXPECT_ERROR(r.rmsnorm(r.zeros({4, 6}), r.zeros({6}), -1.0f), "rank 1: rmsnorm: eps must be >= 0");
  EXPECT_ERROR(r.rmsnorm_backward(r.zeros({4, 6}), r.zeros({4, 6}), r.zeros({6}), r.zeros({3})),
               "rank 1: rmsnorm_backward: 'rstd' is float32[3]; expected shape [4] (the rows of x)");
  EXPECT_ERROR(r.swiglu(r.zeros({4, 5})), "rank 1: swiglu: x is float32[4, 5]; its columns must be pairs");
  EXPECT_ERROR(r.swiglu_backward(r.zeros({4, 4}), r.zeros({4, 6})),
               "rank 1: swiglu_backward: 'dy' is float32[4, 4]; expected shape [4, 3]");
}

TEST(ComputeChecks, Embedding) {
  EXPECT_ERROR(r.embedding(r.zeros({2, 2}), r.zeros({8, 4}), 0),
               "rank 1: embedding: 'ids' must be 1-D [rows]; got float32[2, 2]");
  EXPECT_ERROR(r.embedding(r.zeros({2}), r.zeros({8}), 0),
               "rank 1: embedding: 'table' must be 2-D [vocab rows, dim]; got float32[8]");
  EXPECT_ERROR(r.embedding(r.zeros({2}), r.zeros({8, 4}), -3),
               "rank 1: embedding: vocab_start -3 is negative");
  EXPECT_ERROR(r.embedding(r.zeros({2}, DType::BFloat16), r.zeros({8, 4}), 0),
               "rank 1: embedding: 'ids' is bfloat16[2]; it must be float32");
  EXPECT_ERROR(r.embedding_backward_(r.zeros({8, 4}), r.zeros({2, 5}), r.zeros({2}), 0),
               "rank 1: embedding_backward_: 'dy' is float32[2, 5]; expected shape [2, 4] ([ids, columns of "
               "dtable])");
  EXPECT_ERROR(r.embedding_backward_(r.zeros({8, 4}, DType::BFloat16), r.zeros({2, 4}), r.zeros({2}), 0),
               "'dtable' is bfloat16[8, 4]; it must be float32");
}

TEST(ComputeChecks, CrossEntropy) {
  EXPECT_ERROR(r.row_max(r.zeros({4})),
               "rank 1: row_max: 'logits' must be 2-D [rows, vocab shard]; got float32[4]");
  EXPECT_ERROR(r.softmax_stats(r.zeros({2, 8}), r.zeros({3}), r.zeros({2}), 0),
               "rank 1: softmax_stats: 'row_max' is float32[3]; expected shape [2] (the rows of logits)");
  EXPECT_ERROR(r.softmax_stats(r.zeros({2, 8}), r.zeros({2}), r.zeros({2}), -1),
               "rank 1: softmax_stats: vocab_start -1 is negative");
  EXPECT_ERROR(r.cross_entropy_loss(r.zeros({2, 1}), r.zeros({2, 2})),
               "rank 1: cross_entropy_loss: 'row_max' must be 1-D [rows]; got float32[2, 1]");
  EXPECT_ERROR(r.cross_entropy_loss(r.zeros({2}), r.zeros({2, 3})),
               "'stats' is float32[2, 3]; expected shape [2, 2] ([rows of row_max, 2])");
  EXPECT_ERROR(
      r.cross_entropy_backward(r.zeros({2, 8}), r.zeros({2}), r.zeros({2, 2}), r.zeros({3}), 0, 1.0f),
      "rank 1: cross_entropy_backward: 'targets' is float32[3]; expected shape [2] (the rows of logits)");
  EXPECT_ERROR(r.cross_entropy_backward(r.zeros({2, 8}), r.zeros({2}, DType::BFloat16), r.zeros({2, 2}),
                                        r.zeros({2}), 0, 1.0f),
               "'row_max' is bfloat16[2]; it must be float32");
}

}  // namespace
}  // namespace ranklab
