// collectives: every collective of the lecture, on real numbers, printed in the lecture's notation.
//
// Each example builds its inputs on every rank, runs one collective, and shows every rank's input and
// output. The lesson then computes each expected output itself and checks the collective against it,
// and checks the lecture's identity: all-reduce = reduce-scatter followed by all-gather.
#include <fmt/format.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/rank.h"

namespace ranklab {
namespace {

// The checks, below the examples: each expected output computed by hand, with the rounding bound of the
// reductions that round.
void expect(Rank& r, const std::string& what, const Tensor& t, const std::vector<double>& want,
            const std::vector<double>& bound = {});
double gamma(int n);
double sum_bound(int w, double sum_of_magnitudes);
double product_bound(int w, double product);
std::vector<double> as_double(const std::vector<float>& v);
std::vector<double> iota(int n, double start);
void heading(Rank& r, const std::string& title, const std::string& why);

// Broadcast, scatter and gather: data moved from one rank or to one, not combined.
void one_to_all_and_back(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  // Broadcast: rank 0's tensor is copied to every rank.
  heading(r, "broadcast(root=0)", "One rank's tensor reaches every rank, e.g. weights loaded by rank 0.");
  {
    Tensor t = me == 0 ? r.arange(w) : r.zeros({w});
    r.show("  Input:  ", t);
    r.broadcast(t, 0);
    r.show("  Output: ", t);
    expect(r, "broadcast copies rank 0's tensor to every rank", t, iota(w, 0));
  }

  // Scatter: rank 0's tensor is cut into one piece per rank.
  heading(r, "scatter(root=0)", "Rank 0's tensor is split; rank i receives piece i.");
  {
    Tensor in = me == 0 ? r.arange(w) : Tensor();
    Tensor out = r.zeros({1});
    if (me == 0) r.print(fmt::format("  Input:   rank0 = {}", format_values({w}, r.to_host(in))));
    r.scatter(out, in, 0);
    r.show("  Output: ", out);
    expect(r, "scatter gives rank i piece i", out, {static_cast<double>(me)});
  }

  // Gather: the inverse of scatter.
  heading(r, "gather(root=0)", "Every rank's piece is concatenated on rank 0: the inverse of scatter.");
  {
    Tensor in = r.full({1}, static_cast<float>(me));
    Tensor out = me == 0 ? r.zeros({w}) : Tensor();
    r.show("  Input:  ", in);
    r.gather(out, in, 0);
    if (me == 0) {
      r.print(fmt::format("  Output:  rank0 = {}", format_values({w}, r.to_host(out))));
      expect(r, "gather concatenates every piece on rank 0", out, iota(w, 0));
    }
  }
}

// Reduce and all_gather: gather's two relatives, one combining on a root, one gathering on every rank.
void reduce_and_all_gather(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  // Reduce: like gather, but the pieces are combined instead of concatenated.
  heading(r, "reduce(root=0, Sum)",
          "Like gather, but the pieces are summed (or max, min, product) on rank 0.");
  {
    Tensor t = r.full({1}, static_cast<float>(me));
    r.show("  Input:  ", t);
    r.reduce(t, 0, ReduceOp::Sum);
    if (me == 0) {
      r.print(fmt::format("  Output:  rank0 = {}", format_values({1}, r.to_host(t))));
      const double sum = w * (w - 1.0) / 2;
      expect(r, "reduce sums every rank's value on rank 0", t, {sum}, {sum_bound(w, sum)});
    }
  }

  // All-gather: gather, with the result on every rank.
  heading(r, "all_gather",
          "Gather with the result on every rank: how sharded parameters are put back together.");
  {
    Tensor in = r.full({1}, static_cast<float>(me));
    Tensor out = r.zeros({w});
    r.show("  Input:  ", in);
    r.all_gather(out, in);
    r.show("  Output: ", out);
    expect(r, "all_gather gives every rank every piece", out, iota(w, 0));
  }
}

// What reduce_scatter and all_reduce left on this rank, and the sums they should hold: the identity that
// ties the two is checked on them.
struct Summed {
  Tensor reduce_scatter_out, all_reduce_out;
  std::vector<double> sums, bounds;  // component j's exact sum, and how far float32 may be from it
};

// Reduce-scatter and all-reduce, over the lecture's inputs: rank i holds [i, i+1, ..., i+w-1].
Summed reduce_scatter_and_all_reduce(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  Summed out;
  // Reduce-scatter: reduce component i over ranks and leave it on rank i.
  heading(r, "reduce_scatter(Sum)",
          "Component i is summed over ranks and lands on rank i: how gradients are sharded.");
  // Component j sums to sum_i (i + j). Every term is positive, so the sum of magnitudes is the sum itself.
  out.sums.resize(w);
  out.bounds.resize(w);
  for (int j = 0; j < w; ++j) {
    out.sums[j] = static_cast<double>(w) * j + w * (w - 1.0) / 2;
    out.bounds[j] = sum_bound(w, out.sums[j]);
  }
  out.reduce_scatter_out = r.zeros({1});
  {
    Tensor in = r.arange({w}, static_cast<float>(me));
    r.show("  Input:  ", in);
    r.reduce_scatter(out.reduce_scatter_out, in, ReduceOp::Sum);
    r.show("  Output: ", out.reduce_scatter_out);
    expect(r, "reduce_scatter leaves component i's sum on rank i", out.reduce_scatter_out, {out.sums[me]},
           {out.bounds[me]});
  }

  // All-reduce: every rank ends with the sum of every rank's tensor.
  heading(r, "all_reduce(Sum)", "Every rank gets the elementwise sum: the one call data parallelism needs.");
  out.all_reduce_out = r.arange({w}, static_cast<float>(me));
  r.show("  Input:  ", out.all_reduce_out);
  r.all_reduce(out.all_reduce_out, ReduceOp::Sum);
  r.show("  Output: ", out.all_reduce_out);
  expect(r, "all_reduce gives every rank the sum", out.all_reduce_out, out.sums, out.bounds);
  return out;
}

// The identity: reduce-scatter then all-gather is an all-reduce.
void reduce_scatter_then_all_gather(Rank& r, const Summed& summed) {
  const int w = r.world_size();
  heading(r, "reduce_scatter + all_gather = all_reduce",
          "All-gathering the reduce-scatter's pieces rebuilds the all-reduce's result.");
  Tensor rebuilt = r.zeros({w});
  r.all_gather(rebuilt, summed.reduce_scatter_out);
  r.show("  all_gather(reduce_scatter(x)): ", rebuilt);
  // Both are within their bound of the exact sums, so within twice it of each other (equal while the
  // sums are exact).
  std::vector<double> twice(w);
  for (int j = 0; j < w; ++j) twice[j] = 2 * summed.bounds[j];
  expect(r, "reduce_scatter followed by all_gather equals all_reduce", rebuilt,
         as_double(r.to_host(summed.all_reduce_out)), twice);
}

// All-to-all: piece j of rank i goes to rank j; with equal pieces it transposes the rank x piece matrix.
void all_to_all(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  heading(r, "all_to_all",
          "Piece j of rank i goes to rank j: a transpose across ranks, as MoE routing needs.");
  {
    Tensor in = r.arange({w}, static_cast<float>(me * w));
    Tensor out = r.zeros({w});
    r.show("  Input:  ", in);
    r.all_to_all(out, in);
    r.show("  Output: ", out);
    std::vector<double> want(w);
    for (int i = 0; i < w; ++i) want[i] = static_cast<double>(i) * w + me;
    expect(r, "all_to_all transposes the pieces", out, want);
  }
}

// The other reduce ops, on one all_reduce each.
void other_reduce_ops(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  heading(r, "all_reduce with Max, Min, Prod and Avg", "Any associative, commutative op can reduce.");
  for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::Avg}) {
    Tensor t = r.full({1}, static_cast<float>(me + 1));
    r.all_reduce(t, op);
    double want = 0, bound = 0;
    switch (op) {
      case ReduceOp::Max:
        want = w;
        break;
      case ReduceOp::Min:
        want = 1;
        break;
      case ReduceOp::Prod:
        // w!: past 34! (3.0e38) it is more than float32 holds (3.4e38), and every order overflows to inf.
        want = w <= 34 ? std::tgamma(w + 1.0) : INFINITY;
        bound = w <= 34 ? product_bound(w, want) : 0;
        break;
      default:
        // The sum divided by w; NCCL multiplies each term by 1/w first: two roundings more than a sum.
        want = (w + 1.0) / 2;
        bound = gamma(w + 1) * want;
    }
    if (me == 0) {
      r.print(fmt::format("  all_reduce({}) of rank+1 = {}{}", reduce_op_name(op),
                          format_values({1}, r.to_host(t)),
                          op == ReduceOp::Prod && w > 34 ? "  (35! and beyond overflow float32)" : ""));
    }
    expect(r, fmt::format("all_reduce({}) of rank+1", reduce_op_name(op)), t, {want}, {bound});
  }
}

