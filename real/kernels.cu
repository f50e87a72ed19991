// The real backend's elementwise, reduction, optimizer and transformer kernels (FP8's are in
// fp8_kernels.cu). One file, so CI compiles one translation unit per GPU architecture for them.
//
// Elementwise kernels are grid-stride loops (each thread handles elements i, i + stride, ...), which keeps
// the launch shape independent of the tensor's size and the indices in 64 bits. Row kernels (layer norm,
// softmax statistics) give each row one block. Every kernel reads its element type, computes in float32
// and rounds once when it stores, as the simulator models a GPU; reductions run in a fixed order, so
// results do not depend on timing (only embedding_backward_ adds with atomics).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/lse_merge.h"
#include "common/random.h"
#include "real/cuda_check.h"
#include "real/kernel_common.cuh"
#include "real/kernels.h"

namespace ranklab::kernels {

namespace {

// One block per row (or per attention query): CUDA takes up to 2^31 - 1 blocks in x.
unsigned row_blocks(std::int64_t rows, const char* kernel) {
  if (rows > 2147483647) {
    throw UsageError(std::string(kernel) + ": more than 2^31 - 1 rows in one launch");
  }
  return static_cast<unsigned>(rows);
}

// ---- element types -------------------------------------------------------------------------------------

__device__ inline float to_f(float x) {
  return x;
}
__device__ inline float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ inline float to_f(__half x) {
  return __half2float(x);
}

// Float to T, round to nearest even (what the simulator's rounding of a 16-bit tensor models).
template <typename T>
__device__ inline T from_f(float x);
template <>
__device__ inline float from_f<float>(float x) {
  return x;
}
template <>
__device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half from_f<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) with T the element type of `t`.
template <typename Fn>
void dispatch(DType t, Fn&& fn) {
  switch (t) {
    case DType::Float32:
      fn(Tag<float>{});
      return;
    case DType::BFloat16:
      fn(Tag<__nv_bfloat16>{});
      return;
    case DType::Float16:
      fn(Tag<__half>{});
      return;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      break;
  }
  throw UsageError(std::string("no kernel but matmul reads ") + dtype_name(t) +
                   " tensors: quantize makes them");
}

// Calls fn(Tag<T>{}, Tag<O>{}) with T the element type of `t` and O that of `o`.
template <typename Fn>
void dispatch_pair(DType t, DType o, Fn&& fn) {
  dispatch(t, [&](auto t_tag) { dispatch(o, [&](auto o_tag) { fn(t_tag, o_tag); }); });
}
// ---- block reductions ----------------------------------------------------------------------------------

// Sums `value` over a block of kThreads in double; the result is valid in thread 0.
__device__ double block_sum_d(double value) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  return partial[0];
}

// ---- elementwise ---------------------------------------------------------------------------------------

template <typename T>
__global__ void fill_kernel(T* out, std::int64_t n, float value) {
  const T v = from_f<T>(value);
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = v;
}

__global__ void arange_kernel(float* out, std::int64_t n, float start) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = static_cast<float>(i) + start;
}

template <typename T>
__global__ void randn_slice_kernel(T* out, std::int64_t n, std::int64_t size, std::int64_t inner,
                                   std::int64_t start, std::int64_t length, std::uint64_t seed, float std) {
  for (std::int64_t e = first_index(); e < n; e += stride()) {
    // Element e of the slice [outer, length, inner] is element (o, start + j, i) of the full tensor.
    const std::int64_t i = e % inner;
    const std::int64_t j = (e / inner) % length;
    const std::int64_t o = e / (inner * length);
    const std::int64_t full = (o * size + start + j) * inner + i;
    out[e] = from_f<T>(std * normal_at(seed, static_cast<std::uint64_t>(full)));
  }
}

template <typename T>
__global__ void relu_kernel(T* out, const T* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const float v = to_f(x[i]);
    out[i] = from_f<T>(v > 0.0f ? v : 0.0f);
  }
}

template <typename T>
__global__ void relu_backward_kernel(T* out, const T* grad_out, const T* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    out[i] = to_f(x[i]) > 0.0f ? grad_out[i] : from_f<T>(0.0f);
  }
}

template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

template <typename T>
__global__ void axpy_kernel(T* dst, AnyIn src, float alpha, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride())
    dst[i] = from_f<T>(to_f(dst[i]) + alpha * src[i]);
}

template <typename T>
__global__ void convert_kernel(T* dst, AnyIn src, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) dst[i] = from_f<T>(src[i]);
}

template <typename T>
__global__ void scale_kernel(T* t, float factor, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) t[i] = from_f<T>(to_f(t[i]) * factor);
}

template <typename T>
__global__ void sgd_kernel(T* param, AnyIn grad, float lr, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride())
    param[i] = from_f<T>(to_f(param[i]) - lr * grad[i]);
}

// Loshchilov & Hutter's AdamW: the decay is applied to the weights, not folded into the gradient.
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, float lr, float beta1,
                             float beta2, float eps, float weight_decay, float bias_correction1,
                             float bias_correction2, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float m_hat = mi / bias_correction1;
    const float v_hat = vi / bias_correction2;
    param[i] -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * param[i]);
  }
}

// GELU's tanh approximation and its derivative, in float32.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

template <typename T>
__global__ void gelu_kernel(T* y, const T* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const float v = to_f(x[i]);
    const float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    y[i] = from_f<T>(0.5f * v * (1.0f + tanhf(u)));
  }
}

// d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u', u' = sqrt(2/pi) (1 + 3c x^2).
template <typename T>
__global__ void gelu_backward_kernel(T* dx, const T* dy, const T* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const float v = to_f(x[i]);
    const float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    const float th = tanhf(u);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v * v);
    const float grad = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] = from_f<T>(to_f(dy[i]) * grad);
  }
}

template <typename T>
__global__ void dropout_kernel(T* y, const T* x, std::int64_t rows, std::int64_t cols, float p,
                               std::uint64_t seed, std::int64_t first_row, std::int64_t split,
                               std::int64_t second_row) {
  const float scale = 1.0f / (1.0f - p);
  for (std::int64_t i = first_index(); i < rows * cols; i += stride()) {
    const bool keep = dropout_keeps(seed, row_of_runs(i / cols, first_row, split, second_row), i % cols, p);
    y[i] = from_f<T>(keep ? to_f(x[i]) * scale : 0.0f);
  }
}

template <typename T>
__global__ void add_bias_kernel(T* x, const T* bias, std::int64_t rows, std::int64_t cols) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = first_index(); i < n; i += stride())
    x[i] = from_f<T>(to_f(x[i]) + to_f(bias[i % cols]));
}

// ---- sums ----------------------------------------------------------------------------------------------

// Pass one: each block sums its grid-stride share into scratch[block]. Pass two: one block sums those.
template <typename T>
__global__ void sum_partial_kernel(double* scratch, const T* x, std::int64_t n) {
  double acc = 0;
  for (std::int64_t i = first_index(); i < n; i += stride()) acc += to_f(x[i]);
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) scratch[blockIdx.x] = total;
}

template <typename T>
__global__ void sum_final_kernel(T* out, const double* scratch, int parts) {
  double acc = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) acc += scratch[i];
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) out[0] = from_f<T>(static_cast<float>(total));
}

template <typename T>
__global__ void sumsq_partial_kernel(double* scratch, const T* x, std::int64_t n) {
  double acc = 0;
  for (std::int64_t i = first_index(); i < n; i += stride())
    acc += static_cast<double>(to_f(x[i])) * to_f(x[i]);
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) scratch[blockIdx.x] = total;
}

__global__ void accumulate_partials_kernel(double* scratch, int parts) {
  double acc = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) acc += scratch[i];
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) scratch[parts] += total;
}

