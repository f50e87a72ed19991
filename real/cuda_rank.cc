// CudaRank: tensors, kernels, time, memory and output of one GPU rank. Communication is in cuda_comm.cc.
#include "real/cuda_rank.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#include "common/compute_checks.h"
#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/half_convert.h"
#include "real/kernels.h"

namespace ranklab {

namespace {

// One mutex for the whole process: ranks that are threads print whole lines, never interleaved ones.
std::mutex& stdout_mutex() {
  static std::mutex m;
  return m;
}

// Rows before `dim`, entries along it, and elements after it: a tensor seen as [outer, size, inner].
struct Layout {
  std::int64_t outer = 1;
  std::int64_t size = 1;
  std::int64_t inner = 1;
};
Layout layout_along(const Shape& s, int dim) {
  Layout l;
  for (int i = 0; i < dim; ++i) l.outer *= s[i];
  l.size = s[dim];
  for (int i = dim + 1; i < s.ndim(); ++i) l.inner *= s[i];
  return l;
}

}  // namespace

CudaRank::CudaRank(const RankSetup& setup)
    : rank_(setup.rank),
      world_(setup.world),
      device_(setup.device),
      host_(setup.host),
      config_(*setup.config),
      host_name_(host_name()),
      watchdog_(setup.config->watchdog_timeout_s, setup.abort_flag),
      timeline_(setup.config->max_timed_ops_per_rank),
      comms_(setup.rank, setup.world, &watchdog_) {
  try {
    init();
  } catch (...) {
    release();
    throw;
  }
}

void CudaRank::init() {
  set_error_context(rank_, device_);
  RANKLAB_CUDA(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  RANKLAB_CUDA(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  compute_capability_ = prop.major * 10 + prop.minor;
  // Non-blocking streams never synchronise with the legacy default stream, which other code may use.
  RANKLAB_CUDA(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  RANKLAB_CUDA(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&issue_, cudaEventDisableTiming));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&sync_compute_, cudaEventDisableTiming));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&sync_comm_, cudaEventDisableTiming));
  RANKLAB_CUBLAS(cublasCreate(&cublas_));
  RANKLAB_CUBLAS(cublasSetStream(cublas_, compute_));
  RANKLAB_CUBLAS(cublasLtCreate(&cublaslt_));
  // Plain float32 unless asked: with TF32 the products keep about 10 bits of mantissa, and the numbers
  // stop matching the simulator's.
  RANKLAB_CUBLAS(
      cublasSetMathMode(cublas_, config_.allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));

  // Freed blocks stay in the pool for the next allocation instead of going back to the driver.
  cudaMemPool_t pool = nullptr;
  RANKLAB_CUDA(cudaDeviceGetDefaultMemPool(&pool, device_));
  std::uint64_t keep_all = UINT64_MAX;
  RANKLAB_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  size_t free_bytes = 0, total_bytes = 0;
  RANKLAB_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  account_ =
      std::make_shared<DeviceAccount>(rank_, device_, fmt::format("{} (GPU {})", device_name_, device_),
                                      compute_, static_cast<std::int64_t>(total_bytes));
  RANKLAB_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&sum_scratch_),
                               sizeof(double) * (kernels::kSumBlocks + 1), compute_));
  // cuBLAS's workspace from the same stream-ordered pool, so a GEMM never calls cudaMalloc behind our back
  // (32 MiB is what NVIDIA recommends for Hopper; less is enough elsewhere).
  RANKLAB_CUDA(cudaMallocAsync(&cublas_workspace_, kCublasWorkspaceBytes, compute_));
  RANKLAB_CUBLAS(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
  log_.rank = rank_;
  log_.device = device_;
  log_.host = host_name_;
  log_.device_name = device_name_;
}

CudaRank::~CudaRank() {
  release();
}

void CudaRank::release() noexcept {
  // Nothing here may throw; on a failed run the device may be in any state.
  comms_.abort();
  if (sum_scratch_) cudaFreeAsync(sum_scratch_, compute_);
  if (account_) account_->close();
  if (cublas_) cublasDestroy(cublas_);
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  if (cublas_workspace_) cudaFreeAsync(cublas_workspace_, compute_);
  for (cudaEvent_t e : {issue_, sync_compute_, sync_comm_}) {
    if (e) cudaEventDestroy(e);
  }
  if (compute_) cudaStreamDestroy(compute_);
  if (comm_) cudaStreamDestroy(comm_);
  sum_scratch_ = nullptr;
  cublas_workspace_ = nullptr;
  cublas_ = nullptr;
  cublaslt_ = nullptr;
  issue_ = sync_compute_ = sync_comm_ = nullptr;
  compute_ = comm_ = nullptr;
}

void CudaRank::connect() {
  std::string id_bytes(NCCL_UNIQUE_ID_BYTES, '\0');
  ncclUniqueId id{};
  if (rank_ == 0) {
    RANKLAB_NCCL(ncclGetUniqueId(&id), nullptr);
    std::memcpy(id_bytes.data(), &id, sizeof(id));
  }
  host_->broadcast(id_bytes);
  if (id_bytes.size() != sizeof(id)) {
    throw BackendError(fmt::format("{}: the NCCL unique id arrived garbled", error_where()));
  }
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  comms_.init_world(id);
}

void CudaRank::start() {
  host_->barrier(0);
  timeline_.start(compute_);
  origin_ = std::chrono::steady_clock::now();
}

RankLog CudaRank::finish() {
  if (!open_regions_.empty()) {
    throw UsageError(
        fmt::format("{}: region '{}' was never closed", where("finish"), open_regions_.back().first));
  }
  synchronize();
  log_.end_us = now();
  comms_.finalize();
  for (const TimedKernel& k : kernels_) {
    auto [start, end] = timeline_.times(k.interval);
    log_.compute.push_back(Span{rank_, SpanKind::Compute, k.name, start, end});
  }
  for (TimedComm& c : comm_timings_) {
    std::tie(c.timing.start_us, c.timing.end_us) = timeline_.times(c.interval);
    log_.comms.push_back(std::move(c.timing));
  }
  log_.peak_bytes = account_->peak();
  log_.capacity_bytes = account_->capacity();
  log_.spans_truncated = timeline_.truncated();
  // Give the pool's cached blocks back, so the next run (or another program) finds the memory free.
  cudaMemPool_t pool = nullptr;
  RANKLAB_CUDA(cudaDeviceGetDefaultMemPool(&pool, device_));
  RANKLAB_CUDA(cudaMemPoolTrimTo(pool, 0));
  return std::move(log_);
}

void CudaRank::abort() noexcept {
  comms_.abort();
}

// ---- argument checks -----------------------------------------------------------------------------------

std::string CudaRank::where(const char* op) const {
  return fmt::format("rank {}: {}", rank_, op);
}

void* CudaRank::require(const Tensor& t, const char* op, const char* arg) const {
  watchdog_.check_abort();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  auto* s = dynamic_cast<CudaStorage*>(t.storage());
  if (s == nullptr || t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
  if (is_float8(t.dtype()) && !takes_float8(op)) check_float8_use(rank_, op, t, arg);
  return s->data();
}

float* CudaRank::require_f32(const Tensor& t, const char* op, const char* arg) const {
  void* p = require(t, op, arg);
  if (t.dtype() != DType::Float32) {
    throw UsageError(fmt::format("{}: '{}' is {}; it must be float32", where(op), arg, t.str()));
  }
  return static_cast<float*>(p);
}

void CudaRank::before_kernel(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    if (const AsyncOp* pending = static_cast<CudaStorage*>(t->storage())->unwaited()) {
      throw UsageError(fmt::format(
          "{}: {} is still in use by {}, issued with Async::Yes and not waited on; call wait() on its Work "
          "before touching the tensor (on a GPU this would be a silent race)",
          where(op), t->str(), pending->label));
    }
  }
}

void CudaRank::require_same_shape(const Tensor& a, const Tensor& b, const char* op) const {
  if (a.shape() != b.shape()) {
    throw UsageError(fmt::format("{}: shapes differ: {} and {}", where(op), a.str(), b.str()));
  }
}

