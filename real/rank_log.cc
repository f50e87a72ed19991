#include "real/rank_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>

#include "common/errors.h"

namespace ranklab {

namespace {

// A flat little-endian byte stream: every process of a job is the same build on the same architecture,
// so fixed-width copies are enough.
class Writer {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void put(const std::string& s) {
    put<std::uint64_t>(s.size());
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  std::string get_string() {
    const auto n = get<std::uint64_t>();
    need(n);
    std::string s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  bool done() const { return at_ == in_.size(); }

 private:
  void need(std::uint64_t n) const {
    if (n > in_.size() - at_) throw BackendError("a rank's log arrived truncated");
  }
  const std::string& in_;
  size_t at_ = 0;
};

constexpr std::uint32_t kMagic = 0x52414e4b;  // "RANK"

}  // namespace

std::string serialize(const RankLog& log) {
  Writer w;
  w.put(kMagic);
  w.put<std::int32_t>(log.rank);
  w.put<std::int32_t>(log.device);
  w.put(log.host);
  w.put(log.device_name);
  w.put(log.end_us);
  w.put(log.peak_bytes);
  w.put(log.capacity_bytes);
  w.put<std::uint8_t>(log.spans_truncated);
  w.put<std::uint64_t>(log.compute.size());
  for (const Span& s : log.compute) {
    w.put<std::int32_t>(static_cast<std::int32_t>(s.kind));
    w.put(s.name.str());
    w.put(s.start_us);
    w.put(s.end_us);
  }
  w.put<std::uint64_t>(log.comms.size());
  for (const CommTiming& c : log.comms) {
    w.put<std::int32_t>(static_cast<std::int32_t>(c.op));
    w.put(c.key);
    w.put(c.group);
    w.put<std::int32_t>(c.group_size);
    w.put(c.bytes);
    w.put<std::uint8_t>(c.record_owner);
    w.put<std::uint8_t>(c.bookkeeping);
    w.put(c.start_us);
    w.put(c.end_us);
  }
  w.put<std::uint64_t>(log.regions.size());
  for (const RegionRecord& r : log.regions) {
    w.put(r.name);
    w.put(r.start_us);
    w.put(r.end_us);
  }
  w.put<std::uint64_t>(log.checks.size());
  for (const CheckRecord& c : log.checks) {
    w.put(c.what);
    w.put<std::uint8_t>(c.passed);
    w.put(c.detail);
  }
  w.put<std::uint64_t>(log.output.size());
  for (const TimedLine& l : log.output) {
    w.put(l.time_us);
    w.put(l.text);
  }
  w.put<std::uint8_t>(log.training.has_value());
  if (log.training) {
    const TrainingStats& t = *log.training;
    w.put(t.model);
    w.put(t.layout);
    w.put(t.tokens_per_step);
    w.put<std::int32_t>(t.micro_batches);
    for (double x : {t.step_time_us, t.model_flops, t.hardware_flops, t.model_tflops_per_gpu,
                     t.hardware_tflops_per_gpu, t.mfu, t.bubble_fraction, t.bubble_fraction_formula}) {
      w.put(x);
    }
    w.put<std::uint64_t>(t.exposed_comm_us.size());
    for (const auto& [dim, us] : t.exposed_comm_us) {
      w.put(dim);
      w.put(us);
    }
    for (std::int64_t b : {t.peak_memory_bytes, t.weights_bytes, t.grads_bytes, t.optimizer_bytes,
                           t.activations_bytes, t.moe_routes, t.moe_dropped_routes}) {
      w.put(b);
    }
  }
  w.put<std::uint64_t>(log.pipeline.size());
  for (const PipelineTask& t : log.pipeline) {
    for (int x : {t.rank, t.stage, t.chunk, t.micro_batch}) w.put<std::int32_t>(x);
    w.put<std::uint8_t>(t.forward);
    w.put(t.start_us);
    w.put(t.end_us);
  }
  return w.take();
}

RankLog deserialize(const std::string& bytes) {
  Reader r(bytes);
  if (r.get<std::uint32_t>() != kMagic) throw BackendError("a rank's log arrived garbled");
  RankLog log;
  log.rank = r.get<std::int32_t>();
  log.device = r.get<std::int32_t>();
  log.host = r.get_string();
  log.device_name = r.get_string();
  log.end_us = r.get<double>();
  log.peak_bytes = r.get<std::int64_t>();
  log.capacity_bytes = r.get<std::int64_t>();
  log.spans_truncated = r.get<std::uint8_t>() != 0;
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    Span s;
    s.rank = log.rank;
    s.kind = static_cast<SpanKind>(r.get<std::int32_t>());
    s.name = r.get_string();
    s.start_us = r.get<double>();
    s.end_us = r.get<double>();
    log.compute.push_back(std::move(s));
  }
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    CommTiming c;
    c.op = static_cast<CommOp>(r.get<std::int32_t>());
    c.key = r.get_string();
    c.group = r.get_string();
    c.group_size = r.get<std::int32_t>();
    c.bytes = r.get<std::int64_t>();
    c.record_owner = r.get<std::uint8_t>() != 0;
    c.bookkeeping = r.get<std::uint8_t>() != 0;
    c.start_us = r.get<double>();
    c.end_us = r.get<double>();
    log.comms.push_back(std::move(c));
  }
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    RegionRecord g;
    g.rank = log.rank;
    g.name = r.get_string();
    g.start_us = r.get<double>();
    g.end_us = r.get<double>();
    log.regions.push_back(std::move(g));
  }
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    CheckRecord c;
    c.rank = log.rank;
    c.what = r.get_string();
    c.passed = r.get<std::uint8_t>() != 0;
    c.detail = r.get_string();
    log.checks.push_back(std::move(c));
  }
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    TimedLine l;
    l.time_us = r.get<double>();
    l.text = r.get_string();
    log.output.push_back(std::move(l));
  }
  if (r.get<std::uint8_t>() != 0) {
    TrainingStats t;
    t.model = r.get_string();
    t.layout = r.get_string();
    t.tokens_per_step = r.get<std::int64_t>();
    t.micro_batches = r.get<std::int32_t>();
    for (double* x : {&t.step_time_us, &t.model_flops, &t.hardware_flops, &t.model_tflops_per_gpu,
                      &t.hardware_tflops_per_gpu, &t.mfu, &t.bubble_fraction, &t.bubble_fraction_formula}) {
      *x = r.get<double>();
    }
    for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
      std::string dim = r.get_string();
      t.exposed_comm_us[std::move(dim)] = r.get<double>();
    }
    for (std::int64_t* b : {&t.peak_memory_bytes, &t.weights_bytes, &t.grads_bytes, &t.optimizer_bytes,
                            &t.activations_bytes, &t.moe_routes, &t.moe_dropped_routes}) {
      *b = r.get<std::int64_t>();
    }
    log.training = std::move(t);
  }
  for (auto n = r.get<std::uint64_t>(); n > 0; --n) {
    PipelineTask t;
    for (int* x : {&t.rank, &t.stage, &t.chunk, &t.micro_batch}) *x = r.get<std::int32_t>();
    t.forward = r.get<std::uint8_t>() != 0;
    t.start_us = r.get<double>();
    t.end_us = r.get<double>();
    log.pipeline.push_back(t);
  }
  if (!r.done()) throw BackendError("a rank's log arrived with bytes to spare");
  return log;
}

