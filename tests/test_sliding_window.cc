// Sliding-window attention and attention sinks (AttentionSpec::window, AttentionSpec::sinks): the kernels
// against a float64 softmax written out here, context parallelism's blocks and the sinks' merge against
// the whole attention, the time of a windowed attention by its pairs, and the gpt lesson's llama block with
// gpt-oss's alternating windows and sinks trained equal to one device on every layout.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/random.h"
#include "gpt_fixture.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "sim/compute_model.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::expect_usage_error;
using testing::run_collect;
using testing::run_error_message;
using testing::run_gpt;
using Values = std::vector<float>;

Values random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  Values v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * normal_at(seed, i);
  return v;
}

// The shapes of one call: seq positions of `batch` samples, `heads` query heads over `groups` key-value
// heads of hd features, a window (0: none) and sinks or not.
struct Case {
  int seq, batch, heads, groups, hd, window;
  bool sinks;
  int rows() const { return seq * batch; }
  int width() const { return (heads + 2 * groups) * hd; }
  int out_width() const { return heads * hd; }
  AttentionSpec spec(const Tensor& sinks_tensor) const {
    AttentionSpec s{batch, heads, groups, true};
    s.window = window;
    if (sinks) s.sinks = sinks_tensor;
    return s;
  }
};

struct Result {
  Values out, lse, dqkv, dsinks;
};

// Causal attention with the window and the sinks in float64, and its gradients by the softmax's Jacobian:
// ds_j = p_j (dp_j - sum_k p_k dp_k), d sink = -p_sink sum_k p_k dp_k.
Result float64_attention(const Case& c, const Values& qkv, const Values& dout, const Values& sinks) {
  Result r;
  r.out.assign(c.rows() * c.out_width(), 0);
  r.lse.assign(c.batch * c.heads * c.seq, 0);
  r.dqkv.assign(qkv.size(), 0);
  r.dsinks.assign(c.heads, 0);
  const int per = c.heads / c.groups;
  auto at = [&](int pos, int b, int head, int part) {  // qkv's column of head's q (0), or its group's k, v
    const int g = head / per, first = g * (per + 2);
    const int col = (part == 0 ? first + head % per : first + per + part - 1) * c.hd;
    return (pos * c.batch + b) * c.width() + col;
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      for (int i = 0; i < c.seq; ++i) {
        const int lo = c.window > 0 ? std::max(0, i - c.window + 1) : 0;
        std::vector<double> p(i + 1, 0.0);
        double mx = c.sinks ? sinks[h] : -1e300;
        for (int j = lo; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < c.hd; ++d) s += double{qkv[at(i, b, h, 0) + d]} * qkv[at(j, b, h, 1) + d];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = c.sinks ? std::exp(sinks[h] - mx) : 0.0;
        for (int j = lo; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int j = lo; j <= i; ++j) p[j] /= sum;
        const double p_sink = c.sinks ? std::exp(sinks[h] - mx) / sum : 0.0;
        r.lse[(b * c.heads + h) * c.seq + i] = static_cast<float>(mx + std::log(sum));
        const int o = (i * c.batch + b) * c.out_width() + h * c.hd;
        std::vector<double> dp(i + 1, 0.0);
        double dot = 0;
        for (int j = lo; j <= i; ++j) {
          for (int d = 0; d < c.hd; ++d) {
            r.out[o + d] += static_cast<float>(p[j] * qkv[at(j, b, h, 2) + d]);
            dp[j] += double{dout[o + d]} * qkv[at(j, b, h, 2) + d];
            r.dqkv[at(j, b, h, 2) + d] += static_cast<float>(p[j] * dout[o + d]);
          }
          dot += p[j] * dp[j];
        }
        r.dsinks[h] += static_cast<float>(-p_sink * dot);
        for (int j = lo; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (int d = 0; d < c.hd; ++d) {
            r.dqkv[at(i, b, h, 0) + d] += static_cast<float>(ds * qkv[at(j, b, h, 1) + d]);
            r.dqkv[at(j, b, h, 1) + d] += static_cast<float>(ds * qkv[at(i, b, h, 0) + d]);
          }
        }
      }
    }
  }
  return r;
}