__global__ void zero_accumulator_kernel(double* scratch, int parts) {
  scratch[parts] = 0;
}

__global__ void store_accumulator_kernel(float* out, const double* scratch, int parts) {
  out[0] = static_cast<float>(scratch[parts]);
}

// Column reductions over rows: a block of 32 x 8 threads owns 32 adjacent columns (coalesced reads of a
// row); its 8 thread rows stride down the rows and meet in shared memory, in a fixed order.
constexpr int kColTile = 32;
constexpr int kRowLanes = 8;

unsigned column_blocks(std::int64_t cols) {
  return static_cast<unsigned>((cols + kColTile - 1) / kColTile);
}

template <typename T>
__global__ void sum_rows_kernel(float* out, const T* x, std::int64_t rows, std::int64_t cols) {
  __shared__ float part[kRowLanes][kColTile];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float acc = 0;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += kRowLanes) acc += to_f(x[r * cols + c]);
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = part[0][threadIdx.x];
    for (int k = 1; k < kRowLanes; ++k) total += part[k][threadIdx.x];
    out[c] = total;
  }
}

// ---- layer norm ----------------------------------------------------------------------------------------

// One block per row: the mean, then the variance about it (two passes: no cancellation from E[x^2] -
// E[x]^2), biased as in Ba et al. and PyTorch.
template <typename T>
__global__ void layernorm_kernel(T* y, float* mean_out, float* rstd_out, const T* x, AnyIn gamma, AnyIn beta,
                                 std::int64_t cols, float eps) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float s = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += to_f(xr[c]);
  const float mean = block_sum_f(s, scratch) / static_cast<float>(cols);
  float sq = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_f(xr[c]) - mean;
    sq += d * d;
  }
  const float var = block_sum_f(sq, scratch) / static_cast<float>(cols);
  const float rstd = 1.0f / sqrtf(var + eps);
  T* yr = y + row * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    yr[c] = from_f<T>((to_f(xr[c]) - mean) * rstd * gamma[c] + beta[c]);
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), with g = dy gamma and xhat = (x - mean) rstd.
template <typename T>
__global__ void layernorm_dx_kernel(T* dx, const T* dy, const T* x, AnyIn gamma, const float* mean,
                                    const float* rstd, std::int64_t cols) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const T* dyr = dy + row * cols;
  const float mu = mean[row], rs = rstd[row];
  float sg = 0, sgx = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_f(dyr[c]) * gamma[c];
    sg += g;
    sgx += g * (to_f(xr[c]) - mu) * rs;
  }
  const float mean_g = block_sum_f(sg, scratch) / static_cast<float>(cols);
  const float mean_gx = block_sum_f(sgx, scratch) / static_cast<float>(cols);
  T* dxr = dx + row * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_f(dyr[c]) * gamma[c];
    const float xhat = (to_f(xr[c]) - mu) * rs;
    dxr[c] = from_f<T>(rs * (g - mean_g - xhat * mean_gx));
  }
}

// dgamma[c] = sum_r dy xhat, dbeta[c] = sum_r dy: column reductions as in sum_rows.
template <typename T>
__global__ void layernorm_dparams_kernel(float* dgamma, float* dbeta, const T* dy, const T* x,
                                         const float* mean, const float* rstd, std::int64_t rows,
                                         std::int64_t cols) {
  __shared__ float pg[kRowLanes][kColTile];
  __shared__ float pb[kRowLanes][kColTile];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float ag = 0, ab = 0;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += kRowLanes) {
      const float d = to_f(dy[r * cols + c]);
      ag += d * (to_f(x[r * cols + c]) - mean[r]) * rstd[r];
      ab += d;
    }
  }
  pg[threadIdx.y][threadIdx.x] = ag;
  pb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float g = pg[0][threadIdx.x], b = pb[0][threadIdx.x];
    for (int k = 1; k < kRowLanes; ++k) {
      g += pg[k][threadIdx.x];
      b += pb[k][threadIdx.x];
    }
    dgamma[c] = g;
    dbeta[c] = b;
  }
}

// ---- RMSNorm and SwiGLU ----------------------------------------------------------------------------------

template <typename T>
__global__ void rmsnorm_kernel(T* y, float* rstd_out, const T* x, const T* gamma, std::int64_t cols,
                               float eps) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float sq = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) sq += to_f(xr[c]) * to_f(xr[c]);
  const float rstd = 1.0f / sqrtf(block_sum_f(sq, scratch) / static_cast<float>(cols) + eps);
  T* yr = y + row * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    yr[c] = from_f<T>(to_f(xr[c]) * rstd * to_f(gamma[c]));
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

// dx = rstd (g - xhat mean(g xhat)), with g = dy gamma and xhat = x rstd.
template <typename T>
__global__ void rmsnorm_dx_kernel(T* dx, const T* dy, const T* x, const T* gamma, const float* rstd,
                                  std::int64_t cols) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const T* dyr = dy + row * cols;
  const float rs = rstd[row];
  float sgx = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    sgx += to_f(dyr[c]) * to_f(gamma[c]) * to_f(xr[c]) * rs;
  }
  const float mean_gx = block_sum_f(sgx, scratch) / static_cast<float>(cols);
  T* dxr = dx + row * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    dxr[c] = from_f<T>(rs * (to_f(dyr[c]) * to_f(gamma[c]) - to_f(xr[c]) * rs * mean_gx));
  }
}

// dgamma[c] = sum_r dy x rstd: a column reduction as in sum_rows.
template <typename T>
__global__ void rmsnorm_dgamma_kernel(float* dgamma, const T* dy, const T* x, const float* rstd,
                                      std::int64_t rows, std::int64_t cols) {
  __shared__ float pg[kRowLanes][kColTile];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float ag = 0;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += kRowLanes) {
      ag += to_f(dy[r * cols + c]) * to_f(x[r * cols + c]) * rstd[r];
    }
  }
  pg[threadIdx.y][threadIdx.x] = ag;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float g = pg[0][threadIdx.x];
    for (int k = 1; k < kRowLanes; ++k) g += pg[k][threadIdx.x];
    dgamma[c] = g;
  }
}

// The gated unit's arithmetic is common/glu.h's, which the simulator runs too.
template <typename T>
__global__ void swiglu_kernel(T* y, const T* x, std::int64_t n, GluSpec glu) {
  for (std::int64_t i = first_index(); i < n; i += stride())
    y[i] = from_f<T>(glu::forward(to_f(x[2 * i]), to_f(x[2 * i + 1]), glu));
}

template <typename T>
__global__ void swiglu_backward_kernel(T* dx, const T* dy, const T* x, std::int64_t n, GluSpec glu) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    float da = 0, db = 0;
    glu::backward(to_f(x[2 * i]), to_f(x[2 * i + 1]), to_f(dy[i]), glu, &da, &db);
    dx[2 * i] = from_f<T>(da);
    dx[2 * i + 1] = from_f<T>(db);
  }
}

// ---- attention -----------------------------------------------------------------------------------------

// One block per (sample, head, query or key position); the block's threads first take one key (or query)
// each of a tile of kAttnTile, computing its dot products over head_dim, then one or more of head_dim's
// columns each, accumulating over the tile. Each thread keeps at most kMaxHeadDim / kAttnTile columns.
constexpr int kAttnTile = 128;
constexpr int kDimsPerThread = kMaxHeadDim / kAttnTile;

