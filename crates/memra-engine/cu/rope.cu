// Rotary position embedding. Pairs are (2i, 2i+1) when `halves` is 0 (Llama),
// (i, i + n_dims/2) otherwise (NeoX, Qwen, Gemma); dimensions past n_dims pass through;
// freq_factors (n_dims/2, Llama 3.1 scaling) may be null.
#include "common.cuh"

// Decode step: RoPE on q (n_head heads, in place) and k (n_head_kv heads, written rotated
// into its cache row at `pos`), and v copied into its cache row: one launch instead of two
// RoPEs and two copies. One thread per rotation pair, per passed-through k element and per
// v element, so no two threads touch the same value.
__device__ __forceinline__ void rotate(const float* src, float* dst, int i, int half, int n_dims, int pos,
                                       float base, float freq_scale, const float* freq_factors, int halves) {
    float theta = powf(base, -2.0f * i / n_dims);
    if (freq_factors) theta /= freq_factors[i];
    float s, c;
    sincosf(pos * freq_scale * theta, &s, &c);
    const int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
    const float x0 = src[a], x1 = src[b];
    dst[a] = x0 * c - x1 * s;
    dst[b] = x0 * s + x1 * c;
}

extern "C" __global__ void rope_qk_append_f32(float* __restrict__ q, const float* __restrict__ k,
                                              const float* __restrict__ v, float* __restrict__ k_cache,
                                              float* __restrict__ v_cache, int n_head, int n_head_kv,
                                              int head_dim, int dv, int n_dims, int pos, float base,
                                              float freq_scale, const float* __restrict__ freq_factors,
                                              int halves) {
    const int half = n_dims / 2;
    const int q_pairs = n_head * half, k_pairs = n_head_kv * half;
    const int k_rest = n_head_kv * (head_dim - n_dims), v_n = n_head_kv * dv;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    float* k_row = k_cache + (size_t)pos * n_head_kv * head_dim;
    if (idx < q_pairs) {
        float* qh = q + (size_t)(idx / half) * head_dim;
        rotate(qh, qh, idx % half, half, n_dims, pos, base, freq_scale, freq_factors, halves);
        return;
    }
    idx -= q_pairs;
    if (idx < k_pairs) {
        const int h = idx / half;
        rotate(k + (size_t)h * head_dim, k_row + (size_t)h * head_dim, idx % half, half, n_dims, pos, base,
               freq_scale, freq_factors, halves);
        return;
    }
    idx -= k_pairs;
    if (idx < k_rest) {
        const int rest = head_dim - n_dims;
        const int h = idx / rest, e = n_dims + idx % rest;
        k_row[(size_t)h * head_dim + e] = k[(size_t)h * head_dim + e];
        return;
    }
    idx -= k_rest;
    if (idx < v_n) {
        v_cache[(size_t)pos * v_n + idx] = v[idx];
    }
}
