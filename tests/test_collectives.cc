// Every collective against a reference computed here on the host: world sizes 1 to 8, every ReduceOp,
// synchronous and async, on the world and on sub-groups.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>

#include "common/errors.h"
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

// ---- all_to_all with uneven splits (torch's all_to_all_single with split sizes) -------------------------

constexpr int kRowWidth = 2;

// Rows member i sends member j: 0 to 3, zero for some pairs (and for some members' own piece).
std::int64_t rows_sent(int i, int j) {
  return (i + 2 * j) % 4;
}

std::vector<std::int64_t> in_splits_of(int i, int n) {
  std::vector<std::int64_t> s(n);
  for (int j = 0; j < n; ++j) s[j] = rows_sent(i, j);
  return s;
}

std::vector<std::int64_t> out_splits_of(int i, int n) {
  std::vector<std::int64_t> s(n);
  for (int j = 0; j < n; ++j) s[j] = rows_sent(j, i);
  return s;
}

// Element c of row k of member i's input: distinct everywhere, so a misplaced row shows.
float uneven_value(int i, std::int64_t k, int c) {
  return static_cast<float>(100 * i + 10 * k + c);
}

class UnevenAllToAll : public ::testing::TestWithParam<int> {};

TEST_P(UnevenAllToAll, RowsGoWhereTheSplitsSay) {
  const int n = GetParam();
  auto got = run_collect<Values>(n, [&](Rank& r) {
    const std::vector<std::int64_t> in_splits = in_splits_of(r.rank(), n),
                                    out_splits = out_splits_of(r.rank(), n);
    const std::int64_t in_rows = std::accumulate(in_splits.begin(), in_splits.end(), std::int64_t{0});
    const std::int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), std::int64_t{0});
    Values v;
    for (std::int64_t k = 0; k < in_rows; ++k) {
      for (int c = 0; c < kRowWidth; ++c) v.push_back(uneven_value(r.rank(), k, c));
    }
    Tensor in = r.from_host({in_rows, kRowWidth}, v);
    Tensor out = r.full({out_rows, kRowWidth}, -1.0f);
    r.all_to_all(out, in, out_splits, in_splits);
    return r.to_host(out);
  });
  // Worked out on the host: member i's output is, for j = 0..n-1, the rows j sends i, which start in j's
  // input after the rows j sends to members 0..i-1.
  for (int i = 0; i < n; ++i) {
    Values want;
    for (int j = 0; j < n; ++j) {
      std::int64_t first = 0;
      for (int m = 0; m < i; ++m) first += rows_sent(j, m);
      for (std::int64_t k = first; k < first + rows_sent(j, i); ++k) {
        for (int c = 0; c < kRowWidth; ++c) want.push_back(uneven_value(j, k, c));
      }
    }
    expect_values(got[i], want, "uneven all_to_all rank " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(World, UnevenAllToAll, ::testing::Values(1, 3, 4, 5));

TEST(UnevenAllToAllCase, ThreeRanksByHand) {
  // Rank 0 sends [1 | 2 | -], rank 1 [- | - | 3 4], rank 2 [5 6 | 7 | 8]; rows of one number.
  const std::vector<std::vector<std::int64_t>> in = {{1, 1, 0}, {0, 0, 2}, {2, 1, 1}};
  const std::vector<Values> data = {{1, 2}, {3, 4}, {5, 6, 7, 8}};
  auto got = run_collect<Values>(3, [&](Rank& r) {
    const int i = r.rank();
    const std::vector<std::int64_t> out_splits = {in[0][i], in[1][i], in[2][i]};
    Tensor t_in = r.from_host({static_cast<std::int64_t>(data[i].size()), 1}, data[i]);
    Tensor t_out = r.zeros({out_splits[0] + out_splits[1] + out_splits[2], 1});
    r.all_to_all(t_out, t_in, out_splits, in[i]);
    return r.to_host(t_out);
  });
  expect_values(got[0], {1, 5, 6}, "rank 0");
  expect_values(got[1], {2, 7}, "rank 1");
  expect_values(got[2], {3, 4, 8}, "rank 2");
}

struct Timed {
  Values out;
  double us = 0;
};

// all_to_all of `rows_per_peer` rows of 3 to each of 4 ranks, as the even call or with equal splits.
std::vector<Timed> timed_all_to_all(std::int64_t rows_per_peer, bool uneven) {
  const int n = 4;
  return run_collect<Timed>(n, [&](Rank& r) {
    const std::int64_t rows = rows_per_peer * n;
    Tensor in = r.from_host({rows, 3}, input_of(r.rank(), static_cast<int>(rows * 3)));
    Tensor out = r.zeros({rows, 3});
    r.synchronize();
    const double t0 = r.now();
    if (uneven) {
      const std::vector<std::int64_t> splits(n, rows_per_peer);
      r.all_to_all(out, in, splits, splits);
    } else {
      r.all_to_all(out, in);
    }
    r.synchronize();
    return Timed{r.to_host(out), r.now() - t0};
  });
}

TEST(UnevenAllToAllCase, EqualSplitsAreTheEvenCallInNumbersAndTime) {
  for (const std::int64_t rows_per_peer : {1, 4096}) {  // LL and Simple
    const std::vector<Timed> even = timed_all_to_all(rows_per_peer, false);
    const std::vector<Timed> split = timed_all_to_all(rows_per_peer, true);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(split[i].out, even[i].out) << "rank " << i;
      EXPECT_EQ(split[i].us, even[i].us) << "rank " << i;  // bit for bit
    }
  }
}

double uneven_time_us(const std::vector<std::vector<std::int64_t>>& rows, std::int64_t width) {
  const int n = static_cast<int>(rows.size());
  auto times = run_collect<double>(n, [&](Rank& r) {
    const int i = r.rank();
    std::vector<std::int64_t> out_splits(n);
    std::int64_t in_rows = 0, out_rows = 0;
    for (int j = 0; j < n; ++j) {
      out_splits[j] = rows[j][i];
      in_rows += rows[i][j];
      out_rows += rows[j][i];
    }
    Tensor in = r.phantom({in_rows, width});
    Tensor out = r.phantom({out_rows, width});
    r.synchronize();
    const double t0 = r.now();
    r.all_to_all(out, in, out_splits, rows[i]);
    r.synchronize();
    return r.now() - t0;
  });
  return *std::max_element(times.begin(), times.end());
}

TEST(UnevenAllToAllCase, TheLargestPairSetsTheTime) {
  // 768 MiB in all over 4 GPUs of one NVSwitch node, large enough that latency hardly counts. Spread as
  // 64 MiB per ordered pair, every GPU's NVLink carries 192 MiB each way; all of it from rank 0 to rank 1,
  // that one pair's path carries 768 MiB, and the all_to_all takes about four times as long.
  const std::int64_t width = 1024, mib_rows = 256;  // a row of 4 KiB, 256 rows per MiB
  std::vector<std::vector<std::int64_t>> spread(4, std::vector<std::int64_t>(4, 64 * mib_rows));
  for (int i = 0; i < 4; ++i) spread[i][i] = 0;
  std::vector<std::vector<std::int64_t>> one_pair(4, std::vector<std::int64_t>(4, 0));
  one_pair[0][1] = 768 * mib_rows;
  const double spread_us = uneven_time_us(spread, width), one_pair_us = uneven_time_us(one_pair, width);
  // NCCL's pieces: a spread pair's 64 MiB goes as 8 pieces of 8 MiB (16 steps of 512 KiB, 17/16 with the
  // pipeline's fill), the one pair's 768 MiB as 32 pieces of 24 MiB (49/48).
  EXPECT_NEAR(one_pair_us / spread_us, 4.0 * (49.0 / 48) / (17.0 / 16), 0.1)
      << spread_us << " vs " << one_pair_us;
  // One more MiB to one peer takes longer than the same bytes spread.
  std::vector<std::vector<std::int64_t>> more = spread;
  more[0][2] += mib_rows;
  EXPECT_GT(uneven_time_us(more, width), spread_us);
}

TEST(UnevenAllToAllCase, SplitsThatDisagreeNameBothRanksAndCounts) {
  SimBackend backend(testing::quiet_config());
  try {
    backend.launch(3, [](Rank& r) {
      // Rank 0 sends rank 2 two rows; rank 2 expects one.
      const std::vector<std::vector<std::int64_t>> in = {{1, 1, 2}, {1, 1, 1}, {1, 1, 1}};
      std::vector<std::int64_t> out_splits = {in[0][r.rank()], in[1][r.rank()], in[2][r.rank()]};
      if (r.rank() == 2) out_splits[0] = 1;
      const std::int64_t in_rows = in[r.rank()][0] + in[r.rank()][1] + in[r.rank()][2];
      r.all_to_all(r.zeros({out_splits[0] + out_splits[1] + out_splits[2], 2}), r.zeros({in_rows, 2}),
                   out_splits, in[r.rank()]);
    });
    ADD_FAILURE() << "no error";
  } catch (const MismatchError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0 sends 2 rows to rank 2, but rank 2 expects 1 rows from rank 0"),
              std::string::npos)
        << msg;
  }
}

