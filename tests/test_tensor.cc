#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"

namespace ranklab {
namespace {

TEST(Shape, NumelAndStr) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.ndim(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s.str(), "[2, 3, 4]");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ(s.with_dim(1, 7), (Shape{2, 7, 4}));
}

TEST(Shape, RejectsTooManyDimsAndNegativeSizes) {
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), UsageError);
  EXPECT_THROW((Shape{2, -1}), UsageError);
  EXPECT_THROW((Shape{2})[1], UsageError);
}

TEST(Random, CounterBasedIsAPureFunctionOfSeedAndIndex) {
  EXPECT_EQ(normal_at(7, 123), normal_at(7, 123));
  EXPECT_NE(normal_at(7, 123), normal_at(8, 123));
  EXPECT_NE(normal_at(7, 123), normal_at(7, 124));
}

TEST(Random, NormalMomentsAreClose) {
  const int n = 200000;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < n; ++i) {
    double x = normal_at(42, i);
    sum += x;
    sum_sq += x * x;
  }
  double mean = sum / n;
  double var = sum_sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.02);
}

}  // namespace
}  // namespace ranklab