// Where a token's q (part 0) of head h, or the k (1) or v (2) of h's group, starts in qkv: each group's q
// heads, then its k and v (common/rank.h).
template <typename T>
__device__ inline const T* qkv_at(const T* qkv, const AttentionShape& a, std::int64_t pos, std::int64_t b,
                                  int h, int part) {
  const std::int64_t row = pos * a.batch + b;
  const int per_group = a.heads / a.kv_heads, group = h / per_group;
  const std::int64_t first = static_cast<std::int64_t>(group) * (per_group + 2);
  const std::int64_t head = part == 0 ? first + h % per_group : first + per_group + part - 1;
  return qkv + row * (static_cast<std::int64_t>(a.heads + 2 * a.kv_heads) * a.head_dim) + head * a.head_dim;
}
template <typename T>
__device__ inline std::int64_t out_offset(const AttentionShape& a, std::int64_t pos, std::int64_t b, int h) {
  return (pos * a.batch + b) * (static_cast<std::int64_t>(a.heads) * a.head_dim) +
         static_cast<std::int64_t>(h) * a.head_dim;
}

// Dot product of a float vector in shared memory with a row of T.
template <typename T>
__device__ inline float dot(const float* s, const T* row, int n) {
  float acc = 0;
  for (int d = 0; d < n; ++d) acc += s[d] * to_f(row[d]);
  return acc;
}

// Where a head's keys and values are: in qkv itself (each group's q heads, then its k and v), or in a kv
// tensor of their own (each group's k, then its v: Rank::key_values, context parallelism's blocks).
struct KeyValues {
  std::int64_t row_width = 0;  // elements per row
  int per_group = 0;           // q heads before each group's k: heads / kv_heads in qkv, 0 in kv
  // Group g's k (part 1) or v (part 2) at position pos of sample b.
  template <typename T>
  __device__ const T* at(const T* base, const AttentionShape& a, std::int64_t pos, std::int64_t b, int group,
                         int part) const {
    const std::int64_t head = static_cast<std::int64_t>(group) * (per_group + 2) + per_group + part - 1;
    return base + (pos * a.batch + b) * row_width + head * a.head_dim;
  }
};
__host__ __device__ inline KeyValues in_qkv(const AttentionShape& a) {
  return {static_cast<std::int64_t>(a.heads + 2 * a.kv_heads) * a.head_dim, a.heads / a.kv_heads};
}
inline KeyValues in_kv(const AttentionShape& a) {
  return {2 * static_cast<std::int64_t>(a.kv_heads) * a.head_dim, 0};
}
// The whole attention as a block: every query against qkv's own keys, the mask by position.
inline AttentionBlockShape whole(const AttentionShape& a) {
  AttentionBlockShape k;
  k.a = a;
  k.kv_seq = a.seq;
  k.q_end = a.seq;
  k.causal = a.causal;
  return k;
}

// The keys [first, end) of the block that query `i` sees: all of them, or with the mask those up to its
// position, and with a window (causal only) those from the window's start on (AttentionSpec::first_key).
struct KeyRange {
  std::int64_t first, end;
};
__device__ inline KeyRange visible_keys(const AttentionBlockShape& k, std::int64_t i) {
  if (!k.causal) return {0, k.kv_seq};
  const std::int64_t pos = k.q_position + (i - k.q_first), w = k.a.window;
  const std::int64_t v = pos - k.kv_position + 1;
  const std::int64_t end = v < 0 ? 0 : (v > k.kv_seq ? k.kv_seq : v);
  const std::int64_t from = (w > 0 && pos >= w ? pos - w + 1 : 0) - k.kv_position;
  return {from < 0 ? 0 : (from > end ? end : from), end};
}

// Block ids of the per-query kernels run over (sample, head, query of the block), the query fastest.
struct BlockQuery {
  std::int64_t b, i;
  int h;
};
__device__ inline BlockQuery block_query(const AttentionBlockShape& k) {
  const std::int64_t id = blockIdx.x, queries = k.q_end - k.q_first;
  BlockQuery x;
  x.i = k.q_first + id % queries;
  x.h = static_cast<int>((id / queries) % k.a.heads);
  x.b = id / (queries * k.a.heads);
  return x;
}

// Forward: the online softmax of Milakov & Gimelshein (2018) as FlashAttention uses it. Per tile of keys:
// scores, the tile's max, rescale what was accumulated by exp(old max - new max), add exp(score - max) v.
// The whole attention writes out and lse; a context-parallel block (`merge`) merges its result into the
// running ones by their log-sum-exps, out = e^(lse - total) out + e^(lse_block - total) out_block with
// total = log(e^lse + e^lse_block), in the arithmetic the simulator merges with (common/lse_merge.h). A sink
// (the whole attention's; `sinks.p` null: none) is a key of logit sinks[h] whose value is zero: the online
// softmax starts from it, m = sink and l = 1, with nothing accumulated.
template <typename T, typename O>
__global__ void attention_kernel(O* out, float* lse, const T* qkv, const T* keys, KeyValues kvs,
                                 AttentionBlockShape k, AnyIn sinks, float scale, bool merge) {
  extern __shared__ float smem[];
  float* q = smem;                 // [head_dim]
  float* p = q + k.a.head_dim;     // [kAttnTile]
  float* scratch = p + kAttnTile;  // [32]
  const AttentionShape& a = k.a;
  const BlockQuery x = block_query(k);
  const KeyRange keys_seen = visible_keys(k, x.i);
  // Every key of a block is after this query, or before its window: the same for the thread block. (The
  // whole attention's queries always see their own key.)
  if (keys_seen.first == keys_seen.end) return;
  const int tid = threadIdx.x, group = x.h / (a.heads / a.kv_heads);
  const T* qrow = qkv_at(qkv, a, x.i, x.b, x.h, 0);
  for (int d = tid; d < a.head_dim; d += blockDim.x) q[d] = to_f(qrow[d]);
  __syncthreads();
  const float sink = sinks.p != nullptr ? sinks[x.h] : -INFINITY;
  float m = sink, l = isinf(sink) ? 0.0f : 1.0f;
  float acc[kDimsPerThread];
  for (float& v : acc) v = 0;
  for (std::int64_t j0 = keys_seen.first; j0 < keys_seen.end; j0 += kAttnTile) {
    const std::int64_t j = j0 + tid;
    float s = -INFINITY;
    if (j < keys_seen.end) s = dot(q, kvs.at(keys, a, j, x.b, group, 1), a.head_dim) * scale;
    // Every tile holds at least one key, so the max is finite from the first tile on.
    const float new_m = fmaxf(m, block_max_f(s, scratch));
    const float e = j < keys_seen.end ? expf(s - new_m) : 0.0f;
    p[tid] = e;
    const float tile_sum = block_sum_f(e, scratch);  // its barriers also publish p
    const float correction = expf(m - new_m);        // 0 on the first tile without a sink (m = -inf)
    l = l * correction + tile_sum;
    const int n = static_cast<int>(keys_seen.end - j0 < kAttnTile ? keys_seen.end - j0 : kAttnTile);
    for (int c = 0; c < kDimsPerThread; ++c) {
      const int d = tid + c * kAttnTile;
      if (d >= a.head_dim) break;
      float v = acc[c] * correction;
      for (int t = 0; t < n; ++t) v += p[t] * to_f(kvs.at(keys, a, j0 + t, x.b, group, 2)[d]);
      acc[c] = v;
    }
    m = new_m;
    __syncthreads();  // p is rewritten by the next tile
  }
  const std::int64_t stat = (x.b * a.heads + x.h) * a.seq + x.i;
  O* orow = out + out_offset<O>(a, x.i, x.b, x.h);
  const float own_lse = m + logf(l);
  if (!merge) {
    for (int c = 0; c < kDimsPerThread; ++c) {
      const int d = tid + c * kAttnTile;
      if (d < a.head_dim) orow[d] = from_f<O>(acc[c] / l);
    }
    if (tid == 0) lse[stat] = own_lse;
    return;
  }
  const LseMerge merged = merge_lse(lse[stat], own_lse);
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int d = tid + c * kAttnTile;
    if (d < a.head_dim) orow[d] = from_f<O>(merged.keep * to_f(orow[d]) + merged.add * (acc[c] / l));
  }
  __syncthreads();  // every thread has read the old lse
  if (tid == 0) lse[stat] = merged.total;
}

