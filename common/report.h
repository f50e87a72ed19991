// RunReport: what a run did and how long it took, filled by either backend, so the writers and
// `compare` never care where a report came from.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/rank.h"
#include "common/units.h"

namespace ranklab {

// A name stored once per distinct text for the life of the process (kernel, collective, group and
// algorithm names repeat millions of times in a large run): one pointer, compared by pointer, read as a
// std::string. Interning is thread-safe.
class SpanName {
 public:
  SpanName();                       // ""
  SpanName(std::string_view text);  // NOLINT: implicit, so a Span is built from any string
  SpanName(const std::string& text) : SpanName(std::string_view(text)) {}  // NOLINT
  SpanName(const char* text) : SpanName(std::string_view(text)) {}         // NOLINT
  const std::string& str() const { return *text_; }
  operator const std::string&() const { return *text_; }  // NOLINT
  const char* c_str() const { return text_->c_str(); }
  std::size_t size() const { return text_->size(); }
  bool empty() const { return text_->empty(); }
  friend bool operator==(const SpanName& a, const SpanName& b) { return a.text_ == b.text_; }
  friend bool operator==(const SpanName& a, std::string_view b) { return *a.text_ == b; }
  friend bool operator==(const SpanName& a, const char* b) { return *a.text_ == b; }
  friend bool operator==(const SpanName& a, const std::string& b) { return *a.text_ == b; }
  friend auto operator<=>(const SpanName& a, const SpanName& b) { return *a.text_ <=> *b.text_; }
  friend std::string operator+(const std::string& a, const SpanName& b) { return a + *b.text_; }
  friend std::string operator+(const char* a, const SpanName& b) { return a + *b.text_; }

 private:
  const std::string* text_;
};

// What a rank's timeline shows at a moment.
enum class SpanKind : std::uint8_t { Compute, Comm, Idle };
const char* span_kind_name(SpanKind k);

// One interval on one rank's stream. Idle spans are the time a rank's communication stream spent
// waiting for the other members of a collective to arrive: the bubble. 32 bytes: a large simulated run
// records tens of millions.
struct Span {
  std::int32_t rank = 0;
  SpanKind kind = SpanKind::Compute;
  SpanName name;  // kernel or collective name
  double start_us = 0;
  double end_us = 0;
};

// One collective as the group saw it (recorded once, by the group's first member).
struct CollectiveRecord {
  CommOp op = CommOp::AllReduce;
  SpanName group;  // "world" or "group 2 {0, 1}"
  int group_size = 0;
  std::int64_t bytes = 0;  // the size nccl-tests calls `size` (see docs/model.md)
  SpanName algorithm;      // "ring", ...
  double start_us = 0;
  double end_us = 0;
  double algbw_gbps = 0;  // bytes / time
  double busbw_gbps = 0;  // algbw times the op's bus factor (nccl-tests doc/PERFORMANCE.md)
  // Issued inside Rank::bookkeeping() (the lesson's checks and printed figures): left out of the
  // summary's collectives table and of the link traffic, and counted apart.
  bool bookkeeping = false;
  double time_us() const { return end_us - start_us; }
};

// The collectives of one (op, size, group size, algorithm), as the summary's table groups them: gathered
// over every operation of the run, where a large run keeps the records of its traced ranks' operations only.
struct CollectiveTotal {
  CommOp op = CommOp::AllReduce;
  std::int64_t bytes = 0;
  int group_size = 0;
  SpanName algorithm;
  bool bookkeeping = false;  // the lesson's own checks and figures (CollectiveRecord::bookkeeping)
  std::int64_t count = 0;
  double total_us = 0;
  double min_us = 0;
  double max_us = 0;
  double mean_us() const { return count > 0 ? total_us / static_cast<double>(count) : 0; }
  // nccl-tests' definitions at the mean time: algbw = size / time, busbw = algbw * bus factor.
  double algbw_gbps() const;
  double busbw_gbps() const;
};

// Collective records grouped into CollectiveTotal rows, in order of their first record (for a sweep, the
// sweep's order).
class CollectiveTally {
 public:
  void add(const CollectiveRecord& c);
  const std::vector<CollectiveTotal>& rows() const { return rows_; }
  std::vector<CollectiveTotal> take() { return std::move(rows_); }

