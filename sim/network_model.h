// NetworkModel: how long communication takes and which links carry its bytes.
//
// The simulator asks the model for each collective once every member has launched it and its start
// time is known. This model is the alpha-beta ring of Thakur, Rabenseifner & Gropp ("Optimization of
// Collective Communication Operations in MPICH", IJHPCA 2005): a collective over n ranks is a ring of
// n-1 (or 2(n-1) for all_reduce) steps, each paying the tier's latency alpha and moving its share of the
// bytes at the tier's bandwidth beta. A group that spans nodes runs at the slower tier.
//
// The interface is the seam for richer models (topology, algorithm choice, bandwidth sharing): the
// simulator only needs an end time for a transfer that starts at a known time, plus per-link bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/profile.h"
#include "common/rank.h"
#include "common/report.h"

namespace ranklab::sim {

struct CommCost {
  double duration_us = 0;
  std::string algorithm;
};

class NetworkModel {
 public:
  virtual ~NetworkModel() = default;
  // A collective `op` over `ranks` (global ranks, in group order) whose nccl-tests size is `bytes`.
  virtual CommCost collective(CommOp op, std::int64_t bytes, const std::vector<int>& ranks, int root,
                              double start_us) = 0;
  virtual CommCost point_to_point(int src, int dst, std::int64_t bytes, double start_us) = 0;
  // Bytes carried by each directed link so far.
  virtual std::vector<LinkTraffic> link_traffic() const = 0;
};

class AlphaBetaRingModel : public NetworkModel {
 public:
  explicit AlphaBetaRingModel(const Profile& profile) : profile_(profile) {}
  CommCost collective(CommOp op, std::int64_t bytes, const std::vector<int>& ranks, int root,
                      double start_us) override;
  CommCost point_to_point(int src, int dst, std::int64_t bytes, double start_us) override;
  std::vector<LinkTraffic> link_traffic() const override;

 private:
  const LinkTier& tier_between(int a, int b) const;
  void count(int src, int dst, double bytes);

  Profile profile_;
  std::unordered_map<std::uint64_t, double> link_bytes_;  // key: src << 32 | dst
};

std::unique_ptr<NetworkModel> make_network_model(const Profile& profile);

}  // namespace ranklab::sim
