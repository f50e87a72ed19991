// FlowHeap: the flows in flight ordered by a time each (when it ends, when it counts as done), earliest
// first, ties by flow id. (Any ids by a time each: the simulator keeps the ranks it must stop the engine
// for in one too, SimWorld::kernel_watches_.) A flow has at most one entry, which moves when its time
// changes: the transfer engine re-times thousands of flows whenever a sharing changes their rates, and a heap
// that took a new entry for each would spend most of its time passing over the superseded ones (a skewed
// all_to_all's flows end one by one, each end re-timing the rest).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ranklab::sim {

class FlowHeap {
 public:
  struct Entry {
    double at_us = 0;
    std::uint32_t flow = 0;
    bool before(const Entry& o) const { return at_us < o.at_us || (at_us == o.at_us && flow < o.flow); }
  };

  bool empty() const { return heap_.empty(); }
  std::size_t size() const { return heap_.size(); }
  const Entry& top() const { return heap_.front(); }
  bool contains(std::uint32_t flow) const { return flow < where_.size() && where_[flow] != kAbsent; }

  // Gives `flow` the time `at_us`, adding it when it has none.
  void set(std::uint32_t flow, double at_us) {
    if (!contains(flow)) {
      if (flow >= where_.size()) where_.resize(flow + 1, kAbsent);
      heap_.push_back({at_us, flow});
      where_[flow] = heap_.size() - 1;
      up(heap_.size() - 1);
      return;
    }
    const std::size_t at = where_[flow];
    const double was = heap_[at].at_us;
    heap_[at].at_us = at_us;
    at_us < was ? up(at) : down(at);
  }
  // Takes `flow`'s entry out, if it has one.
  void erase(std::uint32_t flow) {
    if (!contains(flow)) return;
    const std::size_t at = where_[flow];
    where_[flow] = kAbsent;
    if (at + 1 == heap_.size()) {
      heap_.pop_back();
      return;
    }
    const std::uint32_t moved = heap_.back().flow;
    heap_[at] = heap_.back();
    heap_.pop_back();
    where_[moved] = at;
    // The entry moved into the gap may belong above it or below it.
    up(at);
    if (where_[moved] == at) down(at);
  }
  // Takes the earliest entry out. The gap it leaves sinks along the earlier child to the bottom, and the
  // last entry, moved into it there, rises to its place: one comparison per level on the way down where
  // sifting the last entry down from the top takes two, and a last entry seldom rises far.
  void pop() {
    where_[heap_.front().flow] = kAbsent;
    const Entry last = heap_.back();
    heap_.pop_back();
    if (heap_.empty()) return;
    std::size_t at = 0;
    for (std::size_t child = earlier_child(at); child < heap_.size(); child = earlier_child(at)) {
      place(at, heap_[child]);
      at = child;
    }
    place(at, last);
    up(at);
  }

  // Sets many times at once: one by one when they are few against the heap, else in place and the heap
  // built again in one linear pass (a sharing that re-timed most flows in flight).
  void set_all(const std::vector<Entry>& times) {
    if (times.size() * 8 < heap_.size()) {
      for (const Entry& e : times) set(e.flow, e.at_us);
      return;
    }
    for (const Entry& e : times) {
      if (contains(e.flow)) {
        heap_[where_[e.flow]].at_us = e.at_us;
      } else {
        if (e.flow >= where_.size()) where_.resize(e.flow + 1, kAbsent);
        heap_.push_back(e);
        where_[e.flow] = heap_.size() - 1;
      }
    }
    rebuild();
  }
  // Takes out every entry due at or before `now_us`, in no particular order, passing each to `fn`: in one
  // pass over the heap when many are due, else popping them one by one.
  template <typename Fn>
  void take_due(double now_us, Fn&& fn) {
    std::size_t popped = 0;
    while (!heap_.empty() && heap_.front().at_us <= now_us) {
      if (++popped > 64 && popped > heap_.size() / 16) {
        std::size_t kept = 0;
        for (std::size_t i = 0; i < heap_.size(); ++i) {
          const Entry e = heap_[i];
          if (e.at_us <= now_us) {
            where_[e.flow] = kAbsent;
            fn(e);
          } else {
            heap_[kept++] = e;
          }
        }
        heap_.resize(kept);
        rebuild();
        return;
      }
      const Entry e = heap_.front();
      pop();
      fn(e);
    }
  }

 private:
  static constexpr std::size_t kAbsent = static_cast<std::size_t>(-1);

  void place(std::size_t at, const Entry& e) {
    heap_[at] = e;
    where_[e.flow] = at;
  }
  void up(std::size_t at) {
    const Entry e = heap_[at];
    while (at > 0) {
      const std::size_t parent = (at - 1) / 2;
      if (!e.before(heap_[parent])) break;
      place(at, heap_[parent]);
      at = parent;
    }
    place(at, e);
  }
  // The earlier of `at`'s children, or an index past the end when it has none.
  std::size_t earlier_child(std::size_t at) const {
    const std::size_t child = 2 * at + 1;
    return child + 1 < heap_.size() && heap_[child + 1].before(heap_[child]) ? child + 1 : child;
  }
  void down(std::size_t at) {
    const Entry e = heap_[at];
    while (true) {
      const std::size_t child = earlier_child(at);
      if (child >= heap_.size()) break;
      if (!heap_[child].before(e)) break;
      place(at, heap_[child]);
      at = child;
    }
    place(at, e);
  }
  void rebuild() {
    for (std::size_t i = 0; i < heap_.size(); ++i) where_[heap_[i].flow] = i;
    for (std::size_t i = heap_.size() / 2; i-- > 0;) down(i);
  }

  std::vector<Entry> heap_;
  std::vector<std::size_t> where_;  // per flow id: its index in heap_, or kAbsent
};

}  // namespace ranklab::sim
