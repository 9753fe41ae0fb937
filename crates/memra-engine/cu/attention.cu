// Attention over the paged f16 KV cache: split-K flash decoding for one query token of
// each of several sequences (with a combine kernel that merges the splits and quantizes the
// result for the output projection), and flash attention for prompt chunks of several
// sequences: on the tensor cores for heads of up to 128 dimensions, on CUDA cores above.
//
// Layouts: the pool holds, per slot, n_head_kv heads of D halves (K and V alike: these
// kernels take dk == dv == D, one of 32, 64, 128, 256). Sequence s keeps position j in slot
// block_tables[s * max_blocks + j / B] * B + j % B, B = 1 << bs_log2 positions per block.
// Queries are f32, n_head x D per token; query head h reads kv head h / (n_head /
// n_head_kv). A layer with a sliding window of w positions lets the query at position p
// see positions p-w+1 .. p.
#include "common.cuh"
#include "tensor_core.cuh"

#define MAX_SPLITS 128
#define KEYS_PER_SPLIT 64  // ops::KEYS_PER_SPLIT: the split count a context gets

// The pool slot of position j of the sequence whose block table is `bt`.
__device__ __forceinline__ size_t kv_slot(const int* __restrict__ bt, int j, int bs_log2) {
    return ((size_t)bt[j >> bs_log2] << bs_log2) | (size_t)(j & ((1 << bs_log2) - 1));
}

// Per-lane share of a head: D / 32 values.
template <int D> struct HeadSplit {
    static constexpr int per_lane = D / 32;
};

// Loads `n` halves from global memory into floats (n = 1, 2, 4 or 8; aligned to n halves).
template <int N>
__device__ __forceinline__ void load_halves(const __half* p, float (&out)[N]) {
    if (N == 8) {
        const uint4 u = *(const uint4*)p;
        const __half2* h = (const __half2*)&u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __low2float(h[i]);
            out[2 * i + 1] = __high2float(h[i]);
        }
    } else if (N == 4) {
        const uint2 u = *(const uint2*)p;
        const __half2* h = (const __half2*)&u;
        out[0] = __low2float(h[0]);
        out[1] = __high2float(h[0]);
        out[2] = __low2float(h[1]);
        out[3] = __high2float(h[1]);
    } else if (N == 2) {
        const __half2 h = *(const __half2*)p;
        out[0] = __low2float(h);
        out[1] = __high2float(h);
    } else {
        out[0] = __half2float(*p);
    }
}

// Query heads a decode block handles: G, 1 (attn_decode_d*_g1, a block per query head, for
// launches of few blocks) or 4 or 8 (_g4, _g8: a KV head's group, the kernel compiled for
// the model's group; ops::decode_kernel). Its loops and arrays run to G, so a group of 4 in
// the kernel for 8 had paid for 8: llama3-8b on the H100, 16 rows 18.8 -> 16.0 us a layer
// (2.40 -> 2.22 M instructions); and a block of one head in the kernel for 4 kept its 164
// registers (the one-head kernel instead: 1 row +1.6%, 9 rows +1-5%, docs/cuda.md).
#define DECODE_WARPS 2
#define DECODE_BLOCK 16  // positions per KV block the decode kernel takes (bs_log2 == 4)

