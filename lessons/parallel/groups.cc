#include "lessons/parallel/groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <string_view>

#include "common/errors.h"

namespace ranklab::parallel {

std::vector<std::string> Layout::dims() const {
  std::vector<std::string> out;
  std::string rest = order;
  while (!rest.empty()) {
    const size_t dash = rest.find('-');
    out.push_back(rest.substr(0, dash));
    rest = dash == std::string::npos ? "" : rest.substr(dash + 1);
  }
  if (cp > 1 && std::find(out.begin(), out.end(), "cp") == out.end()) {
    out.insert(std::find(out.begin(), out.end(), "tp") + 1, "cp");
  }
  return out;
}

Layout::Grid Layout::symmetry(bool mirror_dp) const {
  Grid g;
  for (const std::string& d : dims()) {
    g.sizes.push_back(size_of(d));
    // Context-parallel ranks shift keys and values around their ring (an all-to-all a mirror can take part
    // in) and compute the same pairs; the ring's blocks differ a little in shape from rank to rank (rank 0's
    // are the slowest), so cp is mirrored with dp, not with tp alone.
    g.replicated.push_back(d == "tp" || ((d == "dp" || d == "cp") && mirror_dp));
  }
  return g;
}

Layout::Grid Layout::expert_symmetry() const {
  if (ep < 1 || ep * etp % (tp * cp) != 0) {
    throw UsageError(fmt::format(
        "--ep {}{}: a skewed routing is mirrored across the ranks that hold the same experts, which needs "
        "each ep group's ep x etp block to be whole tp x cp blocks (ep x etp a multiple of {}); run it "
        "without --symmetric",
        ep, etp > 1 ? fmt::format(" --etp {}", etp) : "", tp * cp));
  }
  const int inner = ep * etp / (tp * cp);
  Grid g;
  for (const std::string& d : dims()) {
    if (d == "dp") {
      g.sizes.push_back(inner);
      g.replicated.push_back(false);
      g.sizes.push_back(dp / inner);
      g.replicated.push_back(true);
    } else {
      g.sizes.push_back(size_of(d));
      g.replicated.push_back(false);
    }
  }
  return g;
}

int Layout::size_of(const std::string& dim) const {
  return dim == "tp" ? tp : dim == "cp" ? cp : dim == "dp" ? dp : pp;
}

namespace {
// Where `dim` sits in `order`, as a number that sorts the dimensions innermost first: its place in the
// string, and for a cp the order does not name, just after tp's.
std::size_t place_of(const std::string& order, const char* dim) {
  const std::size_t at = order.find(dim);
  if (at != std::string::npos || std::string_view(dim) != "cp") return at;
  return order.find("tp") + 1;
}
}  // namespace

namespace {
constexpr const char* kGridDimNames[] = {"tp", "cp", "dp", "pp"};

// The strides of tp, cp, dp and pp: each the product of the sizes of the dimensions inside it.
std::array<int, 4> strides_of(const Layout& l) {
  std::array<std::size_t, 4> place{};
  for (int d = 0; d < 4; ++d) place[d] = place_of(l.order, kGridDimNames[d]);
  const std::array<int, 4> sizes = {l.tp, l.cp, l.dp, l.pp};
  std::array<int, 4> strides{};
  for (int d = 0; d < 4; ++d) {
    strides[d] = 1;
    for (int inner = 0; inner < 4; ++inner)
      if (place[inner] < place[d]) strides[d] *= sizes[inner];
  }
  return strides;
}

// The rank at those coordinates, with the strides strides_of gives.
int rank_at(const std::array<int, 4>& stride, int tp_rank, int cp_rank, int dp_rank, int pp_rank) {
  return tp_rank * stride[0] + cp_rank * stride[1] + dp_rank * stride[2] + pp_rank * stride[3];
}
}  // namespace

int Layout::rank_of(int tp_rank, int cp_rank, int dp_rank, int pp_rank) const {
  return rank_at(strides_of(*this), tp_rank, cp_rank, dp_rank, pp_rank);
}

Layout::Coord Layout::coord(int rank) const {
  Coord c;
  for (const std::string& d : dims()) {
    const int n = size_of(d), i = rank % n;
    rank /= n;
    (d == "tp" ? c.tp : d == "cp" ? c.cp : d == "dp" ? c.dp : c.pp) = i;
  }
  return c;
}

void validate_order(const std::string& order) {
  std::vector<std::string> d;
  std::string rest = order;
  while (!rest.empty()) {
    const size_t dash = rest.find('-');
    d.push_back(rest.substr(0, dash));
    rest = dash == std::string::npos ? "" : rest.substr(dash + 1);
  }
  std::sort(d.begin(), d.end());
  if (d != std::vector<std::string>{"dp", "pp", "tp"} &&
      d != std::vector<std::string>{"cp", "dp", "pp", "tp"}) {
    throw UsageError(fmt::format(
        "--order '{}' must name tp, dp and pp once each (and cp, or it follows tp), innermost first, such as "
        "tp-dp-pp (Megatron's layout), tp-cp-dp-pp or dp-tp-pp",
        order));
  }
}

namespace {
// The dimensions as each_group counts them, outermost first.
enum GridDim { kPp, kDp, kTp, kCp, kGridDims };

// Every group of ranks that differ only along `varying` (outermost first), each as its ranks in that order
// and whether it is `me`'s: visit(ranks, mine). The groups come in a fixed order, the other dimensions'
// coordinates counted outermost first as pp, dp, tp, cp run, so that every rank creates them alike.
template <typename Visit>
void each_group(const Layout& l, const Layout::Coord& me, const std::vector<GridDim>& varying,
                Visit&& visit) {
  const std::array<int, kGridDims> size{l.pp, l.dp, l.tp, l.cp}, mine{me.pp, me.dp, me.tp, me.cp};
  std::vector<GridDim> others;
  for (int d = 0; d < kGridDims; ++d) {
    if (std::find(varying.begin(), varying.end(), d) == varying.end()) others.push_back(GridDim(d));
  }
  // Counts `dims`' coordinates in `c` on by one, the last fastest; false once they have wrapped around.
  auto advance = [&](std::array<int, kGridDims>& c, const std::vector<GridDim>& dims) {
    for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
      if (++c[*d] < size[*d]) return true;
      c[*d] = 0;
    }
    return false;
  };
  // The strides worked out once, not per member (Layout::rank_of): every rank walks every group of the world.
  const std::array<int, 4> stride = strides_of(l);
  std::array<int, kGridDims> c{};
  std::vector<int> ranks;
  do {
    ranks.clear();
    do {
      ranks.push_back(rank_at(stride, c[kTp], c[kCp], c[kDp], c[kPp]));
    } while (advance(c, varying));
    bool is_mine = true;
    for (GridDim d : others) is_mine = is_mine && c[d] == mine[d];
    visit(ranks, is_mine);
  } while (advance(c, others));
}
}  // namespace

