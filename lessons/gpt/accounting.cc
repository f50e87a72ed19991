#include "lessons/gpt/accounting.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "common/errors.h"
#include "common/tensor.h"
#include "lessons/gpt/model.h"
#include "lessons/parallel/pipeline.h"
#include "lessons/parallel/zero.h"

namespace ranklab::gpt {

namespace {
// Per token, forward: a MoE layer's router (2 h E) and its top-k experts' GEMMs, less the dense MLP's that it
// replaces (2 FLOPs per weight each).
double moe_extra_flops_per_token(const Config& c) {
  if (!c.moe()) return 0;
  const double h = c.hidden, mats = c.llama() ? 3 : 2;
  const double dense = c.llama() ? 3 * h * static_cast<double>(c.ffn()) : 8 * h * h;
  const double shared = 3 * h * static_cast<double>(c.shared_experts * c.moe_ffn());
  return 2 * (h * c.experts + c.top_k * mats * h * static_cast<double>(c.moe_ffn()) + shared - dense);
}
}  // namespace

Flops step_flops(const Config& c) {
  Flops f = dense_step_flops(c);
  // Forward and backward (three times the forward), and the forward again with full recomputation.
  const double moe =
      static_cast<double>(c.global_batch) * c.seq * c.moe_layer_count() * moe_extra_flops_per_token(c);
  f.model += 3 * moe;
  f.hardware += (c.recompute == Recompute::Full ? 4 : 3) * moe;
  return f;
}

namespace {
// The keys a token's attention counts per layer, averaged over the layers: the sequence's, counted whole as
// Megatron counts them (not halved by the mask), or in a layer with a sliding window the window's.
double keys_per_layer(const Config& c) {
  double keys = 0;
  for (int layer = 0; layer < c.layers; ++layer) {
    const std::int64_t w = c.window(layer);
    keys += static_cast<double>(w > 0 ? std::min<std::int64_t>(w, c.seq) : c.seq);
  }
  return keys / c.layers;
}
}  // namespace

Flops dense_step_flops(const Config& c) {
  const double B = static_cast<double>(c.global_batch), s = c.seq, L = c.layers, h = c.hidden,
               V = static_cast<double>(c.vocab);
  Flops f;
  if (c.llama()) {
    // Per token and layer, forward: 2 FLOPs per weight of wqkv (h x (a + 2 g) d), wo (a d x h) and the
    // three SwiGLU matrices (3 h f), and attention's two products over s keys (4 s a d = 4 s h, counted
    // whole as for GPT); the output layer 2 h V. Backward twice the forward.
    // A layer with a sliding window counts its window's keys (keys_per_layer).
    const double d = c.head_dim(), a = c.heads, g = c.kv(), ffn = static_cast<double>(c.ffn());
    const double linear = 2 * (h * (a + 2 * g) * d + a * d * h + 3 * h * ffn);
    const double attention = 4 * keys_per_layer(c) * a * d;  // per token and layer, on average
    const double layer = linear + attention;
    f.model = 3 * B * s * (L * layer + 2 * h * V);
    f.hardware = f.model;
    if (c.recompute == Recompute::Full) f.hardware += B * s * L * layer;
    if (c.recompute == Recompute::Selective) f.hardware += B * s * L * attention;
    return f;
  }
  if (c.sliding_window > 0) {
    const double keys = keys_per_layer(c);
    f.model = 72.0 * B * s * L * h * h * (1 + keys / (6 * h) + V / (12 * h * L));
    f.hardware = f.model;
    if (c.recompute == Recompute::Full) f.hardware += B * s * L * h * h * (24 + 4 * keys / h);
    if (c.recompute == Recompute::Selective) f.hardware += 4.0 * B * s * keys * h * L;
    return f;
  }
  f.model = 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L));
  f.hardware = f.model;
  if (c.recompute == Recompute::Full) f.hardware += B * s * L * h * h * (24 + 4 * s / h);
  if (c.recompute == Recompute::Selective) f.hardware += 4.0 * B * s * s * h * L;
  return f;
}

std::string MemoryPlan::largest() const {
  const std::pair<std::int64_t, const char*> parts[] = {
      {weights, "weights (16-bit copies and float32 masters)"},
      {grads, "gradients (float32)"},
      {optimizer, "optimizer state (Adam's m and v, float32)"},
      {fp8_weights, "FP8 weight copies"},
      {fp8_scaling, "FP8 amax histories"},
      {activations, "activations"}};
  const auto* big = std::max_element(std::begin(parts), std::end(parts),
                                     [](const auto& a, const auto& b) { return a.first < b.first; });
  return fmt::format("{} {}", big->second, format_bytes(static_cast<double>(big->first)));
}

