#include "sim/validate.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

#include "common/compare.h"
#include "common/errors.h"
#include "common/measurements.h"
#include "common/profile.h"
#include "common/text.h"
#include "common/units.h"
#include "sim/measured_sim.h"
#include "sim/net/comm_plan.h"
#include "sim/net/network_model.h"

namespace ranklab {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

// "+4.2%", "-0.3%"; "-" where there is nothing to score.
std::string signed_percent(double fraction) {
  if (!std::isfinite(fraction)) return "-";
  return fmt::format("{:+.1f}%", 100 * fraction);
}

std::string rows_text(int n) {
  return fmt::format("{} row{}", n, n == 1 ? "" : "s");
}

bool in_mid_range(std::int64_t bytes) {
  return bytes >= kValidationMidBytes && bytes <= kValidationLastBytes;
}
bool in_large_range(std::int64_t bytes) {
  return bytes >= kValidationLargeBytes;
}

std::string setup_text(const ValidationSetup& s) {
  std::string text = fmt::format("{}, {} node{}", s.profile, s.nodes, s.nodes == 1 ? "" : "s");
  if (!s.algorithm.empty()) text += ", NCCL_ALGO=" + s.algorithm;
  if (!s.protocol.empty()) text += ", NCCL_PROTO=" + s.protocol;
  if (s.algorithm.empty() && s.protocol.empty()) text += ", NCCL's choice";
  return text;
}

}  // namespace

ValidationSetup parse_validation_setup(const std::string& text, const std::string& origin) {
  const std::vector<std::string> lines = lines_of(text);
  std::optional<std::size_t> found;
  ValidationSetup setup;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    std::vector<std::string> words = split_words(lines[n]);
    // "# ranklab: ..." and "#ranklab: ...".
    if (words.empty() || words[0].rfind('#', 0) != 0) continue;
    if (words[0] == "#") {
      words.erase(words.begin());
    } else {
      words[0] = words[0].substr(1);
    }
    if (words.empty() || words[0] != "ranklab:") continue;
    auto fail = [&](const std::string& what) {
      return UsageError(fmt::format("{}:{}: {}", origin, n + 1, what));
    };
    if (found) throw fail(fmt::format("a second '# ranklab:' line (the first is line {})", *found + 1));
    found = n;
    bool has_profile = false;
    for (std::size_t k = 1; k < words.size(); k += 2) {
      const std::string& flag = words[k];
      if (flag != "--profile" && flag != "--nodes" && flag != "--algo" && flag != "--proto") {
        throw fail(
            fmt::format("'{}' is not an option of the '# ranklab:' line (--profile, --nodes, --algo, "
                        "--proto)",
                        flag));
      }
      if (k + 1 >= words.size() || words[k + 1].rfind("--", 0) == 0)
        throw fail(fmt::format("{} needs a value", flag));
      const std::string& value = words[k + 1];
      if (flag == "--profile") {
        const std::vector<std::string> known = list_profiles();
        if (std::find(known.begin(), known.end(), value) == known.end()) {
          throw fail(fmt::format("--profile {}: no such profile (one of {})", value, fmt::join(known, ", ")));
        }
        setup.profile = value;
        has_profile = true;
      } else if (flag == "--nodes") {
        int nodes = 0;
        const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), nodes);
        if (ec != std::errc() || end != value.data() + value.size() || nodes < 1)
          throw fail(fmt::format("--nodes {}: not a whole number of nodes, 1 or more", value));
        setup.nodes = nodes;
      } else if (flag == "--algo") {
        if (!sim::parse_algorithm(value))
          throw fail(fmt::format("--algo {}: not an algorithm (ring, tree, nvls, nvls_tree)", value));
        setup.algorithm = value;
      } else {
        if (!sim::parse_protocol(value))
          throw fail(fmt::format("--proto {}: not a protocol (ll, ll128, simple)", value));
        setup.protocol = value;
      }
    }
    if (!has_profile) throw fail("the line names no --profile");
  }
  if (!found) {
    throw UsageError(fmt::format(
        "{}: no '# ranklab: --profile P [--nodes N]' line says which machine simulates this measurement",
        origin));
  }
  return setup;
}

