// ContentionModel: how communication kernels slow the compute kernels beside them on one GPU.
//
// NCCL runs a collective as thread blocks, one SM per channel, reading and writing the GPU's HBM. A
// compute kernel that overlaps it gets the SMs those blocks leave for its arithmetic and the HBM bandwidth
// their traffic leaves for its memory traffic, and takes the slower of the two at each moment (docs/model.md,
// "SM and HBM contention"). This class owns that arithmetic and nothing else: which kernels wait to be
// timed, and which operations may overlap them, is the world's (SimWorld::launch_kernel, try_settle); it
// hands the operations in, and gets back an end time and whether that end is final.
//
// It sits beside ComputeModel, which times a kernel on an idle GPU; this one stretches that time by what
// else the GPU runs. It keeps its scratch lists between calls: a phantom step times millions of kernels.
#pragma once

#include <memory>
#include <vector>

#include "common/profile.h"
#include "sim/comm_op.h"
#include "sim/compute_model.h"
#include "sim/front_queue.h"
#include "sim/net/comm_plan.h"
#include "sim/net/topology.h"
#include "sim/net/transfer_engine.h"

namespace ranklab::sim {

class ContentionModel {
 public:
  // `gpu`, `topology` and `engine` outlive the model (the world owns all four).
  ContentionModel(const GpuModel& gpu, const Topology& topology, TransferEngine& engine)
      : gpu_(gpu), topo_(topology), engine_(engine) {}

  // Sets what `op`, run as `plan`, takes from each member's GPU while it runs: its channels (SMs) and
  // its HBM traffic in bytes per microsecond.
  void set_hbm_rates(CommOpState& op, const CommPlan& plan) const;

  // The end of a kernel of cost `cost` from `start_us`, under the operations of [first, last) that are in
  // flight on its GPU, taking an operation whose end is not known as running on. `known` is set when
  // nothing unknown could change the end, `started` when every operation that could overlap the kernel
  // has started.
  using OpIterator = FrontQueue<std::shared_ptr<CommOpState>>::const_iterator;
  double kernel_end_us(OpIterator first, OpIterator last, double start_us, const KernelCost& cost,
                       bool& known, bool& started);

  // Whether the end kernel_end_us gave is final: the engine has reached it, or nothing the engine holds
  // starts or ends before it, so each operation in flight lasts past it.
  bool settled(bool known, bool started, double end_us) const;

 private:
  struct Load {
    double from_us, to_us;
    int channels;
    double hbm_bytes_per_us;
  };
  const GpuModel& gpu_;
  const Topology& topo_;
  TransferEngine& engine_;
  std::vector<Load> loads_;              // scratch of kernel_end_us
  std::vector<double> load_changes_us_;  // when the operations in flight change, after the kernel's start
};

}  // namespace ranklab::sim
