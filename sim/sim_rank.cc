// SimRank: the checks every call makes, the compute stream's waits for communication, and the calls
// that communicate, synchronize or keep time. Its tensors and kernels are in sim/sim_rank_kernels.cc.
#include "sim/sim_rank.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <boost/fiber/operations.hpp>
#include <cmath>
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
    world_.stream_waits_for(rank_, op_);
  }
  bool waited() const override { return synchronous_ || op_->member_of(rank_).waited; }
  double elapsed_us() override {
    if (!op_->finished) world_.wait_finished(rank_, op_, "Work::elapsed_us()");
    return op_->end_us - op_->start_us;
  }
  std::optional<double> elapsed_us_if_ended() override {
    if (!op_->finished) return std::nullopt;
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
  world_.scheduler().check_thread(rank_, op);
  world_.scheduler().check_aborted();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  if (t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
  // An FP8 tensor goes only into matmul, copies, and communication that moves it without adding it up.
  if (is_float8(t.dtype()) && !takes_float8(op)) {
    check_float8_use(rank_, op, t, arg);
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
  world_.scheduler().check_thread(rank_, op);
  world_.scheduler().check_aborted();
  MemoryAccount& m = *memory_;
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
  return Tensor(s, dtype, std::make_shared<SimStorage>(memory_, s.numel(), dtype, phantom));
}

void SimRank::before_reading(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    SimStorage& st = *sim_storage(*t);
    const bool all_read = std::all_of(st.uses().begin(), st.uses().end(), [&](const PendingUse& u) {
      return !st.overlaps(u) || u.reads_only || u.op->member_of(rank_).waited;
    });
    if (!all_read) {
      before_kernel({t}, op);
      continue;
    }
    // The readers in flight stay recorded, so that a kernel writing the buffer later is still caught.
    std::erase_if(st.uses(),
                  [&](const PendingUse& u) { return st.overlaps(u) && u.op->member_of(rank_).waited; });
  }
  world_.waits_before_kernel(rank_, op);
}

void SimRank::before_kernel(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    SimStorage& st = *sim_storage(*t);
    for (const PendingUse& u : st.uses()) {
      if (st.overlaps(u) && !u.op->member_of(rank_).waited) {
        throw UsageError(fmt::format(
            "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
            "before touching the tensor (on a GPU this would be a silent race)",
            where(op), t->str(), u.op->label()));
      }
    }
    std::erase_if(st.uses(), [&](const PendingUse& u) { return st.overlaps(u); });
  }
  world_.waits_before_kernel(rank_, op);
}

void SimRank::launch_kernel(const std::string& name, double flops, double bytes, DType dtype) {
  launch_kernel_cost(name, world_.compute().kernel_cost(flops, bytes, dtype));
}

void SimRank::launch_kernel_cost(const std::string& name, const KernelCost& cost) {
  // Kernels that read no tensor (fills, random numbers) wait too.
  world_.waits_before_kernel(rank_, name.c_str());
  world_.advance_host(rank_, world_.compute().launch_us());
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
  world_.host_waits_for_stream(rank_, "to_host");  // a device-to-host copy waits for the stream
  return std::vector<float>(sim_data(t), sim_data(t) + t.numel());
}

// ---- communication ---------------------------------------------------------------------------------

void SimRank::validate(const CommCall& call) const {
  world_.operations().check_group(rank_, call.group, comm_op_name(call.op));  // before anything indexes by it
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
         (!call.output.defined() || !sim_storage(call.output)->overlaps(*sim_storage(call.input)));
}
}  // namespace

// Communication on a buffer that an Async::Yes operation not yet waited on still uses runs on another
// stream on a GPU: unless both only read it, the two race.
void SimRank::check_no_race(const CommCall& call) const {
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    SimStorage& st = *sim_storage(*t);
    for (const PendingUse& u : st.uses()) {
      if (!st.overlaps(u) || u.op->member_of(rank_).waited || (u.reads_only && only_reads(call, *t)))
        continue;
      throw UsageError(fmt::format(
          "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
          "first (on a GPU the two would race on different streams)",
          where(comm_op_name(call.op)), t->str(), u.op->label()));
    }
  }
}

Work SimRank::communicate(const CommCall& call) {
  world_.scheduler().check_thread(rank_, comm_op_name(call.op));
  world_.scheduler().check_aborted();
  validate(call);
  check_no_race(call);
  if (call.op == CommOp::Barrier) {
    world_.barrier(rank_, call.group);
    return Work();
  }
  world_.advance_host(rank_, world_.compute().launch_us());
  world_.before_issue(rank_, call);
  std::shared_ptr<CommOpState> op = world_.post(rank_, call);
  if (call.async == Async::No) {
    world_.stream_waits_for(rank_, op);  // the compute stream waits for it; the host goes on
    return Work(SimWork::done(world_, rank_, op));
  }
  world_.note_async_posted(rank_, op);
  for (const Tensor* t : {&call.input, &call.output}) {
    if (!t->defined()) continue;
    sim_storage(*t)->add_use(op, only_reads(call, *t));
  }
  return Work(std::make_shared<SimWork>(world_, rank_, op));
}

