#include "common/rank_timeline.h"

#include <algorithm>
#include <iterator>

namespace ranklab {

void RankTimeline::insert(std::vector<Interval>& v, Interval iv) {
  // Spans arrive nearly in time order: the place is found from the back.
  auto pos = v.end();
  while (pos != v.begin() && std::prev(pos)->start > iv.start) --pos;
  if (pos != v.begin() && iv.start <= std::prev(pos)->end) {
    --pos;
    pos->end = std::max(pos->end, iv.end);
  } else {
    pos = v.insert(pos, iv);
  }
  // It may now reach the intervals after it.
  auto last = std::next(pos);
  while (last != v.end() && last->start <= pos->end) {
    pos->end = std::max(pos->end, last->end);
    ++last;
  }
  v.erase(std::next(pos), last);
}

void RankTimeline::add(SpanKind kind, double start_us, double end_us) {
  last_end_us_ = std::max(last_end_us_, end_us);
  if (!(end_us > start_us)) return;  // covers nothing
  switch (kind) {
    case SpanKind::Compute:
      insert(compute_, {start_us, end_us});
      break;
    case SpanKind::Comm:
      insert(comm_, {start_us, end_us});
      break;
    case SpanKind::Idle:
      wait_us_ += end_us - start_us;
      bins_.add(ActivityBins::kWait, start_us, end_us);
      break;
  }
}

void ActivityBins::add(Kind kind, double start_us, double end_us) {
  if (!(end_us > start_us) || !(start_us >= 0)) return;
  // Widen until the span ends inside the last bin: pairs of bins merge.
  while (end_us > kBins * bin_us_) {
    for (auto& row : us_) {
      for (int i = 0; i < kBins / 2; ++i) row[i] = row[2 * i] + row[2 * i + 1];
      std::fill(row.begin() + kBins / 2, row.end(), 0.0f);
    }
    bin_us_ *= 2;
  }
  const int first = std::min(kBins - 1, static_cast<int>(start_us / bin_us_));
  const int last = std::min(kBins - 1, static_cast<int>(end_us / bin_us_));
  for (int i = first; i <= last; ++i) {
    const double lo = std::max(start_us, i * bin_us_), hi = std::min(end_us, (i + 1) * bin_us_);
    if (hi > lo) us_[kind][static_cast<std::size_t>(i)] += static_cast<float>(hi - lo);
  }
}

ActivityStrip activity_strip(const std::vector<const ActivityBins*>& per_rank, double makespan_us) {
  constexpr int kBins = ActivityBins::kBins;
  // One width for every rank: the widest, doubled until the bins span the run. Every rank's width divides
  // it (each is a power of two times the first), so a rank's bins merge into it whole.
  double width = 1;
  for (const ActivityBins* b : per_rank) {
    if (b != nullptr) width = std::max(width, b->bin_us());
  }
  while (kBins * width < makespan_us) width *= 2;
  ActivityStrip strip;
  strip.bin_us = width;
  strip.bins = kBins;
  strip.ranks.reserve(per_rank.size());
  for (const ActivityBins* b : per_rank) {
    std::string& row = strip.ranks.emplace_back();
    if (b == nullptr) continue;
    const int merge = static_cast<int>(std::lround(width / b->bin_us()));
    row.reserve(3 * kBins);
    for (int i = 0; i < kBins; ++i) {
      double us[ActivityBins::kKinds] = {};
      for (int k = 0; k < ActivityBins::kKinds; ++k) {
        for (int j = i * merge; j < std::min(kBins, (i + 1) * merge); ++j)
          us[k] += b->us(static_cast<ActivityBins::Kind>(k), j);
      }
      const double compute = std::clamp(us[ActivityBins::kCompute] / width, 0.0, 1.0);
      const double exposed =
          std::clamp((us[ActivityBins::kComm] - us[ActivityBins::kBoth]) / width, 0.0, 1.0 - compute);
      const double wait = std::clamp(us[ActivityBins::kWait] / width, 0.0, 1.0 - compute - exposed);
      for (double share : {compute, exposed, wait}) row += static_cast<char>('0' + std::lround(9 * share));
    }
  }
  return strip;
}

double RankTimeline::length(Intervals v, double total) {
  for (const Interval& iv : v) total += iv.end - iv.start;
  return total;
}

// The intersection's length added to `total`, piece by piece in time order: one merge-like pass. Each piece
// goes to `bins` too, when given.
double RankTimeline::overlap(Intervals a, Intervals b, double total, ActivityBins* bins) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].start, b[j].start);
    const double hi = std::min(a[i].end, b[j].end);
    if (hi > lo) {
      total += hi - lo;
      if (bins != nullptr) bins->add(ActivityBins::kBoth, lo, hi);
    }
    // Whichever ends first cannot overlap anything further along the other list.
    if (a[i].end < b[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

void RankTimeline::fold(double watermark_us) {
  // The cut: where the stretch of busy time (compute or communication) that reaches the watermark begins,
  // or the watermark when none does. Every interval before it ends before the watermark, so no later span
  // joins it, and before every interval kept, so none overlaps what is kept.
  double cut_us = watermark_us;
  std::size_t i = 0, j = 0;
  while (i < compute_.size() || j < comm_.size()) {
    const bool from_compute =
        j == comm_.size() || (i < compute_.size() && compute_[i].start <= comm_[j].start);
    const double stretch_start = from_compute ? compute_[i].start : comm_[j].start;
    double stretch_end = stretch_start;
    while (true) {
      if (i < compute_.size() && compute_[i].start <= stretch_end) {
        stretch_end = std::max(stretch_end, compute_[i++].end);
      } else if (j < comm_.size() && comm_[j].start <= stretch_end) {
        stretch_end = std::max(stretch_end, comm_[j++].end);
      } else {
        break;
      }
    }
    if (stretch_end >= watermark_us) {
      cut_us = stretch_start;
      break;
    }
  }
  auto before_cut = [cut_us](std::vector<Interval>& v) {
    return std::partition_point(v.begin(), v.end(), [cut_us](const Interval& iv) { return iv.end < cut_us; });
  };
  const auto compute_end = before_cut(compute_), comm_end = before_cut(comm_);
  const Intervals compute_done(compute_.begin(), compute_end), comm_done(comm_.begin(), comm_end);
  compute_us_ = length(compute_done, compute_us_);
  comm_us_ = length(comm_done, comm_us_);
  both_us_ = overlap(compute_done, comm_done, both_us_);
  add_to(bins_, compute_done, comm_done);
  compute_.erase(compute_.begin(), compute_end);
  comm_.erase(comm_.begin(), comm_end);
}

void RankTimeline::add_to(ActivityBins& bins, Intervals compute, Intervals comm) {
  for (const Interval& iv : compute) bins.add(ActivityBins::kCompute, iv.start, iv.end);
  for (const Interval& iv : comm) bins.add(ActivityBins::kComm, iv.start, iv.end);
  overlap(compute, comm, 0, &bins);
}

ActivityBins RankTimeline::activity() const {
  ActivityBins bins = bins_;
  add_to(bins, compute_, comm_);
  return bins;
}

void RankTimeline::summarize(RankSummary& s) const {
  const double compute_us = length(compute_, compute_us_);
  const double comm_us = length(comm_, comm_us_);
  const double both_us = overlap(compute_, comm_, both_us_);
  s.compute_us = compute_us;
  s.comm_us = comm_us;
  s.comm_wait_us = wait_us_;
  s.exposed_comm_us = comm_us - both_us;
  if (s.end_us == 0) s.end_us = last_end_us_;
  s.idle_us = std::max(0.0, s.end_us - (compute_us + comm_us - both_us));
}

}  // namespace ranklab
