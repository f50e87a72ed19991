#include "common/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>

#include "common/errors.h"
#include "common/measurements.h"

namespace ranklab {

namespace {

struct Step {
  CommOp op;
  std::int64_t bytes;
};

std::vector<const CollectiveRecord*> in_start_order(const RunReport& r) {
  std::vector<const CollectiveRecord*> order;
  for (const CollectiveRecord& c : r.collectives) order.push_back(&c);
  std::stable_sort(order.begin(), order.end(), [](const CollectiveRecord* a, const CollectiveRecord* b) {
    return a->start_us < b->start_us;
  });
  return order;
}

// The element type whose size divides the buffer, so the replay moves exactly the measured bytes; a size
// no element divides is rounded up to whole float32 elements (label_as_replay restores the label).
DType element_type(std::int64_t bytes, std::int64_t pieces) {
  if (bytes % (4 * pieces) == 0) return DType::Float32;
  return DType::BFloat16;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// The tensors one step launches on, made once however often it is launched.
struct StepTensors {
  Tensor big, small, extra;
};

StepTensors tensors_for(Rank& r, const Step& s) {
  const int n = r.world_size();
  // The buffer is split in n pieces by the gathers and scatters (nccl-tests' size is the whole buffer).
  const bool split = s.op == CommOp::AllGather || s.op == CommOp::ReduceScatter || s.op == CommOp::Gather ||
                     s.op == CommOp::Scatter || s.op == CommOp::AllToAll;
  const DType dtype = element_type(s.bytes, split ? n : 1);
  const std::int64_t piece =
      std::max<std::int64_t>(1, ceil_div(s.bytes, dtype_bytes(dtype) * (split ? n : 1)));
  const std::int64_t whole = split ? piece * n : piece;
  StepTensors t;
  t.big = r.phantom({whole}, dtype);
  t.small = split && s.op != CommOp::AllToAll ? r.phantom({piece}, dtype) : t.big;
  if (s.op == CommOp::AllToAll) t.extra = r.phantom({whole}, dtype);
  if (s.op == CommOp::Send || s.op == CommOp::Recv) t.extra = r.phantom({piece}, dtype);
  return t;
}

// One launch of the step's collective.
void launch(Rank& r, const Step& s, const StepTensors& t) {
  const int n = r.world_size();
  switch (s.op) {
    case CommOp::AllReduce:
      r.all_reduce(t.big, ReduceOp::Sum);
      break;
    case CommOp::Broadcast:
      r.broadcast(t.big, 0);
      break;
    case CommOp::Reduce:
      r.reduce(t.big, 0, ReduceOp::Sum);
      break;
    case CommOp::AllGather:
      r.all_gather(t.big, t.small);
      break;
    case CommOp::ReduceScatter:
      r.reduce_scatter(t.small, t.big, ReduceOp::Sum);
      break;
    case CommOp::Gather:
      r.gather(t.big, t.small, 0);
      break;
    case CommOp::Scatter:
      r.scatter(t.small, t.big, 0);
      break;
    case CommOp::AllToAll:
      r.all_to_all(t.extra, t.big);
      break;
    case CommOp::Send:
    case CommOp::Recv: {
      // nccl-tests' sendrecv: every rank sends to the next and receives from the previous.
      std::vector<Rank::P2POp> ops = {{CommOp::Send, t.big, (r.rank() + 1) % n},
                                      {CommOp::Recv, t.extra, (r.rank() + n - 1) % n}};
      for (Work& w : r.batch_isend_irecv(ops)) w.wait();
      break;
    }
    case CommOp::Barrier:
      r.barrier();
      break;
  }
}

// The region around each timed loop of an nccl-tests replay: its host time is what nccl-tests' timer reads.
constexpr const char* kTimedLoopRegion = "nccl-tests timed loop";

}  // namespace

std::function<void(Rank&)> replay_program(const RunReport& measured) {
  auto steps = std::make_shared<std::vector<Step>>();
  for (const CollectiveRecord* c : in_start_order(measured)) {
    if (c->group_size != measured.world) {
      throw UsageError(fmt::format(
          "replaying {}: a {} of {} ranks in a run of {}; only collectives of the whole world can be "
          "replayed — simulate the program that made the measurement and compare its report instead",
          measured.lesson, comm_op_name(c->op), c->group_size, measured.world));
    }
    steps->push_back({c->op, c->bytes});
  }
  const std::optional<NcclTestsLoop> loop = nccl_tests_loop(measured);
  if (!loop) {
    return [steps](Rank& r) {
      for (const Step& s : *steps) {
        launch(r, s, tensors_for(r, s));
        r.synchronize();
      }
    };
  }
  return [steps, loop = *loop](Rank& r) {
    // nccl-tests' TimeTest: every size warmed up first, untimed.
    for (std::size_t k = 0; k < steps->size(); ++k) {
      const Step& s = (*steps)[k];
      if (k > 0 && s.op == (*steps)[k - 1].op && s.bytes == (*steps)[k - 1].bytes) continue;
      const StepTensors t = tensors_for(r, s);
      for (int i = 0; i < loop.warmup_iters; ++i) launch(r, s, t);
      r.synchronize();
    }
    // Then BenchTime per row: the ranks line up on the host, and the timer runs from before the first
    // launch to after the synchronize that follows the last.
    for (const Step& s : *steps) {
      const StepTensors t = tensors_for(r, s);
      r.barrier();
      auto timed = r.region(kTimedLoopRegion);
      for (int i = 0; i < loop.iters; ++i) launch(r, s, t);
      r.synchronize();
    }
  };
}

namespace {

// An nccl-tests replay: one collective per timed loop, timed as nccl-tests prints it (the loop's host time
// over its iterations, averaged over the ranks), in place of the loop's many launches.
void label_timed_loops(RunReport& replayed, const std::vector<const CollectiveRecord*>& want, int iters) {
  std::map<int, std::vector<const RegionRecord*>> loops;  // by rank, in start order
  for (const RegionRecord& g : replayed.regions) {
    if (g.name == kTimedLoopRegion) loops[g.rank].push_back(&g);
  }
  for (auto& [rank, list] : loops) {
    std::stable_sort(list.begin(), list.end(),
                     [](const RegionRecord* a, const RegionRecord* b) { return a->start_us < b->start_us; });
    if (list.size() != want.size()) {
      throw UsageError(fmt::format("replaying {}: {} rows measured but rank {} timed {} loops",
                                   replayed.lesson, want.size(), rank, list.size()));
    }
  }
  if (loops.empty() && !want.empty()) {
    throw UsageError(fmt::format("replaying {}: the replay timed no loop", replayed.lesson));
  }
  std::vector<CollectiveRecord> launched = std::move(replayed.collectives);
  std::stable_sort(
      launched.begin(), launched.end(),
      [](const CollectiveRecord& a, const CollectiveRecord& b) { return a.start_us < b.start_us; });
  replayed.collectives.clear();
  for (std::size_t k = 0; k < want.size(); ++k) {
    double start_us = INFINITY, sum_us = 0;
    for (const auto& [rank, list] : loops) {
      start_us = std::min(start_us, list[k]->start_us);
      sum_us += list[k]->end_us - list[k]->start_us;
    }
    CollectiveRecord c = *want[k];
    c.start_us = start_us;
    c.end_us = start_us + sum_us / static_cast<double>(loops.size()) / iters;
    // The algorithm of the loop's first launch.
    auto first = std::lower_bound(launched.begin(), launched.end(), start_us,
                                  [](const CollectiveRecord& a, double t) { return a.start_us < t; });
    c.algorithm = first != launched.end() ? first->algorithm : SpanName();
    const double t = c.time_us();
    c.algbw_gbps = t > 0 ? static_cast<double>(c.bytes) / (t * 1e3) : 0;
    c.busbw_gbps = c.algbw_gbps * bus_factor(c.op, c.group_size);
    replayed.collectives.push_back(c);
  }
  std::erase_if(replayed.regions, [](const RegionRecord& g) { return g.name == kTimedLoopRegion; });
}

}  // namespace

void label_as_replay(RunReport& replayed, const RunReport& measured) {
  replayed.lesson = measured.lesson;
  if (const std::optional<NcclTestsLoop> loop = nccl_tests_loop(measured)) {
    label_timed_loops(replayed, in_start_order(measured), loop->iters);
    return;
  }
  // The replay ran the measured collectives one at a time in the measured order: the k-th it recorded is
  // the k-th measured, whose size (before rounding to whole elements) and group name it takes.
  const std::vector<const CollectiveRecord*> want = in_start_order(measured);
  std::stable_sort(
      replayed.collectives.begin(), replayed.collectives.end(),
      [](const CollectiveRecord& a, const CollectiveRecord& b) { return a.start_us < b.start_us; });
  if (replayed.collectives.size() != want.size()) {
    throw UsageError(fmt::format("replaying {}: {} collectives measured but {} replayed", measured.lesson,
                                 want.size(), replayed.collectives.size()));
  }
  for (std::size_t k = 0; k < want.size(); ++k) {
    replayed.collectives[k].bytes = want[k]->bytes;
    replayed.collectives[k].group = want[k]->group;
  }
}

}  // namespace ranklab
