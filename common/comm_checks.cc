#include "common/comm_checks.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "common/errors.h"

namespace ranklab {

namespace {

// all_to_all with uneven splits: one count per member on each side, none negative, summing to the rows of
// `in` and `out`, whose other dimensions agree (each row is one message unit, as in torch's
// all_to_all_single).
void check_splits(const CommCall& call, const std::string& where, int n) {
  auto side = [&](const CommCall::Splits& splits, const char* splits_name, const Tensor& t,
                  const char* t_name) {
    if (static_cast<int>(splits.size()) != n) {
      throw UsageError(
          fmt::format("{}: '{}' has {} entries but the group has {} ranks; give one row count "
                      "per member",
                      where, splits_name, splits.size(), n));
    }
    std::int64_t total = 0;
    for (std::size_t j = 0; j < splits.size(); ++j) {
      if (splits[j] < 0) {
        throw UsageError(fmt::format("{}: '{}'[{}] is {}; row counts cannot be negative", where, splits_name,
                                     j, splits[j]));
      }
      total += splits[j];
    }
    if (t.ndim() == 0 || total != t.size(0)) {
      throw UsageError(fmt::format("{}: '{}' = [{}] sums to {} rows but '{}' is {}", where, splits_name,
                                   fmt::join(splits, ", "), total, t_name, t.str()));
    }
  };
  side(call.input_splits, "in_splits", call.input, "in");
  side(call.output_splits, "out_splits", call.output, "out");
  if (call.input.shape().with_dim(0, 0) != call.output.shape().with_dim(0, 0)) {
    throw UsageError(fmt::format("{}: rows of 'in' {} and 'out' {} differ in shape beyond dimension 0", where,
                                 call.input.str(), call.output.str()));
  }
}

}  // namespace

void check_comm_call(const CommCall& call, int rank, int world_size,
                     const std::function<void(const Tensor& t, const char* arg)>& require) {
  const char* op = comm_op_name(call.op);
  const int n = call.group.size(world_size);
  auto where = [rank](const char* what) { return fmt::format("rank {}: {}", rank, what); };
  if (call.group.index_of(rank) < 0) {
    throw UsageError(
        fmt::format("{} on {}: rank {} is not a member of the group", where(op), call.group.str(), rank));
  }
  auto rooted = [&] {
    if (call.peer < 0 || call.peer >= world_size || call.group.index_of(call.peer) < 0) {
      throw UsageError(
          fmt::format("{}: root {} is not a member of {}", where(op), call.peer, call.group.str()));
    }
  };
  // `big` must be `small` with dimension 0 multiplied by the group size.
  auto stacked = [&](const Tensor& big, const char* big_name, const Tensor& small, const char* small_name) {
    if (small.ndim() == 0 || big.shape() != small.shape().with_dim(0, small.size(0) * n)) {
      throw UsageError(fmt::format(
          "{}: '{}' is {} so '{}' must have {} times its first dimension (the group has {} ranks); got {}",
          where(op), small_name, small.str(), big_name, n, n, big.str()));
    }
  };
  const bool root = call.peer == rank;
  switch (call.op) {
    case CommOp::AllReduce:
      require(call.output, "tensor");
      break;
    case CommOp::Broadcast:
    case CommOp::Reduce:
      require(call.output, "tensor");
      rooted();
      break;
    case CommOp::AllGather:
      require(call.input, "in");
      require(call.output, "out");
      stacked(call.output, "out", call.input, "in");
      break;
    case CommOp::ReduceScatter:
      require(call.input, "in");
      require(call.output, "out");
      stacked(call.input, "in", call.output, "out");
      break;
    case CommOp::Scatter:
      rooted();
      require(call.output, "out");
      if (root) {
        require(call.input, "in");
        stacked(call.input, "in", call.output, "out");
      }
      break;
    case CommOp::Gather:
      rooted();
      require(call.input, "in");
      if (root) {
        require(call.output, "out");
        stacked(call.output, "out", call.input, "in");
      }
      break;
    case CommOp::AllToAll:
      require(call.input, "in");
      require(call.output, "out");
      if (call.uneven()) {
        check_splits(call, where(op), n);
        break;
      }
      if (call.input.shape() != call.output.shape() || call.input.ndim() == 0 ||
          call.input.size(0) % n != 0) {
        throw UsageError(
            fmt::format("{}: 'in' and 'out' must have the same shape with a first dimension divisible by the "
                        "group size {}; "
                        "got {} and {}",
                        where(op), n, call.input.str(), call.output.str()));
      }
      break;
    case CommOp::Send:
    case CommOp::Recv: {
      require(call.op == CommOp::Send ? call.input : call.output, "tensor");
      const char* role = call.op == CommOp::Send ? "dst" : "src";
      if (call.peer < 0 || call.peer >= world_size) {
        throw UsageError(fmt::format("{}: {}={} is outside the world of {} ranks", where(op), role, call.peer,
                                     world_size));
      }
      if (call.peer == rank)
        throw UsageError(fmt::format("{}: {}={} is this rank itself", where(op), role, call.peer));
      break;
    }
    case CommOp::Barrier:
      break;
  }
}

}  // namespace ranklab
