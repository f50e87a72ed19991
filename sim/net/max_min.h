// Max-min fair bandwidth sharing: how concurrent flows divide the links they cross.
//
// A flow's rate is limited by its most contended link. Max-min fairness (Bertsekas & Gallager, "Data
// Networks", 2nd ed., section 6.5.2) gives every flow as much as it can get without taking from a flow that
// has less; progressive filling computes it: raise all rates together until some link is full, fix the
// flows crossing it, and go on with the rest. This is the flow-level model network simulators use for
// TCP-like and RDMA traffic (SimGrid's LMM solver is the classic implementation), and what NCCL's channels
// see when two collectives share NVLink or a NIC.
//
// Pure functions over numbered links and flows, so the simulator's engine can call them with whatever set
// of transfers is in flight at a moment.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ranklab::sim {

// Flows over links numbered [0, capacity_gbps.size()).
struct FlowNetwork {
  std::vector<double> capacity_gbps;         // per link, GB/s (1e9 bytes per second)
  std::vector<std::uint32_t> path_begin{0};  // flow i crosses path_links[path_begin[i], path_begin[i + 1])
  std::vector<std::uint32_t> path_links;

  int flows() const { return static_cast<int>(path_begin.size()) - 1; }
  int links() const { return static_cast<int>(capacity_gbps.size()); }
  // Adds a link and returns its number.
  std::uint32_t add_link(double capacity_gbps);
  // Adds a flow over `links` (each a number from add_link, none twice) and returns its number.
  int add_flow(std::span<const std::uint32_t> links);
  std::span<const std::uint32_t> path(int flow) const {
    return {path_links.data() + path_begin[flow], path_begin[flow + 1] - path_begin[flow]};
  }
};

// Each flow's max-min fair rate in GB/s. A flow that crosses no link is not limited: +infinity.
// `active`, when given, says which flows take part (the others get 0 and use nothing).
// O(levels x (links + flows' path lengths)), where levels is the number of distinct bottleneck rates.
std::vector<double> max_min_rates(const FlowNetwork& net, const std::vector<bool>* active = nullptr);

// Flows that all start at time 0, flow i carrying bytes[i]; whenever one finishes, the others' rates are
// shared again. Returns when each finishes, in microseconds (0 for a flow of no bytes or no links).
std::vector<double> fluid_finish_us(const FlowNetwork& net, std::span<const double> bytes);

}  // namespace ranklab::sim
