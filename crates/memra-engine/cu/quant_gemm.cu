// Quantized weights times f16 activations on the f16 tensor cores (`mma.sync m16n8k16`,
// f32 accumulate), for batches of tokens: the prompt path's matrices without f16 copies,
// and the experts of a mixture-of-experts layer with the batch's tokens grouped by expert.
//
// The weights are a copy made at load (`qgemm.rs`, "tile layout"): each row tile of 16 rows
// and each chunk of 64 columns is 32 lanes' A fragments, so that a warp reads one chunk in
// one coalesced 16-byte load per lane (4-bit levels) or two (8-bit), the levels already in
// the order the mma wants them. Every weight is `s * u - m` with u an unsigned level, s and
// m f16 per row and group of 16 or 32 columns (the file's sub-block scales, the type's
// offset folded into m). A lane turns 8 levels into f16 with integer ops (a level or'ed
// into the mantissa of 1024.0), one subtraction of 1024 and one fma per pair: the weight
// is rounded to f16 once, as the cuBLAS path's f16 copies round it.
//
// A block of 4 warps takes 64 rows (16 a warp) and BN = 8 * NT tokens. Each stage of 128
// columns is copied into shared memory by cp.async, QG_STAGES in flight: every warp's own
// levels and scales (contiguous in the layout) and the block's tokens' activations, each
// 16-byte piece of a row at a position xor'ed by the row so that ldmatrix meets no bank
// twice. (With the weights one stage ahead in registers, 16 tokens read them at 1.3-1.8
// TB/s: too few bytes in flight.) A dense product's first weight stages are fetched before
// the programmatic wait. Matrices with few row tiles split the row over blocks
// (gridDim.z parts, chosen by the matrix's shape only); each part writes its sums to a work
// buffer and `qgemm_reduce` adds them in part order, so a token's result never depends on
// the other tokens of the batch.
//
// Grouped (experts): a tile list on the device (`moe_group`) gives each block its expert,
// first slot and token count; blocks past the list's length return at once. A slot's
// activations are row idx[slot] of X (or row slot itself), its output row `slot` of Y.
#include "common.cuh"
#include "tensor_core.cuh"

#define QG_THREADS 128
#define QG_ROWS 64  // rows per block, 16 a warp
#define QG_KC 128   // columns per stage
// Stages in flight (weights and activations, cp.async): enough bytes on their way to keep
// the memory busy at 16-32 tokens; fewer at 64, whose activations take more shared memory.
#define QG_STAGES(NT) ((NT) <= 4 ? 4 : 3)

// (1024 + u) as half2 -> s * u - m: the subtraction is exact, the fma rounds once.
__device__ __forceinline__ uint32_t qg_weight(uint32_t biased, __half2 s, __half2 negm) {
    const __half2 u = __hsub2(u2h(biased), __float2half2_rn(1024.0f));
    return h2u(__hfma2(u, s, negm));
}

// One k16 step's A fragment from its levels. 4-bit: one word, nibbles (row g: 0 and 4;
// row g+8: 1 and 5; row g, k+8: 2 and 6; row g+8, k+8: 3 and 7). 8-bit: two words, bytes
// (row g: 0, 1; row g+8: 2, 3) of the first for k 2t, 2t+1, of the second for k+8.
template <int BITS>
__device__ __forceinline__ void qg_unpack(uint32_t (&a)[4], const uint32_t* w, __half2 sg, __half2 mg, __half2 s8,
                                          __half2 m8) {
    if (BITS == 4) {
        const uint32_t x = w[0];
        a[0] = qg_weight((x & 0x000F000Fu) | 0x64006400u, sg, mg);
        a[1] = qg_weight(((x >> 4) & 0x000F000Fu) | 0x64006400u, s8, m8);
        a[2] = qg_weight(((x >> 8) & 0x000F000Fu) | 0x64006400u, sg, mg);
        a[3] = qg_weight(((x >> 12) & 0x000F000Fu) | 0x64006400u, s8, m8);
    } else {
        a[0] = qg_weight(__byte_perm(w[0], 0x64u, 0x4140), sg, mg);
        a[1] = qg_weight(__byte_perm(w[0], 0x64u, 0x4342), s8, m8);
        a[2] = qg_weight(__byte_perm(w[1], 0x64u, 0x4140), sg, mg);
        a[3] = qg_weight(__byte_perm(w[1], 0x64u, 0x4342), s8, m8);
    }
}

