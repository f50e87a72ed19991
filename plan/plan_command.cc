#include "plan/plan_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/output_files.h"
#include "lessons/gpt/config.h"
#include "lessons/gpt/presets.h"
#include "plan/plan_report.h"
#include "plan/search.h"

namespace ranklab::plan {

const OptionTable<Request>& request_options() {
  using O = Request;
  static const OptionTable<O> table = {
      {"profile", &O::profile, "hardware profile name or .toml file (see `ranklab profiles`)"},
      Option<O>("nodes", &O::nodes, "nodes of the profile: the world is all of their GPUs").at_least(1),
      {"framework", &O::framework,
       "the framework to plan for: its overlaps (megatron-lm-2021, megatron-lm-2022, megatron-core, "
       "torchtitan)"},
      Option<O>("top", &O::top, "how many layouts the table shows").at_least(1),
      {"tp-across-nodes", &O::tp_across_nodes, "also try tensor-parallel groups larger than a node"},
      {"try-fp8", &O::try_fp8,
       "also try every layout with its linear layers' GEMMs in FP8 by this recipe (current, delayed, "
       "blockwise or mxfp8, as gpt's --fp8-recipe), where the GPU has FP8 tensor cores; the question's dtype "
       "must be "
       "bf16"},
      Option<O>("max-interleave", &O::max_interleave, "the most model chunks per pipeline rank tried")
          .at_least(1),
      Option<O>("max-candidates", &O::max_candidates,
                "simulate at most this many layouts (0: as many as the bound leaves)")
          .at_least(0),
      {"no-symmetry", &O::no_symmetry,
       "simulate every rank, not one per class of identical ranks (slower; for checking)"},
      {"no-extrapolation", &O::no_extrapolation,
       "screen every layout over its whole step, not a step of m >= 12 p micro-batches from steps of 2 p and "
       "4 p (slower; for checking)"},
      {"no-probe", &O::no_probe,
       "screen every layout the model's bound leaves, without first bounding it again from the kernels of a "
       "short run (slower; for checking)"},
      Option<O>(
          "jobs", &O::jobs,
          "simulations at once, each on a thread, at most one per core (0: one per core); the answer is "
          "the same")
          .at_least(0),
      Option<O>("confirm", &O::confirm,
                "the leading layouts simulated again with every rank running after screening (0: none, "
                "the screenings are the answer)")
          .at_least(0),
      Option<O>("confirm-margin", &O::confirm_margin,
                "and every layout whose screened step is within this fraction of the best")
          .at_least(0)
          .below(1),
      {"report", &O::report_dir, "write plan.json and plan.html to this folder"},
      {"force", &O::force, "with --report: replace files in the folder that ranklab did not write"},
      {"explain", &O::explain, "a layout as the table prints it: where its time goes against the winner's"},
  };
  return table;
}

const std::vector<std::string>& shape_flags() {
  static const std::vector<std::string> flags = {"model",
                                                 "block",
                                                 "layers",
                                                 "hidden",
                                                 "heads",
                                                 "kv-heads",
                                                 "kv-channels",
                                                 "qk-layernorm",
                                                 "sliding-window",
                                                 "sliding-window-layers",
                                                 "attention-sinks",
                                                 "add-qkv-bias",
                                                 "add-bias-linear",
                                                 "quick-geglu",
                                                 "activation-func-clamp-value",
                                                 "glu-linear-offset",
                                                 "ffn-hidden",
                                                 "rope-theta",
                                                 "seq",
                                                 "vocab",
                                                 "global-batch",
                                                 "dtype",
                                                 "fp8-recipe",
                                                 "experts",
                                                 "top-k",
                                                 "moe-ffn-hidden",
                                                 "shared-experts",
                                                 "moe-layers",
                                                 "moe-router-score-function",
                                                 "capacity-factor",
                                                 "moe-aux-loss-coeff"};
  return flags;
}

Question make_question(const Request& r) {
  request_options().check(r, "plan");
  for (const auto& [flag, value] : r.shape) {
    if (std::find(shape_flags().begin(), shape_flags().end(), flag) == shape_flags().end()) {
      throw UsageError(fmt::format("plan: --{} is not part of a shape; the shape's flags are: --{}", flag,
                                   fmt::join(shape_flags(), ", --")));
    }
  }
  // The gpt lesson's own defaults, then the preset for what the flags leave (as `ranklab run gpt --model`
  // fills them), then the flags.
  const gpt::Config c =
      gpt::options_table().read(resolve_settings(find_lesson("gpt"), r.shape, /*lecture=*/false), "plan");
  if (c.hidden > (1 << 30)) throw UsageError(fmt::format("plan: --hidden {} is too large", c.hidden));
  Question q;
  q.model = c.model_name();
  q.layers = c.layers;
  q.hidden = c.hidden;
  q.heads = c.heads;
  q.seq = c.seq;
  q.vocab = c.vocab;
  q.global_batch = c.global_batch;
  q.dtype = gpt::options_table().find("dtype")->write(c);  // as the lesson spells it: "bf16"
  q.fp8_recipe = gpt::options_table().find("fp8-recipe")->write(c);
  q.experts = c.experts;
  // The rest as the lesson writes them, but for a dropless router (the capacity factor's absence).
  const std::set<std::string> fields = {"model", "layers",       "hidden", "heads",      "seq",
                                        "vocab", "global-batch", "dtype",  "fp8-recipe", "experts"};
  for (const std::string& flag : shape_flags()) {
    if (fields.count(flag) > 0 || (flag == "capacity-factor" && c.capacity_factor == 0)) continue;
    q.shape[flag] = gpt::options_table().find(flag)->write(c);
  }
  q.tp_across_nodes = r.tp_across_nodes;
  q.max_interleave = r.max_interleave;
  gpt::framework_settings(r.framework);  // UsageError naming --framework for one it does not know
  q.framework = r.framework;
  q.profile = load_profile(r.profile);
  if (!q.profile.nodes_at.empty() && r.nodes != q.profile.nodes) {
    throw UsageError(fmt::format("--nodes {} contradicts the profile's 'nodes = {}' ({}); drop one of them",
                                 r.nodes, q.profile.nodes, q.profile.nodes_at));
  }
  try {
    q.profile.gpus_in(r.nodes);  // more GPUs than a world holds
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("plan: --nodes {}: {}", r.nodes, e.what()));
  }
  q.profile.nodes = r.nodes;
  // The shape and dtype on one rank: the lesson's checks of everything that is not the layout.
  auto on_one_rank = [&](const Layout& l) {
    Settings one = lesson_settings(q, l);
    one["world"] = std::to_string(1);
    gpt::for_gpu(gpt::resolve(gpt::options_table().read(one, "gpt"), 1), q.profile.gpu);
  };
  on_one_rank(Layout{});
  if (!r.try_fp8.empty()) {
    if (q.dtype != "bf16" || q.fp8_recipe != "none") {
      throw UsageError(fmt::format(
          "plan: --try-fp8 tries each layout in bf16 and with FP8 GEMMs; the question is already {}{}: drop "
          "--try-fp8, or ask in bf16",
          q.dtype, q.fp8_recipe == "none" ? "" : " with --fp8-recipe " + q.fp8_recipe));
    }
    q.try_fp8 = r.try_fp8;
    try {
      on_one_rank(Layout{.fp8 = true});
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("plan: --try-fp8 {}: {}", r.try_fp8, e.what()));
    }
  }
  return q;
}

