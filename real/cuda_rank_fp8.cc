// CudaRank's FP8: quantizing with per-tensor and per-block scales, the per-tensor scale's small kernels,
// delayed scaling's update, and GEMMs of FP8 inputs (Rank's FP8 section, common/rank.h).
//
// An FP8 tensor here holds one byte per element, float8_code's (common/dtype_round.h), and its allocation
// carries its scales (Fp8Scales, real/device_memory.h): what the simulator's FP8 tensors hold as values, the
// codes times 1 / scale, is what to_host reads back. A GEMM of two tensors scaled per tensor runs on
// cuBLASLt's FP8 GEMM, which applies the two 1 / scale factors to its float32 sums
// (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER and B_SCALE_POINTER), where the GPU has FP8 tensor cores (compute
// capability 8.9 on) and the shapes suit it (every dimension a multiple of 16, every pointer 16-byte
// aligned). Hopper's FP8 GEMM reads both inputs k-major (cuBLASLt's "TN" layout): an input that is not is
// transposed first by a byte-copying kernel, the copy TransformerEngine writes in its cast instead.
// Block-scaled inputs (blockwise, MXFP8), and shapes cuBLASLt's FP8 GEMM does not take, are multiplied as
// the values they stand for in float32 (cuBLAS without TF32): the simulator's numbers, not the FP8 GEMM's
// speed.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "common/compute_checks.h"
#include "common/dtype_round.h"
#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/cuda_rank.h"
#include "real/kernels.h"

namespace ranklab {

namespace {

CudaStorage& storage_of(const Tensor& t) {
  return *static_cast<CudaStorage*>(t.storage());
}

kernels::Fp8Blocks blocks_of(const Fp8Scales& s) {
  return kernels::Fp8Blocks{s.block_rows, s.block_cols, s.e8m0};
}

// A tensor seen as a matrix: 2-D as it is, anything else as one row.
std::int64_t rows_of(const Tensor& t) {
  return t.ndim() == 2 ? t.size(0) : 1;
}
std::int64_t cols_of(const Tensor& t) {
  return t.ndim() == 2 ? t.size(1) : t.numel();
}

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// cuBLASLt's descriptors, destroyed on every path out.
struct LtDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDesc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c}) {
      if (l) cublasLtMatrixLayoutDestroy(l);
    }
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

cudaDataType_t fp8_type(DType t) {
  return t == DType::Float8E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

}  // namespace

void CudaRank::require_fp8_gpu(bool mx, const char* op) const {
  if (compute_capability_ < 89) {
    throw UsageError(
        fmt::format("{}: {} (compute capability {}.{}) has no FP8 tensor cores; FP8 needs 8.9 "
                    "or later (L40, H100, H200, B200)",
                    where(op), device_name_, compute_capability_ / 10, compute_capability_ % 10));
  }
  if (mx && compute_capability_ < 100) {
    throw UsageError(
        fmt::format("{}: {} (compute capability {}.{}) has no MX block scaling; MXFP8 needs "
                    "Blackwell (10.0 or later)",
                    where(op), device_name_, compute_capability_ / 10, compute_capability_ % 10));
  }
}

const Fp8Scales& CudaRank::fp8_scales_of(const Tensor& t, const char* op, const char* arg,
                                         std::int64_t* first_row) const {
  const CudaStorage& s = storage_of(t);
  const std::shared_ptr<Fp8Scales>& scales = s.fp8_scales();
  if (!scales) {
    throw UsageError(fmt::format(
        "{}: '{}' ({}) holds FP8 bytes nothing scaled: quantize makes FP8 tensors, and copy_, all_gather "
        "and all_to_all carry their scales",
        where(op), arg, t.str()));
  }
  *first_row = 0;
  if (!scales->per_tensor()) {
    if (t.ndim() != 2 || t.size(1) != scales->cols || s.begin() % scales->cols != 0) {
      throw UsageError(
          fmt::format("{}: '{}' ({}) is part of a block-scaled FP8 tensor of {} columns that is "
                      "not whole rows of it: its blocks' scales cannot be found",
                      where(op), arg, t.str(), scales->cols));
    }
    *first_row = s.begin() / scales->cols;
  }
  return *scales;
}

char* CudaRank::fp8_row_scales(const Tensor& t, const char* op, const char* arg,
                               std::int64_t* bytes_per_row) const {
  std::int64_t first_row = 0;
  const Fp8Scales& s = fp8_scales_of(t, op, arg, &first_row);
  if (s.block_rows != 1) {
    throw UsageError(
        fmt::format("{}: {} is scaled per {} x {} block; FP8 tensors move between tensors and "
                    "ranks scaled per tensor or per 1 x N block, whose scales move row by row "
                    "with them",
                    where(op), t.str(), s.block_rows, s.block_cols));
  }
  *bytes_per_row = s.row_blocks() * s.scale_bytes();
  return static_cast<char*>(storage_of(s.scale_inv).data()) + first_row * *bytes_per_row;
}

