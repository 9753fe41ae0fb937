// Weight formats on the device: regrouping at upload, dequantization of weight matrices to
// f16 for the prompt GEMMs (cuBLAS multiplies them with f16 activations on tensor cores),
// and embedding rows to f32 for the tokens of a step.
#include "quant_blocks.cuh"

// Regroups Q8_0 or Q6_K weights in place (the `_R` layouts of quant_blocks.cuh): one thread
// block per group of 8 blocks, read into shared memory, then written field by field. The
// blocks' fields (offset order, lengths in bytes) are all of even length, so the copy goes
// by halves.
template <int BYTES, int NF>
__device__ __forceinline__ void regroup_group(uint8_t* __restrict__ W, const int (&len)[NF]) {
    constexpr int G = REGROUP * BYTES;
    __shared__ uint16_t group[G / 2];
    uint16_t* g = (uint16_t*)(W + (size_t)blockIdx.x * G);
    for (int p = threadIdx.x; p < G / 2; p += blockDim.x) group[p] = g[p];
    __syncthreads();
    for (int p = threadIdx.x; p < G / 2; p += blockDim.x) {
        int at = 2 * p, off = 0, f = 0;
        while (f + 1 < NF && at >= REGROUP * len[f]) {
            at -= REGROUP * len[f];
            off += len[f];
            ++f;
        }
        g[p] = group[((at / len[f]) * BYTES + off + at % len[f]) / 2];
    }
}

extern "C" __global__ void regroup_q8_0(uint8_t* __restrict__ W) {
    PDL_WAIT();
    const int len[2] = {2, 32};  // d, quants
    regroup_group<34>(W, len);
}

extern "C" __global__ void regroup_q6_k(uint8_t* __restrict__ W) {
    PDL_WAIT();
    const int len[4] = {128, 64, 16, 2};  // low bits, high bits, scales, d
    regroup_group<210>(W, len);
}

// One thread per 32 weights: sub-block `i` of the whole matrix (rows of ncols weights).
template <int T>
__device__ __forceinline__ void dequant_f16(const uint8_t* __restrict__ W, __half* __restrict__ out, int ncols,
                                            long long n_subs) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_subs) return;
    const int per_row = ncols / 32;
    const long long row = i / per_row;
    const int s = (int)(i % per_row);
    const uint8_t* w = W + row * (long long)(ncols / BlockTraits<T>::n) * BlockTraits<T>::bytes;
    int v[8];
    float sc[2], mn[2];
    unpack32<T>(w, s, v, sc, mn);
    __align__(16) __half h[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) h[e] = __float2half(sc[e / 16] * byte_of(v[e / 4], e % 4) - mn[e / 16]);
    uint4* dst = (uint4*)(out + i * 32);
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[k] = ((const uint4*)h)[k];
}

#define DEQUANT_F16(name, T)                                                                                        \
    extern "C" __global__ void name(const uint8_t* __restrict__ W, __half* __restrict__ out, int ncols,             \
                                    long long n_subs) {                                                             \
        PDL_WAIT();                                                                                                 \
        dequant_f16<T>(W, out, ncols, n_subs);                                                                      \
    }

DEQUANT_F16(dequant_f16_q4_0, T_Q4_0)
DEQUANT_F16(dequant_f16_q4_1, T_Q4_1)
DEQUANT_F16(dequant_f16_q5_0, T_Q5_0)
DEQUANT_F16(dequant_f16_q5_1, T_Q5_1)
DEQUANT_F16(dequant_f16_q8_0, T_Q8_0)
DEQUANT_F16(dequant_f16_iq4_nl, T_IQ4_NL)
DEQUANT_F16(dequant_f16_q2_k, T_Q2_K)
DEQUANT_F16(dequant_f16_q3_k, T_Q3_K)
DEQUANT_F16(dequant_f16_q4_k, T_Q4_K)
DEQUANT_F16(dequant_f16_q5_k, T_Q5_K)
DEQUANT_F16(dequant_f16_q6_k, T_Q6_K)
DEQUANT_F16(dequant_f16_iq4_xs, T_IQ4_XS)
DEQUANT_F16(dequant_f16_q8_0_r, T_Q8_0_R)
DEQUANT_F16(dequant_f16_q6_k_r, T_Q6_K_R)

// The float types: f32 and bf16 converted element-wise (F16 weights are used as they are).
// bf16 values beyond f16's range saturate; weights do not reach it in practice.
extern "C" __global__ void dequant_f16_f32(const float* __restrict__ W, __half* __restrict__ out, long long n) {
    PDL_WAIT();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2half(W[i]);
}

extern "C" __global__ void dequant_f16_bf16(const uint16_t* __restrict__ W, __half* __restrict__ out,
                                            long long n) {
    PDL_WAIT();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2half(__uint_as_float((uint32_t)W[i] << 16));
}

// The embedding rows of `n` tokens: out[t] = W[ids[t]] * scale (ncols values each, f32).
// One block per token, one thread per 32 values; `ty` is the ggml type id of W.
template <int T>
__device__ __forceinline__ void embed_row(const uint8_t* __restrict__ W, int id, float* __restrict__ out,
                                          int ncols, float scale) {
    const uint8_t* row = W + (size_t)id * row_bytes_of(T, ncols);
    for (int s = threadIdx.x; s < ncols / 32; s += blockDim.x) {
        float v[32];
        decode32<T>(row, s, v);
#pragma unroll
        for (int e = 0; e < 32; ++e) out[s * 32 + e] = v[e] * scale;
    }
}

extern "C" __global__ void embed_rows(const uint8_t* __restrict__ W, int ty, const int* __restrict__ ids,
                                      float* __restrict__ out, int ncols, float scale) {
    PDL_WAIT();
    const int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * ncols;
#define EMBED(T) embed_row<T>(W, id, o, ncols, scale)
    switch (ty) {
        case T_F32: EMBED(T_F32); break;
        case T_F16: EMBED(T_F16); break;
        case T_BF16: EMBED(T_BF16); break;
        default: DISPATCH_QUANT_TYPES(ty, EMBED)
    }
#undef EMBED
}
