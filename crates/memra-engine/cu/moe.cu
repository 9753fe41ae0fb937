// Mixture-of-experts routing (one token a warp, `moe_route.cuh`) and the weighted sum of the
// chosen experts' outputs (the expert products themselves are the mmvq_moe_* kernels of
// quant_matvec.cu).
#include "moe_route.cuh"

#define MOE_ROUTE(NPL)                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE)                                                     \
        moe_route_##NPL(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights,   \
                        int n_exp, int n_used, int normalize) {                                                 \
        PDL_WAIT();                                                                                             \
        const size_t t = blockIdx.x;                                                                            \
        moe_route_warp<NPL>(logits + t * n_exp, ids + t * n_used, weights + t * n_used, n_exp, n_used, normalize); \
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
