// CudaRank's communication: every collective and point-to-point call through NCCL, on the communication
// stream, ordered against the compute stream with events (see cuda_rank.h).
//
// NCCL has no scatter, gather or all-to-all in its classic API; they are built from grouped ncclSend /
// ncclRecv exactly as NCCL's documentation shows (user guide, "Point-to-point communication"): one group
// per call, so NCCL launches the sends and receives together and none waits on another.
#include <fmt/format.h>

#include <algorithm>
#include <optional>
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

// NCCL's element type for a tensor's dtype: a 16-bit collective moves (and reduces) 16-bit values, an FP8
// one moves bytes.
ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::BFloat16:
      return ncclBfloat16;
    case DType::Float16:
      return ncclFloat16;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      return ncclUint8;  // moved, never added up (CudaRank::validate)
    case DType::Float32:
      break;
  }
  return ncclFloat32;
}

// Device time from `start` to `end` on the communication stream; the host waits for `end`.
double elapsed_between(const CudaEvent& start, const CudaEvent& end) {
  RANKLAB_CUDA(cudaEventSynchronize(end.get()));
  return elapsed_us_completed(start.get(), end.get());
}

// A synchronous call: the compute stream already waits for it; it only reports its time.
class CudaDoneWork : public WorkState {
 public:
  CudaDoneWork(std::shared_ptr<CudaEvent> started, std::shared_ptr<CudaEvent> done)
      : started_(std::move(started)), done_(std::move(done)) {}
  void wait() override {}
  bool waited() const override { return true; }
  double elapsed_us() override { return elapsed_between(*started_, *done_); }
  std::optional<double> elapsed_us_if_ended() override {
    return elapsed_us_if_reached(started_->get(), done_->get());
  }

 private:
  std::shared_ptr<CudaEvent> started_, done_;
};

// An asynchronous call in flight. It keeps its tensors alive until the compute stream waits for it: their
// memory is freed in compute-stream order, and must not be reused while NCCL still reads or writes it.
class CudaWork : public WorkState {
 public:
  CudaWork(std::shared_ptr<DeviceAccount> account, std::shared_ptr<CudaEvent> started,
           std::shared_ptr<CudaEvent> done, std::shared_ptr<AsyncOp> op, std::vector<Tensor> keep)
      : account_(std::move(account)),
        started_(std::move(started)),
        done_(std::move(done)),
        op_(std::move(op)),
        keep_(std::move(keep)) {}
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
  double elapsed_us() override { return elapsed_between(*started_, *done_); }
  std::optional<double> elapsed_us_if_ended() override {
    return elapsed_us_if_reached(started_->get(), done_->get());
  }

