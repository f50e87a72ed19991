// SimRank's kernels of context-parallel attention (Rank::key_values, add_key_values_, attention_block_ and
// its backward): the arithmetic of ring attention's blocks, in float32 as the fused kernels compute it,
// and their time from the compute model's fused attention with as many keys as the block has.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/compute_checks.h"
#include "common/errors.h"
#include "common/lse_merge.h"
#include "sim/sim_rank.h"
#include "sim/sim_rank_kernels.h"

namespace ranklab::sim {

using namespace kernels;

namespace {
const float* cdata(const Tensor& t) {
  return sim_data(t);
}
// Where an attention block's operands live: qkv [seq * batch, (heads + 2 groups) * head_dim] with each
// group's q heads, k and v; kv [kv_seq * batch, 2 groups * head_dim] with each group's k and v.
struct BlockDims {
  BlockDims(const Tensor& qkv, const Tensor& kv, const AttentionSpec& spec)
      : batch(spec.batch),
        heads(spec.heads),
        per_group(spec.heads / spec.groups()),
        head_dim(qkv.size(1) / (spec.heads + 2 * spec.groups())),
        width(qkv.size(1)),
        seq(qkv.size(0) / spec.batch),
        kv_seq(kv.size(0) / spec.batch),
        kv_width(kv.size(1)) {}
  std::int64_t batch, heads, per_group, head_dim, width, seq, kv_seq, kv_width;
  std::int64_t q_col(std::int64_t h) const {
    const std::int64_t group = h / per_group;
    return (group * (per_group + 2) + h % per_group) * head_dim;
  }
  // Group g's k (part 1) or v (part 2) in qkv, and in kv.
  std::int64_t qkv_col(std::int64_t g, int part) const {
    return (g * (per_group + 2) + per_group + part - 1) * head_dim;
  }
  std::int64_t kv_col(std::int64_t g, int part) const { return (2 * g + part - 1) * head_dim; }
  std::int64_t row(std::int64_t pos, std::int64_t b) const { return pos * batch + b; }
  // The keys [first, end) of kv that query `i` of the block sees: all of them, or with the causal mask
  // those up to its position, and with a window those within it.
  struct Keys {
    std::int64_t first = 0, end = 0;
    std::int64_t count() const { return end - first; }
  };
  Keys visible(const AttentionSpec& spec, const Rank::AttentionBlock& block, std::int64_t i) const {
    if (!block.causal) return {0, kv_seq};
    const std::int64_t q_pos = block.q_position + (i - block.q_first);
    const std::int64_t end = std::clamp<std::int64_t>(q_pos - block.kv_position + 1, 0, kv_seq);
    return {std::clamp<std::int64_t>(spec.first_key(q_pos) - block.kv_position, 0, end), end};
  }
  AttentionShape shape(const AttentionSpec& spec, const Rank::AttentionBlock& block,
                       std::int64_t queries) const {
    AttentionShape s{batch, queries, heads, head_dim, block.causal, 0.0f, spec.groups()};
    s.kv_seq = kv_seq;
    if (spec.window > 0) {
      s.window = spec.window;
      s.first_query_position = block.q_position - block.kv_position;
    }
    return s;
  }
};

}  // namespace

Tensor SimRank::key_values(const Tensor& qkv, const AttentionSpec& spec) {
  const char* op = "key_values";
  require(qkv, op, "qkv");
  check_float8_use(rank_, op, qkv, "qkv");
  const AttentionDims a = check_attention(rank_, op, qkv, spec);
  Tensor kv = allocate(Shape{qkv.size(0), 2 * spec.groups() * a.head_dim}, qkv.dtype(), qkv.phantom(), op);
  before_reading({&qkv}, op);
  if (!qkv.phantom()) {
    const BlockDims d(qkv, kv, spec);
    const float* QKV = cdata(qkv);
    float* KV = sim_data(kv);
    for (std::int64_t r = 0; r < qkv.size(0); ++r) {
      for (std::int64_t g = 0; g < spec.groups(); ++g) {
        for (int part : {1, 2}) {
          std::copy_n(QKV + r * d.width + d.qkv_col(g, part), d.head_dim,
                      KV + r * d.kv_width + d.kv_col(g, part));
        }
      }
    }
  }
  launch_kernel_cost(kKeyValues, world_.compute().memory_cost(2.0 * static_cast<double>(bytes_of(kv))));
  return kv;
}

void SimRank::add_key_values_(const Tensor& dqkv, const Tensor& dkv, const AttentionSpec& spec) {
  const char* op = "add_key_values_";
  require(dqkv, op, "dqkv");
  require(dkv, op, "dkv");
  check_float8_use(rank_, op, dqkv, "dqkv");
  check_key_values(rank_, op, dqkv, dkv, spec);
  require_shape(dkv, Shape{dqkv.size(0), dkv.size(1)}, op, "dkv");
  require_same_kind(op, dqkv, dkv);
  before_kernel({&dqkv}, op);
  before_reading({&dkv}, op);
  if (!dqkv.phantom()) {
    const BlockDims d(dqkv, dkv, spec);
    float* DQKV = sim_data(dqkv);
    const float* DKV = cdata(dkv);
    for (std::int64_t r = 0; r < dqkv.size(0); ++r) {
      for (std::int64_t g = 0; g < spec.groups(); ++g) {
        for (int part : {1, 2}) {
          float* to = DQKV + r * d.width + d.qkv_col(g, part);
          const float* from = DKV + r * d.kv_width + d.kv_col(g, part);
          for (std::int64_t i = 0; i < d.head_dim; ++i) to[i] += from[i];
        }
      }
    }
    round_to_dtype(dqkv);
  }
  // Reads dkv and the k and v columns of dqkv, writes those columns.
  launch_kernel_cost(kAddKeyValues, world_.compute().memory_cost(3.0 * static_cast<double>(bytes_of(dkv))));
}

void SimRank::attention_block_(AttentionOut& acc, const Tensor& qkv, const Tensor& kv,
                               const AttentionSpec& spec, const AttentionBlock& block) {
  const char* op = "attention_block_";
  require(qkv, op, "qkv");
  require(kv, op, "kv");
  require(acc.out, op, "out");
  require(acc.lse, op, "lse");
  check_float8_use(rank_, op, qkv, "qkv");
  const BlockRange range = check_attention_block(rank_, op, qkv, kv, acc.out, acc.lse, spec, block);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&kv, &acc.out, &acc.lse})
    require_same_kind(op, qkv, *t);
  const BlockDims d(qkv, kv, spec);
  before_kernel({&acc.out, &acc.lse}, op);
  before_reading({&qkv, &kv}, op);
  if (!qkv.phantom()) {
    const float *QKV = cdata(qkv), *KV = cdata(kv);
    float *OUT = sim_data(acc.out), *LSE = sim_data(acc.lse);
    const std::int64_t out_w = d.heads * d.head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
    std::vector<float> s(static_cast<size_t>(d.kv_seq)), o(static_cast<size_t>(d.head_dim));
    for (std::int64_t b = 0; b < d.batch; ++b) {
      for (std::int64_t h = 0; h < d.heads; ++h) {
        const std::int64_t g = h / d.per_group;
        for (std::int64_t i = range.first; i < range.end; ++i) {
          const BlockDims::Keys keys = d.visible(spec, block, i);
          if (keys.count() == 0)
            continue;  // every key of the block is after this query, or before its window
          const float* first = KV + d.row(keys.first, b) * d.kv_width;  // the first key's row
          const float block_lse = attend_query(
              QKV + d.row(i, b) * d.width + d.q_col(h), first + d.kv_col(g, 1), first + d.kv_col(g, 2),
              d.batch * d.kv_width, keys.count(), d.head_dim, scale, s.data(), o.data());
          // Merge with what earlier blocks gave this query: weights exp(lse_part - lse_total).
          float& lse = LSE[(b * d.heads + h) * d.seq + i];
          const LseMerge m = merge_lse(lse, block_lse);
          float* out = OUT + d.row(i, b) * out_w + h * d.head_dim;
          for (std::int64_t e = 0; e < d.head_dim; ++e) out[e] = m.keep * out[e] + m.add * o[e];
          lse = m.total;
        }
      }
    }
    round_to_dtype(acc.out);
  }
  const std::int64_t queries = range.end - range.first;
  launch_kernel_cost(kAttentionBlock,
                     world_.compute().attention_cost(d.shape(spec, block, queries), AttentionKernel::Flash,
                                                     false, qkv.dtype()));
  // The correction kernel reads the block's out and lse and the running ones, and writes the running ones.
  const double rows = static_cast<double>(queries * d.batch),
               cols = static_cast<double>(d.heads * d.head_dim);
  const double bytes =
      rows * cols * static_cast<double>(dtype_bytes(qkv.dtype()) + 2 * dtype_bytes(acc.out.dtype())) +
      3.0 * 4.0 * rows * static_cast<double>(d.heads);
  launch_kernel_cost(kAttentionMerge, world_.compute().memory_cost(bytes));
}

