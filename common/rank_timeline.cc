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

void RankTimeline::Held::add(Interval iv) {
  if (open_ && iv.start >= last_.start) {
    if (iv.start <= last_.end) {
      last_.end = std::max(last_.end, iv.end);
      return;
    }
    list_.push_back(last_);
    last_ = iv;
    return;
  }
  if (!open_) {
    // The first, or the first since a fold took them all: it goes after what the list holds, if anywhere.
    if (list_.empty() || iv.start >= list_.back().start) {
      if (!list_.empty() && iv.start <= list_.back().end) {
        last_ = list_.back();
        list_.pop_back();
        last_.end = std::max(last_.end, iv.end);
      } else {
        last_ = iv;
      }
      open_ = true;
      return;
    }
  }
  // Out of order: into the list, whose last interval is then kept apart again.
  insert(all(), iv);
  close();
}

std::vector<RankTimeline::Interval>& RankTimeline::Held::all() {
  if (open_) list_.push_back(last_);
  open_ = false;
  return list_;
}

void RankTimeline::Held::close() {
  if (list_.empty()) return;
  last_ = list_.back();
  list_.pop_back();
  open_ = true;
}

std::vector<RankTimeline::Interval> RankTimeline::Held::copy() const {
  std::vector<Interval> out = list_;
  if (open_) out.push_back(last_);
  return out;
}

void RankTimeline::add(SpanKind kind, double start_us, double end_us) {
  last_end_us_ = std::max(last_end_us_, end_us);
  if (!(end_us > start_us)) return;  // covers nothing
  switch (kind) {
    case SpanKind::Compute:
      compute_.add({start_us, end_us});
      break;
    case SpanKind::Comm:
      comm_.add({start_us, end_us});
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
  std::vector<Interval>& compute = compute_.all();
  std::vector<Interval>& comm = comm_.all();
  // The cut: where the stretch of busy time (compute or communication) that reaches the watermark begins,
  // or the watermark when none does. Every interval before it ends before the watermark, so no later span
  // joins it, and before every interval kept, so none overlaps what is kept.
  double cut_us = watermark_us;
  std::size_t i = 0, j = 0;
  while (i < compute.size() || j < comm.size()) {
    const bool from_compute = j == comm.size() || (i < compute.size() && compute[i].start <= comm[j].start);
    const double stretch_start = from_compute ? compute[i].start : comm[j].start;
    double stretch_end = stretch_start;
    while (true) {
      if (i < compute.size() && compute[i].start <= stretch_end) {
        stretch_end = std::max(stretch_end, compute[i++].end);
      } else if (j < comm.size() && comm[j].start <= stretch_end) {
        stretch_end = std::max(stretch_end, comm[j++].end);
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
  const auto compute_end = before_cut(compute), comm_end = before_cut(comm);
  const Intervals compute_done(compute.begin(), compute_end), comm_done(comm.begin(), comm_end);
  compute_us_ = length(compute_done, compute_us_);
  comm_us_ = length(comm_done, comm_us_);
  both_us_ = overlap(compute_done, comm_done, both_us_);
  add_to(bins_, compute_done, comm_done);
  compute.erase(compute.begin(), compute_end);
  comm.erase(comm.begin(), comm_end);
  compute_.close();
  comm_.close();
}

void RankTimeline::add_to(ActivityBins& bins, Intervals compute, Intervals comm) {
  for (const Interval& iv : compute) bins.add(ActivityBins::kCompute, iv.start, iv.end);
  for (const Interval& iv : comm) bins.add(ActivityBins::kComm, iv.start, iv.end);
  overlap(compute, comm, 0, &bins);
}

ActivityBins RankTimeline::activity() const {
  ActivityBins bins = bins_;
  add_to(bins, compute_.copy(), comm_.copy());
  return bins;
}

void RankTimeline::summarize(RankSummary& s) const {
  const std::vector<Interval> compute = compute_.copy(), comm = comm_.copy();
  const double compute_us = length(compute, compute_us_);
  const double comm_us = length(comm, comm_us_);
  const double both_us = overlap(compute, comm, both_us_);
  s.compute_us = compute_us;
  s.comm_us = comm_us;
  s.comm_wait_us = wait_us_;
  s.exposed_comm_us = comm_us - both_us;
  if (s.end_us == 0) s.end_us = last_end_us_;
  s.idle_us = std::max(0.0, s.end_us - (compute_us + comm_us - both_us));
}

}  // namespace ranklab
