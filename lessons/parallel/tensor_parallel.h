// Tensor parallelism as Megatron-LM does it (Shoeybi et al. 2019): a transformer's linear layers come in
// pairs, the first split by columns (each rank computes some of the output features: the attention heads
// of qkv, a quarter of the MLP's 4h) and the second by rows (each rank multiplies its features by its rows
// of the weight and gets a partial sum of the whole output). Between the two nothing is communicated; after
// the pair, one all-reduce adds the partial sums. The backward mirrors it: the input gradient of the
// column-parallel layer is partial and needs one all-reduce. Megatron calls the two conjugate operators
//
//   f  (entering the pair)   forward: identity            backward: all-reduce
//   g  (leaving the pair)    forward: all-reduce          backward: identity
//
// Sequence parallelism (Korthikanti et al. 2022) notices that an all-reduce is a reduce-scatter followed by
// an all-gather, and that what lies between two pairs (layernorm, bias, residual, dropout) works on each
// token alone. So it keeps those activations split along the sequence: g becomes a reduce-scatter (each
// rank keeps its tokens) and f an all-gather (the pair needs every token). The same bytes move, but the
// activations between pairs take 1/tp of the memory, and so does the work on them.
//
//   f (sp)   forward: all-gather (tokens)     backward: reduce-scatter
//   g (sp)   forward: reduce-scatter          backward: all-gather
//
// Rows are tokens in sequence-major order, so "split along the sequence" is "split along dim 0", which is
// what all_gather and reduce_scatter do.
#pragma once

#include "common/rank.h"
#include "lessons/parallel/exposed.h"

namespace ranklab::parallel {

struct TensorParallel {
  Rank& r;
  Group group;
  int size = 1;
  bool seq_parallel = false;
  bool phantom = false;
  ExposedComm& exposed;

  Dim dim() const { return seq_parallel ? Dim::Sp : Dim::Tp; }
  // f, forward: the input of a column-parallel layer, whole (SP: gathered from every rank's tokens).
  Tensor enter(const Tensor& x);
  // f, backward: the input gradient, summed over ranks (SP: summed and split back into tokens).
  Tensor enter_backward(const Tensor& dx);
  // g, forward: the row-parallel layer's partial output summed (SP: summed, each rank keeping its tokens).
  Tensor leave(const Tensor& y);
  // g, backward: the output gradient as the row-parallel layer needs it (SP: gathered).
  Tensor leave_backward(const Tensor& dy);

  Tensor all_reduce(const Tensor& t, Dim d);   // in place, returns t
  Tensor all_gather(const Tensor& local);      // along rows
  Tensor reduce_scatter(const Tensor& whole);  // along rows
};

// A linear layer y = x @ w (+ b) and its backward, the same whether w is a column block or a row block:
// what makes it column- or row-parallel is where the f and g above go.
Tensor linear(Rank& r, const Tensor& x, const Tensor& w, const Tensor& b);
struct LinearGrads {
  Tensor dw, db, dx;  // db: float32 (undefined without a bias)
};
LinearGrads linear_backward(Rank& r, const Tensor& x, const Tensor& w, const Tensor& dy, bool bias,
                            bool want_dx);

}  // namespace ranklab::parallel
