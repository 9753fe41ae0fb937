// Picking the next token on the device, so that only its id crosses to the host: the
// greedy pick (argmax), and sampling as the CPU sampler (`src/sampler.rs`) does it: logit
// bias and repetition penalties, top-k, top-p, min-p, temperature, and a draw with the
// uniform number the host's seeded generator gives.
#include "common.cuh"

// The index of the largest of n logits (the first on ties, as the CPU sampler picks), in
// two launches: blocks of 1024 threads each reduce a slice into (value, index) pairs, then
// one block reduces those. All NaN: index 0, as on the CPU.
__device__ __forceinline__ void better(float& best, int& at, float b, int a) {
    if (b > best || (b == best && a < at)) {
        best = b;
        at = a;
    }
}

__device__ __forceinline__ void block_argmax(float& best, int& at) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        better(best, at, __shfl_xor_sync(0xffffffff, best, o), __shfl_xor_sync(0xffffffff, at, o));
    }
    __shared__ float sb[32];
    __shared__ int sa[32];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        sb[warp] = best;
        sa[warp] = at;
    }
    __syncthreads();
    const int n_warps = blockDim.x / WARP_SIZE;
    best = lane < n_warps ? sb[lane] : -INFINITY;
    at = lane < n_warps ? sa[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        better(best, at, __shfl_xor_sync(0xffffffff, best, o), __shfl_xor_sync(0xffffffff, at, o));
    }
}

extern "C" __global__ void argmax_partial(const float* __restrict__ x, int n, float* __restrict__ part_v,
                                          int* __restrict__ part_i) {
    PDL_WAIT();
    float best = -INFINITY;
    int at = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) better(best, at, x[i], i);
    block_argmax(best, at);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = best;
        part_i[blockIdx.x] = at;
    }
}

extern "C" __global__ void argmax_final(const float* __restrict__ part_v, const int* __restrict__ part_i,
                                        int n_parts, int* __restrict__ out) {
    PDL_WAIT();
    float best = -INFINITY;
    int at = 0x7fffffff;
    for (int i = threadIdx.x; i < n_parts; i += blockDim.x) better(best, at, part_v[i], part_i[i]);
    block_argmax(best, at);
    if (threadIdx.x == 0) *out = at == 0x7fffffff ? 0 : at;
}

// Bias and penalties, one thread per token id the host lists (each id once): logit += bias,
// then for ids seen `count` > 0 times among the recent tokens, positive logits divided by
// `repeat`, others multiplied, and count * freq + presence taken off (the CPU's order).
extern "C" __global__ void sample_adjust(float* __restrict__ logits, const int* __restrict__ ids,
                                         const float* __restrict__ bias, const int* __restrict__ counts, int n,
                                         float repeat, float freq, float presence) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = logits[ids[i]] + bias[i];
    if (counts[i] > 0) {
        v = v > 0.0f ? v / repeat : v * repeat;
        // Rounded as the CPU rounds it: no fused multiply-add.
        v = __fsub_rn(v, __fadd_rn(__fmul_rn((float)counts[i], freq), presence));
    }
    logits[ids[i]] = v;
}

#define SAMPLE_THREADS 1024
#define MAX_CANDIDATES 1024

// A key whose unsigned order is the floats' total order (so +0 ranks above -0, as the
// CPU's total_cmp has it).
__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Whether candidate a comes before b: larger logit first, then the lower id.
__device__ __forceinline__ bool before(uint32_t ka, int ia, uint32_t kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// Sampling from n logits, in one block: out[0] = the token, out[1] = 1 when the draw `u`
// was used; out[0] = -1 when no logit is finite (the host then falls back to the CPU
// sampler's rule).
// 1. The top k finite logits (k <= MAX_CANDIDATES): the k-th largest key by a radix select
//    of four 8-bit passes over the logits (a histogram in shared memory per pass), then
//    every key above it and the lowest ids among those equal to it.
// 2. Sorted (bitonic, in shared memory); softmax; the shortest prefix whose probability
//    reaches top_p; those at least min_p times the first's; then the softmax of the rest at
//    temperature `temp` and the first whose running sum passes u. The sums go in the CPU's
//    order (one thread, f32 sums and f64 running sums), so both pick the same token up to
//    the last bits of exp.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_top_k(const float* __restrict__ logits, int n, int k, float top_p, float min_p, float temp, double u,
                 int* __restrict__ out) {
    PDL_WAIT();
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ unsigned s_remaining, s_finite, n_above, n_ties, n_taken;
    __shared__ uint32_t ck[MAX_CANDIDATES];
    __shared__ int ci[MAX_CANDIDATES];
    __shared__ float pe[MAX_CANDIDATES];
    __shared__ unsigned warp_ties[SAMPLE_THREADS / WARP_SIZE];
    const int tid = threadIdx.x;

    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += SAMPLE_THREADS) hist[b] = 0;
        __syncthreads();
