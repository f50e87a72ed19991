// SimWorld: what the simulated ranks share, and the parts that run it. It owns each rank's clocks and
// streams (RankState) and brings together the parts that each own one job:
//   RankScheduler   blocking, waking, failing the run, deadlock reports (sim/rank_scheduler.h)
//   Operations      groups, the matching of calls into operations, their agreement, the order they run in
//                   and their completion (sim/operations.h)
//   Symmetry        which ranks run and which mirror them (sim/symmetry.h)
//   ContentionModel compute kernels slowed by communication beside them (sim/contention_model.h)
//   NetworkModel, TransferEngine   what an operation moves over which links, and when it ends (sim/net/)
// SimRank (the Rank interface) talks to it through the methods below.
//
// How an operation runs: a rank *posts* its part (the host does not wait, as with NCCL); when every
// member has posted and every operation it depends on has finished, the operation *executes*: its
// numerics are done on the members' buffers and its start (the latest member's ready time) is known.
// Its transfer then runs in the TransferEngine, sharing links with whatever else is in flight, and the
// operation *finishes* when the engine reaches its end. A rank blocks, in real time, only when it needs
// such an outcome: synchronize(), to_host(), barrier(), and a kernel after a synchronous collective or a
// wait() when it may need the collective's numbers (otherwise the kernel waits for it on the stream:
// may_defer_waits).
//
// Virtual time moves in two ways. Before a rank issues communication at its clock t, the engine is
// brought up to t as long as no other runnable rank is behind t (so a transfer issued at t sees every
// transfer started before t). When every live rank is blocked, the engine jumps to its next event. When
// every rank is blocked and the engine has nothing in flight, nothing can wake anyone: that is a
// deadlock, reported with every rank's pending operation.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/profile.h"
#include "common/progress.h"
#include "common/rank_timeline.h"
#include "common/report.h"
#include "sim/comm_op.h"
#include "sim/compute_model.h"
#include "sim/contention_model.h"
#include "sim/front_queue.h"
#include "sim/net/flow_heap.h"
#include "sim/net/network_model.h"
#include "sim/net/transfer_engine.h"
#include "sim/operations.h"
#include "sim/rank_scheduler.h"
#include "sim/sim_backend.h"
#include "sim/storage.h"
#include "sim/symmetry.h"

