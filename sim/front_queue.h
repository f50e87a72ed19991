// FrontQueue: a vector that items leave from the front, in amortized constant time per item.
//
// A rank that runs ahead of its operations holds a step's kernels, the posts behind them and the
// operations beside them in lists that the world consumes from the front as it times them. Erasing a
// prefix of a std::vector moves everything behind it, which at every event is quadratic in the list's
// length; a std::deque costs a node allocation and an indirection per rank even when empty, which thousands
// of ranks pay in cache misses. This keeps the items contiguous and moves them only once the consumed
// front is as long as what is left.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace ranklab::sim {

template <class T>
class FrontQueue {
 public:
  using iterator = typename std::vector<T>::iterator;
  using const_iterator = typename std::vector<T>::const_iterator;

  bool empty() const { return head_ == items_.size(); }
  std::size_t size() const { return items_.size() - head_; }
  T& operator[](std::size_t i) { return items_[head_ + i]; }
  const T& operator[](std::size_t i) const { return items_[head_ + i]; }
  T& front() { return items_[head_]; }
  const T& front() const { return items_[head_]; }
  iterator begin() { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  const_iterator end() const { return items_.end(); }

  void push_back(T item) { items_.push_back(std::move(item)); }

  // Drops the first n items. They are reset at once, so that what they hold is let go of now.
  void pop_front(std::size_t n) {
    for (std::size_t i = head_; i < head_ + n; ++i) items_[i] = T{};
    head_ += n;
    if (head_ == items_.size()) {
      items_.clear();
      head_ = 0;
    } else if (head_ >= 16 && 2 * head_ >= items_.size()) {
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

  // Drops every item for which pred holds, keeping the others in order.
  template <class Pred>
  void erase_if(Pred pred) {
    items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
    head_ = 0;
    std::erase_if(items_, pred);
  }

 private:
  std::vector<T> items_;
  std::size_t head_ = 0;  // items_[0, head_) have left
};

}  // namespace ranklab::sim
