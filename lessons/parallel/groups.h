// How a world of ranks is cut into tensor-, context-, data- and pipeline-parallel groups, the way
// Megatron-LM lays them out.
//
// Every rank has a coordinate (tp, cp, dp, pp). The order string names the dimensions from the innermost
// (fastest-varying rank number) outwards; Megatron's default is "tp-dp-pp": the tp ranks of a group are
// consecutive, so with tp <= GPUs per node a tensor-parallel group sits inside one node and its
// all-reduces, two per layer per micro-batch forward and two backward, stay on NVLink. Data parallelism
// comes next (one gradient reduction per step, latency-tolerant), pipeline parallelism outermost (only
// activations at stage boundaries cross it). `--order dp-tp-pp` puts a tp group across nodes: run it
// and watch the tp line of the exposed communication grow. Context parallelism (--cp), which exchanges
// keys and values every layer, sits right outside tp unless the order names it (Megatron-Core's
// tp-cp-ep-dp-pp).
#pragma once

#include <string>
#include <vector>

#include "common/rank.h"

namespace ranklab::parallel {

struct Layout {
  int tp = 1, pp = 1, dp = 1;
  std::string order = "tp-dp-pp";  // innermost first; "cp" may be named, else it follows tp
  int cp = 1;
  // Expert parallelism: 0 makes no expert groups; ep >= 1 lays each stage's tp x cp x dp ranks (tp fastest)
  // out as Megatron-Core's expert grid, etp fastest, then ep, then the expert-data-parallel rest: etp
  // consecutive ranks split each expert's weights (Groups::etp), and every etp-th rank of ep x etp
  // consecutive ones holds a share of the experts (Groups::ep).
  int ep = 0;
  int etp = 1;

  int world() const { return tp * cp * pp * dp; }
  // The dimensions innermost first: "tp", "dp", "pp" in the order's places, and "cp" in its place when the
  // order names it or there is context parallelism.
  std::vector<std::string> dims() const;
  int size_of(const std::string& dim) const;
  // The global rank at a coordinate (cp 0 where it is not given), and a rank's coordinate.
  int rank_of(int tp_rank, int dp_rank, int pp_rank) const { return rank_of(tp_rank, 0, dp_rank, pp_rank); }
  int rank_of(int tp_rank, int cp_rank, int dp_rank, int pp_rank) const;
  struct Coord {
    int tp = 0, dp = 0, pp = 0, cp = 0;
  };
  Coord coord(int rank) const;
  // The world as a grid, innermost first, and which of its dimensions are replicas: with phantom tensors
  // every rank of a pipeline stage does the same work whatever its tp and dp coordinates (and nearly the
  // same whatever its cp coordinate), so a simulator may run one rank per stage and let the others mirror
  // it (SimConfig::symmetry). Without `mirror_dp` only the tp dimension is replicated: one rank per stage,
  // dp replica and cp rank runs.
  struct Grid {
    std::vector<int> sizes;
    std::vector<bool> replicated;
  };
  Grid symmetry(bool mirror_dp = true) const;
  // The symmetry left when the experts' loads differ (a skewed routing): the ranks of an ep group hold
  // different experts and do different work, but every rank that holds the same experts (its lane of the
  // edp group) does the same. When ep x etp is a multiple of tp x cp the lanes are a split of dp: dp =
  // inner x outer with inner = ep etp / (tp cp) and the outer part replicated, so one ep x etp block per
  // stage runs. UsageError naming --ep otherwise (an ep group inside a tp x cp block has no such split of
  // the grid).
  Grid expert_symmetry() const;
};

// Throws UsageError naming --order when it is not a permutation of tp, dp and pp, or of tp, cp, dp and pp.
void validate_order(const std::string& order);

// The groups one rank belongs to. Every rank creates every group, in the same order, as
// torch.distributed requires of new_group.
struct Groups {
  Layout layout;
  Layout::Coord me;
  Group tp, dp, pp;
  // The context-parallel group (ranks that split each sequence), and the group the gradients are reduced
  // and ZeRO's shards spread over: dp x cp, as Megatron-Core's distributed optimizer does (every cp rank
  // holds the whole model and gradients of its part of the tokens). Both are dp's with cp 1.
  Group cp, dp_cp;
  std::vector<int> cp_ranks;
  int dp_cp_index = 0;  // this rank's place in dp_cp: its ZeRO shard
  // The first and last pipeline stage of this rank's (tp, dp) column: they hold the two copies of the
  // word embedding that the output layer shares, and add up its gradient (Megatron's embedding group).
  Group embedding;
  std::vector<int> tp_ranks, dp_ranks, pp_ranks;
  // With Layout::ep, Megatron-Core's expert grid: the expert-parallel group (ep ranks of the stage that hold
  // all of its experts, or with etp > 1 one shard of each), the expert tensor-parallel group (the etp ranks
  // that hold the shards of the same experts) and the expert-data-parallel group (the ranks that hold the
  // same shards as this one, which reduce their gradients).
  Group ep, etp, edp;
  std::vector<int> ep_ranks;
  int ep_index = 0, etp_index = 0, edp_index = 0, edp_size = 1;
};
Groups make_groups(Rank& r, const Layout& layout);
// The expert groups of `g` (make_groups makes them when layout.ep > 0).
void make_expert_groups(Rank& r, const Layout& layout, Groups& g);
// The group of this rank's pipeline stage: its tp x cp x dp ranks, which hold the same layers. FP8's delayed
// scaling reduces its amaxes over it (Megatron-LM's amax reduction group, tensor x data x context parallel,
// parallel_state.get_amax_reduction_group). Every rank makes every stage's group.
Group make_stage_group(Rank& r, const Layout& layout);

// "tp groups {0..7} {8..15} ...": a few lines saying which ranks form which groups, and whether each
// tp group stays within a node.
std::vector<std::string> describe_groups(const Layout& layout, int gpus_per_node);

}  // namespace ranklab::parallel
