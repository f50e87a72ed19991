// Files a command writes: the --report folder, made and tried before a run that may take minutes (so
// one that cannot be written fails at once, not after the run), and each file in it, with an error that
// names the path when the write fails (a full disk, a folder removed meanwhile).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace ranklab {

// Creates `dir` (and its parents) and checks that a file can be written in it; UsageError naming
// `--report DIR` otherwise.
void prepare_report_dir(const std::string& dir);

// UsageError naming `flag` when `out` is one of `inputs` (the same file, however spelled): a command
// never writes over a file it reads.
void refuse_input_as_output(const std::string& flag, const std::string& out,
                            const std::vector<std::string>& inputs);

// Writes `text` to `path`, replacing it; UsageError naming the path when the write fails.
void write_file(const std::filesystem::path& path, const std::string& text);

}  // namespace ranklab
