#include "sim/network_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace ranklab::sim {

const LinkTier& AlphaBetaRingModel::tier_between(int a, int b) const {
  const int per_node = profile_.gpus_per_node;
  return a / per_node == b / per_node ? profile_.intra_node : profile_.inter_node;
}

void AlphaBetaRingModel::count(int src, int dst, double bytes) {
  link_bytes_[(static_cast<std::uint64_t>(src) << 32) | static_cast<std::uint32_t>(dst)] += bytes;
}

CommCost AlphaBetaRingModel::collective(CommOp op, std::int64_t bytes, const std::vector<int>& ranks,
                                        int root, double /*start_us*/) {
  const int n = static_cast<int>(ranks.size());
  if (n <= 1) return {0.0, "local"};

  // The ring runs at its slowest hop.
  double bw_gbps = INFINITY, alpha_us = 0;
  for (int i = 0; i < n; ++i) {
    const LinkTier& t = tier_between(ranks[i], ranks[(i + 1) % n]);
    bw_gbps = std::min(bw_gbps, t.bandwidth_gbps);
    alpha_us = std::max(alpha_us, t.latency_us);
  }
  const double s = static_cast<double>(bytes);
  const double share = s * (n - 1) / n;  // what each rank sends in one pass of the ring
  double steps = n - 1, sent_per_rank = share;
  std::string algorithm = "ring";
  switch (op) {
    case CommOp::AllReduce:  // reduce-scatter then all-gather: two passes
      steps = 2.0 * (n - 1);
      sent_per_rank = 2 * share;
      break;
    case CommOp::AllGather:
    case CommOp::ReduceScatter:
    case CommOp::AllToAll:
      break;
    case CommOp::Broadcast:
    case CommOp::Reduce:
      // A pipelined chain from (or to) the root: every hop but the last carries the whole message.
      sent_per_rank = s;
      algorithm = "chain";
      break;
    case CommOp::Scatter:
    case CommOp::Gather:
      // The root's own link carries every other member's piece.
      algorithm = "direct";
      break;
    case CommOp::Send:
    case CommOp::Recv:
    case CommOp::Barrier:
      break;
  }
  const double duration_us = steps * alpha_us + sent_per_rank / (bw_gbps * 1e3);

  // Traffic: which directed links carry the bytes.
  if (op == CommOp::Scatter || op == CommOp::Gather) {
    const double piece = s / n;
    for (int r : ranks) {
      if (r == root) continue;
      op == CommOp::Scatter ? count(root, r, piece) : count(r, root, piece);
    }
  } else if (op == CommOp::AllToAll) {
    const double piece = s / n / n;  // each rank's input is s/n, split n ways
    for (int a : ranks)
      for (int b : ranks)
        if (a != b) count(a, b, piece);
  } else if (op == CommOp::Broadcast || op == CommOp::Reduce) {
    // The chain starts (broadcast) or ends (reduce) at the root.
    const int at = static_cast<int>(std::find(ranks.begin(), ranks.end(), root) - ranks.begin());
    for (int k = 0; k + 1 < n; ++k) {
      const int a = ranks[(at + k) % n], b = ranks[(at + k + 1) % n];
      op == CommOp::Broadcast ? count(a, b, s) : count(b, a, s);
    }
  } else {
    for (int i = 0; i < n; ++i) count(ranks[i], ranks[(i + 1) % n], sent_per_rank);
  }
  return {duration_us, algorithm};
}

CommCost AlphaBetaRingModel::point_to_point(int src, int dst, std::int64_t bytes, double /*start_us*/) {
  const LinkTier& t = tier_between(src, dst);
  count(src, dst, static_cast<double>(bytes));
  return {t.latency_us + static_cast<double>(bytes) / (t.bandwidth_gbps * 1e3), "p2p"};
}

std::vector<LinkTraffic> AlphaBetaRingModel::link_traffic() const {
  std::map<std::uint64_t, double> sorted(link_bytes_.begin(), link_bytes_.end());
  std::vector<LinkTraffic> out;
  out.reserve(sorted.size());
  for (const auto& [key, bytes] : sorted) {
    const int src = static_cast<int>(key >> 32), dst = static_cast<int>(key & 0xffffffffu);
    const LinkTier& t = tier_between(src, dst);
    out.push_back({fmt::format("gpu{}->gpu{}", src, dst), t.name, static_cast<std::int64_t>(std::llround(bytes))});
  }
  return out;
}

std::unique_ptr<NetworkModel> make_network_model(const Profile& profile) {
  return std::make_unique<AlphaBetaRingModel>(profile);
}

}  // namespace ranklab::sim
