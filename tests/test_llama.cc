// The gpt lesson's llama block (RMSNorm, grouped-query attention with rotary positions, SwiGLU, no
// biases, an untied output layer): every layout trains equal to one device; the presets carry their
// models' shapes and parameter counts; a gradient left in the rotated frame fails the check; the block's
// flags are refused where they do not fit.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "gpt_fixture.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/presets.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::expect_usage_error;
using testing::run_gpt;
using testing::tiny_llama;

// A layout's flags on top of the tiny model.
using Case = std::tuple<std::string, Settings>;

class LlamaEqualsOneDevice : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaEqualsOneDevice, ThreeStepsOfAdamW) {
  Settings o = tiny_llama();
  for (const auto& [flag, value] : std::get<1>(GetParam())) o[flag] = value;
  const RunReport rep = run_gpt(o);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
  int numeric = 0;
  for (const CheckRecord& c : rep.checks) numeric += c.what.find("one device") != std::string::npos;
  EXPECT_GE(numeric, 2 * testing::number(o, "world"));
  ASSERT_TRUE(rep.training);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LlamaEqualsOneDevice,
    ::testing::Values(
        Case{"tp2_kv2_fp32", {{"world", "2"}, {"tp", "2"}, {"dtype", "fp32"}}},
        Case{"tp2_sp_zero1_bf16", {{"world", "4"}, {"tp", "2"}, {"seq-parallel", "true"}, {"zero", "1"}}},
        Case{"tp2_pp2_zero1_8_ranks", {{"world", "8"}, {"tp", "2"}, {"pp", "2"}, {"zero", "1"}}},
        Case{"pp2_interleaved_zero3_full",
             {{"world", "4"}, {"pp", "2"}, {"interleave", "2"}, {"zero", "3"}, {"recompute", "full"}}},
        Case{"mqa_zero2_selective",
             {{"world", "2"}, {"kv-heads", "1"}, {"zero", "2"}, {"recompute", "selective"}}},
        Case{"mha_tp4", {{"world", "4"}, {"tp", "4"}, {"kv-heads", "4"}, {"dtype", "fp32"}}},
        // Heads of 24 features beside a hidden size of 64 (Mistral NeMo's and Qwen3's head_dim), with
        // sequence and context parallelism.
        Case{"kv_channels_tp2_sp_cp2",
             {{"world", "4"}, {"kv-channels", "24"}, {"tp", "2"}, {"seq-parallel", "true"}, {"cp", "2"}}},
        // Qwen3's QK-norm: its gains' gradients summed over the tp ranks' heads, with recomputation.
        Case{"qk_norm_tp2_sp_cp2_pp2",
             {{"world", "8"},
              {"qk-layernorm", "true"},
              {"kv-channels", "24"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"cp", "2"},
              {"pp", "2"},
              {"zero", "1"}}},
        Case{"qk_norm_tp2_zero3_full",
             {{"world", "4"}, {"qk-layernorm", "true"}, {"tp", "2"}, {"zero", "3"}, {"recompute", "full"}}},
        Case{"qk_norm_selective_fp32",
             {{"world", "2"},
              {"qk-layernorm", "true"},
              {"zero", "2"},
              {"recompute", "selective"},
              {"dtype", "fp32"}}},
        Case{"megatron_core_rings_dropout",
             {{"world", "4"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"zero", "1"},
              {"framework", "megatron-core"},
              {"dropout", "0.1"}}},
        // Biases: Qwen2's on wqkv alone, with sequence and context parallelism; on all four linear layers
        // (gpt-oss's attention) with the pipeline, ZeRO 3 and full recomputation.
        Case{"qkv_bias_tp2_sp_cp2",
             {{"world", "4"}, {"add-qkv-bias", "true"}, {"tp", "2"}, {"seq-parallel", "true"}, {"cp", "2"}}},
        Case{"linear_biases_tp2_sp_pp2_zero3_full",
             {{"world", "4"},
              {"add-bias-linear", "true"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"pp", "2"},
              {"zero", "3"},
              {"recompute", "full"}}},
        Case{"linear_biases_fp32", {{"world", "2"}, {"add-bias-linear", "true"}, {"dtype", "fp32"}}},
        // gpt-oss's MoE biases: the router's and each expert's two, with a shared expert's dense ones,
        // experts over ep with capacity drops, and ZeRO 1 over the expert-data-parallel ranks.
        Case{"linear_biases_experts_ep2_drops_zero1",
             {{"world", "4"},
              {"add-bias-linear", "true"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"experts", "4"},
              {"top-k", "2"},
              {"moe-ffn-hidden", "32"},
              {"shared-experts", "1"},
              {"capacity-factor", "1.0"},
              {"ep", "2"},
              {"zero", "1"}}},
        // Experts split over etp: w13's bias by its columns, w2's added once before the members' sum.
        Case{"linear_biases_experts_ep2_etp2_fp32",
             {{"world", "4"},
              {"add-bias-linear", "true"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"experts", "4"},
              {"top-k", "2"},
              {"moe-ffn-hidden", "32"},
              {"ep", "2"},
              {"etp", "2"},
              {"dtype", "fp32"}}},
        Case{"linear_biases_experts_ep4_pp2_fp32",
             {{"world", "8"},
              {"add-bias-linear", "true"},
              {"experts", "4"},
              {"top-k", "1"},
              {"moe-ffn-hidden", "32"},
              {"ep", "4"},
              {"pp", "2"},
              {"dtype", "fp32"}}},
        // gpt-oss's gated unit, its clamps at 0.1 (7 in the model) so that the tiny model's activations
        // (of order 0.16) meet them: in the dense MLP, and in experts split over ep and etp. In fp32: with
        // so many inputs at a clamp, bf16's rounding moves some across it, where the derivative jumps (the
        // etp layout's w13 gradient then reads 0.19 against bf16's 0.15; fp32 and an unclamped bf16 pass).
        Case{"quick_geglu_clamped_offset_tp2_fp32",
             {{"world", "2"},
              {"tp", "2"},
              {"quick-geglu", "true"},
              {"activation-func-clamp-value", "0.1"},
              {"glu-linear-offset", "1"},
              {"dtype", "fp32"}}},
        Case{"quick_geglu_experts_ep2_etp2",
             {{"world", "4"},
              {"tp", "2"},
              {"seq-parallel", "true"},
              {"experts", "4"},
              {"top-k", "2"},
              {"moe-ffn-hidden", "32"},
              {"ep", "2"},
              {"etp", "2"},
              {"quick-geglu", "true"},
              {"activation-func-clamp-value", "0.1"},
              {"glu-linear-offset", "1"},
              {"dtype", "fp32"}}}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::get<0>(info.param); });

