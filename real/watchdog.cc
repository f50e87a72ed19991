#include "real/watchdog.h"

#include <fmt/format.h>

#include <thread>

#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/host_comm.h"

namespace ranklab {

CudaEvent::CudaEvent(bool timing) {
  RANKLAB_CUDA(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

CudaEvent::~CudaEvent() {
  // Destroying an event that is still pending is allowed: CUDA releases it once it completes.
  if (event_) cudaEventDestroy(event_);
}

Watchdog::Watchdog(double timeout_s, const std::atomic<bool>* abort_flag)
    : timeout_s_(timeout_s), abort_flag_(abort_flag) {}

void Watchdog::check_abort() const {
  if (abort_flag_ && abort_flag_->load(std::memory_order_relaxed)) {
    throw RunAborted(fmt::format("{}: stopped because another rank failed", error_where()));
  }
}

void Watchdog::track(std::string what, std::shared_ptr<CudaEvent> done) {
  // Forget what has finished, so the queue holds only what is really in flight.
  while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().done->get()) == cudaSuccess) {
    in_flight_.pop_front();
  }
  in_flight_.push_back(InFlight{std::move(what), std::move(done), Clock::now()});
}

std::string Watchdog::oldest_unfinished() {
  while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().done->get()) == cudaSuccess) {
    in_flight_.pop_front();
  }
  if (in_flight_.empty()) return "";
  const InFlight& f = in_flight_.front();
  const double age_s = std::chrono::duration<double>(Clock::now() - f.issued).count();
  return fmt::format("{}, issued {:.0f} s ago", f.what, age_s);
}

void Watchdog::poll(const std::string& why, Clock::time_point started, long iteration) {
  check_abort();
  const Clock::time_point now = Clock::now();
  // NCCL's asynchronous errors (a peer process died, a network error) are checked every millisecond.
  if (now - last_error_check_ > std::chrono::milliseconds(1)) {
    last_error_check_ = now;
    for (ncclComm_t comm : comms_) {
      ncclResult_t state = ncclSuccess;
      RANKLAB_NCCL(ncclCommGetAsyncError(comm, &state), comm);
      if (state != ncclSuccess && state != ncclInProgress) {
        throw_nccl_error(state, "ncclCommGetAsyncError (an asynchronous NCCL error)", comm);
      }
    }
  }
  const double waited_s = std::chrono::duration<double>(now - started).count();
  if (waited_s > timeout_s_) {
    std::string oldest = oldest_unfinished();
    throw BackendError(fmt::format(
        "{}: {} waited {:.0f} s for the GPU (the watchdog's limit).{} A collective that some member never "
        "calls, or calls with other arguments, never finishes: check that every rank of the group makes the "
        "same calls in the same order. The communicators were aborted",
        error_where(), why, waited_s,
        oldest.empty() ? "" : fmt::format(" The oldest unfinished operation is {}.", oldest)));
  }
  // Spin politely for short waits, which is what timings need; sleep for long ones.
  if (waited_s < 1.0 || iteration < 1000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Watchdog::wait_event(cudaEvent_t event, const std::string& why) {
  const Clock::time_point started = Clock::now();
  for (long i = 0;; ++i) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) throw_cuda_error(e, "cudaEventQuery");
    poll(why, started, i);
  }
}

void Watchdog::settle(ncclComm_t comm, const std::string& what) {
  const Clock::time_point started = Clock::now();
  for (long i = 0;; ++i) {
    ncclResult_t state = ncclSuccess;
    RANKLAB_NCCL(ncclCommGetAsyncError(comm, &state), comm);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) throw_nccl_error(state, what.c_str(), comm);
    poll(what, started, i);
  }
}

}  // namespace ranklab