namespace ranklab::sim {

// The key of a rank's communication streams. Each group's collectives have their own stream (-1 - group
// id), as each torch.distributed process group has its own NCCL communicator and stream, so collectives
// of different groups can overlap; point-to-point traffic with each peer has its own stream (the peer's
// rank), as NCCL-backed torch.distributed gives each peer pair its own.
inline int collective_stream(int group_id) {
  return -1 - group_id;
}

// The stream `op` runs on for member `rank`.
inline int stream_of(const CommOpState& op, int rank) {
  if (op.op != CommOp::Send) return collective_stream(op.group_id);
  return rank == op.ranks[0] ? op.ranks[1] : op.ranks[0];
}

struct StreamState {
  double end_us = 0;                  // when the last executed operation on it ended
  std::shared_ptr<CommOpState> last;  // the last operation posted on it
  // Operations posted together (batch_isend_irecv) do not wait for each other, as in one NCCL group: each
  // waits for what the stream held before the group.
  std::uint64_t group = 0;
  std::shared_ptr<CommOpState> before_group;
  // Asynchronous operations on it, in posting order, neither finished nor waited on (async_in_flight).
  std::vector<std::shared_ptr<CommOpState>> unwaited;
};

struct RankState {
  double host_us = 0;
  double compute_us = 0;  // when the compute stream's last kernel ends
  std::map<int, StreamState> streams;
  // Operations the compute stream must wait for before its next kernel: synchronous ones, and asynchronous
  // ones wait() was called on (at most one per collective stream; SimWorld::stream_waits_for).
  // The next kernel takes them along when it need not block for them (SimWorld::may_defer_waits).
  std::vector<std::shared_ptr<CommOpState>> unfolded_waits;
  // Earlier operations on the same streams that those stand for: blocking for the later would have seen
  // these end too, and let go of their buffers (SimWorld::defer_waits).
  std::vector<std::shared_ptr<CommOpState>> folded_with;
  // defer_waits has run since unfolded_waits last grew (and no asynchronous operation was posted since):
  // the kernel about to launch need not ask again (SimWorld::waits_before_kernel, which a kernel calls
  // before its numerics and again at its launch).
  bool waits_deferred = false;
  // Asynchronous operations posted and neither finished nor waited on, nor before one waited on on the
  // same stream (StreamState::unwaited). Their buffers are let go when they end, wherever the rank's
  // program then is, so a rank that ran ahead of its operations would see them later: the next kernel
  // blocks for the compute stream's waits while there are any.
  int async_in_flight = 0;
  // Everything this rank posted that has not executed (synchronize waits for all of it).
  std::vector<std::shared_ptr<CommOpState>> outstanding;
  std::size_t outstanding_prune_at = 64;  // its size at which finished entries are next dropped
  // Device time the compute stream lost to communication kernels running beside it (launch_kernel).
  double comm_slowed_compute_us = 0;
  // Device time the compute stream stood idle until the host had launched its next kernel (launch_kernel).
  double host_wait_us = 0;
  // Kernels launched while communication they may overlap was in flight or not yet started, whose times
  // are not known yet: compute_us is where the first of them may start (SimWorld::settle_compute).
  struct PendingKernel {
    SpanName name;
    KernelCost cost;
    double host_us;  // the host clock at its launch: it starts no earlier
    // What the compute stream waited for before it (unfolded_waits, when the rank did not block for them):
    // it starts no earlier than `after_us`, the end of those that had ended, nor than the end of `after`,
    // the one that had not (SimWorld::may_defer_waits lets one at most), and cannot be timed before then.
    double after_us = 0;
    std::shared_ptr<CommOpState> after;
  };
  FrontQueue<PendingKernel> pending_kernels;
  std::uint64_t kernels_timed = 0;  // kernels launched before the first of pending_kernels
  // What the rank posted that a kernel launched from now on may still overlap: dropped once finished
  // before the compute stream's clock.
  FrontQueue<std::shared_ptr<CommOpState>> beside_ops;
  std::size_t beside_ops_prune_at = 16;
  // Collectives posted behind pending kernels: the member is ready when the kernels launched before it
  // (`kernels_before`, counted from the rank's first, as kernels_timed) have ended, and not before
  // `host_us`, the host clock at the post. The rank goes on instead of waiting for those kernels' times;
  // the world settles them as the engine learns what they overlap (SimWorld::resettle), and the operation
  // starts once every member's ready time is known. In posting order, so readied from the front.
  struct DeferredPost {
    std::shared_ptr<CommOpState> op;
    std::uint64_t kernels_before;
    double host_us;
  };
  FrontQueue<DeferredPost> deferred_posts;
  // While the rank waits in settle_compute, or has deferred posts: the end, as far as known, of the kernel
  // they wait for (the engine must not pass it); NaN otherwise.
  double watched_end_us = std::numeric_limits<double>::quiet_NaN();
  bool settling = false;         // blocked in settle_compute
  bool resettle_queued = false;  // in SimWorld::resettles_, not yet run
  std::shared_ptr<MemoryAccount> memory;
  // A phantom buffer charged to no account, which an operation the rank no longer blocks for holds in
  // place of the rank's tensors (SimWorld::defer_waits).
  std::shared_ptr<Storage> uncharged;
  std::map<int, std::uint64_t> barrier_seq;  // per group id
  std::uint64_t p2p_group = 0;  // nonzero while a batch of point-to-point operations is being posted
  std::uint64_t p2p_groups_posted = 0;
  std::uint64_t shows = 0;
  // The rank's busy and idle totals (SimWorld::add_span), and the size at which it is next folded.
  RankTimeline timeline;
  std::size_t timeline_fold_at = 64;
  std::size_t timeline_held_most = 0;
  // The host clock at each post whose operation has not finished, in posting order from the post numbered
  // `first_unfinished_post`: an operation starts no earlier than any member's post, so no transfer span of
  // this rank will start before the first of these (SimWorld::timeline_watermark).
  struct PostMark {
    double host_us = 0;
    bool finished = false;
  };
  FrontQueue<PostMark> unfinished_posts;
  std::uint64_t first_unfinished_post = 0;
};

class SimWorld {
 public:
  SimWorld(const SimConfig& config, int world_size);