// BITS: 4 or 8. GPC: scale groups per 64-column chunk (2: per 32, 4: per 16). NT: n-tiles
// of 8 tokens per block.
//   wq: levels, [row tile][chunk][WPC][lane] uint4 (WPC = BITS / 4)
//   sc: scales, [row tile][chunk][16 rows][GPC] half2 (s, -m)
//   x: activations, rows of k f16; y: rows of ldy f32 (the output's column 0 is row 0 of
//   the matrix); bias: n_rows f32 or null; part: split sums, [part][slot][n_rows]
//   tiles: null (dense: tile blockIdx.y, n tokens) or [tile][3] (expert, slot0, count) with
//   the count of tiles at tiles_n; idx: x row of each slot, or null
//   w_stride, s_stride: one expert's levels (uint4) and scales (half2)
template <int BITS, int GPC, int NT>
__device__ __forceinline__ void qgemm(const uint4* __restrict__ wq, const uint2* __restrict__ sc,
                                      const __half* __restrict__ x, float* __restrict__ y,
                                      const float* __restrict__ bias, float* __restrict__ part,
                                      const int* __restrict__ tiles, const int* __restrict__ tiles_n,
                                      const int* __restrict__ idx, int n, int k, int n_rows, int ldy,
                                      long long w_stride, long long s_stride) {
    constexpr int BN = 8 * NT;
    constexpr int WPC = BITS / 4;
    constexpr int SC = GPC / 2;  // uint2 of scales per row and chunk
    constexpr int S = QG_STAGES(NT);
    constexpr int XS = BN * 16;             // uint4 of activations a stage
    constexpr int WL = 2 * WPC * WARP_SIZE;  // uint4 of one warp's levels a stage
    constexpr int WS = 16 * SC;              // uint4 of one warp's scales a stage
    extern __shared__ uint4 qg_smem[];
    uint4* xsm = qg_smem;               // [S][XS]
    uint4* wsm = qg_smem + S * XS;      // [S][4 warps][WL + WS]
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, tq = lane % 4;
    const int rt = blockIdx.x * 4 + warp;
    const int n_chunks = k / 64, n_stages = k / QG_KC;
    const int parts = gridDim.z, z = blockIdx.z;
    const int st0 = z * n_stages / parts, st1 = (z + 1) * n_stages / parts;
    const int nst = st1 - st0;

    // This warp's levels and scales of a stage (2 chunks, contiguous in the layout): copied
    // by the warp itself, so only the activations need the block.
    const uint4* wsrc = wq + (size_t)rt * n_chunks * WPC * WARP_SIZE;
    const uint4* ssrc = reinterpret_cast<const uint4*>(sc + (size_t)rt * n_chunks * 16 * SC);
    auto stage_w = [&](int i) {
        const int st = st0 + i;
        uint4* d = wsm + ((i % S) * 4 + warp) * (WL + WS);
#pragma unroll
        for (int p = 0; p < WL / WARP_SIZE; ++p)
            tc_cp16(d + p * WARP_SIZE + lane, wsrc + (size_t)st * WL + p * WARP_SIZE + lane, true);
        if (lane < WS) tc_cp16(d + WL + lane, ssrc + (size_t)st * WS + lane, true);
    };

    int slot0, count;
    if (tiles == nullptr) {
        slot0 = blockIdx.y * BN;
        count = min(BN, n - slot0);
        // The weights depend on no earlier kernel: their first stages are fetched before the
        // programmatic wait, while the previous kernel finishes.
        for (int i = 0; i < S - 1 && i < nst; ++i) stage_w(i);
        PDL_WAIT();
    } else {
        PDL_WAIT();
        if ((int)blockIdx.y >= *tiles_n) return;
        const int* t = tiles + 3 * blockIdx.y;
        wsrc += t[0] * w_stride;
        ssrc += t[0] * (s_stride / 4);
        slot0 = t[1];
        count = t[2];
        for (int i = 0; i < S - 1 && i < nst; ++i) stage_w(i);
    }

    // Activations: BN rows of 16 pieces a stage, NT pieces a thread.
    const int pc = threadIdx.x % 16;
    const __half* src[NT];
    bool ok[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const int r = threadIdx.x / 16 + 8 * i;
        ok[i] = r < count;
        const int s = slot0 + (ok[i] ? r : 0);
        const int row = idx != nullptr ? idx[s] : s;
        src[i] = x + (size_t)row * k + pc * 8;
    }
    auto stage_x = [&](int i) {
        const int st = st0 + i;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int r = threadIdx.x / 16 + 8 * j;
            uint4* dst = xsm + ((i % S) * BN + r) * 16 + (pc ^ (r & 7));
            tc_cp16(dst, src[j] + st * QG_KC, ok[j]);
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // S - 1 stages in flight ahead of the one multiplied; a group committed for every stage,
    // empty past the end, so that the wait below counts alike on every iteration.
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (i < nst) stage_x(i);
        tc_commit();
    }
    for (int i = 0; i < nst; ++i) {
        tc_wait<S - 2>();
        __syncthreads();  // stage i has landed for all; stage i - 1's buffers are free
        if (i + S - 1 < nst) {
            stage_w(i + S - 1);
            stage_x(i + S - 1);
        }
        tc_commit();
        const uint4* xs = xsm + (i % S) * XS;
        const uint4* ws = wsm + ((i % S) * 4 + warp) * (WL + WS);
        uint4 w_cur[2 * WPC];
#pragma unroll
        for (int p = 0; p < 2 * WPC; ++p) w_cur[p] = ws[p * WARP_SIZE + lane];
        const uint2* ss = reinterpret_cast<const uint2*>(ws + WL);
        uint2 s_cur[2][2 * SC];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
            for (int h = 0; h < SC; ++h) {
                s_cur[0][c * SC + h] = ss[(c * 16 + g) * SC + h];
                s_cur[1][c * SC + h] = ss[(c * 16 + g + 8) * SC + h];
            }
        }
        const uint32_t* words = reinterpret_cast<const uint32_t*>(w_cur);
        const uint32_t* sg_words = reinterpret_cast<const uint32_t*>(s_cur[0]);
        const uint32_t* s8_words = reinterpret_cast<const uint32_t*>(s_cur[1]);
#pragma unroll
        for (int step = 0; step < 8; step += 2) {
            // B fragments of two k16 steps for every n-tile: matrix i / 8 of lane i is
            // piece 2 * step + i / 8 of token row 8j + i % 8.
            uint32_t b[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int r = 8 * j + (lane % 8), p = 2 * step + lane / 8;
                tc_ldmatrix4(b[j], xs + r * 16 + (p ^ (r & 7)));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int s = step + h;           // k16 step in the stage
                const int c = s / 4, j4 = s % 4;  // chunk, step in the chunk
                const int gi = c * GPC + (GPC == 2 ? j4 / 2 : j4);  // scale group in the stage
                const __half2 sa = u2h(sg_words[gi]), sb = u2h(s8_words[gi]);
                const __half2 sg = __low2half2(sa), mg = __high2half2(sa);
                const __half2 s8 = __low2half2(sb), m8 = __high2half2(sb);
                uint32_t a[4];
                qg_unpack<BITS>(a, words + (c * WPC) * 4 + j4 * (BITS / 4), sg, mg, s8, m8);
#pragma unroll
                for (int j = 0; j < NT; ++j) tc_mma(acc[j], a, b[j][2 * h], b[j][2 * h + 1]);
            }
        }
    }
    // C fragment: rows g and g + 8 of the warp's tile, tokens 2tq and 2tq + 1 of each n-tile.
    const int r0 = rt * 16 + g;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r0 + (e / 2) * 8, tok = 8 * j + 2 * tq + (e % 2);
            if (row >= n_rows || tok >= count) continue;
            const size_t slot = (size_t)(slot0 + tok);
            if (parts > 1) {
                part[((size_t)z * gridDim.y * BN + slot) * n_rows + row] = acc[j][e];
            } else {
                y[slot * ldy + row] = acc[j][e] + (bias != nullptr ? bias[row] : 0.0f);
            }
        }
    }
}

