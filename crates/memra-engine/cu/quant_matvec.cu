// Matrix-vector products on quantized weights for decoding (1 to 8 tokens).
//
// Activations are first quantized to int8 in blocks of 32 with an f32 scale and the scaled
// block sum (`quantize_act_q8`, the form llama.cpp calls q8_1); then the weights are
// unpacked to packed int8 and multiplied with `dp4a`, four products per instruction.
// Weights are read once per call whatever the token count; decode speed is bound by
// exactly that read.
//
// W: nrows rows of ncols weights in the ggml block layout (Q8_0 and Q6_K regrouped where
// rows are whole groups, quant_blocks.cuh). XQ: ntok x ncols int8; XD, XS: ntok x ncols/32
// f32 (scale, scale * sum of the block). Y: ntok x nrows f32. Thread blocks of 128 threads.
// One launch multiplies up to three matrices of one type with the same activations (q, k
// and v; gate and up), each thread block working on one of them: small matrices leave
// most of the GPU idle, together they fill it.
//
// Two kernel shapes: Q4_K and the regrouped Q6_K / Q8_0, the formats of nearly all decode
// bytes, have block-cooperative kernels (`mmvq_coop`); every other format one warp per row
// (`mmvq_generic`, `mmvq_q6_k` for Q6_K rows that are not whole groups, `mmvq_float`).
#include "moe_route.cuh"
#include "quant_blocks.cuh"

#define THREADS 128
#define ROWS_PER_BLOCK (THREADS / WARP_SIZE)  // one warp per row
#define MAX_TOKENS 8

// One warp per 32 activations.
extern "C" __global__ void quantize_act_q8(const float* __restrict__ x, int8_t* __restrict__ q,
                                           float* __restrict__ d, float* __restrict__ s, int n) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    quantize_warp_block(i < n ? x[i] : 0.0f, i, i < n, q, d, s);
}

