#include "common/profile.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "common/errors.h"

namespace ranklab {

std::int64_t Profile::hbm_capacity_bytes() const {
  // GiB, not GB: device memory comes in powers of two, and nvidia-smi reports MiB.
  return static_cast<std::int64_t>(std::llround(gpu.hbm_capacity_gib * 1073741824.0));
}

int Profile::gpus_in(int node_count) const {
  const std::int64_t gpus = std::int64_t{node_count} * gpus_per_node;
  if (gpus > INT_MAX) {
    throw UsageError(fmt::format("{} nodes x {} GPUs per node ({}) = {} GPUs, more than a world holds ({})",
                                 node_count, gpus_per_node, name, gpus, INT_MAX));
  }
  return static_cast<int>(gpus);
}

namespace {

namespace fs = std::filesystem;

// toml++ numbers lines from 1; a node it built itself (no text behind it) has line 0.
int line_of(const toml::source_region& where) {
  return where.begin.line > 0 ? static_cast<int>(where.begin.line) : 1;
}

// "FILE:LINE" of a node. A profile built on a base profile mixes nodes of two files, so the file comes from
// the node itself when toml++ recorded it, and from `origin` otherwise.
std::string location(const toml::source_region& where, const std::string& origin) {
  const std::string& file = where.path && !where.path->empty() ? *where.path : origin;
  return fmt::format("{}:{}", file, line_of(where));
}

[[noreturn]] void fail(const std::string& origin, int line, const std::string& message) {
  throw ProfileError(fmt::format("{}:{}: {}", origin, line, message));
}

[[noreturn]] void fail_at(const toml::source_region& where, const std::string& origin,
                          const std::string& message) {
  throw ProfileError(fmt::format("{}: {}", location(where, origin), message));
}

const char* type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a floating-point number";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

// Levenshtein distance, for "did you mean" on misspelt keys. Keys are short, so O(a*b) is nothing.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Reads one table of a profile: rejects keys it does not know (a misspelt key silently falling back to a
// default would make a profile lie), and turns every type or range problem into "FILE:LINE: message".
class TableReader {
 public:
  // `prefix` is "" for the top level and "gpu" for [gpu]; it qualifies key names in messages.
  TableReader(const toml::table& table, std::string prefix, const std::string& origin,
              std::vector<std::string> known)
      : table_(table), prefix_(std::move(prefix)), origin_(origin), known_(std::move(known)) {
    for (auto&& [key, node] : table_) {
      std::string k(key.str());
      if (std::find(known_.begin(), known_.end(), k) != known_.end()) continue;
      std::string suggestion;
      std::size_t best = 3;  // more edits than this is a different word, not a typo
      for (const std::string& candidate : known_) {
        std::size_t d = edit_distance(k, candidate);
        if (d < best) {
          best = d;
          suggestion = fmt::format(" (did you mean '{}'?)", qualified(candidate));
        }
      }
      fail_at(key.source().begin.line > 0 ? key.source() : node.source(), origin_,
              fmt::format("unknown key '{}'{}; known keys of {}: {}", qualified(k), suggestion, where(),
                          fmt::join(known_, ", ")));
    }
  }

  bool has(const std::string& key) const { return table_.get(key) != nullptr; }

  std::string require_string(const std::string& key) {
    const toml::node& n = require(key);
    if (!n.is_string()) type_error(key, n, "a string");
    std::string s = n.as_string()->get();
    if (s.empty()) fail_at(n.source(), origin_, fmt::format("'{}' must not be empty", qualified(key)));
    return s;
  }

  std::string optional_string(const std::string& key, const std::string& fallback) {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return fallback;
    if (!n->is_string()) type_error(key, *n, "a string");
    return n->as_string()->get();
  }

  // A string that must be one of `choices`.
  std::string choice(const std::string& key, const std::vector<std::string>& choices) {
    std::string s = require_string(key);
    if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
      fail_at(at(key), origin_,
              fmt::format("'{}' must be one of {}, got \"{}\"", qualified(key), fmt::join(choices, ", "), s));
    }
    return s;
  }

