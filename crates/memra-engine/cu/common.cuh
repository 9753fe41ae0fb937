// Shared helpers of memra's CUDA kernels: warp reductions and launch constants.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#define WARP_SIZE 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, offset);
    }
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = lane < n_warps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}
