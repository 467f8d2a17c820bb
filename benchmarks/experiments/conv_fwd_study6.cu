// Forward study, session 6: why the channel-first forward stays at ~85% of the copy bandwidth.
// Times, at the benchmark shapes (bf16, W = 4, SiLU, bias), the library's kernel (csrc/causal_conv1d,
// included as source: compile against two trees to A/B them) against one parameterised variant:
// block size, words per thread (C), load flavour (plain, L2 256-byte prefetch hint, read-only
// non-allocating), and ITER consecutive tiles per block with the next tile's loads issued before the
// current tile's arithmetic. A copy kernel with the same grid gives the ceiling of the access pattern.
// Every variant's output is compared with the library's before it is timed.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I csrc/causal_conv1d benchmarks/experiments/conv_fwd_study6.cu \
//        -o /tmp/fwd6 && /tmp/fwd6
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fwd.cu"
#include "study_harness.cuh"

namespace s6 {

using T = __nv_bfloat16;
constexpr int W = 4;
constexpr int N = 8;  // bf16 per 16-byte word
using study::pack;
using study::sig;
using study::unpack;

// LOAD: 0 plain ld.global, 1 with the L2 256-byte prefetch hint, 2 read-only, no L1 allocation and
// the 256-byte hint, 3 read-only (ld.global.nc).
template <int LOAD>
__device__ __forceinline__ uint4 ld(const T* p, bool ok) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return v;
    if (LOAD == 0) {
        v = *reinterpret_cast<const uint4*>(p);
    } else if (LOAD == 1) {
        asm("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if (LOAD == 2) {
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        v = __ldg(reinterpret_cast<const uint4*>(p));
    }
    return v;
}



// A block owns ITER consecutive tiles of THREADS * N * C times of one row; the grid runs a row's
// tile groups fastest. Lanes 1..31 take the halo from the lane below, lane 0 loads the word before.
template <int THREADS, int C, int LOAD, int ITER, bool SILU = true>
__global__ void __launch_bounds__(THREADS) fv(const DflashConvParams p, int64_t n_groups) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t row = blockIdx.x / n_groups, g = blockIdx.x - row * n_groups;
    const int64_t b = row / p.dim, d = row - b * p.dim;
    const int64_t T_ = p.seqlen;
    const int lane = threadIdx.x & 31;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;
    uint4 xw[C], hw[C];
    auto fetch = [&](int64_t tile, uint4 (&xo)[C], uint4 (&ho)[C]) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            xo[c] = ld<LOAD>(xr + t0, t0 < T_);
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
            ho[c] = ld<LOAD>(xr + t0 - N, lane == 0 && t0 >= N && t0 < T_);
        }
    };
    fetch(g * ITER, xw, hw);
    const T* wp = static_cast<const T*>(p.weight);
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = __bfloat162float(wp[d * W + i]);
    const float bias = __bfloat162float(static_cast<const T*>(p.bias)[d]);
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int64_t tile = g * ITER + it;
        uint4 xn[C], hn[C];
        if (it + 1 < ITER) fetch(tile + 1, xn, hn);
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
            if (t0 >= T_) continue;
            float out[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                float acc = bias;
#pragma unroll
                for (int i = 0; i < W; ++i) {
                    const int j = k + i;
                    acc += w[i] * (j < W - 1 ? halo[j] : xv[j - (W - 1)]);
                }
                out[k] = SILU ? acc * sig(acc) : acc;
            }
            *reinterpret_cast<uint4*>(yr + t0) = pack(out);
        }
        if (it + 1 < ITER) {
#pragma unroll
            for (int c = 0; c < C; ++c) { xw[c] = xn[c]; hw[c] = hn[c]; }
        }
    }
}

// The same grid and accesses as fv<THREADS, C, LOAD, 1> (without the halo load), copying x to y.
template <int THREADS, int C, int LOAD>
__global__ void __launch_bounds__(THREADS) copy_kernel(const DflashConvParams p, int64_t n_groups) {
    constexpr int64_t kTile = int64_t(THREADS) * N * C;
    const int64_t row = blockIdx.x / n_groups, tile = blockIdx.x - row * n_groups;
    const int64_t b = row / p.dim, d = row - b * p.dim;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
    T* yr = static_cast<T*>(p.y) + b * p.y_sb + d * p.y_sd;
    uint4 xw[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
        xw[c] = ld<LOAD>(xr + t0, t0 < p.seqlen);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t t0 = tile * kTile + (int64_t(c) * THREADS + threadIdx.x) * N;
        if (t0 < p.seqlen) *reinterpret_cast<uint4*>(yr + t0) = xw[c];
    }
}

}  // namespace s6

static bool same_bits(const void* a, const void* b, size_t bytes) {
    std::vector<uint8_t> ha(bytes), hb(bytes);
    CK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
    return ha == hb;
}

