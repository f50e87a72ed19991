#include "plan/plan_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/output_files.h"
#include "lessons/gpt/presets.h"
#include "plan/plan_report.h"
#include "plan/search.h"

namespace ranklab::plan {

namespace {

void at_least(std::int64_t v, std::int64_t minimum, const char* flag) {
  if (v < minimum) throw UsageError(fmt::format("plan: {} must be at least {} (got {})", flag, minimum, v));
}

}  // namespace

Question make_question(const Request& r) {
  at_least(r.top, 1, "--top");
  at_least(r.nodes, 1, "--nodes");
  at_least(r.max_candidates, 0, "--max-candidates");
  at_least(r.max_interleave, 1, "--max-interleave");
  at_least(r.jobs, 0, "--jobs");
  at_least(r.confirm, 0, "--confirm");
  if (!(r.confirm_margin >= 0 && r.confirm_margin < 1))
    throw UsageError(
        fmt::format("plan: --confirm-margin must be a fraction from 0 to 1 (got {})", r.confirm_margin));
  // The gpt lesson's own defaults, then the preset for what the flags leave (as `ranklab run gpt --model`
  // fills them), then the flags.
  Options o = with_lesson_defaults(find_lesson("gpt"), Options{}, {}, false);
  o.model = r.model;
  gpt::apply_preset(o, [&](const std::string& flag) {
    return (flag == "--layers" && r.layers) || (flag == "--hidden" && r.hidden) ||
           (flag == "--heads" && r.heads) || (flag == "--seq" && r.seq) || (flag == "--vocab" && r.vocab) ||
           (flag == "--global-batch" && r.global_batch);
  });
  if (r.layers) o.layers = *r.layers;
  if (r.hidden) o.hidden = *r.hidden;
  if (r.heads) o.heads = *r.heads;
  if (r.seq) o.seq = *r.seq;
  if (r.vocab) o.vocab = *r.vocab;
  if (r.global_batch) o.global_batch = *r.global_batch;
  if (o.hidden > (1 << 30)) throw UsageError(fmt::format("plan: --hidden {} is too large", o.hidden));
  Question q;
  q.model = o.model.empty() ? "custom" : o.model;
  q.layers = o.layers;
  q.hidden = static_cast<int>(o.hidden);
  q.heads = o.heads;
  q.seq = o.seq;
  q.vocab = o.vocab;
  q.global_batch = o.global_batch;
  q.dtype = r.dtype;
  q.tp_across_nodes = r.tp_across_nodes;
  q.max_interleave = r.max_interleave;
  q.profile = load_profile(r.profile);
  if (!q.profile.nodes_at.empty() && r.nodes != q.profile.nodes) {
    throw UsageError(fmt::format("--nodes {} contradicts the profile's 'nodes = {}' ({}); drop one of them",
                                 r.nodes, q.profile.nodes, q.profile.nodes_at));
  }
  q.profile.nodes = r.nodes;
  // The shape and dtype on one rank: the lesson's checks of everything that is not the layout.
  Options one = lesson_options(q, Layout{});
  one.world = 1;
  gpt::config_from(one, 1);
  return q;
}

int plan_command(const Request& r) {
  const Question q = make_question(r);
  std::optional<Layout> explain;
  if (!r.explain.empty()) {
    explain = parse_layout(r.explain);
    try {
      gpt::config_from(lesson_options(q, *explain), q.world());
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--explain {}: the gpt lesson refuses it: {}", r.explain, e.what()));
    }
  }
  if (!r.report_dir.empty()) prepare_report_dir(r.report_dir);

  std::printf("plan: %s\n", describe_question(q).c_str());
  std::fflush(stdout);
  SearchOptions options;
  options.max_candidates = r.max_candidates;
  options.symmetry = r.symmetry;
  options.progress = r.progress;
  options.jobs = r.jobs > 0 ? r.jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.confirm = r.confirm;
  options.confirm_margin = r.confirm_margin;
  const Plan plan = search(q, options);
  std::fputs(format_counts(plan).c_str(), stdout);
  std::fputs("\n", stdout);
  std::fputs(format_table(plan, r.top).c_str(), stdout);
  const std::vector<const Result*> ranked = plan.ranked();
  if (ranked.size() >= 2) {
    std::printf("\n%s", why_line(*ranked[0], *ranked[1]).c_str());
    // A tie says nothing about what makes the winner fast: hold it against the first slower layout too.
    for (const Result* other : ranked) {
      if (other->run->stats.step_time_us == ranked[0]->run->stats.step_time_us) continue;
      if (other != ranked[1]) std::printf("%s", why_line(*ranked[0], *other).c_str());
      break;
    }
  }
  if (ranked.empty()) {
    std::printf(
        "\nno layout fits in the device's %s: more nodes, a smaller global batch or a shorter "
        "sequence would\n",
        format_bytes(static_cast<double>(q.profile.hbm_capacity_bytes())).c_str());
  }

  if (explain && !ranked.empty()) {
    const std::string name = explain->name();
    const Result* asked = nullptr;
    for (const Result& res : plan.results)
      if (res.candidate.name == name && (res.run || res.candidate.status == Status::RejectedMemory))
        asked = &res;
    // Not decided by the search (pruned, or not enumerated): run it now.
    const Result ran = asked ? Result{} : simulate(q, *explain, r.symmetry);
    std::printf("\n%s", format_explain(asked ? *asked : ran, *ranked[0]).c_str());
  }

  if (!r.report_dir.empty()) {
    write_file(std::filesystem::path(r.report_dir) / "plan.json", plan_to_json(plan));
    write_file(std::filesystem::path(r.report_dir) / "plan.html", plan_to_html(plan));
    std::string shown = r.report_dir;
    while (shown.size() > 1 && shown.back() == '/') shown.pop_back();
    std::printf("\nreport written to %s%s (plan.json, plan.html)\n", shown.c_str(), shown == "/" ? "" : "/");
  }
  return ranked.empty() ? 2 : 0;
}

}  // namespace ranklab::plan
