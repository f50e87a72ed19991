#include "common/text.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "common/errors.h"

namespace ranklab {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(fmt::format("{}: cannot read the file", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> split_at(const std::string& text, char separator) {
  std::vector<std::string> pieces;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    std::size_t end = text.find(separator, begin);
    if (end == std::string::npos) end = text.size();
    pieces.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return pieces;
}

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::string format_percent(double fraction) {
  if (!std::isfinite(fraction)) return "-";
  return fmt::format("{:.1f}%", 100 * fraction);
}

}  // namespace ranklab