// Backward (Dao et al. 2022, Algorithm 4, without the tiling of queries): with P = exp(scale q.k - lse),
// dP = dout . v, delta = dout . out and dS = P (dP - delta):
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dout_i.
// Two kernels, so every sum has one owner and no atomics: one block per query for dq (it also writes
// delta, [batch, heads, queries of the block]), then one block per key for dk and dv. The whole
// attention writes its gradients; a context-parallel block (`accumulate`) adds into the running ones.
template <typename T, typename O>
__global__ void attention_dq_kernel(T* dqkv, float* delta_out, const O* dout, const T* qkv, const T* keys,
                                    KeyValues kvs, const O* out, const float* lse, AttentionBlockShape k,
                                    float scale, bool accumulate) {
  extern __shared__ float smem[];
  float* q = smem;                  // [head_dim]
  float* go = q + k.a.head_dim;     // [head_dim]: d out of this query
  float* ds = go + k.a.head_dim;    // [kAttnTile]
  float* scratch = ds + kAttnTile;  // [32]
  const AttentionShape& a = k.a;
  const BlockQuery x = block_query(k);
  const int tid = threadIdx.x, group = x.h / (a.heads / a.kv_heads);
  const T* qrow = qkv_at(qkv, a, x.i, x.b, x.h, 0);
  const std::int64_t o = out_offset<O>(a, x.i, x.b, x.h);
  float part = 0;
  for (int d = tid; d < a.head_dim; d += blockDim.x) {
    q[d] = to_f(qrow[d]);
    go[d] = to_f(dout[o + d]);
    part += go[d] * to_f(out[o + d]);
  }
  const float delta = block_sum_f(part, scratch);  // its barriers also publish q and go
  if (tid == 0) delta_out[(x.b * a.heads + x.h) * (k.q_end - k.q_first) + (x.i - k.q_first)] = delta;
  const float lse_i = lse[(x.b * a.heads + x.h) * a.seq + x.i];
  const KeyRange keys_seen = visible_keys(k, x.i);
  float acc[kDimsPerThread];
  for (float& v : acc) v = 0;
  for (std::int64_t j0 = keys_seen.first; j0 < keys_seen.end; j0 += kAttnTile) {
    const std::int64_t j = j0 + tid;
    float dsj = 0;
    if (j < keys_seen.end) {
      const float pj = expf(dot(q, kvs.at(keys, a, j, x.b, group, 1), a.head_dim) * scale - lse_i);
      const float dpj = dot(go, kvs.at(keys, a, j, x.b, group, 2), a.head_dim);
      dsj = pj * (dpj - delta);
    }
    ds[tid] = dsj;
    __syncthreads();
    const int n = static_cast<int>(keys_seen.end - j0 < kAttnTile ? keys_seen.end - j0 : kAttnTile);
    for (int c = 0; c < kDimsPerThread; ++c) {
      const int d = tid + c * kAttnTile;
      if (d >= a.head_dim) break;
      for (int t = 0; t < n; ++t) acc[c] += ds[t] * to_f(kvs.at(keys, a, j0 + t, x.b, group, 1)[d]);
    }
    __syncthreads();
  }
  T* dq = const_cast<T*>(qkv_at(static_cast<const T*>(dqkv), a, x.i, x.b, x.h, 0));
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int d = tid + c * kAttnTile;
    if (d < a.head_dim) dq[d] = from_f<T>((accumulate ? to_f(dq[d]) : 0.0f) + scale * acc[c]);
  }
}

// One block per (sample, key-value head, key): the sums run over every query of every q head of the group
// that sees the key. dk and dv go where `dkvs` says in `dkeys`: dqkv's k and v columns for the whole
// attention, the block's dkv for a block.
template <typename T, typename O>
__global__ void attention_dkv_kernel(T* dkeys, KeyValues dkvs, const float* delta, const O* dout,
                                     const T* qkv, const T* keys, KeyValues kvs, const float* lse,
                                     AttentionBlockShape k, float scale, bool accumulate) {
  extern __shared__ float smem[];
  float* kk = smem;               // [head_dim]: this key
  float* vv = kk + k.a.head_dim;  // [head_dim]: its value
  float* p = vv + k.a.head_dim;   // [kAttnTile]
  float* ds = p + kAttnTile;      // [kAttnTile]
  const AttentionShape& a = k.a;
  const std::int64_t id = blockIdx.x, queries = k.q_end - k.q_first;
  const std::int64_t j = id % k.kv_seq, b = id / (k.kv_seq * a.kv_heads);
  const int group = static_cast<int>((id / k.kv_seq) % a.kv_heads), per_group = a.heads / a.kv_heads;
  const int tid = threadIdx.x;
  const T* krow = kvs.at(keys, a, j, b, group, 1);
  const T* vrow = kvs.at(keys, a, j, b, group, 2);
  for (int d = tid; d < a.head_dim; d += blockDim.x) {
    kk[d] = to_f(krow[d]);
    vv[d] = to_f(vrow[d]);
  }
  __syncthreads();
  // Under the mask, query i sees key j from q_position + (i - q_first) >= kv_position + j on; under a
  // window, up to the last query whose position is below kv_position + j + window (key positions are not
  // negative, so that is the whole of AttentionSpec::first_key's condition).
  std::int64_t first = k.q_first, end = k.q_end;
  if (k.causal) {
    const std::int64_t from = k.q_first + k.kv_position + j - k.q_position;
    if (from > first) first = from;
    if (a.window > 0 && from + a.window < end) end = from + a.window;
  }
  float acc_k[kDimsPerThread], acc_v[kDimsPerThread];
  for (int c = 0; c < kDimsPerThread; ++c) acc_k[c] = acc_v[c] = 0;
  for (int h = group * per_group; h < (group + 1) * per_group; ++h) {
    const std::int64_t stats = (b * a.heads + h) * a.seq, deltas = (b * a.heads + h) * queries - k.q_first;
    for (std::int64_t i0 = first; i0 < end; i0 += kAttnTile) {
      const std::int64_t i = i0 + tid;
      float pi = 0, dsi = 0;
      if (i < end) {
        pi = expf(dot(kk, qkv_at(qkv, a, i, b, h, 0), a.head_dim) * scale - lse[stats + i]);
        const float dpi = dot(vv, dout + out_offset<O>(a, i, b, h), a.head_dim);
        dsi = pi * (dpi - delta[deltas + i]);
      }
      p[tid] = pi;
      ds[tid] = dsi;
      __syncthreads();
      const int n = static_cast<int>(end - i0 < kAttnTile ? end - i0 : kAttnTile);
      for (int c = 0; c < kDimsPerThread; ++c) {
        const int d = tid + c * kAttnTile;
        if (d >= a.head_dim) break;
        for (int t = 0; t < n; ++t) {
          acc_v[c] += p[t] * to_f(dout[out_offset<O>(a, i0 + t, b, h) + d]);
          acc_k[c] += ds[t] * to_f(qkv_at(qkv, a, i0 + t, b, h, 0)[d]);
        }
      }
      __syncthreads();
    }
  }
  T* dk = const_cast<T*>(dkvs.at(static_cast<const T*>(dkeys), a, j, b, group, 1));
  T* dv = const_cast<T*>(dkvs.at(static_cast<const T*>(dkeys), a, j, b, group, 2));
  for (int c = 0; c < kDimsPerThread; ++c) {
    const int d = tid + c * kAttnTile;
    if (d < a.head_dim) {
      dk[d] = from_f<T>((accumulate ? to_f(dk[d]) : 0.0f) + scale * acc_k[c]);
      dv[d] = from_f<T>((accumulate ? to_f(dv[d]) : 0.0f) + acc_v[c]);
    }
  }
}