  int size() const { return static_cast<int>(ranks_.size()); }
  // Symmetric runs (SimConfig::symmetry): whether `rank` runs a program of its own (it is a
  // representative) or mirrors its representative; every rank runs when there is no symmetry.
  bool runs(int rank) const { return symmetry_.runs(rank); }
  int representative(int rank) const { return symmetry_.representative(rank); }
  int running_ranks() const { return symmetry_.running(); }
  const Profile& profile() const { return config_.profile; }
  const SimConfig& config() const { return config_; }
  const ComputeModel& compute() const { return compute_; }
  // The algorithm and protocol the network model runs a collective `op` of `bytes` over the whole world
  // with ("ring/simple"): SimRank::collective_algorithm.
  std::string world_algorithm(CommOp op, std::int64_t bytes, int root) {
    return network_->plan_collective(op, bytes, operations_.world(), root).name();
  }
  // The rank's device memory account.
  const std::shared_ptr<MemoryAccount>& memory(int rank) const { return ranks_[rank]->memory; }

  // Runs one rank's program in its fiber: catches what it throws and finishes the rank.
  void run_rank(int rank, const std::function<void()>& program);

  // Posting. The call has been validated for this rank alone; these check it against the other members.
  std::shared_ptr<CommOpState> post(int rank, const CommCall& call);
  void barrier(int rank, const Group& group);
  void show(int rank, const std::string& label, const std::string& values);
  Group new_group(int rank, const std::vector<int>& ranks);
  // Groups, the matching of calls into operations, their agreement and order.
  const Operations& operations() const { return operations_; }

  // Blocking, waking, failing the run and deadlock reports.
  RankScheduler& scheduler() { return scheduler_; }
  const RankScheduler& scheduler() const { return scheduler_; }
  // What a rank blocked until `op` finishes waits for, for deadlock reports; `by` and `folded` as below.
  std::string describe_wait(int rank, const CommOpState& op, const char* by, bool folded) const;
  // Blocks until `op` has finished (its end time is final). `by` names the call that waits, for deadlock
  // reports; `folded` adds that `by` waits for `op` on the compute stream, after a synchronous call or a
  // wait() (formatted only when a report needs it, as a wait happens at every rank for every operation).
  void wait_finished(int rank, const std::shared_ptr<CommOpState>& op, const char* by, bool folded = false);
  // Called before `rank` issues `call`: lets ranks whose clocks are behind go first, and brings the
  // transfer engine up to this rank's clock. A call that only marks the rank arrived (arrival_only) goes
  // at once.
  void before_issue(int rank, const CommCall& call);
  // Launches a kernel on `rank`'s compute stream that costs `cost` on an idle GPU, given the
  // communication kernels on its GPU: while n channels of communication run, the kernel's arithmetic gets
  // the SMs they leave (its math time x sm_count / (sm_count - n)) and its memory traffic the HBM bandwidth
  // they leave; it takes the slower of the two at each moment. Only communication the rank posted before
  // the kernel can overlap it (a later one waits for the compute stream). Where such an operation's start
  // or end is not known yet, the kernel's times wait (pending_kernels) until something needs the compute
  // stream's clock (settle_compute). Adds the time lost to the rank's comm_slowed_compute_us.
  void launch_kernel(int rank, SpanName name, const KernelCost& cost);
  // Makes compute_us final: the pending kernels' times, once the engine knows the communication they
  // overlap (the rank waits for that, in real time). Everything that reads compute_us calls it first, but
  // for a collective's post, which may go on without it (RankState::deferred_posts).
  void settle_compute(int rank);
  // Device time the rank's compute stream lost to communication kernels running beside it.
  double comm_slowed_compute_us(int rank) const { return ranks_[rank]->comm_slowed_compute_us; }
  // Device time the rank's compute stream stood idle waiting for the host's next launch.
  double host_wait_us(int rank) const { return ranks_[rank]->host_wait_us; }