 private:
  std::shared_ptr<DeviceAccount> account_;
  std::shared_ptr<CudaEvent> started_;
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
  // NCCL takes one element type per call, for input and output alike.
  if (call.input.defined() && call.output.defined() && call.input.dtype() != call.output.dtype()) {
    throw UsageError(fmt::format("{}: 'in' is {} but 'out' is {}; they must share a dtype",
                                 where(comm_op_name(call.op)), call.input.str(), call.output.str()));
  }
  // An FP8 tensor's scales travel with it where the receiver learns them from its own input: all_gather and
  // all_to_all, whose members all send (take_fp8_scales).
  const Tensor& any = call.output.defined() ? call.output : call.input;
  if (any.defined() && is_float8(any.dtype()) && call.op != CommOp::AllGather &&
      call.op != CommOp::AllToAll) {
    throw UsageError(
        fmt::format("{}: {} is FP8; on GPUs FP8 tensors travel by all_gather and all_to_all, "
                    "which carry their scales",
                    where(comm_op_name(call.op)), any.str()));
  }
  // NCCL's sends and receives of one group run at once: in place they would overwrite what is unsent.
  if (call.op == CommOp::AllToAll && call.group.size(world_) > 1 &&
      static_cast<CudaStorage*>(call.input.storage())
          ->overlaps(*static_cast<CudaStorage*>(call.output.storage()))) {
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

std::int64_t CudaRank::fp8_scale_row_bytes(const Tensor& t) const {
  if (!t.defined() || !is_float8(t.dtype())) return 0;
  const std::shared_ptr<Fp8Scales>& s = static_cast<CudaStorage*>(t.storage())->fp8_scales();
  return s && !s->per_tensor() ? s->row_blocks() * s->scale_bytes() : 0;
}

void CudaRank::all_to_all_fp8_scales(const CommCall& call, const Resolved& r, const CommCall::Splits& sent,
                                     const CommCall::Splits& received) {
  std::int64_t row_bytes = 0;
  if (fp8_scale_row_bytes(call.input) == 0) return;
  char* in = fp8_row_scales(call.input, "all_to_all", "in", &row_bytes);
  char* out = fp8_row_scales(call.output, "all_to_all", "out", &row_bytes);
  std::int64_t send_at = 0, recv_at = 0;
  RANKLAB_NCCL(ncclGroupStart(), r.comm);
  for (int i = 0; i < r.size; ++i) {
    const std::int64_t send_bytes = sent[i] * row_bytes, recv_bytes = received[i] * row_bytes;
    if (send_bytes > 0) {
      RANKLAB_NCCL(ncclSend(in + send_at, static_cast<size_t>(send_bytes), ncclUint8, i, r.comm, comm_),
                   r.comm);
    }
    if (recv_bytes > 0) {
      RANKLAB_NCCL(ncclRecv(out + recv_at, static_cast<size_t>(recv_bytes), ncclUint8, i, r.comm, comm_),
                   r.comm);
    }
    send_at += send_bytes;
    recv_at += recv_bytes;
  }
  settle(RANKLAB_NCCL(ncclGroupEnd(), r.comm), r.comm, "ncclGroupEnd (all_to_all, FP8 scales)");
}

void CudaRank::launch_nccl(const CommCall& call, const Resolved& r) {
  ncclComm_t comm = r.comm;
  auto ptr = [](const Tensor& t) {
    return static_cast<char*>(t.defined() ? static_cast<CudaStorage*>(t.storage())->data() : nullptr);
  };
  char* in = ptr(call.input);
  char* out = ptr(call.output);
  const ncclRedOp_t op = nccl_op(call.reduce);
  const Tensor& any = call.output.defined() ? call.output : call.input;
  const ncclDataType_t type = nccl_type(any.dtype());
  // Offsets into the buffers are in bytes: chunk i of `count` elements starts at i * count * elem.
  const auto elem = static_cast<size_t>(dtype_bytes(any.dtype()));
  switch (call.op) {
    case CommOp::AllReduce: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclAllReduce(out, out, count, type, op, comm, comm_), comm), comm,
             "ncclAllReduce");
      break;
    }
    case CommOp::Broadcast: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclBroadcast(out, out, count, type, r.peer, comm, comm_), comm), comm,
             "ncclBroadcast");
      break;
    }
    case CommOp::Reduce: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclReduce(out, out, count, type, op, r.peer, comm, comm_), comm), comm,
             "ncclReduce");
      break;
    }
    case CommOp::AllGather: {
      const auto count = static_cast<size_t>(call.input.numel());
      settle(RANKLAB_NCCL(ncclAllGather(in, out, count, type, comm, comm_), comm), comm, "ncclAllGather");
      if (const std::int64_t row_bytes = fp8_scale_row_bytes(call.input); row_bytes > 0) {
        // A block-scaled FP8 tensor's scales, row by row beside its bytes (TransformerEngine gathers an
        // MXFP8 tensor's scale_inv with a second all-gather).
        std::int64_t b = 0;
        const auto scale_count = static_cast<size_t>(call.input.size(0) * row_bytes);
        settle(RANKLAB_NCCL(ncclAllGather(fp8_row_scales(call.input, "all_gather", "in", &b),
                                          fp8_row_scales(call.output, "all_gather", "out", &b), scale_count,
                                          ncclUint8, comm, comm_),
                            comm),
               comm, "ncclAllGather (FP8 scales)");
      }
      break;
    }
    case CommOp::ReduceScatter: {
      const auto count = static_cast<size_t>(call.output.numel());
      settle(RANKLAB_NCCL(ncclReduceScatter(in, out, count, type, op, comm, comm_), comm), comm,
             "ncclReduceScatter");
      break;
    }
    case CommOp::Scatter: {
      const auto count = static_cast<size_t>(call.output.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      if (r.is_root()) {
        for (int i = 0; i < r.size; ++i) {
          RANKLAB_NCCL(ncclSend(in + count * elem * static_cast<size_t>(i), count, type, i, comm, comm_),
                       comm);
        }
      }
      RANKLAB_NCCL(ncclRecv(out, count, type, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (scatter)");
      break;
    }
    case CommOp::Gather: {
      const auto count = static_cast<size_t>(call.input.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclSend(in, count, type, r.peer, comm, comm_), comm);
      if (r.is_root()) {
        for (int i = 0; i < r.size; ++i) {
          RANKLAB_NCCL(ncclRecv(out + count * elem * static_cast<size_t>(i), count, type, i, comm, comm_),
                       comm);
        }
      }
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (gather)");
      break;
    }
    case CommOp::AllToAll: {
      if (call.uneven()) {
        // As NCCL runs all_to_all itself (and torch's all_to_all_single with splits): one send and one
        // receive per member, each with its own count, at the offsets of the rows before it.
        const auto row = static_cast<size_t>(call.input.shape().with_dim(0, 1).numel());
        size_t send_at = 0, recv_at = 0;
        RANKLAB_NCCL(ncclGroupStart(), comm);
        for (int i = 0; i < r.size; ++i) {
          const auto send_count = static_cast<size_t>(call.input_splits[i]) * row;
          const auto recv_count = static_cast<size_t>(call.output_splits[i]) * row;
          if (send_count > 0)
            RANKLAB_NCCL(ncclSend(in + send_at * elem, send_count, type, i, comm, comm_), comm);
          if (recv_count > 0)
            RANKLAB_NCCL(ncclRecv(out + recv_at * elem, recv_count, type, i, comm, comm_), comm);
          send_at += send_count;
          recv_at += recv_count;
        }
        settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (all_to_all)");
        all_to_all_fp8_scales(call, r, call.input_splits, call.output_splits);
        break;
      }
      const auto count = static_cast<size_t>(call.input.numel() / r.size);
      RANKLAB_NCCL(ncclGroupStart(), comm);
      for (int i = 0; i < r.size; ++i) {
        RANKLAB_NCCL(ncclSend(in + count * elem * static_cast<size_t>(i), count, type, i, comm, comm_), comm);
        RANKLAB_NCCL(ncclRecv(out + count * elem * static_cast<size_t>(i), count, type, i, comm, comm_),
                     comm);
      }
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (all_to_all)");
      if (fp8_scale_row_bytes(call.input) > 0) {
        const CommCall::Splits even(static_cast<std::size_t>(r.size), call.input.size(0) / r.size);
        all_to_all_fp8_scales(call, r, even, even);
      }
      break;
    }
    case CommOp::Send: {
      const auto count = static_cast<size_t>(call.input.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclSend(in, count, type, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (send)");
      break;
    }
    case CommOp::Recv: {
      const auto count = static_cast<size_t>(call.output.numel());
      RANKLAB_NCCL(ncclGroupStart(), comm);
      RANKLAB_NCCL(ncclRecv(out, count, type, r.peer, comm, comm_), comm);
      settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (recv)");
      break;
    }
    case CommOp::Barrier:
      break;
  }
}

// What the report calls this operation, matched across its members by key. Counts the call.
CommTiming CudaRank::timing_of(const CommCall& call, const Resolved& r) {
  CommTiming timing;
  timing.op = call.op;
  timing.bookkeeping = call.bookkeeping;
  timing.group_size = r.size;
  timing.group = r.group;
  const std::int64_t in = numel_or_zero(call.input), out = numel_or_zero(call.output);
  std::int64_t elements = std::max(in, out);
  if (call.op == CommOp::Scatter) elements = out * r.size;
  if (call.op == CommOp::Gather) elements = in * r.size;
  // nccl-tests' size for all_to_all is what each rank sends; with uneven splits that differs between
  // ranks, and the report's record takes the largest (merge_logs).
  if (call.op == CommOp::AllToAll) elements = in;
  const Tensor& any = call.output.defined() ? call.output : call.input;
  timing.bytes = elements * dtype_bytes(any.dtype());
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
  return timing;
}

// The Work of an asynchronous call that ends with `done`: its tensors are off limits until it is waited on.
Work CudaRank::async_work(const CommCall& call, const std::shared_ptr<CudaEvent>& started,
                          const std::shared_ptr<CudaEvent>& done) {
  std::vector<Tensor> keep;
  for (const Tensor* t : {&call.input, &call.output}) {
    if (t->defined()) keep.push_back(*t);
  }
  auto op = std::make_shared<AsyncOp>(AsyncOp{call.describe(), false});
  for (const Tensor& t : keep) static_cast<CudaStorage*>(t.storage())->add_pending(op);
  outstanding_.push_back(op);
  return Work(std::make_shared<CudaWork>(account_, started, done, op, std::move(keep)));
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
  CommTiming timing = timing_of(call, r);
  if (call.input.defined() && is_float8(call.input.dtype())) {
    take_fp8_scales(call.output, call.input, comm_op_name(call.op), /*copy_rows=*/false);
  }

  // The communication stream starts after every kernel issued so far on the compute stream.
  RANKLAB_CUDA(cudaEventRecord(issue_, compute_));
  RANKLAB_CUDA(cudaStreamWaitEvent(comm_, issue_, 0));
  auto started = std::make_shared<CudaEvent>(/*timing=*/true);
  RANKLAB_CUDA(cudaEventRecord(started->get(), comm_));
  const int interval = timeline_.begin(comm_);
  launch_nccl(call, r);
  timeline_.end(interval, comm_);
  auto done = std::make_shared<CudaEvent>(/*timing=*/true);
  RANKLAB_CUDA(cudaEventRecord(done->get(), comm_));
  watchdog_.track(call.describe(), done);
  if (interval >= 0) comm_timings_.push_back(TimedComm{std::move(timing), interval});

  if (call.async == Async::No) {
    RANKLAB_CUDA(cudaStreamWaitEvent(compute_, done->get(), 0));
    return Work(std::make_shared<CudaDoneWork>(started, done));
  }
  return async_work(call, started, done);
}

// torch.distributed.batch_isend_irecv: every send and receive inside one ncclGroupStart/End, so NCCL posts
// them together and two ranks that both send first still meet. They share one end event and one timed
// interval, and each gets its own Work, as each has its own tensor.
// GCC 12 warns, wrongly, that moving a CommCall's inline splits (boost::container::small_vector) reads past
// its 64 bytes: the length it fears is one the calls never have.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overread"
std::vector<Work> CudaRank::batch_isend_irecv(const std::vector<P2POp>& ops) {
  watchdog_.check_abort();
  const char* op_name = "batch_isend_irecv";
  std::vector<CommCall> calls;
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& o = ops[i];
    if (o.op != CommOp::Send && o.op != CommOp::Recv) {
      throw UsageError(fmt::format("{}: ops[{}] is {}; only send and recv can be batched", where(op_name), i,
                                   comm_op_name(o.op)));
    }
    CommCall c;
    c.op = o.op;
    (o.op == CommOp::Send ? c.input : c.output) = o.tensor;
    c.peer = o.peer;
    c.async = Async::Yes;
    validate(c);  // all of them before any is posted
    calls.push_back(std::move(c));
  }
  if (calls.empty()) return {};
  std::vector<CommTiming> timings;
  for (const CommCall& c : calls) timings.push_back(timing_of(c, resolve(c)));
  ncclComm_t comm = comms_.world();  // point-to-point calls name global ranks

  RANKLAB_CUDA(cudaEventRecord(issue_, compute_));
  RANKLAB_CUDA(cudaStreamWaitEvent(comm_, issue_, 0));
  auto started = std::make_shared<CudaEvent>(/*timing=*/true);
  RANKLAB_CUDA(cudaEventRecord(started->get(), comm_));
  const int interval = timeline_.begin(comm_);
  RANKLAB_NCCL(ncclGroupStart(), comm);
  for (const CommCall& c : calls) {
    const bool send = c.op == CommOp::Send;
    const Tensor& t = send ? c.input : c.output;
    void* p = static_cast<CudaStorage*>(t.storage())->data();
    const auto count = static_cast<size_t>(t.numel());
    const ncclDataType_t type = nccl_type(t.dtype());
    if (send) {
      RANKLAB_NCCL(ncclSend(p, count, type, c.peer, comm, comm_), comm);
    } else {
      RANKLAB_NCCL(ncclRecv(p, count, type, c.peer, comm, comm_), comm);
    }
  }
  settle(RANKLAB_NCCL(ncclGroupEnd(), comm), comm, "ncclGroupEnd (batch_isend_irecv)");
  timeline_.end(interval, comm_);
  auto done = std::make_shared<CudaEvent>(/*timing=*/true);
  RANKLAB_CUDA(cudaEventRecord(done->get(), comm_));
  watchdog_.track(
      fmt::format("batch_isend_irecv of {} operations, the first {}", calls.size(), calls.front().describe()),
      done);
  std::vector<Work> works;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (interval >= 0) comm_timings_.push_back(TimedComm{std::move(timings[i]), interval});
    works.push_back(async_work(calls[i], started, done));
  }
  return works;
}
#pragma GCC diagnostic pop

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
