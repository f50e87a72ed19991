// The real backend's own CUDA kernels: everything a lesson computes that is not a matrix product (cuBLAS
// does those). Each launches on the given stream and returns at once; sizes are element counts.
//
// Plain declarations, so the C++ side of the backend needs no CUDA compiler: only kernels.cu does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ranklab::kernels {

void fill(float* out, std::int64_t n, float value, cudaStream_t s);
void arange(float* out, std::int64_t n, float start, cudaStream_t s);
// out[i] = std * normal_at(seed, i): the counter-based generator of common/random.h, as the simulator.
void randn(float* out, std::int64_t n, std::uint64_t seed, float std, cudaStream_t s);
void relu(float* out, const float* x, std::int64_t n, cudaStream_t s);
void relu_backward(float* out, const float* grad_out, const float* x, std::int64_t n, cudaStream_t s);
void add(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t s);
void axpy(float* dst, const float* src, float alpha, std::int64_t n, cudaStream_t s);  // dst += alpha src
void scale(float* t, float factor, std::int64_t n, cudaStream_t s);
void sgd_step(float* param, const float* grad, float lr, std::int64_t n, cudaStream_t s);
// AdamW with the bias corrections 1 - beta^t computed by the caller.
void adamw_step(float* param, const float* grad, float* m, float* v, float lr, float beta1, float beta2,
                float eps, float weight_decay, float bias_correction1, float bias_correction2, std::int64_t n,
                cudaStream_t s);

// Scratch doubles sum() needs: one partial per block of the first pass.
constexpr int kSumBlocks = 256;
// out[0] = the sum of x[0..n), accumulated in double in a fixed order, so it is deterministic.
void sum(float* out, const float* x, std::int64_t n, double* scratch, cudaStream_t s);

}  // namespace ranklab::kernels
