#include "real/device_memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/errors.h"
#include "real/cuda_check.h"

namespace ranklab {

DeviceAccount::DeviceAccount(int rank, int device, std::string device_label, cudaStream_t stream,
                             std::int64_t capacity_bytes)
    : rank_(rank),
      device_(device),
      device_label_(std::move(device_label)),
      stream_(stream),
      capacity_(capacity_bytes) {}

std::int64_t DeviceAccount::in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}

std::int64_t DeviceAccount::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void* DeviceAccount::allocate(const Shape& shape, DType dtype, const char* op) {
  const std::int64_t bytes = shape.numel() * dtype_bytes(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  // The simulator's words, with this device in place of the profile's.
  auto oom = [&](const std::string& why) {
    return OutOfMemoryError(
        fmt::format("rank {}: {}: out of memory allocating {}{} ({}): {} already in use of the {} of a {}{}",
                    rank_, op, dtype_name(dtype), shape.str(), format_bytes(static_cast<double>(bytes)),
                    format_bytes(static_cast<double>(in_use_)), format_bytes(static_cast<double>(capacity_)),
                    device_label_, why));
  };
  if (bytes > capacity_ - in_use_) throw oom("");
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  const cudaError_t e = cudaMallocAsync(&ptr, static_cast<size_t>(bytes), stream_);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so later calls do not report it
    throw oom(" (the device refused: CUDA, cuBLAS and NCCL keep some of its memory for themselves)");
  }
  cuda_check(e, "cudaMallocAsync");
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return ptr;
}

void DeviceAccount::release(void* ptr, std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= bytes;
  if (ptr == nullptr) return;
  // Destructors must not throw: a failed free is lost memory, reported by the next CUDA call that fails.
  if (open_) {
    cudaFreeAsync(ptr, stream_);
  } else {
    cudaSetDevice(device_);
    cudaFree(ptr);
  }
}

void DeviceAccount::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = in_use_;
}

void DeviceAccount::compute_waits_for(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_) RANKLAB_CUDA(cudaStreamWaitEvent(stream_, event, 0));
}

void DeviceAccount::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  open_ = false;
}

CudaStorage::CudaStorage(std::shared_ptr<DeviceAccount> account, const Shape& shape, DType dtype,
                         bool phantom, const char* op)
    : Storage(account->rank(), shape.numel() * dtype_bytes(dtype)),
      account_(std::move(account)),
      phantom_(phantom),
      end_(shape.numel()) {
  data_ = account_->allocate(shape, dtype, op);
}

CudaStorage::CudaStorage(const Tensor& base, std::int64_t offset, std::int64_t numel)
    : Storage(base.owner_rank(), numel * dtype_bytes(base.dtype())), phantom_(base.phantom()), base_(base) {
  const CudaStorage& b = *static_cast<const CudaStorage*>(base.storage());
  if (b.data_ != nullptr) data_ = static_cast<char*>(b.data_) + offset * dtype_bytes(base.dtype());
  root_ = b.root_;
  begin_ = b.begin_ + offset;
  end_ = begin_ + numel;
}

CudaStorage::~CudaStorage() {
  if (account_) account_->release(data_, bytes());
}

const AsyncOp* CudaStorage::unwaited() {
  std::erase_if(root_->pending_, [](const Use& u) { return u.op->waited; });
  for (const Use& u : root_->pending_) {
    if (u.begin < end_ && begin_ < u.end) return u.op.get();
  }
  return nullptr;
}

}  // namespace ranklab
