// ring_all_reduce: all_reduce written from send and recv, the way NCCL's ring algorithm moves data.
//
// The buffer is cut into W pieces. In W - 1 steps of reduce-scatter, every rank sends one piece to the next
// rank and adds the piece it receives from the previous one; afterwards rank r holds the full sum of piece
// (r + 1) mod W. In W - 1 steps of all-gather the summed pieces travel once more around the ring. Each rank
// sends 2 (W - 1) / W of the buffer in all, which is why nccl-tests' bus bandwidth of all_reduce is its
// algorithm bandwidth times 2 (W - 1) / W.
//
// The lesson checks its result against the library's all_reduce, and compares the two times.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "common/rank.h"

namespace {

using namespace ranklab;

// The lesson's options: its own struct, each member with its default, declared below for the command line.
struct RingOptions : LessonOptions {
  std::int64_t count = 1 << 20;  // float32 elements of the buffer, all pieces together
  bool phantom = false;          // time it without numbers (no check)
};

void ring_all_reduce(Rank& r, const RingOptions& o) {
  const int world = r.world_size(), me = r.rank();
  const int next = (me + 1) % world, prev = (me + world - 1) % world;
  const std::int64_t n = std::max<std::int64_t>(1, o.count / world);  // floats per piece (--count in all)
  const Shape whole{world * n};
  const std::uint64_t seed = 100 + me;
  // The buffer as W pieces, each made on its own; and the same buffer whole, for the library to reduce.
  std::vector<Tensor> piece(world);
  for (int k = 0; k < world; ++k) piece[k] = r.randn_slice(whole, 0, k * n, n, seed, 1.0f, DType::Float32);
  Tensor expected = r.randn(whole, seed);
  Tensor incoming = r.empty({n});

  r.synchronize();
  r.barrier();
  const double t0 = r.now();
  // Reduce-scatter: at step s, send piece (me - s) on, and add what arrives into piece (me - s - 1).
  for (int s = 0; s < world - 1; ++s) {
    const int send = (me - s + world) % world, add = (me - s - 1 + world) % world;
    for (Work& w : r.batch_isend_irecv({{CommOp::Send, piece[send], next}, {CommOp::Recv, incoming, prev}})) {
      w.wait();
    }
    r.add_(piece[add], incoming, 1.0f);
  }
  // All-gather: at step s, send piece (me + 1 - s) on, and receive piece (me - s) in place.
  for (int s = 0; s < world - 1; ++s) {
    const int send = (me + 1 - s + world) % world, take = (me - s + world) % world;
    for (Work& w :
         r.batch_isend_irecv({{CommOp::Send, piece[send], next}, {CommOp::Recv, piece[take], prev}})) {
      w.wait();
    }
  }
  r.synchronize();
  r.barrier();
  const double ring_us = r.now() - t0;

  r.all_reduce(expected, ReduceOp::Sum);
  r.synchronize();
  r.barrier();
  const double library_us = r.now() - t0 - ring_us;

  std::string verdict = "not checked: phantom tensors hold no numbers";
  if (!o.phantom) {
    // Both add the same W float32 numbers per element in different orders. Each order's rounding error is at
    // most (W - 1) float32 epsilons times the sum of the numbers' magnitudes (Higham, "Accuracy and Stability
    // of Numerical Algorithms", 2nd ed., section 4.2), and W standard normal numbers sum to at most 5 W in
    // magnitude but with a vanishing probability; the two orders' errors add.
    const std::vector<float> got = r.to_host(r.cat(piece, 0)), want = r.to_host(expected);
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
    const double tolerance = 2 * (world - 1) * 1.1920929e-7 * 5.0 * world;
    const bool ok = worst <= tolerance;
    r.check("ring all_reduce equals all_reduce", ok,
            fmt::format("largest difference {:.9g}, allowed {:.9g}", worst, tolerance));
    verdict = ok ? "check passed: equal to all_reduce" : "CHECK FAILED";
  }
  if (me == 0) {
    r.print(fmt::format(
        "ring all_reduce of {} floats on {} ranks: {:.1f} us by hand, {:.1f} us by all_reduce; {}", world * n,
        world, ring_us, library_us, verdict));
  }
}

const OptionTable<RingOptions> kOptions = {
    {"world", &RingOptions::world, "ranks of the ring"},
    Option<RingOptions>("count", &RingOptions::count, "float32 elements of the buffer").at_least(1),
    {"phantom", &RingOptions::phantom, "time it without numbers (no check)"},
};

RANKLAB_LESSON("ring_all_reduce", "all_reduce written by hand from send/recv around a ring", ring_all_reduce,
               kOptions);

}  // namespace
