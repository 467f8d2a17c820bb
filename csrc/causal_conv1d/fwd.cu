// Forward of the causal depthwise conv1d: channel-first and channel-last kernels, fp32 math.
//
// Memory-bound: one read of x and one write of y per element is the floor. Each thread issues
// its 16-byte loads before any arithmetic, so several are in flight; the W - 1 inputs before a
// thread's first come from its neighbour (warp shuffle, channel-first) or from the previous step
// of its own time walk (channel-last), never a second pass over DRAM.

#include "layout.cuh"

namespace dflash {
namespace {

template <typename T, int W>
__global__ void __launch_bounds__(kCfThreads)
fwd_channel_first_kernel(const DflashConvParams p, const int64_t n_tiles, const bool vec) {
    constexpr int N = 16 / sizeof(T);
    constexpr int64_t kTile = cf_tile<T>();
    const int64_t row = blockIdx.x / n_tiles;
    const int64_t tile = blockIdx.x - row * n_tiles;
    const int64_t b = row / p.dim, d = row - (row / p.dim) * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;

    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = weight_at(p, d, i);
    const float bias = bias_at(p, d);
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;

    float xv[kCfChunks][N];
    int64_t t0[kCfChunks];
#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
        t0[c] = tile * kTile + int64_t(c) * kCfThreads * N + int64_t(threadIdx.x) * N;
        const int64_t left = T_ - t0[c];
        const int n = left <= 0 ? 0 : (left >= N ? N : int(left));
        load_vec<T, 16>(xr + t0[c] * p.x_st, p.x_st, n, vec && n == N, xv[c]);
    }
    // Lane 0's halo (the W - 1 inputs before the warp's first) is loaded here, in flight with the
    // loads above, not after the shuffles: a block moves only a few KiB, so a second dependent
    // round trip to memory per block would halve the achievable bandwidth.
    float halo[kCfChunks][W - 1];
#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
#pragma unroll
        for (int j = 0; j < W - 1; ++j)
            halo[c][j] = lane == 0 ? src_x<T, W>(p, b, d, t0[c] - (W - 1) + j) : 0.f;
    }

#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
        // win[j] holds the input at time t0 - (W - 1) + j: the halo, then this thread's N inputs.
        float win[N + W - 1];
#pragma unroll
        for (int j = 0; j < W - 1; ++j) win[j] = __shfl_up_sync(kFullMask, xv[c][N - (W - 1) + j], 1);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < W - 1; ++j) win[j] = halo[c][j];
        }
#pragma unroll
        for (int k = 0; k < N; ++k) win[W - 1 + k] = xv[c][k];
        if (t0[c] >= T_) continue;  // after the shuffles: every lane takes part in them

        int sq[N + W - 1];
        if (p.seq_idx != nullptr) {
#pragma unroll
            for (int j = 0; j < N + W - 1; ++j) {
                const int64_t s = t0[c] - (W - 1) + j;
                sq[j] = s < T_ ? seq_at(p, b, s) : -2;
            }
        }
        float out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float acc = bias;
#pragma unroll
            for (int i = 0; i < W; ++i) {
                const bool keep = p.seq_idx == nullptr || sq[k + i] == sq[k + W - 1];
                acc += keep ? w[i] * win[k + i] : 0.f;
            }
            out[k] = p.silu ? acc * sigmoid(acc) : acc;
            if (p.seq_idx != nullptr && sq[k + W - 1] < 0) out[k] = 0.f;  // padding
        }
        const int64_t left = T_ - t0[c];
        const int n = left >= N ? N : int(left);
        store_vec<T, 16>(yr + t0[c] * p.y_st, p.y_st, n, vec && n == N, out);
    }

    if (p.final_states != nullptr && tile == n_tiles - 1 && threadIdx.x == 0) write_final<T, W>(p, b, d);
}

