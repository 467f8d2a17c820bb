// Backward of the causal depthwise conv1d: dx, partial dweight/dbias, dinitial_states.
//
// x[t] feeds outputs u = t + s (s = 0..W-1) through weight W-1-s, so
//     dx[t] = sum_s w[W-1-s] * g[t+s] * [seq(t+s) == seq(t)],   g = dy * act'(pre),
// with pre recomputed from x (never stored). dweight[i] = sum_t g[t] * x[t-(W-1-i)] and
// dbias = sum_t g[t] are reduced per block and written as one fp32 partial row per block; the host
// sums the rows (deterministic: no float atomics). dfinal_states[j] adds to dx at T-(W-1)+j.

#include "layout.cuh"

namespace dflash {
namespace {

// Block sums of a channel-first block's dweight and dbias in a fixed order (warp tree, then
// thread 0 over the warps), written as partial row `part` (no atomics: deterministic).
template <int W>
__device__ __forceinline__ void store_block_partials(const DflashConvParams& p, float (&dw)[W], float db,
                                                     int64_t part, int64_t d) {
    constexpr int kWarps = kCfThreads / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float red[kWarps][W + 1];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < W; ++i) dw[i] += __shfl_xor_sync(kFullMask, dw[i], off);
        db += __shfl_xor_sync(kFullMask, db, off);
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < W; ++i) red[warp][i] = dw[i];
        red[warp][W] = db;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i <= W; ++i) {
            float acc = 0.f;
#pragma unroll
            for (int v = 0; v < kWarps; ++v) acc += red[v][i];
            if (i < W) p.dweight_part[(part * p.dim + d) * W + i] = acc;
            else if (p.dbias_part != nullptr) p.dbias_part[part * p.dim + d] = acc;
        }
    }
}

// dx at one time from g at that time and the W - 1 after it: sum_s w[W-1-s] g[t+s], plus the
// final-state gradient where t is one of the last W - 1 times.
template <int W>
__device__ __forceinline__ float dx_at(const DflashConvParams& p, const float (&w)[W], const float* g,
                                       int64_t b, int64_t d, int64_t t) {
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < W; ++s) acc += w[W - 1 - s] * g[s];
    if (p.dfinal != nullptr) {
        const int64_t j = t - (p.seqlen - (W - 1));
        if (j >= 0 && j < W - 1)
            acc += load_any(p.dfinal, p.dfin_dtype, b * p.dfin_sb + d * p.dfin_sd + j * p.dfin_st);
    }
    return acc;
}

template <typename T, int W>
__global__ void __launch_bounds__(kCfThreads)
bwd_channel_first_kernel(const DflashConvParams p, const int64_t n_tiles, const bool vec) {
    constexpr int N = 16 / sizeof(T);
    constexpr int64_t kTile = cf_tile<T>();
    const int64_t row = blockIdx.x / n_tiles;
    const int64_t tile = blockIdx.x - row * n_tiles;
    const int64_t b = row / p.dim, d = row - (row / p.dim) * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const bool has_seq = p.seq_idx != nullptr;

    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = weight_at(p, d, i);
    const float bias = bias_at(p, d);
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd;
    T* dxr = static_cast<T*>(p.dx) + b * p.dx_sb + d * p.dx_sd;

    float xv[kCfChunks][N], gv[kCfChunks][N];
    int64_t t0[kCfChunks];
    int nn[kCfChunks];
#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
        t0[c] = tile * kTile + int64_t(c) * kCfThreads * N + int64_t(threadIdx.x) * N;
        const int64_t left = T_ - t0[c];
        nn[c] = left <= 0 ? 0 : (left >= N ? N : int(left));
        load_vec<T, 16>(xr + t0[c] * p.x_st, p.x_st, nn[c], vec && nn[c] == N, xv[c]);
        load_vec<T, 16>(dyr + t0[c] * p.dy_st, p.dy_st, nn[c], vec && nn[c] == N, gv[c]);
    }
    // The warp-edge values (lane 0's left halo of x, lane 31's g after its last time) are loaded
    // here, in flight with the loads above, not after the shuffles (see fwd.cu).
    float halo[kCfChunks][W - 1], edge[kCfChunks][W - 1];
#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            halo[c][j] = lane == 0 ? src_x<T, W>(p, b, d, t0[c] - (W - 1) + j) : 0.f;
            edge[c][j] = lane == 31 ? g_at<T, W>(p, b, d, t0[c] + N + j) : 0.f;
        }
    }

    float dw[W], db = 0.f;
