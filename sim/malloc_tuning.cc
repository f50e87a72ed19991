#include "sim/malloc_tuning.h"

#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>

// tcmalloc's own name for malloc: present when it serves the process.
extern "C" void* tc_malloc(std::size_t) __attribute__((weak));

namespace ranklab::sim {

bool tcmalloc_serves_malloc() {
  return tc_malloc != nullptr;
}

void tune_malloc(char** argv) {
#if defined(__GLIBC__) && defined(__linux__)
  if (tcmalloc_serves_malloc()) return;
  if (std::getenv("RANKLAB_MALLOC_TUNED") != nullptr) return;
  const char* current = std::getenv("GLIBC_TUNABLES");
  std::string tunables = current ? current : "";
  bool added = false;
  // A setting the user made is kept as it is.
  for (const char* setting : {"glibc.malloc.tcache_count=2000", "glibc.malloc.mxfast=0"}) {
    const std::string_view name = std::string_view(setting).substr(0, std::string_view(setting).find('='));
    if (tunables.find(name) != std::string::npos) continue;
    if (!tunables.empty()) tunables += ':';
    tunables += setting;
    added = true;
  }
  if (!added) return;
  setenv("GLIBC_TUNABLES", tunables.c_str(), 1);
  setenv("RANKLAB_MALLOC_TUNED", "1", 1);
  execv("/proc/self/exe", argv);
  // Not executed again (no /proc): run as is.
#else
  (void)argv;
#endif
}

}  // namespace ranklab::sim
