#include "common/measurements.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>

#include "common/errors.h"
#include "common/text.h"

namespace ranklab {

const char* const kInPlaceGroup = "world, in place";

const char* measurement_format_name(MeasurementFormat f) {
  switch (f) {
    case MeasurementFormat::Report:
      return "ranklab report";
    case MeasurementFormat::NcclTests:
      return "nccl-tests output";
    case MeasurementFormat::Csv:
      return "CSV";
    case MeasurementFormat::Kineto:
      return "PyTorch profiler trace";
  }
  return "?";
}

namespace {

// The lesson name of a report of nccl-tests output: this and the collective's name.
constexpr const char* kNcclTestsLesson = "nccl-tests ";

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines = split_at(text, '\n');
  for (std::string& line : lines) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
  }
  return lines;
}

template <class T>
bool parse_number(const std::string& s, T& out) {
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars for doubles is in libstdc++ 11+; strtod would accept "inf" and trailing junk.
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && p == s.data() + s.size() && std::isfinite(out);
  } else {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && p == s.data() + s.size();
  }
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// "all_reduce", "allreduce", "AllReduce", "_allgather_base", "reduce_scatter_tensor_coalesced" ...: the
// letters alone, lowercased, then the longest operation name they contain.
std::optional<CommOp> op_from_name(const std::string& name) {
  std::string letters;
  for (char ch : lower(name)) {
    if (std::isalpha(static_cast<unsigned char>(ch))) letters += ch;
  }
  // Longer names first, so "reducescatter" is not read as "reduce" nor "allgather" as "gather".
  static const std::pair<const char*, CommOp> names[] = {
      {"reducescatter", CommOp::ReduceScatter},
      {"allreduce", CommOp::AllReduce},
      {"allgather", CommOp::AllGather},
      {"alltoall", CommOp::AllToAll},
      {"broadcast", CommOp::Broadcast},
      {"sendrecv", CommOp::Send},
      {"gather", CommOp::Gather},
      {"scatter", CommOp::Scatter},
      {"reduce", CommOp::Reduce},
      {"send", CommOp::Send},
      {"recv", CommOp::Recv},
      {"barrier", CommOp::Barrier},
  };
  for (const auto& [n, op] : names) {
    if (letters.find(n) != std::string::npos) return op;
  }
  return std::nullopt;
}

// Bytes of one element of an nccl-tests or PyTorch dtype name; 0 when unknown.
int element_bytes(const std::string& dtype) {
  static const std::map<std::string, int> sizes = {
      {"int8", 1},     {"uint8", 1},    {"char", 1},    {"byte", 1},    {"bool", 1},    {"fp8_e4m3", 1},
      {"fp8_e5m2", 1}, {"f8e4m3", 1},   {"f8e5m2", 1},  {"half", 2},    {"float16", 2}, {"fp16", 2},
      {"f16", 2},      {"bfloat16", 2}, {"bf16", 2},    {"short", 2},   {"int32", 4},   {"uint32", 4},
      {"int", 4},      {"float", 4},    {"float32", 4}, {"fp32", 4},    {"f32", 4},     {"int64", 8},
      {"uint64", 8},   {"long", 8},     {"double", 8},  {"float64", 8}, {"f64", 8},     {"u8", 1},
      {"i8", 1},       {"i32", 4},      {"u32", 4},     {"i64", 8},     {"u64", 8},
  };
  auto it = sizes.find(lower(dtype));
  return it == sizes.end() ? 0 : it->second;
}

// What a CSV row measures, named by its column: a time, or one of nccl-tests' bandwidths, from which the
// time follows. Read by the format's detection and by its reader.
enum class CsvMeasure { TimeUs, BusbwGbps, AlgbwGbps };
constexpr std::array<std::pair<std::string_view, CsvMeasure>, 3> kCsvMeasures = {{
    {"time_us", CsvMeasure::TimeUs},
    {"busbw_gbps", CsvMeasure::BusbwGbps},
    {"algbw_gbps", CsvMeasure::AlgbwGbps},
}};

// A report of measured collectives, each after the last on one timeline, as nccl-tests runs them.
RunReport measured_report(const std::string& lesson, int world) {
  RunReport r;
  r.lesson = lesson;
  r.backend = "measured";
  r.world = world;
  return r;
}