// Each token's sum over the warp, plus the row's bias (B may be null), into Y.
__device__ __forceinline__ void warp_store(float (&acc)[MAX_TOKENS], int ntok, float* Y, const float* B, int nrows,
                                           int row) {
    const float b = B ? B[row] : 0.0f;
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < ntok) {
            const float v = warp_sum(acc[t]);
            if (threadIdx.x % WARP_SIZE == 0) Y[(size_t)t * nrows + row] = v + b;
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

// Every other format: one lane per 32-weight sub-block (lane l takes sub-blocks l, l + 32,
// ...), decoded by unpack32 to int8 levels and per-16 scales and mins, multiplied with
// dp4a. The mins need the activations' sums: per 32 (XS) where both halves share a min,
// per 16 (counted here with dp4a) for Q2_K.
template <int T> struct MinKind { static constexpr int v = 0; };  // 0: none, 1: per 32, 2: per 16
template <> struct MinKind<T_Q4_1> { static constexpr int v = 1; };
template <> struct MinKind<T_Q5_1> { static constexpr int v = 1; };
template <> struct MinKind<T_Q5_K> { static constexpr int v = 1; };
template <> struct MinKind<T_Q2_K> { static constexpr int v = 2; };

template <int T>
__device__ __forceinline__ void mmvq_generic(int blk_id, const uint8_t* __restrict__ W,
                                             const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                             const float* __restrict__ XS, float* __restrict__ Y,
                                             const float* __restrict__ B, int ncols, int nrows, int ntok) {
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
    warp_store(acc, ntok, Y, B, nrows, row);
}

// Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
// scales per 16 weights, d). Eight lanes share a block; lane (h, c, f) reads 16 bytes of
// low nibbles, both of whose nibbles it uses (weights of two sub-blocks), and the 16 bytes
// of high bits they need: 32 bytes per 32 weights. (One lane per sub-block read 64.)
__device__ __forceinline__ void mmvq_q6_k(int blk_id, const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                          const float* __restrict__ XD, const float* __restrict__ XS,
                                          float* __restrict__ Y, const float* __restrict__ B, int ncols, int nrows,
                                          int ntok) {
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
    warp_store(acc, ntok, Y, B, nrows, row);
}

// Float weights (F32, F16, BF16) against the same int8 activations, in f32.
template <int T>
__device__ __forceinline__ void mmvq_float(int blk_id, const uint8_t* __restrict__ W,
                                           const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                           const float* __restrict__ XS, float* __restrict__ Y,
                                           const float* __restrict__ B, int ncols, int nrows, int ntok) {
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
    warp_store(acc, ntok, Y, B, nrows, row);
}

// Block-cooperative kernels for the formats that dominate decode (Q4_K, and the regrouped
// Q6_K and Q8_0): the block's 128 threads split each row into units of 32 weights (thread
// i takes units i, i + 128, ...) and each thread works on R rows at once, so that a thread
// has R rows' loads in flight and its activations serve all R. Partial sums meet in shared
// memory. A row of 4096 weights is one unit per thread: no serial chain of loads per warp,
// which is what held the one-warp-per-row kernels to 1.5 TB/s on 4096 x 4096. Rows per block
// (R) as measured on the H200 (docs/cuda.md): 8 for Q4_K and Q6_K, 2 for Q8_0.

// scale_min_k4 on the 12 scale bytes held as three words (a byte array in registers
// would go to local memory).
__device__ __forceinline__ void scale_min_k4_words(int j, uint32_t y, uint32_t z, uint32_t w, int& s, int& m) {
    const int b = 8 * (j % 4);
    const int qy = (y >> b) & 0xff, qz = (z >> b) & 0xff, qw = (w >> b) & 0xff;
    s = j < 4 ? qy & 63 : (qw & 0x0f) | ((qy >> 6) << 4);
    m = j < 4 ? qz & 63 : (qw >> 4) | ((qz >> 6) << 4);
}

// Q4_K unit j (0..7) of a block: the 16 bytes of nibbles at 16j, whose low nibbles are
// weights 16f..16f+15 of sub-block 2c and high nibbles the same of sub-block 2c + 1
// (c = j / 2, f = j % 2). The mins go to the f = 0 unit of each pair, which adds them for
// the whole 32 of both sub-blocks (the activations' sums per 32 are at hand).
struct CoopQ4K {
    int4 q;
    float d_lo, d_hi, m_lo, m_hi;
    __device__ __forceinline__ void load(const uint8_t* row, int u) {
        const int kb = u / 8, j = u % 8, c = j / 2;
        const uint8_t* blk = row + (size_t)kb * 144;
        const int4 head = *(const int4*)blk;
        q = *(const int4*)(blk + 16 + 16 * j);
        const half2 dm = __halves2half2(__ushort_as_half(head.x & 0xffff), __ushort_as_half(head.x >> 16));
        int s0, m0, s1, m1;
        scale_min_k4_words(2 * c, head.y, head.z, head.w, s0, m0);
        scale_min_k4_words(2 * c + 1, head.y, head.z, head.w, s1, m1);
        const float d = __low2float(dm), dmin = j % 2 ? 0.0f : __high2float(dm);
        d_lo = d * s0;
        d_hi = d * s1;
        m_lo = dmin * m0;
        m_hi = dmin * m1;
    }
    __device__ __forceinline__ float dot(const int8_t* xq, const float* xd, const float* xs, int u) const {
        const int kb = u / 8, j = u % 8, c = j / 2, f = j % 2;
        const int e = kb * 256 + 64 * c + 16 * f;
        const int4 a = *(const int4*)(xq + e), b = *(const int4*)(xq + e + 32);
        int lo = 0, hi = 0;
        lo = __dp4a(q.x & 0x0f0f0f0f, a.x, lo);
        lo = __dp4a(q.y & 0x0f0f0f0f, a.y, lo);
        lo = __dp4a(q.z & 0x0f0f0f0f, a.z, lo);
        lo = __dp4a(q.w & 0x0f0f0f0f, a.w, lo);
        hi = __dp4a((q.x >> 4) & 0x0f0f0f0f, b.x, hi);
        hi = __dp4a((q.y >> 4) & 0x0f0f0f0f, b.y, hi);
        hi = __dp4a((q.z >> 4) & 0x0f0f0f0f, b.z, hi);
        hi = __dp4a((q.w >> 4) & 0x0f0f0f0f, b.w, hi);
        const int sb = kb * 8 + 2 * c;
        return d_lo * xd[sb] * lo + d_hi * xd[sb + 1] * hi - (m_lo * xs[sb] + m_hi * xs[sb + 1]);
    }
};

// Q6_K unit k (0..7) of a block, the lane layout of mmvq_q6_k: 16 bytes of low bits
// (both nibbles: weights e and e + 64, e = 128h + 32c + 16f) and the 16 bytes of high bits
// they need. Regrouped (T_Q6_K_R), unit k's low bits are at 16k in the block's 128: a
// warp's loads are one contiguous 512 bytes, 16 at a time. The plain layout (expert rows
// of 768, not whole groups) is read 2 bytes at a time.
template <int T>
struct CoopQ6K {
    int4 ql, qh;
    float s_lo, s_hi;
    __device__ __forceinline__ void load(const uint8_t* row, int u) {
        const int kb = u / 8, k = u % 8, h = k / 4, c = (k / 2) % 2, f = k % 2;
        const Q6KFields fl = q6_k_fields<T>(row, kb);
        if (T == T_Q6_K_R) {
            ql = *(const int4*)(fl.ql + 16 * k);
            qh = *(const int4*)(fl.qh + 32 * h + 16 * f);
        } else {
            const uint8_t *l = fl.ql + 16 * k, *hb = fl.qh + 32 * h + 16 * f;
            ql = make_int4(ld32(l), ld32(l + 4), ld32(l + 8), ld32(l + 12));
            qh = make_int4(ld32(hb), ld32(hb + 4), ld32(hb + 8), ld32(hb + 12));
        }
        const float d = ldh(fl.d);
        const int e = 128 * h + 32 * c + 16 * f;
        s_lo = d * fl.scales[e / 16];
        s_hi = d * fl.scales[e / 16 + 4];
    }
    __device__ __forceinline__ float dot(const int8_t* xq, const float* xd, const float*, int u) const {
        const int kb = u / 8, k = u % 8, h = k / 4, c = (k / 2) % 2, f = k % 2;
        const int e = kb * 256 + 128 * h + 32 * c + 16 * f;
        const int4 a = *(const int4*)(xq + e), b = *(const int4*)(xq + e + 64);
        const int l[4] = {ql.x, ql.y, ql.z, ql.w}, hb[4] = {qh.x, qh.y, qh.z, qh.w};
        const int av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int wl = __vsubss4((l[i] & 0x0f0f0f0f) | (((hb[i] >> (2 * c)) & 0x03030303) << 4), 0x20202020);
            const int wh =
                __vsubss4(((l[i] >> 4) & 0x0f0f0f0f) | (((hb[i] >> (4 + 2 * c)) & 0x03030303) << 4), 0x20202020);
            lo = __dp4a(wl, av[i], lo);
            hi = __dp4a(wh, bv[i], hi);
        }
        return s_lo * xd[e / 32] * lo + s_hi * xd[e / 32 + 2] * hi;
    }
};

