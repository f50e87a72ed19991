// Headless Chromium for the tests of the HTML pages: found on PATH (Debian's `chromium` package), run with
// a throwaway profile and no network, and given at most 20 seconds. Tests skip when it is not installed.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace ranklab::testing {

namespace fs = std::filesystem;

// The browser's path, or "" when none is installed.
inline std::string find_chromium() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
    std::size_t begin = 0;
    while (begin <= dirs.size()) {
      std::size_t end = dirs.find(':', begin);
      if (end == std::string::npos) end = dirs.size();
      const fs::path candidate = fs::path(dirs.substr(begin, end - begin)) / name;
      if (access(candidate.c_str(), X_OK) == 0) return candidate.string();
      begin = end + 1;
    }
  }
  return "";
}

// Runs headless Chromium on `page` with `mode` (--dump-dom, or --screenshot=FILE) and returns its stdout.
inline std::string run_chromium(const std::string& chromium, const fs::path& page, const std::string& mode) {
  const fs::path profile = fs::temp_directory_path() / fmt::format("ranklab-chromium-{}", getpid());
  const std::string command = fmt::format(
      "timeout 20 '{}' --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
      "--disable-background-networking --disable-component-update --disable-sync --user-data-dir='{}' "
      "--window-size=1400,1000 {} 'file://{}' 2>/dev/null",
      chromium, profile.string(), mode, fs::absolute(page).string());
  std::string out;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    std::array<char, 65536> buffer;
    std::size_t n;
    while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
    pclose(pipe);
  }
  std::error_code ec;
  fs::remove_all(profile, ec);
  return out;
}

}  // namespace ranklab::testing
