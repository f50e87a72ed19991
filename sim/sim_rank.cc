// SimRank: the checks every call makes, the compute stream's waits for communication, and the calls
// that communicate, synchronize or keep time. Its tensors and kernels are in sim/sim_rank_kernels.cc.
#include "sim/sim_rank.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/comm_checks.h"
#include "common/compute_checks.h"
#include "common/dtype_round.h"
#include "common/errors.h"
#include "common/random.h"
#include "sim/asan_fibers.h"
#include "sim/scheduler.h"

namespace ranklab::sim {

namespace {

// A point on a rank's compute stream: when the kernels launched before it end.
class SimEvent : public EventState {
 public:
  SimEvent(int rank, double time_us) : rank(rank), time_us(time_us) {}
  int rank;
  double time_us;
};

// The compute stream waits for `op` before its next kernel: `op` is synchronous, or wait() was called on it.
// A group's collectives run one after another on its stream, so the later of two stands for both:
// back-to-back collectives, or the buckets of a step waited on in turn, keep the list as short as the number
// of streams (at most one collective per group, which is what the search below relies on).
void compute_stream_waits_for(RankState& s, const std::shared_ptr<CommOpState>& op) {
  s.waits_deferred = false;
  if (op->op != CommOp::Send) {
    const auto same_stream = std::find_if(
        s.unfolded_waits.begin(), s.unfolded_waits.end(), [&](const std::shared_ptr<CommOpState>& other) {
          return other->op != CommOp::Send && other->group_id == op->group_id;
        });
    if (same_stream != s.unfolded_waits.end()) {
      if ((*same_stream)->seq >= op->seq) {  // a later one already stands for it
        if (!op->finished) s.folded_with.push_back(op);
        return;
      }
      if (!(*same_stream)->finished) s.folded_with.push_back(*same_stream);
      s.unfolded_waits.erase(same_stream);
    }
  }
  s.unfolded_waits.push_back(op);
}

class SimWork : public WorkState {
 public:
  SimWork(SimWorld& world, int rank, std::shared_ptr<CommOpState> op)
      : world_(world), rank_(rank), op_(std::move(op)) {}
  // A synchronous call's: complete as far as the program can tell (the compute stream waits for it), with
  // the operation's time.
  static std::shared_ptr<SimWork> done(SimWorld& world, int rank, std::shared_ptr<CommOpState> op) {
    auto w = std::make_shared<SimWork>(world, rank, std::move(op));
    w->synchronous_ = true;
    return w;
  }
  // As torch's work.wait() on NCCL: the compute stream waits for the operation, the host does not. The
  // rank goes on at once; its next kernel (or anything else that needs the compute stream's clock or the
  // operation's numbers) waits for the operation's end. Waiting for every bucket of a step then blocks once,
  // on the last one, instead of once per bucket.
  void wait() override {
    if (synchronous_) return;
    CommMember& m = op_->member_of(rank_);
    if (m.waited) return;
    m.waited = true;
    world_.note_waited(rank_, op_);
    compute_stream_waits_for(world_.state(rank_), op_);
  }
  bool waited() const override { return synchronous_ || op_->member_of(rank_).waited; }
  double elapsed_us() override {
    if (!op_->finished) world_.wait_finished(rank_, op_, "Work::elapsed_us()");
    return op_->end_us - op_->start_us;
  }

