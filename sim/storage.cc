#include "sim/storage.h"

namespace ranklab::sim {

SimStorage::SimStorage(std::shared_ptr<MemoryAccount> account, std::int64_t numel, DType dtype, bool phantom)
    : Storage(account->rank, numel * dtype_bytes(dtype)), account_(std::move(account)) {
  // Even an empty tensor gets a buffer, so that "no buffer" always means phantom.
  if (!phantom) {
    data_.reset(new float[numel > 0 ? numel : 1]);
    host_bytes_ = static_cast<std::int64_t>(sizeof(float)) * std::max<std::int64_t>(numel, 1);
    if (account_->host) account_->host->used += host_bytes_;
  }
  account_->allocated += bytes();
  account_->peak = std::max(account_->peak, account_->allocated);
}

SimStorage::~SimStorage() {
  account_->allocated -= bytes();
  if (account_->host) account_->host->used -= host_bytes_;
}

}  // namespace ranklab::sim