struct Inputs {
  Values qkv, dout, sinks;
};
Inputs inputs(const Case& c) {
  return {random_values(c.rows() * c.width(), 80), random_values(c.rows() * c.out_width(), 81),
          random_values(c.heads, 82, 2.0f)};
}

// Rank::attention, its backward and the sinks' gradient on the simulator.
Result simulated(const Case& c, const Inputs& in) {
  return run_collect<Result>(1, [&](Rank& r) {
    Tensor x = r.from_host({c.rows(), c.width()}, in.qkv),
           dout = r.from_host({c.rows(), c.out_width()}, in.dout);
    const AttentionSpec spec = c.spec(r.from_host({c.heads}, in.sinks));
    Rank::AttentionOut o = r.attention(x, spec);
    Tensor dqkv = r.attention_backward(dout, x, o.out, o.lse, spec);
    Result res{r.to_host(o.out), r.to_host(o.lse), r.to_host(dqkv), {}};
    if (c.sinks) res.dsinks = r.to_host(r.attention_sinks_backward(dout, o.out, o.lse, spec));
    return res;
  })[0];
}

void expect_near_all(const Values& got, const Values& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " at " << i;
}

TEST(SlidingWindow, AttentionEqualsAFloat64SoftmaxOverTheWindowAndTheSinks) {
  for (const Case& c : {Case{9, 2, 4, 2, 4, 3, false}, Case{9, 2, 4, 2, 4, 0, true},
                        Case{8, 1, 2, 1, 6, 4, true}, Case{6, 1, 2, 2, 4, 1, true}}) {
    const Inputs in = inputs(c);
    const Result want = float64_attention(c, in.qkv, in.dout, in.sinks), got = simulated(c, in);
    const std::string what = fmt::format("seq {} window {} sinks {}", c.seq, c.window, c.sinks);
    expect_near_all(got.out, want.out, 2e-6, "out, " + what);
    expect_near_all(got.lse, want.lse, 2e-6, "lse, " + what);
    expect_near_all(got.dqkv, want.dqkv, 1e-5, "dqkv, " + what);
    if (c.sinks) expect_near_all(got.dsinks, want.dsinks, 1e-5, "dsinks, " + what);
  }
}

// The window changes the numbers: against the same inputs without it, some output differs.
TEST(SlidingWindow, AWindowShorterThanTheSequenceMasksEarlierKeys) {
  Case c{9, 1, 2, 1, 4, 3, false};
  const Inputs in = inputs(c);
  const Values windowed = simulated(c, in).out;
  c.window = 0;
  const Values whole = simulated(c, in).out;
  // The first `window` positions see the same keys either way; later ones do not.
  const int out_w = c.out_width();
  for (int i = 0; i < 3 * out_w; ++i) EXPECT_NEAR(windowed[i], whole[i], 1e-6) << i;
  double most = 0;
  for (int i = 3 * out_w; i < c.rows() * out_w; ++i)
    most = std::max(most, double{std::fabs(windowed[i] - whole[i])});
  EXPECT_GT(most, 1e-2);
}

