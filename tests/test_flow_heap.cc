// FlowHeap (sim/net/flow_heap.h): one entry per flow, earliest time first and ties by flow id, whatever
// mix of setting, re-timing, erasing and bulk changes brought it there; checked against a sorted model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "sim/net/flow_heap.h"

namespace ranklab::sim {
namespace {

// The model: flow -> time, and the order FlowHeap must give.
using Model = std::map<std::uint32_t, double>;
std::set<std::pair<double, std::uint32_t>> order_of(const Model& m) {
  std::set<std::pair<double, std::uint32_t>> out;
  for (const auto& [flow, at] : m) out.emplace(at, flow);
  return out;
}

TEST(FlowHeap, PopsEarliestFirstTiesByFlowAfterAnyMixOfChanges) {
  std::mt19937 rng(7);
  FlowHeap heap;
  Model model;
  // Few distinct times, so that ties are common.
  auto time = [&] { return static_cast<double>(rng() % 50); };
  for (int step = 0; step < 20000; ++step) {
    const std::uint32_t flow = rng() % 3000;
    switch (rng() % 6) {
      case 0:
      case 1:
        heap.set(flow, model[flow] = time());
        break;
      case 2:
        heap.erase(flow);
        model.erase(flow);
        break;
      case 3: {
        // A sharing re-times a batch: sometimes a few (one by one), sometimes most (in place, rebuilt).
        std::vector<FlowHeap::Entry> batch;
        const std::uint32_t n = rng() % 2 == 0 ? 3 : 2000;
        for (std::uint32_t i = 0; i < n; ++i) {
          const std::uint32_t f = rng() % 3000;
          if (std::any_of(batch.begin(), batch.end(), [&](const FlowHeap::Entry& e) { return e.flow == f; }))
            continue;
          batch.push_back({time(), f});
          model[f] = batch.back().at_us;
        }
        heap.set_all(batch);
        break;
      }
      case 5: {
        // A transfer's flows end together: a few of the heap or most of it.
        std::vector<std::uint32_t> ended;
        const std::size_t n = rng() % 2 == 0 ? 2 : model.size() / 2;
        for (auto it = model.begin(); it != model.end() && ended.size() < n;) {
          if (rng() % 2 == 0) {
            ended.push_back(it->first);
            it = model.erase(it);
          } else {
            ++it;
          }
        }
        for (std::uint32_t f : ended) heap.erase(f);
        break;
      }
      case 4: {
        if (heap.empty()) break;
        const auto want = *order_of(model).begin();
        ASSERT_EQ(heap.top().at_us, want.first) << "step " << step;
        ASSERT_EQ(heap.top().flow, want.second) << "step " << step;
        heap.pop();
        model.erase(want.second);
        break;
      }
    }
    ASSERT_EQ(heap.size(), model.size()) << "step " << step;
  }
  // What is left comes out in order.
  for (const auto& [at, flow] : order_of(model)) {
    ASSERT_FALSE(heap.empty());
    EXPECT_EQ(heap.top().at_us, at);
    EXPECT_EQ(heap.top().flow, flow);
    heap.pop();
  }
  EXPECT_TRUE(heap.empty());
}

TEST(FlowHeap, TakesEveryDueEntryOnceWhetherFewOrMany) {
  for (const int flows : {10, 5000}) {
    FlowHeap heap;
    for (int f = 0; f < flows; ++f) heap.set(static_cast<std::uint32_t>(f), static_cast<double>(f % 100));
    std::set<std::uint32_t> taken;
    heap.take_due(49.0, [&](const FlowHeap::Entry& e) {
      EXPECT_LE(e.at_us, 49.0);
      EXPECT_TRUE(taken.insert(e.flow).second) << "flow " << e.flow << " taken twice";
    });
    std::size_t due = 0;
    for (int f = 0; f < flows; ++f) due += f % 100 <= 49;
    EXPECT_EQ(taken.size(), due) << flows << " flows";
    EXPECT_EQ(heap.size(), static_cast<std::size_t>(flows) - due);
    // The rest keep their order, and a taken flow can come back.
    double last = -1;
    std::uint32_t last_flow = 0;
    heap.set(0, 60.0);
    while (!heap.empty()) {
      const FlowHeap::Entry e = heap.top();
      EXPECT_TRUE(e.at_us > last || (e.at_us == last && e.flow > last_flow));
      EXPECT_GE(e.at_us, 50.0);
      last = e.at_us, last_flow = e.flow;
      heap.pop();
    }
  }
}

}  // namespace
}  // namespace ranklab::sim
