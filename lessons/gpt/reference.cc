#include "lessons/gpt/reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>
#include <string>

#include "common/random.h"
#include "lessons/check.h"
#include "lessons/gpt/model.h"
#include "lessons/parallel/expert_parallel.h"

namespace ranklab::gpt {

namespace {
using Vec = std::vector<double>;

// Half the distance between 1 and the next number of `t`: the largest relative rounding error.
double unit_roundoff(DType t) {
  switch (t) {
    case DType::BFloat16:
      return 0x1p-8;
    case DType::Float16:
      return 0x1p-11;
    default:
      return 0x1p-24;
  }
}

// What the run rounds a layer's activations to on their way to a router: the compute dtype, or with FP8
// GEMMs the linear layers' e4m3 inputs (3 mantissa bits: a unit roundoff of 2^-4).
double activation_roundoff(const Config& c) {
  return c.fp8 != parallel::Fp8Recipe::None ? 0x1p-4 : unit_roundoff(c.dtype);
}

// A parameter's gradient as the backward sums it: its values, and beside each element the sum of the
// magnitudes of the terms added into it. A float sum's rounding error is bounded by the unit roundoff times
// the latter, whatever the order of the additions (Higham, "Accuracy and Stability of Numerical
// Algorithms", 2nd ed., 2002, section 4.2: |fl(sum) - sum| <= (n - 1) u sum |x_i| to first order), and so
// is the error of terms each rounded to u relatively (an FP8 GEMM's operands): a gradient that cancels
// (dgamma = sum over tokens of dy xhat, a bias's column sum) is checked against what its terms round, not
// against its own small value.
struct GradSum {
  Vec& value;
  Vec& magnitude;
  void add(std::size_t i, double term) {
    value[i] += term;
    magnitude[i] += std::fabs(term);
  }
  std::size_t size() const { return value.size(); }
};

// y[n, k] = x[n, m] @ w[m, k] (+ b)
Vec mm(const Vec& x, const Vec& w, std::int64_t n, std::int64_t m, std::int64_t k) {
  Vec y(n * k, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < m; ++j) {
      const double a = x[i * m + j];
      for (std::int64_t l = 0; l < k; ++l) y[i * k + l] += a * w[j * k + l];
    }
  }
  return y;
}
// dw[m, k] += x^T dy ; dx[n, m] = dy w^T
void mm_backward(const Vec& x, const Vec& w, const Vec& dy, std::int64_t n, std::int64_t m, std::int64_t k,
                 GradSum dw, Vec* dx) {
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < m; ++j) {
      const double a = x[i * m + j];
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        dw.add(j * k + l, a * dy[i * k + l]);
        s += dy[i * k + l] * w[j * k + l];
      }
      if (dx) (*dx)[i * m + j] = s;
    }
  }
}
void add_bias(Vec& y, const Vec& b, std::int64_t n) {
  const std::int64_t k = static_cast<std::int64_t>(b.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t l = 0; l < k; ++l) y[i * k + l] += b[l];
}
void bias_backward(const Vec& dy, std::int64_t n, GradSum db) {
  const std::int64_t k = static_cast<std::int64_t>(db.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t l = 0; l < k; ++l) db.add(l, dy[i * k + l]);
}

struct Norm {
  Vec y, xhat, rstd;
};
Norm layernorm(const Vec& x, const Vec& g, const Vec& b, std::int64_t n, std::int64_t h) {
  Norm o{Vec(n * h), Vec(n * h), Vec(n)};
  for (std::int64_t i = 0; i < n; ++i) {
    double mean = 0, var = 0;
    for (std::int64_t j = 0; j < h; ++j) mean += x[i * h + j];
    mean /= h;
    for (std::int64_t j = 0; j < h; ++j) var += (x[i * h + j] - mean) * (x[i * h + j] - mean);
    var /= h;
    o.rstd[i] = 1.0 / std::sqrt(var + 1e-5);
    for (std::int64_t j = 0; j < h; ++j) {
      o.xhat[i * h + j] = (x[i * h + j] - mean) * o.rstd[i];
      o.y[i * h + j] = o.xhat[i * h + j] * g[j] + b[j];
    }
  }
  return o;
}
Vec layernorm_backward(const Norm& nm, const Vec& g, const Vec& dy, std::int64_t n, std::int64_t h,
                       GradSum dg, GradSum db) {
  Vec dx(n * h);
  for (std::int64_t i = 0; i < n; ++i) {
    double a = 0, b = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      const double d = dy[i * h + j] * g[j];
      a += d;
      b += d * nm.xhat[i * h + j];
      dg.add(j, dy[i * h + j] * nm.xhat[i * h + j]);
      db.add(j, dy[i * h + j]);
    }
    a /= h;
    b /= h;
    for (std::int64_t j = 0; j < h; ++j) {
      dx[i * h + j] = nm.rstd[i] * (dy[i * h + j] * g[j] - a - nm.xhat[i * h + j] * b);
    }
  }
  return dx;
}

// RMSNorm: y = xhat g with xhat = x rstd, rstd = 1 / sqrt(mean(x^2) + eps).
Norm rmsnorm(const Vec& x, const Vec& g, std::int64_t n, std::int64_t h) {
  Norm o{Vec(n * h), Vec(n * h), Vec(n)};
  for (std::int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (std::int64_t j = 0; j < h; ++j) ss += x[i * h + j] * x[i * h + j];
    o.rstd[i] = 1.0 / std::sqrt(ss / h + 1e-5);
    for (std::int64_t j = 0; j < h; ++j) {
      o.xhat[i * h + j] = x[i * h + j] * o.rstd[i];
      o.y[i * h + j] = o.xhat[i * h + j] * g[j];
    }
  }
  return o;
}
Vec rmsnorm_backward(const Norm& nm, const Vec& g, const Vec& dy, std::int64_t n, std::int64_t h,
                     GradSum dg) {
  Vec dx(n * h);
  for (std::int64_t i = 0; i < n; ++i) {
    double b = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      b += dy[i * h + j] * g[j] * nm.xhat[i * h + j];
      dg.add(j, dy[i * h + j] * nm.xhat[i * h + j]);
    }
    b /= h;
    for (std::int64_t j = 0; j < h; ++j)
      dx[i * h + j] = nm.rstd[i] * (dy[i * h + j] * g[j] - nm.xhat[i * h + j] * b);
  }
  return dx;
}

// The llama block's gated unit of gate a and value b: y = act(a') (b' + offset), act(x) = x sigmoid(alpha x),
// with a' = min(a, limit) and b' = b clamped to [-limit, limit] where a limit is set; and dy/da, dy/db (zero
// where a clamp holds its input).
struct Glu {
  double y, dgate, dvalue;
};

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
double gelu(double u) {
  return 0.5 * u * (1 + std::tanh(kGeluC * (u + 0.044715 * u * u * u)));
}
double gelu_grad(double u) {
  const double t = std::tanh(kGeluC * (u + 0.044715 * u * u * u));
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * kGeluC * (1 + 3 * 0.044715 * u * u);
}

