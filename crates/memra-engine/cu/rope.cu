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

// RoPE on q (n_head heads per token, read from q_in and written to q) and k (n_head_kv
// heads, written rotated into the f16 cache), after each head's RMS norm where the
// architecture has QK-norms (q_norm, k_norm: head_dim weights, or null), and v copied
// into the cache: one launch
// instead of two norms, two RoPEs and two copies. Token t of the batch (blockIdx.y) sits at
// position pos[t] and writes cache row slot[t] (its sequence's block and offset in the paged
// pool); both are read on the device so that a captured decode graph replays with new ones.
// The first blocks give a warp to each head (the norm needs the whole head; the rotation
// reads it from shared memory), the rest a thread to each v element. Token t's q, k and v
// start at t * ld_q, t * ld_kv and t * ld_kv of their pointers (k and v inside a fused
// product's rows, whose q part is then rotated into a buffer of its own). q_in may be q: a
// warp reads its whole head into shared memory before it writes any of it.
#define ROPE_WARPS 4

// A fused q|k|v tile product left as split sums (ops::QkvRows::Sums): up to three runs of
// columns, run r holding columns end[r-1] .. end[r]-1 (from 0) as parts[r] arrays of
// slots[r] rows at sums + off[r]. The rope adds them in part order, as qgemm_reduce would,
// so a step needs no reduce launch before it. sums null: the rows are as given.
struct QkvSums {
    const float* sums;
    const float* bias;  // of the fused columns, may be null
    int end[3];
    int parts[3];
    int slots[3];
    long long off[3];
};

__device__ __forceinline__ float qkv_sum(const QkvSums& s, int t, int col) {
    const int r = col < s.end[0] ? 0 : (col < s.end[1] ? 1 : 2);
    const int c0 = r == 0 ? 0 : s.end[r - 1], m = s.end[r] - c0;
    const float* src = s.sums + s.off[r] + (size_t)t * m + (col - c0);
    return add_parts(s.bias ? s.bias[col] : 0.0f, src, (size_t)s.slots[r] * m, 0, s.parts[r]);
}

extern "C" __global__ void __launch_bounds__(ROPE_WARPS * WARP_SIZE)
    rope_qk_append(const float* q_in, float* q, const float* __restrict__ k, const float* __restrict__ v,
                   int ld_q, int ld_kv, __half* __restrict__ k_cache, __half* __restrict__ v_cache, int n_head,
                   int n_head_kv, int head_dim, int dv, int n_dims, const int* __restrict__ pos, const int* __restrict__ slot,
                   float base, float freq_scale, const float* __restrict__ freq_factors, int halves,
                   const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps, QkvSums sums) {
    // The batch arrays were copied before the step began: read them before waiting for
    // the previous kernel.
    const int t = blockIdx.y, p = pos[t];
    const size_t cache_row = (size_t)slot[t];
    PDL_WAIT();
    const int head_blocks = (n_head + n_head_kv + ROPE_WARPS - 1) / ROPE_WARPS;
    if ((int)blockIdx.x >= head_blocks) {
        const int v_n = n_head_kv * dv;
        const int i = (blockIdx.x - head_blocks) * blockDim.x + threadIdx.x;
        if (i < v_n) {
            const float x = sums.sums ? qkv_sum(sums, t, n_head * head_dim + v_n + i) : v[(size_t)t * ld_kv + i];
            v_cache[cache_row * v_n + i] = __float2half(x);
        }
        return;
    }
    __shared__ float hs[ROPE_WARPS][256];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int hw = blockIdx.x * ROPE_WARPS + warp;
    if (hw >= n_head + n_head_kv) return;
    const bool is_q = hw < n_head;
    const int h = is_q ? hw : hw - n_head;
    const float* src = is_q ? q_in + (size_t)t * ld_q + h * head_dim : k + (size_t)t * ld_kv + h * head_dim;
    const int col0 = hw * head_dim;  // the head's first column in fused rows (q's heads, then k's)
    const float* w = is_q ? q_norm : k_norm;
    float* sh = hs[warp];
    // The sum of squares in rms_norm_inplace_f32's order (256 threads, one element each:
    // 32-element warp sums, then their sum across a warp), so that the fused norm gives
    // the separate kernel's values bit for bit: lane j ends with chunk j's sum.
    float part = 0.0f;
    for (int d0 = 0; d0 < head_dim; d0 += WARP_SIZE) {
        const float x = sums.sums ? qkv_sum(sums, t, col0 + d0 + lane) : src[d0 + lane];
        sh[d0 + lane] = x;
        const float c = warp_sum(x * x);
        if (lane == d0 / WARP_SIZE) part = c;
    }
    if (w) {
        // As rms_norm_inplace_f32: x * (1 / sqrt(mean(x^2) + eps)) * w.
        const float scale = rsqrtf(warp_sum(part) / head_dim + eps);
        for (int d = lane; d < head_dim; d += WARP_SIZE) sh[d] = sh[d] * scale * w[d];
    }
    __syncwarp();
    const int half = n_dims / 2;
    float* qh = is_q ? q + ((size_t)t * n_head + h) * head_dim : nullptr;
    __half* kh = is_q ? nullptr : k_cache + (cache_row * n_head_kv + h) * head_dim;
    for (int i = lane; i < half; i += WARP_SIZE) {
        float a, b;
        rotate(sh, i, half, n_dims, p, base, freq_scale, freq_factors, halves, a, b);
        const int ia = halves ? i : 2 * i, ib = halves ? i + half : 2 * i + 1;
        if (is_q) {
            qh[ia] = a;
            qh[ib] = b;
        } else {
            kh[ia] = __float2half(a);
            kh[ib] = __float2half(b);
        }
    }
    for (int e = n_dims + lane; e < head_dim; e += WARP_SIZE) {
        if (is_q) {
            qh[e] = sh[e];
        } else {
            kh[e] = __float2half(sh[e]);
        }
    }
}