parallel::ZeroConfig zero_config(const Config& c) {
  parallel::ZeroConfig z;
  z.stage = c.zero;
  z.dtype = c.dtype;
  z.reduce_dtype = c.reduce_dtype;
  z.phantom = c.phantom;
  z.tp_size = c.tp;
  z.dp_size = c.dp * c.cp;  // the gradients and ZeRO's shards spread over dp x cp (Groups::dp_cp)
  z.seq_parallel = c.seq_parallel;
  z.embedding_group = c.pp > 1;  // the first and last stages add up the shared embedding's gradient
  z.broken = c.broken;
  z.overlap_grad_reduce = c.overlap_grad_reduce;
  z.overlap_param_gather = c.overlap_param_gather;
  z.grad_accum_fusion = c.grad_accum_fusion;
  z.bucket_params = c.bucket_params;
  return z;
}

parallel::ZeroConfig expert_zero_config(const Config& c) {
  parallel::ZeroConfig z = zero_config(c);
  z.tp_size = c.etp;
  z.dp_size = c.tp * c.cp * c.dp / (c.ep * c.etp);
  z.seq_parallel = false;
  z.embedding_group = false;
  return z;
}

namespace {
std::vector<parallel::LocalSize> local_sizes(const std::vector<ParamId>& ids, const Config& c) {
  std::vector<parallel::LocalSize> sizes;
  sizes.reserve(ids.size());
  for (ParamId id : ids) sizes.push_back(parallel::local_size(param_spec(c, id, false), c.tp));
  return sizes;
}
}  // namespace

parallel::DataParallel::Bytes dense_state_bytes(const Config& c, int stage) {
  return parallel::DataParallel::bytes(local_sizes(backward_order(c, stage), c), zero_config(c));
}

parallel::DataParallel::Bytes expert_state_bytes(const Config& c, int stage) {
  if (!c.moe()) return {};
  // The experts of ep rank 0: every ep rank holds as many, of the same shapes. Every expert's input weight
  // has one size, and every output weight another: two specs stand for the thousands of a large MoE, each
  // split over etp.
  auto size_of = [&](int kind) { return parallel::local_size(param_spec(c, {kind, 0}, false), c.etp); };
  const parallel::LocalSize input = size_of(expert_kind(0, 0)), output = size_of(expert_kind(0, 1));
  parallel::LocalSize bias_in{}, bias_out{};
  if (c.add_bias_linear)
    bias_in = size_of(expert_bias_kind(c, 0, 0)), bias_out = size_of(expert_bias_kind(c, 0, 1));
  const std::vector<ParamId> ids = expert_backward_order(c, stage, 0);
  std::vector<parallel::LocalSize> sizes;
  sizes.reserve(ids.size());
  for (ParamId id : ids) {
    if (is_expert_bias_kind(c, id.kind)) {
      sizes.push_back(expert_bias(c, id.kind).which == 0 ? bias_in : bias_out);
    } else {
      sizes.push_back(expert_weight(id.kind).which == 0 ? input : output);
    }
  }
  return parallel::DataParallel::bytes(sizes, expert_zero_config(c));
}

parallel::DataParallel::Bytes state_bytes(const Config& c, int stage) {
  parallel::DataParallel::Bytes b = dense_state_bytes(c, stage);
  return b += expert_state_bytes(c, stage);
}

MemoryPlan memory_plan(const Config& c, int stage) {
  return memory_plan(c, stage, state_bytes(c, stage));
}

