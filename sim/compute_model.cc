#include "sim/compute_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "common/errors.h"

namespace ranklab::sim {

namespace {
double ceil_div(std::int64_t a, std::int64_t b) {
  return static_cast<double>((a + b - 1) / b);
}

// The fraction of the SMs' tile slots doing useful work: each SM computes whole tm x tn tiles (a partial
// tile at an edge costs a whole one), in waves of one tile per SM (the last wave may leave SMs idle).
// `batch` GEMMs of one shape in one call put all their tiles into the same waves.
double tile_wave_efficiency(std::int64_t m, std::int64_t n, std::int64_t tm, std::int64_t tn, int sms,
                            std::int64_t batch) {
  const double tiles = ceil_div(m, tm) * ceil_div(n, tn);
  const double all_tiles = tiles * static_cast<double>(batch);
  const double waves = std::ceil(all_tiles / sms);
  const double tile_fill =
      static_cast<double>(m) * static_cast<double>(n) / (tiles * static_cast<double>(tm * tn));
  const double wave_fill = all_tiles / (waves * sms);
  return tile_fill * wave_fill;
}

double d(std::int64_t v) {
  return static_cast<double>(v);
}

// The sides of the tiles cuBLAS and CUTLASS build their 16-bit kernels from: 64 is the smallest (Hopper's
// warpgroup MMA is 64 rows, wgmma.m64nNk16; CUTLASS's SM80 and SM90 tile lists start at 64x64), 256 the
// largest side of a one-SM tile (128x256, 256x128).
constexpr std::int64_t kTileSides[] = {64, 128, 256};

// A split-K partial sum is float32 (cuBLAS accumulates 16-bit GEMMs in float32).
constexpr double kPartialSumBytes = 4;

// Operand intensity of a tm x tn tile: per element of k it loads tm + tn operands and does 2 tm tn flops.
double tile_flops_per_byte(std::int64_t tm, std::int64_t tn, double element_bytes) {
  return 2.0 * static_cast<double>(tm) * static_cast<double>(tn) /
         (static_cast<double>(tm + tn) * element_bytes);
}
}  // namespace

namespace {
// Models made so far, each numbered from 1 when its ceilings are known (ComputeModel::gemm_fastest).
std::atomic<std::uint64_t> models_made{0};
}  // namespace

ComputeModel::ComputeModel(const GpuModel& gpu) : gpu_(gpu) {
  // The profile's tile and its transpose, and with the shape model cuBLAS's smaller kernels: every tile of
  // kTileSides no larger than the profile's.
  const std::int64_t tm0 = gpu_.gemm_tile_m, tn0 = gpu_.gemm_tile_n;
  gemm_tiles_ = {{tm0, tn0}, {tn0, tm0}};
  if (gpu_.gemm_ridge_flops_per_byte > 0) {
    for (std::int64_t a : kTileSides) {
      for (std::int64_t b : kTileSides) {
        if (a * b <= tm0 * tn0 &&
            std::find(gemm_tiles_.begin(), gemm_tiles_.end(), std::make_pair(a, b)) == gemm_tiles_.end())
          gemm_tiles_.emplace_back(a, b);
      }
    }
  }
  if (gpu_.sm_count <= 0 || gpu_.gemm_mamf_tflops <= 0) return;
  // Solved with both ceilings at 1: the candidates' times at full rate.
  gemm_ceiling_ = gemm_ceiling_fp8_ = 1.0;
  const double ceiling_16 = solve_ceiling(gpu_.gemm_mamf_tflops, gpu_.gemm_mamf_m, gpu_.gemm_mamf_n,
                                          gpu_.gemm_mamf_k, DType::BFloat16, "gemm_mamf");
  const double ceiling_8 =
      gpu_.peak_tflops_fp8 > 0 && gpu_.gemm_mamf_fp8_tflops > 0
          ? solve_ceiling(gpu_.gemm_mamf_fp8_tflops, gpu_.gemm_mamf_fp8_m, gpu_.gemm_mamf_fp8_n,
                          gpu_.gemm_mamf_fp8_k, DType::Float8E4M3, "gemm_mamf_fp8")
          : ceiling_16;
  gemm_ceiling_ = ceiling_16;
  gemm_ceiling_fp8_ = ceiling_8;
  id_ = models_made.fetch_add(1) + 1;
}

double ComputeModel::solve_ceiling(double tflops, int m, int n, int k, DType dtype, const char* field) const {
  // The measured GEMM ran at ceiling x (the rate of the fastest candidate at a ceiling of 1); solve for the
  // ceiling. It scales every candidate alike, so the fastest one does not depend on it.
  // With the fixed time: measured = fixed + (the time at a ceiling of 1) / ceiling.
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const double measured_us = flops / (tflops * 1e6);
  const double work_us = gemm_fastest(m, n, k, dtype).us - gpu_.gemm_fixed_us;
  const double ceiling =
      measured_us > gpu_.gemm_fixed_us ? work_us / (measured_us - gpu_.gemm_fixed_us) : 2.0;
  if (ceiling > 1) {
    throw UsageError(fmt::format(
        "profile GPU {}: the measured GEMM ({}_tflops: {} TFLOPS at {}x{}x{}) is faster than {} of "
        "peak, which the GEMM model's tile, wave and k factors allow; check gemm_tile_m/n, "
        "gemm_k_overhead and sm_count",
        gpu_.name, field, tflops, m, n, k, ceiling));
  }
  return ceiling;
}

void ComputeModel::require_fp8(bool mx) const {
  if (gpu_.peak_tflops_fp8 <= 0) {
    throw UsageError(
        fmt::format("the {} has no FP8 tensor cores (its profile gives no peak_tflops_fp8): FP8 "
                    "training needs Hopper (H100, H200) or Blackwell (B200, GB200)",
                    gpu_.name));
  }
  if (mx && !gpu_.fp8_mx) {
    throw UsageError(
        fmt::format("the {}'s tensor cores do not apply MX block scales (its profile sets no "
                    "fp8_mx): MXFP8 needs Blackwell (B200, GB200)",
                    gpu_.name));
  }
}

double ComputeModel::gemm_ceiling(DType dtype) const {
  return is_float8(dtype) ? gemm_ceiling_fp8_ : gemm_ceiling_;
}

double ComputeModel::gemm_k_overhead(DType dtype) const {
  // The pipeline holds k-blocks of a fixed number of bytes (a 128x256 tile's 64 16-bit elements of k, or
  // 128 8-bit ones): the same fill and drain time, twice the elements of k in 8 bits.
  return gpu_.gemm_k_overhead * 2.0 / static_cast<double>(dtype_bytes(dtype));
}

double ComputeModel::gemm_quantization(std::int64_t m, std::int64_t n, std::int64_t batch) const {
  if (gpu_.sm_count <= 0 || m <= 0 || n <= 0 || batch <= 0) return 1.0;
  const std::int64_t tm = gpu_.gemm_tile_m, tn = gpu_.gemm_tile_n;
  // cuBLAS's heuristics pick among tile shapes; the model takes the better orientation of the profile's.
  return std::max(tile_wave_efficiency(m, n, tm, tn, gpu_.sm_count, batch),
                  tile_wave_efficiency(m, n, tn, tm, gpu_.sm_count, batch));
}

double ComputeModel::gemm_k_efficiency(std::int64_t k, DType dtype) const {
  if (k <= 0) return 1.0;
  const double kd = static_cast<double>(k);
  return kd / (kd + gemm_k_overhead(dtype));
}

double ComputeModel::gemm_tile_efficiency(std::int64_t tile_m, std::int64_t tile_n, DType dtype) const {
  // An SM's operand feed moves the same bytes per second whatever the type, so tensor cores twice as fast
  // need twice the intensity: the ridge scales with the type's peak against the 16-bit one.
  const double ridge = gpu_.gemm_ridge_flops_per_byte * peak_tflops(dtype) / gpu_.peak_tflops_bf16;
  if (ridge <= 0) return 1.0;
  // A tile's SM runs its tensor cores at full rate while its operands arrive fast enough: at the ridge
  // intensity and above. Below it, the SM waits for operands and runs at intensity / ridge. Relative to the
  // profile's (largest) tile, whose rate the ceiling already carries.
  const double e = static_cast<double>(dtype_bytes(dtype));
  auto rate = [&](std::int64_t tm, std::int64_t tn) {
    return std::min(1.0, tile_flops_per_byte(tm, tn, e) / ridge);
  };
  return rate(tile_m, tile_n) / rate(gpu_.gemm_tile_m, gpu_.gemm_tile_n);
}

std::vector<GemmCandidate> ComputeModel::gemm_candidates(std::int64_t m, std::int64_t n, std::int64_t k,
                                                         DType dtype, std::int64_t batch) const {
  std::vector<GemmCandidate> out;
  each_gemm_candidate(m, n, k, dtype, batch, [&](const GemmCandidate& c) { out.push_back(c); });
  return out;
}

void ComputeModel::each_gemm_candidate(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                       std::int64_t batch,
                                       const std::function<void(const GemmCandidate&)>& visit) const {
  if (!gemm_shape_model() || m <= 0 || n <= 0 || k <= 0) return;
  const bool shapes = gpu_.gemm_ridge_flops_per_byte > 0;
  const int sms = gpu_.sm_count;
  // One SM's share of the peak at the ceiling, in flop per microsecond.
  const double sm_flops_per_us = peak_tflops(dtype) * 1e6 * gemm_ceiling(dtype) / sms;
  const double k0 = gemm_k_overhead(dtype);
  for (const auto& [tm, tn] : gemm_tiles_) {
    const double tiles_count = ceil_div(m, tm) * ceil_div(n, tn) * static_cast<double>(batch);
    const double tile_flops_per_k = 2.0 * static_cast<double>(tm) * static_cast<double>(tn);
    const double sm_rate = sm_flops_per_us * gemm_tile_efficiency(tm, tn, dtype);
    // Data-parallel: waves of one tile per SM, each tile the whole k-loop and its pipeline fill and drain.
    const double waves = std::ceil(tiles_count / sms);
    visit({static_cast<int>(tm), static_cast<int>(tn), 1,
           gpu_.gemm_fixed_us + waves * tile_flops_per_k * (static_cast<double>(k) + k0) / sm_rate});
    if (!shapes) continue;
    // Split-K (what stream-K does when the tiles do not fill the SMs): each tile's k-loop in `splits`
    // slices on as many SMs, all in one wave; no slice shorter than its own pipeline. The slices write
    // float32 partial sums and the reduction reads them back, through HBM, after the slices' arithmetic.
    for (int splits = 2; tiles_count * splits <= sms && ceil_div(k, splits) >= std::max(k0, 1.0); ++splits) {
      const double slice_us = tile_flops_per_k * (ceil_div(k, splits) + k0) / sm_rate;
      const double fixup_us = memory_us(2.0 * splits * kPartialSumBytes * static_cast<double>(m) *
                                        static_cast<double>(n) * static_cast<double>(batch));
      visit({static_cast<int>(tm), static_cast<int>(tn), splits, gpu_.gemm_fixed_us + slice_us + fixup_us});
    }
  }
}

GemmCandidate ComputeModel::gemm_fastest(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                         std::int64_t batch) const {
  // A step times the same few shapes millions of times: the answers are kept per thread, a slot per key,
  // for the model that gave them (models_made: none while the constructor solves its ceilings).
  struct Kept {
    std::uint64_t model = 0;
    std::int64_t m = 0, n = 0, k = 0, batch = 0;
    DType dtype = DType::Float32;
    GemmCandidate best;
  };
  constexpr std::size_t kSlots = 512;
  thread_local std::array<Kept, kSlots> kept;
  std::size_t hash = static_cast<std::size_t>(id_);
  for (std::int64_t v : {m, n, k, batch, static_cast<std::int64_t>(dtype)})
    hash = (hash ^ static_cast<std::size_t>(v)) * 0x100000001b3ULL;
  Kept& slot = kept[(hash ^ (hash >> 29)) % kSlots];
  if (id_ != 0 && slot.model == id_ && slot.m == m && slot.n == n && slot.k == k && slot.batch == batch &&
      slot.dtype == dtype)
    return slot.best;
  // cuBLAS's heuristics intend the fastest kernel; ties go to the first (the profile's tile, unsplit).
  GemmCandidate best;
  bool any = false;
  each_gemm_candidate(m, n, k, dtype, batch, [&](const GemmCandidate& c) {
    if (!any || c.us < best.us) best = c;
    any = true;
  });
  if (id_ != 0) slot = {id_, m, n, k, batch, dtype, best};
  return best;
}

double ComputeModel::peak_tflops(DType dtype) const {
  switch (dtype) {
    case DType::Float32:
      return gpu_.peak_tflops_fp32;  // numerics are float32 without tensor cores
    case DType::BFloat16:
      return gpu_.peak_tflops_bf16;  // dense tensor-core rate
    case DType::Float16:
      return gpu_.peak_tflops_fp16 > 0 ? gpu_.peak_tflops_fp16 : gpu_.peak_tflops_bf16;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      if (gpu_.peak_tflops_fp8 <= 0) {
        throw UsageError(
            fmt::format("profile GPU {} has no FP8 tensor cores (no peak_tflops_fp8)", gpu_.name));
      }
      return gpu_.peak_tflops_fp8;
  }
  return gpu_.peak_tflops_fp32;
}

KernelCost ComputeModel::kernel_cost(double flops, double bytes, DType dtype) const {
  // TFLOP/s = 1e12 flop/s = 1e6 flop/us; GB/s = 1e9 B/s = 1e3 B/us.
  return {flops / (peak_tflops(dtype) * 1e6 * gpu_.compute_efficiency), memory_us(bytes)};
}

double ComputeModel::memory_us(double bytes) const {
  return bytes / (gpu_.hbm_bandwidth_gbps * 1e3 * gpu_.memory_efficiency);
}

KernelCost ComputeModel::gemm_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
  return batched_gemm_cost(1, m, n, k, dtype);
}

