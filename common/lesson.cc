#include "common/lesson.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "common/backend.h"
#include "common/compare.h"
#include "common/errors.h"

namespace ranklab {

namespace {
// A function-local static so registration from other translation units never sees it uninitialised.
std::vector<Lesson>& registry() {
  static std::vector<Lesson> all;
  return all;
}

// The order of the lecture; lessons not listed follow by name.
int tour_position(const std::string& name) {
  static const char* order[] = {"tour",          "collectives",     "benchmark",
                                "data_parallel", "tensor_parallel", "pipeline_parallel"};
  for (int i = 0; i < static_cast<int>(std::size(order)); ++i) {
    if (name == order[i]) return i;
  }
  return static_cast<int>(std::size(order));
}
}  // namespace

bool register_lesson(Lesson lesson) {
  registry().push_back(std::move(lesson));
  return true;
}

std::vector<Lesson> lessons() {
  std::vector<Lesson> all = registry();
  std::sort(all.begin(), all.end(), [](const Lesson& a, const Lesson& b) {
    int pa = tour_position(a.name), pb = tour_position(b.name);
    return pa != pb ? pa < pb : a.name < b.name;
  });
  return all;
}

const Lesson& find_lesson(const std::string& name) {
  for (const Lesson& l : registry()) {
    if (l.name == name) return l;
  }
  std::vector<std::string> names;
  for (const Lesson& l : lessons()) names.push_back(l.name);
  throw UsageError(fmt::format("no lesson called '{}'; the lessons are: {}", name, fmt::join(names, ", ")));
}

Options with_lesson_defaults(const Lesson& lesson, const Options& given, const std::vector<std::string>& set,
                             bool lecture) {
  std::map<std::string, std::string> record = options_record(given);
  int world = given.world;
  auto apply = [&](const std::vector<LessonOption>& options) {
    for (const LessonOption& opt : options) {
      if (std::find(set.begin(), set.end(), opt.name) != set.end()) continue;  // the command line's wins
      if (opt.name == "world") {
        world = std::stoi(opt.value);
      } else {
        record[opt.name] = opt.value;
      }
    }
  };
  apply(lesson.options);
  if (lecture) apply(lesson.lecture);
  Options out = options_from_record(record, world);
  out.quiet = given.quiet;
  out.comm_algorithm = given.comm_algorithm;
  return out;
}

std::string lesson_help(const Lesson& lesson) {
  std::string out = fmt::format("ranklab run {}: {}\n", lesson.name, lesson.summary);
  if (lesson.options.empty()) {
    out += "\nThis lesson takes no options of its own.\n";
  } else {
    out += "\nOptions of this lesson, with its defaults:\n";
    for (const LessonOption& o : lesson.options) {
      const std::string flag = o.value == "true" || o.value == "false"
                                   ? fmt::format("--{}", o.name)
                                   : fmt::format("--{} {}", o.name, o.value);
      out += fmt::format("  {:<26} {}{}\n", flag, o.help, o.value == "false" ? " (off)" : "");
    }
  }
  if (!lesson.lecture.empty()) {
    std::vector<std::string> parts;
    for (const LessonOption& o : lesson.lecture) parts.push_back(fmt::format("--{} {}", o.name, o.value));
    out += fmt::format("\n--lecture runs the lecture's own setup: {}\n", fmt::join(parts, " "));
    for (const LessonOption& o : lesson.lecture) {
      if (!o.help.empty()) out += fmt::format("  ({})\n", o.help);
    }
  }
  out +=
      "\nEvery lesson also takes --backend sim|cuda, --profile P, --nodes N, --report DIR, --quiet, --algo A "
      "and --proto P (`ranklab run --help`).\n";
  return out;
}

RunReport run_lesson(Backend& backend, const std::string& name, const Options& options) {
  const Lesson& lesson = find_lesson(name);
  RunReport report;
  try {
    report = backend.launch(options.world, [&](Rank& r) { lesson.fn(r, options); });
  } catch (const ProgramError& e) {
    throw ProgramError(fmt::format("lesson {}: {}", name, e.what()));
  }
  report.lesson = name;
  return report;
}

}  // namespace ranklab
