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

void validate(const Options& o, const std::string& lesson) {
  auto fail = [&](const std::string& why) { throw UsageError(fmt::format("{}: {}", lesson, why)); };
  if (o.batch < 1) fail(fmt::format("--batch must be at least 1 (got {})", o.batch));
  if (o.dim < 1) fail(fmt::format("--dim must be at least 1 (got {})", o.dim));
  if (o.layers < 1) fail(fmt::format("--layers must be at least 1 (got {})", o.layers));
  if (o.steps < 1) fail(fmt::format("--steps must be at least 1 (got {})", o.steps));
  if (!(o.lr > 0) || !std::isfinite(o.lr))
    fail(fmt::format("--lr must be positive and finite (got {})", o.lr));
  if (o.optimizer != "sgd" && o.optimizer != "adamw") {
    fail(fmt::format("--optimizer must be sgd or adamw (got '{}')", o.optimizer));
  }
}

std::string describe(const Options& o) {
  return fmt::format("{} layers of {} x {}, batch {}, {} lr {}, {} step{}{}", o.layers, o.dim, o.dim, o.batch,
                     o.optimizer, o.lr, o.steps, o.steps == 1 ? "" : "s",
                     o.phantom ? ", phantom tensors" : "");
}

// ---- the numbers ------------------------------------------------------------------------------------------

Tensor make_samples(Rank& r, const Options& o, std::int64_t first, std::int64_t count) {
  if (o.phantom) return r.phantom({count, o.dim});
  std::vector<Tensor> rows;
  rows.reserve(count);
  for (std::int64_t i = first; i < first + count; ++i) rows.push_back(r.randn({1, o.dim}, kSampleSeed + i));
  return rows.size() == 1 ? rows[0] : r.cat(rows, 0);
}

Tensor make_weight(Rank& r, const Options& o, int layer) {
  if (o.phantom) return r.phantom({o.dim, o.dim});
  return r.randn({o.dim, o.dim}, kWeightSeed + layer, weight_std(o.dim));
}

Tensor make_weight_columns(Rank& r, const Options& o, int layer, std::int64_t first_col, std::int64_t cols) {
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

Tensor loss_grad(Rank& r, const Options& o, const Shape& s, std::int64_t batch) {
  if (o.phantom) return r.phantom(s);
  return r.full(s, 1.0f / static_cast<float>(batch));
}

Tensor buffer(Rank& r, const Options& o, const Shape& s) {
  return o.phantom ? r.phantom(s) : r.empty(s);
}

// ---- the optimizer ----------------------------------------------------------------------------------------

Optimizer::Optimizer(Rank& r, const Options& o, std::vector<Tensor> params)
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
using Matrix = std::vector<float>;  // row-major

// op(a) @ op(b), n x m: a is n x k (k x n when ta), b is k x m (m x k when tb); sums in double.
Matrix matmul(const Matrix& a, const Matrix& b, std::int64_t n, std::int64_t k, std::int64_t m, bool ta,
              bool tb) {
  Matrix c(n * m);
  std::vector<double> acc(m);
  for (std::int64_t i = 0; i < n; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::int64_t p = 0; p < k; ++p) {
      const double aip = ta ? a[p * n + i] : a[i * k + p];
      if (aip == 0.0) continue;
      for (std::int64_t j = 0; j < m; ++j) acc[j] += aip * (tb ? b[j * k + p] : b[p * m + j]);
    }
    for (std::int64_t j = 0; j < m; ++j) c[i * m + j] = static_cast<float>(acc[j]);
  }
  return c;
}

// The training itself: the model's weights, gradients and optimizer state, as one device holds them.
class Training {
 public:
  explicit Training(const Options& o);
  void step();
  double loss() const { return loss_; }
  const std::vector<std::vector<float>>& grads() const { return grads_; }
  const std::vector<std::vector<float>>& weights() const { return weights_; }

 private:
  Options o_;
  Matrix x_;  // the batch, row-major batch x dim
  std::vector<Matrix> weights_, grads_, m_, v_;
  double loss_ = 0;
  int t_ = 0;
};

}  // namespace

Training::Training(const Options& o) : o_(o) {
  const std::int64_t d = o.dim;
  const float std = weight_std(d);
  for (int l = 0; l < o.layers; ++l) {
    Matrix w(d * d);
    for (std::int64_t i = 0; i < d * d; ++i) w[i] = std * normal_at(kWeightSeed + l, i);
    weights_.push_back(std::move(w));
    grads_.emplace_back(d * d, 0.0f);
    m_.emplace_back(d * d, 0.0f);
    v_.emplace_back(d * d, 0.0f);
  }
  Matrix x(o.batch * d);
  for (std::int64_t s = 0; s < o.batch; ++s) {
    for (std::int64_t j = 0; j < d; ++j) x[s * d + j] = normal_at(kSampleSeed + s, j);
  }
  x_ = std::move(x);
}

