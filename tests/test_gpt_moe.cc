// The gpt lesson with mixtures of experts (--experts, --ep): the MoE layers train equal to one device with
// the experts split over 1, 2 and 4 ranks, top-1 and top-2, in both blocks, beside tp, sp, pp and every
// ZeRO stage; tokens sent to the wrong rank and a combine without its gates are caught; a phantom step
// times the all-to-alls as expert-parallel communication and holds the memory the plan says; and what
// cannot be split is refused naming the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "gpt_fixture.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/presets.h"
#include "lessons/parallel/expert_parallel.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

// The tiny model with 4 experts of width 32 in every layer, in float32: a route is a discrete choice, and
// at 16 bits a logit's rounding can swap two experts whose logits lie closer than it.
Settings with_experts(int world, int ep, int top_k) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(world);
  o["experts"] = option_text(4);
  o["top-k"] = option_text(top_k);
  o["moe-ffn-hidden"] = option_text(32);
  o["ep"] = option_text(ep);
  o["dtype"] = "fp32";
  return o;
}

// The llama block with grouped-query attention over tp 2 (sequence-parallel) x pp 2 x dp 2, `experts`
// experts over ep 4: the layout every MoE feature is also checked in.
Settings llama_across_tp_sp_pp(int experts) {
  Settings o = with_experts(8, 4, 2);
  o["experts"] = option_text(experts);
  o["block"] = "llama";
  o["kv-heads"] = option_text(2);
  o["tp"] = option_text(2);
  o["seq-parallel"] = option_text(true);
  o["pp"] = option_text(2);
  return o;
}

// The lesson with --model's preset expanded, as the command line expands it.
RunReport run_preset(const Settings& o) {
  return testing::run_gpt(resolve_settings(find_lesson("gpt"), o, /*lecture=*/false));
}

// Two of Mixtral 8x7B's layers on 8 ranks, a global batch of 8, one phantom step, and the flags in `more`.
Settings mixtral_phantom(const std::map<std::string, std::string>& more) {
  Settings o{
      {"model", "mixtral-8x7b"}, {"layers", "2"},  {"global-batch", "8"}, {"world", "8"}, {"steps", "1"},
      {"phantom", "true"},       {"quiet", "true"}};
  for (const auto& [k, v] : more) o[k] = v;
  return o;
}

