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
// o is `parts` arrays of rows `stride` floats apart, added in part order: a product's
// rows (parts 1), or the split sums of a tile product, which this adds as qgemm_reduce
// would (so that a step needs no reduce launch before the norm). Where s is given the sum
// is times s[row] (the gated activation's factor, as scale_rows would apply it).
extern "C" __global__ void add_norm_f16(float* __restrict__ x, const float* __restrict__ o,
                                        const float* __restrict__ s, const float* __restrict__ w,
                                        __half* __restrict__ out, int n, int parts, long long stride,
                                        float eps) {
    PDL_WAIT();
    float* xr = x + (size_t)blockIdx.x * n;
    const float* orow = o ? o + (size_t)blockIdx.x * n : nullptr;
    const float f = s ? s[blockIdx.x] : 1.0f;
    float ss = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (orow) {
            const float* src = orow + i;
            const float acc = add_parts(src[0], src, (size_t)stride, 1, parts);
            v += __fmul_rn(acc, f);  // rounded apart, as scale_rows then the add did
            xr[i] = v;
        }
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / n + eps);
    __half* outr = out + (size_t)blockIdx.x * n;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) outr[i] = __float2half(xr[i] * scale * w[i]);
}