void SimRank::attention_block_backward_(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout,
                                        const Tensor& qkv, const Tensor& kv, const Tensor& out,
                                        const Tensor& lse, const AttentionSpec& spec,
                                        const AttentionBlock& block) {
  const char* op = "attention_block_backward_";
  for (auto [t, name] : {std::pair{&dqkv, "dqkv"},
                         {&dkv, "dkv"},
                         {&dout, "dout"},
                         {&qkv, "qkv"},
                         {&kv, "kv"},
                         {&out, "out"},
                         {&lse, "lse"}}) {
    require(*t, op, name);
  }
  check_float8_use(rank_, op, qkv, "qkv");
  const BlockRange range = check_attention_block(rank_, op, qkv, kv, out, lse, spec, block);
  require_shape(dqkv, qkv.shape(), op, "dqkv");
  require_shape(dkv, kv.shape(), op, "dkv");
  require_shape(dout, out.shape(), op, "dout");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dqkv, &dkv, &dout, &kv, &out, &lse})
    require_same_kind(op, qkv, *t);
  const BlockDims d(qkv, kv, spec);
  before_kernel({&dqkv, &dkv}, op);
  before_reading({&dout, &qkv, &kv, &out, &lse}, op);
  if (!qkv.phantom()) {
    const float *QKV = cdata(qkv), *KV = cdata(kv), *OUT = cdata(out), *DOUT = cdata(dout), *LSE = cdata(lse);
    float *DQKV = sim_data(dqkv), *DKV = sim_data(dkv);
    const std::int64_t out_w = d.heads * d.head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
    for (std::int64_t b = 0; b < d.batch; ++b) {
      for (std::int64_t h = 0; h < d.heads; ++h) {
        const std::int64_t g = h / d.per_group;
        for (std::int64_t i = range.first; i < range.end; ++i) {
          const float* q = QKV + d.row(i, b) * d.width + d.q_col(h);
          const float* o_i = OUT + d.row(i, b) * out_w + h * d.head_dim;
          const float* do_i = DOUT + d.row(i, b) * out_w + h * d.head_dim;
          float* dq = DQKV + d.row(i, b) * d.width + d.q_col(h);
          const float lse_i = LSE[(b * d.heads + h) * d.seq + i];
          float delta = 0;  // D_i = dout_i . out_i (FlashAttention-2, Algorithm 2), of the final out
          for (std::int64_t e = 0; e < d.head_dim; ++e) delta += do_i[e] * o_i[e];
          const BlockDims::Keys keys = d.visible(spec, block, i);
          const float* first = KV + d.row(keys.first, b) * d.kv_width;  // the first key's row
          float* dfirst = DKV + d.row(keys.first, b) * d.kv_width;
          attend_query_backward(q, first + d.kv_col(g, 1), first + d.kv_col(g, 2), dfirst + d.kv_col(g, 1),
                                dfirst + d.kv_col(g, 2), d.batch * d.kv_width, keys.count(), d.head_dim,
                                scale, do_i, lse_i, delta, dq);
        }
      }
    }
    round_to_dtype(dqkv);
    round_to_dtype(dkv);
  }
  const std::int64_t queries = range.end - range.first;
  launch_kernel_cost(kAttentionBlockBackward,
                     world_.compute().attention_cost(d.shape(spec, block, queries), AttentionKernel::Flash,
                                                     true, qkv.dtype()));
  // The block's d q, d k and d v add into the running ones: read both, write the running ones.
  const double q_bytes =
      static_cast<double>(queries * d.batch * d.heads * d.head_dim * dtype_bytes(dqkv.dtype()));
  launch_kernel_cost(kAttentionMerge,
                     world_.compute().memory_cost(3.0 * (q_bytes + static_cast<double>(bytes_of(dkv)))));
}

