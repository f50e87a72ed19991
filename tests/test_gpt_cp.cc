// The gpt lesson with context parallelism (--cp): each sequence split over cp ranks in 2 cp chunks trains
// equal to one device with the ring and with all-gather, alone and beside tp, sp, pp and ZeRO; a broken
// mask is caught; the ring hides its transfers under attention where all-gather cannot; activations
// shrink with cp; and what cannot be split is refused naming the flag.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "gpt_fixture.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/model.h"
#include "lessons/parallel/groups.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

Settings with_cp(int world, int cp, const std::string& comm) {
  Settings o = testing::tiny_gpt();
  o["world"] = option_text(world);
  o["cp"] = option_text(cp);
  o["cp-comm"] = comm;
  return o;
}

TEST(GptContextParallel, TwoAndFourRanksTrainEqualToOneDeviceWithEitherExchange) {
  for (const std::string comm : {"p2p", "all-gather"}) {
    for (int cp : {2, 4}) {
      const RunReport rep = testing::run_gpt(with_cp(cp, cp, comm));
      EXPECT_TRUE(rep.all_checks_passed()) << comm << " cp " << cp << "\n" << testing::failed_checks(rep);
    }
  }
}

TEST(GptContextParallel, LlamaWithTpCpPpAndZeroTogetherTrainsEqualToOneDevice) {
  for (const std::string comm : {"p2p", "all-gather"}) {
    Settings o = with_cp(8, 2, comm);
    o["block"] = "llama";
    o["kv-heads"] = option_text(2);
    o["tp"] = option_text(2);
    o["seq-parallel"] = option_text(true);
    o["pp"] = option_text(2);
    o["zero"] = option_text(1);
    const RunReport rep = testing::run_gpt(o);
    EXPECT_TRUE(rep.all_checks_passed()) << comm << "\n" << testing::failed_checks(rep);
    ASSERT_TRUE(rep.training.has_value());
    EXPECT_NE(rep.training->layout.find("cp 2 (" + comm + ")"), std::string::npos) << rep.training->layout;
  }
}

// Masking the other ranks' blocks by local position hides keys a query must see (and shows ones it must
// not): the one-device check catches it.
TEST(GptContextParallel, AMaskOnEveryBlockFailsTheCheck) {
  Settings o = with_cp(2, 2, "p2p");
  o["break"] = "cp-mask-every-block";
  EXPECT_FALSE(testing::run_gpt(o).all_checks_passed());
}

// Dropout's masks follow the global rows: a cp rank's second chunk lies elsewhere in the sequence than its
// first, so its rows continue from that chunk's start: in one kernel over both chunks (cp alone), or in a
// sequence-parallel part within one chunk (beside tp 2 with sequence parallelism). Masks that run the rank's
// rows on from its first chunk's start fail the check.
TEST(GptContextParallel, DropoutMasksEachChunkByItsRowsOfTheSequence) {
  Settings alone = with_cp(2, 2, "p2p");
  alone["dropout"] = "0.1";
  Settings beside_tp = with_cp(8, 2, "all-gather");
  beside_tp["dropout"] = "0.1";
  beside_tp["tp"] = option_text(2);
  beside_tp["seq-parallel"] = option_text(true);
  beside_tp["pp"] = option_text(2);
  for (Settings* o : {&alone, &beside_tp}) {
    const RunReport rep = testing::run_gpt(*o);
    EXPECT_TRUE(rep.all_checks_passed()) << testing::failed_checks(rep);
    (*o)["break"] = "dropout-cp-rows";
    EXPECT_FALSE(testing::run_gpt(*o).all_checks_passed());
  }
}