FileValidation validate_file(const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  FileValidation v;
  v.name = name;
  v.folder = std::filesystem::path(path).parent_path().filename().string();
  v.setup = parse_validation_setup(read_text_file(path), path);
  const RunReport measured = read_measurements({path}, std::nullopt);
  Profile profile = load_profile(v.setup.profile);
  profile.nodes = v.setup.nodes;
  const int per_node = profile.gpus_per_node;
  if (measured.world > per_node * profile.nodes || measured.world <= per_node * (profile.nodes - 1)) {
    throw UsageError(fmt::format(
        "{}: the measurement ran on {} ranks, which {} node{} of {} GPUs ({}) do not fill; fix --nodes in "
        "its "
        "'# ranklab:' line",
        path, measured.world, profile.nodes, profile.nodes == 1 ? "" : "s", per_node, v.setup.profile));
  }
  v.ranks = measured.world;
  const RunReport simulated = simulate_measured(measured, profile, v.setup.algorithm, v.setup.protocol);

  // The simulated collectives carry their measured counterparts' labels (common/replay.h): match by
  // (group, size, occurrence), the out-of-place ones only.
  std::map<std::tuple<std::string, std::int64_t, int>, const CollectiveRecord*> simulated_by_key;
  std::map<std::pair<std::string, std::int64_t>, int> seen;
  for (const CollectiveRecord& c : simulated.collectives) {
    if (c.bookkeeping) continue;
    const std::string group(c.group);
    simulated_by_key[{group, c.bytes, seen[{group, c.bytes}]++}] = &c;
  }
  seen.clear();
  sim::NetworkModel model(profile, sim::NetworkOptions{v.setup.algorithm, v.setup.protocol});
  std::vector<int> ranks(v.ranks);
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<double> mid, large;
  for (const CollectiveRecord& c : measured.collectives) {
    const std::string group(c.group);
    const int occurrence = seen[{group, c.bytes}]++;
    if (group == kInPlaceGroup || c.bytes < kValidationFirstRowBytes) continue;
    v.op = c.op;
    const auto it = simulated_by_key.find({group, c.bytes, occurrence});
    if (it == simulated_by_key.end()) {
      throw UsageError(fmt::format("{}: the simulation has no counterpart of {} {} on {}", path,
                                   comm_op_name(c.op), format_bytes(static_cast<double>(c.bytes)), group));
    }
    ValidationRow row;
    row.bytes = c.bytes;
    row.measured_us = c.time_us();
    row.simulated_us = it->second->time_us();
    const double factor = bus_factor(c.op, v.ranks);
    row.measured_busbw_gbps = static_cast<double>(c.bytes) / (row.measured_us * 1e3) * factor;
    row.simulated_busbw_gbps = static_cast<double>(c.bytes) / (row.simulated_us * 1e3) * factor;
    row.algorithm = model.plan_collective(c.op, c.bytes, ranks, -1).name();
    const double ratio = row.simulated_busbw_gbps / row.measured_busbw_gbps;
    if (in_mid_range(row.bytes)) mid.push_back(ratio);
    if (in_large_range(row.bytes)) large.push_back(ratio);
    v.rows.push_back(row);
  }
  if (v.rows.empty()) {
    throw UsageError(fmt::format("{}: no out-of-place row of {} or more to validate", path,
                                 format_bytes(static_cast<double>(kValidationFirstRowBytes))));
  }
  v.error_mid = geomean_error(mid);
  v.error_large = geomean_error(large);
  v.rows_mid = static_cast<int>(mid.size());
  v.rows_large = static_cast<int>(large.size());
  return v;
}

std::vector<FileValidation> validate_dir(const std::string& dir) {
  std::vector<std::string> paths;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string ext = entry.path().extension().string();
    if (entry.is_regular_file() && (ext == ".log" || ext == ".csv")) paths.push_back(entry.path().string());
  }
  if (ec) throw UsageError(fmt::format("{}: cannot list the folder ({})", dir, ec.message()));
  if (paths.empty()) throw UsageError(fmt::format("{}: no measurement (*.log, *.csv) to validate", dir));
  std::sort(paths.begin(), paths.end());
  std::vector<FileValidation> all;
  for (const std::string& p : paths) all.push_back(validate_file(p));
  return all;
}