std::vector<Work> SimRank::batch_isend_irecv(const std::vector<P2POp>& ops) {
  world_.scheduler().check_aborted();
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
    SimWorld& world;
    int rank;
    ~GroupScope() { world.end_p2p_group(rank); }
  } scope{world_, rank_};
  world_.begin_p2p_group(rank_);
  for (const P2POp& p : ops) {
    works.push_back(p.op == CommOp::Send ? send(p.tensor, p.peer, Async::Yes)
                                         : recv(p.tensor, p.peer, Async::Yes));
  }
  return works;
}

// ---- time, regions, output -------------------------------------------------------------------------

void SimRank::synchronize() {
  world_.scheduler().check_thread(rank_, "synchronize()");
  world_.scheduler().check_aborted();
  world_.synchronize(rank_);
}

double SimRank::now() {
  world_.scheduler().check_thread(rank_, "now()");
  world_.scheduler().check_aborted();
  // The host clock moves only with the rank's own calls, so a loop waiting on now() would never end.
  constexpr std::int64_t kSpinLimit = 10'000'000;
  const double host_us = world_.host_us(rank_);
  if (host_us != last_now_us_) {
    last_now_us_ = host_us;
    same_now_calls_ = 0;
  } else if (++same_now_calls_ >= kSpinLimit) {
    throw UsageError(fmt::format(
        "{}: returned the same time ({} us) {} times in a row; the simulated host clock moves only with "
        "the rank's own calls (kernels, communication, synchronize()), so a loop that waits for time to "
        "pass never ends",
        where("now()"), host_us, kSpinLimit));
  }
  return host_us;
}

Event SimRank::record_event() {
  world_.scheduler().check_aborted();
  // The stream reaches the marker when its earlier kernels (and any synchronous collective it waits
  // for) are done, and not before the host enqueues it.
  return Event(std::make_shared<SimEvent>(rank_, world_.stream_time_us(rank_, "record_event")));
}

namespace {

// The two events a rank times, each checked to be one its own record_event() made.
// `where` names the call in an error (formatted only for one).
template <class Where>
std::pair<const SimEvent*, const SimEvent*> own_events(const Event& start, const Event& end, int rank,
                                                       const Where& where) {
  const SimEvent* e[2] = {nullptr, nullptr};
  const Event* ev[2] = {&start, &end};
  const char* names[2] = {"start", "end"};
  for (int i = 0; i < 2; ++i) {
    if (!ev[i]->defined()) {
      throw UsageError(
          fmt::format("{}: '{}' is an undefined event; make it with record_event()", where(), names[i]));
    }
    e[i] = dynamic_cast<const SimEvent*>(ev[i]->state());
    if (e[i] == nullptr || e[i]->rank != rank) {
      throw UsageError(
          fmt::format("{}: '{}' was recorded by {}; a rank can only time its own events", where(), names[i],
                      e[i] ? fmt::format("rank {}", e[i]->rank) : std::string("another backend")));
    }
  }
  return {e[0], e[1]};
}

}  // namespace

double SimRank::elapsed_us(const Event& start, const Event& end) {
  world_.scheduler().check_aborted();
  const auto [s, e] = own_events(start, end, rank_, [&] { return where("elapsed_us"); });
  world_.host_waits_until(rank_, e->time_us);  // cudaEventSynchronize on `end`
  return e->time_us - s->time_us;
}

std::optional<double> SimRank::elapsed_us_if_ended(const Event& start, const Event& end) {
  world_.scheduler().check_aborted();
  const auto [s, e] = own_events(start, end, rank_, [&] { return where("elapsed_us_if_ended"); });
  if (world_.host_us(rank_) < e->time_us) return std::nullopt;  // cudaEventQuery: not ready
  return e->time_us - s->time_us;
}

void SimRank::region_begin(const std::string& name) {
  regions_.emplace_back(name, world_.host_us(rank_));
}

void SimRank::region_end() {
  // Regions end in destructors, also while an out-of-memory error unwinds the rank's stack.
  unpoison_dead_stack();
  if (regions_.empty()) throw UsageError(where("region_end") + ": no region is open");
  world_.add_region(rank_, regions_.back().first, regions_.back().second, world_.host_us(rank_));
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