// Async: the call returns at once and wait() orders later work after it.
void async_all_reduce(Rank& r) {
  const int w = r.world_size(), me = r.rank();
  heading(r, "async all_reduce", "Async::Yes returns a Work at once; wait() before touching the tensor.");
  {
    Tensor t = r.full({2}, 1.0f);
    Work work = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
    work.wait();
    expect(r, "async all_reduce after wait()", t, {static_cast<double>(w), static_cast<double>(w)});
    if (me == 0) r.print(fmt::format("  rank0 = {} after wait()", format_values({2}, r.to_host(t))));
  }
}

void collectives(Rank& r, const LessonOptions&) {
  const int w = r.world_size(), me = r.rank();
  if (me == 0) {
    r.print(fmt::format(
        "Collectives on {} ranks. Each rank is one GPU; every line below is one rank's tensor.", w));
  }

  one_to_all_and_back(r);
  reduce_and_all_gather(r);
  const Summed summed = reduce_scatter_and_all_reduce(r);
  reduce_scatter_then_all_gather(r, summed);
  all_to_all(r);
  other_reduce_ops(r);
  async_all_reduce(r);
}

// ---- the checks ---------------------------------------------------------------------------------------

// Records whether `t` holds `want` on this rank, element i within bound[i]; a failure names the first
// element out of bounds with every digit of both numbers. Copies (broadcast, gather, all_to_all, ...) and
// max / min are exact: bound 0. A reduction that sums or multiplies rounds, and the ranks' float32 numbers
// may be combined in any order (the simulator goes in member order, NCCL's ring in another), so its
// bound is the one that holds for every order; see sum_bound and product_bound.
void expect(Rank& r, const std::string& what, const Tensor& t, const std::vector<double>& want,
            const std::vector<double>& bound) {
  const std::vector<float> got = r.to_host(t);
  std::string detail;
  for (size_t i = 0; i < want.size() && detail.empty(); ++i) {
    const double b = bound.empty() ? 0.0 : bound[i];
    const bool ok = i < got.size() && (got[i] == want[i] || std::fabs(got[i] - want[i]) <= b);
    if (!ok) {
      detail = fmt::format("rank {} element {}: expected {:.17g}, got {:.9g} (bound {:.3g}); rank {} has {}",
                           r.rank(), i, want[i], i < got.size() ? got[i] : NAN, b, r.rank(),
                           format_values(t.shape(), got));
    }
  }
  if (got.size() != want.size() && detail.empty()) {
    detail = fmt::format("rank {}: {} values where {} were expected", r.rank(), got.size(), want.size());
  }
  r.check(what, detail.empty(), detail);
}

