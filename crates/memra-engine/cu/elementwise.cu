// Element-wise kernels: bias adds (residual adds and the gated activations are fused into
// the quantization kernels of quant_matvec.cu).
#include "common.cuh"

// y[r][i] += b[i] for rows of length n (total elements `total`).
extern "C" __global__ void add_bias_f32(float* __restrict__ y, const float* __restrict__ b, int n, int total) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % n];
}
