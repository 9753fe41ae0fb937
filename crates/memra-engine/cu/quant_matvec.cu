// Matrix-vector products on quantized weights for decoding (1 to 8 tokens).
//
// Activations are first quantized to int8 in blocks of 32 with an f32 scale and the scaled
// block sum (`quantize_act_q8`, the form llama.cpp calls q8_1); then one warp per weight
// row unpacks the weights to packed int8 and multiplies them with `dp4a`, four products per
// instruction. Weights are read once per call whatever the token count; decode speed is
// bound by exactly that read.
//
// W: nrows rows of ncols weights in the ggml block layout. XQ: ntok x ncols int8;
// XD, XS: ntok x ncols/32 f32 (scale, scale * sum of the block). Y: ntok x nrows f32.
// Thread blocks of ROWS_PER_BLOCK warps. One launch multiplies up to three matrices of one
// type with the same activations (q, k and v; gate and up), each thread block working on
// one of them: small matrices leave most of the GPU idle, together they fill it.
#include "quant_blocks.cuh"

#define ROWS_PER_BLOCK 4
#define MAX_TOKENS 8

// One warp per 32 activations.
extern "C" __global__ void quantize_act_q8(const float* __restrict__ x, int8_t* __restrict__ q,
                                           float* __restrict__ d, float* __restrict__ s, int n) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    quantize_warp_block(i < n ? x[i] : 0.0f, i, i < n, q, d, s);
}

__device__ __forceinline__ void warp_store(float (&acc)[MAX_TOKENS], int ntok, float* Y, int nrows, int row) {
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < ntok) {
            const float v = warp_sum(acc[t]);
            if (threadIdx.x % WARP_SIZE == 0) Y[(size_t)t * nrows + row] = v;
        }
    }
}

// 32 int8 activations of token t at element `at` as eight packed ints.
__device__ __forceinline__ void load_act(const int8_t* XQ, size_t at, int (&a)[8]) {
    const int4* p = (const int4*)(XQ + at);
    const int4 lo = p[0], hi = p[1];
    a[0] = lo.x; a[1] = lo.y; a[2] = lo.z; a[3] = lo.w;
    a[4] = hi.x; a[5] = hi.y; a[6] = hi.z; a[7] = hi.w;
}

// Q4_K: 144-byte blocks of 256 (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles). Eight lanes share a block, one 32-weight sub-block each.
// Two rows per warp: the activations each lane loads serve both rows, halving that
// traffic (the activation reads were as large as the Q4_K weight reads).
#define Q4_K_ROWS_PER_WARP 2

__device__ __forceinline__ void mmvq_q4_k(int blk_id, const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                          const float* __restrict__ XD, const float* __restrict__ XS,
                                          float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row0 = (blk_id * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE) * Q4_K_ROWS_PER_WARP;
    if (row0 >= nrows) return;
    const int nr = min(Q4_K_ROWS_PER_WARP, nrows - row0);
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 256;
    const int j = lane % 8;
    const int shift = (j % 2) * 4;
    float acc[Q4_K_ROWS_PER_WARP][MAX_TOKENS] = {};
    for (int b = lane / 8; b < nb; b += WARP_SIZE / 8) {
        int v[Q4_K_ROWS_PER_WARP][8];
        float ds[Q4_K_ROWS_PER_WARP], dmn[Q4_K_ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < Q4_K_ROWS_PER_WARP; ++r) {
            if (r >= nr) break;
            const uint8_t* blk = W + ((size_t)(row0 + r) * nb + b) * 144;
            const half2 dm = *(const half2*)blk;
            int sc, mn;
            scale_min_k4(j, blk + 4, sc, mn);
            const int4* q = (const int4*)(blk + 16 + 32 * (j / 2));
            const int4 q0 = q[0], q1 = q[1];
            const int w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) v[r][i] = (w[i] >> shift) & 0x0f0f0f0f;
            ds[r] = __low2float(dm) * sc;
            dmn[r] = __high2float(dm) * mn;
        }
        const int xb = b * 8 + j;  // activation block of 32
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            int a[8];
            load_act(XQ, (size_t)t * ncols + (size_t)xb * 32, a);
            const size_t ai = (size_t)t * (ncols / 32) + xb;
            const float xd = XD[ai], xs = XS[ai];
#pragma unroll
            for (int r = 0; r < Q4_K_ROWS_PER_WARP; ++r) {
                if (r >= nr) break;
                int dot = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = __dp4a(v[r][i], a[i], dot);
                acc[r][t] += ds[r] * xd * dot - dmn[r] * xs;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < Q4_K_ROWS_PER_WARP; ++r) {
        if (r < nr) warp_store(acc[r], ntok, Y, nrows, row0 + r);
    }
}