// Regrouped Q8_0: a unit is one block, 32 quants at a 16-byte boundary.
struct CoopQ80R {
    int4 q0, q1;
    float d;
    __device__ __forceinline__ void load(const uint8_t* row, int u) {
        const uint8_t* g = q8_0_r_group(row, u);
        const int i = u % REGROUP;
        const int4* q = (const int4*)(g + 16 + 32 * i);
        q0 = q[0];
        q1 = q[1];
        d = ldh(g + 2 * i);
    }
    __device__ __forceinline__ float dot(const int8_t* xq, const float* xd, const float*, int u) const {
        const int4* x = (const int4*)(xq + 32 * u);
        const int4 a = x[0], b = x[1];
        int s = 0;
        s = __dp4a(q0.x, a.x, s);
        s = __dp4a(q0.y, a.y, s);
        s = __dp4a(q0.z, a.z, s);
        s = __dp4a(q0.w, a.w, s);
        s = __dp4a(q1.x, b.x, s);
        s = __dp4a(q1.y, b.y, s);
        s = __dp4a(q1.z, b.z, s);
        s = __dp4a(q1.w, b.w, s);
        return d * xd[u] * s;
    }
};

// F32 (expert routers): a unit is 32 floats, eight 16-byte loads; the products as
// mmvq_float computes them.
struct CoopF32 {
    float4 w[8];
    __device__ __forceinline__ void load(const uint8_t* row, int u) {
        const float4* p = (const float4*)(row + (size_t)u * 128);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = p[i];
    }
    __device__ __forceinline__ float dot(const int8_t* xq, const float* xd, const float*, int u) const {
        int a[8];
        load_act(xq, (size_t)u * 32, a);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s += w[i].x * byte_of(a[i], 0);
            s += w[i].y * byte_of(a[i], 1);
            s += w[i].z * byte_of(a[i], 2);
            s += w[i].w * byte_of(a[i], 3);
        }
        return xd[u] * s;
    }
};

