// The command lines of `ranklab run gpt` and `ranklab plan`, up to where they would start simulating. The
// first byte picks the command; the rest is cut into words at NUL bytes and read as the command line reads
// them ("--flag value", "--flag=value", or a switch alone), then checked as the command checks them: the gpt
// lesson's options read by its table, the configuration resolved for the world and its memory plan; plan's
// request, its question and the layouts it enumerates and bounds. Any words must be accepted or refused
// with a ranklab error, never crash, hang, balloon or raise anything else.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/backend.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/options.h"
#include "common/text.h"
#include "common/trace_ranks.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/config.h"
#include "plan/candidates.h"
#include "plan/plan_command.h"

namespace {

using ranklab::Settings;

// The flags as the command line gives them: a word that is not a flag's value and not a flag is ignored
// (CLI11 would refuse it, with an error of its own).
Settings flags_of(const std::vector<std::string>& words) {
  Settings s;
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w.size() < 3 || w.compare(0, 2, "--") != 0) continue;
    const std::size_t eq = w.find('=');
    if (eq != std::string::npos) {
      s[w.substr(2, eq - 2)] = w.substr(eq + 1);
    } else if (i + 1 < words.size() && words[i + 1].compare(0, 2, "--") != 0) {
      s[w.substr(2)] = words[++i];
    } else {
      s[w.substr(2)] = "true";
    }
  }
  return s;
}

void run_gpt(const Settings& given) {
  using namespace ranklab;
  // The backend's flags (--trace-ranks among them) apart from the lesson's, as `ranklab run` reads them.
  Settings backend_flags, lesson_flags;
  const std::vector<OptionSpec> specs = backend_options().specs();
  for (const auto& entry : given) {
    const bool backend = std::any_of(specs.begin(), specs.end(),
                                     [&entry](const OptionSpec& s) { return s.flag == entry.first; });
    (backend ? backend_flags : lesson_flags)[entry.first] = entry.second;
  }
  const BackendOptions b = backend_options().read(backend_flags, "");
  const gpt::Config c =
      gpt::options_table().read(resolve_settings(find_lesson("gpt"), lesson_flags, false), "gpt");
  TraceRanks::parse(b.trace_ranks, "--trace-ranks").check(c.world, "--trace-ranks");
  const gpt::Config resolved = gpt::resolve(c, c.world);
  gpt::memory_plans(resolved);
}

void plan(const Settings& given) {
  using namespace ranklab;
  Settings request_flags, shape_flags;
  for (const auto& [flag, value] : given) {
    const auto& shape = plan::shape_flags();
    (std::find(shape.begin(), shape.end(), flag) != shape.end() ? shape_flags[flag] : request_flags[flag]) =
        value;
  }
  plan::Request r = plan::request_options().read(request_flags, "plan");
  r.shape = shape_flags;
  const plan::Question q = plan::make_question(r);
  plan::enumerate(q);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const Settings flags =
      flags_of(ranklab::split_at(std::string(reinterpret_cast<const char*>(data + 1), size - 1), '\0'));
  try {
    if (data[0] % 2 == 0) {
      run_gpt(flags);
    } else {
      plan(flags);
    }
  } catch (const ranklab::Error&) {
  }
  return 0;
}