// A kernel's inputs share one dtype (common/rank.h): mixing them is a lesson's mistake, not a conversion.
void CudaRank::require_same_dtype(const Tensor& a, const Tensor& b, const char* op) const {
  if (a.dtype() != b.dtype()) {
    throw UsageError(fmt::format("{}: dtypes differ: {} and {}; convert one with cast() first", where(op),
                                 a.str(), b.str()));
  }
}

// An in-place op on a real tensor cannot take its values from a phantom (the simulator's rule; here
// both hold bytes, but a lesson that mixes them is wrong on the simulator).
void CudaRank::require_same_kind(const Tensor& dst, const Tensor& src, const char* op) const {
  if (!dst.phantom() && src.phantom()) {
    throw UsageError(fmt::format("{}: writes phantom {} into real {}; make both phantom or both real",
                                 where(op), src.str(), dst.str()));
  }
}

void CudaRank::require_ndim(const Tensor& t, int ndim, const char* op, const char* arg) const {
  if (t.ndim() != ndim) {
    throw UsageError(fmt::format("{}: '{}' must be {}-D; got {}", where(op), arg, ndim, t.str()));
  }
}

void CudaRank::require_shape(const Tensor& t, const Shape& s, const char* op, const char* arg,
                             const char* why) const {
  if (t.shape() != s) {
    throw UsageError(
        fmt::format("{}: '{}' is {}; expected shape {} ({})", where(op), arg, t.str(), s.str(), why));
  }
}

Tensor CudaRank::allocate(const Shape& s, DType dtype, bool phantom, const char* op) {
  watchdog_.check_abort();
  return Tensor(s, dtype, std::make_shared<CudaStorage>(account_, s, dtype, phantom, op));
}

// ---- tensors -------------------------------------------------------------------------------------------

// Uninitialised, as cudaMalloc leaves it (the simulator fills NaN; no lesson may read it either way).
Tensor CudaRank::empty(const Shape& s, DType dtype) {
  return allocate(s, dtype, false, "empty");
}

Tensor CudaRank::zeros(const Shape& s, DType dtype) {
  Tensor t = allocate(s, dtype, false, "zeros");
  void* p = require(t, "zeros", "out");
  // All-zero bytes are +0 in float32, bfloat16 and float16 alike.
  kernel("fill", [&] {
    if (p) RANKLAB_CUDA(cudaMemsetAsync(p, 0, static_cast<size_t>(t.bytes()), compute_));
  });
  return t;
}

Tensor CudaRank::full(const Shape& s, float value, DType dtype) {
  Tensor t = allocate(s, dtype, false, "full");
  void* p = require(t, "full", "out");
  kernel("fill", [&] { kernels::fill(p, dtype, t.numel(), value, compute_); });
  return t;
}

Tensor CudaRank::arange(const Shape& s, float start) {
  Tensor t = allocate(s, DType::Float32, false, "arange");
  float* p = require_f32(t, "arange", "out");
  kernel("arange", [&] { kernels::arange(p, t.numel(), start, compute_); });
  return t;
}

Tensor CudaRank::randn(const Shape& s, std::uint64_t seed, float std, DType dtype) {
  Tensor t = allocate(s, dtype, false, "randn");
  void* p = require(t, "randn", "out");
  const std::int64_t n = t.numel();
  kernel("randn", [&] { kernels::randn_slice(p, dtype, 1, n, 1, 0, n, seed, std, compute_); });
  return t;
}

Tensor CudaRank::randn_slice(const Shape& full, int dim, std::int64_t start, std::int64_t length,
                             std::uint64_t seed, float std, DType dtype) {
  check_randn_slice(rank_, full, dim, start, length);
  Tensor t = allocate(full.with_dim(dim, length), dtype, false, "randn_slice");
  void* p = require(t, "randn_slice", "out");
  const Layout l = layout_along(full, dim);
  // Each element draws the number of its index in the full tensor, so the slices of all ranks put
  // together are randn(full) exactly, and no rank makes more than its own part.
  kernel("randn", [&] {
    kernels::randn_slice(p, dtype, l.outer, l.size, l.inner, start, length, seed, std, compute_);
  });
  return t;
}

Tensor CudaRank::from_host(const Shape& s, const std::vector<float>& values, DType dtype) {
  if (static_cast<std::int64_t>(values.size()) != s.numel()) {
    throw UsageError(fmt::format("{}: {} values do not fill shape {} ({} elements)", where("from_host"),
                                 values.size(), s.str(), s.numel()));
  }
  Tensor t = allocate(s, dtype, false, "from_host");
  void* p = require(t, "from_host", "out");
  // 16-bit values are rounded on the host, so only their bytes cross the bus.
  std::vector<unsigned char> bytes(static_cast<size_t>(t.bytes()));
  encode_values(dtype, values.data(), t.numel(), bytes.data());
  // From pageable memory CUDA stages the bytes before returning, so `bytes` may go away after this.
  kernel("copy_h2d", [&] {
    if (p) {
      RANKLAB_CUDA(cudaMemcpyAsync(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, compute_));
    }
  });
  return t;
}

// A phantom tensor is a simulator idea (a shape without bytes). Here it is real, uninitialised device
// memory, so a lesson's phantom mode runs and is timed for real, and fails with OutOfMemoryError where
// the GPU cannot hold it.
Tensor CudaRank::phantom(const Shape& s, DType dtype) {
  return allocate(s, dtype, true, "phantom");
}

Tensor CudaRank::view(const Tensor& base, std::int64_t offset, const Shape& shape) {
  require(base, "view", "base");
  check_view(rank_, base, offset, shape);
  return Tensor(shape, base.dtype(), std::make_shared<CudaStorage>(base, offset, shape.numel()));
}

std::vector<float> CudaRank::to_host(const Tensor& t) {
  void* p = require(t, "to_host", "t");
  if (t.phantom()) {
    throw UsageError(fmt::format("{}: {} has a shape but no values (phantom tensors only advance time)",
                                 where("to_host"), t.str()));
  }
  before_kernel({&t}, "to_host");
  if (is_float8(t.dtype())) return to_host(fp8_values(t, "to_host"));
  std::vector<unsigned char> bytes(static_cast<size_t>(t.bytes()));
  // Wait through the watchdog first, so a stuck collective upstream becomes an error, not a hang.
  RANKLAB_CUDA(cudaEventRecord(sync_compute_, compute_));
  watchdog_.wait_event(sync_compute_, "to_host");
  if (p) {
    RANKLAB_CUDA(cudaMemcpyAsync(bytes.data(), p, bytes.size(), cudaMemcpyDeviceToHost, compute_));
    RANKLAB_CUDA(cudaStreamSynchronize(compute_));
  }
  std::vector<float> values(static_cast<size_t>(t.numel()));
  decode_values(t.dtype(), bytes.data(), t.numel(), values.data());
  return values;
}

// ---- compute -------------------------------------------------------------------------------------------

namespace {

cudaDataType_t cublas_type(DType t) {
  switch (t) {
    case DType::BFloat16:
      return CUDA_R_16BF;
    case DType::Float16:
      return CUDA_R_16F;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      throw UsageError(fmt::format("{}: FP8 GEMMs run in fp8_gemm", dtype_name(t)));
    case DType::Float32:
      break;
  }
  return CUDA_R_32F;
}

}  // namespace

