#include "sim/net/max_min.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/errors.h"

namespace ranklab::sim {

std::uint32_t FlowNetwork::add_link(double capacity) {
  if (!(capacity > 0) || !std::isfinite(capacity)) {
    throw UsageError(fmt::format("a link's capacity must be a positive number of GB/s, got {}", capacity));
  }
  capacity_gbps.push_back(capacity);
  return static_cast<std::uint32_t>(capacity_gbps.size() - 1);
}

int FlowNetwork::add_flow(std::span<const std::uint32_t> links) {
  for (std::uint32_t l : links) {
    if (l >= capacity_gbps.size())
      throw UsageError(fmt::format("flow over link {}, which does not exist", l));
  }
  path_links.insert(path_links.end(), links.begin(), links.end());
  path_begin.push_back(static_cast<std::uint32_t>(path_links.size()));
  return flows() - 1;
}

std::vector<double> max_min_rates(const FlowNetwork& net, const std::vector<bool>* active) {
  const int F = net.flows(), L = net.links();
  std::vector<double> rate(F, 0.0);
  std::vector<char> fixed(F, 1);
  std::vector<double> remaining(net.capacity_gbps);
  std::vector<std::uint32_t> unfixed_on(L, 0);  // flows not yet fixed that cross each link

  // Link -> flows, for fixing every flow of a link that fills up.
  std::vector<std::uint32_t> begin(L + 1, 0);
  int open = 0;
  for (int f = 0; f < F; ++f) {
    if (active != nullptr && !(*active)[f]) continue;
    std::span<const std::uint32_t> path = net.path(f);
    if (path.empty()) {
      rate[f] = std::numeric_limits<double>::infinity();
      continue;
    }
    fixed[f] = 0;
    ++open;
    for (std::uint32_t l : path) ++unfixed_on[l];
  }
  for (int l = 0; l < L; ++l) begin[l + 1] = begin[l] + unfixed_on[l];
  std::vector<std::uint32_t> on_link(begin[L]);
  {
    std::vector<std::uint32_t> fill(begin.begin(), begin.end() - 1);
    for (int f = 0; f < F; ++f) {
      if (fixed[f]) continue;
      for (std::uint32_t l : net.path(f)) on_link[fill[l]++] = static_cast<std::uint32_t>(f);
    }
  }

  std::vector<std::uint32_t> busy;  // links some unfixed flow still crosses
  for (int l = 0; l < L; ++l) {
    if (unfixed_on[l] > 0) busy.push_back(static_cast<std::uint32_t>(l));
  }
  std::vector<std::uint32_t> full;
  while (open > 0) {
    // The fair share every unfixed flow could still get from its most contended link.
    double level = std::numeric_limits<double>::infinity();
    for (std::uint32_t l : busy) level = std::min(level, remaining[l] / unfixed_on[l]);
    level = std::max(level, 0.0);
    // Every link at that share is full: its flows can go no faster. (Relative tolerance, so flows that
    // tie in exact arithmetic are not split by rounding.)
    full.clear();
    for (std::uint32_t l : busy) {
      if (remaining[l] / unfixed_on[l] <= level * (1 + 1e-12)) full.push_back(l);
    }
    for (std::uint32_t l : full) {
      for (std::uint32_t i = begin[l]; i < begin[l + 1]; ++i) {
        const std::uint32_t f = on_link[i];
        if (fixed[f]) continue;
        fixed[f] = 1;
        rate[f] = level;
        --open;
        for (std::uint32_t m : net.path(static_cast<int>(f))) {
          remaining[m] = std::max(0.0, remaining[m] - level);
          --unfixed_on[m];
        }
      }
    }
    busy.erase(std::remove_if(busy.begin(), busy.end(), [&](std::uint32_t l) { return unfixed_on[l] == 0; }),
               busy.end());
  }
  return rate;
}

std::vector<double> fluid_finish_us(const FlowNetwork& net, std::span<const double> bytes) {
  const int F = net.flows();
  if (static_cast<int>(bytes.size()) != F) {
    throw UsageError(fmt::format("fluid_finish_us: {} byte counts for {} flows", bytes.size(), F));
  }
  std::vector<double> finish(F, 0.0), left(bytes.begin(), bytes.end());
  std::vector<bool> active(F, false);
  int running = 0;
  for (int f = 0; f < F; ++f) {
    if (bytes[f] > 0 && !net.path(f).empty()) {
      active[f] = true;
      ++running;
    }
  }
  double now_us = 0;
  while (running > 0) {
    const std::vector<double> rate = max_min_rates(net, &active);
    // GB/s is 1e3 bytes per microsecond. The next event is the first flow to finish at these rates.
    double step_us = std::numeric_limits<double>::infinity();
    for (int f = 0; f < F; ++f) {
      if (active[f]) step_us = std::min(step_us, left[f] / (rate[f] * 1e3));
    }
    now_us += step_us;
    for (int f = 0; f < F; ++f) {
      if (!active[f]) continue;
      left[f] -= rate[f] * 1e3 * step_us;
      // Flows within rounding of done finish now, so that flows that tie end in the same step.
      if (left[f] <= bytes[f] * 1e-9) {
        active[f] = false;
        finish[f] = now_us;
        --running;
      }
    }
  }
  return finish;
}

}  // namespace ranklab::sim