// Channel-first fast path: 16-byte accesses legal (vec), T a multiple of N and no seq_idx, so every
// word is whole or wholly past T: plain predicated loads, no per-word branch. A block of THREADS
// threads owns ITER consecutive tiles of THREADS * N * C times of one row; thread i holds word i of
// each of the C stretches of THREADS words, and issues the next tile's loads before the current
// tile's arithmetic. Lanes 1..31 take their W - 1 halo inputs from the lane below by shuffle, lane 0
// loads the word before its own (an L1/L2 hit: the neighbouring warp's). The grid runs a row's tile
// groups fastest, so resident blocks stream one contiguous stretch of memory, as a copy does.
// THREADS, C and ITER were chosen by timing the variants on the H200 (bf16, W=4, SiLU;
// a stand-alone study program kept in the git history; results in benchmarks/results/README.md): this shape
// runs closest to cudaMemcpy across batch sizes. SILU is a template argument, as in those variants.
template <typename T, int W, int THREADS, int C, int ITER, bool SILU>
__global__ void __launch_bounds__(THREADS)
fwd_channel_first_fast_kernel(const DflashConvParams p, const int64_t n_groups) {
    constexpr int N = 16 / sizeof(T);
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t row = blockIdx.x / n_groups, group = blockIdx.x - row * n_groups;
    const int64_t b = row / p.dim, d = row - (row / p.dim) * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;

    // words of tile `tile` (zeros past T or when !go); lane 0 also the word before each of its own
    auto fetch = [&](int64_t tile, bool go, uint4 (&xo)[C], uint4 (&ho)[C]) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            xo[c] = load16_if<T>(xr + t0, go && t0 < T_);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            ho[c] = load16_if<T>(xr + t0 - N, go && lane == 0 && t0 >= N && t0 < T_);
        }
    };
    uint4 xw[C], hw[C];
    fetch(group * ITER, true, xw, hw);
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = weight_at(p, d, i);
    const float bias = bias_at(p, d);

#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int64_t tile = group * ITER + it;
        uint4 xn[C], hn[C];
        if (it + 1 < ITER) fetch(tile + 1, (tile + 1) * kTile < T_, xn, hn);
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            float xv[N], prev[N], halo[W - 1];
            unpack16<T>(xw[c], xv);
            unpack16<T>(hw[c], prev);
#pragma unroll
            for (int j = 0; j < W - 1; ++j) {
                const float up = __shfl_up_sync(kFullMask, xv[N - (W - 1) + j], 1);
                // lane 0: the word before (zeros at the row's start; an initial state is fixed up below)
                halo[j] = lane != 0 ? up : prev[N - (W - 1) + j];
            }
            if (t0 >= T_) continue;  // after the shuffles: every lane takes part in them
            float out[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                float acc = bias;
#pragma unroll
                for (int i = 0; i < W; ++i) {
                    const int j = k + i;  // window index: halo for j < W - 1, then this thread's inputs
                    acc += w[i] * (j < W - 1 ? halo[j] : xv[j - (W - 1)]);
                }
                out[k] = SILU ? acc * sigmoid(acc) : acc;
            }
            store16<T>(yr + t0, out);
        }
        if (it + 1 < ITER) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                xw[c] = xn[c];
                hw[c] = hn[c];
            }
        }
    }
}

// The fast kernel's row edges, one thread per (b, d) row, launched after it on the same stream and
// only when asked for: with an initial state the row's first word again (the fast kernel used zeros
// as its halo), the final state. Kept out of the fast kernel, where this code (never taken there)
// costs registers.
template <typename T, int W, bool SILU>
__global__ void __launch_bounds__(kCfThreads) fwd_channel_first_edges_kernel(const DflashConvParams p) {
    constexpr int N = 16 / sizeof(T);
    const int64_t row = int64_t(blockIdx.x) * kCfThreads + threadIdx.x;
    if (row >= p.batch * p.dim) return;
    const int64_t b = row / p.dim, d = row - b * p.dim;
    if (p.init != nullptr) {
        float out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float acc = pre_at<T, W>(p, b, d, k);
            out[k] = SILU ? acc * sigmoid(acc) : acc;
        }
        store16<T>(static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd, out);
    }
    if (p.final_states != nullptr) write_final<T, W>(p, b, d);
}

