#include "lessons/parallel/tensor_parallel.h"

namespace ranklab::parallel {

Tensor TensorParallel::all_reduce(const Tensor& t, Dim d) {
  if (size == 1) return t;
  const Event e = exposed.before();
  exposed.after(d, e, r.all_reduce(t, ReduceOp::Sum, Async::No, group));
  return t;
}

Tensor TensorParallel::all_gather(const Tensor& local) {
  if (size == 1) return local;
  Tensor out = buffer(r, phantom, local.shape().with_dim(0, local.size(0) * size), local.dtype());
  const Event e = exposed.before();
  exposed.after(Dim::Sp, e, r.all_gather(out, local, Async::No, group));
  return out;
}

Tensor TensorParallel::reduce_scatter(const Tensor& whole) {
  if (size == 1) return whole;
  Tensor out = buffer(r, phantom, whole.shape().with_dim(0, whole.size(0) / size), whole.dtype());
  const Event e = exposed.before();
  exposed.after(Dim::Sp, e, r.reduce_scatter(out, whole, ReduceOp::Sum, Async::No, group));
  return out;
}

Tensor TensorParallel::enter(const Tensor& x) {
  return seq_parallel ? all_gather(x) : x;
}
Tensor TensorParallel::enter_backward(const Tensor& dx) {
  return seq_parallel ? reduce_scatter(dx) : all_reduce(dx, Dim::Tp);
}
Tensor TensorParallel::leave(const Tensor& y) {
  return seq_parallel ? reduce_scatter(y) : all_reduce(y, Dim::Tp);
}
Tensor TensorParallel::leave_backward(const Tensor& dy) {
  return seq_parallel ? all_gather(dy) : dy;
}

Tensor TensorParallel::column_backward(const Tensor& x, const std::function<Tensor()>& dgrad,
                                       const std::function<void(const Tensor&)>& wgrad) {
  if (!(async_backward || overlapped()) || size == 1) {
    wgrad(enter(x));
    return enter_backward(dgrad());
  }
  // The input's all-gather runs while the input gradient's GEMM does; that gradient's reduction, while the
  // weight gradient's GEMM does. The GEMMs are issued after the collective they hide, so that it starts
  // first (Megatron-LM runs with one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1, for the same reason).
  Tensor whole = x;
  Work gathered;
  if (seq_parallel) {
    whole = buffer(r, phantom, x.shape().with_dim(0, x.size(0) * size), x.dtype());
    gathered = r.all_gather(whole, x, Async::Yes, group);
    exposed.communicated(Dim::Sp, gathered);
  }
  Tensor dx = dgrad();
  if (seq_parallel) exposed.wait(Dim::Sp, gathered);
  Tensor reduced = dx;
  Work reduction;
  if (seq_parallel) {
    reduced = buffer(r, phantom, dx.shape().with_dim(0, dx.size(0) / size), dx.dtype());
    reduction = r.reduce_scatter(reduced, dx, ReduceOp::Sum, Async::Yes, group);
  } else {
    reduction = r.all_reduce(dx, ReduceOp::Sum, Async::Yes, group);
  }
  exposed.communicated(dim(), reduction);
  wgrad(whole);
  exposed.wait(dim(), reduction);
  return reduced;
}

// ---- the linear layers of a pair ------------------------------------------------------------------------

// ---- the GEMMs, in 16 bits or FP8 -------------------------------------------------------------------------

Tensor TensorParallel::forward_gemm(const Tensor& x, const Tensor& w, const Tensor& out) {
  const Tensor a = fp8 && !is_float8(x.dtype()) ? fp8->activation(x, Fp8::Use::Forward) : x;
  const Tensor b = fp8 ? fp8->weight(w).along_rows : w;
  if (!out.defined()) return r.matmul(a, b);
  r.matmul_(out, a, b, Trans::No, Trans::No);
  return out;
}

Tensor TensorParallel::dgrad_gemm(const Tensor& dy, const Tensor& w, const Fp8Operand* dy8,
                                  const Tensor& out) {
  Tensor a = dy, b = w;
  if (fp8) {
    a = dy8 ? dy8->along_cols : fp8->gradient(dy, Fp8::Use::Dgrad);
    b = fp8->weight(w).along_cols;
  }
  if (!out.defined()) return r.matmul(a, b, Trans::No, Trans::Yes);
  r.matmul_(out, a, b, Trans::No, Trans::Yes);
  return out;
}

Tensor TensorParallel::wgrad_gemm(const Tensor& x, const Tensor& dy, const Fp8Operand* dy8,
                                  const Tensor& into) {
  if (!fp8) return weight_grad(r, x, dy, into);
  return weight_grad(r, is_float8(x.dtype()) ? x : fp8->activation(x, Fp8::Use::Wgrad),
                     dy8 ? dy8->along_rows : fp8->gradient(dy, Fp8::Use::Wgrad), into);
}

Tensor TensorParallel::ring_gemm(const Tensor& a, const Tensor& w, Trans tw, const Tensor& out) {
  return tw == Trans::No ? forward_gemm(a, w, out) : dgrad_gemm(a, w, nullptr, out);
}

// ---- the linear layers of a pair ------------------------------------------------------------------------

Tensor TensorParallel::keep_input(const Tensor& x, Kept* kept, bool gathered) {
  if (kept == nullptr) return x;
  if (!fp8) {
    kept->x = x;
    return x;
  }
  std::function<void(const Tensor&)> reduce_amax;
  if (gathered && seq_parallel && size > 1) {
    reduce_amax = [&](const Tensor& amax) {
      const Event e = exposed.before();
      exposed.after(Dim::Sp, e, r.all_reduce(amax, ReduceOp::Max, Async::No, group));
    };
  }
  Fp8Operand q = fp8->input(x, reduce_amax);
  kept->x = q.along_rows;
  kept->scales = q.rows_scales;
  return q.along_cols;
}

Tensor TensorParallel::column_linear(const Tensor& x, const Tensor& w, const Tensor& b, Kept* kept) {
  const Tensor in = keep_input(x, kept, /*gathered=*/true);
  if (!overlapped()) {
    Tensor y = forward_gemm(enter(in), w);
    if (b.defined()) r.add_bias_(y, b);
    return y;
  }
  return ring_gather_gemm(in, w, b, Trans::No, nullptr);
}

Tensor TensorParallel::row_linear(const Tensor& x, const Tensor& w, Kept* kept) {
  const Tensor in = keep_input(x, kept, /*gathered=*/false);
  if (!overlapped()) return leave(forward_gemm(in, w));
  return ring_gemm_scatter(in, w);
}

TensorParallel::Grads TensorParallel::column_linear_backward(const Tensor& x, const Tensor& w,
                                                             const Tensor& dy, bool bias,
                                                             const Tensor& dw_into) {
  Grads g;
  Fp8Operand dy8;
  if (fp8) dy8 = fp8->gradient(dy);
  const Fp8Operand* q = fp8 ? &dy8 : nullptr;
  g.dx = column_backward(
      x, [&] { return dgrad_gemm(dy, w, q); },
      [&](const Tensor& whole) {
        g.dw = wgrad_gemm(whole, dy, q, dw_into);
        if (bias) g.db = r.sum_rows(dy);
      });
  return g;
}

TensorParallel::Grads TensorParallel::row_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                                          const Tensor& dw_into) {
  if (!overlapped()) {
    const Tensor whole = leave_backward(dy);
    Fp8Operand dy8;
    if (fp8) dy8 = fp8->gradient(whole);
    const Fp8Operand* q = fp8 ? &dy8 : nullptr;
    Grads g;
    g.dw = wgrad_gemm(x, whole, q, dw_into);
    g.dx = dgrad_gemm(whole, w, q);
    return g;
  }
  Grads g;
  Tensor dy_whole;
  g.dx = ring_gather_gemm(dy, w, Tensor(), Trans::Yes, &dy_whole);
  g.dw = wgrad_gemm(x, dy_whole, nullptr, dw_into);
  return g;
}

