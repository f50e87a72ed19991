#include "lessons/mlp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "common/errors.h"
#include "common/random.h"

namespace ranklab::mlp {

namespace {
// Sample i of the batch has seed kSampleSeed + i; layer l's weight has seed kWeightSeed + l. The two
// ranges never meet, so no sample repeats a weight's numbers.
constexpr std::uint64_t kSampleSeed = std::uint64_t{1} << 32;
constexpr std::uint64_t kWeightSeed = 1;

float weight_std(std::int64_t dim) {
  return std::sqrt(2.0f / static_cast<float>(dim));
}
}  // namespace

// ---- options --------------------------------------------------------------------------------------------

std::string describe(const TrainingOptions& o) {
  return fmt::format("{} layers of {} x {}, batch {}, {} lr {}, {} step{}{}", o.layers, o.dim, o.dim, o.batch,
                     o.optimizer, o.lr, o.steps, o.steps == 1 ? "" : "s",
                     o.phantom ? ", phantom tensors" : "");
}

// ---- the numbers ------------------------------------------------------------------------------------------

Tensor make_samples(Rank& r, const TrainingOptions& o, std::int64_t first, std::int64_t count) {
  if (o.phantom) return r.phantom({count, o.dim});
  std::vector<Tensor> rows;
  rows.reserve(count);
  for (std::int64_t i = first; i < first + count; ++i) rows.push_back(r.randn({1, o.dim}, kSampleSeed + i));
  return rows.size() == 1 ? rows[0] : r.cat(rows, 0);
}

Tensor make_weight(Rank& r, const TrainingOptions& o, int layer) {
  if (o.phantom) return r.phantom({o.dim, o.dim});
  return r.randn({o.dim, o.dim}, kWeightSeed + layer, weight_std(o.dim));
}

Tensor make_weight_columns(Rank& r, const TrainingOptions& o, int layer, std::int64_t first_col,
                           std::int64_t cols) {
  if (o.phantom) return r.phantom({o.dim, cols});
  const float std = weight_std(o.dim);
  std::vector<float> v(o.dim * cols);
  for (std::int64_t i = 0; i < o.dim; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      v[i * cols + j] =
          std * normal_at(kWeightSeed + layer, static_cast<std::uint64_t>(i * o.dim + first_col + j));
    }
  }
  return r.from_host({o.dim, cols}, v);
}

Tensor make_weight_rows(Rank& r, const TrainingOptions& o, int layer, std::int64_t first_row,
                        std::int64_t rows) {
  if (o.phantom) return r.phantom({rows, o.dim});
  return r.randn_slice({o.dim, o.dim}, 0, first_row, rows, kWeightSeed + layer, weight_std(o.dim),
                       DType::Float32);
}

// ---- one layer --------------------------------------------------------------------------------------------

Tensor forward_layer(Rank& r, const Tensor& x, const Tensor& w) {
  return r.relu(r.matmul(x, w));
}

LayerGrads backward_layer(Rank& r, const Tensor& x, const Tensor& y, const Tensor& w, const Tensor& dy,
                          bool want_dx) {
  Tensor dz = r.relu_backward(dy, y);
  LayerGrads g;
  g.w = r.matmul(x, dz, Trans::Yes, Trans::No);
  if (want_dx) g.x = r.matmul(dz, w, Trans::No, Trans::Yes);
  return g;
}

Tensor output_sum(Rank& r, const Tensor& y) {
  return r.sum(y);
}

Tensor loss_grad(Rank& r, const TrainingOptions& o, const Shape& s, std::int64_t batch) {
  if (o.phantom) return r.phantom(s);
  return r.full(s, 1.0f / static_cast<float>(batch));
}

Tensor buffer(Rank& r, const TrainingOptions& o, const Shape& s) {
  return o.phantom ? r.phantom(s) : r.empty(s);
}

// ---- the optimizer ----------------------------------------------------------------------------------------

