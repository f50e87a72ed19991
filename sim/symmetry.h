// Symmetry: which ranks of a symmetric run (SimConfig::symmetry) run a program and which mirror one.
//
// A symmetric run lays the world out as a grid and declares some of its dimensions replicated (a GPT's tp
// and dp): ranks that differ only along those dimensions run the same program with the same timing, so
// one of them, the representative (every replicated coordinate zero), runs it and the others mirror it.
// Their communication still takes its place on the links: each operation of a representative's group has
// images, the groups the symmetry maps it to, whose transfers run beside it for their effect on the links
// alone (SimWorld::schedule_images). This class owns the grid, the map from ranks to representatives and
// the images of each group, made once per group; without symmetry every rank runs and no group has images.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "sim/comm_op.h"
#include "sim/net/comm_plan.h"
#include "sim/net/topology.h"
#include "sim/sim_backend.h"

namespace ranklab::sim {

class Symmetry {
 public:
  // UsageError unless `symmetry` is empty or describes a grid of exactly `world_size` ranks.
  Symmetry(const SimSymmetry& symmetry, int world_size);

  bool enabled() const { return !rep_.empty(); }
  // Whether `rank` runs a program of its own (it is a representative) or mirrors its representative.
  bool runs(int rank) const { return rep_.empty() || rep_[rank] == rank; }
  int representative(int rank) const { return rep_.empty() ? rank : rep_[rank]; }
  int running() const { return running_; }

  // Marks the members `rank` stands for in `op` arrived, as copies of its member: the same call, ready at the
  // same moment. UsageError for a send or receive with a mirror: traffic between classes breaks the symmetry.
  void join_mirrors(CommOpState& op, int rank) const;
  // UsageError unless a group that holds a representative holds the representative of each member.
  void check_group(const std::vector<int>& ranks) const;
  // The groups the symmetry maps `op`'s ranks to, other than theirs, each in the same member order; made
  // once per group (or pair).
  const std::vector<std::vector<int>>& images(const CommOpState& op);

  // Notes whether `plan` crosses a spine of `topo`: the fabric's leaves and its hashed spine choice (ECMP)
  // need not map onto each other as the ranks do, so the replicas' transfers may share links otherwise
  // than the representatives' and the run is no longer exactly the full one.
  void note_spine(const CommPlan& plan, const Topology& topo);
  bool spine_crossed() const { return spine_crossed_; }

 private:
  // `rank` moved by translation number `t` along the replicated dimensions.
  int translate(int rank, int t) const;

  std::vector<int> rep_;              // per rank: its representative; empty without symmetry
  std::vector<int> dims_;             // the grid, innermost first
  std::vector<int> replicated_dims_;  // indices into dims_
  int translations_ = 1;              // the product of the replicated dimensions
  int running_ = 0;
  // Each group's images by its id (null: not worked out yet), each pair's by (src, dst): every operation
  // asks, so a group's answer is one index away.
  std::vector<std::unique_ptr<std::vector<std::vector<int>>>> group_images_;
  std::map<std::pair<int, int>, std::vector<std::vector<int>>> pair_images_;
  bool spine_crossed_ = false;
};

}  // namespace ranklab::sim
