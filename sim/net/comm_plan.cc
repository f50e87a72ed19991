#include "sim/net/comm_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <compare>
#include <numeric>
#include <stdexcept>
#include <tuple>

namespace ranklab::sim {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::Ring:
      return "ring";
    case Algorithm::Tree:
      return "tree";
    case Algorithm::Nvls:
      return "nvls";
    case Algorithm::NvlsTree:
      return "nvls_tree";
    case Algorithm::Direct:
      return "direct";
    case Algorithm::Pairwise:
      return "pairwise";
    case Algorithm::Local:
      return "local";
  }
  return "?";
}

const char* protocol_name(Protocol p) {
  switch (p) {
    case Protocol::LL:
      return "ll";
    case Protocol::LL128:
      return "ll128";
    case Protocol::Simple:
      return "simple";
  }
  return "?";
}

namespace {
// Lower case without '_' or '-', so "NVLSTree", "nvls_tree" and "nvls-tree" are one name.
std::string normalized(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '_' || c == '-') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}
}  // namespace

std::optional<Algorithm> parse_algorithm(const std::string& name) {
  const std::string n = normalized(name);
  for (Algorithm a : {Algorithm::Ring, Algorithm::Tree, Algorithm::Nvls, Algorithm::NvlsTree}) {
    if (n == normalized(algorithm_name(a))) return a;
  }
  return std::nullopt;
}

std::optional<Protocol> parse_protocol(const std::string& name) {
  const std::string n = normalized(name);
  for (Protocol p : {Protocol::LL, Protocol::LL128, Protocol::Simple}) {
    if (n == protocol_name(p)) return p;
  }
  return std::nullopt;
}

void CommPlan::add_flow(std::span<const LinkId> path, double payload, double occupied) {
  Flow f;
  std::vector<LinkId>& all = links.mutate();
  f.first = static_cast<std::uint32_t>(all.size());
  f.length = static_cast<std::uint32_t>(path.size());
  // Plans are built at scale 1 and scaled after (NetworkModel::scaled).
  if (bytes_scale != 1 || payload_scale != 1) throw std::logic_error("CommPlan::add_flow on a scaled plan");
  f.unscaled_bytes = occupied;
  f.unscaled_payload_bytes = payload;
  all.insert(all.end(), path.begin(), path.end());
  flows.mutate().push_back(f);
}

std::string CommPlan::name() const {
  if (algorithm == Algorithm::Local) return "local";
  return fmt::format("{}/{}", algorithm_name(algorithm), protocol_name(protocol));
}

void count_copies(CommPlan& plan) {
  // The flows in the order of (path, bytes, payload), equal ones in plan order: each run of equal flows is
  // counted on its first.
  const auto n = static_cast<std::uint32_t>(plan.flows.size());
  std::vector<std::uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  auto less = [&](std::uint32_t a, std::uint32_t b) {
    const Flow &fa = plan.flows[a], &fb = plan.flows[b];
    const std::span<const LinkId> pa = plan.path(fa), pb = plan.path(fb);
    const auto by_path = std::lexicographical_compare_three_way(pa.begin(), pa.end(), pb.begin(), pb.end());
    if (by_path != 0) return by_path < 0;
    return std::tie(fa.unscaled_bytes, fa.unscaled_payload_bytes) <
           std::tie(fb.unscaled_bytes, fb.unscaled_payload_bytes);
  };
  std::stable_sort(order.begin(), order.end(), less);
  std::vector<std::uint32_t>& copies = plan.copies.mutate();
  copies.assign(n, 0);
  for (std::uint32_t k = 0; k < n;) {
    std::uint32_t end = k + 1;
    while (end < n && !less(order[k], order[end])) ++end;
    copies[order[k]] = end - k;
    k = end;
  }
}

void find_bundle(CommPlan& plan, const Topology& topology) {
  plan.bundle = false;
  auto copies = [&](std::size_t f) { return plan.copies.empty() ? 1u : plan.copies[f]; };
  const Flow* first = nullptr;
  std::uint32_t first_copies = 0;
  std::vector<LinkId> links;
  for (std::size_t f = 0; f < plan.flows.size(); ++f) {
    if (copies(f) == 0) continue;
    const Flow& flow = plan.flows[f];
    if (first == nullptr) {
      first = &flow;
      first_copies = copies(f);
    }
    if (flow.length == 0 || flow.length != first->length || flow.unscaled_bytes != first->unscaled_bytes ||
        flow.unscaled_payload_bytes != first->unscaled_payload_bytes || copies(f) != first_copies) {
      return;
    }
    const std::span<const LinkId> path = plan.path(flow), first_path = plan.path(*first);
    for (std::size_t i = 0; i < path.size(); ++i) {
      if (topology.capacity_gbps(path[i]) != topology.capacity_gbps(first_path[i])) return;
    }
    links.insert(links.end(), path.begin(), path.end());
    if (links.size() > kMaxBundleLinks) return;
  }
  if (first == nullptr || links.size() == first->length) return;  // one flow is no bundle
  std::sort(links.begin(), links.end());
  plan.bundle = std::adjacent_find(links.begin(), links.end()) == links.end();
}

}  // namespace ranklab::sim
