// Options declared once: a table reads text into its struct, checking each value against its declaration
// and its member's type, and writes the struct back as the same text.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/options.h"

namespace ranklab {
namespace {

enum class Colour { Red, Green };

struct Base {
  int count = 3;
};

struct Example : Base {
  std::int64_t bytes = 1 << 20;
  double rate = 0.5;
  float share = 0.1f;
  bool fast = false;
  std::string name = "ring";
  std::string bug;
  Colour colour = Colour::Red;
};

const OptionTable<Example>& table() {
  using O = Example;
  static const OptionTable<O> t = {
      Option<O>("count", &O::count, "how many").at_least(1),
      Option<O>("bytes", &O::bytes, "how much").unit("B").at_least(0),
      Option<O>("rate", &O::rate, "how fast").above(0).below(1),
      Option<O>("share", &O::share, "a float's worth"),
      {"fast", &O::fast, "a switch"},
      Option<O>("name", &O::name, "the algorithm").choices({"ring", "tree"}),
      Option<O>("bug", &O::bug, "a deliberate bug").choices({"sum"}).not_identity(),
      Option<O>("colour", &O::colour, "an enum",
                {{"red", Colour::Red}, {"green", Colour::Green}, {"g", Colour::Green}}),
  };
  return t;
}

std::string error_of(const Settings& s) {
  try {
    table().read(s, "example");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Options, DefaultsComeFromTheStructAndReadBackAsTheSameText) {
  const Settings defaults = table().write(Example{});
  EXPECT_EQ(defaults.at("count"), "3");  // a member of a base of the struct
  EXPECT_EQ(defaults.at("bytes"), "1048576");
  EXPECT_EQ(defaults.at("rate"), "0.5");
  EXPECT_EQ(defaults.at("share"), "0.1");  // a float as the float it is, not its double's digits
  EXPECT_EQ(defaults.at("fast"), "false");
  EXPECT_EQ(defaults.at("colour"), "red");
  EXPECT_EQ(table().find("bytes")->spec().default_text, "1048576");
  const Example o = table().read({{"count", "7"}, {"rate", "0.25"}, {"fast", "true"}, {"colour", "g"}}, "");
  EXPECT_EQ(o.count, 7);
  EXPECT_EQ(o.rate, 0.25);
  EXPECT_TRUE(o.fast);
  EXPECT_EQ(o.colour, Colour::Green);
  EXPECT_EQ(table().write(o).at("colour"), "green");  // an alias is written as the value's first name
  EXPECT_EQ(table().read(table().write(o), "").count, 7);
  EXPECT_FALSE(table().write(o, /*identity_only=*/true).count("bug"));
}

TEST(Options, EveryValueIsCheckedNamingTheFlagTheRangeAndTheValue) {
  EXPECT_EQ(error_of({{"count", "0"}}), "example: --count must be at least 1 (got 0)");
  EXPECT_EQ(error_of({{"count", "2147483648"}}),
            "example: --count must be at least 1 and at most 2147483647 (got 2147483648)");
  EXPECT_EQ(error_of({{"bytes", "99999999999999999999"}}),
            "example: --bytes must be at least 0 and at most 9223372036854775807 (got 99999999999999999999)");
  EXPECT_EQ(error_of({{"count", "3.5"}}), "example: --count takes a whole number, at least 1 (got '3.5')");
  EXPECT_EQ(error_of({{"rate", "1"}}), "example: --rate must be a finite number above 0 and below 1 (got 1)");
  EXPECT_EQ(error_of({{"rate", "inf"}}),
            "example: --rate must be a finite number above 0 and below 1 (got inf)");
  EXPECT_EQ(error_of({{"rate", "fast"}}),
            "example: --rate takes a finite number above 0 and below 1 (got 'fast')");
  EXPECT_EQ(error_of({{"share", "1e39"}}),
            "example: --share must be a finite number at least -3.4028235e+38 and at most 3.4028235e+38 (got "
            "1e39)");
  EXPECT_EQ(error_of({{"fast", "1"}}), "example: --fast is a switch: true or false (got '1')");
  EXPECT_EQ(error_of({{"name", "star"}}), "example: --name must be ring or tree (got 'star')");
  EXPECT_EQ(error_of({{"colour", "blue"}}), "example: --colour must be red or green (got 'blue')");
  EXPECT_EQ(
      error_of({{"speed", "9"}}),
      "example: there is no option --speed; the options are: --count, --bytes, --rate, --share, --fast, "
      "--name, --bug, --colour");
  // The default of a text with choices is always taken: no bug is "".
  EXPECT_EQ(table().read({{"bug", ""}}, "").bug, "");
}

TEST(Options, AStructMadeInCodeIsCheckedTheSameWay) {
  Example o;
  EXPECT_NO_THROW(table().check(o, "example"));
  o.rate = 2;
  EXPECT_THROW(table().check(o, "example"), UsageError);
}

TEST(Options, HelpSaysWhatEachTakes) {
  EXPECT_EQ(table().find("count")->spec().range_text(), "at least 1");
  EXPECT_EQ(table().find("rate")->spec().range_text(), "above 0 and below 1");
  EXPECT_EQ(table().find("name")->spec().range_text(), "ring | tree");
  EXPECT_EQ(table().find("colour")->spec().range_text(), "red | green");  // not the alias
  EXPECT_EQ(table().find("share")->spec().range_text(), "");
  EXPECT_EQ(table().find("bytes")->spec().unit, "B");
}

TEST(Options, ATableCanChangeOrLeaveOutASharedDeclaration) {
  using O = Example;
  OptionTable<O> t = table();
  t.add({Option<O>("count", &O::count, "how many, at most 9").at_least(1).at_most(9)});
  t.remove("fast");
  EXPECT_EQ(t.options().front().spec().flag, "count");  // replaced in place
  EXPECT_EQ(t.find("count")->spec().help, "how many, at most 9");
  EXPECT_EQ(t.find("fast"), nullptr);
  EXPECT_THROW(t.read({{"count", "10"}}, ""), UsageError);
  EXPECT_THROW(t.read({{"fast", "true"}}, ""), UsageError);
}

TEST(Options, AnOptionCanExpandIntoOthers) {
  using O = Example;
  const Option<O> o = Option<O>("name", &O::name, "a preset").expands([](const std::string& v) {
    if (v != "tree") throw UsageError("no preset " + v);
    return Settings{{"count", "2"}};
  });
  EXPECT_EQ(o.expansion()("tree").at("count"), "2");
  EXPECT_THROW(o.expansion()("star"), UsageError);
  EXPECT_EQ(option_text(true), "true");
  EXPECT_EQ(option_text(0.01), "0.01");
  EXPECT_EQ(option_text(std::int64_t{1} << 40), "1099511627776");
  EXPECT_EQ(option_text("gpipe"), "gpipe");
}

}  // namespace
}  // namespace ranklab
