// Exposed communication: the time a rank's compute stream stood still waiting for communication, per
// parallel dimension.
//
// A synchronous collective, or wait() on an asynchronous one, makes the compute stream wait until the
// communication has finished. An event recorded on the compute stream just before the call and another
// just after it complete at the moments the stream reached the call and got past it; the difference is
// the wait, whatever its cause: the transfer itself, or the other members arriving late (for pipeline
// receives, that includes the bubble). Communication hidden under compute costs nothing here, which is
// the point. The events are read once, after the step, so timing never makes the host wait mid-step.
//
// Beside it, the time each dimension communicated: every operation's own time on its stream
// (Work::elapsed_us), summed. What it communicated and did not expose was hidden under compute (or under
// other communication); for pipeline receives the exposed time also holds the bubble, so less shows as
// hidden there than was.
#pragma once

#include <algorithm>
#include <array>
#include <vector>

#include "common/rank.h"

namespace ranklab::parallel {

enum class Dim { Tp, Sp, Pp, Dp };
inline constexpr int kDims = 4;
inline constexpr const char* kDimNames[kDims] = {"tp", "sp", "pp", "dp"};

class ExposedComm {
 public:
  explicit ExposedComm(Rank& r) : r_(r) {}
  // Only the timed step records events.
  void enable(bool on) {
    on_ = on;
    waits_.clear();
    works_.clear();
  }
  Event before() { return on_ ? r_.record_event() : Event(); }
  void after(Dim d, const Event& start) {
    if (on_) waits_.push_back({d, start, r_.record_event()});
  }
  // An operation of dimension `d` (synchronous or not), for the time communicated.
  void communicated(Dim d, const Work& w) {
    if (on_) works_.push_back({d, {w}});
  }
  // Operations posted together (batch_isend_irecv), which run at once: the longest of them.
  void communicated(Dim d, const std::vector<Work>& together) {
    if (on_) works_.push_back({d, together});
  }
  // The compute stream waits for `w`, counted as dimension `d`'s exposed time.
  void wait(Dim d, Work& w) {
    const Event e = before();
    w.wait();
    after(d, e);
  }
  // The wait on a synchronous operation `w` whose call began after `start`.
  void after(Dim d, const Event& start, const Work& w) {
    after(d, start);
    communicated(d, w);
  }
  // Microseconds per dimension; the host waits for the last event.
  std::array<double, kDims> totals() {
    std::array<double, kDims> t{};
    for (const Wait& w : waits_) t[static_cast<int>(w.dim)] += r_.elapsed_us(w.start, w.end);
    return t;
  }
  // Microseconds per dimension that its operations took; the host waits for the last of them.
  std::array<double, kDims> communicated_totals() {
    std::array<double, kDims> t{};
    for (Timed& w : works_) {
      double longest = 0;
      for (Work& one : w.works) longest = std::max(longest, one.elapsed_us());
      t[static_cast<int>(w.dim)] += longest;
    }
    return t;
  }

 private:
  struct Wait {
    Dim dim;
    Event start, end;
  };
  struct Timed {
    Dim dim;
    std::vector<Work> works;
  };
  Rank& r_;
  bool on_ = false;
  std::vector<Wait> waits_;
  std::vector<Timed> works_;
};

// A tensor to receive into: empty, or phantom in a phantom run.
inline Tensor buffer(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.empty(s, dtype);
}
inline Tensor zeros(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.zeros(s, dtype);
}

}  // namespace ranklab::parallel
