// Element-wise kernels: bias adds and the gated FFN activation of prompt batches (residual
// adds and the decode step's gated activation are fused into the quantization kernels of
// quant_matvec.cu).
#include "common.cuh"

// y[r][i] += b[i] for rows of length n (total elements `total`).
extern "C" __global__ void add_bias_f32(float* __restrict__ y, const float* __restrict__ b, int n, int total) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % n];
}

// out = act(g) * u as f16, the down projection's GEMM input, for rows of n. Products can
// outgrow f16 (65504) where activations grow from layer to layer, so a row whose largest
// magnitude passes 2^14 is scaled down by a power of two; scale_rows applies the inverse
// to the projection's output. A row is spread over GATED_CHUNK-column blocks (grid x) so
// that a step of a few rows still fills the GPU: one block a row of 14,336 took 48 us for
// 32 rows on the H200, about 20 times what its bytes cost. Two passes: gated_amax writes
// each chunk's largest magnitude after the rows' factors in `scales` (rows x (1 + chunks)),
// gated_f16 reduces a row's chunks, writes its f16 values and (chunk 0) the row's factor.
// Rows of g and u are ld apart (n, or 2n where both are one fused product's rows).
#define GATED_CHUNK 1024

extern "C" __global__ void gated_amax(const float* __restrict__ g, const float* __restrict__ u,
                                      float* __restrict__ scales, int n, int ld, int gelu) {
    PDL_WAIT();
    const size_t base = (size_t)blockIdx.y * ld;
    const int end = min(n, (int)(blockIdx.x + 1) * GATED_CHUNK);
    float amax = 0.0f;
#pragma unroll 4
    for (int i = blockIdx.x * GATED_CHUNK + threadIdx.x; i < end; i += blockDim.x) {
        amax = fmaxf(amax, fabsf(gate_act(g[base + i], gelu) * u[base + i]));
    }
    amax = block_max(amax);
    if (threadIdx.x == 0) scales[gridDim.y + (size_t)blockIdx.y * gridDim.x + blockIdx.x] = amax;
}

extern "C" __global__ void gated_f16(const float* __restrict__ g, const float* __restrict__ u,
                                     __half* __restrict__ out, float* __restrict__ scales, int n, int ld,
                                     int gelu) {
    PDL_WAIT();
    const int row = blockIdx.y, chunks = gridDim.x;
    const float* part = scales + gridDim.y + (size_t)row * chunks;
    float amax = 0.0f;
    for (int c = 0; c < chunks; c++) amax = fmaxf(amax, part[c]);
    const float scale = amax > 16384.0f ? exp2f(-ceilf(log2f(amax / 16384.0f))) : 1.0f;
    const size_t base = (size_t)row * ld, out_base = (size_t)row * n;
    const int end = min(n, (int)(blockIdx.x + 1) * GATED_CHUNK);
#pragma unroll 4
    for (int i = blockIdx.x * GATED_CHUNK + threadIdx.x; i < end; i += blockDim.x) {
        out[out_base + i] = __float2half(gate_act(g[base + i], gelu) * u[base + i] * scale);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) scales[row] = 1.0f / scale;
}

// x[row] *= s[row] for rows of n (one block per row).
extern "C" __global__ void scale_rows(float* __restrict__ x, const float* __restrict__ s, int n) {
    PDL_WAIT();
    const float f = s[blockIdx.x];
    if (f == 1.0f) return;
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[(size_t)blockIdx.x * n + i] *= f;
}
