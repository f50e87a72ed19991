// Bandwidth sharing between communication in flight: collectives of different groups run at the same
// time and share the links they both cross; on disjoint links they do not slow each other down; on one
// group's stream they run one after the other.
#include <gtest/gtest.h>

#include "sim_fixture.h"

namespace ranklab {
namespace {

constexpr std::int64_t kGiBFloats = std::int64_t{1} << 28;

// Runs `fn` on `world` ranks and returns the report's collectives.
std::vector<CollectiveRecord> collectives_of(int world, const std::function<void(Rank&)>& fn) {
  SimBackend backend(testing::quiet_config());
  return backend.launch(world, fn).collectives;
}

double one_alone_us() {
  auto recs = collectives_of(2, [](Rank& r) {
    Tensor t = r.phantom({kGiBFloats});
    r.all_reduce(t, ReduceOp::Sum);
    r.synchronize();
  });
  return recs.at(0).time_us();
}

TEST(LinkSharing, TwoGroupsOnTheSameLinksEachTakeTwiceAsLong) {
  auto recs = collectives_of(2, [](Rank& r) {
    Group a = r.new_group({0, 1}), b = r.new_group({0, 1});
    Tensor x = r.phantom({kGiBFloats}), y = r.phantom({kGiBFloats});
    Work wa = r.all_reduce(x, ReduceOp::Sum, Async::Yes, a);
    Work wb = r.all_reduce(y, ReduceOp::Sum, Async::Yes, b);
    wa.wait();
    wb.wait();
    r.synchronize();
  });
  ASSERT_EQ(recs.size(), 2u);
  const double alone = one_alone_us();
  // Both run over the same NVLink links at half the rate each; the fixed latency is a tiny part of a GiB.
  for (const CollectiveRecord& rec : recs) {
    EXPECT_GT(rec.time_us(), 1.98 * alone);
    EXPECT_LT(rec.time_us(), 2.0 * alone);
  }
}

TEST(LinkSharing, GroupsOnDisjointLinksDoNotSlowEachOther) {
  auto recs = collectives_of(4, [](Rank& r) {
    Group low = r.new_group({0, 1}), high = r.new_group({2, 3});
    Tensor x = r.phantom({kGiBFloats});
    r.all_reduce(x, ReduceOp::Sum, Async::No, r.rank() < 2 ? low : high);
    r.synchronize();
  });
  ASSERT_EQ(recs.size(), 2u);
  const double alone = one_alone_us();
  EXPECT_DOUBLE_EQ(recs[0].time_us(), alone);
  EXPECT_DOUBLE_EQ(recs[1].time_us(), alone);
  EXPECT_DOUBLE_EQ(recs[0].start_us, recs[1].start_us);  // they did run at the same time
}

TEST(LinkSharing, OneGroupsCollectivesRunOneAfterTheOther) {
  auto recs = collectives_of(2, [](Rank& r) {
    Tensor x = r.phantom({kGiBFloats}), y = r.phantom({kGiBFloats});
    Work wa = r.all_reduce(x, ReduceOp::Sum, Async::Yes);
    Work wb = r.all_reduce(y, ReduceOp::Sum, Async::Yes);
    wa.wait();
    wb.wait();
  });
  ASSERT_EQ(recs.size(), 2u);
  const double alone = one_alone_us();
  EXPECT_DOUBLE_EQ(recs[0].time_us(), alone);
  EXPECT_DOUBLE_EQ(recs[1].time_us(), alone);
  EXPECT_DOUBLE_EQ(recs[1].start_us, recs[0].end_us);  // the stream keeps them in order
}

TEST(LinkSharing, ACollectiveStartingMidwayDelaysTheOneInFlight) {
  // Group b's all_reduce starts after ranks 0 and 1 spend time computing; it then shares the links with
  // group a's, which therefore ends later than it would alone, but earlier than twice as late.
  auto recs = collectives_of(2, [](Rank& r) {
    Group a = r.new_group({0, 1}), b = r.new_group({0, 1});
    Tensor x = r.phantom({kGiBFloats}), y = r.phantom({kGiBFloats});
    Tensor m = r.phantom({2048, 2048});  // a few hundred microseconds: less than the all_reduce
    Work wa = r.all_reduce(x, ReduceOp::Sum, Async::Yes, a);
    r.matmul(m, m);
    Work wb = r.all_reduce(y, ReduceOp::Sum, Async::Yes, b);
    wa.wait();
    wb.wait();
    r.synchronize();
  });
  ASSERT_EQ(recs.size(), 2u);
  const double alone = one_alone_us();
  const CollectiveRecord& first = recs[0].start_us < recs[1].start_us ? recs[0] : recs[1];
  const CollectiveRecord& second = recs[0].start_us < recs[1].start_us ? recs[1] : recs[0];
  ASSERT_LT(second.start_us, first.start_us + alone) << "the second must start while the first is in flight";
  EXPECT_GT(first.time_us(), alone);
  EXPECT_LT(first.time_us(), 2 * alone);
  // The two together moved twice the bytes over links that were busy the whole time.
  EXPECT_NEAR(second.end_us - first.start_us, 2 * alone, 0.01 * alone);
}

}  // namespace
}  // namespace ranklab
