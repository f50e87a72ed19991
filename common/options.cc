#include "common/options.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

#include "common/errors.h"

namespace ranklab {

namespace {

// "a, b or c"
std::string one_of(const std::vector<std::string>& choices) {
  std::string out;
  for (std::size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) out += i + 1 == choices.size() ? " or " : ", ";
    out += choices[i];
  }
  return out;
}

std::string prefix(const std::string& who) {
  return who.empty() ? "" : who + ": ";
}

// The range a number must lie in, as the declaration gives it; `integer` writes the bounds as whole numbers.
std::string range_of(const OptionSpec& spec, bool integer) {
  auto text = [&](double v) { return integer ? fmt::format("{:.0f}", v) : number_text(v); };
  std::string low, high;
  if (spec.min) low = fmt::format("{} {}", spec.min_open ? "above" : "at least", text(*spec.min));
  if (spec.max) high = fmt::format("{} {}", spec.max_open ? "below" : "at most", text(*spec.max));
  return !low.empty() && !high.empty() ? low + " and " + high : low + high;
}

// The same, with the type's own bounds where the declaration sets none: what an int member holds.
template <class T>
std::string range_within(const OptionSpec& spec, T type_min, T type_max) {
  std::string low, high;
  const std::string declared = range_of(spec, std::is_integral_v<T>);
  // A float's bounds to the float's own precision: 3.4028235e+38, not the double's digits.
  const char* format = std::is_integral_v<T> ? "{}" : "{:.8g}";
  if (!spec.min) low = "at least " + fmt::format(fmt::runtime(format), type_min);
  if (!spec.max) high = "at most " + fmt::format(fmt::runtime(format), type_max);
  std::vector<std::string> parts;
  for (const std::string* p :
       {static_cast<const std::string*>(&low), &declared, static_cast<const std::string*>(&high)}) {
    if (!p->empty()) parts.push_back(*p);
  }
  return fmt::format("{}", fmt::join(parts, " and "));
}

// "a finite number at least 0": what a number must be, for errors.
std::string number_range(const OptionSpec& spec, const std::string& range) {
  if (spec.kind != OptionKind::Number) return range;
  return range.empty() ? "a finite number" : "a finite number " + range;
}

bool below_min(const OptionSpec& spec, double v) {
  return spec.min && (spec.min_open ? !(v > *spec.min) : !(v >= *spec.min));
}
bool above_max(const OptionSpec& spec, double v) {
  return spec.max && (spec.max_open ? !(v < *spec.max) : !(v <= *spec.max));
}

// `high`: the value is above the declared maximum, whose reason (a cap on work) the error then gives.
[[noreturn]] void out_of_range(const OptionSpec& spec, const std::string& text, const std::string& who,
                               const std::string& range, bool high = false) {
  const std::string why = high && !spec.max_why.empty() ? ": " + spec.max_why : "";
  throw UsageError(fmt::format("{}--{} must be {} (got {}){}", prefix(who), spec.flag,
                               number_range(spec, range), text, why));
}

}  // namespace

std::string number_text(double v) {
  return fmt::format("{}", v);
}
std::string number_text(float v) {
  return fmt::format("{}", v);
}
std::string number_text(std::int64_t v) {
  return fmt::format("{}", v);
}

std::string OptionSpec::range_text() const {
  if (!choices.empty()) return fmt::format("{}", fmt::join(choices, " | "));
  std::string low, high;
  return range_of(*this, kind == OptionKind::Integer);
}

std::int64_t read_integer(const OptionSpec& spec, const std::string& text, const std::string& who,
                          std::int64_t type_min, std::int64_t type_max) {
  std::int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [at, ec] = std::from_chars(text.data(), end, v);
  // The range texts are built only for an error: a planner reads thousands of layouts' flags.
  auto range = [&] { return range_of(spec, true); };
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && (v < type_min || v > type_max))) {
    // Past the type's range, the message says what the type holds too.
    if (at == end) out_of_range(spec, text, who, range_within(spec, type_min, type_max), text[0] != '-');
  }
  if (ec != std::errc() || at != end) {
    const std::string r = range();
    throw UsageError(fmt::format("{}--{} takes a whole number{} (got '{}')", prefix(who), spec.flag,
                                 r.empty() ? "" : ", " + r, text));
  }
  if (below_min(spec, static_cast<double>(v))) out_of_range(spec, text, who, range());
  if (above_max(spec, static_cast<double>(v))) out_of_range(spec, text, who, range(), true);
  return v;
}

double read_number(const OptionSpec& spec, const std::string& text, const std::string& who, double type_max) {
  double v = 0;
  const char* end = text.data() + text.size();
  const auto [at, ec] = std::from_chars(text.data(), end, v);
  auto range = [&] { return range_of(spec, false); };
  if ((ec == std::errc::result_out_of_range && at == end) ||
      (ec == std::errc() && at == end && !std::isfinite(v))) {
    out_of_range(spec, text, who, range());
  }
  if (ec != std::errc() || at != end) {
    throw UsageError(
        fmt::format("{}--{} takes {} (got '{}')", prefix(who), spec.flag, number_range(spec, range()), text));
  }
  // A number that would not fit the type it ends up in (1e39 as a float) is refused here, not turned
  // into infinity later.
  if (std::fabs(v) > type_max) out_of_range(spec, text, who, range_within(spec, -type_max, type_max));
  if (below_min(spec, v)) out_of_range(spec, text, who, range());
  if (above_max(spec, v)) out_of_range(spec, text, who, range(), true);
  return v;
}

bool read_switch(const OptionSpec& spec, const std::string& text, const std::string& who) {
  if (text == "true") return true;
  if (text == "false") return false;
  throw UsageError(fmt::format("{}--{} is a switch: true or false (got '{}')", prefix(who), spec.flag, text));
}

std::string read_text(const OptionSpec& spec, const std::string& text, const std::string& who) {
  if (spec.choices.empty() || text == spec.default_text) return text;
  for (const auto* names : {&spec.choices, &spec.aliases}) {
    for (const std::string& c : *names) {
      if (c == text) return text;
    }
  }
  throw UsageError(
      fmt::format("{}--{} must be {} (got '{}')", prefix(who), spec.flag, one_of(spec.choices), text));
}

void throw_unknown_option(const std::string& who, const std::string& flag,
                          const std::vector<std::string>& table_flags) {
  std::vector<std::string> dashed;
  for (const std::string& f : table_flags) dashed.push_back("--" + f);
  throw UsageError(fmt::format("{}there is no option --{}; the options are: {}", prefix(who), flag,
                               fmt::join(dashed, ", ")));
}

}  // namespace ranklab