template <typename Unit, int T, int R, int NT>
__device__ __forceinline__ void mmvq_coop(int blk_id, const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                          const float* __restrict__ XD, const float* __restrict__ XS,
                                          float* __restrict__ Y, const float* __restrict__ B, int ncols, int nrows,
                                          int ntok) {
    const size_t row_bytes = row_bytes_of(T, ncols);
    const int row0 = blk_id * R;
    const int n_units = ncols / 32;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    }
    for (int u = threadIdx.x; u < n_units; u += THREADS) {
        Unit w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // Rows past the end repeat the last row; their sums are not stored.
            w[r].load(W + (size_t)min(row0 + r, nrows - 1) * row_bytes, u);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t >= ntok) break;
            const int8_t* xq = XQ + (size_t)t * ncols;
            const float* xd = XD + (size_t)t * n_units;
            const float* xs = XS + (size_t)t * n_units;
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][t] += w[r].dot(xq, xd, xs, u);
        }
    }
    __shared__ float partial[THREADS / WARP_SIZE][R * NT];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t >= ntok) break;
            const float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r * NT + t] = v;
        }
    }
    __syncthreads();
    const int i = threadIdx.x, r = i / NT, t = i % NT;
    if (i < R * NT && row0 + r < nrows && t < ntok) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < THREADS / WARP_SIZE; ++w) v += partial[w][i];
        Y[(size_t)t * nrows + row0 + r] = B ? v + B[row0 + r] : v;
    }
}

// Block blk of the nblk over a matrix of nrows rows of type T: its rows' bytes into L2
// before the wait for the previous kernel (weights are never written, prefetch_l2). Rows
// per block as the grid implies them (a hint: where the kernel's R does not divide the
// rows, a block's share here may be a little short of what it reads).
template <int T>
__device__ __forceinline__ void prefetch_block_rows(const uint8_t* w, int blk, int nblk, int nrows, int ncols) {
    if (threadIdx.x != 0 || nblk <= 0) return;
    const int per = (nrows + nblk - 1) / nblk, r0 = blk * per, r1 = min(nrows, r0 + per);
    if (r1 <= r0) return;
    const size_t rb = row_bytes_of(T, ncols);
    prefetch_l2(w + (size_t)r0 * rb, (size_t)(r1 - r0) * rb);
}

// Up to three matrices per launch: block b works on matrix m where
// first[m] <= b < first[m + 1] (first[0] = 0, first[3] = the grid size).
struct MatvecSet {
    const uint8_t* w[3];
    float* y[3];
    const float* bias[3];  // added to each row's sum (Qwen2's q, k, v); may be null
    int nrows[3];
    int first[4];
    int prefetch;  // whether blocks prefetch their rows (matvec.rs: PREFETCH_MAX_BYTES)
};

#define MMVQ(name, T, FN)                                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
        name(MatvecSet set, const int8_t* __restrict__ XQ, const float* __restrict__ XD,                            \
             const float* __restrict__ XS, int ncols, int ntok) {                                                   \
        /* Selects, not indexing: a dynamic index would copy the set to local memory. */                            \
        const int b = blockIdx.x;                                                                                   \
        const bool m2 = b >= set.first[2], m1 = !m2 && b >= set.first[1];                                           \
        const int first = m2 ? set.first[2] : m1 ? set.first[1] : 0;                                                \
        const int end = m2 ? set.first[3] : m1 ? set.first[2] : set.first[1];                                      \
        const uint8_t* w = m2 ? set.w[2] : m1 ? set.w[1] : set.w[0];                                                \
        float* y = m2 ? set.y[2] : m1 ? set.y[1] : set.y[0];                                                        \
        const float* bias = m2 ? set.bias[2] : m1 ? set.bias[1] : set.bias[0];                                      \
        const int nrows = m2 ? set.nrows[2] : m1 ? set.nrows[1] : set.nrows[0];                                     \
        if (set.prefetch) prefetch_block_rows<T>(w, b - first, end - first, nrows, ncols);                          \
        PDL_WAIT();                                                                                                 \
        FN(b - first, w, XQ, XD, XS, y, bias, ncols, nrows, ntok);                                                        \
    }