Optimizer::Optimizer(Rank& r, const TrainingOptions& o, std::vector<Tensor> params)
    : r_(r), params_(std::move(params)), adamw_(o.optimizer == "adamw") {
  hyper_.lr = static_cast<float>(o.lr);
  if (!adamw_) return;
  for (const Tensor& p : params_) {
    m_.push_back(o.phantom ? r.phantom(p.shape()) : r.zeros(p.shape()));
    v_.push_back(o.phantom ? r.phantom(p.shape()) : r.zeros(p.shape()));
  }
}

void Optimizer::step(const std::vector<Tensor>& grads) {
  ++t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (adamw_) {
      r_.adamw_step(params_[i], grads[i], m_[i], v_[i], hyper_, t_);
    } else {
      r_.sgd_step(params_[i], grads[i], hyper_.lr);
    }
  }
}

// ---- the one-device reference -----------------------------------------------------------------------------

namespace {
using Matrix = std::vector<double>;  // row-major

// float32's unit roundoff: a correctly rounded operation is off by at most this much, relatively.
constexpr double kUnit = 0x1p-24;
// How many standard deviations of a rounding error a bound allows. Worst-case bounds (every rounding in
// the same direction, every error lined up with the weights' signs) grow by a factor of about sqrt(dim)
// at every layer and say nothing after a few layers; real rounding errors have random signs and add up
// like a random walk (Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J.
// Sci. Comput. 41(5), 2019: a k-term sum is within lambda sqrt(k) u of its exact value, relative to the
// sum of the terms' magnitudes, with probability at least 1 - 2 exp(-lambda^2 / 2)). With lambda = 8 that
// probability misses by 2.5e-14 per number, so a run of 10^8 checked numbers fails falsely fewer than
// once in 10^5 runs, while a wrong gradient (off by a factor, a transposition, a missing term) is off by
// about the value itself and still fails by orders of magnitude.
constexpr double kLambda = 8;

// op(a) @ op(b), n x m: a is n x k (k x n when ta), b is k x m (m x k when tb); sums in double. The
// inner loop runs along rows of b (b is transposed first when tb), so it streams through memory.
Matrix matmul(const Matrix& a, const Matrix& b, std::int64_t n, std::int64_t k, std::int64_t m, bool ta,
              bool tb) {
  if (tb) {
    Matrix bt(k * m);
    for (std::int64_t j = 0; j < m; ++j) {
      for (std::int64_t p = 0; p < k; ++p) bt[p * m + j] = b[j * k + p];
    }
    return matmul(a, bt, n, k, m, ta, false);
  }
  Matrix c(n * m);
  for (std::int64_t i = 0; i < n; ++i) {
    double* ci = c.data() + i * m;
    for (std::int64_t p = 0; p < k; ++p) {
      const double aip = ta ? a[p * n + i] : a[i * k + p];
      if (aip == 0.0) continue;
      const double* bp = b.data() + p * m;
      for (std::int64_t j = 0; j < m; ++j) ci[j] += aip * bp[j];
    }
  }
  return c;
}

Matrix abs_plus(const Matrix& a, const Matrix& e) {
  Matrix out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = std::fabs(a[i]) + e[i];
  return out;
}

Matrix squared(const Matrix& a) {
  Matrix out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] * a[i];
  return out;
}

bool all_zero(const Matrix& a) {
  return std::all_of(a.begin(), a.end(), [](double v) { return v == 0; });
}

