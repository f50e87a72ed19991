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
    R"([intra_node])",                    // 17
    R"(name = "nvlink")",                 // 18
    R"(bandwidth_gbps = 100.0)",          // 19
    R"(latency_us = 1.0)",                // 20
    R"()",                                // 21
    R"([inter_node])",                    // 22
    R"(name = "infiniband")",             // 23
    R"(bandwidth_gbps = 25.0)",           // 24
    R"(latency_us = 3.0)",                // 25
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
  ASSERT_GE(names.size(), 2u);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(std::find(names.begin(), names.end(), "dgx-h100"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "pcie-4gpu"), names.end());
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    Profile p = load_profile(name);
    EXPECT_EQ(p.name, name) << "a profile's name should match its file name";
    EXPECT_FALSE(p.description.empty());
    EXPECT_EQ(fs::path(p.source_file).filename(), name + ".toml");
    EXPECT_GT(p.gpu.peak_tflops_bf16, p.gpu.peak_tflops_fp32);
    EXPECT_GT(p.intra_node.bandwidth_gbps, p.inter_node.bandwidth_gbps);
    EXPECT_EQ(p.nodes, 1);
    EXPECT_GE(p.gpus_per_node, 1);
  }
}

TEST_F(ProfileTest, DgxH100Numbers) {
  Profile p = load_profile("dgx-h100");
  EXPECT_EQ(p.gpus_per_node, 8);
  EXPECT_EQ(p.max_world(), 8);
  EXPECT_DOUBLE_EQ(p.gpu.peak_tflops_bf16, 989.4);
  EXPECT_DOUBLE_EQ(p.gpu.hbm_bandwidth_gbps, 3350.0);
  EXPECT_EQ(p.intra_node.name, "nvlink");
  EXPECT_DOUBLE_EQ(p.intra_node.bandwidth_gbps, 450.0);
  EXPECT_EQ(p.inter_node.name, "infiniband");
  EXPECT_DOUBLE_EQ(p.inter_node.bandwidth_gbps, 50.0);
  EXPECT_EQ(p.hbm_capacity_bytes(), std::llround(79.6 * 1073741824.0));
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
  EXPECT_EQ(p.intra_node.name, "nvlink");
  EXPECT_DOUBLE_EQ(p.intra_node.bandwidth_gbps, 100.0);
  EXPECT_DOUBLE_EQ(p.intra_node.latency_us, 1.0);
  EXPECT_EQ(p.inter_node.name, "infiniband");
  EXPECT_DOUBLE_EQ(p.inter_node.bandwidth_gbps, 25.0);
  EXPECT_DOUBLE_EQ(p.inter_node.latency_us, 3.0);
}

TEST_F(ProfileTest, OptionalFields) {
  // Efficiencies default to 1; description to ""; nodes to 1 but a file may set it.
  std::vector<std::string> lines = without_lines(14, 15);
  lines.erase(lines.begin() + 1);  // description
  lines.insert(lines.begin() + 1, "nodes = 3");
  Profile p = parse_profile(join(lines), "inline");
  EXPECT_DOUBLE_EQ(p.gpu.compute_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(p.gpu.memory_efficiency, 1.0);
  EXPECT_EQ(p.description, "");
  EXPECT_EQ(p.nodes, 3);
  EXPECT_EQ(p.max_world(), 12);
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
  lines.push_back("[network]");  // line 27
  lines.push_back("name = \"x\"");
  msg = error_of(lines);
  EXPECT_EQ(msg.rfind(at(27), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'network'"), std::string::npos) << msg;

  msg = error_of(with_line(20, "latency = 1.0"));
  EXPECT_EQ(msg.rfind(at(20), 0), 0u) << msg;
  EXPECT_NE(msg.find("unknown key 'intra_node.latency'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, MissingFieldNamesTheTableHeader) {
  std::string msg = error_of(without_lines(11, 11));
  EXPECT_EQ(msg.rfind(at(6), 0), 0u) << msg;
  EXPECT_NE(msg.find("[gpu] is missing 'hbm_bandwidth_gbps'"), std::string::npos) << msg;

  msg = error_of(without_lines(24, 24));
  EXPECT_EQ(msg.rfind(at(22), 0), 0u) << msg;
  EXPECT_NE(msg.find("[inter_node] is missing 'bandwidth_gbps'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, MissingTopLevelFieldOrTable) {
  std::string msg = error_of(without_lines(21, 25));
  EXPECT_EQ(msg.rfind(at(1), 0), 0u) << msg;
  EXPECT_NE(msg.find("missing 'inter_node'"), std::string::npos) << msg;

  msg = error_of(without_lines(1, 1));
  EXPECT_NE(msg.find("missing 'name'"), std::string::npos) << msg;
}

TEST_F(ProfileTest, WrongTypes) {
  std::string msg = error_of(with_line(19, R"(bandwidth_gbps = "fast")"));
  EXPECT_EQ(msg.rfind(at(19), 0), 0u) << msg;
  EXPECT_NE(msg.find("'intra_node.bandwidth_gbps' must be a number, got a string"), std::string::npos) << msg;

  msg = error_of(with_line(3, "gpus_per_node = 2.5"));
  EXPECT_EQ(msg.rfind(at(3), 0), 0u) << msg;
  EXPECT_NE(msg.find("must be an integer"), std::string::npos) << msg;

  msg = error_of(with_line(7, "name = 7"));
  EXPECT_EQ(msg.rfind(at(7), 0), 0u) << msg;
  EXPECT_NE(msg.find("'gpu.name' must be a string"), std::string::npos) << msg;

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
      {24, "bandwidth_gbps = -25.0", "'inter_node.bandwidth_gbps' must be greater than 0, got -25"},
      {19, "bandwidth_gbps = 0", "'intra_node.bandwidth_gbps' must be greater than 0"},
      {12, "hbm_capacity_gib = 0", "'gpu.hbm_capacity_gib' must be greater than 0"},
      {8, "peak_tflops_fp32 = -1", "'gpu.peak_tflops_fp32' must be greater than 0"},
      {11, "hbm_bandwidth_gbps = 0.0", "'gpu.hbm_bandwidth_gbps' must be greater than 0"},
      {14, "compute_efficiency = 1.5", "'gpu.compute_efficiency' must be in (0, 1], got 1.5"},
      {15, "memory_efficiency = 0", "'gpu.memory_efficiency' must be in (0, 1]"},
      {3, "gpus_per_node = 0", "'gpus_per_node' must be at least 1, got 0"},
      {20, "latency_us = -1", "'intra_node.latency_us' must not be negative"},
      {13, "launch_overhead_us = -0.5", "'gpu.launch_overhead_us' must not be negative"},
      {8, "peak_tflops_fp32 = nan", "'gpu.peak_tflops_fp32' must be finite"},
      {18, R"(name = "")", "'intra_node.name' must not be empty"},
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
