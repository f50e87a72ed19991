// A training step timed as the lecture times it, for every lesson that trains: synchronize() then barrier()
// before reading the clock (so each rank starts when its own device is done and the hosts have met), the
// step's phases as regions of the report's timeline (which `ranklab compare` matches by name), and
// synchronize() again before reading it at the end.
//
//   TimedStep step(r);
//   step.phase("forward");  ...
//   step.phase("backward"); ...
//   step.end_phase();
//   const double step_us = step.finish();
#pragma once

#include <optional>
#include <string>

#include "common/rank.h"

namespace ranklab {

class TimedStep {
 public:
  explicit TimedStep(Rank& r) : r_(r) {
    r.synchronize();  // synchronize, then barrier: the other order would start the clock too early
    r.barrier();
    start_us_ = r.now();
  }
  // Closes the open phase, if any, and opens `name`. An exception (running out of memory) closes it too.
  void phase(std::string name) {
    phase_.reset();
    phase_.emplace(&r_, std::move(name));
  }
  void end_phase() { phase_.reset(); }
  double start_us() const { return start_us_; }
  // The host's time since the start: how long launching the step's kernels has taken it so far.
  double host_us() { return r_.now() - start_us_; }
  // Closes the open phase, waits for the device and returns the step's time.
  double finish() {
    phase_.reset();
    r_.synchronize();
    return r_.now() - start_us_;
  }

 private:
  Rank& r_;
  double start_us_ = 0;
  std::optional<Rank::Region> phase_;
};

}  // namespace ranklab