RunReport assemble_report(const std::vector<RankLog>& logs, const std::string& backend,
                          const std::string& profile) {
  std::vector<const RankLog*> ordered;
  for (const RankLog& l : logs) ordered.push_back(&l);
  std::sort(ordered.begin(), ordered.end(),
            [](const RankLog* a, const RankLog* b) { return a->rank < b->rank; });

  RunReport report;
  report.backend = backend;
  report.profile = profile;
  report.world = static_cast<int>(logs.size());

  // The transfer of each operation is its shortest member's duration (see the header).
  // Its size is the largest member's: they agree but for an uneven all_to_all, whose size (as nccl-tests
  // reports all_to_all, the bytes a rank sends) is the busiest sender's, as on the simulator.
  std::map<std::string, double> transfer_us;
  std::map<std::string, std::int64_t> size_bytes;
  for (const RankLog* l : ordered) {
    for (const CommTiming& c : l->comms) {
      const double d = std::max(0.0, c.end_us - c.start_us);
      auto [it, inserted] = transfer_us.try_emplace(c.key, d);
      if (!inserted) it->second = std::min(it->second, d);
      std::int64_t& b = size_bytes[c.key];
      b = std::max(b, c.bytes);
    }
  }

  // GPUs per node, as the run used them: the most ranks any one host ran. The topology is what the logs
  // know of it: each rank's GPU and the host it was in (hosts numbered in rank order); not the links.
  std::map<std::string, int> ranks_per_host, host_index;
  for (const RankLog* l : ordered) {
    report.gpus_per_node = std::max(report.gpus_per_node, ++ranks_per_host[l->host]);
    const int host = host_index.try_emplace(l->host, static_cast<int>(host_index.size())).first->second;
    report.topology.nodes.push_back({fmt::format("gpu{}", l->rank), "gpu", 0, host, l->rank});
  }

  std::vector<std::pair<int, const TimedLine*>> lines;
  for (const RankLog* l : ordered) {
    RankSummary s;
    s.rank = l->rank;
    s.end_us = l->end_us;
    s.peak_bytes = l->peak_bytes;
    s.capacity_bytes = l->capacity_bytes;
    report.ranks.push_back(s);
    report.makespan_us = std::max(report.makespan_us, l->end_us);
    report.spans.insert(report.spans.end(), l->compute.begin(), l->compute.end());
    for (const CommTiming& c : l->comms) {
      const double transfer = transfer_us[c.key];
      const double begin = std::max(c.start_us, c.end_us - transfer);
      const std::string name = comm_op_name(c.op);
      if (begin > c.start_us) report.spans.push_back(Span{l->rank, SpanKind::Idle, name, c.start_us, begin});
      report.spans.push_back(Span{l->rank, SpanKind::Comm, name, begin, c.end_us});
      if (c.record_owner) {
        CollectiveRecord r;
        r.op = c.op;
        r.group = c.group;
        r.group_size = c.group_size;
        r.bytes = size_bytes[c.key];
        r.algorithm = "nccl";
        r.start_us = begin;
        r.end_us = c.end_us;
        r.bookkeeping = c.bookkeeping;
        if (transfer > 0) {
          r.algbw_gbps = static_cast<double>(r.bytes) / transfer * 1e-3;  // bytes per us -> GB/s
          r.busbw_gbps = r.algbw_gbps * bus_factor(c.op, c.group_size);
        }
        report.collectives.push_back(std::move(r));
      }
    }
    report.regions.insert(report.regions.end(), l->regions.begin(), l->regions.end());
    // Rank 0 reports the training figures; should another rank do so too, the lowest rank's win.
    if (l->training && !report.training) report.training = l->training;
    report.pipeline.insert(report.pipeline.end(), l->pipeline.begin(), l->pipeline.end());
    report.checks.insert(report.checks.end(), l->checks.begin(), l->checks.end());
    for (const TimedLine& t : l->output) lines.emplace_back(l->rank, &t);
  }

  std::sort(report.spans.begin(), report.spans.end(), [](const Span& a, const Span& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.start_us < b.start_us;
  });
  std::stable_sort(
      report.collectives.begin(), report.collectives.end(),
      [](const CollectiveRecord& a, const CollectiveRecord& b) { return a.start_us < b.start_us; });
  std::stable_sort(lines.begin(), lines.end(), [](const auto& a, const auto& b) {
    return a.second->time_us != b.second->time_us ? a.second->time_us < b.second->time_us : a.first < b.first;
  });
  for (const auto& [rank, line] : lines) report.output.push_back(line->text);
  summarize_spans(report);
  return report;
}

}  // namespace ranklab
