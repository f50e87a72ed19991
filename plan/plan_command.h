// `ranklab plan`: the best parallel layout for a GPT on a cluster, found by simulating candidates.
//
//   ranklab plan --model llama3-70b --profile dgx-h100 --nodes 64 --global-batch 1024 [--top 10]
//
// The command line fills a Request; make_question checks it and turns it into the Question the search
// answers (candidates.h, search.h); plan_command prints the answer (plan_report.h) and writes the report.
#pragma once

#include <cstdint>
#include <string>

#include "common/options.h"
#include "plan/candidates.h"
#include "plan/cluster.h"

namespace ranklab::plan {

struct Request {
  // The shape: the gpt lesson's options as the command line gives them (shape_flags: --model, --layers, ...);
  // the lesson's defaults and --model's preset fill the rest, as with `ranklab run gpt`.
  Settings shape;
  std::string profile = "dgx-h100";
  int nodes = 1;
  bool tp_across_nodes = false;
  int max_interleave = 4;
  std::string framework = "megatron-core";
  std::string try_fp8;  // Question::try_fp8
  // The search and its output.
  int top = 10;
  int max_candidates = 0;  // 0: no limit
  bool no_symmetry = false;
  bool no_extrapolation = false;
  bool no_probe = false;
  int jobs = 0;     // simulations at once; 0: one per core
  int confirm = 1;  // see SearchOptions
  double confirm_margin = 0.01;
  bool progress = true;    // the search's progress line (stderr, a terminal only)
  std::string report_dir;  // "": no report
  bool force = false;      // replace files in report_dir that ranklab did not write
  std::string explain;     // a layout name, or ""
};
// The flags of `ranklab plan` besides the shape's.
const OptionTable<Request>& request_options();
// The gpt lesson's options that make the shape a plan is asked for.
const std::vector<std::string>& shape_flags();

// The question a request asks; UsageError naming the flag for anything wrong with it.
Question make_question(const Request& r);

// Runs the search and prints its answer to stdout; writes plan.json and plan.html to report_dir when
// given. UsageError for bad input, including a question none of whose layouts the gpt lesson accepts.
// With `cluster` (a job of several processes, cluster.h), rank 0 does all that with every rank's slots, and
// the other ranks only simulate what it sends them, printing nothing.
int plan_command(const Request& r, Messenger* cluster = nullptr);

}  // namespace ranklab::plan
