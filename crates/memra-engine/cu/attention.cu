// Attention for one query token over the cached keys and values (decode).
//
// q: n_head x dk; k_cache: positions x (n_head_kv * dk); v_cache: positions x
// (n_head_kv * dv); out: n_head x dv. The query sees positions first..n_kv-1 (first > 0
// for sliding-window layers). One block per head; scores live in dynamic shared memory
// (n_kv - first floats).
#include "common.cuh"

extern "C" __global__ void attn_decode_f32(const float* __restrict__ q, const float* __restrict__ k_cache,
                                           const float* __restrict__ v_cache, float* __restrict__ out,
                                           int n_head, int n_head_kv, int dk, int dv, int first, int n_kv,
                                           float scale) {
    extern __shared__ float scores[];
    const int h = blockIdx.x;
    const int kvh = h / (n_head / n_head_kv);
    const float* qh = q + (size_t)h * dk;
    const int n = n_kv - first;
    float local_max = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float* kj = k_cache + (size_t)(first + j) * n_head_kv * dk + (size_t)kvh * dk;
        float s = 0.0f;
        for (int d = 0; d < dk; ++d) s += qh[d] * kj[d];
        s *= scale;
        scores[j] = s;
        local_max = fmaxf(local_max, s);
    }
    // Block max.
    __shared__ float red[WARP_SIZE];
    float m = local_max;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (threadIdx.x % WARP_SIZE == 0) red[threadIdx.x / WARP_SIZE] = m;
    __syncthreads();
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    m = threadIdx.x < n_warps ? red[threadIdx.x] : -INFINITY;
    if (threadIdx.x < WARP_SIZE) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        if (threadIdx.x == 0) red[0] = m;
    }
    __syncthreads();
    const float max = red[0];
    __syncthreads();
    float local_sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(scores[j] - max);
        scores[j] = e;
        local_sum += e;
    }
    const float inv = 1.0f / block_sum(local_sum);
    __syncthreads();
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) {
            acc += scores[j] * v_cache[(size_t)(first + j) * n_head_kv * dv + (size_t)kvh * dv + d];
        }
        out[(size_t)h * dv + d] = acc * inv;
    }
}