MemoryPlan memory_plan(const Config& c, int stage, const parallel::DataParallel::Bytes& state) {
  MemoryPlan p;
  p.weights = state.weights;
  p.grads = state.grads;
  p.optimizer = state.optimizer;
  bool embedding = false, head = false;
  std::vector<std::int64_t> stash(c.v);
  for (int k = 0; k < c.v; ++k) {
    const int vs = k * c.pp + stage;
    const bool e = vs == 0, hd = vs == c.pp * c.v - 1;
    embedding = embedding || e;
    head = head || hd;
    stash[k] = stash_bytes(c, c.chunk_layers(vs), e, hd, c.chunk_first_layer(vs));
  }
  // The most activations alive at once, walking this rank's schedule (as far as its first steady period,
  // which reaches the most).
  const std::vector<parallel::Task> order =
      parallel::schedule_through_first_period(c.pp, stage, c.v, static_cast<int>(c.micro_batches()));
  std::int64_t alive = 0;
  std::vector<int> count(c.v, 0);
  for (const parallel::Task& t : order) {
    alive += (t.forward ? 1 : -1) * stash[t.chunk];
    count[t.chunk] += t.forward ? 1 : -1;
    if (alive > p.stash) {
      p.stash = alive;
      p.most_alive = *std::max_element(count.begin(), count.end());
    }
  }
  // The data: token ids and targets of every micro-batch, the positions, the loss.
  const std::int64_t m = c.micro_batches(), r = c.rows(), lr = c.local_rows();
  // (The llama block looks up no positions: its blocks rotate q and k.)
  const std::int64_t positions = c.llama() ? 0 : lr * 4;
  std::int64_t data = (embedding ? m * r * 4 + positions : 0) + (head ? m * r * 4 + 4 : 0);
  // Temporaries of one task: a block's whole forward (what recomputation rebuilds) and its gradients of the
  // widest layer; the output layer's logits' gradient and the embedding's. Zero 2 and 3 with dp > 1 hold a
  // block's gradients until its unit is reduced, and the reduction's input laid out rank by rank; zero 3
  // the block's gathered weights, the all_gather's buffer they are copied out of, and the next block's
  // buffer, in flight (parallel/zero.h).
  const std::int64_t dt = dtype_bytes(c.dtype), h = c.hidden, hl = h / c.tp;
  std::int64_t block_elements = 0;
  for (int q = 0; q < block_params(c); ++q) {
    if (!has_block_param(c, q)) continue;
    block_elements += parallel::local_shape(block_spec(c, 0, q, false), c.tp).numel();
  }
  // FP8: each linear layer's weight copies and its scaling state, for a layer with its dense MLP and for a
  // MoE layer (its shared experts' MLP, and each local expert's two linear layers, split over etp); the
  // layers of a kind all have one shape.
  struct LayerFp8 {
    std::int64_t bytes = 0, linears = 0;
  };
  auto layer_fp8 = [&](bool moe) {
    LayerFp8 f;
    if (c.fp8 == parallel::Fp8Recipe::None) return f;
    int layer = 0;  // the first of the kind
    while (layer + 1 < c.layers && c.moe_layer(layer) != moe) ++layer;
    for (int q = 0; q < block_params(c); ++q) {
      const parallel::ParamSpec spec = block_spec(c, layer, q, false);
      const Shape local = parallel::local_shape(spec, c.tp);
      if (spec.full.ndim() != 2 || local.numel() == 0) continue;
      if (is_mlp_param(c, q) && !c.has_dense_mlp(layer)) continue;  // a MoE layer has experts instead
      f.bytes += parallel::fp8_weight_bytes(c.fp8, local, c.fp8_any_layout);
      ++f.linears;
    }
    if (moe) {
      for (int which : {0, 1}) {
        const Shape local = parallel::local_shape(param_spec(c, {expert_kind(0, which), 0}, false), c.etp);
        f.bytes += c.local_experts() * parallel::fp8_weight_bytes(c.fp8, local, c.fp8_any_layout);
      }
      f.linears += 2 * c.local_experts();
    }
    return f;
  };
  const bool all_moe = c.moe_layer_count() == c.layers;
  const LayerFp8 dense_fp8 = all_moe ? LayerFp8{} : layer_fp8(false),
                 moe_fp8 = c.moe() ? layer_fp8(true) : LayerFp8{};
  // The largest layer's copies, gathered one block at a time under zero 3.
  const std::int64_t block_fp8 = std::max(dense_fp8.bytes, moe_fp8.bytes);
  for (int k = 0; k < c.v; ++k) {
    const int vs = k * c.pp + stage, first = c.chunk_first_layer(vs), layers = c.chunk_layers(vs);
    const std::int64_t moe = c.moe_layer_count(first, layers), dense = layers - moe;
    if (c.zero < 3) p.fp8_weights += dense * dense_fp8.bytes + moe * moe_fp8.bytes;
    p.fp8_scaling += parallel::fp8_scaling_bytes(c.fp8, dense * dense_fp8.linears + moe * moe_fp8.linears);
  }
  const bool units = c.zero >= 2 && c.dp * c.cp > 1;
  Config none = c;
  none.recompute = Recompute::None;
  std::int64_t block = stash_bytes(none, 1, false, false) + 3 * r * 4 * hl * dt + 4 * h * hl * (dt + 4);
  std::int64_t out = head ? r * (c.vocab / c.tp) * dt + (c.vocab / c.tp) * h * (dt + 8) + 2 * r * h * dt : 0;
  std::int64_t emb = embedding ? (c.zero >= 2 ? (c.vocab / c.tp) * h * 8 : 0) + 2 * r * h * dt : 0;
  if (units) block += 2 * block_elements * dtype_bytes(c.reduce_dtype);
  if (c.moe()) {
    // A MoE layer's dispatch: the router's logits, and the routed rows before and after each all-to-all.
    const std::int64_t routes = c.local_rows() * c.top_k;
    block += c.local_rows() * c.experts * dt + 4 * routes * h * dt;
  }
  if (c.cp > 1) {
    // Context parallelism's attention: the float32 output it merges into, and the keys and values (with
    // their gradients in the backward) of this rank, of the block at hand and of the next; all-gather holds
    // every rank's, twice (in rank order and in sequence order), and their gradients.
    const std::int64_t heads = c.heads / c.tp, kv_row = 2 * (c.kv() / c.tp) * c.head_dim() * dt;
    const std::int64_t held = c.cp_comm == CpComm::AllGather ? 4 * c.cp * r * kv_row : 5 * r * kv_row;
    block += r * heads * c.head_dim() * 4 + held;
  }
  p.transient = std::max({block, out, emb}) + (c.zero == 3 && units ? 3 * block_elements * dt : 0) +
                (c.zero == 3 ? block_fp8 : 0);
  p.activations = p.stash + data + p.transient;
  return p;
}

