#include "plan/candidates.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "common/errors.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/model.h"
#include "lessons/parallel/groups.h"
#include "sim/compute_model.h"
#include "sim/net/network_model.h"

namespace ranklab::plan {

std::string Layout::name() const {
  return fmt::format("tp{}-pp{}-v{}-dp{}-zero{}{}-mb{}-{}-{}", tp, pp, v, dp, zero, sp ? "-sp" : "",
                     micro_batch, recompute, order);
}

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

// The number after `prefix` in `token` ("tp4" -> 4), or -1.
int number_after(const std::string& token, const std::string& prefix) {
  if (token.rfind(prefix, 0) != 0 || token.size() == prefix.size() || token.size() > prefix.size() + 6)
    return -1;
  int v = 0;
  for (std::size_t i = prefix.size(); i < token.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(token[i]))) return -1;
    v = v * 10 + (token[i] - '0');
  }
  return v;
}

}  // namespace

Layout parse_layout(const std::string& name) {
  const std::string example = "tp4-pp8-v2-dp16-zero1-sp-mb1-selective-tp-dp-pp";
  auto bad = [&](const std::string& what) {
    return UsageError(fmt::format(
        "--explain '{}': {}; a layout is written as the table prints it, such as {}", name, what, example));
  };
  std::vector<std::string> t = split(name, '-');
  if (t.size() < 9) throw bad("too few parts");
  Layout l;
  l.order = t[t.size() - 3] + "-" + t[t.size() - 2] + "-" + t[t.size() - 1];
  t.resize(t.size() - 3);
  const std::vector<std::pair<const char*, int*>> numbers = {
      {"tp", &l.tp}, {"pp", &l.pp}, {"v", &l.v}, {"dp", &l.dp}, {"zero", &l.zero}};
  std::size_t i = 0;
  for (const auto& [prefix, field] : numbers) {
    if (i >= t.size() || (*field = number_after(t[i], prefix)) < 0)
      throw bad(fmt::format("part {} should be {}N", i + 1, prefix));
    ++i;
  }
  if (i < t.size() && t[i] == "sp") {
    l.sp = true;
    ++i;
  }
  if (i >= t.size() || (l.micro_batch = number_after(t[i], "mb")) < 0)
    throw bad("the micro-batch should be mbN");
  ++i;
  if (i >= t.size() || (t[i] != "none" && t[i] != "selective" && t[i] != "full"))
    throw bad("the recompute part should be none, selective or full");
  l.recompute = t[i++];
  if (i != t.size()) throw bad(fmt::format("unexpected '{}'", t[i]));
  return l;
}

Options lesson_options(const Question& q, const Layout& l) {
  // The lesson's defaults for everything the question and the layout leave (the learning rate), as
  // `ranklab run gpt` gives them.
  static const Options defaults = with_lesson_defaults(find_lesson("gpt"), Options{}, {}, false);
  Options o = defaults;
  o.world = q.world();
  o.model = q.model == "custom" ? "" : q.model;
  o.layers = q.layers;
  o.hidden = q.hidden;
  o.heads = q.heads;
  o.seq = q.seq;
  o.vocab = q.vocab;
  o.global_batch = q.global_batch;
  o.dtype = q.dtype;
  o.micro_batch = l.micro_batch;
  o.tp = l.tp;
  o.pp = l.pp;
  o.dp = l.dp;
  o.interleave = l.v;
  o.zero = l.zero;
  o.seq_parallel = l.sp;
  o.recompute = l.recompute;
  o.order = l.order;
  o.phantom = true;
  o.steps = 1;
  o.quiet = true;
  o.peak_tflops_16bit = q.profile.gpu.peak_tflops_bf16;
  o.peak_tflops_fp32 = q.profile.gpu.peak_tflops_fp32;
  o.gpus_per_node = q.profile.gpus_per_node;
  return o;
}

const char* status_name(Status s) {
  switch (s) {
    case Status::Invalid:
      return "invalid";
    case Status::RejectedMemory:
      return "rejected-memory";
    case Status::PrunedBound:
      return "pruned-bound";
    case Status::Unexplored:
      return "unexplored";
    case Status::Simulated:
      return "simulated";
    case Status::Pending:
      return "pending";
  }
  return "?";
}

std::int64_t planned_peak_bytes(const gpt::Config& c) {
  std::int64_t most = 0;
  for (int s = 0; s < c.pp; ++s) most = std::max(most, gpt::memory_plan(c, s).total());
  return most;
}

StepBound::StepBound(const Profile& profile)
    : profile_(profile),
      compute_(std::make_unique<sim::ComputeModel>(profile.gpu)),
      network_(std::make_unique<sim::NetworkModel>(profile)) {}

