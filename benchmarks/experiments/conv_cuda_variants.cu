// Variant study for the CUDA causal conv1d (channel-first fast paths, bf16, W = 4, SiLU, bias):
// times the library's current kernels (csrc/causal_conv1d, included as source) against variants
// that take the halo from the neighbouring lane by shuffle instead of a second load, with other
// block sizes and words per thread, and against the device-to-device copy, at the benchmark shapes.
// Each variant's outputs are checked against the current kernel's before it is timed.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I csrc/causal_conv1d benchmarks/experiments/conv_cuda_variants.cu \
//        -o /tmp/conv_variants && /tmp/conv_variants
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fwd.cu"
#include "study_harness.cuh"
#include "bwd.cu"

namespace var {

using T = __nv_bfloat16;
constexpr int W = 4;
constexpr int N = 8;  // bf16 per 16-byte word
using study::pack;
using study::sig;
using study::unpack;

__device__ __forceinline__ uint4 ld16(const T* p, bool ok) {
    if (ok) return *reinterpret_cast<const uint4*>(p);
    return make_uint4(0, 0, 0, 0);
}
template <bool STREAM>
__device__ __forceinline__ uint4 ldw(const T* p, bool ok) {
    if (!ok) return make_uint4(0, 0, 0, 0);
    return STREAM ? __ldcs(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
}
template <bool STREAM>
__device__ __forceinline__ void stw(T* p, const uint4& v) {
    if (STREAM) __stcs(reinterpret_cast<uint4*>(p), v);
    else *reinterpret_cast<uint4*>(p) = v;
}

// Forward: a block of THREADS threads owns C stretches of THREADS * N times of one row (TILES_FAST:
// the grid runs a row's tiles fastest, else rows fastest). Lanes 1..31 take their W - 1 halo inputs
// from the lane below by shuffle; lane 0 loads the word before its own (the row start: zeros).
// Requires T % N == 0 (the fast path's condition in this study).
template <int THREADS, int C, int MINB, bool TILES_FAST, bool STREAM = false>
__global__ void __launch_bounds__(THREADS, MINB) fwd_shfl(const DflashConvParams p) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    int64_t row, tile;
    if (TILES_FAST) {
        const int64_t nt = (p.seqlen + kTile - 1) / kTile;
        row = blockIdx.x / nt;
        tile = blockIdx.x - row * nt;
    } else {
        row = blockIdx.x;
        tile = blockIdx.y;
    }
    const int64_t b = row / p.dim, d = row - b * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;
    uint4 xw[C], hw[C];
    int64_t t0[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        t0[c] = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
        xw[c] = ldw<STREAM>(xr + t0[c], t0[c] < T_);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) hw[c] = ld16(xr + t0[c] - N, lane == 0 && t0[c] >= N && t0[c] < T_);
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = dflash::weight_at(p, d, i);
    const float bias = dflash::bias_at(p, d);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        float xv[N], hv[N], halo[W - 1];
        unpack(xw[c], xv);
        unpack(hw[c], hv);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
            halo[j] = lane == 0 ? hv[N - (W - 1) + j] : up;
        }
        if (t0[c] >= T_) continue;
        float out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float acc = bias;
#pragma unroll
            for (int i = 0; i < W; ++i) {
                const int j = k + i;
                acc += w[i] * (j < W - 1 ? halo[j] : xv[j - (W - 1)]);
            }
            out[k] = p.silu ? acc * sig(acc) : acc;
        }
        stw<STREAM>(yr + t0[c], pack(out));
    }
}

// Persistent forward: a grid of resident blocks walks the items (row, tile; tiles fastest) with a
// stride of the grid, loading the next item's words (and weights) before computing the current.
template <int THREADS, int C>
__global__ void __launch_bounds__(THREADS) fwd_pers(const DflashConvParams p, int64_t n_items) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t nt = (p.seqlen + kTile - 1) / kTile;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* wp = static_cast<const T*>(p.weight);
    const T* bp = static_cast<const T*>(p.bias);
    uint4 xw[C], hw[C];
    uint2 wb;
    T bb;
    auto fetch = [&](int64_t item, uint4 (&xo)[C], uint4 (&ho)[C], uint2& wo, T& bo) {
        const int64_t row = item / nt, tile = item - row * nt;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            xo[c] = ld16(xr + t0, t0 < T_);
            ho[c] = ld16(xr + t0 - N, lane == 0 && t0 >= N && t0 < T_);
        }
        wo = *reinterpret_cast<const uint2*>(wp + d * W);
        bo = bp[d];
    };
    int64_t item = blockIdx.x;
    if (item < n_items) fetch(item, xw, hw, wb, bb);
    while (item < n_items) {
        const int64_t next = item + gridDim.x;
        uint4 xn[C], hn[C];
        uint2 wn;
        T bn;
        if (next < n_items) fetch(next, xn, hn, wn, bn);
        const int64_t row = item / nt, tile = item - row * nt;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;
        float w[W];
        {
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&wb);
            const float2 a = __bfloat1622float2(h[0]), c2 = __bfloat1622float2(h[1]);
            w[0] = a.x; w[1] = a.y; w[2] = c2.x; w[3] = c2.y;
        }
        const float bias = __bfloat162float(bb);
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            float xv[N], hv[N], halo[W - 1];
            unpack(xw[c], xv);
            unpack(hw[c], hv);
