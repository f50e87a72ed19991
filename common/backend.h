// Backend: the SPMD spawn of the lecture. launch() runs `fn` once per rank and returns what happened.
#pragma once

#include <functional>
#include <string>

#include "common/rank.h"
#include "common/report.h"

namespace ranklab {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Runs fn on `world` ranks. Errors in any rank end the run: the first error is rethrown after every
  // rank has unwound. The report is returned even when a lesson's check failed (see all_checks_passed).
  virtual RunReport launch(int world, const std::function<void(Rank&)>& fn) = 0;
  // Whether this process holds the whole report. Under mpirun each process runs one rank and only one
  // of them assembles the report; the others print and write nothing.
  virtual bool owns_report() const { return true; }
};

}  // namespace ranklab
