// Weight block formats (ggml's layouts), decoded per 32 weights on the device.
//
// `unpack32<T>(row, s, v, sc, mn)` decodes sub-block `s` (weights 32s .. 32s+31) of a row
// of type T into packed int8 levels v (weights 0-15 in words 0-3, 16-31 in words 4-7) and
// per-16 affine factors: weight i = sc[i / 16] * level i - mn[i / 16]. This is the form the
// CPU engine unpacks to (memra-gguf `unpack_row`), so one decoder per format serves the
// generic decode matvec, the dequantization for prompt GEMMs and the embedding lookup.
// Blocks are only 2-byte aligned in general (18, 22, 110, 210 bytes), hence `ld32`.
//
// Regrouped layouts (`_R` ids): Q8_0 and Q6_K, whose 34- and 210-byte blocks leave every
// field misaligned, are stored on the device in groups of 8 blocks with each field of the
// 8 blocks together (Q8_0: 8 scales, then 8 x 32 quants; Q6_K: 8 x 128 low bits, 8 x 64
// high bits, 8 x 16 scales, 8 scales d), so that the quants are 16-byte aligned and the
// matvec kernels read them with 16-byte loads. Same bytes, same size; rows must be whole
// groups (`regroup_q8_0` / `regroup_q6_k` in dequant.cu rewrite them in place at upload).
#pragma once

#include "common.cuh"

// ggml type ids (memra-gguf GgmlType).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
// Device-only ids: the regrouped layouts.
#define T_Q8_0_R 108
#define T_Q6_K_R 114

// A 32-bit word from a 2-byte-aligned address.
__device__ __forceinline__ int ld32(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (int)h[0] | ((int)h[1] << 16);
}

__device__ __forceinline__ float ldh(const uint8_t* p) { return __half2float(__ushort_as_half(*(const uint16_t*)p)); }

// Bits k..k+3 of `bits` at bit 4 of each byte of a word (Q5_0 / Q5_1 fifth bits).
__device__ __forceinline__ int fifth_bits(uint32_t bits, int k) {
    return (((bits >> k) & 1) << 4) | (((bits >> (k + 1)) & 1) << 12) | (((bits >> (k + 2)) & 1) << 20) |
           (((bits >> (k + 3)) & 1) << 28);
}

// The 16 IQ4_NL levels (ggml kvalues_iq4nl) as four little-endian words.
#define IQ4_T0 0xbfad9881u  // -127 -104 -83 -65
#define IQ4_T1 0xf6eaddcfu  // -49 -35 -22 -10
#define IQ4_T2 0x26190d01u  // 1 13 25 38
#define IQ4_T3 0x71594535u  // 53 69 89 113

// Four 4-bit indices (one per byte of `idx`) to their IQ4_NL levels, by byte permutes.
__device__ __forceinline__ int iq4_levels(uint32_t idx) {
    const uint32_t sel = (idx & 7) | ((idx >> 4) & 0x70) | ((idx >> 8) & 0x700) | ((idx >> 12) & 0x7000);
    const uint32_t lo = __byte_perm(IQ4_T0, IQ4_T1, sel);
    const uint32_t hi = __byte_perm(IQ4_T2, IQ4_T3, sel);
    const uint32_t high = ((idx >> 3) & 0x01010101u) * 0xffu;
    return (int)((hi & high) | (lo & ~high));
}