int main() {
    constexpr int kReps = 30;  // cudaEvent timings per variant (median)
    using namespace s6;
    const int64_t shapes[][3] = {{1, 10240, 4096}, {4, 10240, 4096}, {8, 10240, 16384}};
    for (auto& s : shapes) {
        const int64_t B = s[0], D = s[1], Tn = s[2], n = B * D * Tn;
        const double gb = double(n) * 2 / 1e9;
        __nv_bfloat16 *x, *y, *y2, *wgt, *bias;
        CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&y, n * 2)); CK(cudaMalloc(&y2, n * 2));
        CK(cudaMalloc(&wgt, D * W * 2)); CK(cudaMalloc(&bias, D * 2));
        study::fill_kernel<<<1024, 256>>>(x, n, 1, 4.f);
        study::fill_kernel<<<64, 256>>>(wgt, D * W, 3, 1.f);
        study::fill_kernel<<<64, 256>>>(bias, D, 4, 1.f);
        CK(cudaDeviceSynchronize());
        DflashConvParams p{};
        p.batch = B; p.dim = D; p.seqlen = Tn; p.width = W; p.x_dtype = DFLASH_BF16; p.silu = 1;
        p.x = x; p.x_sb = D * Tn; p.x_sd = Tn; p.x_st = 1;
        p.weight = wgt; p.w_sd = W; p.w_sw = 1; p.weight_dtype = DFLASH_BF16;
        p.bias = bias; p.bias_s = 1; p.bias_dtype = DFLASH_BF16;
        p.y = y; p.y_sb = D * Tn; p.y_sd = Tn; p.y_st = 1;
        printf("== B=%lld D=%lld T=%lld (%.3f GB per tensor)\n", (long long)B, (long long)D, (long long)Tn, gb);
        const float cp = study::time_ms([&] { CK(cudaMemcpyAsync(y2, x, n * 2, cudaMemcpyDeviceToDevice)); }, kReps);
        printf("memcpy            %.4f ms  %.3f TB/s\n", cp, 2 * gb / cp);
        const float f0 = study::time_ms([&] { CK(dflash_causal_conv1d_fwd(&p, 0)); }, kReps);
        printf("fwd library       %.4f ms  %.3f TB/s  %.1f%% of memcpy\n", f0, 2 * gb / f0, 100 * cp / f0);
        DflashConvParams q = p;
        q.y = y2;
        auto variant = [&](const char* name, auto kernel, int threads, int64_t tile, int iter, bool check) {
            const int64_t nt = (Tn + tile - 1) / tile, groups = (nt + iter - 1) / iter;
            CK(cudaMemset(y2, 0xff, n * 2));
            auto go = [&] { kernel<<<unsigned(B * D * groups), threads>>>(q, groups); };
            go();
            CK(cudaDeviceSynchronize());
            const char* ok = !check ? "-" : same_bits(check ? y : x, y2, n * 2) ? "same" : "DIFFERENT";
            const float t = study::time_ms(go, kReps);
            printf("%-17s %.4f ms  %.3f TB/s  %.1f%% of memcpy  %s\n", name, t, 2 * gb / t, 100 * cp / t, ok);
        };
        // copy kernels: compared with x (check=false would skip; the copy must equal x)
        auto copy_variant = [&](const char* name, auto kernel, int threads, int64_t tile) {
            const int64_t nt = (Tn + tile - 1) / tile;
            CK(cudaMemset(y2, 0xff, n * 2));
            auto go = [&] { kernel<<<unsigned(B * D * nt), threads>>>(q, nt); };
            go();
            CK(cudaDeviceSynchronize());
            const bool ok = same_bits(x, y2, n * 2);
            const float t = study::time_ms(go, kReps);
            printf("%-17s %.4f ms  %.3f TB/s  %.1f%% of memcpy  %s\n", name, t, 2 * gb / t, 100 * cp / t,
                   ok ? "same" : "DIFFERENT");
        };
        copy_variant("copy 128x4", copy_kernel<128, 4, 0>, 128, 128 * 8 * 4);
        copy_variant("copy 128x4 L2h", copy_kernel<128, 4, 1>, 128, 128 * 8 * 4);
        copy_variant("copy 128x8", copy_kernel<128, 8, 0>, 128, 128 * 8 * 8);
        copy_variant("copy 256x4", copy_kernel<256, 4, 0>, 256, 256 * 8 * 4);
        variant("fv 128x4", fv<128, 4, 0, 1>, 128, 128 * 8 * 4, 1, true);
        variant("fv 128x4 L2h", fv<128, 4, 1, 1>, 128, 128 * 8 * 4, 1, true);
        variant("fv 128x4 ncL2h", fv<128, 4, 2, 1>, 128, 128 * 8 * 4, 1, true);
        variant("fv 128x4 nc", fv<128, 4, 3, 1>, 128, 128 * 8 * 4, 1, true);
        variant("fv 128x8", fv<128, 8, 0, 1>, 128, 128 * 8 * 8, 1, true);
        variant("fv 128x2", fv<128, 2, 0, 1>, 128, 128 * 8 * 2, 1, true);
        variant("fv 64x4", fv<64, 4, 0, 1>, 64, 64 * 8 * 4, 1, true);
        variant("fv 128x4 it2", fv<128, 4, 0, 2>, 128, 128 * 8 * 4, 2, true);
        variant("fv 128x4 it4", fv<128, 4, 0, 4>, 128, 128 * 8 * 4, 4, true);
        variant("fv 128x2 it4", fv<128, 2, 0, 4>, 128, 128 * 8 * 2, 4, true);
        variant("fv 128x2 it8", fv<128, 2, 0, 8>, 128, 128 * 8 * 2, 8, true);
        variant("fv 128x4 L2h it4", fv<128, 4, 1, 4>, 128, 128 * 8 * 4, 4, true);
        variant("fv 128x2 L2h it4", fv<128, 2, 1, 4>, 128, 128 * 8 * 2, 4, true);
        variant("fv 64x2 it4", fv<64, 2, 0, 4>, 64, 64 * 8 * 2, 4, true);
        variant("fv 256x2 it4", fv<256, 2, 0, 4>, 256, 256 * 8 * 2, 4, true);
        variant("fv 128x2 it2", fv<128, 2, 0, 2>, 128, 128 * 8 * 2, 2, true);
        variant("fv 128x1 it8", fv<128, 1, 0, 8>, 128, 128 * 8 * 1, 8, true);
        variant("fv 128x4 no-silu", fv<128, 4, 0, 1, false>, 128, 128 * 8 * 4, 1, false);
        CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(y2)); CK(cudaFree(wgt)); CK(cudaFree(bias));
    }
    return 0;
}