void CudaRank::gemm(const Tensor& c, const Tensor& a, const Tensor& b, Trans ta, Trans tb, const char* op,
                    bool accumulate) {
  const void* pa = require(a, op, "a");
  const void* pb = require(b, op, "b");
  void* pc = require(c, op, "out");
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = c.size(0), n = c.size(1), k = at ? a.size(0) : a.size(1);
  const DType dtype = a.dtype();
  before_kernel({&a, &b, &c}, op);
  if (m == 0 || n == 0) return;
  if (is_float8(dtype) && k > 0) {
    fp8_gemm(c, a, b, ta, tb, accumulate);
    return;
  }
  kernel(op, [&] {
    if (k == 0) {
      if (!accumulate) RANKLAB_CUDA(cudaMemsetAsync(pc, 0, static_cast<size_t>(c.bytes()), compute_));
      return;
    }
    // cuBLAS is column-major and ours are row-major: a row-major X is a column-major X^T, so compute
    // C^T = op(B)^T op(A)^T, which cuBLAS sees as op(B) times op(A) on the same buffers.
    const float one = 1.0f, zero = 0.0f;
    const float* beta = accumulate ? &one : &zero;
    const cublasOperation_t opb = bt ? CUBLAS_OP_T : CUBLAS_OP_N, opa = at ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int ldb = cublas_dim(std::max<std::int64_t>(1, b.size(1)), "ldb");
    const int lda = cublas_dim(std::max<std::int64_t>(1, a.size(1)), "lda");
    if (dtype == DType::Float32) {
      RANKLAB_CUBLAS(cublasSgemm(cublas_, opb, opa, cublas_dim(n, "n"), cublas_dim(m, "m"),
                                 cublas_dim(k, "k"), &one, static_cast<const float*>(pb), ldb,
                                 static_cast<const float*>(pa), lda, beta, static_cast<float*>(pc),
                                 cublas_dim(n, "ldc")));
    } else {
      // 16-bit inputs on tensor cores, float32 accumulation and float scalars; the product is rounded once,
      // to the output's type (16-bit, or float32 where matmul_add_ sums into a float32 gradient).
      const cudaDataType_t type = cublas_type(dtype);
      RANKLAB_CUBLAS(cublasGemmEx(cublas_, opb, opa, cublas_dim(n, "n"), cublas_dim(m, "m"),
                                  cublas_dim(k, "k"), &one, pb, type, ldb, pa, type, lda, beta, pc,
                                  cublas_type(c.dtype()), cublas_dim(n, "ldc"), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    }
  });
}

Tensor CudaRank::matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
  require(a, "matmul", "a");
  require(b, "matmul", "b");
  const Shape s = check_matmul(rank_, "matmul", a, b, ta, tb);
  Tensor c = allocate(s, gemm_output(a.dtype()), a.phantom() || b.phantom(), "matmul");
  gemm(c, a, b, ta, tb, "matmul");
  return c;
}

void CudaRank::matmul_into(const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                           bool accumulate) {
  const char* op = accumulate ? "matmul_add_" : "matmul_";
  require(a, op, "a");
  require(b, op, "b");
  require(out, op, "out");
  check_matmul_out(rank_, out, a, b, ta, tb, accumulate);
  gemm(out, a, b, ta, tb, op, accumulate);
}

Tensor CudaRank::relu(const Tensor& x) {
  const void* px = require(x, "relu", "x");
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "relu");
  void* py = require(y, "relu", "out");
  before_kernel({&x}, "relu");
  kernel("relu", [&] { kernels::relu(py, px, x.dtype(), x.numel(), compute_); });
  return y;
}

Tensor CudaRank::relu_backward(const Tensor& grad_out, const Tensor& x) {
  const void* pg = require(grad_out, "relu_backward", "grad_out");
  const void* px = require(x, "relu_backward", "x");
  require_same_shape(grad_out, x, "relu_backward");
  require_same_dtype(grad_out, x, "relu_backward");
  Tensor g = allocate(x.shape(), x.dtype(), x.phantom() || grad_out.phantom(), "relu_backward");
  void* po = require(g, "relu_backward", "out");
  before_kernel({&grad_out, &x}, "relu_backward");
  kernel("relu_backward", [&] { kernels::relu_backward(po, pg, px, x.dtype(), x.numel(), compute_); });
  return g;
}

Tensor CudaRank::add(const Tensor& a, const Tensor& b) {
  const void* pa = require(a, "add", "a");
  const void* pb = require(b, "add", "b");
  require_same_shape(a, b, "add");
  require_same_dtype(a, b, "add");
  Tensor c = allocate(a.shape(), a.dtype(), a.phantom() || b.phantom(), "add");
  void* pc = require(c, "add", "out");
  before_kernel({&a, &b}, "add");
  kernel("add", [&] { kernels::add(pc, pa, pb, a.dtype(), a.numel(), compute_); });
  return c;
}

void CudaRank::add_(const Tensor& dst, const Tensor& src, float alpha) {
  void* pd = require(dst, "add_", "dst");
  const void* ps = require(src, "add_", "src");
  require_same_shape(dst, src, "add_");
  require_same_kind(dst, src, "add_");
  before_kernel({&dst, &src}, "add_");
  kernel("add_", [&] { kernels::axpy(pd, dst.dtype(), ps, src.dtype(), alpha, dst.numel(), compute_); });
}

void CudaRank::scale_(const Tensor& t, float factor) {
  void* p = require(t, "scale_", "t");
  before_kernel({&t}, "scale_");
  kernel("scale_", [&] { kernels::scale(p, t.dtype(), factor, t.numel(), compute_); });
}

void CudaRank::copy_(const Tensor& dst, const Tensor& src) {
  void* pd = require(dst, "copy_", "dst");
  const void* ps = require(src, "copy_", "src");
  if (dst.numel() != src.numel()) {
    throw UsageError(fmt::format("{}: {} and {} differ in size", where("copy_"), dst.str(), src.str()));
  }
  require_same_kind(dst, src, "copy_");
  if (is_float8(dst.dtype()) && src.dtype() != dst.dtype()) {
    throw UsageError(fmt::format("{}: copies {} into {}: quantize scales a tensor into FP8", where("copy_"),
                                 src.str(), dst.str()));
  }
  before_kernel({&dst, &src}, "copy_");
  if (is_float8(dst.dtype())) take_fp8_scales(dst, src, "copy_", /*copy_rows=*/true);
  kernel("copy", [&] {
    if (dst.dtype() != src.dtype()) {
      kernels::convert(pd, dst.dtype(), ps, src.dtype(), dst.numel(), compute_);
    } else if (pd && pd != ps) {
      RANKLAB_CUDA(
          cudaMemcpyAsync(pd, ps, static_cast<size_t>(dst.bytes()), cudaMemcpyDeviceToDevice, compute_));
    }
  });
}

Tensor CudaRank::cast(const Tensor& t, DType dtype) {
  const void* p = require(t, "cast", "t");
  if (is_float8(dtype)) {
    throw UsageError(fmt::format("{}: cast makes no {} tensor: quantize scales a tensor into FP8",
                                 where("cast"), dtype_name(dtype)));
  }
  Tensor out = allocate(t.shape(), dtype, t.phantom(), "cast");
  void* po = require(out, "cast", "out");
  before_kernel({&t}, "cast");
  kernel("cast", [&] {
    if (dtype != t.dtype()) {
      kernels::convert(po, dtype, p, t.dtype(), t.numel(), compute_);
    } else if (po) {
      RANKLAB_CUDA(
          cudaMemcpyAsync(po, p, static_cast<size_t>(t.bytes()), cudaMemcpyDeviceToDevice, compute_));
    }
  });
  return out;
}

// Context parallelism's attention blocks (kernels.cu): the block's attention and its merge into the running
// out and lse in one kernel, its backward in two (each query's d q, then each key's d k and d v).
Tensor CudaRank::key_values(const Tensor& qkv, const AttentionSpec& spec) {
  const char* op = "key_values";
  void* pq = require(qkv, op, "qkv");
  const kernels::AttentionShape a = attention_shape(qkv, spec, op);
  Tensor kv = allocate(Shape{qkv.size(0), 2 * spec.groups() * a.head_dim}, qkv.dtype(), qkv.phantom(), op);
  void* pk = require(kv, op, "kv");
  before_kernel({&qkv}, op);
  kernel(op, [&] { kernels::key_values(pq, pk, qkv.dtype(), a, false, compute_); });
  return kv;
}

void CudaRank::add_key_values_(const Tensor& dqkv, const Tensor& dkv, const AttentionSpec& spec) {
  const char* op = "add_key_values_";
  void* pq = require(dqkv, op, "dqkv");
  void* pk = require(dkv, op, "dkv");
  check_key_values(rank_, op, dqkv, dkv, spec);
  require_shape(dkv, Shape{dqkv.size(0), dkv.size(1)}, op, "dkv", "a row per row of dqkv");
  require_same_kind(dqkv, dkv, op);
  const kernels::AttentionShape a = attention_shape(dqkv, spec, op);
  before_kernel({&dqkv, &dkv}, op);
  kernel(op, [&] { kernels::key_values(pq, pk, dqkv.dtype(), a, true, compute_); });
}

