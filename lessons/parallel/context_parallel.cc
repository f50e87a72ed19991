#include "lessons/parallel/context_parallel.h"

#include <limits>

namespace ranklab::parallel {

Rank::AttentionOut ContextParallel::attention(const Tensor& qkv, const AttentionSpec& spec) {
  return all_gather ? gathered_attention(qkv, spec) : ring_attention(qkv, spec);
}

Tensor ContextParallel::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                           const Tensor& lse, const AttentionSpec& spec) {
  return all_gather ? gathered_attention_backward(dout, qkv, out, lse, spec)
                    : ring_attention_backward(dout, qkv, out, lse, spec);
}

// ---- the ring ---------------------------------------------------------------------------------------------

namespace {
// The spec of the blocks: the sinks merge once, after them.
AttentionSpec without_sinks(AttentionSpec spec) {
  spec.sinks = Tensor();
  return spec;
}
}  // namespace

Rank::AttentionOut ContextParallel::ring_attention(const Tensor& qkv, const AttentionSpec& spec) {
  const std::int64_t chunk = qkv.size(0) / spec.batch / 2;
  const AttentionSpec blocks = without_sinks(spec);
  Tensor keys = r.key_values(qkv, spec);  // step 0: this rank's own
  Rank::AttentionOut acc = empty_result(qkv, spec);
  for (int s = 0; s < size; ++s) {
    // While this step's attention runs, the keys it uses travel on to the next rank.
    Tensor next;
    std::vector<Work> exchange;
    if (s + 1 < size) exchange = pass_on(keys, next);
    for (const RingBlock& b : ring_blocks((index - s + size) % size, chunk, spec))
      r.attention_block_(acc, qkv, block_keys(b, keys, chunk * spec.batch), blocks, b.block);
    for (Work& w : exchange) exposed.wait(Dim::Cp, w);
    if (s + 1 < size) keys = next;
  }
  if (spec.sinks.defined()) r.attention_sinks_(acc, spec);
  return {r.cast(acc.out, qkv.dtype()), acc.lse};
}

Tensor ContextParallel::ring_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                                const Tensor& lse, const AttentionSpec& spec) {
  const std::int64_t chunk = qkv.size(0) / spec.batch / 2;
  const AttentionSpec blocks = without_sinks(spec);
  Tensor dqkv = zeros(r, phantom, qkv.shape(), qkv.dtype());
  Tensor keys = r.key_values(qkv, spec);
  Tensor dkeys_in;  // what the ranks before added to the gradient of `keys`
  std::vector<Work> dkeys_exchange;
  std::vector<Tensor> sending;  // kept until their sends are done
  for (int s = 0; s < size; ++s) {
    Tensor next;
    std::vector<Work> exchange;
    if (s + 1 < size) exchange = pass_on(keys, next);
    Tensor dkeys = zeros(r, phantom, keys.shape(), keys.dtype());
    const std::int64_t chunk_rows = chunk * spec.batch;
    for (const RingBlock& b : ring_blocks((index - s + size) % size, chunk, spec)) {
      r.attention_block_backward_(dqkv, block_keys(b, dkeys, chunk_rows), dout, qkv,
                                  block_keys(b, keys, chunk_rows), out, lse, blocks, b.block);
    }
    if (s > 0) {
      for (Work& w : dkeys_exchange) exposed.wait(Dim::Cp, w);
      sending.clear();  // their sends are done
      r.add_(dkeys, dkeys_in, 1.0f);
    }
    // The sum goes to the rank that holds these keys next; after the last step, to their owner.
    dkeys_exchange = pass_on(dkeys, dkeys_in);
    sending.push_back(dkeys);
    for (Work& w : exchange) exposed.wait(Dim::Cp, w);
    if (s + 1 < size) keys = next;
  }
  for (Work& w : dkeys_exchange) exposed.wait(Dim::Cp, w);
  r.add_key_values_(dqkv, dkeys_in, spec);
  return dqkv;
}

std::vector<ContextParallel::RingBlock> ContextParallel::ring_blocks(int from, std::int64_t chunk,
                                                                     const AttentionSpec& spec) const {
  if (spec.window == 0) return {ring_block(from, chunk)};
  std::vector<RingBlock> out;
  for (int q_half : {0, 1}) {
    for (int k_half : {0, 1}) {
      const std::int64_t q = chunk_position(index, q_half, chunk), k = chunk_position(from, k_half, chunk);
      // Every key after the chunk's last query, or before its first query's window: nothing to see.
      if (k > q + chunk - 1 || k + chunk - 1 < q - spec.window + 1) continue;
      RingBlock b;
      b.block = Rank::AttentionBlock{q_half * chunk, chunk, true, q, k};
      b.key_chunk = k_half;
      out.push_back(b);
    }
  }
  return out;
}

ContextParallel::RingBlock ContextParallel::ring_block(int from, std::int64_t chunk) const {
  RingBlock b;
  if (broken == "cp-mask-every-block") {
    b.block.causal = true;
    return b;
  }
  if (from == index) {
    b.block.causal = true;  // this rank's own chunks: in order, so the mask is by local position
  } else if (from < index) {
    b.key_chunk = 0;  // chunk `from` is before both of this rank's; chunk 2 cp - 1 - from after
  } else {
    b.block.q_first = chunk;  // only this rank's later chunk comes after chunks `from` and its mirror
    b.block.q_count = chunk;
  }
  return b;
}

Tensor ContextParallel::block_keys(const RingBlock& b, const Tensor& t, std::int64_t chunk_rows) {
  if (b.key_chunk < 0) return t;
  return r.view(t, b.key_chunk * chunk_rows * t.size(1), t.shape().with_dim(0, chunk_rows));
}

