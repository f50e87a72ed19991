#include "sim/net/comm_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

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

}  // namespace ranklab::sim
