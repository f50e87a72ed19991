#include "lessons/parallel/tensor_parallel.h"

namespace ranklab::parallel {

Tensor TensorParallel::all_reduce(const Tensor& t, Dim d) {
  if (size == 1) return t;
  const Event e = exposed.before();
  r.all_reduce(t, ReduceOp::Sum, Async::No, group);
  exposed.after(d, e);
  return t;
}

Tensor TensorParallel::all_gather(const Tensor& local) {
  if (size == 1) return local;
  Tensor out = buffer(r, phantom, local.shape().with_dim(0, local.size(0) * size), local.dtype());
  const Event e = exposed.before();
  r.all_gather(out, local, Async::No, group);
  exposed.after(Dim::Sp, e);
  return out;
}

Tensor TensorParallel::reduce_scatter(const Tensor& whole) {
  if (size == 1) return whole;
  Tensor out = buffer(r, phantom, whole.shape().with_dim(0, whole.size(0) / size), whole.dtype());
  const Event e = exposed.before();
  r.reduce_scatter(out, whole, ReduceOp::Sum, Async::No, group);
  exposed.after(Dim::Sp, e);
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

Tensor linear(Rank& r, const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor y = r.matmul(x, w);
  if (b.defined()) r.add_bias_(y, b);
  return y;
}

LinearGrads linear_backward(Rank& r, const Tensor& x, const Tensor& w, const Tensor& dy, bool bias,
                            bool want_dx) {
  LinearGrads g;
  g.dw = r.matmul(x, dy, Trans::Yes, Trans::No);  // x^T dy
  if (bias) g.db = r.sum_rows(dy);
  if (want_dx) g.dx = r.matmul(dy, w, Trans::No, Trans::Yes);  // dy w^T
  return g;
}

}  // namespace ranklab::parallel
