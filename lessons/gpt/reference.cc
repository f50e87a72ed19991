#include "lessons/gpt/reference.h"

#include <cmath>
#include <mutex>
#include <string>

#include "common/random.h"
#include "lessons/check.h"
#include "lessons/gpt/model.h"

namespace ranklab::gpt {

namespace {
using Vec = std::vector<double>;

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
                 Vec& dw, Vec* dx) {
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < m; ++j) {
      const double a = x[i * m + j];
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        dw[j * k + l] += a * dy[i * k + l];
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
void bias_backward(const Vec& dy, std::int64_t n, Vec& db) {
  const std::int64_t k = static_cast<std::int64_t>(db.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t l = 0; l < k; ++l) db[l] += dy[i * k + l];
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
Vec layernorm_backward(const Norm& nm, const Vec& g, const Vec& dy, std::int64_t n, std::int64_t h, Vec& dg,
                       Vec& db) {
  Vec dx(n * h);
  for (std::int64_t i = 0; i < n; ++i) {
    double a = 0, b = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      const double d = dy[i * h + j] * g[j];
      a += d;
      b += d * nm.xhat[i * h + j];
      dg[j] += dy[i * h + j] * nm.xhat[i * h + j];
      db[j] += dy[i * h + j];
    }
    a /= h;
    b /= h;
    for (std::int64_t j = 0; j < h; ++j) {
      dx[i * h + j] = nm.rstd[i] * (dy[i * h + j] * g[j] - a - nm.xhat[i * h + j] * b);
    }
  }
  return dx;
}

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
double gelu(double u) {
  return 0.5 * u * (1 + std::tanh(kGeluC * (u + 0.044715 * u * u * u)));
}
double gelu_grad(double u) {
  const double t = std::tanh(kGeluC * (u + 0.044715 * u * u * u));
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * kGeluC * (1 + 3 * 0.044715 * u * u);
}
}  // namespace

Reference::Reference(const Config& cfg) : c_(cfg) {
  const std::int64_t B = c_.global_batch, S = c_.seq, h = c_.hidden, V = c_.vocab, H = c_.heads;
  const std::int64_t hd = h / H, n = B * S, L = c_.layers;
  // Parameters: blocks first (layer-major), then the others.
  const int count = static_cast<int>(L * kBlockParams + kOtherParams);
  std::vector<parallel::ParamSpec> specs(count);
  for (int l = 0; l < L; ++l)
    for (int k = 0; k < kBlockParams; ++k)
      specs[l * kBlockParams + k] = block_spec(c_, l, static_cast<BlockParam>(k));
  for (int k = 0; k < kOtherParams; ++k)
    specs[L * kBlockParams + k] = other_spec(c_, static_cast<OtherParam>(k));
  std::vector<Vec> w(count), m(count), v(count);
  for (int i = 0; i < count; ++i) {
    const std::int64_t size = specs[i].full.numel();
    w[i].resize(size);
    for (std::int64_t e = 0; e < size; ++e) {
      w[i][e] =
          specs[i].std > 0 ? static_cast<double>(specs[i].std * normal_at(specs[i].seed, e)) : specs[i].value;
    }
    m[i].assign(size, 0.0);
    v[i].assign(size, 0.0);
  }
  auto P = [&](int layer, int k) -> Vec& { return w[layer * kBlockParams + k]; };
  const int other = static_cast<int>(L * kBlockParams);
  std::vector<std::int64_t> tok(n), tgt(n);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      tok[b * S + s] = token(c_, b, s);
      tgt[b * S + s] = token(c_, b, s + 1);
    }
  }

  struct Acts {
    Vec x;
    Norm ln1;
    Vec qkv, att, x1;
    Norm ln2;
    Vec u, g;
    std::vector<Vec> probs;  // per (sample, head): S x S
  };
  weights_.push_back(w);  // step 0: the initial values
  for (int step = 1; step <= c_.steps; ++step) {
    // The residual dropout at `site` of layer l, on a [n, h] branch or its gradient: the element of sample
    // b, position s is row s * micro_batch + b % micro_batch of the (b / micro_batch)-th micro-batch.
    auto drop = [&](Vec& branch, int l, int site) {
      if (c_.dropout == 0) return;
      const std::uint64_t seed = dropout_seed(step, l, site);
      const double kept = 1.0 / (1.0 - static_cast<double>(c_.dropout));
      const std::int64_t mb = c_.micro_batch;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t b = i / S, s = i % S, row = dropout_row(c_, b / mb, s * mb + b % mb);
        for (std::int64_t j = 0; j < h; ++j)
          branch[i * h + j] *= dropout_keeps(seed, row, j, c_.dropout) ? kept : 0.0;
      }
    };
    // ---- forward
    Vec x(n * h);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < h; ++j)
        x[i * h + j] = w[other + kWte][tok[i] * h + j] + w[other + kWpe][(i % S) * h + j];
    std::vector<Acts> acts(L);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    for (int l = 0; l < L; ++l) {
      Acts& a = acts[l];
      a.x = x;
      a.ln1 = layernorm(x, P(l, kLn1G), P(l, kLn1B), n, h);
      a.qkv = mm(a.ln1.y, P(l, kQkvW), n, h, 3 * h);
      add_bias(a.qkv, P(l, kQkvB), n);
      a.att.assign(n * h, 0.0);
      a.probs.assign(B * H, Vec(S * S, 0.0));
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t hh = 0; hh < H; ++hh) {
          Vec& p = a.probs[b * H + hh];
          auto q = [&](std::int64_t s, std::int64_t d) {
            return a.qkv[(b * S + s) * 3 * h + hh * 3 * hd + d];
          };
          auto k = [&](std::int64_t s, std::int64_t d) {
            return a.qkv[(b * S + s) * 3 * h + hh * 3 * hd + hd + d];
          };
          auto vv = [&](std::int64_t s, std::int64_t d) {
            return a.qkv[(b * S + s) * 3 * h + hh * 3 * hd + 2 * hd + d];
          };
          for (std::int64_t i = 0; i < S; ++i) {
            double mx = -1e300;
            for (std::int64_t j = 0; j <= i; ++j) {
              double sc = 0;
              for (std::int64_t d = 0; d < hd; ++d) sc += q(i, d) * k(j, d);
              p[i * S + j] = sc * scale;
              mx = std::max(mx, p[i * S + j]);
            }
            double sum = 0;
            for (std::int64_t j = 0; j <= i; ++j) sum += (p[i * S + j] = std::exp(p[i * S + j] - mx));
            for (std::int64_t j = 0; j <= i; ++j) p[i * S + j] /= sum;
            for (std::int64_t d = 0; d < hd; ++d) {
              double o = 0;
              for (std::int64_t j = 0; j <= i; ++j) o += p[i * S + j] * vv(j, d);
              a.att[(b * S + i) * h + hh * hd + d] = o;
            }
          }
        }
      }
      Vec proj = mm(a.att, P(l, kProjW), n, h, h);
      add_bias(proj, P(l, kProjB), n);
      drop(proj, l, 0);
      a.x1 = x;
      for (std::int64_t i = 0; i < n * h; ++i) a.x1[i] += proj[i];
      a.ln2 = layernorm(a.x1, P(l, kLn2G), P(l, kLn2B), n, h);
      a.u = mm(a.ln2.y, P(l, kFc1W), n, h, 4 * h);
      add_bias(a.u, P(l, kFc1B), n);
      a.g = a.u;
      for (double& e : a.g) e = gelu(e);
      Vec o = mm(a.g, P(l, kFc2W), n, 4 * h, h);
      add_bias(o, P(l, kFc2B), n);
      drop(o, l, 1);
      x = a.x1;
      for (std::int64_t i = 0; i < n * h; ++i) x[i] += o[i];
    }
    Norm lnf = layernorm(x, w[other + kLnfG], w[other + kLnfB], n, h);
    const Vec& wte = w[other + kWte];
    Vec dlog(n * V);
    double loss = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      double mx = -1e300;
      for (std::int64_t t = 0; t < V; ++t) {
        double z = 0;
        for (std::int64_t j = 0; j < h; ++j) z += lnf.y[i * h + j] * wte[t * h + j];
        dlog[i * V + t] = z;
        mx = std::max(mx, z);
      }
      double sum = 0;
      for (std::int64_t t = 0; t < V; ++t) sum += std::exp(dlog[i * V + t] - mx);
      loss += std::log(sum) + mx - dlog[i * V + tgt[i]];
      for (std::int64_t t = 0; t < V; ++t) {
        dlog[i * V + t] =
            (std::exp(dlog[i * V + t] - mx) / sum - (t == tgt[i] ? 1.0 : 0.0)) / static_cast<double>(n);
      }
    }
    loss_.push_back(loss / static_cast<double>(n));

    // ---- backward
    std::vector<Vec> g(count);
    for (int i = 0; i < count; ++i) g[i].assign(w[i].size(), 0.0);
    Vec dyf(n * h, 0.0);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t t = 0; t < V; ++t) {
        const double d = dlog[i * V + t];
        for (std::int64_t j = 0; j < h; ++j) {
          g[other + kWte][t * h + j] += d * lnf.y[i * h + j];
          dyf[i * h + j] += d * wte[t * h + j];
        }
      }
    }
    Vec dx = layernorm_backward(lnf, w[other + kLnfG], dyf, n, h, g[other + kLnfG], g[other + kLnfB]);
    for (int l = static_cast<int>(L) - 1; l >= 0; --l) {
      Acts& a = acts[l];
      auto G = [&](int k) -> Vec& { return g[l * kBlockParams + k]; };
      // MLP
      Vec dout = dx;
      drop(dout, l, 1);
      bias_backward(dout, n, G(kFc2B));
      Vec dg(n * 4 * h);
      mm_backward(a.g, P(l, kFc2W), dout, n, 4 * h, h, G(kFc2W), &dg);
      for (std::int64_t i = 0; i < n * 4 * h; ++i) dg[i] *= gelu_grad(a.u[i]);
      bias_backward(dg, n, G(kFc1B));
      Vec dy2(n * h);
      mm_backward(a.ln2.y, P(l, kFc1W), dg, n, h, 4 * h, G(kFc1W), &dy2);
      Vec dx1 = layernorm_backward(a.ln2, P(l, kLn2G), dy2, n, h, G(kLn2G), G(kLn2B));
      for (std::int64_t i = 0; i < n * h; ++i) dx1[i] += dx[i];
      // attention
      Vec dproj = dx1;
      drop(dproj, l, 0);
      bias_backward(dproj, n, G(kProjB));
      Vec datt(n * h);
      mm_backward(a.att, P(l, kProjW), dproj, n, h, h, G(kProjW), &datt);
      Vec dqkv(n * 3 * h, 0.0);
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t hh = 0; hh < H; ++hh) {
          const Vec& p = a.probs[b * H + hh];
          auto col = [&](std::int64_t s, int part, std::int64_t d) {
            return (b * S + s) * 3 * h + hh * 3 * hd + part * hd + d;
          };
          for (std::int64_t i = 0; i < S; ++i) {
            Vec dp(i + 1);
            double dot = 0;
            for (std::int64_t j = 0; j <= i; ++j) {
              double s = 0;
              for (std::int64_t d = 0; d < hd; ++d) {
                s += datt[(b * S + i) * h + hh * hd + d] * a.qkv[col(j, 2, d)];
                dqkv[col(j, 2, d)] += p[i * S + j] * datt[(b * S + i) * h + hh * hd + d];
              }
              dp[j] = s;
              dot += p[i * S + j] * s;
            }
            for (std::int64_t j = 0; j <= i; ++j) {
              const double ds = p[i * S + j] * (dp[j] - dot) * scale;
              for (std::int64_t d = 0; d < hd; ++d) {
                dqkv[col(i, 0, d)] += ds * a.qkv[col(j, 1, d)];
                dqkv[col(j, 1, d)] += ds * a.qkv[col(i, 0, d)];
              }
            }
          }
        }
      }
      bias_backward(dqkv, n, G(kQkvB));
      Vec dy1(n * h);
      mm_backward(a.ln1.y, P(l, kQkvW), dqkv, n, h, 3 * h, G(kQkvW), &dy1);
      Vec dxl = layernorm_backward(a.ln1, P(l, kLn1G), dy1, n, h, G(kLn1G), G(kLn1B));
      for (std::int64_t i = 0; i < n * h; ++i) dx[i] = dx1[i] + dxl[i];
    }
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < h; ++j) {
        g[other + kWte][tok[i] * h + j] += dx[i * h + j];
        g[other + kWpe][(i % S) * h + j] += dx[i * h + j];
      }
    }

    // ---- AdamW (Loshchilov & Hutter), weight decay only on the matrices and embeddings
    const AdamW hyper;
    for (int i = 0; i < count; ++i) {
      check::adamw_step(w[i], g[i], m[i], v[i], c_.lr, specs[i].decay ? hyper.weight_decay : 0.0, hyper,
                        step);
    }
    grads_.push_back(std::move(g));
    weights_.push_back(w);
  }
}