#pragma unroll
            for (int j = 0; j < W - 1; ++j) {
                const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
                halo[j] = lane == 0 ? hv[N - (W - 1) + j] : up;
            }
            if (t0 < T_) {
                float out[N];
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    float acc = bias;
#pragma unroll
                    for (int i = 0; i < W; ++i) {
                        const int j = k + i;
                        acc += w[i] * (j < W - 1 ? halo[j] : xv[j - (W - 1)]);
                    }
                    out[k] = p.silu ? acc * sig(acc) : acc;
                }
                *reinterpret_cast<uint4*>(yr + t0) = pack(out);
            }
        }
        item = next;
        if (item < n_items) {
#pragma unroll
            for (int c = 0; c < C; ++c) { xw[c] = xn[c]; hw[c] = hn[c]; }
            wb = wn;
            bb = bn;
        }
    }
}

// Backward, same layout: x and dy words from DRAM; the W - 1 inputs before (shuffle up; lane 0
// loads), the W - 1 inputs and output gradients after (shuffle down; lane 31 loads). Per-block
// dweight / dbias partial rows as in the library (warp tree, then thread 0 over the warps).
template <int THREADS, int C, int MINB, bool TILES_FAST = false>
__global__ void __launch_bounds__(THREADS, MINB) bwd_shfl(const DflashConvParams p) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t n_tiles = TILES_FAST ? (p.seqlen + kTile - 1) / kTile : gridDim.y;
    const int64_t row = TILES_FAST ? blockIdx.x / n_tiles : blockIdx.x;
    const int64_t tile = TILES_FAST ? blockIdx.x - row * n_tiles : blockIdx.y;
    const int64_t b = row / p.dim, d = row - b * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd;
    T* dxr = static_cast<T*>(p.dx) + b * p.dx_sb + d * p.dx_sd;
    uint4 xw[C], gw[C], xe[C], ge[C];  // xe/ge: lane 0 the x word before, lane 31 the x/dy words after
    int64_t t0[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        t0[c] = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
        xw[c] = ld16(xr + t0[c], t0[c] < T_);
        gw[c] = ld16(dyr + t0[c], t0[c] < T_);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const bool first = lane == 0, last = lane == 31;
        xe[c] = ld16(xr + (first ? t0[c] - N : t0[c] + N),
                     (first && t0[c] >= N && t0[c] < T_) || (last && t0[c] + N < T_));
        ge[c] = ld16(dyr + t0[c] + N, last && t0[c] + N < T_);
    }
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = dflash::weight_at(p, d, i);
    const float bias = dflash::bias_at(p, d);
    float dw[W] = {}, db = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
        float xv[N], gv[N], ev[N], fv[N];
        unpack(xw[c], xv);
        unpack(gw[c], gv);
        unpack(xe[c], ev);
        unpack(ge[c], fv);
        float win[N + 2 * (W - 1)], gg[N + W - 1];
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
            win[j] = lane == 0 ? ev[N - (W - 1) + j] : up;
            const float dn = __shfl_down_sync(0xffffffffu, xv[j], 1);
            win[W - 1 + N + j] = lane == 31 ? ev[j] : dn;
            const float gd = __shfl_down_sync(0xffffffffu, gv[j], 1);
            gg[N + j] = lane == 31 ? fv[j] : gd;
        }
