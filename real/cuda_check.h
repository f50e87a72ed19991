// Every CUDA, cuBLAS and NCCL call of the real backend goes through one of these checks, so a failure
// names the call, the library's error string, the rank and the device instead of surfacing later as a
// wrong number or a hang.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <optional>
#include <string>

namespace ranklab {

// The rank and device the calling thread serves; set once per rank thread, read by the messages.
void set_error_context(int rank, int device);
// "rank 1 (GPU 1)" for the calling thread, or "ranklab" outside any rank.
std::string error_where();

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call);
[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call);
[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* call, ncclComm_t comm);

// A GEMM's dimension or leading dimension as cuBLAS's int: a UsageError naming `what` past 2^31 - 1.
int cublas_dim(std::int64_t n, const char* what);

inline void cuda_check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw_cuda_error(e, call);
}
inline void cublas_check(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_cublas_error(s, call);
}
// Communicators are non-blocking (see nccl_comm.h): ncclInProgress is not a failure but a state to poll.
inline ncclResult_t nccl_check(ncclResult_t r, const char* call, ncclComm_t comm) {
  if (r != ncclSuccess && r != ncclInProgress) throw_nccl_error(r, call, comm);
  return r;
}

// Device time from `start` to `end` in microseconds (cudaEventElapsedTime), both completed.
double elapsed_us_completed(cudaEvent_t start, cudaEvent_t end);
// The same where `end` has completed (cudaEventQuery), waiting for nothing; nullopt while it has not.
// `start` was recorded before `end` on the same stream, so it has completed too.
std::optional<double> elapsed_us_if_reached(cudaEvent_t start, cudaEvent_t end);

}  // namespace ranklab

#define RANKLAB_CUDA(call) ::ranklab::cuda_check((call), #call)
#define RANKLAB_CUBLAS(call) ::ranklab::cublas_check((call), #call)
#define RANKLAB_NCCL(call, comm) ::ranklab::nccl_check((call), #call, (comm))