TEST(UnevenAllToAllCase, SplitsThatDoNotFitTheTensorsAreAUsageError) {
  auto error = [](const std::function<void(Rank&)>& fn) -> std::string {
    SimBackend backend(testing::quiet_config());
    try {
      backend.launch(2, fn);
    } catch (const UsageError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no error";
    return "";
  };
  std::string msg = error([](Rank& r) { r.all_to_all(r.zeros({3, 2}), r.zeros({3, 2}), {1, 2}, {2, 2}); });
  EXPECT_NE(msg.find("all_to_all: 'in_splits' = [2, 2] sums to 4 rows but 'in' is float32[3, 2]"),
            std::string::npos)
      << msg;
  msg = error([](Rank& r) { r.all_to_all(r.zeros({3, 2}), r.zeros({3, 2}), {3}, {1, 2}); });
  EXPECT_NE(msg.find("'out_splits' has 1 entries but the group has 2 ranks"), std::string::npos) << msg;
  msg = error([](Rank& r) { r.all_to_all(r.zeros({3, 2}), r.zeros({3, 2}), {4, -1}, {1, 2}); });
  EXPECT_NE(msg.find("'out_splits'[1] is -1"), std::string::npos) << msg;
  msg = error([](Rank& r) { r.all_to_all(r.zeros({3, 4}), r.zeros({3, 2}), {1, 2}, {1, 2}); });
  EXPECT_NE(msg.find("differ in shape beyond dimension 0"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ranklab