 private:
  SimWorld& world_;
  int rank_;
  std::shared_ptr<CommOpState> op_;
  bool synchronous_ = false;
};

}  // namespace

// ---- checks and bookkeeping ------------------------------------------------------------------------

std::string SimRank::where(const char* op) const {
  return fmt::format("rank {}: {}", rank_, op);
}

void SimRank::require(const Tensor& t, const char* op, const char* arg) const {
  world_.check_thread(rank_, op);
  world_.check_aborted();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  if (t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
}

void SimRank::require_dtype(const Tensor& t, DType dtype, const char* op, const char* arg) const {
  if (t.dtype() != dtype) {
    throw UsageError(
        fmt::format("{}: '{}' is {}; it must be {}", where(op), arg, t.str(), dtype_name(dtype)));
  }
}

void SimRank::require_same_dtype(const Tensor& a, const Tensor& b, const char* op) const {
  if (a.dtype() != b.dtype()) {
    throw UsageError(
        fmt::format("{}: dtypes differ: {} and {}; cast one first", where(op), a.str(), b.str()));
  }
}

void SimRank::require_shape(const Tensor& t, const Shape& want, const char* op, const char* arg) const {
  if (t.shape() != want) {
    throw UsageError(fmt::format("{}: '{}' is {}; expected shape {}", where(op), arg, t.str(), want.str()));
  }
}

Tensor SimRank::allocate(const Shape& s, DType dtype, bool phantom, const char* op) {
  world_.check_thread(rank_, op);
  world_.check_aborted();
  MemoryAccount& m = *s_.memory;
  const std::int64_t bytes = s.numel() * dtype_bytes(dtype);
  if (m.allocated + bytes > m.capacity) {
    throw OutOfMemoryError(fmt::format(
        "{}: out of memory allocating {}{} ({}): {} already in use of the {} of a {} ({})", where(op),
        dtype_name(dtype), s.str(), format_bytes(static_cast<double>(bytes)),
        format_bytes(static_cast<double>(m.allocated)), format_bytes(static_cast<double>(m.capacity)),
        world_.profile().gpu.name, world_.profile().name));
  }
  if (!phantom && m.host && m.host->limit > 0) {
    const std::int64_t need = static_cast<std::int64_t>(sizeof(float)) * std::max<std::int64_t>(s.numel(), 1);
    if (need > m.host->limit - m.host->used) {
      throw UsageError(fmt::format(
          "{}: the simulator is out of host memory allocating {}{} ({}): the real tensors of all {} ranks "
          "already hold {} of the {} it may use on this machine; time the run with --phantom, or use fewer "
          "ranks or smaller sizes",
          where(op), dtype_name(dtype), s.str(), format_bytes(static_cast<double>(need)), world_.size(),
          format_bytes(static_cast<double>(m.host->used)), format_bytes(static_cast<double>(m.host->limit))));
    }
  }
  return Tensor(s, dtype, std::make_shared<SimStorage>(s_.memory, s.numel(), dtype, phantom));
}

void SimRank::fold_waits(const char* by) {
  if (!s_.unfolded_waits.empty()) world_.settle_compute(rank_);
  for (const auto& op : s_.unfolded_waits) {
    if (!op->finished) {
      world_.wait_finished(rank_, op, by, /*folded=*/true);
    }
    s_.compute_us = std::max(s_.compute_us, op->end_us);
  }
  s_.unfolded_waits.clear();
  s_.folded_with.clear();  // ended before those
}

void SimRank::waits_before_kernel(const char* by) {
  if (s_.unfolded_waits.empty() || s_.waits_deferred) return;
  if (world_.may_defer_waits(rank_)) {
    world_.defer_waits(rank_);  // the kernel takes them along (SimWorld::launch_kernel)
    return;
  }
  fold_waits(by);
}

void SimRank::before_reading(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    SimStorage& st = *sim_storage(*t);
    bool all_read = true;
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      if (!st.pending[i]->member_of(rank_).waited && !st.pending_reads_only[i]) all_read = false;
    }
    if (!all_read) {
      before_kernel({t}, op);
      continue;
    }
    // The readers in flight stay recorded, so that a kernel writing the buffer later is still caught.
    std::size_t kept = 0;
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      if (st.pending[i]->member_of(rank_).waited) continue;
      st.pending[kept] = st.pending[i];
      st.pending_reads_only[kept] = true;
      ++kept;
    }
    st.pending.resize(kept);
    st.pending_reads_only.resize(kept);
  }
  waits_before_kernel(op);
}

void SimRank::before_kernel(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    auto& pending = sim_storage(*t)->pending;
    for (const auto& p : pending) {
      if (!p->member_of(rank_).waited) {
        throw UsageError(fmt::format(
            "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
            "before touching the tensor (on a GPU this would be a silent race)",
            where(op), t->str(), p->label()));
      }
    }
    pending.clear();
    sim_storage(*t)->pending_reads_only.clear();
  }
  waits_before_kernel(op);
}

void SimRank::launch_kernel(const std::string& name, double flops, double bytes, DType dtype) {
  launch_kernel_cost(name, world_.compute().kernel_cost(flops, bytes, dtype));
}

void SimRank::launch_kernel_cost(const std::string& name, const KernelCost& cost) {
  waits_before_kernel(name.c_str());  // kernels that read no tensor (fills, random numbers) wait too
  s_.host_us += world_.compute().launch_us();
  // Communication this GPU runs at the same time holds some of its SMs and HBM bandwidth.
  world_.launch_kernel(rank_, name, cost);
}

// ---- copies to the host ---------------------------------------------------------------------------