// Q4_K / Q5_K: 6-bit scale and min of sub-block j (ggml get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, int& s, int& m) {
    if (j < 4) {
        s = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        s = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K: the i-th of sixteen 6-bit scales, offset by 32.
__device__ __forceinline__ int q3_k_scale(int i, const uint8_t* p) {
    const int low = i < 8 ? p[i] & 0x0f : p[i - 8] >> 4;
    const int high = (p[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

template <int T> struct BlockTraits;
template <> struct BlockTraits<T_Q4_0> { static constexpr int bytes = 18, n = 32; };
template <> struct BlockTraits<T_Q4_1> { static constexpr int bytes = 20, n = 32; };
template <> struct BlockTraits<T_Q5_0> { static constexpr int bytes = 22, n = 32; };
template <> struct BlockTraits<T_Q5_1> { static constexpr int bytes = 24, n = 32; };
template <> struct BlockTraits<T_Q8_0> { static constexpr int bytes = 34, n = 32; };
template <> struct BlockTraits<T_IQ4_NL> { static constexpr int bytes = 18, n = 32; };
template <> struct BlockTraits<T_Q2_K> { static constexpr int bytes = 84, n = 256; };
template <> struct BlockTraits<T_Q3_K> { static constexpr int bytes = 110, n = 256; };
template <> struct BlockTraits<T_Q4_K> { static constexpr int bytes = 144, n = 256; };
template <> struct BlockTraits<T_Q5_K> { static constexpr int bytes = 176, n = 256; };
template <> struct BlockTraits<T_Q6_K> { static constexpr int bytes = 210, n = 256; };
template <> struct BlockTraits<T_IQ4_XS> { static constexpr int bytes = 136, n = 256; };
template <> struct BlockTraits<T_Q8_0_R> { static constexpr int bytes = 34, n = 32; };
template <> struct BlockTraits<T_Q6_K_R> { static constexpr int bytes = 210, n = 256; };

// Blocks per group of the regrouped layouts, and where block i's fields are in its group.
#define REGROUP 8
__device__ __forceinline__ const uint8_t* q8_0_r_group(const uint8_t* row, int kb) {
    return row + (size_t)(kb / REGROUP) * (REGROUP * 34);
}
struct Q6KFields {
    const uint8_t* ql;      // 128 bytes
    const uint8_t* qh;      // 64 bytes
    const int8_t* scales;   // 16
    const uint8_t* d;       // f16
};
template <int T>
__device__ __forceinline__ Q6KFields q6_k_fields(const uint8_t* row, int kb) {
    if (T == T_Q6_K_R) {
        const uint8_t* g = row + (size_t)(kb / REGROUP) * (REGROUP * 210);
        const int i = kb % REGROUP;
        return {g + 128 * i, g + 1024 + 64 * i, (const int8_t*)(g + 1536 + 16 * i), g + 1664 + 2 * i};
    }
    const uint8_t* b = row + (size_t)kb * 210;
    return {b, b + 128, (const int8_t*)(b + 192), b + 208};
}

template <int T>
__device__ __forceinline__ void unpack32(const uint8_t* __restrict__ row, int s, int (&v)[8], float (&sc)[2],
                                         float (&mn)[2]) {
    constexpr int subs = BlockTraits<T>::n / 32;
    const uint8_t* blk = row + (size_t)(s / subs) * BlockTraits<T>::bytes;
    const int j = s % subs;
    mn[0] = mn[1] = 0.0f;
    if (T == T_Q8_0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = ld32(blk + 2 + 4 * i);
        sc[0] = sc[1] = ldh(blk);
    } else if (T == T_Q8_0_R) {
        const uint8_t* g = q8_0_r_group(row, s);
        const int i = s % REGROUP;
        const int4* q = (const int4*)(g + 16 + 32 * i);
        const int4 q0 = q[0], q1 = q[1];
        v[0] = q0.x; v[1] = q0.y; v[2] = q0.z; v[3] = q0.w;
        v[4] = q1.x; v[5] = q1.y; v[6] = q1.z; v[7] = q1.w;
        sc[0] = sc[1] = ldh(g + 2 * i);
    } else if (T == T_Q4_0 || T == T_Q4_1 || T == T_IQ4_NL) {
        const int qs = T == T_Q4_1 ? 4 : 2;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int w = ld32(blk + qs + 4 * i);
            const int lo = w & 0x0f0f0f0f, hi = (w >> 4) & 0x0f0f0f0f;
            if (T == T_Q4_0) {
                v[i] = __vsubss4(lo, 0x08080808);
                v[i + 4] = __vsubss4(hi, 0x08080808);
            } else if (T == T_Q4_1) {
                v[i] = lo;
                v[i + 4] = hi;
            } else {
                v[i] = iq4_levels(lo);
                v[i + 4] = iq4_levels(hi);
            }
        }
        sc[0] = sc[1] = ldh(blk);
        if (T == T_Q4_1) mn[0] = mn[1] = -ldh(blk + 2);
    } else if (T == T_Q5_0 || T == T_Q5_1) {
        const int qh_at = T == T_Q5_0 ? 2 : 4;
        const uint32_t qh = (uint32_t)ld32(blk + qh_at);
        const int offset = T == T_Q5_0 ? 0x10101010 : 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int w = ld32(blk + qh_at + 4 + 4 * i);
            v[i] = __vsubss4((w & 0x0f0f0f0f) | fifth_bits(qh, 4 * i), offset);
            v[i + 4] = __vsubss4(((w >> 4) & 0x0f0f0f0f) | fifth_bits(qh, 16 + 4 * i), offset);
        }
        sc[0] = sc[1] = ldh(blk);
        if (T == T_Q5_1) mn[0] = mn[1] = -ldh(blk + 2);
    } else if (T == T_Q2_K) {
        const int h = j / 4, r = j % 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (ld32(blk + 16 + 32 * h + 4 * i) >> (2 * r)) & 0x03030303;
        const float d = ldh(blk + 80), dmin = ldh(blk + 82);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int b = blk[2 * j + k];
            sc[k] = d * (b & 0x0f);
            mn[k] = dmin * (b >> 4);
        }
    } else if (T == T_Q3_K) {
        const int h = j / 4, r = j % 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int low = (ld32(blk + 32 + 32 * h + 4 * i) >> (2 * r)) & 0x03030303;
            const int high = (ld32(blk + 4 * i) >> j) & 0x01010101;
            v[i] = __vsubss4(low | (high << 2), 0x04040404);
        }
        const float d = ldh(blk + 108);
        sc[0] = d * q3_k_scale(2 * j, blk + 96);
        sc[1] = d * q3_k_scale(2 * j + 1, blk + 96);
    } else if (T == T_Q4_K || T == T_Q5_K) {
        const int c = j / 2, shift = 4 * (j % 2);
        const int qs = T == T_Q4_K ? 16 : 48;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int w = (ld32(blk + qs + 32 * c + 4 * i) >> shift) & 0x0f0f0f0f;
            if (T == T_Q5_K) w |= ((ld32(blk + 16 + 4 * i) >> j) & 0x01010101) << 4;
            v[i] = w;
        }
        int s6, m6;
        scale_min_k4(j, blk + 4, s6, m6);
        sc[0] = sc[1] = ldh(blk) * s6;
        mn[0] = mn[1] = ldh(blk + 2) * m6;
    } else if (T == T_Q6_K || T == T_Q6_K_R) {
        const Q6KFields f = q6_k_fields<T>(row, s / subs);
        const int h = j / 4, p = j % 4;
        const uint8_t* ql = f.ql + 64 * h + 32 * (p % 2);
        const uint8_t* qh = f.qh + 32 * h;
        const int lshift = (p / 2) * 4, hshift = 2 * p;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int lo = (ld32(ql + 4 * i) >> lshift) & 0x0f0f0f0f;
            const int hi = ((ld32(qh + 4 * i) >> hshift) & 0x03030303) << 4;
            v[i] = __vsubss4(lo | hi, 0x20202020);
        }
        const float d = ldh(f.d);
        sc[0] = d * f.scales[2 * j];
        sc[1] = d * f.scales[2 * j + 1];
    } else if (T == T_IQ4_XS) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int w = ld32(blk + 8 + 16 * j + 4 * i);
            v[i] = iq4_levels(w & 0x0f0f0f0f);
            v[i + 4] = iq4_levels((w >> 4) & 0x0f0f0f0f);
        }
        const int scales_h = *(const uint16_t*)(blk + 2);
        const int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
        const int scale = (low | (((scales_h >> (2 * j)) & 3) << 4)) - 32;
        sc[0] = sc[1] = ldh(blk) * scale;
    }
}

