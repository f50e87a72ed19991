// Options declared once. A lesson (or a backend) keeps its options in a plain struct, each member with
// its default; a table beside the struct declares, per member, its flag, help, unit, range or choices,
// and whether it is part of the run's identity. Everything that reads or writes options is generated
// from that table: the command line's flags, `ranklab run LESSON --help`, the record of a run in
// report.json, the replay of that record, the `--break` lists and the checks of each value.
//
//   struct BucketOptions : LessonOptions {
//     bool overlap = false;
//     double bucket_mb = 25;
//   };
//   const OptionTable<BucketOptions> kOptions = {
//       {"world", &BucketOptions::world, "ranks"},
//       {"overlap", &BucketOptions::overlap, "all-reduce gradients in buckets during backward"},
//       Option<BucketOptions>("bucket-mb", &BucketOptions::bucket_mb, "gradient bucket size")
//           .unit("MiB").above(0).at_most(1 << 20),
//   };
//
// Values travel as text (Settings): the command line's words, a report's record. A table reads them into
// its struct, checking each against its declaration, and writes a struct back as the same text.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ranklab {

// Options as text: the flag without its dashes ("bucket-mb") -> its value as the command line spells it
// ("0.5"; "true" or "false" for a switch).
using Settings = std::map<std::string, std::string>;

enum class OptionKind {
  Switch,   // bool: given alone it is true (--phantom)
  Integer,  // int or std::int64_t
  Number,   // double or float
  Text,     // std::string or an enum, perhaps one of `choices`
};

// What a table says of one option, whatever its struct: all that help, the command line and reports need.
struct OptionSpec {
  std::string flag;  // "bucket-mb"
  OptionKind kind = OptionKind::Text;
  std::string default_text;  // the default-constructed struct's value, as text ("25"; "" for none)
  std::string help;
  std::string unit;                  // "MiB", "ranks"; "" when the number has none
  std::vector<std::string> choices;  // a Text option that takes only these values, or its default
  std::vector<std::string> aliases;  // and these, which help does not list ("bfloat16" for "bf16")
  // Integer and Number options: the smallest and largest value taken, each open (excluded) or not. The
  // type's own range always applies: an int member refuses 2^31 even without a maximum here.
  std::optional<double> min, max;
  bool min_open = false, max_open = false;
  // Why there is a maximum, where it caps work rather than meaning ("each layer is simulated kernel by
  // kernel ..."): said with the error of a value above it.
  std::string max_why;
  // A Text option that may also be given alone (`--symmetric` is `--symmetric tp-dp`): that value.
  std::string implicit;
  // Part of the run's identity: recorded in report.json, compared by `ranklab compare`, set again when
  // the run is replayed. Not so for what changes only the output (--quiet).
  bool identity = true;
  // "--count has no effect with --sweep, which ...": given together with the option `ignored_with`, this
  // option would change nothing, and the command line refuses the pair, saying why.
  std::string ignored_with, ignored_why;

  // What values it takes, for help: "at least 1", "sgd | adamw", "above 0 and at most 1048576"; "" for
  // any.
  std::string range_text() const;
};

// The checks every option's value passes, one way for every flag and every file. `who` names where the
// value came from in errors ("data_parallel", "the report's options"). Each throws UsageError naming the
// flag, the range and the value given.
std::int64_t read_integer(const OptionSpec& spec, const std::string& text, const std::string& who,
                          std::int64_t type_min, std::int64_t type_max);
double read_number(const OptionSpec& spec, const std::string& text, const std::string& who, double type_max);
bool read_switch(const OptionSpec& spec, const std::string& text, const std::string& who);
std::string read_text(const OptionSpec& spec, const std::string& text, const std::string& who);
// A number as options write it: the shortest text that reads back as the same value.
std::string number_text(double v);
std::string number_text(float v);
std::string number_text(std::int64_t v);

// One option of struct O: a member, its flag and what the table says of it.
template <class O>
class Option {
 public:
  // A member of O, or of a base of O (shared options: mlp::TrainingOptions).
  template <class T, class C>
  Option(std::string flag, T C::*member, std::string help);
  // An enum member, spelled on the command line as `names` say.
  template <class E, class C>
  Option(std::string flag, E C::*member, std::string help, std::vector<std::pair<std::string, E>> names);