#pragma unroll
    for (int i = 0; i < W; ++i) dw[i] = 0.f;

#pragma unroll
    for (int c = 0; c < kCfChunks; ++c) {
        float win[N + W - 1];  // input at t0 - (W - 1) + j
#pragma unroll
        for (int j = 0; j < W - 1; ++j) win[j] = __shfl_up_sync(kFullMask, xv[c][N - (W - 1) + j], 1);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < W - 1; ++j) win[j] = halo[c][j];
        }
#pragma unroll
        for (int k = 0; k < N; ++k) win[W - 1 + k] = xv[c][k];

        // Sequence ids at times t0 - (W - 1) .. t0 + N - 1 + (W - 1); -2 past the end.
        int sq[N + 2 * (W - 1)];
        if (has_seq) {
#pragma unroll
            for (int j = 0; j < N + 2 * (W - 1); ++j) {
                const int64_t s = t0[c] - (W - 1) + j;
                sq[j] = s < T_ ? seq_at(p, b, s) : -2;
            }
        }

        // g at this thread's own times (zero past T, where dy was loaded as zero).
#pragma unroll
        for (int k = 0; k < N; ++k) {
            if (p.silu) {
                float pre = bias;
#pragma unroll
                for (int i = 0; i < W; ++i) {
                    const bool keep = !has_seq || sq[k + i] == sq[k + W - 1];
                    pre += keep ? w[i] * win[k + i] : 0.f;
                }
                gv[c][k] *= silu_grad(pre);
            }
            if (has_seq && sq[k + W - 1] < 0) {  // padding: a constant 0 output, and no weight gradient
                gv[c][k] = 0.f;                  // (0 * x would carry a non-finite x at padding into dw)
                continue;
            }
            const float g = gv[c][k];
            db += g;
#pragma unroll
            for (int i = 0; i < W; ++i) {
                const bool keep = !has_seq || sq[k + i] == sq[k + W - 1];
                dw[i] += keep ? g * win[k + i] : 0.f;
            }
        }

        // g at the W - 1 times after this thread's last: from the lane above, or recomputed at a
        // warp's edge.
        float gh[W - 1];
#pragma unroll
        for (int j = 0; j < W - 1; ++j) gh[j] = __shfl_down_sync(kFullMask, gv[c][j], 1);
        if (lane == 31) {
#pragma unroll
            for (int j = 0; j < W - 1; ++j) gh[j] = edge[c][j];
        }
        if (nn[c] == 0) continue;  // after the shuffles: every lane takes part in them

        float dx[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < W; ++s) {
                const float g = k + s < N ? gv[c][k + s] : gh[k + s - N];
                const bool keep = !has_seq || sq[W - 1 + k + s] == sq[W - 1 + k];
                acc += keep ? w[W - 1 - s] * g : 0.f;
            }
            if (p.dfinal != nullptr) {
                const int64_t j = t0[c] + k - (T_ - (W - 1));
                if (j >= 0 && j < W - 1)
                    acc += load_any(p.dfinal, p.dfin_dtype, b * p.dfin_sb + d * p.dfin_sd + j * p.dfin_st);
            }
            dx[k] = acc;
        }
        store_vec<T, 16>(dxr + t0[c] * p.dx_st, p.dx_st, nn[c], vec && nn[c] == N, dx);
    }

    if (p.init != nullptr && p.dinit != nullptr && tile == 0 && threadIdx.x == 0) write_dinit<T, W>(p, b, d);

    store_block_partials<W>(p, dw, db, b * n_tiles + tile, d);
}

// Channel-first fast path: 16-byte accesses legal, T a multiple of N (every word whole or wholly
// past T: predicated loads, no per-word branch) and no seq_idx. A warp owns one row (channel):
// a block is kCfThreads / 32 rows by cf_tile() times, walked in kBwdSteps steps of kBwdCols words
// per thread; a warp's 16-byte accesses cover 32 * N consecutive times. Per word a thread loads x
// and dy; the W - 1 inputs before come from the lane below by shuffle (lane 0 loads the word before),
// the W - 1 inputs and output gradients after from the lane above (lane 31 loads the words after).
// A row's dweight / dbias sums stay in one warp (shuffle tree, no shared memory, no barrier), one
// partial row per block as in the other kernels. Measured faster on the H200 than one row per block
// with every lane loading its neighbours' words (a stand-alone study program kept in the git history,
// results in benchmarks/results/README.md).
constexpr int kBwdCols = 2;
constexpr int kBwdSteps = 4;

