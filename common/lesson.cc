#include "common/lesson.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "common/backend.h"
#include "common/errors.h"
#include "common/report.h"

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

// Each of `over`'s settings in `into`, over what is there.
void overlay(Settings& into, const Settings& over) {
  for (const auto& [flag, value] : over) into[flag] = value;
}
}  // namespace

const OptionSpec* Lesson::option(const std::string& flag) const {
  for (const OptionSpec& s : options) {
    if (s.flag == flag) return &s;
  }
  return nullptr;
}

bool register_lesson(Lesson lesson) {
  registry().push_back(std::move(lesson));
  return true;
}

bool register_lesson(std::string name, std::string summary, void (*fn)(Rank&, const LessonOptions&)) {
  return register_lesson(std::move(name), std::move(summary), fn, OptionTable<LessonOptions>{});
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

Settings resolve_settings(const Lesson& lesson, const Settings& given, bool lecture) {
  Settings out;
  if (lecture) {
    for (const LectureSetting& s : lesson.lecture) out[s.flag] = s.value;
  }
  // What the options set so far expand to, then what the command line's own expand to; the command line's
  // words win over both.
  Settings expanded;
  for (const Settings* source : {static_cast<const Settings*>(&out), &given}) {
    for (const auto& [flag, value] : *source) overlay(expanded, lesson.expand(flag, value));
  }
  overlay(out, expanded);
  overlay(out, given);
  return out;
}

RunReport run_lesson(Backend& backend, const std::string& name, const Settings& settings) {
  const Lesson& lesson = find_lesson(name);
  const PreparedLesson prepared = lesson.prepare(settings);
  RunReport report;
  try {
    report = backend.launch(prepared.world, prepared.program);
  } catch (const ProgramError& e) {
    throw ProgramError(fmt::format("lesson {}: {}", name, e.what()));
  }
  report.lesson = name;
  report.options = prepared.record;
  return report;
}

std::string lesson_help(const Lesson& lesson) {
  std::string out = fmt::format("ranklab run {}: {}\n", lesson.name, lesson.summary);
  out += "\nOptions of this lesson, with its defaults:\n";
  for (const OptionSpec& o : lesson.options) {
    std::string flag = fmt::format("--{}", o.flag);
    if (o.kind != OptionKind::Switch && !o.default_text.empty()) flag += " " + o.default_text;
    if (o.kind != OptionKind::Switch && !o.unit.empty()) flag += " " + o.unit;
    std::string help = o.help;
    const std::string range = o.range_text();
    if (!range.empty()) help += fmt::format("; {}", range);
    if (o.kind == OptionKind::Switch) help += o.default_text == "true" ? " (on)" : " (off)";
    out += fmt::format("  {:<26} {}\n", flag, help);
  }
  if (!lesson.lecture.empty()) {
    std::vector<std::string> parts;
    for (const LectureSetting& s : lesson.lecture) parts.push_back(fmt::format("--{} {}", s.flag, s.value));
    out += fmt::format("\n--lecture runs the lecture's own setup: {}\n", fmt::join(parts, " "));
    for (const LectureSetting& s : lesson.lecture) {
      if (!s.note.empty()) out += fmt::format("  ({})\n", s.note);
    }
  }
  out +=
      "\nEvery lesson also takes --backend sim|cuda, --profile P, --nodes N, --report DIR, --algo A and "
      "--proto P (`ranklab run --help`).\n";
  return out;
}

}  // namespace ranklab