// Byte k of a packed word as a signed value.
__device__ __forceinline__ int byte_of(int w, int k) { return (int)(int8_t)(w >> (8 * k)); }

// Weight e (0..31) of sub-block s of a row of type `ty` as a float, for the float types
// too: the slow generic path, used where speed does not matter (embedding rows).
template <int T>
__device__ __forceinline__ void decode32(const uint8_t* __restrict__ row, int s, float (&out)[32]) {
    if constexpr (T == T_F32 || T == T_F16 || T == T_BF16) {
#pragma unroll
        for (int e = 0; e < 32; ++e) {
            const size_t i = (size_t)s * 32 + e;
            if (T == T_F32) out[e] = ((const float*)row)[i];
            if (T == T_F16) out[e] = __half2float(((const __half*)row)[i]);
            if (T == T_BF16) out[e] = __uint_as_float((uint32_t)((const uint16_t*)row)[i] << 16);
        }
    } else {
        int v[8];
        float sc[2], mn[2];
        unpack32<T>(row, s, v, sc, mn);
#pragma unroll
        for (int e = 0; e < 32; ++e) out[e] = sc[e / 16] * byte_of(v[e / 4], e % 4) - mn[e / 16];
    }
}

// Row bytes of `ncols` weights of each type.
__device__ __forceinline__ size_t row_bytes_of(int ty, int ncols) {
    switch (ty) {
        case T_F32: return (size_t)ncols * 4;
        case T_F16:
        case T_BF16: return (size_t)ncols * 2;
        case T_Q4_0: return (size_t)ncols / 32 * 18;
        case T_Q4_1: return (size_t)ncols / 32 * 20;
        case T_Q5_0: return (size_t)ncols / 32 * 22;
        case T_Q5_1: return (size_t)ncols / 32 * 24;
        case T_Q8_0:
        case T_Q8_0_R: return (size_t)ncols / 32 * 34;
        case T_IQ4_NL: return (size_t)ncols / 32 * 18;
        case T_Q2_K: return (size_t)ncols / 256 * 84;
        case T_Q3_K: return (size_t)ncols / 256 * 110;
        case T_Q4_K: return (size_t)ncols / 256 * 144;
        case T_Q5_K: return (size_t)ncols / 256 * 176;
        case T_Q6_K:
        case T_Q6_K_R: return (size_t)ncols / 256 * 210;
        case T_IQ4_XS: return (size_t)ncols / 256 * 136;
        default: return 0;
    }
}

