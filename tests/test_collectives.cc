// Every collective against a reference computed here on the host: world sizes 1 to 8, every ReduceOp,
// synchronous and async, on the world and on sub-groups.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "sim_fixture.h"

namespace ranklab {
namespace {

using testing::run_collect;
using Values = std::vector<float>;

// Small positive integers, so Prod stays exact in float32 for up to 8 ranks.
float input_value(int rank, int i) {
  return static_cast<float>((rank * 7 + i * 3) % 5 + 1);
}

Values input_of(int rank, int n) {
  Values v(n);
  for (int i = 0; i < n; ++i) v[i] = input_value(rank, i);
  return v;
}

float reduce_ref(ReduceOp op, const std::vector<int>& ranks, int i) {
  float acc = input_value(ranks[0], i);
  for (size_t j = 1; j < ranks.size(); ++j) {
    const float x = input_value(ranks[j], i);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc += x;
        break;
      case ReduceOp::Max:
        acc = std::max(acc, x);
        break;
      case ReduceOp::Min:
        acc = std::min(acc, x);
        break;
      case ReduceOp::Prod:
        acc *= x;
        break;
    }
  }
  return op == ReduceOp::Avg ? acc / static_cast<float>(ranks.size()) : acc;
}

std::vector<int> all_ranks(int w) {
  std::vector<int> r(w);
  for (int i = 0; i < w; ++i) r[i] = i;
  return r;
}

void expect_values(const Values& got, const Values& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << where << " element " << i;
}

Work maybe_wait(Work w) {
  w.wait();
  return w;
}

class Collectives : public ::testing::TestWithParam<std::tuple<int, ReduceOp, Async>> {
 protected:
  int w() const { return std::get<0>(GetParam()); }
  ReduceOp op() const { return std::get<1>(GetParam()); }
  Async async() const { return std::get<2>(GetParam()); }
};

constexpr int kChunk = 3;  // elements per rank-piece

TEST_P(Collectives, AllReduce) {
  const int n = 2 * kChunk + 1;
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor t = r.from_host({n}, input_of(r.rank(), n));
    maybe_wait(r.all_reduce(t, op(), async()));
    return r.to_host(t);
  });
  for (int rank = 0; rank < w(); ++rank) {
    Values want(n);
    for (int i = 0; i < n; ++i) want[i] = reduce_ref(op(), all_ranks(w()), i);
    expect_values(got[rank], want, "rank " + std::to_string(rank));
  }
}

TEST_P(Collectives, ReduceToLastRank) {
  const int n = 5, root = w() - 1;
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor t = r.from_host({n}, input_of(r.rank(), n));
    maybe_wait(r.reduce(t, root, op(), async()));
    return r.to_host(t);
  });
  Values want(n);
  for (int i = 0; i < n; ++i) want[i] = reduce_ref(op(), all_ranks(w()), i);
  expect_values(got[root], want, "root");
  for (int rank = 0; rank < w(); ++rank) {
    if (rank != root) expect_values(got[rank], input_of(rank, n), "non-root keeps its input");
  }
}

TEST_P(Collectives, ReduceScatter) {
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor in = r.from_host({w() * kChunk}, input_of(r.rank(), w() * kChunk));
    Tensor out = r.zeros({kChunk});
    maybe_wait(r.reduce_scatter(out, in, op(), async()));
    return r.to_host(out);
  });
  for (int rank = 0; rank < w(); ++rank) {
    Values want(kChunk);
    for (int i = 0; i < kChunk; ++i) want[i] = reduce_ref(op(), all_ranks(w()), rank * kChunk + i);
    expect_values(got[rank], want, "rank " + std::to_string(rank));
  }
}

INSTANTIATE_TEST_SUITE_P(WorldOpMode, Collectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max,
                                                              ReduceOp::Min, ReduceOp::Prod),
                                            ::testing::Values(Async::No, Async::Yes)));

// The collectives without a reduce op, per world size and mode.
class DataMovement : public ::testing::TestWithParam<std::tuple<int, Async>> {
 protected:
  int w() const { return std::get<0>(GetParam()); }
  Async async() const { return std::get<1>(GetParam()); }
};

TEST_P(DataMovement, Broadcast) {
  const int root = w() / 2;
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor t = r.from_host({4}, input_of(r.rank(), 4));
    maybe_wait(r.broadcast(t, root, async()));
    return r.to_host(t);
  });
  for (int rank = 0; rank < w(); ++rank) expect_values(got[rank], input_of(root, 4), "broadcast");
}

TEST_P(DataMovement, AllGather) {
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor in = r.from_host({1, kChunk}, input_of(r.rank(), kChunk));
    Tensor out = r.zeros({w(), kChunk});
    maybe_wait(r.all_gather(out, in, async()));
    return r.to_host(out);
  });
  Values want;
  for (int rank = 0; rank < w(); ++rank) {
    Values piece = input_of(rank, kChunk);
    want.insert(want.end(), piece.begin(), piece.end());
  }
  for (int rank = 0; rank < w(); ++rank) expect_values(got[rank], want, "all_gather");
}

