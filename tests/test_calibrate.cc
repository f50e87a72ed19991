#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "common/compare.h"
#include "common/errors.h"
#include "common/measurements.h"
#include "common/profile.h"
#include "common/replay.h"
#include "sim/measured_sim.h"
#include "sim/net/calibrate.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

// A small training-shaped program on 16 ranks over two nodes, on phantom tensors: compute-bound matmuls,
// memory-bound elementwise kernels, and collectives of several sizes inside a node and across nodes, each
// phase a region.
void workload(Rank& r) {
  // Every rank makes both groups, in the same order, and uses its own node's.
  const Group low = r.new_group({0, 1, 2, 3, 4, 5, 6, 7});
  const Group high = r.new_group({8, 9, 10, 11, 12, 13, 14, 15});
  const Group& node = r.rank() < 8 ? low : high;
  for (int step = 0; step < 2; ++step) {
    {
      auto scope = r.region("compute");
      Tensor a = r.phantom({1024, 1024}), b = r.phantom({1024, 1024});
      Tensor c = r.matmul(a, b);
      Tensor big = r.phantom({1 << 22});
      Tensor y = r.relu(big);
      r.scale_(y, 0.5f);
      (void)c;
      r.synchronize();
    }
    for (std::int64_t kib : {16, 256, 4096, 65536}) {
      auto scope = r.region(fmt::format("comm {} KiB", kib));
      Tensor t = r.phantom({kib * 256});
      r.all_reduce(t, ReduceOp::Sum, Async::No, node);
      r.all_reduce(t, ReduceOp::Sum);
      r.synchronize();
    }
  }
}

SimConfig two_nodes(const Profile& p) {
  SimConfig c;
  c.profile = p;
  c.profile.nodes = 2;
  c.echo_output = false;
  return c;
}

RunReport simulate(const Profile& p) {
  SimBackend backend(two_nodes(p));
  return backend.launch(16, workload);
}

TEST(Calibrate, FittedProfileBringsTheSimulationToTheMeasurement) {
  const Profile profile = load_profile("dgx-h100");
  // The "measured" machine: slower links, more latency and less efficient kernels than the profile says.
  Profile truth = profile;
  truth.gpu.compute_efficiency = 0.45;
  truth.gpu.memory_efficiency = 0.5;
  truth.nvlink.efficiency = 0.5;
  truth.nvlink.latency_us = 0.9;
  truth.nic.efficiency = 0.7;
  truth.nic.latency_us = 1.8;
  const RunReport measured = simulate(truth);

  const double before = compare_reports(simulate(profile), measured).error;
  const Calibration c = calibrate(measured, profile, simulate);
  EXPECT_GT(c.collectives, 0);
  EXPECT_GT(c.kernels, 0);
  EXPECT_LT(c.error_after, c.error_before);

  // The fitted profile, written as a file, read back and simulated again, is close to the measurement.
  const std::string text = fitted_profile_text(read_text(profile.source_file), c, "dgx-h100-fitted",
                                               "measured.json", "2030-01-02");
  Profile fitted = parse_profile(text, "fitted.toml");
  EXPECT_EQ(fitted.name, "dgx-h100-fitted");
  const double after = compare_reports(simulate(fitted), measured).error;
  EXPECT_GT(before, 0.2) << "the perturbation should matter";
  EXPECT_LT(after, before / 5) << format_calibration(c);
  EXPECT_LT(after, 0.03) << format_calibration(c);

  // The efficiencies are recovered (kernels and large messages pin them down).
  EXPECT_NEAR(fitted.gpu.compute_efficiency, 0.45, 0.01) << format_calibration(c);
  EXPECT_NEAR(fitted.gpu.memory_efficiency, 0.5, 0.01) << format_calibration(c);
  EXPECT_NEAR(fitted.nvlink.efficiency, 0.5, 0.03) << format_calibration(c);
  // Every value fitted says where it came from.
  EXPECT_TRUE(contains(text, "Fitted by `ranklab calibrate` on 2030-01-02 to measured.json")) << text;
  const std::string summary = format_calibration(c);
  EXPECT_TRUE(contains(summary, "gpu.compute_efficiency")) << summary;
}