  // A rank's host clock and what moves it.
  double host_us(int rank) const { return ranks_[rank]->host_us; }
  void advance_host(int rank, double us) { ranks_[rank]->host_us += us; }
  // The host waits (cudaEventSynchronize) until `t_us`.
  void host_waits_until(int rank, double t_us);
  // When the compute stream reaches a marker the host enqueues now: after its kernels and what it waits for
  // (RankState::unfolded_waits, folded: the rank blocks until their ends are known). `by` names the call.
  double stream_time_us(int rank, const char* by);
  // The host waits for the compute stream (a device-to-host copy).
  void host_waits_for_stream(int rank, const char* by);
  // The host waits for every stream: the compute stream and everything the rank posted (synchronize()).
  void synchronize(int rank);

  // What the compute stream waits for.
  // Before its next kernel: `op`, synchronous or waited on. A group's collectives run one after another on
  // its stream, so the later of two stands for both.
  void stream_waits_for(int rank, const std::shared_ptr<CommOpState>& op);
  // Before a kernel: what it waits for is folded into the stream's clock (the rank blocks until their ends
  // are known), or, when only the ends are missing (may_defer_waits), taken along by the kernel while the
  // rank goes on. `by` names the kernel, for deadlock reports.
  void waits_before_kernel(int rank, const char* by);
  // Asynchronous `op`, just posted by `rank`; wait() called on it (RankState::async_in_flight). Its end
  // is noted by on_finished.
  void note_async_posted(int rank, const std::shared_ptr<CommOpState>& op);
  void note_waited(int rank, const std::shared_ptr<CommOpState>& op);
  // batch_isend_irecv: the point-to-point operations posted between these do not wait for each other.
  void begin_p2p_group(int rank);
  void end_p2p_group(int rank) { ranks_[rank]->p2p_group = 0; }

  // Whether posting `call` now only marks `rank` arrived: a collective that still waits for another member
  // after it. Such a post starts no transfer, so it need not wait for the ranks whose clocks are behind:
  // the engine stays behind their clocks either way, and a dependency that ends before this rank's clock
  // but that the engine has not reached yet delays nothing (the member is ready at its clock anyway). The
  // member that completes the operation still waits its turn. Each rank of a world-wide collective then
  // switches fibers once per call instead of twice. (Not in symmetric runs, where a post also marks the
  // members the rank stands for.)
  bool arrival_only(int rank, const CommCall& call) const;

  // Output and report.
  void print(const std::string& line);
  void add_span(int rank, SpanKind kind, SpanName name, double start_us, double end_us);
  void add_region(int rank, const std::string& name, double start_us, double end_us);
  void add_check(int rank, const std::string& what, bool passed, const std::string& detail);
  void set_training(const TrainingStats& stats) { report_.training = stats; }
  void add_pipeline(const std::vector<PipelineTask>& tasks) {
    report_.pipeline.insert(report_.pipeline.end(), tasks.begin(), tasks.end());
  }
  // Whether `rank` keeps its spans and regions in the report (SimConfig::trace_ranks); keep_in_trace marks
  // one when the lesson chooses.
  bool traced(int rank) const { return traced_[rank] != 0; }
  void keep_in_trace(int rank);
  // The most timeline intervals one rank held at once (SimBackend::timeline_held_most).
  std::size_t timeline_held_most() const;
  // The report, but for its topology: see describe_topology.
  RunReport finish_report();
  // RunReport::topology for this run. Separate from finish_report so that the caller can build it after
  // releasing the ranks' stacks: at 8,192 servers it is about a hundred megabytes of names, which would
  // otherwise add to the run's peak memory.
  RunTopology describe_topology() const;

