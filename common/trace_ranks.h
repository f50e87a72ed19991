// Which ranks a report keeps span by span (--trace-ranks). The trace, the report's spans and regions and
// the page's timeline show only these; every rank's totals, the collectives table and the link traffic
// cover every rank whatever this says. A large run's timeline is gigabytes; its totals are not.
#pragma once

#include <string>
#include <vector>

#include "common/report.h"

namespace ranklab {

struct TraceRanks {
  enum class Mode {
    All,     // every rank ("all")
    Lesson,  // rank 0 and the ranks the lesson marks (Rank::keep_in_trace), or every rank of a small world
    Named,   // the ranks named
  };
  Mode mode = Mode::All;
  std::vector<int> ranks;  // Named: sorted, each once

  // "all", "auto" (Mode::Lesson) or a list of ranks and ranges: "0,8,16-23". UsageError naming `flag`
  // otherwise.
  static TraceRanks parse(const std::string& text, const std::string& flag);
  // UsageError naming `flag` when a named rank is not one of the world's.
  void check(int world, const std::string& flag) const;
  // Whether every rank of a world of `world` ranks is traced: with `all`, and with `auto` in a world this
  // small (a page and a trace of a few ranks stay small, and the lecture's lessons run on a few).
  bool keeps_every_rank(int world) const {
    return mode == Mode::All || (mode == Mode::Lesson && world <= kAllUpTo);
  }
  static constexpr int kAllUpTo = 16;
};

// Drops the spans and regions of the ranks `trace` leaves out, once the report's totals are taken
// (RunReport::collective_totals included), and lists the ranks it kept: what a backend that measures every
// rank's timeline reports. Mode::Lesson keeps rank 0 (every rank of a small world).
void keep_traced_only(RunReport& report, const TraceRanks& trace);

}  // namespace ranklab