Groups make_groups(Rank& r, const Layout& layout) {
  Groups g;
  g.layout = layout;
  g.me = layout.coord(r.rank());
  // Every rank calls new_group for every group of each kind, and keeps its own.
  each_group(layout, g.me, {kTp}, [&](const std::vector<int>& ranks, bool mine) {
    Group grp = r.new_group(ranks);
    if (mine) g.tp = grp, g.tp_ranks = ranks;
  });
  each_group(layout, g.me, {kDp}, [&](const std::vector<int>& ranks, bool mine) {
    Group grp = r.new_group(ranks);
    if (mine) g.dp = grp, g.dp_ranks = ranks;
  });
  each_group(layout, g.me, {kPp}, [&](const std::vector<int>& ranks, bool mine) {
    Group grp = r.new_group(ranks);
    if (mine) g.pp = grp, g.pp_ranks = ranks;
    if (layout.pp > 1) {
      Group emb = r.new_group({ranks.front(), ranks.back()});
      if (mine) g.embedding = emb;
    }
  });
  g.cp = g.dp_cp = g.dp;
  g.cp_ranks = {r.rank()};
  g.dp_cp_index = g.me.dp;
  if (layout.cp > 1) {
    each_group(layout, g.me, {kCp}, [&](const std::vector<int>& ranks, bool mine) {
      Group grp = r.new_group(ranks);
      if (mine) g.cp = grp, g.cp_ranks = ranks;
    });
    each_group(layout, g.me, {kDp, kCp}, [&](const std::vector<int>& ranks, bool mine) {
      Group grp = r.new_group(ranks);
      if (!mine) return;
      g.dp_cp = grp;
      g.dp_cp_index = static_cast<int>(std::find(ranks.begin(), ranks.end(), r.rank()) - ranks.begin());
    });
  }
  if (layout.ep > 0) make_expert_groups(r, layout, g);
  return g;
}

Group make_stage_group(Rank& r, const Layout& layout) {
  Group mine;
  each_group(layout, layout.coord(r.rank()), {kDp, kCp, kTp},
             [&](const std::vector<int>& ranks, bool is_mine) {
               Group grp = r.new_group(ranks);
               if (is_mine) mine = grp;
             });
  return mine;
}