kernels::AttentionBlockShape CudaRank::block_shape(const Tensor& qkv, const Tensor& kv, const Tensor& out,
                                                   const Tensor& lse, const AttentionSpec& spec,
                                                   const AttentionBlock& block, const char* op) const {
  const BlockRange range = check_attention_block(rank_, op, qkv, kv, out, lse, spec, block);
  kernels::AttentionBlockShape k;
  k.a = attention_shape(qkv, spec, op);
  k.kv_seq = kv.size(0) / spec.batch;
  k.q_first = range.first;
  k.q_end = range.end;
  k.q_position = block.q_position;
  k.kv_position = block.kv_position;
  k.causal = block.causal;
  return k;
}

void CudaRank::attention_block_(AttentionOut& acc, const Tensor& qkv, const Tensor& kv,
                                const AttentionSpec& spec, const AttentionBlock& block) {
  const char* op = "attention_block_";
  const void* pq = require(qkv, op, "qkv");
  const void* pk = require(kv, op, "kv");
  void* po = require(acc.out, op, "out");
  float* pl = require_f32(acc.lse, op, "lse");
  const kernels::AttentionBlockShape k = block_shape(qkv, kv, acc.out, acc.lse, spec, block, op);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&kv, &acc.out, &acc.lse})
    require_same_kind(qkv, *t, op);
  before_kernel({&qkv, &kv, &acc.out, &acc.lse}, op);
  kernel(op, [&] { kernels::attention_block(po, acc.out.dtype(), pl, pq, pk, qkv.dtype(), k, compute_); });
}

void CudaRank::attention_block_backward_(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout,
                                         const Tensor& qkv, const Tensor& kv, const Tensor& out,
                                         const Tensor& lse, const AttentionSpec& spec,
                                         const AttentionBlock& block) {
  const char* op = "attention_block_backward_";
  void* pdq = require(dqkv, op, "dqkv");
  void* pdk = require(dkv, op, "dkv");
  const void* pdo = require(dout, op, "dout");
  const void* pq = require(qkv, op, "qkv");
  const void* pk = require(kv, op, "kv");
  const void* po = require(out, op, "out");
  const float* pl = require_f32(lse, op, "lse");
  const kernels::AttentionBlockShape k = block_shape(qkv, kv, out, lse, spec, block, op);
  require_shape(dqkv, qkv.shape(), op, "dqkv", "qkv's");
  require_shape(dkv, kv.shape(), op, "dkv", "kv's");
  require_shape(dout, out.shape(), op, "dout", "out's");
  // One kernel template per pair of dtypes: the gradients are their operands', dout is out's.
  if (dqkv.dtype() != qkv.dtype() || dkv.dtype() != kv.dtype() || dout.dtype() != out.dtype()) {
    throw UsageError(
        fmt::format("{}: dqkv, dkv and dout must have the dtypes of qkv, kv and out; got {}, {}, {} "
                    "for {}, {}, {}",
                    where(op), dqkv.str(), dkv.str(), dout.str(), qkv.str(), kv.str(), out.str()));
  }
  for (const Tensor* t : {&dqkv, &dkv, &dout, &kv, &out, &lse}) require_same_kind(qkv, *t, op);
  // Each query's dout . out, which both kernels read: scratch, freed in stream order after them.
  Tensor delta =
      allocate(Shape{spec.batch, spec.heads, k.q_end - k.q_first}, DType::Float32, qkv.phantom(), op);
  float* pdelta = require_f32(delta, op, "delta");
  before_kernel({&dqkv, &dkv, &dout, &qkv, &kv, &out, &lse}, op);
  kernel(op, [&] {
    kernels::attention_block_backward(pdq, pdk, pdelta, pdo, pq, pk, po, out.dtype(), pl, qkv.dtype(), k,
                                      compute_);
  });
}

// Attention sinks merged after the attention (context parallelism's blocks take none), and their gradient:
// one kernel each (kernels.cu).
void CudaRank::attention_sinks_(AttentionOut& acc, const AttentionSpec& spec) {
  const char* op = "attention_sinks_";
  void* po = require(acc.out, op, "out");
  require(acc.lse, op, "lse");
  check_attention_sinks(rank_, op, acc.out, acc.lse, spec);
  float* pl = require_f32(acc.lse, op, "lse");
  const void* ps = require(spec.sinks, op, "sinks");
  require_same_kind(acc.out, acc.lse, op);
  require_same_kind(acc.out, spec.sinks, op);
  before_kernel({&acc.out, &acc.lse, &spec.sinks}, op);
  const std::int64_t seq = acc.lse.size(2), head_dim = acc.out.size(1) / spec.heads;
  kernel(op, [&] {
    kernels::attention_sinks(po, acc.out.dtype(), pl, ps, spec.sinks.dtype(), seq, spec.batch, spec.heads,
                             head_dim, compute_);
  });
}

Tensor CudaRank::attention_sinks_backward(const Tensor& dout, const Tensor& out, const Tensor& lse,
                                          const AttentionSpec& spec) {
  const char* op = "attention_sinks_backward";
  const void* pdo = require(dout, op, "dout");
  const void* po = require(out, op, "out");
  require(lse, op, "lse");
  check_attention_sinks(rank_, op, out, lse, spec);
  const float* pl = require_f32(lse, op, "lse");
  const void* ps = require(spec.sinks, op, "sinks");
  require_shape(dout, out.shape(), op, "dout", "out's");
  // One kernel template per dtype: dout is out's, as in the blocks' backward.
  require_same_dtype(out, dout, op);
  for (const Tensor* t : {&dout, &lse, &spec.sinks}) require_same_kind(out, *t, op);
  const std::int64_t seq = lse.size(2), head_dim = out.size(1) / spec.heads;
  Tensor dsinks = allocate(Shape{spec.heads}, DType::Float32, out.phantom(), op);
  float* pds = require_f32(dsinks, op, "dsinks");
  before_kernel({&dout, &out, &lse, &spec.sinks}, op);
  kernel(op, [&] {
    kernels::attention_sinks_backward(pds, pdo, po, out.dtype(), pl, ps, spec.sinks.dtype(), seq, spec.batch,
                                      spec.heads, head_dim, compute_);
  });
  return dsinks;
}

Tensor CudaRank::sum(const Tensor& t) {
  const void* p = require(t, "sum", "t");
  Tensor out = allocate(Shape{}, t.dtype(), t.phantom(), "sum");
  void* po = require(out, "sum", "out");
  before_kernel({&t}, "sum");
  // Accumulated in double, like the simulator, so results agree to float rounding.
  kernel("sum", [&] { kernels::sum(po, p, t.dtype(), t.numel(), sum_scratch_, compute_); });
  return out;
}

Tensor CudaRank::squared_norm(const std::vector<Tensor>& ts) {
  bool phantom = false;
  std::vector<std::pair<const void*, std::int64_t>> parts;
  for (const Tensor& t : ts) {
    parts.emplace_back(require(t, "squared_norm", "ts[i]"), t.numel());
    phantom = phantom || t.phantom();
  }
  Tensor out = allocate(Shape{}, DType::Float32, phantom, "squared_norm");
  float* po = require_f32(out, "squared_norm", "out");
  for (const Tensor& t : ts) before_kernel({&t}, "squared_norm");
  // Accumulated in double, like the simulator.
  kernel("squared_norm", [&] {
    kernels::squared_norm_begin(sum_scratch_, compute_);
    for (std::size_t i = 0; i < ts.size(); ++i) {
      kernels::squared_norm_add(sum_scratch_, parts[i].first, ts[i].dtype(), parts[i].second, compute_);
    }
    kernels::squared_norm_end(po, sum_scratch_, compute_);
  });
  return out;
}

