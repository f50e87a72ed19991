#include "sim/storage.h"

namespace ranklab::sim {

SimStorage::SimStorage(std::shared_ptr<MemoryAccount> account, std::int64_t numel, DType dtype, bool phantom)
    : Storage(account->rank, numel * dtype_bytes(dtype)),
      account_(std::move(account)),
      phantom_(phantom),
      end_(numel) {
  // Even an empty tensor gets a buffer, so that "no buffer" always means phantom.
  if (!phantom) {
    owned_.reset(new float[numel > 0 ? numel : 1]);
    data_ = owned_.get();
    host_bytes_ = static_cast<std::int64_t>(sizeof(float)) * std::max<std::int64_t>(numel, 1);
    if (account_->host) account_->host->used += host_bytes_;
  }
  account_->allocated += bytes();
  account_->peak = std::max(account_->peak, account_->allocated);
}

SimStorage::SimStorage(const Tensor& base, std::int64_t offset, std::int64_t numel)
    : Storage(base.owner_rank(), numel * dtype_bytes(base.dtype())), phantom_(base.phantom()), base_(base) {
  SimStorage& b = *static_cast<SimStorage*>(base.storage());
  if (b.data_ != nullptr) data_ = b.data_ + offset;
  root_ = b.root_;
  begin_ = b.begin_ + offset;
  end_ = begin_ + numel;
}

SimStorage::~SimStorage() {
  if (!account_) return;
  account_->allocated -= bytes();
  if (account_->host) account_->host->used -= host_bytes_;
}

}  // namespace ranklab::sim