 private:
  std::vector<CollectiveTotal> rows_;
  std::map<std::tuple<int, std::int64_t, int, const std::string*, bool>, std::size_t> index_;
};

struct RegionRecord {
  int rank = 0;
  std::string name;
  double start_us = 0;
  double end_us = 0;
};

struct CheckRecord {
  int rank = 0;
  std::string what;
  bool passed = false;
  std::string detail;
};

// Per-rank totals. Busy times are unions of spans on each stream; idle is the rest of the rank's time.
struct RankSummary {
  int rank = 0;
  double end_us = 0;           // host clock when the rank finished
  double compute_us = 0;       // compute-stream busy time
  double comm_us = 0;          // communication-stream busy time (transfers, not waiting)
  double comm_wait_us = 0;     // time collectives waited for late members
  double exposed_comm_us = 0;  // communication not hidden under compute
  double idle_us = 0;          // neither stream busy: the bubble
  // Simulator: device time compute kernels lost to communication kernels on the same GPU, which hold
  // some of its SMs and HBM bandwidth while they run (docs/model.md). 0 elsewhere.
  double comm_slowed_compute_us = 0;
  // Simulator: device time the compute stream stood idle waiting for the host to launch its next kernel
  // (Rank::host_wait_us). 0 elsewhere.
  double host_wait_us = 0;
  std::int64_t peak_bytes = 0;
  std::int64_t capacity_bytes = 0;
  // Simulator, symmetric runs: the representative this rank mirrors, whose figures are its own
  // (SimSymmetry); -1 for a rank that ran.
  int mirror_of = -1;
};

struct LinkTraffic {
  std::string link;  // "nvlink gpu0->gpu1"
  std::string tier;  // "nvlink", "network", ...
  std::int64_t bytes = 0;
  double bandwidth_gbps = 0;  // the link's capacity per direction; 0 when unknown
};

// The machine a run used, as data: its devices and the directed links between them, so the report draws
// the topology without reading link names back. The simulator describes its model (every device of the
// servers that ran a rank, and the fabric between them); the real backend knows which host ran each GPU and
// nothing of the links. Both lists are empty when the backend knew nothing.
struct TopologyNode {
  std::string id;    // unique in the report: "gpu3", "nvswitch0", "leaf5"
  std::string kind;  // "gpu", "nvswitch", "pcie", "cpu", "nic", "leaf", "spine"
  // Its row in the hierarchy, top to bottom: the simulator puts the fabric's spines at 0, then leaves, NICs
  // (and the CPU), PCIe switches, GPUs, and the NVSwitches below the GPUs. Only the order matters.
  int level = 0;
  int host = -1;  // the server it is part of; -1 for a switch the servers share
  int rank = -1;  // the rank that ran on it (a GPU); -1 otherwise
};

struct TopologyLink {
  std::string id;    // the name LinkTraffic::link gives it: "gpu3->nvswitch0"
  std::string from;  // TopologyNode ids
  std::string to;
  std::string tier;           // "nvlink", "pcie", "network"
  double bandwidth_gbps = 0;  // per direction; 0 when unknown
};

struct RunTopology {
  std::vector<TopologyNode> nodes;
  std::vector<TopologyLink> links;
  bool empty() const { return nodes.empty() && links.empty(); }
};

// Every rank's time, bin by bin over the run, as the page's heat strip draws it. Per rank and bin, three
// digits: the ninths of the bin (0 to 9, 9 the whole bin) its compute kept busy, its communication kept busy
// beyond the compute (exposed), and its collectives spent waiting for late members beyond both; the rest
// is idle. A mirror's row is empty: its representative's (RankSummary::mirror_of) is its own.
struct ActivityStrip {
  double bin_us = 0;
  int bins = 0;
  std::vector<std::string> ranks;
};

struct RunReport {
  std::string lesson;
  std::string backend;  // "sim" or "cuda"
  std::string profile;
  int world = 0;
  int gpus_per_node = 0;  // of the profile; 0 when unknown (the topology drawing groups by node)
  // The lesson's options as the command line spells them (name -> value), so `compare` can refuse two
  // reports of different configurations and `calibrate` can simulate the same run again.
  std::map<std::string, std::string> options;
  double makespan_us = 0;  // the latest rank's end
  // Simulator: transfers that started in the engine's past (a rank a barrier woke behind the present), run
  // alone up to it, so their contention with what had already ended is not modelled. 0 elsewhere.
  std::int64_t late_starts = 0;
  std::vector<RankSummary> ranks;
  // The ranks whose timeline the report keeps (spans, regions, and the records of their collectives),
  // ascending; empty when it keeps every rank's (TraceRanks).
  std::vector<int> traced_ranks;
  std::vector<Span> spans;
  std::vector<CollectiveRecord> collectives;
  // Every collective of the run, grouped; empty where `collectives` holds them all (collective_totals).
  std::vector<CollectiveTotal> collective_totals;
  ActivityStrip activity;  // empty where the backend gathered none (the real backend, older reports)
  std::vector<RegionRecord> regions;
  std::vector<CheckRecord> checks;
  std::vector<LinkTraffic> links;  // the links that carried bytes
  RunTopology topology;
  std::vector<std::string> output;  // the lesson's printed lines, in order
  // What a training lesson reported for its timed step (Rank::report_training); empty otherwise.
  std::optional<TrainingStats> training;
  // A pipeline-parallel lesson's timed step, task by task, as its ranks reported them
  // (Rank::report_pipeline); empty otherwise.
  std::vector<PipelineTask> pipeline;

