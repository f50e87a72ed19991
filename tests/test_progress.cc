#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <thread>

#include "common/progress.h"

namespace ranklab {
namespace {

std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buffer[256];
  std::size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) out.append(buffer, n);
  return out;
}

TEST(Progress, Line) {
  EXPECT_EQ(progress_line("sweep", 12, 40, ""), "[sweep] 12/40");
  EXPECT_EQ(progress_line("sim", 7, 0, "collectives"), "[sim] 7 collectives");
}

TEST(Progress, SilentWhenNotATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("sweep", 3, f);  // a file is not a terminal
    EXPECT_FALSE(p.enabled());
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    p.update(3);
  }
  EXPECT_EQ(contents(f), "");
  std::fclose(f);
}

TEST(Progress, RewritesOneLineAndClearsIt) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("sweep", 40, f, /*enabled=*/true);
    p.update(1);  // too soon after the start: work this short shows nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    p.update(12);
    p.update(13);  // too soon after the last one
    p.update(40);  // the last always shows
  }
  EXPECT_EQ(contents(f), "\r[sweep] 12/40\r[sweep] 40/40\r             \r");
  std::fclose(f);
}

TEST(Progress, OtherOutputErasesTheLineFirstAndATotalTooSmallGrows) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("calibrate", 2, f, /*enabled=*/true);
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    p.update(1);
    Progress::erase_shown();  // what prints a lesson's line or an error calls this first
    std::fputs("a line\n", f);
    Progress::erase_shown();  // nothing shown: nothing written
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    p.update(3);  // more work than the total said
  }
  EXPECT_EQ(contents(f), "\r[calibrate] 1/2\r               \ra line\n\r[calibrate] 3/3\r               \r");
  std::fclose(f);
}

}  // namespace
}  // namespace ranklab