// The same with the set's last matrix (a layer's v) of another type, FN_B: one launch for
// q, k and v where they are not all of one type (the decode graph's launches are its
// cost at small batches).
#define MMVQ_PAIR(name, TA, FN_A, TB, FN_B)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
        name(MatvecSet set, const int8_t* __restrict__ XQ, const float* __restrict__ XD,                            \
             const float* __restrict__ XS, int ncols, int ntok) {                                                   \
        const int b = blockIdx.x;                                                                                   \
        if (!set.prefetch) {                                                                                        \
        } else if (b >= set.first[2]) {                                                                             \
            prefetch_block_rows<TB>(set.w[2], b - set.first[2], set.first[3] - set.first[2], set.nrows[2], ncols); \
        } else {                                                                                                    \
            const bool m1 = b >= set.first[1];                                                                      \
            prefetch_block_rows<TA>(m1 ? set.w[1] : set.w[0], b - (m1 ? set.first[1] : 0),                          \
                                    m1 ? set.first[2] - set.first[1] : set.first[1], m1 ? set.nrows[1] : set.nrows[0], \
                                    ncols);                                                                         \
        }                                                                                                           \
        PDL_WAIT();                                                                                                 \
        if (b >= set.first[2]) {                                                                                    \
            FN_B(b - set.first[2], set.w[2], XQ, XD, XS, set.y[2], set.bias[2], ncols, set.nrows[2], ntok);         \
        } else {                                                                                                    \
            const bool m1 = b >= set.first[1];                                                                      \
            FN_A(b - (m1 ? set.first[1] : 0), m1 ? set.w[1] : set.w[0], XQ, XD, XS, m1 ? set.y[1] : set.y[0],       \
                 m1 ? set.bias[1] : set.bias[0], ncols, m1 ? set.nrows[1] : set.nrows[0], ntok);                    \
        }                                                                                                           \
    }

// Decode (one token) and batches of up to MAX_TOKENS; rows per block: the first number.
MMVQ(mmvq_q4_k, T_Q4_K, (mmvq_coop<CoopQ4K, T_Q4_K, 8, 1>))
MMVQ(mmvq_q4_k_batch, T_Q4_K, (mmvq_coop<CoopQ4K, T_Q4_K, 2, MAX_TOKENS>))
MMVQ(mmvq_q6_k_r, T_Q6_K_R, (mmvq_coop<CoopQ6K<T_Q6_K_R>, T_Q6_K_R, 8, 1>))
MMVQ(mmvq_q6_k_r_batch, T_Q6_K_R, (mmvq_coop<CoopQ6K<T_Q6_K_R>, T_Q6_K_R, 2, MAX_TOKENS>))
MMVQ(mmvq_q8_0_r, T_Q8_0_R, (mmvq_coop<CoopQ80R, T_Q8_0_R, 2, 1>))
MMVQ(mmvq_q8_0_r_batch, T_Q8_0_R, (mmvq_coop<CoopQ80R, T_Q8_0_R, 2, MAX_TOKENS>))
// One warp per row.
MMVQ(mmvq_q6_k, T_Q6_K, mmvq_q6_k)
MMVQ(mmvq_q4_0, T_Q4_0, mmvq_generic<T_Q4_0>)
MMVQ(mmvq_q4_1, T_Q4_1, mmvq_generic<T_Q4_1>)
MMVQ(mmvq_q5_0, T_Q5_0, mmvq_generic<T_Q5_0>)
MMVQ(mmvq_q5_1, T_Q5_1, mmvq_generic<T_Q5_1>)
MMVQ(mmvq_q8_0, T_Q8_0, mmvq_generic<T_Q8_0>)
MMVQ(mmvq_iq4_nl, T_IQ4_NL, mmvq_generic<T_IQ4_NL>)
MMVQ(mmvq_q2_k, T_Q2_K, mmvq_generic<T_Q2_K>)
MMVQ(mmvq_q3_k, T_Q3_K, mmvq_generic<T_Q3_K>)
MMVQ(mmvq_q5_k, T_Q5_K, mmvq_generic<T_Q5_K>)
MMVQ(mmvq_iq4_xs, T_IQ4_XS, mmvq_generic<T_IQ4_XS>)
MMVQ(mmvq_f32, T_F32, mmvq_float<T_F32>)
MMVQ(mmvq_f32_coop, T_F32, (mmvq_coop<CoopF32, T_F32, 2, 1>))
MMVQ(mmvq_f16, T_F16, mmvq_float<T_F16>)
MMVQ(mmvq_bf16, T_BF16, mmvq_float<T_BF16>)
MMVQ_PAIR(mmvq_q4_k_v_q6_k_r, T_Q4_K, (mmvq_coop<CoopQ4K, T_Q4_K, 8, 1>), T_Q6_K_R, (mmvq_coop<CoopQ6K<T_Q6_K_R>, T_Q6_K_R, 8, 1>))
MMVQ_PAIR(mmvq_q4_k_v_q6_k, T_Q4_K, (mmvq_coop<CoopQ4K, T_Q4_K, 8, 1>), T_Q6_K, mmvq_q6_k)
MMVQ_PAIR(mmvq_q5_0_v_q8_0, T_Q5_0, mmvq_generic<T_Q5_0>, T_Q8_0, mmvq_generic<T_Q8_0>)

