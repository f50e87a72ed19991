// FrontQueue (sim/front_queue.h): items leave from the front in the order they came, what leaves is let go
// of at once, and the items that stay keep their order and values across the compaction that reclaims
// the front.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "sim/front_queue.h"

namespace ranklab::sim {
namespace {

std::vector<int> contents(const FrontQueue<int>& q) {
  return std::vector<int>(q.begin(), q.end());
}

TEST(FrontQueue, ItemsLeaveFromTheFrontInOrderAcrossCompactions) {
  FrontQueue<int> q;
  int next_in = 0, next_out = 0;
  // Three in, two out, many times: the front is reclaimed again and again while items remain.
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < 3; ++i) q.push_back(next_in++);
    ASSERT_EQ(q.front(), next_out) << "round " << round;
    for (int i = 0; i < 2; ++i) EXPECT_EQ(q[static_cast<std::size_t>(i)], next_out + i);
    q.pop_front(2);
    next_out += 2;
  }
  EXPECT_EQ(q.size(), static_cast<std::size_t>(next_in - next_out));
  std::vector<int> want;
  for (int v = next_out; v < next_in; ++v) want.push_back(v);
  EXPECT_EQ(contents(q), want);
  q.pop_front(q.size());
  EXPECT_TRUE(q.empty());
}

TEST(FrontQueue, WhatLeavesIsLetGoOfAtOnce) {
  FrontQueue<std::shared_ptr<int>> q;
  auto first = std::make_shared<int>(1), second = std::make_shared<int>(2);
  q.push_back(first);
  q.push_back(second);
  q.pop_front(1);
  EXPECT_EQ(first.use_count(), 1);  // not kept until the front is reclaimed
  EXPECT_EQ(second.use_count(), 2);
  EXPECT_EQ(*q.front(), 2);
}

TEST(FrontQueue, EraseIfKeepsTheOthersInOrder) {
  FrontQueue<int> q;
  for (int v = 0; v < 40; ++v) q.push_back(v);
  q.pop_front(17);
  q.erase_if([](int v) { return v % 3 == 0; });
  std::vector<int> want;
  for (int v = 17; v < 40; ++v) {
    if (v % 3 != 0) want.push_back(v);
  }
  EXPECT_EQ(contents(q), want);
  q.push_back(40);
  EXPECT_EQ(q[q.size() - 1], 40);
}

}  // namespace
}  // namespace ranklab::sim
