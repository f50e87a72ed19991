#include "sim/net/comm_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <unordered_map>

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
  f.first = static_cast<std::uint32_t>(links.size());
  f.length = static_cast<std::uint32_t>(path.size());
  f.bytes = occupied;
  f.payload_bytes = payload;
  links.insert(links.end(), path.begin(), path.end());
  flows.push_back(f);
}

std::string CommPlan::name() const {
  if (algorithm == Algorithm::Local) return "local";
  return fmt::format("{}/{}", algorithm_name(algorithm), protocol_name(protocol));
}

void count_copies(CommPlan& plan) {
  plan.copies.assign(plan.flows.size(), 1);
  // Candidates by a hash of the path; equal paths are then compared link by link.
  std::unordered_multimap<std::uint64_t, std::uint32_t> first_of;
  for (std::uint32_t i = 0; i < plan.flows.size(); ++i) {
    const Flow& f = plan.flows[i];
    const std::span<const LinkId> path = plan.path(f);
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the links
    for (LinkId l : path) {
      h ^= l;
      h *= 1099511628211ull;
    }
    bool copy = false;
    for (auto [it, end] = first_of.equal_range(h); it != end; ++it) {
      const Flow& g = plan.flows[it->second];
      const std::span<const LinkId> other = plan.path(g);
      if (g.bytes == f.bytes && g.payload_bytes == f.payload_bytes &&
          std::equal(path.begin(), path.end(), other.begin(), other.end())) {
        ++plan.copies[it->second];
        plan.copies[i] = 0;
        copy = true;
        break;
      }
    }
    if (!copy) first_of.emplace(h, i);
  }
}

}  // namespace ranklab::sim