// Calls F<T>() for the runtime type id `ty`; returns false for a type without a decoder.
#define DISPATCH_QUANT_TYPES(ty, CALL)                                                                              \
    switch (ty) {                                                                                                   \
        case T_Q4_0: CALL(T_Q4_0); break;                                                                           \
        case T_Q4_1: CALL(T_Q4_1); break;                                                                           \
        case T_Q5_0: CALL(T_Q5_0); break;                                                                           \
        case T_Q5_1: CALL(T_Q5_1); break;                                                                           \
        case T_Q8_0: CALL(T_Q8_0); break;                                                                           \
        case T_IQ4_NL: CALL(T_IQ4_NL); break;                                                                       \
        case T_Q2_K: CALL(T_Q2_K); break;                                                                           \
        case T_Q3_K: CALL(T_Q3_K); break;                                                                           \
        case T_Q4_K: CALL(T_Q4_K); break;                                                                           \
        case T_Q5_K: CALL(T_Q5_K); break;                                                                           \
        case T_Q6_K: CALL(T_Q6_K); break;                                                                           \
        case T_IQ4_XS: CALL(T_IQ4_XS); break;                                                                       \
        case T_Q8_0_R: CALL(T_Q8_0_R); break;                                                                       \
        case T_Q6_K_R: CALL(T_Q6_K_R); break;                                                                       \
        default: break;                                                                                             \
    }