// What a block's forward keeps for its backward.
struct BlockActs {
  Norm ln1, ln2;                // the two norms' outputs and statistics
  Norm qn, kn;                  // QK-norm's, of every q head's and every group's k (rows of hd features)
  Vec qkv, att;                 // qkv's output (llama: rotated); attention's, the heads side by side
  std::vector<Vec> probs;       // attention's probabilities per (sample, head): S x S, causal
  std::vector<Vec> sink_probs;  // with sinks: each query's sink probability per (sample, head)
  Vec u, g;                     // fc1's output and its gelu (llama: w13's and its swiglu)
  // A MoE layer: each token's top-k experts and gates, and per route (token-major, k per token) the
  // expert's w_in output, its activation and the expert's output.
  std::vector<int> chosen;
  std::vector<char> kept;  // whether the route was under its expert's capacity
  Vec gates;
  Vec probs_all;  // [n, E]: every expert's score over their sum, which the load-balancing loss weighs
  // d score / d logit over the score: of each route, and of each token's every expert (1 for the softmax,
  // 1 - s for a sigmoid score s).
  Vec slope, probs_slope;
  std::vector<Vec> route_u, route_g, route_out;
};

// The reference's training run: the sizes in the notation of the comments, the parameters with Adam's
// moments, and the data. The parameters are the blocks' first (layer-major), then the others (OtherParam).
// A step (step()) is the forward of the whole batch, its backward, and AdamW on every parameter.
class Training {
 public:
  // At the initial values (the seeded ones the lesson starts from too), or at `start`.
  // `routes`: the run's routing (Reference::step).
  explicit Training(const Config& c, const Reference::State* start = nullptr,
                    const Reference::Routes* routes = nullptr);
  // Returns the step's loss (the mean over its tokens, before the update) and leaves its gradients in `g`
  // and, beside each element, the sum of its terms' magnitudes in `magnitude` (GradSum).
  double step(int step, std::vector<Vec>& g, std::vector<Vec>& magnitude);
  Reference::State state() const { return {w_, m_, v_}; }
  const Reference::RoutingAgreement& routing() const { return routing_; }
  // Reference::softmax_shift: q and k each rounded to the activations' precision move a score by up to
  // 2 u sum |q_d k_d|, the output layer's input and weight each rounded to the compute dtype (it stays in
  // 16 bits) a logit by up to 2 u sum |y_j w_j|.
  double softmax_shift() const {
    return std::max(2 * activation_roundoff(c_) * score_magnitude_,
                    2 * unit_roundoff(c_.dtype) * logit_magnitude_);
  }

 private:
  const Vec& block_weight(int layer, int k) const { return w_[layer * nb_ + k]; }
  bool has(int layer, int k) const { return has_block_param(c_, layer, k); }
  // A MoE layer's router (kind kRouterKind) or expert weight (expert_kind).
  int moe_index(int layer, int kind) const { return moe_ + layer * moe_kinds(c_) + (kind - kRouterKind); }
  const Vec& other_weight(OtherParam k) const { return w_[other_ + k]; }
  // Parameter `index`'s gradient in `g` with its magnitudes, for the backward to add into.
  GradSum grad(std::vector<Vec>& g, int index) const { return {g[index], magnitude_[index]}; }

  // ---- forward
  Vec embed() const;
  Vec block_forward(int step, int layer, const Vec& x, BlockActs& a) const;
  Vec llama_forward(int step, int layer, const Vec& x, BlockActs& a) const;
  // Rotary embeddings on qkv's q heads and each group's k, by each row's position; `inverse` rotates back.
  void rope(Vec& qkv, bool inverse) const;
  // The column of element d of head `head`'s q (part 0), or of its group's k (1) or v (2).
  std::int64_t col(std::int64_t head, int part, std::int64_t d) const {
    const std::int64_t group = head / per_, first = group * (per_ + 2);
    return (part == 0 ? first + head % per_ : first + per_ + part - 1) * hd + d;
  }
  // QK-norm: every row's q heads and k heads (parts 0 and 1) RMS-normalised over their hd features; the
  // backward adds the gains' gradients and turns d qkv into the gradient of its input.
  void qk_norm(BlockActs& a, int layer) const;
  void qk_norm_backward(const BlockActs& a, int layer, Vec& dqkv, std::vector<Vec>& g) const;
  // Where in qkv element k of the rows of hd features of part `part` lies (0: q, a row per token and head; 1:
  // k, per token and group), for every k: those rows out of qkv and back are a gather and a scatter.
  std::vector<std::int64_t> qk_rows(int part) const;
  // Layer `layer`'s attention: its window and its sinks.
  void attention(BlockActs& a, int layer) const;
  void attention_head(BlockActs& a, std::int64_t b, std::int64_t head, int layer) const;
  // The first key query i sees in layer `layer`.
  std::int64_t first_key(int layer, std::int64_t i) const {
    const std::int64_t w = c_.window(layer);
    return w > 0 && i >= w ? i - w + 1 : 0;
  }
  // A MoE layer's MLP on y [n, h]: each token's top-k experts by the router's logits, their outputs weighted
  // by the softmax over the chosen logits; its backward adds the router's and the experts' gradients.
  Vec moe_forward(int layer, const Vec& y, BlockActs& a) const;
  Vec moe_backward(int layer, const Vec& y, const BlockActs& a, const Vec& dout, std::vector<Vec>& g) const;
  // Token t's experts as the run chose them (`chosen`, k of them) against the reference's `order` of its
  // logits `l`: each chosen expert's logit at least the k-th largest less the run's rounding bound.
  void judge_route(int layer, std::int64_t t, const Vec& y, const double* l, const std::vector<int>& order,
                   const int* chosen) const;
  // With a capacity: each expert kept as many of a rank's routes as its capacity lets it, those of the
  // highest gates (the run's drops, judged against the reference's gates).
  void judge_drops(int layer, const BlockActs& a) const;
  // The load-balancing loss's gradient by the logits (Config::aux_loss_coeff), added into `dlogits`.
  void add_load_balancing(const BlockActs& a, Vec& dlogits) const;
  std::int64_t routing_group(std::int64_t t) const;
  Glu glu(double a, double b) const {
    const double alpha = c_.quick_geglu ? 1.702 : 1.0, limit = c_.activation_func_clamp_value;
    const bool gate_free = !(limit > 0 && a > limit), value_free = !(limit > 0 && std::fabs(b) > limit);
    const double g = gate_free ? a : limit,
                 v = (value_free ? b : std::copysign(limit, b)) + c_.glu_linear_offset;
    const double s = 1 / (1 + std::exp(-alpha * g));
    return {g * s * v, gate_free ? v * s * (1 + alpha * g * (1 - s)) : 0.0, value_free ? g * s : 0.0};
  }
  // An expert's activation (gelu, or llama's gated unit of adjacent pairs) and its backward.
  Vec expert_act(const Vec& u) const;
  Vec expert_act_backward(const Vec& u, const Vec& dg) const;
  // The loss summed over the tokens; `dlogits` becomes the loss's gradient by the logits (of the mean).
  double head_forward(const Norm& lnf, Vec& dlogits) const;
  // The residual dropout at `site` (0 after attention, 1 after the MLP) of `layer`, on a [n, h] branch or
  // its gradient.
  void drop(Vec& branch, int step, int layer, int site) const;

