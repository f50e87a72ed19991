#include "real/cuda_check.h"

#include <fmt/format.h>

#include "common/errors.h"

namespace ranklab {

namespace {
thread_local int t_rank = -1;
thread_local int t_device = -1;

// "cudaMemcpyAsync" from "cudaMemcpyAsync(dst, src, ...)": the call's name, not its arguments.
std::string call_name(const char* call) {
  std::string s(call);
  const size_t paren = s.find('(');
  return paren == std::string::npos ? s : s.substr(0, paren);
}
}  // namespace

void set_error_context(int rank, int device) {
  t_rank = rank;
  t_device = device;
}

std::string error_where() {
  if (t_rank < 0) return "ranklab";
  return fmt::format("rank {} (GPU {})", t_rank, t_device);
}

int cublas_dim(std::int64_t n, const char* what) {
  if (n > 2147483647) {
    throw UsageError(fmt::format("matmul: {} = {} is beyond what cuBLAS takes (2^31 - 1)", what, n));
  }
  return static_cast<int>(n);
}

void throw_cuda_error(cudaError_t e, const char* call) {
  throw BackendError(fmt::format("{}: {} failed: {} ({})", error_where(), call_name(call),
                                 cudaGetErrorString(e), cudaGetErrorName(e)));
}

void throw_cublas_error(cublasStatus_t s, const char* call) {
  throw BackendError(fmt::format("{}: {} failed: {} ({})", error_where(), call_name(call),
                                 cublasGetStatusString(s), cublasGetStatusName(s)));
}

void throw_nccl_error(ncclResult_t r, const char* call, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  throw BackendError(fmt::format("{}: {} failed: {}{}{}", error_where(), call_name(call),
                                 ncclGetErrorString(r), last && *last ? ": " : "", last ? last : ""));
}

double elapsed_us_completed(cudaEvent_t start, cudaEvent_t end) {
  float ms = 0;
  RANKLAB_CUDA(cudaEventElapsedTime(&ms, start, end));
  return 1000.0 * static_cast<double>(ms);
}

std::optional<double> elapsed_us_if_reached(cudaEvent_t start, cudaEvent_t end) {
  const cudaError_t reached = cudaEventQuery(end);
  if (reached == cudaErrorNotReady) return std::nullopt;
  RANKLAB_CUDA(reached);
  return elapsed_us_completed(start, end);
}

}  // namespace ranklab
