// TransferEngine: communication in flight, in virtual time, with links shared between transfers.
//
// Each operation the simulator executes becomes a transfer: its plan's flows start at the operation's
// start time and share every link they cross max-min fairly with every other flow in flight at that
// moment (sim/max_min.h); when its last flow is done, the plan's latency follows, and then the operation
// has ended. Whenever a flow starts or finishes, the rates of all flows are shared again, so an end time
// is provisional until the engine reaches it. The simulator moves the engine forward only to times that
// no rank can issue work before (sim/world.cc), so a transfer that starts at t sees every transfer that
// started before t.
//
// A transfer whose start lies before the engine's present (possible when a host rendezvous wakes a rank
// whose clock is behind) is progressed alone up to the present and then joins the others: its contention
// with transfers that already ended is not modelled. The engine counts such late starts.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "sim/comm_op.h"
#include "sim/comm_plan.h"
#include "sim/topology.h"

namespace ranklab::sim {

class TransferEngine {
 public:
  explicit TransferEngine(const Topology& topology) : topo_(topology) {}

  double now_us() const { return now_us_; }
  // `op` moves `plan` from `start_us` on.
  void schedule(std::shared_ptr<CommOpState> op, CommPlan plan, double start_us);
  // When the next start or end happens (+infinity when nothing is in flight).
  double next_event_us() const;
  // Processes every start and end up to `t_us` and moves the present there (never backwards). Returns the
  // operations that ended, with end_us set and finished true, in the order they ended.
  std::vector<std::shared_ptr<CommOpState>> advance_to(double t_us);
  bool idle() const { return transfers_.empty(); }
  long late_starts() const { return late_starts_; }

 private:
  struct Transfer {
    std::shared_ptr<CommOpState> op;
    CommPlan plan;
    std::vector<double> left_bytes;  // per flow
    int flows_left = 0;
    double flows_done_us = -1;  // when the last flow finished; then the latency runs
  };
  // One flow of one transfer in flight.
  struct Running {
    Transfer* transfer;
    int flow;
  };

  void begin_flows(Transfer* t);
  void reshare();
  // Moves every running flow forward by `dt_us` at its current rate.
  void progress(double dt_us);
  // Retires flows with nothing left; a transfer with no flow left starts its latency tail.
  void retire_done_flows();
  double next_flow_end_us() const;

  const Topology& topo_;
  double now_us_ = 0;
  std::vector<std::unique_ptr<Transfer>> transfers_;  // in flight (waiting, flowing or in latency)
  std::multimap<double, Transfer*> starts_;           // future starts
  std::multimap<double, Transfer*> tails_;            // transfers whose flows are done: end time
  std::vector<Running> running_;
  std::vector<double> rate_bytes_per_us_;            // per running flow
  std::vector<std::shared_ptr<CommOpState>> ended_;  // finished but not yet handed out
  long late_starts_ = 0;
};

}  // namespace ranklab::sim