void append_collective(RunReport& r, CommOp op, std::int64_t bytes, int ranks, double time_us) {
  CollectiveRecord c;
  c.op = op;
  c.group = "world";
  c.group_size = ranks;
  c.bytes = bytes;
  c.start_us = r.makespan_us;
  c.end_us = c.start_us + time_us;
  c.algbw_gbps = time_us > 0 ? static_cast<double>(bytes) / (time_us * 1e3) : 0;
  c.busbw_gbps = c.algbw_gbps * bus_factor(op, ranks);
  r.makespan_us = c.end_us;
  r.collectives.push_back(c);
}

}  // namespace

std::optional<CommOp> comm_op_from_text(const std::string& text) {
  // nccl-tests' tools are named <op>_perf; a log that shows its command line names it there.
  static const std::pair<const char*, CommOp> tools[] = {
      {"all_reduce_perf", CommOp::AllReduce},
      {"all_gather_perf", CommOp::AllGather},
      {"reduce_scatter_perf", CommOp::ReduceScatter},
      {"alltoall_perf", CommOp::AllToAll},
      {"broadcast_perf", CommOp::Broadcast},
      {"reduce_perf", CommOp::Reduce},
      {"sendrecv_perf", CommOp::Send},
      {"gather_perf", CommOp::Gather},
      {"scatter_perf", CommOp::Scatter},
      {"hypercube_perf", CommOp::AllGather},
  };
  std::optional<CommOp> found;
  std::size_t first = std::string::npos;
  for (const auto& [tool, op] : tools) {
    // "reduce_perf" is also the tail of "all_reduce_perf": only a match at a word start counts.
    for (std::size_t at = text.find(tool); at != std::string::npos; at = text.find(tool, at + 1)) {
      const bool word_start =
          at == 0 || !(std::isalnum(static_cast<unsigned char>(text[at - 1])) || text[at - 1] == '_');
      if (word_start && at < first) {
        first = at;
        found = op;
      }
    }
  }
  return found;
}

MeasurementFormat detect_measurement_format(const std::string& text, const std::string& origin) {
  std::size_t i = text.find_first_not_of(" \t\r\n");
  if (i == std::string::npos) throw UsageError(fmt::format("{}: the file is empty", origin));
  if (text[i] == '{') {
    if (text.find("\"traceEvents\"") != std::string::npos) return MeasurementFormat::Kineto;
    return MeasurementFormat::Report;
  }
  // A CSV's header is its first line that is not a comment: a file may say where its numbers come from
  // first. It is looked for before nccl-tests' words, which a CSV of bandwidths names too (algbw_gbps).
  std::size_t j = i;
  while (j != std::string::npos && text[j] == '#') {
    const std::size_t end = text.find('\n', j);
    j = end == std::string::npos ? std::string::npos : text.find_first_not_of(" \t\r\n", end);
  }
  const std::string first_line = j == std::string::npos ? "" : lower(text.substr(j, text.find('\n', j) - j));
  const bool names_a_measure = std::any_of(kCsvMeasures.begin(), kCsvMeasures.end(), [&](const auto& m) {
    return first_line.find(m.first) != std::string::npos;
  });
  if (first_line.find("op") != std::string::npos && first_line.find(',') != std::string::npos &&
      names_a_measure) {
    return MeasurementFormat::Csv;
  }
  if (text.find("out-of-place") != std::string::npos || text.find("# nThread") != std::string::npos ||
      text.find("algbw") != std::string::npos) {
    return MeasurementFormat::NcclTests;
  }
  throw UsageError(fmt::format(
      "{}: not a measurement ranklab reads (a report.json, nccl-tests output, a PyTorch profiler trace, or "
      "a CSV with the header op,bytes,ranks,time_us or busbw_gbps)",
      origin));
}

// ---- nccl-tests ------------------------------------------------------------------------------------------