#pragma unroll
        for (int k = 0; k < N; ++k) {
            win[W - 1 + k] = xv[k];
            gg[k] = gv[k];
        }
        if (t0[c] >= T_) continue;
        if (p.silu) {
#pragma unroll
            for (int k = 0; k < N + W - 1; ++k) {
                float pre = bias;
#pragma unroll
                for (int i = 0; i < W; ++i) pre += w[i] * win[k + i];
                const float s = sig(pre);
                gg[k] *= s * (1.f + pre * (1.f - s));
            }
        }
        float dx[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            db += gg[k];
#pragma unroll
            for (int i = 0; i < W; ++i) dw[i] += gg[k] * win[k + i];
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < W; ++s) acc += w[W - 1 - s] * gg[k + s];
            dx[k] = acc;
        }
        *reinterpret_cast<uint4*>(dxr + t0[c]) = pack(dx);
    }
    constexpr int kWarps = THREADS / 32;
    __shared__ float red[kWarps][W + 1];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < W; ++i) dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], off);
        db += __shfl_xor_sync(0xffffffffu, db, off);
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < W; ++i) red[threadIdx.x >> 5][i] = dw[i];
        red[threadIdx.x >> 5][W] = db;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int64_t part = b * n_tiles + tile;
        for (int i = 0; i <= W; ++i) {
            float acc = 0.f;
            for (int v = 0; v < kWarps; ++v) acc += red[v][i];
            if (i < W) p.dweight_part[(part * p.dim + d) * W + i] = acc;
            else p.dbias_part[part * p.dim + d] = acc;
        }
    }
}

// Persistent backward: as bwd_shfl, but resident blocks walk the items (row, tile; tiles fastest)
// with a stride of the grid, the next item's words loaded before the current one is computed.
template <int THREADS, int C>
__global__ void __launch_bounds__(THREADS) bwd_pers(const DflashConvParams p, int64_t n_items) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t nt = (p.seqlen + kTile - 1) / kTile;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* wp = static_cast<const T*>(p.weight);
    const T* bp = static_cast<const T*>(p.bias);
    constexpr int kWarps = THREADS / 32;
    __shared__ float red[2][kWarps][W + 1];
    uint4 xw[C], gw[C], xe[C], ge[C];
    uint2 wb;
    T bb;
    auto fetch = [&](int64_t item, uint4 (&xo)[C], uint4 (&go)[C], uint4 (&eo)[C], uint4 (&fo)[C], uint2& wo,
                     T& bo) {
        const int64_t row = item / nt, tile = item - row * nt;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
        const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            xo[c] = ld16(xr + t0, t0 < T_);
            go[c] = ld16(dyr + t0, t0 < T_);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            const bool first = lane == 0, last = lane == 31;
            eo[c] = ld16(xr + (first ? t0 - N : t0 + N), (first && t0 >= N && t0 < T_) || (last && t0 + N < T_));
            fo[c] = ld16(dyr + t0 + N, last && t0 + N < T_);
        }
        wo = *reinterpret_cast<const uint2*>(wp + d * W);
        bo = bp[d];
    };
    int64_t item = blockIdx.x;
    if (item < n_items) fetch(item, xw, gw, xe, ge, wb, bb);
    int parity = 0;
    while (item < n_items) {
        const int64_t next = item + gridDim.x;
        uint4 xn[C], gn[C], en[C], fn[C];
        uint2 wn;
        T bn;
        if (next < n_items) fetch(next, xn, gn, en, fn, wn, bn);
        const int64_t row = item / nt, tile = item - row * nt;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        T* dxr = static_cast<T*>(p.dx) + b * p.dx_sb + d * p.dx_sd;
        float w[W];
        {
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&wb);
            const float2 a = __bfloat1622float2(h[0]), c2 = __bfloat1622float2(h[1]);
            w[0] = a.x; w[1] = a.y; w[2] = c2.x; w[3] = c2.y;
        }
        const float bias = __bfloat162float(bb);
        float dw[W] = {}, db = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            float xv[N], gv[N], ev[N], fv[N];
            unpack(xw[c], xv);
            unpack(gw[c], gv);
            unpack(xe[c], ev);
            unpack(ge[c], fv);
            float win[N + 2 * (W - 1)], gg[N + W - 1];