  bool boolean(const std::string& key, bool fallback) {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return fallback;
    if (!n->is_boolean()) type_error(key, *n, "a boolean (true or false)");
    return n->as_boolean()->get();
  }

  // A finite number; TOML integers are accepted where a float is expected, since `450` is as clear as
  // `450.0` in a profile.
  std::optional<double> number(const std::string& key, bool required) {
    const toml::node* n = required ? &require(key) : table_.get(key);
    if (n == nullptr) return std::nullopt;
    double v = 0;
    if (n->is_integer()) {
      v = static_cast<double>(n->as_integer()->get());
    } else if (n->is_floating_point()) {
      v = n->as_floating_point()->get();
    } else {
      type_error(key, *n, "a number");
    }
    if (!std::isfinite(v)) fail_at(n->source(), origin_, fmt::format("'{}' must be finite", qualified(key)));
    return v;
  }

  // Greater than 0 and at least `minimum` (a denormal bandwidth would make every transfer last forever),
  // at most `maximum` (a huge latency or capacity overflows the clocks and byte counts built from it).
  double positive(const std::string& key, double minimum, double maximum) {
    double v = *number(key, true);
    if (v <= 0)
      fail_at(at(key), origin_, fmt::format("'{}' must be greater than 0, got {}", qualified(key), v));
    if (v < minimum)
      fail_at(at(key), origin_, fmt::format("'{}' must be at least {}, got {}", qualified(key), minimum, v));
    return at_most(key, v, maximum);
  }

  double non_negative(const std::string& key, double maximum) {
    double v = *number(key, true);
    if (v < 0) fail_at(at(key), origin_, fmt::format("'{}' must not be negative, got {}", qualified(key), v));
    return at_most(key, v, maximum);
  }

  double at_most(const std::string& key, double v, double maximum) {
    if (v > maximum)
      fail_at(at(key), origin_, fmt::format("'{}' must be at most {}, got {}", qualified(key), maximum, v));
    return v;
  }

  // At least `minimum`, or `fallback` when absent.
  double at_least(const std::string& key, double minimum, double maximum, double fallback) {
    std::optional<double> v = number(key, false);
    if (!v) return fallback;
    if (*v < minimum) {
      fail_at(at(key), origin_, fmt::format("'{}' must be at least {}, got {}", qualified(key), minimum, *v));
    }
    return at_most(key, *v, maximum);
  }

  // A fraction of a peak the hardware reaches: 0 would mean the work never finishes, above 1 is faster than
  // the hardware can go.
  double efficiency(const std::string& key, double fallback) {
    std::optional<double> v = number(key, false);
    if (!v) return fallback;
    if (*v <= 0 || *v > 1) {
      fail_at(at(key), origin_, fmt::format("'{}' must be in (0, 1], got {}", qualified(key), *v));
    }
    return *v;
  }

  std::optional<int> count(const std::string& key, bool required, int minimum, int maximum) {
    const toml::node* n = required ? &require(key) : table_.get(key);
    if (n == nullptr) return std::nullopt;
    if (!n->is_integer()) type_error(key, *n, "an integer");
    std::int64_t v = n->as_integer()->get();
    if (v < minimum) {
      fail_at(n->source(), origin_,
              fmt::format("'{}' must be at least {}, got {}", qualified(key), minimum, v));
    }
    if (v > maximum) {
      fail_at(n->source(), origin_,
              fmt::format("'{}' must be at most {}, got {}", qualified(key), maximum, v));
    }
    return static_cast<int>(v);
  }

  const toml::table& table(const std::string& key) {
    const toml::node& n = require(key);
    if (!n.is_table()) type_error(key, n, "a table");
    return *n.as_table();
  }

  const toml::table* optional_table(const std::string& key) {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return nullptr;
    if (!n->is_table()) type_error(key, *n, "a table");
    return n->as_table();
  }

