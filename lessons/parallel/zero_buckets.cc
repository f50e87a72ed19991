// Zero 0 and 1 as Megatron-LM lays them out: flat buckets of gradients (and, for the distributed
// optimizer, of weights), each reduced by one collective; zero.h says why.
#include <algorithm>
#include <numeric>

#include "lessons/parallel/zero.h"

namespace ranklab::parallel {

namespace {
std::int64_t round_up(std::int64_t n, std::int64_t divisor) {
  return (n + divisor - 1) / divisor * divisor;
}
}  // namespace

BucketLayout layout_buckets(const std::vector<LocalSize>& backward_order, const ZeroConfig& c) {
  const bool distributed_optimizer = c.stage == 1 && c.dp_size > 1;
  const std::int64_t limit = c.bucket_params > 0 ? c.bucket_params : default_bucket_params(c.dp_size);
  // The distributed optimizer's alignment (param_and_grad_buffer.py, _pad_start_of_param_if_needed and
  // _pad_end_of_bucket_if_needed): parameters start on 64 elements, buckets end on lcm(dp, 128).
  const std::int64_t param_align = distributed_optimizer ? 64 : 1;
  const std::int64_t bucket_align = distributed_optimizer ? std::lcm<std::int64_t>(c.dp_size, 128) : 1;
  BucketLayout l;
  std::int64_t at = 0;  // the next element of the open bucket
  bool open = false;
  auto close = [&] {
    l.elements.push_back(round_up(at, bucket_align));
    at = 0;
    open = false;
  };
  for (const LocalSize& s : backward_order) {
    const std::int64_t n = s.elements;
    // The tied embedding of a pipeline has a bucket of its own under the distributed optimizer, so that its
    // two stages shard it alike and its all-reduce over them can follow the reduce-scatter
    // (_does_param_require_new_bucket).
    const bool alone = distributed_optimizer && s.tied && c.embedding_group;
    if (open && alone) close();
    at = round_up(at, param_align);
    l.bucket.push_back(static_cast<int>(l.elements.size()));
    l.offset.push_back(at);
    at += n;
    open = true;
    // Without overlap_grad_reduce Megatron makes the bucket size unbounded: one bucket.
    if (alone || (c.overlap_grad_reduce && at >= limit)) close();
  }
  if (open) close();
  return l;
}

void DataParallel::make_buffers(Bucket& b) {
  b.grads = zeros(r_, c_.phantom, Shape{b.elements}, c_.reduce_dtype);
  if (!distributed_optimizer()) return;
  const std::int64_t shard = shard_elements(b);
  b.weights = zeros(r_, c_.phantom, Shape{b.elements}, c_.dtype);
  b.master = c_.dtype == DType::Float32 ? shard_of(b, b.weights)
                                        : zeros(r_, c_.phantom, Shape{shard}, DType::Float32);
  b.m = zeros(r_, c_.phantom, Shape{shard}, DType::Float32);
  b.v = zeros(r_, c_.phantom, Shape{shard}, DType::Float32);
}

DataParallel::InShard DataParallel::in_shard(const Param& p) const {
  const std::int64_t shard = shard_elements(buckets_[p.bucket]), first = c_.dp_rank * shard;
  const std::int64_t from = std::max(p.offset, first);
  const std::int64_t to = std::min(p.offset + p.local.numel(), first + shard);
  if (to <= from) return {};
  return {from - p.offset, to - from, from - first};
}

void DataParallel::init_flat(Param& p, const Tensor& local) {
  Bucket& b = buckets_[p.bucket];
  p.grad = r_.view(b.grads, p.offset, p.local);
  if (!distributed_optimizer()) {
    p.master = local;
    p.copy = c_.dtype == DType::Float32 ? local : r_.cast(local, c_.dtype);
    p.m = zeros(r_, c_.phantom, p.local, DType::Float32);
    p.v = zeros(r_, c_.phantom, p.local, DType::Float32);
    return;
  }
  p.copy = r_.view(b.weights, p.offset, p.local);
  r_.copy_(p.copy, local);
  // Once the bucket's weights are all made, the float32 master of this rank's shard starts from them, as
  // Megatron's distributed optimizer makes it (shard_model_param.clone().float()).
  if (++b.initialized == static_cast<int>(b.params.size()) && c_.dtype != DType::Float32) {
    r_.copy_(b.master, shard_of(b, b.weights));
  }
}

void DataParallel::issue_reduction(Bucket& b) {
  b.reducing = true;
  if (!sharded()) return;
  if (distributed_optimizer()) {  // each rank receives its shard's sum, in place
    b.reduction = r_.reduce_scatter(shard_of(b, b.grads), b.grads, dp_op(), Async::Yes, c_.dp);
  } else {
    b.reduction = r_.all_reduce(b.grads, dp_op(), Async::Yes, c_.dp);
  }
  exposed_.communicated(Dim::Dp, b.reduction);
}

void DataParallel::finish_flat(const std::vector<Param*>& ps) {
  for (Bucket& b : buckets_) {
    if (!b.reducing) issue_reduction(b);
  }
  for (Bucket& b : buckets_) {
    if (!b.reduction.waited()) exposed_.wait(Dim::Dp, b.reduction);
  }
  // Megatron's finalize_model_grads, after the data-parallel reduction: the sequence-parallel parameters'
  // gradients summed over tp in one all-reduce of them flattened (_allreduce_layernorm_grads; with them
  // QK-norm's gains, each tp rank's covering its own heads), then the tied embedding's over its two stages
  // (_allreduce_embedding_grads).
  if (c_.broken != "no-sp-grad-sync") {
    std::vector<Tensor> parts;
    for (Param* p : ps) {
      if (partial_over_tp(*p)) parts.push_back(r_.view(p->grad, 0, Shape{p->local.numel()}));
    }
    if (!parts.empty()) {
      Tensor together = r_.cat(parts, 0);
      const Event e = exposed_.before();
      exposed_.after(Dim::Sp, e, r_.all_reduce(together, ReduceOp::Sum, Async::No, c_.tp));
      std::int64_t at = 0;
      for (const Tensor& part : parts) {
        r_.copy_(part, r_.view(together, at, part.shape()));
        at += part.numel();
      }
    }
  }
  for (Param* p : ps) {
    if (!p->spec.tied || !c_.embedding_group) continue;
    const Event e = exposed_.before();
    exposed_.after(Dim::Pp, e, r_.all_reduce(p->grad, ReduceOp::Sum, Async::No, c_.embedding));
  }
  if (!distributed_optimizer()) return;
  for (Bucket& b : buckets_) {
    Tensor mine = shard_of(b, b.grads);
    b.shard_grad = c_.reduce_dtype == DType::Float32 ? mine : r_.cast(mine, DType::Float32);
  }
}

void DataParallel::step_flat(const std::vector<Param*>& ps, const AdamW& h, int t) {
  std::vector<Rank::AdamWPart> parts;
  if (!distributed_optimizer()) {
    for (Param* p : ps) {
      const Tensor g = p->grad.dtype() == DType::Float32 ? p->grad : r_.cast(p->grad, DType::Float32);
      parts.push_back({p->master, g, p->m, p->v, p->spec.decay});
    }
    r_.fused_adamw_step(parts, h, t);
    for (Param* p : ps) {
      if (!p->copy.same_storage(p->master)) r_.copy_(p->copy, p->master);
    }
    return;
  }
  // Each bucket's shard in parts: the pieces of its parameters, and the padding between them (zeros, which
  // stay zeros), so that every rank updates as many elements as the others.
  for (Bucket& b : buckets_) {
    std::int64_t at = 0;
    auto part = [&](std::int64_t count, bool decay) {
      auto piece = [&](const Tensor& x) { return r_.view(x, at, Shape{count}); };
      parts.push_back({piece(b.master), piece(b.shard_grad), piece(b.m), piece(b.v), decay});
      at += count;
    };
    for (Param* p : b.params) {  // in the order of their offsets
      const InShard s = in_shard(*p);
      if (s.count == 0) continue;
      if (s.at > at) part(s.at - at, false);
      part(s.count, p->spec.decay);
    }
    if (shard_elements(b) > at) part(shard_elements(b) - at, false);
  }
  r_.fused_adamw_step(parts, h, t);
  // Every rank updated its shard; an all_gather in place puts each bucket's weights back together.
  for (Bucket& b : buckets_) {
    Tensor mine = shard_of(b, b.weights);
    if (c_.dtype != DType::Float32) r_.copy_(mine, b.master);
    if (c_.overlap_param_gather) {  // started by the next step's forward (start_step, gather)
      b.gather_due = true;
      continue;
    }
    b.gather = r_.all_gather(b.weights, mine, Async::Yes, c_.dp);
    exposed_.communicated(Dim::Dp, b.gather);
  }
  for (Bucket& b : buckets_) {
    if (!b.gather.waited()) exposed_.wait(Dim::Dp, b.gather);
  }
}

}  // namespace ranklab::parallel
