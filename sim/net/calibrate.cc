#include "sim/net/calibrate.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <tuple>

#include "common/compare.h"
#include "common/errors.h"

namespace ranklab {

const ParameterFit* Calibration::find(const std::string& key) const {
  for (const ParameterFit& f : fits) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

namespace {

// ---- the parameters --------------------------------------------------------------------------------------

// A profile number the fit may change. Times are linear in a latency, and in the inverse of an efficiency,
// so the fit works in g = value or g = 1 / value. A fitted value is kept inside [lowest, highest], the range
// the profile file accepts, so that the fitted profile loads.
struct Knob {
  std::string key;
  bool inverse;
  double& (*field)(Profile&);
  double lowest = 0;
  double highest = 1e6;
  double value(const Profile& p) const { return field(const_cast<Profile&>(p)); }  // only reads
  double g(const Profile& p) const { return inverse ? 1 / value(p) : value(p); }
};

// Efficiencies before latencies: when the data cannot tell two apart, the later one is kept as it was, and a
// latency is the better one to keep (bandwidth shows in every large message, latency only in small ones).
// NCCL's latency scale comes before the launch overhead (a launch shows only where it exceeds a
// collective, or through nccl-tests' loop as a twentieth of one) and before the link latencies, which
// collectives do not read (their latencies are NCCL's; docs/model.md section 4).
std::vector<Knob> knobs(const Profile& p) {
  std::vector<Knob> k;
  auto efficiency = [&](const char* key, double& (*field)(Profile&)) {
    k.push_back({key, true, field, 0.01, 1});
  };
  auto latency = [&](const char* key, double& (*field)(Profile&)) {
    k.push_back({key, false, field, 0, 1e6});
  };
  efficiency("gpu.compute_efficiency", [](Profile& q) -> double& { return q.gpu.compute_efficiency; });
  efficiency("gpu.memory_efficiency", [](Profile& q) -> double& { return q.gpu.memory_efficiency; });
  if (p.has_nvlink)
    efficiency("nvlink.efficiency", [](Profile& q) -> double& { return q.nvlink.efficiency; });
  efficiency("nic.efficiency", [](Profile& q) -> double& { return q.nic.efficiency; });
  efficiency("pcie.efficiency", [](Profile& q) -> double& { return q.pcie.efficiency; });
  k.push_back(
      {"nccl.latency_scale", false, [](Profile& q) -> double& { return q.nccl.latency_scale; }, 0.01, 100});
  latency("gpu.launch_overhead_us", [](Profile& q) -> double& { return q.gpu.launch_overhead_us; });
  if (p.has_nvlink) latency("nvlink.latency_us", [](Profile& q) -> double& { return q.nvlink.latency_us; });
  latency("nic.latency_us", [](Profile& q) -> double& { return q.nic.latency_us; });
  latency("pcie.latency_us", [](Profile& q) -> double& { return q.pcie.latency_us; });
  latency("fabric.switch_latency_us", [](Profile& q) -> double& { return q.fabric.switch_latency_us; });
  return k;
}

// ---- what is fitted: collectives and kernels
// ---------------------------------------------------------------

// Durations keyed by (what, occurrence), occurrences counted in start order: the third all_reduce of 4 MiB on
// the world is the same collective in both reports, whatever order a backend recorded them in.
template <class Key>
std::map<std::pair<Key, std::size_t>, double> by_occurrence(
    std::map<Key, std::vector<std::pair<double, double>>> grouped) {
  std::map<std::pair<Key, std::size_t>, double> out;
  for (auto& [key, list] : grouped) {
    std::stable_sort(list.begin(), list.end());
    for (std::size_t k = 0; k < list.size(); ++k) out[{key, k}] = list[k].second;
  }
  return out;
}

using CollectiveKey = std::tuple<int, std::int64_t, std::string>;
using KernelKey = std::pair<int, std::string>;

std::map<std::pair<CollectiveKey, std::size_t>, double> collective_times(const RunReport& r) {
  std::map<CollectiveKey, std::vector<std::pair<double, double>>> grouped;
  for (const CollectiveRecord& c : r.collectives) {
    if (c.op == CommOp::Barrier || c.group_size < 2 || c.bookkeeping) continue;
    grouped[{static_cast<int>(c.op), c.bytes, c.group}].push_back({c.start_us, c.time_us()});
  }
  return by_occurrence(std::move(grouped));
}

std::map<std::pair<KernelKey, std::size_t>, double> kernel_times(const RunReport& r) {
  std::map<KernelKey, std::vector<std::pair<double, double>>> grouped;
  for (const Span& s : r.spans) {
    if (s.kind == SpanKind::Compute) grouped[{s.rank, s.name}].push_back({s.start_us, s.end_us - s.start_us});
  }
  return by_occurrence(std::move(grouped));
}

// The measured items in a fixed order, and a way to find the same items in a simulated report.
struct Targets {
  std::vector<std::pair<CollectiveKey, std::size_t>> collectives;
  std::vector<std::pair<KernelKey, std::size_t>> kernels;
  std::vector<double> measured_us;  // collectives, then kernels
};

// The items of `measured` that `simulated` has too, with positive times in both.
Targets match(const RunReport& measured, const RunReport& simulated) {
  Targets t;
  const auto mc = collective_times(measured), sc = collective_times(simulated);
  for (const auto& [key, us] : mc) {
    auto it = sc.find(key);
    if (us > 0 && it != sc.end() && it->second > 0) {
      t.collectives.push_back(key);
      t.measured_us.push_back(us);
    }
  }
  const auto mk = kernel_times(measured), sk = kernel_times(simulated);
  for (const auto& [key, us] : mk) {
    auto it = sk.find(key);
    if (us > 0 && it != sk.end() && it->second > 0) {
      t.kernels.push_back(key);
      t.measured_us.push_back(us);
    }
  }
  return t;
}

// The simulated times of the targets, in the targets' order; 0 for one the simulation lacks.
std::vector<double> times_of(const Targets& t, const RunReport& simulated) {
  std::vector<double> out;
  out.reserve(t.measured_us.size());
  const auto sc = collective_times(simulated);
  for (const auto& key : t.collectives) {
    auto it = sc.find(key);
    out.push_back(it == sc.end() ? 0 : it->second);
  }
  const auto sk = kernel_times(simulated);
  for (const auto& key : t.kernels) {
    auto it = sk.find(key);
    out.push_back(it == sk.end() ? 0 : it->second);
  }
  return out;
}

double error_of(const std::vector<double>& measured, const std::vector<double>& simulated) {
  std::vector<double> ratios;
  for (std::size_t i = 0; i < measured.size(); ++i) ratios.push_back(simulated[i] / measured[i]);
  return geomean_error(ratios);
}

// ---- least squares ---------------------------------------------------------------------------------------

// The Jacobian's columns as a matrix, one row per measured point.
Eigen::MatrixXd as_matrix(const std::vector<std::vector<double>>& columns) {
  const Eigen::Index rows = columns.empty() ? 0 : static_cast<Eigen::Index>(columns.front().size());
  Eigen::MatrixXd a(rows, static_cast<Eigen::Index>(columns.size()));
  for (std::size_t j = 0; j < columns.size(); ++j) {
    a.col(static_cast<Eigen::Index>(j)) = Eigen::Map<const Eigen::VectorXd>(columns[j].data(), rows);
  }
  return a;
}

// Which columns of A the data can tell apart: Gram-Schmidt over the columns in order, dropping a column
// that is (nearly) a combination of the earlier ones. What is left of a column after removing the earlier
// ones must be at least 1% of it, or the data says nothing about that parameter that the earlier ones do
// not already say. (A pivoting QR would pick the columns in its own order; the order here is the
// parameters' priority.)
std::vector<bool> independent_columns(const std::vector<std::vector<double>>& columns) {
  const Eigen::MatrixXd a = as_matrix(columns);
  std::vector<bool> kept(columns.size(), false);
  Eigen::MatrixXd basis(a.rows(), 0);
  for (Eigen::Index j = 0; j < a.cols(); ++j) {
    const double norm0 = a.col(j).norm();
    if (norm0 == 0) continue;
    Eigen::VectorXd v = a.col(j);
    for (Eigen::Index q = 0; q < basis.cols(); ++q) v -= basis.col(q).dot(v) * basis.col(q);
    const double norm = v.norm();
    if (norm < 1e-2 * norm0) continue;
    basis.conservativeResize(Eigen::NoChange, basis.cols() + 1);
    basis.col(basis.cols() - 1) = v / norm;
    kept[static_cast<std::size_t>(j)] = true;
  }
  return kept;
}

// Solves min |A x - b|^2 + lambda * sum_j |A_j|^2 x_j^2 over the `kept` columns (the others' x stay 0): a
// Levenberg-Marquardt step, which is Gauss-Newton's at lambda 0 and shrinks towards no change as lambda
// grows. The normal equations are fine here: a handful of columns, none collinear (independent_columns),
// and their matrix is symmetric positive definite, so Cholesky (LDL^T) solves it.
std::vector<double> damped_least_squares(const std::vector<std::vector<double>>& columns,
                                         const std::vector<double>& b, const std::vector<bool>& kept,
                                         double lambda) {
  std::vector<Eigen::Index> idx;
  for (std::size_t j = 0; j < columns.size(); ++j) {
    if (kept[j]) idx.push_back(static_cast<Eigen::Index>(j));
  }
  const Eigen::MatrixXd all = as_matrix(columns);
  Eigen::MatrixXd a(all.rows(), static_cast<Eigen::Index>(idx.size()));
  for (std::size_t k = 0; k < idx.size(); ++k) a.col(static_cast<Eigen::Index>(k)) = all.col(idx[k]);
  const Eigen::Map<const Eigen::VectorXd> rhs(b.data(), static_cast<Eigen::Index>(b.size()));
  Eigen::MatrixXd normal = a.transpose() * a;
  normal.diagonal() *= 1 + lambda;
  const Eigen::VectorXd y = normal.ldlt().solve(a.transpose() * rhs);
  std::vector<double> x(columns.size(), 0);
  for (std::size_t k = 0; k < idx.size(); ++k)
    x[static_cast<std::size_t>(idx[k])] = y(static_cast<Eigen::Index>(k));
  return x;
}

// ---- the profile file ------------------------------------------------------------------------------------

// Four significant digits, always with a decimal point so TOML reads a float, without trailing zeros.
std::string toml_number(double v) {
  const int magnitude = v == 0 ? 0 : static_cast<int>(std::floor(std::log10(std::fabs(v))));
  const int decimals = std::clamp(3 - magnitude, 1, 6);
  std::string s = fmt::format("{:.{}f}", v, decimals);
  while (s.size() > 1 && s.back() == '0' && s[s.size() - 2] != '.') s.pop_back();
  return s;
}

// Text for a comment or a basic string: one line, quotes and backslashes escaped when quoted.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : one_line(s)) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// "26 collectives", "3 kernels", "26 collectives and 3 kernels".
std::string samples_text(const ParameterFit& f) {
  auto count = [](int n, const char* what) { return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s"); };
  if (f.kernels == 0) return count(f.collectives, "collective");
  if (f.collectives == 0) return count(f.kernels, "kernel");
  return count(f.collectives, "collective") + " and " + count(f.kernels, "kernel");
}

}  // namespace

Calibration calibrate(const RunReport& measured, const Profile& profile, const Simulate& simulate) {
  if (!simulate) throw UsageError("calibrate needs a simulator to repeat the measured run with");
  Calibration c;
  c.profile = profile;
  auto run = [&](const Profile& p) {
    ++c.simulations;
    return simulate(p);
  };

  const RunReport base = run(profile);
  const Targets targets = match(measured, base);
  c.collectives = static_cast<int>(targets.collectives.size());
  c.kernels = static_cast<int>(targets.kernels.size());
  if (targets.measured_us.empty()) {
    throw UsageError(fmt::format(
        "nothing to fit: no collective or kernel of the measured report matches a simulation of lesson '{}' "
        "on {} ranks",
        measured.lesson, measured.world));
  }
  const std::vector<double>& m = targets.measured_us;
  std::vector<double> sim = times_of(targets, base);
  c.error_before = c.error_after = error_of(m, sim);

  // Sensitivities: d(time) / d(g) for each parameter, by simulating once with it nudged: efficiencies down
  // by a tenth, latencies up by a tenth (or 0.1 us from 0). Small, because the model is only piecewise
  // linear and the slope wanted is the one where the profile is.
  const std::vector<Knob> all = knobs(profile);
  auto linearize = [&](const Profile& at, const std::vector<double>& sim_at, const std::vector<bool>& probe) {
    std::vector<std::vector<double>> columns(all.size(), std::vector<double>(m.size(), 0));
    for (std::size_t j = 0; j < all.size(); ++j) {
      if (!probe[j]) continue;
      const Knob& k = all[j];
      Profile nudged = at;
      double& v = k.field(nudged);
      v = k.inverse ? v * 0.9 : v + std::max(0.1 * v, 0.1);
      const double dg = k.g(nudged) - k.g(at);
      const std::vector<double> t = times_of(targets, run(nudged));
      for (std::size_t i = 0; i < m.size(); ++i) {
        // A time that moved by rounding alone (a kernel's end minus its start, both shifted by a latency)
        // does not depend on the parameter.
        const double change = t[i] - sim_at[i];
        columns[j][i] =
            std::fabs(change) > 1e-9 * std::max(std::fabs(t[i]), std::fabs(sim_at[i])) ? change / dg : 0;
      }
    }
    return columns;
  };
  // Relative to the measurement, so that small and large messages count alike.
  auto relative = [&](const std::vector<std::vector<double>>& columns) {
    std::vector<std::vector<double>> a(all.size(), std::vector<double>(m.size()));
    for (std::size_t j = 0; j < all.size(); ++j) {
      for (std::size_t i = 0; i < m.size(); ++i) a[j][i] = columns[j][i] / m[i];
    }
    return a;
  };
  const std::vector<std::vector<double>> jacobian =
      linearize(profile, sim, std::vector<bool>(all.size(), true));
  std::vector<std::vector<double>> a = relative(jacobian);
  const std::vector<bool> independent = independent_columns(a);
  std::vector<bool> fit = independent;  // what the current linearization fits

  // Levenberg-Marquardt with that Jacobian: each step solves for the change of g that best explains the
  // remaining relative residual. A step that does not lower the error is retried shorter (more damping);
  // one that does is kept, and the next may be longer. The model is only piecewise linear (the roofline's
  // max, the slowest link of a path, NCCL's choice of algorithm, a launch-bound loop against a
  // kernel-bound one), so a full step can overshoot, and the slopes where the fit ends up may not be the
  // ones where it started: when the steps stop helping, the Jacobian is measured again where the profile
  // now is (for the parameters the first one could fit), and the iteration goes on while that helps.
  std::vector<double> g(all.size());
  for (std::size_t j = 0; j < all.size(); ++j) g[j] = all[j].g(profile);
  std::vector<bool> changed(all.size(), false);
  std::vector<std::string> clamped(all.size());
  const int refit = static_cast<int>(std::count(independent.begin(), independent.end(), true));
  while (true) {
    const double pass_start_error = c.error_after;
    double lambda = 0;
    while (c.simulations < kCalibrationSimulations && lambda < 1e6) {
      std::vector<double> b(m.size());
      for (std::size_t i = 0; i < m.size(); ++i) b[i] = (m[i] - sim[i]) / m[i];
      const std::vector<double> dg = damped_least_squares(a, b, fit, lambda);
      Profile next = c.profile;
      std::vector<std::string> next_clamped = clamped;
      for (std::size_t j = 0; j < all.size(); ++j) {
        if (!fit[j]) continue;
        const Knob& knob = all[j];
        const double gj = g[j] + dg[j];
        double value = knob.inverse ? (gj > 0 ? 1 / gj : knob.highest) : gj;
        next_clamped[j].clear();
        if (knob.inverse && value > knob.highest) {
          value = knob.highest;
          next_clamped[j] = "clamped to 1: the measurement is faster than the line rate or peak allows";
        } else if (value < knob.lowest && knob.lowest == 0) {
          value = 0;
          next_clamped[j] = "fitted below 0 and set to 0";
        } else if (value < knob.lowest || value > knob.highest) {
          value = std::clamp(value, knob.lowest, knob.highest);
          next_clamped[j] = fmt::format("clamped to {}", toml_number(value));
        }
        knob.field(next) = value;
      }
      const std::vector<double> next_sim = times_of(targets, run(next));
      const double next_error = error_of(m, next_sim);
      if (!(next_error < c.error_after)) {
        lambda = lambda == 0 ? 1e-2 : lambda * 10;
        continue;
      }
      const bool converged = c.error_after - next_error < 1e-4 * (1 + c.error_after);
      c.profile = next;
      sim = next_sim;
      c.error_after = next_error;
      clamped = next_clamped;
      for (std::size_t j = 0; j < all.size(); ++j) {
        const double before_step = g[j];
        g[j] = all[j].g(c.profile);
        changed[j] = changed[j] || g[j] != before_step;
      }
      if (converged) break;
      lambda = lambda < 1e-2 ? 0 : lambda / 10;
    }
    // Linearize again only when this pass helped and the budget holds another probe of every parameter
    // and a step.
    const bool helped = pass_start_error - c.error_after > 1e-4 * (1 + c.error_after);
    if (!helped || refit == 0 || c.simulations + refit + 1 > kCalibrationSimulations) break;
    a = relative(linearize(c.profile, sim, independent));
    const std::vector<bool> now = independent_columns(a);
    for (std::size_t j = 0; j < all.size(); ++j) fit[j] = independent[j] && now[j];
  }

  for (std::size_t j = 0; j < all.size(); ++j) {
    ParameterFit f;
    f.key = all[j].key;
    f.before = all[j].value(profile);
    f.after = all[j].field(c.profile);
    for (std::size_t i = 0; i < m.size(); ++i) {
      if (jacobian[j][i] == 0) continue;
      ++(i < targets.collectives.size() ? f.collectives : f.kernels);
    }
    f.fitted = changed[j];
    if (f.collectives + f.kernels == 0) {
      f.note = "no collective or kernel of the report depends on it";
    } else if (!independent[j]) {
      f.note = "the data cannot tell it apart from the parameters above";
    } else if (!f.fitted) {
      f.note = "no change of it fitted the report better";
    } else {
      f.note = clamped[j];
    }
    c.fits.push_back(f);
  }
  if (!(c.error_after < c.error_before))
    c.notes.push_back("no change of the profile fitted the report better");
  return c;
}

std::string fitted_profile_text(const std::string& original, const Calibration& calibration,
                                const std::string& name, const std::string& measured_name,
                                const std::string& date) {
  std::vector<std::string> lines;
  {
    std::istringstream in(original);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  // Where each table's last line is and where each key is set, by line.
  static const std::regex header(R"(^\s*\[\s*([A-Za-z0-9_.\-]+)\s*\]\s*(#.*)?$)");
  static const std::regex assignment(R"(^\s*([A-Za-z0-9_\-]+)\s*=.*$)");
  std::map<std::string, std::size_t> table_end{{"", 0}};
  std::map<std::pair<std::string, std::string>, std::size_t> key_line;
  std::string table;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    if (std::regex_match(lines[i], m, header)) {
      table = m[1];
      table_end[table] = i + 1;
    } else if (std::regex_match(lines[i], m, assignment)) {
      key_line[{table, m[1]}] = i;
      table_end[table] = i + 1;
    }
  }

  // Edits (at a line: replace it, or insert before it), applied from the bottom up so lines keep their
  // numbers until they are edited.
  struct Edit {
    std::size_t line;
    bool replace;
    std::vector<std::string> text;
  };
  std::vector<Edit> edits;
  std::map<std::string, std::vector<std::string>> new_tables;  // for a table the file does not have
  auto set = [&](const std::string& tbl, const std::string& key, const std::string& value,
                 const std::string& comment) {
    std::vector<std::string> text;
    if (!comment.empty()) text.push_back("# " + one_line(comment));
    text.push_back(fmt::format("{} = {}", key, value));
    auto it = key_line.find({tbl, key});
    if (it != key_line.end()) {
      edits.push_back({it->second, true, text});
    } else if (table_end.count(tbl)) {
      edits.push_back({table_end[tbl], false, text});
    } else {
      // A profile built on a base may leave a table out; writing the table here overrides just this key.
      auto& t = new_tables[tbl];
      t.insert(t.end(), text.begin(), text.end());
    }
  };

  const Profile& p = calibration.profile;
  set("", "name", toml_string(name), "");
  if (key_line.count({"", "description"})) {
    set("", "description",
        toml_string(fmt::format("{} (calibrated on {} to {})", p.description, date, measured_name)), "");
  }
  for (const ParameterFit& f : calibration.fits) {
    if (!f.fitted) continue;
    const std::size_t dot = f.key.find('.');
    set(f.key.substr(0, dot), f.key.substr(dot + 1), toml_number(f.after),
        fmt::format("Fitted by `ranklab calibrate` on {} to {} ({}{}); was {}.", date, measured_name,
                    samples_text(f), f.note.empty() ? "" : "; " + f.note, toml_number(f.before)));
  }
  std::stable_sort(edits.begin(), edits.end(), [](const Edit& a, const Edit& b) { return a.line > b.line; });
  for (const Edit& e : edits) {
    auto at = lines.begin() + static_cast<std::ptrdiff_t>(e.line);
    if (e.replace) {
      const std::string indent = lines[e.line].substr(0, lines[e.line].find_first_not_of(" \t"));
      at = lines.erase(at);
      std::vector<std::string> text;
      for (const std::string& t : e.text) text.push_back(indent + t);
      lines.insert(at, text.begin(), text.end());
    } else {
      lines.insert(at, e.text.begin(), e.text.end());
    }
  }
  for (const auto& [tbl, text] : new_tables) {
    lines.push_back("");
    lines.push_back(fmt::format("[{}]", tbl));
    lines.insert(lines.end(), text.begin(), text.end());
  }

  std::string out = fmt::format(
      "# Calibrated by `ranklab calibrate` on {} from profile '{}'\n"
      "# to the measured report {}.\n"
      "# Over its {} collectives and {} kernels, the simulation's geometric-mean error went from {:.1f}% to "
      "{:.1f}%.\n"
      "# Each fitted value has a comment above it giving what it replaced; every other number is the "
      "original's.\n\n",
      date, one_line(p.name), one_line(measured_name), calibration.collectives, calibration.kernels,
      100 * calibration.error_before, 100 * calibration.error_after);
  for (const std::string& line : lines) out += line + "\n";
  parse_profile(out, "the fitted profile");  // what is written must load
  return out;
}

std::string format_calibration(const Calibration& c) {
  std::string out =
      fmt::format("fitted to {} collectives and {} kernels in {} simulations: error {:.1f}% -> {:.1f}%\n",
                  c.collectives, c.kernels, c.simulations, 100 * c.error_before, 100 * c.error_after);
  std::size_t width = 0;
  for (const ParameterFit& f : c.fits) width = std::max(width, f.key.size());
  for (const ParameterFit& f : c.fits) {
    if (f.fitted) {
      out += fmt::format("  {:<{}} {:>9} -> {:<9} ({}){}\n", f.key, width, toml_number(f.before),
                         toml_number(f.after), samples_text(f), f.note.empty() ? "" : ": " + f.note);
    } else {
      out += fmt::format("  {:<{}} {:>9}    kept: {}\n", f.key, width, toml_number(f.before), f.note);
    }
  }
  for (const std::string& note : c.notes) out += fmt::format("  note: {}\n", note);
  return out;
}

}  // namespace ranklab