  // Where `key` is written (the table's header when it is absent): for errors that involve two fields.
  const toml::source_region& at(const std::string& key) const {
    const toml::node* n = table_.get(key);
    return n != nullptr ? n->source() : table_.source();
  }
  std::string qualified(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }

 private:
  std::string where() const { return prefix_.empty() ? "the top level" : "[" + prefix_ + "]"; }

  const toml::node& require(const std::string& key) {
    const toml::node* n = table_.get(key);
    if (n == nullptr) {
      // The table header is where the missing line belongs.
      fail_at(table_.source(), origin_, fmt::format("{} is missing '{}'", where(), key));
    }
    return *n;
  }

  [[noreturn]] void type_error(const std::string& key, const toml::node& n, const char* expected) {
    fail_at(n.source(), origin_,
            fmt::format("'{}' must be {}, got {}", qualified(key), expected, type_name(n)));
  }

  const toml::table& table_;
  std::string prefix_;
  const std::string& origin_;
  std::vector<std::string> known_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ProfileError(fmt::format("cannot open profile file '{}': {}", path, std::strerror(errno)));
  // A profile is a page of text; a base that names something else (a device, /proc/kcore) must not be
  // read to its end.
  constexpr std::size_t kMaxBytes = 1 << 20;
  std::string text(kMaxBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw ProfileError(fmt::format("cannot read profile file '{}'", path));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxBytes) {
    throw ProfileError(
        fmt::format("profile file '{}' is larger than {} bytes; is it a profile?", path, kMaxBytes));
  }
  return text;
}

bool is_file(const fs::path& p) {
  std::error_code ec;  // an unreadable directory is "not found", not a crash
  return fs::is_regular_file(p, ec);
}

toml::table parse_toml(const std::string& text, const std::string& origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    fail(origin, line_of(e.source()), std::string(e.description()));
  }
}

// Moves every key of `from` into `into`; tables present in both are merged key by key, so a profile built
// on a base changes exactly the keys it writes. Moving (not copying) keeps each node's file and line.
void overlay(toml::table& into, toml::table&& from) {
  for (auto&& [key, node] : from) {
    toml::table* existing = into.get_as<toml::table>(key.str());
    if (existing != nullptr && node.is_table()) {
      overlay(*existing, std::move(*node.as_table()));
    } else {
      into.insert_or_assign(key, std::move(node));
    }
  }
}

std::optional<std::string> find_profile_file(const std::string& name_or_path, const std::string& first_dir);

// The profile's table with its base, if it names one, merged underneath.
toml::table resolve(const std::string& text, const std::string& origin, const std::string& dir, int depth) {
  toml::table root = parse_toml(text, origin);
  const toml::node* base = root.get("base");
  if (base == nullptr) return root;
  if (!base->is_string())
    fail_at(base->source(), origin, fmt::format("'base' must be a string, got {}", type_name(*base)));
  const std::string base_name = base->as_string()->get();
  if (depth >= 8) {
    fail_at(base->source(), origin,
            fmt::format("'base = \"{}\"': profiles are based on each other more than 8 deep (a cycle?)",
                        base_name));
  }
  if (root.get("name") == nullptr) {
    fail_at(root.source(), origin, "a profile with a 'base' must still set its own 'name'");
  }
  std::optional<std::string> path = find_profile_file(base_name, dir);
  if (!path) {
    fail_at(base->source(), origin,
            fmt::format("'base = \"{}\"': no such profile (available: {})", base_name,
                        fmt::join(list_profiles(), ", ")));
  }
  toml::table merged = resolve(read_file(*path), *path, fs::path(*path).parent_path().string(), depth + 1);
  root.erase("base");
  overlay(merged, std::move(root));
  return merged;
}