 private:
  RankState& state(int rank) { return *ranks_[rank]; }
  // No span of `s` added from now on starts before this: its compute stream's clock bounds its kernels, the
  // host clock its posts to come, and its earliest unfinished post the transfers in flight.
  static double timeline_watermark(const RankState& s);
  // The post numbered `seq` of `s` has finished.
  static void finish_post(RankState& s, std::uint64_t seq);
  // Whether `rank`'s next kernel may take its unfolded_waits along instead of blocking for them: each has
  // finished, or its numbers are done (it executed, or this rank's buffers are phantoms), so only its end
  // is missing. Then the rank goes on, as a GPU's host does past a synchronous NCCL call, and its
  // synchronous collectives cost it no fiber switch. Not while an asynchronous operation the rank has not
  // waited on is in flight (RankState::async_in_flight), nor with more than one unfinished operation to
  // wait for, nor in symmetric runs or in clock order.
  bool may_defer_waits(int rank) const;
  // Lets the operations in unfolded_waits drop this rank's tensors, as the rank would see them freed had
  // it blocked until they finished: its memory is then counted at the same points of its program whether
  // it blocks or not. They keep the tensors' shapes (phantoms charged to no account).
  void defer_waits(int rank);
  // The compute stream's waits folded into its clock: the rank blocks until their ends are known.
  void fold_waits(int rank, const char* by);
  // Blocks `rank` until pred() holds (RankScheduler::block_until, queued by the rank's host clock).
  void block_until(int rank, const std::function<bool()>& pred, const std::function<std::string()>& what,
                   const CommOpState* op = nullptr);
  void try_execute(const std::shared_ptr<CommOpState>& op);
  void execute(const std::shared_ptr<CommOpState>& op);
  // Records what finished in the engine and executes what waited for it.
  void on_finished(const std::vector<EndedTransfer>& ended);
  // The report's record of an ended operation.
  CollectiveRecord collective_record(const CommOpState& op);
  // Moves the engine up to t_us, one ending at a time; stops early, returning true, when an ending woke a
  // rank: that rank may issue communication before t_us, and must find the engine no further than that.
  bool advance_engine(double t_us);
  // Moves the engine to its next event; false when nothing is in flight.
  bool advance_engine_one_event();
  // Starts loading the state of `op`'s member number `member` (nothing when there is none), and with
  // `with_fiber` the context of its suspended fiber: the loops over a large collective's members touch
  // every member's state, which with thousands of ranks is out of the cache, so they ask this many
  // members ahead.
  void prefetch_state(const CommOpState& op, std::size_t member, bool with_fiber = false) const;
  static constexpr std::size_t kPrefetchAhead = 8;

  // Runs the images of an operation that starts at `start_us` beside it (Symmetry::images): what the
  // other classes do at the same moment. `in_nodes`: the operation's plan, where it stays inside nodes, so
  // that an image in nodes where no rank runs need only count its traffic: its links are its node's own,
  // which only other images cross, and their copies in the representatives' nodes see all of theirs.
  void schedule_images(const std::shared_ptr<CommOpState>& op, double start_us, const CommPlan* in_nodes);
  // Per node: whether a rank of it runs (a representative).
  std::vector<char> node_runs_;

  struct HostRendezvous {
    int expected = 0;
    int arrived = 0;
    double latest_host_us = 0;
    std::vector<std::string> payload;  // show(): each member's formatted values
    std::string label;
    int first_rank = -1;  // show(): the rank whose label the others must match
  };
  HostRendezvous& host_rendezvous(const std::string& key, int expected);

  SimConfig config_;
  ComputeModel compute_;
  std::unique_ptr<NetworkModel> network_;
  Symmetry symmetry_;
  RankScheduler scheduler_;
  Operations operations_;
  TransferEngine engine_;
  ContentionModel contention_;
  std::vector<std::unique_ptr<RankState>> ranks_;
  std::map<std::string, HostRendezvous> host_rendezvous_;
  RunReport report_;
  std::vector<char> traced_;  // per rank: SimWorld::traced
  CollectiveTally collective_tally_;
  // A large world's run shows its communication finishing on stderr (a terminal only).
  Progress progress_;
  std::int64_t finished_ops_ = 0;
  std::string progress_detail_;
  // Names every operation of a kind shares, formatted and interned once: a collective's name ("all_reduce",
  // "send/recv"), a group's ("group 2 {0, 1}"; "rank 0 -> rank 1" for a pair), a plan's ("ring/simple").
  SpanName op_name(CommOp op);
  SpanName group_name(const CommOpState& op);
  SpanName plan_name(const CommPlan& plan);
  // By operation, by group id (pairs by (src, dst)) and by algorithm and protocol; "" where not made yet.
  std::vector<SpanName> op_names_;
  std::vector<SpanName> group_names_;
  std::map<std::pair<int, int>, SpanName> pair_names_;
  std::vector<SpanName> plan_names_;