namespace {

// The loop's settings from the words of nccl-tests' header ("nGpus 8 ... warmup iters: 5 iters: 20 agg
// iters: 1"), into `loop`; `where` ("file:line: ") opens the message of a setting no loop can have.
void read_loop_settings(const std::vector<std::string>& words, NcclTestsLoop& loop,
                        const std::string& where) {
  for (std::size_t k = 0; k + 1 < words.size(); ++k) {
    if (words[k] == "nGpus") {
      if (!parse_number(words[k + 1], loop.gpus_per_thread) || loop.gpus_per_thread < 1) {
        throw UsageError(fmt::format("{}the header's 'nGpus' is '{}': a thread drives 1 GPU or more", where,
                                     words[k + 1]));
      }
      continue;
    }
    if (words[k] != "iters:") continue;
    const std::string before = k > 0 ? words[k - 1] : "";
    int count = 0;
    if (before == "agg" || !parse_number(words[k + 1], count) || count < 0) continue;
    (before == "warmup" ? loop.warmup_iters : loop.iters) = count;
  }
  if (loop.iters < 1) {
    throw UsageError(fmt::format("{}the header's 'iters' is 0: nccl-tests times at least one launch", where));
  }
}

// The loop's settings as a report keeps them (nccl_tests_loop reads them back).
std::map<std::string, std::string> loop_options(const NcclTestsLoop& loop) {
  return {{"warmup_iters", std::to_string(loop.warmup_iters)},
          {"iters", std::to_string(loop.iters)},
          {"gpus_per_thread", std::to_string(loop.gpus_per_thread)}};
}

}  // namespace