  // ---- backward: each adds its parameters' gradients into `g` and returns its input's gradient
  Vec head_backward(const Norm& lnf, const Vec& dlogits, std::vector<Vec>& g) const;
  Vec block_backward(int step, int layer, const BlockActs& a, const Vec& dx, std::vector<Vec>& g) const;
  Vec llama_backward(int step, int layer, const BlockActs& a, const Vec& dx, std::vector<Vec>& g) const;
  Vec attention_backward(const BlockActs& a, const Vec& datt, int layer, std::vector<Vec>& g) const;
  void attention_head_backward(const BlockActs& a, const Vec& datt, int layer, std::vector<Vec>& g,
                               std::int64_t b, std::int64_t head, Vec& dqkv) const;
  void embed_backward(const Vec& dx, std::vector<Vec>& g) const;

  // ---- the optimizer
  void adamw(int step, std::vector<Vec>& g);

  const Config& c_;
  // sequences, positions, features, vocabulary, heads; features per head, tokens (B S), blocks; key-value
  // heads, q heads per key-value head, qkv's columns, the MLP's width; the block's parameters
  const std::int64_t B, S, h, V, H, hd, n, L, G, per_, qkv_cols_, F;
  const int nb_;
  const double scale_;     // attention's 1 / sqrt(hd)
  const int E_, K_;        // experts and top-k (0 and 0 without)
  const std::int64_t Fe_;  // each expert's width
  const int other_;        // the index of the first that is not a block's
  const int moe_;          // the index of the first MoE parameter (Reference::index)
  const int count_;        // the parameters
  std::vector<parallel::ParamSpec> specs_;
  std::vector<Vec> w_, m_, v_;           // the parameters and Adam's two moments
  mutable std::vector<Vec> magnitude_;   // the step's gradients' sums of magnitudes (GradSum)
  std::vector<std::int64_t> tok_, tgt_;  // the inputs and the next tokens, row = sample * S + position
  const Reference::Routes* routes_;
  mutable Reference::RoutingAgreement routing_;
  // The largest sum of its products' magnitudes of any attention score (scaled as the score) and of any
  // logit: what their rounding is relative to (softmax_shift).
  mutable double score_magnitude_ = 0, logit_magnitude_ = 0;
};

Training::Training(const Config& c, const Reference::State* start, const Reference::Routes* routes)
    : c_(c),
      B(c.global_batch),
      S(c.seq),
      h(c.hidden),
      V(c.vocab),
      H(c.heads),
      hd(c.head_dim()),
      n(B * S),
      L(c.layers),
      G(c.kv()),
      per_(H / G),
      qkv_cols_((H + 2 * G) * hd),
      F(c.ffn()),
      nb_(block_params(c)),
      scale_(1.0 / std::sqrt(static_cast<double>(hd))),
      E_(c.experts),
      K_(c.moe() ? c.top_k : 0),
      Fe_(c.moe_ffn()),
      other_(static_cast<int>(L * nb_)),
      moe_(other_ + kOtherParams),
      count_(static_cast<int>(moe_ + (c.moe() ? L * moe_kinds(c) : 0))),
      specs_(count_),
      w_(count_),
      m_(count_),
      v_(count_),
      tok_(n),
      tgt_(n),
      routes_(routes) {
  for (int l = 0; l < L; ++l) {
    // A MoE layer's MLP parameters stay empty; its router and experts have their own.
    for (int k = 0; k < nb_; ++k)
      if (has_block_param(c_, l, k)) specs_[l * nb_ + k] = block_spec(c_, l, k);
    if (!c_.moe_layer(l)) continue;
    for (int kind = kRouterKind; kind < kRouterKind + moe_kinds(c_); ++kind)
      specs_[moe_index(l, kind)] = param_spec(c_, {kind, l});
  }
  for (int k = 0; k < kOtherParams; ++k) {
    // A parameter the block does not have stays empty.
    if (has_other(c_, static_cast<OtherParam>(k)))
      specs_[other_ + k] = other_spec(c_, static_cast<OtherParam>(k));
  }
  if (start) {
    w_ = start->w, m_ = start->m, v_ = start->v;
  } else {
    for (int i = 0; i < count_; ++i) {
      const parallel::ParamSpec& spec = specs_[i];
      const std::int64_t size = spec.full.numel();
      w_[i].resize(size);
      for (std::int64_t e = 0; e < size; ++e)
        w_[i][e] = spec.std > 0 ? static_cast<double>(spec.std * normal_at(spec.seed, e)) : spec.value;
      m_[i].assign(size, 0.0);
      v_[i].assign(size, 0.0);
    }
  }
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      tok_[b * S + s] = token(c_, b, s);
      tgt_[b * S + s] = token(c_, b, s + 1);
    }
  }
}

double Training::step(int step, std::vector<Vec>& g, std::vector<Vec>& magnitude) {
  Vec x = embed();
  std::vector<BlockActs> acts(L);
  for (int l = 0; l < L; ++l)
    x = c_.llama() ? llama_forward(step, l, x, acts[l]) : block_forward(step, l, x, acts[l]);
  const Norm lnf = c_.llama() ? rmsnorm(x, other_weight(kLnfG), n, h)
                              : layernorm(x, other_weight(kLnfG), other_weight(kLnfB), n, h);
  Vec dlogits(n * V);
  const double loss = head_forward(lnf, dlogits) / static_cast<double>(n);

  g.assign(count_, Vec());
  for (int i = 0; i < count_; ++i) g[i].assign(w_[i].size(), 0.0);
  magnitude_ = g;
  Vec dx = head_backward(lnf, dlogits, g);
  for (int l = static_cast<int>(L) - 1; l >= 0; --l) {
    dx = c_.llama() ? llama_backward(step, l, acts[l], dx, g) : block_backward(step, l, acts[l], dx, g);
  }
  embed_backward(dx, g);

  adamw(step, g);
  magnitude = std::move(magnitude_);
  return loss;
}

// ---- forward

// x = wte[token] + wpe[position] (llama: wte[token])
Vec Training::embed() const {
  const Vec &wte = other_weight(kWte), &wpe = other_weight(kWpe);
  Vec x(n * h);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < h; ++j)
      x[i * h + j] = wte[tok_[i] * h + j] + (c_.llama() ? 0.0 : wpe[(i % S) * h + j]);
  return x;
}

// x1 = x + wo(attention(rope(wqkv(rmsnorm1(x))))); returns x1 + w2(swiglu(w13(rmsnorm2(x1))))
Vec Training::llama_forward(int step, int layer, const Vec& x, BlockActs& a) const {
  auto W = [&](int k) -> const Vec& { return block_weight(layer, k); };
  a.ln1 = rmsnorm(x, W(kNorm1), n, h);
  a.qkv = mm(a.ln1.y, W(kWqkv), n, h, qkv_cols_);
  if (has(layer, kBqkv)) add_bias(a.qkv, W(kBqkv), n);
  if (c_.qk_layernorm) qk_norm(a, layer);
  rope(a.qkv, false);
  attention(a, layer);
  Vec proj = mm(a.att, W(kWo), n, H * hd, h);
  if (has(layer, kBo)) add_bias(proj, W(kBo), n);
  drop(proj, step, layer, 0);
  Vec x1 = x;
  for (std::int64_t i = 0; i < n * h; ++i) x1[i] += proj[i];
  a.ln2 = rmsnorm(x1, W(kNorm2), n, h);
  Vec o(n * h, 0.0);
  const std::int64_t f = c_.dense_ffn(layer);  // the dense MLP's, or a MoE layer's shared experts'
  if (f > 0) {
    a.u = mm(a.ln2.y, W(kW13), n, h, 2 * f);
    if (has(layer, kB13)) add_bias(a.u, W(kB13), n);
    a.g = expert_act(a.u);
    o = mm(a.g, W(kW2), n, f, h);
    if (has(layer, kB2)) add_bias(o, W(kB2), n);
  }
  if (c_.moe_layer(layer)) {
    const Vec routed = moe_forward(layer, a.ln2.y, a);
    for (std::int64_t i = 0; i < n * h; ++i) o[i] += routed[i];
  }
  drop(o, step, layer, 1);
  Vec x2 = x1;
  for (std::int64_t i = 0; i < n * h; ++i) x2[i] += o[i];
  return x2;
}

