#include "lessons/gpt/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/random.h"

namespace ranklab::gpt {

using parallel::Param;
using parallel::ParamSpec;

namespace {
constexpr std::uint64_t kSeed = 0x67707400;  // "gpt"
constexpr float kStd = 0.02f;                // GPT-2's initialisation
constexpr float kEps = 1e-5f;                // layernorm
std::string layer_name(int layer, const char* what) {
  return "layer " + std::to_string(layer) + " " + what;
}

// A block's two kinds of linear layer. A column-parallel one splits its output features over tp, its bias
// with them. A row-parallel one splits its input features and writes into the residual stream, which GPT-2
// keeps from growing with depth by starting those weights smaller, by 1/sqrt(2 L).
void column_parallel(ParamSpec& s, Shape full) {
  s.full = std::move(full);
  s.tp_dim = 1;
  s.std = kStd;
}
void column_parallel_bias(ParamSpec& s, std::int64_t features) {
  s.full = Shape{features};
  s.tp_dim = 0;
  s.decay = false;
}
void row_parallel(ParamSpec& s, Shape full, const Config& c) {
  s.full = std::move(full);
  s.tp_dim = 0;
  s.std = kStd / std::sqrt(2.0f * static_cast<float>(c.layers));
}
// A vector per hidden feature (a norm's gain or shift, the bias after a row-parallel layer): every tp rank
// holds all of it and, under sequence parallelism, sees the gradient of its own tokens only.
void per_feature(ParamSpec& s, const Config& c, float value) {
  s.full = Shape{c.hidden};
  s.decay = false;
  s.sp_partial = true;
  s.value = value;
}
}  // namespace

int block_params(const Config& c) {
  return c.llama() ? int{kLlamaParams} : int{kBlockParams};
}

bool has_block_param(const Config& c, int which) {
  if (!c.llama()) return true;
  if (which == kQNorm || which == kKNorm) return c.qk_layernorm;
  if (which == kSinks) return c.attention_sinks;
  if (which == kBqkv) return c.add_qkv_bias || c.add_bias_linear;
  if (which == kBo || which == kB13 || which == kB2) return c.add_bias_linear;
  return true;
}

bool has_block_param(const Config& c, int layer, int which) {
  return has_block_param(c, which) && (!is_mlp_param(c, which) || c.has_dense_mlp(layer));
}

namespace {
ParamSpec llama_spec(const Config& c, int layer, LlamaParam which, bool named) {
  static const char* names[kLlamaParams] = {"norm1",   "wqkv",     "wo",     "norm2", "w13",
                                            "w2",      "q norm",   "k norm", "sinks", "wqkv bias",
                                            "wo bias", "w13 bias", "w2 bias"};
  const std::int64_t h = c.hidden, hd = c.head_dim(), f = c.dense_ffn(layer);
  ParamSpec s;
  if (named) s.name = layer_name(layer, names[which]);
  s.seed = kSeed + 64 * static_cast<std::uint64_t>(layer) + 32 + which;
  switch (which) {
    case kNorm1:
    case kNorm2:
      per_feature(s, c, 1.0f);
      break;
    case kWqkv:
      column_parallel(s, Shape{h, (c.heads + 2 * std::int64_t{c.kv()}) * hd});
      break;
    case kWo:
      row_parallel(s, Shape{c.heads * hd, h}, c);
      break;
    case kW13:
      column_parallel(s, Shape{h, 2 * f});
      break;
    case kW2:
      row_parallel(s, Shape{f, h}, c);
      break;
    case kQNorm:
    case kKNorm:
      // One gain per feature of a head, shared by the heads: each tp rank holds it whole and sees the
      // gradient of its own heads.
      s.full = Shape{hd};
      s.decay = false;
      s.tp_partial = true;
      s.value = 1.0f;
      break;
    case kSinks:
      // One logit per query head, split with the heads; zeros at first, as Megatron-Core starts its
      // learnable softmax offset.
      s.full = Shape{c.heads};
      s.tp_dim = 0;
      s.decay = false;
      break;
    case kBqkv:
      column_parallel_bias(s, (c.heads + 2 * std::int64_t{c.kv()}) * hd);
      break;
    case kB13:
      column_parallel_bias(s, 2 * f);
      break;
    case kBo:
    case kB2:
      per_feature(s, c, 0.0f);
      break;
    default:
      break;
  }
  return s;
}
}  // namespace

ParamSpec block_spec(const Config& c, int layer, int which, bool named) {
  if (c.llama()) return llama_spec(c, layer, static_cast<LlamaParam>(which), named);
  static const char* names[kBlockParams] = {"ln1 gamma",   "ln1 beta",  "qkv weight", "qkv bias",
                                            "proj weight", "proj bias", "ln2 gamma",  "ln2 beta",
                                            "fc1 weight",  "fc1 bias",  "fc2 weight", "fc2 bias"};
  const std::int64_t h = c.hidden;
  ParamSpec s;
  if (named) s.name = layer_name(layer, names[which]);
  s.seed = kSeed + 64 * static_cast<std::uint64_t>(layer) + which;
  switch (static_cast<BlockParam>(which)) {
    case kLn1G:
    case kLn2G:
      per_feature(s, c, 1.0f);
      break;
    case kLn1B:
    case kLn2B:
    case kProjB:
    case kFc2B:
      per_feature(s, c, 0.0f);
      break;
    case kQkvW:
      column_parallel(s, Shape{h, 3 * h});
      break;
    case kQkvB:
      column_parallel_bias(s, 3 * h);
      break;
    case kProjW:
      row_parallel(s, Shape{h, h}, c);
      break;
    case kFc1W:
      column_parallel(s, Shape{h, 4 * h});
      break;
    case kFc1B:
      column_parallel_bias(s, 4 * h);
      break;
    case kFc2W:
      row_parallel(s, Shape{4 * h, h}, c);
      break;
    default:
      break;
  }
  return s;
}

ParamSpec other_spec(const Config& c, OtherParam which) {
  const std::int64_t h = c.hidden;
  ParamSpec s;
  s.seed = kSeed + 1'000'000 + which;
  switch (which) {
    case kWte:
      s.name = "word embedding";
      s.full = Shape{c.vocab, h};
      s.tp_dim = 0;
      s.std = kStd;
      s.tied = !c.llama();
      break;
    case kOutput:
      s.name = "output layer";
      s.full = Shape{c.vocab, h};
      s.tp_dim = 0;
      s.std = kStd;
      break;
    case kWpe:
      s.name = "position embedding";
      s.full = Shape{c.seq, h};
      s.std = kStd / 2;
      s.sp_partial = true;
      break;
    case kLnfG:
      s.name = "final ln gamma";
      s.full = Shape{h};
      s.value = 1;
      s.decay = false;
      s.sp_partial = true;
      break;
    case kLnfB:
      s.name = "final ln beta";
      s.full = Shape{h};
      s.decay = false;
      s.sp_partial = true;
      break;
    default:
      break;
  }
  return s;
}

bool has_other(const Config& c, OtherParam which) {
  switch (which) {
    case kWpe:
    case kLnfB:
      return !c.llama();
    case kOutput:
      return c.llama();
    default:
      return true;
  }
}

namespace {
// The parameters of the model with `experts_counted` of each MoE layer's experts.
std::int64_t parameters_with(const Config& c, std::int64_t experts_counted) {
  const std::int64_t h = c.hidden;
  // A MoE layer's MLP: the router and the experts counted, in place of the dense MLP (with its biases).
  const std::int64_t expert =
      (c.llama() ? 3 : 2) * h * c.moe_ffn() + (c.add_bias_linear ? (c.llama() ? 2 : 1) * c.moe_ffn() + h : 0);
  const std::int64_t mlp_biases = c.add_bias_linear ? 2 * c.ffn() + h : 0;
  const std::int64_t dense_mlp = c.llama() ? 3 * h * c.ffn() + mlp_biases : 8 * h * h + 5 * h;
  const std::int64_t shared =
      3 * h * c.shared_experts * c.moe_ffn() +
      (c.add_bias_linear && c.shared_experts > 0 ? 2 * c.shared_experts * c.moe_ffn() + h : 0);
  const std::int64_t moe = c.moe_layer_count() * ((h + (c.add_bias_linear ? 1 : 0)) * c.experts +
                                                  (experts_counted * expert + shared) - dense_mlp);
  if (c.llama()) {
    const std::int64_t attention =
        h * (c.heads + 2 * std::int64_t{c.kv()}) * c.head_dim() + c.heads * c.head_dim() * h +
        (c.qk_layernorm ? 2 * c.head_dim() : 0) + (c.attention_sinks ? c.heads : 0) +
        (c.add_qkv_bias || c.add_bias_linear ? (c.heads + 2 * std::int64_t{c.kv()}) * c.head_dim() : 0) +
        (c.add_bias_linear ? h : 0);
    return c.layers * (attention + 3 * h * c.ffn() + mlp_biases + 2 * h) + 2 * c.vocab * h + h + moe;
  }
  return c.layers * (12 * h * h + 13 * h) + c.vocab * h + c.seq * h + 2 * h + moe;
}
}  // namespace

std::int64_t parameter_count(const Config& c) {
  return parameters_with(c, c.experts);
}

std::int64_t active_parameter_count(const Config& c) {
  return parameters_with(c, c.top_k);
}

std::int64_t token(const Config& c, std::int64_t sample, std::int64_t pos) {
  const std::uint64_t z = mix64(0x746f6b656e73ull ^ (static_cast<std::uint64_t>(sample) * (c.seq + 1) + pos));
  return static_cast<std::int64_t>(z % static_cast<std::uint64_t>(c.vocab));
}

std::uint64_t dropout_seed(int step, int layer, int site) {
  return mix64(kSeed ^ 0x64726F70ull) +
         mix64((static_cast<std::uint64_t>(step) << 32) + 2 * static_cast<std::uint64_t>(layer) + site);
}

std::int64_t routed_stash_bytes(const Config& c) {
  if (!c.moe()) return 0;
  const std::int64_t dt = dtype_bytes(c.dtype), h = c.hidden, f = c.moe_ffn();
  // The routes this rank sends, and, every expert getting its share, as many received (ep rank 0's, which
  // takes one more where they do not divide).
  const parallel::Routing ro = parallel::route_balanced(c.local_rows(), c.experts, c.top_k);
  const std::int64_t routes = ro.routes();
  // Each local expert's rows: with etp, what the etp ranks received, gathered, on their shards of the
  // experts. In FP8 an expert keeps its two GEMMs' inputs as their weight gradients read them (w_in's
  // input and the activation), in 16 bits the inputs and the activation themselves.
  const std::int64_t fl = f / c.etp;
  const bool fp8 = c.fp8 != parallel::Fp8Recipe::None;
  std::int64_t gathered = 0, experts = 0;
  for (int le = 0; le < c.local_experts(); ++le) {
    const std::int64_t rows = c.etp * c.ep * ro.per_expert[le];
    gathered += rows;
    experts += rows * (c.llama() ? 2 : 1) * fl * dt;  // w_in's outputs
    experts += fp8 ? parallel::fp8_kept_bytes(c.fp8, rows, h) + parallel::fp8_kept_bytes(c.fp8, rows, fl)
                   : rows * (h + fl) * dt;
  }
  std::int64_t bytes = routes * 2 * 4                    // each route's token and gate, float32
                       + experts                         // the experts' activations
                       + routes * h * dt;                // their outputs, back at the routes' ranks
  if (c.ep > 1 || c.etp > 1) bytes += 2 * gathered * 4;  // the sort by expert and back, float32
  return bytes;
}

std::int64_t stash_bytes(const Config& c, int layers, bool embedding, bool head, int first_layer) {
  (void)embedding;  // the embedding's output is the first block's input; the token ids are data
  const std::int64_t dt = dtype_bytes(c.dtype), r = c.rows(), lr = c.local_rows();
  const std::int64_t h = c.hidden, hl = h / c.tp, heads = c.heads / c.tp;
  // A linear layer's input as its backward takes it: 16-bit, or its FP8 copy (TensorParallel::Kept).
  const bool fp8 = c.fp8 != parallel::Fp8Recipe::None;
  auto kept = [&](std::int64_t rows, std::int64_t cols) {
    return fp8 ? parallel::fp8_kept_bytes(c.fp8, rows, cols) : rows * cols * dt;
  };
  std::int64_t block = lr * h * dt;  // x, the block's input: all that full recomputation keeps
  std::int64_t mlp = 0;              // of that, the dense MLP's activations
  if (c.llama() && c.recompute != Recompute::Full) {
    const std::int64_t hd = c.head_dim(), f = c.ffn() / c.tp, kv = c.kv() / c.tp;
    mlp = r * 2 * f * dt + kept(r, f);         // w13's output u and swiglu(u)
    block += 2 * lr * 4                        // the two RMSNorms' reciprocal deviations, float32
             + 2 * kept(lr, h) + lr * h * dt   // y1, y2 (the linear layers' inputs) and x1
             + r * (heads + 2 * kv) * hd * dt  // qkv (rotated)
             + (c.qk_layernorm ? r * (heads + kv) * (hd * dt + 4) : 0)  // QK-norm's q, k and statistics
             + mlp                                                      //
             + (fp8 ? kept(r, heads * hd) : 0);                         // wo's own copy of its input
    if (c.recompute == Recompute::None) {
      block += r * heads * hd * dt + 4 * r * heads;  // attention out and lse
      if (c.attention == AttentionKernel::Unfused) block += c.micro_batch * heads * c.seq * c.seq * dt;
    }
  } else if (c.recompute != Recompute::Full) {
    mlp = r * 4 * hl * dt + kept(r, 4 * hl);  // fc1's output u and gelu(u)
    block += 4 * lr * 4                       // layernorm means and reciprocal deviations, float32
             + 2 * kept(lr, h) +
             lr * h * dt        // y1, y2, x1 (local rows: 1/tp of them with sequence parallelism)
             + r * 3 * hl * dt  // qkv
             + mlp + (fp8 ? kept(r, hl) : 0);  // proj's own copy of its input
    if (c.recompute == Recompute::None) {
      block += r * hl * dt + 4 * r * heads;  // attention out and lse
      // The unfused path's probabilities: [micro-batch x heads, seq, seq] of the compute dtype.
      if (c.attention == AttentionKernel::Unfused) block += c.micro_batch * heads * c.seq * c.seq * dt;
    }
  }
  // A MoE layer keeps its routed tokens' activations in place of the dense MLP's, and its shared experts'
  // MLP's (the llama block's).
  const std::int64_t fs = c.shared_experts * c.moe_ffn() / c.tp;
  const std::int64_t shared = r * 2 * fs * dt + kept(r, fs);
  // In FP8 the router's weight gradient reads the layer's input in 16 bits; the shared experts keep their
  // own FP8 copy of it besides.
  const std::int64_t router_x = fp8 ? lr * h * dt - (fs > 0 ? 0 : kept(lr, h)) : 0;
  const std::int64_t moe_block = c.recompute == Recompute::Full
                                     ? block
                                     : block - mlp + routed_stash_bytes(c) + (fs > 0 ? shared : 0) + router_x;
  const std::int64_t moe_layers = c.moe_layer_count(first_layer, layers);
  std::int64_t total = (layers - moe_layers) * block + moe_layers * moe_block;
  if (head) {
    total += 2 * lr * h * dt + (c.llama() ? 1 : 2) * lr * 4  // x, y and the statistics of the final norm
             + r * (c.vocab / c.tp) * dt + 3 * r * 4;        // logits, row max, softmax statistics
  }
  return total;
}

Model::Model(Rank& r, const Config& c, int tp_rank, int dp_rank, int pp_rank, parallel::TensorParallel& tp,
             parallel::DataParallel& dp, int cp_rank, parallel::ContextParallel* cp,
             parallel::ExpertParallel* ep, parallel::DataParallel* expert_dp)
    : r_(r),
      c_(c),
      tp_rank_(tp_rank),
      dp_rank_(dp_rank),
      pp_rank_(pp_rank),
      cp_rank_(cp_rank),
      tp_(tp),
      dp_(dp),
      cp_(c.cp > 1 ? cp : nullptr),
      ep_(c.moe() ? ep : nullptr),
      expert_dp_(c.moe() ? expert_dp : nullptr) {
  if (c.moe() && (ep_ == nullptr || expert_dp_ == nullptr))
    throw std::logic_error("gpt: a model with experts needs their expert-parallel group and its reduction");
  for (int k = 0; k < c.v; ++k) {
    const int virtual_stage = k * c.pp + pp_rank;  // rank p holds chunks p, p + pp, p + 2 pp, ...
    Chunk ch;
    ch.embedding = virtual_stage == 0;
    ch.head = virtual_stage == c.pp * c.v - 1;
    embedding_ = embedding_ || ch.embedding;
    head_ = head_ || ch.head;
    ch.blocks.resize(c.chunk_layers(virtual_stage));
    const int first = c.chunk_first_layer(virtual_stage);
    for (std::size_t i = 0; i < ch.blocks.size(); ++i) {
      Block& b = ch.blocks[i];
      b.layer = first + static_cast<int>(i);
      b.moe = c.moe_layer(b.layer);
      if (b.moe) b.experts.resize(2 * static_cast<std::size_t>(c.local_experts()));
      if (b.moe && c.add_bias_linear) b.expert_biases.resize(b.experts.size());
    }
    chunks_.push_back(std::move(ch));
  }
  // The data-parallel buckets are laid out first: zero 0's and 1's tensors are views of their buffers.
  const std::vector<ParamId> order = backward_order(c, pp_rank);
  for (ParamId id : order) param(id).spec = param_spec(c, id);
  dp.set_buckets(params_in_backward_order());
  for (Param* p : params()) dp.init(*p);
  for (Chunk& ch : chunks_) {
    for (Block& b : ch.blocks) dp.add_unit(block_param_list(b));
  }
  // The experts' weights: buckets of their own, reduced over the ranks that hold the same experts.
  if (expert_dp_ != nullptr) {
    std::vector<Param*> experts;
    for (ParamId id : expert_backward_order(c, pp_rank, ep_->index)) {
      Param& p = param(id);
      p.spec = param_spec(c, id);
      experts.push_back(&p);
    }
    expert_dp_->set_buckets(experts);
    for (Param* p : expert_params()) expert_dp_->init(*p);
    for (Chunk& ch : chunks_) {
      for (Block& b : ch.blocks)
        if (b.moe) expert_dp_->add_unit(expert_param_list(b));
    }
  }
  vocab_start_ = tp_rank * (c.vocab / c.tp);

  // The data: this data-parallel rank's samples, one micro-batch after another; rows sequence-major.
  const std::int64_t m = c.micro_batches(), mb = c.micro_batch, rows = c.rows();
  auto make = [&](std::int64_t first_sample, int shift) {
    if (c.phantom) return r.phantom({rows}, DType::Float32);
    std::vector<float> v(rows);
    // This rank's positions of the sequence: all of them, or its two chunks with context parallelism.
    for (std::int64_t pos = 0; pos < c.cp_seq(); ++pos) {
      const std::int64_t at = c.cp_position(cp_rank, pos);
      for (std::int64_t s = 0; s < mb; ++s)
        v[pos * mb + s] = static_cast<float>(token(c, first_sample + s, at + shift));
    }
    return r.from_host({rows}, v);
  };
  const std::int64_t first = dp_rank * (c.global_batch / c.dp);
  for (std::int64_t k = 0; k < m; ++k) {
    if (embedding_) ids_.push_back(make(first + k * mb, 0));
    if (head_) targets_.push_back(make(first + k * mb, 1));
  }
  // The positions of this rank's rows (its part of the sequence with --seq-parallel); llama's blocks rotate
  // q and k instead.
  if (embedding_ && !c.llama()) {
    const std::int64_t lr = c.local_rows(), start = tp_rank * lr * (c.seq_parallel ? 1 : 0);
    std::vector<float> v(lr);
    for (std::int64_t i = 0; i < lr; ++i) v[i] = static_cast<float>(c.cp_position(cp_rank, (start + i) / mb));
    pos_ids_.push_back(c.phantom ? r.phantom({lr}, DType::Float32) : r.from_host({lr}, v));
  }
  if (head_) loss_sum = c.phantom ? r.phantom({}, DType::Float32) : r.zeros({}, DType::Float32);
  stash_.assign(c.v, std::vector<Stash>(m));
}

bool Model::has_head() const {
  return chunks_.back().head;
}

std::int64_t Model::kept_bytes(int chunk, int mb) const {
  const Stash& st = stash_[chunk][mb];
  std::int64_t n = 0;
  auto add = [&](const Tensor& t) { n += t.defined() ? t.bytes() : 0; };
  for (const BlockActs& a : st.blocks) {
    for (const Tensor* t :
         {&a.x,        &a.mean1, &a.rstd1,       &a.y1,    &a.qkv,   &a.out,    &a.lse,       &a.probs,
          &a.x1,       &a.mean2, &a.rstd2,       &a.y2,    &a.u,     &a.g,      &a.y1_scales, &a.y2_scales,
          &a.g_scales, &a.out8,  &a.out8_scales, &a.q_pre, &a.k_pre, &a.rstd_q, &a.rstd_k,    &a.router_x}) {
      add(*t);
    }
  }
  const HeadActs& h = st.head;
  for (const Tensor* t : {&h.x, &h.mean, &h.rstd, &h.y, &h.logits, &h.row_max, &h.stats}) add(*t);
  return n + routed_bytes(chunk, mb);
}

std::int64_t Model::routed_bytes(int chunk, int mb) const {
  std::int64_t n = 0;
  auto add = [&](const Tensor& t) { n += t.defined() ? t.bytes() : 0; };
  for (const BlockActs& a : stash_[chunk][mb].blocks) {
    const parallel::ExpertParallel::Kept& k = a.moe;
    for (const Tensor* t : {&k.index, &k.gates, &k.sorted, &k.back, &k.sort, &k.unsort}) add(*t);
    for (const std::vector<Tensor>* ts : {&k.u, &k.g})
      for (const Tensor& t : *ts) add(t);
    for (const std::vector<parallel::Fp8Operand>* qs : {&k.x8, &k.g8})
      for (const parallel::Fp8Operand& q : *qs) add(q.along_rows), add(q.rows_scales);
  }
  return n;
}

void Model::start_step() {
  ++step_;
  routes_.clear();
  routed_ = dropped_ = 0;
  if (loss_sum.defined()) r_.scale_(loss_sum, 0.0f);
}

void Model::fp8_linear(int layer, int weight) {
  if (tp_.fp8 != nullptr) tp_.fp8->select(layer * block_params(c_) + weight);
}

Tensor Model::residual_dropout(const Tensor& branch, int layer, int site, int mb) {
  if (c_.dropout == 0) return branch;
  // With sequence parallelism the branch holds this rank's part of the rows; without, all of them (every
  // tp rank then makes the same mask). The deliberate bug forgets the part's offset.
  const std::int64_t first =
      c_.seq_parallel && c_.broken != "dropout-row" ? tp_rank_ * c_.local_rows() : std::int64_t{0};
  const std::int64_t global_mb = dp_rank_ * c_.micro_batches() + mb, mbs = c_.micro_batch;
  // The row of the micro-batch that local row `i` is: rows are sequence-major, and with context parallelism
  // the rank's positions are two chunks apart in the sequence (Config::cp_position).
  auto row_of = [&](std::int64_t i) {
    return dropout_row(c_, global_mb, c_.cp_position(cp_rank_, i / mbs) * mbs + i % mbs);
  };
  Rank::DropoutRows rows(row_of(first));
  // Rows past the first chunk's (a multiple of the micro-batch) continue from the second chunk's start. The
  // deliberate bug runs the rank's rows on from its first chunk's start, as one block of rows.
  const std::int64_t second = c_.cp_chunk() * mbs;
  if (c_.broken == "dropout-cp-rows") {
    rows = Rank::DropoutRows(row_of(0) + first);
  } else if (c_.cp > 1 && first < second && first + branch.size(0) > second) {
    rows = Rank::DropoutRows(row_of(first), second - first, row_of(second));
  }
  return r_.dropout(branch, c_.dropout, dropout_seed(step_, layer, site), rows);
}

std::vector<Param*> Model::params() {
  std::vector<Param*> out;
  for (const Named& n : named_params())
    if (n.dp == &dp_) out.push_back(n.p);
  return out;
}

std::vector<ParamId> backward_order(const Config& c, int stage) {
  auto other = [](OtherParam which) { return ParamId{kMostBlockParams + which, -1}; };
  std::vector<ParamId> out;
  for (int k = c.v - 1; k >= 0; --k) {
    const int vs = k * c.pp + stage;
    if (vs == c.pp * c.v - 1) {  // the head
      if (c.llama()) {
        out.push_back(other(kOutput));
        out.push_back(other(kLnfG));
      } else {
        out.push_back(other(kLnfB));
        out.push_back(other(kLnfG));
        if (stage != 0) out.push_back(other(kWte));  // else final after the embedding's backward
      }
    }
    const int first = c.chunk_first_layer(vs);
    for (int layer = first + c.chunk_layers(vs) - 1; layer >= first; --layer) {
      for (int q = block_params(c) - 1; q >= 0; --q) {
        // A MoE layer's router comes before its (shared experts') MLP.
        if (c.moe_layer(layer) && q == (c.llama() ? int{kW2} : int{kFc2B})) {
          out.push_back({kRouterKind, layer});
          if (c.add_bias_linear) out.push_back({router_bias_kind(c), layer});
        }
        if (has_block_param(c, layer, q)) out.push_back({q, layer});
      }
    }
    if (vs == 0) {  // the embedding
      if (!c.llama()) out.push_back(other(kWpe));
      out.push_back(other(kWte));
    }
  }
  return out;
}

bool is_mlp_param(const Config& c, int which) {
  if (c.llama()) return which == kW13 || which == kW2 || which == kB13 || which == kB2;
  return which == kFc1W || which == kFc1B || which == kFc2W || which == kFc2B;
}

namespace {
// A MoE layer's router (kind kRouterKind) or an expert's weight. An expert's w_in is split by columns and
// its w_out by rows over the expert tensor-parallel ranks (whole where etp is 1; the SwiGLU's adjacent
// pairs stay together); the router is replicated and, with sequence parallelism, each tp rank's gradient
// is of its own tokens.
ParamSpec moe_spec(const Config& c, int layer, int kind, bool named) {
  const std::int64_t h = c.hidden, f = c.moe_ffn();
  ParamSpec s;
  const std::uint64_t per_layer = 2 * static_cast<std::uint64_t>(c.experts) + 1;
  s.seed = kSeed + 2'000'000 + per_layer * static_cast<std::uint64_t>(layer) + (kind - kRouterKind);
  s.std = kStd;
  if (kind == kRouterKind) {
    if (named) s.name = layer_name(layer, "router");
    s.full = Shape{h, c.experts};
    s.sp_partial = true;
    return s;
  }
  const char* names[2][2] = {{"fc1", "fc2"}, {"w13", "w2"}};
  if (kind >= router_bias_kind(c)) {  // zeros at first, as every bias
    s.std = 0;
    s.decay = false;
    if (kind == router_bias_kind(c)) {
      if (named) s.name = layer_name(layer, "router bias");
      s.full = Shape{c.experts};
      s.sp_partial = true;
      return s;
    }
    const auto [expert, which] = expert_bias(c, kind);
    if (named) s.name = fmt::format("layer {} expert {} {} bias", layer, expert, names[c.llama()][which]);
    s.full = Shape{which == 0 ? (c.llama() ? 2 * f : f) : h};
    s.tp_dim = which == 0 ? 0 : -1;
    return s;
  }
  const auto [expert, which] = expert_weight(kind);
  if (named) s.name = fmt::format("layer {} expert {} {}", layer, expert, names[c.llama()][which]);
  if (which == 0) {
    s.full = Shape{h, c.llama() ? 2 * f : f};
    s.tp_dim = 1;
  } else {
    s.full = Shape{f, h};
    s.tp_dim = 0;
    s.std = kStd / std::sqrt(2.0f * static_cast<float>(c.layers));
  }
  return s;
}
}  // namespace

std::vector<ParamId> expert_backward_order(const Config& c, int stage, int ep_index) {
  std::vector<ParamId> out;
  const int per = c.local_experts();
  for (int k = c.v - 1; k >= 0; --k) {
    const int vs = k * c.pp + stage, first = c.chunk_first_layer(vs);
    for (int layer = first + c.chunk_layers(vs) - 1; layer >= first; --layer) {
      if (!c.moe_layer(layer)) continue;
      for (int le = per - 1; le >= 0; --le) {
        out.push_back({expert_kind(ep_index * per + le, 1), layer});
        out.push_back({expert_kind(ep_index * per + le, 0), layer});
      }
      if (!c.add_bias_linear) continue;
      for (int le = per - 1; le >= 0; --le) {
        out.push_back({expert_bias_kind(c, ep_index * per + le, 1), layer});
        out.push_back({expert_bias_kind(c, ep_index * per + le, 0), layer});
      }
    }
  }
  return out;
}

ParamSpec param_spec(const Config& c, ParamId id, bool named) {
  if (id.kind >= kRouterKind) return moe_spec(c, id.layer, id.kind, named);
  return id.kind < kMostBlockParams ? block_spec(c, id.layer, id.kind, named)
                                    : other_spec(c, static_cast<OtherParam>(id.kind - kMostBlockParams));
}

Param& Model::param(ParamId id) {
  if (id.kind < kMostBlockParams || id.kind >= kRouterKind) {
    for (Chunk& ch : chunks_) {
      const int first = ch.blocks.front().layer;
      if (id.layer < first || id.layer >= first + static_cast<int>(ch.blocks.size())) continue;
      Block& b = ch.blocks[id.layer - first];
      if (id.kind < kMostBlockParams) return b.p[id.kind];
      if (id.kind == kRouterKind) return b.router;
      if (id.kind == router_bias_kind(c_)) return b.router_bias;
      if (is_expert_bias_kind(c_, id.kind)) {
        const auto [expert, which] = expert_bias(c_, id.kind);
        return b.expert_biases[2 * (expert - ep_->index * c_.local_experts()) + which];
      }
      const auto [expert, which] = expert_weight(id.kind);
      return b.experts[2 * (expert - ep_->index * c_.local_experts()) + which];
    }
    throw std::logic_error("gpt: layer " + std::to_string(id.layer) + " is not on this pipeline rank");
  }
  switch (static_cast<OtherParam>(id.kind - kMostBlockParams)) {
    case kWte:
      return wte_;
    case kWpe:
      return wpe_;
    case kLnfG:
      return lnf_g_;
    case kOutput:
      return output_;
    default:
      return lnf_b_;
  }
}

std::vector<Param*> Model::params_in_backward_order() {
  std::vector<Param*> out;
  for (ParamId id : backward_order(c_, pp_rank_)) out.push_back(&param(id));
  return out;
}

std::vector<Param*> Model::expert_params() {
  std::vector<Param*> out;
  for (Chunk& ch : chunks_) {
    for (Block& b : ch.blocks)
      for (Param* p : expert_param_list(b)) out.push_back(p);
  }
  return out;
}

std::vector<Model::Named> Model::named_params() {
  std::vector<Named> out;
  for (Chunk& ch : chunks_) {
    for (Block& b : ch.blocks) {
      for (int k = 0; k < block_params(c_); ++k) {
        if (has_block_param(c_, b.layer, k)) out.push_back({k, b.layer, &b.p[k], &dp_});
      }
      if (!b.moe) continue;
      out.push_back({kRouterKind, b.layer, &b.router, &dp_});
      if (c_.add_bias_linear) out.push_back({router_bias_kind(c_), b.layer, &b.router_bias, &dp_});
      // Each local expert's two weights, then its two biases, in pairs.
      const int first_expert = ep_->index * c_.local_experts();
      for (bool biases : {false, true}) {
        std::vector<Param>& pairs = biases ? b.expert_biases : b.experts;
        for (std::size_t i = 0; i < pairs.size(); ++i) {
          const int expert = first_expert + static_cast<int>(i / 2), which = static_cast<int>(i % 2);
          const int kind = biases ? expert_bias_kind(c_, expert, which) : expert_kind(expert, which);
          out.push_back({kind, b.layer, &pairs[i], expert_dp_});
        }
      }
    }
  }
  auto other = [&](OtherParam which, bool here) {
    if (here && has_other(c_, which))
      out.push_back({kMostBlockParams + which, -1, &param({kMostBlockParams + which, -1}), &dp_});
  };
  other(kWte, embedding_ || (head_ && !c_.llama()));
  other(kWpe, embedding_);
  other(kLnfG, head_);
  other(kLnfB, head_);
  other(kOutput, head_);
  return out;
}

std::vector<Param*> Model::block_param_list(Block& b) const {
  std::vector<Param*> ps;
  for (int k = 0; k < block_params(c_); ++k) {
    if (has_block_param(c_, b.layer, k)) ps.push_back(&b.p[k]);
  }
  if (b.moe) ps.push_back(&b.router);
  if (b.moe && c_.add_bias_linear) ps.push_back(&b.router_bias);
  return ps;
}

std::vector<Param*> Model::expert_param_list(Block& b) {
  std::vector<Param*> ps;
  for (Param& p : b.experts) ps.push_back(&p);
  for (Param& p : b.expert_biases) ps.push_back(&p);
  return ps;
}

Model::GatheredBlock Model::gather(Block& b) {
  GatheredBlock g;
  g.dense = dp_.gather(block_param_list(b));
  g.moe = b.moe;
  g.layer = b.layer;
  if (b.moe) g.experts = expert_dp_->gather(expert_param_list(b));
  return g;
}

Model::Weights Model::get(GatheredBlock& g) {
  std::vector<Tensor> got = dp_.get(g.dense);
  Weights w;
  // In block_param_list's order: the block's parameters but a MoE layer's MLP, then its router.
  std::size_t at = 0;
  const bool moe = g.moe;
  for (int k = 0; k < block_params(c_); ++k) {
    if (has_block_param(c_, g.layer, k)) w.dense[k] = got[at++];
  }
  if (!moe) return w;
  w.router = got[at];
  if (c_.add_bias_linear) w.biases.router = got[at + 1];
  // In expert_param_list's order: the weights in pairs, then the biases.
  std::vector<Tensor> experts = expert_dp_->get(g.experts);
  const std::size_t weights = 2 * static_cast<std::size_t>(c_.local_experts());
  for (std::size_t i = 0; i < experts.size(); i += 2) {
    std::vector<Tensor>& in = i < weights ? w.w_in : w.biases.in;
    std::vector<Tensor>& out = i < weights ? w.w_out : w.biases.out;
    in.push_back(experts[i]);
    out.push_back(experts[i + 1]);
  }
  return w;
}

// ---- one block --------------------------------------------------------------------------------------------

Tensor Model::block_forward(const Weights& w, const Tensor& x, BlockActs& a, bool keep_all, int layer,
                            int mb) {
  if (c_.llama()) return llama_forward(w, x, a, keep_all, layer, mb);
  Rank& r = r_;
  a.x = x;
  // Attention: layernorm on this rank's tokens; f; qkv for this rank's heads; attention; proj's partial
  // sum; g; bias and residual.
  parallel::TensorParallel::Kept k1, kp, k2, kg;  // the linear layers' inputs, as their backward takes them
  Rank::LayerNormOut ln1 = r.layernorm(x, w[kLn1G], w[kLn1B], kEps);
  fp8_linear(layer, kQkvW);
  Tensor qkv = tp_.column_linear(ln1.y, w[kQkvW], w[kQkvB], &k1);
  Rank::AttentionOut att = attend(qkv, w, layer);
  fp8_linear(layer, kProjW);
  Tensor p = tp_.row_linear(att.out, w[kProjW], &kp);
  r.add_bias_(p, w[kProjB]);
  Tensor x1 = r.add(x, residual_dropout(p, layer, 0, mb));
  // MLP: the same shape of computation with fc1 (column-parallel, 4h) and fc2 (row-parallel).
  Rank::LayerNormOut ln2 = r.layernorm(x1, w[kLn2G], w[kLn2B], kEps);
  Tensor u, o;
  parallel::ExpertParallel::Kept moe;
  if (w.router.defined()) {  // a MoE layer: the experts in place of the MLP
    o = moe_forward(w, ln2.y, moe, layer, mb, !keep_all);
    k2.x = ln2.y;
  } else {
    fp8_linear(layer, kFc1W);
    u = tp_.column_linear(ln2.y, w[kFc1W], w[kFc1B], &k2);
    fp8_linear(layer, kFc2W);
    o = tp_.row_linear(r.gelu(u), w[kFc2W], &kg);
    r.add_bias_(o, w[kFc2B]);
  }
  Tensor x2 = r.add(x1, residual_dropout(o, layer, 1, mb));
  if (keep_all || c_.recompute != Recompute::Full) {
    a.mean1 = ln1.mean, a.rstd1 = ln1.rstd, a.qkv = qkv;
    a.x1 = x1, a.mean2 = ln2.mean, a.rstd2 = ln2.rstd, a.u = u, a.moe = std::move(moe);
    keep_inputs(a, k1, kp, k2, kg);
    // Selective recomputation drops the attention core's output: backward recomputes it from qkv.
    if (keep_all || c_.recompute == Recompute::None) a.out = att.out, a.lse = att.lse, a.probs = att.probs;
  }
  return x2;
}

void Model::rebuild(const Weights& w, BlockActs& a, int layer, int mb) {
  if (c_.recompute == Recompute::Selective) {
    Rank::AttentionOut att = attend(a.qkv, w, layer);
    a.out = att.out, a.lse = att.lse, a.probs = att.probs;
  }
  if (c_.recompute != Recompute::Full) return;
  // The forward once more, its communication included.
  BlockActs again;
  if (tp_.fp8 != nullptr) tp_.fp8->begin_recompute();
  if (c_.llama()) {
    llama_forward(w, a.x, again, true, layer, mb);
  } else {
    block_forward(w, a.x, again, true, layer, mb);
  }
  if (tp_.fp8 != nullptr) tp_.fp8->end_recompute();
  a = std::move(again);
}

Tensor Model::block_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dx2, int mb) {
  if (c_.llama()) return llama_backward(b, w, a, dx2, mb);
  Rank& r = r_;
  rebuild(w, a, b.layer, mb);
  // MLP backward. g's backward: the output gradient, whole (gathered with sequence parallelism).
  const Tensor dout = residual_dropout(dx2, b.layer, 1, mb);
  Tensor dy2;
  if (b.moe) {
    dy2 = moe_backward(b, w, a, dout);
  } else {
    dp_.add_grad(b.p[kFc2B], r.sum_rows(dout));
    fp8_linear(b.layer, kFc2W);
    parallel::TensorParallel::Grads fc2 =
        tp_.row_linear_backward(a.g, w[kFc2W], dout, dp_.wgrad_into(b.p[kFc2W]));
    dp_.add_grad(b.p[kFc2W], fc2.dw);
    const Tensor du = r.gelu_backward(fc2.dx, a.u);
    fp8_linear(b.layer, kFc1W);
    parallel::TensorParallel::Grads fc1 =
        tp_.column_linear_backward(a.y2, w[kFc1W], du, /*bias=*/true, dp_.wgrad_into(b.p[kFc1W]));
    dp_.add_grad(b.p[kFc1W], fc1.dw);
    dp_.add_grad(b.p[kFc1B], fc1.db);
    dy2 = fc1.dx;
  }
  Rank::LayerNormGrads ln2 = r.layernorm_backward(dy2, a.x1, w[kLn2G], a.mean2, a.rstd2);
  dp_.add_grad(b.p[kLn2G], ln2.dgamma);
  dp_.add_grad(b.p[kLn2B], ln2.dbeta);
  const Tensor dx1 = r.add(dx2, ln2.dx);
  // Attention backward.
  const Tensor dp = residual_dropout(dx1, b.layer, 0, mb);
  dp_.add_grad(b.p[kProjB], r.sum_rows(dp));
  fp8_linear(b.layer, kProjW);
  parallel::TensorParallel::Grads proj =
      tp_.row_linear_backward(a.out8.defined() ? a.out8 : a.out, w[kProjW], dp, dp_.wgrad_into(b.p[kProjW]));
  dp_.add_grad(b.p[kProjW], proj.dw);
  const Tensor dqkv = attend_backward(b, w, proj.dx, a);
  fp8_linear(b.layer, kQkvW);
  parallel::TensorParallel::Grads qkv =
      tp_.column_linear_backward(a.y1, w[kQkvW], dqkv, /*bias=*/true, dp_.wgrad_into(b.p[kQkvW]));
  dp_.add_grad(b.p[kQkvW], qkv.dw);
  dp_.add_grad(b.p[kQkvB], qkv.db);
  Rank::LayerNormGrads ln1 = r.layernorm_backward(qkv.dx, a.x, w[kLn1G], a.mean1, a.rstd1);
  dp_.add_grad(b.p[kLn1G], ln1.dgamma);
  dp_.add_grad(b.p[kLn1B], ln1.dbeta);
  return r.add(dx1, ln1.dx);
}

