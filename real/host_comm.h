// HostComm: what the ranks of the real backend say to each other on the host, outside NCCL.
//
// NCCL moves tensors between GPUs; a few things must travel between the ranks' host threads instead: the
// NCCL unique id before any communicator exists, barrier() (a host rendezvous that, as the lecture
// stresses, does not wait for device work), show() gathering every rank's values to rank 0, and each
// rank's timings at the end of a run. Two implementations: threads of one process sharing memory (the
// thread-per-GPU launcher) and MPI (the process-per-GPU launcher under mpirun or srun).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"

namespace ranklab {

// Raised in a rank that was waiting when another rank failed: the run unwinds and the launcher reports
// the first rank's error, not this one.
class RunAborted : public Error {
 public:
  using Error::Error;
};

class HostComm {
 public:
  virtual ~HostComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank of the world calls this with the same group, in the same order (as Rank::new_group).
  virtual void add_group(int group_id, const std::vector<int>& ranks) = 0;
  // Returns once every member of group `group_id` (0 is the world) has arrived.
  virtual void barrier(int group_id) = 0;
  // Rank 0's `bytes` replace every other rank's.
  virtual void broadcast(std::string& bytes) = 0;
  // Every rank's string in rank order, on rank 0; an empty vector elsewhere.
  virtual std::vector<std::string> gather(const std::string& mine) = 0;
  // Every rank's string in rank order, on every rank.
  virtual std::vector<std::string> all_gather(const std::string& mine) = 0;
};

// The shared memory of the thread-per-GPU launcher: one per run, one ThreadHostComm per rank over it.
class ThreadHostWorld {
 public:
  explicit ThreadHostWorld(int size);
  int size() const { return size_; }
  // Wakes every waiting rank with RunAborted; later waits raise it at once.
  void abort();
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }
  // A flag the device-side waits of each rank poll, so a rank stuck on the GPU unwinds too.
  const std::atomic<bool>* abort_flag() const { return &aborted_; }

 private:
  friend class ThreadHostComm;
  struct Rendezvous {
    int members = 0;
    int arrived = 0;
    std::uint64_t generation = 0;
  };
  void arrive(int group_id, const char* what);

  int size_;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<int, Rendezvous> groups_;  // group 0 is the world
  std::vector<std::string> slots_;    // one per rank, for broadcast and gathers
};

class ThreadHostComm : public HostComm {
 public:
  ThreadHostComm(ThreadHostWorld* world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  void add_group(int group_id, const std::vector<int>& ranks) override;
  void barrier(int group_id) override;
  void broadcast(std::string& bytes) override;
  std::vector<std::string> gather(const std::string& mine) override;
  std::vector<std::string> all_gather(const std::string& mine) override;

 private:
  ThreadHostWorld* world_;
  int rank_;
};

// True when this build can talk MPI (the process-per-GPU launcher).
bool mpi_available();

// The MPI side of a job that mpirun or srun started. MPI is initialised on first use and finalised when
// the process exits; a process whose run failed aborts the job instead (MPI_Abort), so the other ranks do
// not wait for it until the watchdog fires.
class MpiHostComm : public HostComm {
 public:
  // The process's communicator; initialises MPI the first time. Raises BackendError without MPI.
  static MpiHostComm& instance();
  // Marks this process as failed: at exit it aborts the job rather than finalising MPI.
  static void mark_failed();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Position and count of the job's processes on this node (from MPI, not the environment).
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  const std::string& host() const { return host_; }
  void add_group(int group_id, const std::vector<int>& ranks) override;
  void barrier(int group_id) override;
  void broadcast(std::string& bytes) override;
  std::vector<std::string> gather(const std::string& mine) override;
  std::vector<std::string> all_gather(const std::string& mine) override;
  // Drops the sub-groups of a finished run (their ids are reused by the next one).
  void clear_groups();
  // Messages between two processes (`ranklab plan` across a job): send returns at once (the bytes are
  // copied and go out as the receiver takes them); poll returns a message from any rank if one has
  // arrived, never blocking; flush waits until every message sent has gone out.
  void send(int to, const std::string& bytes);
  std::optional<std::pair<int, std::string>> poll();
  void flush();

 private:
  MpiHostComm();
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  std::string host_;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// This machine's host name, for messages.
std::string host_name();

}  // namespace ranklab