// Runs of keys as context parallelism's blocks at their positions, under the window and without sinks,
// merged, and the sinks merged once after them: the whole attention's out, lse, d qkv and d sinks.
TEST(SlidingWindow, BlocksAtTheirPositionsAndTheSinksMergeToTheWholeAttention) {
  const Case c{12, 2, 4, 2, 4, 5, true};
  const Inputs in = inputs(c);
  const int run = 4, runs = c.seq / run;
  auto got = run_collect<std::vector<Result>>(1, [&](Rank& r) {
    Tensor x = r.from_host({c.rows(), c.width()}, in.qkv),
           dout = r.from_host({c.rows(), c.out_width()}, in.dout);
    const AttentionSpec spec = c.spec(r.from_host({c.heads}, in.sinks));
    AttentionSpec blocks = spec;
    blocks.sinks = Tensor();
    Rank::AttentionOut whole = r.attention(x, spec);
    Tensor dwhole = r.attention_backward(dout, x, whole.out, whole.lse, spec);
    Tensor kv = r.key_values(x, spec);
    const std::int64_t kv_w = kv.size(1);
    Rank::AttentionOut acc{
        r.zeros({c.rows(), c.out_width()}, DType::Float32),
        r.full({c.batch, c.heads, c.seq}, -std::numeric_limits<float>::infinity(), DType::Float32)};
    // Every pair of a run of queries and a run of keys, the queries at or after the keys: with a window of
    // 5, the queries of run 2 see none of run 0's keys but where their window reaches.
    std::vector<std::pair<int, int>> pairs;
    for (int q = 0; q < runs; ++q)
      for (int k = 0; k <= q; ++k) pairs.emplace_back(q, k);
    auto block_of = [&](int q, int k) { return Rank::AttentionBlock{q * run, run, true, q * run, k * run}; };
    auto keys = [&](const Tensor& t, int k) {
      return r.view(t, k * run * c.batch * kv_w, {run * c.batch, kv_w});
    };
    for (auto [q, k] : pairs) r.attention_block_(acc, x, keys(kv, k), blocks, block_of(q, k));
    r.attention_sinks_(acc, spec);
    Tensor dqkv = r.zeros({c.rows(), c.width()}, DType::Float32);
    Tensor dkv = r.zeros(kv.shape(), DType::Float32);
    for (auto [q, k] : pairs) {
      r.attention_block_backward_(dqkv, keys(dkv, k), dout, x, keys(kv, k), whole.out, whole.lse, blocks,
                                  block_of(q, k));
    }
    r.add_key_values_(dqkv, dkv, spec);
    Tensor dsinks = r.attention_sinks_backward(dout, whole.out, whole.lse, spec);
    Tensor dsinks_merged = r.attention_sinks_backward(dout, acc.out, acc.lse, spec);
    return std::vector<Result>{
        {r.to_host(acc.out), r.to_host(acc.lse), r.to_host(dqkv), r.to_host(dsinks_merged)},
        {r.to_host(whole.out), r.to_host(whole.lse), r.to_host(dwhole), r.to_host(dsinks)}};
  })[0];
  expect_near_all(got[0].out, got[1].out, 2e-6, "out");
  expect_near_all(got[0].lse, got[1].lse, 2e-6, "lse");
  expect_near_all(got[0].dqkv, got[1].dqkv, 1e-5, "dqkv");
  expect_near_all(got[0].dsinks, got[1].dsinks, 1e-5, "dsinks");
}

// A windowed query does 4 d flops per head for each key of its window: the pairs are counted exactly.
TEST(SlidingWindow, TheKernelIsChargedForTheWindowsPairs) {
  sim::AttentionShape a{1, 8, 1, 64, true, 0.0f, 1};
  a.window = 3;
  EXPECT_EQ(a.pairs(), 1 + 2 + 6 * 3);
  a.window = 8;  // as long as the sequence: every earlier key, counted exactly
  EXPECT_EQ(a.pairs(), 36);
  // A block of 4 queries at positions 8..11 against keys at 0..3 (position 8 from key 0): with a window of
  // 6 the queries see keys 3, none, none, none.
  sim::AttentionShape b{1, 4, 1, 64, true, 0.0f, 1};
  b.kv_seq = 4;
  b.window = 6;
  b.first_query_position = 8;
  EXPECT_EQ(b.pairs(), 1);
  // On the simulator, a long sequence's windowed attention takes at least its share of the causal one's
  // pairs (about window / (seq / 2)) of its time, and less than half: the share's math, at the lower
  // efficiency of a key loop as short as the window's.
  const Case big{4096, 1, 8, 8, 128, 512, false};
  auto time_us = [&](int window) {
    return run_collect<double>(1, [&](Rank& r) {
      Tensor x = r.phantom({big.rows(), big.width()}, DType::BFloat16);
      AttentionSpec spec{1, big.heads, big.groups, true};
      spec.window = window;
      r.synchronize();
      const double t0 = r.now();
      r.attention(x, spec);
      r.synchronize();
      return r.now() - t0;
    })[0];
  };
  sim::AttentionShape windowed{1, big.seq, big.heads, big.hd, true, 0.0f, big.groups}, causal = windowed;
  windowed.window = big.window;
  const double ratio = time_us(big.window) / time_us(0), share = windowed.pairs() / causal.pairs();
  EXPECT_NEAR(share, 0.234, 0.001);
  EXPECT_GT(ratio, share);
  EXPECT_LT(ratio, 2.5 * share);
}

