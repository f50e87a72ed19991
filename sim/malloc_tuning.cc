#include "sim/malloc_tuning.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace ranklab::sim {

void tune_malloc(char** argv) {
#if defined(__GLIBC__) && defined(__linux__)
  if (std::getenv("RANKLAB_MALLOC_TUNED") != nullptr) return;
  const char* current = std::getenv("GLIBC_TUNABLES");
  std::string tunables = current ? current : "";
  if (tunables.find("glibc.malloc.tcache_count") != std::string::npos) return;
  tunables += (tunables.empty() ? "" : ":") + std::string("glibc.malloc.tcache_count=2000");
  setenv("GLIBC_TUNABLES", tunables.c_str(), 1);
  setenv("RANKLAB_MALLOC_TUNED", "1", 1);
  execv("/proc/self/exe", argv);
  // Not executed again (no /proc): run as is.
#else
  (void)argv;
#endif
}

}  // namespace ranklab::sim