// The pairs (d, d + hd / 2) of each q head and each group's k, rotated by position * theta^(-2d / hd).
void Training::rope(Vec& qkv, bool inverse) const {
  const std::int64_t half = hd / 2;
  Vec frequency(half), cs(half), sn(half);
  for (std::int64_t d = 0; d < half; ++d)
    frequency[d] = std::pow(c_.rope_theta, -2.0 * static_cast<double>(d) / static_cast<double>(hd));
  for (std::int64_t i = 0; i < n; ++i) {
    const double pos = static_cast<double>(i % S);
    for (std::int64_t d = 0; d < half; ++d) {
      cs[d] = std::cos(pos * frequency[d]);
      sn[d] = inverse ? -std::sin(pos * frequency[d]) : std::sin(pos * frequency[d]);
    }
    for (std::int64_t head = 0; head < H + G; ++head) {
      const std::int64_t first = head < H ? col(head, 0, 0) : col((head - H) * per_, 1, 0);
      for (std::int64_t d = 0; d < half; ++d) {
        double& x1 = qkv[i * qkv_cols_ + first + d];
        double& x2 = qkv[i * qkv_cols_ + first + d + half];
        const double a = x1, b = x2;
        x1 = a * cs[d] - b * sn[d];
        x2 = b * cs[d] + a * sn[d];
      }
    }
  }
}

// x1 = x + dropout(proj(attention(qkv(layernorm1(x))))); returns x1 + dropout(fc2(gelu(fc1(layernorm2(x1)))))
Vec Training::block_forward(int step, int layer, const Vec& x, BlockActs& a) const {
  auto W = [&](int k) -> const Vec& { return block_weight(layer, k); };
  a.ln1 = layernorm(x, W(kLn1G), W(kLn1B), n, h);
  a.qkv = mm(a.ln1.y, W(kQkvW), n, h, 3 * h);
  add_bias(a.qkv, W(kQkvB), n);
  attention(a, layer);
  Vec proj = mm(a.att, W(kProjW), n, h, h);
  add_bias(proj, W(kProjB), n);
  drop(proj, step, layer, 0);
  Vec x1 = x;
  for (std::int64_t i = 0; i < n * h; ++i) x1[i] += proj[i];

  a.ln2 = layernorm(x1, W(kLn2G), W(kLn2B), n, h);
  Vec o;
  if (c_.moe_layer(layer)) {
    o = moe_forward(layer, a.ln2.y, a);
  } else {
    a.u = mm(a.ln2.y, W(kFc1W), n, h, 4 * h);
    add_bias(a.u, W(kFc1B), n);
    a.g = expert_act(a.u);
    o = mm(a.g, W(kFc2W), n, 4 * h, h);
    add_bias(o, W(kFc2B), n);
  }
  drop(o, step, layer, 1);
  Vec x2 = x1;
  for (std::int64_t i = 0; i < n * h; ++i) x2[i] += o[i];
  return x2;
}

std::vector<std::int64_t> Training::qk_rows(int part) const {
  const std::int64_t heads = part == 0 ? H : G;
  std::vector<std::int64_t> at(n * heads * hd);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < heads; ++j)
      for (std::int64_t d = 0; d < hd; ++d)
        at[(i * heads + j) * hd + d] = i * qkv_cols_ + col(part == 0 ? j : j * per_, part, d);
  return at;
}

// The rows of each part normalised (or, backward, their gradient taken back through the norm) in place.
void Training::qk_norm(BlockActs& a, int layer) const {
  for (int part : {0, 1}) {
    const std::vector<std::int64_t> at = qk_rows(part);
    Vec rows(at.size());
    for (std::size_t k = 0; k < at.size(); ++k) rows[k] = a.qkv[at[k]];
    Norm& norm = part == 0 ? a.qn : a.kn;
    norm = rmsnorm(rows, block_weight(layer, part == 0 ? kQNorm : kKNorm), at.size() / hd, hd);
    for (std::size_t k = 0; k < at.size(); ++k) a.qkv[at[k]] = norm.y[k];
  }
}

void Training::qk_norm_backward(const BlockActs& a, int layer, Vec& dqkv, std::vector<Vec>& g) const {
  for (int part : {0, 1}) {
    const std::vector<std::int64_t> at = qk_rows(part);
    const int gain = part == 0 ? kQNorm : kKNorm;
    Vec dy(at.size());
    for (std::size_t k = 0; k < at.size(); ++k) dy[k] = dqkv[at[k]];
    const Vec dx = rmsnorm_backward(part == 0 ? a.qn : a.kn, block_weight(layer, gain), dy, at.size() / hd,
                                    hd, grad(g, layer * nb_ + gain));
    for (std::size_t k = 0; k < at.size(); ++k) dqkv[at[k]] = dx[k];
  }
}

void Training::attention(BlockActs& a, int layer) const {
  a.att.assign(n * H * hd, 0.0);
  a.probs.assign(B * H, Vec(S * S, 0.0));
  if (c_.attention_sinks) a.sink_probs.assign(B * H, Vec(S, 0.0));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t head = 0; head < H; ++head) attention_head(a, b, head, layer);
}

// softmax(q k^T / sqrt(hd)) v over the positions up to each query's (from its window's start), for sample
// b's head `head`; a sink is one more logit in the softmax, of no value. qkv's columns are per head: q, k,
// v of head 0, then of head 1, ...
void Training::attention_head(BlockActs& a, std::int64_t b, std::int64_t head, int layer) const {
  Vec& p = a.probs[b * H + head];
  auto qkv = [&](std::int64_t s, int part, std::int64_t d) {
    return a.qkv[(b * S + s) * qkv_cols_ + col(head, part, d)];
  };
  const bool sinks = c_.attention_sinks;
  const double sink = sinks ? block_weight(layer, kSinks)[head] : 0.0;
  for (std::int64_t i = 0; i < S; ++i) {
    const std::int64_t lo = first_key(layer, i);
    double mx = sinks ? sink : -1e300;
    for (std::int64_t j = lo; j <= i; ++j) {
      double sc = 0, magnitude = 0;
      for (std::int64_t d = 0; d < hd; ++d) {
        sc += qkv(i, 0, d) * qkv(j, 1, d);
        magnitude += std::fabs(qkv(i, 0, d) * qkv(j, 1, d));
      }
      score_magnitude_ = std::max(score_magnitude_, magnitude * scale_);
      p[i * S + j] = sc * scale_;
      mx = std::max(mx, p[i * S + j]);
    }
    double sum = sinks ? std::exp(sink - mx) : 0.0;
    for (std::int64_t j = lo; j <= i; ++j) sum += (p[i * S + j] = std::exp(p[i * S + j] - mx));
    for (std::int64_t j = lo; j <= i; ++j) p[i * S + j] /= sum;
    if (sinks) a.sink_probs[b * H + head][i] = std::exp(sink - mx) / sum;
    for (std::int64_t d = 0; d < hd; ++d) {
      double o = 0;
      for (std::int64_t j = lo; j <= i; ++j) o += p[i * S + j] * qkv(j, 2, d);
      a.att[(b * S + i) * H * hd + head * hd + d] = o;
    }
  }
}