#pragma unroll
            for (int j = 0; j < W - 1; ++j) {
                const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
                win[j] = lane == 0 ? ev[N - (W - 1) + j] : up;
                const float dn = __shfl_down_sync(0xffffffffu, xv[j], 1);
                win[W - 1 + N + j] = lane == 31 ? ev[j] : dn;
                const float gd = __shfl_down_sync(0xffffffffu, gv[j], 1);
                gg[N + j] = lane == 31 ? fv[j] : gd;
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                win[W - 1 + k] = xv[k];
                gg[k] = gv[k];
            }
            if (t0 < T_) {
                if (p.silu) {
#pragma unroll
                    for (int k = 0; k < N + W - 1; ++k) {
                        float pre = bias;
#pragma unroll
                        for (int i = 0; i < W; ++i) pre += w[i] * win[k + i];
                        const float s = sig(pre);
                        gg[k] *= s * (1.f + pre * (1.f - s));
                    }
                }
                float dx[N];
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    db += gg[k];
#pragma unroll
                    for (int i = 0; i < W; ++i) dw[i] += gg[k] * win[k + i];
                    float acc = 0.f;
#pragma unroll
                    for (int s2 = 0; s2 < W; ++s2) acc += w[W - 1 - s2] * gg[k + s2];
                    dx[k] = acc;
                }
                *reinterpret_cast<uint4*>(dxr + t0) = pack(dx);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int i = 0; i < W; ++i) dw[i] += __shfl_xor_sync(0xffffffffu, dw[i], off);
            db += __shfl_xor_sync(0xffffffffu, db, off);
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < W; ++i) red[parity][threadIdx.x >> 5][i] = dw[i];
            red[parity][threadIdx.x >> 5][W] = db;
        }
        __syncthreads();  // red[parity] complete; the other half was last read before this barrier
        if (threadIdx.x == 0) {
            const int64_t part = b * nt + tile;
            for (int i = 0; i <= W; ++i) {
                float acc = 0.f;
                for (int v = 0; v < kWarps; ++v) acc += red[parity][v][i];
                if (i < W) p.dweight_part[(part * p.dim + d) * W + i] = acc;
                else p.dbias_part[part * p.dim + d] = acc;
            }
        }
        parity ^= 1;
        item = next;
        if (item < n_items) {
#pragma unroll
            for (int c = 0; c < C; ++c) { xw[c] = xn[c]; gw[c] = gn[c]; xe[c] = en[c]; ge[c] = fn[c]; }
            wb = wn;
            bb = bn;
        }
    }
}

// "Rows" layout (the Triton kernels' tile shape): a block of 128 threads owns RB rows (channels) x
// COLS * 256 times; a warp's 16-byte accesses cover 256 consecutive times of one row, a thread's C
// words lie in RB / 4 rows and COLS column stretches. The grid runs the time tiles fastest.
template <int RB, int COLS>
__global__ void __launch_bounds__(128) fwd_rows(const DflashConvParams p) {
    constexpr int TB = COLS * 256, C = (RB / 4) * COLS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t tile = blockIdx.x, d0 = int64_t(blockIdx.y) * RB, b = blockIdx.z;
    const int64_t T_ = p.seqlen;
    uint4 xw[C], hw[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = d0 + (c / COLS) * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
        const bool ok = d < p.dim && t0 < T_;
        const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
        xw[c] = ld16(xr + t0, ok);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = d0 + (c / COLS) * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
        const bool ok = d < p.dim && t0 < T_;
        const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
        hw[c] = ld16(xr + t0 - N, ok && lane == 0 && t0 >= N);
    }
    float w[RB / 4][W], bias[RB / 4];
#pragma unroll
    for (int r = 0; r < RB / 4; ++r) {
        const int64_t d = min(d0 + r * 4 + warp, p.dim - 1);
#pragma unroll
        for (int i = 0; i < W; ++i) w[r][i] = dflash::weight_at(p, d, i);
        bias[r] = dflash::bias_at(p, d);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int r = c / COLS;
        const int64_t d = d0 + r * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
        float xv[N], hv[N], halo[W - 1];
        unpack(xw[c], xv);
        unpack(hw[c], hv);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
            halo[j] = lane == 0 ? hv[N - (W - 1) + j] : up;
        }
        if (d >= p.dim || t0 >= T_) continue;
        float out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float acc = bias[r];
#pragma unroll
            for (int i = 0; i < W; ++i) {
                const int j = k + i;
                acc += w[r][i] * (j < W - 1 ? halo[j] : xv[j - (W - 1)]);
            }
            out[k] = p.silu ? acc * sig(acc) : acc;
        }
        T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;
        *reinterpret_cast<uint4*>(yr + t0) = pack(out);
    }
}