// ---- a MoE layer's MLP (parallel/expert_parallel.h) -------------------------------------------------------

Tensor Model::moe_forward(const Weights& w, const Tensor& y2, parallel::ExpertParallel::Kept& k, int layer,
                          int mb, bool record) {
  Tensor y = ep_->forward(y2, w.router, w.w_in, w.w_out, k, layer, w.biases);
  const parallel::Routing& ro = k.routing;
  if (record) routed_ += ro.routes() + ro.dropped(), dropped_ += ro.dropped();
  if (!record || c_.phantom) return y;
  // Row i of y2 is local row i of this rank's rows (sequence-major: position * micro_batch + sample; with
  // sequence parallelism this tp rank's part of them).
  // A dropped route's expert e is recorded as -1 - e.
  std::vector<std::vector<int>> experts(ro.tokens);
  for (std::size_t i = 0; i < ro.token.size(); ++i) experts[ro.token[i]].push_back(ro.expert[i]);
  for (std::size_t i = 0; i < ro.dropped_token.size(); ++i)
    experts[ro.dropped_token[i]].push_back(-1 - ro.dropped_expert[i]);
  const std::int64_t first_row = c_.seq_parallel ? tp_rank_ * c_.local_rows() : 0;
  const std::int64_t first_sample = dp_rank_ * (c_.global_batch / c_.dp) + mb * c_.micro_batch;
  TokenExperts& log = routes_[layer];
  for (std::int64_t i = 0; i < ro.tokens; ++i) {
    const std::int64_t row = first_row + i, sample = first_sample + row % c_.micro_batch;
    const std::int64_t position = c_.cp_position(cp_rank_, row / c_.micro_batch);
    std::sort(experts[i].begin(), experts[i].end(),
              [](int a, int b) { return (a < 0 ? -1 - a : a) < (b < 0 ? -1 - b : b); });
    log.emplace_back(sample * c_.seq + position, std::move(experts[i]));
  }
  return y;
}