// A MoE layer's F32 router for one token, and its routing: the router's rows as
// mmvq_f32_coop computes them (2 a block) into `logits`, then the last block to finish (a
// counter, which it resets) picks the experts into ids and weights as moe_route does. One
// launch a layer fewer than the router and moe_route apart.
extern "C" __global__ void __launch_bounds__(THREADS)
    moe_router_f32(const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                   const float* __restrict__ XS, float* __restrict__ logits, int ncols, int n_exp,
                   unsigned* __restrict__ counter, int* __restrict__ ids, float* __restrict__ weights, int n_used,
                   int normalize) {
    PDL_WAIT();
    mmvq_coop<CoopF32, T_F32, 2, 1>(blockIdx.x, W, XQ, XD, XS, logits, nullptr, ncols, n_exp, 1);
    // Every thread's stores before the count (the CUDA programming guide's last-block
    // pattern): the last block then reads all the logits through L2.
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *counter = 0;
    __threadfence();
    if (threadIdx.x < WARP_SIZE) moe_route_any(logits, ids, weights, n_exp, n_used, normalize);
}

// Experts: block (b, k, t) computes rows of expert ids[t][k] (weights at W + id * stride)
// for token t; its input is token t's activations (gate and up: `per_slot` 0) or the
// (t, k) row of its own (down: `per_slot` 1); its output is the (t, k) row of Y.
#define MMVQ_MOE(name, FN)                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
        name(const uint8_t* __restrict__ W, long long stride, const int* __restrict__ ids, int n_used,              \
             const int8_t* __restrict__ XQ, const float* __restrict__ XD, const float* __restrict__ XS,             \
             float* __restrict__ Y, int ncols, int nrows, int per_slot) {                                           \
        PDL_WAIT();                                                                                                 \
        const int k = blockIdx.y, t = blockIdx.z;                                                                   \
        const size_t slot = (size_t)t * n_used + k;                                                                 \
        const size_t x = per_slot ? slot : t;                                                                       \
        FN(blockIdx.x, W + ids[slot] * stride, XQ + x * ncols, XD + x * (ncols / 32),                               \
           XS + x * (ncols / 32), Y + slot * nrows, nullptr, ncols, nrows, 1);                                 \
    }

MMVQ_MOE(mmvq_moe_q4_k, (mmvq_coop<CoopQ4K, T_Q4_K, 8, 1>))
MMVQ_MOE(mmvq_moe_q6_k_r, (mmvq_coop<CoopQ6K<T_Q6_K_R>, T_Q6_K_R, 8, 1>))
MMVQ_MOE(mmvq_moe_q8_0_r, (mmvq_coop<CoopQ80R, T_Q8_0_R, 2, 1>))
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