template <typename T, int W>
__global__ void __launch_bounds__(kCfThreads)
bwd_channel_first_fast_kernel(const DflashConvParams p) {
    constexpr int N = 16 / sizeof(T);
    constexpr int C = kBwdCols;
    constexpr int64_t kSpan = 32 * N, kStep = kSpan * C;
    static_assert(kStep * kBwdSteps == cf_tile<T>(), "one partial row per cf_tile() times, as partials() counts");
    const int lane = threadIdx.x & 31;
    const int64_t chunk = blockIdx.x, n_chunks = gridDim.x;
    const int64_t d = int64_t(blockIdx.y) * (kCfThreads / 32) + (threadIdx.x >> 5), b = blockIdx.z;
    if (d >= p.dim) return;  // a whole warp: no shuffle or barrier waits for it
    const int64_t T_ = p.seqlen;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + d * p.dy_sd;
    T* dxr = static_cast<T*>(p.dx) + b * p.dx_sb + d * p.dx_sd;
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = weight_at(p, d, i);
    const float bias = bias_at(p, d);
    float dw[W], db = 0.f;
#pragma unroll
    for (int i = 0; i < W; ++i) dw[i] = 0.f;
    // The inputs before time 0 (initial state or zeros), read by lane 0 at the row's first word;
    // loaded once here, not in the loop (a load there stalls the warp on every word).
    float start[W - 1];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) start[j] = chunk == 0 && lane == 0 ? src_x<T, W>(p, b, d, j - (W - 1)) : 0.f;

    for (int step = 0; step < kBwdSteps; ++step) {
        const int64_t base = (chunk * kBwdSteps + step) * kStep;
        if (base >= T_) break;
        uint4 xw[C], gw[C], xe[C], ge[C];  // xe: lane 0 the x word before, lane 31 the x word after
        int64_t t0[C];
        bool in[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            t0[c] = base + c * kSpan + lane * N;
            in[c] = t0[c] < T_;
            xw[c] = load16_if<T>(xr + t0[c], in[c]);
            gw[c] = load16_if<T>(dyr + t0[c], in[c]);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const bool first = lane == 0, last = lane == 31, next_in = t0[c] + N < T_;
            xe[c] = load16_if<T>(xr + (first ? t0[c] - N : t0[c] + N),
                                 first ? t0[c] >= N && in[c] : last && next_in);
            ge[c] = load16_if<T>(dyr + t0[c] + N, last && next_in);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            // win[j]: input at t0 - (W - 1) + j, j < N + 2 (W - 1); gg[j]: g at t0 + j, j < N + W - 1.
            float win[N + 2 * (W - 1)], gg[N + W - 1];
            {
                float xv[N], gv[N], ev[N], fv[N];
                unpack16<T>(xw[c], xv);
                unpack16<T>(gw[c], gv);
                unpack16<T>(xe[c], ev);
                unpack16<T>(ge[c], fv);
#pragma unroll
                for (int j = 0; j < W - 1; ++j) {
                    const float up = __shfl_up_sync(kFullMask, xv[N - (W - 1) + j], 1);
                    // lane 0: the word before, or at the row's start the initial state (or zeros)
                    win[j] = lane != 0 ? up : t0[c] >= N ? ev[N - (W - 1) + j] : start[j];
                    const float dn = __shfl_down_sync(kFullMask, xv[j], 1);
                    win[W - 1 + N + j] = lane == 31 ? ev[j] : dn;
                    const float gd = __shfl_down_sync(kFullMask, gv[j], 1);
                    gg[N + j] = lane == 31 ? fv[j] : gd;  // past T: dy was loaded as zero
                }
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    win[W - 1 + k] = xv[k];
                    gg[k] = gv[k];
                }
            }
            if (!in[c]) continue;  // after the shuffles: every lane takes part in them
            if (p.silu) {
#pragma unroll
                for (int k = 0; k < N + W - 1; ++k) {
                    float pre = bias;
#pragma unroll
                    for (int i = 0; i < W; ++i) pre += w[i] * win[k + i];
                    gg[k] *= silu_grad(pre);
                }
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                db += gg[k];
#pragma unroll
                for (int i = 0; i < W; ++i) dw[i] += gg[k] * win[k + i];
            }
            float dx[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                float acc = 0.f;
#pragma unroll
                for (int s = 0; s < W; ++s) acc += w[W - 1 - s] * gg[k + s];
                dx[k] = acc;
            }
            // The final-state gradient adds to the last W - 1 times only: one test per word, not per time.
            if (p.dfinal != nullptr && t0[c] + N > T_ - (W - 1)) {
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    const int64_t j = t0[c] + k - (T_ - (W - 1));
                    if (j >= 0 && j < W - 1)
                        dx[k] += load_any(p.dfinal, p.dfin_dtype, b * p.dfin_sb + d * p.dfin_sd + j * p.dfin_st);
                }
            }
            store16<T>(dxr + t0[c], dx);
        }
    }
    if (p.init != nullptr && p.dinit != nullptr && chunk == 0 && lane == 0) write_dinit<T, W>(p, b, d);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < W; ++i) dw[i] += __shfl_xor_sync(kFullMask, dw[i], off);
        db += __shfl_xor_sync(kFullMask, db, off);
    }
    if (lane == 0) {
        const int64_t part = b * n_chunks + chunk;
#pragma unroll
        for (int i = 0; i < W; ++i) p.dweight_part[(part * p.dim + d) * W + i] = dw[i];
        if (p.dbias_part != nullptr) p.dbias_part[part * p.dim + d] = db;
    }
}