void SimRank::attention_sinks_(AttentionOut& acc, const AttentionSpec& spec) {
  const char* op = "attention_sinks_";
  require(acc.out, op, "out");
  require(acc.lse, op, "lse");
  check_attention_sinks(rank_, op, acc.out, acc.lse, spec);
  require_same_kind(op, acc.out, acc.lse);
  require_same_kind(op, acc.out, spec.sinks);
  before_kernel({&acc.out, &acc.lse}, op);
  before_reading({&spec.sinks}, op);
  const std::int64_t seq = acc.lse.size(2), batch = spec.batch, heads = spec.heads;
  const std::int64_t head_dim = acc.out.size(1) / heads;
  if (!acc.out.phantom()) {
    const float* SINKS = cdata(spec.sinks);
    float *OUT = sim_data(acc.out), *LSE = sim_data(acc.lse);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t i = 0; i < seq; ++i) {
          // The sink is a block of one key whose value is zero: it adds to the total, not to out.
          float& lse = LSE[(b * heads + h) * seq + i];
          const LseMerge m = merge_lse(lse, SINKS[h]);
          float* out = OUT + (i * batch + b) * heads * head_dim + h * head_dim;
          for (std::int64_t e = 0; e < head_dim; ++e) out[e] *= m.keep;
          lse = m.total;
        }
      }
    }
    round_to_dtype(acc.out);
  }
  // Reads and writes out and lse.
  launch_kernel_cost(kAttentionSinks, world_.compute().memory_cost(
                                          2.0 * static_cast<double>(bytes_of(acc.out) + bytes_of(acc.lse))));
}