// Sinks merged after the attention (context parallelism's blocks take none): one warp per (sample, head,
// query), which alone reads and writes that query's lse and its head's columns of out, so the update in
// place needs no barrier but the warp's. As the merge of a block (attention_kernel), with the sink a block
// of one key of logit sinks[h] whose value is zero: it adds to the total, not to out.
template <typename O>
__global__ void attention_sinks_kernel(O* out, float* lse, AnyIn sinks, std::int64_t seq, std::int64_t batch,
                                       int heads, std::int64_t head_dim) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t queries = batch * heads * seq;
  // The warp's index is the same for its 32 lanes, so each warp takes the loop's turns together.
  for (std::int64_t w = first_index() / 32; w < queries; w += stride() / 32) {
    const std::int64_t i = w % seq, b = w / (seq * heads);
    const int h = static_cast<int>((w / seq) % heads);
    const LseMerge m = merge_lse(lse[w], sinks[h]);
    O* row = out + (i * batch + b) * (heads * head_dim) + h * head_dim;
    for (std::int64_t d = lane; d < head_dim; d += 32) row[d] = from_f<O>(m.keep * to_f(row[d]));
    __syncwarp();  // every lane has read the old lse
    if (lane == 0) lse[w] = m.total;
  }
}

// d sink_h = -sum over (sample, query) of e^(sink_h - lse) (dout . out): one block of kThreads per head, a
// warp per query at a time (its lanes along head_dim, so the reads of a row are coalesced), summed in double
// in a fixed order, so no atomics and the same sum on every run.
template <typename O>
__global__ void attention_sinks_backward_kernel(float* dsinks, const O* dout, const O* out, const float* lse,
                                                AnyIn sinks, std::int64_t seq, std::int64_t batch,
                                                std::int64_t head_dim) {
  const int h = static_cast<int>(blockIdx.x), heads = static_cast<int>(gridDim.x);
  const int lane = static_cast<int>(threadIdx.x % 32), warps = static_cast<int>(blockDim.x / 32);
  const float sink = sinks[h];
  double acc = 0;
  for (std::int64_t q = threadIdx.x / 32; q < batch * seq; q += warps) {
    const std::int64_t b = q / seq, i = q % seq;
    const std::int64_t at = (i * batch + b) * (heads * head_dim) + h * head_dim;
    float part = 0;
    for (std::int64_t d = lane; d < head_dim; d += 32) part += to_f(dout[at + d]) * to_f(out[at + d]);
    for (int offset = 16; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffffu, part, offset);
    if (lane == 0) acc -= static_cast<double>(expf(sink - lse[(b * heads + h) * seq + i]) * part);
  }
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) dsinks[h] = static_cast<float>(total);
}

// Copies qkv's k and v columns into kv (add = false), or adds a kv-shaped gradient into them (add = true):
// one thread per element of kv.
template <typename T>
__global__ void key_values_kernel(T* qkv, T* kv, AttentionShape a, bool add, std::int64_t n) {
  const KeyValues packed = in_qkv(a);
  const std::int64_t kv_width = 2 * static_cast<std::int64_t>(a.kv_heads) * a.head_dim;
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const std::int64_t row = i / kv_width, col = i % kv_width;
    const int head = static_cast<int>(col / a.head_dim);  // of kv's: group head / 2, k or v by its parity
    T* in_qkv_at = const_cast<T*>(packed.at(static_cast<const T*>(qkv), a, row / a.batch, row % a.batch,
                                            head / 2, head % 2 + 1)) +
                   col % a.head_dim;
    if (add) {
      *in_qkv_at = from_f<T>(to_f(*in_qkv_at) + to_f(kv[i]));
    } else {
      kv[i] = *in_qkv_at;
    }
  }
}

// Rotary embeddings: one thread per (row, rotated head, pair).
template <typename T>
__global__ void rope_kernel(T* qkv, AttentionShape a, std::int64_t first_position, double base, bool inverse,
                            std::int64_t n) {
  const int half = a.head_dim / 2, rotated = a.heads + a.kv_heads, per_group = a.heads / a.kv_heads;
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    const int pair = static_cast<int>(i % half);
    const int head = static_cast<int>((i / half) % rotated);
    const std::int64_t row = i / (static_cast<std::int64_t>(half) * rotated);
    // The q heads first, then each group's k.
    const int h = head < a.heads ? head : (head - a.heads) * per_group;
    T* x = const_cast<T*>(
        qkv_at(static_cast<const T*>(qkv), a, row / a.batch, row % a.batch, h, head < a.heads ? 0 : 1));
    const double angle =
        static_cast<double>(first_position + row / a.batch) * pow(base, -2.0 * pair / a.head_dim);
    const float c = static_cast<float>(cos(angle)),
                sn = static_cast<float>(inverse ? -sin(angle) : sin(angle));
    const float x1 = to_f(x[pair]), x2 = to_f(x[pair + half]);
    x[pair] = from_f<T>(x1 * c - x2 * sn);
    x[pair + half] = from_f<T>(x2 * c + x1 * sn);
  }
}

// ---- embedding -----------------------------------------------------------------------------------------

// The row of this shard that token id `id` (a float holding an integer) selects, or -1 when it is not here.
__device__ inline std::int64_t shard_row(float id, std::int64_t shard_rows, std::int64_t vocab_start) {
  if (!(id >= 0.0f) || id >= 9.0e18f) return -1;  // negative, NaN or beyond int64
  const std::int64_t local = static_cast<std::int64_t>(id) - vocab_start;
  return local >= 0 && local < shard_rows ? local : -1;
}

template <typename T>
__global__ void embedding_kernel(T* out, const float* ids, const T* table, std::int64_t rows,
                                 std::int64_t cols, std::int64_t shard_rows, std::int64_t vocab_start) {
  const std::int64_t n = rows * cols;
  for (std::int64_t e = first_index(); e < n; e += stride()) {
    const std::int64_t r = e / cols, c = e % cols;
    const std::int64_t local = shard_row(ids[r], shard_rows, vocab_start);
    out[e] = local >= 0 ? table[local * cols + c] : from_f<T>(0.0f);
  }
}

// Several rows may hold the same id, so the adds into one table row race: atomics, in float32.
template <typename T>
__global__ void embedding_backward_kernel(float* dtable, const T* dy, const float* ids, std::int64_t rows,
                                          std::int64_t cols, std::int64_t shard_rows,
                                          std::int64_t vocab_start) {
  const std::int64_t n = rows * cols;
  for (std::int64_t e = first_index(); e < n; e += stride()) {
    const std::int64_t r = e / cols, c = e % cols;
    const std::int64_t local = shard_row(ids[r], shard_rows, vocab_start);
    if (local >= 0) atomicAdd(dtable + local * cols + c, to_f(dy[e]));
  }
}

// ---- vocabulary-parallel cross-entropy -----------------------------------------------------------------

template <typename T>
__global__ void row_max_kernel(float* out, const T* logits, std::int64_t cols) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  float m = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_f(logits[row * cols + c]));
  m = block_max_f(m, scratch);
  if (threadIdx.x == 0) out[row] = m;
}

