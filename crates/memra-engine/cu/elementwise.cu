// Element-wise kernels: bias adds and the gated FFN activation of prompt batches (residual
// adds and the decode step's gated activation are fused into the quantization kernels of
// quant_matvec.cu).
#include "common.cuh"

// The rows of a fused q/k/v product (n x (nq + nk + nv)) into q, k and v (n x nq, n x nk,
// n x nv).
extern "C" __global__ void split_qkv(const float* __restrict__ y, float* __restrict__ q, float* __restrict__ k,
                                     float* __restrict__ v, int nq, int nk, int nv, int n) {
    PDL_WAIT();
    const int w = nq + nk + nv;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * w) return;
    const size_t t = i / w;
    const int c = (int)(i % w);
    const float x = y[i];
    if (c < nq) {
        q[t * nq + c] = x;
    } else if (c < nq + nk) {
        k[t * nk + c - nq] = x;
    } else {
        v[t * nv + c - nq - nk] = x;
    }
}

// y[r][i] += b[i] for rows of length n (total elements `total`).
extern "C" __global__ void add_bias_f32(float* __restrict__ y, const float* __restrict__ b, int n, int total) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % n];
}

// out = act(g) * u as f16, the down projection's GEMM input, one block per row of n.
// Products can outgrow f16 (65504) where activations grow from layer to layer, so a row
// whose largest magnitude passes 2^14 is scaled down by a power of two; `inv_scale[row]`
// gets the factor that scale_rows applies to the projection's output.
extern "C" __global__ void gated_f16(const float* __restrict__ g, const float* __restrict__ u,
                                     __half* __restrict__ out, float* __restrict__ inv_scale, int n, int gelu) {
    PDL_WAIT();
    const size_t base = (size_t)blockIdx.x * n;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) amax = fmaxf(amax, fabsf(gate_act(g[base + i], gelu) * u[base + i]));
    amax = block_max(amax);
    const float scale = amax > 16384.0f ? exp2f(-ceilf(log2f(amax / 16384.0f))) : 1.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[base + i] = __float2half(gate_act(g[base + i], gelu) * u[base + i] * scale);
    }
    if (threadIdx.x == 0) inv_scale[blockIdx.x] = 1.0f / scale;
}

// x[row] *= s[row] for rows of n (one block per row).
extern "C" __global__ void scale_rows(float* __restrict__ x, const float* __restrict__ s, int n) {
    PDL_WAIT();
    const float f = s[blockIdx.x];
    if (f == 1.0f) return;
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[(size_t)blockIdx.x * n + i] *= f;
}
