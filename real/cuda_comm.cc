// CudaRank's communication: every collective and point-to-point call through NCCL, on the communication
// stream, ordered against the compute stream with events (see cuda_rank.h).
//
// NCCL has no scatter, gather or all-to-all in its classic API; they are built from grouped ncclSend /
// ncclRecv exactly as NCCL's documentation shows (user guide, "Point-to-point communication"): one group
// per call, so NCCL launches the sends and receives together and none waits on another.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "common/comm_checks.h"
#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/cuda_rank.h"

namespace ranklab {

namespace {

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Prod:
      return ncclProd;
  }
  return ncclSum;
}

// An asynchronous call in flight. It keeps its tensors alive until the compute stream waits for it: their
// memory is freed in compute-stream order, and must not be reused while NCCL still reads or writes it.
class CudaWork : public WorkState {
 public:
  CudaWork(std::shared_ptr<DeviceAccount> account, std::shared_ptr<CudaEvent> done,
           std::shared_ptr<AsyncOp> op, std::vector<Tensor> keep)
      : account_(std::move(account)), done_(std::move(done)), op_(std::move(op)), keep_(std::move(keep)) {}
  ~CudaWork() override {
    // Dropped without wait(): the compute stream still waits, so later work cannot reuse the memory under
    // it (its tensors still count as in use, as in the simulator).
    if (!ordered_) {
      try {
        account_->compute_waits_for(done_->get());
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (!ordered_) account_->compute_waits_for(done_->get());
    ordered_ = true;
    op_->waited = true;
    keep_.clear();
  }
  // True after wait(), or after a synchronize() that found it finished.
  bool waited() const override { return op_->waited; }

 private:
  std::shared_ptr<DeviceAccount> account_;
  std::shared_ptr<CudaEvent> done_;
  std::shared_ptr<AsyncOp> op_;
  std::vector<Tensor> keep_;
  bool ordered_ = false;  // the compute stream already waits for it
};

std::int64_t numel_or_zero(const Tensor& t) {
  return t.defined() ? t.numel() : 0;
}

}  // namespace

struct CudaRank::Resolved {
  ncclComm_t comm = nullptr;
  int group_id = 0;  // 0 is the world
  std::string group;
  int size = 0;   // members
  int index = 0;  // this rank among them
  int peer = -1;  // root, src or dst among them (the world's rank for send and recv)
  bool is_root() const { return peer == index; }
};

// The checks both backends share (common/comm_checks.h), and one only GPUs need.
void CudaRank::validate(const CommCall& call) const {
  check_comm_call(call, rank_, world_,
                  [&](const Tensor& t, const char* arg) { require(t, comm_op_name(call.op), arg); });
  // NCCL's sends and receives of one group run at once: in place they would overwrite what is unsent.
  if (call.op == CommOp::AllToAll && call.group.size(world_) > 1 && call.input.same_storage(call.output)) {
    throw UsageError(
        fmt::format("{}: 'in' and 'out' must be different tensors on GPUs", where(comm_op_name(call.op))));
  }
}

CudaRank::Resolved CudaRank::resolve(const CommCall& call) const {
  Resolved r;
  if (call.group.is_world()) {
    r.comm = comms_.world();
    r.group = "world";
  } else {
    r.comm = comms_.group(call.group.id());
    if (r.comm == nullptr) {
      throw UsageError(fmt::format("{}: {} was not made by new_group in this run",
                                   where(comm_op_name(call.op)), call.group.str()));
    }
    r.group_id = call.group.id();
    r.group = call.group.str();
  }
  r.size = call.group.size(world_);
  r.index = call.group.index_of(rank_);
  switch (call.op) {
    case CommOp::Broadcast:
    case CommOp::Reduce:
    case CommOp::Scatter:
    case CommOp::Gather:
      r.peer = call.group.index_of(call.peer);
      break;
    case CommOp::Send:
    case CommOp::Recv:
      r.peer = call.peer;  // on the world's communicator, whose ranks are the global ones
      break;
    default:
      break;
  }
  return r;
}

void CudaRank::settle(ncclResult_t r, ncclComm_t comm, const char* what) {
  if (r == ncclInProgress) watchdog_.settle(comm, what);
}

void CudaRank::launch_nccl(const CommCall& call, const Resolved& r) {
  ncclComm_t comm = r.comm;
  auto ptr = [](const Tensor& t) {
    return t.defined() ? static_cast<CudaStorage*>(t.storage())->data() : nullptr;
  };
  float* in = ptr(call.input);
  float* out = ptr(call.output);
  const ncclRedOp_t op = nccl_op(call.reduce);
  switch (call.op) {
    case CommOp::AllReduce: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclAllReduce(out, out, count, ncclFloat32, op, comm, comm_), comm), comm,
             "ncclAllReduce");
      break;
    }
    case CommOp::Broadcast: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclBroadcast(out, out, count, ncclFloat32, r.peer, comm, comm_), comm), comm,
             "ncclBroadcast");
      break;
    }
    case CommOp::Reduce: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclReduce(out, out, count, ncclFloat32, op, r.peer, comm, comm_), comm), comm,
             "ncclReduce");
      break;
    }
    case CommOp::AllGather: {
      const auto count = static_cast<size_t>(call.input.numel());
      settle(RANKLAB_NCCL(ncclAllGather(in, out, count, ncclFloat32, comm, comm_), comm), comm,
             "ncclAllGather");
      break;
    }
    case CommOp::ReduceScatter: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclReduceScatter(in, out, count, ncclFloat32, op, comm, comm_), comm), comm,
             "ncclReduceScatter");
      break;
    }
    case CommOp::Scatter: {
      const auto count = static_cast<size_t>(call.output.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      if (r.is_root()) {
        for (int i = 0; i < r.size; ++i) {
          RANKLAB_NCCL(ncclSend(in + count * static_cast<size_t>(i), count, ncclFloat32, i, comm, comm_),
                       comm);
        }
      }
      RANKLAB_NCCL(ncclRecv(out, count, ncclFloat32, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (scatter)");
      break;
    }
    case CommOp::Gather: {
      const auto count = static_cast<size_t>(call.input.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclSend(in, count, ncclFloat32, r.peer, comm, comm_), comm);
      if (r.is_root()) {
        for (int i = 0; i < r.size; ++i) {
          RANKLAB_NCCL(ncclRecv(out + count * static_cast<size_t>(i), count, ncclFloat32, i, comm, comm_),
                       comm);
        }
      }
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (gather)");
      break;
    }
    case CommOp::AllToAll: {
      const auto count = static_cast<size_t>(call.input.numel() / r.size);
      RANKLAB_NCCL(ncclGroupStart(), comm);
      for (int i = 0; i < r.size; ++i) {
        RANKLAB_NCCL(ncclSend(in + count * static_cast<size_t>(i), count, ncclFloat32, i, comm, comm_), comm);
        RANKLAB_NCCL(ncclRecv(out + count * static_cast<size_t>(i), count, ncclFloat32, i, comm, comm_),
                     comm);
      }
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (all_to_all)");
      break;
    }
    case CommOp::Send: {
      const auto count = static_cast<size_t>(call.input.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclSend(in, count, ncclFloat32, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (send)");
      break;
    }
    case CommOp::Recv: {
      const auto count = static_cast<size_t>(call.output.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclRecv(out, count, ncclFloat32, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (recv)");
      break;
    }
    case CommOp::Barrier:
      break;
  }
}

Work CudaRank::communicate(const CommCall& call) {
  watchdog_.check_abort();
  validate(call);
  if (call.op == CommOp::Barrier) {
    // A host rendezvous, deliberately blind to the device (see cuda_rank.h).
    host_->barrier(call.group.is_world() ? 0 : call.group.id());
    return Work();
  }
  const Resolved r = resolve(call);

  // What the report calls this operation, matched across its members by key.
  CommTiming timing;
  timing.op = call.op;
  timing.group_size = r.size;
  timing.group = r.group;
  const std::int64_t in = numel_or_zero(call.input), out = numel_or_zero(call.output);
  std::int64_t elements = std::max(in, out);
  if (call.op == CommOp::Scatter) elements = out * r.size;
  if (call.op == CommOp::Gather) elements = in * r.size;
  timing.bytes = elements * static_cast<std::int64_t>(sizeof(float));
  if (call.op == CommOp::Send) {
    timing.key = fmt::format("p2p {}->{} #{}", rank_, r.peer, sends_to_[r.peer]++);
    timing.group = fmt::format("p2p {}->{}", rank_, r.peer);
    timing.group_size = 2;
    timing.record_owner = true;
  } else if (call.op == CommOp::Recv) {
    timing.key = fmt::format("p2p {}->{} #{}", r.peer, rank_, recvs_from_[r.peer]++);
    timing.group = fmt::format("p2p {}->{}", r.peer, rank_);
    timing.group_size = 2;
  } else {
    timing.key = fmt::format("g{}#{}", r.group_id, group_calls_[r.group_id]++);
    timing.record_owner = r.index == 0;
  }

  // The communication stream starts after every kernel issued so far on the compute stream.
  RANKLAB_CUDA(cudaEventRecord(issue_, compute_));
  RANKLAB_CUDA(cudaStreamWaitEvent(comm_, issue_, 0));
  const int interval = timeline_.begin(comm_);
  launch_nccl(call, r);
  timeline_.end(interval, comm_);
  auto done = std::make_shared<CudaEvent>(/*timing=*/false);
  RANKLAB_CUDA(cudaEventRecord(done->get(), comm_));
  const std::string what = call.describe();
  watchdog_.track(what, done);
  if (interval >= 0) comm_timings_.push_back(TimedComm{std::move(timing), interval});

  if (call.async == Async::No) {
    RANKLAB_CUDA(cudaStreamWaitEvent(compute_, done->get(), 0));
    return Work();
  }
  std::vector<Tensor> keep;
  for (const Tensor* t : {&call.input, &call.output}) {
    if (t->defined()) keep.push_back(*t);
  }
  auto op = std::make_shared<AsyncOp>(AsyncOp{what, false});
  for (const Tensor& t : keep) static_cast<CudaStorage*>(t.storage())->add_pending(op);
  outstanding_.push_back(op);
  return Work(std::make_shared<CudaWork>(account_, done, op, std::move(keep)));
}

Group CudaRank::new_group(const std::vector<int>& ranks) {
  watchdog_.check_abort();
  if (ranks.empty()) throw UsageError(fmt::format("rank {}: new_group: the group has no ranks", rank_));
  std::set<int> seen;
  for (int member : ranks) {
    if (member < 0 || member >= world_) {
      throw UsageError(fmt::format("rank {}: new_group({}): rank {} is outside the world of {}", rank_,
                                   fmt::join(ranks, ", "), member, world_));
    }
    if (!seen.insert(member).second) {
      throw UsageError(fmt::format("rank {}: new_group({}): rank {} appears twice", rank_,
                                   fmt::join(ranks, ", "), member));
    }
  }
  const int id = next_group_id_++;
  comms_.split(id, ranks);
  host_->add_group(id, ranks);
  return Group(id, ranks);
}

}  // namespace ranklab
