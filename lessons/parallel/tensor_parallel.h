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
//
// Communication overlap (`comm_overlap`, Megatron's --tp-comm-overlap; Wang et al. 2022, "Overlap
// Communication with Dependent Computation via Decomposition", as TransformerEngine's userbuffers and
// torch's AsyncTP do it): with sequence parallelism an all-gather followed by the GEMM that consumes it is
// tp GEMMs on the tp pieces of the rows, each piece passed on to the next rank around the ring while the
// GEMM of the one before runs; a GEMM followed by a reduce-scatter is tp partial GEMMs whose sums travel
// around the ring, each hop hidden under the next partial GEMM. The same bytes move, point to point, and
// the compute stream waits only for what a GEMM did not hide. The backward of a column-parallel layer is
// not decomposed: its input's all-gather (for the weight gradient) runs beside the input gradient's GEMM,
// and that gradient's reduce-scatter beside the weight gradient's GEMM, as column_backward's asynchronous
// form does. TransformerEngine's defaults pick these methods per GEMM (transformer_engine/pytorch/module/
// base.py, initialize_ub: "ring_exchange" for qkv_fprop, fc1_fprop, proj_dgrad and fc2_dgrad, "bulk" for
// qkv_dgrad, qkv_wgrad, fc1_dgrad and fc1_wgrad); the row-parallel forward's "pipeline" (the GEMM in 4
// chunks of output columns, each reduce-scattered as the next is computed) is modelled by the ring, which
// moves the same bytes and hides all but one hop. As the userbuffers do, the pieces live in one buffer
// (views of it): each arrives in its place and each GEMM writes its rows of the output in place; only this
// rank's own rows are copied in.
#pragma once

#include <functional>
#include <vector>

#include "common/rank.h"
#include "lessons/parallel/exposed.h"
#include "lessons/parallel/fp8.h"

namespace ranklab::parallel {

struct TensorParallel {
  Rank& r;
  Group group;
  int size = 1;
  bool seq_parallel = false;
  bool phantom = false;
  ExposedComm& exposed;
  bool comm_overlap = false;    // with seq_parallel: the ring decompositions above
  bool async_backward = false;  // column_backward's collectives beside its GEMMs (see there)
  int index = 0;                // this rank's place in the group
  std::vector<int> ranks{};     // the group's global ranks, in order
  Fp8* fp8 = nullptr;           // the linear layers' GEMMs in FP8 (fp8.h); 16-bit without

  Dim dim() const { return seq_parallel ? Dim::Sp : Dim::Tp; }
  // f, forward: the input of a column-parallel layer, whole (SP: gathered from every rank's tokens).
  Tensor enter(const Tensor& x);
  // f, backward: the input gradient, summed over ranks (SP: summed and split back into tokens).
  Tensor enter_backward(const Tensor& dx);
  // g, forward: the row-parallel layer's partial output summed (SP: summed, each rank keeping its tokens).
  Tensor leave(const Tensor& y);
  // g, backward: the output gradient as the row-parallel layer needs it (SP: gathered).
  Tensor leave_backward(const Tensor& dy);

  // f's backward around a column-parallel layer's two gradient GEMMs. `dgrad()` gives the input gradient
  // before the reduction; `wgrad(whole)` makes the weight's gradients from the whole input (with sequence
  // parallelism gathered again: forward kept only this rank's tokens). Returns the reduced input gradient.
  // Plain, each collective waits. With async_backward or comm_overlap, as Megatron-LM's
  // LinearWithGradAccumulationAndAsyncCommunication (since September 2021, commit cf7efd4; the sequence-
  // parallel form since March 2022, commit 02bb1f5), the gather runs beside dgrad and the reduction beside
  // wgrad.
  Tensor column_backward(const Tensor& x, const std::function<Tensor()>& dgrad,
                         const std::function<void(const Tensor&)>& wgrad);

  // The pairs' linear layers with their communication: the column-parallel layer y = f(x) @ w + b, the
  // row-parallel one y = g(x @ w), and their backwards (dx reduced as f's backward reduces it; for the
  // row-parallel layer dy is the output gradient before g's backward). With comm_overlap they run as the
  // ring decompositions; without, as f or g and one GEMM.
  //
  // `kept`, when given, receives what the layer's backward takes as its input x: x itself, or with FP8 its
  // copy quantized for the weight gradient (one byte an element) and that copy's block scales.
  struct Kept {
    Tensor x, scales;
  };
  Tensor column_linear(const Tensor& x, const Tensor& w, const Tensor& b, Kept* kept = nullptr);
  Tensor row_linear(const Tensor& x, const Tensor& w, Kept* kept = nullptr);
  struct Grads {
    Tensor dw, db, dx;
  };
  // `bias`: whether the layer has one (db). `dw_into`, when given, is the weight's gradient buffer: the
  // weight-gradient GEMM sums into it (gradient-accumulation fusion) and Grads::dw stays undefined.
  Grads column_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, bool bias = true,
                               const Tensor& dw_into = Tensor());
  Grads row_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                            const Tensor& dw_into = Tensor());

  Tensor all_reduce(const Tensor& t, Dim d);   // in place, returns t
  Tensor all_gather(const Tensor& local);      // along rows
  Tensor reduce_scatter(const Tensor& whole);  // along rows

 private:
  bool overlapped() const { return comm_overlap && seq_parallel && size > 1; }
  // A linear layer's three GEMMs, in FP8 when fp8 is set: forward x @ w and dgrad dy @ w^T (into `out`
  // when defined), wgrad x^T @ dy (summed into `into` when defined). `dy8`: dy already quantized for both;
  // an x already in FP8 goes in as it is.
  Tensor forward_gemm(const Tensor& x, const Tensor& w, const Tensor& out = Tensor());
  Tensor dgrad_gemm(const Tensor& dy, const Tensor& w, const Fp8Operand* dy8, const Tensor& out = Tensor());
  Tensor wgrad_gemm(const Tensor& x, const Tensor& dy, const Fp8Operand* dy8, const Tensor& into);
  // forward_gemm (tw No) or dgrad_gemm (tw Yes): the GEMM of a ring step.
  Tensor ring_gemm(const Tensor& a, const Tensor& w, Trans tw, const Tensor& out = Tensor());
  // Each rank's rows `local` times w, every rank's pieces in turn as they come around the ring; the
  // products in the group's row order. `keep_gathered`: also the gathered rows.
  Tensor ring_gather_gemm(const Tensor& local, const Tensor& w, const Tensor& b, Trans tw,
                          Tensor* keep_gathered);
  // The rows of `whole` this rank keeps of the sum over ranks of whole @ w (a row-parallel layer's
  // forward), the sums passed on around the ring.
  Tensor ring_gemm_scatter(const Tensor& whole, const Tensor& w);
  // x as the layer's forward GEMM takes it, and into `kept` what its backward will: with FP8 and a `kept`,
  // both quantized in one pass. `gathered`: x is this rank's rows of what an all-gather joins (a
  // column-parallel layer's with sequence parallelism), whose pieces must share one per-tensor scale.
  Tensor keep_input(const Tensor& x, Kept* kept, bool gathered);
  // Sends `out` to the next rank and receives into `in` from the previous one.
  Work ring_exchange(const Tensor& out, const Tensor& in);
};

// x^T dy, the weight gradient of y = x @ w: a new tensor, or, when `into` is defined, summed into it by the
// GEMM (Megatron-LM's gradient-accumulation fusion) and an undefined tensor returned.
Tensor weight_grad(Rank& r, const Tensor& x, const Tensor& dy, const Tensor& into);

}  // namespace ranklab::parallel
