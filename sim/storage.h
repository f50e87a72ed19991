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

class SimStorage : public Storage {
 public:
  // numel floats, or none for a phantom; the account is charged numel elements of `dtype` (the
  // simulator holds 16-bit values as floats, but the device holds them in 2 bytes).
  SimStorage(std::shared_ptr<MemoryAccount> account, std::int64_t numel, DType dtype, bool phantom);
  ~SimStorage() override;

  bool phantom() const override { return data_ == nullptr; }
  float* data() { return data_.get(); }

  // Communication posted on this buffer that has not been executed, or (when async) not yet waited on.
  // Compute on the buffer must wait for the first kind and is an error for the second.
  std::vector<std::shared_ptr<CommOpState>> pending;
  // Per entry of `pending`: the operation only reads this buffer (a send, an out-of-place input), so
  // another operation that only reads it may run beside it.
  std::vector<bool> pending_reads_only;

 private:
  std::shared_ptr<MemoryAccount> account_;
  std::unique_ptr<float[]> data_;
  std::int64_t host_bytes_ = 0;
};

inline SimStorage* sim_storage(const Tensor& t) {
  return static_cast<SimStorage*>(t.storage());
}
inline float* sim_data(const Tensor& t) {
  return sim_storage(t)->data();
}

}  // namespace ranklab::sim
