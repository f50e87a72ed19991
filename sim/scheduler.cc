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

void VirtualTimeScheduler::awakened(boost::fibers::context* ctx, VirtualTimeProps& props) noexcept {
  props.arrival_ = next_arrival_++;
  props.queued_ = true;
  props.queued_time_us_ = props.time_us;
  props.queued_rank_ = props.rank;
  ready_.insert(key_of(ctx, props));
}

boost::fibers::context* VirtualTimeScheduler::pick_next() noexcept {
  if (ready_.empty()) return nullptr;
  auto it = ready_.begin();
  boost::fibers::context* ctx = std::get<3>(*it);
  ready_.erase(it);
  properties(ctx).queued_ = false;
  set_running_rank(properties(ctx).rank);
  return ctx;
}

void VirtualTimeScheduler::property_change(boost::fibers::context* ctx, VirtualTimeProps& props) noexcept {
  // A queued fiber whose clock changed must move to its new place; a running one is placed on its
  // next awakening.
  if (!props.queued_) return;
  ready_.erase(Key{props.queued_time_us_, props.queued_rank_, props.arrival_, ctx});
  props.queued_time_us_ = props.time_us;
  props.queued_rank_ = props.rank;
  ready_.insert(key_of(ctx, props));
}

double VirtualTimeScheduler::min_ready_time_us() const {
  return ready_.empty() ? std::numeric_limits<double>::infinity() : std::get<0>(*ready_.begin());
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
