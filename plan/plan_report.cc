#include "plan/plan_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/html_report.h"
#include "common/report.h"
#include "lessons/gpt/config.h"
#include "plan/candidates.h"

namespace ranklab::plan {

namespace {

// The step's communication parts, in the breakdown's order, and what each is called.
constexpr int kParts = 6;  // kParts is "compute and the rest"
constexpr const char* kDims[kParts] = {"tp", "sp", "cp", "pp", "dp", "ep"};
constexpr const char* kPartNames[kParts + 1] = {
    "exposed tp communication", "exposed sp communication",
    "exposed cp communication", "pipeline wait (bubble and pp transfers)",
    "exposed dp communication", "exposed ep communication (the experts' all-to-alls)",
    "compute and the rest"};
constexpr int kPipelinePart = 3;

// "16.98 s", "523 ms", "40.2 ms", "812 us": three significant digits at most, for a table.
std::string short_time(double us) {
  const double a = std::fabs(us);
  if (a >= 1e6) return fmt::format("{:.2f} s", us / 1e6);
  if (a >= 1e5) return fmt::format("{:.0f} ms", us / 1e3);
  if (a >= 1e3) return fmt::format("{:.1f} ms", us / 1e3);
  return fmt::format("{:.0f} us", us);
}

double exposed(const TrainingStats& t, const char* dim) {
  const auto it = t.exposed_comm_us.find(dim);
  return it == t.exposed_comm_us.end() ? 0.0 : it->second;
}

// The step's parts: the exposed communication of each dimension, then the rest of the step.
struct Parts {
  double comm[kParts] = {};
  double rest = 0;
};
Parts parts_of(const TrainingStats& t) {
  Parts p;
  double sum = 0;
  for (int d = 0; d < kParts; ++d) sum += p.comm[d] = exposed(t, kDims[d]);
  p.rest = t.step_time_us - sum;
  return p;
}

std::string part_name(int d) {
  return kPartNames[std::clamp(d, 0, kParts)];
}

// What differs between two layouts, from `from` to `to`: "tp 8 → 4, pp 4 → 8".
std::string layout_changes(const Layout& from, const Layout& to) {
  std::vector<std::string> d;
  auto num = [&](const char* name, int a, int b) {
    if (a != b) d.push_back(fmt::format("{} {} → {}", name, a, b));
  };
  num("tp", from.tp, to.tp);
  num("cp", from.cp, to.cp);
  num("pp", from.pp, to.pp);
  num("v", from.v, to.v);
  num("dp", from.dp, to.dp);
  num("ep", from.ep, to.ep);
  num("etp", from.etp, to.etp);
  num("zero", from.zero, to.zero);
  if (from.sp != to.sp) d.push_back(to.sp ? "sequence parallelism on" : "sequence parallelism off");
  num("micro-batch", from.micro_batch, to.micro_batch);
  if (from.recompute != to.recompute)
    d.push_back(fmt::format("recompute {} → {}", from.recompute, to.recompute));
  if (from.fp8 != to.fp8) d.push_back(to.fp8 ? "FP8 GEMMs on" : "FP8 GEMMs off");
  if (from.order != to.order) d.push_back(fmt::format("order {} → {}", from.order, to.order));
  return d.empty() ? "the same layout" : fmt::format("{}", fmt::join(d, ", "));
}

std::string bytes(std::int64_t b) {
  return format_bytes(static_cast<double>(b));
}

}  // namespace

std::string describe_question(const Question& q) {
  // The model's shape as the lesson reads and says it (gpt::Config::shape).
  const gpt::Config model = gpt::options_table().read(lesson_settings(q, Layout{}), "gpt");
  const std::string precision =
      q.fp8_recipe != "none" ? fmt::format("{} (fp8 recipe {})", q.dtype, q.fp8_recipe)
      : !q.try_fp8.empty()   ? fmt::format("{}, and with FP8 GEMMs (recipe {})", q.dtype, q.try_fp8)
                             : q.dtype;
  return fmt::format("{}{}; global batch {}; {} on {} x {} ({}, {} node{}); {}",
                     q.model == "custom" ? "" : q.model + ": ", model.shape(), q.global_batch, precision,
                     q.world(), q.profile.gpu.name, q.profile.name, q.profile.nodes,
                     q.profile.nodes == 1 ? "" : "s", q.framework);
}

std::string format_counts(const Plan& p) {
  const int feasible = p.enumerated - p.invalid - p.rejected_by_plan;
  std::string out = fmt::format(
      "layouts: {} enumerated; {} refused by the gpt lesson's checks; {} over the device's {} by the "
      "lesson's "
      "memory plan; {} left, tried in order of a lower bound on their step time\n",
      p.enumerated, p.invalid, p.rejected_by_plan, bytes(p.question.profile.hbm_capacity_bytes()), feasible);
  const int screened = p.simulated + p.rejected_by_run;
  out += fmt::format(
      "simulated {}: {} finished, {} ran out of memory in the simulation; {} pruned (their bound "
      "cannot beat the best){}{}\n",
      screened, p.simulated, p.rejected_by_run, p.pruned,
      p.probed > 0
          ? fmt::format("; {} probed first with short steps, {} of them pruned by the kernels measured",
                        p.probed, p.pruned_by_probe)
          : "",
      p.unexplored > 0 ? fmt::format("; {} not simulated (--max-candidates)", p.unexplored) : "");
  if (p.symmetric) {
    out += fmt::format(
        "screened with one rank per pipeline stage running (sym); {} leading again with every rank running "
        "(full)",
        p.confirmed);
  } else {
    out += "every rank running in every simulation (full)";
  }
  out += p.processes > 1 ? fmt::format("; {} at a time on each of {} processes, {:.1f} s\n", p.jobs,
                                       p.processes, p.wall_s)
                         : fmt::format("; {} at a time, {:.1f} s\n", p.jobs, p.wall_s);
  return out;
}

namespace {

// The table's `run` column: how the figures of a row were simulated.
const char* run_kind(const Result& r) {
  if (r.full) return "full";
  return r.run->extrapolated_from > 0 ? "ext" : "sym";
}

}  // namespace

std::string format_table(const Plan& p, int top) {
  const std::vector<const Result*> ranked = p.ranked();
  if (ranked.empty()) return "no layout finished a step\n";
  const int n = std::min<int>(top, static_cast<int>(ranked.size()));
  std::size_t width = 6;
  for (int i = 0; i < n; ++i) width = std::max(width, ranked[i]->candidate.name.size());
  // The exposed communication of each dimension, a column each.
  auto dims = [](const TrainingStats* t) {
    std::string cells;
    for (const char* dim : kDims)
      cells += fmt::format(" {:>8}", t == nullptr ? dim : short_time(exposed(*t, dim)));
    return cells.substr(1);
  };
  std::string out =
      fmt::format("{:>4}  {:<{}}  {:>8}  {:<4}  {:>7}  {:>5}  {:>6}  {}  {:>9}  {}\n", "rank", "layout",
                  width, "step", "run", "TFLOP/s", "MFU", "bubble", dims(nullptr), "peak", "largest part");
  out += fmt::format("{:>4}  {:<{}}  {:>8}  {:<4}  {:>7}  {:>5}  {:>6}  {:^{}}  {:>9}\n", "", "", width, "",
                     "", "per GPU", "", "", "exposed communication", 9 * kParts - 1, "per rank");
  bool screened = false;
  for (int i = 0; i < n; ++i) {
    const Result& r = *ranked[i];
    const TrainingStats& t = r.run->stats;
    screened = screened || !r.full;
    out += fmt::format("{:>4}  {:<{}}  {:>8}  {:<4}  {:>7.1f}  {:>4.1f}%  {:>5.1f}%  {}  {:>9}  {}\n", i + 1,
                       r.candidate.name, width, short_time(t.step_time_us), run_kind(r),
                       t.model_tflops_per_gpu, 100 * t.mfu, 100 * t.bubble_fraction, dims(&t),
                       bytes(r.run->peak_bytes), r.run->peak_part);
  }
  if (screened) {
    out +=
        "run: full, every rank simulated; sym, the screening's symmetric run (one rank per pipeline stage, "
        "the replicas mirroring it: close to the full run, not equal, where traffic crosses the spines); "
        "ext, a symmetric screening of steps of 2 p and 4 p micro-batches extended to the step's m\n";
  }
  return out;
}

std::string why_line(const Result& winner, const Result& runner_up) {
  const TrainingStats &w = winner.run->stats, &r = runner_up.run->stats;
  const Parts pw = parts_of(w), pr = parts_of(r);
  // Each part's saving going from the runner-up to the winner (negative: what the winner pays more).
  std::vector<std::pair<double, int>> delta;
  for (int d = 0; d < kParts; ++d) delta.push_back({pr.comm[d] - pw.comm[d], d});
  delta.push_back({pr.rest - pw.rest, kParts});
  std::sort(delta.begin(), delta.end(), [](const auto& a, const auto& b) {
    return std::fabs(a.first) != std::fabs(b.first) ? std::fabs(a.first) > std::fabs(b.first)
                                                    : a.second < b.second;
  });
  const double gap = r.step_time_us - w.step_time_us;
  // Parts that moved by less than a twentieth of the larger one are noise next to it.
  const double noticed = 0.05 * std::fabs(delta.front().first);
  auto describe = [&](double d, int part) {
    const double from = part < kParts ? pr.comm[part] : pr.rest, to = part < kParts ? pw.comm[part] : pw.rest;
    std::string s = fmt::format("{} {} ({} → {}", short_time(std::fabs(d)), part_name(part), short_time(from),
                                short_time(to));
    if (part == kPipelinePart)
      s += fmt::format("; bubble {:.1f}% → {:.1f}%", 100 * r.bubble_fraction, 100 * w.bubble_fraction);
    if (part == kParts && r.hardware_flops != w.hardware_flops)
      s += fmt::format("; {:.4g} → {:.4g} PFLOP with recompute", r.hardware_flops / 1e15,
                       w.hardware_flops / 1e15);
    return s + ")";
  };
  std::vector<std::string> gains, costs;
  for (const auto& [d, part] : delta) {
    if (std::fabs(d) < noticed || d == 0) continue;
    (d > 0 ? gains : costs).push_back(describe(d, part));
  }
  if (gap == 0) {
    return fmt::format("why: {} and {} take the same time per step ({}); the first is first by name only\n",
                       winner.candidate.name, runner_up.candidate.name, short_time(w.step_time_us));
  }
  std::string out = fmt::format(
      "why: {} beats {} by {} per step ({:.1f}%); from the runner-up's layout to the "
      "winner's ({})",
      winner.candidate.name, runner_up.candidate.name, short_time(gap),
      r.step_time_us > 0 ? 100 * gap / r.step_time_us : 0.0,
      layout_changes(runner_up.candidate.layout, winner.candidate.layout));
  if (!gains.empty()) out += fmt::format(" saves {}", fmt::join(gains, " and "));
  if (!costs.empty())
    out += fmt::format("{} costs {} more", gains.empty() ? "" : ", while it", fmt::join(costs, " and "));
  if (gains.empty() && costs.empty()) out += " changes no part of the step noticeably";
  return out + "\n";
}

std::string format_explain(const Result& asked, const Result& winner) {
  std::string out = fmt::format("explain {}:\n", asked.candidate.name);
  if (asked.run && !asked.full)
    out += "  (the figures of its symmetric screening, one rank per stage running)\n";
  if (asked.run && asked.run->extrapolated_from > 0)
    out += fmt::format("  (its step extended from steps of {} and {} micro-batches)\n",
                       asked.run->extrapolated_from, 2 * asked.run->extrapolated_from);
  if (asked.candidate.status != Status::Simulated) {
    return out + fmt::format("  {}: {}\n", status_name(asked.candidate.status), asked.candidate.reason);
  }
  const TrainingStats &a = asked.run->stats, &w = winner.run->stats;
  const bool same = asked.candidate.name == winner.candidate.name;
  if (same) {
    out += "  it is the winner\n";
  } else {
    out += fmt::format("  {} per step against the winner's {} ({}{}, {:+.1f}%); the winner is {}\n",
                       short_time(a.step_time_us), short_time(w.step_time_us),
                       a.step_time_us >= w.step_time_us ? "+" : "-",
                       short_time(std::fabs(a.step_time_us - w.step_time_us)),
                       100 * (a.step_time_us - w.step_time_us) / w.step_time_us, winner.candidate.name);
    out += fmt::format("  from the winner's layout to this one: {}\n",
                       layout_changes(winner.candidate.layout, asked.candidate.layout));
  }
  const Parts pa = parts_of(a), pw = parts_of(w);
  out += fmt::format("  {:<42} {:>10} {:>10} {:>10}\n", "where the step's time goes", "this", "winner",
                     "difference");
  for (int part = 0; part <= kParts; ++part) {
    const double x = part < kParts ? pa.comm[part] : pa.rest, y = part < kParts ? pw.comm[part] : pw.rest;
    out += fmt::format("  {:<42} {:>10} {:>10} {:>10}\n", part_name(part), short_time(x), short_time(y),
                       fmt::format("{}{}", x >= y ? "+" : "-", short_time(std::fabs(x - y))));
  }
  out +=
      fmt::format("  {:<42} {:>10} {:>10}\n", "step", short_time(a.step_time_us), short_time(w.step_time_us));
  out += fmt::format("  {:<42} {:>9.1f}% {:>9.1f}%\n", "pipeline bubble (idle over compute)",
                     100 * a.bubble_fraction, 100 * w.bubble_fraction);
  out += fmt::format("  {:<42} {:>10.4g} {:>10.4g}\n", "hardware PFLOP per step (recompute included)",
                     a.hardware_flops / 1e15, w.hardware_flops / 1e15);
  out += fmt::format("  {:<42} {:>9.1f}% {:>9.1f}%\n", "MFU", 100 * a.mfu, 100 * w.mfu);
  out += fmt::format("  {:<42} {:>10} {:>10}\n", "peak memory per rank", bytes(asked.run->peak_bytes),
                     bytes(winner.run->peak_bytes));
  out += fmt::format("  its largest part: {} (stage {}); the winner's: {} (stage {})\n", asked.run->peak_part,
                     asked.run->peak_stage, winner.run->peak_part, winner.run->peak_stage);
  return out;
}

namespace {

nlohmann::json result_json(const Result& r, int rank) {
  const Candidate& k = r.candidate;
  const Layout& l = k.layout;
  nlohmann::json j = {{"layout", k.name},
                      {"status", status_name(k.status)},
                      {"tp", l.tp},
                      {"cp", l.cp},
                      {"pp", l.pp},
                      {"interleave", l.v},
                      {"dp", l.dp},
                      {"ep", l.ep},
                      {"etp", l.etp},
                      {"zero", l.zero},
                      {"seq_parallel", l.sp},
                      {"micro_batch", l.micro_batch},
                      {"recompute", l.recompute},
                      {"fp8", l.fp8},
                      {"order", l.order}};
  if (k.status != Status::Invalid) {
    j["step_time_lower_bound_us"] = k.bound_us;
    if (k.probed) j["bound_probed"] = true;
    j["planned_peak_bytes"] = k.planned_bytes;
  }
  if (!k.reason.empty()) j["reason"] = k.reason;
  if (r.wall_s > 0) j["simulation_wall_s"] = r.wall_s;
  if (r.run) j["simulation"] = r.full ? "full" : "symmetric";
  if (r.run && r.run->extrapolated_from > 0) j["extrapolated_from_micro_batches"] = r.run->extrapolated_from;
  if (r.screening) j["screening_step_time_us"] = r.screening->stats.step_time_us;
  if (r.run) {
    const TrainingStats& t = r.run->stats;
    j["rank"] = rank;
    j["stats"] = {{"step_time_us", t.step_time_us},
                  {"model_tflops_per_gpu", t.model_tflops_per_gpu},
                  {"hardware_tflops_per_gpu", t.hardware_tflops_per_gpu},
                  {"mfu", t.mfu},
                  {"model_flops", t.model_flops},
                  {"hardware_flops", t.hardware_flops},
                  {"micro_batches", t.micro_batches},
                  {"bubble_fraction", t.bubble_fraction},
                  {"bubble_fraction_formula", t.bubble_fraction_formula},
                  {"exposed_comm_us", t.exposed_comm_us},
                  {"peak_memory_bytes", r.run->peak_bytes},
                  {"peak_stage", r.run->peak_stage},
                  {"peak_largest_part", r.run->peak_part},
                  {"rank0_peak_memory_bytes", t.peak_memory_bytes},
                  {"rank0_weights_bytes", t.weights_bytes},
                  {"rank0_grads_bytes", t.grads_bytes},
                  {"rank0_optimizer_bytes", t.optimizer_bytes},
                  {"rank0_activations_bytes", t.activations_bytes}};
  }
  return j;
}

}  // namespace

std::string plan_to_json(const Plan& p) {
  const Question& q = p.question;
  nlohmann::json j;
  j["question"] = {{"model", q.model},
                   {"layers", q.layers},
                   {"hidden", q.hidden},
                   {"heads", q.heads},
                   {"seq", q.seq},
                   {"vocab", q.vocab},
                   {"global_batch", q.global_batch},
                   {"dtype", q.dtype},
                   {"fp8_recipe", q.fp8_recipe},
                   {"try_fp8", q.try_fp8},
                   {"experts", q.experts},
                   {"framework", q.framework},
                   {"profile", q.profile.name},
                   {"nodes", q.profile.nodes},
                   {"world", q.world()},
                   {"device_memory_bytes", q.profile.hbm_capacity_bytes()},
                   {"tp_across_nodes", q.tp_across_nodes},
                   {"max_interleave", q.max_interleave}};
  // The other shape flags under their names in snake case: numbers and switches as JSON's, the rest text.
  for (const auto& [flag, text] : q.shape) {
    std::string key = flag;
    std::replace(key.begin(), key.end(), '-', '_');
    const nlohmann::json value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    j["question"][key] = value.is_number() || value.is_boolean() ? value : nlohmann::json(text);
  }
  j["counts"] = {{"enumerated", p.enumerated},
                 {"invalid", p.invalid},
                 {"rejected_memory_by_plan", p.rejected_by_plan},
                 {"rejected_memory_by_simulation", p.rejected_by_run},
                 {"pruned_bound", p.pruned},
                 {"probed", p.probed},
                 {"pruned_by_probe", p.pruned_by_probe},
                 {"unexplored", p.unexplored},
                 {"simulated", p.simulated},
                 {"confirmed_full", p.confirmed},
                 {"screening_rounds", p.screenings}};
  j["jobs"] = p.jobs;
  j["processes"] = p.processes;
  j["wall_s"] = p.wall_s;
  const std::vector<const Result*> ranked = p.ranked();
  if (!ranked.empty()) j["winner"] = ranked[0]->candidate.name;
  if (ranked.size() >= 2) j["why"] = why_line(*ranked[0], *ranked[1]);
  nlohmann::json all = nlohmann::json::array();
  int rank = 0;
  for (const Result& r : p.results) all.push_back(result_json(r, r.run ? ++rank : 0));
  j["candidates"] = std::move(all);
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string plan_to_html(const Plan& p) {
  const std::vector<const Result*> ranked = p.ranked();
  std::string out = html_page_start("ranklab plan");
  out += "<h1>ranklab plan</h1>\n";
  out += fmt::format("<p class=\"sub\">{}</p>\n", html_escape(describe_question(p.question)));
  out += fmt::format("<pre>{}</pre>\n", html_escape(format_counts(p)));
  if (ranked.size() >= 2) out += fmt::format("<p>{}</p>\n", html_escape(why_line(*ranked[0], *ranked[1])));

  // The scatter: step time (up) against peak memory per rank (right), the device's memory as a line.
  out += "<h2>Step time against peak memory</h2>\n";
  if (!ranked.empty()) {
    const double capacity = static_cast<double>(p.question.profile.hbm_capacity_bytes()) / (1 << 30);
    double t_max = 0, m_max = capacity;
    for (const Result* r : ranked) {
      t_max = std::max(t_max, r->run->stats.step_time_us / 1e6);
      m_max = std::max(m_max, static_cast<double>(r->run->peak_bytes) / (1 << 30));
    }
    t_max *= 1.08;
    m_max *= 1.05;
    const double W = 760, H = 420, left = 64, right = 20, top = 16, bottom = 48;
    auto x = [&](double gib) { return left + (W - left - right) * gib / m_max; };
    auto y = [&](double s) { return H - bottom - (H - top - bottom) * s / t_max; };
    out += fmt::format(
        "<div class=\"wide\"><svg id=\"scatter\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" "
        "height=\"{:.0f}\" data-points=\"{}\">\n",
        W, H, ranked.size());
    out += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"#5d6875\"/>\n", left,
        H - bottom, W - right);
    out += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#5d6875\"/>\n", left,
        H - bottom, top);
    for (int i = 0; i <= 4; ++i) {
      const double gib = m_max * i / 4, s = t_max * i / 4;
      out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n", x(gib),
                         H - bottom + 16, gib);
      out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n", left - 6,
                         y(s) + 4, s);
    }
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">peak memory per rank (GiB)</text>\n",
        (left + W - right) / 2, H - 10);
    out += fmt::format(
        "<text transform=\"translate(14 {:.1f}) rotate(-90)\" text-anchor=\"middle\">step time (s)</text>\n",
        (top + H - bottom) / 2);
    out += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#c8383e\" "
        "stroke-dasharray=\"4 3\"><title>device memory {3:.1f} GiB</title></line>\n",
        x(capacity), H - bottom, top, capacity);
    // The winner last, so that it is drawn on top.
    for (std::size_t i = ranked.size(); i-- > 0;) {
      const Result& r = *ranked[i];
      const double s = r.run->stats.step_time_us / 1e6,
                   gib = static_cast<double>(r.run->peak_bytes) / (1 << 30);
      const bool win = i == 0;
      out += fmt::format(
          "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"{}\" fill=\"{}\" fill-opacity=\"{}\"{}><title>#{} {}: {} "
          "per "
          "step, {} peak</title></circle>\n",
          x(gib), y(s), win ? 7 : 4, win ? "#c8383e" : "#3b75af", win ? "1" : "0.6",
          win ? " id=\"winner\" stroke=\"#1d232b\"" : "", i + 1, html_escape(r.candidate.name),
          short_time(r.run->stats.step_time_us), bytes(r.run->peak_bytes));
    }
    out += "</svg></div>\n";
    out += fmt::format(
        "<p class=\"sub\">Each point a simulated layout; the winner, {}, in red; the dashed "
        "line the device's memory.</p>\n",
        html_escape(ranked[0]->candidate.name));
  }

  out += "<h2>Simulated layouts, best first</h2>\n<div class=\"scroll wide\"><table id=\"ranking\">\n";
  out +=
      "<tr><th>rank</th><th class=\"l\">layout</th><th>step</th><th>run</th><th>TFLOP/s per "
      "GPU</th><th>MFU</th>"
      "<th>bubble</th>";
  for (const char* dim : kDims) out += fmt::format("<th>{}</th>", dim);
  out += "<th>peak per rank</th><th class=\"l\">largest part</th></tr>\n";
  int rank = 0;
  for (const Result* r : ranked) {
    const TrainingStats& t = r->run->stats;
    out += fmt::format(
        "<tr{}><td>{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{:.1f}</td><td>{:.1f}%</td>"
        "<td>{:.1f}%</td>",
        rank == 0 ? " class=\"ok\"" : "", rank + 1, html_escape(r->candidate.name),
        short_time(t.step_time_us), r->full ? "full" : "sym", t.model_tflops_per_gpu, 100 * t.mfu,
        100 * t.bubble_fraction);
    for (const char* dim : kDims) out += fmt::format("<td>{}</td>", short_time(exposed(t, dim)));
    out += fmt::format("<td>{}</td><td class=\"l\">{}</td></tr>\n", bytes(r->run->peak_bytes),
                       html_escape(r->run->peak_part));
    ++rank;
  }
  out += "</table></div>\n";

  // The layouts that did not run, with why.
  out +=
      "<h2>Not simulated, or out of memory</h2>\n<details><summary>every other layout, with the "
      "reason</summary>\n<div class=\"scroll wide\"><table id=\"others\">\n"
      "<tr><th class=\"l\">layout</th><th class=\"l\">status</th><th>bound on the step</th>"
      "<th class=\"l\">reason</th></tr>\n";
  for (const Result& r : p.results) {
    if (r.run) continue;
    const Candidate& k = r.candidate;
    out += fmt::format(
        "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td></tr>\n",
        html_escape(k.name), status_name(k.status), k.status == Status::Invalid ? "" : short_time(k.bound_us),
        html_escape(k.reason));
  }
  out += "</table></div></details>\n";
  out += html_page_end();
  return out;
}

}  // namespace ranklab::plan
