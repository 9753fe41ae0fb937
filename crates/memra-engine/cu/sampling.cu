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

// A grammar's token mask (constrained decoding), one thread per logit: logits whose bit is
// clear are set to -inf (token t: bit t % 32 of word t / 32; tokens at or past 32 * n_words
// are banned), as `constraint::apply_mask` does on the host, before argmax or sampling.
extern "C" __global__ void apply_token_mask(float* __restrict__ logits, int n, const uint32_t* __restrict__ mask,
                                            int n_words) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int w = i / 32;
    const bool allowed = w < n_words && ((mask[w] >> (i % 32)) & 1u);
    if (!allowed) logits[i] = -INFINITY;
}

// Masks of several rows in one launch (a batch's constrained greedy rows): block row j
// bans, in row list[j] of `logits` (rows of n), what mask j bans; `list` holds the n_rows
// row numbers, then n_rows masks of n_words = ceil(n / 32) words each.
extern "C" __global__ void apply_token_masks(float* __restrict__ logits, int n, const uint32_t* __restrict__ list,
                                             int n_rows, int n_words) {
    PDL_WAIT();
    const int j = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t* mask = list + n_rows + (size_t)j * n_words;
    if (!((mask[i / 32] >> (i % 32)) & 1u)) logits[(size_t)list[j] * n + i] = -INFINITY;
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
#define SLICE 4096  // logits per block of the first stage

// A key whose unsigned order is the floats' total order (so +0 ranks above -0, as the
// CPU's total_cmp has it). Key 0 (a NaN's) marks "not a candidate": no finite logit has it.
__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Whether candidate a comes before b: larger logit first, then the lower id.
__device__ __forceinline__ bool before(uint32_t ka, int ia, uint32_t kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// Rank of this thread's flag among the block's set flags before it, and their total.
__device__ __forceinline__ unsigned block_rank(bool flag, unsigned& total) {
    __shared__ unsigned warp_count[SAMPLE_THREADS / WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const unsigned ballot = __ballot_sync(0xffffffff, flag);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    unsigned rank = __popc(ballot & ((1u << lane) - 1));
    total = 0;
    for (int w = 0; w < SAMPLE_THREADS / WARP_SIZE; ++w) {
        if (w < warp) rank += warp_count[w];
        total += warp_count[w];
    }
    __syncthreads();
    return rank;
}

// The top `k` of `n` keys (key 0: none) in the total order (key desc, then position asc),
// copied in position order to out_keys/out_pos (positions offset by `base`): a radix select
// of four 8-bit passes finds the k-th largest key, then one ordered pass takes every key
// above it and the first of those equal to it. `key_at(i)` reads key i. Returns how many.
template <typename KeyAt>
__device__ __forceinline__ unsigned select_top_k(KeyAt key_at, int n, unsigned k, uint32_t* out_keys,
                                                 int* out_pos, int base) {
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ unsigned s_remaining, s_count;
    const int tid = threadIdx.x;
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += SAMPLE_THREADS) hist[b] = 0;
        __syncthreads();
        // Logits crowd into a few bins (the exponent bits), so the lanes of a warp that
        // share a bin add their count once.
        for (int start = 0; start < n; start += SAMPLE_THREADS) {
            const int i = start + tid;
            const uint32_t key = i < n ? key_at(i) : 0;
            const bool counted = key != 0 && (key & mask) == prefix;
            const unsigned bin = (key >> shift) & 0xff;
            const unsigned peers = __match_any_sync(0xffffffff, counted ? bin : 0x100u);
            if (counted && __ffs(peers) - 1 == tid % WARP_SIZE) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            if (shift == 24) {
                unsigned total = 0;
                for (int b = 0; b < 256; ++b) total += hist[b];
                s_count = total;
                s_remaining = min(k, total);
            }
            unsigned above = 0;
            int b = 255;
            for (; b > 0 && above + hist[b] < s_remaining; --b) above += hist[b];
            s_prefix = prefix | ((uint32_t)b << shift);
            s_remaining -= above;
        }
        __syncthreads();
        if (s_count == 0) return 0;
        prefix = s_prefix;
        mask |= 0xffu << shift;
    }
    // prefix: the k-th largest key; the first s_remaining keys equal to it are taken.
    const unsigned ties_wanted = s_remaining, count = min(k, s_count);
    unsigned taken = 0, ties = 0;
    for (int start = 0; start < n && taken < count; start += SAMPLE_THREADS) {
        const int i = start + tid;
        const uint32_t key = i < n ? key_at(i) : 0;
        unsigned n_ties;
        const bool tie = key != 0 && key == prefix;
        const unsigned tie_rank = block_rank(tie, n_ties);
        const bool take = (key != 0 && key > prefix) || (tie && ties + tie_rank < ties_wanted);
        unsigned n_take;
        const unsigned at = taken + block_rank(take, n_take);
        if (take) {
            out_keys[at] = key;
            out_pos[at] = base + i;
        }
        taken += n_take;
        ties += n_ties;
    }
    __syncthreads();  // the copies are visible to the whole block
    return count;
}

// Stage 1: block b takes logits b*SLICE .. and writes its top k (in id order) at b*k of
// cand_keys / cand_ids, and how many to counts[b]. Every token of the overall top k is
// among its block's top k, so stage 2 needs only these.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_candidates(const float* __restrict__ logits, int n, int k, uint32_t* __restrict__ cand_keys,
                      int* __restrict__ cand_ids, int* __restrict__ counts) {
    PDL_WAIT();
    __shared__ uint32_t keys[SLICE];
    const int base = blockIdx.x * SLICE, len = min(SLICE, n - base);
    for (int i = threadIdx.x; i < len; i += SAMPLE_THREADS) {
        const float v = logits[base + i];
        keys[i] = isfinite(v) ? order_key(v) : 0;
    }
    __syncthreads();
    const size_t at = (size_t)blockIdx.x * k;
    const uint32_t* slice = keys;
    const unsigned count =
        select_top_k([=](int i) { return slice[i]; }, len, k, cand_keys + at, cand_ids + at, base);
    if (threadIdx.x == 0) counts[blockIdx.x] = count;
}

