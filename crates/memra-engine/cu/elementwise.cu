// Element-wise kernels: bias adds and gated activations (residual adds are fused into
// add_norm_quantize in quant_matvec.cu).
#include "common.cuh"

// y[r][i] += b[i] for rows of length n (total elements `total`).
extern "C" __global__ void add_bias_f32(float* __restrict__ y, const float* __restrict__ b, int n, int total) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % n];
}

// g[i] = silu(g[i]) * u[i]
extern "C" __global__ void swiglu_f32(float* __restrict__ g, const float* __restrict__ u, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// g[i] = gelu_tanh(g[i]) * u[i]
extern "C" __global__ void geglu_f32(float* __restrict__ g, const float* __restrict__ u, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = g[i];
        const float c = 0.7978845608f * x * (1.0f + 0.044715f * x * x);
        g[i] = 0.5f * x * (1.0f + tanhf(c)) * u[i];
    }
}