// Caught with grouped-query attention and with a key-value head per query head, in bf16: the fused
// projection's gradient is checked part by part, so the queries' and keys' errors do not hide under the
// values' larger gradient.
TEST(Llama, AGradientLeftInTheRotatedFrameFailsTheCheck) {
  for (const bool grouped : {true, false}) {
    Settings o = tiny_llama();
    if (!grouped) o.erase("kv-heads"), o.erase("ffn-hidden");
    o["world"] = option_text(2);
    o["tp"] = option_text(2);
    EXPECT_TRUE(run_gpt(o).all_checks_passed()) << grouped;
    o["break"] = "no-rope-backward";
    const RunReport rep = run_gpt(o);
    EXPECT_FALSE(rep.all_checks_passed()) << grouped;
    EXPECT_NE(testing::failed_checks(rep).find("wqkv ("), std::string::npos) << testing::failed_checks(rep);
  }
}

TEST(Llama, PresetsCarryTheirModelsShapes) {
  gpt::Config c = gpt::options_table().read(gpt::preset_settings("llama3-8b"), "gpt");
  EXPECT_TRUE(c.llama());
  EXPECT_EQ(c.kv(), 8);
  EXPECT_EQ(c.ffn(), 14336);
  // Meta's published counts: 8.03B and 70.6B parameters.
  EXPECT_EQ(gpt::parameter_count(c), 8'030'261'248);
  c = gpt::options_table().read(gpt::preset_settings("llama3-70b"), "gpt");
  EXPECT_EQ(gpt::parameter_count(c), 70'553'706'496);
  c = gpt::options_table().read(gpt::preset_settings("llama3.1-405b"), "gpt");
  EXPECT_EQ(c.layers, 126);
  EXPECT_EQ(c.global_batch * c.seq, 2048 * 8192);  // 16M tokens
  // A GPT preset keeps the gpt block.
  EXPECT_FALSE(gpt::options_table().read(gpt::preset_settings("gpt3-175b"), "gpt").llama());
}

TEST(Llama, FlopsCountTheBlocksOwnMatrices) {
  // Per token and layer, forward: 2 (h (a + 2g) d + a d h + 3 h f) + 4 s a d; three times that per step with
  // the backward, plus the output layer.
  gpt::Config c = gpt::options_table().read(tiny_llama(), "gpt");
  c = gpt::resolve(c, 1);
  const double h = 64, a = 4, g = 2, d = 16, f = 96, s = 16, L = 4, V = 128, tokens = 8 * 16;
  const double layer = 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f) + 4 * s * a * d;
  EXPECT_DOUBLE_EQ(gpt::step_flops(c).model, 3 * tokens * (L * layer + 2 * h * V));
}

// --kv-channels: the attention heads * d wide, whatever the hidden size; its parameters and FLOPs count
// it, and a published model that has it counts as its config does (Mistral NeMo: 12.2B).
TEST(Llama, HeadsOfAWidthOfTheirOwn) {
  Settings o = tiny_llama();
  o["kv-channels"] = option_text(24);
  gpt::Config c = gpt::resolve(gpt::options_table().read(o, "gpt"), 1);
  EXPECT_EQ(c.head_dim(), 24);
  const double h = 64, a = 4, g = 2, d = 24, f = 96, s = 16, L = 4, V = 128, tokens = 8 * 16;
  const double layer = 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * f) + 4 * s * a * d;
  EXPECT_DOUBLE_EQ(gpt::step_flops(c).model, 3 * tokens * (L * layer + 2 * h * V));
  EXPECT_NE(c.shape().find("4 heads (2 key-value, 24 channels each)"), std::string::npos) << c.shape();
  c = gpt::options_table().read(gpt::preset_settings("mistral-nemo-12b"), "gpt");
  EXPECT_EQ(c.head_dim(), 128);
  // 40 layers of (5120 x (32 + 16) x 128 + 4096 x 5120 + 3 x 5120 x 14336 + 2 x 5120), two embeddings of
  // 131072 x 5120 and the final norm: 12,247,782,400.
  EXPECT_EQ(gpt::parameter_count(c), 12'247'782'400);
}

// QK-norm's gains are whole on every tp rank, each of which sees its own heads' gradient: without their
// sum over tp (the same all-reduce as sequence parallelism's norms, which the break skips) the check fails.
TEST(Llama, QkNormGainsSummedOverTheTensorParallelHeads) {
  Settings o = tiny_llama();
  o["qk-layernorm"] = option_text(true);
  o["world"] = option_text(2);
  o["tp"] = option_text(2);
  o["break"] = "no-sp-grad-sync";
  const RunReport rep = run_gpt(o);
  EXPECT_FALSE(rep.all_checks_passed());
  EXPECT_NE(testing::failed_checks(rep).find("norm gradient"), std::string::npos)
      << testing::failed_checks(rep);
  // Qwen3-30B-A3B as its config publishes it: 30,532,122,624 parameters, 3,353,032,704 of them active.
  const gpt::Config c = gpt::options_table().read(gpt::preset_settings("qwen3-30b-a3b"), "gpt");
  EXPECT_TRUE(c.qk_layernorm);
  EXPECT_EQ(gpt::parameter_count(c), 30'532'122'624);
  EXPECT_EQ(gpt::active_parameter_count(c), 3'353'032'704);
}

// Qwen2.5 as its configs count it: 7,615,616,512 and 72,706,203,648 parameters, the q, k and v biases among
// them (7.62B and 72.7B; Qwen's model cards give 7.61B and 72.7B).
TEST(Llama, Qwen25CountsItsQkvBiases) {
  gpt::Config c = gpt::options_table().read(gpt::preset_settings("qwen2.5-7b"), "gpt");
  EXPECT_TRUE(c.add_qkv_bias);
  EXPECT_FALSE(c.add_bias_linear);
  EXPECT_EQ(gpt::parameter_count(c), 7'615'616'512);
  c = gpt::options_table().read(gpt::preset_settings("qwen2.5-72b"), "gpt");
  EXPECT_EQ(gpt::parameter_count(c), 72'706'203'648);
  c.add_qkv_bias = false;
  EXPECT_EQ(gpt::parameter_count(c), 72'706'203'648 - 80 * (64 + 16) * 128);
}

TEST(Llama, ThePhantom8BStepRuns) {
  Settings o = gpt::preset_settings("llama3-8b");
  o["world"] = option_text(8);
  o["tp"] = option_text(8);
  o["seq-parallel"] = option_text(true);
  o["global-batch"] = option_text(2);
  o["layers"] = option_text(2);
  o["phantom"] = option_text(true);
  o["steps"] = option_text(1);
  o["quiet"] = option_text(true);
  const RunReport rep = run_gpt(o);
  ASSERT_TRUE(rep.training);
  EXPECT_GT(rep.training->step_time_us, 0);
  EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);  // the memory plan's
}

TEST(Llama, BadFlagsNameTheFlag) {
  Settings o = tiny_llama();
  o["kv-heads"] = option_text(3);
  expect_usage_error(o, "--kv-heads 3 does not divide --heads 4");
  o = tiny_llama();
  o["world"] = option_text(4);
  o["tp"] = option_text(4);
  expect_usage_error(o, "--kv-heads 2 is not divisible by --tp 4");
  o = tiny_llama();
  o["world"] = option_text(2);
  o["tp"] = option_text(2);
  o["ffn-hidden"] = option_text(95);
  expect_usage_error(o, "--ffn-hidden 95 is not divisible by --tp 2");
  o = tiny_llama();
  o["block"] = "gpt";
  expect_usage_error(o, "--kv-heads 2: the gpt block's attention");
  o = tiny_llama();
  o["hidden"] = option_text(12);
  o["kv-heads"] = option_text(4);
  expect_usage_error(o, "features per head is odd");
  o = tiny_llama();
  o["kv-channels"] = option_text(15);
  expect_usage_error(o, "--kv-channels 15 is odd");
  o = testing::tiny_gpt();
  o["qk-layernorm"] = option_text(true);
  expect_usage_error(o, "--qk-layernorm: the gpt block's attention has no norm");
  o = testing::tiny_gpt();
  o["add-qkv-bias"] = option_text(true);
  expect_usage_error(o, "the gpt block has them always");
  o = testing::tiny_gpt();
  o["glu-linear-offset"] = option_text(1);
  expect_usage_error(o, "the gpt block's MLP is GELU");
  o = tiny_llama();
  o["activation-func-clamp-value"] = option_text(-1);
  expect_usage_error(o, "--activation-func-clamp-value");
  o = testing::tiny_gpt();
  o["kv-channels"] = option_text(24);
  expect_usage_error(o, "--kv-channels 24: the gpt block's heads split --hidden 64 into --heads 4");
}

}  // namespace
}  // namespace ranklab
