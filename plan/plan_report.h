// What `ranklab plan` prints and writes: the ranked table of simulated layouts, the line on why the winner
// beats the runner-up, --explain's comparison of one layout with the winner, and the --report files
// (plan.json with every layout considered, plan.html with a scatter of step time against peak memory and
// the table).
//
// Where a step's time goes is read off the run's own figures, additively: the exposed communication of each
// dimension (the compute stream waiting on it; pp's includes waiting in the pipeline's bubble) and the rest,
// step time minus all of them, which is the compute (recompute included) and what is neither. The why-line
// and --explain compare two layouts part by part in those terms.
#pragma once

#include <string>

#include "plan/search.h"

namespace ranklab::plan {

// "llama3-70b (80 layers, ...), global batch 1024 x seq 8192, on 512 x H100 SXM5 80GB (dgx-h100, 64 nodes)"
std::string describe_question(const Question& q);
// What was considered, decided and simulated, in a few lines.
std::string format_counts(const Plan& p);
// The `top` best simulated layouts, one line each.
std::string format_table(const Plan& p, int top);
// One line: why the best layout beats the second best; "" with fewer than two.
std::string why_line(const Result& winner, const Result& runner_up);
// Where `asked`'s time goes against the winner's, part by part; for a layout that did not run, why not.
std::string format_explain(const Result& asked, const Result& winner);

std::string plan_to_json(const Plan& p);
std::string plan_to_html(const Plan& p);

}  // namespace ranklab::plan