// How far a float32 evaluation of op(a) @ op(b) may be from the exact product when the float32 operands
// are themselves within `ea` and `eb` of `a` and `b`, element by element (bounds at lambda standard
// deviations). Two parts:
//  - the operands' errors, carried through the sum: independent errors add in quadrature, so the bound
//    squared is ea^2 @ (b^2 + eb^2) + a^2 @ eb^2 (squares elementwise);
//  - the sum's own roundings: lambda sqrt(terms) u (|a| + ea) @ (|b| + eb), whatever the order of the
//    additions (a GEMM's blocking, a ring's or a tree's reduction across ranks, micro-batches added up).
// `terms` is the longest chain of roundings a sum may see: k, plus what a reduction across ranks adds.
Matrix product_bound(const Matrix& a, const Matrix& ea, const Matrix& b, const Matrix& eb, std::int64_t n,
                     std::int64_t k, std::int64_t m, bool ta, bool tb, double terms) {
  Matrix out = matmul(abs_plus(a, ea), abs_plus(b, eb), n, k, m, ta, tb);
  const double rounding = kLambda * std::sqrt(terms) * kUnit;
  for (double& v : out) v *= rounding;
  Matrix carried(out.size(), 0.0);
  bool any = false;
  if (!all_zero(ea)) {
    Matrix b2 = squared(b), eb2 = squared(eb);
    for (size_t i = 0; i < b2.size(); ++i) b2[i] += eb2[i];
    carried = matmul(squared(ea), b2, n, k, m, ta, tb);
    any = true;
  }
  if (!all_zero(eb)) {
    const Matrix more = matmul(squared(a), squared(eb), n, k, m, ta, tb);
    for (size_t i = 0; i < more.size(); ++i) carried[i] += more[i];
    any = true;
  }
  if (any) {
    for (size_t i = 0; i < out.size(); ++i) out[i] += std::sqrt(carried[i]);
  }
  return out;
}

std::vector<float> to_float(const Matrix& m) {
  return std::vector<float>(m.begin(), m.end());
}

// The training itself: the model's weights, gradients and optimizer state, as one device holds them,
// computed in double; beside every value, a bound on how far a float32 training can be from it.
class Training {
 public:
  explicit Training(const TrainingOptions& o);
  void step();
  double loss() const { return loss_; }
  double loss_bound() const { return loss_bound_; }
  const std::vector<Matrix>& grads() const { return grads_; }
  const std::vector<Matrix>& weights() const { return weights_; }
  const std::vector<Matrix>& grad_bounds() const { return grad_bounds_; }
  const std::vector<Matrix>& weight_bounds() const { return weight_bounds_; }

 private:
  void adamw(int l);
  void sgd(int l);

  TrainingOptions o_;
  Matrix x_;  // the batch, row-major batch x dim
  std::vector<Matrix> weights_, grads_, m_, v_;
  std::vector<Matrix> weight_bounds_, grad_bounds_, m_bounds_, v_bounds_;
  double loss_ = 0, loss_bound_ = 0;
  int t_ = 0;
};

}  // namespace

Training::Training(const TrainingOptions& o) : o_(o) {
  const std::int64_t d = o.dim;
  const float std = weight_std(d);
  for (int l = 0; l < o.layers; ++l) {
    Matrix w(d * d), ew(d * d);
    for (std::int64_t i = 0; i < d * d; ++i) {
      w[i] = std * normal_at(kWeightSeed + l, i);  // the float32 number every backend makes
      ew[i] = kUnit * std::fabs(w[i]);             // should a backend round std * normal differently
    }
    weights_.push_back(std::move(w));
    weight_bounds_.push_back(std::move(ew));
    for (auto* v : {&grads_, &m_, &v_, &grad_bounds_, &m_bounds_, &v_bounds_}) v->emplace_back(d * d, 0.0);
  }
  Matrix x(o.batch * d);
  for (std::int64_t s = 0; s < o.batch; ++s) {
    for (std::int64_t j = 0; j < d; ++j) x[s * d + j] = normal_at(kSampleSeed + s, j);
  }
  x_ = std::move(x);
}

