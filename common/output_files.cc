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

namespace {
bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::error_code ec;
  if (std::filesystem::exists(a, ec) && std::filesystem::exists(b, ec)) {
    const bool same = std::filesystem::equivalent(a, b, ec);
    if (!ec) return same;
  }
  return std::filesystem::weakly_canonical(a, ec) == std::filesystem::weakly_canonical(b, ec);
}
}  // namespace

void refuse_input_as_output(const std::string& flag, const std::string& out,
                            const std::vector<std::string>& inputs) {
  for (const std::string& in : inputs) {
    if (!in.empty() && same_file(out, in)) {
      throw UsageError(fmt::format(
          "{} {}: that is a file this command reads ({}); write the output elsewhere", flag, out, in));
    }
  }
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