  Option& unit(std::string u) { return spec_.unit = std::move(u), *this; }
  Option& at_least(double v) { return spec_.min = v, spec_.min_open = false, *this; }
  Option& above(double v) { return spec_.min = v, spec_.min_open = true, *this; }
  Option& at_most(double v) { return spec_.max = v, spec_.max_open = false, *this; }
  // A cap on work, not a bound of meaning: the error of a value above it says `why`.
  Option& at_most(double v, std::string why) {
    spec_.max_why = std::move(why);
    return at_most(v);
  }
  Option& below(double v) { return spec_.max = v, spec_.max_open = true, *this; }
  Option& choices(std::vector<std::string> c) { return spec_.choices = std::move(c), *this; }
  Option& implicit(std::string v) { return spec_.implicit = std::move(v), *this; }
  Option& not_identity() { return spec_.identity = false, *this; }
  Option& ignored_with(std::string flag, std::string why) {
    spec_.ignored_with = std::move(flag);
    spec_.ignored_why = std::move(why);
    return *this;
  }
  // Given a value, this option also sets others, under those the command line gives itself: `--model
  // gpt3-175b` fills the shape. `expand` returns them (UsageError for a value it does not know).
  Option& expands(std::function<Settings(const std::string& value)> expand) {
    expand_ = std::move(expand);
    return *this;
  }

  const OptionSpec& spec() const { return spec_; }
  const std::function<Settings(const std::string&)>& expansion() const { return expand_; }
  // Sets the member of `o` from `text`, checked against the declaration (UsageError naming the flag).
  void read(O& o, const std::string& text, const std::string& who) const { read_(o, spec_, text, who); }
  std::string write(const O& o) const { return write_(o); }

 private:
  OptionSpec spec_;
  std::function<void(O&, const OptionSpec&, const std::string&, const std::string&)> read_;
  std::function<std::string(const O&)> write_;
  std::function<Settings(const std::string&)> expand_;
};

// The options of struct O, in the order help lists them. A flag declared again replaces its earlier
// declaration in place, so a table can start from shared declarations and change one of them.
template <class O>
class OptionTable {
 public:
  OptionTable(std::initializer_list<Option<O>> options) { add(options); }
  explicit OptionTable(const std::vector<Option<O>>& options) { add(options); }

  template <class List>
  OptionTable& add(const List& options) {
    for (const Option<O>& o : options) {
      auto same = [&](const Option<O>& x) { return x.spec().flag == o.spec().flag; };
      auto it = std::find_if(options_.begin(), options_.end(), same);
      if (it == options_.end()) {
        options_.push_back(o);
      } else {
        *it = o;
      }
    }
    return *this;
  }
  OptionTable& add(std::initializer_list<Option<O>> options) { return add<decltype(options)>(options); }
  // Leaves out a shared declaration this table's struct has the member for but does not take.
  OptionTable& remove(const std::string& flag) {
    std::erase_if(options_, [&](const Option<O>& o) { return o.spec().flag == flag; });
    return *this;
  }

  const std::vector<Option<O>>& options() const { return options_; }
  const Option<O>* find(const std::string& flag) const {
    for (const Option<O>& o : options_) {
      if (o.spec().flag == flag) return &o;
    }
    return nullptr;
  }
  std::vector<OptionSpec> specs() const {
    std::vector<OptionSpec> out;
    for (const Option<O>& o : options_) out.push_back(o.spec());
    return out;
  }
  // O's defaults with `settings` over them. UsageError naming `who` and the flag for a name the table
  // does not declare or a value its declaration refuses.
  O read(const Settings& settings, const std::string& who) const;
  // The same over `o`: each flag sets a field of its own, so reading settings in parts, in any order, is
  // reading them at once.
  void read_into(O& o, const Settings& settings, const std::string& who) const;
  // UsageError, as read() gives it, for a member of `o` (made in code) that its declaration refuses.
  void check(const O& o, const std::string& who) const { read(write(o), who); }
  // Every option of `o` as text; with `identity_only`, only those that are part of the run's identity.
  Settings write(const O& o, bool identity_only = false) const {
    Settings out;
    for (const Option<O>& opt : options_) {
      if (!identity_only || opt.spec().identity) out[opt.spec().flag] = opt.write(o);
    }
    return out;
  }

 private:
  std::vector<Option<O>> options_;
};