// Channel-last: 8-byte accesses (4 bf16 channels per thread) keep the register count, and with it
// the number of resident threads, up; a warp still covers 256 contiguous bytes per time step.
template <typename T>
__host__ __device__ constexpr int cl_bwd_elems() { return 8 / sizeof(T); }

template <typename T, int W>
__global__ void __launch_bounds__(kClLanes * kClRows)
bwd_channel_last_kernel(const DflashConvParams p, const int64_t L, const bool vec) {
    constexpr int N = cl_bwd_elems<T>();
    constexpr int U = 4;
    const int64_t d0 = (int64_t(blockIdx.x) * kClLanes + threadIdx.x) * N;
    const int64_t ts = (int64_t(blockIdx.y) * kClRows + threadIdx.y) * L;
    const int64_t b = blockIdx.z;
    const int64_t T_ = p.seqlen;
    const int64_t left_d = p.dim - d0;
    const int nd = left_d <= 0 ? 0 : (left_d >= N ? N : int(left_d));
    const bool has_seq = p.seq_idx != nullptr;
    const bool active = nd > 0 && ts < T_;

    if (p.init != nullptr && p.dinit != nullptr && blockIdx.y == 0 && threadIdx.y == 0) {
        for (int k = 0; k < nd; ++k) write_dinit<T, W>(p, b, d0 + k);
    }

    float dw[N][W], db[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
        db[k] = 0.f;
#pragma unroll
        for (int i = 0; i < W; ++i) dw[k][i] = 0.f;
    }

    if (active) {
        float w[N][W], bias[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int64_t d = k < nd ? d0 + k : d0;
#pragma unroll
            for (int i = 0; i < W; ++i) w[k][i] = weight_at(p, d, i);
            bias[k] = bias_at(p, d);
        }
        const bool vec_here = vec && nd == N;
        const T* xb = static_cast<const T*>(p.x) + b * p.x_sb + d0 * p.x_sd;
        const T* dyb = static_cast<const T*>(p.dy) + b * p.dy_sb + d0 * p.dy_sd;
        T* dxb = static_cast<T*>(p.dx) + b * p.dx_sb + d0 * p.dx_sd;

        // Before step u: xw[j] / sx[j] = input and sequence id at time u - (W - 1) + j;
        // gr[j] / sg[j] = g and sequence id at the same times (only read once t = u - (W-1) >= ts).
        float xw[W - 1][N], gr[W - 1][N];
        int sx[W - 1], sg[W - 1];
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const int64_t s = ts - (W - 1) + j;
            if (s >= 0) {
                load_vec<T, 8>(xb + s * p.x_st, p.x_sd, nd, vec_here, xw[j]);
            } else {
#pragma unroll
                for (int k = 0; k < N; ++k) xw[j][k] = k < nd ? src_x<T, W>(p, b, d0 + k, s) : 0.f;
            }
            sx[j] = has_seq ? seq_at(p, b, s) : 0;
            sg[j] = sx[j];
#pragma unroll
            for (int k = 0; k < N; ++k) gr[j][k] = 0.f;
        }

        const int64_t te = ts + L < T_ ? ts + L : T_;
        const int64_t ue = te + (W - 1);  // g is needed W - 1 steps past the run for its last dx
        for (int64_t ub = ts; ub < ue; ub += U) {
            float xin[U][N], dyin[U][N];
            int sin[U];
#pragma unroll
            for (int v = 0; v < U; ++v) {
                const int64_t u = ub + v;
                if (u < ue && u < T_) {
                    load_vec<T, 8>(xb + u * p.x_st, p.x_sd, nd, vec_here, xin[v]);
                    load_vec<T, 8>(dyb + u * p.dy_st, p.dy_sd, nd, vec_here, dyin[v]);
                    sin[v] = has_seq ? seq_at(p, b, u) : 0;
                } else {
#pragma unroll
                    for (int k = 0; k < N; ++k) xin[v][k] = dyin[v][k] = 0.f;
                    sin[v] = -2;
                }
            }
#pragma unroll
            for (int v = 0; v < U; ++v) {
                const int64_t u = ub + v;
                if (u >= ue) break;
                float g[N];
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    g[k] = dyin[v][k];
                    if (p.silu) {
                        float pre = bias[k] + w[k][W - 1] * xin[v][k];
#pragma unroll
                        for (int i = 0; i < W - 1; ++i) pre += (!has_seq || sx[i] == sin[v]) ? w[k][i] * xw[i][k] : 0.f;
                        g[k] *= silu_grad(pre);
                    }
                    if (has_seq && sin[v] < 0) g[k] = 0.f;  // padding: a constant 0 output
                }
                if (u < te && !(has_seq && sin[v] < 0)) {  // padding adds nothing (0 * a non-finite x would)
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        db[k] += g[k];
                        dw[k][W - 1] += g[k] * xin[v][k];
#pragma unroll
                        for (int i = 0; i < W - 1; ++i)
                            dw[k][i] += (!has_seq || sx[i] == sin[v]) ? g[k] * xw[i][k] : 0.f;
                    }
                }
                const int64_t t = u - (W - 1);
                if (t >= ts) {
                    // dx[t] = sum_s w[W-1-s] g[t+s]: s < W-1 from the ring, s = W-1 is g[u].
                    float dx[N];
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        float acc = (!has_seq || sin[v] == sg[0]) ? w[k][0] * g[k] : 0.f;
#pragma unroll
                        for (int s = 0; s < W - 1; ++s)
                            acc += (!has_seq || sg[s] == sg[0]) ? w[k][W - 1 - s] * gr[s][k] : 0.f;
                        if (p.dfinal != nullptr && k < nd) {
                            const int64_t j = t - (T_ - (W - 1));
                            if (j >= 0 && j < W - 1)
                                acc += load_any(p.dfinal, p.dfin_dtype,
                                                b * p.dfin_sb + (d0 + k) * p.dfin_sd + j * p.dfin_st);
                        }
                        dx[k] = acc;
                    }
                    store_vec<T, 8>(dxb + t * p.dx_st, p.dx_sd, nd, vec_here, dx);
                }
