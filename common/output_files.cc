#include "common/output_files.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <regex>
#include <string_view>

#include "common/errors.h"

namespace ranklab {

void write_file(const std::filesystem::path& path, const std::function<void(std::ostream&)>& fill) {
  std::ofstream f(path, std::ios::binary);
  fill(f);
  f.close();
  if (!f) throw UsageError(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno)));
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  write_file(path, [&text](std::ostream& f) { f << text; });
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

bool written_by_ranklab(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return true;
  std::ifstream f(path, std::ios::binary);
  std::string head(1024, '\0');
  f.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<std::size_t>(f.gcount()));
  auto starts = [&](std::string_view p) { return head.starts_with(p); };
  // report.json, trace.json, plan.json (nlohmann's pretty print, keys in order), and every page.
  if (starts("{\"schema_version\":") || starts("{\"traceEvents\":[") || starts("{\n \"candidates\": ["))
    return true;
  if (starts("<!doctype html>") && head.find("<title>ranklab") != std::string::npos) return true;
  // A Perfetto trace (report_to_perfetto): its first packet describes the run's track, "ranklab: ...".
  if (starts("\x0a") && head.substr(0, 24).find("ranklab: ") != std::string::npos) return true;
  // summary.txt: "gpt on sim (dgx-h100), 8 ranks: 1.2 ms" (format_summary).
  static const std::regex summary(R"(^[^\s]+ on [^\s,]+( \([^)\n]*\))?, [0-9]+ ranks?: [^\n]*\n)");
  return std::regex_search(head, summary);
}

namespace {
// The folders of `folder`'s path that do not exist, the outermost first.
std::vector<std::filesystem::path> missing_folders(const std::filesystem::path& folder) {
  std::error_code ec;
  std::vector<std::filesystem::path> missing;
  for (std::filesystem::path p = std::filesystem::absolute(folder, ec);
       !p.empty() && !std::filesystem::exists(p, ec); p = p.parent_path()) {
    missing.insert(missing.begin(), p);
    if (p == p.parent_path()) break;
  }
  return missing;
}

// 0 when a file can be made in `folder` (one is, and removed again), else the errno of the attempt.
int write_error(const std::filesystem::path& folder) {
  const std::filesystem::path probe = folder / ".ranklab-write-test";
  if (!std::ofstream(probe)) return errno != 0 ? errno : EIO;
  std::error_code ec;
  std::filesystem::remove(probe, ec);
  return 0;
}
}  // namespace

ReportFolder::ReportFolder(std::string flag, std::string dir, std::vector<std::string> names, bool force)
    : flag_(std::move(flag)), dir_(std::move(dir)) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path folder(dir_);
  if (fs::exists(folder, ec)) {
    if (!fs::is_directory(folder, ec))
      throw UsageError(fmt::format("{} {}: that is a file, not a folder", flag_, dir_));
    if (const int error = write_error(folder))
      throw UsageError(
          fmt::format("{} {}: cannot write in the folder: {}", flag_, dir_, std::strerror(error)));
    for (const std::string& name : names) {
      if (!force && !written_by_ranklab(folder / name)) {
        throw UsageError(fmt::format(
            "{} {}: {} is not a file ranklab wrote; give --force to replace it, or another folder", flag_,
            dir_, (folder / name).string()));
      }
    }
    return;
  }
  // Made and tried now, and removed again: the folder is made for the files at the end.
  const std::vector<fs::path> missing = missing_folders(folder);
  fs::create_directories(folder, ec);
  if (ec) throw UsageError(fmt::format("{} {}: cannot create the folder: {}", flag_, dir_, ec.message()));
  const int error = write_error(folder);
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) fs::remove(*it, ec);
  if (error)
    throw UsageError(fmt::format("{} {}: cannot write in the folder: {}", flag_, dir_, std::strerror(error)));
}

ReportFolder::~ReportFolder() {
  if (committed_) return;
  std::error_code ec;
  for (const auto& [temporary, final_path] : written_) std::filesystem::remove(temporary, ec);
  for (auto it = made_.rbegin(); it != made_.rend(); ++it) std::filesystem::remove(*it, ec);  // if empty
}

void ReportFolder::write(const std::string& name, const std::string& text) {
  write(name, [&text](std::ostream& f) { f << text; });
}

void ReportFolder::write(const std::string& name, const std::function<void(std::ostream&)>& fill) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path folder(dir_);
  if (written_.empty() && !fs::exists(folder, ec)) {
    made_ = missing_folders(folder);
    fs::create_directories(folder, ec);
    if (ec) throw UsageError(fmt::format("{} {}: cannot create the folder: {}", flag_, dir_, ec.message()));
  }
  const fs::path final_path = folder / name, temporary = folder / ("." + name + ".ranklab-partial");
  written_.emplace_back(temporary, final_path);
  write_file(temporary, fill);
}

void ReportFolder::commit() {
  for (const auto& [temporary, final_path] : written_) {
    std::error_code ec;
    std::filesystem::rename(temporary, final_path, ec);
    if (ec) throw UsageError(fmt::format("cannot write {}: {}", final_path.string(), ec.message()));
  }
  committed_ = true;
}

}  // namespace ranklab