void make_expert_groups(Rank& r, const Layout& layout, Groups& g) {
  // A stage's tp x cp x dp ranks, tp fastest, as the grid etp x ep x edp, etp fastest (Megatron-Core's
  // expert RankGenerator, order tp-ep-dp): etp consecutive ranks hold the shards of the same experts (an
  // etp group); the ranks of one etp lane in ep x etp consecutive ones hold one shard of every expert
  // between them (an ep group); the ranks that hold the same shards (every ep x etp-th) reduce their
  // gradients (an edp group).
  const int ep = layout.ep, etp = layout.etp, block = ep * etp;
  each_group(layout, g.me, {kDp, kCp, kTp}, [&](const std::vector<int>& stage, bool mine) {
    const int n = static_cast<int>(stage.size());
    const int at = static_cast<int>(std::find(stage.begin(), stage.end(), r.rank()) - stage.begin());
    // Every rank makes every group, in the same order: ep groups, then etp groups, then edp groups.
    auto make = [&](int first, int count, int stride, auto&& keep) {
      std::vector<int> ranks;
      for (int i = 0; i < count; ++i) ranks.push_back(stage[first + i * stride]);
      Group grp = r.new_group(ranks);
      if (mine && std::find(ranks.begin(), ranks.end(), r.rank()) != ranks.end()) keep(grp, ranks);
    };
    for (int first = 0; first < n; first += block) {
      for (int lane = 0; lane < etp; ++lane) {
        make(first + lane, ep, etp, [&](Group grp, const std::vector<int>& ranks) {
          g.ep = grp, g.ep_ranks = ranks, g.ep_index = at % block / etp;
        });
      }
    }
    if (etp > 1) {
      for (int first = 0; first < n; first += etp)
        make(first, etp, 1, [&](Group grp, const std::vector<int>&) { g.etp = grp, g.etp_index = at % etp; });
    }
    for (int lane = 0; lane < block; ++lane) {
      make(lane, n / block, block, [&](Group grp, const std::vector<int>&) {
        g.edp = grp, g.edp_size = n / block, g.edp_index = at / block;
      });
    }
  });
}

namespace {
std::string ranks_str(const std::vector<int>& ranks) {
  bool consecutive = ranks.size() > 2;
  for (size_t i = 1; i < ranks.size(); ++i) consecutive = consecutive && ranks[i] == ranks[i - 1] + 1;
  if (consecutive) return fmt::format("{{{}..{}}}", ranks.front(), ranks.back());
  if (ranks.size() > 6) {
    return fmt::format("{{{}, {}, {}, ..., {}}}", ranks[0], ranks[1], ranks[2], ranks.back());
  }
  return fmt::format("{{{}}}", fmt::join(ranks, ", "));
}

}  // namespace

std::vector<std::string> describe_groups(const Layout& l, int gpus_per_node) {
  std::vector<std::string> out;
  out.push_back(
      fmt::format("process groups, order {} (innermost first): rank = position in the order's "
                  "dimensions, the first varying fastest",
                  l.order));
  // The first three groups of each kind by their first rank, and how many there are.
  const std::pair<const char*, GridDim> kinds[] = {{"tp", kTp}, {"cp", kCp}, {"dp", kDp}, {"pp", kPp}};
  for (const auto& [name, dim] : kinds) {
    if (dim == kCp && l.cp == 1) continue;
    std::vector<std::vector<int>> groups;
    each_group(l, Layout::Coord{}, {dim},
               [&](const std::vector<int>& ranks, bool) { groups.push_back(ranks); });
    std::sort(groups.begin(), groups.end());
    std::string shown;
    for (std::size_t i = 0; i < std::min<std::size_t>(groups.size(), 3); ++i)
      shown += fmt::format(" {}", ranks_str(groups[i]));
    if (groups.size() > 3) shown += fmt::format(" ... ({} groups)", groups.size());
    out.push_back(fmt::format("  {}:{}", name, shown));
  }
  if (gpus_per_node > 0) {
    const int a = l.rank_of(0, 0, 0), b = l.rank_of(l.tp - 1, 0, 0);
    const bool inside = a / gpus_per_node == b / gpus_per_node;
    out.push_back(fmt::format("  a tp group {} one node ({} GPUs per node){}",
                              inside ? "fits in" : "spans more than", gpus_per_node,
                              inside ? "" : ": its all-reduces cross the network; put tp first in --order"));
  }
  return out;
}

}  // namespace ranklab::parallel