StepBound::~StepBound() = default;

double StepBound::comm_us(CommOp op, std::int64_t bytes, const std::vector<int>& ranks) {
  const auto key = std::make_tuple(static_cast<int>(op), bytes, ranks);
  const auto it = comm_.find(key);
  if (it != comm_.end()) return it->second;
  const double t = op == CommOp::Send
                       ? sim::duration_us(network_->plan_p2p(ranks[0], ranks[1], bytes))
                       : sim::duration_us(network_->plan_collective(op, bytes, ranks, ranks[0]));
  return comm_[key] = t;
}

double StepBound::us(const gpt::Config& c) {
  // The kernels each take what the simulator's compute model charges them (sim/compute_model.h), for the
  // shapes the model's code gives them (model.cc, parallel/tensor_parallel.cc): per layer, per micro-batch of
  // R = s b rows, on one tp rank, four GEMMs forward, the weight's and the input's gradient of each backward,
  // and causal attention over heads / tp heads both ways. Recompute runs forward parts again.
  const sim::ComputeModel& k = *compute_;
  const std::int64_t R = c.rows(), h = c.hidden, t = c.tp, V = c.vocab;
  const DType d = c.dtype;
  struct Gemm {
    std::int64_t in, out;
  };
  const Gemm linears[] = {{h, 3 * h / t}, {h / t, h}, {h, 4 * h / t}, {4 * h / t, h}};  // qkv, proj, fc1, fc2
  double forward_us = 0, backward_us = 0;
  for (const Gemm& g : linears) {
    forward_us += k.gemm_us(R, g.out, g.in, d);
    backward_us += k.gemm_us(g.in, g.out, R, d) + k.gemm_us(R, g.in, g.out, d);  // x^T dy, dy w^T
  }
  const double attention_fwd =
      k.attention_us(c.micro_batch, c.seq, c.heads / t, c.head_dim(), true, false, d);
  backward_us += k.attention_us(c.micro_batch, c.seq, c.heads / t, c.head_dim(), true, true, d);
  if (c.recompute == gpt::Recompute::Full) backward_us += forward_us + attention_fwd;
  if (c.recompute == gpt::Recompute::Selective) backward_us += attention_fwd;
  forward_us += attention_fwd;
  double layer_us = forward_us + backward_us;
  // The layer's blocking tensor-parallel collectives of [s b, h] activations (tensor_parallel.h): without
  // sequence parallelism an all-reduce after each pair forward and one before it backward (4); with it an
  // all-gather before and a reduce-scatter after each pair forward (4), and backward a reduce-scatter and
  // two all-gathers per pair (the output gradient's, and the input again for the weight gradient) (6). The
  // sizes are as nccl-tests counts them: the whole [s b, h] tensor for all three.
  // Recomputation's collectives are left out.
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order};
  const std::int64_t act_bytes = c.rows() * c.hidden * dtype_bytes(c.dtype);
  if (c.tp > 1) {
    std::vector<int> tp_ranks;
    for (int i = 0; i < c.tp; ++i) tp_ranks.push_back(grid.rank_of(i, 0, 0));
    if (c.seq_parallel) {
      layer_us += 6 * comm_us(CommOp::AllGather, act_bytes, tp_ranks) +
                  4 * comm_us(CommOp::ReduceScatter, act_bytes, tp_ranks);
    } else {
      layer_us += 4 * comm_us(CommOp::AllReduce, act_bytes, tp_ranks);
    }
  }
  // The output layer's logits against the shared embedding [V / tp, h], forward and both gradients.
  const double head_us = k.gemm_us(R, V / t, h, d) + k.gemm_us(V / t, h, R, d) + k.gemm_us(R, h, V / t, d);
  const int lpc = c.layers_per_chunk();
  const double m = static_cast<double>(c.micro_batches());
  // A micro-batch's activations (or their gradient) between two stages: a send each way per hop.
  const std::int64_t hop_bytes = c.local_rows() * c.hidden * dtype_bytes(c.dtype);
  double bound = 0, ahead_us = 0;
  for (int stage = 0; stage < c.pp; ++stage) {
    // Every micro-batch through every chunk of this stage, one after another on its compute stream...
    double per_micro_batch = c.v * lpc * layer_us;
    if (stage == c.pp - 1) per_micro_batch += head_us;  // the head is on the last virtual stage
    // ...after the first micro-batch's forward through the chunks ahead of it, and before the last one's
    // backward through them (a stage's last task is the last micro-batch's backward of its first chunk).
    bound = std::max(bound, m * per_micro_batch + ahead_us);
    if (stage + 1 < c.pp) {
      const std::vector<int> hop = {grid.rank_of(0, 0, stage), grid.rank_of(0, 0, stage + 1)};
      ahead_us += lpc * layer_us + comm_us(CommOp::Send, hop_bytes, hop) +
                  comm_us(CommOp::Send, hop_bytes, {hop[1], hop[0]});
    }
  }
  return std::max(bound, zero_stream_us(c));
}

