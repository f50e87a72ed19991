// `ranklab plan`: the best parallel layout for a GPT on a cluster, found by simulating candidates.
//
//   ranklab plan --model llama3-70b --profile dgx-h100 --nodes 64 --global-batch 1024 [--top 10]
//
// The command line fills a Request; make_question checks it and turns it into the Question the search
// answers (candidates.h, search.h); plan_command prints the answer (plan_report.h) and writes the report.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "plan/candidates.h"

namespace ranklab::plan {

struct Request {
  // The shape: a preset (--model) and the flags that override it; what neither gives is the gpt lesson's
  // default, as with `ranklab run gpt`.
  std::string model;
  std::optional<int> layers, heads, seq;
  std::optional<std::int64_t> hidden, vocab, global_batch;
  std::string dtype = "bf16";
  std::string profile = "dgx-h100";
  int nodes = 1;
  bool tp_across_nodes = false;
  int max_interleave = 4;
  // The search and its output.
  int top = 10;
  int max_candidates = 0;  // 0: no limit
  bool symmetry = true;
  int jobs = 0;     // simulations at once; 0: one per core
  int confirm = 1;  // see SearchOptions
  double confirm_margin = 0.01;
  bool progress = true;
  std::string report_dir;  // "": no report
  std::string explain;     // a layout name, or ""
};

// The question a request asks; UsageError naming the flag for anything wrong with it.
Question make_question(const Request& r);

// Runs the search and prints its answer to stdout; writes plan.json and plan.html to report_dir when
// given. UsageError for bad input, including a question none of whose layouts the gpt lesson accepts.
int plan_command(const Request& r);

}  // namespace ranklab::plan