Tensor Model::moe_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dout) {
  const Tensor& x = a.router_x.defined() ? a.router_x : a.y2;
  parallel::ExpertParallel::Grads g = ep_->backward(dout, x, w.router, w.w_in, w.w_out, a.moe, w.biases);
  for (std::size_t le = 0; le < g.dw_in.size(); ++le) {
    expert_dp_->add_grad(b.experts[2 * le], g.dw_in[le]);
    expert_dp_->add_grad(b.experts[2 * le + 1], g.dw_out[le]);
  }
  for (std::size_t le = 0; le < g.db_in.size(); ++le) {
    expert_dp_->add_grad(b.expert_biases[2 * le], g.db_in[le]);
    expert_dp_->add_grad(b.expert_biases[2 * le + 1], g.db_out[le]);
  }
  dp_.add_grad(b.router, g.drouter);
  if (g.drouter_bias.defined()) dp_.add_grad(b.router_bias, g.drouter_bias);
  return g.dx;
}

void Model::keep_inputs(BlockActs& a, const parallel::TensorParallel::Kept& y1,
                        const parallel::TensorParallel::Kept& out, const parallel::TensorParallel::Kept& y2,
                        const parallel::TensorParallel::Kept& g) {
  a.y1 = y1.x, a.y1_scales = y1.scales, a.y2 = y2.x, a.y2_scales = y2.scales, a.g = g.x,
  a.g_scales = g.scales;
  // The attention's output is kept as it is for the attention's backward; in FP8 proj keeps its own copy.
  if (is_float8(out.x.dtype())) a.out8 = out.x, a.out8_scales = out.scales;
}

