// Products of quantized weights with 9 to 16 tokens' int8 activations on the int8 tensor
// cores (`mma.sync`), for decode steps of many sequences: the form llama.cpp calls MMQ.
//
// The mat-vec kernels (quant_matvec.cu) unpack a weight once and multiply it with each
// token's activations by dp4a: work that grows with the tokens, so that from about 8 tokens
// they are bound by arithmetic, not by reading the weights. Here a warp multiplies a 32-weight
// sub-block of 16 weight rows with 8 tokens in one instruction (m16n8k32: A the rows' int8
// levels, B the tokens' int8 activations, int32 sums), then scales the sums by the
// sub-block's weight scale and each token's activation scale in f32, as the mat-vec kernels
// do for one token. Same inputs (`quantize_act_q8`'s int8 per 32 with an f32 scale and
// scaled sum), same output (Y: ntok x nrows f32).
//
// A block of 4 warps takes 64 rows (16 a warp) and every token. The row is walked in chunks
// of 256 weights; each chunk's weights (64 rows) and activations (every token) are copied
// into shared memory by cp.async, the next chunk's while the warps multiply this one's, so
// the activations are read once per 64 rows. Matrices with few rows split the row in up to
// 8 parts over blocks (`ksplit`, chosen by the matrix's shape only); each part writes its
// sums to a work buffer, and the last part of a tile to finish adds them in part order:
// a token's result depends only on its own activations and the matrix, never on the other
// tokens of the step.
//
// The k index inside a sub-block is permuted, the same way for A and B (a dot product does
// not care about order): lane (g, q) of the mma's layout holds the 8 weights at 8q..8q+7 of
// its rows and the 8 activations at 8q..8q+7 of its token, each one 8-byte load where the
// documented layout would take two 4-byte ones. Q6_K, whose scales are per 16, uses
// m16n8k16 per 16 weights (lane q: weights 4q..4q+3).
#include "quant_blocks.cuh"
#include "tensor_core.cuh"

#define MMQ_THREADS 128
#define MMQ_TILE 64    // rows per block, 16 a warp
#define XROW 288       // bytes per token in the staged activations: 256 and 32 of padding
                       // (a stride of 72 words: the 8-byte fragment loads of a half-warp
                       // meet no bank twice)

__device__ __forceinline__ void mma_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], int a0, int a1, int b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// The staged activations of one chunk: q[t][XROW] int8, d[t][8] and s[t][8] f32 (per 32).
struct Acts {
    const int8_t* q;
    const float* d;
    const float* s;
};

// An int32 sum as f32 by the exponent trick (|c| < 2^22, which every sum of 32 products of
// int8 activations and 8-bit levels is): an integer add and a float add, where cvt.f32.s32
// runs at a quarter of the FP32 rate (measured: no faster, kept for fewer slow ops).
__device__ __forceinline__ float i2f(int c) { return __int_as_float(c + 0x4B400000) - 12582912.0f; }

// acc += sa * d * c - m * s for the thread's four C elements: rows g (sa, ma) and g + 8
// (sb, mb), tokens 0 and 1 (d, s).
__device__ __forceinline__ void scale_add(float (&acc)[4], const int (&c)[4], float sa, float sb, float ma, float mb,
                                          float2 d, float2 s) {
    acc[0] += sa * d.x * i2f(c[0]) - ma * s.x;
    acc[1] += sa * d.y * i2f(c[1]) - ma * s.y;
    acc[2] += sb * d.x * i2f(c[2]) - mb * s.x;
    acc[3] += sb * d.y * i2f(c[3]) - mb * s.y;
}

__device__ __forceinline__ void scale_add(float (&acc)[4], const int (&c)[4], float sa, float sb, float2 d) {
    acc[0] += sa * d.x * i2f(c[0]);
    acc[1] += sa * d.y * i2f(c[1]);
    acc[2] += sb * d.x * i2f(c[2]);
    acc[3] += sb * d.y * i2f(c[3]);
}

// Byte k of w as f32 (the exponent trick again: 0x4B0000bb is 2^23 + b).
__device__ __forceinline__ float byte_f(uint32_t w, int k) {
    return __int_as_float(__byte_perm(w, 0x4B, 0x4550 | k)) - 8388608.0f;
}