TEST_P(DataMovement, ScatterFromRootOne) {
  const int root = w() > 1 ? 1 : 0;
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor in = r.rank() == root ? r.from_host({w() * kChunk}, input_of(root, w() * kChunk)) : Tensor();
    Tensor out = r.zeros({kChunk});
    maybe_wait(r.scatter(out, in, root, async()));
    return r.to_host(out);
  });
  const Values all = input_of(root, w() * kChunk);
  for (int rank = 0; rank < w(); ++rank) {
    expect_values(got[rank], Values(all.begin() + rank * kChunk, all.begin() + (rank + 1) * kChunk),
                  "scatter");
  }
}

TEST_P(DataMovement, GatherToRootZero) {
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor in = r.from_host({kChunk}, input_of(r.rank(), kChunk));
    Tensor out = r.rank() == 0 ? r.zeros({w() * kChunk}) : Tensor();
    maybe_wait(r.gather(out, in, 0, async()));
    return r.rank() == 0 ? r.to_host(out) : Values{};
  });
  Values want;
  for (int rank = 0; rank < w(); ++rank) {
    Values piece = input_of(rank, kChunk);
    want.insert(want.end(), piece.begin(), piece.end());
  }
  expect_values(got[0], want, "gather");
}

TEST_P(DataMovement, AllToAllTransposes) {
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    Tensor in = r.from_host({w() * kChunk}, input_of(r.rank(), w() * kChunk));
    Tensor out = r.zeros({w() * kChunk});
    maybe_wait(r.all_to_all(out, in, async()));
    return r.to_host(out);
  });
  for (int i = 0; i < w(); ++i) {
    Values want;
    for (int j = 0; j < w(); ++j) {
      Values from_j = input_of(j, w() * kChunk);
      want.insert(want.end(), from_j.begin() + i * kChunk, from_j.begin() + (i + 1) * kChunk);
    }
    expect_values(got[i], want, "all_to_all rank " + std::to_string(i));
  }
}

TEST_P(DataMovement, SendRecvAroundARing) {
  if (w() < 2) GTEST_SKIP() << "a ring needs two ranks";
  auto got = run_collect<Values>(w(), [&](Rank& r) {
    const int next = (r.rank() + 1) % w(), prev = (r.rank() + w() - 1) % w();
    Tensor mine = r.from_host({4}, input_of(r.rank(), 4));
    Tensor from_prev = r.zeros({4});
    // Even ranks send first and odd ranks receive first, so blocking calls cannot deadlock.
    if (r.rank() % 2 == 0) {
      maybe_wait(r.send(mine, next, async()));
      maybe_wait(r.recv(from_prev, prev, async()));
    } else {
      maybe_wait(r.recv(from_prev, prev, async()));
      maybe_wait(r.send(mine, next, async()));
    }
    return r.to_host(from_prev);
  });
  for (int rank = 0; rank < w(); ++rank)
    expect_values(got[rank], input_of((rank + w() - 1) % w(), 4), "ring");
}

INSTANTIATE_TEST_SUITE_P(WorldMode, DataMovement,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(Async::No, Async::Yes)));

TEST(SubGroups, EachGroupReducesOnlyItsMembers) {
  // Two interleaved groups, as tensor parallelism inside a node and data parallelism across nodes use.
  auto got = run_collect<Values>(4, [&](Rank& r) {
    Group even = r.new_group({0, 2});
    Group odd = r.new_group({3, 1});  // group order, not rank order, decides all_gather's layout
    Tensor t = r.from_host({3}, input_of(r.rank(), 3));
    Tensor gathered = r.zeros({6});
    if (r.rank() % 2 == 0) {
      r.all_reduce(t, ReduceOp::Sum, Async::No, even);
    } else {
      Tensor mine = r.from_host({3}, input_of(r.rank(), 3));
      r.all_gather(gathered, mine, Async::Yes, odd).wait();
      r.all_reduce(t, ReduceOp::Max, Async::No, odd);
    }
    Values v = r.to_host(t), g = r.to_host(gathered);
    v.insert(v.end(), g.begin(), g.end());
    return v;
  });
  for (int rank : {0, 2}) {
    for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(got[rank][i], input_value(0, i) + input_value(2, i));
  }
  for (int rank : {1, 3}) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_FLOAT_EQ(got[rank][i], std::max(input_value(1, i), input_value(3, i)));
      EXPECT_FLOAT_EQ(got[rank][3 + i], input_value(3, i));  // group member 0 is rank 3
      EXPECT_FLOAT_EQ(got[rank][6 + i], input_value(1, i));
    }
  }
}

TEST(SubGroups, AllReduceWithinNodesThenAcrossEqualsWorldAllReduce) {
  // The hierarchical all-reduce: the same buffer goes through two groups, in order.
  const int w = 8;
  auto got = run_collect<Values>(w, [&](Rank& r) {
    std::vector<Group> halves = {r.new_group({0, 1, 2, 3}), r.new_group({4, 5, 6, 7})};
    std::vector<Group> pairs;
    for (int i = 0; i < 4; ++i) pairs.push_back(r.new_group({i, i + 4}));
    Tensor t = r.from_host({5}, input_of(r.rank(), 5));
    r.all_reduce(t, ReduceOp::Sum, Async::No, halves[r.rank() / 4]);
    r.all_reduce(t, ReduceOp::Sum, Async::No, pairs[r.rank() % 4]);
    return r.to_host(t);
  });
  for (int rank = 0; rank < w; ++rank) {
    for (int i = 0; i < 5; ++i) EXPECT_FLOAT_EQ(got[rank][i], reduce_ref(ReduceOp::Sum, all_ranks(w), i));
  }
}

}  // namespace
}  // namespace ranklab