#pragma unroll 4
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            const float v = logits[i];
            const uint32_t key = order_key(v);
            if (isfinite(v) && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            if (shift == 24) {
                unsigned total = 0;
                for (int b = 0; b < 256; ++b) total += hist[b];
                s_finite = total;
                s_remaining = min((unsigned)k, total);
            }
            unsigned above = 0;
            int b = 255;
            for (; b > 0 && above + hist[b] < s_remaining; --b) above += hist[b];
            s_prefix = prefix | ((uint32_t)b << shift);
            s_remaining -= above;
        }
        __syncthreads();
        if (s_finite == 0) {
            if (tid == 0) {
                out[0] = -1;
                out[1] = 0;
            }
            return;
        }
        prefix = s_prefix;
        mask |= 0xffu << shift;
    }
    // prefix is now the k-th largest key; s_remaining of the keys equal to it are taken.
    const unsigned kk = min((unsigned)k, s_finite);
    if (tid == 0) {
        n_above = 0;
        n_ties = 0;
    }
    __syncthreads();
    for (int i = tid; i < n; i += SAMPLE_THREADS) {
        const float v = logits[i];
        const uint32_t key = order_key(v);
        if (!isfinite(v)) continue;
        if (key > prefix) {
            const unsigned at = atomicAdd(&n_above, 1u);
            ck[at] = key;
            ci[at] = i;
        } else if (key == prefix) {
            atomicAdd(&n_ties, 1u);
        }
    }
    __syncthreads();
    const unsigned take = kk - n_above;
    if (n_ties == take) {
        // The usual case: every equal key is taken.
        if (tid == 0) n_taken = 0;
        __syncthreads();
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            const float v = logits[i];
            if (isfinite(v) && order_key(v) == prefix) {
                const unsigned at = n_above + atomicAdd(&n_taken, 1u);
                ck[at] = prefix;
                ci[at] = i;
            }
        }
    } else {
        // More equal keys than places: the lowest ids, in order, 1024 ids at a time.
        unsigned taken = 0;
        for (int base = 0; base < n && taken < take; base += SAMPLE_THREADS) {
            const int i = base + tid;
            const bool tie = i < n && isfinite(logits[i]) && order_key(logits[i]) == prefix;
            const unsigned ballot = __ballot_sync(0xffffffff, tie);
            const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
            if (lane == 0) warp_ties[warp] = __popc(ballot);
            __syncthreads();
            unsigned rank = __popc(ballot & ((1u << lane) - 1)), total = 0;
            for (int w = 0; w < SAMPLE_THREADS / WARP_SIZE; ++w) {
                if (w < warp) rank += warp_ties[w];
                total += warp_ties[w];
            }
            if (tie && taken + rank < take) {
                ck[n_above + taken + rank] = prefix;
                ci[n_above + taken + rank] = i;
            }
            taken += total;
            __syncthreads();
        }
    }
    __syncthreads();

    // Bitonic sort of the kk candidates, padded to a power of two with the lowest keys.
    unsigned p2 = 1;
    while (p2 < kk) p2 <<= 1;
    for (unsigned i = kk + tid; i < p2; i += SAMPLE_THREADS) {
        ck[i] = 0;
        ci[i] = 0x7fffffff;
    }
    __syncthreads();
    for (unsigned size = 2; size <= p2; size <<= 1) {
        for (unsigned stride = size / 2; stride > 0; stride >>= 1) {
            const unsigned i = tid, j = i ^ stride;
            if (i < p2 && j > i) {
                const bool first_half = (i & size) == 0;
                const bool swap = first_half ? before(ck[j], ci[j], ck[i], ci[i]) : before(ck[i], ci[i], ck[j], ci[j]);
                if (swap) {
                    const uint32_t tk = ck[i];
                    ck[i] = ck[j];
                    ck[j] = tk;
                    const int ti = ci[i];
                    ci[i] = ci[j];
                    ci[j] = ti;
                }
            }
            __syncthreads();
        }
    }

    // Keys back to logits: cand i has logit logits[ci[i]].
    const float top = logits[ci[0]];
    for (unsigned i = tid; i < kk; i += SAMPLE_THREADS) pe[i] = expf(logits[ci[i]] - top);
    __syncthreads();
    __shared__ unsigned s_keep;
    if (tid == 0) {
        float z = 0.0f;
        for (unsigned i = 0; i < kk; ++i) z += pe[i];
        unsigned keep = kk;
        if (top_p < 1.0f) {
            double cum = 0.0;
            for (unsigned i = 0; i < kk; ++i) {
                cum += (double)(pe[i] / z);
                if (cum >= (double)top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (min_p > 0.0f) {
            const float floor = pe[0] / z * min_p;
            unsigned above = 0;
            while (above < kk && pe[above] / z >= floor) ++above;
            keep = min(keep, max(above, 1u));
        }
        s_keep = keep;
    }
    __syncthreads();
    const unsigned keep = s_keep;
    const float top_t = top / temp;
    for (unsigned i = tid; i < keep; i += SAMPLE_THREADS) pe[i] = expf(logits[ci[i]] / temp - top_t);
    __syncthreads();
    if (tid == 0) {
        float z = 0.0f;
        for (unsigned i = 0; i < keep; ++i) z += pe[i];
        double cum = 0.0;
        int pick = ci[keep - 1];
        for (unsigned i = 0; i < keep; ++i) {
            cum += (double)(pe[i] / z);
            if (u < cum) {
                pick = ci[i];
                break;
            }
        }
        out[0] = pick;
        out[1] = 1;
    }
}
