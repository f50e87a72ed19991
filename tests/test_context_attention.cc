// Context parallelism's attention kernels (Rank::key_values, add_key_values_, attention_block_ and its
// backward) against the one-call attention they split: blocks of keys merged by their log-sum-exps give
// attention's out and lse, and their backward with the final out and lse gives its d qkv.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/random.h"
#include "sim/compute_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::quiet_config;
using testing::run_collect;
using testing::run_error_message;
using Values = std::vector<float>;

Values random_values(std::size_t n, std::uint64_t seed) {
  Values v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = normal_at(seed, i);
  return v;
}

void expect_near_all(const Values& got, const Values& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " at " << i;
}

struct Case {
  int seq, batch, heads, groups, hd;
  bool causal;
};

// Splits qkv's keys into `pieces` runs of positions and runs one block per run, in the order `order`;
// returns out, lse and d qkv (k and v added back from each run's dkv), and the same from attention.
struct Result {
  Values out, lse, dqkv;
};
std::vector<Result> blocks_and_whole(const Case& c, int pieces, const std::vector<int>& order) {
  const int rows = c.seq * c.batch, width = (c.heads + 2 * c.groups) * c.hd, out_w = c.heads * c.hd;
  const Values qkv = random_values(rows * width, 70), w = random_values(rows * out_w, 71);
  const AttentionSpec spec{c.batch, c.heads, c.groups, c.causal};
  return run_collect<std::vector<Result>>(1, [&](Rank& r) {
    Tensor x = r.from_host({rows, width}, qkv), dout = r.from_host({rows, out_w}, w);
    Rank::AttentionOut whole = r.attention(x, spec);
    Tensor dwhole = r.attention_backward(dout, x, whole.out, whole.lse, spec);
    Tensor kv = r.key_values(x, spec);
    const std::int64_t run = c.seq / pieces, kv_w = kv.size(1);
    Rank::AttentionOut acc{
        r.zeros({rows, out_w}, DType::Float32),
        r.full({c.batch, c.heads, c.seq}, -std::numeric_limits<float>::infinity(), DType::Float32)};
    std::vector<Tensor> parts;
    for (int p = 0; p < pieces; ++p)
      parts.push_back(r.view(kv, p * run * c.batch * kv_w, {run * c.batch, kv_w}));
    auto block_of = [&](int p) {
      Rank::AttentionBlock b;
      b.causal = c.causal;
      b.kv_position = p * run;
      return b;
    };
    for (int p : order) r.attention_block_(acc, x, parts[p], spec, block_of(p));
    Tensor dqkv = r.zeros({rows, width}, DType::Float32);
    for (int p : order) {
      Tensor dkv = r.zeros({run * c.batch, kv_w}, DType::Float32);
      r.attention_block_backward_(dqkv, dkv, dout, x, parts[p], whole.out, whole.lse, spec, block_of(p));
      // The run's keys are rows [p run batch, (p + 1) run batch) of qkv.
      r.add_key_values_(r.view(dqkv, p * run * c.batch * width, {run * c.batch, width}), dkv, spec);
    }
    return std::vector<Result>{{r.to_host(acc.out), r.to_host(acc.lse), r.to_host(dqkv)},
                               {r.to_host(whole.out), r.to_host(whole.lse), r.to_host(dwhole)}};
  })[0];
}

TEST(ContextAttention, BlocksOfKeysMergeToAttentionInAnyOrder) {
  for (const Case& c : {Case{8, 2, 4, 2, 4, true}, Case{6, 1, 2, 2, 4, false}, Case{8, 1, 4, 1, 2, true}}) {
    for (const std::vector<int>& order : {std::vector<int>{0, 1}, {1, 0}}) {
      const std::vector<Result> got = blocks_and_whole(c, 2, order);
      const std::string what = fmt::format("seq {} batch {} heads {} groups {} causal {}, blocks {}", c.seq,
                                           c.batch, c.heads, c.groups, c.causal, fmt::join(order, " "));
      expect_near_all(got[0].out, got[1].out, 2e-6, "out " + what);
      expect_near_all(got[0].lse, got[1].lse, 2e-6, "lse " + what);
      expect_near_all(got[0].dqkv, got[1].dqkv, 1e-5, "dqkv " + what);
    }
  }
}

TEST(ContextAttention, FourRunsOfKeysMergeToAttention) {
  const std::vector<Result> got = blocks_and_whole(Case{8, 2, 2, 1, 4, true}, 4, {2, 0, 3, 1});
  expect_near_all(got[0].out, got[1].out, 2e-6, "out");
  expect_near_all(got[0].dqkv, got[1].dqkv, 1e-5, "dqkv");
}