// Every bound below follows one float32 training through the same step: each operation's rounding
// (product_bound's for sums, a few units of roundoff for elementwise arithmetic), plus how the errors
// already in its operands pass through it. They hold for any order of summation, so for every lesson's split
// of the work (a slice of the batch and an all_reduce, column blocks and reduce_scatter, stages and
// micro-batches). Relu is where a float32 run can differ from exact arithmetic by more than rounding: an
// input within its error bound of zero may be on either side of it, so its gradient is taken or not; the
// bound then counts the whole gradient, which is also why AdamW (whose first steps move every weight by
// about lr, whatever the gradient's size) needs the interval arithmetic in adamw().
void Training::step() {
  const std::int64_t b = o_.batch, d = o_.dim;
  const double n_out = static_cast<double>(b * d);
  // Reductions across ranks add at most one rounding per rank (world <= batch in data parallelism, the
  // only lesson whose gradient sums cross ranks), and the loss's and gradients' 1 / batch one more.
  const double grad_terms = 2.0 * b + 4, input_terms = d + 2.0;
  // Forward, keeping every layer's input and pre-activation.
  std::vector<Matrix> xs{x_}, ex{Matrix(b * d, 0.0)}, zs, ez;
  for (int l = 0; l < o_.layers; ++l) {
    zs.push_back(matmul(xs[l], weights_[l], b, d, d, false, false));
    ez.push_back(product_bound(xs[l], ex[l], weights_[l], weight_bounds_[l], b, d, d, false, false, d));
    Matrix y = zs[l];
    for (double& v : y) v = std::max(v, 0.0);
    xs.push_back(std::move(y));
    // relu moves no two numbers further apart than they were, and where the input is surely negative
    // both sides are exactly 0.
    Matrix e = ez[l];
    for (std::int64_t i = 0; i < b * d; ++i) {
      if (zs[l][i] < -e[i]) e[i] = 0;
    }
    ex.push_back(std::move(e));
  }
  double total = 0, err2 = 0, mag = 0;
  for (size_t i = 0; i < xs.back().size(); ++i) {
    total += xs.back()[i];
    err2 += ex.back()[i] * ex.back()[i];
    mag += std::fabs(xs.back()[i]) + ex.back()[i];
  }
  loss_ = total / static_cast<double>(b);
  loss_bound_ =
      (std::sqrt(err2) + kLambda * std::sqrt(n_out + grad_terms) * kUnit * mag) / static_cast<double>(b) +
      2 * kUnit * std::fabs(loss_);
  // Backward.
  Matrix g(b * d, 1.0 / static_cast<double>(b)), eg(b * d, 2 * kUnit / static_cast<double>(b));
  for (int l = o_.layers - 1; l >= 0; --l) {
    const Matrix &z = zs[l], &e = ez[l];
    for (std::int64_t i = 0; i < b * d; ++i) {
      const bool certain = std::fabs(z[i]) > e[i];
      if (!certain) {
        // Taken on one side of zero, dropped on the other: off by all of g. That is a certain bound on
        // this number, but the sums it enters add such errors in quadrature (product_bound), which gives
        // a bound at lambda standard deviations only if every term's bound is lambda of its deviations
        // too, as rounding's are. A number known only to lie within +-|g| has a deviation of up to |g|
        // (Hoeffding's inequality bounds a sum of such terms at lambda times their quadrature), so it
        // enters at lambda |g|. Entered at |g|, a sum of a few flips ran past its bound at 64 ranks.
        eg[i] += kLambda * std::fabs(g[i]);
      } else if (z[i] < 0) {
        eg[i] = 0;  // dropped by both
      }
      if (z[i] <= 0) g[i] = 0;
    }
    grads_[l] = matmul(xs[l], g, d, b, d, true, false);
    grad_bounds_[l] = product_bound(xs[l], ex[l], g, eg, d, b, d, true, false, grad_terms);
    if (l > 0) {
      Matrix next = matmul(g, weights_[l], b, d, d, false, true);
      eg = product_bound(g, eg, weights_[l], weight_bounds_[l], b, d, d, false, true, input_terms);
      g = std::move(next);
    }
  }
  ++t_;
  for (int l = 0; l < o_.layers; ++l) {
    if (o_.optimizer == "sgd") {
      sgd(l);
    } else {
      adamw(l);
    }
  }
}

// w - lr g: the gradient's error scaled by lr, and a few roundings (lr in float32, the product, the
// difference).
void Training::sgd(int l) {
  Matrix &w = weights_[l], &ew = weight_bounds_[l];
  const Matrix &gr = grads_[l], &eg = grad_bounds_[l];
  const double lr = o_.lr;
  for (size_t i = 0; i < w.size(); ++i) {
    const double next = w[i] - lr * gr[i];
    ew[i] += lr * eg[i] + 3 * kUnit * (std::fabs(w[i]) + lr * std::fabs(gr[i]));
    w[i] = next;
  }
}