RunReport read_nccl_tests(const std::string& text, const std::string& origin, std::optional<CommOp> op) {
  const std::vector<std::string> lines = split_lines(text);
  auto fail = [&](std::size_t line, const std::string& what) -> UsageError {
    return UsageError(fmt::format("{}:{}: {}", origin, line + 1, what));
  };

  // The devices: "#  Rank  3 Group  0 Pid  1234 on host device  3 [0x0c] NVIDIA H100 80GB HBM3".
  std::set<int> ranks;
  std::string gpu;
  // The columns, from the header row that names them; the first "time" is out-of-place.
  std::vector<std::string> columns;
  struct Row {
    std::size_t line;
    std::int64_t bytes;
    std::string type, redop;
    int root;
    double time_us, algbw, busbw, in_place_us;
  };
  std::vector<Row> rows;
  NcclTestsLoop loop;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    const std::string& line = lines[n];
    std::vector<std::string> words = split_words(line);
    if (words.empty()) continue;
    if (words[0][0] == '#') {
      if (words[0] == "#")
        words.erase(words.begin());
      else
        words[0] = words[0].substr(1);
      // "# nThread 1 nGpus 8 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 agg
      // iters: 1 validation: 1 graph: 0": the loop's counts (older versions print no warm-up count).
      if (!words.empty() && words[0] == "nThread")
        read_loop_settings(words, loop, fmt::format("{}:{}: ", origin, n + 1));
      if (words.size() >= 2 && words[0] == "Rank") {
        int r = 0;
        if (!parse_number(words[1], r) || r < 0)
          throw fail(n, fmt::format("a device line with rank '{}'", words[1]));
        ranks.insert(r);
        const std::size_t bracket = line.find("] ");
        if (gpu.empty() && bracket != std::string::npos) gpu = line.substr(bracket + 2);
      }
      const bool names_columns = std::find(words.begin(), words.end(), "time") != words.end() &&
                                 (std::find(words.begin(), words.end(), "size") != words.end() ||
                                  std::find(words.begin(), words.end(), "bytes") != words.end());
      if (names_columns) columns = words;
      continue;
    }
    // Anything else before the column header, or a line that does not start with a number (NCCL's INFO
    // and WARN lines, MPI's messages), is not a measurement.
    std::int64_t bytes = 0;
    if (columns.empty() || !parse_number(words[0], bytes)) continue;
    if (words.size() != columns.size()) {
      throw fail(n, fmt::format("a row of {} fields where the header names {} ({}); is the log cut short?",
                                words.size(), columns.size(), fmt::join(columns, " ")));
    }
    Row row{n, bytes, "", "", -1, NAN, NAN, NAN, NAN};
    int times_seen = 0;
    for (std::size_t k = 0; k < columns.size(); ++k) {
      const std::string& col = columns[k];
      const std::string& v = words[k];
      auto number = [&](double& out) {
        if (!parse_number(v, out) || out < 0) {
          throw fail(n, fmt::format("column '{}' is '{}', not a non-negative number", col, v));
        }
      };
      if (col == "type")
        row.type = v;
      else if (col == "redop" || col == "op")
        row.redop = v;
      else if (col == "root")
        parse_number(v, row.root);
      else if (col == "time") {
        number(times_seen++ == 0 ? row.time_us : row.in_place_us);
      } else if (col == "algbw" && times_seen == 1)
        number(row.algbw);
      else if (col == "busbw" && times_seen == 1)
        number(row.busbw);
    }
    if (!(row.time_us > 0)) throw fail(n, fmt::format("out-of-place time '{}' is not positive", row.time_us));
    rows.push_back(row);
  }
  if (columns.empty()) {
    throw UsageError(
        fmt::format("{}: no nccl-tests column header (\"# size count type ... time algbw busbw\")", origin));
  }
  if (rows.empty()) throw UsageError(fmt::format("{}: the log has a header but no measurements", origin));

  // The world: one device line per rank; without them, from the bus factor of a known operation.
  const bool reduces = rows.front().redop != "none" && !rows.front().redop.empty();
  double factor = NAN;  // busbw / algbw at the largest size whose algbw printed as non-zero
  for (const Row& row : rows) {
    if (row.algbw >= 0.1) factor = row.busbw / row.algbw;
  }
  int world = ranks.empty() ? 0 : *ranks.rbegin() + 1;
  if (!ranks.empty() && static_cast<int>(ranks.size()) != world) {
    throw UsageError(fmt::format("{}: device lines name {} ranks but the largest is rank {}", origin,
                                 ranks.size(), world - 1));
  }

  if (!op) op = comm_op_from_text(origin + "\n" + text);
  if (!op) {
    // Which operations fit the bus factor, the reduction column and the root column.
    std::vector<CommOp> fits;
    const bool rooted = rows.front().root >= 0;
    for (CommOp candidate :
         {CommOp::AllReduce, CommOp::AllGather, CommOp::ReduceScatter, CommOp::AllToAll, CommOp::Broadcast,
          CommOp::Reduce, CommOp::Gather, CommOp::Scatter, CommOp::Send}) {
      const bool is_reduction =
          candidate == CommOp::AllReduce || candidate == CommOp::ReduceScatter || candidate == CommOp::Reduce;
      const bool is_rooted = candidate == CommOp::Broadcast || candidate == CommOp::Reduce ||
                             candidate == CommOp::Gather || candidate == CommOp::Scatter;
      if (is_reduction != reduces || is_rooted != rooted) continue;
      if (world > 0 && std::isfinite(factor) &&
          std::fabs(bus_factor(candidate, world) - factor) > 0.02 * factor + 0.01)
        continue;
      fits.push_back(candidate);
    }
    if (fits.size() != 1) {
      std::vector<std::string> names;
      for (CommOp c : fits) names.push_back(comm_op_name(c));
      throw UsageError(fmt::format(
          "{}: nccl-tests does not print which collective it ran, and {} — name it with --op (one of "
          "all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce, gather, scatter, send)",
          origin,
          fits.empty() ? std::string("no collective has these columns and bus factor")
                       : fmt::format("{} all fit these columns", fmt::join(names, ", "))));
    }
    op = fits.front();
  }
  if (world == 0) {
    // busbw = algbw * f(n): all_reduce's 2(n-1)/n and the (n-1)/n of the gathers and scatters give n.
    double n = NAN;
    if (*op == CommOp::AllReduce && factor < 2) n = 2 / (2 - factor);
    if ((*op == CommOp::AllGather || *op == CommOp::ReduceScatter || *op == CommOp::AllToAll) && factor < 1)
      n = 1 / (1 - factor);
    if (!std::isfinite(n) || n < 1.5) {
      throw UsageError(fmt::format(
          "{}: the log has no '# Using devices' lines, so the number of ranks is unknown, and busbw / algbw "
          "does not give it for {}",
          origin, comm_op_name(*op)));
    }
    world = static_cast<int>(std::lround(n));
  }

  RunReport r = measured_report(fmt::format("{}{}", kNcclTestsLesson, comm_op_name(*op)), world);
  r.profile = gpu;
  r.options = loop_options(loop);
  for (const Row& row : rows) {
    if (!row.type.empty() && element_bytes(row.type) == 0) {
      throw fail(row.line, fmt::format("unknown data type '{}'", row.type));
    }
    append_collective(r, *op, row.bytes, world, row.time_us);
    if (std::isfinite(row.in_place_us)) {
      append_collective(r, *op, row.bytes, world, row.in_place_us);
      r.collectives.back().group = kInPlaceGroup;
    }
  }
  return r;
}

