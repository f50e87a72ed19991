// CudaRank: tensors, kernels, time, memory and output of one GPU rank. Communication is in cuda_comm.cc.
#include "real/cuda_rank.h"

#include <fmt/format.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <tuple>

#include "common/errors.h"
#include "real/cuda_check.h"
#include "real/kernels.h"

namespace ranklab {

namespace {

// One mutex for the whole process: ranks that are threads print whole lines, never interleaved ones.
std::mutex& stdout_mutex() {
  static std::mutex m;
  return m;
}

int as_int(std::int64_t n, const char* what) {
  if (n > INT_MAX) {
    throw UsageError(fmt::format("matmul: {} = {} is beyond what cuBLAS takes (2^31 - 1)", what, n));
  }
  return static_cast<int>(n);
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
  // Non-blocking streams never synchronise with the legacy default stream, which other code may use.
  RANKLAB_CUDA(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  RANKLAB_CUDA(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&issue_, cudaEventDisableTiming));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&sync_compute_, cudaEventDisableTiming));
  RANKLAB_CUDA(cudaEventCreateWithFlags(&sync_comm_, cudaEventDisableTiming));
  RANKLAB_CUBLAS(cublasCreate(&cublas_));
  RANKLAB_CUBLAS(cublasSetStream(cublas_, compute_));
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
  RANKLAB_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&sum_scratch_), sizeof(double) * kernels::kSumBlocks,
                               compute_));
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
  if (cublas_workspace_) cudaFreeAsync(cublas_workspace_, compute_);
  for (cudaEvent_t e : {issue_, sync_compute_, sync_comm_}) {
    if (e) cudaEventDestroy(e);
  }
  if (compute_) cudaStreamDestroy(compute_);
  if (comm_) cudaStreamDestroy(comm_);
  sum_scratch_ = nullptr;
  cublas_workspace_ = nullptr;
  cublas_ = nullptr;
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