// Every other format: one lane per 32-weight sub-block (lane l takes sub-blocks l, l + 32,
// ...), decoded by unpack32 to int8 levels and per-16 scales and mins, multiplied with
// dp4a. The mins need the activations' sums: per 32 (XS) where both halves share a min,
// per 16 (counted here with dp4a) for Q2_K.
template <int T> struct MinKind { static constexpr int v = 0; };  // 0: none, 1: per 32, 2: per 16
template <> struct MinKind<T_Q4_1> { static constexpr int v = 1; };
template <> struct MinKind<T_Q5_1> { static constexpr int v = 1; };
template <> struct MinKind<T_Q4_K> { static constexpr int v = 1; };
template <> struct MinKind<T_Q5_K> { static constexpr int v = 1; };
template <> struct MinKind<T_Q2_K> { static constexpr int v = 2; };

template <int T>
__device__ __forceinline__ void mmvq_generic(int blk_id, const uint8_t* __restrict__ W,
                                             const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                             const float* __restrict__ XS, float* __restrict__ Y, int ncols,
                                             int nrows, int ntok) {
    const int row = blk_id * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_subs = ncols / 32;
    const uint8_t* wrow = W + (size_t)row * (ncols / BlockTraits<T>::n) * BlockTraits<T>::bytes;
    float acc[MAX_TOKENS] = {0};
    for (int s = lane; s < n_subs; s += WARP_SIZE) {
        int v[8];
        float sc[2], mn[2];
        unpack32<T>(wrow, s, v, sc, mn);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            int a[8];
            load_act(XQ, (size_t)t * ncols + (size_t)s * 32, a);
            int d0 = 0, d1 = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                d0 = __dp4a(v[i], a[i], d0);
                d1 = __dp4a(v[i + 4], a[i + 4], d1);
            }
            const size_t ai = (size_t)t * n_subs + s;
            float r = XD[ai] * (sc[0] * d0 + sc[1] * d1);
            if (MinKind<T>::v == 1) r -= mn[0] * XS[ai];
            if (MinKind<T>::v == 2) {
                int h0 = 0, h1 = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    h0 = __dp4a(0x01010101, a[i], h0);
                    h1 = __dp4a(0x01010101, a[i + 4], h1);
                }
                r -= XD[ai] * (mn[0] * h0 + mn[1] * h1);
            }
            acc[t] += r;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