  // The ranks the engine must stop for (RankState::watched_end_us), by that kernel's end as far as known:
  // those waiting in settle_compute, which issue nothing before it, and those with deferred posts, which
  // start no earlier. The engine is not moved past the first. Ties go to the lower rank.
  FlowHeap kernel_watches_;  // ids are ranks
  // The end of a kernel of `rank` from `start_us` under the communication its GPU has in flight
  // (ContentionModel::kernel_end_us over the operations that may overlap it). `kernel` is the kernel's
  // place in pending_kernels: deferred posts behind it cannot overlap it.
  double contended_end_us(int rank, std::size_t kernel, double start_us, const KernelCost& cost, bool& known,
                          bool& started);
  // Times the pending kernels whose overlap is known, from the first, and readies the deferred posts
  // behind them. Returns true when none is left pending; else `end_us` is, as far as known, the end of
  // the kernel the engine must stop at: the last one before the first deferred post, or the last one.
  bool try_settle(int rank, double& end_us);
  // Takes `op` off `rank`'s list of asynchronous operations not waited on, as it ends or (`waited`) is
  // waited on; a wait takes the collectives before it on its stream along, into folded_with.
  void forget_unwaited(int rank, const CommOpState& op, bool waited);
  // Drops from s.beside_ops what ended by `from_us`, before which no kernel of the rank starts from now on.
  static void drop_ops_over(RankState& s, double from_us);
  // When `kernel` starts if the stream's kernels before it end at `stream_us`: infinity while an
  // operation it waits for has not ended.
  static double kernel_start_us(const RankState::PendingKernel& kernel, double stream_us);
  // try_settle from the world's side, when the engine reaches a waiting rank's kernel or an operation it
  // overlaps starts or ends: wakes the rank if it waited in settle_compute and may go on, and keeps the
  // engine's stop for it up to date.
  void resettle(int rank);
  void watch_kernel_end(int rank, double end_us);  // sets the rank's entry of kernel_watches_
  void clear_kernel_watch(int rank);
  // Runs `op` if nothing holds it back any more (try_execute). One that still waits, but only for the
  // engine (for operations before it), tells its members that watch a kernel's end: whether that kernel
  // is final depends on it (ContentionModel::settled's `started`).
  void execute_readied(const std::shared_ptr<CommOpState>& op);
  // resettle, queued while the engine or an operation is half way through a change, and run after it.
  void resettle_later(int rank);
  void run_resettles();
  std::vector<int> resettles_;
  bool running_resettles_ = false;
  int changing_ = 0;  // on_finished and execute calls under way
  // One of them: raises changing_, and lowers it at done() or, should an exception leave first, on the
  // way out (the run then aborts, but nothing is left counting a change that is over).
  class Change {
   public:
    explicit Change(int& changing) : changing_(changing) { ++changing_; }
    ~Change() {
      if (!done_) --changing_;
    }
    Change(const Change&) = delete;
    Change& operator=(const Change&) = delete;
    void done() {
      --changing_;
      done_ = true;
    }

   private:
    int& changing_;
    bool done_ = false;
  };
  // When every live rank is blocked: moves the engine to its next event or to the first watched kernel end
  // (kernel_watches_), whichever is first. False when there is neither.
  bool advance_when_stalled();
  std::vector<double> pending_ends_us_;  // scratch of try_settle
  // Times again (resettle) the kernels of the ranks of kernel_watches_ whose end the engine has reached.
  void resettle_watched();
};

}  // namespace ranklab::sim