Tensor CudaRank::slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) {
  const void* p = require(t, "slice", "t");
  if (dim < 0 || dim >= t.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("slice"), dim, t.str()));
  }
  if (start < 0 || length < 0 || start > t.size(dim) - length) {  // no overflow near INT64_MAX
    throw UsageError(fmt::format("{}: {} elements from {} are outside dimension {} of {} (size {})",
                                 where("slice"), length, start, dim, t.str(), t.size(dim)));
  }
  Tensor out = allocate(t.shape().with_dim(dim, length), t.dtype(), t.phantom(), "slice");
  void* po = require(out, "slice", "out");
  before_kernel({&t}, "slice");
  const Layout l = layout_along(t.shape(), dim);
  const auto elem = static_cast<size_t>(dtype_bytes(t.dtype()));
  const size_t row_bytes = static_cast<size_t>(length * l.inner) * elem;
  kernel("slice", [&] {
    if (out.numel() == 0) return;
    const char* src = static_cast<const char*>(p) + static_cast<size_t>(start * l.inner) * elem;
    if (l.outer == 1) {
      RANKLAB_CUDA(cudaMemcpyAsync(po, src, row_bytes, cudaMemcpyDeviceToDevice, compute_));
    } else {
      // One strided copy: `outer` rows of `length * inner` elements, `size * inner` apart in the source.
      RANKLAB_CUDA(cudaMemcpy2DAsync(po, row_bytes, src, static_cast<size_t>(l.size * l.inner) * elem,
                                     row_bytes, static_cast<size_t>(l.outer), cudaMemcpyDeviceToDevice,
                                     compute_));
    }
  });
  return out;
}

Tensor CudaRank::cat(const std::vector<Tensor>& parts, int dim) {
  if (parts.empty()) throw UsageError(fmt::format("{}: nothing to concatenate", where("cat")));
  const Tensor& first = parts[0];
  require(first, "cat", "parts[0]");
  if (dim < 0 || dim >= first.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("cat"), dim, first.str()));
  }
  std::vector<const char*> ptrs;
  std::int64_t total = 0;
  bool phantom = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    ptrs.push_back(static_cast<const char*>(require(parts[i], "cat", "parts[i]")));
    if (parts[i].shape().with_dim(dim, 0) != first.shape().with_dim(dim, 0)) {
      throw UsageError(
          fmt::format("{}: parts[{}] is {} but parts[0] is {}; they may differ only in dimension {}",
                      where("cat"), i, parts[i].str(), first.str(), dim));
    }
    if (parts[i].dtype() != first.dtype()) {
      throw UsageError(fmt::format("{}: parts[{}] is {} but parts[0] is {}; they must share a dtype",
                                   where("cat"), i, parts[i].str(), first.str()));
    }
    total += parts[i].size(dim);
    phantom = phantom || parts[i].phantom();
  }
  Tensor out = allocate(first.shape().with_dim(dim, total), first.dtype(), phantom, "cat");
  char* po = static_cast<char*>(require(out, "cat", "out"));
  for (const Tensor& part : parts) before_kernel({&part}, "cat");
  const Layout lo = layout_along(out.shape(), dim);
  const auto elem = static_cast<size_t>(dtype_bytes(first.dtype()));
  kernel("cat", [&] {
    std::int64_t offset = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::int64_t len = parts[i].size(dim);
      const size_t row_bytes = static_cast<size_t>(len * lo.inner) * elem;
      if (row_bytes > 0 && lo.outer > 0) {
        char* dst = po + static_cast<size_t>(offset * lo.inner) * elem;
        if (lo.outer == 1) {
          RANKLAB_CUDA(cudaMemcpyAsync(dst, ptrs[i], row_bytes, cudaMemcpyDeviceToDevice, compute_));
        } else {
          RANKLAB_CUDA(cudaMemcpy2DAsync(dst, static_cast<size_t>(total * lo.inner) * elem, ptrs[i],
                                         row_bytes, row_bytes, static_cast<size_t>(lo.outer),
                                         cudaMemcpyDeviceToDevice, compute_));
        }
      }
      offset += len;
    }
  });
  return out;
}

void CudaRank::sgd_step(const Tensor& param, const Tensor& grad, float lr) {
  void* pp = require(param, "sgd_step", "param");
  const void* pg = require(grad, "sgd_step", "grad");
  require_same_shape(param, grad, "sgd_step");
  require_same_kind(param, grad, "sgd_step");
  before_kernel({&param, &grad}, "sgd_step");
  kernel("sgd_step",
         [&] { kernels::sgd_step(pp, param.dtype(), pg, grad.dtype(), lr, param.numel(), compute_); });
}

void CudaRank::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          const AdamW& h, int step) {
  // Mixed precision keeps the optimizer in float32 (common/rank.h).
  float* pp = require_f32(param, "adamw_step", "param");
  const float* pg = require_f32(grad, "adamw_step", "grad");
  float* pm = require_f32(m, "adamw_step", "m");
  float* pv = require_f32(v, "adamw_step", "v");
  require_same_shape(param, grad, "adamw_step");
  require_same_shape(param, m, "adamw_step");
  require_same_shape(param, v, "adamw_step");
  require_same_kind(param, grad, "adamw_step");
  if (step < 1) throw UsageError(fmt::format("{}: step counts from 1; got {}", where("adamw_step"), step));
  before_kernel({&param, &grad, &m, &v}, "adamw_step");
  // The bias corrections in float, computed as the simulator computes them.
  const float c1 = 1 - std::pow(h.beta1, static_cast<float>(step));
  const float c2 = 1 - std::pow(h.beta2, static_cast<float>(step));
  kernel("adamw_step", [&] {
    kernels::adamw_step(pp, pg, pm, pv, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, c1, c2, param.numel(),
                        compute_);
  });
}

void CudaRank::fused_adamw_step(const std::vector<AdamWPart>& parts, const AdamW& h, int step) {
  for (const AdamWPart& part : parts) {
    AdamW hp = h;
    if (!part.decay) hp.weight_decay = 0;
    adamw_step(part.param, part.grad, part.m, part.v, hp, step);
  }
}

// ---- transformer kernels -------------------------------------------------------------------------------

void CudaRank::add_bias_(const Tensor& x, const Tensor& bias) {
  const char* op = "add_bias_";
  void* px = require(x, op, "x");
  const void* pb = require(bias, op, "bias");
  require_ndim(x, 2, op, "x");
  require_shape(bias, Shape{x.size(1)}, op, "bias", "the columns of x");
  require_same_dtype(x, bias, op);
  require_same_kind(x, bias, op);
  before_kernel({&x, &bias}, op);
  kernel(op, [&] { kernels::add_bias(px, pb, x.dtype(), x.size(0), x.size(1), compute_); });
}

Tensor CudaRank::sum_rows(const Tensor& x) {
  const char* op = "sum_rows";
  const void* px = require(x, op, "x");
  require_ndim(x, 2, op, "x");
  Tensor out = allocate(Shape{x.size(1)}, DType::Float32, x.phantom(), op);
  float* po = require_f32(out, op, "out");
  before_kernel({&x}, op);
  kernel(op, [&] { kernels::sum_rows(po, px, x.dtype(), x.size(0), x.size(1), compute_); });
  return out;
}

Rank::LayerNormOut CudaRank::layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
  const char* op = "layernorm";
  const void* px = require(x, op, "x");
  const void* pg = require(gamma, op, "gamma");
  const void* pb = require(beta, op, "beta");
  check_layernorm(rank_, x, gamma, beta, eps);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = x.phantom() || gamma.phantom() || beta.phantom();
  LayerNormOut out{allocate(x.shape(), x.dtype(), ph, op), allocate(Shape{rows}, DType::Float32, ph, op),
                   allocate(Shape{rows}, DType::Float32, ph, op)};
  void* py = require(out.y, op, "y");
  float* pm = require_f32(out.mean, op, "mean");
  float* pr = require_f32(out.rstd, op, "rstd");
  before_kernel({&x, &gamma, &beta}, op);
  kernel(op, [&] {
    kernels::layernorm(py, pm, pr, px, x.dtype(), pg, pb, gamma.dtype(), rows, cols, eps, compute_);
  });
  return out;
}

