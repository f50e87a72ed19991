// benchmark: timing collectives the way the lecture does, and the bandwidths nccl-tests reports.
//
// The lecture times an all_reduce and a reduce_scatter of 100M float32 on 4 GPUs: a warm-up call,
// synchronize() then barrier() so that every rank starts the clock together, the timed call, and
// synchronize() again. From the duration it computes a bandwidth. This lesson does the same and prints
// nccl-tests' two figures (doc/PERFORMANCE.md of NVIDIA/nccl-tests):
//   algbw = size / time
//   busbw = algbw x the operation's bus factor (2(W-1)/W for all_reduce, (W-1)/W for reduce_scatter)
// next to the lecture's own formula, whose code and text disagree (docs/lessons/benchmark.md).
//
//   --wrong-order  barrier() before synchronize(): the ranks no longer start together
//   --sweep        an nccl-tests table of --op from 8 B to 16 GiB, with the algorithm the backend chose
//
// It first checks its own numerics on a small all_reduce of real numbers; the timed calls use phantom
// tensors (shapes without numbers), so 16 GiB costs no memory on the machine running the simulator.
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"
#include "common/rank.h"
#include "common/report.h"

namespace ranklab {
namespace {

constexpr std::int64_t kFloat = 4;  // bytes of a float32

// Rank r has r mod 8 GEMMs of 2048 x 2048 to finish first: the uneven work real ranks have when a
// measurement starts (data loading, a longer backward), which the fence must absorb. Bounded, so that a
// rank's work does not grow with the world; on up to 8 ranks it is r GEMMs.
constexpr int kUnevenPeriod = 8;

struct BenchmarkOptions : LessonOptions {
  std::int64_t count = 100'000'000;  // float32 elements of the timed collective
  bool wrong_order = false;          // barrier() before synchronize()
  bool sweep = false;                // nccl-tests' table of --op from 8 B to 16 GiB
  std::string op = "all_reduce";     // the collective --sweep times
};

// One timed collective: what it was, its nccl-tests size, and the time measured.
struct Measured {
  CommOp op;
  double size_bytes, time_us;
};

// The lecture's measurement: a warm-up, `before` (extra device work that differs between ranks), the
// fence, the timed call, the fence again. The right fence is synchronize() then barrier(): every rank's
// device is idle and every rank has arrived before anyone reads the clock, so every rank starts together
// and stops together, and they all measure the same duration. barrier() does not wait for the device, so
// the wrong fence, barrier() then synchronize(), lines up only the hosts: each rank then starts its clock
// when its own device is idle, which is not when the others are ready, and a rank that was ready early
// also times the wait for the late ones.
double measure_us(Rank& r, const std::function<void()>& call, const std::function<void()>& before,
                  bool wrong_order) {
  auto fence = [&] {
    if (wrong_order) {
      r.barrier();
      r.synchronize();
    } else {
      r.synchronize();
      r.barrier();
    }
  };
  call();  // warm-up: NCCL sets up its connections on the first call
  before();
  fence();
  const double t0 = r.now();
  call();
  fence();
  return r.now() - t0;
}

std::int64_t timed_count(Rank& r, const BenchmarkOptions& o);
std::function<void()> make_call(Rank& r, CommOp op, std::int64_t count);
std::function<void()> uneven_work(Rank& r);
void check_numerics(Rank& r);
void print_bandwidths(Rank& r, const std::vector<Measured>& results, double size);
void explain(Rank& r, const BenchmarkOptions& o, const std::vector<Measured>& results, double size);
CommOp parse_op(const std::string& name);
bool reduces(CommOp op);
bool rooted(CommOp op);
bool split(CommOp op);
std::string algorithm_of(Rank& r, CommOp op, std::int64_t bytes, int root);

// The lecture's measurement of all_reduce and reduce_scatter, with its bandwidths.
void lecture(Rank& r, const BenchmarkOptions& o) {
  const int w = r.world_size();
  const bool me = r.rank() == 0;
  const std::int64_t count = timed_count(r, o);
  const double size = static_cast<double>(count * kFloat);
  if (me) {
    r.print(fmt::format(
        "Timing all_reduce and reduce_scatter of {} float32 ({}) on {} ranks, as the lecture does:", count,
        format_bytes(size), w));
    r.print(fmt::format(
        "a warm-up call, rank r does {} GEMMs (uneven work), {}, the timed call, the same again.",
        w <= kUnevenPeriod ? "r" : "r mod 8",
        o.wrong_order ? "barrier() then synchronize() [--wrong-order]" : "synchronize() then barrier()"));
  }
  const std::function<void()> before = uneven_work(r);
  std::vector<Measured> results;
  for (CommOp op : {CommOp::AllReduce, CommOp::ReduceScatter}) {
    // all_reduce: a tensor of `count` floats on every rank. reduce_scatter: the lecture gives every rank a
    // W x count input and a count output; nccl-tests' size is the whole input.
    const std::int64_t total = op == CommOp::AllReduce ? count : count * w;
    const double t_us = measure_us(r, make_call(r, op, total), before, o.wrong_order);
    results.push_back({op, static_cast<double>(total * kFloat), t_us});
  }
  print_bandwidths(r, results, size);
  explain(r, o, results, size);
}

void sweep(Rank& r, const BenchmarkOptions& o) {
  const int w = r.world_size();
  const CommOp op = parse_op(o.op);
  const bool me = r.rank() == 0;
  if (me) {
    r.print(
        fmt::format("# ranklab benchmark --sweep: {} on {} ranks, float32, sizes 8 B to 16 GiB (nccl-tests' "
                    "-b 8 -e 16G -f 2)",
                    comm_op_name(op), w));
    r.print(
        "# one warm-up and one timed call per size; time from synchronize() + barrier() to the same again");
    r.print("#");
    r.print(fmt::format("# {:>12} {:>13} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8}  {}", "size", "count", "type",
                        "redop", "root", "time", "algbw", "busbw", "algorithm"));
    r.print(fmt::format("# {:>12} {:>13} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8}", "(B)", "(elements)", "", "",
                        "", "(us)", "(GB/s)", "(GB/s)"));
  }
  const std::function<void()> nothing = [] {};
  for (int log = 3; log <= 34; ++log) {
    const std::int64_t size = std::int64_t{1} << log;
    std::int64_t count = size / kFloat;
    if (split(op)) count = count / w * w;
    if (count == 0) continue;  // fewer floats than ranks: nothing to split
    const std::int64_t bytes = count * kFloat;
    const double t_us = measure_us(r, make_call(r, op, count), nothing, false);
    if (!me) continue;
    const double algbw = t_us > 0 ? static_cast<double>(bytes) / (t_us * 1e3) : 0;
    r.print(fmt::format("  {:>12} {:>13} {:>9} {:>6} {:>5} {:>10.2f} {:>8.2f} {:>8.2f}  {}", bytes, count,
                        "float", reduces(op) ? "sum" : "none", rooted(op) ? 0 : -1, t_us, algbw,
                        algbw * bus_factor(op, w), algorithm_of(r, op, bytes, rooted(op) ? 0 : -1)));
  }
}

void benchmark(Rank& r, const BenchmarkOptions& o) {
  check_numerics(r);
  if (o.sweep) {
    sweep(r, o);
  } else {
    lecture(r, o);
  }
}

// ---- the lecture's figures -----------------------------------------------------------------------------

// The count the lecture's measurement times: --count, a multiple of the ranks, that fits a byte count.
std::int64_t timed_count(Rank& r, const BenchmarkOptions& o) {
  const int w = r.world_size();
  const bool me = r.rank() == 0;
  if (o.op != "all_reduce") {
    parse_op(o.op);  // a name that is no collective says so first
    throw UsageError(fmt::format(
        "--op {} needs --sweep: without it the benchmark times all_reduce and reduce_scatter, as the lecture "
        "does",
        o.op));
  }
  if (o.count < w) {
    throw UsageError(
        fmt::format("--count {}: the benchmark needs at least one element per rank ({})", o.count, w));
  }
  // reduce_scatter's input is W x count float32: its bytes must fit a byte count.
  if (o.count > std::numeric_limits<std::int64_t>::max() / 8 / kFloat / w) {
    throw UsageError(fmt::format("--count {}: {} ranks x {} float32 is more bytes than a tensor can hold",
                                 o.count, w, o.count));
  }
  const std::int64_t count = o.count / w * w;  // reduce_scatter gives every rank the same share
  if (me && count != o.count) {
    r.print(fmt::format(
        "--count {} is not a multiple of the {} ranks (reduce_scatter gives each the same share): "
        "timing {} float32.",
        o.count, w, count));
  }
  return count;
}

// Rank 0: each collective's duration and bandwidths, nccl-tests' and the lecture's.
void print_bandwidths(Rank& r, const std::vector<Measured>& results, double size) {
  const int w = r.world_size();
  const bool me = r.rank() == 0;
  for (const Measured& x : results) {
    if (!me) break;
    const double algbw = x.size_bytes / (x.time_us * 1e3);  // GB/s: 1e9 bytes per second
    const double factor = bus_factor(x.op, w);
    const double busbw = algbw * factor;
    const bool ar = x.op == CommOp::AllReduce;
    r.print("");
    r.print(fmt::format(
        "{} of {}{} [{}]", comm_op_name(x.op), format_bytes(x.size_bytes),
        ar ? "" : fmt::format(" in (W x {} per rank), {} out", format_bytes(size), format_bytes(size)),
        algorithm_of(r, x.op, static_cast<std::int64_t>(x.size_bytes), -1)));
    r.print(fmt::format("  duration {:.3f} ms", x.time_us / 1e3));
    auto row = [&](const std::string& what, double gbps, const std::string& note) {
      r.print(fmt::format("  {:<58} = {:7.1f} GB/s  {}", what, gbps, note));
    };
    row("algbw = size / duration", algbw, "");
    row(fmt::format("busbw = algbw x {}", ar ? "2(W-1)/W" : "(W-1)/W"), busbw, "(nccl-tests)");
    // The lecture's code, literally: data_bytes is the bytes of the tensor it passes (all_reduce: the
    // tensor; reduce_scatter: the output, one rank's share), sent_bytes = data_bytes x 2 (W-1) for
    // all_reduce and x (W-1) for reduce_scatter, total_duration = W x duration.
    if (ar) {
      row("the lecture's code: data_bytes x 2(W-1) / (W x duration)", busbw, "(= busbw)");
    } else {
      row("the lecture's code: output bytes x (W-1) / (W x duration)", busbw / w,
          fmt::format("(= busbw / W: it counts the output, size / W, where nccl-tests counts the input)"));
    }
    if (ar) row("the lecture's text: 2 x size x (W-1)/W / (W x duration)", busbw / w, "(= busbw / W)");
  }
}

// What the figures say: with --wrong-order every rank's own measurement and why they differ; otherwise why
// the two bus bandwidths agree, and what the lecture's reduce_scatter figure counts.
void explain(Rank& r, const BenchmarkOptions& o, const std::vector<Measured>& results, double size) {
  const int w = r.world_size();
  const bool me = r.rank() == 0;
  if (o.wrong_order) {
    // Every rank's own measurement, side by side (show() is out of band: it costs no time).
    if (me) r.print("");
    for (const Measured& x : results) {
      r.show(fmt::format("{} measured (ms) by", comm_op_name(x.op)),
             r.from_host({1}, {static_cast<float>(x.time_us / 1e3)}));
    }
    if (!me) return;
    r.print("");
    r.print(
        "barrier() does not wait for the device. With barrier() before synchronize() the hosts meet while");
    r.print("the devices are still busy, and each rank starts its clock when its own device is done: a rank");
    r.print("that was ready early (rank 0 has no extra work) also times the wait for the slower ones, so it");
    r.print(
        "measures too much, and the ranks disagree. synchronize() then barrier() starts every clock when");
    r.print("the last device is ready, and every rank measures the collective alone.");
  } else if (me) {
    r.print("");
    r.print(
        "Per byte of size, all_reduce moves 2(W-1)/W over each rank's link and reduce_scatter (W-1)/W: twice "
        "the");
    r.print(
        "data, in about twice the time per byte. The bus factor undoes exactly that, so the two busbw "
        "agree");
    // busbw of each: size / time x its bus factor.
    auto busbw = [&](const Measured& x) { return x.size_bytes / x.time_us * bus_factor(x.op, w); };
    const double ratio = busbw(results[1]) / busbw(results[0]);
    if (w > 1 && (ratio < 0.8 || ratio > 1.25)) {
      r.print(fmt::format(
          "once transfers dominate. At {} they do not yet ({:.0f} against {:.0f} GB/s): each call's fixed "
          "latency still counts. At the lecture's --count 100000000 they agree.",
          format_bytes(size), busbw(results[0]) / 1e3, busbw(results[1]) / 1e3));
    } else {
      r.print("once transfers dominate, as they do at this size.");
    }
    r.print(
        "The lecture's reduce_scatter code counts the output's bytes (size / W) where nccl-tests counts the "
        "input's,");
    r.print(fmt::format(
        "so its figure is busbw / W: a {} of it here, and smaller the more ranks there are, however fast "
        "the links.",
        w == 4 ? "quarter" : fmt::format("1/{}", w)));
  }
}

// ---- the collectives' calls ------------------------------------------------------------------------

// The algorithm the backend runs a collective of the world with, where it can say.
std::string algorithm_of(Rank& r, CommOp op, std::int64_t bytes, int root) {
  const std::string name = r.collective_algorithm(op, bytes, root);
  return name.empty() ? "-" : name;
}

CommOp parse_op(const std::string& name) {
  for (CommOp op : {CommOp::AllReduce, CommOp::ReduceScatter, CommOp::AllGather, CommOp::Broadcast,
                    CommOp::Reduce, CommOp::AllToAll, CommOp::Scatter, CommOp::Gather}) {
    if (name == comm_op_name(op)) return op;
  }
  throw UsageError(fmt::format(
      "--op {}: the benchmark times all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, "
      "scatter or gather",
      name));
}

bool reduces(CommOp op) {
  return op == CommOp::AllReduce || op == CommOp::ReduceScatter || op == CommOp::Reduce;
}
bool rooted(CommOp op) {
  return op == CommOp::Broadcast || op == CommOp::Reduce || op == CommOp::Scatter || op == CommOp::Gather;
}
// Operations whose buffer is split into one piece per rank: nccl-tests' size must be a multiple of W floats.
bool split(CommOp op) {
  return op == CommOp::AllGather || op == CommOp::ReduceScatter || op == CommOp::AllToAll ||
         op == CommOp::Scatter || op == CommOp::Gather;
}

// One call of `op` whose nccl-tests size is `count` float32 in total (phantom tensors), made again each
// time it is called. Root 0 for the rooted operations.
std::function<void()> make_call(Rank& r, CommOp op, std::int64_t count) {
  const int w = r.world_size();
  const std::int64_t piece = count / w;
  const bool root = r.rank() == 0;
  switch (op) {
    case CommOp::AllReduce: {
      Tensor t = r.phantom({count});
      return [&r, t] { r.all_reduce(t, ReduceOp::Sum); };
    }
    case CommOp::Broadcast: {
      Tensor t = r.phantom({count});
      return [&r, t] { r.broadcast(t, 0); };
    }
    case CommOp::Reduce: {
      Tensor t = r.phantom({count});
      return [&r, t] { r.reduce(t, 0, ReduceOp::Sum); };
    }
    case CommOp::AllGather: {
      Tensor in = r.phantom({piece}), out = r.phantom({piece * w});
      return [&r, in, out] { r.all_gather(out, in); };
    }
    case CommOp::ReduceScatter: {
      Tensor in = r.phantom({piece * w}), out = r.phantom({piece});
      return [&r, in, out] { r.reduce_scatter(out, in, ReduceOp::Sum); };
    }
    case CommOp::AllToAll: {
      Tensor in = r.phantom({piece * w}), out = r.phantom({piece * w});
      return [&r, in, out] { r.all_to_all(out, in); };
    }
    case CommOp::Scatter: {
      Tensor in = root ? r.phantom({piece * w}) : Tensor(), out = r.phantom({piece});
      return [&r, in, out] { r.scatter(out, in, 0); };
    }
    case CommOp::Gather: {
      Tensor in = r.phantom({piece}), out = root ? r.phantom({piece * w}) : Tensor();
      return [&r, in, out] { r.gather(out, in, 0); };
    }
    default:
      break;
  }
  throw UsageError(fmt::format("the benchmark does not time {}", comm_op_name(op)));
}

void check_numerics(Rank& r) {
  // Rank i holds (i + j) mod 8 at element j: small integers, so every partial sum of any order is an
  // integer below 7 W, exact in float32 up to W = 2^24 / 7 (2.4 million ranks), and the check can ask
  // for the exact sum at any world size.
  const int w = r.world_size(), n = 1024;
  std::vector<float> mine(n);
  for (int j = 0; j < n; ++j) mine[j] = static_cast<float>((r.rank() + j) % 8);
  Tensor t = r.from_host({n}, mine);
  r.all_reduce(t, ReduceOp::Sum);
  const std::vector<float> got = r.to_host(t);
  auto want = [w](int j) {  // sum over i < w of (i + j) mod 8: w / 8 full cycles of 0..7, then the rest
    std::int64_t s = static_cast<std::int64_t>(w / 8) * 28;
    for (int i = w / 8 * 8; i < w; ++i) s += (i + j) % 8;
    return s;
  };
  int wrong = -1;
  for (int j = 0; j < n && wrong < 0; ++j) {
    if (static_cast<double>(got[j]) != static_cast<double>(want(j))) wrong = j;
  }
  r.check("a small all_reduce of real numbers gives every rank the elementwise sum", wrong < 0,
          wrong < 0 ? ""
                    : fmt::format("rank {} element {}: expected {}, got {:.9g}", r.rank(), wrong, want(wrong),
                                  got[wrong]));
  if (r.rank() == 0) {
    r.print(fmt::format("Numerics: a 1024-element all_reduce of real numbers is checked on every rank ({}).",
                        wrong < 0 ? "the sum, exactly" : "WRONG, see the checks"));
  }
}

// Rank r's uneven work before the measurement: r mod kUnevenPeriod GEMMs (phantom tensors).
std::function<void()> uneven_work(Rank& r) {
  Tensor a = r.phantom({2048, 2048});
  return [&r, a] {
    for (int i = 0; i < r.rank() % kUnevenPeriod; ++i) r.matmul(a, a);
  };
}

}  // namespace

using O = BenchmarkOptions;
const OptionTable<O> kOptions = {
    {"world", &O::world, "ranks"},
    Option<O>("count", &O::count,
              "float32 elements of the timed all_reduce (381 MiB, the lecture's \"400 MB\" of 1e8 floats)")
        .at_least(1)
        .ignored_with("sweep", "which times every size from 8 B to 16 GiB"),
    {"wrong-order", &O::wrong_order, "barrier() before synchronize(): see what that measures"},
    {"sweep", &O::sweep, "nccl-tests' table of --op from 8 B to 16 GiB instead"},
    Option<O>("op", &O::op, "with --sweep: the collective to time")
        .choices({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
                  "scatter", "gather"}),
};
const std::vector<LectureSetting> kLecture = {{"world", "4", ""}, {"count", "100000000", ""}};

RANKLAB_LESSON("benchmark",
               "time collectives as the lecture does: duration, algbw, busbw; --sweep for nccl-tests' table",
               benchmark, kOptions, kLecture);

}  // namespace ranklab
