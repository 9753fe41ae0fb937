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
// Thread blocks of ROWS_PER_BLOCK warps; grid = ceil(nrows / ROWS_PER_BLOCK).
#include "common.cuh"

#define ROWS_PER_BLOCK 4
#define MAX_TOKENS 8

// The whole warp quantizes one block of 32 values, lane l holding value v of element i
// (i % 32 == l): int8 q[i], scale d = max|v| / 127, and s = d * sum(q) per block. Lanes
// with `valid` false take part in the reductions with v = 0 and write nothing.
__device__ __forceinline__ void quantize_warp_block(float v, int i, bool valid, int8_t* __restrict__ q,
                                                    float* __restrict__ d, float* __restrict__ s) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    const float scale = amax / 127.0f;
    const int qi = amax == 0.0f ? 0 : (int)roundf(v / scale);
    const float sum = warp_sum((float)qi);
    if (valid) {
        q[i] = (int8_t)qi;
        if (i % 32 == 0) {
            d[i / 32] = scale;
            s[i / 32] = scale * sum;
        }
    }
}

// One warp per 32 activations.
extern "C" __global__ void quantize_act_q8(const float* __restrict__ x, int8_t* __restrict__ q,
                                           float* __restrict__ d, float* __restrict__ s, int n) {
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

// A 32-bit word from a 2-byte-aligned address.
__device__ __forceinline__ int load_int_b2(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (int)h[0] | ((int)h[1] << 16);
}

// Q4_K: 144-byte blocks of 256 (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles). Eight lanes share a block, one 32-weight sub-block each.
__device__ __forceinline__ void q4_k_scale_min(int j, const uint8_t* q, int& s, int& m) {
    if (j < 4) {
        s = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        s = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Two rows per warp: the activations each lane loads serve both rows, halving that
// traffic (the activation reads were as large as the Q4_K weight reads).
#define Q4_K_ROWS_PER_WARP 2

extern "C" __global__ void mmvq_q4_k(const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                     const float* __restrict__ XD, const float* __restrict__ XS,
                                     float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row0 = (blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE) * Q4_K_ROWS_PER_WARP;
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
            q4_k_scale_min(j, blk + 4, sc, mn);
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

// Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales, d). Eight lanes share a block: lane (h, p) takes weights 128h + 32p .. + 32,
// whose two halves of 16 have their own scales.
extern "C" __global__ void mmvq_q6_k(const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                     const float* __restrict__ XD, const float* __restrict__ XS,
                                     float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 256;
    const uint8_t* wrow = W + (size_t)row * nb * 210;
    const int h = (lane % 8) / 4, p = lane % 4;
    const int lshift = (p / 2) * 4, hshift = 2 * p;
    float acc[MAX_TOKENS] = {0};
    for (int b = lane / 8; b < nb; b += WARP_SIZE / 8) {
        const uint8_t* blk = wrow + (size_t)b * 210;
        const uint8_t* ql = blk + 64 * h + 32 * (p % 2);
        const uint8_t* qh = blk + 128 + 32 * h;
        int v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int lo = (load_int_b2(ql + 4 * i) >> lshift) & 0x0f0f0f0f;
            const int hi = ((load_int_b2(qh + 4 * i) >> hshift) & 0x03030303) << 4;
            v[i] = __vsubss4(lo | hi, 0x20202020);
        }
        const int8_t* sc = (const int8_t*)(blk + 192) + 8 * h + 2 * p;
        const float d = __half2float(__ushort_as_half(*(const uint16_t*)(blk + 208)));
        const float s0 = d * sc[0], s1 = d * sc[1];
        const int xb = b * 8 + 4 * h + p;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            int a[8];
            load_act(XQ, (size_t)t * ncols + (size_t)xb * 32, a);
            int d0 = 0, d1 = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                d0 = __dp4a(v[i], a[i], d0);
                d1 = __dp4a(v[i + 4], a[i + 4], d1);
            }
            acc[t] += XD[(size_t)t * (ncols / 32) + xb] * (s0 * d0 + s1 * d1);
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// The 32-weight formats: one lane per block. Each decoder fills eight packed int8 words
// (weights 0-15 in words 0-3, 16-31 in 4-7) and returns the block scale.
enum Block32 { Q4_0, Q5_0, Q8_0 };

template <Block32 K> struct Block32Traits;
template <> struct Block32Traits<Q4_0> { static constexpr int bytes = 18; };
template <> struct Block32Traits<Q5_0> { static constexpr int bytes = 22; };
template <> struct Block32Traits<Q8_0> { static constexpr int bytes = 34; };

// Bits k..k+3 of `bits` at bit 4 of each byte of a word.
__device__ __forceinline__ int fifth_bits(uint32_t bits, int k) {
    return (((bits >> k) & 1) << 4) | (((bits >> (k + 1)) & 1) << 12) | (((bits >> (k + 2)) & 1) << 20) |
           (((bits >> (k + 3)) & 1) << 28);
}

template <Block32 K>
__device__ __forceinline__ float decode_block32(const uint8_t* blk, int (&v)[8]) {
    const float d = __half2float(__ushort_as_half(*(const uint16_t*)blk));
    if (K == Q8_0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = load_int_b2(blk + 2 + 4 * i);
    } else if (K == Q4_0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int w = load_int_b2(blk + 2 + 4 * i);
            v[i] = __vsubss4(w & 0x0f0f0f0f, 0x08080808);
            v[i + 4] = __vsubss4((w >> 4) & 0x0f0f0f0f, 0x08080808);
        }
    } else {
        const uint32_t qh = (uint32_t)load_int_b2(blk + 2);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int w = load_int_b2(blk + 6 + 4 * i);
            v[i] = __vsubss4((w & 0x0f0f0f0f) | fifth_bits(qh, 4 * i), 0x10101010);
            v[i + 4] = __vsubss4(((w >> 4) & 0x0f0f0f0f) | fifth_bits(qh, 16 + 4 * i), 0x10101010);
        }
    }
    return d;
}

template <Block32 K>
__device__ __forceinline__ void mmvq_block32(const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,
                                             const float* __restrict__ XD, float* __restrict__ Y, int ncols,
                                             int nrows, int ntok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 32;
    const uint8_t* wrow = W + (size_t)row * nb * Block32Traits<K>::bytes;
    float acc[MAX_TOKENS] = {0};
    for (int b = lane; b < nb; b += WARP_SIZE) {
        int v[8];
        const float d = decode_block32<K>(wrow + (size_t)b * Block32Traits<K>::bytes, v);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            int a[8];
            load_act(XQ, (size_t)t * ncols + (size_t)b * 32, a);
            int dot = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) dot = __dp4a(v[i], a[i], dot);
            acc[t] += d * XD[(size_t)t * nb + b] * dot;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

#define MMVQ_BLOCK32(name, kind)                                                                        \
    extern "C" __global__ void name(const uint8_t* __restrict__ W, const int8_t* __restrict__ XQ,       \
                                    const float* __restrict__ XD, const float* __restrict__ XS,         \
                                    float* __restrict__ Y, int ncols, int nrows, int ntok) {            \
        mmvq_block32<kind>(W, XQ, XD, Y, ncols, nrows, ntok);                                           \
    }

MMVQ_BLOCK32(mmvq_q4_0, Q4_0)
MMVQ_BLOCK32(mmvq_q5_0, Q5_0)
MMVQ_BLOCK32(mmvq_q8_0, Q8_0)

// The residual step and the next matvec's input in one launch: x += o (o may be null),
// then the RMS norm of x times w, quantized to int8 per 32 as quantize_act_q8 does.
// One block; x has n elements (a multiple of 32). Replaces add + rms_norm + quantize.
extern "C" __global__ void add_norm_quantize(float* __restrict__ x, const float* __restrict__ o,
                                             const float* __restrict__ w, int8_t* __restrict__ q,
                                             float* __restrict__ d, float* __restrict__ s, int n, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i];
        if (o) {
            v += o[i];
            x[i] = v;
        }
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / n + eps);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    for (int c = warp; c < n / 32; c += n_warps) {
        const int i = c * 32 + lane;
        quantize_warp_block(x[i] * scale * w[i], i, true, q, d, s);
    }
}

// The gated FFN activation and the down projection's input in one launch: act(g) * u,
// quantized to int8 per 32 (one warp per block of 32); `gelu` picks GELU (tanh) over SiLU.
extern "C" __global__ void gated_quantize(const float* __restrict__ g, const float* __restrict__ u,
                                          int8_t* __restrict__ q, float* __restrict__ d,
                                          float* __restrict__ s, int n, int gelu) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.0f;
    if (i < n) {
        const float x = g[i];
        const float a = gelu ? 0.5f * x * (1.0f + tanhf(0.7978845608f * x * (1.0f + 0.044715f * x * x)))
                             : x / (1.0f + expf(-x));
        v = a * u[i];
    }
    quantize_warp_block(v, i, i < n, q, d, s);
}