std::optional<NcclTestsLoop> nccl_tests_loop(const RunReport& r) {
  if (r.backend != "measured" || r.lesson.rfind(kNcclTestsLesson, 0) != 0) return std::nullopt;
  NcclTestsLoop loop;
  auto count = [&](const char* key, int& out, int minimum) {
    auto it = r.options.find(key);
    int v = 0;
    if (it != r.options.end() && parse_number(it->second, v) && v >= minimum) out = v;
  };
  count("warmup_iters", loop.warmup_iters, 0);
  count("iters", loop.iters, 1);
  count("gpus_per_thread", loop.gpus_per_thread, 1);
  return loop;
}

// ---- CSV
// ---------------------------------------------------------------------------------------------------

RunReport read_measurement_csv(const std::string& text, const std::string& origin) {
  const std::vector<std::string> lines = split_lines(text);
  std::vector<std::string> header;
  auto cells = [](const std::string& line) {
    std::vector<std::string> out;
    std::string cell;
    std::istringstream in(line);
    while (std::getline(in, cell, ',')) {
      const std::size_t a = cell.find_first_not_of(" \t"), b = cell.find_last_not_of(" \t");
      out.push_back(a == std::string::npos ? "" : cell.substr(a, b - a + 1));
    }
    if (!line.empty() && line.back() == ',') out.push_back("");
    return out;
  };
  int col_op = -1, col_bytes = -1, col_ranks = -1, col_value = -1;
  CsvMeasure measure = CsvMeasure::TimeUs;
  std::optional<NcclTestsLoop> loop;
  std::optional<RunReport> r;
  for (std::size_t n = 0; n < lines.size(); ++n) {
    auto fail = [&](const std::string& what) {
      return UsageError(fmt::format("{}:{}: {}", origin, n + 1, what));
    };
    if (lines[n].find_first_not_of(" \t") == std::string::npos) continue;
    if (lines[n][0] == '#') {
      // "# nccl-tests loop: nGpus 8 warmup iters: 5 iters: 40": the rows are nccl-tests rows, timed by
      // its loop with these settings (the words of its own header).
      std::vector<std::string> words = split_words(lines[n].substr(1));
      if (words.size() >= 2 && words[0] == "nccl-tests" && words[1] == "loop:") {
        if (loop) throw fail("a second '# nccl-tests loop:' line");
        if (!header.empty()) throw fail("the '# nccl-tests loop:' line must come before the header");
        loop.emplace();
        read_loop_settings({words.begin() + 2, words.end()}, *loop, fmt::format("{}:{}: ", origin, n + 1));
      }
      continue;
    }
    std::vector<std::string> row = cells(lines[n]);
    if (header.empty()) {
      header = row;
      int measures_named = 0;
      for (int k = 0; k < static_cast<int>(header.size()); ++k) {
        const std::string h = lower(header[k]);
        if (h == "op") col_op = k;
        if (h == "bytes") col_bytes = k;
        if (h == "ranks") col_ranks = k;
        for (const auto& [name, m] : kCsvMeasures) {
          if (h != name) continue;
          col_value = k;
          measure = m;
          ++measures_named;
        }
      }
      if (col_op < 0 || col_bytes < 0 || col_ranks < 0 || measures_named != 1) {
        throw fail(fmt::format(
            "the header must name the columns op, bytes, ranks and one of time_us, busbw_gbps and "
            "algbw_gbps; it has '{}'",
            lines[n]));
      }
      continue;
    }
    if (row.size() != header.size()) {
      throw fail(fmt::format("{} fields where the header has {}", row.size(), header.size()));
    }
    const std::optional<CommOp> op = op_from_name(row[col_op]);
    if (!op || *op == CommOp::Barrier) throw fail(fmt::format("unknown collective '{}'", row[col_op]));
    std::int64_t bytes = 0;
    int ranks = 0;
    double value = 0;
    if (!parse_number(row[col_bytes], bytes) || bytes < 0)
      throw fail(fmt::format("bytes '{}' is not a size", row[col_bytes]));
    if (!parse_number(row[col_ranks], ranks) || ranks < 1)
      throw fail(fmt::format("ranks '{}' is not a positive count", row[col_ranks]));
    if (!parse_number(row[col_value], value) || !(value > 0) || !std::isfinite(value)) {
      throw fail(fmt::format("{} '{}' is not a positive {}", header[col_value], row[col_value],
                             measure == CsvMeasure::TimeUs ? "time" : "bandwidth"));
    }
    if (measure != CsvMeasure::TimeUs && bytes == 0) {
      throw fail("a bandwidth for 0 bytes gives no time; give time_us for such rows");
    }
    if (measure == CsvMeasure::BusbwGbps && !(bus_factor(*op, ranks) > 0)) {
      throw fail(fmt::format("{} on {} rank{} moves nothing across a bus, so its busbw gives no time",
                             comm_op_name(*op), ranks, ranks == 1 ? "" : "s"));
    }
    if (!r) {
      r = measured_report(
          loop ? fmt::format("{}{}", kNcclTestsLesson, comm_op_name(*op)) : "measured collectives", ranks);
      if (loop) r->options = loop_options(*loop);
    }
    if (ranks != r->world) {
      throw fail(fmt::format("{} ranks where the rows above have {}: one file describes one world", ranks,
                             r->world));
    }
    if (loop && !r->collectives.empty() && *op != r->collectives.front().op) {
      throw fail(fmt::format("{} in an nccl-tests loop of {}: nccl-tests times one collective a run",
                             comm_op_name(*op), comm_op_name(r->collectives.front().op)));
    }
    // nccl-tests' bandwidths (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x the bus factor.
    const double b = static_cast<double>(bytes);
    const double time_us = measure == CsvMeasure::TimeUs      ? value
                           : measure == CsvMeasure::AlgbwGbps ? b / (value * 1e3)
                                                              : b * bus_factor(*op, ranks) / (value * 1e3);
    if (!std::isfinite(time_us)) {
      throw fail(
          fmt::format("{} '{}' for {} bytes gives no finite time", header[col_value], row[col_value], bytes));
    }
    append_collective(*r, *op, bytes, ranks, time_us);
  }
  if (!r) {
    throw UsageError(
        fmt::format("{}: no rows under the header op,bytes,ranks and time_us (or busbw_gbps, "
                    "algbw_gbps)",
                    origin));
  }
  return std::move(*r);
}

