// A lesson's figures gathered across ranks as named structs, not as float vectors read by position.
//
// A figures struct holds only floats (a rank's step time, its exposed communication, its worst
// difference): it travels as the float32 tensor of its members, in one collective, so the lesson's
// printout reads `all[rank].step_us`, not `v[i * stride + 3]`.
//
//   struct Figures { float step_us, exposed_us, worst; };
//   std::vector<Figures> all = gather_figures(r, Figures{...});   // on rank 0; empty on the others
//   Figures most = reduce_figures(r, mine, ReduceOp::Max);         // on every rank
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "common/rank.h"

namespace ranklab {

namespace figures_detail {
template <class F>
constexpr std::int64_t floats_in() {
  static_assert(std::is_trivially_copyable_v<F> && sizeof(F) % sizeof(float) == 0,
                "a figures struct holds floats only");
  return static_cast<std::int64_t>(sizeof(F) / sizeof(float));
}
template <class F>
std::vector<float> as_floats(const std::vector<F>& figures) {
  std::vector<float> out(figures.size() * floats_in<F>());
  if (!out.empty()) std::memcpy(out.data(), figures.data(), out.size() * sizeof(float));
  return out;
}
template <class F>
std::vector<F> from_floats(const std::vector<float>& floats) {
  std::vector<F> out(floats.size() / floats_in<F>());
  if (!out.empty()) std::memcpy(out.data(), floats.data(), out.size() * sizeof(F));
  return out;
}
}  // namespace figures_detail

// Every rank's `mine`, in rank order, on rank 0 (one gather); empty on the other ranks. It is real
// communication: lessons call it after their timed steps.
template <class F>
std::vector<F> gather_figures(Rank& r, const F& mine) {
  return gather_figures(r, std::vector<F>{mine});
}
// The same for a rank's several figures (one per stage or per layout): rank k's are at [k * n, (k + 1) n).
template <class F>
std::vector<F> gather_figures(Rank& r, const std::vector<F>& mine) {
  const std::vector<float> in = figures_detail::as_floats(mine);
  const auto n = static_cast<std::int64_t>(in.size());
  // Only rank 0 receives, so only rank 0 holds W x n: the other ranks' memory does not grow with the world.
  const bool root = r.rank() == 0;
  Tensor out = root ? r.zeros({n * r.world_size()}) : Tensor();
  r.gather(out, r.from_host({n}, in), 0);
  if (!root) return {};
  return figures_detail::from_floats<F>(r.to_host(out));
}

// Each member combined over every rank with `op` (Sum, Max, ...), on every rank (one all_reduce).
template <class F>
F reduce_figures(Rank& r, const F& mine, ReduceOp op, Group group = {}) {
  Tensor t = r.from_host({figures_detail::floats_in<F>()}, figures_detail::as_floats(std::vector<F>{mine}));
  r.all_reduce(t, op, Async::No, group);
  return figures_detail::from_floats<F>(r.to_host(t)).front();
}

}  // namespace ranklab
