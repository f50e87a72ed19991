// tune_malloc: the settings the simulator adds to glibc's allocator, what a user set kept, and the way out.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

struct Probe {
  std::string tunables;
  long fast_bin_blocks = -1;
};

// Runs the probe (tests/malloc_tuning_probe.cc) under `env` ("NAME=value ..." or empty) and reads its report.
Probe run_probe(const std::string& env) {
  const std::string command = "env -u GLIBC_TUNABLES -u RANKLAB_MALLOC_TUNED " + env + " " RANKLAB_PROBE;
  FILE* out = popen(command.c_str(), "r");
  EXPECT_NE(out, nullptr) << command;
  Probe p;
  if (out == nullptr) return p;
  std::array<char, 512> line{};
  while (std::fgets(line.data(), line.size(), out) != nullptr) {
    std::string s(line.data());
    if (!s.empty() && s.back() == '\n') s.pop_back();
    if (s.rfind("tunables=", 0) == 0) p.tunables = s.substr(9);
    if (s.rfind("fast_bin_blocks=", 0) == 0) p.fast_bin_blocks = std::stol(s.substr(16));
  }
  EXPECT_EQ(pclose(out), 0) << command;
  return p;
}

#if defined(__GLIBC__) && defined(__linux__)
constexpr bool kGlibc = true;
#else
constexpr bool kGlibc = false;
#endif
// AddressSanitizer replaces glibc's allocator: the tunables are still set, but there are no bins to count.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kGlibcAllocator = false;
#else
constexpr bool kGlibcAllocator = true;
#endif

TEST(MallocTuning, AddsTheThreadCacheAndTurnsTheFastBinsOff) {
  if (!kGlibc) GTEST_SKIP() << "tune_malloc tunes glibc only";
  const Probe p = run_probe("");
  EXPECT_EQ(p.tunables, "glibc.malloc.tcache_count=2000:glibc.malloc.mxfast=0");
  if (kGlibcAllocator) {
    EXPECT_EQ(p.fast_bin_blocks, 0);
  }
}

TEST(MallocTuning, KeepsWhatTheUserSetAndAddsTheRest) {
  if (!kGlibc) GTEST_SKIP() << "tune_malloc tunes glibc only";
  const Probe p = run_probe("GLIBC_TUNABLES=glibc.malloc.mxfast=64");
  EXPECT_EQ(p.tunables, "glibc.malloc.mxfast=64:glibc.malloc.tcache_count=2000");
  // The user's fast bins are on: what overflows the cache of 2,000 lands there.
  if (kGlibcAllocator) {
    EXPECT_GT(p.fast_bin_blocks, 2000);
  }
}

TEST(MallocTuning, RanklabMallocTunedLeavesTheAllocatorAsItIs) {
  if (!kGlibc) GTEST_SKIP() << "tune_malloc tunes glibc only";
  const Probe p = run_probe("RANKLAB_MALLOC_TUNED=1");
  EXPECT_EQ(p.tunables, "");
  // glibc's own cache holds 7 blocks of a size: nearly all of the 5,000 land in the fast bins.
  if (kGlibcAllocator) {
    EXPECT_GT(p.fast_bin_blocks, 4000);
  }
}

}  // namespace