Rank::LayerNormGrads CudaRank::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                  const Tensor& mean, const Tensor& rstd) {
  const char* op = "layernorm_backward";
  const void* pdy = require(dy, op, "dy");
  const void* px = require(x, op, "x");
  const void* pg = require(gamma, op, "gamma");
  const float* pm = require_f32(mean, op, "mean");
  const float* pr = require_f32(rstd, op, "rstd");
  check_layernorm_backward(rank_, dy, x, gamma, mean, rstd);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = dy.phantom() || x.phantom() || gamma.phantom() || mean.phantom() || rstd.phantom();
  LayerNormGrads g{allocate(x.shape(), x.dtype(), ph, op), allocate(Shape{cols}, DType::Float32, ph, op),
                   allocate(Shape{cols}, DType::Float32, ph, op)};
  void* pdx = require(g.dx, op, "dx");
  float* pdg = require_f32(g.dgamma, op, "dgamma");
  float* pdb = require_f32(g.dbeta, op, "dbeta");
  before_kernel({&dy, &x, &gamma, &mean, &rstd}, op);
  kernel(op, [&] {
    kernels::layernorm_backward(pdx, pdg, pdb, pdy, px, x.dtype(), pg, gamma.dtype(), pm, pr, rows, cols,
                                compute_);
  });
  return g;
}

Tensor CudaRank::gelu(const Tensor& x) {
  const void* px = require(x, "gelu", "x");
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), "gelu");
  void* py = require(y, "gelu", "out");
  before_kernel({&x}, "gelu");
  kernel("gelu", [&] { kernels::gelu(py, px, x.dtype(), x.numel(), compute_); });
  return y;
}

Tensor CudaRank::gelu_backward(const Tensor& dy, const Tensor& x) {
  const char* op = "gelu_backward";
  const void* pdy = require(dy, op, "dy");
  const void* px = require(x, op, "x");
  check_gelu_backward(rank_, dy, x);
  Tensor dx = allocate(x.shape(), x.dtype(), x.phantom() || dy.phantom(), op);
  void* pdx = require(dx, op, "out");
  before_kernel({&dy, &x}, op);
  kernel(op, [&] { kernels::gelu_backward(pdx, pdy, px, x.dtype(), x.numel(), compute_); });
  return dx;
}

Tensor CudaRank::dropout(const Tensor& x, float p, std::uint64_t seed, const DropoutRows& rows) {
  const char* op = "dropout";
  const void* px = require(x, op, "x");
  check_dropout(rank_, x, p, rows);
  Tensor y = allocate(x.shape(), x.dtype(), x.phantom(), op);
  void* py = require(y, op, "out");
  before_kernel({&x}, op);
  kernel(op, [&] {
    kernels::dropout(py, px, x.dtype(), x.size(0), x.size(1), p, seed, rows.first_row, rows.split,
                     rows.second_row, compute_);
  });
  return y;
}

kernels::AttentionShape CudaRank::attention_shape(const Tensor& qkv, const AttentionSpec& spec,
                                                  const char* op) const {
  const AttentionDims dims = check_attention(rank_, op, qkv, spec);
  kernels::AttentionShape a;
  a.batch = spec.batch;
  a.seq = dims.seq;
  a.heads = spec.heads;
  a.kv_heads = spec.groups();
  a.causal = spec.causal;
  a.window = spec.window;  // check_attention allows one with causal attention only
  const std::int64_t head_dim = dims.head_dim;
  if (head_dim > kernels::kMaxHeadDim) {
    throw UsageError(
        fmt::format("{}: head_dim {} (from qkv {} and {} heads) is more than the {} the kernel takes",
                    where(op), head_dim, qkv.str(), spec.heads, kernels::kMaxHeadDim));
  }
  a.head_dim = static_cast<int>(head_dim);
  return a;
}

// The GPU runs its own fused kernel whichever `kernel` is asked for; the unfused path's probabilities are
// allocated, so that its memory is what that path keeps.
Rank::AttentionOut CudaRank::attention(const Tensor& qkv, const AttentionSpec& spec) {
  const char* op = "attention";
  const void* pq = require(qkv, op, "qkv");
  const kernels::AttentionShape a = attention_shape(qkv, spec, op);
  const std::int64_t batch = spec.batch, heads = spec.heads;
  AttentionOut out{allocate(Shape{qkv.size(0), heads * a.head_dim}, qkv.dtype(), qkv.phantom(), op),
                   allocate(Shape{batch, heads, a.seq}, DType::Float32, qkv.phantom(), op)};
  void* po = require(out.out, op, "out");
  float* pl = require_f32(out.lse, op, "lse");
  // The sinks (checked by attention_shape) are read in the kernel, in whatever float dtype they have.
  const bool sinks = spec.sinks.defined();
  const void* ps = sinks ? require(spec.sinks, op, "sinks") : nullptr;
  if (sinks) require_same_kind(qkv, spec.sinks, op);
  before_kernel({&qkv}, op);
  if (sinks) before_kernel({&spec.sinks}, op);
  if (spec.kernel == AttentionKernel::Unfused) {
    out.probs = allocate(Shape{batch * heads, a.seq, a.seq}, qkv.dtype(), /*phantom=*/true, op);
  }
  const DType sinks_t = sinks ? spec.sinks.dtype() : DType::Float32;
  this->kernel(op, [&] { kernels::attention(po, pl, pq, qkv.dtype(), ps, sinks_t, a, compute_); });
  return out;
}

Tensor CudaRank::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                    const Tensor& lse, const AttentionSpec& spec) {
  const char* op = "attention_backward";
  const void* pdo = require(dout, op, "dout");
  const void* pq = require(qkv, op, "qkv");
  const void* po = require(out, op, "out");
  const float* pl = require_f32(lse, op, "lse");
  check_attention_backward(rank_, dout, qkv, out, lse, spec);
  const kernels::AttentionShape a = attention_shape(qkv, spec, op);
  const bool ph = dout.phantom() || qkv.phantom() || out.phantom() || lse.phantom();
  Tensor dqkv = allocate(qkv.shape(), qkv.dtype(), ph, op);
  void* pd = require(dqkv, op, "dqkv");
  // Each query's dout . out, which both backward kernels need: scratch, freed in stream order after them.
  Tensor delta = allocate(Shape{spec.batch, spec.heads, a.seq}, DType::Float32, ph, op);
  float* pdelta = require_f32(delta, op, "delta");
  before_kernel({&dout, &qkv, &out, &lse}, op);
  kernel(op, [&] { kernels::attention_backward(pd, pdelta, pdo, pq, po, pl, qkv.dtype(), a, compute_); });
  return dqkv;
}

void CudaRank::rope_(const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position, double base,
                     bool inverse) {
  const char* op = "rope_";
  void* pq = require(qkv, op, "qkv");
  check_rope(rank_, qkv, spec, first_position, base);
  const kernels::AttentionShape a = attention_shape(qkv, spec, op);
  before_kernel({&qkv}, op);
  kernel(op, [&] { kernels::rope(pq, qkv.dtype(), a, first_position, base, inverse, compute_); });
}

Rank::RmsNormOut CudaRank::rmsnorm(const Tensor& x, const Tensor& gamma, float eps) {
  const char* op = "rmsnorm";
  const void* px = require(x, op, "x");
  const void* pg = require(gamma, op, "gamma");
  check_rmsnorm(rank_, x, gamma, eps);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = x.phantom() || gamma.phantom();
  RmsNormOut out{allocate(x.shape(), x.dtype(), ph, op), allocate(Shape{rows}, DType::Float32, ph, op)};
  void* py = require(out.y, op, "y");
  float* pr = require_f32(out.rstd, op, "rstd");
  before_kernel({&x, &gamma}, op);
  kernel(op, [&] { kernels::rmsnorm(py, pr, px, x.dtype(), pg, rows, cols, eps, compute_); });
  return out;
}