// Backward in the rows layout; a block walks LOOP consecutive time tiles of its rows, so one partial
// dweight / dbias row covers LOOP * COLS * 256 times. A row belongs to one warp: its sums reduce
// within the warp (no shared memory, no block barrier).
template <int RB, int COLS, int LOOP>
__global__ void __launch_bounds__(128) bwd_rows(const DflashConvParams p) {
    constexpr int TB = COLS * 256, C = (RB / 4) * COLS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t chunk = blockIdx.x, d0 = int64_t(blockIdx.y) * RB, b = blockIdx.z;
    const int64_t T_ = p.seqlen;
    float w[RB / 4][W], bias[RB / 4], dw[RB / 4][W], db[RB / 4];
#pragma unroll
    for (int r = 0; r < RB / 4; ++r) {
        const int64_t d = min(d0 + r * 4 + warp, p.dim - 1);
#pragma unroll
        for (int i = 0; i < W; ++i) {
            w[r][i] = dflash::weight_at(p, d, i);
            dw[r][i] = 0.f;
        }
        bias[r] = dflash::bias_at(p, d);
        db[r] = 0.f;
    }
    for (int it = 0; it < LOOP; ++it) {
        const int64_t tile = chunk * LOOP + it;
        if (tile * TB >= T_) break;
        uint4 xw[C], gw[C], xe[C], ge[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t d = d0 + (c / COLS) * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
            const bool ok = d < p.dim && t0 < T_;
            xw[c] = ld16(static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd + t0, ok);
            gw[c] = ld16(static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd + t0, ok);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t d = d0 + (c / COLS) * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
            const bool ok = d < p.dim && t0 < T_, first = lane == 0, last = lane == 31;
            const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
            const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd;
            xe[c] = ld16(xr + (first ? t0 - N : t0 + N), ok && ((first && t0 >= N) || (last && t0 + N < T_)));
            ge[c] = ld16(dyr + t0 + N, ok && last && t0 + N < T_);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int r = c / COLS;
            const int64_t d = d0 + r * 4 + warp, t0 = tile * TB + (c % COLS) * 256 + lane * N;
            float xv[N], gv[N], ev[N], fv[N];
            unpack(xw[c], xv);
            unpack(gw[c], gv);
            unpack(xe[c], ev);
            unpack(ge[c], fv);
            float win[N + 2 * (W - 1)], gg[N + W - 1];
#pragma unroll
            for (int j = 0; j < W - 1; ++j) {
                const float up = __shfl_up_sync(0xffffffffu, xv[N - (W - 1) + j], 1);
                win[j] = lane == 0 ? ev[N - (W - 1) + j] : up;
                const float dn = __shfl_down_sync(0xffffffffu, xv[j], 1);
                win[W - 1 + N + j] = lane == 31 ? ev[j] : dn;
                const float gd = __shfl_down_sync(0xffffffffu, gv[j], 1);
                gg[N + j] = lane == 31 ? fv[j] : gd;
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                win[W - 1 + k] = xv[k];
                gg[k] = gv[k];
            }
            if (d >= p.dim || t0 >= T_) continue;
            if (p.silu) {
#pragma unroll
                for (int k = 0; k < N + W - 1; ++k) {
                    float pre = bias[r];
#pragma unroll
                    for (int i = 0; i < W; ++i) pre += w[r][i] * win[k + i];
                    const float s = sig(pre);
                    gg[k] *= s * (1.f + pre * (1.f - s));
                }
            }
            float dx[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                db[r] += gg[k];
#pragma unroll
                for (int i = 0; i < W; ++i) dw[r][i] += gg[k] * win[k + i];
                float acc = 0.f;
#pragma unroll
                for (int s2 = 0; s2 < W; ++s2) acc += w[r][W - 1 - s2] * gg[k + s2];
                dx[k] = acc;
            }
            *reinterpret_cast<uint4*>(static_cast<T*>(p.dx) + b * p.dx_sb + d * p.dx_sd + t0) = pack(dx);
        }
    }
#pragma unroll
    for (int r = 0; r < RB / 4; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int i = 0; i < W; ++i) dw[r][i] += __shfl_xor_sync(0xffffffffu, dw[r][i], off);
            db[r] += __shfl_xor_sync(0xffffffffu, db[r], off);
        }
        const int64_t d = d0 + r * 4 + warp;
        if (lane == 0 && d < p.dim) {
            const int64_t part = b * gridDim.x + chunk;
#pragma unroll
            for (int i = 0; i < W; ++i) p.dweight_part[(part * p.dim + d) * W + i] = dw[r][i];
            p.dbias_part[part * p.dim + d] = db[r];
        }
    }
}
}  // namespace var

static std::vector<uint16_t> host(const void* dev, size_t n) {
    std::vector<uint16_t> h(n);
    CK(cudaMemcpy(h.data(), dev, n * 2, cudaMemcpyDeviceToHost));
    return h;
}

static double max_diff_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        uint32_t ua = uint32_t(a[i]) << 16, ub = uint32_t(b[i]) << 16;
        float fa, fb;
        memcpy(&fa, &ua, 4);
        memcpy(&fb, &ub, 4);
        m = std::max(m, double(std::abs(fa - fb)));
    }
    return m;
}

