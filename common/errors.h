// The errors a run can end with. Each message names what was wrong and where (rank, operation, shape,
// file and line) so the user can act on it without a debugger.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace ranklab {

// Base of every error ranklab raises on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments: an invalid world size, rank, root, group, shape or option.
class UsageError : public Error {
 public:
  using Error::Error;
};

// An allocation that would take a rank past its device's memory capacity.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// Ranks that disagree on a collective (operation, size, dtype, root, reduce op or group).
class MismatchError : public Error {
 public:
  using Error::Error;
};

// Every rank is waiting and nothing can wake any of them; the message lists each rank's pending operation.
class DeadlockError : public Error {
 public:
  using Error::Error;
};

// A profile file that cannot be used; the message names the file and line.
class ProfileError : public Error {
 public:
  using Error::Error;
};

// A lesson's own numerical check failed.
class CheckFailedError : public Error {
 public:
  using Error::Error;
};

// An exception a rank's program threw that ranklab did not raise (a std::exception of the program's own,
// or something that is not a std::exception at all); the message names the lesson, the rank and what was
// thrown.
class ProgramError : public Error {
 public:
  using Error::Error;
};

// Inside a catch block: the exception being handled, as the error a run ends with. One of ranklab's own
// (an Error) is kept as it is; anything else, a std::exception of the program's own or a thrown value that
// is not an exception at all, becomes a ProgramError naming the rank and the type ("rank 3 threw
// std::out_of_range: index 7"). Both backends call it where a rank's program ends.
std::exception_ptr current_error_of_rank(int rank);

// A backend failure (CUDA, cuBLAS, NCCL) naming the call, the error string, the rank and the device.
class BackendError : public Error {
 public:
  using Error::Error;
};

}  // namespace ranklab