// AdamW as Loshchilov & Hutter and torch.optim.AdamW write it (decoupled weight decay, bias-corrected
// moments), with interval arithmetic for the bounds: the update m^ / (sqrt(v^) + eps) is taken at the
// ends of the intervals its inputs may lie in. Where the gradient's sign is uncertain, the update may be
// anything from -1 to 1 at the first step, and the bound says so.
void Training::adamw(int l) {
  const AdamW h;
  const double lr = o_.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps, u = kUnit;
  const double p1 = std::pow(b1, t_), p2 = std::pow(b2, t_);
  const double c1 = 1 - p1, c2 = 1 - p2;
  // 1 - beta^t in float32: pow is off by a unit or so, and the subtraction magnifies it by beta^t / c.
  const double rel1 = 3 * u * p1 / c1 + u, rel2 = 3 * u * p2 / c2 + u;
  // Whatever the gradients, the update m^ / sqrt(v^) is at most `most` in size: Cauchy-Schwarz on the
  // moments' sums, sum b1^k g = sum (b1^k / b2^(k/2)) (b2^(k/2) g), gives |m| / sqrt(v) <= (1 - b1) /
  // sqrt(1 - b2) sqrt(sum_{k<t} (b1^2 / b2)^k), times the bias corrections sqrt(c2) / c1 (1 at the
  // first step; Kingma & Ba, "Adam", ICLR 2015, section 2.1, state its limit). The interval arithmetic
  // below divides by sqrt(v^) + eps, which an uncertain v^ lets fall to eps; without this cap one
  // gradient within rounding of zero would let a weight be anywhere within lr / eps of its value.
  double series = 0;
  for (int k = 0; k < t_; ++k) series += std::pow(b1 * b1 / b2, k);
  const double most = (1 - b1) / c1 * std::sqrt(c2 / (1 - b2)) * std::sqrt(series) * (1 + 8 * u);
  Matrix &w = weights_[l], &ew = weight_bounds_[l], &m = m_[l], &v = v_[l], &em = m_bounds_[l],
         &ev = v_bounds_[l];
  const Matrix &gr = grads_[l], &eg = grad_bounds_[l];
  for (size_t i = 0; i < w.size(); ++i) {
    const double g = gr[i], e = eg[i];
    // The bounds of the moments, from their values before the step.
    em[i] = b1 * em[i] + (1 - b1) * e + 3 * u * (b1 * std::fabs(m[i]) + (1 - b1) * std::fabs(g));
    const double g2 = g * g, eg2 = e * (2 * std::fabs(g) + e) + u * g2;
    ev[i] = b2 * ev[i] + (1 - b2) * eg2 + 3 * u * (b2 * v[i] + (1 - b2) * g2);
    // The values, as every reference takes an AdamW step.
    const double next = check::adamw_element(w[i], g, m[i], v[i], lr, h.weight_decay, h, c1, c2);
    const double mh = m[i] / c1, emh = em[i] / c1 + std::fabs(mh) * (rel1 + 2 * u);
    const double vh = v[i] / c2, evh = ev[i] / c2 + vh * (rel2 + 2 * u);
    const double upd = mh / (std::sqrt(vh) + eps);
    // The denominator's interval, widened for the square root's and the sum's roundings.
    const double den_lo = (std::sqrt(std::max(0.0, vh - evh)) + eps) * (1 - 2 * u);
    const double den_hi = (std::sqrt(vh + evh) + eps) * (1 + 2 * u);
    const double lo = std::max(-most, std::min((mh - emh) / den_lo, (mh - emh) / den_hi));
    const double hi = std::min(most, std::max((mh + emh) / den_lo, (mh + emh) / den_hi));
    const double eupd = std::max(hi - upd, upd - lo) + 2 * u * std::fabs(upd);
    ew[i] = ew[i] * (1 - lr * h.weight_decay) + lr * eupd + 4 * u * (std::fabs(w[i]) + lr * std::fabs(upd));
    w[i] = next;
  }
}

struct Reference::Result {
  double loss = 0, loss_bound = 0;
  std::vector<std::vector<float>> grads, weights, grad_bounds, weight_bounds;
};

