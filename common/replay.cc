#include "common/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "common/errors.h"

namespace ranklab {

namespace {

struct Step {
  CommOp op;
  std::int64_t bytes;
  bool in_place_region;  // time this one inside a region named `region`
  std::string region;
};

// The element type whose size divides the buffer, so the replay moves exactly the measured bytes; a size
// no element divides is rounded up to whole float32 elements (label_as_replay restores the label).
DType element_type(std::int64_t bytes, std::int64_t pieces) {
  if (bytes % (4 * pieces) == 0) return DType::Float32;
  return DType::BFloat16;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

void run_step(Rank& r, const Step& s) {
  const int n = r.world_size();
  // The buffer is split in n pieces by the gathers and scatters (nccl-tests' size is the whole buffer).
  const bool split = s.op == CommOp::AllGather || s.op == CommOp::ReduceScatter || s.op == CommOp::Gather ||
                     s.op == CommOp::Scatter || s.op == CommOp::AllToAll;
  const DType dtype = element_type(s.bytes, split ? n : 1);
  const std::int64_t piece =
      std::max<std::int64_t>(1, ceil_div(s.bytes, dtype_bytes(dtype) * (split ? n : 1)));
  const std::int64_t whole = split ? piece * n : piece;
  Tensor big = r.phantom({whole}, dtype);
  Tensor small = split && s.op != CommOp::AllToAll ? r.phantom({piece}, dtype) : big;
  switch (s.op) {
    case CommOp::AllReduce:
      r.all_reduce(big, ReduceOp::Sum);
      break;
    case CommOp::Broadcast:
      r.broadcast(big, 0);
      break;
    case CommOp::Reduce:
      r.reduce(big, 0, ReduceOp::Sum);
      break;
    case CommOp::AllGather:
      r.all_gather(big, small);
      break;
    case CommOp::ReduceScatter:
      r.reduce_scatter(small, big, ReduceOp::Sum);
      break;
    case CommOp::Gather:
      r.gather(big, small, 0);
      break;
    case CommOp::Scatter:
      r.scatter(small, big, 0);
      break;
    case CommOp::AllToAll: {
      Tensor out = r.phantom({whole}, dtype);
      r.all_to_all(out, big);
      break;
    }
    case CommOp::Send:
    case CommOp::Recv: {
      // nccl-tests' sendrecv: every rank sends to the next and receives from the previous.
      Tensor in = r.phantom({piece}, dtype);
      std::vector<Rank::P2POp> ops = {{CommOp::Send, big, (r.rank() + 1) % n},
                                      {CommOp::Recv, in, (r.rank() + n - 1) % n}};
      for (Work& w : r.batch_isend_irecv(ops)) w.wait();
      break;
    }
    case CommOp::Barrier:
      r.barrier();
      break;
  }
}

}  // namespace

std::function<void(Rank&)> replay_program(const RunReport& measured) {
  std::vector<const CollectiveRecord*> order;
  for (const CollectiveRecord& c : measured.collectives) {
    if (c.group_size != measured.world) {
      throw UsageError(fmt::format(
          "replaying {}: a {} of {} ranks in a run of {}; only collectives of the whole world can be "
          "replayed — simulate the program that made the measurement and compare its report instead",
          measured.lesson, comm_op_name(c.op), c.group_size, measured.world));
    }
    order.push_back(&c);
  }
  std::stable_sort(order.begin(), order.end(), [](const CollectiveRecord* a, const CollectiveRecord* b) {
    return a->start_us < b->start_us;
  });
  auto steps = std::make_shared<std::vector<Step>>();
  for (const CollectiveRecord* c : order) {
    steps->push_back({c->op, c->bytes, false, ""});
    const std::string in_place = fmt::format("in-place {} {}", comm_op_name(c->op), c->bytes);
    const bool measured_in_place = std::any_of(measured.regions.begin(), measured.regions.end(),
                                               [&](const RegionRecord& g) { return g.name == in_place; });
    if (measured_in_place) steps->push_back({c->op, c->bytes, true, in_place});
  }
  return [steps](Rank& r) {
    for (const Step& s : *steps) {
      r.synchronize();
      if (s.in_place_region) r.region_begin(s.region);
      run_step(r, s);
      r.synchronize();
      if (s.in_place_region) r.region_end();
    }
  };
}

void label_as_replay(RunReport& replayed, const RunReport& measured) {
  replayed.lesson = measured.lesson;
  // The replay's collectives, in order, are the measured ones in start order (in-place repeats are inside
  // regions and recorded as collectives too: those are the even-numbered ones after each measured one).
  std::vector<const CollectiveRecord*> order;
  for (const CollectiveRecord& c : measured.collectives) order.push_back(&c);
  std::stable_sort(order.begin(), order.end(), [](const CollectiveRecord* a, const CollectiveRecord* b) {
    return a->start_us < b->start_us;
  });
  std::vector<CollectiveRecord*> replay;
  for (CollectiveRecord& c : replayed.collectives) replay.push_back(&c);
  std::stable_sort(replay.begin(), replay.end(), [](const CollectiveRecord* a, const CollectiveRecord* b) {
    return a->start_us < b->start_us;
  });
  // Drop the in-place repeats from the collectives: the regions carry their times.
  std::vector<CollectiveRecord> kept;
  std::size_t next = 0;
  for (CollectiveRecord* c : replay) {
    const bool inside_region =
        std::any_of(replayed.regions.begin(), replayed.regions.end(), [&](const RegionRecord& g) {
          return g.rank == 0 && g.start_us <= c->start_us && c->end_us <= g.end_us;
        });
    if (inside_region) continue;
    if (next < order.size() && c->op == order[next]->op) c->bytes = order[next]->bytes;
    ++next;
    kept.push_back(*c);
  }
  replayed.collectives = std::move(kept);
}

}  // namespace ranklab
