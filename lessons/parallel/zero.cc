#include "lessons/parallel/zero.h"

#include <algorithm>

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

std::int64_t default_bucket_params(int dp_size) {
  // Megatron-Core's DistributedDataParallelConfig.bucket_size default: larger data-parallel groups need
  // larger buckets for their collectives not to be bound by latency.
  return std::max<std::int64_t>(40'000'000, std::int64_t{1'000'000} * dp_size);
}

void DataParallel::set_buckets(const std::vector<Param*>& backward_order) {
  buckets_.clear();
  const std::int64_t limit = c_.bucket_params > 0 ? c_.bucket_params : default_bucket_params(c_.dp_size);
  std::int64_t numel = 0;
  for (Param* p : backward_order) {
    // The tied embedding on two stages gets a bucket of its own, as Megatron gives it: its gradient is
    // final only after the other stage's part is added.
    const bool alone = p->spec.tied && c_.embedding_group;
    if (buckets_.empty() || (c_.overlap_grad_reduce && (numel >= limit || alone))) {
      buckets_.emplace_back();
      numel = 0;
    }
    p->bucket = static_cast<int>(buckets_.size()) - 1;
    buckets_.back().params.push_back(p);
    numel += p->local.numel();
    if (alone) numel = limit;  // and nothing after it
  }
}

void DataParallel::start_step() {
  for (Bucket& b : buckets_) b.ready = 0, b.reducing = false;
  next_gather_bucket_ = static_cast<int>(buckets_.size()) - 1;
  if (!gathers_.empty()) issue_gathers(next_gather_bucket_);
}

void DataParallel::take_gathered(Param& p, const Tensor& whole) {
  if (p.rows_padded == p.rows) {
    p.copy = whole;
  } else {
    r_.copy_(p.copy, unpad(p, whole));
  }
}

void DataParallel::issue_gathers(int bucket) {
  // In forward order, every bucket up to this one: a forward that reaches a bucket early starts the ones
  // before it too, so no weight is read before its gather is issued.
  for (; next_gather_bucket_ >= std::max(bucket, 0); --next_gather_bucket_) {
    for (Param* p : buckets_[next_gather_bucket_].params) {
      if (p->gather_slot < 0) continue;
      Pending& q = gathers_[p->gather_slot];
      q.work = r_.all_gather(q.out, q.in, Async::Yes, c_.dp);
      exposed_.communicated(Dim::Dp, q.work);
    }
  }
}

