#include "lessons/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace ranklab::check {

void Agreement::merge(double difference, const std::string& at) {
  if (std::isnan(worst)) return;  // NaN wins, and stays
  if (!(difference <= worst)) {
    worst = difference;
    where = at;
  }
}

void Agreement::add_relative(const std::vector<float>& got, const std::vector<double>& want,
                             const std::string& what, std::int64_t cols, double* largest_so_far,
                             const std::vector<double>* allowance) {
  double scale_of_want = 1e-30;
  for (double w : want) scale_of_want = std::max(scale_of_want, std::abs(w));
  if (largest_so_far != nullptr) scale_of_want = *largest_so_far = std::max(*largest_so_far, scale_of_want);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double beyond = std::abs(got[i] - want[i]) - (allowance != nullptr ? (*allowance)[i] : 0.0);
    const double rel = std::max(beyond, 0.0) / scale_of_want;
    if (!(rel <= worst)) {
      merge(rel,
            fmt::format("{} [{}, {}]: expected {:.9g}, got {:.9g}", what, static_cast<std::int64_t>(i) / cols,
                        static_cast<std::int64_t>(i) % cols, want[i], got[i]));
    }
  }
}

double Agreement::relative() const {
  return max_abs / (scale > 1e-30 ? scale : 1.0);
}

void Agreement::merge(const Agreement& d) {
  tight += d.tight;
  loose += d.loose;
  if (d.loosest > loosest) {
    loosest = d.loosest;
    loosest_where = d.loosest_where;
  }
  // The worst element of either decides (NaN the worst of all); the relative figure keeps the larger.
  if (!std::isnan(worst) && (std::isnan(d.worst) || d.worst > worst)) {
    worst = d.worst;
    where = d.where;
  }
  if (d.max_abs / std::max(d.scale, 1e-30) >= max_abs / std::max(scale, 1e-30)) {
    max_abs = d.max_abs;
    scale = d.scale;
  }
}

namespace {
// got against want within bound: the share of the bound used, NaN counting as infinitely far.
double used(double got, double want, double bound) {
  const double e = std::fabs(got - want);
  if (std::isnan(e)) return INFINITY;
  if (e == 0) return 0;
  return bound > 0 ? e / bound : INFINITY;
}

// A bound over the magnitude of what it bounds; infinite when the bound is, 0 when both are 0.
double looseness(double bound, double magnitude) {
  if (!(bound < INFINITY)) return INFINITY;
  if (bound == 0) return 0;
  return magnitude > 0 ? bound / magnitude : INFINITY;
}
}  // namespace

Agreement within_bound(const std::vector<float>& got, const std::vector<float>& want,
                       const std::vector<float>& bound, const std::string& what, std::int64_t cols) {
  Agreement d;
  if (got.size() != want.size()) {
    d.worst = INFINITY;
    d.where = fmt::format("{}: {} numbers where {} were expected", what, got.size(), want.size());
    return d;
  }
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    d.max_abs = std::isnan(e) ? INFINITY : std::max(d.max_abs, e);
    d.scale = std::max(d.scale, std::fabs(static_cast<double>(want[i])));
    const double u = used(got[i], want[i], bound[i]);
    if (u > d.worst || (i == 0 && u == 0)) {
      d.worst = u;
      at = i;
    }
  }
  // How loose the bound is against what it bounds: its largest element over the tensor's largest value.
  double widest = 0;
  for (float b : bound) widest = std::max(widest, static_cast<double>(b));
  d.loosest = looseness(widest, d.scale);
  (d.loosest < 1 ? d.tight : d.loose) = 1;
  d.loosest_where = fmt::format("{} (bound up to {:.3g}, values up to {:.3g})", what, widest, d.scale);
  if (!got.empty()) {
    const auto i = static_cast<std::int64_t>(at);
    d.where = fmt::format("{} [{}, {}]: expected {:.9g}, got {:.9g}, difference {:.3g}, bound {:.3g}", what,
                          i / cols, i % cols, want[at], got[at],
                          static_cast<double>(got[at]) - static_cast<double>(want[at]), bound[at]);
  }
  return d;
}

Agreement within_bound(double got, double want, double bound, const std::string& what) {
  Agreement d;
  d.max_abs = std::isnan(got) ? INFINITY : std::fabs(got - want);
  d.scale = std::fabs(want);
  d.worst = used(got, want, bound);
  d.where = fmt::format("{}: expected {:.17g}, got {:.17g}, difference {:.3g}, bound {:.3g}", what, want, got,
                        got - want, bound);
  d.loosest = looseness(bound, d.scale);
  (d.loosest < 1 ? d.tight : d.loose) = 1;
  d.loosest_where = fmt::format("{} (bound {:.3g}, value {:.3g})", what, bound, d.scale);
  return d;
}

void record_step(Rank& r, const std::string& lesson, int step, const std::string& what, const Agreement& d,
                 const std::string& where) {
  // Within a bound as large as the values themselves a wrong number passes too. The bounds are the
  // reference's alone, whatever the rank computed, so a broken lesson cannot make its check undecided by
  // being wrong; only a training past what float32 can follow does: a relu input within rounding of zero
  // decides whether a gradient flows, and after enough such layers no float32 run, on one device or many,
  // is bound to exact arithmetic.
  const std::string beyond =
      d.loose == 0 ? ""
                   : fmt::format(
                         "{} of {} tensors compared have a bound as large as their values, so agreeing "
                         "there proves nothing (the loosest: {}); ",
                         d.loose, d.loose + d.tight, d.loosest_where);
  if (!d.decided()) {
    if (r.rank() == 0) {
      r.print(fmt::format(
          "{} step {}: not decided: {}every number is within its bound ({:.3g} used at worst), "
          "but the training is past what float32 can follow (relu inputs within rounding of zero, "
          "layer after layer)",
          lesson, step, beyond, d.worst));
    }
    return;
  }
  r.check(
      fmt::format("{} step {}: {} equal one device's within float32's rounding bound", lesson, step, what),
      d.ok(),
      fmt::format("{}{:.3g} of the bound used at worst; {}; largest relative difference {:.3g}{}", where,
                  d.worst, d.where, d.relative(),
                  d.loose == 0 ? "" : "; " + beyond.substr(0, beyond.size() - 2)));
}

std::string agreement(double worst, double relative, bool decided) {
  return fmt::format("{} (at worst {:.3g} of float32's rounding bound; largest relative difference {:.3g}){}",
                     worst <= 1 ? "yes" : "NO", worst, relative,
                     decided || worst > 1 ? "" : "; but not decided at every step (see above)");
}

std::string verdict(const Agreement& d) {
  if (!d.ok()) return "DIFFERENT";
  return d.decided() ? "ok" : "not decided";
}

void adamw_step(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& m,
                std::vector<double>& v, double lr, double weight_decay, const AdamW& h, int step) {
  if (m.empty()) m.assign(w.size(), 0.0), v.assign(w.size(), 0.0);
  const AdamWCorrections c = adamw_corrections(h, step);
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = adamw_element(w[i], g[i], m[i], v[i], lr, weight_decay, h, c.c1, c.c2);
}

}  // namespace ranklab::check