// Decode: block (kv head and head share, split) takes its share of keys for its share of
// the query heads of the group: gridDim.x is n_head_kv x the shares (the host's choice,
// `decode_grid_x`: 1 or the group; a graph rewrites it, and the kernel, with the split
// count), a share ceil(group / shares) heads. Fewer heads per warp is less serial work per
// warp: at short contexts the kernel is one warp's instruction latency (8 query heads a
// warp took 2,800 instructions for 4 keys, 18 us under Nsight Compute on the 30B-A3B).
// Each lane scores one key per 32-key step (its whole row: no reduction across lanes), the
// warp updates its running softmax per head once per step, then accumulates the values
// with the lanes spread over the head's dimensions. The block's warps merge in shared
// memory and write one partial result (max, sum, unnormalized output) per head and split.
//
// Sequence blockIdx.z's query sees its ctx_len positions (its own key included), read on
// the device with its block table, so a captured graph replays with new ones without
// changes; n_split is a plain argument a graph rewrites when the split count changes.
// Partials: n_split x n_head per sequence (the combine kernel reads them with the same
// n_split). A sequence spreads its keys over the splits its own context would get alone
// (decode_splits in ops.rs, within n_split), its later splits left empty (an empty
// partial adds exact zeros in the combine), so that a row of a batch, or of a speculative
// verify step whose later rows see more keys, sums in the order it would by itself.
template <int D, int G>
__device__ __forceinline__ void attn_decode(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                            const __half* __restrict__ v_cache, float* __restrict__ part_o,
                                            float* __restrict__ part_ml, const int* __restrict__ ctx_len,
                                            const int* __restrict__ block_tables, int max_blocks, int bs_log2,
                                            int n_head, int n_head_kv, int window, float scale, int n_split) {
    constexpr int E = HeadSplit<D>::per_lane;
    const int split = blockIdx.y, seq = blockIdx.z;
    const int group = n_head / n_head_kv, shares = gridDim.x / n_head_kv;
    const int kvh = blockIdx.x / shares, per_share = (group + shares - 1) / shares;
    const int g0 = (blockIdx.x % shares) * per_share;  // the share's first head in the group
    const int gn = max(0, min(group, g0 + per_share) - g0);  // and its count
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_kv = ctx_len[seq];
    const int* __restrict__ bt = block_tables + (size_t)seq * max_blocks;
    (void)bs_log2;  // DECODE_BLOCK: the host checks the pool's blocks are its size
    q += (size_t)seq * n_head * D;
    part_o += (size_t)seq * n_split * n_head * D;
    part_ml += (size_t)seq * n_split * n_head * 2;
    const int first = window > 0 ? max(0, n_kv - window) : 0;
    // Splits start at multiples of 32 positions (keys before `first` are masked), so a
    // warp's step of 32 positions is two whole blocks: its slots come from two table
    // entries.
    const int first_al = first & ~(WARP_SIZE - 1);
    const int own = min(n_split, max(1, min(MAX_SPLITS, (n_kv + KEYS_PER_SPLIT - 1) / KEYS_PER_SPLIT)));
    const int per = ((n_kv - first_al + own - 1) / own + WARP_SIZE - 1) & ~(WARP_SIZE - 1);
    const int begin = first_al + split * per, end = min(n_kv, begin + per);
    // A step's table entries (the first step's loaded before the wait for the previous
    // kernel: the batch arrays were copied before the step began, so under programmatic
    // launch their latency hides behind the previous kernel's tail); each step loads the
    // next step's at its start.
    const int step = DECODE_WARPS * WARP_SIZE;
    int t0, t1;
    {
        const int b = begin + warp * WARP_SIZE;
        t0 = b < end ? bt[b / DECODE_BLOCK] : 0;
        t1 = b + DECODE_BLOCK < end ? bt[b / DECODE_BLOCK + 1] : t0;
    }
    PDL_WAIT();

    // The group's queries (contiguous) into shared memory, a thread's loads all in flight
    // together: a loop waiting on each load in turn had cost the kernel 7-16 L2 round trips,
    // most of its time at short contexts.
    __shared__ float qs[G][D];
    {
        constexpr int QN = (G * D + DECODE_WARPS * WARP_SIZE - 1) / (DECODE_WARPS * WARP_SIZE);
        const float* qg = q + ((size_t)kvh * group + g0) * D;
        float qv[QN];
#pragma unroll
        for (int j = 0; j < QN; ++j) {
            const int i = threadIdx.x + j * DECODE_WARPS * WARP_SIZE;
            qv[j] = i < gn * D ? qg[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < QN; ++j) {
            const int i = threadIdx.x + j * DECODE_WARPS * WARP_SIZE;
            if (i < gn * D) qs[i / D][i % D] = qv[j] * scale;
        }
    }
    __syncthreads();

    const size_t row = (size_t)n_head_kv * D;
    float m[G], l[G], o[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[g][e] = 0.0f;
    }
    // Heads of up to 128 dimensions load the step's 32 value rows (E halves each per lane)
    // together with the keys, before any arithmetic: one wait for memory per step, not two.
    constexpr bool PREFETCH_V = E <= 4;
    constexpr int VW = E <= 2 ? 1 : 2;  // 32-bit words per lane per value row
    for (int base = begin + warp * WARP_SIZE; base < end; base += step) {
        const int key = base + lane;
        const bool valid = key < end && key >= first;
        // Position base + j (j < 32) is in block base / 16 + j / 16, at offset j % 16
        // (base is a multiple of 32): the offsets are known at compile time.
        const int nb = base + step;
        const int next0 = nb < end ? bt[nb / DECODE_BLOCK] : 0;
        const int next1 = nb + DECODE_BLOCK < end ? bt[nb / DECODE_BLOCK + 1] : next0;
#define STEP_SLOT(j) ((size_t)((j) < DECODE_BLOCK ? t0 : t1) * DECODE_BLOCK + (size_t)((j) & (DECODE_BLOCK - 1)))
        uint32_t vraw[PREFETCH_V ? WARP_SIZE : 1][VW];
        if constexpr (PREFETCH_V) {
#pragma unroll
            for (int j = 0; j < WARP_SIZE; ++j) {
                const bool in = base + j < end;
                const __half* vp = v_cache + STEP_SLOT(j) * row + (size_t)kvh * D + lane * E;
                if (E == 4) {
                    const uint2 u = in ? *(const uint2*)vp : make_uint2(0, 0);
                    vraw[j][0] = u.x;
                    vraw[j][VW - 1] = u.y;
                } else if (E == 2) {
                    vraw[j][0] = in ? *(const uint32_t*)vp : 0;
                } else {
                    vraw[j][0] = in ? *(const uint16_t*)vp : 0;
                }
            }
        }
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.0f;
        if (valid) {
            const __half* kr = k_cache + STEP_SLOT(lane) * row + (size_t)kvh * D;
            // Unrolled so that a lane's loads of its key row are in flight together.
#pragma unroll 8
            for (int d = 0; d < D; d += 8) {
                float kv[8];
                load_halves<8>(kr + d, kv);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g < gn) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) s[g] += qs[g][d + i] * kv[i];
                    }
                }
            }
        }
        const int n_valid = min(WARP_SIZE, end - base);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= gn) break;
            float mx = valid ? s[g] : -INFINITY;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
            const float m_new = fmaxf(m[g], mx);
            const float p = valid ? __expf(s[g] - m_new) : 0.0f;
            const float corr = __expf(m[g] - m_new);
            l[g] = l[g] * corr + warp_sum(p);
            m[g] = m_new;
