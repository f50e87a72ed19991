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

#include <cstddef>
#include <cstdint>
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

// Every rank's `floats` (the same length on every rank), one after another in rank order, on rank 0 (one
// gather); empty on the other ranks. The tensor to send is made before the one to receive into, as
// mlp::gather_to_root makes them.
inline std::vector<float> gather_floats(Rank& r, const std::vector<float>& floats) {
  const auto n = static_cast<std::int64_t>(floats.size());
  Tensor in = r.from_host({n}, floats);
  // Only rank 0 receives, so only rank 0 holds W x n: the other ranks' memory does not grow with the world.
  const bool root = r.rank() == 0;
  Tensor out = root ? r.zeros({n * r.world_size()}) : Tensor();
  r.gather(out, in, 0);
  if (!root) return {};
  return r.to_host(out);
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
  return figures_detail::from_floats<F>(figures_detail::gather_floats(r, figures_detail::as_floats(mine)));
}

// A rank's figures and a list of floats after them (one per expert the rank holds, say), the list of the
// same length on every rank.
template <class F>
struct FiguresAndList {
  F figures;
  std::vector<float> list;
};
// Every rank's `mine` and `list`, in rank order, on rank 0, in the same one gather: rank k's members, then
// its list; empty on the other ranks.
template <class F>
std::vector<FiguresAndList<F>> gather_figures(Rank& r, const F& mine, const std::vector<float>& list) {
  std::vector<float> in = figures_detail::as_floats(std::vector<F>{mine});
  in.insert(in.end(), list.begin(), list.end());
  const std::vector<float> all = figures_detail::gather_floats(r, in);
  std::vector<FiguresAndList<F>> out;
  const auto n = static_cast<std::ptrdiff_t>(in.size());
  const auto members = static_cast<std::ptrdiff_t>(figures_detail::floats_in<F>());
  for (auto at = all.begin(); at != all.end(); at += n) {
    out.push_back({figures_detail::from_floats<F>(std::vector<float>(at, at + members)).front(),
                   std::vector<float>(at + members, at + n)});
  }
  return out;
}

// Each member combined over every rank with `op` (Sum, Max, ...), on every rank (one all_reduce).
template <class F>
F reduce_figures(Rank& r, const F& mine, ReduceOp op, Group group = {}) {
  Tensor t = r.from_host({figures_detail::floats_in<F>()}, figures_detail::as_floats(std::vector<F>{mine}));
  r.all_reduce(t, op, Async::No, group);
  return figures_detail::from_floats<F>(r.to_host(t)).front();
}

}  // namespace ranklab