std::vector<Work> ContextParallel::pass_on(const Tensor& send, Tensor& receive) {
  receive = buffer(r, phantom, send.shape(), send.dtype());
  // A shift around the ring is an all-to-all whose one non-empty piece goes to the next rank: the grouped
  // send and receive NCCL runs for it (TransformerEngine's batch_isend_irecv), as one call of the group,
  // which a symmetric simulation can mirror (every rank's piece goes one place on).
  std::vector<std::int64_t> sent(size, 0), received(size, 0);
  sent[(index + 1) % size] = send.size(0);
  received[(index + size - 1) % size] = receive.size(0);
  Work shift = r.all_to_all(receive, send, received, sent, Async::Yes, group);
  exposed.communicated(Dim::Cp, shift);
  return {shift};
}

Rank::AttentionOut ContextParallel::empty_result(const Tensor& qkv, const AttentionSpec& spec) {
  const std::int64_t head_dim = qkv.size(1) / (spec.heads + 2 * spec.groups());
  const Shape out{qkv.size(0), spec.heads * head_dim}, lse{spec.batch, spec.heads, qkv.size(0) / spec.batch};
  if (phantom) return {r.phantom(out, DType::Float32), r.phantom(lse, DType::Float32)};
  // float32, so that the merges round once, at the end.
  return {r.zeros(out, DType::Float32), r.full(lse, -std::numeric_limits<float>::infinity(), DType::Float32)};
}

// ---- all-gather -------------------------------------------------------------------------------------------

Rank::AttentionOut ContextParallel::gathered_attention(const Tensor& qkv, const AttentionSpec& spec) {
  const std::int64_t chunk = qkv.size(0) / spec.batch / 2, chunk_rows = chunk * spec.batch;
  const Tensor mine = r.key_values(qkv, spec);
  Tensor by_rank = buffer(r, phantom, mine.shape().with_dim(0, size * mine.size(0)), mine.dtype());
  const Event e = exposed.before();
  exposed.after(Dim::Cp, e, r.all_gather(by_rank, mine, Async::No, group));
  const Tensor keys = to_sequence_order(by_rank, chunk_rows);
  Rank::AttentionOut acc = empty_result(qkv, spec);
  // Each of this rank's chunks attends to the keys up to its end, with the causal mask.
  for (int half : {0, 1}) {
    const std::int64_t c = half == 0 ? index : 2 * size - 1 - index;
    const Rank::AttentionBlock block{half * chunk, chunk, true, c * chunk, 0};
    r.attention_block_(acc, qkv, r.view(keys, 0, keys.shape().with_dim(0, (c + 1) * chunk_rows)),
                       without_sinks(spec), block);
  }
  if (spec.sinks.defined()) r.attention_sinks_(acc, spec);
  return {r.cast(acc.out, qkv.dtype()), acc.lse};
}

Tensor ContextParallel::gathered_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                                    const Tensor& lse, const AttentionSpec& spec) {
  const std::int64_t chunk = qkv.size(0) / spec.batch / 2, chunk_rows = chunk * spec.batch;
  const Tensor mine = r.key_values(qkv, spec);
  Tensor by_rank = buffer(r, phantom, mine.shape().with_dim(0, size * mine.size(0)), mine.dtype());
  Event e = exposed.before();
  exposed.after(Dim::Cp, e, r.all_gather(by_rank, mine, Async::No, group));  // gathered again, not kept
  const Tensor keys = to_sequence_order(by_rank, chunk_rows);
  Tensor dkeys = zeros(r, phantom, keys.shape(), keys.dtype());
  Tensor dqkv = zeros(r, phantom, qkv.shape(), qkv.dtype());
  for (int half : {0, 1}) {
    const std::int64_t c = half == 0 ? index : 2 * size - 1 - index;
    const Rank::AttentionBlock block{half * chunk, chunk, true, c * chunk, 0};
    const Shape prefix = keys.shape().with_dim(0, (c + 1) * chunk_rows);
    r.attention_block_backward_(dqkv, r.view(dkeys, 0, prefix), dout, qkv, r.view(keys, 0, prefix), out, lse,
                                without_sinks(spec), block);
  }
  // Every rank's share of each rank's key gradients, summed at their owner.
  Tensor dmine = buffer(r, phantom, mine.shape(), mine.dtype());
  e = exposed.before();
  exposed.after(Dim::Cp, e,
                r.reduce_scatter(dmine, to_rank_order(dkeys, chunk_rows), ReduceOp::Sum, Async::No, group));
  r.add_key_values_(dqkv, dmine, spec);
  return dqkv;
}

Tensor ContextParallel::to_sequence_order(const Tensor& by_rank, std::int64_t chunk_rows) {
  const std::int64_t w = by_rank.size(1);
  std::vector<Tensor> parts;
  for (int c = 0; c < 2 * size; ++c) {
    const int owner = c < size ? c : 2 * size - 1 - c, half = c < size ? 0 : 1;
    parts.push_back(r.view(by_rank, (2 * owner + half) * chunk_rows * w, Shape{chunk_rows, w}));
  }
  return r.cat(parts, 0);
}

Tensor ContextParallel::to_rank_order(const Tensor& by_position, std::int64_t chunk_rows) {
  const std::int64_t w = by_position.size(1);
  std::vector<Tensor> parts;
  for (int owner = 0; owner < size; ++owner) {
    for (int c : {owner, 2 * size - 1 - owner}) {
      parts.push_back(r.view(by_position, c * chunk_rows * w, Shape{chunk_rows, w}));
    }
  }
  return r.cat(parts, 0);
}

}  // namespace ranklab::parallel