Rank::RmsNormGrads CudaRank::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                              const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  const void* pdy = require(dy, op, "dy");
  const void* px = require(x, op, "x");
  const void* pg = require(gamma, op, "gamma");
  const float* pr = require_f32(rstd, op, "rstd");
  check_rmsnorm_backward(rank_, dy, x, gamma, rstd);
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const bool ph = dy.phantom() || x.phantom() || gamma.phantom() || rstd.phantom();
  RmsNormGrads g{allocate(x.shape(), x.dtype(), ph, op), allocate(Shape{cols}, DType::Float32, ph, op)};
  void* pdx = require(g.dx, op, "dx");
  float* pdg = require_f32(g.dgamma, op, "dgamma");
  before_kernel({&dy, &x, &gamma, &rstd}, op);
  kernel(op, [&] { kernels::rmsnorm_backward(pdx, pdg, pdy, px, x.dtype(), pg, pr, rows, cols, compute_); });
  return g;
}

Tensor CudaRank::swiglu(const Tensor& x, const GluSpec& glu) {
  const char* op = "swiglu";
  const void* px = require(x, op, "x");
  check_swiglu(rank_, x);
  Tensor y = allocate(Shape{x.size(0), x.size(1) / 2}, x.dtype(), x.phantom(), op);
  void* py = require(y, op, "y");
  before_kernel({&x}, op);
  kernel(op, [&] { kernels::swiglu(py, px, x.dtype(), y.numel(), glu, compute_); });
  return y;
}

Tensor CudaRank::swiglu_backward(const Tensor& dy, const Tensor& x, const GluSpec& glu) {
  const char* op = "swiglu_backward";
  const void* pdy = require(dy, op, "dy");
  const void* px = require(x, op, "x");
  check_swiglu_backward(rank_, dy, x);
  Tensor dx = allocate(x.shape(), x.dtype(), x.phantom() || dy.phantom(), op);
  void* pdx = require(dx, op, "dx");
  before_kernel({&dy, &x}, op);
  kernel(op, [&] { kernels::swiglu_backward(pdx, pdy, px, x.dtype(), dy.numel(), glu, compute_); });
  return dx;
}

Tensor CudaRank::embedding(const Tensor& ids, const Tensor& table, std::int64_t vocab_start) {
  const char* op = "embedding";
  const float* pi = require_f32(ids, op, "ids");
  const void* pt = require(table, op, "table");
  check_embedding(rank_, ids, table, vocab_start);
  const std::int64_t rows = ids.size(0), cols = table.size(1);
  Tensor out = allocate(Shape{rows, cols}, table.dtype(), ids.phantom() || table.phantom(), op);
  void* po = require(out, op, "out");
  before_kernel({&ids, &table}, op);
  kernel(op, [&] {
    kernels::embedding(po, pi, pt, table.dtype(), rows, cols, table.size(0), vocab_start, compute_);
  });
  return out;
}

void CudaRank::embedding_backward_(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                                   std::int64_t vocab_start) {
  const char* op = "embedding_backward_";
  float* pt = require_f32(dtable, op, "dtable");
  const void* pdy = require(dy, op, "dy");
  const float* pi = require_f32(ids, op, "ids");
  check_embedding_backward(rank_, dtable, dy, ids, vocab_start);
  require_same_kind(dtable, dy, op);
  require_same_kind(dtable, ids, op);
  before_kernel({&dtable, &dy, &ids}, op);
  kernel(op, [&] {
    kernels::embedding_backward(pt, pdy, dy.dtype(), pi, ids.size(0), dtable.size(1), dtable.size(0),
                                vocab_start, compute_);
  });
}

// ---- mixture-of-experts permutation -------------------------------------------------------------------

Tensor CudaRank::gather_rows(const Tensor& x, const Tensor& index, const Tensor& weights) {
  const char* op = "gather_rows";
  const void* px = require(x, op, "x");
  const void* pi = require(index, op, "index");
  const void* pw = weights.defined() ? require(weights, op, "weights") : nullptr;
  check_gather_rows(rank_, x, index, weights);
  const std::int64_t n = index.size(0), cols = x.size(1);
  const bool ph = x.phantom() || index.phantom() || (weights.defined() && weights.phantom());
  Tensor out = allocate(Shape{n, cols}, x.dtype(), ph, op);
  void* po = require(out, op, "out");
  if (weights.defined()) {
    before_kernel({&x, &index, &weights}, op);
  } else {
    before_kernel({&x, &index}, op);
  }
  kernel(op, [&] {
    kernels::gather_rows(po, px, x.dtype(), static_cast<const float*>(pi), static_cast<const float*>(pw), n,
                         x.size(0), cols, compute_);
  });
  return out;
}

Tensor CudaRank::scatter_add_rows(const Tensor& src, const Tensor& index, const Tensor& weights,
                                  std::int64_t rows) {
  const char* op = "scatter_add_rows";
  const void* ps = require(src, op, "src");
  const void* pi = require(index, op, "index");
  const void* pw = weights.defined() ? require(weights, op, "weights") : nullptr;
  check_scatter_add_rows(rank_, src, index, weights, rows);
  const std::int64_t n = index.size(0), cols = src.size(1);
  const bool ph = src.phantom() || index.phantom() || (weights.defined() && weights.phantom());
  Tensor out = allocate(Shape{rows, cols}, src.dtype(), ph, op);
  void* po = require(out, op, "out");
  if (weights.defined()) {
    before_kernel({&src, &index, &weights}, op);
  } else {
    before_kernel({&src, &index}, op);
  }
  if (n == 0) {  // no routes: zeros, and no need to read the index
    kernel(op, [&] {
      if (po) RANKLAB_CUDA(cudaMemsetAsync(po, 0, static_cast<size_t>(out.bytes()), compute_));
    });
    return out;
  }
  // The routes grouped by output row, built on the host from the index: each output element then adds its
  // row's routes in order, with no atomics, so the sums are the same on every run and the simulator's.
  // Reading the index waits for the device, as Megatron-Core's permutation also does: it reads the tokens
  // per expert on the host (tokens_per_expert.cpu(), the all_to_all's splits) before it permutes.
  std::vector<float> host(static_cast<size_t>(n));
  RANKLAB_CUDA(cudaEventRecord(sync_compute_, compute_));
  watchdog_.wait_event(sync_compute_, op);
  RANKLAB_CUDA(
      cudaMemcpyAsync(host.data(), pi, host.size() * sizeof(float), cudaMemcpyDeviceToHost, compute_));
  RANKLAB_CUDA(cudaStreamSynchronize(compute_));
  // A phantom index holds whatever the memory held: its routes out of range are left out, not refused.
  std::vector<std::int64_t> target(static_cast<size_t>(n), -1);
  if (ph) {
    for (std::int64_t i = 0; i < n; ++i) {
      const float v = host[static_cast<size_t>(i)];
      if (v >= 0.0f && static_cast<double>(v) < static_cast<double>(rows)) {
        target[static_cast<size_t>(i)] = static_cast<std::int64_t>(v);
      }
    }
  } else {
    target = check_route_rows(rank_, op, host.data(), n, rows, "the rows of the output");
  }
  // [rows + 1 offsets, then the routes in order of output row and, within one, of i].
  std::vector<std::int64_t> csr(static_cast<size_t>(rows + 1 + n), 0);
  for (std::int64_t t : target) {
    if (t >= 0) ++csr[static_cast<size_t>(t + 1)];
  }
  for (std::int64_t r = 0; r < rows; ++r) csr[static_cast<size_t>(r + 1)] += csr[static_cast<size_t>(r)];
  std::vector<std::int64_t> next(csr.begin(), csr.begin() + rows);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = target[static_cast<size_t>(i)];
    if (t >= 0) csr[static_cast<size_t>(rows + 1 + next[static_cast<size_t>(t)]++)] = i;
  }
  // Scratch for the CSR (int64 words in a float32 tensor's bytes), freed in stream order after the kernel.
  Tensor scratch = allocate(Shape{2 * static_cast<std::int64_t>(csr.size())}, DType::Float32, false, op);
  auto* pc = static_cast<std::int64_t*>(require(scratch, op, "scratch"));
  // From pageable memory CUDA stages the bytes before returning, so `csr` may go away after this.
  RANKLAB_CUDA(
      cudaMemcpyAsync(pc, csr.data(), csr.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice, compute_));
  kernel(op, [&] {
    kernels::scatter_add_rows(po, ps, src.dtype(), pc, pc + rows + 1, static_cast<const float*>(pw), rows,
                              cols, compute_);
  });
  return out;
}