// ---- the rings ------------------------------------------------------------------------------------------

Work TensorParallel::ring_exchange(const Tensor& out, const Tensor& in) {
  // A shift around the ring is an all-to-all whose one non-empty piece goes to the next rank: the same
  // grouped sends and receives NCCL runs for it, and one call the whole group makes together.
  std::vector<std::int64_t> sent(size, 0), received(size, 0);
  sent[(index + 1) % size] = out.size(0);
  received[(index + size - 1) % size] = in.size(0);
  Work shift = r.all_to_all(in, out, received, sent, Async::Yes, group);
  exposed.communicated(Dim::Sp, shift);
  return shift;
}

Tensor TensorParallel::ring_gather_gemm(const Tensor& local, const Tensor& w, const Tensor& b, Trans tw,
                                        Tensor* keep_gathered) {
  // One buffer of every rank's rows (the userbuffer): this rank's copied in, the others' received in place,
  // each GEMM writing its rows of the output in place.
  const std::int64_t rows = local.size(0), out_cols = tw == Trans::No ? w.size(1) : w.size(0);
  Tensor gathered = buffer(r, phantom, local.shape().with_dim(0, rows * size), local.dtype());
  Tensor out = buffer(r, phantom, Shape{rows * size, out_cols}, gemm_output(local.dtype()));
  auto rows_of = [&](const Tensor& t, int rank) {
    return r.view(t, rank * rows * t.size(1), Shape{rows, t.size(1)});
  };
  r.copy_(rows_of(gathered, index), local);
  // Step s holds the rows of rank index - s: its own first, then each one the previous rank passes on.
  for (int s = 0; s < size; ++s) {
    const int from = (index - s + size) % size;
    Work exchange;
    if (s + 1 < size)
      exchange = ring_exchange(rows_of(gathered, from), rows_of(gathered, (from + size - 1) % size));
    ring_gemm(rows_of(gathered, from), w, tw, rows_of(out, from));
    if (b.defined()) r.add_bias_(rows_of(out, from), b);
    if (s + 1 < size) exposed.wait(Dim::Sp, exchange);
  }
  if (keep_gathered != nullptr) *keep_gathered = gathered;
  return out;
}

