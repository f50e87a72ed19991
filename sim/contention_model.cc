#include "sim/contention_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

namespace ranklab::sim {

void ContentionModel::set_hbm_rates(CommOpState& op, const CommPlan& plan) const {
  op.channels = plan.channels;
  const double us = duration_us(plan);
  if (plan.flows.empty() || us <= 0) return;
  // A flow that leaves a GPU reads its bytes from that GPU's HBM, one that arrives writes them; a ring or
  // tree reduction adds each arriving piece to the GPU's own, which reads that much again (NVLS adds in
  // the switch). Spread over the time the plan takes alone on the machine, that is the rate.
  const bool reduces =
      (op.op == CommOp::AllReduce || op.op == CommOp::ReduceScatter || op.op == CommOp::Reduce) &&
      (plan.algorithm == Algorithm::Ring || plan.algorithm == Algorithm::Tree);
  // Spread evenly over the members: a double binary tree gives each GPU an inner node's place in one
  // tree and a leaf's in the other, which balance, and replicas of a symmetric run must see the same rate
  // to the bit whatever their place in a ring or tree. (A root's extra traffic is spread over its group.)
  double total_bytes = 0;
  for (const Flow& f : plan.flows) {
    const std::span<const LinkId> path = plan.path(f);
    if (path.empty()) continue;
    const double payload_bytes = plan.payload_bytes(f);
    if (topo_.leaves_gpu(path.front())) total_bytes += payload_bytes;
    if (topo_.enters_gpu(path.back())) total_bytes += (reduces ? 2.0 : 1.0) * payload_bytes;
  }
  op.hbm_bytes_per_us = std::round(total_bytes / static_cast<double>(op.members.size())) / us;
}

double ContentionModel::kernel_end_us(OpIterator first, OpIterator last, double start_us,
                                      const KernelCost& cost, bool& known, bool& started) {
  known = true;
  started = true;
  const double nominal_us = cost.us();
  if (nominal_us <= 0) return start_us;
  std::vector<Load>& loads = loads_;
  std::vector<double>& changes_us = load_changes_us_;
  loads.clear();
  changes_us.clear();
  for (auto it = first; it != last; ++it) {
    const std::shared_ptr<CommOpState>& op = *it;
    if (!op->executed) {
      // Its start is not known: it may yet start during the kernel. With every member there and ready,
      // it waits only for operations before it on their streams, which end in the engine: it starts
      // after the engine's next event.
      known = false;
      if (!op->all_arrived() || op->unready > 0) started = false;
      continue;
    }
    if (op->finished && op->end_us <= start_us) continue;
    const int channels = gpu_.sm_count > 0 ? op->channels : 0;
    const double hbm = op->hbm_bytes_per_us;
    if (channels <= 0 && hbm <= 0) continue;  // takes nothing from the kernel
    const double to_us = op->finished ? op->end_us : std::numeric_limits<double>::infinity();
    loads.push_back({op->start_us, to_us, channels, hbm});
    if (op->start_us > start_us) changes_us.push_back(op->start_us);
    if (std::isfinite(to_us)) changes_us.push_back(to_us);
  }
  if (loads.empty()) return start_us + nominal_us;
  std::sort(changes_us.begin(), changes_us.end());
  // How much longer the kernel runs, per unit of its own time, with these operations beside it.
  const double hbm_peak_bytes_per_us = gpu_.hbm_bandwidth_gbps * 1e3;
  auto stretch = [&](double t_us) {
    int channels = 0;
    double hbm = 0;
    for (const Load& l : loads) {
      if (l.from_us <= t_us && t_us < l.to_us) {
        channels += l.channels;
        hbm += l.hbm_bytes_per_us;
      }
    }
    if (channels == 0 && hbm == 0) return 1.0;
    // The SMs NCCL's blocks hold are not the kernel's; one SM at least stays its own.
    const double sm_share =
        channels > 0 ? static_cast<double>(std::max(1, gpu_.sm_count - channels)) / gpu_.sm_count : 1.0;
    // HBM shared with the communication's traffic; when both ask for more than it has, each gets an even
    // share at least, as the links share bandwidth max-min fairly (sim/net/sharing.h).
    const double hbm_share =
        hbm_peak_bytes_per_us > 0 ? std::max(0.5, 1.0 - hbm / hbm_peak_bytes_per_us) : 1.0;
    return std::max(cost.math_us / sm_share, cost.memory_us / hbm_share) / nominal_us;
  };
  double t_us = start_us, left_us = nominal_us;  // left_us: the kernel's own time still to run
  double end_us = start_us + nominal_us;
  std::size_t next = 0;
  while (true) {
    while (next < changes_us.size() && changes_us[next] <= t_us) ++next;
    const double until_us =
        next < changes_us.size() ? changes_us[next] : std::numeric_limits<double>::infinity();
    const double f = stretch(t_us);
    if (t_us == start_us && f == 1.0 && until_us - t_us >= left_us) break;  // untouched: exactly as alone
    if ((until_us - t_us) / f >= left_us) {
      end_us = t_us + left_us * f;
      break;
    }
    left_us -= (until_us - t_us) / f;
    t_us = until_us;
  }
  // An operation in flight whose end is not known yet may end before the kernel does.
  for (const Load& l : loads) {
    if (!std::isfinite(l.to_us) && l.from_us < end_us) known = false;
  }
  return end_us;
}

bool ContentionModel::settled(bool known, bool started, double end_us) const {
  if (known) return true;
  // Once the engine has reached the end so computed, every operation still in flight lasts past it and
  // none that has not started can start before it.
  if (engine_.now_us() >= end_us) return true;
  // Every operation that could overlap has started, and the engine holds no start or end before the
  // kernel's end: those in flight end after it. (Transfers other ranks start before then take bandwidth;
  // they could move an end earlier only through max-min's second-order shifts, which this leaves out.)
  return started && engine_.next_event_us() >= end_us;
}

}  // namespace ranklab::sim