template <typename T, int W>
cudaError_t launch_fwd_fast(const DflashConvParams& p, cudaStream_t stream) {
    constexpr int kThreads = 64, C = 2, ITER = 4;  // see the kernel's comment
    const int64_t n_tiles = ceil_div(p.seqlen, int64_t(kThreads) * (16 / sizeof(T)) * C);
    const int64_t n_groups = ceil_div(n_tiles, int64_t(ITER));
    if (p.batch * p.dim * n_groups > 0x7fffffffLL) return cudaErrorInvalidValue;
    const unsigned blocks = unsigned(p.batch * p.dim * n_groups);
    const unsigned edge_blocks = unsigned(ceil_div(p.batch * p.dim, int64_t(kCfThreads)));
    const bool edges = p.init != nullptr || p.final_states != nullptr;
    if (p.silu) {
        fwd_channel_first_fast_kernel<T, W, kThreads, C, ITER, true><<<blocks, kThreads, 0, stream>>>(p, n_groups);
        if (edges) fwd_channel_first_edges_kernel<T, W, true><<<edge_blocks, kCfThreads, 0, stream>>>(p);
    } else {
        fwd_channel_first_fast_kernel<T, W, kThreads, C, ITER, false><<<blocks, kThreads, 0, stream>>>(p, n_groups);
        if (edges) fwd_channel_first_edges_kernel<T, W, false><<<edge_blocks, kCfThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
}

// At least two blocks of 256 threads per SM, so at most 128 registers: left to itself, nvcc gives the
// bf16 / fp16 W=4 instance (with the __fdividef sigmoid) more than 128, one block per SM, and the
// kernel measured much slower on the H200 than with the bound, under which ptxas reports no spills
// on sm_90 (benchmarks/results/README.md).
template <typename T, int W>
__global__ void __launch_bounds__(kClLanes * kClRows, 2)
fwd_channel_last_kernel(const DflashConvParams p, const int64_t L, const bool vec) {
    constexpr int N = 16 / sizeof(T);
    constexpr int U = 4;  // time steps loaded together: U independent 16-byte loads in flight
    const int64_t d0 = (int64_t(blockIdx.x) * kClLanes + threadIdx.x) * N;
    const int64_t ts = (int64_t(blockIdx.y) * kClRows + threadIdx.y) * L;
    const int64_t b = blockIdx.z;
    const int64_t T_ = p.seqlen;
    const int64_t left_d = p.dim - d0;
    const int nd = left_d <= 0 ? 0 : (left_d >= N ? N : int(left_d));

    if (p.final_states != nullptr && blockIdx.y == gridDim.y - 1 && threadIdx.y == 0) {
        for (int k = 0; k < nd; ++k) write_final<T, W>(p, b, d0 + k);
    }
    if (nd == 0 || ts >= T_) return;  // no shuffles below: threads may leave early

    float w[N][W], bias[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t d = k < nd ? d0 + k : d0;
#pragma unroll
        for (int i = 0; i < W; ++i) w[k][i] = weight_at(p, d, i);
        bias[k] = bias_at(p, d);
    }
    const bool has_seq = p.seq_idx != nullptr;
    const bool vec_here = vec && nd == N;
    const T* xb = static_cast<const T*>(p.x) + b * p.x_sb + d0 * p.x_sd;
    T* yb = static_cast<T*>(p.y) + b * p.y_sb + d0 * p.y_sd;

    // win[j]: input at time t - (W - 1) + j for the step about to run; sw[j]: its sequence id.
    float win[W - 1][N];
    int sw[W - 1];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const int64_t s = ts - (W - 1) + j;
        if (s >= 0) {
            load_vec<T, 16>(xb + s * p.x_st, p.x_sd, nd, vec_here, win[j]);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) win[j][k] = k < nd ? src_x<T, W>(p, b, d0 + k, s) : 0.f;
        }
        sw[j] = has_seq ? seq_at(p, b, s) : 0;
    }

    const int64_t te = ts + L < T_ ? ts + L : T_;
    for (int64_t tb = ts; tb < te; tb += U) {
        float xin[U][N];
        int sin[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t t = tb + u;
            if (t < te) {
                load_vec<T, 16>(xb + t * p.x_st, p.x_sd, nd, vec_here, xin[u]);
                sin[u] = has_seq ? seq_at(p, b, t) : 0;
            } else {
#pragma unroll
                for (int k = 0; k < N; ++k) xin[u][k] = 0.f;
                sin[u] = 0;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t t = tb + u;
            if (t < te) {
                float out[N];
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    float acc = bias[k] + w[k][W - 1] * xin[u][k];
#pragma unroll
                    for (int i = 0; i < W - 1; ++i) {
                        const bool keep = !has_seq || sw[i] == sin[u];
                        acc += keep ? w[k][i] * win[i][k] : 0.f;
                    }
                    out[k] = p.silu ? acc * sigmoid(acc) : acc;
                    if (has_seq && sin[u] < 0) out[k] = 0.f;  // padding
                }
                store_vec<T, 16>(yb + t * p.y_st, p.y_sd, nd, vec_here, out);
            }
#pragma unroll
            for (int j = 0; j < W - 2; ++j) {
#pragma unroll
                for (int k = 0; k < N; ++k) win[j][k] = win[j + 1][k];
                sw[j] = sw[j + 1];
            }
#pragma unroll
            for (int k = 0; k < N; ++k) win[W - 2][k] = xin[u][k];
            sw[W - 2] = sin[u];
        }
    }
}

