// Files a command writes: the --report folder, made and tried before a run that may take minutes (so
// one that cannot be written fails at once, not after the run), and each file in it, with an error that
// names the path when the write fails (a full disk, a folder removed meanwhile).
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace ranklab {

// Whether the file at `path` is one ranklab writes (a run's summary, report or trace, a plan, a page), by
// its opening: what a command replaces without --force. One that does not exist loses nothing: true.
bool written_by_ranklab(const std::filesystem::path& path);

// The files a command writes into its --report folder at its end. Checked before the run, so that a run of
// minutes does not fail at its end: the folder exists and takes files, or can be made; none of `names` in it
// is a file ranklab did not write, unless `force`. UsageError naming `flag DIR` (and the file) otherwise.
// Nothing is made before the first write: the files go to temporary names beside theirs, the folder made
// then, and commit() renames them. A run that fails, or a write that fails, before commit() leaves the
// folder as it was: its temporaries removed, and the folder too where this made it.
class ReportFolder {
 public:
  ReportFolder(std::string flag, std::string dir, std::vector<std::string> names, bool force);
  ReportFolder(const ReportFolder&) = delete;
  ReportFolder& operator=(const ReportFolder&) = delete;
  ~ReportFolder();
  void write(const std::string& name, const std::string& text);
  // The same, the file's text written by `fill` as it goes (a report too large to hold as one string).
  void write(const std::string& name, const std::function<void(std::ostream&)>& fill);
  void commit();

 private:
  std::string flag_, dir_;
  std::vector<std::filesystem::path> made_;  // the folders write() made, the outermost first
  std::vector<std::pair<std::filesystem::path, std::filesystem::path>> written_;  // temporary, final
  bool committed_ = false;
};

// UsageError naming `flag` when `out` is one of `inputs` (the same file, however spelled): a command
// never writes over a file it reads.
void refuse_input_as_output(const std::string& flag, const std::string& out,
                            const std::vector<std::string>& inputs);

// Writes `text` to `path`, replacing it; UsageError naming the path when the write fails.
void write_file(const std::filesystem::path& path, const std::string& text);
void write_file(const std::filesystem::path& path, const std::function<void(std::ostream&)>& fill);

}  // namespace ranklab