// Experts, fused, for the block-cooperative formats: the launches of a MoE FFN go from
// five (gate, up, activation, down, weighted sum) to two, and a warp takes whole short
// rows (768 or 2048 weights: the block-cooperative layout left 104 or 64 of a block's 128
// threads idle on them). 16 warps a block, each with little work: with 8, Nsight Compute
// found both kernels bound by instruction latency (a warp issuing every 9 cycles, 0.3-0.4
// instructions a cycle per scheduler, under 3 warps each; 13.5 us for the 30B-A3B's gate
// and up, 13.4 for its Q6_K down).
#define MOE_WARPS 16

// Gate and up of the chosen experts, the gated activation, quantized per 32 as the down
// products' input (slot (t, k)'s row of nrows in OQ, OD, OS): block (tile of 32 rows, slot
// k, token t); warp w takes rows 2w and 2w+1 of the tile in both matrices, its lanes the
// rows' units of 32 weights. nrows is a multiple of 32 (the host checks).
template <typename Unit, int T>
__device__ __forceinline__ void moe_gate_up(const uint8_t* __restrict__ WG, const uint8_t* __restrict__ WU,
                                            long long stride, const int* __restrict__ ids, int n_used,
                                            const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                            const float* __restrict__ XS, int8_t* __restrict__ OQ,
                                            float* __restrict__ OD, float* __restrict__ OS, int ncols, int nrows,
                                            int gelu) {
    constexpr int R = 32 / MOE_WARPS;
    const int k = blockIdx.y, t = blockIdx.z;
    const size_t slot = (size_t)t * n_used + k;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int row0 = blockIdx.x * 32 + warp * R, n_units = ncols / 32;
    const size_t row_bytes = row_bytes_of(T, ncols);
    const size_t e = (size_t)ids[slot] * stride + row0 * row_bytes;
    const int8_t* xq = XQ + (size_t)t * ncols;
    const float *xd = XD + (size_t)t * n_units, *xs = XS + (size_t)t * n_units;
    float ag[R], au[R];
#pragma unroll
    for (int r = 0; r < R; ++r) ag[r] = au[r] = 0.0f;
    // Two passes' loads in flight together where a unit is small enough (Q4_K; the 30B's
    // rows of 2,048 are exactly two passes): one pass at a time, a warp waited on memory
    // twice. Larger units spilled at the 64 registers of two blocks an SM.
    constexpr int PASSES = sizeof(Unit) <= 32 ? 2 : 1;
#pragma unroll PASSES
    for (int u = lane; u < n_units; u += WARP_SIZE) {
        Unit g[R], v[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            g[r].load(WG + e + r * row_bytes, u);
            v[r].load(WU + e + r * row_bytes, u);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ag[r] += g[r].dot(xq, xd, xs, u);
            au[r] += v[r].dot(xq, xd, xs, u);
        }
    }
    __shared__ float h[32];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float a = warp_sum(ag[r]), b = warp_sum(au[r]);
        if (lane == 0) h[warp * R + r] = gate_act(a, gelu) * b;
    }
    __syncthreads();
    if (warp == 0) {
        quantize_warp_block(h[lane], blockIdx.x * 32 + lane, true, OQ + slot * nrows, OD + slot * (nrows / 32),
                            OS + slot * (nrows / 32));
    }
}

