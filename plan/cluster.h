// `ranklab plan` across the processes of an MPI job (mpirun, srun): rank 0 enumerates, bounds and decides
// as one process does, and hands each simulation it would run to a free slot of any rank (`jobs` slots
// each, rank 0's own included), cheapest bound first; the others only simulate what they are given and
// send the figures back. Since rank 0 takes its decisions in the order of the bound whatever order the
// results come in (search.h), the plan does not depend on how many processes ran it.
//
// The messages are text: a task names its layout as the table does, a result carries the candidate and
// its figures as JSON (doubles printed to round-trip exactly), so rank 0's plan.json is the one a single
// process writes.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>

#include "plan/search.h"

namespace ranklab::plan {

// The processes of the job as the plan uses them. tools/ gives it MPI's (no MPI here: plan/ stays a
// library of the simulator).
class Messenger {
 public:
  virtual ~Messenger() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string host() const = 0;
  // Sends without waiting for the receiver; the bytes are copied.
  virtual void send(int to, const std::string& message) = 0;
  // A message from any rank, if one has arrived (its sender and bytes); never blocks.
  virtual std::optional<std::pair<int, std::string>> poll() = 0;
};

// What travels: a task for a worker, its result or the error it met, and rank 0's word to stop.
struct Message {
  enum class Kind { Task, Result, Error, Stop };
  Kind kind = Kind::Stop;
  std::size_t id = 0;
  // Task: the layout and how to simulate it.
  std::string layout;
  bool symmetry = true, extrapolate = false;
  std::optional<Cutoff> cutoff;
  // Result.
  std::optional<plan::Result> result;
  // Error: what the simulation threw, and where.
  std::string error, host;
};
std::string encode(const Message& m);
// ProgramError for text another ranklab did not write (a mismatched build), naming the sender.
Message decode(const std::string& text, int from);

}  // namespace ranklab::plan