std::vector<float> SimRank::to_host(const Tensor& t) {
  require(t, "to_host", "t");
  if (t.phantom()) {
    throw UsageError(fmt::format("{}: {} has a shape but no values (phantom tensors only advance time)",
                                 where("to_host"), t.str()));
  }
  before_kernel({&t}, "to_host");
  fold_waits("to_host");  // the copy needs the stream's clock
  world_.settle_compute(rank_);
  s_.host_us = std::max(s_.host_us, s_.compute_us);  // a device-to-host copy waits for the stream
  return std::vector<float>(sim_data(t), sim_data(t) + t.numel());
}

// ---- communication ---------------------------------------------------------------------------------

void SimRank::validate(const CommCall& call) const {
  world_.check_group(rank_, call.group, comm_op_name(call.op));  // before anything indexes by it
  check_comm_call(call, rank_, world_.size(),
                  [&](const Tensor& t, const char* arg) { require(t, comm_op_name(call.op), arg); });
  if (call.input.defined() && call.output.defined() && call.input.dtype() != call.output.dtype()) {
    throw UsageError(fmt::format("{}: 'in' is {} but 'out' is {}; communication does not convert dtypes",
                                 where(comm_op_name(call.op)), call.input.str(), call.output.str()));
  }
}

namespace {
// Whether `call` only reads `t`: a send, or the input of an out-of-place collective.
bool only_reads(const CommCall& call, const Tensor& t) {
  if (call.op == CommOp::Send) return true;
  const bool out_of_place = call.op == CommOp::AllGather || call.op == CommOp::ReduceScatter ||
                            call.op == CommOp::AllToAll || call.op == CommOp::Scatter ||
                            call.op == CommOp::Gather;
  return out_of_place && call.input.defined() && t.storage() == call.input.storage() &&
         (!call.output.defined() || call.output.storage() != call.input.storage());
}
}  // namespace

// Communication on a buffer that an Async::Yes operation not yet waited on still uses runs on another
// stream on a GPU: unless both only read it, the two race.
void SimRank::check_no_race(const CommCall& call) const {
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    const SimStorage& st = *sim_storage(*t);
    for (std::size_t i = 0; i < st.pending.size(); ++i) {
      const auto& p = st.pending[i];
      if (p->member_of(rank_).waited || (st.pending_reads_only[i] && only_reads(call, *t))) continue;
      throw UsageError(fmt::format(
          "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
          "first (on a GPU the two would race on different streams)",
          where(comm_op_name(call.op)), t->str(), p->label()));
    }
  }
}

Work SimRank::communicate(const CommCall& call) {
  world_.check_thread(rank_, comm_op_name(call.op));
  world_.check_aborted();
  validate(call);
  check_no_race(call);
  if (call.op == CommOp::Barrier) {
    world_.barrier(rank_, call.group);
    return Work();
  }
  s_.host_us += world_.compute().launch_us();
  world_.before_issue(rank_, call);
  std::shared_ptr<CommOpState> op = world_.post(rank_, call);
  if (call.async == Async::No) {
    compute_stream_waits_for(s_, op);  // the compute stream waits for it; the host goes on
    return Work(SimWork::done(world_, rank_, op));
  }
  world_.note_async_posted(rank_, op);
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    sim_storage(*t)->pending.push_back(op);
    sim_storage(*t)->pending_reads_only.push_back(only_reads(call, *t));
  }
  return Work(std::make_shared<SimWork>(world_, rank_, op));
}

std::vector<Work> SimRank::batch_isend_irecv(const std::vector<P2POp>& ops) {
  world_.check_aborted();
  // Every operation is checked before any is posted, so a bad one leaves nothing half issued.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].op != CommOp::Send && ops[i].op != CommOp::Recv) {
      throw UsageError(fmt::format("{}: ops[{}] is {}; only send and recv can be batched",
                                   where("batch_isend_irecv"), i, comm_op_name(ops[i].op)));
    }
  }
  // Each is posted asynchronously, in order, as one group: none waits for another on its stream, so two
  // ranks that both send first and then receive cannot deadlock (NCCL's ncclGroupStart/End).
  std::vector<Work> works;
  works.reserve(ops.size());
  struct GroupScope {
    RankState& s;
    ~GroupScope() { s.p2p_group = 0; }
  } scope{s_};
  s_.p2p_group = ++s_.p2p_groups_posted;
  for (const P2POp& p : ops) {
    works.push_back(p.op == CommOp::Send ? send(p.tensor, p.peer, Async::Yes)
                                         : recv(p.tensor, p.peer, Async::Yes));
  }
  return works;
}

