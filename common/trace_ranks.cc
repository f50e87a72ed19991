#include "common/trace_ranks.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string_view>

#include "common/errors.h"

namespace ranklab {

namespace {

constexpr std::int64_t kMostNamed = 1 << 20;

int read_rank(std::string_view text, std::string_view spec, const std::string& flag) {
  int v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < 0) {
    throw UsageError(
        fmt::format("{} {}: '{}' is not a rank; give all, auto, or ranks and ranges such as 0,8,16-23", flag,
                    spec, text));
  }
  return v;
}

}  // namespace

TraceRanks TraceRanks::parse(const std::string& text, const std::string& flag) {
  TraceRanks t;
  if (text == "all") return t;
  if (text == "auto") {
    t.mode = Mode::Lesson;
    return t;
  }
  t.mode = Mode::Named;
  std::string_view rest = text;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const std::size_t dash = item.find('-');
    const int first = read_rank(item.substr(0, dash), text, flag);
    const int last = dash == std::string_view::npos ? first : read_rank(item.substr(dash + 1), text, flag);
    if (last < first) {
      throw UsageError(fmt::format("{} {}: the range {} ends before it starts", flag, text, item));
    }
    // The ranks are checked against the world later; this many are more than a run has.
    if (static_cast<std::int64_t>(t.ranks.size()) + last - first >= kMostNamed) {
      throw UsageError(
          fmt::format("{} {}: names more than {} ranks; give all for every rank", flag, text, kMostNamed));
    }
    for (int r = first; r <= last; ++r) t.ranks.push_back(r);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  std::sort(t.ranks.begin(), t.ranks.end());
  t.ranks.erase(std::unique(t.ranks.begin(), t.ranks.end()), t.ranks.end());
  return t;
}

void keep_traced_only(RunReport& report, const TraceRanks& trace) {
  const int world = std::max(report.world, static_cast<int>(report.ranks.size()));
  if (trace.keeps_every_rank(world)) return;
  report.traced_ranks = trace.mode == TraceRanks::Mode::Named ? trace.ranks : std::vector<int>{0};
  report.collective_totals = collective_totals(report);
  std::erase_if(report.spans, [&](const Span& s) { return !report.traces(s.rank); });
  std::erase_if(report.regions, [&](const RegionRecord& g) { return !report.traces(g.rank); });
  // The collectives' records stay: one per operation, not per rank, and a record names its group, not
  // whether a traced rank was in it.
}

void TraceRanks::check(int world, const std::string& flag) const {
  if (mode == Mode::Named && !ranks.empty() && ranks.back() >= world) {
    throw UsageError(fmt::format("{}: rank {} is not one of the run's {} ranks (0 to {})", flag, ranks.back(),
                                 world, world - 1));
  }
}

}  // namespace ranklab