namespace {
// One step's numbers as the ranks compare with them: float32 values, and bounds that also cover the
// values' own rounding to float32 (and are rounded up, not to nearest).
std::shared_ptr<const Reference::Result> snapshot(const Training& t) {
  auto r = std::make_shared<Reference::Result>();
  r->loss = t.loss();
  r->loss_bound = t.loss_bound();
  auto bounds = [](const Matrix& v, const Matrix& e) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      out[i] = static_cast<float>((e[i] + kUnit * std::fabs(v[i])) * (1 + 4 * kUnit));
    }
    return out;
  };
  for (size_t l = 0; l < t.weights().size(); ++l) {
    r->grads.push_back(to_float(t.grads()[l]));
    r->weights.push_back(to_float(t.weights()[l]));
    r->grad_bounds.push_back(bounds(t.grads()[l], t.grad_bounds()[l]));
    r->weight_bounds.push_back(bounds(t.weights()[l], t.weight_bounds()[l]));
  }
  return r;
}
}  // namespace

// One training for every rank's reference. Step k's result is kept until every rank that shares the
// training has taken it; a rank keeps the result of its last step for as long as it needs it.
struct Reference::Shared {
  explicit Shared(const TrainingOptions& o) : training(o), initial(snapshot(training)) {}

  // One reference fewer waits for result k: it took it, or it is gone.
  void release_one(size_t k) {
    if (--waiting[k] > 0) return;
    results[k].reset();
  }

  std::shared_ptr<const Result> take(int step) {
    std::lock_guard<std::mutex> lock(mu);
    while (static_cast<int>(results.size()) < step) {
      training.step();
      results.push_back(snapshot(training));
      waiting.push_back(users);
    }
    std::shared_ptr<const Result> r = results[step - 1];
    if (!r) throw std::logic_error("the one-device reference was asked for a step it no longer keeps");
    release_one(step - 1);
    return r;
  }

  std::mutex mu;
  Training training;
  std::shared_ptr<const Result> initial;
  std::vector<std::shared_ptr<const Result>> results;  // results[k - 1]: after step k, until all took it
  std::vector<int> waiting;                            // how many references have yet to take each one
  int users = 0;                                       // the references sharing this training
};

namespace {
// The trainings in use, by the options that decide the numbers. A run's ranks all make their reference
// before its first step, so they find each other here; when the last one is gone, so is the training.
std::shared_ptr<Reference::Shared> shared_training(const TrainingOptions& o) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Reference::Shared>> trainings;
  const std::string key =
      fmt::format("batch {} dim {} layers {} {} lr {:a}", o.batch, o.dim, o.layers, o.optimizer, o.lr);
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = trainings.begin(); it != trainings.end();) {
    it = it->second.expired() ? trainings.erase(it) : std::next(it);
  }
  std::shared_ptr<Reference::Shared> s = trainings[key].lock();
  if (s) {
    std::lock_guard<std::mutex> inner(s->mu);
    if (s->results.empty()) {  // one that comes after a step was taken (the next lesson) trains anew
      ++s->users;
      return s;
    }
  }
  s = std::make_shared<Reference::Shared>(o);
  s->users = 1;
  trainings[key] = s;
  return s;
}
}  // namespace

Reference::Reference(const TrainingOptions& o)
    : dim_(o.dim), shared_(shared_training(o)), now_(shared_->initial) {}

Reference::~Reference() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  --shared_->users;
  // The results of the steps this reference did not take need one taker fewer.
  for (size_t k = t_; k < shared_->results.size(); ++k) shared_->release_one(k);
}

void Reference::step() {
  now_ = shared_->take(++t_);
}

double Reference::loss() const {
  return now_->loss;
}
double Reference::loss_bound() const {
  return now_->loss_bound;
}
const std::vector<float>& Reference::grad_bound(int layer) const {
  return now_->grad_bounds[layer];
}
const std::vector<float>& Reference::weight_bound(int layer) const {
  return now_->weight_bounds[layer];
}
const std::vector<float>& Reference::grad(int layer) const {
  return now_->grads[layer];
}
const std::vector<float>& Reference::weight(int layer) const {
  return now_->weights[layer];
}