Tensor CudaRank::row_dots(const Tensor& a, const Tensor& b) {
  const char* op = "row_dots";
  const void* pa = require(a, op, "a");
  const void* pb = require(b, op, "b");
  check_row_dots(rank_, a, b);
  Tensor out = allocate(Shape{a.size(0)}, DType::Float32, a.phantom() || b.phantom(), op);
  float* po = require_f32(out, op, "out");
  before_kernel({&a, &b}, op);
  kernel(op, [&] { kernels::row_dots(po, pa, pb, a.dtype(), a.size(0), a.size(1), compute_); });
  return out;
}

Tensor CudaRank::row_max(const Tensor& logits) {
  const char* op = "row_max";
  const void* pl = require(logits, op, "logits");
  check_row_max(rank_, logits);
  Tensor out = allocate(Shape{logits.size(0)}, DType::Float32, logits.phantom(), op);
  float* po = require_f32(out, op, "out");
  before_kernel({&logits}, op);
  kernel(op, [&] { kernels::row_max(po, pl, logits.dtype(), logits.size(0), logits.size(1), compute_); });
  return out;
}

Tensor CudaRank::softmax_stats(const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                               std::int64_t vocab_start) {
  const char* op = "softmax_stats";
  const void* pl = require(logits, op, "logits");
  const float* pm = require_f32(row_max, op, "row_max");
  const float* pt = require_f32(targets, op, "targets");
  check_softmax_stats(rank_, logits, row_max, targets, vocab_start);
  const std::int64_t rows = logits.size(0);
  Tensor out = allocate(Shape{rows, 2}, DType::Float32,
                        logits.phantom() || row_max.phantom() || targets.phantom(), op);
  float* po = require_f32(out, op, "out");
  before_kernel({&logits, &row_max, &targets}, op);
  kernel(op, [&] {
    kernels::softmax_stats(po, pl, logits.dtype(), pm, pt, rows, logits.size(1), vocab_start, compute_);
  });
  return out;
}

Tensor CudaRank::cross_entropy_loss(const Tensor& row_max, const Tensor& stats) {
  const char* op = "cross_entropy_loss";
  const float* pm = require_f32(row_max, op, "row_max");
  const float* ps = require_f32(stats, op, "stats");
  check_cross_entropy_loss(rank_, row_max, stats);
  Tensor out = allocate(Shape{}, DType::Float32, row_max.phantom() || stats.phantom(), op);
  float* po = require_f32(out, op, "out");
  before_kernel({&row_max, &stats}, op);
  kernel(op, [&] { kernels::cross_entropy_loss(po, pm, ps, row_max.size(0), compute_); });
  return out;
}

Tensor CudaRank::cross_entropy_backward(const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                        const Tensor& targets, std::int64_t vocab_start, float scale) {
  const char* op = "cross_entropy_backward";
  const void* pl = require(logits, op, "logits");
  const float* pm = require_f32(row_max, op, "row_max");
  const float* ps = require_f32(stats, op, "stats");
  const float* pt = require_f32(targets, op, "targets");
  check_cross_entropy_backward(rank_, logits, row_max, stats, targets, vocab_start);
  const std::int64_t rows = logits.size(0);
  const bool ph = logits.phantom() || row_max.phantom() || stats.phantom() || targets.phantom();
  Tensor out = allocate(logits.shape(), logits.dtype(), ph, op);
  void* po = require(out, op, "out");
  before_kernel({&logits, &row_max, &stats, &targets}, op);
  kernel(op, [&] {
    kernels::cross_entropy_backward(po, pl, logits.dtype(), pm, ps, pt, rows, logits.size(1), vocab_start,
                                    scale, compute_);
  });
  return out;
}

// ---- time ----------------------------------------------------------------------------------------------

void CudaRank::synchronize() {
  watchdog_.check_abort();
  RANKLAB_CUDA(cudaEventRecord(sync_compute_, compute_));
  RANKLAB_CUDA(cudaEventRecord(sync_comm_, comm_));
  watchdog_.wait_event(sync_compute_, "synchronize()");
  watchdog_.wait_event(sync_comm_, "synchronize()");
  // The device is idle: nothing is in flight any more, so no tensor is still in use.
  for (const auto& op : outstanding_) op->waited = true;
  outstanding_.clear();
}

double CudaRank::now() {
  watchdog_.check_abort();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

namespace {

// A lesson's Event on this backend: a timing CUDA event and the rank that recorded it.
class CudaEventState : public EventState {
 public:
  explicit CudaEventState(int rank) : rank(rank), event(/*timing=*/true) {}
  const int rank;
  const CudaEvent event;
};

}  // namespace

Event CudaRank::record_event() {
  watchdog_.check_abort();
  auto state = std::make_shared<CudaEventState>(rank_);
  RANKLAB_CUDA(cudaEventRecord(state->event.get(), compute_));
  return Event(std::move(state));
}

cudaEvent_t CudaRank::own_event(const Event& e, const char* arg, const char* op) const {
  auto* s = dynamic_cast<CudaEventState*>(e.state());
  if (s == nullptr || s->rank != rank_) {
    throw UsageError(fmt::format("{}: '{}' is {}; pass an Event this rank's record_event() returned",
                                 where(op), arg,
                                 e.defined() ? "another rank's or backend's event" : "an undefined event"));
  }
  return s->event.get();
}

double CudaRank::elapsed_us(const Event& start, const Event& end) {
  cudaEvent_t s = own_event(start, "start", "elapsed_us"), e = own_event(end, "end", "elapsed_us");
  // cudaEventSynchronize in effect, through the watchdog, so a stuck collective before `end` becomes an
  // error instead of a hang. Both events: one recorded after `end` would not be complete yet.
  watchdog_.wait_event(e, "elapsed_us");
  watchdog_.wait_event(s, "elapsed_us");
  return elapsed_us_completed(s, e);
}

std::optional<double> CudaRank::elapsed_us_if_ended(const Event& start, const Event& end) {
  cudaEvent_t s = own_event(start, "start", "elapsed_us_if_ended"),
              e = own_event(end, "end", "elapsed_us_if_ended");
  return elapsed_us_if_reached(s, e);
}

// ---- output --------------------------------------------------------------------------------------------

void CudaRank::region_begin(const std::string& name) {
  open_regions_.emplace_back(name, now());
}

void CudaRank::region_end() {
  if (open_regions_.empty()) throw UsageError(where("region_end") + ": no region is open");
  auto [name, start] = std::move(open_regions_.back());
  open_regions_.pop_back();
  log_.regions.push_back(RegionRecord{rank_, std::move(name), start, now()});
}

void CudaRank::print(const std::string& line) {
  if (config_.echo_output) {
    std::lock_guard<std::mutex> lock(stdout_mutex());
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  log_.output.push_back(TimedLine{now(), line});
}

void CudaRank::show(const std::string& label, const Tensor& t) {
  require(t, "show", "t");
  if (!t.phantom()) before_kernel({&t}, "show");
  const std::string mine = t.phantom() ? fmt::format("<{}>", t.str()) : format_values(t.shape(), to_host(t));
  // Out of band: the values travel between hosts, not through NCCL, and nothing is timed.
  const std::vector<std::string> all = host_->gather(mine);
  const std::string pad(label.size(), ' ');
  for (size_t i = 0; i < all.size(); ++i)
    print(fmt::format("{} rank{} = {}", i == 0 ? label : pad, i, all[i]));
}

void CudaRank::check(const std::string& what, bool passed, const std::string& detail) {
  log_.checks.push_back(CheckRecord{rank_, what, passed, detail});
  if (!passed) {
    print(fmt::format("CHECK FAILED on rank {}: {} ({})", rank_, what, detail));
  } else if (rank_ == 0) {
    print(fmt::format("check passed: {}{}{}", what, detail.empty() ? "" : " — ", detail));
  }
}

}  // namespace ranklab
