#include "lessons/parallel/zero.h"

#include <algorithm>

namespace ranklab::parallel {

namespace {
// A tensor of `s` with dim 0 replaced.
Shape rows_shape(const Shape& s, std::int64_t rows) {
  return s.with_dim(0, rows);
}
std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

DataParallel::DataParallel(Rank& r, ZeroConfig c, ExposedComm& exposed)
    : r_(r), c_(std::move(c)), exposed_(exposed) {}

ReduceOp DataParallel::dp_op() const {
  return c_.broken == "dp-sum" ? ReduceOp::Sum : ReduceOp::Avg;
}

Tensor DataParallel::pad(const Param& p, const Tensor& t) {
  if (p.rows_padded == p.rows) return t;
  Tensor fill = zeros(r_, c_.phantom, rows_shape(t.shape(), p.rows_padded - p.rows), t.dtype());
  return r_.cat({t, fill}, 0);
}

Tensor DataParallel::unpad(const Param& p, const Tensor& t) {
  return p.rows_padded == p.rows ? t : r_.slice(t, 0, 0, p.rows);
}

Tensor DataParallel::shard_of(const Param& p, const Tensor& local) {
  if (c_.dp_size == 1) return local;
  return r_.slice(pad(p, local), 0, c_.dp_rank * p.shard_rows, p.shard_rows);
}

std::int64_t DataParallel::shard_first_row(const Param& p) const {
  return c_.stage >= 1 && c_.dp_size > 1 ? c_.dp_rank * p.shard_rows : 0;
}
std::int64_t DataParallel::shard_valid_rows(const Param& p) const {
  if (c_.stage == 0 || c_.dp_size == 1) return p.rows;
  return std::clamp<std::int64_t>(p.rows - shard_first_row(p), 0, p.shard_rows);
}

namespace {
Shape local_shape(const ParamSpec& s, int tp_size) {
  return s.tp_dim < 0 ? s.full : s.full.with_dim(s.tp_dim, s.full[s.tp_dim] / tp_size);
}
}  // namespace

DataParallel::Bytes DataParallel::bytes(const ParamSpec& s, const ZeroConfig& c) {
  const Shape local = local_shape(s, c.tp_size);
  const std::int64_t n = local.numel(), rows = local[0];
  const std::int64_t shard = ceil_div(rows, c.dp_size) * (n / rows);
  const bool sharded = c.dp_size > 1;
  const std::int64_t master = c.stage >= 1 && sharded ? shard : n;
  const std::int64_t copy = c.stage == 3 && sharded ? shard : n;
  // The 16-bit copy and the float32 master are one tensor when both are float32 and the same size.
  const bool same = c.dtype == DType::Float32 && master == copy;
  Bytes b;
  b.weights = 4 * master + (same ? 0 : copy * dtype_bytes(c.dtype));
  b.grads = 4 * (c.stage >= 2 && sharded ? shard : n);
  b.optimizer = 8 * master;
  return b;
}

void DataParallel::init(Param& p) {
  const ParamSpec& s = p.spec;
  p.local = local_shape(s, c_.tp_size);
  p.tp_start = s.tp_dim < 0 ? 0 : c_.tp_rank * p.local[s.tp_dim];
  p.rows = p.local[0];
  p.shard_rows = ceil_div(p.rows, c_.dp_size);
  p.rows_padded = p.shard_rows * c_.dp_size;

  Tensor local;
  if (c_.phantom) {
    local = r_.phantom(p.local, DType::Float32);
  } else if (s.std > 0) {
    const int dim = s.tp_dim < 0 ? 0 : s.tp_dim;
    local = r_.randn_slice(s.full, dim, p.tp_start, p.local[dim], s.seed, s.std, DType::Float32);
  } else {
    local = r_.full(p.local, s.value, DType::Float32);
  }
  auto to_dtype = [&](const Tensor& t) { return c_.dtype == DType::Float32 ? t : r_.cast(t, c_.dtype); };
  const bool sharded = c_.dp_size > 1;
  if (c_.stage == 0 || !sharded) {
    p.master = local;
    p.copy = to_dtype(local);
  } else {
    p.master = shard_of(p, local);
    p.copy = c_.stage == 3 ? to_dtype(p.master) : to_dtype(local);
  }
  const Shape grad_shape = c_.stage >= 2 && sharded ? rows_shape(p.local, p.shard_rows) : p.local;
  p.grad = zeros(r_, c_.phantom, grad_shape, DType::Float32);
  p.m = zeros(r_, c_.phantom, p.master.shape(), DType::Float32);
  p.v = zeros(r_, c_.phantom, p.master.shape(), DType::Float32);
}

DataParallel::Gathered DataParallel::gather(Param& p) {
  if (c_.stage < 3 || c_.dp_size == 1) return {&p, p.copy, Work()};
  Gathered g{&p, buffer(r_, c_.phantom, rows_shape(p.local, p.rows_padded), c_.dtype), Work()};
  g.work = r_.all_gather(g.full, p.copy, Async::Yes, c_.dp);
  return g;
}

Tensor DataParallel::get(Gathered& g) {
  if (!g.work.waited()) {
    const Event e = exposed_.before();
    g.work.wait();
    exposed_.after(Dim::Dp, e);
    g.full = unpad(*g.p, g.full);
  }
  return g.full;
}

void DataParallel::add_grad(Param& p, const Tensor& g) {
  if (c_.stage <= 1 || c_.dp_size == 1) {
    r_.add_(p.grad, g, 1.0f);
    return;
  }
  Tensor t = pad(p, g.dtype() == c_.reduce_dtype ? g : r_.cast(g, c_.reduce_dtype));
  if (c_.broken == "no-reduce-scatter") {  // each rank keeps its own micro-batches' gradient
    r_.add_(p.grad, r_.slice(t, 0, c_.dp_rank * p.shard_rows, p.shard_rows), 1.0f);
    return;
  }
  Pending q{&p, buffer(r_, c_.phantom, rows_shape(p.local, p.shard_rows), c_.reduce_dtype), t, Work()};
  q.work = r_.reduce_scatter(q.out, t, dp_op(), Async::Yes, c_.dp);
  pending_.push_back(std::move(q));
}

Tensor DataParallel::embedding_grad_target(Param& p) {
  if (c_.stage <= 1 || c_.dp_size == 1) return p.grad;
  return zeros(r_, c_.phantom, p.local, DType::Float32);
}

void DataParallel::embedding_grad_done(Param& p, const Tensor& target) {
  if (!target.same_storage(p.grad)) add_grad(p, target);
}

void DataParallel::drain() {
  for (Pending& q : pending_) {
    const Event e = exposed_.before();
    q.work.wait();
    exposed_.after(Dim::Dp, e);
    r_.add_(q.p->grad, q.out, 1.0f);
  }
  pending_.clear();
}

void DataParallel::bucket_ready(const std::vector<Param*>& ps) {
  if (c_.stage >= 2 || c_.dp_size == 1) return;
  for (Param* p : ps) {
    Tensor t = c_.reduce_dtype == DType::Float32 ? p->grad : r_.cast(p->grad, c_.reduce_dtype);
    Work w = r_.all_reduce(t, dp_op(), Async::Yes, c_.dp);
    reduces_.push_back({p, t, Tensor(), std::move(w)});
  }
}

void DataParallel::finish(const std::vector<Param*>& ps) {
  drain();
  for (Pending& q : reduces_) {
    const Event e = exposed_.before();
    q.work.wait();
    exposed_.after(Dim::Dp, e);
    if (!q.out.same_storage(q.p->grad)) r_.copy_(q.p->grad, q.out);
  }
  reduces_.clear();
  for (Param* p : ps) {
    if (p->spec.sp_partial && c_.seq_parallel && c_.tp_size > 1 && c_.broken != "no-sp-grad-sync") {
      const Event e = exposed_.before();
      r_.all_reduce(p->grad, ReduceOp::Sum, Async::No, c_.tp);
      exposed_.after(Dim::Sp, e);
    }
    if (p->spec.tied && c_.embedding_group) {
      const Event e = exposed_.before();
      r_.all_reduce(p->grad, ReduceOp::Sum, Async::No, c_.embedding);
      exposed_.after(Dim::Pp, e);
    }
  }
}

void DataParallel::step(const std::vector<Param*>& ps, const AdamW& h, int t) {
  const bool sharded = c_.dp_size > 1;
  std::vector<Pending> gathers;
  for (Param* p : ps) {
    AdamW hp = h;
    if (!p->spec.decay) hp.weight_decay = 0;
    const Tensor g = c_.stage == 1 && sharded ? shard_of(*p, p->grad) : p->grad;
    r_.adamw_step(p->master, g, p->m, p->v, hp, t);
    if (c_.stage == 0 || c_.stage == 3 || !sharded) {
      if (!p->copy.same_storage(p->master)) r_.copy_(p->copy, p->master);
      continue;
    }
    // zero 1 and 2: every rank updated its shard; an all_gather puts the 16-bit weights back together.
    Tensor mine = c_.dtype == DType::Float32 ? p->master : r_.cast(p->master, c_.dtype);
    Pending q{p, buffer(r_, c_.phantom, rows_shape(p->local, p->rows_padded), c_.dtype), mine, Work()};
    q.work = r_.all_gather(q.out, mine, Async::Yes, c_.dp);
    gathers.push_back(std::move(q));
  }
  for (Pending& q : gathers) {
    const Event e = exposed_.before();
    q.work.wait();
    exposed_.after(Dim::Dp, e);
    if (q.p->rows_padded == q.p->rows) {
      q.p->copy = q.out;
    } else {
      r_.copy_(q.p->copy, unpad(*q.p, q.out));
    }
  }
}

void DataParallel::zero_grads(const std::vector<Param*>& ps) {
  for (Param* p : ps) r_.scale_(p->grad, 0.0f);
}

}  // namespace ranklab::parallel