// Q4_K's 12 scale bytes (words y, z, w of the block head) as four words of bytes: scales of
// sub-blocks 0-3, 4-7, then mins 0-3, 4-7.
__device__ __forceinline__ void unpack_scales_k4(int4 head, uint32_t (&out)[4]) {
    const uint32_t y = head.y, z = head.z, w = head.w;
    out[0] = y & 0x3f3f3f3f;
    out[1] = (w & 0x0f0f0f0f) | (((y >> 6) & 0x03030303) << 4);
    out[2] = z & 0x3f3f3f3f;
    out[3] = ((w >> 4) & 0x0f0f0f0f) | (((z >> 6) & 0x03030303) << 4);
}

// The scales of tokens t0 and t0 + 1 for sub-block j of the chunk.
__device__ __forceinline__ float2 pair(const float* v, int t0, int j) { return make_float2(v[t0 * 8 + j], v[t0 * 8 + 8 + j]); }

// Q4_K: a chunk is one block (144 bytes: d, dmin, 12 scale bytes, 128 of nibbles), staged
// in rows of 160. Unit c of 4: 32 bytes of nibbles whose low nibbles are sub-block 2c and
// high nibbles sub-block 2c + 1.
struct MmqQ4K {
    static constexpr int T = T_Q4_K;
    static constexpr int SROW = 160;
    static constexpr int COPIES = 9;  // 16-byte copies per row and chunk
    __device__ static const uint8_t* src(const uint8_t* row, int kb, int i) { return row + (size_t)kb * 144 + 16 * i; }
    template <int NT>
    __device__ static void chunk(float (&acc)[NT][4], const uint8_t* ra, const uint8_t* rb, const Acts& x, int g,
                                 int q) {
        const int4 ha = *(const int4*)ra, hb = *(const int4*)rb;
        const float da = __half2float(__ushort_as_half(ha.x & 0xffff));
        const float ma0 = __half2float(__ushort_as_half((uint32_t)ha.x >> 16));
        const float db = __half2float(__ushort_as_half(hb.x & 0xffff));
        const float mb0 = __half2float(__ushort_as_half((uint32_t)hb.x >> 16));
        // The 8 scales and 8 mins of each row as bytes (ggml's kmask unpacking of
        // scale_min_k4): words [scales 0-3, scales 4-7, mins 0-3, mins 4-7].
        uint32_t ka[4], kb4[4];
        unpack_scales_k4(ha, ka);
        unpack_scales_k4(hb, kb4);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const uint2 wa = *(const uint2*)(ra + 16 + 32 * c + 8 * q);
            const uint2 wb = *(const uint2*)(rb + 16 + 32 * c + 8 * q);
            float sa[2], sb[2], ma[2], mb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int j = 2 * c + i;
                sa[i] = da * byte_f(ka[j / 4], j % 4);
                ma[i] = ma0 * byte_f(ka[2 + j / 4], j % 4);
                sb[i] = db * byte_f(kb4[j / 4], j % 4);
                mb[i] = mb0 * byte_f(kb4[2 + j / 4], j % 4);
            }
            const int lo[4] = {(int)(wa.x & 0x0f0f0f0f), (int)(wb.x & 0x0f0f0f0f), (int)(wa.y & 0x0f0f0f0f),
                               (int)(wb.y & 0x0f0f0f0f)};
            const int hi[4] = {(int)((wa.x >> 4) & 0x0f0f0f0f), (int)((wb.x >> 4) & 0x0f0f0f0f),
                               (int)((wa.y >> 4) & 0x0f0f0f0f), (int)((wb.y >> 4) & 0x0f0f0f0f)};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int8_t* xb = x.q + (8 * n + g) * XROW + 64 * c + 8 * q;
                const uint2 b0 = *(const uint2*)xb, b1 = *(const uint2*)(xb + 32);
                const int t0 = 8 * n + 2 * q;
                // Both sub-blocks' scale and sum of tokens t0 and t0 + 1.
                const float2 d0 = *(const float2*)(x.d + t0 * 8 + 2 * c), d1 = *(const float2*)(x.d + t0 * 8 + 8 + 2 * c);
                const float2 s0 = *(const float2*)(x.s + t0 * 8 + 2 * c), s1 = *(const float2*)(x.s + t0 * 8 + 8 + 2 * c);
                int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                mma_k32(c0, lo[0], lo[1], lo[2], lo[3], b0.x, b0.y);
                mma_k32(c1, hi[0], hi[1], hi[2], hi[3], b1.x, b1.y);
                scale_add(acc[n], c0, sa[0], sb[0], ma[0], mb[0], make_float2(d0.x, d1.x), make_float2(s0.x, s1.x));
                scale_add(acc[n], c1, sa[1], sb[1], ma[1], mb[1], make_float2(d0.y, d1.y), make_float2(s0.y, s1.y));
            }
        }
    }
};