int plan_command(const Request& r, Messenger* cluster) {
  const Question q = make_question(r);
  std::optional<Layout> explain;
  if (!r.explain.empty()) {
    explain = parse_layout(r.explain);
    if (explain->fp8 && q.try_fp8.empty()) {
      throw UsageError(fmt::format(
          "--explain {}: a layout with FP8 GEMMs (-fp8) is one of a question asked with --try-fp8 RECIPE; "
          "add it, as the plan that printed the layout had it",
          r.explain));
    }
    try {
      lesson_config(q, *explain);
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--explain {}: the gpt lesson refuses it: {}", r.explain, e.what()));
    }
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (r.jobs > cores) {
    throw UsageError(fmt::format(
        "plan: --jobs {} is more than this machine's {} cores: each job is a simulation on a thread of its "
        "own, "
        "holding its run's memory, and more of them than cores only share the cores; give --jobs {} or fewer "
        "(0: one per core)",
        r.jobs, cores, cores));
  }
  const int jobs = r.jobs > 0 ? r.jobs : cores;
  if (cluster != nullptr && cluster->rank() > 0) {
    serve(q, *cluster, jobs);
    return 0;
  }
  std::optional<ReportFolder> folder;
  if (!r.report_dir.empty())
    folder.emplace("--report", r.report_dir, std::vector<std::string>{"plan.json", "plan.html"}, r.force);

  std::printf("plan: %s\n", describe_question(q).c_str());
  std::fflush(stdout);
  SearchOptions options;
  options.max_candidates = r.max_candidates;
  options.symmetry = !r.no_symmetry;
  options.extrapolate = !r.no_extrapolation;
  options.probe = !r.no_probe;
  options.progress = r.progress;
  options.jobs = jobs;
  options.cluster = cluster;
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
    const Result ran = asked ? Result{} : simulate(q, *explain, !r.no_symmetry, !r.no_extrapolation);
    std::printf("\n%s", format_explain(asked ? *asked : ran, *ranked[0]).c_str());
  }

  if (!r.report_dir.empty()) {
    folder->write("plan.json", plan_to_json(plan));
    folder->write("plan.html", plan_to_html(plan));
    folder->commit();
    std::string shown = r.report_dir;
    while (shown.size() > 1 && shown.back() == '/') shown.pop_back();
    std::printf("\nreport written to %s%s (plan.json, plan.html)\n", shown.c_str(), shown == "/" ? "" : "/");
  }
  return ranked.empty() ? 2 : 0;
}

}  // namespace ranklab::plan
