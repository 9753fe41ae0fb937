// Mixture-of-experts routing and the weighted sum of the chosen experts' outputs (the
// expert products themselves are the mmvq_moe_* kernels of quant_matvec.cu).
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

// Per token (one warp each): softmax over the router's n_exp logits, the n_used most
// probable experts (ties: the lower index, as the CPU engine sorts), their probabilities
// renormalized to sum to one when `normalize`. ids, weights: n_tok x n_used.
// A lane holds logits lane, lane + 32, ... (NPL of them, n_exp <= 32 * NPL) in registers as
// order-preserving keys, all loaded at once; each pick is two warp reductions (sm_80's
// redux: the largest key, then the lowest index holding it), and lane k keeps pick k.
// The earlier kernel reread the logits from memory in every pass and kept its picks in a
// dynamically indexed (local memory) array: 1,558 instructions at 7.9 cycles apart, 8 us
// under Nsight Compute for one token of the 30B-A3B.
template <int NPL>
__device__ __forceinline__ void moe_route_warp(const float* __restrict__ logits, int* __restrict__ ids,
                                               float* __restrict__ weights, int n_exp, int n_used, int normalize) {
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (size_t)t * n_exp;
    float v[NPL];
#pragma unroll
    for (int j = 0; j < NPL; ++j) v[j] = lane + 32 * j < n_exp ? l[lane + 32 * j] : -INFINITY;
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
        ids[(size_t)t * n_used + lane] = my_id;
        weights[(size_t)t * n_used + lane] = normalize ? p / total : p;
    }
}

#define MOE_ROUTE(NPL)                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE)                                                     \
        moe_route_##NPL(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights,   \
                        int n_exp, int n_used, int normalize) {                                                 \
        PDL_WAIT();                                                                                             \
        moe_route_warp<NPL>(logits, ids, weights, n_exp, n_used, normalize);                                    \
    }

// Up to 32, 64, 128, 256, 512, 1024 experts.
MOE_ROUTE(1)
MOE_ROUTE(2)
MOE_ROUTE(4)
MOE_ROUTE(8)
MOE_ROUTE(16)
MOE_ROUTE(32)

// out[t] = sum over k of weights[t][k] * y[t][k] (y: n_tok x n_used x n); one thread per
// output element (block row blockIdx.y is token t), the n_used loads in flight together.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       float* __restrict__ out, int n_used, int n) {
    PDL_WAIT();
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v[MAX_USED];
#pragma unroll
    for (int k = 0; k < MAX_USED; ++k) v[k] = k < n_used ? y[((size_t)t * n_used + k) * n + i] : 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_USED; ++k) {
        if (k < n_used) acc += weights[(size_t)t * n_used + k] * v[k];
    }
    out[(size_t)t * n + i] = acc;
}

// Groups a batch's (token, choice) pairs by expert for the grouped products (one block):
// slot_tok[slot] = the pair's token, slot_of[pair] = its slot, slots of an expert
// consecutive, experts in order; tiles of at most `bn` slots of one expert, (expert, first
// slot, count), and their count in *tiles_n. Shared memory: 3 ints an expert. A slot's place
// among its expert's slots depends on the order of atomics, which changes no result: every
// product reads only its own slot's row.
extern "C" __global__ void moe_group(const int* __restrict__ ids, int* __restrict__ slot_tok,
                                     int* __restrict__ slot_of, int* __restrict__ tiles, int* __restrict__ tiles_n,
                                     int n_pairs, int n_used, int n_exp, int bn) {
    PDL_WAIT();
    extern __shared__ int group_sh[];
    int *cnt = group_sh, *off = group_sh + n_exp, *cur = group_sh + 2 * n_exp;
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) cnt[e] = cur[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    // Offsets and tiles: a warp scan over experts, 32 at a time.
    if (threadIdx.x < WARP_SIZE) {
        const int lane = threadIdx.x;
        int base = 0, tbase = 0;
        for (int e0 = 0; e0 < n_exp; e0 += WARP_SIZE) {
            const int e = e0 + lane;
            const int c = e < n_exp ? cnt[e] : 0, nt = (c + bn - 1) / bn;
            int sc = c, st = nt;  // inclusive scans
#pragma unroll
            for (int o = 1; o < WARP_SIZE; o <<= 1) {
                const int a = __shfl_up_sync(0xffffffff, sc, o), b = __shfl_up_sync(0xffffffff, st, o);
                if (lane >= o) {
                    sc += a;
                    st += b;
                }
            }
            if (e < n_exp) {
                off[e] = base + sc - c;
                for (int j = 0; j < nt; ++j) {
                    int* t = tiles + 3 * (tbase + st - nt + j);
                    t[0] = e;
                    t[1] = base + sc - c + j * bn;
                    t[2] = min(bn, c - j * bn);
                }
            }
            base += __shfl_sync(0xffffffff, sc, WARP_SIZE - 1);
            tbase += __shfl_sync(0xffffffff, st, WARP_SIZE - 1);
        }
        if (lane == 0) *tiles_n = tbase;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int e = ids[i], slot = off[e] + atomicAdd(&cur[e], 1);
        slot_tok[slot] = i / n_used;
        slot_of[i] = slot;
    }
}

// out[t] = sum over k of weights[t][k] * scale[s] * y[s], s = slot_of[t][k] (y: slots x n,
// scale: the gated activations' f16 range factors per slot); in choice order, as
// moe_combine, one thread per output element.
extern "C" __global__ void moe_combine_slots(const float* __restrict__ y, const int* __restrict__ slot_of,
                                             const float* __restrict__ weights, const float* __restrict__ scale,
                                             float* __restrict__ out, int n_used, int n) {
    PDL_WAIT();
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v[MAX_USED];
#pragma unroll
    for (int k = 0; k < MAX_USED; ++k) {
        if (k < n_used) {
            const int s = slot_of[t * n_used + k];
            v[k] = scale[s] * y[(size_t)s * n + i];
        }
    }
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_USED; ++k) {
        if (k < n_used) acc += weights[(size_t)t * n_used + k] * v[k];
    }
    out[(size_t)t * n + i] = acc;
}
