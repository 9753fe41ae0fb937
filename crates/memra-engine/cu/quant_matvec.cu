// Matrix-vector products on quantized weights for decoding (1 to 8 tokens): one warp per
// weight row, weights dequantized in registers and multiplied with f32 activations. The
// weights are read once per call whatever the token count, which is what decode speed is
// bound by.
//
// W: nrows rows of ncols weights in the ggml block layout; X: ntok x ncols f32;
// Y: ntok x nrows f32. Blocks of ROWS_PER_BLOCK warps; grid = ceil(nrows / ROWS_PER_BLOCK).
#include "common.cuh"

#define ROWS_PER_BLOCK 4
#define MAX_TOKENS 8

__device__ __forceinline__ void warp_store(float (&acc)[MAX_TOKENS], int ntok, float* Y, int nrows, int row) {
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < ntok) {
            const float v = warp_sum(acc[t]);
            if (threadIdx.x % WARP_SIZE == 0) {
                Y[(size_t)t * nrows + row] = v;
            }
        }
    }
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

extern "C" __global__ void mmvq_q4_k(const uint8_t* __restrict__ W, const float* __restrict__ X,
                                     float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 256;
    const uint8_t* wrow = W + (size_t)row * nb * 144;
    const int j = lane % 8;
    float acc[MAX_TOKENS] = {0};
    for (int b = lane / 8; b < nb; b += WARP_SIZE / 8) {
        const uint8_t* blk = wrow + (size_t)b * 144;
        const float d = __half2float(*(const __half*)blk);
        const float dmin = __half2float(*(const __half*)(blk + 2));
        int s, m;
        q4_k_scale_min(j, blk + 4, s, m);
        const float ds = d * s, dm = dmin * m;
        const uint4* q = (const uint4*)(blk + 16 + 32 * (j / 2));
        uint4 v[2] = {q[0], q[1]};
        const uint8_t* bytes = (const uint8_t*)v;
        const int shift = (j % 2) * 4;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            const float4* x = (const float4*)(X + (size_t)t * ncols + b * 256 + 32 * j);
            float sum = 0.0f, xsum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 xv = x[i];
                sum += xv.x * ((bytes[4 * i + 0] >> shift) & 15) + xv.y * ((bytes[4 * i + 1] >> shift) & 15) +
                       xv.z * ((bytes[4 * i + 2] >> shift) & 15) + xv.w * ((bytes[4 * i + 3] >> shift) & 15);
                xsum += xv.x + xv.y + xv.z + xv.w;
            }
            acc[t] += ds * sum - dm * xsum;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales, d). Eight lanes share a block: lane (h, p) takes weights 128h + 32p .. + 32.
extern "C" __global__ void mmvq_q6_k(const uint8_t* __restrict__ W, const float* __restrict__ X,
                                     float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 256;
    const uint8_t* wrow = W + (size_t)row * nb * 210;
    const int h = (lane % 8) / 4, p = lane % 4;
    float acc[MAX_TOKENS] = {0};
    for (int b = lane / 8; b < nb; b += WARP_SIZE / 8) {
        const uint8_t* blk = wrow + (size_t)b * 210;
        const float d = __half2float(__ushort_as_half(blk[208] | (blk[209] << 8)));
        const uint8_t* ql = blk + 64 * h + 32 * (p % 2);
        const uint8_t* qh = blk + 128 + 32 * h;
        const int8_t* sc = (const int8_t*)(blk + 192) + 8 * h + 2 * p;
        const int lshift = (p / 2) * 4, hshift = 2 * p;
        int8_t w[32];
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            w[l] = (int8_t)((((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32);
        }
        const float s0 = d * sc[0], s1 = d * sc[1];
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            const float* x = X + (size_t)t * ncols + b * 256 + 128 * h + 32 * p;
            float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
            for (int l = 0; l < 16; ++l) {
                a0 += x[l] * w[l];
                a1 += x[l + 16] * w[l + 16];
            }
            acc[t] += s0 * a0 + s1 * a1;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}

// Q8_0: 34-byte blocks of 32 (d, 32 int8); one lane per block.
extern "C" __global__ void mmvq_q8_0(const uint8_t* __restrict__ W, const float* __restrict__ X,
                                     float* __restrict__ Y, int ncols, int nrows, int ntok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int nb = ncols / 32;
    const uint8_t* wrow = W + (size_t)row * nb * 34;
    float acc[MAX_TOKENS] = {0};
    for (int b = lane; b < nb; b += WARP_SIZE) {
        const uint16_t* blk = (const uint16_t*)(wrow + (size_t)b * 34);
        const float d = __half2float(__ushort_as_half(blk[0]));
        int8_t w[32];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint16_t pair = blk[1 + i];
            w[2 * i] = (int8_t)(pair & 0xff);
            w[2 * i + 1] = (int8_t)(pair >> 8);
        }
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t >= ntok) break;
            const float4* x = (const float4*)(X + (size_t)t * ncols + b * 32);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 xv = x[i];
                sum += xv.x * w[4 * i] + xv.y * w[4 * i + 1] + xv.z * w[4 * i + 2] + xv.w * w[4 * i + 3];
            }
            acc[t] += d * sum;
        }
    }
    warp_store(acc, ntok, Y, nrows, row);
}
