// Rotary position embedding. Pairs are (2i, 2i+1) when `halves` is 0 (Llama),
// (i, i + n_dims/2) otherwise (NeoX, Qwen, Gemma); dimensions past n_dims pass through;
// freq_factors (n_dims/2, Llama 3.1 scaling) may be null.
#include "common.cuh"

__device__ __forceinline__ void rotate(const float* src, int i, int half, int n_dims, int pos, float base,
                                       float freq_scale, const float* freq_factors, int halves, float& a,
                                       float& b) {
    float theta = powf(base, -2.0f * i / n_dims);
    if (freq_factors) theta /= freq_factors[i];
    float s, c;
    sincosf(pos * freq_scale * theta, &s, &c);
    const float x0 = src[halves ? i : 2 * i], x1 = src[halves ? i + half : 2 * i + 1];
    a = x0 * c - x1 * s;
    b = x0 * s + x1 * c;
}

// RoPE on q (n_head heads per token, in place) and k (n_head_kv heads, written rotated
// into the f16 cache), and v copied into the cache: one launch instead of two RoPEs and two
// copies. Token t of the batch (blockIdx.y) sits at position pos[t] and writes cache row
// slot[t] (its sequence's block and offset in the paged pool); both are read on the device
// so that a captured decode graph replays with new ones. One thread per rotation pair, per
// passed-through k element and per v element.
extern "C" __global__ void rope_qk_append(float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, __half* __restrict__ k_cache,
                                          __half* __restrict__ v_cache, int n_head, int n_head_kv, int head_dim,
                                          int dv, int n_dims, const int* __restrict__ pos,
                                          const int* __restrict__ slot, float base,
                                          float freq_scale, const float* __restrict__ freq_factors, int halves) {
    // The batch arrays were copied before the step began: read them before waiting for
    // the previous kernel.
    const int t = blockIdx.y, p = pos[t];
    const size_t cache_row = (size_t)slot[t];
    PDL_WAIT();
    const int half = n_dims / 2;
    const int q_pairs = n_head * half, k_pairs = n_head_kv * half;
    const int k_rest = n_head_kv * (head_dim - n_dims), v_n = n_head_kv * dv;
    q += (size_t)t * n_head * head_dim;
    k += (size_t)t * n_head_kv * head_dim;
    v += (size_t)t * v_n;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    __half* k_row = k_cache + cache_row * n_head_kv * head_dim;
    if (idx < q_pairs) {
        float* qh = q + (size_t)(idx / half) * head_dim;
        float a, b;
        rotate(qh, idx % half, half, n_dims, p, base, freq_scale, freq_factors, halves, a, b);
        const int i = idx % half;
        qh[halves ? i : 2 * i] = a;
        qh[halves ? i + half : 2 * i + 1] = b;
        return;
    }
    idx -= q_pairs;
    if (idx < k_pairs) {
        const int h = idx / half, i = idx % half;
        float a, b;
        rotate(k + (size_t)h * head_dim, i, half, n_dims, p, base, freq_scale, freq_factors, halves, a, b);
        k_row[(size_t)h * head_dim + (halves ? i : 2 * i)] = __float2half(a);
        k_row[(size_t)h * head_dim + (halves ? i + half : 2 * i + 1)] = __float2half(b);
        return;
    }
    idx -= k_pairs;
    if (idx < k_rest) {
        const int rest = head_dim - n_dims;
        const int h = idx / rest, e = n_dims + idx % rest;
        k_row[(size_t)h * head_dim + e] = __float2half(k[(size_t)h * head_dim + e]);
        return;
    }
    idx -= k_rest;
    if (idx < v_n) {
        v_cache[cache_row * v_n + idx] = __float2half(v[idx]);
    }
}