KernelCost ComputeModel::gemm_accumulate_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                              DType out_dtype) const {
  const double e = static_cast<double>(dtype_bytes(dtype)),
               out_e = static_cast<double>(dtype_bytes(out_dtype));
  KernelCost cost = gemm_cost(m, n, k, dtype);
  cost.memory_us = memory_us(e * static_cast<double>(m * k + k * n) + 2 * out_e * static_cast<double>(m * n));
  return cost;
}

KernelCost ComputeModel::batched_gemm_cost(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k,
                                           DType dtype) const {
  const double e = static_cast<double>(dtype_bytes(dtype)),
               out_e = static_cast<double>(dtype_bytes(gemm_output(dtype)));
  const double flops =
      d(batch) * (2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k));
  const double bytes =
      d(batch) * (e * static_cast<double>(m * k + k * n) + out_e * static_cast<double>(m * n));
  // float32 runs on CUDA cores: the plain roofline, as before 16-bit types existed.
  if (dtype == DType::Float32 || !gemm_shape_model() || flops == 0) return kernel_cost(flops, bytes, dtype);
  return {gemm_fastest(m, n, k, dtype, batch).us, memory_us(bytes)};
}

namespace {
// sum over i in [0, n) of clamp(c + i, 0, cap): the keys a run of n queries sees below a bound that moves
// with the query.
double clamped_ramp_sum(std::int64_t c, std::int64_t n, std::int64_t cap) {
  const std::int64_t from = std::clamp<std::int64_t>(-c, 0, n),
                     to = std::clamp<std::int64_t>(cap - c, from, n);
  // c + i runs from c + from to c + to - 1 between the bounds, then stays at cap.
  const double ramp = d(to - from) * (d(c + from) + d(c + to - 1)) / 2;
  return ramp + d(n - to) * d(cap);
}
}  // namespace