std::string format_file_validation(const FileValidation& v) {
  const std::string file = v.folder.empty() ? v.name : v.folder + "/" + v.name;
  std::string out = fmt::format("`{}`: {} on {} ranks, simulated as {}.\n\n", file, comm_op_name(v.op),
                                v.ranks, setup_text(v.setup));
  out +=
      "| size | measured (us) | ranklab (us) | measured busbw (GB/s) | ranklab busbw (GB/s) | error "
      "| ranklab's choice |\n";
  out += "|---|---:|---:|---:|---:|---:|---|\n";
  for (const ValidationRow& r : v.rows) {
    out += fmt::format("| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} | {} |\n",
                       format_bytes(static_cast<double>(r.bytes)), r.measured_us, r.simulated_us,
                       r.measured_busbw_gbps, r.simulated_busbw_gbps, signed_percent(r.error()), r.algorithm);
  }
  out += fmt::format(
      "\nGeometric mean of |error| of bus bandwidth: 1 MiB to 16 GiB **{}** ({}; target 10%), 256 MiB and "
      "above "
      "**{}** ({}; target 5%).\n",
      format_percent(v.error_mid), rows_text(v.rows_mid), format_percent(v.error_large),
      rows_text(v.rows_large));
  return out;
}

std::string format_validation_summary(const std::vector<FileValidation>& all) {
  std::string out = "| file | operation | ranks | simulated as | 1 MiB - 16 GiB | >= 256 MiB |\n";
  out += "|---|---|---:|---|---:|---:|\n";
  std::vector<double> mid, large;
  for (const FileValidation& v : all) {
    out += fmt::format("| `{}` | {} | {} | {} | {} | {} |\n", v.name, comm_op_name(v.op), v.ranks,
                       setup_text(v.setup), format_percent(v.error_mid), format_percent(v.error_large));
    for (const ValidationRow& r : v.rows) {
      const double ratio = r.simulated_busbw_gbps / r.measured_busbw_gbps;
      if (in_mid_range(r.bytes)) mid.push_back(ratio);
      if (in_large_range(r.bytes)) large.push_back(ratio);
    }
  }
  out += fmt::format("| all files | | | | **{}** ({} rows) | **{}** ({} rows) |\n",
                     format_percent(geomean_error(mid)), mid.size(), format_percent(geomean_error(large)),
                     large.size());
  return out;
}

std::string update_validation_doc(const std::string& doc, const std::string& doc_origin,
                                  const std::vector<FileValidation>& all) {
  std::map<std::string, std::string> blocks;
  for (const FileValidation& v : all) blocks[v.name] = format_file_validation(v);
  blocks[kValidationSummaryName] = format_validation_summary(all);

  const std::string open = "<!-- validate: ", close = "<!-- /validate -->";
  const std::vector<std::string> lines = lines_of(doc);
  std::string out;
  std::set<std::string> placed;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    const std::string& line = lines[n];
    out += line + "\n";
    if (line.rfind(open, 0) != 0) continue;
    const std::size_t end = line.find(" -->", open.size());
    if (end == std::string::npos)
      throw UsageError(fmt::format("{}:{}: a marker without its closing ' -->'", doc_origin, n + 1));
    const std::string name = line.substr(open.size(), end - open.size());
    const auto it = blocks.find(name);
    if (it == blocks.end()) {
      throw UsageError(fmt::format("{}:{}: the marker names '{}', which is no file of the validated folder",
                                   doc_origin, n + 1, name));
    }
    if (!placed.insert(name).second)
      throw UsageError(fmt::format("{}:{}: a second block for '{}'", doc_origin, n + 1, name));
    std::size_t k = n + 1;
    while (k < lines.size() && lines[k] != close) ++k;
    if (k == lines.size()) {
      throw UsageError(
          fmt::format("{}:{}: the block for '{}' has no closing '{}'", doc_origin, n + 1, name, close));
    }
    out += it->second;
    out += close + "\n";
    n = k;
  }
  std::vector<std::string> missing;
  for (const auto& [name, block] : blocks) {
    if (!placed.count(name)) missing.push_back(name);
  }
  if (!missing.empty()) {
    throw UsageError(fmt::format(
        "{}: no block for {}; add a pair of markers where each belongs (\"{}NAME -->\" then \"{}\")",
        doc_origin, fmt::join(missing, ", "), open, close));
  }
  return out;
}

}  // namespace ranklab
