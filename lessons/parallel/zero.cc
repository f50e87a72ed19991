// DataParallel: what every ZeRO stage shares, and zero 2 and 3, which shard tensor by tensor. Zero 0's and
// 1's flat buckets are in zero_buckets.cc.
#include "lessons/parallel/zero.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

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

Shape local_shape(const ParamSpec& s, int tp_size) {
  return s.tp_dim < 0 ? s.full : s.full.with_dim(s.tp_dim, s.full[s.tp_dim] / tp_size);
}

LocalSize local_size(const ParamSpec& s, int tp_size) {
  const Shape local = local_shape(s, tp_size);
  return {local.numel(), local[0], s.tied};
}

DataParallel::DataParallel(Rank& r, ZeroConfig c, ExposedComm& exposed)
    : r_(r), c_(std::move(c)), exposed_(exposed) {}

ReduceOp DataParallel::dp_op() const {
  return c_.broken == "dp-sum" ? ReduceOp::Sum : ReduceOp::Avg;
}

std::int64_t default_bucket_params(int dp_size) {
  // Megatron-Core's DistributedDataParallelConfig.bucket_size default: larger data-parallel groups need
  // larger buckets for their collectives not to be bound by latency.
  return std::max<std::int64_t>(40'000'000, std::int64_t{1'000'000} * dp_size);
}

// ---- the parameters' tensors -------------------------------------------------------------------------

