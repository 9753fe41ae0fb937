// Normalization kernels.
#include "common.cuh"

// RMS norm of each row of x (rows x n), times weight (n), in place; one block per row.
// Matches the CPU reference: x / sqrt(mean(x^2) + eps) * w, accumulated in f32.
extern "C" __global__ void rms_norm_inplace_f32(float* __restrict__ x, const float* __restrict__ weight, int n,
                                                float eps) {
    PDL_WAIT();
    float* xr = x + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        ss += xr[i] * xr[i];
    }
    const float scale = rsqrtf(block_sum(ss) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        xr[i] = xr[i] * scale * weight[i];
    }
}

// Prompt batches: x += o (o may be null), then the RMS norm of each row times w, written as
// f16 for the next GEMM. One block per row of n, launched with ADD_NORM_THREADS: a row's
// loads are issued together (256 threads looping over a row of 4,096 waited on one load
// after another, 13 us a launch for 32 rows on the H200).
extern "C" __global__ void add_norm_f16(float* __restrict__ x, const float* __restrict__ o,
                                        const float* __restrict__ w, __half* __restrict__ out, int n, float eps) {
    PDL_WAIT();
    float* xr = x + (size_t)blockIdx.x * n;
    const float* orow = o ? o + (size_t)blockIdx.x * n : nullptr;
    float ss = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (orow) {
            v += orow[i];
            xr[i] = v;
        }
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / n + eps);
    __half* outr = out + (size_t)blockIdx.x * n;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) outr[i] = __float2half(xr[i] * scale * w[i]);
}