#pragma unroll
            for (int e = 0; e < E; ++e) o[g][e] *= corr;
            s[g] = p;
        }
        if constexpr (PREFETCH_V) {
#pragma unroll
            for (int j = 0; j < WARP_SIZE; ++j) {
                if (j >= n_valid) break;
                float vv[E];
                const __half2* h2 = (const __half2*)vraw[j];
                if (E == 1) {
                    vv[0] = __half2float(__ushort_as_half((unsigned short)vraw[j][0]));
                } else {
#pragma unroll
                    for (int e = 0; e < E; e += 2) {
                        vv[e] = __low2float(h2[e / 2]);
                        vv[e + 1 < E ? e + 1 : e] = __high2float(h2[e / 2]);
                    }
                }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g >= gn) break;
                    const float p = __shfl_sync(0xffffffff, s[g], j);
#pragma unroll
                    for (int e = 0; e < E; ++e) o[g][e] += p * vv[e];
                }
            }
        } else {
            // Eight value rows in flight at once.
#pragma unroll 8
            for (int j = 0; j < n_valid; ++j) {
                float vv[E];
                load_halves<E>(v_cache + STEP_SLOT(j) * row + (size_t)kvh * D + lane * E, vv);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g >= gn) break;
                    const float p = __shfl_sync(0xffffffff, s[g], j);
#pragma unroll
                    for (int e = 0; e < E; ++e) o[g][e] += p * vv[e];
                }
            }
        }
        t0 = next0;
        t1 = next1;
    }

#undef STEP_SLOT
    // Merge the warps: each writes its state, warp 0 combines.
    __shared__ float sm[DECODE_WARPS][G][2];
    __shared__ float so[DECODE_WARPS][G][D];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= gn) break;
        if (lane == 0) {
            sm[warp][g][0] = m[g];
            sm[warp][g][1] = l[g];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) so[warp][g][lane * E + e] = o[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gn * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float mx = -INFINITY;
        for (int w = 0; w < DECODE_WARPS; ++w) mx = fmaxf(mx, sm[w][g][0]);
        float acc = 0.0f, sum = 0.0f;
        for (int w = 0; w < DECODE_WARPS; ++w) {
            const float c = sm[w][g][0] == -INFINITY ? 0.0f : __expf(sm[w][g][0] - mx);
            acc += c * so[w][g][d];
            sum += c * sm[w][g][1];
        }
        const int h = kvh * group + g0 + g;
        part_o[((size_t)split * n_head + h) * D + d] = acc;
        if (d == 0) {
            part_ml[((size_t)split * n_head + h) * 2] = mx;
            part_ml[((size_t)split * n_head + h) * 2 + 1] = sum;
        }
    }
}