std::vector<MemoryPlan> memory_plans(const Config& c) {
  std::vector<MemoryPlan> plans;
  for (int s = 0; s < c.pp; ++s) plans.push_back(memory_plan(c, s));
  return plans;
}

void check_fits(const Config& c, const std::vector<MemoryPlan>& plans, std::int64_t capacity_bytes) {
  int worst_stage = 0;  // the first of those that need the most
  for (int s = 0; s < c.pp; ++s)
    if (plans[s].total() > plans[worst_stage].total()) worst_stage = s;
  const MemoryPlan& worst = plans[worst_stage];
  if (worst.total() <= capacity_bytes) return;
  throw OutOfMemoryError(
      fmt::format("gpt: out of memory: pipeline stage {} needs {} per GPU and the device holds {}; the "
                  "largest part is {}. "
                  "To fit: {}",
                  worst_stage, format_bytes(worst.total()), format_bytes(capacity_bytes), worst.largest(),
                  memory_advice(c, worst)));
}

std::string memory_advice(const Config& c, const MemoryPlan& p) {
  std::vector<std::string> ways;
  const std::int64_t largest = std::max({p.weights, p.grads, p.optimizer, p.activations});
  if (largest == p.activations) {
    if (c.recompute != Recompute::Full) ways.push_back("--recompute full (keeps only each block's input)");
    if (c.micro_batch > 1) ways.push_back("a smaller --micro-batch");
    if (!c.seq_parallel && c.tp > 1)
      ways.push_back("--seq-parallel (activations between the pairs split by tp)");
    // Context parallelism splits every activation by the sequence (the flash kernels keep no s x s scores).
    if (c.attention == AttentionKernel::Flash && c.dropout == 0 && c.seq % (4 * std::int64_t{c.cp}) == 0)
      ways.push_back(fmt::format("--cp {} (each rank holds 1/cp of every sequence)", 2 * c.cp));
    ways.push_back("more --tp or --pp");
  } else {
    if (c.zero < 3 && c.dp * c.cp > 1) {
      ways.push_back(fmt::format("--zero {} (shards {} over the {} data-parallel ranks)", c.zero + 1,
                                 c.zero == 0   ? "the optimizer state"
                                 : c.zero == 1 ? "the gradients"
                                               : "the weights",
                                 c.dp * c.cp));
    }
    ways.push_back("more --tp or --pp (each rank holds fewer layers or less of each)");
  }
  return fmt::format("{}", fmt::join(ways, "; or "));
}

}  // namespace ranklab::gpt