template <typename T>
__global__ void softmax_stats_kernel(float* out, const T* logits, const float* row_max, const float* targets,
                                     std::int64_t cols, std::int64_t vocab_start) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const float m = row_max[row];
  float s = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_f(logits[row * cols + c]) - m);
  s = block_sum_f(s, scratch);
  if (threadIdx.x == 0) {
    const std::int64_t local = shard_row(targets[row], cols, vocab_start);
    out[2 * row] = s;
    out[2 * row + 1] = local >= 0 ? to_f(logits[row * cols + local]) : 0.0f;
  }
}

__global__ void cross_entropy_loss_kernel(float* out, const float* row_max, const float* stats,
                                          std::int64_t rows) {
  double acc = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    acc += static_cast<double>(logf(stats[2 * r]) + row_max[r] - stats[2 * r + 1]);
  }
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) out[0] = static_cast<float>(total);
}

template <typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* row_max,
                                              const float* stats, const float* targets, std::int64_t rows,
                                              std::int64_t cols, std::int64_t vocab_start, float scale) {
  const std::int64_t n = rows * cols;
  for (std::int64_t e = first_index(); e < n; e += stride()) {
    const std::int64_t r = e / cols, c = e % cols;
    const float softmax = expf(to_f(logits[e]) - row_max[r]) / stats[2 * r];
    const float onehot = shard_row(targets[r], cols, vocab_start) == c ? 1.0f : 0.0f;
    dlogits[e] = from_f<T>(scale * (softmax - onehot));
  }
}

// ---- mixture-of-experts permutation ---------------------------------------------------------------------

// The row a route's index (a float holding an integer) names, or -1 when it is not one of `rows`.
__device__ inline std::int64_t route_row(float index, std::int64_t rows) {
  if (!(index >= 0.0f) || index >= 9.0e18f) return -1;  // negative, NaN or beyond int64
  const std::int64_t r = static_cast<std::int64_t>(index);
  return r < rows ? r : -1;
}

// One thread per (route, column): coalesced along the columns of a row.
template <typename T>
__global__ void gather_rows_kernel(T* out, const T* x, const float* index, const float* weights,
                                   std::int64_t n, std::int64_t x_rows, std::int64_t cols) {
  const std::int64_t total = n * cols;
  for (std::int64_t e = first_index(); e < total; e += stride()) {
    const std::int64_t i = e / cols, c = e % cols;
    const std::int64_t r = route_row(index[i], x_rows);
    if (r < 0) {
      out[e] = from_f<T>(0.0f);
    } else if (weights != nullptr) {
      out[e] = from_f<T>(__fmul_rn(to_f(x[r * cols + c]), weights[i]));
    } else {
      out[e] = x[r * cols + c];
    }
  }
}

// One thread per output element, adding its row's routes in the order the CSR lists them (ascending), so
// the sum is the same on every run and the same as the simulator's; no atomics. __fmul_rn keeps the
// product from contracting into an FMA, which the simulator's host arithmetic does not do.
template <typename T>
__global__ void scatter_add_rows_kernel(T* out, const T* src, const std::int64_t* offsets,
                                        const std::int64_t* routes, const float* weights, std::int64_t rows,
                                        std::int64_t cols) {
  const std::int64_t total = rows * cols;
  for (std::int64_t e = first_index(); e < total; e += stride()) {
    const std::int64_t r = e / cols, c = e % cols;
    float acc = 0.0f;
    for (std::int64_t k = offsets[r]; k < offsets[r + 1]; ++k) {
      const std::int64_t i = routes[k];
      const float v = to_f(src[i * cols + c]);
      acc = __fadd_rn(acc, weights != nullptr ? __fmul_rn(v, weights[i]) : v);
    }
    out[e] = from_f<T>(acc);
  }
}

// One block per row, summed in double in a fixed order (as the simulator sums it).
template <typename T>
__global__ void row_dots_kernel(float* out, const T* a, const T* b, std::int64_t cols) {
  const std::int64_t row = blockIdx.x;
  double acc = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    acc += static_cast<double>(to_f(a[row * cols + c])) * static_cast<double>(to_f(b[row * cols + c]));
  }
  const double total = block_sum_d(acc);
  if (threadIdx.x == 0) out[row] = static_cast<float>(total);
}

}  // namespace

// ---- launches ------------------------------------------------------------------------------------------

void fill(void* out, DType t, std::int64_t n, float value, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(out), n, value);
  });
  check_launch("fill kernel launch");
}

void arange(float* out, std::int64_t n, float start, cudaStream_t s) {
  if (n == 0) return;
  arange_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, n, start);
  check_launch("arange kernel launch");
}

void randn_slice(void* out, DType t, std::int64_t outer, std::int64_t size, std::int64_t inner,
                 std::int64_t start, std::int64_t length, std::uint64_t seed, float std, cudaStream_t s) {
  const std::int64_t n = outer * length * inner;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    randn_slice_kernel<T>
        <<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(out), n, size, inner, start, length, seed, std);
  });
  check_launch("randn kernel launch");
}

void relu(void* out, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    relu_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(out), static_cast<const T*>(x), n);
  });
  check_launch("relu kernel launch");
}

void relu_backward(void* out, const void* grad_out, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    relu_backward_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<T*>(out), static_cast<const T*>(grad_out), static_cast<const T*>(x), n);
  });
  check_launch("relu_backward kernel launch");
}

void add(void* out, const void* a, const void* b, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    add_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(out), static_cast<const T*>(a),
                                                     static_cast<const T*>(b), n);
  });
  check_launch("add kernel launch");
}

void axpy(void* dst, DType dst_t, const void* src, DType src_t, float alpha, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(dst_t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    axpy_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(dst), AnyIn{src, src_t}, alpha, n);
  });
  check_launch("add_ kernel launch");
}

void convert(void* dst, DType dst_t, const void* src, DType src_t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(dst_t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    convert_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(dst), AnyIn{src, src_t}, n);
  });
  check_launch("convert kernel launch");
}

void scale(void* t, DType dt, float factor, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(t), factor, n);
  });
  check_launch("scale_ kernel launch");
}

void sgd_step(void* param, DType param_t, const void* grad, DType grad_t, float lr, std::int64_t n,
              cudaStream_t s) {
  if (n == 0) return;
  dispatch(param_t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sgd_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(param), AnyIn{grad, grad_t}, lr, n);
  });
  check_launch("sgd_step kernel launch");
}

void adamw_step(float* param, const float* grad, float* m, float* v, float lr, float beta1, float beta2,
                float eps, float weight_decay, float bias_correction1, float bias_correction2, std::int64_t n,
                cudaStream_t s) {
  if (n == 0) return;
  adamw_kernel<<<blocks_for(n), kThreads, 0, s>>>(param, grad, m, v, lr, beta1, beta2, eps, weight_decay,
                                                  bias_correction1, bias_correction2, n);
  check_launch("adamw_step kernel launch");
}

void sum(void* out, const void* x, DType t, std::int64_t n, double* scratch, cudaStream_t s) {
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sum_partial_kernel<T><<<kSumBlocks, kThreads, 0, s>>>(scratch, static_cast<const T*>(x), n);
    check_launch("sum kernel launch");
    sum_final_kernel<T><<<1, kThreads, 0, s>>>(static_cast<T*>(out), scratch, kSumBlocks);
  });
  check_launch("sum kernel launch");
}

void squared_norm_begin(double* scratch, cudaStream_t s) {
  zero_accumulator_kernel<<<1, 1, 0, s>>>(scratch, kSumBlocks);
  check_launch("squared_norm kernel launch");
}

void squared_norm_add(double* scratch, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sumsq_partial_kernel<T><<<kSumBlocks, kThreads, 0, s>>>(scratch, static_cast<const T*>(x), n);
    check_launch("squared_norm kernel launch");
    accumulate_partials_kernel<<<1, kThreads, 0, s>>>(scratch, kSumBlocks);
  });
  check_launch("squared_norm kernel launch");
}