// gpt-oss as its model card counts it: 116.83B and 20.91B parameters; 5.13B active in the 120B model, the
// card's count, which leaves out the input embedding (ranklab's counts it: 0.58B more). Two of the 120B
// model's layers, with every part of its block, run a phantom step on 8 GPUs with its experts over ep 8.
TEST(GptMoe, GptOssCountsAndRunsAsPublished) {
  const gpt::Config big = gpt::options_table().read(gpt::preset_settings("gpt-oss-120b"), "gpt");
  EXPECT_EQ(gpt::parameter_count(big), 116'829'156'672);
  EXPECT_EQ(gpt::active_parameter_count(big) - std::int64_t{201088} * 2880, 5'132'849'472);
  EXPECT_EQ(gpt::parameter_count(gpt::options_table().read(gpt::preset_settings("gpt-oss-20b"), "gpt")),
            20'914'757'184);
  EXPECT_EQ(big.sliding_window, 128);
  EXPECT_TRUE(big.attention_sinks && big.add_bias_linear && big.quick_geglu);
  const Settings o{{"model", "gpt-oss-120b"},
                   {"layers", "2"},
                   {"global-batch", "8"},
                   {"world", "8"},
                   {"ep", "8"},
                   {"steps", "1"},
                   {"phantom", "true"},
                   {"quiet", "true"}};
  const RunReport rep = run_preset(o);
  ASSERT_TRUE(rep.training);
  EXPECT_GT(rep.training->step_time_us, 0);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

TEST(GptMoe, ExpertsOverOneTwoAndFourRanksTrainEqualToOneDevice) {
  for (int ep : {1, 2, 4}) {
    for (int k : {1, 2}) {
      const RunReport rep = testing::run_gpt(with_experts(4, ep, k));
      EXPECT_TRUE(rep.all_checks_passed()) << "ep " << ep << " top-" << k << "\n"
                                           << testing::failed_checks(rep);
    }
  }
}

TEST(GptMoe, LlamaWithTpSpPpAndEpTogetherTrainsEqualToOneDevice) {
  for (int zero : {0, 1, 3}) {
    Settings o = llama_across_tp_sp_pp(8);
    o["zero"] = option_text(zero);
    const RunReport rep = testing::run_gpt(o);
    EXPECT_TRUE(rep.all_checks_passed()) << "zero " << zero << "\n" << testing::failed_checks(rep);
    ASSERT_TRUE(rep.training.has_value());
    EXPECT_NE(rep.training->layout.find("ep 4 (2 experts each)"), std::string::npos) << rep.training->layout;
  }
}

// Expert tensor parallelism: each expert split over etp 2 ranks, which gather what their ep groups received
// and reduce-scatter their partial outputs: with ep 2 and ep 1 on four ranks, and with the llama layout
// (etp 2 = tp, so the etp groups are the tp groups) with capacity drops and ZeRO 1. A dispatch to the wrong
// rank is still caught.
TEST(GptMoe, ExpertTensorParallelismTrainsEqualToOneDevice) {
  for (int ep : {1, 2}) {
    Settings o = with_experts(4, ep, 2);
    o["etp"] = option_text(2);
    const RunReport rep = testing::run_gpt(o);
    EXPECT_TRUE(rep.all_checks_passed()) << "ep " << ep << "\n" << testing::failed_checks(rep);
  }
  Settings o = llama_across_tp_sp_pp(4);
  o["ep"] = option_text(2);
  o["etp"] = option_text(2);
  o["zero"] = option_text(1);
  o["capacity-factor"] = "1.0";
  const RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  ASSERT_TRUE(rep.training.has_value());
  EXPECT_NE(rep.training->layout.find("ep 2 (2 experts each, split over etp 2)"), std::string::npos)
      << rep.training->layout;
  Settings wrong = with_experts(4, 2, 2);
  wrong["etp"] = option_text(2);
  wrong["break"] = "moe-wrong-expert-rank";
  EXPECT_FALSE(testing::run_gpt(wrong).all_checks_passed());
}

// Shared experts (DeepSeek's): a tensor-parallel SwiGLU MLP beside the routed ones.
TEST(GptMoe, SharedExpertsTrainEqualToOneDevice) {
  Settings o = llama_across_tp_sp_pp(8);
  o["zero"] = option_text(3);
  o["shared-experts"] = option_text(2);
  o["moe-layers"] = "from:1";
  const RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

// The parameter count's formula against the parameters the model makes, every stage's and every ep rank's
// experts: the gpt block, the llama block with shared experts, some layers MoE.
TEST(GptMoe, TheParameterCountIsTheModelsParameters) {
  auto config = [](gpt::Block block, int shared, const std::string& layers) {
    gpt::Config c;
    c.block = block, c.layers = 6, c.hidden = 64, c.heads = 4, c.vocab = 128, c.seq = 16;
    c.experts = 8, c.top_k = 2, c.moe_ffn_hidden = 48, c.shared_experts = shared, c.moe_layers = layers;
    c.pp = 2, c.ep = 4, c.world = 8;
    return gpt::resolve(c, 8);
  };
  for (const gpt::Config& c : {config(gpt::Block::Gpt, 0, "every:2"), config(gpt::Block::Llama, 2, "from:1"),
                               config(gpt::Block::Llama, 0, "all")}) {
    std::int64_t made = 0;
    for (int stage = 0; stage < c.pp; ++stage) {
      for (gpt::ParamId id : gpt::backward_order(c, stage)) {
        // The tied embedding is counted once (both end stages hold it with pp > 1).
        if (id.kind == gpt::kMostBlockParams + gpt::kWte && !c.llama() && stage == c.pp - 1) continue;
        made += gpt::param_spec(c, id).full.numel();
      }
      for (int e = 0; e < c.ep; ++e)
        for (gpt::ParamId id : gpt::expert_backward_order(c, stage, e))
          made += gpt::param_spec(c, id).full.numel();
    }
    EXPECT_EQ(gpt::parameter_count(c), made) << c.shape();
  }
}

// Layers 0 and 2 of 4 MoE (Megatron-Core's --moe-layer-freq 2), or layers 1 on (DeepSeek-V3's dense first
// layers), with ZeRO 2's per-micro-batch reductions.
TEST(GptMoe, SomeLayersMoeTrainEqualToOneDevice) {
  for (const std::string spec : {"every:2", "from:1"}) {
    Settings o = with_experts(4, 2, 2);
    o["moe-layers"] = spec;
    o["zero"] = option_text(2);
    const RunReport rep = testing::run_gpt(o);
    EXPECT_TRUE(rep.all_checks_passed()) << spec << "\n" << testing::failed_checks(rep);
  }
}

// Gradient clipping by the global norm takes the experts' gradients too, each counted once (on the ep rank
// that holds it, once over the ranks holding the same experts): with ZeRO 1 over ep 2, and in the llama
// layout over tp, sp, pp and ep 4 with ZeRO 2. Left out of the norm, the experts' gradients fail the check.
TEST(GptMoe, ClippingByTheGlobalNormCountsTheExperts) {
  Settings o = with_experts(4, 2, 2);
  o["zero"] = option_text(1);
  o["clip-grad"] = option_text(0.05);  // below the tiny model's norm: every step clips
  RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  o = llama_across_tp_sp_pp(4);
  o["zero"] = option_text(2);
  o["clip-grad"] = option_text(0.05);
  rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

// Over an expert's capacity the lowest-gated routes are dropped, on each rank's tokens of a micro-batch:
// the reference drops the same ones (and judges the run's choice), with tp, sp and pp beside ep.
TEST(GptMoe, CapacityDropsTrainEqualToOneDevice) {
  for (int k : {1, 2}) {
    Settings o = with_experts(4, 2, k);
    o["capacity-factor"] = "1";
    const RunReport rep = testing::run_gpt(o);
    EXPECT_TRUE(rep.all_checks_passed()) << "top-" << k << "\n" << testing::failed_checks(rep);
    // The tiny router is not balanced: some expert is over capacity. 4 layers, 128 tokens, top k.
    ASSERT_TRUE(rep.training.has_value());
    EXPECT_EQ(rep.training->moe_routes, 4 * 128 * k);
    EXPECT_GT(rep.training->moe_dropped_routes, 0);
    EXPECT_LT(rep.training->moe_dropped_routes, rep.training->moe_routes / 2);
  }
  Settings o = llama_across_tp_sp_pp(4);
  o["capacity-factor"] = "1.1";
  const RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

// The load-balancing loss moves the router: its gradient, with sequence parallelism's split tokens and
// context parallelism's, is the reference's (the mean over each rank's tokens of a micro-batch); left out,
// the check fails.
TEST(GptMoe, TheLoadBalancingLossTrainsEqualToOneDeviceAndIsMissedWhenLeftOut) {
  Settings o = llama_across_tp_sp_pp(8);
  o["moe-aux-loss-coeff"] = "0.5";
  RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  o = with_experts(4, 2, 2);
  o["block"] = "llama";
  o["cp"] = option_text(2);
  o["moe-aux-loss-coeff"] = "0.5";
  rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  o["break"] = "moe-no-load-balancing-grad";
  EXPECT_FALSE(testing::run_gpt(o).all_checks_passed());
}

TEST(GptMoe, ASigmoidRouterTrainsEqualToOneDevice) {
  Settings o = with_experts(4, 2, 2);
  o["moe-router-score-function"] = "sigmoid";
  o["capacity-factor"] = "1";
  o["moe-aux-loss-coeff"] = "0.3";
  const RunReport rep = testing::run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
}

TEST(GptMoe, TokensAtTheWrongRankAndUngatedCombinesFailTheCheck) {
  Settings wrong = with_experts(2, 2, 2);
  wrong["break"] = "moe-wrong-expert-rank";
  EXPECT_FALSE(testing::run_gpt(wrong).all_checks_passed());
  Settings ungated = with_experts(2, 2, 2);
  ungated["break"] = "moe-combine-without-gates";
  EXPECT_FALSE(testing::run_gpt(ungated).all_checks_passed());
}

// A Mixtral-shaped layer at full size, phantom: the dispatch and combine are expert-parallel communication,
// and what the step keeps is what the memory plan says.
TEST(GptMoe, APhantomStepCommunicatesOverEpAndKeepsWhatThePlanSays) {
  const RunReport rep = run_preset(mixtral_phantom({{"ep", "8"}}));
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  ASSERT_TRUE(rep.training.has_value());
  EXPECT_GT(rep.training->communicated_comm_us.at("ep"), 0);
  EXPECT_EQ(rep.training->communicated_comm_us.at("tp"), 0);
}

// Expert tensor parallelism at full size, phantom: each rank holds half of its experts' weights, the etp
// gather and reduce-scatter add expert-parallel traffic, and what the step keeps is what the plan says.
TEST(GptMoe, APhantomStepWithEtpHoldsHalfTheExpertsAndGathersTheirTokens) {
  auto run = [](int etp) {
    const RunReport rep = run_preset(
        mixtral_phantom({{"tp", "2"}, {"seq-parallel", "true"}, {"ep", "4"}, {"etp", option_text(etp)}}));
    EXPECT_TRUE(rep.all_checks_passed()) << "etp " << etp << "\n" << testing::failed_checks(rep);
    return rep;
  };
  const RunReport whole = run(1), split = run(2);
  ASSERT_TRUE(whole.training && split.training);
  EXPECT_GT(split.training->communicated_comm_us.at("ep"), whole.training->communicated_comm_us.at("ep"));
  auto config = [](int etp) {
    gpt::Config c;
    c.block = gpt::Block::Llama;
    c.layers = 2, c.hidden = 4096, c.heads = 32, c.kv_heads = 8, c.ffn_hidden = 14336, c.vocab = 32000;
    c.experts = 8, c.top_k = 2;
    c.global_batch = 8, c.tp = 2, c.seq_parallel = true, c.ep = 4, c.etp = etp, c.phantom = true;
    return gpt::resolve(c, 8);
  };
  const gpt::Config c1 = config(1), c2 = config(2);
  // Two layers of 8 experts over ep 4: 2 experts of three [4096, 14336] matrices each per rank, in bf16
  // copies and fp32 masters and gradients (ZeRO 0): 2 + 4 + 4 bytes an element, halved by etp 2.
  const std::int64_t expert_elements = 2 * 2 * 3 * std::int64_t{4096} * 14336;
  EXPECT_EQ(gpt::expert_state_bytes(c1, 0).weights - gpt::expert_state_bytes(c2, 0).weights,
            expert_elements / 2 * (2 + 4));
}

// The routing models of phantom runs: every route given, none past one per token, the shares as named.
TEST(GptMoe, RoutingModelsSpreadEveryRouteAndCapEachExpertAtTheTokens) {
  const std::int64_t tokens = 1000;
  const parallel::Routing skew =
      parallel::route_modelled(tokens, 8, 2, parallel::read_routing_model("skew:2", 8, 2), 3);
  std::vector<std::int64_t> counts = skew.per_expert;
  std::sort(counts.rbegin(), counts.rend());
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), std::int64_t{0}), tokens * 2);
  EXPECT_EQ(counts[0], 500);  // twice the even share of 2000 / 8
  EXPECT_EQ(counts[1], 215);  // the other seven share the rest: 1500 / 7, 3 of them one more
  EXPECT_EQ(counts[7], 214);
  // The others' extra routes spread over the expert ids: every ep rank's block of consecutive experts, the
  // hottest expert's block aside, takes within one route of every other (DeepSeek-V3's 256 experts, top 8,
  // of 4,096 tokens, in every layer).
  for (int layer = 0; layer < 8; ++layer) {
    const parallel::Routing wide =
        parallel::route_modelled(4096, 256, 8, parallel::read_routing_model("skew:2", 256, 8), layer);
    const auto hot =
        std::max_element(wide.per_expert.begin(), wide.per_expert.end()) - wide.per_expert.begin();
    for (const int ep : {8, 16, 32, 64, 128}) {
      const int block = 256 / ep;
      std::int64_t least = std::numeric_limits<std::int64_t>::max(), most = 0;
      for (int r = 0; r < ep; ++r) {
        if (hot / block == r) continue;
        const std::int64_t sum = std::accumulate(wide.per_expert.begin() + r * block,
                                                 wide.per_expert.begin() + (r + 1) * block, std::int64_t{0});
        least = std::min(least, sum), most = std::max(most, sum);
      }
      EXPECT_LE(most - least, 1) << "layer " << layer << ", ep " << ep;
    }
  }
  // Zipf's law with a steep exponent puts more than all the tokens on the first expert: capped at them.
  const parallel::Routing zipf =
      parallel::route_modelled(tokens, 8, 2, parallel::read_routing_model("zipf:3", 8, 2), 3);
  counts = zipf.per_expert;
  std::sort(counts.rbegin(), counts.rend());
  EXPECT_EQ(counts[0], tokens);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), std::int64_t{0}), tokens * 2);
  EXPECT_GT(counts[1], counts[2]);
  // Each layer its own hot expert.
  const parallel::Routing other =
      parallel::route_modelled(tokens, 8, 2, parallel::read_routing_model("zipf:3", 8, 2), 4);
  EXPECT_NE(other.per_expert, zipf.per_expert);
  for (const std::string bad : {"skew:0.5", "skew:5", "zipf:-1", "zipf", "skewed:2", "zipf:nan"}) {
    try {
      parallel::read_routing_model(bad, 8, 2);
      ADD_FAILURE() << "not refused: " << bad;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--routing " + bad), std::string::npos) << e.what();
    }
  }
}

// The straggler: with one expert taking twice its share, the others' ranks wait for it in the all-to-all
// after the experts, and its rank holds more activations. (Virtual times: exact.)
TEST(GptMoe, ASkewedRoutingSlowsTheStepAndRaisesThePeak) {
  auto run = [](const std::string& routing) {
    const RunReport rep = run_preset(mixtral_phantom({{"seq", "2048"}, {"ep", "8"}, {"routing", routing}}));
    EXPECT_TRUE(rep.all_checks_passed()) << routing << "\n" << testing::failed_checks(rep);
    return rep;
  };
  auto most_memory = [](const RunReport& rep) {
    std::int64_t most = 0;
    for (const RankSummary& s : rep.ranks) most = std::max(most, s.peak_bytes);
    return most;
  };
  const RunReport even = run("balanced"), skewed = run("skew:2");
  EXPECT_GT(skewed.training->step_time_us, even.training->step_time_us);
  EXPECT_GT(skewed.training->exposed_comm_us.at("ep"), even.training->exposed_comm_us.at("ep"));
  EXPECT_GT(most_memory(skewed), most_memory(even));
}

TEST(GptMoe, MixtralCountsItsParametersAndTheActiveOnes) {
  gpt::Config c;
  c.block = gpt::Block::Llama;
  c.layers = 32, c.hidden = 4096, c.heads = 32, c.kv_heads = 8, c.ffn_hidden = 14336, c.vocab = 32000;
  c.experts = 8, c.top_k = 2;
  // Mixtral 8x7B: 46.7B parameters, 12.9B of them active per token (Jiang et al. 2024, section 2).
  EXPECT_EQ(gpt::parameter_count(c), 46'702'792'704);
  EXPECT_EQ(gpt::active_parameter_count(c), 12'879'925'248);
}

TEST(GptMoe, RoutingPicksTheTopKAndItsGradientIsTheSoftmaxOverThem) {
  // Two tokens, three experts, top 2 over two ranks of experts (one expert each... three do not split
  // in two, so one rank of three).
  const std::vector<double> logits = {0.0, 2.0, 1.0,    // token 0: experts 1 and 2
                                      3.0, 3.0, -1.0};  // token 1: a tie goes to the lower expert
  const parallel::Routing ro = parallel::route_top_k(logits, 2, 3, 2, 3);
  ASSERT_EQ(ro.token.size(), 4u);
  // Dispatch order: by expert, then token.
  EXPECT_EQ(ro.expert, (std::vector<int>{0, 1, 1, 2}));
  EXPECT_EQ(ro.token, (std::vector<std::int64_t>{1, 0, 1, 0}));
  EXPECT_EQ(ro.per_expert, (std::vector<std::int64_t>{1, 2, 1}));
  EXPECT_NEAR(ro.gate[0], 0.5, 1e-12);                                  // token 1's tie
  EXPECT_NEAR(ro.gate[1], std::exp(1.0) / (std::exp(1.0) + 1), 1e-12);  // token 0's expert 1
  EXPECT_EQ(ro.closest_call, 1.0);  // token 0: 1.0 (expert 2) against 0.0 (expert 0)
  // d loss / d gate 1 for every route: the gates sum to one, so the logits get no gradient.
  for (double g : parallel::router_logit_grads(ro, std::vector<double>(4, 1.0))) EXPECT_NEAR(g, 0, 1e-15);
  const std::vector<double> dl = parallel::router_logit_grads(ro, {0, 1, 0, 0});  // token 0's expert 1 only
  const double g1 = ro.gate[1];
  EXPECT_NEAR(dl[0 * 3 + 1], g1 * (1 - g1), 1e-12);
  EXPECT_NEAR(dl[0 * 3 + 2], -g1 * (1 - g1), 1e-12);
  EXPECT_EQ(dl[0 * 3 + 0], 0);
}

TEST(GptMoe, OverCapacityTheLowestGatesAreDroppedAndStillShareTheSoftmax) {
  // Three tokens, three experts, top 2: each takes experts 0 and 1, which take ceil(3 x 2 / 3 x 1) = 2
  // routes each. Expert 0's gates are 0.73, 0.95, 0.88 (token 0's goes), expert 1's 0.27, 0.05, 0.12
  // (token 1's goes).
  const std::vector<double> logits = {1, 0, -5, 3, 0, -5, 2, 0, -5};
  EXPECT_EQ(parallel::expert_capacity(3, 3, 2, 1.0), 2);
  EXPECT_EQ(parallel::expert_capacity(3, 3, 2, 0), -1);  // dropless
  const parallel::Routing ro = parallel::route_top_k(logits, 3, 3, 2, 3, 2);
  EXPECT_EQ(ro.expert, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(ro.token, (std::vector<std::int64_t>{1, 2, 0, 2}));
  EXPECT_EQ(ro.dropped_token, (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(ro.dropped_expert, (std::vector<int>{0, 1}));
  EXPECT_EQ(ro.routes(), 4);
  // A dropped route has no gradient of its own, but its logit moves its token's kept gate.
  const std::vector<double> dl = parallel::router_logit_grads(ro, std::vector<double>(4, 1.0));
  const double kept = 1 / (1 + std::exp(1.0)), dropped = 1 - kept;  // token 0: expert 1 kept, 0 dropped
  EXPECT_NEAR(dl[0 * 3 + 0], -dropped * kept, 1e-12);
  EXPECT_NEAR(dl[0 * 3 + 1], kept * (1 - kept), 1e-12);
}

TEST(GptMoe, TheLoadBalancingLossIsOneForAnEvenRouterAndGrowsWithImbalance) {
  // Four tokens over two experts, top 1: a uniform router with an even load gives E / (k T^2) x
  // sum_i (T / E)(T / E) = 1.
  const parallel::Routing even = parallel::route_top_k({0, 0.1, 0.1, 0, 0, 0.1, 0.1, 0}, 4, 2, 1, 2);
  EXPECT_NEAR(parallel::load_balancing_loss(even), 1.0, 1e-2);
  // Every token's first choice expert 0, with its probability high: more.
  const parallel::Routing skewed = parallel::route_top_k({3, 0, 3, 0, 3, 0, 3, 0}, 4, 2, 1, 2);
  EXPECT_GT(parallel::load_balancing_loss(skewed), 1.9);
  // Its gradient pushes the loaded expert's logits down.
  std::vector<double> dl(8, 0.0);
  parallel::add_load_balancing_grads(skewed, 1.0, dl);
  for (int t = 0; t < 4; ++t) EXPECT_GT(dl[t * 2 + 0], 0) << t;
}

// The router's logit gradient against finite differences, for both scores, with a capacity dropping routes
// and the load-balancing loss: L = sum over kept routes of w(token, expert) gate + lb x the balance loss.
TEST(GptMoe, TheRouterGradientIsTheLossesDerivative) {
  const std::int64_t tokens = 5;
  const int experts = 4, k = 2;
  std::vector<double> logits(tokens * experts);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(1.7 * static_cast<double>(i)) * 2;
  auto weight = [](std::int64_t t, int e) { return std::cos(0.3 * static_cast<double>(t) + e); };
  for (parallel::RouterScore score : {parallel::RouterScore::Softmax, parallel::RouterScore::Sigmoid}) {
    const double lb = 0.7;
    auto loss = [&](const std::vector<double>& l) {
      const parallel::Routing ro = parallel::route_top_k(l, tokens, experts, k, experts, 2, 0, score);
      double sum = lb * parallel::load_balancing_loss(ro);
      for (std::size_t i = 0; i < ro.token.size(); ++i) sum += weight(ro.token[i], ro.expert[i]) * ro.gate[i];
      return sum;
    };
    const parallel::Routing ro = parallel::route_top_k(logits, tokens, experts, k, experts, 2, 0, score);
    ASSERT_GT(ro.dropped(), 0);  // capacity ceil(5 x 2 / 4) = 3 for 10 routes over 4 experts
    std::vector<double> dgate;
    for (std::size_t i = 0; i < ro.token.size(); ++i) dgate.push_back(weight(ro.token[i], ro.expert[i]));
    std::vector<double> dl = parallel::router_logit_grads(ro, dgate);
    parallel::add_load_balancing_grads(ro, lb, dl);
    for (std::size_t i = 0; i < logits.size(); ++i) {
      std::vector<double> up = logits, down = logits;
      up[i] += 1e-6, down[i] -= 1e-6;
      EXPECT_NEAR(dl[i], (loss(up) - loss(down)) / 2e-6, 1e-6) << "logit " << i;
    }
  }
}

TEST(GptMoe, BadExpertLayoutsAreRefusedNamingTheFlag) {
  // Each case: the tiny model with experts over (world, ep) or, with world 0, without experts; the flags
  // changed; what the error must say.
  struct Case {
    int world, ep;
    std::map<std::string, std::string> set;
    std::string says;
  };
  const std::vector<Case> cases = {
      {4, 2, {{"top-k", "5"}}, "--top-k 5"},
      {4, 3, {}, "--ep 3 does not divide --experts 4"},
      {2, 4, {}, "--ep 4 does not divide the 2 ranks"},
      {4, 2, {{"tp", "2"}}, "--seq-parallel"},
      {4, 2, {{"moe-layers", "some"}}, "--moe-layers some"},
      {0, 0, {{"world", "2"}, {"ep", "2"}}, "--ep 2 splits experts; it needs --experts"},
      {0, 0, {{"model", "deepseek-v3"}}, "multi-head latent attention"},
      {4, 2, {{"shared-experts", "1"}}, "--shared-experts 1: the shared experts are the llama block's"},
      {4, 2, {{"capacity-factor", "0"}}, "--capacity-factor"},
      {0, 0, {{"capacity-factor", "1.5"}}, "--capacity-factor caps each expert; it needs --experts"},
      {4, 2, {{"routing", "skew:2"}}, "--routing skew:2: with real numbers"},
      {4, 2, {{"etp", "4"}}, "--etp 4 x --ep 2 does not divide the 4 ranks"},
      {4, 1, {{"etp", "4"}, {"moe-ffn-hidden", "30"}}, "--etp 4 does not divide --moe-ffn-hidden 30"},
      {0, 0, {{"world", "2"}, {"etp", "2"}}, "--etp 2 splits experts; it needs --experts"},
  };
  for (const Case& k : cases) {
    Settings o = k.world > 0 ? with_experts(k.world, k.ep, 2) : testing::tiny_gpt();
    for (const auto& [flag, value] : k.set) o[flag] = value;
    try {
      run_preset(o);
      ADD_FAILURE() << "not refused: " << k.says;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(k.says), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace ranklab