void CudaRank::take_fp8_scales(const Tensor& dst, const Tensor& src, const char* op, bool copy_rows) {
  std::int64_t first_row = 0;
  const Fp8Scales& from = fp8_scales_of(src, op, "src", &first_row);
  CudaStorage& to = storage_of(dst);
  if (from.per_tensor()) {
    // Every piece moved into one allocation must share the scale (TransformerEngine's all-gathered FP8
    // tensor takes the local one's scale_inv; the lesson reduces the amax over the group first).
    auto s = std::make_shared<Fp8Scales>(from);
    to.set_fp8_scales(std::move(s));
    return;
  }
  std::int64_t bytes_per_row = 0;
  const char* rows_from = fp8_row_scales(src, op, "src", &bytes_per_row);
  const std::shared_ptr<Fp8Scales>& have = to.fp8_scales();
  const bool same_layout = have && have->block_rows == from.block_rows &&
                           have->block_cols == from.block_cols && have->e8m0 == from.e8m0 &&
                           have->cols == from.cols;
  if (!same_layout) {
    // The allocation's rows: its elements over the row length (dst is whole rows of it).
    if (dst.ndim() != 2 || dst.size(1) != from.cols || to.begin() % from.cols != 0) {
      throw UsageError(
          fmt::format("{}: {} cannot take the rows of block-scaled {}: it must be whole rows of "
                      "{} columns",
                      where(op), dst.str(), src.str(), from.cols));
    }
    auto s = std::make_shared<Fp8Scales>(from);
    const std::int64_t rows = storage_of(dst).allocation_elements() / from.cols;
    const std::int64_t words = (rows * from.row_blocks() * from.scale_bytes() + 3) / 4;
    s->scale_inv = allocate(Shape{words}, DType::Float32, dst.phantom(), op);
    to.set_fp8_scales(std::move(s));
  }
  std::int64_t dst_bytes_per_row = 0;
  char* rows_to = fp8_row_scales(dst, op, "dst", &dst_bytes_per_row);
  if (!copy_rows || src.numel() == 0) return;
  kernel("copy", [&] {
    RANKLAB_CUDA(cudaMemcpyAsync(rows_to, rows_from, static_cast<size_t>(src.size(0) * bytes_per_row),
                                 cudaMemcpyDeviceToDevice, compute_));
  });
}

Rank::Quantized CudaRank::quantize(const Tensor& x, DType format, const Fp8Scaling& scaling,
                                   const Tensor& scale, bool both_layouts, const Tensor& record_amax) {
  const char* op = "quantize";
  const void* px = require(x, op, "x");
  const float* pscale = scale.defined() ? require_f32(scale, op, "scale") : nullptr;
  float* precord = record_amax.defined() ? require_f32(record_amax, op, "record_amax") : nullptr;
  check_quantize(rank_, x, format, scaling, scale, record_amax);
  require_fp8_gpu(scaling.e8m0, op);
  before_kernel({&x}, op);
  for (const Tensor* t : {&scale, &record_amax}) {
    if (t->defined()) before_kernel({t}, op);
  }
  const std::int64_t rows = x.size(0), cols = x.size(1);
  // One layout: its bytes and its scales; only the first records the amax.
  auto quantized = [&](const Fp8Scaling& layout, float* record, Tensor* block_scales) {
    Tensor data = allocate(x.shape(), format, x.phantom(), op);
    auto s = std::make_shared<Fp8Scales>();
    s->block_rows = layout.block_rows;
    s->block_cols = layout.block_cols;
    s->e8m0 = layout.e8m0;
    s->cols = cols;
    if (layout.per_tensor()) {
      s->scale_inv = allocate(Shape{1}, DType::Float32, x.phantom(), op);
    } else {
      s->scale_inv = allocate(Shape{layout.scale_words(x.shape())}, DType::Float32, x.phantom(), op);
      *block_scales = s->scale_inv;
    }
    auto* codes = static_cast<std::uint8_t*>(storage_of(data).data());
    void* scales = storage_of(s->scale_inv).data();
    kernel("quantize", [&] {
      kernels::fp8_quantize(codes, px, x.dtype(), rows, cols, format, blocks_of(*s), pscale,
                            layout.per_tensor() ? static_cast<float*>(scales) : nullptr,
                            layout.per_tensor() ? nullptr : scales, record, compute_);
    });
    storage_of(data).set_fp8_scales(std::move(s));
    return data;
  };
  Quantized q;
  q.data = quantized(scaling, precord, &q.scales);
  if (both_layouts) q.columnwise = quantized(scaling.transposed(), nullptr, &q.columnwise_scales);
  return q;
}

