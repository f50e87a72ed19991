#include "sim/symmetry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <set>

#include "common/errors.h"

namespace ranklab::sim {

Symmetry::Symmetry(const SimSymmetry& symmetry, int world_size) {
  running_ = world_size;
  if (!symmetry.enabled()) return;
  std::int64_t product = 1;
  for (int d : symmetry.dims) {
    if (d < 1) throw UsageError(fmt::format("symmetry: a dimension of size {} (each must be at least 1)", d));
    product *= d;
  }
  if (product != world_size || symmetry.replicated.size() != symmetry.dims.size()) {
    throw UsageError(
        fmt::format("symmetry: the grid {{{}}} ({} replicated flags) does not describe a world of {} ranks",
                    fmt::join(symmetry.dims, " x "), symmetry.replicated.size(), world_size));
  }
  dims_ = symmetry.dims;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (symmetry.replicated[i] && dims_[i] > 1) {
      replicated_dims_.push_back(static_cast<int>(i));
      translations_ *= dims_[i];
    }
  }
  rep_.resize(world_size);
  running_ = 0;
  for (int r = 0; r < world_size; ++r) {
    // Zero the replicated coordinates.
    int rest = r, stride = 1, rep = 0;
    for (size_t i = 0; i < dims_.size(); ++i) {
      const int coord = rest % dims_[i];
      rest /= dims_[i];
      if (!symmetry.replicated[i]) rep += coord * stride;
      stride *= dims_[i];
    }
    rep_[r] = rep;
    if (rep == r) ++running_;
  }
}

int Symmetry::translate(int rank, int t) const {
  int out = 0, stride = 1, rest = rank;
  size_t next = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    int coord = rest % dims_[i];
    rest /= dims_[i];
    if (next < replicated_dims_.size() && replicated_dims_[next] == static_cast<int>(i)) {
      coord = (coord + t % dims_[i]) % dims_[i];
      t /= dims_[i];
      ++next;
    }
    out += coord * stride;
    stride *= dims_[i];
  }
  return out;
}

void Symmetry::check_group(const std::vector<int>& ranks) const {
  if (rep_.empty()) return;
  if (std::none_of(ranks.begin(), ranks.end(), [this](int r) { return runs(r); })) return;
  const std::set<int> in(ranks.begin(), ranks.end());
  for (int r : ranks) {
    if (!in.count(rep_[r])) {
      throw UsageError(fmt::format(
          "symmetric run: group {{{}}} holds rank {} but not rank {}, which it mirrors: nobody would call "
          "the group's collectives for it (the program does not have the symmetry SimConfig::symmetry "
          "declares)",
          fmt::join(ranks, ", "), r, rep_[r]));
    }
  }
}

const std::vector<std::vector<int>>& Symmetry::images(const CommOpState& op) {
  const bool p2p = op.op == CommOp::Send;
  if (!p2p) {
    const auto id = static_cast<std::size_t>(op.group_id);
    if (id < group_images_.size() && group_images_[id]) return *group_images_[id];
  } else if (const auto known = pair_images_.find({op.ranks[0], op.ranks[1]}); known != pair_images_.end()) {
    return known->second;
  }
  const std::vector<int>& ranks = op.ranks;
  std::vector<std::vector<int>> found;
  // A translation maps the group onto itself, onto another group, or onto ranks that are no group at
  // all: a group of ep consecutive ranks of a data-parallel dimension of size dp moved by one is not one
  // of the program's groups. A rank belongs to one group of each kind, so the images are the translations
  // disjoint from the group and from each other; taken in the order of the translations (the innermost
  // dimension fastest), they are the blocks a program cuts the dimension into, and every translation's
  // ranks lie in one of them.
  std::vector<char> covered(rep_.size(), 0);
  for (int r : ranks) covered[static_cast<std::size_t>(r)] = 1;
  std::vector<int> image(ranks.size());
  bool tiled = true;
  for (int t = 1; t < translations_; ++t) {
    for (size_t i = 0; i < ranks.size(); ++i) image[i] = translate(ranks[i], t);
    const auto hit = std::count_if(image.begin(), image.end(), [&](int r) { return covered[r] != 0; });
    if (hit == static_cast<std::ptrdiff_t>(image.size())) continue;  // itself, or ranks of images found
    if (hit > 0) {
      tiled = false;  // part of it only: judged once every image is known
      continue;
    }
    for (int r : image) covered[static_cast<std::size_t>(r)] = 1;
    found.push_back(image);
  }
  if (!tiled) {
    for (int t = 1; t < translations_; ++t) {
      for (int r : ranks) {
        if (covered[static_cast<std::size_t>(translate(r, t))] == 0) {
          throw UsageError(fmt::format(
              "symmetric run: the copies of group {{{}}} along the replicated dimensions overlap it without "
              "tiling the ranks (rank {} is in none): the program does not have the symmetry "
              "SimConfig::symmetry declares",
              fmt::join(ranks, ", "), translate(r, t)));
        }
      }
    }
  }
  if (p2p)
    return pair_images_.emplace(std::make_pair(op.ranks[0], op.ranks[1]), std::move(found)).first->second;
  const auto id = static_cast<std::size_t>(op.group_id);
  if (id >= group_images_.size()) group_images_.resize(id + 1);
  group_images_[id] = std::make_unique<std::vector<std::vector<int>>>(std::move(found));
  return *group_images_[id];
}

void Symmetry::note_spine(const CommPlan& plan, const Topology& topo) {
  if (spine_crossed_) return;
  spine_crossed_ =
      std::any_of(plan.links.begin(), plan.links.end(), [&](LinkId l) { return topo.is_spine_link(l); });
}

void Symmetry::join_mirrors(CommOpState& op, int rank) const {
  const CommMember& m = op.member_of(rank);
  const CommCall& call = m.call;
  if (op.op == CommOp::Send) {
    const int peer = call.peer;
    if (runs(peer)) return;
    throw UsageError(fmt::format(
        "rank {}: {} with rank {}, which mirrors rank {} in this symmetric run: point-to-point traffic "
        "between classes breaks the symmetry (SimConfig::symmetry)",
        rank, comm_op_name(call.op), peer, representative(peer)));
  }
  // They wait for nothing of their own, so the operation starts when the representatives are ready, as it
  // would with every member running the same program.
  const int n = static_cast<int>(op.ranks.size());
  const bool uneven_all_to_all = call.op == CommOp::AllToAll && call.uneven();
  const int mine =
      uneven_all_to_all
          ? static_cast<int>(std::find(op.ranks.begin(), op.ranks.end(), rank) - op.ranks.begin())
          : 0;
  for (int i = 0; i < n; ++i) {  // members are indexed like ranks
    CommMember& x = op.members[i];
    if (x.arrived || representative(x.rank) != rank) continue;
    x.arrived = true;
    x.call = call;
    // An uneven all_to_all's pieces, as the mirror's copy of the program makes them: where they go
    // relative to its own place in the group (a ring shift sends to the next member, whichever it is).
    if (uneven_all_to_all) {
      const int shift = ((i - mine) % n + n) % n;
      auto rotate = [&](CommCall::Splits& v) {
        if (!v.empty()) std::rotate(v.rbegin(), v.rbegin() + shift, v.rend());
      };
      rotate(x.call.input_splits);
      rotate(x.call.output_splits);
    }
    x.issue_ready_us = m.issue_ready_us;
    ++op.arrived;
  }
}

}  // namespace ranklab::sim