// ---- the llama block --------------------------------------------------------------------------------------

AttentionSpec Model::attention_spec(const Weights& w, int layer) const {
  AttentionSpec spec{c_.micro_batch, c_.heads / c_.tp, c_.kv() / c_.tp, true, c_.attention};
  spec.window = c_.window(layer);
  if (c_.attention_sinks) spec.sinks = w[kSinks];
  return spec;
}

Rank::AttentionOut Model::attend(const Tensor& qkv, const Weights& w, int layer) {
  const AttentionSpec spec = attention_spec(w, layer);
  return cp_ != nullptr ? cp_->attention(qkv, spec) : r_.attention(qkv, spec);
}

Tensor Model::attend_backward(Block& b, const Weights& w, const Tensor& dout, const BlockActs& a) {
  const AttentionSpec spec = attention_spec(w, b.layer);
  if (spec.sinks.defined()) {
    // (The deliberate bug leaves the sinks where they started.)
    if (c_.broken != "no-sinks-backward")
      dp_.add_grad(b.p[kSinks], r_.attention_sinks_backward(dout, a.out, a.lse, spec));
  }
  return cp_ != nullptr ? cp_->attention_backward(dout, a.qkv, a.out, a.lse, spec)
                        : r_.attention_backward(dout, a.qkv, a.out, a.lse, spec);
}