// logits = layernorm_f(x) @ wte^T; the loss is the cross-entropy of each token's next.
double Training::head_forward(const Norm& lnf, Vec& dlogits) const {
  const Vec& wte = other_weight(c_.llama() ? kOutput : kWte);
  double loss = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double mx = -1e300;
    for (std::int64_t t = 0; t < V; ++t) {
      double z = 0, magnitude = 0;
      for (std::int64_t j = 0; j < h; ++j) {
        z += lnf.y[i * h + j] * wte[t * h + j];
        magnitude += std::fabs(lnf.y[i * h + j] * wte[t * h + j]);
      }
      logit_magnitude_ = std::max(logit_magnitude_, magnitude);
      dlogits[i * V + t] = z;
      mx = std::max(mx, z);
    }
    double sum = 0;
    for (std::int64_t t = 0; t < V; ++t) sum += std::exp(dlogits[i * V + t] - mx);
    loss += std::log(sum) + mx - dlogits[i * V + tgt_[i]];
    for (std::int64_t t = 0; t < V; ++t) {
      dlogits[i * V + t] =
          (std::exp(dlogits[i * V + t] - mx) / sum - (t == tgt_[i] ? 1.0 : 0.0)) / static_cast<double>(n);
    }
  }
  return loss;
}

// The element of sample b, position s is row s * micro_batch + b % micro_batch of the (b / micro_batch)-th
// micro-batch: the lesson's mask of that row (dropout_row).
void Training::drop(Vec& branch, int step, int layer, int site) const {
  if (c_.dropout == 0) return;
  const std::uint64_t seed = dropout_seed(step, layer, site);
  const double kept = 1.0 / (1.0 - static_cast<double>(c_.dropout));
  const std::int64_t mb = c_.micro_batch;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t b = i / S, s = i % S, row = dropout_row(c_, b / mb, s * mb + b % mb);
    for (std::int64_t j = 0; j < h; ++j)
      branch[i * h + j] *= dropout_keeps(seed, row, j, c_.dropout) ? kept : 0.0;
  }
}

// gelu(u), or for the llama block silu(u[2i]) u[2i + 1]
Vec Training::expert_act(const Vec& u) const {
  if (!c_.llama()) {
    Vec g = u;
    for (double& e : g) e = gelu(e);
    return g;
  }
  Vec g(u.size() / 2);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = glu(u[2 * i], u[2 * i + 1]).y;
  return g;
}

Vec Training::expert_act_backward(const Vec& u, const Vec& dg) const {
  Vec du(u.size());
  if (!c_.llama()) {
    for (std::size_t i = 0; i < u.size(); ++i) du[i] = dg[i] * gelu_grad(u[i]);
    return du;
  }
  for (std::size_t i = 0; i < dg.size(); ++i) {
    const Glu e = glu(u[2 * i], u[2 * i + 1]);
    du[2 * i] = dg[i] * e.dgate;
    du[2 * i + 1] = dg[i] * e.dvalue;
  }
  return du;
}

Vec Training::moe_forward(int layer, const Vec& y, BlockActs& a) const {
  Vec logits = mm(y, w_[moe_index(layer, kRouterKind)], n, h, E_);
  if (c_.add_bias_linear) add_bias(logits, w_[moe_index(layer, router_bias_kind(c_))], n);
  const std::int64_t win = c_.llama() ? 2 * Fe_ : Fe_;
  a.chosen.assign(n * K_, 0);
  a.kept.assign(n * K_, 1);
  a.probs_all.assign(n * E_, 0.0);
  a.slope.assign(n * K_, 1.0);
  a.probs_slope.assign(n * E_, 1.0);
  const bool sigmoid = c_.router_score == parallel::RouterScore::Sigmoid;
  a.gates.assign(n * K_, 0.0);
  a.route_u.assign(n * K_, Vec());
  a.route_g.assign(n * K_, Vec());
  a.route_out.assign(n * K_, Vec());
  Vec out(n * h, 0.0);
  std::vector<int> order(E_);
  const std::vector<int>* given =
      routes_ != nullptr && !(*routes_)[layer].empty() ? &(*routes_)[layer] : nullptr;
  for (std::int64_t t = 0; t < n; ++t) {
    const double* l = &logits[t * E_];
    const double most = *std::max_element(l, l + E_);
    // An expert's score: exp (the softmax's, before its sum) or the sigmoid.
    auto s = [&](int e) { return sigmoid ? 1 / (1 + std::exp(-l[e])) : std::exp(l[e] - most); };
    double all = 0;
    for (int e = 0; e < E_; ++e) all += s(e);
    for (int e = 0; e < E_; ++e) {
      a.probs_all[t * E_ + e] = s(e) / all;
      if (sigmoid) a.probs_slope[t * E_ + e] = 1 - s(e);
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int i, int j) { return l[i] > l[j]; });
    std::vector<char> kept(K_, 1);
    if (given != nullptr) {
      // The run's experts; a dropped one comes as -1 - e.
      std::vector<int> ids(K_);
      for (int j = 0; j < K_; ++j) {
        const int g = (*given)[t * K_ + j];
        ids[j] = g >= 0 ? g : -1 - g;
        kept[j] = g >= 0;
      }
      judge_route(layer, t, y, l, order, ids.data());
      std::copy(ids.begin(), ids.end(), order.begin());
    }
    double sum = 0;
    for (int j = 0; j < K_; ++j) sum += s(order[j]);
    const Vec row(y.begin() + t * h, y.begin() + (t + 1) * h);
    for (int j = 0; j < K_; ++j) {
      const std::int64_t at = t * K_ + j;
      const int e = order[j];
      a.chosen[at] = e;
      a.kept[at] = kept[j];
      a.gates[at] = s(e) / sum;
      if (sigmoid) a.slope[at] = 1 - s(e);
      if (!kept[j]) continue;  // over its expert's capacity: the token keeps the residual for it
      a.route_u[at] = mm(row, w_[moe_index(layer, expert_kind(e, 0))], 1, h, win);
      if (c_.add_bias_linear) add_bias(a.route_u[at], w_[moe_index(layer, expert_bias_kind(c_, e, 0))], 1);
      a.route_g[at] = expert_act(a.route_u[at]);
      a.route_out[at] = mm(a.route_g[at], w_[moe_index(layer, expert_kind(e, 1))], 1, Fe_, h);
      if (c_.add_bias_linear) add_bias(a.route_out[at], w_[moe_index(layer, expert_bias_kind(c_, e, 1))], 1);
      for (std::int64_t d = 0; d < h; ++d) out[t * h + d] += a.gates[at] * a.route_out[at][d];
    }
  }
  if (given != nullptr && c_.capacity_factor > 0) judge_drops(layer, a);
  return out;
}

