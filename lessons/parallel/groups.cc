#include "lessons/parallel/groups.h"

#include <fmt/format.h>

#include <algorithm>

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
  return out;
}

Layout::Grid Layout::symmetry(bool mirror_dp) const {
  Grid g;
  for (const std::string& d : dims()) {
    g.sizes.push_back(size_of(d));
    g.replicated.push_back(d == "tp" || (d == "dp" && mirror_dp));
  }
  return g;
}

int Layout::size_of(const std::string& dim) const {
  return dim == "tp" ? tp : dim == "dp" ? dp : pp;
}

// A dimension's stride is the product of the sizes of the dimensions inside it. (No allocation: every rank
// calls this for every group of the world.)
int Layout::stride_of(const char* dim) const {
  const size_t at = order.find(dim);
  int stride = 1;
  for (const char* d : {"tp", "dp", "pp"}) {
    if (order.find(d) < at) stride *= size_of(d);
  }
  return stride;
}

int Layout::rank_of(int tp_rank, int dp_rank, int pp_rank) const {
  return tp_rank * stride_of("tp") + dp_rank * stride_of("dp") + pp_rank * stride_of("pp");
}

Layout::Coord Layout::coord(int rank) const {
  Coord c;
  for (const std::string& d : dims()) {
    const int n = size_of(d), i = rank % n;
    rank /= n;
    (d == "tp" ? c.tp : d == "dp" ? c.dp : c.pp) = i;
  }
  return c;
}

void validate_order(const std::string& order) {
  Layout l;
  l.order = order;
  std::vector<std::string> d = l.dims();
  std::sort(d.begin(), d.end());
  if (d != std::vector<std::string>{"dp", "pp", "tp"}) {
    throw UsageError(fmt::format(
        "--order '{}' must name tp, dp and pp once each, innermost first, such as tp-dp-pp (Megatron's "
        "layout) or dp-tp-pp",
        order));
  }
}

Groups make_groups(Rank& r, const Layout& layout) {
  Groups g;
  g.layout = layout;
  g.me = layout.coord(r.rank());
  // One loop per kind of group, over every group of that kind: each rank calls new_group for all of them
  // and keeps its own.
  for (int pp = 0; pp < layout.pp; ++pp) {
    for (int dp = 0; dp < layout.dp; ++dp) {
      std::vector<int> ranks;
      for (int tp = 0; tp < layout.tp; ++tp) ranks.push_back(layout.rank_of(tp, dp, pp));
      Group grp = r.new_group(ranks);
      if (pp == g.me.pp && dp == g.me.dp) g.tp = grp, g.tp_ranks = ranks;
    }
  }
  for (int pp = 0; pp < layout.pp; ++pp) {
    for (int tp = 0; tp < layout.tp; ++tp) {
      std::vector<int> ranks;
      for (int dp = 0; dp < layout.dp; ++dp) ranks.push_back(layout.rank_of(tp, dp, pp));
      Group grp = r.new_group(ranks);
      if (pp == g.me.pp && tp == g.me.tp) g.dp = grp, g.dp_ranks = ranks;
    }
  }
  for (int dp = 0; dp < layout.dp; ++dp) {
    for (int tp = 0; tp < layout.tp; ++tp) {
      std::vector<int> ranks;
      for (int pp = 0; pp < layout.pp; ++pp) ranks.push_back(layout.rank_of(tp, dp, pp));
      Group grp = r.new_group(ranks);
      if (dp == g.me.dp && tp == g.me.tp) g.pp = grp, g.pp_ranks = ranks;
      if (layout.pp > 1) {
        Group emb = r.new_group({ranks.front(), ranks.back()});
        if (dp == g.me.dp && tp == g.me.tp) g.embedding = emb;
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
  out.push_back(fmt::format("  tp:{}", some_groups(l.pp * l.dp, [&](int i) {
                              std::vector<int> v;
                              for (int t = 0; t < l.tp; ++t) v.push_back(l.rank_of(t, i % l.dp, i / l.dp));
                              return v;
                            })));
  out.push_back(fmt::format("  dp:{}", some_groups(l.pp * l.tp, [&](int i) {
                              std::vector<int> v;
                              for (int d = 0; d < l.dp; ++d) v.push_back(l.rank_of(i % l.tp, d, i / l.tp));
                              return v;
                            })));
  out.push_back(fmt::format("  pp:{}", some_groups(l.dp * l.tp, [&](int i) {
                              std::vector<int> v;
                              for (int p = 0; p < l.pp; ++p) v.push_back(l.rank_of(i % l.tp, i / l.tp, p));
                              return v;
                            })));
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