double AttentionShape::pairs() const {
  const double sq = d(seq), sk = d(keys());
  if (!causal) return sq * sk;
  if (window <= 0) return sq * sk - sq * sq / 2;
  // Query i (position p + i from key 0) sees keys [p + i - window + 1, p + i], clipped to the block's.
  const std::int64_t p = first_query_position >= 0 ? first_query_position : keys() - seq;
  return clamped_ramp_sum(p + 1, seq, keys()) - clamped_ramp_sum(p + 1 - window, seq, keys());
}

KernelCost ComputeModel::flash_attention_cost(const AttentionShape& a, bool backward, DType dtype,
                                              double efficiency) const {
  // Two GEMMs of 2 d flops per head and (query, key) pair forward (Q K^T and P V), over the pairs the mask
  // leaves.
  double flops = 4.0 * d(a.batch) * a.pairs() * d(a.heads) * d(a.head_dim);
  if (backward) flops *= 2.5;  // five GEMMs instead of two (FlashAttention-2 paper, section 4.1)
  const double e = static_cast<double>(dtype_bytes(dtype));
  const double queries = d(a.batch) * d(a.seq), keys = d(a.batch) * d(a.keys());
  const double q = d(a.heads * a.head_dim), kv = d(2 * a.groups() * a.head_dim);  // per token
  // Forward reads q, k, v and writes out and lse; backward also reads out and d out and writes d q, d k, d v.
  const double bytes = backward ? e * (queries * 4 * q + keys * 2 * kv) + 4.0 * queries * d(a.heads)
                                : e * (queries * 2 * q + keys * kv) + 4.0 * queries * d(a.heads);
  if (dtype == DType::Float32) return kernel_cost(flops, bytes, dtype);
  return {flops / (peak_tflops(dtype) * 1e6 * efficiency), memory_us(bytes)};
}

