// A program that tunes its allocator as `ranklab` does, then reports what it runs with: the GLIBC_TUNABLES
// it was executed again with, and how many freed blocks sit in glibc's fast bins after a wave of frees
// larger than the thread cache (tests/test_malloc_tuning.cc reads both).
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sim/malloc_tuning.h"

int main(int, char** argv) {
  ranklab::sim::tune_malloc(argv);
  // 5,000 blocks of 48 bytes: more than the tuned cache's 2,000 of one size, so the rest go to the fast
  // bins unless they are off.
  std::vector<void*> blocks;
  for (int i = 0; i < 5000; ++i) blocks.push_back(std::malloc(48));
  for (void* b : blocks) std::free(b);
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  std::printf("tunables=%s\nfast_bin_blocks=%zu\n", tunables ? tunables : "", mallinfo2().smblks);
  return 0;
}
