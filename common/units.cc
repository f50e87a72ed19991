#include "common/units.h"

#include <fmt/format.h>

#include <cmath>

namespace ranklab {

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  if (bytes == std::floor(bytes)) return fmt::format("{:.0f} {}", bytes, units[u]);
  const int decimals = std::fabs(bytes) >= 100 ? 0 : std::fabs(bytes) >= 10 ? 1 : 2;
  return fmt::format("{:.{}f} {}", bytes, decimals, units[u]);
}

std::string format_gbps(double gbps) {
  if (std::fabs(gbps) >= 1 || gbps == 0) return fmt::format("{:.1f} GB/s", gbps);
  return fmt::format("{:.1f} MB/s", gbps * 1e3);
}

}  // namespace ranklab
