#include "common/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

namespace ranklab {

namespace {
// Ten updates a second reads as smooth and keeps the cost of printing far below the work's.
constexpr std::chrono::milliseconds kInterval{100};
// The Progress whose line is on the terminal now.
std::atomic<Progress*> shown_progress{nullptr};
}  // namespace

std::string progress_line(const std::string& label, std::int64_t done, std::int64_t total,
                          const std::string& detail) {
  std::string line =
      total > 0 ? fmt::format("[{}] {}/{}", label, done, total) : fmt::format("[{}] {}", label, done);
  if (!detail.empty()) line += " " + detail;
  return line;
}

Progress::Progress(std::string label, std::int64_t total, std::FILE* out)
    : Progress(std::move(label), total, out, on_terminal(out)) {}

bool Progress::on_terminal(std::FILE* out) {
  return out != nullptr && isatty(fileno(out)) == 1;
}

Progress::Progress(std::string label, std::int64_t total, std::FILE* out, bool enabled)
    : label_(std::move(label)), total_(total), out_(out), enabled_(enabled && out != nullptr) {
  // The first update waits one interval too: work that ends quickly never prints at all.
  next_ = std::chrono::steady_clock::now() + kInterval;
}

Progress::~Progress() {
  finish();
}

void Progress::update(std::int64_t done, const std::string& detail) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  // The last unit always prints, so a known total ends on "n/n" rather than wherever the clock left it.
  if (now < next_ && !(total_ > 0 && done >= total_ && shown_)) return;
  next_ = now + kInterval;
  total_ = total_ > 0 ? std::max(total_, done) : total_;
  const std::string line = progress_line(label_, done, total_, detail);
  // Pad with blanks over whatever a longer earlier line left behind.
  const std::size_t pad = width_ > line.size() ? width_ - line.size() : 0;
  width_ = std::max(width_, line.size());
  std::fprintf(out_, "\r%s%*s", line.c_str(), static_cast<int>(pad), "");
  std::fflush(out_);
  shown_ = true;
  shown_progress.store(this);
}

void Progress::finish() {
  Progress* self = this;
  shown_progress.compare_exchange_strong(self, nullptr);
  if (!shown_) return;
  std::fprintf(out_, "\r%*s\r", static_cast<int>(width_), "");
  std::fflush(out_);
  shown_ = false;
  width_ = 0;
}

void Progress::erase_shown() {
  if (Progress* p = shown_progress.exchange(nullptr)) p->finish();
}

}  // namespace ranklab