void squared_norm_end(float* out, const double* scratch, cudaStream_t s) {
  store_accumulator_kernel<<<1, 1, 0, s>>>(out, scratch, kSumBlocks);
  check_launch("squared_norm kernel launch");
}

void add_bias(void* x, const void* bias, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    add_bias_kernel<T>
        <<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(x), static_cast<const T*>(bias), rows, cols);
  });
  check_launch("add_bias_ kernel launch");
}

void sum_rows(float* out, const void* x, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sum_rows_kernel<T>
        <<<column_blocks(cols), dim3(kColTile, kRowLanes), 0, s>>>(out, static_cast<const T*>(x), rows, cols);
  });
  check_launch("sum_rows kernel launch");
}

void layernorm(void* y, float* mean, float* rstd, const void* x, DType t, const void* gamma, const void* beta,
               DType param_t, std::int64_t rows, std::int64_t cols, float eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    layernorm_kernel<T><<<row_blocks(rows, "layernorm"), kThreads, 0, s>>>(
        static_cast<T*>(y), mean, rstd, static_cast<const T*>(x), AnyIn{gamma, param_t}, AnyIn{beta, param_t},
        cols, eps);
  });
  check_launch("layernorm kernel launch");
}

void layernorm_backward(void* dx, float* dgamma, float* dbeta, const void* dy, const void* x, DType t,
                        const void* gamma, DType param_t, const float* mean, const float* rstd,
                        std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows > 0) {
      layernorm_dx_kernel<T><<<row_blocks(rows, "layernorm_backward"), kThreads, 0, s>>>(
          static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x), AnyIn{gamma, param_t},
          mean, rstd, cols);
      check_launch("layernorm_backward kernel launch");
    }
    layernorm_dparams_kernel<T><<<column_blocks(cols), dim3(kColTile, kRowLanes), 0, s>>>(
        dgamma, dbeta, static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, rows, cols);
  });
  check_launch("layernorm_backward kernel launch");
}

void rmsnorm(void* y, float* rstd, const void* x, DType t, const void* gamma, std::int64_t rows,
             std::int64_t cols, float eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rmsnorm_kernel<T><<<row_blocks(rows, "rmsnorm"), kThreads, 0, s>>>(
        static_cast<T*>(y), rstd, static_cast<const T*>(x), static_cast<const T*>(gamma), cols, eps);
  });
  check_launch("rmsnorm kernel launch");
}

void rmsnorm_backward(void* dx, float* dgamma, const void* dy, const void* x, DType t, const void* gamma,
                      const float* rstd, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows > 0) {
      rmsnorm_dx_kernel<T><<<row_blocks(rows, "rmsnorm_backward"), kThreads, 0, s>>>(
          static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x),
          static_cast<const T*>(gamma), rstd, cols);
      check_launch("rmsnorm_backward kernel launch");
    }
    rmsnorm_dgamma_kernel<T><<<column_blocks(cols), dim3(kColTile, kRowLanes), 0, s>>>(
        dgamma, static_cast<const T*>(dy), static_cast<const T*>(x), rstd, rows, cols);
  });
  check_launch("rmsnorm_backward kernel launch");
}

void swiglu(void* y, const void* x, DType t, std::int64_t n, const GluSpec& glu, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(y), static_cast<const T*>(x), n, glu);
  });
  check_launch("swiglu kernel launch");
}

void swiglu_backward(void* dx, const void* dy, const void* x, DType t, std::int64_t n, const GluSpec& glu,
                     cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_backward_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x), n, glu);
  });
  check_launch("swiglu_backward kernel launch");
}

void rope(void* qkv, DType t, const AttentionShape& a, std::int64_t first_position, double base, bool inverse,
          cudaStream_t s) {
  const std::int64_t n = a.seq * a.batch * (a.heads + a.kv_heads) * (a.head_dim / 2);
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rope_kernel<T>
        <<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(qkv), a, first_position, base, inverse, n);
  });
  check_launch("rope kernel launch");
}

void gelu(void* y, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gelu_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(y), static_cast<const T*>(x), n);
  });
  check_launch("gelu kernel launch");
}

void gelu_backward(void* dx, const void* dy, const void* x, DType t, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gelu_backward_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(dx), static_cast<const T*>(dy),
                                                               static_cast<const T*>(x), n);
  });
  check_launch("gelu_backward kernel launch");
}

void dropout(void* y, const void* x, DType t, std::int64_t rows, std::int64_t cols, float p,
             std::uint64_t seed, std::int64_t first_row, std::int64_t split, std::int64_t second_row,
             cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dropout_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(y), static_cast<const T*>(x), rows,
                                                         cols, p, seed, first_row, split, second_row);
  });
  check_launch("dropout kernel launch");
}

namespace {
// The per-query and per-key kernels' launches, which the whole attention (O = T, keys in qkv, results
// written) and the context-parallel blocks (keys in kv, results merged or added) share.
template <typename T, typename O>
void launch_attention(O* out, float* lse, const T* qkv, const T* keys, KeyValues kvs,
                      const AttentionBlockShape& k, AnyIn sinks, bool merge, const char* name,
                      cudaStream_t s) {
  const std::int64_t blocks = k.a.batch * k.a.heads * (k.q_end - k.q_first);
  const float scale = 1.0f / sqrtf(static_cast<float>(k.a.head_dim));
  const size_t shared = sizeof(float) * (static_cast<size_t>(k.a.head_dim) + kAttnTile + 32);
  attention_kernel<T, O>
      <<<row_blocks(blocks, name), kAttnTile, shared, s>>>(out, lse, qkv, keys, kvs, k, sinks, scale, merge);
  check_launch(name);
}
template <typename T, typename O>
void launch_attention_backward(T* dqkv, T* dkeys, KeyValues dkvs, float* delta, const O* dout, const T* qkv,
                               const T* keys, KeyValues kvs, const O* out, const float* lse,
                               const AttentionBlockShape& k, bool accumulate, const char* name,
                               cudaStream_t s) {
  const std::int64_t blocks = k.a.batch * k.a.heads * (k.q_end - k.q_first);
  const float scale = 1.0f / sqrtf(static_cast<float>(k.a.head_dim));
  const size_t shared = sizeof(float) * (2 * static_cast<size_t>(k.a.head_dim) + 2 * kAttnTile + 32);
  attention_dq_kernel<T, O><<<row_blocks(blocks, name), kAttnTile, shared, s>>>(
      dqkv, delta, dout, qkv, keys, kvs, out, lse, k, scale, accumulate);
  check_launch(name);
  // One block per (sample, key-value head, key).
  attention_dkv_kernel<T, O><<<row_blocks(k.a.batch * k.a.kv_heads * k.kv_seq, name), kAttnTile, shared, s>>>(
      dkeys, dkvs, delta, dout, qkv, keys, kvs, lse, k, scale, accumulate);
  check_launch(name);
}
}  // namespace

void attention(void* out, float* lse, const void* qkv, DType t, const void* sinks, DType sinks_t,
               const AttentionShape& a, cudaStream_t s) {
  if (a.batch * a.heads * a.seq == 0 || a.head_dim == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* q = static_cast<const T*>(qkv);
    launch_attention<T, T>(static_cast<T*>(out), lse, q, q, in_qkv(a), whole(a), AnyIn{sinks, sinks_t}, false,
                           "attention kernel launch", s);
  });
}