#define ATTN_DECODE(D, G)                                                                                           \
    extern "C" __global__ void __launch_bounds__(DECODE_WARPS * WARP_SIZE)                                          \
        attn_decode_d##D##_g##G(const float* __restrict__ q, const __half* __restrict__ k_cache,                    \
                                const __half* __restrict__ v_cache, float* __restrict__ part_o,                     \
                                float* __restrict__ part_ml, const int* __restrict__ ctx_len,                       \
                                const int* __restrict__ block_tables, int max_blocks, int bs_log2, int n_head,      \
                                int n_head_kv, int window, float scale, int n_split) {                              \
        attn_decode<D, G>(q, k_cache, v_cache, part_o, part_ml, ctx_len, block_tables, max_blocks, bs_log2, n_head, \
                          n_head_kv, window, scale, n_split);                                                       \
    }

// One head a block (ops::decode_one_head: launches of few blocks), or a group of up to 4 or 8.
ATTN_DECODE(32, 1)
ATTN_DECODE(64, 1)
ATTN_DECODE(128, 1)
ATTN_DECODE(256, 1)
ATTN_DECODE(32, 4)
ATTN_DECODE(64, 4)
ATTN_DECODE(128, 4)
ATTN_DECODE(256, 4)
ATTN_DECODE(32, 8)
ATTN_DECODE(64, 8)
ATTN_DECODE(128, 8)
ATTN_DECODE(256, 8)

// Merges the splits of each head (blockIdx.x) of each sequence (blockIdx.y) into the
// attention output, row blockIdx.y; writes it as f32 (`out`, may be null), as f16 (`out_h`,
// the output projection's GEMM input, may be null) and quantized to int8 per 32 for the
// output projection's matvec (`xq`, `xd`, `xs`, may be null), as
// quantize_act_q8 does. One block of D x SPLIT_GROUPS threads per head: the split weights are computed once per block, in parallel; thread (d, g) sums
// dimension d over the splits g, g + SPLIT_GROUPS, ... with its loads in flight together,
// and the groups meet in shared memory. (A serial loop over 64 splits, waiting on each
// load, had cost more than the attention itself at long contexts.)
#define SPLIT_GROUPS 4

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        float* __restrict__ out, __half* __restrict__ out_h,
                                        int8_t* __restrict__ xq, float* __restrict__ xd, float* __restrict__ xs,
                                        int n_head, int d_head, int n_split) {
    PDL_WAIT();
    __shared__ float weight[MAX_SPLITS];
    __shared__ float group_sum[SPLIT_GROUPS - 1][256];
    const int h = blockIdx.x, d = threadIdx.x % d_head, g = threadIdx.x / d_head, seq = blockIdx.y;
    part_o += (size_t)seq * n_split * n_head * d_head;
    part_ml += (size_t)seq * n_split * n_head * 2;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < n_split; s += blockDim.x) mx = fmaxf(mx, part_ml[((size_t)s * n_head + h) * 2]);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < n_split; s += blockDim.x) {
        const float m = part_ml[((size_t)s * n_head + h) * 2];
        const float c = m == -INFINITY ? 0.0f : __expf(m - mx);
        weight[s] = c;
        sum += c * part_ml[((size_t)s * n_head + h) * 2 + 1];
    }
    sum = block_sum(sum);  // its barrier also publishes `weight`
    float acc = 0.0f;
#pragma unroll 4
    for (int s = g; s < n_split; s += SPLIT_GROUPS) acc += weight[s] * part_o[((size_t)s * n_head + h) * d_head + d];
    if (g > 0) group_sum[g - 1][d] = acc;
    __syncthreads();
    if (g > 0) return;
#pragma unroll
    for (int k = 0; k < SPLIT_GROUPS - 1; ++k) acc += group_sum[k][d];
    const float v = acc / sum;
    const int i = (seq * n_head + h) * d_head + d;
    if (out) out[i] = v;
    if (out_h) out_h[i] = __float2half(v);
    if (xq) quantize_warp_block(v, i, true, xq, xd, xs);
}

