// Lessons and their registry. A lesson is one SPMD function of the Rank and of its own options struct;
// it registers itself, with the table that declares those options (common/options.h), so that `ranklab
// list`, `ranklab run NAME` and `ranklab run NAME --help` find it:
//
//   struct RingOptions : LessonOptions {
//     std::int64_t count = 1 << 20;
//   };
//   void ring(Rank& r, const RingOptions& o) { ... }
//   RANKLAB_LESSON("ring", "all_reduce from send and recv", ring,
//                  OptionTable<RingOptions>{{"world", &RingOptions::world, "ranks of the ring"},
//                                           {"count", &RingOptions::count, "float32 elements"}});
//
// A lesson that takes nothing but its world needs no table: RANKLAB_LESSON("name", "summary", fn), with
// fn taking `const LessonOptions&`.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/options.h"
#include "common/rank.h"

namespace ranklab {

// What every lesson's options hold: how many ranks it runs on, and whether it prints less. A lesson's own
// struct derives from it.
struct LessonOptions {
  int world = 4;
  bool quiet = false;  // fewer lines of output; not part of the run's identity
};

// One option of the lecture's own setup of a lesson (--lecture): the flag, its value, and a note help
// prints beside it ("" for none).
struct LectureSetting {
  std::string flag;
  std::string value;
  std::string note;
};

// A lesson with its options read: what a backend launches.
struct PreparedLesson {
  int world = 0;
  // The options that are part of the run's identity (all but --world, which the report holds itself),
  // as the lesson's table writes them: RunReport::options.
  Settings record;
  std::function<void(Rank&)> program;
};

struct Lesson {
  std::string name;
  std::string summary;
  // Its options as declared, with its defaults: --world first, --quiet last.
  std::vector<OptionSpec> options;
  // What --lecture sets: the lecture's own setup of this lesson.
  std::vector<LectureSetting> lecture;
  // Reads `settings` (any of the lesson's options, as text; the others keep their defaults) into the
  // lesson's struct. UsageError naming the lesson and the flag for an option it does not have or a value
  // its declaration refuses.
  std::function<PreparedLesson(const Settings&)> prepare;
  // The settings an option with a value sets besides itself (`--model gpt3-175b` fills the shape); empty
  // for an option that expands to nothing. UsageError for a value it does not know.
  std::function<Settings(const std::string& flag, const std::string& value)> expand;

  const OptionSpec* option(const std::string& flag) const;
};

// --break: a lesson's deliberate bugs, each a mistake the lesson's own check must catch. Declared with the
// lesson's other options, so that help lists them and a wrong name is refused with the list.
template <class O, class C>
Option<O> break_option(std::string C::*member, std::vector<std::string> bugs) {
  return Option<O>("break", member, "a deliberate bug, to see the lesson's own check catch it")
      .choices(std::move(bugs));
}

// Registers at static-initialisation time; returns true so it can initialise a namespace-scope bool.
// `table` declares the members of O that `fn` reads; --world (if the table leaves it out) and --quiet
// are added to it.
template <class O>
bool register_lesson(std::string name, std::string summary, void (*fn)(Rank&, const O&), OptionTable<O> table,
                     std::vector<LectureSetting> lecture = {});
bool register_lesson(std::string name, std::string summary, void (*fn)(Rank&, const LessonOptions&));
bool register_lesson(Lesson lesson);

// Lessons in registration order of the tour (collectives first), then by name.
std::vector<Lesson> lessons();
// The lesson called `name`, or UsageError listing the ones there are.
const Lesson& find_lesson(const std::string& name);

// The settings a run of `lesson` reads, each source over the one before: with `lecture` the lecture's
// setup; then what the options set so far expand to (Lesson::expand); then `given` (the command line),
// and what `given` expands to under `given` itself.
Settings resolve_settings(const Lesson& lesson, const Settings& given, bool lecture);

class Backend;
struct RunReport;
// Runs lesson `name` on `backend` with `settings` over its defaults; names the lesson in the report and
// records its identity options there (RunReport::options). UsageError for options the lesson refuses.
RunReport run_lesson(Backend& backend, const std::string& name, const Settings& settings = {});

// What `ranklab run NAME --help` prints.
std::string lesson_help(const Lesson& lesson);

#define RANKLAB_LESSON(name, summary, fn, ...)       \
  static const bool ranklab_lesson_registered_##fn = \
      ::ranklab::register_lesson(name, summary, fn __VA_OPT__(, ) __VA_ARGS__)

// ---- implementation -------------------------------------------------------------------------------------

// A lesson's table as the registry keeps it: --world first (the lesson's declaration, or one with a plain
// help) and at least one rank, --quiet last.
template <class O>
OptionTable<O> lesson_table(OptionTable<O> table) {
  OptionTable<O> out{Option<O>("world", &LessonOptions::world, "ranks")};
  out.add(table.options());
  const Option<O>* world = out.find("world");
  if (!world->spec().min) out.add({Option<O>(*world).at_least(1)});
  if (out.find("quiet") == nullptr) {
    out.add({Option<O>("quiet", &LessonOptions::quiet, "print less").not_identity()});
  }
  return out;
}

template <class O>
bool register_lesson(std::string name, std::string summary, void (*fn)(Rank&, const O&), OptionTable<O> table,
                     std::vector<LectureSetting> lecture) {
  static_assert(std::is_base_of_v<LessonOptions, O>, "a lesson's options struct derives from LessonOptions");
  auto full = std::make_shared<const OptionTable<O>>(lesson_table(std::move(table)));
  Lesson l;
  l.name = name;
  l.summary = std::move(summary);
  l.options = full->specs();
  l.lecture = std::move(lecture);
  l.prepare = [full, fn, name](const Settings& settings) {
    auto o = std::make_shared<const O>(full->read(settings, name));
    PreparedLesson p;
    p.world = o->world;
    p.record = full->write(*o, /*identity_only=*/true);
    p.record.erase("world");
    p.program = [o, fn](Rank& r) { fn(r, *o); };
    return p;
  };
  l.expand = [full](const std::string& flag, const std::string& value) {
    const Option<O>* opt = full->find(flag);
    return opt != nullptr && opt->expansion() ? opt->expansion()(value) : Settings{};
  };
  return register_lesson(std::move(l));
}

}  // namespace ranklab
