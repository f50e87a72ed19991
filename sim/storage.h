// SimStorage: a tensor's bytes in host memory, plus what the simulator must know about them: whose
// memory account they count against, and which communication still reads or writes them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/tensor.h"
#include "sim/host_memory.h"

namespace ranklab::sim {

struct CommOpState;

// One rank's device memory: bytes held by live tensors, their peak, and the device's capacity.
struct MemoryAccount {
  int rank = 0;
  std::int64_t allocated = 0;
  std::int64_t peak = 0;
  std::int64_t capacity = 0;
  // The host memory the numbers of every rank's real tensors take (the simulator holds them as floats).
  std::shared_ptr<HostMemory> host;
};

// Communication posted on a buffer that has not been executed, or (when async) not yet waited on: compute
// on the memory it uses must wait for the first kind and is an error for the second.
struct PendingUse {
  std::shared_ptr<CommOpState> op;
  // The operation only reads the memory (a send, an out-of-place input), so another operation that only
  // reads it may run beside it.
  bool reads_only = false;
  std::int64_t begin = 0, end = 0;  // the elements of the allocation it uses
};

class SimStorage : public Storage {
 public:
  // numel floats, or none for a phantom; the account is charged numel elements of `dtype` (the
  // simulator holds 16-bit values as floats, but the device holds them in 2 bytes).
  SimStorage(std::shared_ptr<MemoryAccount> account, std::int64_t numel, DType dtype, bool phantom);
  // A view (Rank::view): `numel` elements of `base` from its element `offset` on. Charged to no account;
  // it keeps `base` alive.
  SimStorage(const Tensor& base, std::int64_t offset, std::int64_t numel);
  ~SimStorage() override;

  bool phantom() const override { return phantom_; }
  float* data() { return data_; }

  // The communication in flight on the allocation this storage is part of (a view's and its base's are
  // one list), each with the elements it uses; `overlaps` says whether a use touches this storage's.
  std::vector<PendingUse>& uses() { return root_->uses_; }
  bool overlaps(const PendingUse& u) const { return u.begin < end_ && begin_ < u.end; }
  void add_use(std::shared_ptr<CommOpState> op, bool reads_only) {
    root_->uses_.push_back({std::move(op), reads_only, begin_, end_});
  }
  // Whether the two share any element.
  bool overlaps(const SimStorage& o) const { return root_ == o.root_ && begin_ < o.end_ && o.begin_ < end_; }

 private:
  std::shared_ptr<MemoryAccount> account_;  // null for a view
  std::unique_ptr<float[]> owned_;
  float* data_ = nullptr;
  bool phantom_ = false;
  std::int64_t host_bytes_ = 0;
  Tensor base_;                       // a view's base
  SimStorage* root_ = this;           // the allocation: itself, or its base's root
  std::int64_t begin_ = 0, end_ = 0;  // its elements within root_
  std::vector<PendingUse> uses_;      // the root's only
};

inline SimStorage* sim_storage(const Tensor& t) {
  return static_cast<SimStorage*>(t.storage());
}
inline float* sim_data(const Tensor& t) {
  return sim_storage(t)->data();
}

}  // namespace ranklab::sim