// Prompt batches: flash attention, f32 arithmetic on CUDA cores. Block (query tile of
// PREFILL_WARPS * 4 tokens, query head); each warp owns 4 queries. Key/value tiles of 32
// positions go through shared memory; each lane scores one key of the tile for the warp's
// queries, then the lanes spread over the dimensions to accumulate the values.
// Sequence blockIdx.z has queries q_start[s] .. q_start[s+1]-1 of the batch, at its last
// positions (its context holds ctx_len[s], the batch's keys already in the pool). Output:
// f16, one row of n_head x D per query, the output projection's GEMM input.
#define PREFILL_WARPS 8
#define Q_PER_WARP 4

template <int D>
__device__ __forceinline__ void attn_prefill(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                             const __half* __restrict__ v_cache, __half* __restrict__ out,
                                             const int* __restrict__ q_start, const int* __restrict__ ctx_len,
                                             const int* __restrict__ block_tables, int max_blocks, int bs_log2,
                                             int n_head, int n_head_kv, int window, float scale) {
    constexpr int E = HeadSplit<D>::per_lane;
    constexpr int QT = PREFILL_WARPS * Q_PER_WARP;
    constexpr int KROW = D / 2 + 1;  // K rows padded by a word: lanes reading rows hit distinct banks
    extern __shared__ float smem[];
    float* qs = smem;                                            // QT x D
    __half2* ks = (__half2*)(qs + QT * D);                       // 32 x KROW
    __half2* vs = ks + 32 * KROW;                                // 32 x D/2

    const int h = blockIdx.y, kvh = h / (n_head / n_head_kv), seq = blockIdx.z;
    const int t0 = blockIdx.x * QT;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_q = q_start[seq + 1] - q_start[seq];
    if (t0 >= n_q) return;  // the grid covers the longest sequence of the batch
    q += (size_t)q_start[seq] * n_head * D;
    out += (size_t)q_start[seq] * n_head * D;
    const int p0 = ctx_len[seq] - n_q;
    const int* __restrict__ bt = block_tables + (size_t)seq * max_blocks;
    for (int i = threadIdx.x; i < QT * D; i += blockDim.x) {
        const int t = t0 + i / D;
        qs[i] = t < n_q ? q[((size_t)t * n_head + h) * D + i % D] * scale : 0.0f;
    }
    // Keys this block needs: from the window start of its first query to its last query.
    const int last_q = min(n_q, t0 + QT) - 1;
    const int k_begin = window > 0 ? max(0, p0 + t0 - window + 1) : 0;
    const int k_end = p0 + last_q + 1;

    float m[Q_PER_WARP], l[Q_PER_WARP], o[Q_PER_WARP][E];
#pragma unroll
    for (int i = 0; i < Q_PER_WARP; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[i][e] = 0.0f;
    }
    const size_t row = (size_t)n_head_kv * D;
    __shared__ int tile_slot[32];
    for (int kb = k_begin - k_begin % 32; kb < k_end; kb += 32) {
        __syncthreads();
        // The tile's 32 slots, looked up once for all the block's loads.
        if (threadIdx.x < 32) {
            const int key = kb + threadIdx.x;
            tile_slot[threadIdx.x] = key < k_end ? (int)kv_slot(bt, key, bs_log2) : 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < 32 * D / 2; i += blockDim.x) {
            const int j = i / (D / 2), c = i % (D / 2);
            const int key = kb + j;
            __half2 kv = __float2half2_rn(0.0f), vv = kv;
            if (key < k_end) {
                const size_t at = (size_t)tile_slot[j] * row + (size_t)kvh * D;
                kv = ((const __half2*)(k_cache + at))[c];
                vv = ((const __half2*)(v_cache + at))[c];
            }
            ks[j * KROW + c] = kv;
            vs[j * (D / 2) + c] = vv;
        }
        __syncthreads();
        float s[Q_PER_WARP] = {};
        const float* qw = qs + warp * Q_PER_WARP * D;
#pragma unroll 4
        for (int c = 0; c < D / 2; ++c) {
            const float2 kf = __half22float2(ks[lane * KROW + c]);
#pragma unroll
            for (int i = 0; i < Q_PER_WARP; ++i) {
                const float2 qf = *(const float2*)(qw + i * D + 2 * c);
                s[i] += qf.x * kf.x + qf.y * kf.y;
            }
        }
        const int key = kb + lane;
#pragma unroll
        for (int i = 0; i < Q_PER_WARP; ++i) {
            const int qp = p0 + t0 + warp * Q_PER_WARP + i;
            const bool valid = key <= qp && key >= k_begin && (window <= 0 || key > qp - window);
            float mx = valid ? s[i] : -INFINITY;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
            const float m_new = fmaxf(m[i], mx);
            // A query with no visible key in this tile yet keeps m = -inf: guard the exps.
            const float p = valid ? __expf(s[i] - m_new) : 0.0f;
            const float corr = m[i] == -INFINITY ? 0.0f : __expf(m[i] - m_new);
            l[i] = l[i] * corr + warp_sum(p);
            m[i] = m_new;
#pragma unroll
            for (int e = 0; e < E; ++e) o[i][e] *= corr;
            s[i] = p;
        }
        for (int j = 0; j < 32; ++j) {
            float vv[E];
#pragma unroll
            for (int e = 0; e < E; e += 2) {
                const int c = (lane * E + e) / 2;
                if (E == 1) {
                    const __half* vh = (const __half*)(vs + j * (D / 2));
                    vv[0] = __half2float(vh[lane]);
                } else {
                    const float2 f = __half22float2(vs[j * (D / 2) + c]);
                    vv[e] = f.x;
                    vv[e + 1] = f.y;
                }
            }
#pragma unroll
            for (int i = 0; i < Q_PER_WARP; ++i) {
                const float p = __shfl_sync(0xffffffff, s[i], j);
#pragma unroll
                for (int e = 0; e < E; ++e) o[i][e] += p * vv[e];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < Q_PER_WARP; ++i) {
        const int t = t0 + warp * Q_PER_WARP + i;
        if (t >= n_q) break;
        const float inv = 1.0f / l[i];
        __half* orow = out + ((size_t)t * n_head + h) * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) orow[e] = __float2half(o[i][e] * inv);
    }
}

// The prompt kernels' entry points: `FN##_d##D` over FN<D> (both kernels take the same
// arguments), blocks of WARPS warps.
#define ATTN_PREFILL_ENTRY(FN, D, WARPS)                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * WARP_SIZE)                                                 \
        FN##_d##D(const float* __restrict__ q, const __half* __restrict__ k_cache,                                \
                    const __half* __restrict__ v_cache, __half* __restrict__ out, const int* __restrict__ q_start,  \
                    const int* __restrict__ ctx_len, const int* __restrict__ block_tables, int max_blocks,          \
                    int bs_log2, int n_head, int n_head_kv, int window, float scale) {                              \
        PDL_WAIT();                                                                                                 \
        FN<D>(q, k_cache, v_cache, out, q_start, ctx_len, block_tables, max_blocks, bs_log2, n_head, n_head_kv,     \
              window, scale);                                                                                       \
    }
