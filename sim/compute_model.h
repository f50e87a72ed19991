// ComputeModel: how long a kernel takes on the profile's GPU. A roofline: a kernel is bound either by
// arithmetic (flops / peak) or by memory traffic (bytes / HBM bandwidth), whichever is slower
// (Williams, Waterman & Patterson, "Roofline", CACM 2009). A 16-bit GEMM's arithmetic rate depends on its
// shape (output tiles, waves of tiles over the SMs, k), scaled so that it reproduces a measured large GEMM;
// fused attention runs at a measured fraction of the 16-bit peak. docs/model.md ("Compute") has the
// formulas and the source of every constant.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/profile.h"
#include "common/rank.h"
#include "common/tensor.h"

namespace ranklab::sim {

// A kernel's two roofline times: its arithmetic at the rate its SMs reach, and its HBM traffic at the
// bandwidth it reaches. It takes the slower of the two; kept apart, they say how a kernel slows when
// communication takes some of the SMs or of the HBM bandwidth (SimWorld::launch_kernel).
struct KernelCost {
  double math_us = 0;
  double memory_us = 0;
  double us() const { return math_us > memory_us ? math_us : memory_us; }
};

// Which kernels compute attention: common/rank.h.
using ranklab::AttentionKernel;

// One attention call on one GPU: `batch` sequences of `seq` tokens, `heads` heads of `head_dim`.
struct AttentionShape {
  std::int64_t batch = 1, seq = 0;
  std::int64_t heads = 1, head_dim = 0;
  bool causal = false;
  float dropout = 0;  // attention-dropout probability (Megatron-LM: 0.1); > 0 adds the unfused dropout passes
  std::int64_t kv_heads = 0;  // key-value heads (grouped-query attention); 0: heads
  // Keys per sequence when they are not the queries' (a context-parallel block); 0: seq. A causal mask
  // over more keys than queries is aligned at the end (each query sees the keys before its own position).
  std::int64_t kv_seq = 0;
  // A causal sliding window (AttentionSpec::window): each query sees the `window` keys up to its position;
  // 0: none. With it, first_query_position is query 0's position counted from key 0's; -1: keys() - seq,
  // the queries at the end of the keys.
  std::int64_t window = 0;
  std::int64_t first_query_position = -1;
  std::int64_t groups() const { return kv_heads > 0 ? kv_heads : heads; }
  std::int64_t keys() const { return kv_seq > 0 ? kv_seq : seq; }
  // The (query, key) pairs the mask leaves per sample and head. Without a window a causal mask hides half
  // of the square block at the end (the diagonal counted half, as the kernels' tiles on it are half
  // wasted); with one, the pairs are counted exactly.
  double pairs() const;
};

// One way cuBLAS can run a 16-bit GEMM: output tiles of tile_m x tile_n, each tile's k-loop split over
// `splits` SMs (1: no split), and the time it takes (docs/model.md, "Compute").
struct GemmCandidate {
  int tile_m = 0;
  int tile_n = 0;
  int splits = 1;
  double us = 0;
};

class ComputeModel {
 public:
  // UsageError when the profile's measured GEMM is faster than the model's shape factors allow.
  explicit ComputeModel(const GpuModel& gpu);

  // The roofline times of a kernel doing `flops` operations and moving `bytes` to and from HBM.
  KernelCost kernel_cost(double flops, double bytes, DType dtype) const;
  // op(a) [m, k] @ op(b) [k, n] with inputs and output of `dtype`.
  double gemm_us(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const {
    return gemm_cost(m, n, k, dtype).us();
  }
  KernelCost gemm_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype) const;
  // The same GEMM adding its product into an output of `out_dtype` (cuBLAS's C with beta 1): the same
  // arithmetic, and the output read as well as written at its own width.
  KernelCost gemm_accumulate_cost(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                  DType out_dtype) const;
  // `batch` independent GEMMs of one shape in one strided-batched call (cuBLAS's
  // cublasGemmStridedBatchedEx): the output tiles of all entries share the waves over the SMs, so a batch
  // of small GEMMs fills the GPU where one alone would not.
  KernelCost batched_gemm_cost(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k,
                               DType dtype) const;

