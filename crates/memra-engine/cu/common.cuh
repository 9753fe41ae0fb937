// Shared helpers of memra's CUDA kernels: warp reductions and launch constants.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#define WARP_SIZE 32

// Programmatic dependent launch (sm_90+): in the captured decode graph a kernel may be
// launched while its predecessor is still finishing; it waits here, before touching
// memory, until the predecessor has completed and its writes are visible, then lets its
// own successor launch. Elsewhere (no programmatic dependency, or an older arch) this is
// a no-op. Every kernel starts with it. Measured on the H200 (docs/cuda.md): waiting alone
// gave tg128 288-292 t/s in a fresh process but 280-283 after prompt tests in the same
// process; with the early trigger 290-291 in both.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait; griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT()
#endif

// A hint to bring bytes [p, p + n) into L2 (sm_90's bulk prefetch: one instruction, by one
// thread). It returns nothing to registers and global memory is coherent in L2, so it may
// run before PDL_WAIT even over bytes the previous kernel is still writing: the one-token
// products start their weights' trip from DRAM while the previous kernel finishes. The
// range is shrunk to 16-byte bounds, as the instruction needs; the bytes at the edges come
// later, by the loads themselves.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const size_t a = (size_t)p, s = (a + 15) & ~(size_t)15, e = (a + n) & ~(size_t)15;
    if (e > s) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"((unsigned)(e - s)) : "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, offset);
    }
    return v;
}

// acc + src[p * stride] for p = first .. parts-1, added in part order (a tile product's
// split sums: qgemm_reduce and add_norm_f16 both add them so, and must agree), four loads in
// flight at once: a loop of one load after another waited on each.
__device__ __forceinline__ float add_parts(float acc, const float* __restrict__ src, size_t stride, int first,
                                           int parts) {
    int p = first;
    for (; p + 4 <= parts; p += 4) {
        const float a = src[p * stride], b = src[(p + 1) * stride], c = src[(p + 2) * stride],
                    d = src[(p + 3) * stride];
        acc += a;
        acc += b;
        acc += c;
        acc += d;
    }
    for (; p < parts; ++p) acc += src[p * stride];
    return acc;
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

// Max over a block of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = lane < n_warps ? partial[lane] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();
    return v;
}

// The whole warp quantizes one block of 32 values, lane l holding value v of element i
// (i % 32 == l): int8 q[i], scale d = max|v| / 127, and s = d * sum(q) per block. Lanes
// with `valid` false take part in the reductions with v = 0 and write nothing.
__device__ __forceinline__ void quantize_warp_block(float v, int i, bool valid, int8_t* __restrict__ q,
                                                    float* __restrict__ d, float* __restrict__ s) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    const float scale = amax / 127.0f;
    const int qi = amax == 0.0f ? 0 : (int)roundf(v / scale);
    const float sum = warp_sum((float)qi);
    if (valid) {
        q[i] = (int8_t)qi;
        if (i % 32 == 0) {
            d[i / 32] = scale;
            s[i / 32] = scale * sum;
        }
    }
}

// The FFN gate: GELU (tanh approximation) when `gelu`, else SiLU.
__device__ __forceinline__ float gate_act(float x, int gelu) {
    return gelu ? 0.5f * x * (1.0f + tanhf(0.7978845608f * x * (1.0f + 0.044715f * x * x))) : x / (1.0f + expf(-x));
}