TEST(SlidingWindow, BadSpecsAreRefusedNamingWhatIsWrong) {
  const Case c{8, 1, 2, 1, 4, 3, false};
  auto error = [&](const std::function<void(Rank&, Tensor&)>& fn) {
    return run_error_message(1, [&](Rank& r) {
      Tensor x = r.zeros({c.rows(), c.width()}, DType::Float32);
      fn(r, x);
    });
  };
  EXPECT_NE(error([&](Rank& r, Tensor& x) {
              AttentionSpec s{1, 2, 1, false};
              s.window = 3;
              r.attention(x, s);
            }).find("a sliding window of 3 keys needs causal attention"),
            std::string::npos);
  EXPECT_NE(error([&](Rank& r, Tensor& x) {
              AttentionSpec s{1, 2, 1, true, AttentionKernel::Unfused};
              s.window = 3;
              r.attention(x, s);
            }).find("sliding windows and sinks run in the fused attention kernels"),
            std::string::npos);
  EXPECT_NE(error([&](Rank& r, Tensor& x) {
              AttentionSpec s{1, 2, 1, true};
              s.sinks = r.zeros({3}, DType::Float32);
              r.attention(x, s);
            }).find("sinks"),
            std::string::npos);
  EXPECT_NE(error([&](Rank& r, Tensor& x) {
              AttentionSpec s{1, 2, 1, true};
              s.sinks = r.zeros({2}, DType::Float32);
              Rank::AttentionOut acc{r.zeros({c.rows(), c.out_width()}, DType::Float32),
                                     r.zeros({1, 2, c.seq}, DType::Float32)};
              r.attention_block_(acc, x, r.key_values(x, s), s, Rank::AttentionBlock{});
            }).find("a block takes no sinks"),
            std::string::npos);
  EXPECT_NE(error([&](Rank& r, Tensor& x) {
              AttentionSpec s{1, 2, 1, true};
              s.window = 3;
              Rank::AttentionOut acc{r.zeros({c.rows(), c.out_width()}, DType::Float32),
                                     r.zeros({1, 2, c.seq}, DType::Float32)};
              r.attention_block_(acc, x, r.key_values(x, s), s, Rank::AttentionBlock{});
            }).find("a block under a sliding window compares positions, so it must be causal"),
            std::string::npos);
}

// ---- the gpt lesson -----------------------------------------------------------------------------------

// The tiny llama model with gpt-oss's attention: a window of 5 keys in layers 0 and 2, every earlier key
// in layers 1 and 3, and sinks.
Settings tiny_gpt_oss() {
  Settings o = testing::tiny_llama();
  o["sliding-window"] = option_text(5);
  o["sliding-window-layers"] = "every:2";
  o["attention-sinks"] = option_text(true);
  return o;
}

