#include "common/lesson.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/backend.h"
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