void Model::rotate(const Tensor& qkv, bool inverse) {
  const AttentionSpec layout{c_.micro_batch, c_.heads / c_.tp, c_.kv() / c_.tp};  // qkv's heads
  if (cp_ == nullptr) {
    r_.rope_(qkv, layout, 0, c_.rope_theta, inverse);
    return;
  }
  // This rank's two chunks of the sequence, each rotated by its own positions.
  const std::int64_t chunk = c_.cp_chunk(), rows = chunk * c_.micro_batch, width = qkv.size(1);
  for (std::int64_t half : {0, 1}) {
    r_.rope_(r_.view(qkv, half * rows * width, Shape{rows, width}), layout,
             c_.cp_position(cp_rank_, half * chunk), c_.rope_theta, inverse);
  }
}

Tensor Model::llama_forward(const Weights& w, const Tensor& x, BlockActs& a, bool keep_all, int layer,
                            int mb) {
  Rank& r = r_;
  a.x = x;
  // Attention: RMSNorm on this rank's tokens; f; q, k and v of this rank's key-value groups, k and q rotated
  // by their positions (the gathered rows: every position of the micro-batch); attention; wo's partial sum;
  // g; residual.
  parallel::TensorParallel::Kept k1, ko, k2, kg;  // the linear layers' inputs, as their backward takes them
  Rank::RmsNormOut n1 = r.rmsnorm(x, w[kNorm1], kEps);
  fp8_linear(layer, kWqkv);
  Tensor qkv = tp_.column_linear(n1.y, w[kWqkv], w[kBqkv], &k1);
  if (c_.qk_layernorm) qkv = qk_norm(qkv, w, a);
  rotate(qkv, false);
  Rank::AttentionOut att = attend(qkv, w, layer);
  fp8_linear(layer, kWo);
  Tensor proj = tp_.row_linear(att.out, w[kWo], &ko);
  if (w[kBo].defined()) r.add_bias_(proj, w[kBo]);
  Tensor x1 = r.add(x, residual_dropout(proj, layer, 0, mb));
  // MLP: the gate and up projections in one column-parallel GEMM, SwiGLU, and the row-parallel down one.
  Rank::RmsNormOut n2 = r.rmsnorm(x1, w[kNorm2], kEps);
  Tensor u, o, router_x;
  parallel::ExpertParallel::Kept moe;
  if (w[kW13].defined()) {  // the dense MLP, or a MoE layer's shared experts
    fp8_linear(layer, kW13);
    u = tp_.column_linear(n2.y, w[kW13], w[kB13], &k2);
    fp8_linear(layer, kW2);
    o = tp_.row_linear(r.swiglu(u, c_.glu()), w[kW2], &kg);
    if (w[kB2].defined()) r.add_bias_(o, w[kB2]);
  }
  if (w.router.defined()) {  // a MoE layer's routed experts
    Tensor routed = moe_forward(w, n2.y, moe, layer, mb, !keep_all);
    o = o.defined() ? r.add(o, routed) : routed;
    if (!k2.x.defined()) k2.x = n2.y;
    if (is_float8(k2.x.dtype())) router_x = n2.y;
  }
  Tensor x2 = r.add(x1, residual_dropout(o, layer, 1, mb));
  if (keep_all || c_.recompute != Recompute::Full) {
    a.rstd1 = n1.rstd, a.qkv = qkv, a.x1 = x1, a.rstd2 = n2.rstd, a.u = u, a.moe = std::move(moe);
    a.router_x = router_x;
    keep_inputs(a, k1, ko, k2, kg);
    if (keep_all || c_.recompute == Recompute::None) a.out = att.out, a.lse = att.lse, a.probs = att.probs;
  } else {
    a.q_pre = a.k_pre = a.rstd_q = a.rstd_k = Tensor();  // full recomputation makes them again
  }
  return x2;
}