// ---- PyTorch profiler (Kineto) traces ---------------------------------------------------------------------

namespace {

using json = nlohmann::json;

// NCCL's kernel names: "ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)" (2.19 on),
// "ncclKernel_AllReduce_RING_LL_Sum_float(...)" (before). The operation and, where present, the type.
bool is_nccl_kernel(const std::string& name) {
  return name.rfind("ncclDevKernel", 0) == 0 || name.rfind("ncclKernel", 0) == 0;
}

std::string kernel_short_name(const std::string& name) {
  const std::size_t paren = name.find('(');
  std::string s = paren == std::string::npos ? name : name.substr(0, paren);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string string_arg(const json& args, const char* key) {
  auto it = args.find(key);
  return it != args.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// An event's "args" object (a shared empty one when it has none): pointers into the trace stay valid.
const json* args_of(const json& event) {
  static const json none = json::object();
  auto it = event.find("args");
  return it != event.end() && it->is_object() ? &*it : &none;
}

std::int64_t int_arg(const json& args, const char* key) {
  auto it = args.find(key);
  if (it == args.end()) return -1;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_string()) {
    std::int64_t v = -1;
    if (parse_number(it->get<std::string>(), v)) return v;
  }
  return -1;
}

}  // namespace

RunReport read_kineto_traces(const std::vector<std::pair<std::string, std::string>>& traces) {
  if (traces.empty()) throw UsageError("no trace given");
  struct Parsed {
    int rank;
    std::string origin;
    json root;
  };
  std::vector<Parsed> parsed;
  for (std::size_t i = 0; i < traces.size(); ++i) {
    const auto& [origin, text] = traces[i];
    json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded())
      throw UsageError(fmt::format("{}: not valid JSON (is the trace cut short?)", origin));
    if (!root.is_object() || !root.contains("traceEvents") || !root["traceEvents"].is_array()) {
      throw UsageError(fmt::format("{}: a profiler trace needs a \"traceEvents\" array", origin));
    }
    int rank = static_cast<int>(i);
    if (auto d = root.find("distributedInfo"); d != root.end() && d->is_object()) {
      const std::int64_t r = int_arg(*d, "rank");
      if (r >= 0) rank = static_cast<int>(r);
    }
    parsed.push_back({rank, origin, std::move(root)});
  }
  std::sort(parsed.begin(), parsed.end(), [](const Parsed& a, const Parsed& b) { return a.rank < b.rank; });
  for (std::size_t i = 0; i < parsed.size(); ++i) {
    if (parsed[i].rank != static_cast<int>(i)) {
      throw UsageError(
          fmt::format("{}: the trace of rank {} where rank {} was expected (traces of ranks 0..{} "
                      "are needed, one each)",
                      parsed[i].origin, parsed[i].rank, i, parsed.size() - 1));
    }
  }
  const int world = static_cast<int>(parsed.size());
  RunReport r = measured_report("profiled run", world);