std::vector<float> columns(const std::vector<float>& m, std::int64_t rows, std::int64_t cols,
                           std::int64_t first, std::int64_t count) {
  std::vector<float> out(rows * count);
  for (std::int64_t i = 0; i < rows; ++i) {
    std::copy_n(m.begin() + i * cols + first, count, out.begin() + i * count);
  }
  return out;
}

check::Agreement compare_layers(Rank& r, const Reference& ref, const std::vector<Tensor>& grads,
                                const std::vector<Tensor>& weights, int first_layer, std::int64_t first_col,
                                std::int64_t cols) {
  const std::int64_t d = ref.dim();
  auto want = [&](const std::vector<float>& m) { return cols == d ? m : columns(m, d, d, first_col, cols); };
  check::Agreement diff;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int l = first_layer + static_cast<int>(i);
    diff.merge(check::within_bound(r.to_host(grads[i]), want(ref.grad(l)), want(ref.grad_bound(l)),
                                   fmt::format("layer {} gradient", l), cols));
    diff.merge(check::within_bound(r.to_host(weights[i]), want(ref.weight(l)), want(ref.weight_bound(l)),
                                   fmt::format("layer {} weight", l), cols));
  }
  return diff;
}

std::vector<float> fingerprint(const std::vector<std::vector<float>>& tensors) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (const auto& t : tensors) {
    for (float v : t) {
      std::uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      for (int k = 0; k < 4; ++k) {
        h ^= (bits >> (8 * k)) & 0xFF;
        h *= 1099511628211ull;
      }
    }
  }
  std::vector<float> out;
  for (int k = 0; k < 4; ++k) out.push_back(static_cast<float>((h >> (16 * k)) & 0xFFFF));
  return out;
}

// ---- bookkeeping ------------------------------------------------------------------------------------------

std::string format_memory(const Memory& m) {
  return fmt::format("params {}  grads {}  optimizer {}  activations {}  total {}", format_bytes(m.params),
                     format_bytes(m.grads), format_bytes(m.optimizer), format_bytes(m.activations),
                     format_bytes(m.total()));
}

std::int64_t optimizer_bytes(const TrainingOptions& o, std::int64_t param_bytes) {
  return o.optimizer == "adamw" ? 2 * param_bytes : 0;
}

std::string launch_note(double launched_us, double step_us) {
  if (step_us <= 0 || launched_us < 0.9 * step_us) return "";
  return fmt::format(
      "launch overhead dominates: the host was still launching kernels {:.0f}% of the way through the step, "
      "so the device mostly waited for it and what looks like idle time is launch time; the kernels are "
      "too small for the GPU at these sizes (try --lecture, or --phantom with a larger --dim and --batch)",
      100 * launched_us / step_us);
}

std::string format_time(double us) {
  if (us >= 1e6) return fmt::format("{:.2f} s", us / 1e6);
  if (us >= 1e3) return fmt::format("{:.2f} ms", us / 1e3);
  return fmt::format("{:.1f} us", us);
}

std::vector<std::vector<float>> gather_to_root(Rank& r, const std::vector<float>& mine) {
  const auto n = static_cast<std::int64_t>(mine.size());
  const int w = r.world_size();
  Tensor in = r.from_host({n}, mine);
  // Only rank 0 receives, so only rank 0 holds W x n: the other ranks' memory does not grow with the world.
  const bool root = r.rank() == 0;
  Tensor out = root ? r.zeros({n * w}) : Tensor();
  r.gather(out, in, 0);
  std::vector<std::vector<float>> all;
  if (!root) return all;
  std::vector<float> flat = r.to_host(out);
  for (int i = 0; i < w; ++i) all.emplace_back(flat.begin() + i * n, flat.begin() + (i + 1) * n);
  return all;
}