// The rank that routed token t (row sample * S + position) and its micro-batch: the tokens an expert's
// capacity counts (ExpertParallel routes each rank's tokens of a micro-batch on their own).
std::int64_t Training::routing_group(std::int64_t t) const {
  const std::int64_t sample = t / S, position = t % S, per_dp = B / c_.dp;
  const std::int64_t dp = sample / per_dp, mb = sample % per_dp / c_.micro_batch;
  const std::int64_t chunk_len = c_.cp_chunk(), chunk = c_.cp > 1 ? position / chunk_len : 0;
  const std::int64_t cp = c_.cp > 1 ? (chunk < c_.cp ? chunk : 2 * c_.cp - 1 - chunk) : 0;
  const std::int64_t local = c_.cp > 1
                                 ? (chunk < c_.cp ? position - cp * chunk_len
                                                  : chunk_len + position - (2 * c_.cp - 1 - cp) * chunk_len)
                                 : position;
  const std::int64_t row = local * c_.micro_batch + sample % c_.micro_batch;
  const std::int64_t tp = c_.seq_parallel ? row / c_.local_rows() : 0;
  return ((dp * c_.micro_batches() + mb) * c_.cp + cp) * c_.tp + tp;
}

// The load-balancing loss, the mean over the groups of a rank's tokens of a micro-batch of
// E / (k T^2) sum over experts i of (sum over the group's tokens of p_ti) c_i (c_i: the group's routes chosen
// for expert i, a count), times the coefficient: its gradient by the logits into `dlogits`.
void Training::add_load_balancing(const BlockActs& a, Vec& dlogits) const {
  const std::int64_t T = c_.local_rows(), groups = n / T;
  std::map<std::int64_t, std::vector<double>> chosen;  // by group: each expert's count
  for (std::int64_t at = 0; at < n * K_; ++at) {
    std::vector<double>& counts = chosen[routing_group(at / K_)];
    counts.resize(E_, 0.0);
    counts[a.chosen[at]] += 1;
  }
  const double weight = c_.aux_loss_coeff / static_cast<double>(groups);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::vector<double>& counts = chosen[routing_group(t)];
    const double* p = &a.probs_all[t * E_];
    auto g = [&](int i) { return E_ * counts[i] / (K_ * static_cast<double>(T) * T); };
    double mean = 0;
    for (int i = 0; i < E_; ++i) mean += p[i] * g(i);
    for (int j = 0; j < E_; ++j)
      dlogits[t * E_ + j] += weight * p[j] * a.probs_slope[t * E_ + j] * (g(j) - mean);
  }
}

void Training::judge_drops(int layer, const BlockActs& a) const {
  const std::int64_t capacity = parallel::expert_capacity(c_.local_rows(), E_, K_, c_.capacity_factor);
  struct Load {
    std::int64_t routes = 0, kept = 0;
    double lowest_kept = INFINITY, highest_dropped = -INFINITY;
  };
  std::map<std::pair<std::int64_t, int>, Load> loads;  // by (group, expert)
  for (std::int64_t at = 0; at < n * K_; ++at) {
    Load& load = loads[{routing_group(at / K_), a.chosen[at]}];
    ++load.routes;
    if (a.kept[at]) {
      ++load.kept;
      load.lowest_kept = std::min(load.lowest_kept, a.gates[at]);
    } else {
      load.highest_dropped = std::max(load.highest_dropped, a.gates[at]);
    }
  }
  // A gate is a softmax of logits the run rounds: within 16 unit roundoffs of the reference's.
  const double bound = 16 * activation_roundoff(c_);
  for (const auto& [key, load] : loads) {
    const bool count_wrong = load.kept != std::min(load.routes, capacity);
    const double over = load.highest_dropped - load.lowest_kept;
    if (!count_wrong && over <= 0) continue;
    const bool decisive = count_wrong || over > bound;
    (decisive ? routing_.decisive : routing_.close_calls) += 1;
    if (decisive || routing_.decisive == 0) {
      routing_.where = fmt::format(
          "layer {}, expert {}, group {} of a rank's tokens (a rank's micro-batch): kept {} of its {} routes "
          "(capacity {}); "
          "its lowest kept gate {:.6g}, its highest dropped {:.6g}; the rounding allows {:.3g}",
          layer, key.second, key.first, load.kept, load.routes, capacity, load.lowest_kept,
          load.highest_dropped, bound);
    }
  }
}

Vec Training::moe_backward(int layer, const Vec& y, const BlockActs& a, const Vec& dout,
                           std::vector<Vec>& g) const {
  const std::int64_t win = c_.llama() ? 2 * Fe_ : Fe_;
  Vec dy(n * h, 0.0), dlogits(n * E_, 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    const Vec row(y.begin() + t * h, y.begin() + (t + 1) * h);
    const Vec dout_t(dout.begin() + t * h, dout.begin() + (t + 1) * h);
    Vec dgate(K_, 0.0);
    double weighted = 0;
    for (int j = 0; j < K_; ++j) {
      const std::int64_t at = t * K_ + j;
      const int e = a.chosen[at];
      if (!a.kept[at]) continue;  // no output, so no gradient of its own (its gate still shares the softmax)
      for (std::int64_t d = 0; d < h; ++d) dgate[j] += dout_t[d] * a.route_out[at][d];
      weighted += a.gates[at] * dgate[j];
      Vec dexpert(h);
      for (std::int64_t d = 0; d < h; ++d) dexpert[d] = a.gates[at] * dout_t[d];
      Vec dg(Fe_);
      if (c_.add_bias_linear)
        bias_backward(dexpert, 1, grad(g, moe_index(layer, expert_bias_kind(c_, e, 1))));
      mm_backward(a.route_g[at], w_[moe_index(layer, expert_kind(e, 1))], dexpert, 1, Fe_, h,
                  grad(g, moe_index(layer, expert_kind(e, 1))), &dg);
      const Vec du = expert_act_backward(a.route_u[at], dg);
      if (c_.add_bias_linear) bias_backward(du, 1, grad(g, moe_index(layer, expert_bias_kind(c_, e, 0))));
      Vec drow(h);
      mm_backward(row, w_[moe_index(layer, expert_kind(e, 0))], du, 1, h, win,
                  grad(g, moe_index(layer, expert_kind(e, 0))), &drow);
      for (std::int64_t d = 0; d < h; ++d) dy[t * h + d] += drow[d];
    }
    // The chosen scores over their sum: d l_e = gate_e slope_e (dgate_e - sum_j gate_j dgate_j).
    for (int j = 0; j < K_; ++j) {
      const std::int64_t at = t * K_ + j;
      dlogits[t * E_ + a.chosen[at]] = a.gates[at] * a.slope[at] * (dgate[j] - weighted);
    }
  }
  if (c_.aux_loss_coeff > 0) add_load_balancing(a, dlogits);
  if (c_.add_bias_linear) bias_backward(dlogits, n, grad(g, moe_index(layer, router_bias_kind(c_))));
  Vec drouter_dy(n * h);
  mm_backward(y, w_[moe_index(layer, kRouterKind)], dlogits, n, h, E_, grad(g, moe_index(layer, kRouterKind)),
              &drouter_dy);
  for (std::int64_t i = 0; i < n * h; ++i) dy[i] += drouter_dy[i];
  return dy;
}

