// Plain text shared by the commands that read measurements and published tables and print what they
// found: a file read whole, a line's words, a fraction as a percentage.
#pragma once

#include <string>
#include <vector>

namespace ranklab {

// The whole file at `path`; UsageError "PATH: cannot read the file" when it cannot be opened.
std::string read_text_file(const std::string& path);

// The pieces of `text` between `separator`s, every one of them: "a\nb\n" is {"a", "b", ""}.
std::vector<std::string> split_at(const std::string& text, char separator);

// The whitespace-separated words of `line`.
std::vector<std::string> split_words(const std::string& line);

// "4.2%" for 0.042; "-" where there is nothing to score (NaN or infinite).
std::string format_percent(double fraction);

}  // namespace ranklab