// The chosen experts' down products and their weighted sum: Y[t] = sum over k of
// weights[t][k] * W_{ids[t][k]} . x[t][k]. Block (tile of R rows, token t); the warps come
// in two halves, each taking half the tile's rows; warp w of a half takes slots w, w +
// SLOT_WARPS, ..., its lanes the units. The warps' sums meet in shared memory in slot
// order, so a token's result depends on nothing else in the batch.
template <typename Unit, int T, int R>
__device__ __forceinline__ void moe_down(const uint8_t* __restrict__ W, long long stride,
                                         const int* __restrict__ ids, const float* __restrict__ weights, int n_used,
                                         const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                         const float* __restrict__ XS, float* __restrict__ Y, int ncols,
                                         int nrows) {
    constexpr int SLOT_WARPS = MOE_WARPS / 2, RH = R / 2;
    const int t = blockIdx.y;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int half = warp / SLOT_WARPS, sw = warp % SLOT_WARPS;
    const int row0 = blockIdx.x * R, rh0 = row0 + half * RH, n_units = ncols / 32;
    const size_t row_bytes = row_bytes_of(T, ncols);
    float acc[RH];
#pragma unroll
    for (int r = 0; r < RH; ++r) acc[r] = 0.0f;
    for (int k = sw; k < n_used; k += SLOT_WARPS) {
        const size_t slot = (size_t)t * n_used + k;
        const uint8_t* w = W + (size_t)ids[slot] * stride;
        const float wt = weights[slot];
        const int8_t* xq = XQ + slot * ncols;
        const float *xd = XD + slot * n_units, *xs = XS + slot * n_units;
        for (int u = lane; u < n_units; u += WARP_SIZE) {
            Unit v[RH];
#pragma unroll
            for (int r = 0; r < RH; ++r) v[r].load(w + (size_t)min(rh0 + r, nrows - 1) * row_bytes, u);
#pragma unroll
            for (int r = 0; r < RH; ++r) acc[r] += wt * v[r].dot(xq, xd, xs, u);
        }
    }
    __shared__ float part[SLOT_WARPS][R];
#pragma unroll
    for (int r = 0; r < RH; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) part[sw][half * RH + r] = v;
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r < R && row0 + r < nrows) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < SLOT_WARPS; ++w) v += part[w][r];
        Y[(size_t)t * nrows + row0 + r] = v;
    }
}

#define MOE_FUSED(sfx, UNIT, T, R)                                                                                 \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP_SIZE, 2) moe_gate_up_##sfx(                       \
        const uint8_t* __restrict__ WG, const uint8_t* __restrict__ WU, long long stride,                          \
        const int* __restrict__ ids, int n_used, const int8_t* __restrict__ XQ, const float* __restrict__ XD,      \
        const float* __restrict__ XS, int8_t* __restrict__ OQ, float* __restrict__ OD, float* __restrict__ OS,     \
        int ncols, int nrows, int gelu) {                                                                          \
        PDL_WAIT();                                                                                                 \
        moe_gate_up<UNIT, T>(WG, WU, stride, ids, n_used, XQ, XD, XS, OQ, OD, OS, ncols, nrows, gelu);             \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP_SIZE, 2) moe_down_##sfx(                         \
        const uint8_t* __restrict__ W, long long stride, const int* __restrict__ ids,                              \
        const float* __restrict__ weights, int n_used, const int8_t* __restrict__ XQ,                              \
        const float* __restrict__ XD, const float* __restrict__ XS, float* __restrict__ Y, int ncols, int nrows) { \
        PDL_WAIT();                                                                                                 \
        moe_down<UNIT, T, R>(W, stride, ids, weights, n_used, XQ, XD, XS, Y, ncols, nrows);                        \
    }

MOE_FUSED(q4_k, CoopQ4K, T_Q4_K, 8)
MOE_FUSED(q6_k_r, CoopQ6K<T_Q6_K_R>, T_Q6_K_R, 8)
MOE_FUSED(q6_k, CoopQ6K<T_Q6_K>, T_Q6_K, 8)
MOE_FUSED(q8_0_r, CoopQ80R, T_Q8_0_R, 4)

// The residual step and the next matvec's input in one launch: x_out = x + o (o may be
// null), then the RMS norm of x_out times w, quantized to int8 per 32 as quantize_act_q8
// does. Blocks of 256 threads each take 256 elements; every block computes the whole row's
// sum of squares itself (the row is a few KiB in L2), so no block waits for another, and
// x_out is a different buffer from x so that no block reads what another has written.
// The sum of squares reads float4s in an unrolled loop, so that a thread's loads are in
// flight together: one at a time, their L2 latencies in a row made each launch 6 us, 0.39
// of a 3.05 ms decode step (measured by leaving it out of the graph, docs/cuda.md).
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
    const float4* x4 = (const float4*)x;
    const float4* o4 = (const float4*)o;
    float ss = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
        float4 v = x4[i];
        if (o) {
            const float4 p = o4[i];
            v.x += p.x;
            v.y += p.y;
            v.z += p.z;
            v.w += p.w;
        }
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
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