// nccl-tests' all_reduce_perf output for a sweep from `min_bytes` to `max_bytes` (factor 2) simulated on
// `p` the way nccl-tests times it (20 launches and a synchronize per row, common/replay.h): the layout its
// src/common.cu prints, times with two decimals as it rounds them. One process per GPU (nGpus 1): the
// simulation that makes the log gives every rank a host of its own.
std::string nccl_tests_log(const Profile& p, int world, std::int64_t min_bytes, std::int64_t max_bytes) {
  const std::string header = fmt::format(
      "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 "
      "validation: 1 graph: 0\n#\n"
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw "
      "  busbw #wrong\n",
      min_bytes, max_bytes);
  auto rows = [&](const std::vector<double>& times_us) {
    std::string out;
    std::size_t k = 0;
    for (std::int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2, k += 2) {
      const double t = times_us[k], t_in = times_us[k + 1];
      const double algbw = bytes / (t * 1e3), algbw_in = bytes / (t_in * 1e3), f = 2.0 * (world - 1) / world;
      out += fmt::format(
          "{:12} {:13} {:>9} {:>7} {:7} {:8.2f} {:7.2f} {:7.2f} {:6} {:8.2f} {:7.2f} {:7.2f} {:6}\n", bytes,
          bytes / 4, "float", "sum", -1, t, algbw, algbw * f, 0, t_in, algbw_in, algbw_in * f, 0);
    }
    return out;
  };
  // The rows the log will have, with placeholder times, read as the measurement is, then replayed on `p`.
  std::vector<double> placeholder;
  for (std::int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2)
    placeholder.insert(placeholder.end(), {1, 1});
  const RunReport sweep = read_nccl_tests(header + rows(placeholder), "all_reduce_perf.log", std::nullopt);
  SimConfig config;
  config.profile = p;
  config.echo_output = false;
  SimBackend sim(config);
  RunReport r = sim.launch(world, replay_program(sweep));
  label_as_replay(r, sweep);
  std::vector<double> times;
  for (const CollectiveRecord& c : r.collectives) times.push_back(c.time_us());
  return header + rows(times);
}

// Simulates a measurement read from a log the way `ranklab compare` and `calibrate` do.
Simulate replay_of(const RunReport& measured) {
  return [&measured](const Profile& p) { return simulate_measured(measured, p); };
}

TEST(Calibrate, FromNcclTestsOutput) {
  // A measured sweep from a machine whose NVLink sustains less than the profile says: calibrating the
  // profile to the log recovers it, replaying the log's collectives on the simulator.
  const Profile profile = load_profile("dgx-a100");
  Profile truth = profile;
  truth.nvlink.efficiency = 0.62;
  const RunReport measured = read_nccl_tests(nccl_tests_log(truth, 8, 1 << 20, std::int64_t{1} << 30),
                                             "all_reduce_perf.log", std::nullopt);
  ASSERT_EQ(measured.world, 8);
  const Calibration c = calibrate(measured, profile, replay_of(measured));
  EXPECT_GT(c.error_before, 0.1) << format_calibration(c);
  EXPECT_LT(c.error_after, 0.02) << format_calibration(c);
  const ParameterFit* nvlink = c.find("nvlink.efficiency");
  ASSERT_NE(nvlink, nullptr);
  EXPECT_TRUE(nvlink->fitted);
  EXPECT_NEAR(nvlink->after, 0.62, 0.02 * 0.62) << format_calibration(c);
}

TEST(Calibrate, BandwidthLatencyAndLaunchFromNcclTestsOutput) {
  // A machine that differs from its profile in all three things an nccl-tests sweep shows: NVLink's
  // sustained bandwidth (large sizes), the collectives' fixed latency (small and mid sizes) and the host's
  // launch overhead. The launch overhead shows only where it is longer than the collective (nccl-tests'
  // loop is then launch-bound; elsewhere a launch adds a twentieth of itself), so the truth's, 25 us, is
  // chosen longer than the smallest sizes' all_reduce (15 us on 8 A100s by NCCL's tables, 20 us at the
  // truth's latency) and shorter than the mid and large sizes' which pin down latency and bandwidth.
  const Profile profile = load_profile("dgx-a100");
  Profile truth = profile;
  truth.nvlink.efficiency = 0.62;     // profile 0.8
  truth.nccl.latency_scale = 1.3;     // profile 1
  truth.gpu.launch_overhead_us = 25;  // profile 4
  const std::string log = nccl_tests_log(truth, 8, 8, std::int64_t{1} << 30);
  const RunReport measured = read_nccl_tests(log, "all_reduce_perf.log", std::nullopt);
  // Launch-bound at the smallest size, not at the largest.
  ASSERT_NEAR(measured.collectives.front().time_us(), 25, 2) << log;
  ASSERT_GT(measured.collectives.back().time_us(), 1000) << log;

  const Calibration c = calibrate(measured, profile, replay_of(measured));
  const std::string summary = format_calibration(c);
  EXPECT_GT(c.error_before, 0.1) << summary;
  EXPECT_LT(c.error_after, 0.02) << summary;
  for (const auto& [key, want] : std::vector<std::pair<std::string, double>>{
           {"nvlink.efficiency", 0.62}, {"nccl.latency_scale", 1.3}, {"gpu.launch_overhead_us", 25}}) {
    const ParameterFit* f = c.find(key);
    ASSERT_NE(f, nullptr) << key;
    EXPECT_TRUE(f->fitted) << key << "\n" << summary;
    EXPECT_NEAR(f->after, want, 0.02 * want) << key << "\n" << summary;
  }
  // Written as a file, the fit loads: dgx-a100.toml has no [nccl] table, so the fit adds one.
  const std::string text = fitted_profile_text(read_text(profile.source_file), c, "dgx-a100-fitted",
                                               "all_reduce_perf.log", "2030-01-02");
  const Profile fitted = parse_profile(text, "dgx-a100-fitted.toml");
  EXPECT_NEAR(fitted.nccl.latency_scale, 1.3, 0.02 * 1.3) << text;
  EXPECT_NEAR(fitted.gpu.launch_overhead_us, 25, 0.02 * 25) << text;
  EXPECT_TRUE(contains(text,
                       "\n[nccl]\n# Fitted by `ranklab calibrate` on 2030-01-02 to all_reduce_perf.log (56 "
                       "collectives); was 1.0.\nlatency_scale = "))
      << text;
  EXPECT_LT(compare_reports(measured, replay_of(measured)(fitted)).error, 0.02);
}

