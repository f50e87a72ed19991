#include "lessons/parallel/groups.h"

#include <fmt/format.h>

#include <algorithm>
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

// A dimension's stride is the product of the sizes of the dimensions inside it. (No allocation: every rank
// calls this for every group of the world.)
int Layout::stride_of(const char* dim) const {
  const std::size_t at = place_of(order, dim);
  int stride = 1;
  for (const char* d : {"tp", "cp", "dp", "pp"}) {
    if (place_of(order, d) < at) stride *= size_of(d);
  }
  return stride;
}

int Layout::rank_of(int tp_rank, int cp_rank, int dp_rank, int pp_rank) const {
  return tp_rank * stride_of("tp") + cp_rank * stride_of("cp") + dp_rank * stride_of("dp") +
         pp_rank * stride_of("pp");
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

Groups make_groups(Rank& r, const Layout& layout) {
  Groups g;
  g.layout = layout;
  g.me = layout.coord(r.rank());
  const Layout::Coord& me = g.me;
  // One loop per kind of group, over every group of that kind: each rank calls new_group for all of them
  // and keeps its own.
  for (int pp = 0; pp < layout.pp; ++pp) {
    for (int dp = 0; dp < layout.dp; ++dp) {
      for (int cp = 0; cp < layout.cp; ++cp) {
        std::vector<int> ranks;
        for (int tp = 0; tp < layout.tp; ++tp) ranks.push_back(layout.rank_of(tp, cp, dp, pp));
        Group grp = r.new_group(ranks);
        if (pp == me.pp && dp == me.dp && cp == me.cp) g.tp = grp, g.tp_ranks = ranks;
      }
    }
  }
  for (int pp = 0; pp < layout.pp; ++pp) {
    for (int tp = 0; tp < layout.tp; ++tp) {
      for (int cp = 0; cp < layout.cp; ++cp) {
        std::vector<int> ranks;
        for (int dp = 0; dp < layout.dp; ++dp) ranks.push_back(layout.rank_of(tp, cp, dp, pp));
        Group grp = r.new_group(ranks);
        if (pp == me.pp && tp == me.tp && cp == me.cp) g.dp = grp, g.dp_ranks = ranks;
      }
    }
  }
  for (int dp = 0; dp < layout.dp; ++dp) {
    for (int tp = 0; tp < layout.tp; ++tp) {
      for (int cp = 0; cp < layout.cp; ++cp) {
        std::vector<int> ranks;
        for (int pp = 0; pp < layout.pp; ++pp) ranks.push_back(layout.rank_of(tp, cp, dp, pp));
        Group grp = r.new_group(ranks);
        const bool mine = dp == me.dp && tp == me.tp && cp == me.cp;
        if (mine) g.pp = grp, g.pp_ranks = ranks;
        if (layout.pp > 1) {
          Group emb = r.new_group({ranks.front(), ranks.back()});
          if (mine) g.embedding = emb;
        }
      }
    }
  }
  g.cp = g.dp_cp = g.dp;
  g.cp_ranks = {r.rank()};
  if (layout.cp > 1) {
    for (int pp = 0; pp < layout.pp; ++pp) {
      for (int dp = 0; dp < layout.dp; ++dp) {
        for (int tp = 0; tp < layout.tp; ++tp) {
          std::vector<int> ranks;
          for (int cp = 0; cp < layout.cp; ++cp) ranks.push_back(layout.rank_of(tp, cp, dp, pp));
          Group grp = r.new_group(ranks);
          if (pp == me.pp && dp == me.dp && tp == me.tp) g.cp = grp, g.cp_ranks = ranks;
        }
      }
    }
    // dp x cp, each group in rank order of (cp, dp): a ZeRO shard's index is its place here.
    for (int pp = 0; pp < layout.pp; ++pp) {
      for (int tp = 0; tp < layout.tp; ++tp) {
        std::vector<int> ranks;
        for (int dp = 0; dp < layout.dp; ++dp) {
          for (int cp = 0; cp < layout.cp; ++cp) ranks.push_back(layout.rank_of(tp, cp, dp, pp));
        }
        Group grp = r.new_group(ranks);
        if (pp == me.pp && tp == me.tp) g.dp_cp = grp;
      }
    }
  }
  return g;
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

template <typename F>
std::string some_groups(int count, F ranks_of) {
  std::string s;
  for (int i = 0; i < std::min(count, 3); ++i) s += fmt::format(" {}", ranks_str(ranks_of(i)));
  if (count > 3) s += fmt::format(" ... ({} groups)", count);
  return s;
}
}  // namespace

std::vector<std::string> describe_groups(const Layout& l, int gpus_per_node) {
  std::vector<std::string> out;
  out.push_back(
      fmt::format("process groups, order {} (innermost first): rank = position in the order's "
                  "dimensions, the first varying fastest",
                  l.order));
  // The groups of `dim`: the ranks whose other coordinates are those of group `i`'s first rank, where
  // the first ranks are taken in rank order.
  auto groups_of = [&](const char* dim) {
    const int size = l.size_of(dim), count = l.world() / size;
    return some_groups(count, [&, dim, size](int i) {
      int found = -1, first = 0;
      for (; first < l.world(); ++first) {
        const Layout::Coord c = l.coord(first);
        const int at = dim == std::string_view("tp")   ? c.tp
                       : dim == std::string_view("cp") ? c.cp
                       : dim == std::string_view("dp") ? c.dp
                                                       : c.pp;
        if (at == 0 && ++found == i) break;
      }
      std::vector<int> v;
      for (int k = 0; k < size; ++k) v.push_back(first + k * l.stride_of(dim));
      return v;
    });
  };
  for (const char* dim : {"tp", "cp", "dp", "pp"}) {
    if (std::string_view(dim) == "cp" && l.cp == 1) continue;
    out.push_back(fmt::format("  {}:{}", dim, groups_of(dim)));
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