using LayoutCase = std::tuple<std::string, Settings>;
class WindowAndSinksEqualOneDevice : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(WindowAndSinksEqualOneDevice, ThreeStepsOfAdamW) {
  Settings o = tiny_gpt_oss();
  for (const auto& [flag, value] : std::get<1>(GetParam())) o[flag] = value;
  const RunReport rep = run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  ASSERT_TRUE(rep.training);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, WindowAndSinksEqualOneDevice,
    ::testing::Values(LayoutCase{"one_rank_fp32", {{"world", "1"}, {"dtype", "fp32"}}},
                      LayoutCase{"tp2_sp_zero1",
                                 {{"world", "2"}, {"tp", "2"}, {"seq-parallel", "true"}, {"zero", "1"}}},
                      // The ring's blocks split into pairs of chunks at their positions: with 4 chunks of 4
                      // positions and a window of 5, chunk 3's queries skip chunk 1's keys.
                      LayoutCase{"cp2_p2p_pp2_selective",
                                 {{"world", "4"}, {"cp", "2"}, {"pp", "2"}, {"recompute", "selective"}}},
                      LayoutCase{"cp2_all_gather_fp32",
                                 {{"world", "2"}, {"cp", "2"}, {"cp-comm", "all-gather"}, {"dtype", "fp32"}}},
                      LayoutCase{"cp4_window3_zero3_full",
                                 {{"world", "4"},
                                  {"cp", "4"},
                                  {"sliding-window", "3"},
                                  {"sliding-window-layers", "all"},
                                  {"zero", "3"},
                                  {"recompute", "full"}}},
                      LayoutCase{"tp2_sp_cp2_pp2_zero1_8_ranks",
                                 {{"world", "8"},
                                  {"tp", "2"},
                                  {"seq-parallel", "true"},
                                  {"cp", "2"},
                                  {"pp", "2"},
                                  {"zero", "1"}}}),
    [](const ::testing::TestParamInfo<LayoutCase>& info) { return std::get<0>(info.param); });

// The sinks learn: a backward that leaves them where they started fails the check, naming them.
TEST(SlidingWindow, SinksLeftWhereTheyStartedFailTheCheck) {
  Settings o = tiny_gpt_oss();
  o["world"] = option_text(2);
  o["tp"] = option_text(2);
  o["break"] = "no-sinks-backward";
  const RunReport rep = run_gpt(o);
  EXPECT_FALSE(rep.all_checks_passed());
  EXPECT_NE(testing::failed_checks(rep).find("sinks"), std::string::npos) << testing::failed_checks(rep);
}

// A windowed layer counts its window's keys in the model's FLOPs, and the sinks one logit per head.
TEST(SlidingWindow, FlopsAndParametersCountTheWindowAndTheSinks) {
  gpt::Config c = gpt::resolve(gpt::options_table().read(tiny_gpt_oss(), "gpt"), 1);
  const double h = 64, a = 4, g = 2, d = 16, f = 96, L = 4, V = 128, tokens = 8 * 16;
  // Layers 0 and 2 see 5 keys, 1 and 3 all 16.
  const double linear = 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f);
  const double attention = 4 * a * d * (5 + 16 + 5 + 16);
  EXPECT_DOUBLE_EQ(gpt::step_flops(c).model, 3 * tokens * (L * linear + attention + 2 * h * V));
  Settings plain = tiny_gpt_oss();
  plain.erase("attention-sinks");
  const gpt::Config p = gpt::resolve(gpt::options_table().read(plain, "gpt"), 1);
  EXPECT_EQ(gpt::parameter_count(c) - gpt::parameter_count(p), 4 * 4);  // 4 layers of 4 heads
  EXPECT_NE(c.shape().find("sinks, window 5 in layers every:2"), std::string::npos) << c.shape();
}

TEST(SlidingWindow, BadFlagsNameTheFlag) {
  Settings o = tiny_gpt_oss();
  o["block"] = "gpt";
  o.erase("kv-heads");
  o.erase("ffn-hidden");
  expect_usage_error(o, "--attention-sinks: the gpt block's attention has no sinks");
  // One flag changed from the tiny gpt-oss model, and what the error must say.
  struct Case {
    std::string flag, value, says;
  };
  for (const Case& k :
       {Case{"sliding-window-layers", "every:0", "--sliding-window-layers every:N needs N of 1"},
        Case{"sliding-window-layers", "from:9", "--sliding-window-layers from:9 windows none"},
        Case{"sliding-window-layers", "odd", "--sliding-window-layers odd: give all, every:N"},
        Case{"attention", "unfused", "--sliding-window runs in the fused attention kernels"},
        Case{"sliding-window", "-1", "--sliding-window"}}) {
    o = tiny_gpt_oss();
    o[k.flag] = k.value;
    expect_usage_error(o, k.says);
  }
}

}  // namespace
}  // namespace ranklab