// Regrouped Q8_0: a chunk is one group of 8 blocks (272 bytes: 8 f16 scales, then 8 x 32
// quants), staged in rows of 288.
struct MmqQ80R {
    static constexpr int T = T_Q8_0_R;
    static constexpr int SROW = 288;
    static constexpr int COPIES = 17;
    __device__ static const uint8_t* src(const uint8_t* row, int kb, int i) { return row + (size_t)kb * 272 + 16 * i; }
    template <int NT>
    __device__ static void chunk(float (&acc)[NT][4], const uint8_t* ra, const uint8_t* rb, const Acts& x, int g,
                                 int q) {
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            uint2 wa[2], wb[2];
            float sa[2], sb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                wa[i] = *(const uint2*)(ra + 16 + 32 * (j + i) + 8 * q);
                wb[i] = *(const uint2*)(rb + 16 + 32 * (j + i) + 8 * q);
                sa[i] = ldh(ra + 2 * (j + i));
                sb[i] = ldh(rb + 2 * (j + i));
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int t0 = 8 * n + 2 * q;
                const float2 d0 = *(const float2*)(x.d + t0 * 8 + j), d1 = *(const float2*)(x.d + t0 * 8 + 8 + j);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const uint2 b = *(const uint2*)(x.q + (8 * n + g) * XROW + 32 * (j + i) + 8 * q);
                    int c[4] = {0, 0, 0, 0};
                    mma_k32(c, (int)wa[i].x, (int)wb[i].x, (int)wa[i].y, (int)wb[i].y, b.x, b.y);
                    scale_add(acc[n], c, sa[i], sb[i], i ? make_float2(d0.y, d1.y) : make_float2(d0.x, d1.x));
                }
            }
        }
    }
};

// Regrouped Q6_K: a chunk is one block, its fields copied out of its group (128 bytes of low
// bits, 64 of high bit pairs, 16 int8 scales, and the group's 16 bytes of f16 scales d), staged
// in rows of 240. Sub-block p of half h: weights 128h + 32p .., low bits at 64h + 32(p % 2)
// (low nibbles for p < 2), high bit pairs at 32h (bits 2p), scales 8h + 2p + (0, 1) per 16.
struct MmqQ6KR {
    static constexpr int T = T_Q6_K_R;
    static constexpr int SROW = 240;
    static constexpr int COPIES = 14;
    __device__ static const uint8_t* src(const uint8_t* row, int kb, int i) {
        const uint8_t* grp = row + (size_t)(kb / REGROUP) * (REGROUP * 210);
        const int b = kb % REGROUP;
        if (i < 8) return grp + 128 * b + 16 * i;
        if (i < 12) return grp + 1024 + 64 * b + 16 * (i - 8);
        if (i < 13) return grp + 1536 + 16 * b;
        return grp + 1664;
    }
    template <int NT>
    __device__ static void chunk(float (&acc)[NT][4], const uint8_t* ra, const uint8_t* rb, const Acts& x, int g,
                                 int q, int kb) {
        const int b = kb % REGROUP;
        const float da = ldh(ra + 208 + 2 * b), db = ldh(rb + 208 + 2 * b);
        const int8_t* sca = (const int8_t*)(ra + 192);
        const int8_t* scb = (const int8_t*)(rb + 192);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int h = u / 2, p0 = u % 2;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int v[2][2];  // [p0, p0 + 2][row g, g + 8]
                const uint8_t* rows[2] = {ra, rb};
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int l = *(const int*)(rows[r] + 64 * h + 32 * p0 + 16 * k + 4 * q);
                    const int hb = *(const int*)(rows[r] + 128 + 32 * h + 16 * k + 4 * q);
                    v[0][r] = __vsubss4((l & 0x0f0f0f0f) | (((hb >> (2 * p0)) & 0x03030303) << 4), 0x20202020);
                    v[1][r] = __vsubss4(((l >> 4) & 0x0f0f0f0f) | (((hb >> (2 * p0 + 4)) & 0x03030303) << 4),
                                        0x20202020);
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int p = p0 + 2 * i;
                    const float sa = da * sca[8 * h + 2 * p + k], sb = db * scb[8 * h + 2 * p + k];
                    const int e = 128 * h + 32 * p + 16 * k;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const int bq = *(const int*)(x.q + (8 * n + g) * XROW + e + 4 * q);
                        int c[4] = {0, 0, 0, 0};
                        mma_k16(c, v[i][0], v[i][1], bq);
                        scale_add(acc[n], c, sa, sb, pair(x.d, 8 * n + 2 * q, 4 * h + p));
                    }
                }
            }
        }
    }
};