// qkv's columns are each key-value group's q heads, then its k and its v: as rows of one group each, the
// queries are the first per * d columns, the key the next d. Qwen3's q_norm and k_norm (Megatron-Core's
// --qk-layernorm) normalise them as rows of d features; the copies out and back stand for the strided
// reads of the frameworks' kernels.
Model::QkvRows Model::split_qkv(const Tensor& qkv) {
  const std::int64_t d = c_.head_dim(), per = c_.heads / c_.kv();
  const std::int64_t groups = qkv.numel() / ((per + 2) * d);
  const Tensor rows = r_.view(qkv, 0, Shape{groups, (per + 2) * d});
  return {r_.view(r_.slice(rows, 1, 0, per * d), 0, Shape{groups * per, d}), r_.slice(rows, 1, per * d, d),
          rows, qkv.shape()};
}

Tensor Model::join_qkv(const Tensor& q, const Tensor& k, const QkvRows& from) {
  const std::int64_t groups = from.rows.size(0), d = k.size(1);
  const Tensor v = r_.slice(from.rows, 1, from.rows.size(1) - d, d);
  return r_.view(r_.cat({r_.view(q, 0, Shape{groups, q.numel() / groups}), k, v}, 1), 0, from.shape);
}

Tensor Model::qk_norm(const Tensor& qkv, const Weights& w, BlockActs& a) {
  const QkvRows in = split_qkv(qkv);
  a.q_pre = in.q, a.k_pre = in.k;
  const Rank::RmsNormOut q = r_.rmsnorm(in.q, w[kQNorm], kEps), k = r_.rmsnorm(in.k, w[kKNorm], kEps);
  a.rstd_q = q.rstd, a.rstd_k = k.rstd;
  return join_qkv(q.y, k.y, in);
}