// scales per 16 weights, d). Eight lanes share a block; lane (h, c, f) reads 16 bytes of
// low nibbles, both of whose nibbles it uses (weights of two sub-blocks), and the 16 bytes
// of high bits they need: 32 bytes per 32 weights. (One lane per sub-block read 64.)
__device__ __forceinline__ void mmvq_q6_k(int blk_id, const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                          const float* __restrict__ XD, const float* __restrict__ XS,
                                          float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row = blk_id * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 256;
    const uint8_t* wrow = W + (size_t)row * nb * 210;
    const int k = lane % 8, h = k / 4, c = (k / 2) % 2, f = k % 2;
    const int e_lo = 128 * h + 32 * c + 16 * f, e_hi = e_lo + 64;  // first weight of each half
    float acc[MAX_TOKENS] = {0};
    for (int b = lane / 8; b < nb; b += WARP_SIZE / 8) {
        const uint8_t* blk = wrow + (size_t)b * 210;
        const uint8_t* ql = blk + 64 * h + 32 * c + 16 * f;
        const uint8_t* qh = blk + 128 + 32 * h + 16 * f;
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int l = ld32(ql + 4 * i), hb = ld32(qh + 4 * i);
            lo[i] = __vsubss4((l & 0x0f0f0f0f) | (((hb >> (2 * c)) & 0x03030303) << 4), 0x20202020);
            hi[i] = __vsubss4(((l >> 4) & 0x0f0f0f0f) | (((hb >> (4 + 2 * c)) & 0x03030303) << 4), 0x20202020);
        }
        const float d = ldh(blk + 208);
        const int8_t* sc = (const int8_t*)(blk + 192);
        const float s_lo = d * sc[e_lo / 16], s_hi = d * sc[e_hi / 16];
        const int x_lo = b * 256 + e_lo, x_hi = b * 256 + e_hi;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            const int4 a_lo = *(const int4*)(XQ + (size_t)t * ncols + x_lo);
            const int4 a_hi = *(const int4*)(XQ + (size_t)t * ncols + x_hi);
            int d_lo = 0, d_hi = 0;
            d_lo = __dp4a(lo[0], a_lo.x, d_lo);
            d_lo = __dp4a(lo[1], a_lo.y, d_lo);
            d_lo = __dp4a(lo[2], a_lo.z, d_lo);
            d_lo = __dp4a(lo[3], a_lo.w, d_lo);
            d_hi = __dp4a(hi[0], a_hi.x, d_hi);
            d_hi = __dp4a(hi[1], a_hi.y, d_hi);
            d_hi = __dp4a(hi[2], a_hi.z, d_hi);
            d_hi = __dp4a(hi[3], a_hi.w, d_hi);
            const size_t ab = (size_t)t * (ncols / 32);
            acc[t] += s_lo * XD[ab + x_lo / 32] * d_lo + s_hi * XD[ab + x_hi / 32] * d_hi;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// Float weights (F32, F16, BF16) against the same int8 activations, in f32.
template <int T>
__device__ __forceinline__ void mmvq_float(int blk_id, const uint8_t* __restrict__ W,
                                           const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                           const float* __restrict__ XS, float* __restrict__ Y, int ncols,
                                           int nrows, int ntok) {
    const int row = blk_id * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_subs = ncols / 32;
    const uint8_t* wrow = W + (size_t)row * row_bytes_of(T, ncols);
    float acc[MAX_TOKENS] = {0};
    for (int s = lane; s < n_subs; s += WARP_SIZE) {
        float w[32];
        decode32<T>(wrow, s, w);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            int a[8];
            load_act(XQ, (size_t)t * ncols + (size_t)s * 32, a);
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < 32; ++e) dot += w[e] * byte_of(a[e / 4], e % 4);
            acc[t] += XD[(size_t)t * n_subs + s] * dot;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// Up to three matrices per launch: block b works on matrix m where
// first[m] <= b < first[m + 1] (first[0] = 0, first[3] = the grid size).
struct MatvecSet {
    const uint8_t* w[3];
    float* y[3];
    int nrows[3];
    int first[4];
};

#define MMVQ(name, FN)                                                                                              \
    extern "C" __global__ void                                                                                      \
        name(MatvecSet set, const int8_t* __restrict__ XQ, const float* __restrict__ XD,                            \
             const float* __restrict__ XS, int ncols, int ntok) {                                                   \
        PDL_WAIT();                                                                                                 \
        /* Selects, not indexing: a dynamic index would copy the set to local memory. */                            \
        const int b = blockIdx.x;                                                                                   \
        const bool m2 = b >= set.first[2], m1 = !m2 && b >= set.first[1];                                           \
        const int first = m2 ? set.first[2] : m1 ? set.first[1] : 0;                                                \
        const uint8_t* w = m2 ? set.w[2] : m1 ? set.w[1] : set.w[0];                                                \
        float* y = m2 ? set.y[2] : m1 ? set.y[1] : set.y[0];                                                        \
        const int nrows = m2 ? set.nrows[2] : m1 ? set.nrows[1] : set.nrows[0];                                     \
        FN(b - first, w, XQ, XD, XS, y, ncols, nrows, ntok);                                                        \
    }

MMVQ(mmvq_q4_k, mmvq_q4_k)
MMVQ(mmvq_q6_k, mmvq_q6_k)
MMVQ(mmvq_q4_0, mmvq_generic<T_Q4_0>)
MMVQ(mmvq_q4_1, mmvq_generic<T_Q4_1>)
MMVQ(mmvq_q5_0, mmvq_generic<T_Q5_0>)
MMVQ(mmvq_q5_1, mmvq_generic<T_Q5_1>)
MMVQ(mmvq_q8_0, mmvq_generic<T_Q8_0>)
MMVQ(mmvq_iq4_nl, mmvq_generic<T_IQ4_NL>)
MMVQ(mmvq_q2_k, mmvq_generic<T_Q2_K>)
MMVQ(mmvq_q3_k, mmvq_generic<T_Q3_K>)
MMVQ(mmvq_q5_k, mmvq_generic<T_Q5_K>)
MMVQ(mmvq_iq4_xs, mmvq_generic<T_IQ4_XS>)
MMVQ(mmvq_f32, mmvq_float<T_F32>)
MMVQ(mmvq_f16, mmvq_float<T_F16>)
MMVQ(mmvq_bf16, mmvq_float<T_BF16>)

// Experts: block (b, k, t) computes rows of expert ids[t][k] (weights at W + id * stride)
// for token t; its input is token t's activations (gate and up: `per_slot` 0) or the
// (t, k) row of its own (down: `per_slot` 1); its output is the (t, k) row of Y.
#define MMVQ_MOE(name, FN)                                                                                          \
    extern "C" __global__ void name(const uint8_t* __restrict__ W, long long stride,                                \
                                    const int* __restrict__ ids, int n_used, const int8_t* __restrict__ XQ,         \
                                    const float* __restrict__ XD, const float* __restrict__ XS,                     \
                                    float* __restrict__ Y, int ncols, int nrows, int per_slot) {                    \
        PDL_WAIT();                                                                                                 \
        const int k = blockIdx.y, t = blockIdx.z;                                                                   \
        const size_t slot = (size_t)t * n_used + k;                                                                 \
        const size_t x = per_slot ? slot : t;                                                                       \
        FN(blockIdx.x, W + ids[slot] * stride, XQ + x * ncols, XD + x * (ncols / 32),                               \
           XS + x * (ncols / 32), Y + slot * nrows, ncols, nrows, 1);                                               \
    }

MMVQ_MOE(mmvq_moe_q4_k, mmvq_q4_k)
MMVQ_MOE(mmvq_moe_q6_k, mmvq_q6_k)
MMVQ_MOE(mmvq_moe_q4_0, mmvq_generic<T_Q4_0>)
MMVQ_MOE(mmvq_moe_q4_1, mmvq_generic<T_Q4_1>)
MMVQ_MOE(mmvq_moe_q5_0, mmvq_generic<T_Q5_0>)
MMVQ_MOE(mmvq_moe_q5_1, mmvq_generic<T_Q5_1>)
MMVQ_MOE(mmvq_moe_q8_0, mmvq_generic<T_Q8_0>)
MMVQ_MOE(mmvq_moe_iq4_nl, mmvq_generic<T_IQ4_NL>)
MMVQ_MOE(mmvq_moe_q2_k, mmvq_generic<T_Q2_K>)
MMVQ_MOE(mmvq_moe_q3_k, mmvq_generic<T_Q3_K>)
MMVQ_MOE(mmvq_moe_q5_k, mmvq_generic<T_Q5_K>)
MMVQ_MOE(mmvq_moe_iq4_xs, mmvq_generic<T_IQ4_XS>)
MMVQ_MOE(mmvq_moe_f32, mmvq_float<T_F32>)
MMVQ_MOE(mmvq_moe_f16, mmvq_float<T_F16>)
MMVQ_MOE(mmvq_moe_bf16, mmvq_float<T_BF16>)

// The residual step and the next matvec's input in one launch: x_out = x + o (o may be
// null), then the RMS norm of x_out times w, quantized to int8 per 32 as quantize_act_q8
// does. Blocks of 256 threads each take 256 elements; every block computes the whole row's
// sum of squares itself (the row is a few KiB in L2), so no block waits for another, and
// x_out is a different buffer from x so that no block reads what another has written.
extern "C" __global__ void add_norm_quantize(const float* __restrict__ x, const float* __restrict__ o,
                                             float* __restrict__ x_out, const float* __restrict__ w,
                                             int8_t* __restrict__ q, float* __restrict__ d,
                                             float* __restrict__ s, int n, float eps) {
    PDL_WAIT();
    // Row blockIdx.y of several (prompt batches); the quantized rows follow each other.
    const size_t r = blockIdx.y;
    x += r * n;
    if (o) o += r * n;
    x_out += r * n;
    q += r * n;
    d += r * (n / 32);
    s += r * (n / 32);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = o ? x[i] + o[i] : x[i];
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / n + eps);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = i < n ? (o ? x[i] + o[i] : x[i]) : 0.0f;
    if (i < n) x_out[i] = v;
    quantize_warp_block(i < n ? v * scale * w[i] : 0.0f, i, i < n, q, d, s);
}

// The gated FFN activation and the down projection's input in one launch: act(g) * u,
// quantized to int8 per 32 (one warp per block of 32); `gelu` picks GELU (tanh) over SiLU.
extern "C" __global__ void gated_quantize(const float* __restrict__ g, const float* __restrict__ u,
                                          int8_t* __restrict__ q, float* __restrict__ d,
                                          float* __restrict__ s, int n, int gelu) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.0f;
    if (i < n) {
        v = gate_act(g[i], gelu) * u[i];
    }
    quantize_warp_block(v, i, i < n, q, d, s);
}
