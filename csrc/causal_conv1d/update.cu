// Decode step of the causal conv1d: L new inputs per sequence against a rolling state [B, D, S]
// (S >= W - 1), updated in place. One thread per (b, d) channel: it alone reads and rewrites its
// state row, so the in-place shift has no race. Decode moves a few bytes per channel, so every
// tensor is read through its strides and a run-time type tag.

#include "common.cuh"

namespace dflash {
namespace {

constexpr int kUpdateThreads = 128;

template <int W>
__global__ void __launch_bounds__(kUpdateThreads) update_kernel(const DflashConvUpdateParams p) {
    const int64_t idx = int64_t(blockIdx.x) * kUpdateThreads + threadIdx.x;
    if (idx >= p.batch * p.dim) return;
    const int64_t b = idx / p.dim, d = idx - (idx / p.dim) * p.dim;
    const int64_t S = p.state_len, L = p.len;
    const int64_t sbase = b * p.s_sb + d * p.s_sd;
    const int64_t xbase = b * p.x_sb + d * p.x_sd;
    const int64_t ybase = b * p.y_sb + d * p.y_sd;

    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = load_any(p.weight, p.weight_dtype, d * p.w_sd + i * p.w_sw);
    const float bias = p.bias != nullptr ? load_any(p.bias, p.bias_dtype, d * p.bias_s) : 0.f;

    // prev[j] = input at t - (W - 1) + j for the step about to run.
    float prev[W - 1];
#pragma unroll
    for (int j = 0; j < W - 1; ++j)
        prev[j] = load_any(p.state, p.state_dtype, sbase + (S - (W - 1) + j) * p.s_ss);

    for (int64_t l = 0; l < L; ++l) {
        const float xl = load_any(p.x, p.x_dtype, xbase + l * p.x_sl);
        float acc = bias + w[W - 1] * xl;
#pragma unroll
        for (int j = 0; j < W - 1; ++j) acc += w[j] * prev[j];
        if (p.silu) acc *= sigmoid(acc);
        store_any(p.y, p.y_dtype, ybase + l * p.y_sl, acc);
#pragma unroll
        for (int j = 0; j < W - 2; ++j) prev[j] = prev[j + 1];
        prev[W - 2] = xl;
    }

    // Shift the state left by L and append the new inputs; ascending j reads j + L before it is
    // overwritten. Values are copied in the state's own type (x converted once).
    for (int64_t j = 0; j < S; ++j) {
        const int64_t src = j + L;
        const float v = src < S ? load_any(p.state, p.state_dtype, sbase + src * p.s_ss)
                                : load_any(p.x, p.x_dtype, xbase + (src - S) * p.x_sl);
        store_any(p.state, p.state_dtype, sbase + j * p.s_ss, v);
    }
}

}  // namespace
}  // namespace dflash

extern "C" cudaError_t dflash_causal_conv1d_update(const DflashConvUpdateParams* p, cudaStream_t stream) {
    if (p == nullptr || p->x == nullptr || p->state == nullptr || p->weight == nullptr || p->y == nullptr)
        return cudaErrorInvalidValue;
    if (p->state_len < p->width - 1 || p->len < 0) return cudaErrorInvalidValue;
    const int64_t n = p->batch * p->dim;
    if (n == 0 || p->len == 0) return cudaSuccess;
    const int64_t blocks = (n + dflash::kUpdateThreads - 1) / dflash::kUpdateThreads;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    switch (p->width) {
        case 2: dflash::update_kernel<2><<<unsigned(blocks), dflash::kUpdateThreads, 0, stream>>>(*p); break;
        case 3: dflash::update_kernel<3><<<unsigned(blocks), dflash::kUpdateThreads, 0, stream>>>(*p); break;
        case 4: dflash::update_kernel<4><<<unsigned(blocks), dflash::kUpdateThreads, 0, stream>>>(*p); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