DataParallel::Gathered DataParallel::gather(Param& p) {
  if (p.gather_slot >= 0) {  // zero 1, 2: the previous step's update, this bucket's and the next one's
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

Tensor DataParallel::get(Gathered& g) {
  Param& p = *g.p;
  if (p.gather_slot >= 0) {
    Pending& q = gathers_[p.gather_slot];
    exposed_.wait(Dim::Dp, q.work);
    take_gathered(p, q.out);
    p.gather_slot = -1;
    q = Pending{};
    g.full = p.copy;
  } else if (!g.work.waited()) {
    exposed_.wait(Dim::Dp, g.work);
    g.full = unpad(p, g.full);
  }
  return g.full;
}

void DataParallel::add_grad(Param& p, const Tensor& g) {
  if (c_.stage <= 1 || !sharded()) {
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
  exposed_.communicated(Dim::Dp, q.work);
  pending_.push_back(std::move(q));
  if (!c_.overlap_grad_reduce) drain();  // the plain schedule waits at once
}

Tensor DataParallel::embedding_grad_target(Param& p) {
  if (c_.stage <= 1 || !sharded()) return p.grad;
  return zeros(r_, c_.phantom, p.local, DType::Float32);
}

void DataParallel::embedding_grad_done(Param& p, const Tensor& target) {
  if (!target.same_storage(p.grad)) add_grad(p, target);
}

void DataParallel::drain() {
  for (Pending& q : pending_) {
    exposed_.wait(Dim::Dp, q.work);
    r_.add_(q.p->grad, q.out, 1.0f);
  }
  pending_.clear();
}

void DataParallel::grads_ready(const std::vector<Param*>& ps) {
  if (c_.stage >= 2 || !sharded() || !c_.overlap_grad_reduce) return;
  for (Param* p : ps) {
    Bucket& b = buckets_[p->bucket];
    if (++b.ready == static_cast<int>(b.params.size())) issue_reduction(b);
  }
}

void DataParallel::issue_reduction(Bucket& b) {
  b.reducing = true;
  for (Param* p : b.params) {
    Tensor t = c_.reduce_dtype == DType::Float32 ? p->grad : r_.cast(p->grad, c_.reduce_dtype);
    if (c_.stage == 0) {
      Work w = r_.all_reduce(t, dp_op(), Async::Yes, c_.dp);
      exposed_.communicated(Dim::Dp, w);
      reduces_.push_back({p, t, Tensor(), std::move(w)});
    } else {  // the distributed optimizer: each rank receives its shard's sum
      Tensor out = buffer(r_, c_.phantom, rows_shape(p->local, p->shard_rows), c_.reduce_dtype);
      Tensor in = pad(*p, t);
      Work w = r_.reduce_scatter(out, in, dp_op(), Async::Yes, c_.dp);
      exposed_.communicated(Dim::Dp, w);
      reduces_.push_back({p, out, in, std::move(w)});
    }
  }
}

void DataParallel::finish_reduction(Pending& q) {
  exposed_.wait(Dim::Dp, q.work);
  Param& p = *q.p;
  if (c_.stage == 0) {
    if (!q.out.same_storage(p.grad)) r_.copy_(p.grad, q.out);
  } else {
    p.reduced = q.out.dtype() == DType::Float32 ? q.out : r_.cast(q.out, DType::Float32);
  }
}

const Tensor& DataParallel::final_grad(const Param& p) const {
  return c_.stage == 1 && sharded() ? p.reduced : p.grad;
}

void DataParallel::finish(const std::vector<Param*>& ps) {
  drain();
  if (c_.stage <= 1 && sharded()) {
    for (Bucket& b : buckets_) {
      if (!b.reducing) issue_reduction(b);
    }
  }
  for (Pending& q : reduces_) finish_reduction(q);
  reduces_.clear();
  for (Param* p : ps) {
    const Tensor& g = final_grad(*p);
    if (p->spec.sp_partial && c_.seq_parallel && c_.tp_size > 1 && c_.broken != "no-sp-grad-sync") {
      const Event e = exposed_.before();
      exposed_.after(Dim::Sp, e, r_.all_reduce(g, ReduceOp::Sum, Async::No, c_.tp));
    }
    if (p->spec.tied && c_.embedding_group) {
      const Event e = exposed_.before();
      exposed_.after(Dim::Pp, e, r_.all_reduce(g, ReduceOp::Sum, Async::No, c_.embedding));
    }
  }
}

void DataParallel::step(const std::vector<Param*>& ps, const AdamW& h, int t) {
  for (Pending& q : gathers_) {  // every one was read by this step's forward
    if (q.p != nullptr)
      throw Error("DataParallel::step: " + q.p->spec.name + "'s weights were never gathered");
  }
  gathers_.clear();
  std::vector<Pending> gathers;
  for (Param* p : ps) {
    AdamW hp = h;
    if (!p->spec.decay) hp.weight_decay = 0;
    r_.adamw_step(p->master, final_grad(*p), p->m, p->v, hp, t);
    if (c_.stage == 0 || c_.stage == 3 || !sharded()) {
      if (!p->copy.same_storage(p->master)) r_.copy_(p->copy, p->master);
      continue;
    }
    // zero 1 and 2: every rank updated its shard; an all_gather puts the 16-bit weights back together.
    Tensor mine = c_.dtype == DType::Float32 ? p->master : r_.cast(p->master, c_.dtype);
    Pending q{p, buffer(r_, c_.phantom, rows_shape(p->local, p->rows_padded), c_.dtype), mine, Work()};
    if (c_.overlap_param_gather) {  // started by the next step's forward (start_step, gather)
      p->gather_slot = static_cast<int>(gathers_.size());
      gathers_.push_back(std::move(q));
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
  if (gathers_.empty()) return;
  next_gather_bucket_ = static_cast<int>(buckets_.size()) - 1;
  issue_gathers(0);
  for (Pending& q : gathers_) {
    if (q.p == nullptr) continue;
    Gathered g{q.p, Tensor(), Work()};
    get(g);
  }
  gathers_.clear();
}

void DataParallel::zero_grads(const std::vector<Param*>& ps) {
  for (Param* p : ps) r_.scale_(p->grad, 0.0f);
}

}  // namespace ranklab::parallel