int Reference::index(int kind, int layer) const {
  return kind < kBlockParams ? layer * kBlockParams + kind : c_.layers * kBlockParams + (kind - kBlockParams);
}
const std::vector<double>& Reference::grad(int step, int kind, int layer) const {
  return grads_[step - 1][index(kind, layer)];
}
const std::vector<double>& Reference::weight(int step, int kind, int layer) const {
  return weights_[step][index(kind, layer)];
}

std::shared_ptr<const Reference> Reference::get(const Config& c) {
  // Only what defines the problem goes into the key: the shape, the data, the optimizer, the steps, and
  // with dropout its probability and the micro-batch size (the masks follow the micro-batches' rows, as a
  // framework's random stream follows its kernels).
  std::string key = c.shape() + " batch " + std::to_string(c.global_batch) + " steps " +
                    std::to_string(c.steps) + " lr " + std::to_string(c.lr);
  if (c.dropout > 0) key += " dropout " + std::to_string(c.dropout) + " mb " + std::to_string(c.micro_batch);
  static std::mutex mu;
  static std::string cached_key;
  static std::shared_ptr<const Reference> cached;
  std::lock_guard<std::mutex> lock(mu);
  if (!cached || cached_key != key) {
    cached = std::make_shared<const Reference>(c);
    cached_key = key;
  }
  return cached;
}

}  // namespace ranklab::gpt
