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

// Records whether `t` holds exactly `want` on every rank (the values are small integers, so exact).
void expect(Rank& r, const std::string& what, const Tensor& t, const std::vector<float>& want) {
  const std::vector<float> got = r.to_host(t);
  r.check(what, got == want,
          got == want ? "" : fmt::format("rank {} has {}", r.rank(), format_values(t.shape(), got)));
}

std::vector<float> iota(int n, float start) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

void heading(Rank& r, const std::string& title, const std::string& why) {
  if (r.rank() != 0) return;
  r.print("");
  r.print(title);
  r.print(why);
}

void collectives(Rank& r, const Options& o) {
  const int w = r.world_size(), me = r.rank();
  (void)o;
  if (me == 0) {
    r.print(fmt::format(
        "Collectives on {} ranks. Each rank is one GPU; every line below is one rank's tensor.", w));
  }

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
    if (me == 0) r.print(fmt::format("  Input:   rank0 = {}", format_values({w}, iota(w, 0))));
    r.scatter(out, in, 0);
    r.show("  Output: ", out);
    expect(r, "scatter gives rank i piece i", out, {static_cast<float>(me)});
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

  // Reduce: like gather, but the pieces are combined instead of concatenated.
  heading(r, "reduce(root=0, Sum)",
          "Like gather, but the pieces are summed (or max, min, product) on rank 0.");
  {
    Tensor t = r.full({1}, static_cast<float>(me));
    r.show("  Input:  ", t);
    r.reduce(t, 0, ReduceOp::Sum);
    if (me == 0) {
      r.print(fmt::format("  Output:  rank0 = {}", format_values({1}, r.to_host(t))));
      expect(r, "reduce sums every rank's value on rank 0", t, {static_cast<float>(w * (w - 1) / 2)});
    }
  }

  // All-gather: gather, with the result on every rank.
  heading(r, "all_gather",
          "Gather with the result on every rank: how sharded parameters are put back together.");
  const std::vector<float> gathered = iota(w, 0);
  {
    Tensor in = r.full({1}, static_cast<float>(me));
    Tensor out = r.zeros({w});
    r.show("  Input:  ", in);
    r.all_gather(out, in);
    r.show("  Output: ", out);
    expect(r, "all_gather gives every rank every piece", out, gathered);
  }

  // Reduce-scatter: reduce component i over ranks and leave it on rank i.
  heading(r, "reduce_scatter(Sum)",
          "Component i is summed over ranks and lands on rank i: how gradients are sharded.");
  // Rank i holds [i, i+1, ..., i+w-1], as in the lecture; component j sums to sum_i (i + j).
  std::vector<float> summed(w);
  for (int j = 0; j < w; ++j) summed[j] = static_cast<float>(w * j + w * (w - 1) / 2);
  Tensor rs_out = r.zeros({1});
  {
    Tensor in = r.arange({w}, static_cast<float>(me));
    r.show("  Input:  ", in);
    r.reduce_scatter(rs_out, in, ReduceOp::Sum);
    r.show("  Output: ", rs_out);
    expect(r, "reduce_scatter leaves component i's sum on rank i", rs_out, {summed[me]});
  }

  // All-reduce: every rank ends with the sum of every rank's tensor.
  heading(r, "all_reduce(Sum)", "Every rank gets the elementwise sum: the one call data parallelism needs.");
  Tensor ar = r.arange({w}, static_cast<float>(me));
  r.show("  Input:  ", ar);
  r.all_reduce(ar, ReduceOp::Sum);
  r.show("  Output: ", ar);
  expect(r, "all_reduce gives every rank the sum", ar, summed);

  // The identity: reduce-scatter then all-gather is an all-reduce.
  heading(r, "reduce_scatter + all_gather = all_reduce",
          "All-gathering the reduce-scatter's pieces rebuilds the all-reduce's result.");
  {
    Tensor rebuilt = r.zeros({w});
    r.all_gather(rebuilt, rs_out);
    r.show("  all_gather(reduce_scatter(x)): ", rebuilt);
    const std::vector<float> a = r.to_host(rebuilt), b = r.to_host(ar);
    r.check("reduce_scatter followed by all_gather equals all_reduce", a == b,
            a == b ? "" : fmt::format("rank {}: {} vs {}", me, format_values({w}, a), format_values({w}, b)));
  }

  // All-to-all: piece j of rank i goes to rank j; with equal pieces it transposes the rank x piece matrix.
  heading(r, "all_to_all",
          "Piece j of rank i goes to rank j: a transpose across ranks, as MoE routing needs.");
  {
    Tensor in = r.arange({w}, static_cast<float>(me * w));
    Tensor out = r.zeros({w});
    r.show("  Input:  ", in);
    r.all_to_all(out, in);
    r.show("  Output: ", out);
    std::vector<float> want(w);
    for (int i = 0; i < w; ++i) want[i] = static_cast<float>(i * w + me);
    expect(r, "all_to_all transposes the pieces", out, want);
  }

  // The other reduce ops, on one all_reduce each.
  heading(r, "all_reduce with Max, Min, Prod and Avg", "Any associative, commutative op can reduce.");
  for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::Avg}) {
    Tensor t = r.full({1}, static_cast<float>(me + 1));
    r.all_reduce(t, op);
    float want = 0;
    switch (op) {
      case ReduceOp::Max:
        want = static_cast<float>(w);
        break;
      case ReduceOp::Min:
        want = 1;
        break;
      case ReduceOp::Prod:
        want = static_cast<float>(std::tgamma(w + 1));
        break;
      default:
        want = static_cast<float>(w + 1) / 2;
    }
    if (me == 0)
      r.print(fmt::format("  all_reduce({}) of rank+1 = {}", reduce_op_name(op),
                          format_values({1}, r.to_host(t))));
    expect(r, fmt::format("all_reduce({}) of rank+1", reduce_op_name(op)), t, {want});
  }

  // Async: the call returns at once and wait() orders later work after it.
  heading(r, "async all_reduce", "Async::Yes returns a Work at once; wait() before touching the tensor.");
  {
    Tensor t = r.full({2}, 1.0f);
    Work work = r.all_reduce(t, ReduceOp::Sum, Async::Yes);
    work.wait();
    expect(r, "async all_reduce after wait()", t, {static_cast<float>(w), static_cast<float>(w)});
    if (me == 0) r.print(fmt::format("  rank0 = {} after wait()", format_values({2}, r.to_host(t))));
  }
}

}  // namespace

RANKLAB_LESSON("collectives", "every collective of the lecture on real numbers, checked", collectives);

}  // namespace ranklab