double StepBound::zero_stream_us(const gpt::Config& c) {
  if (c.zero < 2 || c.dp == 1) return 0;
  // ZeRO 2 and 3 talk to the data-parallel group inside every task (parallel/zero.h): zero 3 all-gathers
  // each parameter of a block before the block runs, forward and again backward, and both reduce-scatter
  // each weight's gradient as its backward makes it. A group's collectives follow each other on its one
  // stream, so the stream is busy for at least the sum of their times alone, and every one but the last
  // task's reduce-scatters is over before the stage's last backward, which the step waits for. (The
  // overlap that hides them behind compute is why this is a bound of its own, not added to the other.)
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order};
  const int lpc = c.layers_per_chunk();
  const std::int64_t m = c.micro_batches();
  double most = 0;
  for (int stage = 0; stage < c.pp; ++stage) {
    std::vector<int> dp_ranks;
    for (int i = 0; i < c.dp; ++i) dp_ranks.push_back(grid.rank_of(0, i, stage));
    double gathers_us = 0, reductions_us = 0;  // per block
    for (int q = 0; q < gpt::kBlockParams; ++q) {
      const parallel::ParamSpec p = gpt::block_spec(c, 0, static_cast<gpt::BlockParam>(q));
      const std::int64_t n = p.full.numel() / (p.tp_dim >= 0 ? c.tp : 1);
      if (c.zero == 3) gathers_us += comm_us(CommOp::AllGather, n * dtype_bytes(c.dtype), dp_ranks);
      if (p.full.ndim() == 2)
        reductions_us += comm_us(CommOp::ReduceScatter, n * dtype_bytes(c.reduce_dtype), dp_ranks);
    }
    const double blocks = static_cast<double>(m) * c.v * lpc;
    most = std::max(most, blocks * 2 * gathers_us + (blocks - lpc) * reductions_us);
  }
  return most;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

}  // namespace

std::vector<Candidate> enumerate(const Question& q) {
  const int world = q.world(), per_node = q.profile.gpus_per_node;
  const std::int64_t capacity = q.profile.hbm_capacity_bytes();
  StepBound bound(q.profile);
  std::vector<Candidate> out;
  for (int tp : divisors(world)) {
    // Within a node: Megatron's tp-innermost order then keeps every tp group on NVLink.
    if (!q.tp_across_nodes && (tp > per_node || per_node % tp != 0)) continue;
    for (int pp : divisors(world / tp)) {
      const int dp = world / (tp * pp);
      // The other order matters only where it changes which groups share a node: on one node every group
      // does, and with a tp group that fills whole nodes dp and pp groups both cross nodes either way.
      std::vector<std::string> orders = {"tp-dp-pp"};
      if (pp > 1 && dp > 1 && tp < per_node && world > per_node) orders.push_back("tp-pp-dp");
      for (int v = 1; v <= std::max(1, q.max_interleave); ++v) {
        if (v > 1 && (pp == 1 || q.layers % (pp * v) != 0)) continue;
        for (int mb : {1, 2, 4}) {
          for (const char* recompute : {"none", "selective", "full"}) {
            for (bool sp : {false, true}) {
              if (sp && tp == 1) continue;
              for (int zero = 0; zero <= 3; ++zero) {
                if (zero > 0 && dp == 1) continue;  // nothing to shard: the same run as zero 0
                for (const std::string& order : orders) {
                  Candidate k;
                  k.layout = Layout{tp, pp, v, dp, zero, sp, mb, recompute, order};
                  k.name = k.layout.name();
                  k.capacity_bytes = capacity;
                  try {
                    const gpt::Config c = gpt::config_from(lesson_options(q, k.layout), world);
                    k.planned_bytes = planned_peak_bytes(c);
                    k.bound_us = bound.us(c);
                    if (k.planned_bytes > capacity) {
                      k.status = Status::RejectedMemory;
                      k.reason =
                          fmt::format("the memory plan needs {} on its largest stage; the device holds {}",
                                      format_bytes(static_cast<double>(k.planned_bytes)),
                                      format_bytes(static_cast<double>(capacity)));
                    }
                  } catch (const UsageError& e) {
                    k.status = Status::Invalid;
                    k.reason = e.what();
                  }
                  out.push_back(std::move(k));
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace ranklab::plan