double ComputeModel::flash_attention_efficiency(const AttentionShape& a, bool backward) const {
  const AttentionShapeModel& m = backward ? gpu_.attention_bwd_shape : gpu_.attention_fwd_shape;
  if (!m.enabled()) {
    const double measured = backward ? gpu_.attention_bwd_efficiency : gpu_.attention_fwd_efficiency;
    return measured > 0 ? measured : gpu_.compute_efficiency;
  }
  // A windowed query's key loop is as long as a causal one's over `window` keys.
  const std::int64_t loop = a.window > 0 ? std::min(a.seq, a.window) : a.seq;
  const double s = d(std::max<std::int64_t>(loop, 1));
  // A short sequence gives each (batch, head) few query blocks and each block few key blocks: the
  // pipeline's start and end and the softmax rescaling are a larger share (FlashAttention-2 paper,
  // section 3.2; FlashAttention-3 paper, section 3.1).
  double efficiency = m.ceiling * s / (s + m.seq_half);
  // Head dim 64 does half the tensor-core work per element of the scores that 128 does, so the softmax
  // (on the slower exponential units) weighs twice as much; measured, not derived.
  const double hd = std::clamp(d(a.head_dim), 64.0, 128.0);
  efficiency *= m.hdim64_factor + (1 - m.hdim64_factor) * (hd - 64) / 64;
  // The causal mask leaves the blocks on the diagonal partly wasted and the rows unequal in work.
  if (a.causal) efficiency *= s / (s + m.causal_tokens);
  return efficiency;
}