// The ranges every number of a profile must lie in. They are far wider than any real machine, and narrow
// enough that no time, byte count or rank count computed from them overflows or stops moving: a latency
// of 1e308 us would never let the clock advance, a bandwidth of 4.9e-324 would make every transfer last
// forever, a capacity of 1e300 GiB overflows a byte count.
constexpr int kMaxGpusPerNode = 4096;
constexpr int kMaxNodes = 65536;  // with kMaxGpusPerNode, a world still fits in an int
constexpr int kMaxCount = 1024;   // links per GPU, GPUs per PCIe switch, NICs per node
constexpr int kMaxRadix = 65536;
constexpr double kMaxLatencyUs = 1e6;  // one second
constexpr double kMinTflops = 1e-3, kMaxTflops = 1e6;
constexpr double kMinGbps = 1e-3, kMaxGbps = 1e6;
constexpr double kMinGib = 1e-3, kMaxGib = 1e6;  // 1 MiB to about 1 PiB
constexpr double kMaxOversubscription = 1000;
// A machine whose collectives start 100 times faster or slower than NCCL predicts is a mistake, not a
// machine.
constexpr double kMinLatencyScale = 0.01, kMaxLatencyScale = 100;
constexpr int kMaxSmCount = 4096;     // streaming multiprocessors of one GPU
constexpr int kMaxTile = 4096;        // a GEMM tile's side, and the k a tile's overhead is worth
constexpr int kMaxGemmDim = 1 << 24;  // a measured GEMM's m, n or k

constexpr double kMaxAttentionTokens = 1 << 24;  // a sequence-length constant of the attention model

// The attention shape model of one pass (`pass` is "fwd" or "bwd"): attention_<pass>_ceiling turns it on,
// and the other three need it (without a ceiling they would silently do nothing).
AttentionShapeModel read_attention_shape(TableReader& gpu, const std::string& pass,
                                         const std::string& origin) {
  const std::string ceiling = "attention_" + pass + "_ceiling";
  AttentionShapeModel m;
  m.ceiling = gpu.efficiency(ceiling, 0);
  for (const char* rest : {"_seq_half", "_hdim64_factor", "_causal_tokens"}) {
    const std::string key = "attention_" + pass + rest;
    if (gpu.has(key) && !gpu.has(ceiling)) {
      fail_at(gpu.at(key), origin,
              fmt::format("'gpu.{}' needs 'gpu.{}', the shape model's ceiling", key, ceiling));
    }
  }
  m.seq_half = gpu.at_least("attention_" + pass + "_seq_half", 0, kMaxAttentionTokens, 0);
  m.hdim64_factor = gpu.efficiency("attention_" + pass + "_hdim64_factor", 1.0);
  m.causal_tokens = gpu.at_least("attention_" + pass + "_causal_tokens", 0, kMaxAttentionTokens, 0);
  return m;
}

// A measured GEMM the GEMM model's ceiling is solved from: `prefix`_tflops at `prefix`_m x _n x _k, which
// it needs, and no faster than the peak named `peak_name`.
struct MeasuredGemm {
  double tflops = 0;
  int m = 0, n = 0, k = 0;
};
MeasuredGemm read_measured_gemm(TableReader& gpu, const std::string& prefix, const char* peak_name,
                                double peak_tflops, const std::string& origin) {
  const std::string tflops = prefix + "_tflops";
  MeasuredGemm g;
  g.tflops = gpu.at_least(tflops, 0, kMaxTflops, 0);
  g.m = gpu.count(prefix + "_m", false, 1, kMaxGemmDim).value_or(0);
  g.n = gpu.count(prefix + "_n", false, 1, kMaxGemmDim).value_or(0);
  g.k = gpu.count(prefix + "_k", false, 1, kMaxGemmDim).value_or(0);
  if (g.tflops > 0 && (g.m == 0 || g.n == 0 || g.k == 0)) {
    fail_at(gpu.at(tflops), origin,
            fmt::format("'gpu.{}' needs the shape it was measured at: {}_m, {}_n and {}_k", tflops, prefix,
                        prefix, prefix));
  }
  if (g.tflops > peak_tflops) {
    fail_at(gpu.at(tflops), origin,
            fmt::format("'gpu.{}' ({}) is above {} ({})", tflops, g.tflops, peak_name, peak_tflops));
  }
  return g;
}