Tensor CudaRank::amax(const Tensor& x) {
  const void* px = require(x, "amax", "x");
  check_float8_use(rank_, "amax", x, "x");
  Tensor out = allocate(Shape{1}, DType::Float32, x.phantom(), "amax");
  float* po = require_f32(out, "amax", "out");
  before_kernel({&x}, "amax");
  kernel("amax", [&] { kernels::amax(po, px, x.dtype(), x.numel(), compute_); });
  return out;
}

Tensor CudaRank::fp8_scale(const Tensor& amax, DType format) {
  const float* pa = require_f32(amax, "fp8_scale", "amax");
  require_shape(amax, Shape{1}, "fp8_scale", "amax", "one largest magnitude");
  if (!is_float8(format)) {
    throw UsageError(fmt::format("{}: the format must be float8_e4m3 or float8_e5m2; got {}",
                                 where("fp8_scale"), dtype_name(format)));
  }
  Tensor out = allocate(Shape{1}, DType::Float32, amax.phantom(), "fp8_scale");
  float* po = require_f32(out, "fp8_scale", "out");
  before_kernel({&amax}, "fp8_scale");
  kernel("fp8_scale", [&] { kernels::fp8_scale(po, pa, float8_format(format).largest, compute_); });
  return out;
}

void CudaRank::fp8_delayed_update(const Tensor& reduced, const std::vector<Tensor>& histories,
                                  const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes,
                                  DType format, int margin) {
  const char* op = "fp8_delayed_update";
  const float* pr = require_f32(reduced, op, "reduced");
  for (const auto* list : {&histories, &scales, &amaxes}) {
    for (const Tensor& t : *list) require_f32(t, op, "state");
  }
  check_fp8_delayed_update(rank_, reduced, histories, scales, amaxes, format, margin);
  before_kernel({&reduced}, op);
  for (const auto* list : {&histories, &scales, &amaxes}) {
    for (const Tensor& t : *list) before_kernel({&t}, op);
  }
  const float largest = std::ldexp(float8_format(format).largest, -margin);
  // One small kernel per tensor (TransformerEngine's fused update is one kernel for all of them).
  kernel("fp8_delayed_update", [&] {
    for (std::size_t i = 0; i < histories.size(); ++i) {
      kernels::fp8_delayed_update(static_cast<float*>(storage_of(histories[i]).data()), histories[i].numel(),
                                  static_cast<float*>(storage_of(scales[i]).data()),
                                  static_cast<float*>(storage_of(amaxes[i]).data()), pr + i, largest,
                                  compute_);
    }
  });
}

Tensor CudaRank::fp8_values(const Tensor& t, const char* op) {
  std::int64_t first_row = 0;
  const Fp8Scales& s = fp8_scales_of(t, op, "t", &first_row);
  const std::int64_t rows = rows_of(t), cols = cols_of(t);
  Tensor out = allocate(Shape{rows, cols}, DType::Float32, t.phantom(), op);
  kernel("dequantize", [&] {
    kernels::fp8_dequantize(static_cast<float*>(storage_of(out).data()),
                            static_cast<const std::uint8_t*>(storage_of(t).data()), rows, cols, t.dtype(),
                            blocks_of(s), storage_of(s.scale_inv).data(), first_row, s.row_blocks(),
                            compute_);
  });
  return out;
}

void CudaRank::fp8_gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                        bool accumulate) {
  std::int64_t first_row = 0;
  const bool per_tensor = fp8_scales_of(a, "matmul", "a", &first_row).per_tensor() &&
                          fp8_scales_of(b, "matmul", "b", &first_row).per_tensor();
  if (per_tensor && fp8_gemm_cublaslt(c, a, b, ta, tb, accumulate)) return;
  fp8_gemm_dequantized(c, a, b, ta, tb, accumulate);
}

