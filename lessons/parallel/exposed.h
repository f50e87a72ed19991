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
//
// A step of thousands of micro-batches issues millions of operations and waits: those already ended are
// folded into the totals as the step goes (Work::elapsed_us_if_ended and Rank::elapsed_us_if_ended, which
// wait for nothing), so what is kept does not grow with the step.
#pragma once

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "common/rank.h"

namespace ranklab::parallel {

enum class Dim { Tp, Sp, Cp, Pp, Dp, Ep };
inline constexpr int kDims = 6;
inline constexpr const char* kDimNames[kDims] = {"tp", "sp", "cp", "pp", "dp", "ep"};

class ExposedComm {
 public:
  explicit ExposedComm(Rank& r) : r_(r) {}
  // Only the timed step records events.
  void enable(bool on) {
    on_ = on;
    waits_.clear();
    works_.clear();
    ended_ = {};
    waited_ = {};
    fold_at_ = fold_waits_at_ = kFoldAtLeast;
  }
  Event before() { return on_ ? r_.record_event() : Event(); }
  void after(Dim d, const Event& start) {
    if (!on_) return;
    waits_.push_back({d, start, r_.record_event()});
    if (waits_.size() >= fold_waits_at_) fold_waits();
  }
  // An operation of dimension `d` (synchronous or not), for the time communicated.
  void communicated(Dim d, const Work& w) {
    if (on_) communicated(d, std::vector<Work>{w});
  }
  // Operations posted together (batch_isend_irecv), which run at once: the longest of them.
  void communicated(Dim d, const std::vector<Work>& together) {
    if (!on_) return;
    works_.push_back({d, together});
    if (works_.size() >= fold_at_) fold_ended();
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
  // Operations recorded and not folded into the totals yet.
  std::size_t kept() const { return works_.size() + waits_.size(); }
  // Microseconds per dimension; the host waits for the last event.
  std::array<double, kDims> totals() {
    std::array<double, kDims> t = waited_;
    for (const Wait& w : waits_) t[static_cast<int>(w.dim)] += r_.elapsed_us(w.start, w.end);
    return t;
  }
  // Microseconds per dimension that its operations took; the host waits for the last of them.
  std::array<double, kDims> communicated_totals() {
    std::array<double, kDims> t = ended_;
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
  // Moves the operations that have ended into ended_, and the waits whose end the device has passed into
  // waited_; the next fold comes when as many again are kept, so folding costs a constant per record.
  void fold_ended() {
    std::erase_if(works_, [&](Timed& w) {
      double longest = 0;
      for (Work& one : w.works) {
        const std::optional<double> us = one.elapsed_us_if_ended();
        if (!us) return false;
        longest = std::max(longest, *us);
      }
      ended_[static_cast<int>(w.dim)] += longest;
      return true;
    });
    fold_at_ = std::max(kFoldAtLeast, 2 * works_.size());
  }
  void fold_waits() {
    std::erase_if(waits_, [&](const Wait& w) {
      const std::optional<double> us = r_.elapsed_us_if_ended(w.start, w.end);
      if (us) waited_[static_cast<int>(w.dim)] += *us;
      return us.has_value();
    });
    fold_waits_at_ = std::max(kFoldAtLeast, 2 * waits_.size());
  }

  static constexpr std::size_t kFoldAtLeast = 1024;
  Rank& r_;
  bool on_ = false;
  std::vector<Wait> waits_;
  std::vector<Timed> works_;            // not folded yet
  std::array<double, kDims> ended_{};   // the time of those folded, per dimension
  std::array<double, kDims> waited_{};  // the waits folded, per dimension
  std::size_t fold_at_ = kFoldAtLeast, fold_waits_at_ = kFoldAtLeast;
};

// A tensor to receive into: empty, or phantom in a phantom run.
inline Tensor buffer(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.empty(s, dtype);
}
inline Tensor zeros(Rank& r, bool phantom, const Shape& s, DType dtype) {
  return phantom ? r.phantom(s, dtype) : r.zeros(s, dtype);
}

}  // namespace ranklab::parallel
