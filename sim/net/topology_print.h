// What `ranklab topo` prints: the modelled machine as the lecture's hierarchy of interconnects, fastest
// first, with HBM beside it for scale, then the devices of a node and the fabric between nodes.
#pragma once

#include <string>

#include "sim/net/topology.h"

namespace ranklab::sim {

std::string format_topology(const Topology& topo);

}  // namespace ranklab::sim