std::vector<KernelCost> ComputeModel::attention_kernels(const AttentionShape& a, AttentionKernel kernel,
                                                        bool backward, DType dtype) const {
  if (kernel == AttentionKernel::Flash) {
    return {flash_attention_cost(a, backward, dtype, flash_attention_efficiency(a, backward))};
  }
  const std::int64_t bh = a.batch * a.heads, s = a.seq, hd = a.head_dim;
  const double e = static_cast<double>(dtype_bytes(dtype));
  const double scores = d(bh) * d(s) * d(s);  // elements of one s x s tensor over every (batch, head)
  const bool dropout = a.dropout > 0;
  // Megatron-LM's kernels: torch.baddbmm and torch.bmm over [b h, s, d] (ParallelAttention/CoreAttention
  // in megatron/model/transformer.py), FusedScaleMaskSoftmax (scaled_upper_triang_masked_softmax_cuda for
  // causal masks, computed in-kernel), and torch's dropout, which writes the output and a 1-byte mask.
  std::vector<KernelCost> out;
  if (!backward) {
    out.push_back(batched_gemm_cost(bh, s, s, hd, dtype));  // scores = Q K^T
    out.push_back(memory_cost(2 * e * scores));             // softmax: read the scores, write probabilities
    if (dropout) out.push_back(memory_cost((2 * e + 1) * scores));  // read P, write P' and the mask
    out.push_back(batched_gemm_cost(bh, s, hd, s, dtype));          // out = P' V
  } else {
    out.push_back(batched_gemm_cost(bh, s, s, hd, dtype));          // dP' = dO V^T
    out.push_back(batched_gemm_cost(bh, s, hd, s, dtype));          // dV = P'^T dO
    if (dropout) out.push_back(memory_cost((2 * e + 1) * scores));  // read dP' and the mask, write dP
    out.push_back(memory_cost(3 * e * scores));                     // read dP and P, write dS
    out.push_back(batched_gemm_cost(bh, s, hd, s, dtype));          // dQ = dS K
    out.push_back(batched_gemm_cost(bh, s, hd, s, dtype));          // dK = dS^T Q
  }
  return out;
}

int ComputeModel::attention_kernel_count(const AttentionShape& a, AttentionKernel kernel, bool backward) {
  if (kernel == AttentionKernel::Flash) return 1;
  return (backward ? 5 : 3) + (a.dropout > 0 ? 1 : 0);
}

KernelCost ComputeModel::attention_cost(const AttentionShape& a, AttentionKernel kernel, bool backward,
                                        DType dtype) const {
  const std::vector<KernelCost> kernels = attention_kernels(a, kernel, backward, dtype);
  if (kernels.size() == 1) return kernels[0];
  KernelCost sum;
  for (const KernelCost& k : kernels) {
    sum.math_us += k.us();
    sum.memory_us += k.memory_us;
  }
  return sum;
}

std::int64_t ComputeModel::unfused_attention_kept_bytes(const AttentionShape& a, DType dtype) {
  const std::int64_t scores = a.batch * a.heads * a.seq * a.seq;
  const std::int64_t e = dtype_bytes(dtype);
  return a.dropout > 0 ? scores * (2 * e + 1) : scores * e;
}

}  // namespace ranklab::sim