template <typename T, int W>
cudaError_t launch_fwd(const DflashConvParams& p, cudaStream_t stream) {
    constexpr int N = 16 / sizeof(T);
    const bool cl = p.channel_last != 0;
    const bool vec = vec_ok(p.x, p.x_sb, p.x_sd, p.x_st, cl, N, 16) &&
                     vec_ok(p.y, p.y_sb, p.y_sd, p.y_st, cl, N, 16);
    if (!cl) {
        if (vec && p.seq_idx == nullptr && p.seqlen % N == 0) {  // one flat grid, a row's tiles fastest
            return launch_fwd_fast<T, W>(p, stream);
        }
        const int64_t n_tiles = ceil_div(p.seqlen, cf_tile<T>());
        const int64_t blocks = p.batch * p.dim * n_tiles;
        if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
        fwd_channel_first_kernel<T, W><<<unsigned(blocks), kCfThreads, 0, stream>>>(p, n_tiles, vec);
    } else {
        const int64_t L = cl_run_length(p, N);
        const dim3 grid(unsigned(ceil_div(p.dim, int64_t(kClLanes) * N)),
                        unsigned(ceil_div(p.seqlen, L * kClRows)), unsigned(p.batch));
        if (grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidValue;
        fwd_channel_last_kernel<T, W><<<grid, dim3(kClLanes, kClRows), 0, stream>>>(p, L, vec);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd_width(const DflashConvParams& p, cudaStream_t stream) {
    switch (p.width) {
        case 2: return launch_fwd<T, 2>(p, stream);
        case 3: return launch_fwd<T, 3>(p, stream);
        case 4: return launch_fwd<T, 4>(p, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace
}  // namespace dflash

extern "C" cudaError_t dflash_causal_conv1d_fwd(const DflashConvParams* p, cudaStream_t stream) {
    if (p == nullptr || p->x == nullptr || p->y == nullptr || p->weight == nullptr) return cudaErrorInvalidValue;
    if (p->batch <= 0 || p->dim <= 0 || p->seqlen <= 0) return p->batch == 0 || p->dim == 0 ? cudaSuccess
                                                                                        : cudaErrorInvalidValue;
    switch (p->x_dtype) {
        case DFLASH_F32: return dflash::launch_fwd_width<float>(*p, stream);
        case DFLASH_F16: return dflash::launch_fwd_width<__half>(*p, stream);
        case DFLASH_BF16: return dflash::launch_fwd_width<__nv_bfloat16>(*p, stream);
        default: return cudaErrorInvalidValue;
    }
}
