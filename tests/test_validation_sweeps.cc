// The published sweeps of validation/ against the model, as docs/validation.md shows them: every table of
// the page between its marker comments must be what `ranklab validate` makes of its file now, so each row
// (simulated times are deterministic) is pinned, and a change to the model that moves one fails here until
// scripts/update-validation.sh has rewritten the page. Also the "# ranklab:" line's errors, and the page's.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "sim/validate.h"

namespace ranklab {
namespace {

const std::string kSource = RANKLAB_SOURCE_DIR;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Validated once for the whole suite: every file is a simulated sweep.
const std::vector<FileValidation>& all_files() {
  static const std::vector<FileValidation> all = validate_dir(kSource + "/validation");
  return all;
}

// The text of docs/validation.md between "<!-- validate: NAME -->" and the next "<!-- /validate -->".
std::string doc_block(const std::string& doc, const std::string& name) {
  const std::string open = "<!-- validate: " + name + " -->\n";
  const std::size_t start = doc.find(open);
  if (start == std::string::npos) return "(no block for " + name + ")";
  const std::size_t end = doc.find("<!-- /validate -->", start);
  if (end == std::string::npos) return "(no closing marker for " + name + ")";
  return doc.substr(start + open.size(), end - start - open.size());
}

// The message of the UsageError `fn` raises ("" when it raises none).
template <typename Fn>
std::string usage_error(Fn fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ValidationSweeps, EveryFileOfTheFolderIsValidated) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kSource + "/validation")) {
    const std::string ext = entry.path().extension().string();
    if (ext == ".log" || ext == ".csv") ++files;
  }
  ASSERT_GT(files, 0);
  EXPECT_EQ(static_cast<int>(all_files().size()), files);
  for (const FileValidation& v : all_files()) EXPECT_FALSE(v.rows.empty()) << v.name;
}

TEST(ValidationSweeps, EachTableOfTheDocIsTheValidateOutput) {
  const std::string doc = read_text(kSource + "/docs/validation.md");
  for (const FileValidation& v : all_files()) {
    EXPECT_EQ(doc_block(doc, v.name), format_file_validation(v))
        << v.name << ": docs/validation.md differs from `ranklab validate`; run scripts/update-validation.sh";
  }
  EXPECT_EQ(doc_block(doc, kValidationSummaryName), format_validation_summary(all_files()))
      << "run scripts/update-validation.sh";
  // And nothing else of the page is touched by the rewrite: it is the page, unchanged.
  EXPECT_EQ(update_validation_doc(doc, "docs/validation.md", all_files()), doc);
}

// The one sweep NVIDIA published itself (its DGX Cloud benchmarking recipe) is held to the targets.
TEST(ValidationSweeps, DgxH100AllReduceMeetsTheTargets) {
  for (const FileValidation& v : all_files()) {
    if (v.name != "h100x8-all_reduce-dgxc-benchmarking.log") continue;
    EXPECT_LE(v.error_mid, 0.10);
    EXPECT_LE(v.error_large, 0.05);
    EXPECT_EQ(v.rows_mid, 15);
    EXPECT_EQ(v.rows_large, 7);
    return;
  }
  FAIL() << "validation/h100x8-all_reduce-dgxc-benchmarking.log was not validated";
}

TEST(ValidationSetup, ParsesTheHeaderLine) {
  const ValidationSetup s = parse_validation_setup(
      "# source\n#  ranklab: --profile dgx-h100 --nodes 2 --algo ring --proto simple\n", "f");
  EXPECT_EQ(s.profile, "dgx-h100");
  EXPECT_EQ(s.nodes, 2);
  EXPECT_EQ(s.algorithm, "ring");
  EXPECT_EQ(s.protocol, "simple");
  EXPECT_EQ(parse_validation_setup("#ranklab: --profile dgx-a100\n", "f").nodes, 1);
}

