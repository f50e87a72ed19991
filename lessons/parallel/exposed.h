// Exposed communication: the time a rank's compute stream stood still waiting for communication, per
// parallel dimension.
//
// A synchronous collective, or wait() on an asynchronous one, makes the compute stream wait until the
// communication has finished. An event recorded on the compute stream just before the call and another
// just after it complete at the moments the stream reached the call and got past it; the difference is
// the wait, whatever its cause: the transfer itself, or the other members arriving late (for pipeline
// receives, that includes the bubble). Communication hidden under compute costs nothing here, which is
// the point. The events are read once, after the step, so timing never makes the host wait mid-step.
#pragma once

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
  }
  Event before() { return on_ ? r_.record_event() : Event(); }
  void after(Dim d, const Event& start) {
    if (on_) waits_.push_back({d, start, r_.record_event()});
  }
  // Microseconds per dimension; the host waits for the last event.
  std::array<double, kDims> totals() {
    std::array<double, kDims> t{};
    for (const Wait& w : waits_) t[static_cast<int>(w.dim)] += r_.elapsed_us(w.start, w.end);
    return t;
  }

 private:
  struct Wait {
    Dim dim;
    Event start, end;
  };
  Rank& r_;
  bool on_ = false;
  std::vector<Wait> waits_;
};

// A tensor to receive into: empty, or phantom in a phantom run.
inline Tensor buffer(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.empty(s, dtype);
}
inline Tensor zeros(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.zeros(s, dtype);
}

}  // namespace ranklab::parallel