float* CudaRank::require(const Tensor& t, const char* op, const char* arg) const {
  watchdog_.check_abort();
  if (!t.defined()) throw UsageError(fmt::format("{}: '{}' is an undefined tensor", where(op), arg));
  auto* s = dynamic_cast<CudaStorage*>(t.storage());
  if (s == nullptr || t.owner_rank() != rank_) {
    throw UsageError(fmt::format("{}: '{}' ({}) belongs to rank {}; a rank can only use tensors it made",
                                 where(op), arg, t.str(), t.owner_rank()));
  }
  return s->data();
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

// An in-place op on a real tensor cannot take its values from a phantom (the simulator's rule; here
// both hold bytes, but a lesson that mixes them is wrong on the simulator).
void CudaRank::require_same_kind(const Tensor& dst, const Tensor& src, const char* op) const {
  if (!dst.phantom() && src.phantom()) {
    throw UsageError(fmt::format("{}: writes phantom {} into real {}; make both phantom or both real",
                                 where(op), src.str(), dst.str()));
  }
}

Tensor CudaRank::allocate(const Shape& s, bool phantom, const char* op) {
  watchdog_.check_abort();
  return Tensor(s, DType::Float32, std::make_shared<CudaStorage>(account_, s, DType::Float32, phantom, op));
}

template <typename Launch>
void CudaRank::kernel(const char* name, Launch&& launch) {
  const int interval = timeline_.begin(compute_);
  launch();
  timeline_.end(interval, compute_);
  if (interval >= 0) kernels_.push_back(TimedKernel{name, interval});
}

// ---- tensors -------------------------------------------------------------------------------------------

// Uninitialised, as cudaMalloc leaves it (the simulator fills NaN; no lesson may read it either way).
Tensor CudaRank::empty(const Shape& s) {
  return allocate(s, false, "empty");
}

Tensor CudaRank::zeros(const Shape& s) {
  Tensor t = allocate(s, false, "zeros");
  float* p = require(t, "zeros", "out");
  kernel("fill", [&] {
    if (p) RANKLAB_CUDA(cudaMemsetAsync(p, 0, static_cast<size_t>(t.bytes()), compute_));
  });
  return t;
}

Tensor CudaRank::full(const Shape& s, float value) {
  Tensor t = allocate(s, false, "full");
  float* p = require(t, "full", "out");
  kernel("fill", [&] { kernels::fill(p, t.numel(), value, compute_); });
  return t;
}

Tensor CudaRank::arange(const Shape& s, float start) {
  Tensor t = allocate(s, false, "arange");
  float* p = require(t, "arange", "out");
  kernel("arange", [&] { kernels::arange(p, t.numel(), start, compute_); });
  return t;
}

Tensor CudaRank::randn(const Shape& s, std::uint64_t seed, float std) {
  Tensor t = allocate(s, false, "randn");
  float* p = require(t, "randn", "out");
  kernel("randn", [&] { kernels::randn(p, t.numel(), seed, std, compute_); });
  return t;
}

Tensor CudaRank::from_host(const Shape& s, const std::vector<float>& values) {
  if (static_cast<std::int64_t>(values.size()) != s.numel()) {
    throw UsageError(fmt::format("{}: {} values do not fill shape {} ({} elements)", where("from_host"),
                                 values.size(), s.str(), s.numel()));
  }
  Tensor t = allocate(s, false, "from_host");
  float* p = require(t, "from_host", "out");
  // From pageable memory CUDA stages the values before returning, so `values` may go away after this.
  kernel("copy_h2d", [&] {
    if (p) {
      RANKLAB_CUDA(cudaMemcpyAsync(p, values.data(), static_cast<size_t>(t.bytes()), cudaMemcpyHostToDevice,
                                   compute_));
    }
  });
  return t;
}

// A phantom tensor is a simulator idea (a shape without bytes). Here it is real, uninitialised device
// memory, so a lesson's phantom mode runs and is timed for real, and fails with OutOfMemoryError where
// the GPU cannot hold it.
Tensor CudaRank::phantom(const Shape& s) {
  return allocate(s, true, "phantom");
}

std::vector<float> CudaRank::to_host(const Tensor& t) {
  float* p = require(t, "to_host", "t");
  if (t.phantom()) {
    throw UsageError(fmt::format("{}: {} has a shape but no values (phantom tensors only advance time)",
                                 where("to_host"), t.str()));
  }
  before_kernel({&t}, "to_host");
  std::vector<float> values(static_cast<size_t>(t.numel()));
  // Wait through the watchdog first, so a stuck collective upstream becomes an error, not a hang.
  RANKLAB_CUDA(cudaEventRecord(sync_compute_, compute_));
  watchdog_.wait_event(sync_compute_, "to_host");
  if (p) {
    RANKLAB_CUDA(
        cudaMemcpyAsync(values.data(), p, static_cast<size_t>(t.bytes()), cudaMemcpyDeviceToHost, compute_));
    RANKLAB_CUDA(cudaStreamSynchronize(compute_));
  }
  return values;
}

// ---- compute -------------------------------------------------------------------------------------------

Tensor CudaRank::matmul(const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
  const float* pa = require(a, "matmul", "a");
  const float* pb = require(b, "matmul", "b");
  if (a.ndim() != 2 || b.ndim() != 2) {
    throw UsageError(fmt::format("{}: needs 2-D tensors; got {} and {}", where("matmul"), a.str(), b.str()));
  }
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = at ? a.size(1) : a.size(0), k = at ? a.size(0) : a.size(1);
  const std::int64_t kb = bt ? b.size(1) : b.size(0), n = bt ? b.size(0) : b.size(1);
  if (k != kb) {
    throw UsageError(fmt::format("{}: inner dimensions differ: {}{} @ {}{} ({} vs {})", where("matmul"),
                                 a.str(), at ? ".T" : "", b.str(), bt ? ".T" : "", k, kb));
  }
  Tensor c = allocate(Shape{m, n}, a.phantom() || b.phantom(), "matmul");
  float* pc = require(c, "matmul", "out");
  before_kernel({&a, &b}, "matmul");
  if (m == 0 || n == 0) return c;
  kernel("matmul", [&] {
    if (k == 0) {
      RANKLAB_CUDA(cudaMemsetAsync(pc, 0, static_cast<size_t>(c.bytes()), compute_));
      return;
    }
    // cuBLAS is column-major and ours are row-major: a row-major X is a column-major X^T, so compute
    // C^T = op(B)^T op(A)^T, which cuBLAS sees as op(B) times op(A) on the same buffers.
    const float one = 1.0f, zero = 0.0f;
    RANKLAB_CUBLAS(cublasSgemm(
        cublas_, bt ? CUBLAS_OP_T : CUBLAS_OP_N, at ? CUBLAS_OP_T : CUBLAS_OP_N, as_int(n, "n"),
        as_int(m, "m"), as_int(k, "k"), &one, pb, as_int(std::max<std::int64_t>(1, b.size(1)), "ldb"), pa,
        as_int(std::max<std::int64_t>(1, a.size(1)), "lda"), &zero, pc, as_int(n, "ldc")));
  });
  return c;
}

Tensor CudaRank::relu(const Tensor& x) {
  const float* px = require(x, "relu", "x");
  Tensor y = allocate(x.shape(), x.phantom(), "relu");
  float* py = require(y, "relu", "out");
  before_kernel({&x}, "relu");
  kernel("relu", [&] { kernels::relu(py, px, x.numel(), compute_); });
  return y;
}

Tensor CudaRank::relu_backward(const Tensor& grad_out, const Tensor& x) {
  const float* pg = require(grad_out, "relu_backward", "grad_out");
  const float* px = require(x, "relu_backward", "x");
  require_same_shape(grad_out, x, "relu_backward");
  Tensor g = allocate(x.shape(), x.phantom() || grad_out.phantom(), "relu_backward");
  float* po = require(g, "relu_backward", "out");
  before_kernel({&grad_out, &x}, "relu_backward");
  kernel("relu_backward", [&] { kernels::relu_backward(po, pg, px, x.numel(), compute_); });
  return g;
}

Tensor CudaRank::add(const Tensor& a, const Tensor& b) {
  const float* pa = require(a, "add", "a");
  const float* pb = require(b, "add", "b");
  require_same_shape(a, b, "add");
  Tensor c = allocate(a.shape(), a.phantom() || b.phantom(), "add");
  float* pc = require(c, "add", "out");
  before_kernel({&a, &b}, "add");
  kernel("add", [&] { kernels::add(pc, pa, pb, a.numel(), compute_); });
  return c;
}

void CudaRank::add_(const Tensor& dst, const Tensor& src, float alpha) {
  float* pd = require(dst, "add_", "dst");
  const float* ps = require(src, "add_", "src");
  require_same_shape(dst, src, "add_");
  require_same_kind(dst, src, "add_");
  before_kernel({&dst, &src}, "add_");
  kernel("add_", [&] { kernels::axpy(pd, ps, alpha, dst.numel(), compute_); });
}

void CudaRank::scale_(const Tensor& t, float factor) {
  float* p = require(t, "scale_", "t");
  before_kernel({&t}, "scale_");
  kernel("scale_", [&] { kernels::scale(p, factor, t.numel(), compute_); });
}

void CudaRank::copy_(const Tensor& dst, const Tensor& src) {
  float* pd = require(dst, "copy_", "dst");
  const float* ps = require(src, "copy_", "src");
  if (dst.numel() != src.numel()) {
    throw UsageError(fmt::format("{}: {} and {} differ in size", where("copy_"), dst.str(), src.str()));
  }
  require_same_kind(dst, src, "copy_");
  before_kernel({&dst, &src}, "copy_");
  kernel("copy", [&] {
    if (pd && pd != ps) {
      RANKLAB_CUDA(
          cudaMemcpyAsync(pd, ps, static_cast<size_t>(dst.bytes()), cudaMemcpyDeviceToDevice, compute_));
    }
  });
}

Tensor CudaRank::sum(const Tensor& t) {
  const float* p = require(t, "sum", "t");
  Tensor out = allocate(Shape{}, t.phantom(), "sum");
  float* po = require(out, "sum", "out");
  before_kernel({&t}, "sum");
  // Accumulated in double, like the simulator, so results agree to float rounding.
  kernel("sum", [&] { kernels::sum(po, p, t.numel(), sum_scratch_, compute_); });
  return out;
}

Tensor CudaRank::slice(const Tensor& t, int dim, std::int64_t start, std::int64_t length) {
  const float* p = require(t, "slice", "t");
  if (dim < 0 || dim >= t.ndim()) {
    throw UsageError(fmt::format("{}: dimension {} is out of range for {}", where("slice"), dim, t.str()));
  }
  if (start < 0 || length < 0 || start + length > t.size(dim)) {
    throw UsageError(fmt::format("{}: [{}, {}) is outside dimension {} of {} (size {})", where("slice"),
                                 start, start + length, dim, t.str(), t.size(dim)));
  }
  Tensor out = allocate(t.shape().with_dim(dim, length), t.phantom(), "slice");
  float* po = require(out, "slice", "out");
  before_kernel({&t}, "slice");
  const Layout l = layout_along(t.shape(), dim);
  const size_t row_bytes = static_cast<size_t>(length * l.inner) * sizeof(float);
  kernel("slice", [&] {
    if (out.numel() == 0) return;
    const float* src = p + start * l.inner;
    if (l.outer == 1) {
      RANKLAB_CUDA(cudaMemcpyAsync(po, src, row_bytes, cudaMemcpyDeviceToDevice, compute_));
    } else {
      // One strided copy: `outer` rows of `length * inner` floats, `size * inner` floats apart in the source.
      RANKLAB_CUDA(cudaMemcpy2DAsync(po, row_bytes, src,
                                     static_cast<size_t>(l.size * l.inner) * sizeof(float), row_bytes,
                                     static_cast<size_t>(l.outer), cudaMemcpyDeviceToDevice, compute_));
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
  std::vector<const float*> ptrs;
  std::int64_t total = 0;
  bool phantom = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    ptrs.push_back(require(parts[i], "cat", "parts[i]"));
    if (parts[i].shape().with_dim(dim, 0) != first.shape().with_dim(dim, 0)) {
      throw UsageError(
          fmt::format("{}: parts[{}] is {} but parts[0] is {}; they may differ only in dimension {}",
                      where("cat"), i, parts[i].str(), first.str(), dim));
    }
    total += parts[i].size(dim);
    phantom = phantom || parts[i].phantom();
  }
  Tensor out = allocate(first.shape().with_dim(dim, total), phantom, "cat");
  float* po = require(out, "cat", "out");
  for (const Tensor& part : parts) before_kernel({&part}, "cat");
  const Layout lo = layout_along(out.shape(), dim);
  kernel("cat", [&] {
    std::int64_t offset = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::int64_t len = parts[i].size(dim);
      const size_t row_bytes = static_cast<size_t>(len * lo.inner) * sizeof(float);
      if (row_bytes > 0 && lo.outer > 0) {
        float* dst = po + offset * lo.inner;
        if (lo.outer == 1) {
          RANKLAB_CUDA(cudaMemcpyAsync(dst, ptrs[i], row_bytes, cudaMemcpyDeviceToDevice, compute_));
        } else {
          RANKLAB_CUDA(cudaMemcpy2DAsync(dst, static_cast<size_t>(total * lo.inner) * sizeof(float), ptrs[i],
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
  float* pp = require(param, "sgd_step", "param");
  const float* pg = require(grad, "sgd_step", "grad");
  require_same_shape(param, grad, "sgd_step");
  require_same_kind(param, grad, "sgd_step");
  before_kernel({&param, &grad}, "sgd_step");
  kernel("sgd_step", [&] { kernels::sgd_step(pp, pg, lr, param.numel(), compute_); });
}

void CudaRank::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          const AdamW& h, int step) {
  float* pp = require(param, "adamw_step", "param");
  const float* pg = require(grad, "adamw_step", "grad");
  float* pm = require(m, "adamw_step", "m");
  float* pv = require(v, "adamw_step", "v");
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