  // Collectives are recorded once, from rank 0's trace (every member ran the same ones); the other ranks'
  // NCCL kernels must agree on how many there are.
  std::vector<int> collectives_per_rank(world, 0);
  for (const Parsed& p : parsed) {
    // PyTorch records each collective's parameters on a CPU op ("record_param_comms"); newer versions copy
    // them onto the kernel. The CPU op and the kernel it launched share an "External id".
    std::map<std::int64_t, const json*> comm_params;
    double t0 = INFINITY;
    for (const json& e : p.root["traceEvents"]) {
      if (!e.is_object()) continue;
      if (auto ts = e.find("ts"); ts != e.end() && ts->is_number()) t0 = std::min(t0, ts->get<double>());
      const json* args = args_of(e);
      if (args->contains("In msg nelems")) {
        const std::int64_t id = int_arg(*args, "External id");
        if (id >= 0) comm_params[id] = args;
      }
    }
    if (!std::isfinite(t0)) t0 = 0;
    std::size_t index = 0;
    for (const json& e : p.root["traceEvents"]) {
      ++index;
      if (!e.is_object() || string_arg(e, "cat") != "kernel") continue;
      const std::string name = string_arg(e, "name");
      auto ts = e.find("ts"), dur = e.find("dur");
      if (ts == e.end() || !ts->is_number() || dur == e.end() || !dur->is_number() ||
          dur->get<double>() < 0) {
        throw UsageError(fmt::format("{}: traceEvents[{}] ('{}') has no valid \"ts\" and \"dur\"", p.origin,
                                     index - 1, kernel_short_name(name)));
      }
      const double start_us = ts->get<double>() - t0, end_us = start_us + dur->get<double>();
      if (!is_nccl_kernel(name)) {
        r.regions.push_back({p.rank, kernel_short_name(name), start_us, end_us});
        continue;
      }
      ++collectives_per_rank[p.rank];
      if (p.rank != 0) continue;
      const json& kargs = *args_of(e);
      const json* params = kargs.contains("In msg nelems") ? &kargs : nullptr;
      if (!params) {
        auto it = comm_params.find(int_arg(kargs, "External id"));
        if (it != comm_params.end()) params = it->second;
      }
      auto bad = [&](const std::string& what) {
        return UsageError(
            fmt::format("{}: traceEvents[{}] ({}): {}", p.origin, index - 1, kernel_short_name(name), what));
      };
      if (!params) {
        throw bad(
            "no message size: record the trace with PyTorch 2.1 or later, which keeps each collective's "
            "\"In msg nelems\", \"dtype\" and \"Group size\"");
      }
      std::optional<CommOp> op = op_from_name(string_arg(*params, "Collective name"));
      if (!op) op = op_from_name(name.substr(name.find('_') + 1));
      if (!op) throw bad("cannot tell which collective the kernel runs");
      const std::string dtype = string_arg(*params, "dtype");
      const int elem = element_bytes(dtype);
      if (elem == 0) throw bad(fmt::format("unknown dtype '{}'", dtype));
      const std::int64_t in = int_arg(*params, "In msg nelems"), out = int_arg(*params, "Out msg nelems");
      std::int64_t group = int_arg(*params, "Group size");
      if (group < 0) group = world;
      if (group > world) {
        throw bad(fmt::format("a collective of {} ranks, but only {} trace{} given: give one trace per rank",
                              group, world, world == 1 ? " was" : "s were"));
      }
      // nccl-tests' size: the whole buffer (the gathered output of an all-gather, the input of a
      // reduce-scatter), as the report's collectives count it.
      const std::int64_t nelems = (*op == CommOp::AllGather || *op == CommOp::Gather)
                                      ? std::max(in * group, out)
                                      : std::max(in, std::int64_t{0});
      CollectiveRecord c;
      c.op = *op;
      c.group = group == world ? "world" : fmt::format("group of {}", group);
      c.group_size = static_cast<int>(group);
      c.bytes = nelems * elem;
      c.start_us = start_us;
      c.end_us = end_us;
      const double t = end_us - start_us;
      c.algbw_gbps = t > 0 ? static_cast<double>(c.bytes) / (t * 1e3) : 0;
      c.busbw_gbps = c.algbw_gbps * bus_factor(*op, c.group_size);
      r.collectives.push_back(c);
    }
    for (const RegionRecord& g : r.regions) r.makespan_us = std::max(r.makespan_us, g.end_us);
  }
  for (int k = 1; k < world; ++k) {
    if (collectives_per_rank[k] != collectives_per_rank[0]) {
      throw UsageError(fmt::format("{} has {} NCCL kernels but {} has {}: are these traces of one run?",
                                   parsed[k].origin, collectives_per_rank[k], parsed[0].origin,
                                   collectives_per_rank[0]));
    }
  }
  for (const CollectiveRecord& c : r.collectives) r.makespan_us = std::max(r.makespan_us, c.end_us);
  if (r.collectives.empty() && r.regions.empty()) {
    throw UsageError(
        fmt::format("{}: the trace has no GPU kernels (was it recorded with "
                    "ProfilerActivity.CUDA?)",
                    parsed[0].origin));
  }
  return r;
}