Profile read_profile(const toml::table& root, const std::string& origin) {
  TableReader top(root, "", origin,
                  {"name", "description", "gpus_per_node", "nodes", "barrier_latency_us", "gpu", "nvlink",
                   "pcie", "nic", "fabric", "nccl"});
  Profile p;
  p.name = top.require_string("name");
  p.description = top.optional_string("description", "");
  p.gpus_per_node = *top.count("gpus_per_node", true, 1, kMaxGpusPerNode);
  p.nodes = top.count("nodes", false, 1, kMaxNodes).value_or(1);
  if (top.has("nodes")) p.nodes_at = location(top.at("nodes"), origin);
  p.barrier_latency_us = top.non_negative("barrier_latency_us", kMaxLatencyUs);

  TableReader gpu(top.table("gpu"), "gpu", origin,
                  {"name",
                   "peak_tflops_fp32",
                   "peak_tflops_tf32",
                   "peak_tflops_bf16",
                   "hbm_bandwidth_gbps",
                   "hbm_capacity_gib",
                   "launch_overhead_us",
                   "compute_efficiency",
                   "memory_efficiency",
                   "peak_tflops_fp16",
                   "sm_count",
                   "gemm_tile_m",
                   "gemm_tile_n",
                   "gemm_k_overhead",
                   "gemm_ridge_flops_per_byte",
                   "gemm_fixed_us",
                   "gemm_mamf_tflops",
                   "gemm_mamf_m",
                   "gemm_mamf_n",
                   "gemm_mamf_k",
                   "peak_tflops_fp8",
                   "peak_tflops_fp4",
                   "fp8_mx",
                   "gemm_mamf_fp8_tflops",
                   "gemm_mamf_fp8_m",
                   "gemm_mamf_fp8_n",
                   "gemm_mamf_fp8_k",
                   "attention_fwd_efficiency",
                   "attention_bwd_efficiency",
                   "attention_fwd_ceiling",
                   "attention_fwd_seq_half",
                   "attention_fwd_hdim64_factor",
                   "attention_fwd_causal_tokens",
                   "attention_bwd_ceiling",
                   "attention_bwd_seq_half",
                   "attention_bwd_hdim64_factor",
                   "attention_bwd_causal_tokens"});
  p.gpu.name = gpu.require_string("name");
  p.gpu.peak_tflops_fp32 = gpu.positive("peak_tflops_fp32", kMinTflops, kMaxTflops);
  p.gpu.peak_tflops_tf32 = gpu.positive("peak_tflops_tf32", kMinTflops, kMaxTflops);
  p.gpu.peak_tflops_bf16 = gpu.positive("peak_tflops_bf16", kMinTflops, kMaxTflops);
  p.gpu.hbm_bandwidth_gbps = gpu.positive("hbm_bandwidth_gbps", kMinGbps, kMaxGbps);
  p.gpu.hbm_capacity_gib = gpu.positive("hbm_capacity_gib", kMinGib, kMaxGib);
  p.gpu.launch_overhead_us = gpu.non_negative("launch_overhead_us", kMaxLatencyUs);
  p.gpu.compute_efficiency = gpu.efficiency("compute_efficiency", 1.0);
  p.gpu.memory_efficiency = gpu.efficiency("memory_efficiency", 1.0);
  p.gpu.peak_tflops_fp16 = gpu.has("peak_tflops_fp16")
                               ? gpu.positive("peak_tflops_fp16", kMinTflops, kMaxTflops)
                               : p.gpu.peak_tflops_bf16;
  p.gpu.sm_count = gpu.count("sm_count", false, 1, kMaxSmCount).value_or(0);
  p.gpu.gemm_tile_m = gpu.count("gemm_tile_m", false, 1, kMaxTile).value_or(p.gpu.gemm_tile_m);
  p.gpu.gemm_tile_n = gpu.count("gemm_tile_n", false, 1, kMaxTile).value_or(p.gpu.gemm_tile_n);
  p.gpu.gemm_k_overhead = gpu.at_least("gemm_k_overhead", 0, kMaxTile, 0);
  p.gpu.gemm_ridge_flops_per_byte = gpu.at_least("gemm_ridge_flops_per_byte", 0, kMaxTile, 0);
  p.gpu.gemm_fixed_us = gpu.at_least("gemm_fixed_us", 0, kMaxLatencyUs, 0);
  const MeasuredGemm mamf =
      read_measured_gemm(gpu, "gemm_mamf", "peak_tflops_bf16", p.gpu.peak_tflops_bf16, origin);
  p.gpu.gemm_mamf_tflops = mamf.tflops;
  p.gpu.gemm_mamf_m = mamf.m, p.gpu.gemm_mamf_n = mamf.n, p.gpu.gemm_mamf_k = mamf.k;
  p.gpu.peak_tflops_fp8 = gpu.at_least("peak_tflops_fp8", 0, kMaxTflops, 0);
  p.gpu.peak_tflops_fp4 = gpu.at_least("peak_tflops_fp4", 0, kMaxTflops, 0);
  p.gpu.fp8_mx = gpu.boolean("fp8_mx", false);
  if (p.gpu.fp8_mx && p.gpu.peak_tflops_fp8 == 0) {
    fail_at(gpu.at("fp8_mx"), origin, "'gpu.fp8_mx' needs FP8 tensor cores: set peak_tflops_fp8");
  }
  const MeasuredGemm mamf_fp8 =
      read_measured_gemm(gpu, "gemm_mamf_fp8", "peak_tflops_fp8", p.gpu.peak_tflops_fp8, origin);
  p.gpu.gemm_mamf_fp8_tflops = mamf_fp8.tflops;
  p.gpu.gemm_mamf_fp8_m = mamf_fp8.m, p.gpu.gemm_mamf_fp8_n = mamf_fp8.n, p.gpu.gemm_mamf_fp8_k = mamf_fp8.k;
  p.gpu.attention_fwd_efficiency = gpu.efficiency("attention_fwd_efficiency", 0);
  p.gpu.attention_bwd_efficiency = gpu.efficiency("attention_bwd_efficiency", 0);
  p.gpu.attention_fwd_shape = read_attention_shape(gpu, "fwd", origin);
  p.gpu.attention_bwd_shape = read_attention_shape(gpu, "bwd", origin);

  if (const toml::table* t = top.optional_table("nvlink")) {
    TableReader nv(
        *t, "nvlink", origin,
        {"generation", "links_per_gpu", "link_bandwidth_gbps", "efficiency", "latency_us", "switch", "nvls"});
    p.has_nvlink = true;
    p.nvlink.generation = nv.require_string("generation");
    p.nvlink.links_per_gpu = *nv.count("links_per_gpu", true, 1, kMaxCount);
    p.nvlink.link_bandwidth_gbps = nv.positive("link_bandwidth_gbps", kMinGbps, kMaxGbps);
    p.nvlink.efficiency = nv.efficiency("efficiency", 1.0);
    p.nvlink.latency_us = nv.non_negative("latency_us", kMaxLatencyUs);
    p.nvlink.switch_name = nv.require_string("switch");
    p.nvlink.nvls = nv.boolean("nvls", false);
  }

  TableReader pcie(top.table("pcie"), "pcie", origin,
                   {"generation", "bandwidth_gbps", "efficiency", "latency_us", "gpus_per_switch"});
  p.pcie.generation = pcie.require_string("generation");
  p.pcie.bandwidth_gbps = pcie.positive("bandwidth_gbps", kMinGbps, kMaxGbps);
  p.pcie.efficiency = pcie.efficiency("efficiency", 1.0);
  p.pcie.latency_us = pcie.non_negative("latency_us", kMaxLatencyUs);
  p.pcie.gpus_per_switch = pcie.count("gpus_per_switch", false, 1, kMaxCount).value_or(1);

  TableReader nic(top.table("nic"), "nic", origin,
                  {"name", "count", "bandwidth_gbps", "efficiency", "latency_us"});
  p.nic.name = nic.require_string("name");
  p.nic.count = *nic.count("count", true, 1, kMaxCount);
  p.nic.bandwidth_gbps = nic.positive("bandwidth_gbps", kMinGbps, kMaxGbps);
  p.nic.efficiency = nic.efficiency("efficiency", 1.0);
  p.nic.latency_us = nic.non_negative("latency_us", kMaxLatencyUs);

  TableReader fabric(top.table("fabric"), "fabric", origin,
                     {"kind", "switch", "switch_radix", "switch_latency_us", "oversubscription"});
  p.fabric.kind = fabric.choice("kind", {"infiniband", "roce"});
  p.fabric.switch_name = fabric.require_string("switch");
  p.fabric.switch_radix = *fabric.count("switch_radix", true, 2, kMaxRadix);
  p.fabric.switch_latency_us = fabric.non_negative("switch_latency_us", kMaxLatencyUs);
  p.fabric.oversubscription = fabric.at_least("oversubscription", 1.0, kMaxOversubscription, 1.0);

  if (const toml::table* t = top.optional_table("nccl")) {
    TableReader nccl(*t, "nccl", origin, {"latency_scale"});
    p.nccl.latency_scale = nccl.at_least("latency_scale", kMinLatencyScale, kMaxLatencyScale, 1.0);
  }

  // Counts that must fit together: the topology gives every PCIe switch and every NIC the same number of
  // GPUs, which is what the built-in machines do and what keeps rails symmetric.
  if (p.gpus_per_node % p.pcie.gpus_per_switch != 0) {
    fail_at(
        pcie.at("gpus_per_switch"), origin,
        fmt::format("'pcie.gpus_per_switch' = {} does not divide gpus_per_node = {}: every PCIe switch must "
                    "hold the same number of GPUs",
                    p.pcie.gpus_per_switch, p.gpus_per_node));
  }
  if (p.gpus_per_node % p.nic.count != 0) {
    fail_at(nic.at("count"), origin,
            fmt::format("'nic.count' = {} does not divide gpus_per_node = {}: every NIC must serve the same "
                        "number of GPUs (at most one NIC per GPU)",
                        p.nic.count, p.gpus_per_node));
  }
  if (p.has_nvlink && p.nvlink.nvls && p.gpus_per_node < 2) {
    fail_at(root.source(), origin, "'nvlink.nvls' needs at least 2 GPUs per node");
  }
  return p;
}

