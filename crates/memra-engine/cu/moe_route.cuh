// Routing of a mixture-of-experts layer: one warp picks a token's experts from its router
// logits. Shared by `moe_route_*` (moe.cu) and the router kernel that routes in its last
// block (`moe_router_f32`, quant_matvec.cu), so that both choose the same experts with the
// same weights.
#pragma once

#include "common.cuh"

#define MAX_USED 16

// A float as an unsigned integer of the same order (negative values flipped whole,
// non-negative ones above them; -0 taken as +0, which compare equal), and back.
__device__ __forceinline__ uint32_t ordered_key(float f) {
    const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_key(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// One token's routing by one warp: softmax over its n_exp router logits, the n_used most
// probable experts (ties: the lower index, as the CPU engine sorts) into ids[0..n_used),
// their probabilities renormalized to sum to one when `normalize` into weights.
// A lane holds logits lane, lane + 32, ... (NPL of them, n_exp <= 32 * NPL) in registers as
// order-preserving keys, all loaded at once; each pick is two warp reductions (sm_80's
// redux: the largest key, then the lowest index holding it), and lane k keeps pick k.
// The earlier kernel reread the logits from memory in every pass and kept its picks in a
// dynamically indexed (local memory) array: 1,558 instructions at 7.9 cycles apart, 8 us
// under Nsight Compute for one token of the 30B-A3B.
template <int NPL>
__device__ __forceinline__ void moe_route_warp(const float* __restrict__ logits, int* __restrict__ ids,
                                               float* __restrict__ weights, int n_exp, int n_used, int normalize) {
    const int lane = threadIdx.x % WARP_SIZE;
    // Through L2 (ld.cg): in moe_router_f32 other blocks wrote the logits in this launch.
    float v[NPL];
#pragma unroll
    for (int j = 0; j < NPL; ++j) v[j] = lane + 32 * j < n_exp ? __ldcg(logits + lane + 32 * j) : -INFINITY;
    // Real experts' keys are at least 1, so that taken ones and padding (0) lose to every
    // real one and an id is always below n_exp.
    uint32_t key[NPL];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NPL; ++j) {
        key[j] = lane + 32 * j < n_exp ? max(ordered_key(v[j]), 1u) : 0u;
        mx = fmaxf(mx, v[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NPL; ++j) sum += lane + 32 * j < n_exp ? expf(v[j] - mx) : 0.0f;
    sum = warp_sum(sum);
    int my_id = 0;
    float my_logit = -INFINITY;
    for (int k = 0; k < n_used; ++k) {
        uint32_t bk = 0;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < NPL; ++j) {
            if (key[j] > bk) {  // strictly: the lowest of a lane's equal keys
                bk = key[j];
                bi = lane + 32 * j;
            }
        }
        const uint32_t mk = __reduce_max_sync(0xffffffff, bk);
        const int at = (int)__reduce_min_sync(0xffffffff, bk == mk ? (uint32_t)bi : 0x7fffffffu);
#pragma unroll
        for (int j = 0; j < NPL; ++j) {
            if (at == lane + 32 * j) key[j] = 0;
        }
        if (lane == k) {
            my_id = at;
            my_logit = from_ordered_key(mk);
        }
    }
    const float p = lane < n_used ? expf(my_logit - mx) / sum : 0.0f;
    const float total = warp_sum(p);
    if (lane < n_used) {
        ids[lane] = my_id;
        weights[lane] = normalize ? p / total : p;
    }
}

// The warp's routing for n_exp <= 1024 experts, by the kernel width that holds them.
__device__ __forceinline__ void moe_route_any(const float* __restrict__ logits, int* __restrict__ ids,
                                              float* __restrict__ weights, int n_exp, int n_used, int normalize) {
    const int npl = (n_exp + WARP_SIZE - 1) / WARP_SIZE;
    if (npl <= 1) moe_route_warp<1>(logits, ids, weights, n_exp, n_used, normalize);
    else if (npl <= 2) moe_route_warp<2>(logits, ids, weights, n_exp, n_used, normalize);
    else if (npl <= 4) moe_route_warp<4>(logits, ids, weights, n_exp, n_used, normalize);
    else if (npl <= 8) moe_route_warp<8>(logits, ids, weights, n_exp, n_used, normalize);
    else if (npl <= 16) moe_route_warp<16>(logits, ids, weights, n_exp, n_used, normalize);
    else moe_route_warp<32>(logits, ids, weights, n_exp, n_used, normalize);
}
