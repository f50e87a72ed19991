// RankTimeline: one rank's busy and idle totals, gathered span by span in space that does not grow with
// the number of spans.
//
// A rank's compute time is the union of its compute spans, its communication time the union of its
// transfers, and what the summary calls exposed communication and idle time needs the overlap of the two
// unions. Holding every span to take the unions at the end costs a large run gigabytes. This holds only the
// unions' intervals that later spans may still touch: a backend that knows no span will start before a
// time (its watermark) folds everything before it into running totals. The totals are those of the whole
// union to the bit: intervals are added to them whole, in time order, as the union of every span would add
// them.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "common/report.h"

namespace ranklab {

// A rank's time in a fixed number of bins of equal width from 0, the width doubling as the timeline grows
// (pairs of bins merge): how busy the rank was when, in constant space. What the page's heat strip draws.
class ActivityBins {
 public:
  static constexpr int kBins = 64;
  enum Kind { kCompute, kComm, kBoth, kWait, kKinds };  // kBoth: communication under compute
  void add(Kind kind, double start_us, double end_us);
  double bin_us() const { return bin_us_; }
  // The time of `kind` in bin i, in microseconds.
  double us(Kind kind, int i) const { return us_[kind][static_cast<std::size_t>(i)]; }

 private:
  std::array<std::array<float, kBins>, kKinds> us_{};
  double bin_us_ = 1;
};

class RankTimeline {
 public:
  // A span of the rank's timeline. Compute and Comm spans join their stream's union; Idle spans (a
  // collective waiting for its late members) are summed: each is one collective's wait.
  void add(SpanKind kind, double start_us, double end_us);

  // No span added from now on starts before `watermark_us`: the intervals that end before it and before
  // the stretch of busy time that reaches it are final, and leave for the totals.
  void fold(double watermark_us);

  // Intervals held, compute and communication together: what the rank's timeline costs in memory now.
  std::size_t held() const { return compute_.size() + comm_.size(); }

  // Fills `s`'s compute, comm, comm_wait, exposed_comm and idle times; its end_us too when it is 0 (the
  // latest span's end). Idle is the rest of [0, end_us].
  void summarize(RankSummary& s) const;

  // When the rank was busy: the folded intervals' bins with the held ones added.
  ActivityBins activity() const;

 private:
  struct Interval {
    double start;
    double end;
  };
  // Sorted by start, disjoint; intervals that touch are one.
  static void insert(std::vector<Interval>& v, Interval iv);
  // One stream's held intervals. The last is kept apart, in the timeline itself: the span that extends it
  // (the next kernel, back to back) touches no other memory, where thousands of ranks' lists are out of
  // the cache.
  class Held {
   public:
    void add(Interval iv);
    std::size_t size() const { return list_.size() + (open_ ? 1 : 0); }
    // Every interval, the last one in the list too, for as long as the caller works on the list; close()
    // takes the last one out again.
    std::vector<Interval>& all();
    void close();
    std::vector<Interval> copy() const;

   private:
    std::vector<Interval> list_;
    Interval last_{0, 0};
    bool open_ = false;
  };
  using Intervals = std::span<const Interval>;
  static double length(Intervals v, double total);
  static double overlap(Intervals a, Intervals b, double total, ActivityBins* bins = nullptr);
  static void add_to(ActivityBins& bins, Intervals compute, Intervals comm);

  Held compute_, comm_;
  // The folded intervals' totals, summed in time order.
  double compute_us_ = 0, comm_us_ = 0, both_us_ = 0;
  double wait_us_ = 0;
  double last_end_us_ = 0;
  ActivityBins bins_;  // of the folded intervals and the waits
};

// Every rank's ActivityBins on one time axis, as the report keeps them (ActivityStrip). `per_rank` holds
// nullptr for a rank that ran no program of its own (a mirror).
ActivityStrip activity_strip(const std::vector<const ActivityBins*>& per_rank, double makespan_us);

}  // namespace ranklab