  // Attention by `kernel`, forward or backward. Flash is one kernel at flash_attention_efficiency. Unfused
  // is the sequence attention_kernels lists, run one after another: math_us is the sum of their times
  // (so us() is the sequence's time) and memory_us the sum of their HBM times, so that communication
  // beside it slows it by the SMs it takes over all of it and by the HBM bandwidth it takes over the
  // traffic. The causal mask does not shorten the unfused GEMMs: they compute all s x s scores.
  double attention_us(const AttentionShape& shape, AttentionKernel kernel, bool backward, DType dtype) const {
    return attention_cost(shape, kernel, backward, dtype).us();
  }
  KernelCost attention_cost(const AttentionShape& shape, AttentionKernel kernel, bool backward,
                            DType dtype) const;
  // Each kernel of an attention pass, in launch order; a caller timing them one by one charges one launch
  // each. Unfused forward: Q K^T, scale-mask-softmax, dropout (when shape.dropout > 0), P V. Unfused
  // backward: dP = dO V^T, dV = P^T dO, dropout backward (when shape.dropout > 0), softmax backward,
  // dQ = dS K, dK = dS^T Q.
  std::vector<KernelCost> attention_kernels(const AttentionShape& shape, AttentionKernel kernel,
                                            bool backward, DType dtype) const;
  // How many kernels attention_kernels lists.
  static int attention_kernel_count(const AttentionShape& shape, AttentionKernel kernel, bool backward);
  // The bytes the unfused forward keeps for its backward beyond q, k, v: the softmax output (b h s^2
  // elements of `dtype`, which the softmax backward reads) and, with dropout, the dropout mask (1 byte per
  // element) and the dropout output (b h s^2 of `dtype`, which dV = P^T dO reads). Korthikanti et al. 2022,
  // "Reducing Activation Recomputation in Large Transformer Models", section 4.1: with a heads, sequence s,
  // micro-batch b in 16-bit, 2as^2b for the softmax, as^2b for the mask and 2as^2b for the dropout output,
  // 5as^2b in all.
  static std::int64_t unfused_attention_kept_bytes(const AttentionShape& shape, DType dtype);
  // Fused attention's fraction of the 16-bit peak for `shape`: the profile's shape model for the pass when
  // it has one (AttentionShapeModel in common/profile.h), its flat fraction otherwise.
  double flash_attention_efficiency(const AttentionShape& shape, bool backward) const;
  // A memory-bound kernel moving `bytes` to and from HBM.
  double memory_us(double bytes) const;
  KernelCost memory_cost(double bytes) const { return {0, memory_us(bytes)}; }
  // UsageError unless the GPU has FP8 tensor cores (and, with `mx`, ones that apply MX block scales).
  void require_fp8(bool mx) const;
  // Host time to launch one kernel.
  double launch_us() const { return gpu_.launch_overhead_us; }

  // The factors of a 16-bit GEMM's rate, each in (0, 1]: the output tiles' fill of their last partial tile
  // times the last wave's fill of the SMs (for the better orientation of the profile's tile), k / (k + k0),
  // a tile's rate against the largest tile's, and the ceiling that makes the model reproduce the profile's
  // measured GEMM. Exposed for tests and docs. With `batch`, the tiles of that many GEMMs of this shape
  // share the waves (batched_gemm_cost).
  double gemm_quantization(std::int64_t m, std::int64_t n, std::int64_t batch = 1) const;
  double gemm_k_efficiency(std::int64_t k, DType dtype = DType::BFloat16) const;
  double gemm_tile_efficiency(std::int64_t tile_m, std::int64_t tile_n, DType dtype) const;
  double gemm_ceiling(DType dtype = DType::BFloat16) const;
  // The elements of k a tile's pipeline fill and drain cost, for inputs of `dtype`.
  double gemm_k_overhead(DType dtype) const;
  // Every way the model considers running a 16-bit GEMM, each with its time; gemm_cost takes the fastest.
  // The profile's tile and its transpose; with gemm_ridge_flops_per_byte, also the smaller tiles and, for
  // a GEMM whose tiles do not fill the SMs, each tile with its k-loop split.
  // With `batch`, that many GEMMs of this shape in one call (strided-batched), their tiles in the same waves.
  std::vector<GemmCandidate> gemm_candidates(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                                             std::int64_t batch = 1) const;
  // Whether 16-bit GEMMs use the shape model (the profile has sm_count and a measured GEMM).
  bool gemm_shape_model() const { return gemm_ceiling_ > 0; }

 private:
  double peak_tflops(DType dtype) const;
  // The ceiling that makes the fastest candidate at m x n x k of `dtype` run at `tflops`, solved while the
  // ceilings are 1. `field` names the profile's fields in an error.
  double solve_ceiling(double tflops, int m, int n, int k, DType dtype, const char* field) const;
  KernelCost flash_attention_cost(const AttentionShape& shape, bool backward, DType dtype,
                                  double efficiency) const;
  GemmCandidate gemm_fastest(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype,
                             std::int64_t batch = 1) const;
  // Calls `visit` with each of gemm_candidates' candidates, in its order, building no list: a large run
  // times millions of GEMMs.
  void each_gemm_candidate(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, std::int64_t batch,
                           const std::function<void(const GemmCandidate&)>& visit) const;
  GpuModel gpu_;
  double gemm_ceiling_ = 0;                                        // 16-bit GEMMs
  double gemm_ceiling_fp8_ = 0;                                    // FP8 GEMMs
  std::vector<std::pair<std::int64_t, std::int64_t>> gemm_tiles_;  // (m, n) of each tile considered
  // Its number once its ceilings are solved, which names its answers in gemm_fastest's memory; 0 before.
  std::uint64_t id_ = 0;
};

}  // namespace ranklab::sim