// UsageError for a flag `table_flags` does not hold: names `who`, the flag and the flags there are.
[[noreturn]] void throw_unknown_option(const std::string& who, const std::string& flag,
                                       const std::vector<std::string>& table_flags);

// ---- implementation -------------------------------------------------------------------------------------

namespace option_detail {
// Reads `text` as a T under `spec`'s checks.
template <class T>
T read_as(const OptionSpec& spec, const std::string& text, const std::string& who) {
  if constexpr (std::is_same_v<T, bool>) {
    return read_switch(spec, text, who);
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(
        read_integer(spec, text, who, std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(read_number(spec, text, who, static_cast<double>(std::numeric_limits<T>::max())));
  } else {
    static_assert(std::is_same_v<T, std::string>, "an option is a bool, an integer, a number or text");
    return read_text(spec, text, who);
  }
}
template <class T>
std::string write_as(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_integral_v<T>) {
    return number_text(static_cast<std::int64_t>(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    return number_text(v);  // a float as a float: 0.1f is "0.1", not its double's digits
  } else {
    return v;
  }
}
template <class T>
constexpr OptionKind kind_of() {
  if constexpr (std::is_same_v<T, bool>) return OptionKind::Switch;
  if constexpr (std::is_integral_v<T>) return OptionKind::Integer;
  if constexpr (std::is_floating_point_v<T>) return OptionKind::Number;
  return OptionKind::Text;
}
}  // namespace option_detail

// A value as an options table writes it: "true", "64", "0.01", a text as it is. For Settings made in code:
// settings["dim"] = option_text(64).
template <class T>
std::string option_text(const T& v) {
  if constexpr (std::is_convertible_v<const T&, std::string>) {
    return std::string(v);
  } else {
    return option_detail::write_as<T>(v);
  }
}

template <class O>
template <class T, class C>
Option<O>::Option(std::string flag, T C::*member, std::string help) {
  static_assert(std::is_base_of_v<C, O>, "an option is a member of its struct or of a base of it");
  spec_.flag = std::move(flag);
  spec_.help = std::move(help);
  spec_.kind = option_detail::kind_of<T>();
  T O::*m = member;
  read_ = [m](O& o, const OptionSpec& spec, const std::string& text, const std::string& who) {
    o.*m = option_detail::read_as<T>(spec, text, who);
  };
  write_ = [m](const O& o) { return option_detail::write_as<T>(o.*m); };
  spec_.default_text = write_(O{});
}

template <class O>
template <class E, class C>
Option<O>::Option(std::string flag, E C::*member, std::string help,
                  std::vector<std::pair<std::string, E>> names) {
  static_assert(std::is_base_of_v<C, O> && std::is_enum_v<E>,
                "an enum member of the struct or of a base of it");
  spec_.flag = std::move(flag);
  spec_.help = std::move(help);
  spec_.kind = OptionKind::Text;
  // The first name of a value is the one it is written as; later names of the same value are aliases.
  for (std::size_t i = 0; i < names.size(); ++i) {
    bool seen = false;
    for (std::size_t j = 0; j < i; ++j) seen = seen || names[j].second == names[i].second;
    (seen ? spec_.aliases : spec_.choices).push_back(names[i].first);
  }
  E O::*m = member;
  read_ = [m, names](O& o, const OptionSpec& spec, const std::string& text, const std::string& who) {
    const std::string name = read_text(spec, text, who);
    for (const auto& [n, value] : names) {
      if (n == name) o.*m = value;
    }
  };
  write_ = [m, names](const O& o) {
    for (const auto& [n, value] : names) {
      if (value == o.*m) return n;
    }
    return std::string("?");
  };
  spec_.default_text = write_(O{});
}

template <class O>
O OptionTable<O>::read(const Settings& settings, const std::string& who) const {
  O o{};
  read_into(o, settings, who);
  return o;
}

template <class O>
void OptionTable<O>::read_into(O& o, const Settings& settings, const std::string& who) const {
  for (const auto& [flag, text] : settings) {
    const Option<O>* opt = find(flag);
    if (opt == nullptr) {
      std::vector<std::string> flags;
      for (const Option<O>& x : options_) flags.push_back(x.spec().flag);
      throw_unknown_option(who, flag, flags);
    }
    opt->read(o, text, who);
  }
}

}  // namespace ranklab