Tensor Model::qk_norm_backward(Block& b, const Tensor& dqkv, const Weights& w, const BlockActs& a) {
  const QkvRows d = split_qkv(dqkv);
  const Rank::RmsNormGrads q = r_.rmsnorm_backward(d.q, a.q_pre, w[kQNorm], a.rstd_q);
  const Rank::RmsNormGrads k = r_.rmsnorm_backward(d.k, a.k_pre, w[kKNorm], a.rstd_k);
  dp_.add_grad(b.p[kQNorm], q.dgamma);
  dp_.add_grad(b.p[kKNorm], k.dgamma);
  return join_qkv(q.dx, k.dx, d);
}

Tensor Model::llama_backward(Block& b, const Weights& w, BlockActs& a, const Tensor& dx2, int mb) {
  Rank& r = r_;
  rebuild(w, a, b.layer, mb);
  // MLP backward.
  const Tensor dout = residual_dropout(dx2, b.layer, 1, mb);
  Tensor dy2;
  if (b.moe) dy2 = moe_backward(b, w, a, dout);
  if (w[kW13].defined()) {  // the dense MLP, or a MoE layer's shared experts
    if (w[kB2].defined()) dp_.add_grad(b.p[kB2], r.sum_rows(dout));
    fp8_linear(b.layer, kW2);
    parallel::TensorParallel::Grads w2 = tp_.row_linear_backward(a.g, w[kW2], dout, dp_.wgrad_into(b.p[kW2]));
    dp_.add_grad(b.p[kW2], w2.dw);
    const Tensor du = r.swiglu_backward(w2.dx, a.u, c_.glu());
    fp8_linear(b.layer, kW13);
    parallel::TensorParallel::Grads w13 =
        tp_.column_linear_backward(a.y2, w[kW13], du, w[kB13].defined(), dp_.wgrad_into(b.p[kW13]));
    dp_.add_grad(b.p[kW13], w13.dw);
    if (w[kB13].defined()) dp_.add_grad(b.p[kB13], w13.db);
    dy2 = dy2.defined() ? r.add(dy2, w13.dx) : w13.dx;
  }
  Rank::RmsNormGrads n2 = r.rmsnorm_backward(dy2, a.x1, w[kNorm2], a.rstd2);
  dp_.add_grad(b.p[kNorm2], n2.dgamma);
  const Tensor dx1 = r.add(dx2, n2.dx);
  // Attention backward: the rotation's backward is the rotation back.
  const Tensor dp = residual_dropout(dx1, b.layer, 0, mb);
  if (w[kBo].defined()) dp_.add_grad(b.p[kBo], r.sum_rows(dp));
  fp8_linear(b.layer, kWo);
  parallel::TensorParallel::Grads wo =
      tp_.row_linear_backward(a.out8.defined() ? a.out8 : a.out, w[kWo], dp, dp_.wgrad_into(b.p[kWo]));
  dp_.add_grad(b.p[kWo], wo.dw);
  const Tensor dqkv = attend_backward(b, w, wo.dx, a);
  // (The deliberate bug forgets it: the gradient of q and k stays in the rotated frame.)
  if (c_.broken != "no-rope-backward") rotate(dqkv, true);
  const Tensor dmixed = c_.qk_layernorm ? qk_norm_backward(b, dqkv, w, a) : dqkv;
  fp8_linear(b.layer, kWqkv);
  parallel::TensorParallel::Grads wqkv =
      tp_.column_linear_backward(a.y1, w[kWqkv], dmixed, w[kBqkv].defined(), dp_.wgrad_into(b.p[kWqkv]));
  dp_.add_grad(b.p[kWqkv], wqkv.dw);
  if (w[kBqkv].defined()) dp_.add_grad(b.p[kBqkv], wqkv.db);
  Rank::RmsNormGrads n1 = r.rmsnorm_backward(wqkv.dx, a.x, w[kNorm1], a.rstd1);
  dp_.add_grad(b.p[kNorm1], n1.dgamma);
  return r.add(dx1, n1.dx);
}