#define QGEMM(name, BITS, GPC, NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                                       \
        name(const uint4* __restrict__ wq, const uint2* __restrict__ sc, const __half* __restrict__ x,             \
             float* __restrict__ y, const float* __restrict__ bias, float* __restrict__ part,                      \
             const int* __restrict__ tiles, const int* __restrict__ tiles_n, const int* __restrict__ idx, int n,  \
             int k, int n_rows, int ldy, long long w_stride, long long s_stride) {                                 \
        qgemm<BITS, GPC, NT>(wq, sc, x, y, bias, part, tiles, tiles_n, idx, n, k, n_rows, ldy, w_stride,          \
                             s_stride);                                                                            \
    }

QGEMM(qgemm_b4_g32_n2, 4, 2, 2)
QGEMM(qgemm_b4_g32_n4, 4, 2, 4)
QGEMM(qgemm_b4_g32_n8, 4, 2, 8)
QGEMM(qgemm_b4_g16_n2, 4, 4, 2)
QGEMM(qgemm_b4_g16_n4, 4, 4, 4)
QGEMM(qgemm_b4_g16_n8, 4, 4, 8)
QGEMM(qgemm_b8_g32_n2, 8, 2, 2)
QGEMM(qgemm_b8_g32_n4, 8, 2, 4)
QGEMM(qgemm_b8_g32_n8, 8, 2, 8)
QGEMM(qgemm_b8_g16_n2, 8, 4, 2)
QGEMM(qgemm_b8_g16_n4, 8, 4, 4)
QGEMM(qgemm_b8_g16_n8, 8, 4, 8)

// y[t][r] = bias[r] + the parts' sums in part order (dense: parts of stride `slots` rows).
extern "C" __global__ void qgemm_reduce(const float* __restrict__ part, const float* __restrict__ bias,
                                        float* __restrict__ y, int n, int n_rows, int ldy, int parts, int slots) {
    PDL_WAIT();
    const int t = blockIdx.y, r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n_rows || t >= n) return;
    // Added in part order, as add_norm_f16 adds them where the norm takes the sums.
    const float* src = part + (size_t)t * n_rows + r;
    const float acc = add_parts(bias != nullptr ? bias[r] : 0.0f, src, (size_t)slots * n_rows, 0, parts);
    y[(size_t)t * ldy + r] = acc;
}