template <typename U, int NT>
__device__ __forceinline__ void chunk_of(float (&acc)[NT][4], const uint8_t* ra, const uint8_t* rb, const Acts& x,
                                         int g, int q, int kb) {
    if constexpr (U::T == T_Q6_K_R) {
        U::template chunk<NT>(acc, ra, rb, x, g, q, kb);
    } else {
        U::template chunk<NT>(acc, ra, rb, x, g, q);
    }
}

// Up to three matrices per launch (q, k and v; gate and up), as the mat-vec kernels take
// them; `part` offsets their regions of the work buffer.
struct MmqSet {
    const uint8_t* w[3];
    float* y[3];
    const float* bias[3];  // added to each row's sum; may be null
    int nrows[3];
    int first[4];
    long long part[3];
};

// Shared memory per stage: the weights' rows, then the activations' int8 rows, scales and
// sums.
template <typename U, int NT>
struct Stage {
    static constexpr int W = MMQ_TILE * U::SROW;
    static constexpr int Q = 8 * NT * XROW;
    static constexpr int F = 8 * NT * 8 * 4;
    static constexpr int BYTES = W + Q + 2 * F;
};

// Stages a chunk: the block's threads copy the tile's rows (consecutive threads take
// consecutive 16-byte pieces of a row: whole sectors per warp) and every token's 256 int8
// activations (16 pieces), 8 scales and 8 sums (2 pieces each).
template <typename U, int NT, int THREADS>
__device__ __forceinline__ void stage_chunk(uint8_t* st, const uint8_t* __restrict__ W, size_t row_bytes, int r0,
                                            int nrows, const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                            const float* __restrict__ XS, int ncols, int ntok, int kb) {
    using S = Stage<U, NT>;
#pragma unroll
    for (int i = threadIdx.x; i < MMQ_TILE * U::COPIES; i += THREADS) {
        const int r = i / U::COPIES, j = i % U::COPIES;
        // Rows past the end repeat the last row; their sums are not stored.
        const uint8_t* row = W + (size_t)min(r0 + r, nrows - 1) * row_bytes;
        tc_cp16(st + r * U::SROW + 16 * j, U::src(row, kb, j), true);
    }
    const int n_sub = ncols / 32;
    // Tokens past ntok repeat the last token; their columns are not stored.
#pragma unroll
    for (int i = threadIdx.x; i < 8 * NT * 20; i += THREADS) {
        const int t = i / 20, j = i % 20, ts = min(t, ntok - 1);
        if (j < 16) {
            tc_cp16(st + S::W + t * XROW + 16 * j, XQ + (size_t)ts * ncols + (size_t)kb * 256 + 16 * j, true);
        } else {
            const float* v = j < 18 ? XD : XS;
            const int off = j < 18 ? 0 : S::F;
            tc_cp16(st + S::W + S::Q + off + t * 32 + 16 * (j % 2), v + (size_t)ts * n_sub + kb * 8 + 4 * (j % 2), true);
        }
    }
}

