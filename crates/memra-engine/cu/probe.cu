// Hardware probes: a streaming read to measure memory bandwidth.
#include "common.cuh"

// Reads n uint4 (16-byte) words with a grid-stride loop and folds them so the loads are
// not optimized away; one word per block reaches memory.
extern "C" __global__ void probe_read(const uint4* __restrict__ src, size_t n, uint32_t* sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) {
        sink[blockIdx.x] = acc;  // practically never taken
    }
}
