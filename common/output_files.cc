#include "common/output_files.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "common/errors.h"

namespace ranklab {

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  if (!f) throw UsageError(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno)));
}

void prepare_report_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UsageError(fmt::format("--report {}: cannot create the folder: {}", dir, ec.message()));
  const std::filesystem::path probe = std::filesystem::path(dir) / ".ranklab-write-test";
  {
    std::ofstream f(probe);
    if (!f)
      throw UsageError(fmt::format("--report {}: cannot write in the folder: {}", dir, std::strerror(errno)));
  }
  std::filesystem::remove(probe, ec);
}

}  // namespace ranklab