int main() {
    constexpr int kReps = 20;  // cudaEvent timings per variant (median)
    using namespace var;
    const int64_t shapes[][3] = {{1, 10240, 4096}, {4, 10240, 4096}, {8, 10240, 16384}};
    for (auto& s : shapes) {
        const int64_t B = s[0], D = s[1], Tn = s[2], n = B * D * Tn;
        const double gb = double(n) * 2 / 1e9;
        bool check = n <= int64_t(1) << 29;
        __nv_bfloat16 *x, *y, *y2, *dy, *dx, *dx2, *wgt, *bias;
        float *dwp, *dbp, *dwp2, *dbp2;
        CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&y2, n * 2));
        CK(cudaMalloc(&dy, n * 2)); CK(cudaMalloc(&dx, n * 2)); CK(cudaMalloc(&dx2, n * 2));
        CK(cudaMalloc(&wgt, D * W * 2)); CK(cudaMalloc(&bias, D * 2));
        const int64_t max_parts = B * ((Tn + 1023) / 1024);
        CK(cudaMalloc(&dwp, max_parts * D * W * 4)); CK(cudaMalloc(&dbp, max_parts * D * 4));
        CK(cudaMalloc(&dwp2, max_parts * D * W * 4)); CK(cudaMalloc(&dbp2, max_parts * D * 4));
        study::fill_kernel<<<1024, 256>>>(x, n, 1, 4.f);
        study::fill_kernel<<<1024, 256>>>(dy, n, 2, 2.f);
        study::fill_kernel<<<64, 256>>>(wgt, D * W, 3, 1.f);
        study::fill_kernel<<<64, 256>>>(bias, D, 4, 1.f);
        CK(cudaDeviceSynchronize());
        DflashConvParams p{};
        p.batch = B; p.dim = D; p.seqlen = Tn; p.width = W; p.x_dtype = DFLASH_BF16; p.silu = 1;
        p.x = x; p.x_sb = D * Tn; p.x_sd = Tn; p.x_st = 1;
        p.weight = wgt; p.w_sd = W; p.w_sw = 1; p.weight_dtype = DFLASH_BF16;
        p.bias = bias; p.bias_s = 1; p.bias_dtype = DFLASH_BF16;
        p.y = y; p.y_sb = D * Tn; p.y_sd = Tn; p.y_st = 1;
        p.dy = dy; p.dy_sb = p.dx_sb = D * Tn; p.dy_sd = p.dx_sd = Tn; p.dy_st = p.dx_st = 1;
        p.dx = dx; p.dweight_part = dwp; p.dbias_part = dbp;
        printf("== B=%lld D=%lld T=%lld (%.3f GB per tensor)\n", (long long)B, (long long)D, (long long)Tn, gb);
        const float cp = study::time_ms([&] { CK(cudaMemcpyAsync(y2, x, n * 2, cudaMemcpyDeviceToDevice)); }, kReps);
        printf("copy            %.4f ms  %.3f TB/s\n", cp, 2 * gb / cp);
        const float f0 = study::time_ms([&] { CK(dflash_causal_conv1d_fwd(&p, 0)); }, kReps);
        printf("fwd current     %.4f ms  %.3f TB/s\n", f0, 2 * gb / f0);
        const auto yref = check ? host(y, n) : std::vector<uint16_t>();
        DflashConvParams q = p;
        q.y = y2;
        auto fwd_variant = [&](const char* name, auto kernel, int threads, int64_t tile, bool tiles_fast) {
            const int64_t nt = (Tn + tile - 1) / tile;
            CK(cudaMemset(y2, 0xff, n * 2));
            auto go = [&] {
                if (tiles_fast) kernel<<<unsigned(B * D * nt), threads>>>(q);
                else kernel<<<dim3(unsigned(B * D), unsigned(nt)), threads>>>(q);
            };
            go();
            CK(cudaDeviceSynchronize());
            const double err = check ? max_diff_bf16(yref, host(y2, n)) : -1;
            const float t = study::time_ms(go, kReps);
            printf("fwd %-12s %.4f ms  %.3f TB/s  max|diff| %.3g\n", name, t, 2 * gb / t, err);
        };
        fwd_variant("s128x4", fwd_shfl<128, 4, 1, false>, 128, 128 * 8 * 4, false);
        fwd_variant("s128x4m6", fwd_shfl<128, 4, 6, false>, 128, 128 * 8 * 4, false);
        fwd_variant("s256x4", fwd_shfl<256, 4, 1, false>, 256, 256 * 8 * 4, false);
        fwd_variant("s128x4tf", fwd_shfl<128, 4, 1, true>, 128, 128 * 8 * 4, true);
        auto fwd_pers_variant = [&](const char* name, auto kernel, int threads, int64_t tile, int per_sm) {
            const int64_t nt = (Tn + tile - 1) / tile, items = B * D * nt;
            int occ = 0, sms = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, 0));
            CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
            const int64_t grid = std::min<int64_t>(items, int64_t(sms) * std::min(occ, per_sm));
            CK(cudaMemset(y2, 0xff, n * 2));
            auto go = [&] { kernel<<<unsigned(grid), threads>>>(q, items); };
            go();
            CK(cudaDeviceSynchronize());
            const double err = check ? max_diff_bf16(yref, host(y2, n)) : -1;
            const float t = study::time_ms(go, kReps);
            printf("fwd %-12s %.4f ms  %.3f TB/s  max|diff| %.3g  (occ %d, grid %lld)\n", name, t, 2 * gb / t,
                   err, occ, (long long)grid);
        };
        fwd_pers_variant("p128x4", fwd_pers<128, 4>, 128, 128 * 8 * 4, 64);
        auto fwd_rows_variant = [&](const char* name, auto kernel, int rb, int tb) {
            const dim3 grid(unsigned((Tn + tb - 1) / tb), unsigned((D + rb - 1) / rb), unsigned(B));
            CK(cudaMemset(y2, 0xff, n * 2));
            auto go = [&] { kernel<<<grid, 128>>>(q); };
            go();
            CK(cudaDeviceSynchronize());
            const double err = check ? max_diff_bf16(yref, host(y2, n)) : -1;
            const float t = study::time_ms(go, kReps);
            printf("fwd %-12s %.4f ms  %.3f TB/s  max|diff| %.3g\n", name, t, 2 * gb / t, err);
        };
        fwd_rows_variant("r16x1", fwd_rows<16, 1>, 16, 256);
        fwd_rows_variant("r8x2", fwd_rows<8, 2>, 8, 512);
        fwd_rows_variant("r4x4", fwd_rows<4, 4>, 4, 1024);
        fwd_rows_variant("r8x1", fwd_rows<8, 1>, 8, 256);
        fwd_rows_variant("r32x1", fwd_rows<32, 1>, 32, 256);
        fwd_rows_variant("r16x2", fwd_rows<16, 2>, 16, 512);
        fwd_variant("s256x4tf", fwd_shfl<256, 4, 1, true>, 256, 256 * 8 * 4, true);

        {   // the forward without the activation: how much of its time the SiLU costs
            q.silu = 0;
            const auto check_saved = check;
            check = false;
            fwd_variant("s128x4tf-noact", fwd_shfl<128, 4, 1, true>, 128, 128 * 8 * 4, true);
            fwd_variant("s128x4-noact", fwd_shfl<128, 4, 1, false>, 128, 128 * 8 * 4, false);
            check = check_saved;
            q.silu = 1;
        }
        if (getenv("ONLY_FWD")) continue;
        const float b0 = study::time_ms([&] { CK(dflash_causal_conv1d_bwd(&p, 0)); }, kReps);
        printf("bwd current     %.4f ms  %.3f TB/s\n", b0, 3 * gb / b0);
        const auto dxref = check ? host(dx, n) : std::vector<uint16_t>();
        const int64_t parts0 = dflash_causal_conv1d_bwd_partials(&p);
        std::vector<float> dw0(parts0 * D * W);
        CK(cudaMemcpy(dw0.data(), dwp, dw0.size() * 4, cudaMemcpyDeviceToHost));
        std::vector<double> dwsum0(D * W, 0.0);
        for (int64_t r = 0; r < parts0; ++r)
            for (int64_t i = 0; i < D * W; ++i) dwsum0[i] += dw0[r * D * W + i];
        DflashConvParams r = p;
        r.dx = dx2; r.dweight_part = dwp2; r.dbias_part = dbp2;
        auto bwd_variant = [&](const char* name, auto kernel, int threads, int64_t tile, bool tf = false) {
            const int64_t nt = (Tn + tile - 1) / tile;
            CK(cudaMemset(dx2, 0xff, n * 2));
            auto go = [&] {
                if (tf) kernel<<<unsigned(B * D * nt), threads>>>(r);
                else kernel<<<dim3(unsigned(B * D), unsigned(nt)), threads>>>(r);
            };
            go();
            CK(cudaDeviceSynchronize());
            const double err = check ? max_diff_bf16(dxref, host(dx2, n)) : -1;
            std::vector<float> dw1(B * nt * D * W);
            CK(cudaMemcpy(dw1.data(), dwp2, dw1.size() * 4, cudaMemcpyDeviceToHost));
            double dwerr = 0, dwmax = 0;
            for (int64_t i = 0; i < D * W; ++i) {
                double acc = 0;
                for (int64_t q2 = 0; q2 < B * nt; ++q2) acc += dw1[q2 * D * W + i];
                dwerr = std::max(dwerr, std::abs(acc - dwsum0[i]));
                dwmax = std::max(dwmax, std::abs(dwsum0[i]));
            }
            const float t = study::time_ms(go, kReps);
            printf("bwd %-12s %.4f ms  %.3f TB/s  max|ddx| %.3g  max|ddw| %.3g (of %.3g)\n", name, t,
                   3 * gb / t, err, dwerr, dwmax);
        };
        bwd_variant("s128x2", bwd_shfl<128, 2, 1>, 128, 128 * 8 * 2);
        bwd_variant("s128x4", bwd_shfl<128, 4, 1>, 128, 128 * 8 * 4);
        bwd_variant("s128x4tf", bwd_shfl<128, 4, 1, true>, 128, 128 * 8 * 4, true);
        bwd_variant("s128x4m4tf", bwd_shfl<128, 4, 4, true>, 128, 128 * 8 * 4, true);
        auto bwd_pers_variant = [&](const char* name, auto kernel, int threads, int64_t tile, int per_sm) {
            const int64_t nt = (Tn + tile - 1) / tile, items = B * D * nt;
            int occ = 0, sms = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, 0));
            CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
            const int64_t grid = std::min<int64_t>(items, int64_t(sms) * std::min(occ, per_sm));
            CK(cudaMemset(dx2, 0xff, n * 2));
            auto go = [&] { kernel<<<unsigned(grid), threads>>>(r, items); };
            go();
            CK(cudaDeviceSynchronize());
            const double err = check ? max_diff_bf16(dxref, host(dx2, n)) : -1;
            std::vector<float> dw1(B * nt * D * W);
            CK(cudaMemcpy(dw1.data(), dwp2, dw1.size() * 4, cudaMemcpyDeviceToHost));
            double dwerr = 0;
            for (int64_t i = 0; i < D * W; ++i) {
                double acc = 0;
                for (int64_t q2 = 0; q2 < B * nt; ++q2) acc += dw1[q2 * D * W + i];
                dwerr = std::max(dwerr, std::abs(acc - dwsum0[i]));
            }
            const float t = study::time_ms(go, kReps);
            printf("bwd %-12s %.4f ms  %.3f TB/s  max|ddx| %.3g  max|ddw| %.3g  (occ %d)\n", name, t, 3 * gb / t,
                   err, dwerr, occ);
        };
        bwd_pers_variant("p128x2", bwd_pers<128, 2>, 128, 128 * 8 * 2, 64);
        auto bwd_rows_variant = [&](const char* name, auto kernel, int rb, int tb, int loop) {
            const int64_t chunks = (Tn + int64_t(tb) * loop - 1) / (int64_t(tb) * loop);
            const dim3 grid(unsigned(chunks), unsigned((D + rb - 1) / rb), unsigned(B));
            CK(cudaMemset(dx2, 0xff, n * 2));
            auto go = [&] { kernel<<<grid, 128>>>(r); };
            go();
            CK(cudaDeviceSynchronize());
            double err = -1, dwerr = -1;
            if (check) {
                err = max_diff_bf16(dxref, host(dx2, n));
                std::vector<float> dw1(B * chunks * D * W);
                CK(cudaMemcpy(dw1.data(), dwp2, dw1.size() * 4, cudaMemcpyDeviceToHost));
                dwerr = 0;
                for (int64_t i = 0; i < D * W; ++i) {
                    double acc = 0;
                    for (int64_t q2 = 0; q2 < B * chunks; ++q2) acc += dw1[q2 * D * W + i];
                    dwerr = std::max(dwerr, std::abs(acc - dwsum0[i]));
                }
            }
            const float t = study::time_ms(go, kReps);
            printf("bwd %-12s %.4f ms  %.3f TB/s  max|ddx| %.3g  max|ddw| %.3g\n", name, t, 3 * gb / t, err, dwerr);
        };
        bwd_rows_variant("r16x1L4", bwd_rows<16, 1, 4>, 16, 256, 4);
        bwd_rows_variant("r8x2L2", bwd_rows<8, 2, 2>, 8, 512, 2);
        bwd_rows_variant("r4x4L1", bwd_rows<4, 4, 1>, 4, 1024, 1);
        bwd_rows_variant("r8x1L4", bwd_rows<8, 1, 4>, 8, 256, 4);
        bwd_rows_variant("r16x1L8", bwd_rows<16, 1, 8>, 16, 256, 8);
        bwd_rows_variant("r4x2L4", bwd_rows<4, 2, 4>, 4, 512, 4);
        CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(y2)); CK(cudaFree(dy)); CK(cudaFree(dx)); CK(cudaFree(dx2));
        CK(cudaFree(wgt)); CK(cudaFree(bias)); CK(cudaFree(dwp)); CK(cudaFree(dbp)); CK(cudaFree(dwp2));
        CK(cudaFree(dbp2));
    }
    return 0;
}
