// Progress: one line on stderr, rewritten in place, for work long enough that a silent terminal looks
// hung (sweeps, large simulated worlds, re-simulating a run to calibrate). It prints only when stderr is a
// terminal, so redirected output and CI logs stay clean, and at most ten times a second, so it costs
// nothing next to the work it reports on.
//
//   Progress p("sweep", sizes.size());
//   for (...) { ...; p.update(i + 1); }
//   // the destructor clears the line
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ranklab {

// "[label] done/total detail", or "[label] done detail" when the total is unknown (0).
std::string progress_line(const std::string& label, std::int64_t done, std::int64_t total,
                          const std::string& detail);

class Progress {
 public:
  // Shows progress on `out` when it is a terminal. `total` 0 means the amount of work is not known.
  explicit Progress(std::string label, std::int64_t total = 0, std::FILE* out = stderr);
  // As above, but shown or not as `enabled` says (tests, or a --progress flag; on_terminal(out) and a
  // condition of the caller's).
  Progress(std::string label, std::int64_t total, std::FILE* out, bool enabled);
  static bool on_terminal(std::FILE* out = stderr);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  bool enabled() const { return enabled_; }
  // Reports `done` units of work finished. Cheap when nothing is printed: one clock read.
  void update(std::int64_t done, const std::string& detail = "");
  // Clears the line (so the next output starts on a clean line); the destructor calls it too.
  void finish();
  // Clears the line of whichever Progress is showing one, if any, so that other output (a lesson's line,
  // an error) starts on a clean line instead of after it; its next update draws it again.
  static void erase_shown();

 private:
  std::string label_;
  std::int64_t total_;  // grows to `done` when the work turns out larger than said
  std::FILE* out_;
  bool enabled_;
  bool shown_ = false;
  std::size_t width_ = 0;  // of the longest line printed, to blank it out
  std::chrono::steady_clock::time_point next_;
};

}  // namespace ranklab