#define ATTN_PREFILL(D) ATTN_PREFILL_ENTRY(attn_prefill, D, PREFILL_WARPS)

ATTN_PREFILL(32)
ATTN_PREFILL(64)
ATTN_PREFILL(128)
ATTN_PREFILL(256)

// Prompt batches on the tensor cores (f16 `mma.sync`, f32 accumulate), flash attention 2's
// order: a block of TC_WARPS warps holds TC_ROWS query rows, 16 a warp, as A fragments in
// registers; key and value tiles of TC_KEYS positions are copied from the paged pool into
// shared memory by cp.async, the next tile while this one is multiplied. A warp scores its
// rows against the tile (S = Q K^T), updates its running softmax in registers (base 2: the
// queries are scaled by log2 e), and multiplies the probabilities, rounded to f16 in the
// accumulators' own layout (which is the A fragment's), by the values.
//
// The rows of one KV head are (query, head of the group) pairs, query-major: row r is query
// r / group, head kvh * group + r % group. All heads of a group share the block's key tiles,
// so a chunk of a few queries (a decode-sized chunk, a speculative verify) still fills the
// block's rows. Blocks take their tiles from the end of the chunk first: the last queries
// see the most keys. Rows are independent: a row's result does not depend on the others of
// its block, nor on the batch.
#define TC_WARPS 4
#define TC_ROWS (TC_WARPS * 16)
#define TC_KEYS 64

