// The report's description of the machine a run used (RunReport::topology), from the simulator's model.
#pragma once

#include "common/report.h"
#include "sim/net/topology.h"

namespace ranklab::sim {

// The part of `topo` that a run of `world` ranks used: rank r's GPU is GPU r; with it come every other
// device of the nodes that hold a rank (NVSwitch, PCIe switches, CPU, NICs: drawn idle where no byte
// crossed them, which is a lesson too), the fabric's switches that serve those nodes, and every link
// between two of these. GPUs first, in rank order; then the other devices as the links meet them.
RunTopology run_topology(const Topology& topo, int world);

}  // namespace ranklab::sim
