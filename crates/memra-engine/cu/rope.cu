// Rotary position embedding, in place, for `heads` heads of `head_dim` at one position.
// Pairs are (2i, 2i+1) when `halves` is 0 (Llama), (i, i + n_dims/2) otherwise (NeoX,
// Qwen, Gemma); dimensions past n_dims pass through. freq_factors (n_dims/2) may be null.
#include "common.cuh"

extern "C" __global__ void rope_f32(float* __restrict__ x, int heads, int head_dim, int n_dims, int pos,
                                    float base, float freq_scale, const float* __restrict__ freq_factors,
                                    int halves) {
    const int half = n_dims / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= heads * half) return;
    const int h = idx / half, i = idx % half;
    float theta = powf(base, -2.0f * i / n_dims);
    if (freq_factors) theta /= freq_factors[i];
    float s, c;
    sincosf(pos * freq_scale * theta, &s, &c);
    float* v = x + (size_t)h * head_dim;
    const int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
}