template <int D>
__device__ __forceinline__ void attn_prefill_tc(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                const __half* __restrict__ v_cache, __half* __restrict__ out,
                                                const int* __restrict__ q_start, const int* __restrict__ ctx_len,
                                                const int* __restrict__ block_tables, int max_blocks, int bs_log2,
                                                int n_head, int n_head_kv, int window, float scale) {
    constexpr int STRIDE = D + 8;  // halves per shared row: ldmatrix's 8 rows meet no bank twice
    constexpr int KD = D / 16;     // k16 steps over a head
    constexpr int NK = TC_KEYS / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* ks = (__half*)smem_raw;       // 2 stages x TC_KEYS x STRIDE
    __half* vs = ks + 2 * TC_KEYS * STRIDE;  // the same

    const int kvh = blockIdx.y, seq = blockIdx.z;
    const int group = n_head / n_head_kv;
    const int n_q = q_start[seq + 1] - q_start[seq];
    const int n_rows = n_q * group;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;
    if (r0 >= n_rows) return;  // the grid covers the longest sequence of the batch
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int p0 = ctx_len[seq] - n_q;
    const int* __restrict__ bt = block_tables + (size_t)seq * max_blocks;
    const size_t row = (size_t)n_head_kv * D;
    const int last_row = min(n_rows, r0 + TC_ROWS) - 1;
    // The block's query positions, the warp's, and this thread's two rows' (a row past the
    // chunk takes the last one's position and is not written).
    const int pos_lo = p0 + r0 / group, pos_hi = p0 + last_row / group;
    const int wr = r0 + warp * 16;
    const int wpos_lo = p0 + min(wr, last_row) / group, wpos_hi = p0 + min(wr + 15, last_row) / group;
    const int ra = wr + g, rb = wr + g + 8;
    const int pa = p0 + min(ra, last_row) / group, pb = p0 + min(rb, last_row) / group;
    const int k_lo = window > 0 ? max(0, pos_lo - window + 1) : 0, k_hi = pos_hi + 1;

    // The warp's queries as A fragments, scaled by scale * log2(e).
    uint32_t qf[KD][4];
    {
        const float qs = scale * 1.4426950408889634f;
        const float* qa = q + ((size_t)(q_start[seq] + min(ra, last_row) / group) * n_head + kvh * group +
                               min(ra, last_row) % group) * D;
        const float* qb = q + ((size_t)(q_start[seq] + min(rb, last_row) / group) * n_head + kvh * group +
                               min(rb, last_row) % group) * D;
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) {
            const float2 a0 = *(const float2*)(qa + 16 * kd + 2 * t), a1 = *(const float2*)(qb + 16 * kd + 2 * t);
            const float2 a2 = *(const float2*)(qa + 16 * kd + 8 + 2 * t), a3 = *(const float2*)(qb + 16 * kd + 8 + 2 * t);
            qf[kd][0] = pack_half2(a0.x * qs, a0.y * qs);
            qf[kd][1] = pack_half2(a1.x * qs, a1.y * qs);
            qf[kd][2] = pack_half2(a2.x * qs, a2.y * qs);
            qf[kd][3] = pack_half2(a3.x * qs, a3.y * qs);
        }
    }

    // Tile kb's keys and values into stage st; positions at or past k_hi are zeros.
    auto load_tile = [&](int kb, int st) {
        for (int c = threadIdx.x; c < TC_KEYS * D / 8; c += TC_WARPS * WARP_SIZE) {
            const int j = c / (D / 8), part = c % (D / 8);
            const int key = kb + j;
            const bool in = key < k_hi;
            const size_t at = in ? kv_slot(bt, key, bs_log2) * row + (size_t)kvh * D + part * 8 : 0;
            const int sh = (st * TC_KEYS + j) * STRIDE + part * 8;
            tc_cp16(ks + sh, k_cache + at, in);
            tc_cp16(vs + sh, v_cache + at, in);
        }
        tc_commit();
    };

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
    const int kb0 = k_lo & ~(TC_KEYS - 1);
    const int n_tiles = (k_hi - kb0 + TC_KEYS - 1) / TC_KEYS;
    const int mi = lane >> 3, mr = lane & 7;  // ldmatrix: this lane's matrix and row in it
    load_tile(kb0, 0);
    for (int it = 0; it < n_tiles; ++it) {
        const int kb = kb0 + it * TC_KEYS, st = it & 1;
        if (it + 1 < n_tiles) {
            load_tile(kb + TC_KEYS, st ^ 1);
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
        // A warp whose rows see none of the tile, or that has no rows, skips it.
        if (wr < n_rows && kb <= wpos_hi && (window <= 0 || kb + TC_KEYS - 1 > wpos_lo - window)) {
            const __half* kt = ks + st * TC_KEYS * STRIDE;
            const __half* vt = vs + st * TC_KEYS * STRIDE;
            float s[NK][4];
#pragma unroll
            for (int j = 0; j < NK; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KD; ++kd) {
#pragma unroll
                for (int j = 0; j < NK; j += 2) {
                    uint32_t b[4];
                    tc_ldmatrix4(b, kt + (8 * j + (mi >> 1) * 8 + mr) * STRIDE + 16 * kd + (mi & 1) * 8);
                    tc_mma(s[j], qf[kd], b[0], b[1]);
                    tc_mma(s[j + 1], qf[kd], b[2], b[3]);
                }
            }
            // Masks only where the tile is not wholly visible to the block's rows.
            if (kb + TC_KEYS - 1 > pos_lo || (window > 0 && kb <= pos_hi - window)) {
#pragma unroll
                for (int j = 0; j < NK; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = kb + 8 * j + 2 * t + e;
                        if (key > pa || (window > 0 && key <= pa - window)) s[j][e] = -INFINITY;
                        if (key > pb || (window > 0 && key <= pb - window)) s[j][2 + e] = -INFINITY;
                    }
                }
            }
            float mx_a = m_a, mx_b = m_b;
#pragma unroll
            for (int j = 0; j < NK; ++j) {
                mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
            }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, off));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, off));
            }
            // A row that has seen no visible key yet keeps m = -inf: guard the exps.
            const float ref_a = mx_a == -INFINITY ? 0.0f : mx_a, ref_b = mx_b == -INFINITY ? 0.0f : mx_b;
            const float c_a = m_a == -INFINITY ? 0.0f : exp2f(m_a - ref_a);
            const float c_b = m_b == -INFINITY ? 0.0f : exp2f(m_b - ref_b);
            m_a = mx_a;
            m_b = mx_b;
            float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
            for (int j = 0; j < NK; ++j) {
                s[j][0] = exp2f(s[j][0] - ref_a);
                s[j][1] = exp2f(s[j][1] - ref_a);
                s[j][2] = exp2f(s[j][2] - ref_b);
                s[j][3] = exp2f(s[j][3] - ref_b);
                sum_a += s[j][0] + s[j][1];
                sum_b += s[j][2] + s[j][3];
            }
            l_a = l_a * c_a + sum_a;
            l_b = l_b * c_b + sum_b;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][0] *= c_a;
                o[i][1] *= c_a;
                o[i][2] *= c_b;
                o[i][3] *= c_b;
            }
#pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; ++kk) {
                const uint32_t pa4[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                         pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                         pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int dn = 0; dn < D / 8; dn += 2) {
                    uint32_t b[4];
                    tc_ldmatrix4_trans(b, vt + (16 * kk + (mi & 1) * 8 + mr) * STRIDE + 8 * dn + (mi >> 1) * 8);
                    tc_mma(o[dn], pa4, b[0], b[1]);
                    tc_mma(o[dn + 1], pa4, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // the stage is refilled next iteration
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffff, l_a, off);
        l_b += __shfl_xor_sync(0xffffffff, l_b, off);
    }
    // Every written row sees its own key, so its sum is positive.
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
    const size_t base = (size_t)q_start[seq] * n_head + kvh * group;
    if (ra < n_rows) {
        __half* orow = out + (base + (size_t)(ra / group) * n_head + ra % group) * D + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) *(__half2*)(orow + 8 * i) = __floats2half2_rn(o[i][0] * inv_a, o[i][1] * inv_a);
    }
    if (rb < n_rows) {
        __half* orow = out + (base + (size_t)(rb / group) * n_head + rb % group) * D + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) *(__half2*)(orow + 8 * i) = __floats2half2_rn(o[i][2] * inv_b, o[i][3] * inv_b);
    }
}

#define ATTN_PREFILL_TC(D) ATTN_PREFILL_ENTRY(attn_prefill_tc, D, TC_WARPS)

ATTN_PREFILL_TC(32)
ATTN_PREFILL_TC(64)
ATTN_PREFILL_TC(128)
