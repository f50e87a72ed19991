// Device tensors of the real backend and the memory account they are charged to.
//
// Allocation is stream-ordered (cudaMallocAsync / cudaFreeAsync on the compute stream) from the device's
// default memory pool, which keeps freed blocks for reuse. Why not cudaMalloc and cudaFree: cudaFree waits
// for the whole device, so a rank that drops a tensor while its collective waits for a peer would block
// its host, and a peer waiting for that host at a barrier would never arrive: a deadlock made by the
// allocator. Stream order is also what makes reuse safe: every use of a buffer, on either stream, is
// ordered before later work on the compute stream (see cuda_rank.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/rank.h"
#include "common/tensor.h"

namespace ranklab {

// One rank's bytes: what its live tensors hold against the device's capacity.
class DeviceAccount {
 public:
  // `device_label` names the device in messages ("NVIDIA H200 (GPU 0)").
  DeviceAccount(int rank, int device, std::string device_label, cudaStream_t stream,
                std::int64_t capacity_bytes);
  int rank() const { return rank_; }
  int device() const { return device_; }
  std::int64_t in_use() const;
  std::int64_t peak() const;
  std::int64_t capacity() const { return capacity_; }

  // Device memory for a tensor of `shape` (null for zero bytes). Past the capacity, or when the device
  // refuses, raises OutOfMemoryError in the simulator's words; `op` names the call that allocated.
  void* allocate(const Shape& shape, DType dtype, const char* op);
  void release(void* ptr, std::int64_t bytes);
  // Starts the peak over from what is in use now (Rank::reset_peak_memory).
  void reset_peak();
  // Makes the compute stream wait for `event` (an async Work's wait()); nothing once the run is over.
  void compute_waits_for(cudaEvent_t event);
  // The rank's streams are gone: later frees (a tensor that outlived its run) wait for the device.
  void close();

 private:
  int rank_;
  int device_;
  std::string device_label_;
  cudaStream_t stream_;
  std::int64_t capacity_;
  mutable std::mutex mutex_;
  std::int64_t in_use_ = 0;
  std::int64_t peak_ = 0;
  bool open_ = true;
};

// An asynchronous collective or point-to-point call, shared by its Work, the tensors it uses and the
// rank: until wait() on the Work (or synchronize()), touching those tensors is a UsageError, as in the
// simulator. Dropping the Work does not count as waiting.
struct AsyncOp {
  std::string label;  // the call's description, for the error
  bool waited = false;
};

// What an FP8 tensor's bytes stand for (common/tensor.h: its elements read as the values the stored codes
// times their scales give): per tensor, one float32 1 / scale; or per block of block_rows x block_cols over
// the allocation's rows of `cols` elements, each block's 1 / scale as float32, or as an E8M0 byte with
// `e8m0` (kernels::Fp8Blocks). Kept on the allocation, so its views read it; whatever writes FP8 bytes into
// the allocation (quantize, copy_, the collectives that move FP8) sets it.
struct Fp8Scales {
  int block_rows = 0, block_cols = 0;  // 0 x 0: per tensor
  bool e8m0 = false;
  std::int64_t cols = 0;  // the allocation's row length in elements (per block only)
  Tensor scale_inv;       // per tensor: float32 [1]; per block: the allocation's block scales
  bool per_tensor() const { return block_rows == 0; }
  // Blocks in one row of blocks, and a block scale's bytes.
  std::int64_t row_blocks() const { return per_tensor() ? 0 : (cols + block_cols - 1) / block_cols; }
  std::int64_t scale_bytes() const { return e8m0 ? 1 : 4; }
};

class CudaStorage : public Storage {
 public:
  CudaStorage(std::shared_ptr<DeviceAccount> account, const Shape& shape, DType dtype, bool phantom,
              const char* op);
  // A view (Rank::view): `numel` elements of `base` from its element `offset` on. Charged to no account; it
  // keeps `base` alive.
  CudaStorage(const Tensor& base, std::int64_t offset, std::int64_t numel);
  ~CudaStorage() override;
  bool phantom() const override { return phantom_; }
  void* data() const { return data_; }

  // Asynchronous calls are recorded on the allocation (a view's and its base's are one list), each with the
  // elements it uses.
  void add_pending(std::shared_ptr<AsyncOp> op) { root_->pending_.push_back({std::move(op), begin_, end_}); }
  // The first asynchronous call on this tensor's elements that has not been waited on, or null. Forgets the
  // calls waited on.
  const AsyncOp* unwaited();
  // Whether the two share any element.
  bool overlaps(const CudaStorage& o) const { return root_ == o.root_ && begin_ < o.end_ && o.begin_ < end_; }
  // Its first element's place in the allocation, and the allocation's elements.
  std::int64_t begin() const { return begin_; }
  std::int64_t allocation_elements() const { return root_->end_; }
  // An FP8 allocation's scales (null until FP8 bytes were written into it).
  const std::shared_ptr<Fp8Scales>& fp8_scales() const { return root_->fp8_; }
  void set_fp8_scales(std::shared_ptr<Fp8Scales> s) { root_->fp8_ = std::move(s); }

 private:
  struct Use {
    std::shared_ptr<AsyncOp> op;
    std::int64_t begin, end;
  };
  std::shared_ptr<DeviceAccount> account_;  // null for a view
  void* data_ = nullptr;
  bool phantom_;
  Tensor base_;                       // a view's base
  CudaStorage* root_ = this;          // the allocation: itself, or its base's root
  std::int64_t begin_ = 0, end_ = 0;  // its elements within root_
  std::vector<Use> pending_;          // the root's only
  std::shared_ptr<Fp8Scales> fp8_;    // the root's only
};

}  // namespace ranklab
