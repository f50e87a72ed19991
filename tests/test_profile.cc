#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/profile.h"

namespace ranklab {
namespace {

namespace fs = std::filesystem;

// A valid profile, one entry per line, so a test can name the line it breaks. Line numbers start at 1.
const std::vector<std::string> kGood = {
    R"(name = "test")",                   // 1
    R"(description = "a test profile")",  // 2
    R"(gpus_per_node = 4)",               // 3
    R"(barrier_latency_us = 2.0)",        // 4
    R"()",                                // 5
    R"([gpu])",                           // 6
    R"(name = "g")",                      // 7
    R"(peak_tflops_fp32 = 10.0)",         // 8
    R"(peak_tflops_tf32 = 20.0)",         // 9
    R"(peak_tflops_bf16 = 40)",           // 10  an integer where a float is expected: allowed
    R"(hbm_bandwidth_gbps = 1000.0)",     // 11
    R"(hbm_capacity_gib = 16)",           // 12
    R"(launch_overhead_us = 3.0)",        // 13
    R"(compute_efficiency = 0.5)",        // 14
    R"(memory_efficiency = 0.75)",        // 15
    R"()",                                // 16
    R"([nvlink])",                        // 17
    R"(generation = "NVLink 4")",         // 18
    R"(links_per_gpu = 4)",               // 19
    R"(link_bandwidth_gbps = 25.0)",      // 20
    R"(efficiency = 0.8)",                // 21
    R"(latency_us = 0.3)",                // 22
    R"(switch = "NVSwitch")",             // 23
    R"(nvls = true)",                     // 24
    R"()",                                // 25
    R"([pcie])",                          // 26
    R"(generation = "PCIe 4.0 x16")",     // 27
    R"(bandwidth_gbps = 31.5)",           // 28
    R"(efficiency = 0.75)",               // 29
    R"(latency_us = 0.5)",                // 30
    R"(gpus_per_switch = 2)",             // 31
    R"()",                                // 32
    R"([nic])",                           // 33
    R"(name = "ConnectX")",               // 34
    R"(count = 2)",                       // 35
    R"(bandwidth_gbps = 25.0)",           // 36
    R"(efficiency = 0.9)",                // 37
    R"(latency_us = 0.6)",                // 38
    R"()",                                // 39
    R"([fabric])",                        // 40
    R"(kind = "infiniband")",             // 41
    R"(switch = "QM")",                   // 42
    R"(switch_radix = 8)",                // 43
    R"(switch_latency_us = 0.1)",         // 44
    R"(oversubscription = 2)",            // 45
};

std::string join(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& l : lines) text += l + "\n";
  return text;
}

// kGood with line `line` (1-based) replaced by `text`.
std::vector<std::string> with_line(int line, const std::string& text) {
  std::vector<std::string> lines = kGood;
  lines.at(line - 1) = text;
  return lines;
}

// kGood without lines [first, last] (1-based, inclusive).
std::vector<std::string> without_lines(int first, int last) {
  std::vector<std::string> lines = kGood;
  lines.erase(lines.begin() + (first - 1), lines.begin() + last);
  return lines;
}

class ProfileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The built-in profiles, and nothing a developer's shell happens to point at.
    if (const char* env = std::getenv("RANKLAB_PROFILE_DIR")) saved_env_ = env;
    unsetenv("RANKLAB_PROFILE_DIR");
    dir_ =
        fs::temp_directory_path() / fs::path("ranklab_test_profile_" + std::to_string(getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (saved_env_) {
      setenv("RANKLAB_PROFILE_DIR", saved_env_->c_str(), 1);
    } else {
      unsetenv("RANKLAB_PROFILE_DIR");
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string write(const std::string& file_name, const std::string& text) {
    fs::path p = dir_ / file_name;
    std::ofstream(p) << text;
    return p.string();
  }

  // Loads `lines` from a file and returns the ProfileError message; fails the test if none is raised.
  std::string error_of(const std::vector<std::string>& lines) {
    std::string path = write("bad.toml", join(lines));
    try {
      load_profile_file(path);
    } catch (const ProfileError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no ProfileError for:\n" << join(lines);
    return "";
  }

  std::string bad_path() const { return (dir_ / "bad.toml").string(); }
  // "FILE:LINE: " as every located error starts.
  std::string at(int line) const { return bad_path() + ":" + std::to_string(line) + ": "; }

  fs::path dir_;
  std::optional<std::string> saved_env_;
};

TEST_F(ProfileTest, EveryBuiltInProfileLoads) {
  std::vector<std::string> names = list_profiles();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const char* want :
       {"dgx-a100", "dgx-h100", "dgx-h100-roce", "dgx-h200", "dgx-b200", "gb200-nvl72", "pcie-4gpu"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  }
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    Profile p = load_profile(name);
    EXPECT_EQ(p.name, name) << "a profile's name should match its file name";
    EXPECT_FALSE(p.description.empty());
    EXPECT_EQ(fs::path(p.source_file).filename(), name + ".toml");
    EXPECT_GT(p.gpu.peak_tflops_bf16, p.gpu.peak_tflops_fp32);
    // The hierarchy of the lecture: a GPU's link inside the node is faster than its share of the network.
    const double intra_gbps = p.has_nvlink ? p.nvlink.gpu_bandwidth_gbps() : p.pcie.bandwidth_gbps;
    EXPECT_GT(intra_gbps, p.nic.bandwidth_gbps * p.nic.count / p.gpus_per_node);
    EXPECT_EQ(p.gpus_per_node % p.nic.count, 0);
    EXPECT_EQ(p.gpus_per_node % p.pcie.gpus_per_switch, 0);
    EXPECT_EQ(p.nodes, 1);
  }
}

TEST_F(ProfileTest, DgxH100Numbers) {
  Profile p = load_profile("dgx-h100");
  EXPECT_EQ(p.gpus_per_node, 8);
  EXPECT_EQ(p.max_world(), 8);
  EXPECT_DOUBLE_EQ(p.gpu.peak_tflops_bf16, 989.4);
  EXPECT_DOUBLE_EQ(p.gpu.hbm_bandwidth_gbps, 3350.0);
  ASSERT_TRUE(p.has_nvlink);
  EXPECT_EQ(p.nvlink.links_per_gpu, 18);
  EXPECT_DOUBLE_EQ(p.nvlink.gpu_bandwidth_gbps(), 450.0);
  EXPECT_DOUBLE_EQ(p.nvlink.efficiency, 0.824);
  EXPECT_TRUE(p.nvlink.nvls);
  EXPECT_EQ(p.nic.count, 8);
  EXPECT_DOUBLE_EQ(p.nic.bandwidth_gbps, 50.0);
  EXPECT_EQ(p.fabric.kind, "infiniband");
  EXPECT_EQ(p.fabric.switch_radix, 64);
  EXPECT_EQ(p.hbm_capacity_bytes(), std::llround(79.6 * 1073741824.0));
}

TEST_F(ProfileTest, ProfilesBuiltOnABase) {
  // dgx-h200 changes the GPU of dgx-h100; dgx-h100-roce its NICs and fabric. The rest comes from the base.
  const Profile h100 = load_profile("dgx-h100");
  const Profile h200 = load_profile("dgx-h200");
  EXPECT_EQ(h200.name, "dgx-h200");
  EXPECT_DOUBLE_EQ(h200.gpu.hbm_bandwidth_gbps, 4800.0);
  EXPECT_DOUBLE_EQ(h200.gpu.launch_overhead_us, h100.gpu.launch_overhead_us);
  EXPECT_DOUBLE_EQ(h200.nvlink.gpu_bandwidth_gbps(), 450.0);
  const Profile roce = load_profile("dgx-h100-roce");
  EXPECT_EQ(roce.fabric.kind, "roce");
  EXPECT_LT(roce.nic.efficiency, h100.nic.efficiency);
  EXPECT_DOUBLE_EQ(roce.nic.bandwidth_gbps, h100.nic.bandwidth_gbps);
  EXPECT_EQ(roce.gpu.name, h100.gpu.name);

  Profile nvl72 = load_profile("gb200-nvl72");
  EXPECT_EQ(nvl72.gpus_per_node, 72);
  EXPECT_FALSE(load_profile("pcie-4gpu").has_nvlink);
  EXPECT_FALSE(load_profile("dgx-a100").nvlink.nvls);
}

TEST_F(ProfileTest, ParsesEveryField) {
  Profile p = parse_profile(join(kGood), "inline");
  EXPECT_EQ(p.name, "test");
  EXPECT_EQ(p.description, "a test profile");
  EXPECT_EQ(p.source_file, "");  // parsed from text, not a file
  EXPECT_EQ(p.gpus_per_node, 4);
  EXPECT_EQ(p.nodes, 1);
  EXPECT_DOUBLE_EQ(p.barrier_latency_us, 2.0);
  EXPECT_EQ(p.gpu.name, "g");
  EXPECT_DOUBLE_EQ(p.gpu.peak_tflops_fp32, 10.0);
  EXPECT_DOUBLE_EQ(p.gpu.peak_tflops_tf32, 20.0);
  EXPECT_DOUBLE_EQ(p.gpu.peak_tflops_bf16, 40.0);
  EXPECT_DOUBLE_EQ(p.gpu.hbm_bandwidth_gbps, 1000.0);
  EXPECT_DOUBLE_EQ(p.gpu.hbm_capacity_gib, 16.0);
  EXPECT_EQ(p.hbm_capacity_bytes(), std::int64_t{16} << 30);
  EXPECT_DOUBLE_EQ(p.gpu.launch_overhead_us, 3.0);
  EXPECT_DOUBLE_EQ(p.gpu.compute_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(p.gpu.memory_efficiency, 0.75);
  EXPECT_TRUE(p.has_nvlink);
  EXPECT_EQ(p.nvlink.generation, "NVLink 4");
  EXPECT_EQ(p.nvlink.links_per_gpu, 4);
  EXPECT_DOUBLE_EQ(p.nvlink.link_bandwidth_gbps, 25.0);
  EXPECT_DOUBLE_EQ(p.nvlink.gpu_bandwidth_gbps(), 100.0);
  EXPECT_DOUBLE_EQ(p.nvlink.efficiency, 0.8);
  EXPECT_DOUBLE_EQ(p.nvlink.latency_us, 0.3);
  EXPECT_EQ(p.nvlink.switch_name, "NVSwitch");
  EXPECT_TRUE(p.nvlink.nvls);
  EXPECT_EQ(p.pcie.generation, "PCIe 4.0 x16");
  EXPECT_DOUBLE_EQ(p.pcie.bandwidth_gbps, 31.5);
  EXPECT_DOUBLE_EQ(p.pcie.efficiency, 0.75);
  EXPECT_DOUBLE_EQ(p.pcie.latency_us, 0.5);
  EXPECT_EQ(p.pcie.gpus_per_switch, 2);
  EXPECT_EQ(p.nic.name, "ConnectX");
  EXPECT_EQ(p.nic.count, 2);
  EXPECT_DOUBLE_EQ(p.nic.bandwidth_gbps, 25.0);
  EXPECT_DOUBLE_EQ(p.nic.efficiency, 0.9);
  EXPECT_DOUBLE_EQ(p.nic.latency_us, 0.6);
  EXPECT_EQ(p.fabric.kind, "infiniband");
  EXPECT_EQ(p.fabric.switch_name, "QM");
  EXPECT_EQ(p.fabric.switch_radix, 8);
  EXPECT_DOUBLE_EQ(p.fabric.switch_latency_us, 0.1);
  EXPECT_DOUBLE_EQ(p.fabric.oversubscription, 2.0);
}

TEST_F(ProfileTest, OptionalFields) {
  // Efficiencies default to 1; description to ""; nodes to 1 but a file may set it; gpus_per_switch to 1;
  // oversubscription to 1; nvls to false; no [nvlink] table means no NVLink.
  std::vector<std::string> lines = kGood;
  for (int line : {45, 37, 31, 29, 24, 21, 15, 14}) lines.erase(lines.begin() + (line - 1));
  lines.erase(lines.begin() + 1);  // description
  lines.insert(lines.begin() + 1, "nodes = 3");
  Profile p = parse_profile(join(lines), "inline");
  EXPECT_DOUBLE_EQ(p.gpu.compute_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(p.gpu.memory_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(p.nvlink.efficiency, 1.0);
  EXPECT_FALSE(p.nvlink.nvls);
  EXPECT_DOUBLE_EQ(p.pcie.efficiency, 1.0);
  EXPECT_EQ(p.pcie.gpus_per_switch, 1);
  EXPECT_DOUBLE_EQ(p.nic.efficiency, 1.0);
  EXPECT_DOUBLE_EQ(p.fabric.oversubscription, 1.0);
  EXPECT_EQ(p.description, "");
  EXPECT_EQ(p.nodes, 3);
  EXPECT_EQ(p.max_world(), 12);

  Profile no_nvlink = parse_profile(join(without_lines(17, 25)), "inline");
  EXPECT_FALSE(no_nvlink.has_nvlink);
}

TEST_F(ProfileTest, NcclLatencyScale) {
  // Without an [nccl] table the machine's collective latency is NCCL's prediction.
  EXPECT_DOUBLE_EQ(parse_profile(join(kGood), "inline").nccl.latency_scale, 1.0);
  std::vector<std::string> lines = kGood;
  lines.push_back("");
  lines.push_back("[nccl]");               // line 47
  lines.push_back("latency_scale = 1.5");  // line 48
  EXPECT_DOUBLE_EQ(parse_profile(join(lines), "inline").nccl.latency_scale, 1.5);
  for (const auto& [text, expect] : std::vector<std::pair<std::string, std::string>>{
           {"latency_scale = 0", "'nccl.latency_scale' must be at least 0.01, got 0"},
           {"latency_scale = -1", "'nccl.latency_scale' must be at least 0.01, got -1"},
           {"latency_scale = 1e9", "'nccl.latency_scale' must be at most 100, got 1000000000"},
           {"latency_scale = nan", "'nccl.latency_scale' must be finite"},
           {"latency = 1.0", "unknown key 'nccl.latency'"}}) {
    SCOPED_TRACE(text);
    lines.back() = text;
    const std::string msg = error_of(lines);
    EXPECT_EQ(msg.rfind(at(48), 0), 0u) << msg;
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
  }
}

TEST_F(ProfileTest, SyntaxErrorNamesFileAndLine) {
  std::string msg = error_of(with_line(9, "peak_tflops_tf32 = = 20.0"));
  EXPECT_EQ(msg.rfind(at(9), 0), 0u) << msg;
}

TEST_F(ProfileTest, DuplicateKeyIsAnError) {
  std::vector<std::string> lines = kGood;
  lines.insert(lines.begin() + 8, "peak_tflops_fp32 = 11.0");  // becomes line 9, repeating line 8
  std::string msg = error_of(lines);
  EXPECT_EQ(msg.rfind(at(9), 0), 0u) << msg;
}

TEST_F(ProfileTest, UnknownKeyInATable) {
  std::string msg = error_of(with_line(8, "peak_tflop_fp32 = 10.0"));
  EXPECT_EQ(msg.rfind(at(8), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'gpu.peak_tflop_fp32'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'gpu.peak_tflops_fp32'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("known keys of [gpu]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hbm_bandwidth_gbps"), std::string::npos) << msg;
}

TEST_F(ProfileTest, UnknownTopLevelKeyAndTable) {
  std::string msg = error_of(with_line(2, R"(descripton = "x")"));
  EXPECT_EQ(msg.rfind(at(2), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'descripton'"), std::string::npos) << msg;

  std::vector<std::string> lines = kGood;
  lines.push_back("");
  lines.push_back("[network]");  // line 47
  lines.push_back("name = \"x\"");
  msg = error_of(lines);
  EXPECT_EQ(msg.rfind(at(47), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'network'"), std::string::npos) << msg;

  msg = error_of(with_line(22, "latency = 1.0"));
  EXPECT_EQ(msg.rfind(at(22), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'nvlink.latency'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, MissingFieldNamesTheTableHeader) {
  std::string msg = error_of(without_lines(11, 11));
  EXPECT_EQ(msg.rfind(at(6), 0), 0u) << msg;
  EXPECT_NE(msg.find("[gpu] is missing 'hbm_bandwidth_gbps'"), std::string::npos) << msg;

  msg = error_of(without_lines(36, 36));
  EXPECT_EQ(msg.rfind(at(33), 0), 0u) << msg;
  EXPECT_NE(msg.find("[nic] is missing 'bandwidth_gbps'"), std::string::npos) << msg;

  msg = error_of(without_lines(20, 20));
  EXPECT_EQ(msg.rfind(at(17), 0), 0u) << msg;
  EXPECT_NE(msg.find("[nvlink] is missing 'link_bandwidth_gbps'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, MissingTopLevelFieldOrTable) {
  std::string msg = error_of(without_lines(39, 45));
  EXPECT_EQ(msg.rfind(at(1), 0), 0u) << msg;
  EXPECT_NE(msg.find("missing 'fabric'"), std::string::npos) << msg;

  msg = error_of(without_lines(1, 1));
  EXPECT_NE(msg.find("missing 'name'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, WrongTypes) {
  std::string msg = error_of(with_line(28, R"(bandwidth_gbps = "fast")"));
  EXPECT_EQ(msg.rfind(at(28), 0), 0u) << msg;
  EXPECT_NE(msg.find("'pcie.bandwidth_gbps' must be a number, got a string"), std::string::npos) << msg;

  msg = error_of(with_line(3, "gpus_per_node = 2.5"));
  EXPECT_EQ(msg.rfind(at(3), 0), 0u) << msg;
  EXPECT_NE(msg.find("must be an integer"), std::string::npos) << msg;

  msg = error_of(with_line(7, "name = 7"));
  EXPECT_EQ(msg.rfind(at(7), 0), 0u) << msg;
  EXPECT_NE(msg.find("'gpu.name' must be a string"), std::string::npos) << msg;

  msg = error_of(with_line(24, "nvls = 1"));
  EXPECT_EQ(msg.rfind(at(24), 0), 0u) << msg;
  EXPECT_NE(msg.find("'nvlink.nvls' must be a boolean"), std::string::npos) << msg;

  msg = error_of(with_line(6, "gpu = 3"));    // the [gpu] keys that follow now belong to the top level
  EXPECT_EQ(msg.rfind(at(7), 0), 0u) << msg;  // first complaint: the stray key 'name' again at the top
}

TEST_F(ProfileTest, ValuesOutOfRange) {
  struct Case {
    int line;
    std::string text;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {36, "bandwidth_gbps = -25.0", "'nic.bandwidth_gbps' must be greater than 0, got -25"},
      {20, "link_bandwidth_gbps = 0", "'nvlink.link_bandwidth_gbps' must be greater than 0"},
      {28, "bandwidth_gbps = -1", "'pcie.bandwidth_gbps' must be greater than 0, got -1"},
      {12, "hbm_capacity_gib = 0", "'gpu.hbm_capacity_gib' must be greater than 0"},
      {8, "peak_tflops_fp32 = -1", "'gpu.peak_tflops_fp32' must be greater than 0"},
      {11, "hbm_bandwidth_gbps = 0.0", "'gpu.hbm_bandwidth_gbps' must be greater than 0"},
      {14, "compute_efficiency = 1.5", "'gpu.compute_efficiency' must be in (0, 1], got 1.5"},
      {15, "memory_efficiency = 0", "'gpu.memory_efficiency' must be in (0, 1]"},
      {21, "efficiency = 1.2", "'nvlink.efficiency' must be in (0, 1], got 1.2"},
      {3, "gpus_per_node = 0", "'gpus_per_node' must be at least 1, got 0"},
      {19, "links_per_gpu = 0", "'nvlink.links_per_gpu' must be at least 1, got 0"},
      {22, "latency_us = -1", "'nvlink.latency_us' must not be negative"},
      {44, "switch_latency_us = -0.1", "'fabric.switch_latency_us' must not be negative"},
      {43, "switch_radix = 1", "'fabric.switch_radix' must be at least 2, got 1"},
      {45, "oversubscription = 0.5", "'fabric.oversubscription' must be at least 1, got 0.5"},
      {41, R"(kind = "ethernet")", "'fabric.kind' must be one of infiniband, roce, got \"ethernet\""},
      {13, "launch_overhead_us = -0.5", "'gpu.launch_overhead_us' must not be negative"},
      {8, "peak_tflops_fp32 = nan", "'gpu.peak_tflops_fp32' must be finite"},
      {34, R"(name = "")", "'nic.name' must not be empty"},
      // Legal TOML, absurd values: each would hang the clock, make a transfer last forever or overflow a
      // byte count.
      {13, "launch_overhead_us = 1e308", "'gpu.launch_overhead_us' must be at most 1000000, got 1e+308"},
      {4, "barrier_latency_us = 1e308", "'barrier_latency_us' must be at most 1000000"},
      {11, "hbm_bandwidth_gbps = 4.9e-324", "'gpu.hbm_bandwidth_gbps' must be at least 0.001"},
      {12, "hbm_capacity_gib = 1e300", "'gpu.hbm_capacity_gib' must be at most 1000000"},
      {22, "latency_us = 1e300", "'nvlink.latency_us' must be at most 1000000"},
      {36, "bandwidth_gbps = 1e300", "'nic.bandwidth_gbps' must be at most 1000000"},
      {45, "oversubscription = 1e300", "'fabric.oversubscription' must be at most 1000"},
      {3, "gpus_per_node = 9223372036854775807", "'gpus_per_node' must be at most 4096"},
      {43, "switch_radix = 100000000", "'fabric.switch_radix' must be at most 65536"},
      {5, "nodes = 1000000", "'nodes' must be at most 65536"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    std::string msg = error_of(with_line(c.line, c.text));
    EXPECT_EQ(msg.rfind(at(c.line), 0), 0u) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
  // Efficiency exactly 1 is allowed: the hardware's peak.
  EXPECT_NO_THROW(parse_profile(join(with_line(14, "compute_efficiency = 1")), "inline"));
}

TEST_F(ProfileTest, NodesRecordsWhereItWasSet) {
  EXPECT_EQ(parse_profile(join(kGood), "inline").nodes_at, "");
  const Profile p = parse_profile(join(with_line(5, "nodes = 2")), "inline");
  EXPECT_EQ(p.nodes, 2);
  EXPECT_EQ(p.nodes_at, "inline:5");
}

TEST_F(ProfileTest, InconsistentGpuCounts) {
  // 4 GPUs cannot be spread evenly over 3 NICs or behind PCIe switches of 3.
  std::string msg = error_of(with_line(35, "count = 3"));
  EXPECT_EQ(msg.rfind(at(35), 0), 0u) << msg;
  EXPECT_NE(msg.find("'nic.count' = 3 does not divide gpus_per_node = 4"), std::string::npos) << msg;

  msg = error_of(with_line(35, "count = 8"));  // more NICs than GPUs
  EXPECT_EQ(msg.rfind(at(35), 0), 0u) << msg;
  EXPECT_NE(msg.find("'nic.count' = 8 does not divide gpus_per_node = 4"), std::string::npos) << msg;

  msg = error_of(with_line(31, "gpus_per_switch = 3"));
  EXPECT_EQ(msg.rfind(at(31), 0), 0u) << msg;
  EXPECT_NE(msg.find("'pcie.gpus_per_switch' = 3 does not divide gpus_per_node = 4"), std::string::npos)
      << msg;

  // Changing gpus_per_node instead reports the line of the count it no longer fits.
  msg = error_of(with_line(3, "gpus_per_node = 5"));
  EXPECT_EQ(msg.rfind(at(31), 0), 0u) << msg;
  EXPECT_NE(msg.find("does not divide gpus_per_node = 5"), std::string::npos) << msg;
}

TEST_F(ProfileTest, BaseProfileErrorsNameTheirOwnFile) {
  write("base.toml", join(kGood));
  // A child that changes one number.
  std::string child = write("child.toml", "base = \"base\"\nname = \"child\"\n\n[nic]\nefficiency = 0.5\n");
  Profile p = load_profile_file(child);
  EXPECT_EQ(p.name, "child");
  EXPECT_EQ(p.source_file, child);
  EXPECT_DOUBLE_EQ(p.nic.efficiency, 0.5);
  EXPECT_DOUBLE_EQ(p.nic.bandwidth_gbps, 25.0);  // from the base
  EXPECT_EQ(p.gpu.name, "g");

  // An error in the child names the child's file and line; one in the base, the base's.
  std::string bad_child = write("bad_child.toml", "base = \"base\"\nname = \"c\"\n[nic]\nefficency = 0.5\n");
  try {
    load_profile_file(bad_child);
    ADD_FAILURE() << "no ProfileError";
  } catch (const ProfileError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(bad_child + ":4: ", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("did you mean 'nic.efficiency'"), std::string::npos) << e.what();
  }
  write("bad_base.toml", join(with_line(36, "bandwidth_gbps = -25.0")));
  std::string on_bad_base = write("on_bad_base.toml", "base = \"bad_base\"\nname = \"c\"\n");
  try {
    load_profile_file(on_bad_base);
    ADD_FAILURE() << "no ProfileError";
  } catch (const ProfileError& e) {
    EXPECT_EQ(std::string(e.what()).rfind((dir_ / "bad_base.toml").string() + ":36: ", 0), 0u) << e.what();
  }
  // A child must name itself, and its base must exist.
  std::string unnamed = write("unnamed.toml", "base = \"base\"\n");
  EXPECT_THROW(load_profile_file(unnamed), ProfileError);
  std::string orphan = write("orphan.toml", "name = \"o\"\nbase = \"no-such-base\"\n");
  try {
    load_profile_file(orphan);
    ADD_FAILURE() << "no ProfileError";
  } catch (const ProfileError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(orphan + ":2: ", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("no such profile"), std::string::npos) << e.what();
  }
  // A base that is (indirectly) itself.
  std::string loop = write("loop.toml", "name = \"loop\"\nbase = \"loop\"\n");
  EXPECT_THROW(load_profile_file(loop), ProfileError);
}

TEST_F(ProfileTest, ParseProfileUsesTheOriginInMessages) {
  try {
    parse_profile(join(with_line(12, "hbm_capacity_gib = -1")), "my-origin");
    FAIL() << "expected ProfileError";
  } catch (const ProfileError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("my-origin:12: ", 0), 0u) << e.what();
  }
}

TEST_F(ProfileTest, UnknownNameListsAvailableProfiles) {
  try {
    load_profile("no-such-profile");
    FAIL() << "expected ProfileError";
  } catch (const ProfileError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'no-such-profile'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dgx-h100"), std::string::npos) << msg;
    EXPECT_NE(msg.find("pcie-4gpu"), std::string::npos) << msg;
  }
  EXPECT_THROW(load_profile((dir_ / "missing.toml").string()), ProfileError);
  EXPECT_THROW(load_profile_file((dir_ / "missing.toml").string()), ProfileError);
}

TEST_F(ProfileTest, LoadsByPathAndByFileName) {
  std::string path = write("mine.toml", join(kGood));
  Profile p = load_profile(path);
  EXPECT_EQ(p.name, "test");
  EXPECT_EQ(p.source_file, path);

  Profile q = load_profile("dgx-h100.toml");
  EXPECT_EQ(q.name, "dgx-h100");
}

TEST_F(ProfileTest, EnvironmentDirectoriesComeFirst) {
  fs::path a = dir_ / "a", b = dir_ / "b";
  fs::create_directories(a);
  fs::create_directories(b);
  std::ofstream(b / "custom.toml") << join(kGood);
  // A user's own dgx-h100 shadows the built-in one.
  std::ofstream(a / "dgx-h100.toml") << join(with_line(1, R"(name = "shadow")"));
  std::string env = a.string() + "::" + b.string() + ":" + (dir_ / "does-not-exist").string();
  setenv("RANKLAB_PROFILE_DIR", env.c_str(), 1);

  std::vector<std::string> dirs = profile_dirs();
  ASSERT_GE(dirs.size(), 4u);
  EXPECT_EQ(dirs[0], a.string());
  EXPECT_EQ(dirs[1], b.string());

  EXPECT_EQ(load_profile("custom").name, "test");
  EXPECT_EQ(load_profile("dgx-h100").name, "shadow");
  EXPECT_EQ(load_profile("pcie-4gpu").name, "pcie-4gpu");  // still found in the built-in directory

  std::vector<std::string> names = list_profiles();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(std::count(names.begin(), names.end(), "dgx-h100"), 1);
  EXPECT_NE(std::find(names.begin(), names.end(), "custom"), names.end());
}

}  // namespace
}  // namespace ranklab

namespace ranklab {
namespace {

TEST(ProfileForGpu, NamesAsDevicesReportThem) {
  // As nvidia-smi, the CUDA runtime and nccl-tests print them.
  EXPECT_EQ(profile_for_gpu("NVIDIA H100 80GB HBM3"), "dgx-h100");
  EXPECT_EQ(profile_for_gpu("NVIDIA A100-SXM4-80GB"), "dgx-a100");
  EXPECT_EQ(profile_for_gpu("NVIDIA A100 80GB PCIe"), "pcie-4gpu");
  EXPECT_EQ(profile_for_gpu("NVIDIA H200"), "dgx-h200");
  EXPECT_EQ(profile_for_gpu("NVIDIA B200"), "dgx-b200");
  EXPECT_EQ(profile_for_gpu("NVIDIA GB200"), "gb200-nvl72");
  EXPECT_EQ(profile_for_gpu("Tesla V100-SXM2-32GB"), "");
  EXPECT_EQ(profile_for_gpu(""), "");
}

}  // namespace
}  // namespace ranklab