Tensor SimRank::attention_sinks_backward(const Tensor& dout, const Tensor& out, const Tensor& lse,
                                         const AttentionSpec& spec) {
  const char* op = "attention_sinks_backward";
  require(dout, op, "dout");
  require(out, op, "out");
  require(lse, op, "lse");
  check_attention_sinks(rank_, op, out, lse, spec);
  require_shape(dout, out.shape(), op, "dout");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &lse, &spec.sinks})
    require_same_kind(op, out, *t);
  const std::int64_t seq = lse.size(2), batch = spec.batch, heads = spec.heads;
  const std::int64_t head_dim = out.size(1) / heads;
  Tensor dsinks = allocate(Shape{heads}, DType::Float32, out.phantom(), op);
  before_kernel({}, op);
  before_reading({&dout, &out, &lse, &spec.sinks}, op);
  if (!out.phantom()) {
    const float *SINKS = cdata(spec.sinks), *OUT = cdata(out), *DOUT = cdata(dout), *LSE = cdata(lse);
    float* DS = sim_data(dsinks);
    for (std::int64_t h = 0; h < heads; ++h) {
      float sum = 0;
      for (std::int64_t b = 0; b < batch; ++b) {
        for (std::int64_t i = 0; i < seq; ++i) {
          const std::int64_t at = (i * batch + b) * heads * head_dim + h * head_dim;
          float delta = 0;  // dout . out
          for (std::int64_t e = 0; e < head_dim; ++e) delta += DOUT[at + e] * OUT[at + e];
          sum -= std::exp(SINKS[h] - LSE[(b * heads + h) * seq + i]) * delta;
        }
      }
      DS[h] = sum;
    }
  }
  // Reads dout, out and lse.
  launch_kernel_cost(
      kAttentionSinksBackward,
      world_.compute().memory_cost(static_cast<double>(bytes_of(dout) + bytes_of(out) + bytes_of(lse))));
  return dsinks;
}

}  // namespace ranklab::sim