#pragma unroll
                for (int j = 0; j < W - 2; ++j) {
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        xw[j][k] = xw[j + 1][k];
                        gr[j][k] = gr[j + 1][k];
                    }
                    sx[j] = sx[j + 1];
                    sg[j] = sg[j + 1];
                }
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    xw[W - 2][k] = xin[v][k];
                    gr[W - 2][k] = g[k];
                }
                sx[W - 2] = sin[v];
                sg[W - 2] = sin[v];
            }
        }
    }

    // Sum the rows of threads in a fixed order through shared memory, then one partial per block.
    __shared__ float red[kClLanes][N * (W + 1)];
    for (int r = 0; r < kClRows; ++r) {
        if (threadIdx.y == r) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
#pragma unroll
                for (int i = 0; i < W; ++i)
                    red[threadIdx.x][k * (W + 1) + i] = (r == 0 ? 0.f : red[threadIdx.x][k * (W + 1) + i]) + dw[k][i];
                red[threadIdx.x][k * (W + 1) + W] = (r == 0 ? 0.f : red[threadIdx.x][k * (W + 1) + W]) + db[k];
            }
        }
        __syncthreads();
    }
    if (threadIdx.y == 0) {
        const int64_t part = b * gridDim.y + blockIdx.y;
        for (int k = 0; k < nd; ++k) {
            const int64_t d = d0 + k;
#pragma unroll
            for (int i = 0; i < W; ++i) p.dweight_part[(part * p.dim + d) * W + i] = red[threadIdx.x][k * (W + 1) + i];
            if (p.dbias_part != nullptr) p.dbias_part[part * p.dim + d] = red[threadIdx.x][k * (W + 1) + W];
        }
    }
}

