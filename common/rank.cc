#include "common/rank.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/errors.h"

namespace ranklab {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "Sum";
    case ReduceOp::Avg:
      return "Avg";
    case ReduceOp::Max:
      return "Max";
    case ReduceOp::Min:
      return "Min";
    case ReduceOp::Prod:
      return "Prod";
  }
  return "?";
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::Broadcast:
      return "broadcast";
    case CommOp::Scatter:
      return "scatter";
    case CommOp::Gather:
      return "gather";
    case CommOp::Reduce:
      return "reduce";
    case CommOp::AllGather:
      return "all_gather";
    case CommOp::ReduceScatter:
      return "reduce_scatter";
    case CommOp::AllReduce:
      return "all_reduce";
    case CommOp::AllToAll:
      return "all_to_all";
    case CommOp::Send:
      return "send";
    case CommOp::Recv:
      return "recv";
    case CommOp::Barrier:
      return "barrier";
  }
  return "?";
}

Group::Group(int id, std::vector<int> ranks) : info_(std::make_shared<Info>(Info{id, std::move(ranks)})) {}

int Group::id() const {
  return info_ ? info_->id : 0;
}

std::vector<int> Group::ranks(int world_size) const {
  if (info_) return info_->ranks;
  std::vector<int> all(world_size);
  for (int i = 0; i < world_size; ++i) all[i] = i;
  return all;
}

int Group::size(int world_size) const {
  return info_ ? static_cast<int>(info_->ranks.size()) : world_size;
}

int Group::index_of(int global_rank) const {
  if (!info_) return global_rank;
  auto it = std::find(info_->ranks.begin(), info_->ranks.end(), global_rank);
  return it == info_->ranks.end() ? -1 : static_cast<int>(it - info_->ranks.begin());
}

std::string Group::str() const {
  if (!info_) return "world";
  return fmt::format("group {} {{{}}}", info_->id, fmt::join(info_->ranks, ", "));
}

std::string CommCall::describe() const {
  const Tensor& t = input.defined() ? input : output;
  std::string args = t.str();
  switch (op) {
    case CommOp::AllReduce:
    case CommOp::ReduceScatter:
      args += fmt::format(", {}", reduce_op_name(reduce));
      break;
    case CommOp::Reduce:
      args += fmt::format(", root={}, {}", peer, reduce_op_name(reduce));
      break;
    case CommOp::Broadcast:
    case CommOp::Scatter:
    case CommOp::Gather:
      args += fmt::format(", root={}", peer);
      break;
    case CommOp::Send:
      args += fmt::format(", dst={}", peer);
      break;
    case CommOp::Recv:
      args += fmt::format(", src={}", peer);
      break;
    case CommOp::Barrier:
      args = "";
      break;
    case CommOp::AllToAll:
      if (uneven()) {
        args += fmt::format(", in_splits=[{}], out_splits=[{}]", fmt::join(input_splits, ", "),
                            fmt::join(output_splits, ", "));
      }
      break;
    case CommOp::AllGather:
      break;
  }
  return fmt::format("{}({}){}{}", comm_op_name(op), args, group.is_world() ? "" : " on ",
                     group.is_world() ? "" : group.str());
}

namespace {
CommCall make_call(CommOp op, const Tensor& out, const Tensor& in, ReduceOp reduce, int peer, Async a,
                   Group g) {
  CommCall c;
  c.op = op;
  c.output = out;
  c.input = in;
  c.reduce = reduce;
  c.peer = peer;
  c.async = a;
  c.group = std::move(g);
  return c;
}
}  // namespace

Work Rank::broadcast(const Tensor& t, int root, Async a, Group g) {
  return issue(make_call(CommOp::Broadcast, t, t, ReduceOp::Sum, root, a, std::move(g)));
}
Work Rank::scatter(const Tensor& out, const Tensor& in, int root, Async a, Group g) {
  return issue(make_call(CommOp::Scatter, out, in, ReduceOp::Sum, root, a, std::move(g)));
}
Work Rank::gather(const Tensor& out, const Tensor& in, int root, Async a, Group g) {
  return issue(make_call(CommOp::Gather, out, in, ReduceOp::Sum, root, a, std::move(g)));
}
Work Rank::reduce(const Tensor& t, int root, ReduceOp op, Async a, Group g) {
  return issue(make_call(CommOp::Reduce, t, t, op, root, a, std::move(g)));
}
Work Rank::all_gather(const Tensor& out, const Tensor& in, Async a, Group g) {
  return issue(make_call(CommOp::AllGather, out, in, ReduceOp::Sum, -1, a, std::move(g)));
}
Work Rank::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, Async a, Group g) {
  return issue(make_call(CommOp::ReduceScatter, out, in, op, -1, a, std::move(g)));
}
Work Rank::all_reduce(const Tensor& t, ReduceOp op, Async a, Group g) {
  return issue(make_call(CommOp::AllReduce, t, t, op, -1, a, std::move(g)));
}
Work Rank::all_to_all(const Tensor& out, const Tensor& in, Async a, Group g) {
  return issue(make_call(CommOp::AllToAll, out, in, ReduceOp::Sum, -1, a, std::move(g)));
}
Work Rank::all_to_all(const Tensor& out, const Tensor& in, const std::vector<std::int64_t>& out_splits,
                      const std::vector<std::int64_t>& in_splits, Async a, Group g) {
  CommCall c = make_call(CommOp::AllToAll, out, in, ReduceOp::Sum, -1, a, std::move(g));
  c.input_splits.assign(in_splits.begin(), in_splits.end());
  c.output_splits.assign(out_splits.begin(), out_splits.end());
  return communicate(c);
}
Work Rank::send(const Tensor& t, int dst, Async a) {
  return issue(make_call(CommOp::Send, Tensor(), t, ReduceOp::Sum, dst, a, Group()));
}
Work Rank::recv(const Tensor& t, int src, Async a) {
  return issue(make_call(CommOp::Recv, t, Tensor(), ReduceOp::Sum, src, a, Group()));
}
void Rank::barrier(Group g) {
  issue(make_call(CommOp::Barrier, Tensor(), Tensor(), ReduceOp::Sum, -1, Async::No, std::move(g)));
}

Rank::Region::Region(Rank* r, std::string name) : rank_(r) {
  rank_->region_begin(name);
}
Rank::Region::Region(Rank* r, std::string name, bool bookkeeping) : rank_(r), bookkeeping_(bookkeeping) {
  rank_->region_begin(name);
  if (bookkeeping_) ++rank_->bookkeeping_depth_;
}
Rank::Region::~Region() {
  if (bookkeeping_) --rank_->bookkeeping_depth_;
  rank_->region_end();
}

Work Rank::issue(CommCall call) {
  call.bookkeeping = bookkeeping_depth_ > 0;
  return communicate(call);
}

}  // namespace ranklab