TEST(ValidationSetup, BadLinesAreNamedByFileAndLine) {
  auto error = [](const std::string& text) {
    return usage_error([&] { parse_validation_setup(text, "sweep.log"); });
  };
  EXPECT_NE(error("# nothing here\n").find("sweep.log: no '# ranklab:"), std::string::npos);
  EXPECT_NE(error("#\n# ranklab: --nodes 2\n").find("sweep.log:2: the line names no --profile"),
            std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100\n# ranklab: --profile dgx-h100\n")
                .find("sweep.log:2: a second '# ranklab:' line (the first is line 1)"),
            std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100 --gpus 8\n").find("sweep.log:1: '--gpus' is not an option"),
            std::string::npos);
  EXPECT_NE(
      error("# ranklab: --profile no-such-machine\n").find("sweep.log:1: --profile no-such-machine: no such"),
      std::string::npos);
  EXPECT_NE(
      error("# ranklab: --profile dgx-h100 --nodes two\n").find("sweep.log:1: --nodes two: not a whole"),
      std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100 --nodes 0\n").find("sweep.log:1: --nodes 0"),
            std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100 --nodes\n").find("sweep.log:1: --nodes needs a value"),
            std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100 --algo spiral\n").find("sweep.log:1: --algo spiral"),
            std::string::npos);
  EXPECT_NE(error("# ranklab: --profile dgx-h100 --proto ll256\n").find("sweep.log:1: --proto ll256"),
            std::string::npos);
}

// A measurement on 8 ranks cannot be simulated on 2 nodes of 8: the file is named and --nodes blamed.
TEST(ValidationSetup, RanksMustFillTheNodes) {
  const std::string path = testing::TempDir() + "/ranks-and-nodes.log";
  std::string text = read_text(kSource + "/validation/h100x8-all_reduce-dgxc-benchmarking.log");
  const std::string from = "# ranklab: --profile dgx-h100 --nodes 1",
                    to = "# ranklab: --profile dgx-h100 --nodes 2";
  ASSERT_NE(text.find(from), std::string::npos);
  text.replace(text.find(from), from.size(), to);
  std::ofstream(path, std::ios::binary) << text;
  const std::string e = usage_error([&] { validate_file(path); });
  EXPECT_NE(e.find(path + ": the measurement ran on 8 ranks, which 2 nodes of 8 GPUs (dgx-h100) do not fill"),
            std::string::npos)
      << e;
  std::remove(path.c_str());
}

// A table typed by hand (op,bytes,ranks,time_us) is validated as well, its rows timed one collective each.
TEST(ValidationSetup, HandMadeCsv) {
  const std::string dir = testing::TempDir() + "/sweeps-csv";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/hand.csv", std::ios::binary)
      << "# where the numbers come from\n# ranklab: --profile dgx-h100 --algo ring\nop,bytes,ranks,time_us\n"
         "all_reduce,16384,8,20\nall_reduce,1073741824,8,5000\n";
  const std::vector<FileValidation> all = validate_dir(dir);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].folder, "sweeps-csv");
  ASSERT_EQ(all[0].rows.size(), 1u);  // 16 KiB is below the tables' first size
  EXPECT_EQ(all[0].rows[0].bytes, std::int64_t{1} << 30);
  EXPECT_EQ(all[0].rows[0].algorithm, "ring/simple");
  EXPECT_NEAR(all[0].rows[0].measured_busbw_gbps, 1073741824.0 / 5000e3 * 1.75, 1e-9);
  EXPECT_EQ(all[0].rows_large, 1);
  std::filesystem::remove_all(dir);
}

TEST(ValidationDoc, BadMarkersAreNamedByLine) {
  const std::vector<FileValidation>& all = all_files();
  auto error = [&](const std::string& doc) {
    return usage_error([&] { update_validation_doc(doc, "page.md", all); });
  };
  EXPECT_NE(error("text\n<!-- validate: nowhere.log -->\n<!-- /validate -->\n")
                .find("page.md:2: the marker names 'nowhere.log'"),
            std::string::npos);
  EXPECT_NE(error("<!-- validate: summary -->\nold table\n")
                .find("page.md:1: the block for 'summary' has no closing"),
            std::string::npos);
  // A page without a block for every file says which are missing.
  EXPECT_NE(error("<!-- validate: summary -->\n<!-- /validate -->\n").find("page.md: no block for "),
            std::string::npos);
}

}  // namespace
}  // namespace ranklab
