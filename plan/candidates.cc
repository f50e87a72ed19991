#include "plan/candidates.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <string_view>
#include <tuple>

#include "common/errors.h"
#include "lessons/gpt/accounting.h"
#include "lessons/gpt/model.h"
#include "lessons/gpt/presets.h"
#include "lessons/parallel/groups.h"
#include "sim/compute_model.h"
#include "sim/net/network_model.h"

namespace ranklab::plan {

std::string Layout::name() const {
  return fmt::format("tp{}{}-pp{}-v{}-dp{}{}{}-zero{}{}-mb{}-{}{}-{}", tp,
                     cp > 1 ? fmt::format("-cp{}", cp) : "", pp, v, dp,
                     ep > 1 ? fmt::format("-ep{}", ep) : "", etp > 1 ? fmt::format("-etp{}", etp) : "", zero,
                     sp ? "-sp" : "", micro_batch, recompute, fp8 ? "-fp8" : "", order);
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
  const std::vector<std::pair<const char*, int*>> numbers = {{"tp", &l.tp},   {"cp", &l.cp},    {"pp", &l.pp},
                                                             {"v", &l.v},     {"dp", &l.dp},    {"ep", &l.ep},
                                                             {"etp", &l.etp}, {"zero", &l.zero}};
  std::size_t i = 0;
  for (const auto& [prefix, field] : numbers) {
    // Only with context parallelism, with experts spread over ranks, and with each expert split.
    const std::string_view name = prefix;
    const bool optional = name == "cp" || name == "ep" || name == "etp";
    if (optional && (i >= t.size() || number_after(t[i], prefix) < 0)) continue;
    if (i >= t.size() || (*field = number_after(t[i], prefix)) < (optional ? 2 : 0))
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
  if (i < t.size() && t[i] == "fp8") {
    l.fp8 = true;
    ++i;
  }
  if (i != t.size()) throw bad(fmt::format("unexpected '{}'", t[i]));
  return l;
}

namespace {
std::string text(std::int64_t v) {
  return std::to_string(v);
}

// The lesson's flags of the question, which every layout shares, and those of a layout (no flag in both).
Settings question_settings(const Question& q) {
  Settings s = gpt::framework_settings(q.framework);
  s["framework"] = q.framework;
  s.insert(q.shape.begin(), q.shape.end());
  s.merge(Settings{{"world", text(q.world())},
                   {"model", q.model == "custom" ? "" : q.model},
                   {"layers", text(q.layers)},
                   {"hidden", text(q.hidden)},
                   {"heads", text(q.heads)},
                   {"seq", text(q.seq)},
                   {"vocab", text(q.vocab)},
                   {"global-batch", text(q.global_batch)},
                   {"dtype", q.dtype},
                   {"experts", text(q.experts)},
                   {"phantom", "true"},
                   {"steps", "1"},
                   {"quiet", "true"}});
  return s;
}

Settings layout_settings(const Question& q, const Layout& l) {
  Settings s{{"fp8-recipe", l.fp8 ? q.try_fp8 : q.fp8_recipe},
             {"ep", text(l.ep)},
             {"etp", text(l.etp)},
             {"micro-batch", text(l.micro_batch)},
             {"tp", text(l.tp)},
             {"cp", text(l.cp)},
             {"pp", text(l.pp)},
             {"dp", text(l.dp)},
             {"interleave", text(l.v)},
             {"zero", text(l.zero)},
             {"seq-parallel", l.sp ? "true" : "false"},
             {"recompute", l.recompute},
             {"order", l.order}};
  // Where the layers do not divide among the stages, Llama 3 405B's split.
  if (const int ends = gpt::one_fewer_at_the_ends(q.layers, l.pp); l.v == 1 && ends > 0)
    s["decoder-first-pipeline-num-layers"] = s["decoder-last-pipeline-num-layers"] = text(ends);
  return s;
}
}  // namespace

Settings lesson_settings(const Question& q, const Layout& l) {
  Settings s = question_settings(q);
  s.merge(layout_settings(q, l));
  return s;
}

LessonConfigs::LessonConfigs(const Question& q) : q_(q) {
  try {
    question_ = gpt::options_table().read(question_settings(q), "gpt");
  } catch (const UsageError& e) {
    refused_ = e.what();
  }
}

gpt::Config LessonConfigs::of(const Layout& l) const {
  if (!refused_.empty()) throw UsageError(refused_);
  gpt::Config c = question_;
  // Each flag sets a field of its own: the question's read once, then the layout's, is the lesson's read.
  gpt::options_table().read_into(c, layout_settings(q_, l), "gpt");
  return gpt::for_gpu(gpt::resolve(c, q_.world()), q_.profile.gpu);
}

gpt::Config lesson_config(const Question& q, const Layout& l) {
  return LessonConfigs(q).of(l);
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

namespace {

// Bytes the memory-bound kernels of one block move to and from HBM, per micro-batch on one tp rank, as the
// simulator charges them (sim/sim_rank.cc: each reads its inputs and writes its outputs once), for the
// calls the model makes (model.cc, parallel/zero.cc). Each kernel takes at least its bytes at the HBM's
// bandwidth (a roofline is never below its memory side), so their sum is a lower bound on their time. Left
// out, which keeps it a lower bound: the small gradients (biases, layernorm), padding, and the zero 2 and
// 3 shards' accumulation.
struct MemoryBound {
  double forward_bytes = 0, backward_bytes = 0;
};

// The llama block's: two RMSNorms, the rotation of q and k, SwiGLU and two residual adds, no biases. `ffn`:
// the width of the layer's tensor-parallel MLP (a MoE layer's shared experts', 0 for none); the experts'
// own kernels are left out.
MemoryBound llama_memory_bound_bytes(const gpt::Config& c, std::int64_t ffn) {
  const double dt = static_cast<double>(dtype_bytes(c.dtype)), f32 = 4;
  const double R = static_cast<double>(c.rows()), lr = static_cast<double>(c.local_rows());
  const double h = static_cast<double>(c.hidden), d = c.head_dim();
  const double a = static_cast<double>(c.heads) / c.tp, g = static_cast<double>(c.kv()) / c.tp;
  const double f = static_cast<double>(ffn) / c.tp;
  const double stream = lr * h * dt;
  // rmsnorm reads x and gamma and writes y and rstd (float32 per row); its backward reads dy, x, gamma and
  // rstd and writes dx and dgamma (float32).
  const double norm_fwd = 2 * stream + h * dt + lr * f32;
  const double norm_bwd = 3 * stream + h * dt + lr * f32 + h * f32;
  const double rope = 2 * R * (a + g) * d * dt;  // reads and writes q and k
  const double add = 3 * stream;
  MemoryBound b;
  // Forward: two norms, the rotation, swiglu (reads [R, 2f], writes [R, f]), two residual adds.
  b.forward_bytes = 2 * norm_fwd + rope + 3 * R * f * dt + 2 * add;
  // Backward: two norm backwards, the rotation back, swiglu's backward (reads dy and u, writes du), two
  // residual adds.
  b.backward_bytes = 2 * norm_bwd + rope + 5 * R * f * dt + 2 * add;
  const double weights = (h * (a + 2 * g) * d + a * d * h + 3 * h * f);
  if (c.zero <= 1 || c.dp * c.cp == 1) {
    b.backward_bytes += weights * (2 * f32 + dt);
  } else if (c.reduce_dtype != c.dtype) {
    b.backward_bytes += weights * (dt + static_cast<double>(dtype_bytes(c.reduce_dtype)));
  }
  return b;
}

MemoryBound block_memory_bound_bytes(const gpt::Config& c, bool dense_mlp);

// What FP8 and context parallelism add to a block's memory-bound kernels, at the least.
MemoryBound extra_memory_bound_bytes(const gpt::Config& c) {
  MemoryBound b;
  const double dt = static_cast<double>(dtype_bytes(c.dtype)), f32 = 4;
  const double R = static_cast<double>(c.rows()), lr = static_cast<double>(c.local_rows());
  const double h = static_cast<double>(c.hidden), d = c.head_dim();
  const double a = static_cast<double>(c.heads) / c.tp, g = static_cast<double>(c.kv()) / c.tp;
  if (c.fp8 != parallel::Fp8Recipe::None) {
    // Every recipe quantizes each linear layer's input forward and its output gradient backward
    // (parallel/fp8.h): at least a read of the 16-bit tensor and a write of one byte per element. A
    // column-parallel layer's input is quantized on this rank's tokens (sequence parallelism gathers it in
    // FP8), the rest on all the rows.
    const double f = static_cast<double>(c.ffn()) / c.tp, up = c.llama() ? 2 * f : f;
    const double inputs = 2 * lr * h + R * a * d + R * f,
                 gradients = R * (a + 2 * g) * d + 2 * R * h + R * up;
    b.forward_bytes += (dt + 1) * inputs;
    b.backward_bytes += (dt + 1) * gradients;
  }
  if (c.cp > 1) {
    // Context parallelism's kernels (parallel/context_parallel.h) around its attention blocks: the keys and
    // values copied out of qkv, each block's merge into the float32 output (the block's output and the
    // running one read, the running one written, the log-sum-exps), the output cast to the compute dtype;
    // backward, the keys copied again, each block's gradients added into the running ones, and the key
    // gradients added back into d qkv.
    // The merges' rows are rank 0's (the bound's): all of them for its own block, its later chunk's for
    // each other rank's in the ring; each chunk's with all-gather.
    const double kv = R * 2 * g * d * dt, out_cols = a * d;
    const double merged_rows = c.cp_comm == gpt::CpComm::AllGather ? R : R + (c.cp - 1) * R / 2;
    const double merges = merged_rows * (out_cols * (dt + 2 * f32) + 3 * f32 * a);
    b.forward_bytes += 2 * kv + merges + R * out_cols * (f32 + dt);
    b.backward_bytes += 2 * kv + 3 * kv;
  }
  return b;
}

// Of a layer with its dense MLP (`dense_mlp`), or of a MoE layer, whose experts' kernels are left out.
MemoryBound memory_bound_bytes(const gpt::Config& c, bool dense_mlp) {
  MemoryBound b = block_memory_bound_bytes(c, dense_mlp);
  const MemoryBound extra = extra_memory_bound_bytes(c);
  b.forward_bytes += extra.forward_bytes;
  b.backward_bytes += extra.backward_bytes;
  return b;
}

MemoryBound block_memory_bound_bytes(const gpt::Config& c, bool dense_mlp) {
  if (c.llama()) return llama_memory_bound_bytes(c, dense_mlp ? c.ffn() : c.shared_experts * c.moe_ffn());
  const double dt = static_cast<double>(dtype_bytes(c.dtype)), f32 = 4;
  const double R = static_cast<double>(c.rows()), lr = static_cast<double>(c.local_rows());
  const double h = static_cast<double>(c.hidden), hl = h / c.tp;
  // [lr, h]: the residual stream on this rank (its tokens with sequence parallelism).
  const double stream = lr * h * dt;
  // layernorm reads x, gamma, beta and writes y, mean and rstd (float32 per row); its backward reads dy,
  // x, gamma, mean, rstd and writes dx, dgamma, dbeta (float32).
  const double ln_fwd = 2 * stream + 2 * h * dt + 2 * lr * f32;
  const double ln_bwd = 3 * stream + h * dt + 2 * lr * f32 + 2 * h * f32;
  const double add = 3 * stream;  // a residual add: two in, one out
  MemoryBound b;
  // Forward: two layernorms; the biases of qkv [R, 3h/tp], proj [lr, h], fc1 [R, 4h/tp] and fc2 [lr, h]
  // (read and write the output, read the bias); gelu [R, 4h/tp]; two residual adds.
  // A MoE layer has no fc1, gelu or fc2 of its own (its experts' kernels are left out): `mlp` 0.
  const double mlp = dense_mlp ? 1 : 0;
  b.forward_bytes = 2 * ln_fwd + (2 * R * 3 * hl * dt + 3 * hl * dt) + (1 + mlp) * (2 * stream + h * dt) +
                    mlp * ((2 * R * 4 * hl * dt + 4 * hl * dt) + 2 * R * 4 * hl * dt) + 2 * add;
  // Backward: the bias gradients (sum_rows into float32) of fc2 and proj [lr, h], fc1 [R, 4h/tp] and qkv
  // [R, 3h/tp]; gelu's backward; two layernorm backwards; two residual adds.
  b.backward_bytes = (1 + mlp) * (stream + h * f32) + mlp * (R * 4 * hl * dt + 4 * hl * f32) +
                     (R * 3 * hl * dt + 3 * hl * f32) + mlp * 3 * R * 4 * hl * dt + 2 * ln_bwd + 2 * add;
  // The four weight gradients (12 h^2 / tp elements, in the compute dtype; 4 h^2 / tp of them attention's):
  // added into the float32 gradient (reads both, writes it), or with zero 2 and 3 cast to the reduction's
  // dtype for the reduce-scatter. With gradient-accumulation fusion their GEMMs sum into the gradient: no
  // pass of its own.
  const double weights = (4 + 8 * mlp) * h * hl;
  if (c.zero <= 1 || c.dp * c.cp == 1) {
    if (!c.grad_accum_fusion) b.backward_bytes += weights * (2 * f32 + dt);
  } else if (c.reduce_dtype != c.dtype) {
    b.backward_bytes += weights * (dt + static_cast<double>(dtype_bytes(c.reduce_dtype)));
  }
  return b;
}

}  // namespace

// The attention calls of one layer's forward on the rank with the most attention to do, per micro-batch:
// one causal call over the sequence, or context parallelism's blocks (parallel/context_parallel.h) on rank
// 0, whose later chunk takes every other rank's keys in the ring (the queries' half of a block, the slower
// shape) and whose two chunks attend to the shortest and the longest prefix with all-gather.
namespace {
std::vector<sim::AttentionShape> attention_blocks(const gpt::Config& c) {
  const std::int64_t heads = c.heads / c.tp, groups = c.kv() / c.tp, b = c.micro_batch;
  auto block = [&](std::int64_t queries, std::int64_t keys, bool causal) {
    sim::AttentionShape a{b, queries, heads, c.head_dim(), causal, 0.0f, groups};
    a.kv_seq = keys;
    return a;
  };
  if (c.cp == 1) return {block(c.seq, c.seq, true)};
  const std::int64_t chunk = c.cp_chunk();
  if (c.cp_comm == gpt::CpComm::AllGather) return {block(chunk, chunk, true), block(chunk, c.seq, true)};
  std::vector<sim::AttentionShape> out = {block(2 * chunk, 2 * chunk, true)};
  for (int from = 1; from < c.cp; ++from) out.push_back(block(chunk, 2 * chunk, false));
  return out;
}
}  // namespace

StepBound::StepBound(const Profile& profile)
    : profile_(profile),
      compute_(std::make_unique<sim::ComputeModel>(profile.gpu)),
      network_(std::make_unique<sim::NetworkModel>(profile)) {}

StepBound::~StepBound() = default;

namespace {
template <class Key>
const std::vector<parallel::DataParallel::Bytes>& stages(
    std::map<Key, std::vector<parallel::DataParallel::Bytes>>& memo, const Key& key, const gpt::Config& c,
    parallel::DataParallel::Bytes (*of)(const gpt::Config&, int)) {
  auto [found, added] = memo.try_emplace(key);
  if (added)
    for (int s = 0; s < c.pp; ++s) found->second.push_back(of(c, s));
  return found->second;
}

// A pipeline stage's tp x cp x dp ranks, tp fastest: the order the expert groups are cut from
// (parallel::make_expert_groups).
std::vector<int> stage_ranks(const gpt::Config& c, const parallel::Layout& grid, int stage) {
  std::vector<int> ranks;
  for (int dp = 0; dp < c.dp; ++dp)
    for (int cp = 0; cp < c.cp; ++cp)
      for (int tp = 0; tp < c.tp; ++tp) ranks.push_back(grid.rank_of(tp, cp, dp, stage));
  return ranks;
}

// The elements ZeRO 2 and 3 gather and reduce-scatter of a parameter split over `tp_size`: its local part
// padded to a multiple of `shards` rows.
std::int64_t padded_elements(const parallel::ParamSpec& p, int tp_size, int shards) {
  const Shape local = parallel::local_shape(p, tp_size);
  const std::int64_t rows = local[0], per_row = local.numel() / rows;
  return (rows + shards - 1) / shards * shards * per_row;
}
}  // namespace

const std::vector<parallel::DataParallel::Bytes>& StageStates::of(const gpt::Config& c) {
  const int ep = std::max(1, c.ep);
  const auto key = std::tuple(c.tp, c.cp, c.pp, c.v, c.dp, c.zero, c.seq_parallel, ep, c.etp);
  auto [found, added] = states_.try_emplace(key);
  if (!added) return found->second;
  const auto& dense = stages(dense_, std::tuple(c.tp, c.cp, c.pp, c.v, c.dp, c.zero, c.seq_parallel), c,
                             gpt::dense_state_bytes);
  const auto& experts =
      stages(experts_, std::tuple(c.pp, c.v, ep, c.etp, c.zero, c.tp * c.cp * c.dp / (ep * c.etp)), c,
             gpt::expert_state_bytes);
  for (int s = 0; s < c.pp; ++s)
    found->second.push_back(parallel::DataParallel::Bytes(dense[s]) += experts[s]);
  return found->second;
}

double StepBound::comm_us(CommOp op, std::int64_t bytes, const std::vector<int>& ranks) {
  const auto key = std::make_tuple(static_cast<int>(op), bytes, ranks);
  const auto it = comm_.find(key);
  if (it != comm_.end()) return it->second;
  const double t = op == CommOp::Send
                       ? sim::duration_us(network_->plan_p2p(ranks[0], ranks[1], bytes))
                       : sim::duration_us(network_->plan_collective(op, bytes, ranks, ranks[0]));
  return comm_[key] = t;
}

double StepBound::us(const gpt::Config& c, std::span<const double> stage_kernels_us) {
  // The kernels each take what the simulator's compute model charges them (sim/compute_model.h), for the
  // shapes the model's code gives them (model.cc, parallel/tensor_parallel.cc): per layer, per micro-batch of
  // R = s b rows, on one tp rank, four GEMMs forward, the weight's and the input's gradient of each backward,
  // and causal attention over heads / tp heads both ways. Recompute runs forward parts again.
  const sim::ComputeModel& k = *compute_;
  const std::int64_t R = c.rows(), h = c.hidden, t = c.tp, V = c.vocab;
  const DType d = c.dtype;
  // FP8 runs the linear layers' GEMMs in e4m3 (its casts are left out: a bound may only be low).
  const DType linear = c.fp8 != parallel::Fp8Recipe::None ? DType::Float8E4M3 : d;
  struct Gemm {
    std::int64_t in, out;
  };
  // With --tp-comm-overlap the forward GEMMs and the input gradients' run as tp GEMMs of R / tp rows each,
  // the pieces the ring passes on (TensorParallel's rings); the weight gradients stay whole.
  const bool rings = c.tp_comm_overlap;
  auto rows_gemm_us = [&](std::int64_t n, std::int64_t kk) {
    return rings ? static_cast<double>(t) * k.gemm_us(R / t, n, kk, linear) : k.gemm_us(R, n, kk, linear);
  };
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order, c.cp};
  const std::int64_t act_bytes = c.rows() * c.hidden * dtype_bytes(c.dtype);
  std::vector<int> tp_ranks;
  for (int i = 0; i < c.tp; ++i) tp_ranks.push_back(grid.rank_of(i, 0, 0));
  // Attention in a layer with every earlier key [0], and in one with a sliding window [1]: the whole
  // sequence's windowed attention, its pairs split over the cp ranks, of which the busiest does at least
  // its share (blocks of fewer queries, each reading its keys, run no faster).
  double attention_fwd[2] = {0, 0}, attention_bwd[2] = {0, 0};
  for (const sim::AttentionShape& a : attention_blocks(c)) {
    attention_fwd[0] += k.attention_us(a, c.attention, false, d);
    attention_bwd[0] += k.attention_us(a, c.attention, true, d);
  }
  if (c.sliding_window > 0) {
    sim::AttentionShape a{c.micro_batch, c.seq, c.heads / t, c.head_dim(), true, 0.0f, c.kv() / t};
    a.window = c.sliding_window;
    attention_fwd[1] = k.attention_us(a, c.attention, false, d) / c.cp;
    attention_bwd[1] = k.attention_us(a, c.attention, true, d) / c.cp;
  }
  // A layer's forward and backward, and of them what the compute stream waits for communication (the
  // blocking collectives, at their time alone on the machine): the rest is its kernels.
  struct LayerUs {
    double forward = 0, backward = 0, comm = 0;
  };
  // The routes each expert receives from each rank of its ep group, every expert getting its share
  // (parallel::route_balanced, the fewer where they do not divide) and no more than a capacity.
  std::int64_t share = 0;
  if (c.moe()) {
    share = c.local_rows() * c.top_k / c.experts;
    if (c.capacity_factor > 0)
      share =
          std::min(share, parallel::expert_capacity(c.local_rows(), c.experts, c.top_k, c.capacity_factor));
  }
  // A MoE layer's all-to-alls over ep group 0 of stage 0 (a stage's tp x cp x dp ranks, tp fastest, every
  // etp-th of the first ep x etp: parallel::make_expert_groups), each at its time alone on the machine,
  // where the balanced routes divide evenly among the experts (the simulator then plans each as an even
  // all_to_all; the uneven one of another size is not compared, so it is left out): forward, the counts
  // (float32, a rank's experts' each) and the routes there and back (the dispatch and the combine);
  // backward, the routes' gradients back and forth. With etp, each way also the etp group's gather of what
  // its members received and the reduce-scatter of their partial outputs (the counts' gather is left
  // out). Full recomputation runs the forward's again (below, with the rest of the forward).
  double ep_pieces_us = 0, ep_counts_us = 0, etp_us = 0;
  if (c.moe() && (c.ep > 1 || c.etp > 1) && c.local_rows() * c.top_k % c.experts == 0) {
    const std::vector<int> stage = stage_ranks(c, grid, 0);
    std::vector<int> ep_ranks, etp_ranks(stage.begin(), stage.begin() + c.etp);
    for (int i = 0; i < c.ep; ++i) ep_ranks.push_back(stage[i * c.etp]);
    const std::int64_t piece_bytes = c.local_experts() * share * h * dtype_bytes(d);
    if (c.ep > 1) {
      if (piece_bytes > 0) ep_pieces_us = comm_us(CommOp::AllToAll, piece_bytes * c.ep, ep_ranks);
      ep_counts_us = comm_us(CommOp::AllToAll, std::int64_t{c.experts} * 4, ep_ranks);
    }
    if (c.etp > 1 && piece_bytes > 0) {
      const std::int64_t gathered_bytes = piece_bytes * c.ep * c.etp;
      etp_us = comm_us(CommOp::AllGather, gathered_bytes, etp_ranks) +
               comm_us(CommOp::ReduceScatter, gathered_bytes, etp_ranks);
    }
  }
  const double ep_forward_us = ep_counts_us + 2 * ep_pieces_us + etp_us;
  // One layer, with its dense MLP or as a MoE layer, with or without a sliding window.
  auto layer_us = [&](bool moe_layer, bool windowed) {
    LayerUs u;
    // qkv, proj, and the tensor-parallel MLP's fc1, fc2 (llama: wqkv, wo, w13, w2): a MoE layer's is its
    // shared experts' (none without them).
    const std::int64_t hd = c.head_dim(), qkv = (c.heads + 2 * std::int64_t{c.kv()}) * hd / t;
    const std::int64_t ffn = moe_layer ? c.shared_experts * c.moe_ffn() : c.ffn();
    const int up = c.llama() ? 2 : 1;
    std::vector<Gemm> linears = {{h, qkv}, {c.heads * hd / t, h}};
    if (ffn > 0) linears.insert(linears.end(), {{h, up * ffn / t}, {ffn / t, h}});
    for (const Gemm& g : linears) {
      u.forward += rows_gemm_us(g.out, g.in);
      u.backward += k.gemm_us(g.in, g.out, R, linear) + rows_gemm_us(g.in, g.out);  // x^T dy, dy w^T
    }
    if (moe_layer) {
      // The router's GEMM on this rank's rows and its two gradients; each local expert's two GEMMs on the
      // routes it receives (its share from each rank of the ep group), forward, and their four gradients.
      // The permutations and the experts' memory-bound kernels are left out.
      const std::int64_t lr = c.local_rows(), E = c.experts;
      u.forward += k.gemm_us(lr, E, h, d);
      u.backward += k.gemm_us(h, E, lr, d) + k.gemm_us(lr, h, E, d);
      // With etp: what the etp ranks received, each on its shard of the experts' width. The experts'
      // GEMMs run in FP8 with the linear layers'.
      const std::int64_t rows = c.etp * c.ep * share;
      const std::int64_t f = c.moe_ffn() / c.etp;
      if (rows > 0) {
        const double experts = static_cast<double>(c.local_experts());
        u.forward += experts * (k.gemm_us(rows, up * f, h, linear) + k.gemm_us(rows, h, f, linear));
        u.backward += experts * (k.gemm_us(f, h, rows, linear) + k.gemm_us(rows, f, h, linear) +
                                 k.gemm_us(h, up * f, rows, linear) + k.gemm_us(rows, h, up * f, linear));
      }
    }
    const MemoryBound mem = memory_bound_bytes(c, !moe_layer);
    u.forward += k.memory_us(mem.forward_bytes);
    u.backward += k.memory_us(mem.backward_bytes) + attention_bwd[windowed];
    if (c.recompute == gpt::Recompute::Selective) u.backward += attention_fwd[windowed];
    u.forward += attention_fwd[windowed];
    double comm_forward = 0, comm_backward = 0;
    if (moe_layer) {
      comm_forward += ep_forward_us;
      comm_backward += 2 * ep_pieces_us + etp_us;
    }
    // The layer's blocking tensor-parallel collectives of [s b, h] activations (tensor_parallel.h), per
    // column-then-row pair (attention's, and the MLP's where the layer has one): without sequence
    // parallelism an all-reduce after the pair forward and one before it backward; with it an all-gather
    // before and a reduce-scatter after the pair forward, and backward a reduce-scatter and two
    // all-gathers (the output gradient's, and the input again for the weight gradient). The sizes are as
    // nccl-tests counts them: the whole [s b, h] tensor for all three. With --tp-comm-overlap all of them are
    // left out: the GEMMs may hide them. With --async-tensor-model-parallel-allreduce the column-parallel
    // backward's gather and reduction may hide under its GEMMs too: only the row-parallel backward's
    // all-gathers are left.
    const double pairs = ffn > 0 ? 2 : 1;
    if (c.tp > 1 && !rings) {
      if (c.seq_parallel) {
        const double gather = comm_us(CommOp::AllGather, act_bytes, tp_ranks),
                     scatter = comm_us(CommOp::ReduceScatter, act_bytes, tp_ranks);
        comm_forward += pairs * (gather + scatter);
        comm_backward += pairs * (c.async_tp_allreduce ? gather : 2 * gather + scatter);
      } else {
        const double reduce = comm_us(CommOp::AllReduce, act_bytes, tp_ranks);
        comm_forward += pairs * reduce;
        if (!c.async_tp_allreduce) comm_backward += pairs * reduce;
      }
    }
    u.forward += comm_forward;
    u.backward += comm_backward;
    u.comm = comm_forward + comm_backward;
    // Full recomputation runs the whole forward once more before the backward, the collectives its compute
    // waits for included (Model::rebuild: "the forward once more, its communication included").
    if (c.recompute == gpt::Recompute::Full) {
      u.backward += u.forward;
      u.comm += comm_forward;
    }
    return u;
  };
  // By [MoE][windowed].
  LayerUs kinds[2][2];
  for (bool moe_layer : {false, true}) {
    if (moe_layer && !c.moe()) continue;
    for (bool windowed : {false, true})
      if (!windowed || c.sliding_window > 0) kinds[moe_layer][windowed] = layer_us(moe_layer, windowed);
  }
  // The `count` layers from `first` on: how many of each kind, times the kind's.
  auto layers_us = [&](int first, int count, double LayerUs::*part) {
    int layers[2][2] = {};
    for (int layer = first; layer < first + count; ++layer) ++layers[c.moe_layer(layer)][c.window(layer) > 0];
    double sum = 0;
    for (int moe_layer : {0, 1})
      for (int windowed : {0, 1}) sum += layers[moe_layer][windowed] * (kinds[moe_layer][windowed].*part);
    return sum;
  };
  auto whole_us = [&](int first, int count) {
    return layers_us(first, count, &LayerUs::forward) + layers_us(first, count, &LayerUs::backward);
  };
  // The output layer's logits against the shared embedding [V / tp, h], forward and both gradients; the
  // softmax reads the logits three times (row max, statistics, the gradient) and writes their gradient.
  const double head_us = k.gemm_us(R, V / t, h, d) + k.gemm_us(V / t, h, R, d) + k.gemm_us(R, h, V / t, d) +
                         k.memory_us(4.0 * static_cast<double>(R * (V / t) * dtype_bytes(d)));
  const double m = static_cast<double>(c.micro_batches());
  // A micro-batch's activations (or their gradient) between two stages: a send each way per hop.
  const std::int64_t hop_bytes = c.local_rows() * c.hidden * dtype_bytes(c.dtype);
  // Every stage's term below ends when rank 0 ends its last backward (the drain runs through stage 0), and
  // the step ends on rank 0 after its optimizer: AdamW reads master, gradient, m and v and writes master, m
  // and v (7 float32 per element of the master copy; m and v, the optimizer state, are 8 bytes an element),
  // then the compute-dtype weights are made from the master copy (4 bytes read, the dtype's written)
  // unless they are the same tensor (float32).
  const double master_elements = static_cast<double>(states_.of(c)[0].optimizer) / 8;
  const double rebuild = c.dtype == DType::Float32 ? 0 : 4 + static_cast<double>(dtype_bytes(c.dtype));
  const double optimizer_us = k.memory_us(master_elements * (7 * 4 + rebuild));
  double bound = 0, ahead_us = 0;
  // drain_us[s]: from the end of stage s's last task to the end of rank 0's: the last micro-batch's
  // backward through the first chunk of every stage before it, with the sends between.
  std::vector<double> drain_us(c.pp, 0.0);
  for (int stage = 0; stage < c.pp; ++stage) {
    // Every micro-batch through every chunk of this stage, one after another on its compute stream (and of
    // it the blocking communication, where a probe measured the stage's kernels)...
    double per_micro_batch = 0, comm = 0;
    for (int chunk = 0; chunk < c.v; ++chunk) {
      const int vs = stage + chunk * c.pp;
      per_micro_batch += whole_us(c.chunk_first_layer(vs), c.chunk_layers(vs));
      if (!stage_kernels_us.empty())
        comm += layers_us(c.chunk_first_layer(vs), c.chunk_layers(vs), &LayerUs::comm);
    }
    if (stage == c.pp - 1) per_micro_batch += head_us;  // the head is on the last virtual stage
    // A stage's kernels measured in a short run of the layout take at least what the model charges
    // them; its blocking communication stays at its time alone.
    if (!stage_kernels_us.empty())
      per_micro_batch = std::max(per_micro_batch, stage_kernels_us[stage] + comm);
    // ...after the first micro-batch's forward through the chunks ahead of it, and before the last one's
    // backward through them (a stage's last task is the last micro-batch's backward of its first chunk).
    bound = std::max(bound, m * per_micro_batch + ahead_us + optimizer_us);
    if (stage + 1 < c.pp) {
      const std::vector<int> hop = {grid.rank_of(0, 0, stage), grid.rank_of(0, 0, stage + 1)};
      const double back_us = comm_us(CommOp::Send, hop_bytes, {hop[1], hop[0]});
      const int first = c.chunk_first_layer(stage), count = c.chunk_layers(stage);
      ahead_us += whole_us(first, count) + comm_us(CommOp::Send, hop_bytes, hop) + back_us;
      drain_us[stage + 1] = drain_us[stage] + back_us + layers_us(first, count, &LayerUs::backward);
    }
  }
  // After a data-parallel stream's work ahead of its last task, the stage's last task computes the
  // backward of its chunk's blocks, then the drain and rank 0's optimizer. (The dense stream's bound is
  // left out with experts, whose gradients and ZeRO shards go over a group of their own: the expert
  // stream's below stands for them.)
  for (int stage = 0; stage < c.pp; ++stage) {
    double stream_us = 0;
    if (c.zero >= 2 && c.dp > 1 && !c.moe()) stream_us = zero_stream_us(c, stage);
    if (c.zero >= 2 && c.moe()) stream_us = std::max(stream_us, expert_stream_us(c, stage));
    if (stream_us <= 0) continue;
    bound = std::max(
        bound, stream_us + layers_us(c.chunk_first_layer(stage), c.chunk_layers(stage), &LayerUs::backward) +
                   drain_us[stage] + optimizer_us);
  }
  return bound;
}

double StepBound::expert_stream_us(const gpt::Config& c, int stage) {
  // ZeRO 2 and 3 gather (zero 3) and reduce-scatter each MoE layer's experts as one unit of their own, over
  // the expert-data-parallel group (the ranks that hold the same shards: every ep x etp-th of the stage's
  // tp x cp x dp ranks, tp fastest; parallel::make_expert_groups), whose stream no other collective uses,
  // in every task as the dense units are (zero_stream_us): the last task waits at its start for the
  // reductions of the backward before it (DataParallel::drain), and with them for everything issued before.
  const int block = c.ep * c.etp, edp = c.tp * c.cp * c.dp / block;
  if (edp <= 1) return 0;
  const std::vector<int> ranks = stage_ranks(c, parallel::Layout{c.tp, c.pp, c.dp, c.order, c.cp}, stage);
  std::vector<int> edp_ranks;
  for (int i = 0; i < edp; ++i) edp_ranks.push_back(ranks[i * block]);
  // A unit: each local expert's two weights, split over etp, each padded to a multiple of edp rows.
  std::int64_t unit_elements = 0;
  for (int which : {0, 1})
    unit_elements += c.local_experts() *
                     padded_elements(gpt::param_spec(c, {gpt::expert_kind(0, which), 0}, false), c.etp, edp);
  const double gather =
      c.zero == 3 ? comm_us(CommOp::AllGather, unit_elements * dtype_bytes(c.dtype), edp_ranks) : 0.0;
  const double reduce =
      comm_us(CommOp::ReduceScatter, unit_elements * dtype_bytes(c.reduce_dtype), edp_ranks);
  int moe_layers = 0;
  for (int k = 0; k < c.v; ++k) {
    const int vs = k * c.pp + stage;
    moe_layers += c.moe_layer_count(c.chunk_first_layer(vs), c.chunk_layers(vs));
  }
  // Every micro-batch's units gathered forward and backward and reduced, less what the last task (the
  // first chunk's backward) issues itself.
  const double total = static_cast<double>(c.micro_batches()) * moe_layers * (2 * gather + reduce);
  const double last =
      c.moe_layer_count(c.chunk_first_layer(stage), c.chunk_layers(stage)) * (gather + reduce);
  return total - last;
}

double StepBound::zero_stream_us(const gpt::Config& c, int stage) {
  // ZeRO 2 and 3 talk to the data-parallel group inside every task (parallel/zero.h, model.cc): zero 3
  // all-gathers a block's parameters, one unit, before the block runs, forward and again backward (and
  // the embedding's and the output layer's where they are used), and both reduce-scatter the block's
  // gradients once its backward has made them, each parameter padded to a multiple of dp rows. A group's
  // collectives follow each other on its one stream, in the order the tasks issue them, each no faster than
  // alone on the machine. The stage's last task (a backward) starts computing only when the stream has done
  // everything issued before it: zero 2 waits at its start for the previous backward's reduce-scatters (and
  // with them for all before), zero 3 for its first block's gather, issued after all the rest. So the step is
  // no shorter than that stream work, followed by the last task's own computation. (The overlap that hides
  // the stream behind compute elsewhere is why this is a bound of its own, not added to the other.)
  const parallel::Layout grid{c.tp, c.pp, c.dp, c.order, c.cp};
  std::vector<int> dp_ranks;
  for (int i = 0; i < c.dp; ++i) dp_ranks.push_back(grid.rank_of(0, i, stage));
  const bool gathers = c.zero == 3;
  // A parameter's gather (of its compute-dtype copy) and its gradient's reduce-scatter, both of the padded
  // tensor that rank holds.
  auto padded = [&](const parallel::ParamSpec& p) { return padded_elements(p, c.tp, c.dp); };
  auto gather_us = [&](const parallel::ParamSpec& p) {
    return gathers ? comm_us(CommOp::AllGather, padded(p) * dtype_bytes(c.dtype), dp_ranks) : 0.0;
  };
  auto reduce_us = [&](const parallel::ParamSpec& p) {
    return comm_us(CommOp::ReduceScatter, padded(p) * dtype_bytes(c.reduce_dtype), dp_ranks);
  };
  // A block is one unit: one gather and one reduce-scatter of all its parameters.
  std::int64_t block_elements = 0;
  for (int q = 0; q < gpt::block_params(c); ++q) {
    if (!gpt::has_block_param(c, q)) continue;
    block_elements += padded(gpt::block_spec(c, 0, q, false));
  }
  const double block_gathers =
      gathers ? comm_us(CommOp::AllGather, block_elements * dtype_bytes(c.dtype), dp_ranks) : 0.0;
  const double block_reductions =
      comm_us(CommOp::ReduceScatter, block_elements * dtype_bytes(c.reduce_dtype), dp_ranks);
  const int lpc = c.chunk_layers(stage);
  const double m = static_cast<double>(c.micro_batches());
  const double blocks = m * c.stage_layers(stage);
  double total = blocks * (2 * block_gathers + block_reductions);
  // What the stage's last task itself issues, at most: its blocks' gathers and reductions, and those of
  // the output layer or the embedding when its chunk holds them.
  double last = lpc * (block_gathers + block_reductions);
  const parallel::ParamSpec wte = gpt::other_spec(c, gpt::kWte), wpe = gpt::other_spec(c, gpt::kWpe),
                            lnf_g = gpt::other_spec(c, gpt::kLnfG), lnf_b = gpt::other_spec(c, gpt::kLnfB),
                            output = gpt::other_spec(c, gpt::kOutput);
  if (c.llama()) {
    // The word embedding gathered forward and its gradient reduced per micro-batch on the first stage; the
    // final norm's and the output layer's gathered forward and backward and reduced on the last.
    if (stage == 0) {
      total += m * (gather_us(wte) + reduce_us(wte));
      last += reduce_us(wte);
    }
    if (stage == c.pp - 1) {
      const double gathers = gather_us(lnf_g) + gather_us(output),
                   reductions = reduce_us(lnf_g) + reduce_us(output);
      total += m * (2 * gathers + reductions);
      if (c.v == 1) last += gathers + reductions;
    }
    return total - last;
  }
  if (stage == 0) {
    // Per micro-batch: the word and position embeddings gathered forward; both gradients reduced.
    const double reductions = reduce_us(wte) + reduce_us(wpe);
    total += m * (gather_us(wte) + gather_us(wpe) + reductions);
    last += reductions;
  }
  if (stage == c.pp - 1) {
    // Per micro-batch: the final layernorm's and the embedding's weights gathered forward (three) and
    // backward (gamma and the embedding); their gradients reduced.
    const double backward_gathers = gather_us(lnf_g) + gather_us(wte);
    const double reductions = reduce_us(wte) + reduce_us(lnf_g) + reduce_us(lnf_b);
    total += m * (backward_gathers + gather_us(lnf_g) + gather_us(lnf_b) + gather_us(wte) + reductions);
    if (c.v == 1) last += backward_gathers + reductions;
  }
  return total - last;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// Every group order with every expert-parallel size and precision, the order outermost.
struct Variant {
  std::string order;
  int ep, etp;
  bool fp8;
};
std::vector<Variant> variants(const std::vector<std::string>& orders,
                              const std::vector<std::pair<int, int>>& eps, bool try_fp8) {
  std::vector<Variant> out;
  for (const std::string& order : orders)
    for (const auto& [ep, etp] : eps)
      for (bool fp8 : {false, true})
        if (!fp8 || try_fp8) out.push_back({order, ep, etp, fp8});
  return out;
}

// The memory plans of the enumerated layouts, each computed once for a layout but its group order.
class PeakBytes {
 public:
  explicit PeakBytes(StageStates& states) : states_(states) {}
  std::int64_t of(const gpt::Config& c, const Layout& l) {
    const auto key =
        std::tuple(l.tp, l.cp, l.pp, l.v, l.dp, l.zero, l.sp, l.ep, l.etp, l.micro_batch, l.recompute, l.fp8);
    if (const auto found = peak_.find(key); found != peak_.end()) return found->second;
    const std::vector<parallel::DataParallel::Bytes>& states = states_.of(c);
    std::int64_t most = 0;
    for (int s = 0; s < c.pp; ++s) most = std::max(most, gpt::memory_plan(c, s, states[s]).total());
    return peak_[key] = most;
  }

 private:
  StageStates& states_;
  std::map<std::tuple<int, int, int, int, int, int, bool, int, int, int, std::string, bool>, std::int64_t>
      peak_;
};

}  // namespace

std::vector<Candidate> enumerate(const Question& q) {
  const int world = q.world(), per_node = q.profile.gpus_per_node;
  const std::int64_t capacity = q.profile.hbm_capacity_bytes();
  StepBound bound(q.profile);
  PeakBytes peak_bytes(bound.states());
  const LessonConfigs configs(q);
  std::vector<Candidate> out;
  for (int tp : divisors(world)) {
    // Within a node: Megatron's tp-innermost order then keeps every tp group on NVLink.
    if (!q.tp_across_nodes && (tp > per_node || per_node % tp != 0)) continue;
    for (int cp : divisors(world / tp)) {
      if (cp > 1 && (q.seq % (2 * cp) != 0 || q.seq / (2 * cp) < kMinCpChunk)) continue;
      for (int pp : divisors(world / (tp * cp))) {
        const int dp = world / (tp * cp * pp);
        // The expert-parallel sizes: dividing the experts and the stage's tp x cp x dp ranks; each expert
        // whole, or split over tp ranks (Megatron-Core's default expert tensor-parallel size).
        std::vector<std::pair<int, int>> eps = {{1, 1}};
        for (int ep : divisors(q.experts)) {
          for (int etp : {1, tp}) {
            if ((ep > 1 || etp > 1) && (tp * cp * dp) % (ep * etp) == 0) eps.push_back({ep, etp});
            if (tp == 1) break;
          }
        }
        // The other order matters only where it changes which groups share a node: on one node every group
        // does, and with a tp group that fills whole nodes dp and pp groups both cross nodes either way.
        std::vector<std::string> orders = {"tp-dp-pp"};
        if (pp > 1 && dp > 1 && tp < per_node && world > per_node) orders.push_back("tp-pp-dp");
        const std::vector<Variant> each = variants(orders, eps, !q.try_fp8.empty());
        for (int v = 1; v <= std::max(1, q.max_interleave); ++v) {
          if (v > 1 && (pp == 1 || q.layers % (pp * v) != 0)) continue;
          for (int mb : {1, 2, 4}) {
            for (const char* recompute : {"none", "selective", "full"}) {
              for (bool sp : {false, true}) {
                if (sp && tp == 1) continue;
                for (int zero = 0; zero <= 3; ++zero) {
                  if (zero > 0 && dp * cp == 1) continue;  // nothing to shard: the same run as zero 0
                  for (const Variant& x : each) {
                    Candidate k;
                    k.layout =
                        Layout{tp, pp, v, dp, zero, sp, mb, recompute, x.order, cp, x.ep, x.fp8, x.etp};
                    k.name = k.layout.name();
                    k.capacity_bytes = capacity;
                    try {
                      const gpt::Config c = configs.of(k.layout);
                      k.planned_bytes = peak_bytes.of(c, k.layout);
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
  }
  return out;
}

}  // namespace ranklab::plan
