// Shared by the simulator tests: a quiet simulator on the dgx-h100 profile, and a way to run a
// program on it and collect one value per rank.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/options.h"
#include "common/profile.h"
#include "common/rank.h"
#include "common/report.h"
#include "sim/sim_backend.h"

namespace ranklab::testing {

// Ranks 0 .. n-1, the group of a world's first n GPUs.
inline std::vector<int> first(int n) {
  std::vector<int> r(n);
  std::iota(r.begin(), r.end(), 0);
  return r;
}

inline SimConfig quiet_config(int nodes = 1) {
  SimConfig c;
  c.profile = load_profile("dgx-h100");
  c.profile.nodes = nodes;
  c.echo_output = false;
  return c;
}

// Every failed check of a run, with its detail (expected and actual, full digits), for a test's message.
inline std::string failed_checks(const RunReport& rep) {
  std::string s;
  for (const CheckRecord& c : rep.checks) {
    if (!c.passed) s += "rank " + std::to_string(c.rank) + ": " + c.what + ": " + c.detail + "\n";
  }
  return s;
}

// A number of a lesson's Settings, as a test reads one back: number(o, "steps").
inline std::int64_t number(const Settings& s, const std::string& flag) {
  return std::stoll(s.at(flag));
}

// What a run of `fn` on `world` ranks fails with, or "" when it does not.
inline std::string run_error_message(int world, const std::function<void(Rank&)>& fn) {
  SimBackend backend(quiet_config());
  try {
    backend.launch(world, fn);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Runs `lesson` with `o` on a quiet one-node simulator, expecting a UsageError whose message holds `needle`.
inline void expect_usage_error(const Settings& o, const std::string& needle,
                               const std::string& lesson = "gpt") {
  SimBackend backend(quiet_config());
  try {
    run_lesson(backend, lesson, resolve_settings(find_lesson(lesson), o, /*lecture=*/false));
    ADD_FAILURE() << "expected a UsageError mentioning " << needle;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Runs `fn` on `world` ranks and returns what each rank put in its slot.
template <typename T>
std::vector<T> run_collect(int world, const std::function<T(Rank&)>& fn, int nodes = 1) {
  SimBackend backend(quiet_config(nodes));
  std::vector<T> out(world);
  backend.launch(world, [&](Rank& r) { out[r.rank()] = fn(r); });
  return out;
}

}  // namespace ranklab::testing