void Training::judge_route(int layer, std::int64_t t, const Vec& y, const double* l,
                           const std::vector<int>& order, const int* chosen) const {
  ++routing_.tokens;
  std::vector<int> mine(order.begin(), order.begin() + K_), theirs(chosen, chosen + K_);
  std::sort(mine.begin(), mine.end());
  std::sort(theirs.begin(), theirs.end());
  if (mine == theirs) return;
  // The run's logit of an expert is off by its rounding of y (and of the router's column): a dot product
  // of h terms each off by up to a unit roundoff, independently, is off by about u |y| |w| / sqrt(h); 16
  // of that covers the activations' rounding through the layers before (FP8's, with FP8 GEMMs there).
  const Vec& router = w_[moe_index(layer, kRouterKind)];
  double y_norm = 0, w_norm = 0;
  for (std::int64_t d = 0; d < h; ++d) y_norm += y[t * h + d] * y[t * h + d];
  for (int e = 0; e < E_; ++e) {
    double col = 0;
    for (std::int64_t d = 0; d < h; ++d) col += router[d * E_ + e] * router[d * E_ + e];
    w_norm = std::max(w_norm, col);
  }
  const double bound = 16 * activation_roundoff(c_) * std::sqrt(y_norm * w_norm / static_cast<double>(h));
  const double kth = l[order[K_ - 1]];
  double worst = INFINITY;
  int worst_expert = theirs[0];
  for (int e : theirs) {
    if (l[e] < worst) worst = l[e], worst_expert = e;
  }
  const bool decisive = kth - worst > bound;
  (decisive ? routing_.decisive : routing_.close_calls) += 1;
  if (decisive || routing_.decisive == 0) {
    routing_.where = fmt::format(
        "layer {} token {} (sample {}, position {}): the run chose expert {} with logit {:.6g}, {:.3g} below "
        "the smallest of one device's top {} ({:.6g}); its rounding allows {:.3g}",
        layer, t, t / S, t % S, worst_expert, worst, kth - worst, K_, kth, bound);
  }
}

// ---- backward

Vec Training::head_backward(const Norm& lnf, const Vec& dlogits, std::vector<Vec>& g) const {
  const OtherParam out = c_.llama() ? kOutput : kWte;
  const Vec& wte = other_weight(out);
  GradSum dwte = grad(g, other_ + out);
  Vec dy(n * h, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t t = 0; t < V; ++t) {
      const double d = dlogits[i * V + t];
      for (std::int64_t j = 0; j < h; ++j) {
        dwte.add(t * h + j, d * lnf.y[i * h + j]);
        dy[i * h + j] += d * wte[t * h + j];
      }
    }
  }
  if (c_.llama()) return rmsnorm_backward(lnf, other_weight(kLnfG), dy, n, h, grad(g, other_ + kLnfG));
  return layernorm_backward(lnf, other_weight(kLnfG), dy, n, h, grad(g, other_ + kLnfG),
                            grad(g, other_ + kLnfB));
}

// `dx` is the gradient by the block's output x2 = x1 + mlp(x1), x1 = x + attention(x).
Vec Training::block_backward(int step, int layer, const BlockActs& a, const Vec& dx,
                             std::vector<Vec>& g) const {
  auto W = [&](int k) -> const Vec& { return block_weight(layer, k); };
  auto G = [&](int k) { return grad(g, layer * nb_ + k); };
  // the MLP
  Vec dout = dx;
  drop(dout, step, layer, 1);
  Vec dy2(n * h);
  if (c_.moe_layer(layer)) {
    dy2 = moe_backward(layer, a.ln2.y, a, dout, g);
  } else {
    bias_backward(dout, n, G(kFc2B));
    Vec dg(n * 4 * h);
    mm_backward(a.g, W(kFc2W), dout, n, 4 * h, h, G(kFc2W), &dg);
    const Vec du = expert_act_backward(a.u, dg);
    bias_backward(du, n, G(kFc1B));
    mm_backward(a.ln2.y, W(kFc1W), du, n, h, 4 * h, G(kFc1W), &dy2);
  }
  Vec dx1 = layernorm_backward(a.ln2, W(kLn2G), dy2, n, h, G(kLn2G), G(kLn2B));
  for (std::int64_t i = 0; i < n * h; ++i) dx1[i] += dx[i];

  // attention
  Vec dproj = dx1;
  drop(dproj, step, layer, 0);
  bias_backward(dproj, n, G(kProjB));
  Vec datt(n * h);
  mm_backward(a.att, W(kProjW), dproj, n, h, h, G(kProjW), &datt);
  const Vec dqkv = attention_backward(a, datt, layer, g);
  bias_backward(dqkv, n, G(kQkvB));
  Vec dy1(n * h);
  mm_backward(a.ln1.y, W(kQkvW), dqkv, n, h, 3 * h, G(kQkvW), &dy1);
  const Vec dxl = layernorm_backward(a.ln1, W(kLn1G), dy1, n, h, G(kLn1G), G(kLn1B));
  Vec dx0(n * h);
  for (std::int64_t i = 0; i < n * h; ++i) dx0[i] = dx1[i] + dxl[i];
  return dx0;
}

Vec Training::llama_backward(int step, int layer, const BlockActs& a, const Vec& dx,
                             std::vector<Vec>& g) const {
  auto W = [&](int k) -> const Vec& { return block_weight(layer, k); };
  auto Gr = [&](int k) { return grad(g, layer * nb_ + k); };
  // the MLP
  Vec dout = dx;
  drop(dout, step, layer, 1);
  Vec dy2(n * h, 0.0);
  if (c_.moe_layer(layer)) dy2 = moe_backward(layer, a.ln2.y, a, dout, g);
  if (const std::int64_t f = c_.dense_ffn(layer); f > 0) {
    Vec dg(n * f), dy_mlp(n * h);
    if (has(layer, kB2)) bias_backward(dout, n, Gr(kB2));
    mm_backward(a.g, W(kW2), dout, n, f, h, Gr(kW2), &dg);
    const Vec du = expert_act_backward(a.u, dg);
    if (has(layer, kB13)) bias_backward(du, n, Gr(kB13));
    mm_backward(a.ln2.y, W(kW13), du, n, h, 2 * f, Gr(kW13), &dy_mlp);
    for (std::int64_t i = 0; i < n * h; ++i) dy2[i] += dy_mlp[i];
  }
  Vec dx1 = rmsnorm_backward(a.ln2, W(kNorm2), dy2, n, h, Gr(kNorm2));
  for (std::int64_t i = 0; i < n * h; ++i) dx1[i] += dx[i];
  // attention
  Vec dproj = dx1;
  drop(dproj, step, layer, 0);
  if (has(layer, kBo)) bias_backward(dproj, n, Gr(kBo));
  Vec datt(n * H * hd);
  mm_backward(a.att, W(kWo), dproj, n, H * hd, h, Gr(kWo), &datt);
  Vec dqkv = attention_backward(a, datt, layer, g);
  rope(dqkv, true);
  if (c_.qk_layernorm) qk_norm_backward(a, layer, dqkv, g);
  if (has(layer, kBqkv)) bias_backward(dqkv, n, Gr(kBqkv));
  Vec dy1(n * h);
  mm_backward(a.ln1.y, W(kWqkv), dqkv, n, h, qkv_cols_, Gr(kWqkv), &dy1);
  const Vec dxl = rmsnorm_backward(a.ln1, W(kNorm1), dy1, n, h, Gr(kNorm1));
  Vec dx0(n * h);
  for (std::int64_t i = 0; i < n * h; ++i) dx0[i] = dx1[i] + dxl[i];
  return dx0;
}