DataParallel::Bytes DataParallel::bytes(const LocalSize& s, const ZeroConfig& c) {
  const std::int64_t n = s.elements, rows = s.rows;
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

DataParallel::Bytes DataParallel::bytes(const std::vector<LocalSize>& backward_order, const ZeroConfig& c) {
  Bytes b;
  if (c.stage >= 2) {
    for (const LocalSize& s : backward_order) b += bytes(s, c);
    return b;
  }
  const BucketLayout layout = layout_buckets(backward_order, c);
  for (std::int64_t e : layout.elements) b.grads += e * dtype_bytes(c.reduce_dtype);
  if (c.stage == 0 || c.dp_size == 1) {  // every parameter's own copy, master and moments
    for (const LocalSize& s : backward_order) {
      const std::int64_t n = s.elements;
      b.weights += 4 * n + (c.dtype == DType::Float32 ? 0 : n * dtype_bytes(c.dtype));
      b.optimizer += 8 * n;
    }
    return b;
  }
  // The distributed optimizer: the flat weights, and the float32 master (unless the weights are float32)
  // and moments of this rank's shard of each bucket.
  for (std::int64_t e : layout.elements) {
    const std::int64_t shard = e / c.dp_size;
    b.weights += e * dtype_bytes(c.dtype) + (c.dtype == DType::Float32 ? 0 : 4 * shard);
    b.optimizer += 8 * shard;
  }
  return b;
}

void DataParallel::init(Param& p) {
  const ParamSpec& s = p.spec;
  Tensor local;
  if (c_.phantom) {
    local = r_.phantom(p.local, DType::Float32);
  } else if (s.std > 0) {
    const int dim = s.tp_dim < 0 ? 0 : s.tp_dim;
    local = r_.randn_slice(s.full, dim, p.tp_start, p.local[dim], s.seed, s.std, DType::Float32);
  } else {
    local = r_.full(p.local, s.value, DType::Float32);
  }
  if (flat()) {
    init_flat(p, local);
    return;
  }
  auto to_dtype = [&](const Tensor& t) { return c_.dtype == DType::Float32 ? t : r_.cast(t, c_.dtype); };
  if (!sharded()) {
    p.master = local;
    p.copy = to_dtype(local);
  } else {
    p.master = shard_of(p, local);
    p.copy = c_.stage == 3 ? to_dtype(p.master) : to_dtype(local);
  }
  const Shape grad_shape = sharded() ? rows_shape(p.local, p.shard_rows) : p.local;
  p.grad = zeros(r_, c_.phantom, grad_shape, DType::Float32);
  p.m = zeros(r_, c_.phantom, p.master.shape(), DType::Float32);
  p.v = zeros(r_, c_.phantom, p.master.shape(), DType::Float32);
}

void DataParallel::set_buckets(const std::vector<Param*>& backward_order) {
  std::vector<LocalSize> sizes;
  for (Param* p : backward_order) {
    p->local = local_shape(p->spec, c_.tp_size);
    p->tp_start = p->spec.tp_dim < 0 ? 0 : c_.tp_rank * p->local[p->spec.tp_dim];
    p->rows = p->local[0];
    p->shard_rows = ceil_div(p->rows, c_.dp_size);
    p->rows_padded = p->shard_rows * c_.dp_size;
    sizes.push_back(local_size(p->spec, c_.tp_size));
  }
  const BucketLayout layout = layout_buckets(sizes, c_);
  buckets_.assign(layout.elements.size(), Bucket{});
  for (std::size_t i = 0; i < backward_order.size(); ++i) {
    Param* p = backward_order[i];
    p->bucket = layout.bucket[i];
    p->offset = layout.offset[i];
    buckets_[p->bucket].params.push_back(p);
  }
  for (std::size_t k = 0; k < buckets_.size(); ++k) {
    buckets_[k].elements = layout.elements[k];
    if (flat()) make_buffers(buckets_[k]);
  }
}

void DataParallel::add_unit(const std::vector<Param*>& ps) {
  if (c_.stage < 2 || !sharded() || ps.size() < 2) return;
  Unit u;
  u.ps = ps;
  for (Param* p : ps) {
    if (p->unit >= 0)
      throw Error(fmt::format("DataParallel::add_unit: {} is in a unit already", p->spec.name));
    p->unit = static_cast<int>(units_.size());
    u.offset.push_back(u.shard_elements);
    u.shard_elements += p->shard_rows * (p->local.numel() / p->rows);
  }
  u.grads.resize(ps.size());
  units_.push_back(std::move(u));
}

// ---- the step ----------------------------------------------------------------------------------------

void DataParallel::start_step() {
  for (Bucket& b : buckets_) b.ready = 0, b.reducing = false;
  next_gather_bucket_ = static_cast<int>(buckets_.size()) - 1;
  issue_gathers(next_gather_bucket_);
}

void DataParallel::issue_gathers(int bucket) {
  // In forward order, every bucket up to this one: a forward that reaches a bucket early starts the ones
  // before it too, so no weight is read before its gather is issued.
  for (; next_gather_bucket_ >= std::max(bucket, 0); --next_gather_bucket_) {
    Bucket& b = buckets_[next_gather_bucket_];
    if (b.gather_due) {
      b.gather_due = false;
      b.gather = r_.all_gather(b.weights, shard_of(b, b.weights), Async::Yes, c_.dp);
      exposed_.communicated(Dim::Dp, b.gather);
    }
    for (Pending& q : b.gathers) {
      if (q.p == nullptr) continue;  // read already
      q.work = r_.all_gather(q.out, q.in, Async::Yes, c_.dp);
      exposed_.communicated(Dim::Dp, q.work);
    }
  }
}

DataParallel::Gathered DataParallel::gather(Param& p) {
  if (c_.overlap_param_gather && c_.stage <= 2) {  // the previous step's update: its bucket's and the next
    issue_gathers(p.bucket);
    issue_gathers(p.bucket - 1);
    return {&p, p.copy, Work()};
  }
  if (c_.stage < 3 || !sharded()) return {&p, p.copy, Work()};
  Gathered g{&p, buffer(r_, c_.phantom, rows_shape(p.local, p.rows_padded), c_.dtype), Work()};
  if (c_.overlap_param_gather) {
    g.work = r_.all_gather(g.full, p.copy, Async::Yes, c_.dp);
    exposed_.communicated(Dim::Dp, g.work);
  } else {
    const Event e = exposed_.before();
    exposed_.after(Dim::Dp, e, r_.all_gather(g.full, p.copy, Async::No, c_.dp));
    g.full = unpad(p, g.full);
  }
  return g;
}

DataParallel::GatheredUnit DataParallel::gather(const std::vector<Param*>& ps) {
  GatheredUnit g;
  if (c_.stage < 3 || ps.empty() || ps[0]->unit < 0) {
    for (Param* p : ps) g.each.push_back(gather(*p));
    return g;
  }
  g.unit = ps[0]->unit;
  const Unit& u = units_[g.unit];
  if (ps != u.ps) throw Error("DataParallel::gather: not a unit's parameters in the unit's order");
  // Copy-in: this rank's shards one after another; the all_gather lays every rank's out in rank order.
  std::vector<Tensor> shards;
  for (Param* p : ps) shards.push_back(r_.view(p->copy, 0, Shape{p->copy.numel()}));
  g.in = r_.cat(shards, 0);
  g.flat = buffer(r_, c_.phantom, Shape{c_.dp_size, u.shard_elements}, c_.dtype);
  const Tensor out = r_.view(g.flat, 0, Shape{c_.dp_size * u.shard_elements});
  if (c_.overlap_param_gather) {
    g.work = r_.all_gather(out, g.in, Async::Yes, c_.dp);
    exposed_.communicated(Dim::Dp, g.work);
  } else {
    const Event e = exposed_.before();
    exposed_.after(Dim::Dp, e, r_.all_gather(out, g.in, Async::No, c_.dp));
  }
  return g;
}

std::vector<Tensor> DataParallel::get(GatheredUnit& g) {
  std::vector<Tensor> out;
  if (g.unit < 0) {
    for (Gathered& e : g.each) out.push_back(get(e));
    return out;
  }
  if (!g.work.waited()) exposed_.wait(Dim::Dp, g.work);
  // Copy-out: a parameter's rows are its shard's columns of every rank's row of the gathered buffer.
  const Unit& u = units_[g.unit];
  for (std::size_t k = 0; k < u.ps.size(); ++k) {
    const Param& p = *u.ps[k];
    const Tensor columns = r_.slice(g.flat, 1, u.offset[k], p.copy.numel());
    out.push_back(unpad(p, r_.view(columns, 0, rows_shape(p.local, p.rows_padded))));
  }
  g.in = g.flat = Tensor();
  return out;
}

Tensor DataParallel::get(Gathered& g) {
  Param& p = *g.p;
  if (c_.stage == 3) {
    if (!g.work.waited()) {
      exposed_.wait(Dim::Dp, g.work);
      g.full = unpad(p, g.full);
    }
    return g.full;
  }
  Bucket& b = buckets_[p.bucket];
  if (!b.gather.waited()) exposed_.wait(Dim::Dp, b.gather);
  for (Pending& q : b.gathers) {
    if (q.p != &p) continue;
    exposed_.wait(Dim::Dp, q.work);
    take_gathered(p, q.out);
    q = Pending{};
  }
  return p.copy;
}

Tensor DataParallel::wgrad_into(Param& p) const {
  if (!c_.grad_accum_fusion || !whole_grads()) return Tensor();
  const DType d = p.grad.dtype();
  return d == c_.dtype || d == DType::Float32 ? p.grad : Tensor();
}

void DataParallel::add_grad(Param& p, const Tensor& g) {
  if (!g.defined()) return;  // summed into p.grad by its GEMM (wgrad_into)
  if (whole_grads()) {
    r_.add_(p.grad, g, 1.0f);
    return;
  }
  Tensor t = pad(p, g.dtype() == c_.reduce_dtype ? g : r_.cast(g, c_.reduce_dtype));
  if (c_.broken == "no-reduce-scatter") {  // each rank keeps its own micro-batches' gradient
    r_.add_(p.grad, r_.slice(t, 0, c_.dp_rank * p.shard_rows, p.shard_rows), 1.0f);
    return;
  }
  if (p.unit >= 0) {  // reduced with its unit, once every gradient of the unit has come
    Unit& u = units_[p.unit];
    const auto k = std::find(u.ps.begin(), u.ps.end(), &p) - u.ps.begin();
    if (u.grads[k].defined()) throw Error(fmt::format("DataParallel::add_grad: {} twice", p.spec.name));
    u.grads[k] = t;
    if (++u.received == u.ps.size()) reduce_unit(u);
    return;
  }
  if (c_.overlap_grad_reduce) drain();  // one reduction in flight at a time (reduce_unit)
  Reduction q{{&p}, buffer(r_, c_.phantom, rows_shape(p.local, p.shard_rows), c_.reduce_dtype), t, Work()};
  q.work = r_.reduce_scatter(q.out, t, dp_op(), Async::Yes, c_.dp);
  exposed_.communicated(Dim::Dp, q.work);
  pending_.push_back(std::move(q));
  if (!c_.overlap_grad_reduce) drain();  // the plain schedule waits at once
}

void DataParallel::reduce_unit(Unit& u) {
  // With overlap_grad_reduce the previous reduction runs beside this unit's backward and is waited for
  // here, before this one's input is made: FSDP2 keeps one reduce-scatter in flight (its
  // reduce_scatter_state), so that the unsharded gradients waiting to be reduced stay one unit's worth.
  if (c_.overlap_grad_reduce) drain();
  // Row j of the input: every gradient's j-th shard in turn, so that rank j receives its shards' sums.
  std::vector<Tensor> parts;
  for (std::size_t k = 0; k < u.ps.size(); ++k) {
    parts.push_back(r_.view(u.grads[k], 0, Shape{c_.dp_size, u.ps[k]->grad.numel()}));
    u.grads[k] = Tensor();
  }
  u.received = 0;
  const Tensor in = r_.cat(parts, 1);
  Reduction q{u.ps, buffer(r_, c_.phantom, Shape{u.shard_elements}, c_.reduce_dtype), in, Work()};
  q.work = r_.reduce_scatter(q.out, r_.view(in, 0, Shape{c_.dp_size * u.shard_elements}), dp_op(), Async::Yes,
                             c_.dp);
  exposed_.communicated(Dim::Dp, q.work);
  pending_.push_back(std::move(q));
  if (!c_.overlap_grad_reduce) drain();
}

Tensor DataParallel::embedding_grad_target(Param& p) {
  if (whole_grads() && p.grad.dtype() == DType::Float32) return p.grad;
  return zeros(r_, c_.phantom, p.local, DType::Float32);
}

void DataParallel::embedding_grad_done(Param& p, const Tensor& target) {
  if (!target.same_storage(p.grad)) add_grad(p, target);
}

void DataParallel::drain() {
  for (Reduction& q : pending_) {
    exposed_.wait(Dim::Dp, q.work);
    std::int64_t at = 0;
    for (Param* p : q.ps) {
      r_.add_(p->grad, q.ps.size() == 1 ? q.out : r_.view(q.out, at, p->grad.shape()), 1.0f);
      at += p->grad.numel();
    }
  }
  pending_.clear();
}

void DataParallel::grads_ready(const std::vector<Param*>& ps) {
  if (!flat() || !sharded() || !c_.overlap_grad_reduce) return;
  for (Param* p : ps) {
    Bucket& b = buckets_[p->bucket];
    if (++b.ready == static_cast<int>(b.params.size())) issue_reduction(b);
  }
}

void DataParallel::finish(const std::vector<Param*>& ps) {
  if (flat()) {
    finish_flat(ps);
    return;
  }
  drain();
  for (const Unit& u : units_) {
    if (u.received != 0)
      throw Error("DataParallel::finish: a unit's backward gave only some of its gradients");
  }
  for (Param* p : ps) {
    if (partial_over_tp(*p) && c_.broken != "no-sp-grad-sync") {
      const Event e = exposed_.before();
      exposed_.after(Dim::Sp, e, r_.all_reduce(p->grad, ReduceOp::Sum, Async::No, c_.tp));
    }
    if (p->spec.tied && c_.embedding_group) {
      const Event e = exposed_.before();
      exposed_.after(Dim::Pp, e, r_.all_reduce(p->grad, ReduceOp::Sum, Async::No, c_.embedding));
    }
  }
}

double DataParallel::clip_grads(const std::vector<Param*>& ps, double max_norm, DataParallel* experts,
                                const std::vector<Param*>& expert_ps) {
  std::vector<Tensor> mine;
  auto add = [&](const DataParallel& dp, const std::vector<Param*>& params) {
    for (Param* p : params) {
      if (!dp.counts_once(*p)) continue;
      const Held h = dp.held(*p);
      mine.push_back(r_.view(h.grad, 0, Shape{h.count}));
    }
  };
  add(*this, ps);
  if (experts != nullptr) add(*experts, expert_ps);
  Tensor squares = r_.squared_norm(mine);
  r_.all_reduce(squares, ReduceOp::Sum);
  if (squares.phantom()) {
    r_.synchronize();  // the host waits to read it
    return 0;
  }
  const double norm = std::sqrt(static_cast<double>(r_.to_host(squares)[0]));
  const double coeff = max_norm / (norm + 1e-6);
  if (coeff >= 1) return norm;
  const float scale = static_cast<float>(coeff);
  scale_grads(ps, scale);
  if (experts != nullptr) experts->scale_grads(expert_ps, scale);
  return norm;
}

void DataParallel::scale_grads(const std::vector<Param*>& ps, float scale) {
  if (distributed_optimizer()) {
    for (Bucket& b : buckets_) r_.scale_(b.shard_grad, scale);
  } else if (flat()) {
    for (Bucket& b : buckets_) r_.scale_(b.grads, scale);
  } else {
    for (Param* p : ps) r_.scale_(p->grad, scale);
  }
}

void DataParallel::step(const std::vector<Param*>& ps, const AdamW& h, int t) {
  for (const Bucket& b : buckets_) {  // every one was read by this step's forward
    const bool unread = b.gather_due || std::any_of(b.gathers.begin(), b.gathers.end(),
                                                    [](const Pending& q) { return q.p != nullptr; });
    if (unread) throw Error("DataParallel::step: a bucket's weights were never gathered");
  }
  if (flat()) {
    step_flat(ps, h, t);
    return;
  }
  std::vector<Rank::AdamWPart> parts;
  for (Param* p : ps) parts.push_back({p->master, p->grad, p->m, p->v, p->spec.decay});
  r_.fused_adamw_step(parts, h, t);
  std::vector<Pending> gathers;
  for (Bucket& b : buckets_) b.gathers.clear();
  for (Param* p : ps) {
    if (c_.stage == 3 || !sharded()) {
      if (!p->copy.same_storage(p->master)) r_.copy_(p->copy, p->master);
      continue;
    }
    // zero 2: every rank updated its shard; an all_gather puts the 16-bit weights back together.
    Tensor mine = c_.dtype == DType::Float32 ? p->master : r_.cast(p->master, c_.dtype);
    Pending q{p, buffer(r_, c_.phantom, rows_shape(p->local, p->rows_padded), c_.dtype), mine, Work()};
    if (c_.overlap_param_gather) {  // started by the next step's forward (start_step, gather)
      buckets_[p->bucket].gathers.push_back(std::move(q));
      continue;
    }
    q.work = r_.all_gather(q.out, mine, Async::Yes, c_.dp);
    exposed_.communicated(Dim::Dp, q.work);
    gathers.push_back(std::move(q));
  }
  for (Pending& q : gathers) {
    exposed_.wait(Dim::Dp, q.work);
    take_gathered(*q.p, q.out);
  }
}

void DataParallel::finish_gathers() {
  next_gather_bucket_ = static_cast<int>(buckets_.size()) - 1;
  issue_gathers(0);
  for (Bucket& b : buckets_) {
    for (Param* p : b.params) {
      Gathered g{p, Tensor(), Work()};
      if (c_.stage != 3) get(g);
    }
    b.gathers.clear();
  }
}

void DataParallel::zero_grads(const std::vector<Param*>& ps) {
  if (flat()) {
    for (Bucket& b : buckets_) r_.scale_(b.grads, 0.0f);
    return;
  }
  for (Param* p : ps) r_.scale_(p->grad, 0.0f);
}

DataParallel::Held DataParallel::held(const Param& p) const {
  if (distributed_optimizer()) {
    const Bucket& b = buckets_[p.bucket];
    const InShard s = in_shard(p);  // (no elements at all on some ranks: then empty views, read alike)
    auto part = [&](const Tensor& t) { return r_.view(t, s.at, Shape{s.count}); };
    return {s.first, s.count, part(b.shard_grad), part(b.master), part(b.m), part(b.v)};
  }
  if (flat() || !sharded()) return {0, p.local.numel(), p.grad, p.master, p.m, p.v};
  const std::int64_t cols = p.local.numel() / p.rows;
  return {shard_first_row(p) * cols, shard_valid_rows(p) * cols, p.grad, p.master, p.m, p.v};
}

bool DataParallel::counts_once(const Param& p) const {
  if (p.spec.tp_dim < 0 && c_.tp_rank != 0) return false;
  if (p.spec.tied && c_.embedding_group && !c_.counts_tied) return false;
  return sharded_grads() || c_.dp_rank == 0;
}

// ---- zero 2 and 3: shards of rows --------------------------------------------------------------------

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
  return c_.dp_rank * p.shard_rows;
}
std::int64_t DataParallel::shard_valid_rows(const Param& p) const {
  return std::clamp<std::int64_t>(p.rows - shard_first_row(p), 0, p.shard_rows);
}

void DataParallel::take_gathered(Param& p, const Tensor& whole) {
  if (p.rows_padded == p.rows) {
    p.copy = whole;
  } else {
    r_.copy_(p.copy, unpad(p, whole));
  }
}

}  // namespace ranklab::parallel
