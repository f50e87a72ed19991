// The real backend's elementwise, reduction and optimizer kernels. One file, so CI compiles one
// translation unit per GPU architecture.
//
// Every kernel is a grid-stride loop (each thread handles elements i, i + stride, ...), which keeps the
// launch shape independent of the tensor's size and the indices in 64 bits.
#include "common/random.h"
#include "real/cuda_check.h"
#include "real/kernels.h"

namespace ranklab::kernels {

namespace {

constexpr int kThreads = 256;

// Enough blocks to fill the GPU several times over, and no more: beyond that a grid-stride loop only adds
// scheduling work.
unsigned blocks_for(std::int64_t n) {
  const std::int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65536 ? wanted : 65536);
}

__device__ inline std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

__global__ void fill_kernel(float* out, std::int64_t n, float value) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = value;
}

__global__ void arange_kernel(float* out, std::int64_t n, float start) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = static_cast<float>(i) + start;
}

__global__ void randn_kernel(float* out, std::int64_t n, std::uint64_t seed, float std) {
  for (std::int64_t i = first_index(); i < n; i += stride()) {
    out[i] = std * normal_at(seed, static_cast<std::uint64_t>(i));
  }
}

__global__ void relu_kernel(float* out, const float* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void relu_backward_kernel(float* out, const float* grad_out, const float* x, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = x[i] > 0.0f ? grad_out[i] : 0.0f;
}

__global__ void add_kernel(float* out, const float* a, const float* b, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) out[i] = a[i] + b[i];
}

__global__ void axpy_kernel(float* dst, const float* src, float alpha, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) dst[i] += alpha * src[i];
}

__global__ void scale_kernel(float* t, float factor, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) t[i] *= factor;
}

__global__ void sgd_kernel(float* param, const float* grad, float lr, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += stride()) param[i] -= lr * grad[i];
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

// Sums `value` over the block; the result is valid in thread 0.
__device__ double block_sum(double value) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  return partial[0];
}

// Pass one: each block sums its grid-stride share into scratch[block]. Pass two: one block sums those.
// Both orders are fixed, so the result does not depend on timing (atomics would).
__global__ void sum_partial_kernel(double* scratch, const float* x, std::int64_t n) {
  double acc = 0;
  for (std::int64_t i = first_index(); i < n; i += stride()) acc += x[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) scratch[blockIdx.x] = total;
}

__global__ void sum_final_kernel(float* out, const double* scratch, int parts) {
  double acc = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) acc += scratch[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) out[0] = static_cast<float>(total);
}

void check_launch(const char* kernel) {
  cuda_check(cudaGetLastError(), kernel);
}

}  // namespace

void fill(float* out, std::int64_t n, float value, cudaStream_t s) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, n, value);
  check_launch("fill kernel launch");
}

void arange(float* out, std::int64_t n, float start, cudaStream_t s) {
  if (n == 0) return;
  arange_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, n, start);
  check_launch("arange kernel launch");
}

void randn(float* out, std::int64_t n, std::uint64_t seed, float std, cudaStream_t s) {
  if (n == 0) return;
  randn_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, n, seed, std);
  check_launch("randn kernel launch");
}

void relu(float* out, const float* x, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  relu_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, x, n);
  check_launch("relu kernel launch");
}

void relu_backward(float* out, const float* grad_out, const float* x, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  relu_backward_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, grad_out, x, n);
  check_launch("relu_backward kernel launch");
}

void add(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, a, b, n);
  check_launch("add kernel launch");
}

void axpy(float* dst, const float* src, float alpha, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  axpy_kernel<<<blocks_for(n), kThreads, 0, s>>>(dst, src, alpha, n);
  check_launch("add_ kernel launch");
}

void scale(float* t, float factor, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  scale_kernel<<<blocks_for(n), kThreads, 0, s>>>(t, factor, n);
  check_launch("scale_ kernel launch");
}

void sgd_step(float* param, const float* grad, float lr, std::int64_t n, cudaStream_t s) {
  if (n == 0) return;
  sgd_kernel<<<blocks_for(n), kThreads, 0, s>>>(param, grad, lr, n);
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

void sum(float* out, const float* x, std::int64_t n, double* scratch, cudaStream_t s) {
  sum_partial_kernel<<<kSumBlocks, kThreads, 0, s>>>(scratch, x, n);
  check_launch("sum kernel launch");
  sum_final_kernel<<<1, kThreads, 0, s>>>(out, scratch, kSumBlocks);
  check_launch("sum kernel launch");
}

}  // namespace ranklab::kernels
