// Pipeline parallelism: 1F1B (Narayanan et al. 2019, PipeDream-Flush) and its interleaved form (Narayanan
// et al. 2021), as Megatron-LM schedules them.
//
// The layers are cut into pp stages; a stage computes a micro-batch and sends the activation on. 1F1B runs
// each stage's forwards ahead of its backwards only as far as needed to fill the pipeline (the warm-up,
// pp - stage - 1 forwards), then alternates one forward and one backward (the steady state), then runs
// the remaining backwards (the cool-down). A stage keeps at most pp - stage micro-batches' activations.
//
// The pipeline is idle while it fills and drains: the bubble, (pp - 1) / m of the ideal time for m
// micro-batches. Interleaving gives each rank v model chunks instead of one contiguous stage (rank p holds
// chunks p, p + pp, p + 2pp, ... of pp·v), so a micro-batch goes around the ranks v times in smaller
// steps and the fill and drain are v times shorter: (pp - 1) / (v m). The price is v times the
// point-to-point messages, and Megatron's schedule needs m to be a multiple of pp: micro-batches go
// through the chunks in groups of pp, so that each rank's forward of chunk c for a group comes right when
// the previous rank has finished it.
//
// Each transition sends the task's result and receives the next task's input in one batch_isend_irecv
// (as Megatron's send_forward_recv_backward does), so two neighbours exchanging in both directions never
// wait on each other. The compute stream waits for the receive just before the task that reads it: the
// transfer itself is exposed. With overlap_p2p (Megatron-LM's overlap_p2p_comm, which its interleaved
// schedule runs by default) each receive is posted one task earlier, with the send of the task before, so
// in the steady state a forward's input arrives while the rank runs a backward, and the other way round,
// at the cost of one more activation-sized buffer alive.
#pragma once

#include <functional>
#include <vector>

#include "common/rank.h"
#include "lessons/parallel/exposed.h"

namespace ranklab::parallel {

struct Task {
  bool forward = true;
  int chunk = 0;  // model chunk of this rank, 0 .. v-1
  int mb = 0;     // micro-batch
};

// The order in which pipeline rank `stage` of `pp` runs its tasks for m micro-batches and v chunks.
std::vector<Task> schedule(int pp, int stage, int v, int m);

// The schedule's tasks up to the end of one whole period of its steady state: whatever it keeps alive at its
// most (of micro-batches, or of bytes however many each chunk's take), the whole schedule keeps no more. The
// steady state pairs the forward of the k-th task with the backward of the (k - warm-up)-th, and both repeat
// their chunks every pp x v tasks, each chunk pp times, so what is alive repeats with that period; the
// cool-down only frees. A planner walks this and not the thousands of tasks of a large global batch.
std::vector<Task> schedule_through_first_period(int pp, int stage, int v, int m);

// The most micro-batches whose activations a rank keeps at once, per chunk, walking its schedule.
std::vector<int> most_alive(const std::vector<Task>& order, int v);

struct PipelineTimes {
  double busy_us = 0;    // the tasks' time on the compute stream
  double window_us = 0;  // from the schedule's start to its last task's end
};

class Pipeline {
 public:
  // pp_ranks: the global ranks of this rank's pipeline, stage order.
  Pipeline(Rank& r, std::vector<int> pp_ranks, int stage, int v, int m, bool phantom, ExposedComm& exposed);

  // forward(task, input) -> output (input undefined on the first virtual stage, output ignored on the last);
  // backward(task, grad of output) -> grad of input (grad undefined on the last virtual stage).
  using Fn = std::function<Tensor(const Task&, const Tensor&)>;
  // Runs one step's schedule. `act` is the shape and dtype of what crosses stages. With `timed`, every task
  // is bracketed by events and times() reads them.
  void run(const Shape& act, DType dtype, const Fn& forward, const Fn& backward, bool timed);
  PipelineTimes times();
  // The timed step's tasks on the run's clock, for the report: `origin` is an event this rank recorded when
  // its host clock read `origin_us` with the device idle.
  std::vector<PipelineTask> tasks(const Event& origin, double origin_us);
  const std::vector<Task>& order() const { return order_; }

  bool overlap_p2p = false;  // receives posted a task earlier (see the top of this file)

 private:
  bool first_virtual(const Task& t) const { return t.chunk == 0 && stage_ == 0; }
  bool last_virtual(const Task& t) const { return t.chunk == v_ - 1 && stage_ == pp_ - 1; }
  bool needs_input(const Task& t) const { return t.forward ? !first_virtual(t) : !last_virtual(t); }
  bool sends_output(const Task& t) const { return t.forward ? !last_virtual(t) : !first_virtual(t); }

  Rank& r_;
  std::vector<int> ranks_;
  int pp_, stage_, v_;
  bool phantom_;
  ExposedComm& exposed_;
  std::vector<Task> order_;
  Event start_;
  std::vector<Event> task_events_;
};

}  // namespace ranklab::parallel