// ---- time, regions, output -------------------------------------------------------------------------

void SimRank::synchronize() {
  world_.check_thread(rank_, "synchronize()");
  world_.check_aborted();
  fold_waits("synchronize()");
  world_.settle_compute(rank_);  // while the operations its kernels overlap are still listed
  for (const auto& op : s_.outstanding) {
    world_.wait_finished(rank_, op, "synchronize()");
    op->member_of(rank_).waited = true;  // the device is idle: nothing is in flight any more
  }
  s_.outstanding.clear();
  double t = std::max(s_.host_us, s_.compute_us);
  for (const auto& [key, stream] : s_.streams) t = std::max(t, stream.end_us);
  s_.host_us = t;
}

double SimRank::now() {
  world_.check_thread(rank_, "now()");
  world_.check_aborted();
  // The host clock moves only with the rank's own calls, so a loop waiting on now() would never end.
  constexpr std::int64_t kSpinLimit = 10'000'000;
  if (s_.host_us != last_now_us_) {
    last_now_us_ = s_.host_us;
    same_now_calls_ = 0;
  } else if (++same_now_calls_ >= kSpinLimit) {
    throw UsageError(fmt::format(
        "{}: returned the same time ({} us) {} times in a row; the simulated host clock moves only with "
        "the rank's own calls (kernels, communication, synchronize()), so a loop that waits for time to "
        "pass never ends",
        where("now()"), s_.host_us, kSpinLimit));
  }
  return s_.host_us;
}

Event SimRank::record_event() {
  world_.check_aborted();
  // The stream reaches the marker when its earlier kernels (and any synchronous collective it waits
  // for) are done, and not before the host enqueues it.
  fold_waits("record_event");
  world_.settle_compute(rank_);
  return Event(std::make_shared<SimEvent>(rank_, std::max(s_.host_us, s_.compute_us)));
}

double SimRank::elapsed_us(const Event& start, const Event& end) {
  world_.check_aborted();
  const SimEvent* e[2] = {nullptr, nullptr};
  const Event* ev[2] = {&start, &end};
  const char* names[2] = {"start", "end"};
  for (int i = 0; i < 2; ++i) {
    if (!ev[i]->defined()) {
      throw UsageError(fmt::format("{}: '{}' is an undefined event; make it with record_event()",
                                   where("elapsed_us"), names[i]));
    }
    e[i] = dynamic_cast<const SimEvent*>(ev[i]->state());
    if (e[i] == nullptr || e[i]->rank != rank_) {
      throw UsageError(
          fmt::format("{}: '{}' was recorded by {}; a rank can only time its own events", where("elapsed_us"),
                      names[i], e[i] ? fmt::format("rank {}", e[i]->rank) : std::string("another backend")));
    }
  }
  s_.host_us = std::max(s_.host_us, e[1]->time_us);  // cudaEventSynchronize on `end`
  return e[1]->time_us - e[0]->time_us;
}

void SimRank::region_begin(const std::string& name) {
  regions_.emplace_back(name, s_.host_us);
}

void SimRank::region_end() {
  // Regions end in destructors, also while an out-of-memory error unwinds the rank's stack.
  unpoison_dead_stack();
  if (regions_.empty()) throw UsageError(where("region_end") + ": no region is open");
  world_.add_region(rank_, regions_.back().first, regions_.back().second, s_.host_us);
  regions_.pop_back();
}

void SimRank::show(const std::string& label, const Tensor& t) {
  require(t, "show", "t");
  std::string values;
  if (t.phantom()) {
    values = fmt::format("<{}>", t.str());
  } else {
    // Out of band: wait for the numbers without moving the host clock (unlike to_host).
    before_kernel({&t}, "show");
    values = format_values(t.shape(), std::vector<float>(sim_data(t), sim_data(t) + t.numel()));
  }
  world_.show(rank_, label, values);
}

void SimRank::check(const std::string& what, bool passed, const std::string& detail) {
  world_.add_check(rank_, what, passed, detail);
  if (!passed) {
    world_.print(fmt::format("CHECK FAILED on rank {}: {} ({})", rank_, what, detail));
  } else if (rank_ == 0) {
    world_.print(fmt::format("check passed: {}{}{}", what, detail.empty() ? "" : " — ", detail));
  }
}

void SimRank::finish() {
  if (!regions_.empty()) {
    throw UsageError(fmt::format("{}: region '{}' was never closed", where("finish"), regions_.back().first));
  }
  synchronize();
}

}  // namespace ranklab::sim