// A block of queries at positions [q_position, ...) against the keys before and up to them (the all-gather
// form: a chunk of queries and the sequence's prefix) gives those queries' rows of attention.
TEST(ContextAttention, AQueryChunkAgainstItsPrefixGivesItsRows) {
  const int seq = 8, batch = 1, heads = 2, groups = 1, hd = 4, rows = seq * batch, width = (heads + 2) * hd;
  const Values qkv = random_values(rows * width, 72);
  const AttentionSpec spec{batch, heads, groups, true};
  auto got = run_collect<std::vector<Values>>(1, [&](Rank& r) {
    Tensor x = r.from_host({rows, width}, qkv);
    Rank::AttentionOut whole = r.attention(x, spec);
    Tensor kv = r.key_values(x, spec);
    Rank::AttentionOut acc{
        r.zeros({rows, heads * hd}, DType::Float32),
        r.full({batch, heads, seq}, -std::numeric_limits<float>::infinity(), DType::Float32)};
    Rank::AttentionBlock block;  // queries 4..5 see keys 0..5
    block.q_first = 4;
    block.q_count = 2;
    block.causal = true;
    block.q_position = 4;
    r.attention_block_(acc, x, r.view(kv, 0, {6 * batch, kv.size(1)}), spec, block);
    return std::vector<Values>{r.to_host(acc.out), r.to_host(whole.out)};
  })[0];
  for (int i = 0; i < rows * heads * hd; ++i) {
    const int row = i / (heads * hd);
    if (row == 4 || row == 5) {
      EXPECT_NEAR(got[0][i], got[1][i], 2e-6) << i;
    } else {
      EXPECT_EQ(got[0][i], 0.0f) << "row " << row << " is not the block's";
    }
  }
}

TEST(ContextAttention, APhantomBlockTakesTheFusedKernelOfItsShapeAndTheMerge) {
  const std::int64_t seq = 4096, batch = 1, heads = 8, groups = 1, hd = 128;
  const std::int64_t width = (heads + 2 * groups) * hd;
  auto got = run_collect<std::vector<double>>(1, [&](Rank& r) {
    Tensor qkv = r.phantom({seq * batch, width}, DType::BFloat16);
    Tensor kv = r.phantom({seq / 2 * batch, 2 * groups * hd}, DType::BFloat16);
    Rank::AttentionOut acc{r.phantom({seq * batch, heads * hd}, DType::Float32),
                           r.phantom({batch, heads, seq}, DType::Float32)};
    r.synchronize();
    Event a = r.record_event();
    r.attention_block_(acc, qkv, kv, AttentionSpec{batch, static_cast<int>(heads), static_cast<int>(groups)},
                       Rank::AttentionBlock{});
    Event b = r.record_event();
    return std::vector<double>{r.elapsed_us(a, b)};
  })[0];
  const sim::ComputeModel model(quiet_config().profile.gpu);
  sim::AttentionShape shape{batch, seq, heads, hd, false, 0, groups};
  shape.kv_seq = seq / 2;
  const double attention_us = model.attention_us(shape, AttentionKernel::Flash, false, DType::BFloat16);
  // Against the square causal call, a non-causal block of half the keys has the same pairs.
  EXPECT_NEAR(attention_us,
              model.attention_us(sim::AttentionShape{batch, seq, heads, hd, true, 0, groups},
                                 AttentionKernel::Flash, false, DType::BFloat16) *
                  model.flash_attention_efficiency(
                      sim::AttentionShape{batch, seq, heads, hd, true, 0, groups}, false) /
                  model.flash_attention_efficiency(shape, false),
              1e-9 * attention_us);
  const double merge_bytes =
      double(seq * batch * heads * hd) * (2 + 2 * 4) + 3.0 * 4 * double(seq * batch * heads);
  // One launch shows: the merge's is made while the block's kernel runs.
  EXPECT_DOUBLE_EQ(got[0], model.launch_us() + attention_us + model.memory_us(merge_bytes));
}

TEST(ContextAttention, KeysAndValuesOfAnotherWidthAreRefusedNamingTheShapes) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    const AttentionSpec spec{1, 2, 1, true};
    Tensor qkv = r.zeros({4, 16});  // head_dim 4: kv must be 8 wide
    Rank::AttentionOut acc{r.zeros({4, 8}), r.zeros({1, 2, 4})};
    r.attention_block_(acc, qkv, r.zeros({4, 6}), spec, Rank::AttentionBlock{});
  });
  EXPECT_NE(
      msg.find("rank 0: attention_block_: kv must be [kv_seq * batch, 2 * key-value heads * head_dim] = "
               "[kv_seq * 1, 8] for qkv float32[4, 16]; got float32[4, 6]"),
      std::string::npos)
      << msg;
}

TEST(ContextAttention, QueriesOutsideQkvAreRefused) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    const AttentionSpec spec{1, 2, 1, true};
    Rank::AttentionOut acc{r.zeros({4, 8}), r.zeros({1, 2, 4})};
    Rank::AttentionBlock block;
    block.q_first = 3;
    block.q_count = 2;
    r.attention_block_(acc, r.zeros({4, 16}), r.zeros({4, 8}), spec, block);
  });
  EXPECT_NE(msg.find("attention_block_: the block's queries [3, 5) are not within qkv's 4 positions"),
            std::string::npos)
      << msg;
}

TEST(ContextAttention, TheUnfusedPathIsRefusedForBlocks) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    const AttentionSpec spec{1, 2, 1, true, AttentionKernel::Unfused};
    Rank::AttentionOut acc{r.zeros({4, 8}), r.zeros({1, 2, 4})};
    r.attention_block_(acc, r.zeros({4, 16}), r.zeros({4, 8}), spec, Rank::AttentionBlock{});
  });
  EXPECT_NE(msg.find("rank 0: attention_block_: context-parallel blocks run in fused attention kernels"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace ranklab