void attention_backward(void* dqkv, float* delta, const void* dout, const void* qkv, const void* out,
                        const float* lse, DType t, const AttentionShape& a, cudaStream_t s) {
  if (a.batch * a.heads * a.seq == 0 || a.head_dim == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* q = static_cast<const T*>(qkv);
    T* d = static_cast<T*>(dqkv);
    launch_attention_backward<T, T>(d, d, in_qkv(a), delta, static_cast<const T*>(dout), q, q, in_qkv(a),
                                    static_cast<const T*>(out), lse, whole(a), false,
                                    "attention_backward kernel launch", s);
  });
}

void key_values(void* qkv, void* kv, DType t, const AttentionShape& a, bool add, cudaStream_t s) {
  const std::int64_t n = a.seq * a.batch * 2 * a.kv_heads * a.head_dim;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    key_values_kernel<T>
        <<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(qkv), static_cast<T*>(kv), a, add, n);
  });
  check_launch("key_values kernel launch");
}

void attention_block(void* out, DType out_t, float* lse, const void* qkv, const void* kv, DType t,
                     const AttentionBlockShape& k, cudaStream_t s) {
  if (k.a.batch * k.a.heads * (k.q_end - k.q_first) <= 0 || k.a.head_dim == 0 || k.kv_seq == 0) return;
  dispatch_pair(t, out_t, [&](auto tag, auto out_tag) {
    using T = typename decltype(tag)::type;
    using O = typename decltype(out_tag)::type;
    // A block takes no sinks: attention_sinks_ merges them once, after the blocks.
    launch_attention<T, O>(static_cast<O*>(out), lse, static_cast<const T*>(qkv), static_cast<const T*>(kv),
                           in_kv(k.a), k, AnyIn{nullptr, DType::Float32}, true,
                           "attention_block_ kernel launch", s);
  });
}

void attention_block_backward(void* dqkv, void* dkv, float* delta, const void* dout, const void* qkv,
                              const void* kv, const void* out, DType out_t, const float* lse, DType t,
                              const AttentionBlockShape& k, cudaStream_t s) {
  if (k.a.batch * k.a.heads * (k.q_end - k.q_first) <= 0 || k.a.head_dim == 0 || k.kv_seq == 0) return;
  dispatch_pair(t, out_t, [&](auto tag, auto out_tag) {
    using T = typename decltype(tag)::type;
    using O = typename decltype(out_tag)::type;
    launch_attention_backward<T, O>(static_cast<T*>(dqkv), static_cast<T*>(dkv), in_kv(k.a), delta,
                                    static_cast<const O*>(dout), static_cast<const T*>(qkv),
                                    static_cast<const T*>(kv), in_kv(k.a), static_cast<const O*>(out), lse, k,
                                    true, "attention_block_backward_ kernel launch", s);
  });
}

void attention_sinks(void* out, DType out_t, float* lse, const void* sinks, DType sinks_t, std::int64_t seq,
                     std::int64_t batch, int heads, std::int64_t head_dim, cudaStream_t s) {
  const std::int64_t queries = batch * heads * seq;
  if (queries == 0) return;
  dispatch(out_t, [&](auto tag) {
    using O = typename decltype(tag)::type;
    attention_sinks_kernel<O><<<blocks_for(32 * queries), kThreads, 0, s>>>(
        static_cast<O*>(out), lse, AnyIn{sinks, sinks_t}, seq, batch, heads, head_dim);
  });
  check_launch("attention_sinks_ kernel launch");
}

void attention_sinks_backward(float* dsinks, const void* dout, const void* out, DType out_t, const float* lse,
                              const void* sinks, DType sinks_t, std::int64_t seq, std::int64_t batch,
                              int heads, std::int64_t head_dim, cudaStream_t s) {
  if (heads == 0) return;
  dispatch(out_t, [&](auto tag) {
    using O = typename decltype(tag)::type;
    // One block per head; kThreads, as block_sum_d takes.
    attention_sinks_backward_kernel<O><<<row_blocks(heads, "attention_sinks_backward"), kThreads, 0, s>>>(
        dsinks, static_cast<const O*>(dout), static_cast<const O*>(out), lse, AnyIn{sinks, sinks_t}, seq,
        batch, head_dim);
  });
  check_launch("attention_sinks_backward kernel launch");
}

void embedding(void* out, const float* ids, const void* table, DType t, std::int64_t rows, std::int64_t cols,
               std::int64_t shard_rows, std::int64_t vocab_start, cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(
        static_cast<T*>(out), ids, static_cast<const T*>(table), rows, cols, shard_rows, vocab_start);
  });
  check_launch("embedding kernel launch");
}

void embedding_backward(float* dtable, const void* dy, DType t, const float* ids, std::int64_t rows,
                        std::int64_t cols, std::int64_t shard_rows, std::int64_t vocab_start,
                        cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_backward_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(dtable, static_cast<const T*>(dy), ids,
                                                                    rows, cols, shard_rows, vocab_start);
  });
  check_launch("embedding_backward_ kernel launch");
}

void row_max(float* out, const void* logits, DType t, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (rows == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_max_kernel<T>
        <<<row_blocks(rows, "row_max"), kThreads, 0, s>>>(out, static_cast<const T*>(logits), cols);
  });
  check_launch("row_max kernel launch");
}

void softmax_stats(float* out, const void* logits, DType t, const float* row_max, const float* targets,
                   std::int64_t rows, std::int64_t cols, std::int64_t vocab_start, cudaStream_t s) {
  if (rows == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_stats_kernel<T><<<row_blocks(rows, "softmax_stats"), kThreads, 0, s>>>(
        out, static_cast<const T*>(logits), row_max, targets, cols, vocab_start);
  });
  check_launch("softmax_stats kernel launch");
}

void cross_entropy_loss(float* out, const float* row_max, const float* stats, std::int64_t rows,
                        cudaStream_t s) {
  cross_entropy_loss_kernel<<<1, kThreads, 0, s>>>(out, row_max, stats, rows);
  check_launch("cross_entropy_loss kernel launch");
}

void cross_entropy_backward(void* dlogits, const void* logits, DType t, const float* row_max,
                            const float* stats, const float* targets, std::int64_t rows, std::int64_t cols,
                            std::int64_t vocab_start, float scale, cudaStream_t s) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cross_entropy_backward_kernel<T>
        <<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(dlogits), static_cast<const T*>(logits), row_max,
                                            stats, targets, rows, cols, vocab_start, scale);
  });
  check_launch("cross_entropy_backward kernel launch");
}

void gather_rows(void* out, const void* x, DType t, const float* index, const float* weights, std::int64_t n,
                 std::int64_t x_rows, std::int64_t cols, cudaStream_t s) {
  const std::int64_t total = n * cols;
  if (total == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gather_rows_kernel<T><<<blocks_for(total), kThreads, 0, s>>>(
        static_cast<T*>(out), static_cast<const T*>(x), index, weights, n, x_rows, cols);
  });
  check_launch("gather_rows kernel launch");
}

void scatter_add_rows(void* out, const void* src, DType t, const std::int64_t* offsets,
                      const std::int64_t* routes, const float* weights, std::int64_t rows, std::int64_t cols,
                      cudaStream_t s) {
  const std::int64_t total = rows * cols;
  if (total == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scatter_add_rows_kernel<T><<<blocks_for(total), kThreads, 0, s>>>(
        static_cast<T*>(out), static_cast<const T*>(src), offsets, routes, weights, rows, cols);
  });
  check_launch("scatter_add_rows kernel launch");
}

void row_dots(float* out, const void* a, const void* b, DType t, std::int64_t n, std::int64_t cols,
              cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_dots_kernel<T><<<row_blocks(n, "row_dots"), kThreads, 0, s>>>(out, static_cast<const T*>(a),
                                                                      static_cast<const T*>(b), cols);
  });
  check_launch("row_dots kernel launch");
}

}  // namespace ranklab::kernels
