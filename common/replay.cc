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
  return [steps](Rank& r) {
    for (const Step& s : *steps) {
      run_step(r, s);
      r.synchronize();
    }
  };
}

void label_as_replay(RunReport& replayed, const RunReport& measured) {
  replayed.lesson = measured.lesson;
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