void Training::step() {
  const std::int64_t b = o_.batch, d = o_.dim;
  // Forward, keeping every layer's output.
  std::vector<Matrix> acts{x_};
  for (int l = 0; l < o_.layers; ++l) {
    Matrix y = matmul(acts.back(), weights_[l], b, d, d, false, false);
    for (float& v : y) v = std::max(v, 0.0f);
    acts.push_back(std::move(y));
  }
  double total = 0;
  for (float v : acts.back()) total += v;
  loss_ = total / static_cast<double>(b);
  // Backward.
  Matrix g(b * d, 1.0f / static_cast<float>(b));
  for (int l = o_.layers - 1; l >= 0; --l) {
    const Matrix& y = acts[l + 1];
    for (std::int64_t i = 0; i < b * d; ++i) g[i] = y[i] > 0 ? g[i] : 0.0f;
    grads_[l] = matmul(acts[l], g, d, b, d, true, false);
    if (l > 0) g = matmul(g, weights_[l], b, d, d, false, true);
  }
  // The optimizer: SGD, or AdamW as Loshchilov & Hutter and torch.optim.AdamW write it (decoupled
  // weight decay, bias-corrected moments).
  ++t_;
  const double lr = o_.lr;
  const AdamW h;
  for (int l = 0; l < o_.layers; ++l) {
    Matrix& w = weights_[l];
    const Matrix& gr = grads_[l];
    for (std::int64_t i = 0; i < d * d; ++i) {
      if (o_.optimizer == "sgd") {
        w[i] = static_cast<float>(w[i] - lr * gr[i]);
        continue;
      }
      double p = w[i] * (1.0 - lr * h.weight_decay);
      double m = h.beta1 * m_[l][i] + (1.0 - h.beta1) * gr[i];
      double v = h.beta2 * v_[l][i] + (1.0 - h.beta2) * static_cast<double>(gr[i]) * gr[i];
      m_[l][i] = static_cast<float>(m);
      v_[l][i] = static_cast<float>(v);
      const double m_hat = m / (1.0 - std::pow(static_cast<double>(h.beta1), t_));
      const double v_hat = v / (1.0 - std::pow(static_cast<double>(h.beta2), t_));
      w[i] = static_cast<float>(p - lr * m_hat / (std::sqrt(v_hat) + h.eps));
    }
  }
}

struct Reference::Result {
  double loss = 0;
  std::vector<std::vector<float>> grads, weights;
};

// One training for every rank's reference. Step k's result is kept until every rank that shares the
// training has taken it; a rank keeps the result of its last step for as long as it needs it.
struct Reference::Shared {
  explicit Shared(const Options& o) : training(o) {
    auto r = std::make_shared<Result>();
    r->grads = training.grads();
    r->weights = training.weights();
    initial = std::move(r);
  }

  // One reference fewer waits for result k: it took it, or it is gone.
  void release_one(size_t k) {
    if (--waiting[k] > 0) return;
    results[k].reset();
  }

  std::shared_ptr<const Result> take(int step) {
    std::lock_guard<std::mutex> lock(mu);
    while (static_cast<int>(results.size()) < step) {
      training.step();
      auto r = std::make_shared<Result>();
      r->loss = training.loss();
      r->grads = training.grads();
      r->weights = training.weights();
      results.push_back(std::move(r));
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
std::shared_ptr<Reference::Shared> shared_training(const Options& o) {
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

Reference::Reference(const Options& o) : dim_(o.dim), shared_(shared_training(o)), now_(shared_->initial) {}

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

void Diff::merge(const Diff& d) {
  // Each tensor is judged against its own scale; the merged Diff keeps the worst relative error.
  if (d.relative() > relative()) *this = d;
}

Diff compare(const std::vector<float>& got, const std::vector<float>& want) {
  Diff d;
  if (got.size() != want.size()) {
    d.max_abs = INFINITY;
    return d;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    d.max_abs = std::isnan(e) ? INFINITY : std::max(d.max_abs, e);
    d.scale = std::max(d.scale, std::fabs(static_cast<double>(want[i])));
  }
  return d;
}

Diff compare(double got, double want) {
  Diff d;
  d.max_abs = std::isnan(got) ? INFINITY : std::fabs(got - want);
  d.scale = std::fabs(want);
  return d;
}

Diff compare_layers(Rank& r, const Reference& ref, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& weights, int first_layer, std::int64_t first_col,
                    std::int64_t cols) {
  const std::int64_t d = ref.dim();
  auto want = [&](const std::vector<float>& m) { return cols == d ? m : columns(m, d, d, first_col, cols); };
  Diff diff;
  for (size_t i = 0; i < weights.size(); ++i) {
    diff.merge(compare(r.to_host(grads[i]), want(ref.grad(first_layer + static_cast<int>(i)))));
    diff.merge(compare(r.to_host(weights[i]), want(ref.weight(first_layer + static_cast<int>(i)))));
  }
  return diff;
}

void check_step(Rank& r, const std::string& lesson, int step, const std::string& what, const Diff& d,
                const std::string& where) {
  r.check(fmt::format("{} step {}: {} equal one device's", lesson, step, what), d.ok(),
          fmt::format("{}largest relative difference {:.2e} (tolerance {:.0e})", where, d.relative(),
                      Diff::kTolerance));
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

StreamClock::StreamClock(Rank& r) : r_(r), marker_(r.zeros({1})) {}

double StreamClock::at() {
  r_.scale_(marker_, 1.0f);
  r_.to_host(marker_);
  return r_.now();
}

std::string format_memory(const Memory& m) {
  return fmt::format("params {}  grads {}  optimizer {}  activations {}  total {}", format_bytes(m.params),
                     format_bytes(m.grads), format_bytes(m.optimizer), format_bytes(m.activations),
                     format_bytes(m.total()));
}

std::int64_t optimizer_bytes(const Options& o, std::int64_t param_bytes) {
  return o.optimizer == "adamw" ? 2 * param_bytes : 0;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
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

}  // namespace ranklab::mlp
