#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/errors.h"
#include "common/measurements.h"

namespace ranklab {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

// The layout every *_perf tool of nccl-tests 2.13 and later prints (src/common.cu): a header, the devices,
// the column names, one row per size with out-of-place and in-place figures.
std::string devices(int n, const std::string& gpu) {
  std::string s = "#\n# Using devices\n";
  for (int r = 0; r < n; ++r) {
    s += fmt::format("#  Rank {:2} Group  0 Pid {:6} on      node{} device {:2} [0x{:02x}] {}\n", r, 1000 + r,
                     r / 8, r % 8, r + 7, gpu);
  }
  return s;
}

constexpr const char* kColumns =
    "#\n"
    "#                                                              out-of-place                       "
    "in-place  "
    "        \n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
    "busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  "
    "(GB/s)       \n";

// One row; algbw and busbw computed as nccl-tests does (size / time, times the bus factor).
std::string row(long bytes, const char* type, int elem, const char* redop, int root, double t_us,
                double t_in_us, double factor) {
  const double algbw = bytes / (t_us * 1e3), algbw_in = bytes / (t_in_us * 1e3);
  return fmt::format(
      "{:12} {:13} {:>9} {:>7} {:7} {:8.2f} {:7.2f} {:7.2f} {:6} {:8.2f} {:7.2f} {:7.2f} {:6}\n", bytes,
      bytes / elem, type, redop, root, t_us, algbw, algbw * factor, 0, t_in_us, algbw_in, algbw_in * factor,
      0);
}

std::string all_reduce_log(int n) {
  const double f = 2.0 * (n - 1) / n;
  std::string s =
      "# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 "
      "agg iters: 1 validation: 1 graph: 0\n";
  s += devices(n, "NVIDIA H100 80GB HBM3");
  s += kColumns;
  s += row(8, "float", 4, "sum", -1, 19.10, 18.90, f);
  s += row(1048576, "float", 4, "sum", -1, 30.25, 29.80, f);
  s += "node0:1000:1000 [0] NCCL INFO comm 0x55 rank 0 nranks 8 - Destroy COMPLETE\n";  // noise between rows
  s += row(1073741824, "float", 4, "sum", -1, 5012.3, 5001.2, f);
  s += "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 120.5 \n#\n";
  return s;
}

TEST(NcclTests, ReadsEveryRowWithWorldAndGpu) {
  const RunReport r = read_nccl_tests(all_reduce_log(8), "ar.log", CommOp::AllReduce);
  EXPECT_EQ(r.world, 8);
  EXPECT_EQ(r.profile, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(r.backend, "measured");
  EXPECT_EQ(r.lesson, "nccl-tests all_reduce");
  // Out-of-place, then in-place, for each size.
  ASSERT_EQ(r.collectives.size(), 6u);
  EXPECT_EQ(r.collectives[2].bytes, 1048576);
  EXPECT_EQ(r.collectives[2].group, "world");
  EXPECT_DOUBLE_EQ(r.collectives[2].time_us(), 30.25);
  EXPECT_EQ(r.collectives[4].group_size, 8);
  EXPECT_NEAR(r.collectives[4].busbw_gbps, 1073741824 / 5012.3e3 * 1.75, 1e-9);
  EXPECT_EQ(r.collectives[5].group, kInPlaceGroup);
  EXPECT_EQ(r.collectives[5].bytes, 1073741824);
  EXPECT_NEAR(r.collectives[5].time_us(), 5001.2, 1e-6);
  EXPECT_GE(r.collectives[5].start_us, r.collectives[4].end_us);
}

TEST(NcclTests, KeepsTheTimingLoopOfTheHeader) {
  // The counts the header prints; nccl-tests' defaults (-w 5 -n 20) for a log without them.
  std::optional<NcclTestsLoop> loop =
      nccl_tests_loop(read_nccl_tests(all_reduce_log(8), "a.log", std::nullopt));
  ASSERT_TRUE(loop.has_value());
  EXPECT_EQ(loop->warmup_iters, 5);
  EXPECT_EQ(loop->iters, 20);
  EXPECT_EQ(loop->gpus_per_thread, 1);
  std::string custom = all_reduce_log(8);
  custom.replace(custom.find("warmup iters: 5 iters: 20"), 25, "warmup iters: 2 iters: 50");
  custom.replace(custom.find("nGpus 1"), 7, "nGpus 8");
  loop = nccl_tests_loop(read_nccl_tests(custom, "b.log", std::nullopt));
  ASSERT_TRUE(loop.has_value());
  EXPECT_EQ(loop->warmup_iters, 2);
  EXPECT_EQ(loop->iters, 50);
  EXPECT_EQ(loop->gpus_per_thread, 8);
  std::string no_gpus = custom;
  no_gpus.replace(no_gpus.find("nGpus 8"), 7, "nGpus 0");
  const std::string gpus_msg = error_of([&] { read_nccl_tests(no_gpus, "g.log", std::nullopt); });
  EXPECT_TRUE(contains(gpus_msg, "g.log:1: the header's 'nGpus' is '0'")) << gpus_msg;
  const std::string no_header =
      devices(8, "A100") + kColumns + row(8, "float", 4, "sum", -1, 19.1, 18.9, 1.75);
  loop = nccl_tests_loop(read_nccl_tests(no_header, "c.log", CommOp::AllReduce));
  ASSERT_TRUE(loop.has_value());
  EXPECT_EQ(loop->iters, 20);
  custom.replace(custom.find("iters: 50"), 9, "iters: 0");
  const std::string msg = error_of([&] { read_nccl_tests(custom, "d.log", std::nullopt); });
  EXPECT_TRUE(contains(msg, "d.log:1: the header's 'iters' is 0")) << msg;
  // Other measurements time each collective by itself.
  EXPECT_FALSE(nccl_tests_loop(read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,8,8,20\n", "t.csv")));
}

TEST(NcclTests, InfersTheCollective) {
  // From the tool's name in the log or the file name.
  EXPECT_EQ(read_nccl_tests("$ mpirun -np 8 ./build/all_reduce_perf -b 8\n" + all_reduce_log(8), "x.log",
                            std::nullopt)
                .lesson,
            "nccl-tests all_reduce");
  EXPECT_EQ(read_nccl_tests(all_reduce_log(8), "logs/all_reduce_perf.txt", std::nullopt).collectives[0].op,
            CommOp::AllReduce);
  EXPECT_EQ(comm_op_from_text("./reduce_scatter_perf -g 8"), CommOp::ReduceScatter);
  EXPECT_EQ(comm_op_from_text("./reduce_perf -g 8"), CommOp::Reduce);
  EXPECT_EQ(comm_op_from_text("nothing here"), std::nullopt);
  // From the bus factor alone: 2(n-1)/n with a reduction is all_reduce.
  EXPECT_EQ(read_nccl_tests(all_reduce_log(16), "run1.log", std::nullopt).collectives[0].op,
            CommOp::AllReduce);

  // (n-1)/n without a reduction fits both all_gather and all_to_all: the reader says so and asks.
  std::string ag = devices(4, "A100") + kColumns + row(4194304, "float", 4, "none", -1, 40.0, 39.0, 0.75);
  const std::string msg = error_of([&] { read_nccl_tests(ag, "run2.log", std::nullopt); });
  EXPECT_TRUE(contains(msg, "all_gather, all_to_all all fit")) << msg;
  EXPECT_TRUE(contains(msg, "--op")) << msg;
  EXPECT_EQ(read_nccl_tests(ag, "run2.log", CommOp::AllGather).collectives[0].op, CommOp::AllGather);
}

TEST(NcclTests, WorldFromTheBusFactorWithoutDeviceLines) {
  std::string s = kColumns;
  s += row(1 << 30, "bfloat16", 2, "sum", -1, 4000.0, 3990.0, 2.0 * 31 / 32);
  const RunReport r = read_nccl_tests(s, "x.log", CommOp::AllReduce);
  EXPECT_EQ(r.world, 32);
}

TEST(NcclTests, OlderLayoutWithoutRootAndWithoutValidation) {
  // nccl-tests before the root column, run with -c 0: the error column prints N/A.
  std::string s = devices(2, "Tesla V100-SXM2-32GB");
  s += "#       size         count      type   redop     time   algbw   busbw  error     time   algbw   "
       "busbw  "
       "error\n";
  s += "     1048576        262144     float     sum    45.10   23.25   23.25    N/A    44.90   23.35   "
       "23.35    "
       "N/A\n";
  const RunReport r = read_nccl_tests(s, "old.log", CommOp::AllReduce);
  ASSERT_EQ(r.collectives.size(), 2u);
  EXPECT_DOUBLE_EQ(r.collectives[0].time_us(), 45.10);
  EXPECT_DOUBLE_EQ(r.collectives[1].time_us(), 44.90);
  EXPECT_EQ(r.world, 2);
}

TEST(NcclTests, BadLogsAreNamedByLine) {
  std::string log = all_reduce_log(8);
  // Cut the last row in half: the reader names the line and says why.
  const std::size_t cut = log.find("  1073741824");
  std::string truncated = log.substr(0, cut + 40);
  std::string msg = error_of([&] { read_nccl_tests(truncated, "cut.log", CommOp::AllReduce); });
  EXPECT_TRUE(contains(msg, "cut.log:")) << msg;
  EXPECT_TRUE(contains(msg, "cut short")) << msg;

  msg = error_of([&] { read_nccl_tests("# nThread 1 nGpus 8\n", "empty.log", CommOp::AllReduce); });
  EXPECT_TRUE(contains(msg, "no nccl-tests column header")) << msg;
  msg = error_of([&] { read_nccl_tests(std::string(kColumns), "h.log", CommOp::AllReduce); });
  EXPECT_TRUE(contains(msg, "no measurements")) << msg;

  std::string bad_time =
      devices(2, "X") + kColumns +
      "        1024           256     float     sum      -1     -3.0    0.00    0.00      0   "
      "  3.00    0.00    0.00      0\n";
  msg = error_of([&] { read_nccl_tests(bad_time, "t.log", CommOp::AllReduce); });
  EXPECT_TRUE(contains(msg, "t.log:")) << msg;
  EXPECT_TRUE(contains(msg, "'time'")) << msg;

  std::string bad_type = devices(2, "X") + kColumns + row(1024, "float", 4, "sum", -1, 10, 10, 1);
  bad_type.replace(bad_type.rfind("float"), 5, "quad8");
  msg = error_of([&] { read_nccl_tests(bad_type, "ty.log", CommOp::AllReduce); });
  EXPECT_TRUE(contains(msg, "unknown data type 'quad8'")) << msg;
}

TEST(MeasurementCsv, RowsByHand) {
  const RunReport r = read_measurement_csv(
      "op,bytes,ranks,time_us\nall_reduce,1048576,8,35.5\n# a comment\nallgather, 4096 ,8,12\n", "t.csv");
  EXPECT_EQ(r.world, 8);
  ASSERT_EQ(r.collectives.size(), 2u);
  EXPECT_EQ(r.collectives[0].op, CommOp::AllReduce);
  EXPECT_EQ(r.collectives[1].op, CommOp::AllGather);
  EXPECT_EQ(r.collectives[1].bytes, 4096);
  EXPECT_DOUBLE_EQ(r.collectives[1].time_us(), 12);

  EXPECT_TRUE(contains(error_of([] { read_measurement_csv("a,b\n1,2\n", "h.csv"); }), "op, bytes, ranks"));
  std::string msg =
      error_of([] { read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,10,8,0\n", "z.csv"); });
  EXPECT_TRUE(contains(msg, "z.csv:2") && contains(msg, "time_us")) << msg;
  msg = error_of([] {
    read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,10,8,1\nall_reduce,10,4,1\n", "w.csv");
  });
  EXPECT_TRUE(contains(msg, "w.csv:3") && contains(msg, "one world")) << msg;
  msg = error_of([] { read_measurement_csv("op,bytes,ranks,time_us\nfrobnicate,10,8,1\n", "o.csv"); });
  EXPECT_TRUE(contains(msg, "unknown collective 'frobnicate'")) << msg;
  msg = error_of([] { read_measurement_csv("op,bytes,ranks,time_us\nall_reduce,10,8\n", "f.csv"); });
  EXPECT_TRUE(contains(msg, "3 fields where the header has 4")) << msg;
}

TEST(MeasurementCsv, BandwidthsGiveTheTimes) {
  // nccl-tests' bandwidths (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x 2(n-1)/n for an
  // all_reduce on n ranks.
  const RunReport bus =
      read_measurement_csv("op,bytes,ranks,busbw_gbps\nall_reduce,1048576,8,52.96\n", "b.csv");
  ASSERT_EQ(bus.collectives.size(), 1u);
  EXPECT_NEAR(bus.collectives[0].time_us(), 1048576 * 1.75 / 52.96e3, 1e-9);
  EXPECT_NEAR(bus.collectives[0].busbw_gbps, 52.96, 1e-9);
  const RunReport alg = read_measurement_csv("op,bytes,ranks,algbw_gbps\nall_gather,4096,8,2\n", "a.csv");
  EXPECT_NEAR(alg.collectives[0].time_us(), 4096 / 2e3, 1e-12);
  EXPECT_FALSE(nccl_tests_loop(bus));  // without the loop's line, each row is a collective's own time
  // Read as CSV although it names nccl-tests' algbw.
  EXPECT_EQ(detect_measurement_format("# from a summary\nop,bytes,ranks,algbw_gbps\n", "a"),
            MeasurementFormat::Csv);

  std::string msg = error_of(
      [] { read_measurement_csv("op,bytes,ranks,time_us,busbw_gbps\nall_reduce,8,8,20,1\n", "two.csv"); });
  EXPECT_TRUE(contains(msg, "two.csv:1") && contains(msg, "one of time_us, busbw_gbps and algbw_gbps"))
      << msg;
  msg = error_of([] { read_measurement_csv("op,bytes,ranks,busbw_gbps\nall_reduce,8,1,3\n", "one.csv"); });
  EXPECT_TRUE(contains(msg, "one.csv:2: all_reduce on 1 rank moves nothing")) << msg;
  msg = error_of([] { read_measurement_csv("op,bytes,ranks,busbw_gbps\nall_reduce,8,8,-3\n", "neg.csv"); });
  EXPECT_TRUE(contains(msg, "neg.csv:2: busbw_gbps '-3' is not a positive bandwidth")) << msg;
  msg = error_of(
      [] { read_measurement_csv("op,bytes,ranks,algbw_gbps\nall_reduce,8,8,1e-320\n", "tiny.csv"); });
  EXPECT_TRUE(contains(msg, "tiny.csv:2: algbw_gbps '1e-320' for 8 bytes gives no finite time")) << msg;
}

TEST(MeasurementCsv, AnNccltestsLoopLineTimesTheRowsAsNcclTestsDid) {
  const std::string csv =
      "# a benchmark's summary of all_reduce_perf -g 8 -n 40\n"
      "# nccl-tests loop: nGpus 8 warmup iters: 5 iters: 40\n"
      "op,bytes,ranks,busbw_gbps\nall_reduce,1048576,8,52.96\nall_reduce,2097152,8,88.78\n";
  const RunReport r = read_measurement_csv(csv, "l.csv");
  EXPECT_EQ(r.lesson, "nccl-tests all_reduce");
  ASSERT_EQ(r.collectives.size(), 2u);
  const std::optional<NcclTestsLoop> loop = nccl_tests_loop(r);
  ASSERT_TRUE(loop.has_value());
  EXPECT_EQ(loop->gpus_per_thread, 8);
  EXPECT_EQ(loop->warmup_iters, 5);
  EXPECT_EQ(loop->iters, 40);

  std::string msg = error_of([&] { read_measurement_csv(csv + "all_gather,4096,8,3\n", "mix.csv"); });
  EXPECT_TRUE(contains(msg, "mix.csv:6: all_gather in an nccl-tests loop of all_reduce")) << msg;
  msg = error_of([] {
    read_measurement_csv("op,bytes,ranks,time_us\n# nccl-tests loop: iters: 20\nall_reduce,8,8,20\n",
                         "late.csv");
  });
  EXPECT_TRUE(contains(msg, "late.csv:2: the '# nccl-tests loop:' line must come before the header")) << msg;
  msg = error_of([] {
    read_measurement_csv("# nccl-tests loop: nGpus 0\nop,bytes,ranks,time_us\nall_reduce,8,8,20\n", "g.csv");
  });
  EXPECT_TRUE(contains(msg, "g.csv:1: the header's 'nGpus' is '0'")) << msg;
}

// A trace as torch.profiler exports it: kernels with ts and dur in microseconds, the collective's
// parameters on the CPU op that launched it, matched by External id.
std::string kineto_trace(int rank, int world, double shift_us) {
  return fmt::format(R"J({{
  "distributedInfo": {{"backend": "nccl", "rank": {0}, "world_size": {1}}},
  "traceEvents": [
    {{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": {2}, "dur": 5,
      "args": {{"External id": 11, "Collective name": "allreduce", "In msg nelems": 262144,
               "Out msg nelems": 262144, "Group size": {1}, "dtype": "BFloat16"}}}},
    {{"ph": "X", "cat": "kernel", "name": "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn(params)",
      "ts": {3}, "dur": 120.5, "args": {{"External id": 10}}}},
    {{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgs)",
      "ts": {4}, "dur": 42.0, "args": {{"External id": 11}}}},
    {{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(x)", "ts": {5}, "dur": 10.0,
      "args": {{"Collective name": "_allgather_base", "In msg nelems": 1024, "Out msg nelems": {6},
               "Group size": {1}, "dtype": "Float"}}}}
  ]
}})J",
                     rank, world, 1000 + shift_us, 1000 + shift_us, 1200 + shift_us, 1300 + shift_us,
                     1024 * world);
}

TEST(Kineto, CollectivesAndComputeFromEveryRank) {
  const RunReport r =
      read_kineto_traces({{"r1.json", kineto_trace(1, 2, 7)}, {"r0.json", kineto_trace(0, 2, 0)}});
  EXPECT_EQ(r.world, 2);
  ASSERT_EQ(r.collectives.size(), 2u);
  EXPECT_EQ(r.collectives[0].op, CommOp::AllReduce);
  EXPECT_EQ(r.collectives[0].bytes, 262144 * 2);  // bf16
  EXPECT_DOUBLE_EQ(r.collectives[0].time_us(), 42.0);
  EXPECT_DOUBLE_EQ(r.collectives[0].start_us, 200.0);  // from the trace's first event
  EXPECT_EQ(r.collectives[1].op, CommOp::AllGather);
  EXPECT_EQ(r.collectives[1].bytes, 1024 * 2 * 4);  // the gathered whole, as nccl-tests counts it
  ASSERT_EQ(r.regions.size(), 2u);                  // one compute kernel per rank
  EXPECT_EQ(r.regions[0].name, "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn");
  EXPECT_EQ(r.regions[0].rank, 0);
  EXPECT_EQ(r.regions[1].rank, 1);
}

TEST(Kineto, BadTracesAreNamed) {
  std::string msg = error_of([] { read_kineto_traces({{"only0.json", kineto_trace(0, 2, 0)}}); });
  EXPECT_TRUE(contains(msg, "only 1 trace was given")) << msg;
  msg = error_of([] {
    read_kineto_traces({{"a.json", kineto_trace(0, 2, 0)}, {"b.json", kineto_trace(0, 2, 0)}});
  });
  EXPECT_TRUE(contains(msg, "rank 0 where rank 1 was expected")) << msg;
  msg = error_of([] { read_kineto_traces({{"cut.json", kineto_trace(0, 1, 0).substr(0, 200)}}); });
  EXPECT_TRUE(contains(msg, "cut.json") && contains(msg, "not valid JSON")) << msg;
  msg = error_of([] { read_kineto_traces({{"n.json", R"({"traceEvents": []})"}}); });
  EXPECT_TRUE(contains(msg, "no GPU kernels")) << msg;
  msg = error_of([] {
    read_kineto_traces(
        {{"s.json", R"J({"traceEvents": [{"cat": "kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float()",
                                            "ts": 1, "dur": 2}]})J"}});
  });
  EXPECT_TRUE(contains(msg, "s.json: traceEvents[0]") && contains(msg, "message size")) << msg;
}

TEST(MeasurementFormat, DetectedFromTheText) {
  EXPECT_EQ(detect_measurement_format(all_reduce_log(8), "a"), MeasurementFormat::NcclTests);
  EXPECT_EQ(detect_measurement_format("op,bytes,ranks,time_us\n", "a"), MeasurementFormat::Csv);
  // Comment lines before the header (where the numbers come from) leave it a CSV; a comment alone is not one.
  EXPECT_EQ(detect_measurement_format(
                "# source: a paper\n\n# ranklab: --profile dgx-h100\nop,bytes,ranks,time_us\n", "a"),
            MeasurementFormat::Csv);
  EXPECT_TRUE(contains(error_of([] { detect_measurement_format("# just a comment\n", "c.csv"); }),
                       "c.csv: not a measurement"));
  EXPECT_EQ(detect_measurement_format(kineto_trace(0, 1, 0), "a"), MeasurementFormat::Kineto);
  EXPECT_EQ(detect_measurement_format(R"({"schema_version": 1})", "a"), MeasurementFormat::Report);
  EXPECT_TRUE(
      contains(error_of([] { detect_measurement_format("hello\n", "x.txt"); }), "x.txt: not a measurement"));
  EXPECT_TRUE(
      contains(error_of([] { detect_measurement_format("  \n", "e.txt"); }), "e.txt: the file is empty"));
}

}  // namespace
}  // namespace ranklab