// A long sequence at full size: the ring's transfers run under the attention of the block before, the
// all-gather's wait. (Virtual times: exact.)
Settings long_llama(const std::string& comm) {
  Settings o;
  for (const auto& [k, v] : std::map<std::string, std::string>{{"block", "llama"},
                                                               {"layers", "2"},
                                                               {"hidden", "4096"},
                                                               {"heads", "32"},
                                                               {"kv-heads", "8"},
                                                               {"ffn-hidden", "14336"},
                                                               {"seq", "32768"},
                                                               {"vocab", "128256"},
                                                               {"global-batch", "1"},
                                                               {"micro-batch", "1"},
                                                               {"steps", "1"},
                                                               {"world", "4"},
                                                               {"cp", "4"},
                                                               {"phantom", "true"},
                                                               {"quiet", "true"}}) {
    o[k] = v;
  }
  o["cp-comm"] = comm;
  return o;
}

TEST(GptContextParallel, TheRingHidesItsTransfersAndAllGatherExposesThem) {
  const RunReport ring = testing::run_gpt(long_llama("p2p"));
  const RunReport gathered = testing::run_gpt(long_llama("all-gather"));
  ASSERT_TRUE(ring.training.has_value() && gathered.training.has_value());
  const TrainingStats &p = *ring.training, &g = *gathered.training;
  EXPECT_GT(p.communicated_comm_us.at("cp"), 0);
  EXPECT_GT(p.hidden_comm_us.at("cp"), 0.5 * p.communicated_comm_us.at("cp"));
  EXPECT_GT(g.exposed_comm_us.at("cp"), 0);
  EXPECT_EQ(g.hidden_comm_us.at("cp"), 0);
  EXPECT_LT(p.exposed_comm_us.at("cp"), g.exposed_comm_us.at("cp"));
}

TEST(GptContextParallel, EachRankKeepsItsShareOfTheActivations) {
  gpt::Config c;
  c.block = gpt::Block::Llama;
  c.hidden = 512, c.heads = 8, c.kv_heads = 2, c.seq = 4096, c.micro_batch = 1;
  const std::int64_t whole = gpt::stash_bytes(c, 4, true, true);
  c.cp = 4;
  EXPECT_EQ(4 * gpt::stash_bytes(c, 4, true, true), whole);
}

TEST(GptContextParallel, RanksAreLaidOutWithCpRightOutsideTpUnlessTheOrderPlacesIt) {
  parallel::Layout l{2, 2, 2, "tp-dp-pp", 2};
  EXPECT_EQ(l.world(), 16);
  EXPECT_EQ(l.rank_of(1, 1, 0, 0), 3);  // cp's stride is tp's size
  EXPECT_EQ(l.rank_of(0, 0, 1, 0), 4);
  const parallel::Layout::Coord c = l.coord(13);  // 13 = 1 + 2 * 0 + 4 * 1 + 8 * 1
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  l.order = "tp-dp-cp-pp";
  EXPECT_EQ(l.rank_of(0, 1, 0, 0), 4);  // cp outside dp
  EXPECT_EQ(l.coord(4).cp, 1);
  EXPECT_NO_THROW(parallel::validate_order("tp-dp-cp-pp"));
  EXPECT_THROW(parallel::validate_order("tp-cp-pp"), UsageError);
}

std::string refusal(const Settings& o) {
  try {
    testing::run_gpt(o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(ran)";
}

TEST(GptContextParallel, WhatCannotBeSplitIsRefusedNamingTheFlag) {
  EXPECT_NE(refusal(with_cp(3, 3, "p2p")).find("--seq 16 is not divisible by 2 x --cp 3 = 6"),
            std::string::npos);
  Settings unfused = with_cp(2, 2, "p2p");
  unfused["attention"] = "unfused";
  EXPECT_NE(refusal(unfused).find("--cp computes attention block by block"), std::string::npos);
  EXPECT_NE(refusal(with_cp(6, 4, "p2p")).find("--world 6 is not divisible by --tp 1 x --cp 4 x --pp 1 = 4"),
            std::string::npos);
  EXPECT_NE(refusal(with_cp(2, 2, "ring")).find("cp-comm"), std::string::npos);
}

}  // namespace
}  // namespace ranklab