// The block: 4 warps, warp w taking rows 16w .. 16w + 15 of the tile and every token; two
// chunks in flight (the shapes tried against it are in docs/cuda.md). matvec.rs's mmq_set
// launches it with MMQ_THREADS threads and the two stages' shared memory for 16 tokens.
#define MMQ_STAGES 2
template <typename U, int NT>
__device__ __forceinline__ void mmq(const MmqSet& set, const int8_t* __restrict__ XQ, const float* __restrict__ XD,
                                    const float* __restrict__ XS, int ncols, int ntok, float* __restrict__ part,
                                    unsigned* __restrict__ counters) {
    using S = Stage<U, NT>;
    constexpr int THREADS = MMQ_THREADS, STAGES = MMQ_STAGES;
    extern __shared__ __align__(16) uint8_t smem[];
    const int b = blockIdx.x;
    const bool m2 = b >= set.first[2], m1 = !m2 && b >= set.first[1];
    const uint8_t* W = m2 ? set.w[2] : m1 ? set.w[1] : set.w[0];
    float* Y = m2 ? set.y[2] : m1 ? set.y[1] : set.y[0];
    const float* B = m2 ? set.bias[2] : m1 ? set.bias[1] : set.bias[0];
    const int nrows = m2 ? set.nrows[2] : m1 ? set.nrows[1] : set.nrows[0];
    const int first = m2 ? set.first[2] : m1 ? set.first[1] : set.first[0];
    const long long part_at = m2 ? set.part[2] : m1 ? set.part[1] : set.part[0];
    const int r0 = (b - first) * MMQ_TILE;
    const size_t row_bytes = row_bytes_of(U::T, ncols);
    // This block's part of the row: chunks [c0, c1).
    const int n_chunks = ncols / 256, ksplit = gridDim.y, split = blockIdx.y;
    const int per = (n_chunks + ksplit - 1) / ksplit;
    const int c0 = split * per, c1 = min(n_chunks, c0 + per);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, q = lane % 4;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
    }
    // The first STAGES - 1 chunks in flight, then one more as each is multiplied.
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (c0 + i < c1)
            stage_chunk<U, NT, THREADS>(smem + i * S::BYTES, W, row_bytes, r0, nrows, XQ, XD, XS, ncols, ntok, c0 + i);
        tc_commit();
    }
    for (int kb = c0; kb < c1; ++kb) {
        uint8_t* st = smem + ((kb - c0) % STAGES) * S::BYTES;
        const int next = kb + STAGES - 1;
        if (next < c1) {
            stage_chunk<U, NT, THREADS>(smem + ((next - c0) % STAGES) * S::BYTES, W, row_bytes, r0, nrows, XQ, XD, XS,
                                        ncols, ntok, next);
        }
        tc_commit();
        tc_wait<STAGES - 1>();
        __syncthreads();
        const Acts x = {(const int8_t*)(st + S::W), (const float*)(st + S::W + S::Q),
                        (const float*)(st + S::W + S::Q + S::F)};
        const uint8_t* ra = st + (16 * warp + g) * U::SROW;
        chunk_of<U, NT>(acc, ra, ra + 8 * U::SROW, x, g, q, kb);
        // Every warp is done with this stage before the next iteration's copies overwrite it.
        __syncthreads();
    }
    const int row_a = r0 + 16 * warp + g;
    if (ksplit == 1) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row_a + 8 * (i / 2), t = 8 * n + 2 * q + i % 2;
                if (row < nrows && t < ntok) Y[(size_t)t * nrows + row] = acc[n][i] + (B ? B[row] : 0.0f);
            }
        }
        return;
    }
    // Split rows: this part's sums into the work buffer; the last part of the tile to finish
    // adds every part's in order.
    float* mine = part + part_at;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row_a + 8 * (i / 2), t = 8 * n + 2 * q + i % 2;
            if (row < nrows && t < ntok) mine[((size_t)split * ntok + t) * nrows + row] = acc[n][i];
        }
    }
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(&counters[b], 1u) == (unsigned)ksplit - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row_a + 8 * (i / 2), t = 8 * n + 2 * q + i % 2;
            if (row < nrows && t < ntok) {
                float v = 0.0f;
                for (int s = 0; s < ksplit; ++s) v += __ldcg(mine + ((size_t)s * ntok + t) * nrows + row);
                Y[(size_t)t * nrows + row] = v + (B ? B[row] : 0.0f);
            }
        }
    }
    if (threadIdx.x == 0) counters[b] = 0;
}

// A kernel: format U, up to 8 NT tokens.
#define MMQ(name, U, NT)                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                                                       \
        name(MmqSet set, const int8_t* __restrict__ XQ, const float* __restrict__ XD, const float* __restrict__ XS,  \
             int ncols, int ntok, float* __restrict__ part, unsigned* __restrict__ counters) {                      \
        PDL_WAIT();                                                                                                 \
        mmq<U, NT>(set, XQ, XD, XS, ncols, ntok, part, counters);                                                   \
    }

// Up to 16 tokens (docs/cuda.md: the shapes for 32 and 64 that were tried lost to the GEMM
// path on f16 copies).
MMQ(mmq_q4_k_16, MmqQ4K, 2)
MMQ(mmq_q6_k_r_16, MmqQ6KR, 2)
MMQ(mmq_q8_0_r_16, MmqQ80R, 2)
