// Tensor-core building blocks (sm_80 and later): 16-byte asynchronous copies into shared
// memory, ldmatrix, and the f16 `mma.sync m16n8k16` with f32 accumulators. Fragment layouts
// are PTX's: lane l is in group g = l / 4 with index t = l % 4 in it; an A fragment holds
// rows g and g + 8, columns 2t, 2t + 1 (and 2t + 8, 2t + 9); a B fragment columns (n) g,
// rows (k) 2t, 2t + 1 (and 2t + 8, 2t + 9); an accumulator rows g and g + 8, columns 2t,
// 2t + 1.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

// 16 bytes from global to shared memory, or zeros where `valid` is false (`gmem` must still
// be a mapped address).
__device__ __forceinline__ void tc_cp16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;"); }

// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void tc_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// c += a * b: a 16 x 16 f16 A fragment, a 16 x 8 B fragment (b0, b1), f32 accumulators.
__device__ __forceinline__ void tc_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 matrices of halves; lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void tc_ldmatrix4(uint32_t (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// The same, each matrix transposed on the way.
__device__ __forceinline__ void tc_ldmatrix4_trans(uint32_t (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Two floats as one register of halves (the lower column in the low half).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return h2u(__floats2half2_rn(lo, hi)); }
