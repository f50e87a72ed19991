// The watchdog: every host wait of the real backend polls instead of blocking, so a rank never hangs.
//
// On a GPU a collective that some member never joins does not fail: its kernel spins forever, and so
// does any host thread blocked on it. Every place the host waits for the device (synchronize, to_host,
// the end of a run) or for NCCL (a communicator being created, split or finalised) goes through here and
// checks, while it waits, three things: whether another rank failed (then unwind too), whether NCCL
// reports an asynchronous error (ncclCommGetAsyncError), and whether the wait has outlasted the timeout.
// The rank's launcher then aborts its communicators (ncclCommAbort), which ends their kernels.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace ranklab {

// A CUDA event owned by whoever holds the pointer (an async Work and the watchdog may share one). Not
// ranklab::Event, which is the lessons' handle on a point of the compute stream (common/rank.h).
class CudaEvent {
 public:
  explicit CudaEvent(bool timing);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // `abort_flag` is raised by the launcher when another rank failed; it may be null (one process, one rank).
  Watchdog(double timeout_s, const std::atomic<bool>* abort_flag);

  // The communicators whose asynchronous errors each wait checks.
  void watch(std::vector<ncclComm_t> comms) { comms_ = std::move(comms); }
  // An operation now queued on the device, named in the message if a wait times out behind it.
  void track(std::string what, std::shared_ptr<CudaEvent> done);
  // The host waits for `event`; `why` names the wait in errors ("synchronize()").
  void wait_event(cudaEvent_t event, const std::string& why);
  // Polls `comm` until it leaves ncclInProgress (a non-blocking communicator's call is finishing).
  void settle(ncclComm_t comm, const std::string& what);
  // Raises RunAborted when another rank has failed.
  void check_abort() const;

 private:
  // One round of a wait: raises on abort, NCCL errors or timeout, then yields or sleeps.
  void poll(const std::string& why, Clock::time_point started, long iteration);
  std::string oldest_unfinished();

  double timeout_s_;
  const std::atomic<bool>* abort_flag_;
  std::vector<ncclComm_t> comms_;
  Clock::time_point last_error_check_{};
  struct InFlight {
    std::string what;
    std::shared_ptr<CudaEvent> done;
    Clock::time_point issued;
  };
  std::deque<InFlight> in_flight_;
};

}  // namespace ranklab