bool print_memory_plan(Rank& r, const std::string& who, const Memory& m) {
  const std::int64_t cap = r.memory_capacity();
  r.print(fmt::format("  {}: {}  ({:.0f}% of {})", who, format_memory(m), 100.0 * m.total() / cap,
                      format_bytes(cap)));
  if (m.total() <= cap) return true;
  r.print(fmt::format("  {}: that is more than the device holds: it will run out of memory", who));
  return false;
}

// ---- RunSummary -------------------------------------------------------------------------------------------

RunSummary::RunSummary(Rank& r, const TrainingOptions& o, std::string lesson)
    : r_(r), o_(o), lesson_(std::move(lesson)), peak_(r) {
  if (!o.phantom) ref_ = std::make_unique<Reference>(o);
}

RunSummary::~RunSummary() = default;

std::optional<check::Agreement> RunSummary::check_step(
    int step, const std::string& what, const std::function<check::Agreement(const Reference&)>& compare,
    const std::string& where) {
  if (!ref_) return std::nullopt;
  auto scope = r_.bookkeeping("reference");
  ref_->step();
  check::Agreement d = compare(*ref_);
  worst_.merge_step(d);
  check::record_step(r_, lesson_, step, what, d, where);
  return d;
}

std::string RunSummary::agreement_of_this_rank() const {
  return check::agreement(worst_.worst, worst_.relative(), worst_.undecided_steps == 0);
}

void RunSummary::begin_report() {
  // A region cannot be moved; made in place from bookkeeping()'s result.
  if (!report_) report_.reset(new Rank::Region(r_.bookkeeping("report")));
}

bool RunSummary::gather(const std::vector<float>& extra, const std::vector<Tensor>* weights) {
  begin_report();
  std::vector<float> stats = {static_cast<float>(peak_.bytes()), static_cast<float>(worst_.relative()),
                              static_cast<float>(worst_.worst)};
  stats.insert(stats.end(), extra.begin(), extra.end());
  extra_ = extra.size();
  if (weights && !o_.phantom) {
    std::vector<std::vector<float>> host;
    for (const Tensor& t : *weights) host.push_back(r_.to_host(t));
    for (float f : fingerprint(host)) stats.push_back(f);
  }
  all_ = gather_to_root(r_, stats);
  if (r_.rank() != 0) return false;
  const auto prints = all_[0].begin() + 3 + static_cast<std::ptrdiff_t>(extra_);
  for (const auto& s : all_) {
    peak_bytes_ = std::max<double>(peak_bytes_, s[0]);
    relative_ = std::max<double>(relative_, s[1]);
    used_ = std::max<double>(used_, s[2]);
    identical_ =
        identical_ && std::equal(s.begin() + 3 + static_cast<std::ptrdiff_t>(extra_), s.end(), prints);
  }
  return true;
}

std::vector<float> RunSummary::extra(int rank) const {
  const auto& s = all_[rank];
  return std::vector<float>(s.begin() + 3, s.begin() + 3 + static_cast<std::ptrdiff_t>(extra_));
}

void RunSummary::print_last_step(double step_us, double launched_us, const std::string& detail) const {
  r_.print(fmt::format("last step: {}{}", format_time(step_us), detail));
  if (const std::string note = launch_note(launched_us, step_us); !note.empty()) r_.print(note);
}

void RunSummary::print_peak_memory() const {
  r_.print(fmt::format("measured peak memory of the busiest rank: {}", format_bytes(peak_bytes_)));
}

bool RunSummary::skipped_comparison() const {
  if (!o_.phantom) return false;
  r_.print("phantom tensors hold no numbers: the comparison with one device was skipped");
  return true;
}

void RunSummary::check_identical_weights() const {
  r_.check(lesson_ + ": the weights are identical on every rank", identical_,
           identical_ ? "the same bits on every rank" : "the ranks' weights differ");
  r_.print(fmt::format("weights identical on every rank ({} of them): {}", r_.world_size(),
                       identical_ ? "yes" : "NO"));
}

void RunSummary::print_agreement(const std::string& what) const {
  r_.print(fmt::format("equal to one device over the full batch after every step{}: {}", what,
                       check::agreement(used_, relative_, worst_.undecided_steps == 0)));
}

}  // namespace ranklab::mlp