Tensor TensorParallel::ring_gemm_scatter(const Tensor& whole, const Tensor& w) {
  // The sum for rank j's rows starts at rank j + 1 and gathers one partial product per hop; after size - 1
  // hops it reaches rank j. At step s this rank adds its part for the rows of rank index - 1 - s.
  const std::int64_t rows = whole.size(0) / size, cols = whole.size(1);
  auto partial = [&](int s) {
    const int of = (index - 1 - s + 2 * size) % size;
    return forward_gemm(r.view(whole, of * rows * cols, Shape{rows, cols}), w);
  };
  Tensor sum = partial(0);
  std::vector<Tensor> sent;  // alive until their sends are done
  for (int s = 1; s < size; ++s) {
    Tensor received = buffer(r, phantom, sum.shape(), sum.dtype());
    Work exchange = ring_exchange(sum, received);
    sent.push_back(sum);
    Tensor mine = partial(s);
    exposed.wait(Dim::Sp, exchange);
    sum = r.add(received, mine);
  }
  return sum;
}

Tensor weight_grad(Rank& r, const Tensor& x, const Tensor& dy, const Tensor& into) {
  if (!into.defined()) return r.matmul(x, dy, Trans::Yes, Trans::No);
  r.matmul_add_(into, x, dy, Trans::Yes, Trans::No);
  return Tensor();
}

}  // namespace ranklab::parallel