  bool all_checks_passed() const;
  // Whether the report keeps `rank`'s timeline.
  bool traces(int rank) const;
  std::int64_t total_link_bytes() const;
};

// nccl-tests' bus-bandwidth factor: busbw = algbw * factor (doc/PERFORMANCE.md of NVIDIA/nccl-tests, and
// src/scatter.cu, src/gather.cu there for the two ops that page leaves out). Raises UsageError when
// group_size < 1.
double bus_factor(CommOp op, int group_size);

// A pipeline task as the report's pages and trace name it ("forward mb 3", "backward mb 0 chunk 1"), and
// its short label inside a box ("F3", "B0.1"); the chunk only when the schedule is interleaved.
std::string pipeline_task_name(const PipelineTask& t, bool interleaved);
std::string pipeline_task_label(const PipelineTask& t, bool interleaved);

// The run's collectives grouped: report.collective_totals, or when it is empty, its records grouped.
std::vector<CollectiveTotal> collective_totals(const RunReport& report);

// Fills each RankSummary's busy/idle totals from the spans. Adds a RankSummary for every rank below
// `world` or named by a span that has none (ranks end up sorted by rank). A rank's end_us is kept when the
// backend set it and otherwise taken from its latest span; makespan_us likewise. O(n log n) in the spans.
void summarize_spans(RunReport& report);

// The training figures as the terminal prints them: step time, FLOPs and MFU, bubble, exposed
// communication per dimension, and the memory of the reporting rank by part.
std::string format_training(const TrainingStats& t);

// The terminal summary: the training figures when there are any, per-rank time split, collectives grouped
// by op and size, checks.
std::string format_summary(const RunReport& report);

// The unit of time the summary prints in, for the other writers: "12.5 us" / "3.20 ms" / "1.500 s". Sizes and
// bandwidths: format_bytes and format_gbps (common/units.h).
std::string human_time(double us);

// The whole report as JSON (schema in docs/report.md).
std::string report_to_json(const RunReport& report);
// The same text written to `out` as it is made, a megabyte at a time.
void write_report_json(const RunReport& report, std::ostream& out);

// Reads back what report_to_json wrote (the same schema version), so `compare` can load saved reports.
// Raises UsageError for text that is not JSON, another schema version, a required field missing, a value
// of the wrong type or an integer its field cannot hold; the message starts with `document` (the file's
// name) and names the value's path: "run/report.json: ranks[3].peak_bytes: expected an integer, got ...".
RunReport report_from_json(const std::string& json, std::string_view document = "report JSON");

// One training step's figures alone, in the form the report's `training` object has (`ranklab plan` passes
// them between the processes of a job); the reader checks it as report_from_json does.
std::string training_to_json(const TrainingStats& stats);
TrainingStats training_from_json(const std::string& json, std::string_view document);

}  // namespace ranklab

template <>
struct fmt::formatter<ranklab::SpanName> : fmt::formatter<std::string_view> {
  auto format(const ranklab::SpanName& n, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(n.str(), ctx);
  }
};