// ---- files -----------------------------------------------------------------------------------------------

RunReport read_measurements(const std::vector<std::string>& paths, std::optional<CommOp> op) {
  if (paths.empty()) throw UsageError("no measurement file given");
  std::vector<std::pair<std::string, std::string>> texts;
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UsageError(fmt::format("cannot read {}", path));
    std::ostringstream s;
    s << in.rdbuf();
    texts.emplace_back(path, s.str());
  }
  const MeasurementFormat f = detect_measurement_format(texts[0].second, texts[0].first);
  for (std::size_t i = 1; i < texts.size(); ++i) {
    if (detect_measurement_format(texts[i].second, texts[i].first) != f || f != MeasurementFormat::Kineto) {
      throw UsageError(fmt::format("{}: only profiler traces come as several files (one per rank); {} is {}",
                                   texts[i].first, texts[0].first, measurement_format_name(f)));
    }
  }
  switch (f) {
    case MeasurementFormat::Report:
      return report_from_json(texts[0].second, texts[0].first);
    case MeasurementFormat::NcclTests:
      return read_nccl_tests(texts[0].second, texts[0].first, op);
    case MeasurementFormat::Csv:
      return read_measurement_csv(texts[0].second, texts[0].first);
    case MeasurementFormat::Kineto:
      return read_kineto_traces(texts);
  }
  throw UsageError("unknown measurement format");
}

}  // namespace ranklab