// ---- the embedding and the output layer -------------------------------------------------------------------

Tensor Model::embed_forward(int mb) {
  if (c_.llama()) {  // no positions: the blocks rotate q and k
    parallel::DataParallel::Gathered wte = dp_.gather(wte_);
    return tp_.leave(r_.embedding(ids_[mb], dp_.get(wte), vocab_start_));
  }
  parallel::DataParallel::Gathered wte = dp_.gather(wte_), wpe = dp_.gather(wpe_);
  // Each tp rank looks up the tokens in its part of the vocabulary (zeros elsewhere); g adds the parts
  // (and with sequence parallelism leaves each rank its tokens).
  Tensor tok = tp_.leave(r_.embedding(ids_[mb], dp_.get(wte), vocab_start_));
  return r_.add(tok, r_.embedding(pos_ids_[0], dp_.get(wpe), 0));
}

void Model::embed_backward(int mb, const Tensor& dx, bool last) {
  std::vector<Param*> made;  // in the order their gradients are made
  if (!c_.llama()) {
    Tensor dwpe = dp_.embedding_grad_target(wpe_);
    r_.embedding_backward_(dwpe, dx, pos_ids_[0], 0);
    dp_.embedding_grad_done(wpe_, dwpe);
    made.push_back(&wpe_);
  }
  Tensor dwte = dp_.embedding_grad_target(wte_);
  r_.embedding_backward_(dwte, tp_.leave_backward(dx), ids_[mb], vocab_start_);
  dp_.embedding_grad_done(wte_, dwte);
  made.push_back(&wte_);
  if (last) dp_.grads_ready(made);
}

void Model::head_forward(int mb, const Tensor& x, HeadActs& h) {
  h.x = x;
  Tensor out_w;
  if (c_.llama()) {
    parallel::DataParallel::Gathered g = dp_.gather(lnf_g_), w = dp_.gather(output_);
    Rank::RmsNormOut n = r_.rmsnorm(x, dp_.get(g), kEps);
    h.rstd = n.rstd, h.y = n.y;
    out_w = dp_.get(w);
  } else {
    parallel::DataParallel::Gathered g = dp_.gather(lnf_g_), b = dp_.gather(lnf_b_), wte = dp_.gather(wte_);
    Rank::LayerNormOut ln = r_.layernorm(x, dp_.get(g), dp_.get(b), kEps);
    h.mean = ln.mean, h.rstd = ln.rstd, h.y = ln.y;
    out_w = dp_.get(wte);
  }
  // Logits for this rank's part of the vocabulary; the softmax needs every part's max and sum of
  // exponentials: two small all-reduces instead of gathering [tokens, vocab].
  h.logits = r_.matmul(tp_.enter(h.y), out_w, Trans::No, Trans::Yes);
  h.row_max = r_.row_max(h.logits);
  if (c_.tp > 1) {
    const Event e = tp_.exposed.before();
    tp_.exposed.after(parallel::Dim::Tp, e, r_.all_reduce(h.row_max, ReduceOp::Max, Async::No, tp_.group));
  }
  h.stats =
      tp_.all_reduce(r_.softmax_stats(h.logits, h.row_max, targets_[mb], vocab_start_), parallel::Dim::Tp);
  r_.add_(loss_sum, r_.cross_entropy_loss(h.row_max, h.stats), 1.0f);
}

Tensor Model::head_backward(int mb, HeadActs& h, bool last) {
  Param& out_p = c_.llama() ? output_ : wte_;
  parallel::DataParallel::Gathered g = dp_.gather(lnf_g_), wte = dp_.gather(out_p);
  // The loss is the mean over the step's tokens of this pipeline; averaging over dp makes it the global mean.
  const float scale = 1.0f / static_cast<float>(c_.micro_batches() * c_.rows());
  Tensor dlogits = r_.cross_entropy_backward(h.logits, h.row_max, h.stats, targets_[mb], vocab_start_, scale);
  h.logits = Tensor();
  const Tensor w = dp_.get(wte);
  // The output layer is column-parallel over the vocabulary, its weight stored [V / tp, h]: the weight
  // gradient is dlogits^T y.
  Tensor dy = tp_.column_backward(
      h.y, [&] { return r_.matmul(dlogits, w); },
      [&](const Tensor& y) {
        dp_.add_grad(out_p, parallel::weight_grad(r_, dlogits, y, dp_.wgrad_into(out_p)));
      });
  if (c_.llama()) {
    Rank::RmsNormGrads n = r_.rmsnorm_backward(dy, h.x, dp_.get(g), h.rstd);
    dp_.add_grad(lnf_g_, n.dgamma);
    if (last) dp_.grads_ready({&output_, &lnf_g_});  // in backward order
    return n.dx;
  }
  Rank::LayerNormGrads ln = r_.layernorm_backward(dy, h.x, dp_.get(g), h.mean, h.rstd);
  dp_.add_grad(lnf_g_, ln.dgamma);
  dp_.add_grad(lnf_b_, ln.dbeta);
  if (last) {
    if (chunks_.front().embedding) {
      dp_.grads_ready({&lnf_g_, &lnf_b_});  // the embedding's backward adds to wte later in this task
    } else {
      dp_.grads_ready({&lnf_g_, &lnf_b_, &wte_});
    }
  }
  return ln.dx;
}

// ---- a pipeline task: one micro-batch through one chunk ---------------------------------------------------

Tensor Model::forward(const parallel::Task& t, const Tensor& in) {
  Chunk& ch = chunks_[t.chunk];
  Stash& st = stash_[t.chunk][t.mb];
  const int n = static_cast<int>(ch.blocks.size());
  st.blocks.assign(n, {});
  Tensor x = ch.embedding ? embed_forward(t.mb) : in;
  // zero 3: the next block's weights are gathered while this one computes.
  GatheredBlock next = gather(ch.blocks[0]);
  for (int i = 0; i < n; ++i) {
    GatheredBlock cur = std::move(next);
    if (i + 1 < n) next = gather(ch.blocks[i + 1]);
    x = block_forward(get(cur), x, st.blocks[i], false, ch.blocks[i].layer, t.mb);
  }
  if (ch.head) {
    head_forward(t.mb, x, st.head);
    return Tensor();
  }
  return x;
}

Tensor Model::backward(const parallel::Task& t, const Tensor& dout) {
  dp_.drain();  // the reductions the previous backward task started
  if (expert_dp_ != nullptr) expert_dp_->drain();
  Chunk& ch = chunks_[t.chunk];
  Stash& st = stash_[t.chunk][t.mb];
  const bool last = t.mb == c_.micro_batches() - 1;  // the chunk's last backward of the step
  const int n = static_cast<int>(ch.blocks.size());
  Tensor dx = ch.head ? head_backward(t.mb, st.head, last) : dout;
  st.head = {};
  GatheredBlock next = gather(ch.blocks[n - 1]);
  for (int i = n - 1; i >= 0; --i) {
    GatheredBlock cur = std::move(next);
    if (i > 0) next = gather(ch.blocks[i - 1]);
    dx = block_backward(ch.blocks[i], get(cur), st.blocks[i], dx, t.mb);
    st.blocks[i] = {};
    if (last) dp_.grads_ready(block_param_list(ch.blocks[i]));
    if (last && ch.blocks[i].moe) expert_dp_->grads_ready(expert_param_list(ch.blocks[i]));
  }
  if (ch.embedding) {
    embed_backward(t.mb, dx, last);
    return Tensor();
  }
  return dx;
}

}  // namespace ranklab::gpt
