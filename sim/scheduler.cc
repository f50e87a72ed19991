#include "sim/scheduler.h"

#include "sim/rank_faults.h"

namespace ranklab::sim {

namespace {
thread_local VirtualTimeScheduler* installed = nullptr;
}

VirtualTimeScheduler::VirtualTimeScheduler() {
  installed = this;
}
VirtualTimeScheduler::~VirtualTimeScheduler() {
  if (installed == this) installed = nullptr;
}

VirtualTimeScheduler* VirtualTimeScheduler::current() {
  return installed;
}

void VirtualTimeProps::requeue(int new_rank, double new_time_us) {
  rank = new_rank;
  time_us = new_time_us;
  if (installed) installed->property_change(ctx_, *this);
}

void VirtualTimeScheduler::sift_up(std::size_t i) {
  const Entry e = ready_[i];
  while (i > 0) {
    const std::size_t parent = (i - 1) / 2;
    if (!before(e, ready_[parent])) break;
    place(i, ready_[parent]);
    i = parent;
  }
  place(i, e);
}

void VirtualTimeScheduler::sift_down(std::size_t i) {
  const Entry e = ready_[i];
  const std::size_t n = ready_.size();
  for (;;) {
    std::size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && before(ready_[child + 1], ready_[child])) ++child;
    if (!before(ready_[child], e)) break;
    place(i, ready_[child]);
    i = child;
  }
  place(i, e);
}

void VirtualTimeScheduler::awakened(boost::fibers::context* ctx, VirtualTimeProps& props) noexcept {
  if (props.slot_ == VirtualTimeProps::kNoSlot) {
    props.slot_ = static_cast<std::uint32_t>(heap_place_.size());
    heap_place_.push_back(kNotQueued);
  }
  props.arrival_ = next_arrival_++;
  ready_.push_back(Entry{props.time_us, props.arrival_, ctx, props.stack_hint, props.rank, props.slot_});
  heap_place_[props.slot_] = ready_.size() - 1;
  sift_up(ready_.size() - 1);
}

void VirtualTimeScheduler::prefetch_next() const {
  if (ready_.empty()) return;
  const Entry& next = ready_.front();
  // Boost keeps a fiber's context at the top of its stack: the part resume() reads.
  const char* ctx = reinterpret_cast<const char*>(next.ctx);
  for (int line = 0; line < 4; ++line) __builtin_prefetch(ctx + 64 * line);
  // The frames around where the fiber suspended: the switch restores its registers from below the hint,
  // and the calls it returns through lie above it.
  if (next.stack_hint != nullptr) {
    const char* hint = static_cast<const char*>(next.stack_hint);
    for (int offset = -1024; offset < 1024; offset += 64) __builtin_prefetch(hint + offset);
  }
}

boost::fibers::context* VirtualTimeScheduler::pick_next() noexcept {
  if (ready_.empty()) return nullptr;
  const Entry top = ready_.front();
  heap_place_[top.slot] = kNotQueued;
  const Entry last = ready_.back();
  ready_.pop_back();
  if (!ready_.empty()) {
    ready_.front() = last;
    sift_down(0);
  }
  prefetch_next();
  set_running_rank(top.rank);
  return top.ctx;
}

void VirtualTimeScheduler::property_change(boost::fibers::context*, VirtualTimeProps& props) noexcept {
  // A queued fiber whose clock changed must move to its new place; a running one is placed on its
  // next awakening.
  if (props.slot_ == VirtualTimeProps::kNoSlot) return;
  const std::size_t i = heap_place_[props.slot_];
  if (i == kNotQueued) return;
  Entry& e = ready_[i];
  const Entry old = e;
  e.time_us = props.time_us;
  e.rank = props.rank;
  if (before(e, old)) {
    sift_up(i);
  } else {
    sift_down(i);
  }
}

double VirtualTimeScheduler::min_ready_time_us() const {
  return ready_.empty() ? std::numeric_limits<double>::infinity() : ready_.front().time_us;
}

// The simulator runs every fiber on one thread and detects deadlock itself, so this waits only for the
// rare wake-up from Boost's own machinery (as its round_robin algorithm does).
void VirtualTimeScheduler::suspend_until(std::chrono::steady_clock::time_point const& when) noexcept {
  std::unique_lock<std::mutex> lk(mutex_);
  if (when == std::chrono::steady_clock::time_point::max()) {
    wakeup_.wait(lk, [this] { return flag_; });
  } else {
    wakeup_.wait_until(lk, when, [this] { return flag_; });
  }
  flag_ = false;
}

void VirtualTimeScheduler::notify() noexcept {
  std::unique_lock<std::mutex> lk(mutex_);
  flag_ = true;
  lk.unlock();
  wakeup_.notify_all();
}

}  // namespace ranklab::sim