// A profile file: `name_or_path` itself when it is an existing file, else NAME or NAME.toml in
// `first_dir` (when given) and then in each profile directory. A path with a directory in it means that
// file and nothing else.
std::optional<std::string> find_profile_file(const std::string& name_or_path, const std::string& first_dir) {
  if (is_file(name_or_path)) return name_or_path;
  if (name_or_path.empty() || name_or_path.find('/') != std::string::npos) return std::nullopt;
  const bool has_ext = fs::path(name_or_path).extension() == ".toml";
  std::vector<std::string> dirs = profile_dirs();
  if (!first_dir.empty()) dirs.insert(dirs.begin(), first_dir);
  for (const std::string& dir : dirs) {
    fs::path candidate = fs::path(dir) / (has_ext ? name_or_path : name_or_path + ".toml");
    if (is_file(candidate)) return candidate.string();
  }
  return std::nullopt;
}

}  // namespace

Profile parse_profile(const std::string& text, const std::string& origin) {
  return read_profile(resolve(text, origin, "", 0), origin);
}

Profile load_profile_file(const std::string& path) {
  Profile p = read_profile(resolve(read_file(path), path, fs::path(path).parent_path().string(), 0), path);
  p.source_file = path;
  return p;
}

std::vector<std::string> profile_dirs() {
  std::vector<std::string> dirs;
  auto add = [&dirs](const std::string& d) {
    if (!d.empty() && std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  };
  // The environment comes first so a user's own profile of the same name wins over the built-in one.
  if (const char* env = std::getenv("RANKLAB_PROFILE_DIR")) {
    std::string list(env);
    std::size_t begin = 0;
    while (begin <= list.size()) {
      std::size_t end = list.find(':', begin);
      if (end == std::string::npos) end = list.size();
      add(list.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  // An installed ranklab keeps its profiles in <prefix>/share/ranklab/profiles beside <prefix>/bin.
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path installed = exe.parent_path().parent_path() / "share" / "ranklab" / "profiles";
    if (fs::is_directory(installed, ec)) add(installed.string());
  }
#ifdef RANKLAB_INSTALLED_PROFILE_DIR
  // Where `cmake --install` puts them by default, for programs of one's own linked with ranklab::sim.
  if (fs::is_directory(RANKLAB_INSTALLED_PROFILE_DIR, ec)) add(RANKLAB_INSTALLED_PROFILE_DIR);
#endif
#ifdef RANKLAB_PROFILE_DIR
  add(RANKLAB_PROFILE_DIR);
#endif
  return dirs;
}

std::vector<std::string> list_profiles() {
  std::vector<std::string> names;
  for (const std::string& dir : profile_dirs()) {
    std::error_code ec;
    fs::directory_iterator it(dir, ec), end;
    if (ec) continue;  // a directory that does not exist simply contributes nothing
    for (; it != end; it.increment(ec)) {
      if (ec) break;
      const fs::path& p = it->path();
      if (p.extension() == ".toml" && is_file(p)) names.push_back(p.stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

namespace {
// The upper-cased words of a GPU's name: "A100-SXM4-80GB" is A100, SXM4, 80GB.
std::set<std::string> name_words(const std::string& name) {
  std::set<std::string> out;
  std::string word;
  for (char c : name + " ") {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      word += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    } else if (!word.empty()) {
      out.insert(word);
      word.clear();
    }
  }
  return out;
}
}  // namespace

std::string profile_for_gpu(const std::string& device_name) {
  const std::set<std::string> device = name_words(device_name);
  std::string best;
  std::size_t best_score = 0;
  for (const std::string& name : list_profiles()) {
    // Shared words count (SXM4, PCIe, 80GB) once a model number (a word with a digit: H100) is shared.
    std::size_t score = 0;
    bool model = false;
    for (const std::string& w : name_words(load_profile(name).gpu.name)) {
      if (!device.count(w)) continue;
      ++score;
      model = model || std::any_of(w.begin(), w.end(),
                                   [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    }
    if (model && score > best_score) {
      best = name;
      best_score = score;
    }
  }
  return best;
}

Profile load_profile(const std::string& name_or_path) {
  // A bare name ("dgx-h100") or a file name ("dgx-h100.toml") is looked up in the profile directories; a
  // path with a directory in it means that file and nothing else.
  if (std::optional<std::string> path = find_profile_file(name_or_path, "")) return load_profile_file(*path);
  const std::vector<std::string> dirs = profile_dirs();
  const bool has_dir = name_or_path.find('/') != std::string::npos;

  std::vector<std::string> available = list_profiles();
  std::string known = available.empty() ? "none found" : fmt::format("{}", fmt::join(available, ", "));
  if (has_dir) {
    throw ProfileError(
        fmt::format("no profile file '{}'; the built-in profiles are: {}", name_or_path, known));
  }
  throw ProfileError(fmt::format(
      "no profile called '{}' (looked in {}); available profiles: {}", name_or_path,
      dirs.empty() ? std::string("no directories") : fmt::format("{}", fmt::join(dirs, ", ")), known));
}

}  // namespace ranklab