// float32's unit roundoff, and Higham's gamma_n = n u / (1 - n u).
constexpr double kUnit = 0x1p-24;
double gamma(int n) {
  return n * kUnit / (1 - n * kUnit);
}
// A float32 sum of w numbers, added in any order, is within gamma_{w-1} * sum |x_i| of the exact sum
// (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 4.2). While every partial sum is an
// integer below 2^24 it is exact, and so is any order.
double sum_bound(int w, double sum_of_magnitudes) {
  return gamma(w - 1) * sum_of_magnitudes;
}
// A float32 product of w numbers, in any order, is within gamma_{w-1} of the exact product, relatively.
double product_bound(int w, double product) {
  return gamma(w - 1) * std::fabs(product);
}

std::vector<double> as_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

std::vector<double> iota(int n, double start) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

void heading(Rank& r, const std::string& title, const std::string& why) {
  if (r.rank() != 0) return;
  r.print("");
  r.print(title);
  r.print(why);
}

}  // namespace

const OptionTable<LessonOptions> kOptions = {
    {"world", &LessonOptions::world, "ranks: every line of output is one rank's tensor"}};
const std::vector<LectureSetting> kLecture = {{"world", "4", "the lecture's examples"}};

RANKLAB_LESSON("collectives", "every collective of the lecture on real numbers, checked", collectives,
               kOptions, kLecture);

}  // namespace ranklab