template <typename T>
int64_t cl_bwd_run_length(const DflashConvParams& p) { return cl_run_length(p, cl_bwd_elems<T>()); }

template <typename T>
int64_t partials(const DflashConvParams& p) {
    if (!p.channel_last) return p.batch * ceil_div(p.seqlen, cf_tile<T>());
    return p.batch * ceil_div(p.seqlen, cl_bwd_run_length<T>(p) * kClRows);
}

template <typename T, int W>
cudaError_t launch_bwd(const DflashConvParams& p, cudaStream_t stream) {
    const bool cl = p.channel_last != 0;
    if (!cl) {
        constexpr int N = 16 / sizeof(T);
        const bool vec = vec_ok(p.x, p.x_sb, p.x_sd, p.x_st, false, N, 16) &&
                         vec_ok(p.dy, p.dy_sb, p.dy_sd, p.dy_st, false, N, 16) &&
                         vec_ok(p.dx, p.dx_sb, p.dx_sd, p.dx_st, false, N, 16);
        const int64_t n_tiles = ceil_div(p.seqlen, cf_tile<T>());
        if (vec && p.seq_idx == nullptr && p.seqlen % N == 0) {  // chunks of a row on x, row groups on y, batch on z
            constexpr int64_t kRows = kCfThreads / 32;
            if (n_tiles > 0x7fffffffLL || ceil_div(p.dim, kRows) > 65535 || p.batch > 65535)
                return cudaErrorInvalidValue;
            const dim3 grid(unsigned(n_tiles), unsigned(ceil_div(p.dim, kRows)), unsigned(p.batch));
            bwd_channel_first_fast_kernel<T, W><<<grid, kCfThreads, 0, stream>>>(p);
            return cudaGetLastError();
        }
        const int64_t blocks = p.batch * p.dim * n_tiles;
        if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
        bwd_channel_first_kernel<T, W><<<unsigned(blocks), kCfThreads, 0, stream>>>(p, n_tiles, vec);
    } else {
        constexpr int N = cl_bwd_elems<T>();
        const bool vec = vec_ok(p.x, p.x_sb, p.x_sd, p.x_st, true, N, 8) &&
                         vec_ok(p.dy, p.dy_sb, p.dy_sd, p.dy_st, true, N, 8) &&
                         vec_ok(p.dx, p.dx_sb, p.dx_sd, p.dx_st, true, N, 8);
        const int64_t L = cl_bwd_run_length<T>(p);
        const dim3 grid(unsigned(ceil_div(p.dim, int64_t(kClLanes) * N)),
                        unsigned(ceil_div(p.seqlen, L * kClRows)), unsigned(p.batch));
        if (grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidValue;
        bwd_channel_last_kernel<T, W><<<grid, dim3(kClLanes, kClRows), 0, stream>>>(p, L, vec);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd_width(const DflashConvParams& p, cudaStream_t stream) {
    switch (p.width) {
        case 2: return launch_bwd<T, 2>(p, stream);
        case 3: return launch_bwd<T, 3>(p, stream);
        case 4: return launch_bwd<T, 4>(p, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace
}  // namespace dflash

extern "C" int64_t dflash_causal_conv1d_bwd_partials(const DflashConvParams* p) {
    switch (p->x_dtype) {
        case DFLASH_F32: return dflash::partials<float>(*p);
        case DFLASH_F16: return dflash::partials<__half>(*p);
        case DFLASH_BF16: return dflash::partials<__nv_bfloat16>(*p);
        default: return -1;
    }
}

extern "C" cudaError_t dflash_causal_conv1d_bwd(const DflashConvParams* p, cudaStream_t stream) {
    if (p == nullptr || p->x == nullptr || p->dy == nullptr || p->dx == nullptr || p->weight == nullptr ||
        p->dweight_part == nullptr || (p->bias != nullptr && p->dbias_part == nullptr) ||
        (p->init != nullptr && p->dinit == nullptr))
        return cudaErrorInvalidValue;
    if (p->batch == 0 || p->dim == 0) return cudaSuccess;
    if (p->batch < 0 || p->dim < 0 || p->seqlen <= 0) return cudaErrorInvalidValue;
    switch (p->x_dtype) {
        case DFLASH_F32: return dflash::launch_bwd_width<float>(*p, stream);
        case DFLASH_F16: return dflash::launch_bwd_width<__half>(*p, stream);
        case DFLASH_BF16: return dflash::launch_bwd_width<__nv_bfloat16>(*p, stream);
        default: return cudaErrorInvalidValue;
    }
}