bool CudaRank::fp8_gemm_cublaslt(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                                 bool accumulate) {
  const std::int64_t m = c.size(0), n = c.size(1), k = ta == Trans::Yes ? a.size(0) : a.size(1);
  if (compute_capability_ < 89 || m % 16 != 0 || n % 16 != 0 || k % 16 != 0) return false;
  if (c.dtype() != DType::BFloat16 && c.dtype() != DType::Float32) return false;
  void* pc = storage_of(c).data();
  if (!aligned16(pc) || !aligned16(storage_of(a).data()) || !aligned16(storage_of(b).data())) return false;
  // Column-major, as cuBLAS sees our row-major buffers: C^T [n, m] = b_k [n, k] times a_k^T [k, m], with a_k
  // and b_k the inputs k-major (a as [m, k], b as [n, k]): cuBLASLt's A = b_k read transposed (T), B = a_k
  // (N). Each input's 1 / scale is its own (a k-major copy shares it).
  const void* scale_a = storage_of(storage_of(a).fp8_scales()->scale_inv).data();
  const void* scale_b = storage_of(storage_of(b).fp8_scales()->scale_inv).data();
  LtDesc d;
  const cudaDataType_t out_type = c.dtype() == DType::BFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  RANKLAB_CUBLAS(cublasLtMatmulDescCreate(&d.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  RANKLAB_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  RANKLAB_CUBLAS(cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
  RANKLAB_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof scale_b));
  RANKLAB_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof scale_a));
  RANKLAB_CUBLAS(cublasLtMatrixLayoutCreate(&d.a, fp8_type(b.dtype()), static_cast<std::uint64_t>(k),
                                            static_cast<std::uint64_t>(n), k));
  RANKLAB_CUBLAS(cublasLtMatrixLayoutCreate(&d.b, fp8_type(a.dtype()), static_cast<std::uint64_t>(k),
                                            static_cast<std::uint64_t>(m), k));
  RANKLAB_CUBLAS(cublasLtMatrixLayoutCreate(&d.c, out_type, static_cast<std::uint64_t>(n),
                                            static_cast<std::uint64_t>(m), n));
  RANKLAB_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref));
  const std::uint64_t workspace = kCublasWorkspaceBytes;
  RANKLAB_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace, sizeof workspace));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(cublaslt_, d.desc, d.a, d.b, d.c, d.c, d.pref, 1, &heuristic, &found) !=
          CUBLAS_STATUS_SUCCESS ||
      found == 0) {
    return false;  // no FP8 kernel for this case: the float32 path
  }
  // An input not k-major is transposed by a byte copy first.
  auto k_major = [&](const Tensor& t, bool already, std::int64_t outer) {
    if (already) return t;
    Tensor copy = allocate(Shape{outer, k}, t.dtype(), t.phantom(), "matmul");
    kernel("transpose", [&] {
      kernels::transpose_bytes(static_cast<std::uint8_t*>(storage_of(copy).data()),
                               static_cast<const std::uint8_t*>(storage_of(t).data()), t.size(0), t.size(1),
                               compute_);
    });
    return copy;
  };
  const Tensor ak = k_major(a, ta == Trans::No, m), bk = k_major(b, tb == Trans::Yes, n);
  const float one = 1.0f, zero = 0.0f;
  kernel("matmul", [&] {
    RANKLAB_CUBLAS(cublasLtMatmul(cublaslt_, d.desc, &one, storage_of(bk).data(), d.a, storage_of(ak).data(),
                                  d.b, accumulate ? &one : &zero, pc, d.c, pc, d.c, &heuristic.algo,
                                  cublas_workspace_, kCublasWorkspaceBytes, compute_));
  });
  return true;
}

void CudaRank::fp8_gemm_dequantized(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                                    bool accumulate) {
  const Tensor av = fp8_values(a, "matmul"), bv = fp8_values(b, "matmul");
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = c.size(0), n = c.size(1), k = at ? a.size(0) : a.size(1);
  // The product in float32, rounded once into c (a bfloat16 c) or summed into it (matmul_add_).
  const bool direct = c.dtype() == DType::Float32;
  const Tensor product = direct ? c : allocate(c.shape(), DType::Float32, c.phantom(), "matmul");
  void* pp = storage_of(product).data();
  kernel("matmul", [&] {
    const float one = 1.0f, zero = 0.0f;
    const float* beta = direct && accumulate ? &one : &zero;
    // Strict float32 (no TF32): the values carry up to 24 bits of mantissa.
    RANKLAB_CUBLAS(cublasGemmEx(
        cublas_, bt ? CUBLAS_OP_T : CUBLAS_OP_N, at ? CUBLAS_OP_T : CUBLAS_OP_N, cublas_dim(n, "n"),
        cublas_dim(m, "m"), cublas_dim(k, "k"), &one, storage_of(bv).data(), CUDA_R_32F,
        cublas_dim(bv.size(1), "ldb"), storage_of(av).data(), CUDA_R_32F, cublas_dim(av.size(1), "lda"), beta,
        pp, CUDA_R_32F, cublas_dim(n, "ldc"), CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
    if (direct) return;
    void* pc = storage_of(c).data();
    if (accumulate) {
      kernels::axpy(pc, c.dtype(), pp, DType::Float32, 1.0f, c.numel(), compute_);
    } else {
      kernels::convert(pc, c.dtype(), pp, DType::Float32, c.numel(), compute_);
    }
  });
}

}  // namespace ranklab
