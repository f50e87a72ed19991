// Rank::view on the simulator: a view shares its base's memory and takes none of its own; asynchronous
// communication on one part of a buffer does not stop kernels on another part, and does stop them on the
// part it uses; collectives run in place on views of one buffer, as NCCL's in-place all-gather and
// reduce-scatter do.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/errors.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::run_collect;
using testing::run_error_message;

TEST(Views, ShareTheBasesElements) {
  const auto seen = run_collect<std::vector<float>>(1, [](Rank& r) {
    Tensor base = r.arange(Shape{2, 4}, 0.0f);
    Tensor row1 = r.view(base, 4, Shape{2, 2});  // elements 4..7
    r.scale_(row1, 10.0f);                       // written through the view ...
    Tensor first = r.view(base, 0, Shape{3});
    r.copy_(first, r.full(Shape{3}, -1.0f));  // ... and through another
    std::vector<float> out = r.to_host(base);
    const std::vector<float> v = r.to_host(row1);
    out.insert(out.end(), v.begin(), v.end());
    return out;
  });
  EXPECT_EQ(seen[0], (std::vector<float>{-1, -1, -1, 3, 40, 50, 60, 70, 40, 50, 60, 70}));
}

TEST(Views, TakeNoMemoryAndKeepTheirBaseAlive) {
  const auto bytes = run_collect<std::vector<std::int64_t>>(1, [](Rank& r) {
    std::vector<std::int64_t> b{r.memory_allocated()};
    Tensor v;
    {
      Tensor base = r.zeros(Shape{1024}, DType::BFloat16);
      b.push_back(r.memory_allocated());
      v = r.view(base, 512, Shape{16, 32});
      b.push_back(r.memory_allocated());
    }
    b.push_back(r.memory_allocated());  // the base is gone, the view holds its memory
    EXPECT_TRUE(v.defined());
    v = Tensor();
    b.push_back(r.memory_allocated());
    return b;
  });
  EXPECT_EQ(bytes[0], (std::vector<std::int64_t>{0, 2048, 2048, 2048, 0}));
}

TEST(Views, AGemmWritesItsProductIntoAView) {
  const auto seen = run_collect<std::vector<float>>(1, [](Rank& r) {
    Tensor a = r.arange(Shape{2, 3}, 1.0f), b = r.arange(Shape{3, 2}, -2.0f);
    Tensor out = r.full(Shape{4, 2}, 9.0f);
    r.matmul_(r.view(out, 4, Shape{2, 2}), a, b, Trans::No, Trans::No);  // the lower two rows
    std::vector<float> got = r.to_host(out);
    const std::vector<float> want = r.to_host(r.matmul(a, b));
    got.insert(got.end(), want.begin(), want.end());
    return got;
  });
  const std::vector<float>& v = seen[0];
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 4), std::vector<float>(4, 9.0f));
  EXPECT_EQ(std::vector<float>(v.begin() + 4, v.begin() + 8), std::vector<float>(v.begin() + 8, v.end()));
  const std::string msg = run_error_message(1, [](Rank& r) {
    r.matmul_(r.zeros(Shape{3, 2}), r.zeros(Shape{2, 3}), r.zeros(Shape{3, 2}), Trans::No, Trans::No);
  });
  EXPECT_NE(msg.find("rank 0: matmul_: 'out'"), std::string::npos) << msg;
}

TEST(Views, OfAPhantomArePhantoms) {
  const auto phantom = run_collect<bool>(1, [](Rank& r) {
    Tensor base = r.phantom(Shape{1 << 20});
    return r.view(base, 1 << 19, Shape{512, 1024}).phantom();
  });
  EXPECT_TRUE(phantom[0]);
}

TEST(Views, OutsideTheBaseIsAnErrorNamingTheRankAndTheRange) {
  const std::string msg = run_error_message(1, [](Rank& r) {
    Tensor base = r.zeros(Shape{8, 4});
    r.view(base, 24, Shape{3, 4});
  });
  EXPECT_NE(
      msg.find("rank 0: view: elements [24, 36) for shape [3, 4] are outside float32[8, 4], which has 32"),
      std::string::npos)
      << msg;
  EXPECT_NE(run_error_message(1, [](Rank& r) { r.view(r.zeros(Shape{8}), -1, Shape{2}); }).find("outside"),
            std::string::npos);
}

// Two ranks exchange half a buffer asynchronously; each then touches the other half, or the half in flight.
std::string touch_while_receiving(bool same_half) {
  return run_error_message(2, [same_half](Rank& r) {
    Tensor buf = r.zeros(Shape{2, 64});
    Tensor in_flight = r.view(buf, 0, Shape{64});
    Tensor other = r.view(buf, 64, Shape{64});
    Work w =
        r.rank() == 0 ? r.send(r.full(Shape{64}, 1.0f), 1, Async::Yes) : r.recv(in_flight, 0, Async::Yes);
    if (r.rank() == 1) r.scale_(same_half ? in_flight : other, 2.0f);
    w.wait();
    r.synchronize();
  });
}

TEST(Views, AsyncCommunicationGuardsOnlyTheElementsItUses) {
  EXPECT_EQ(touch_while_receiving(false), "");
  const std::string msg = touch_while_receiving(true);
  EXPECT_NE(msg.find("scale_: float32[64] is still in use by"), std::string::npos) << msg;
}

TEST(Views, TheBaseOfAViewInFlightIsGuardedToo) {
  const std::string msg = run_error_message(2, [](Rank& r) {
    Tensor buf = r.zeros(Shape{128});
    Work w = r.all_reduce(r.view(buf, 32, Shape{32}), ReduceOp::Sum, Async::Yes);
    r.scale_(buf, 2.0f);
    w.wait();
  });
  EXPECT_NE(msg.find("scale_: float32[128] is still in use by"), std::string::npos) << msg;
}

TEST(Views, InPlaceAllGatherAndReduceScatterOnOneBuffer) {
  // NCCL's in-place forms: all_gather's input is this rank's slot of its output; reduce_scatter's output is
  // this rank's slot of its input (what Megatron's distributed optimizer does with a bucket's buffers).
  const int world = 4;
  const auto seen = run_collect<std::vector<float>>(world, [](Rank& r) {
    const std::int64_t n = 3;
    Tensor gathered = r.full(Shape{4 * n}, -7.0f);
    Tensor mine = r.view(gathered, r.rank() * n, Shape{n});
    r.copy_(mine, r.full(Shape{n}, static_cast<float>(r.rank() + 1)));
    r.all_gather(gathered, mine);
    Tensor grads = r.arange(Shape{4 * n}, static_cast<float>(r.rank()));
    Tensor shard = r.view(grads, r.rank() * n, Shape{n});
    r.reduce_scatter(shard, grads, ReduceOp::Sum);
    std::vector<float> out = r.to_host(gathered);
    const std::vector<float> s = r.to_host(shard);
    out.insert(out.end(), s.begin(), s.end());
    return out;
  });
  for (int rank = 0; rank < world; ++rank) {
    std::vector<float> want{1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4};
    // Element i of the sum over ranks of arange(12) + rank: 4 i + 0 + 1 + 2 + 3.
    for (int i = 0; i < 3; ++i) want.push_back(4.0f * (rank * 3 + i) + 6.0f);
    EXPECT_EQ(seen[rank], want) << "rank " << rank;
  }
}

}  // namespace
}  // namespace ranklab
