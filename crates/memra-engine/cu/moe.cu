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
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ weights, int n_exp, int n_used, int normalize) {
    PDL_WAIT();
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (size_t)t * n_exp;
    float mx = -INFINITY;
    for (int i = lane; i < n_exp; i += WARP_SIZE) mx = fmaxf(mx, l[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    float sum = 0.0f;
    for (int i = lane; i < n_exp; i += WARP_SIZE) sum += expf(l[i] - mx);
    sum = warp_sum(sum);
    // Pick the best remaining expert n_used times; `taken` marks chosen ones per lane slot.
    uint32_t taken = 0;  // bit k: expert lane + 32k chosen (n_exp <= 1024)
    float chosen_p[MAX_USED];
    int chosen_i[MAX_USED];
    float total = 0.0f;
    for (int k = 0; k < n_used; ++k) {
        float best = -INFINITY;
        int at = 0x7fffffff;
        for (int i = lane, j = 0; i < n_exp; i += WARP_SIZE, ++j) {
            if (!((taken >> j) & 1) && (l[i] > best || (l[i] == best && i < at))) {
                best = l[i];
                at = i;
            }
        }
        // The warp's best by two reductions (sm_80's redux) instead of ten shuffles: the
        // largest logit as an order-preserving integer, then the lowest index holding it.
        const uint32_t mk = __reduce_max_sync(0xffffffff, ordered_key(best));
        at = (int)__reduce_min_sync(0xffffffff, ordered_key(best) == mk ? (uint32_t)at : 0x7fffffffu);
        best = from_ordered_key(mk);
        if (at % WARP_SIZE == lane) taken |= 1u << (at / WARP_SIZE);
        chosen_i[k] = at;
        chosen_p[k] = expf(best - mx) / sum;
        total += chosen_p[k];
    }
    if (lane < n_used) {
        float p = 0.0f;
        int id = 0;
        for (int k = 0; k < MAX_USED; ++k) {
            if (k == lane) {
                p = chosen_p[k];
                id = chosen_i[k];
            }
        }
        ids[(size_t)t * n_used + lane] = id;
        weights[(size_t)t * n_used + lane] = normalize ? p / total : p;
    }
}

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
