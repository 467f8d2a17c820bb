// Tiling shared by the forward and backward kernels, and the host-side checks that decide
// whether 16-byte (or 8-byte) vector accesses are legal for a tensor.
#pragma once

#include "common.cuh"

namespace dflash {

// Channel-first ([B, D, T], stride 1 along T): a block of kCfThreads threads owns kCfChunks
// consecutive stretches of kCfThreads * N times of one (b, d) row; thread i holds the N times
// at i * N of each stretch, so a warp's accesses are contiguous and the W - 1 times before a
// thread's first come from the lane below it through a shuffle.
constexpr int kCfThreads = 128;
constexpr int kCfChunks = 2;

template <typename T>
__host__ __device__ constexpr int64_t cf_tile() { return int64_t(kCfThreads) * (16 / sizeof(T)) * kCfChunks; }


// Channel-last ([B, T, D] in memory): a block is 32 lanes across channels (N each) by kClRows
// rows of threads, each walking its own run of L consecutive times with the last W - 1 inputs
// kept in registers. L is chosen at launch so that the grid fills the GPU.
constexpr int kClLanes = 32;
constexpr int kClRows = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Run length per thread for channel-last kernels: about four waves of resident threads, so short
// inputs still spread over every multiprocessor, 8..128 times (a power of two).
inline int64_t cl_run_length(const DflashConvParams& p, int elems_per_thread) {
    const int64_t lanes = p.batch * ceil_div(p.dim, elems_per_thread);
    const int64_t target_threads = int64_t(num_sms()) * 2048 * 4;
    int64_t L = 8;
    while (L < 128 && lanes * ceil_div(p.seqlen, L) > target_threads) L *= 2;
    return L;
}

// Vector accesses of `bytes` are legal for this tensor: the unit stride is where the kernel
// expects it, every row start is aligned, and the base pointer is aligned.
inline bool vec_ok(const void* ptr, int64_t sb, int64_t sd, int64_t st, bool channel_last, int elems,
                   int bytes) {
    if (ptr == nullptr) return true;
    if (!aligned(ptr, bytes)) return false;
    if (channel_last) return sd == 1 && sb % elems == 0 && st % elems == 0;
    return st == 1 && sb % elems == 0 && sd % elems == 0;
}

}  // namespace dflash