// Stage 2, one block: the top k of the n_blocks blocks' candidates (their concatenation is
// in id order), sorted (bitonic, in shared memory); softmax; the shortest prefix whose
// probability reaches top_p; those at least min_p times the first's; then the softmax of
// the rest at temperature `temp` and the first whose running sum passes the uniform `u`.
// The sums go in the CPU's order (one thread, f32 sums and f64 running sums), so both pick
// the same token up to the last bits of exp. out[0] = the token, out[1] = 1 (the draw was
// used); out[0] = -1 when no logit is finite (the host then follows the CPU's rule).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_pick(const uint32_t* __restrict__ cand_keys, const int* __restrict__ cand_ids,
                const int* __restrict__ counts, int n_blocks, int k, float top_p, float min_p, float temp,
                double u, int* __restrict__ out) {
    PDL_WAIT();
    __shared__ uint32_t ck[MAX_CANDIDATES];
    __shared__ int cpos[MAX_CANDIDATES];
    __shared__ int ci[MAX_CANDIDATES];
    __shared__ float pe[MAX_CANDIDATES];
    __shared__ unsigned s_keep;
    const int tid = threadIdx.x;
    const auto key_at = [=](int j) { return (j % k) < counts[j / k] ? cand_keys[j] : 0u; };
    const unsigned kk = select_top_k(key_at, n_blocks * k, k, ck, cpos, 0);
    if (kk == 0) {
        if (tid == 0) {
            out[0] = -1;
            out[1] = 0;
        }
        return;
    }
    for (unsigned i = tid; i < kk; i += SAMPLE_THREADS) ci[i] = cand_ids[cpos[i]];
    // Bitonic sort of the kk candidates, padded to a power of two with keys that sort last.
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
    const float top = key_value(ck[0]);
    for (unsigned i = tid; i < kk; i += SAMPLE_THREADS) pe[i] = expf(key_value(ck[i]) - top);
    __syncthreads();
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
    for (unsigned i = tid; i < keep; i += SAMPLE_THREADS) pe[i] = expf(key_value(ck[i]) / temp - top_t);
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

// The argmax of each of `rows` rows of n logits (the first on ties; all NaN: 0), one block
// of 1024 threads per row: the greedy picks of a batched step in one launch. A thread's
// ARGMAX_ROWS_LOADS loads are issued before it compares any: one load a turn had each
// thread wait out ~150 memory round trips in turn over a 151,936-logit row, 60 us a step
// of 16 rows on the H100, where the row's bytes take a few. `better` breaks ties by
// index, so the order the values are seen in does not change the pick.
#define ARGMAX_ROWS_LOADS 16
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int n, int* __restrict__ out) {
    PDL_WAIT();
    const float* row = x + (size_t)blockIdx.x * n;
    float best = -INFINITY;
    int at = 0x7fffffff;
    for (int base = threadIdx.x; base < n; base += ARGMAX_ROWS_LOADS * blockDim.x) {
        float v[ARGMAX_ROWS_LOADS];
#pragma unroll
        for (int j = 0; j < ARGMAX_ROWS_LOADS; ++j) {
            const int i = base + j * blockDim.x;
            v[j] = i < n ? row[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < ARGMAX_ROWS_LOADS; ++j) {
            const int i = base + j * blockDim.x;
            if (i < n) better(best, at, v[j], i);
        }
    }
    block_argmax(best, at);
    if (threadIdx.x == 0) out[blockIdx.x] = at == 0x7fffffff ? 0 : at;
}
