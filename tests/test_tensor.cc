#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype_round.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "sim_fixture.h"

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

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_bytes(DType::Float32), 4);
  EXPECT_EQ(dtype_bytes(DType::BFloat16), 2);
  EXPECT_EQ(dtype_bytes(DType::Float16), 2);
  EXPECT_STREQ(dtype_name(DType::BFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::Float16), "float16");
}

TEST(DType, BFloat16RoundsToNearestEven) {
  const float step = std::ldexp(1.0f, -7);  // bfloat16's spacing in [1, 2)
  EXPECT_EQ(round_to_bfloat16(1.0f), 1.0f);
  EXPECT_EQ(round_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 1.0f);                 // a tie: 1 is even
  EXPECT_EQ(round_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + 2 * step);  // a tie: up to even
  EXPECT_EQ(round_to_bfloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 1.0f + step);
  EXPECT_EQ(round_to_bfloat16(-1.0f - std::ldexp(1.0f, -9)), -1.0f);
  EXPECT_EQ(round_to_bfloat16(3.140625f), 3.140625f);  // representable values stay
  EXPECT_TRUE(std::isinf(round_to_bfloat16(std::numeric_limits<float>::max())));
  EXPECT_TRUE(std::isnan(round_to_bfloat16(std::numeric_limits<float>::quiet_NaN())));
}

TEST(DType, Float16RoundsToNearestEvenOverflowsAndKeepsSubnormals) {
  EXPECT_EQ(round_to_float16(65504.0f), 65504.0f);  // the largest finite float16
  EXPECT_EQ(round_to_float16(65519.0f), 65504.0f);
  EXPECT_TRUE(std::isinf(round_to_float16(65520.0f)));  // the tie goes to 2^16: infinity
  EXPECT_EQ(round_to_float16(-1e6f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to_float16(1.0f + std::ldexp(1.0f, -11)), 1.0f);  // a tie: 1 is even
  EXPECT_EQ(round_to_float16(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(round_to_float16(0.1f), 0.0999755859375f);
  EXPECT_EQ(round_to_float16(std::ldexp(1.0f, -14)), std::ldexp(1.0f, -14));  // the smallest normal
  EXPECT_EQ(round_to_float16(std::ldexp(5.0f, -24)), std::ldexp(5.0f, -24));  // a subnormal stays
  EXPECT_EQ(round_to_float16(std::ldexp(1.0f, -25)), 0.0f);                   // a tie: 0 is even
  EXPECT_EQ(round_to_float16(std::ldexp(3.0f, -25)), std::ldexp(1.0f, -23));  // a tie: up to even
  EXPECT_EQ(round_to_float16(std::ldexp(1.0f, -26)), 0.0f);
  EXPECT_EQ(round_to_float16(std::ldexp(1023.6f, -24)), std::ldexp(1.0f, -14));  // rounds up to normal
  EXPECT_TRUE(std::isnan(round_to_float16(std::numeric_limits<float>::quiet_NaN())));
}

TEST(DType, SixteenBitTensorsAreAccountedAtTwoBytes) {
  auto got = testing::run_collect<std::vector<std::int64_t>>(1, [](Rank& r) {
    Tensor a = r.zeros({1000}, DType::BFloat16);
    Tensor b = r.phantom({24, 10}, DType::Float16);
    Tensor c = r.zeros({10});
    EXPECT_EQ(a.bytes(), 2000);
    EXPECT_EQ(a.str(), "bfloat16[1000]");
    return std::vector<std::int64_t>{r.memory_allocated()};
  });
  EXPECT_EQ(got[0][0], 2000 + 480 + 40);
}

TEST(DType, OutOfMemoryNamesTheDtype) {
  SimBackend backend(testing::quiet_config());
  std::string msg;
  try {
    backend.launch(1, [](Rank& r) {
      std::vector<Tensor> held;
      for (int i = 0; i < 100; ++i) held.push_back(r.phantom({std::int64_t{1} << 31}, DType::BFloat16));
    });
  } catch (const OutOfMemoryError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 0: phantom: out of memory allocating bfloat16[2147483648] (4 GiB)"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace ranklab