TEST(Calibrate, NothingToFitIsAnError) {
  const Profile profile = load_profile("dgx-h100");
  RunReport empty;
  empty.lesson = "nothing";
  EXPECT_THROW(calibrate(empty, profile, simulate), UsageError);
  EXPECT_THROW(calibrate(simulate(profile), profile, Simulate()), UsageError);
}

TEST(FittedProfileText, ReplacesAddsAndRecords) {
  const std::string original =
      "# a profile\n"
      "name = \"lab\"\n"
      "description = \"the lab's machine\"\n"
      "gpus_per_node = 2\n"
      "barrier_latency_us = 5.0\n"
      "\n"
      "[gpu]\n"
      "name = \"G\"\n"
      "peak_tflops_fp32 = 10.0\n"
      "peak_tflops_tf32 = 10.0\n"
      "peak_tflops_bf16 = 10.0\n"
      "hbm_bandwidth_gbps = 100.0\n"
      "hbm_capacity_gib = 8.0\n"
      "launch_overhead_us = 1.0\n"
      "compute_efficiency = 0.9   # a guess\n"
      "\n"
      "[pcie]\n"
      "generation = \"PCIe 4.0 x16\"\n"
      "bandwidth_gbps = 31.5\n"
      "latency_us = 1.0\n"
      "\n"
      "[nic]\n"
      "name = \"N\"\n"
      "count = 1\n"
      "bandwidth_gbps = 12.5\n"
      "latency_us = 2.0\n"
      "\n"
      "[fabric]\n"
      "kind = \"roce\"\n"
      "switch = \"S\"\n"
      "switch_radix = 32\n"
      "switch_latency_us = 0.5\n";
  const Profile before = parse_profile(original, "lab.toml");
  Calibration c;
  c.profile = before;
  c.collectives = 12;
  c.kernels = 3;
  c.error_before = 0.4;
  c.error_after = 0.01;
  c.fits = {{"gpu.compute_efficiency", 0.9, 0.61234, 0, 3, true, ""},
            {"gpu.memory_efficiency", 1.0, 0.75, 0, 3, true, ""},
            {"pcie.efficiency", 1.0, 0.8, 12, 0, true, ""},
            {"pcie.latency_us", 1.0, 0.0, 12, 1, true, "fitted below 0 and set to 0"},
            {"nic.efficiency", 1.0, 1.0, 0, 0, false, "no collective or kernel of the report depends on it"}};
  const std::string text = fitted_profile_text(original, c, "lab-fitted", "runs/measured.json", "2030-01-02");
  const Profile after = parse_profile(text, "lab-fitted.toml");
  EXPECT_EQ(after.name, "lab-fitted");
  EXPECT_EQ(after.description, "the lab's machine (calibrated on 2030-01-02 to runs/measured.json)");
  EXPECT_DOUBLE_EQ(after.gpu.compute_efficiency, 0.6123);  // four significant digits
  EXPECT_DOUBLE_EQ(after.gpu.memory_efficiency, 0.75);     // added to [gpu], where it was missing
  EXPECT_DOUBLE_EQ(after.pcie.efficiency, 0.8);
  EXPECT_DOUBLE_EQ(after.pcie.latency_us, 0.0);
  EXPECT_DOUBLE_EQ(after.nic.efficiency, before.nic.efficiency);  // not fitted: untouched
  EXPECT_DOUBLE_EQ(after.nic.latency_us, 2.0);
  EXPECT_TRUE(contains(text,
                       "# Fitted by `ranklab calibrate` on 2030-01-02 to runs/measured.json (3 kernels); was "
                       "0.9.\ncompute_efficiency = 0.6123\n"))
      << text;
  EXPECT_TRUE(contains(
      text, "(12 collectives and 1 kernel; fitted below 0 and set to 0); was 1.0.\nlatency_us = 0.0\n"))
      << text;
  EXPECT_TRUE(contains(text, "error went from 40.0% to 1.0%")) << text;
  EXPECT_FALSE(contains(text, "# a guess"));   // the replaced line's own comment goes with it
  EXPECT_TRUE(contains(text, "# a profile"));  // everything else stays
}

}  // namespace
}  // namespace ranklab