Vec Training::attention_backward(const BlockActs& a, const Vec& datt, int layer, std::vector<Vec>& g) const {
  Vec dqkv(n * qkv_cols_, 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t head = 0; head < H; ++head) attention_head_backward(a, datt, layer, g, b, head, dqkv);
  return dqkv;
}

// Through o = p v, then the softmax (ds = p (dp - sum_j p dp) / sqrt(hd)), then s = q k^T. A sink's logit
// gets -p_sink sum_j p dp: its softmax share against every key's, which carry the values.
void Training::attention_head_backward(const BlockActs& a, const Vec& datt, int layer, std::vector<Vec>& g,
                                       std::int64_t b, std::int64_t head, Vec& dqkv) const {
  const Vec& p = a.probs[b * H + head];
  auto col = [&](std::int64_t s, int part, std::int64_t d) {
    return (b * S + s) * qkv_cols_ + this->col(head, part, d);
  };
  for (std::int64_t i = 0; i < S; ++i) {
    const double* dout = &datt[(b * S + i) * H * hd + head * hd];
    const std::int64_t lo = first_key(layer, i);
    Vec dp(i + 1);
    double dot = 0;
    for (std::int64_t j = lo; j <= i; ++j) {
      double s = 0;
      for (std::int64_t d = 0; d < hd; ++d) {
        s += dout[d] * a.qkv[col(j, 2, d)];
        dqkv[col(j, 2, d)] += p[i * S + j] * dout[d];
      }
      dp[j] = s;
      dot += p[i * S + j] * s;
    }
    if (c_.attention_sinks) grad(g, layer * nb_ + kSinks).add(head, -a.sink_probs[b * H + head][i] * dot);
    for (std::int64_t j = lo; j <= i; ++j) {
      const double ds = p[i * S + j] * (dp[j] - dot) * scale_;
      for (std::int64_t d = 0; d < hd; ++d) {
        dqkv[col(i, 0, d)] += ds * a.qkv[col(j, 1, d)];
        dqkv[col(j, 1, d)] += ds * a.qkv[col(i, 0, d)];
      }
    }
  }
}

void Training::embed_backward(const Vec& dx, std::vector<Vec>& g) const {
  GradSum dwte = grad(g, other_ + kWte), dwpe = grad(g, other_ + kWpe);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < h; ++j) {
      dwte.add(tok_[i] * h + j, dx[i * h + j]);
      if (!c_.llama()) dwpe.add((i % S) * h + j, dx[i * h + j]);
    }
  }
}

// ---- AdamW (Loshchilov & Hutter), weight decay only on the matrices and embeddings, at the schedule's
// learning rate, after clipping the gradients to the global norm (every parameter once)
void Training::adamw(int step, std::vector<Vec>& g) {
  if (c_.clip_grad > 0) {
    double squares = 0;
    for (const Vec& gi : g)
      for (double e : gi) squares += e * e;
    const double coeff = c_.clip_grad / (std::sqrt(squares) + 1e-6);
    // The clipped gradient's terms are the unclipped ones' times coeff.
    if (coeff < 1) {
      for (std::vector<Vec>* sums : {&g, &magnitude_})
        for (Vec& gi : *sums)
          for (double& e : gi) e *= coeff;
    }
  }
  const AdamW hyper;
  for (int i = 0; i < count_; ++i) {
    check::adamw_step(w_[i], g[i], m_[i], v_[i], c_.lr_at(step), specs_[i].decay ? hyper.weight_decay : 0.0,
                      hyper, step);
  }
}

}  // namespace

Reference::Reference(const Config& cfg) : c_(cfg) {
  initial_ = Training(c_).state();
}

void Reference::step(int step, const State* from, const Routes* routes) {
  std::lock_guard<std::mutex> lock(mu_);
  const State& start = from ? *from : initial_;
  const Routes none;
  if (step == step_ && start == from_ && (routes ? *routes : none) == routes_) return;
  Training run(c_, &start, routes);
  const double loss = run.step(step, grads_, grad_magnitudes_);
  softmax_shift_ = run.softmax_shift();
  from_ = start;
  after_ = run.state();
  routes_ = routes ? *routes : none;
  routing_ = run.routing();
  step_ = step;
  losses_.resize(step);
  losses_[step - 1] = loss;
}

int Reference::index(int kind, int layer) const {
  const int nb = block_params(c_);
  if (kind >= kRouterKind)
    return c_.layers * nb + kOtherParams + layer * moe_kinds(c_) + (kind - kRouterKind);
  return kind < kMostBlockParams ? layer * nb + kind : c_.layers * nb + (kind - kMostBlockParams);
}

std::shared_ptr<Reference> Reference::get(const Config& c) {
  // Only what defines the problem goes into the key: the shape, the data, the optimizer, the steps, and
  // with dropout its probability and the micro-batch size (the masks follow the micro-batches' rows, as a
  // framework's random stream follows its kernels); the llama block's rotary base; the recipe; the dtype
  // and the FP8 recipe, which set how far a score may move by the run's rounding (softmax_shift).
  std::string key = fmt::format("{} batch {} steps {} lr {} dtype {} fp8 {}", c.shape(), c.global_batch,
                                c.steps, c.lr, dtype_name(c.dtype), static_cast<int>(c.fp8));
  if (c.dropout > 0) key += fmt::format(" dropout {} mb {}", c.dropout, c.micro_batch);
  if (c.llama()) key += fmt::format(" rope theta {}", c.rope_theta);
  if (c.moe() && c.router_score == parallel::RouterScore::Sigmoid) key += " sigmoid router";
  key += fmt::format(" clip {} lr", c.clip_grad);
  // With a capacity, which tokens share one (a rank's of a micro-batch) follows the layout.
  if (c.moe() && (c.capacity_factor > 0 || c.aux_loss_coeff > 0)) {
    key +=
        fmt::format(" capacity {} load balancing {} of {}", c.capacity_factor, c.aux_loss_coeff, c.layout());
  }
  for (int step = 1; step <= c.steps; ++step) key += fmt::format(" {}", c.lr_at(step));
  static std::mutex mu;
  static std::string cached_key;
  static std::shared_ptr<Reference> cached;
  std::lock_guard<std::mutex> lock(mu);
  if (!cached || cached_key != key) {
    cached = std::make_shared<Reference>(c);
    cached_key = key;
  }
  return cached;
}

}  // namespace ranklab::gpt
