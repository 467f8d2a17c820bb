// Device helpers shared by the conv kernels: element types, vector loads along the unit-stride
// axis, and scalar reference-style accessors used at tile edges (halos, states, dinit).
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "causal_conv1d.h"

namespace dflash {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// The small tensors (weight, bias, states) are read element by element, so their type is a
// run-time tag instead of one more template axis.
__device__ __forceinline__ float load_any(const void* ptr, int dtype, int64_t i) {
    switch (dtype) {
        case DFLASH_F16: return __half2float(static_cast<const __half*>(ptr)[i]);
        case DFLASH_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[i]);
        default: return static_cast<const float*>(ptr)[i];
    }
}

__device__ __forceinline__ void store_any(void* ptr, int dtype, int64_t i, float v) {
    switch (dtype) {
        case DFLASH_F16: static_cast<__half*>(ptr)[i] = __float2half_rn(v); break;
        case DFLASH_BF16: static_cast<__nv_bfloat16*>(ptr)[i] = __float2bfloat16_rn(v); break;
        default: static_cast<float*>(ptr)[i] = v; break;
    }
}

// __fdividef: the hardware reciprocal (one MUFU.RCP) instead of IEEE division (rcp.rn: a refinement
// sequence per element, 32 of them per thread in the forward's fast kernel); 1 / inf still gives 0.
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.f, 1.f + __expf(-v)); }

// d silu(pre) / d pre = sig * (1 + pre * (1 - sig))
__device__ __forceinline__ float silu_grad(float pre) {
    const float s = sigmoid(pre);
    return s * (1.f + pre * (1.f - s));
}

// kBytes-wide accesses (16 or 8) of N = kBytes / sizeof(T) elements along the unit-stride axis.
template <int kBytes> struct VecWord;
template <> struct VecWord<16> { using type = uint4; };
template <> struct VecWord<8> { using type = uint2; };

// Loads n contiguous-in-index elements base[k * stride], k < N, as floats; elements at k >= n are 0.
// The caller passes vec = true only when stride == 1, base is kBytes-aligned and n == N.
template <typename T, int kBytes>
__device__ __forceinline__ void load_vec(const T* base, int64_t stride, int n, bool vec,
                                         float (&out)[kBytes / sizeof(T)]) {
    constexpr int N = kBytes / sizeof(T);
    using Word = typename VecWord<kBytes>::type;
    if (vec) {
        alignas(kBytes) T tmp[N];
        *reinterpret_cast<Word*>(tmp) = *reinterpret_cast<const Word*>(base);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = to_float(tmp[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = k < n ? to_float(base[k * stride]) : 0.f;
    }
}

template <typename T, int kBytes>
__device__ __forceinline__ void store_vec(T* base, int64_t stride, int n, bool vec,
                                          const float (&val)[kBytes / sizeof(T)]) {
    constexpr int N = kBytes / sizeof(T);
    using Word = typename VecWord<kBytes>::type;
    if (vec) {
        alignas(kBytes) T tmp[N];
#pragma unroll
        for (int k = 0; k < N; ++k) tmp[k] = from_float<T>(val[k]);
        *reinterpret_cast<Word*>(base) = *reinterpret_cast<const Word*>(tmp);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (k < n) base[k * stride] = from_float<T>(val[k]);
    }
}

// A 16-byte word of N = 16 / sizeof(T) elements, kept packed (4 registers) until used.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& word, float (&out)[16 / sizeof(T)]) {
    constexpr int N = 16 / sizeof(T);
    alignas(16) T tmp[N];
    *reinterpret_cast<uint4*>(tmp) = word;
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(tmp[k]);
}

// The whole word at base (16-byte aligned) when ok, else zeros: one predicated load, no branch (the
// forward with a partial-word branch per load instead measured slower on the H200;
// benchmarks/results/README.md).
template <typename T>
__device__ __forceinline__ uint4 load16_if(const T* base, bool ok) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (ok) v = *reinterpret_cast<const uint4*>(base);
    return v;
}

// N = 16 / sizeof(T) values packed into one 16-byte word: pairs through the two-wide conversions.
__device__ __forceinline__ uint4 pack16(const float (&v)[4]) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const float (&v)[8]) {
    uint32_t u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
            u[i] = *reinterpret_cast<const uint32_t*>(&h);
        } else {
            const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
            u[i] = *reinterpret_cast<const uint32_t*>(&h);
        }
    }
    return make_uint4(u[0], u[1], u[2], u[3]);
}

// Stores N = 16 / sizeof(T) values as one 16-byte word at base (16-byte aligned). (An inline-asm
// st.global.v4 here costs the forward's fast kernel registers.)
template <typename T>
__device__ __forceinline__ void store16(T* base, const float (&val)[16 / sizeof(T)]) {
    uint4 w;
    if constexpr (std::is_same_v<T, float>) w = pack16(val);
    else w = pack16<T>(val);
    *reinterpret_cast<uint4*>(base) = w;
}

// The scalar accessors below serve the edges only.

// Input of channel (b, d) at source time s, before any seq_idx masking: x for 0 <= s < T, the
// initial state for 1 - W <= s < 0, zero elsewhere.
template <typename T, int W>
__device__ __forceinline__ float src_x(const DflashConvParams& p, int64_t b, int64_t d, int64_t s) {
    if (s >= 0) {
        if (s >= p.seqlen) return 0.f;
        return to_float(static_cast<const T*>(p.x)[b * p.x_sb + d * p.x_sd + s * p.x_st]);
    }
    if (p.init != nullptr && s >= 1 - W)
        return load_any(p.init, p.init_dtype, b * p.init_sb + d * p.init_sd + (s + W - 1) * p.init_st);
    return 0.f;
}

// Sequence id of time s (< T); times before 0 belong to the sequence of time 0.
__device__ __forceinline__ int seq_at(const DflashConvParams& p, int64_t b, int64_t s) {
    return p.seq_idx[b * p.seq_sb + (s > 0 ? s : 0)];
}

__device__ __forceinline__ float weight_at(const DflashConvParams& p, int64_t d, int i) {
    return load_any(p.weight, p.weight_dtype, d * p.w_sd + i * p.w_sw);
}

__device__ __forceinline__ float bias_at(const DflashConvParams& p, int64_t d) {
    return p.bias != nullptr ? load_any(p.bias, p.bias_dtype, d * p.bias_s) : 0.f;
}

// Pre-activation at time u (0 <= u < T), computed from scalar loads.
template <typename T, int W>
__device__ float pre_at(const DflashConvParams& p, int64_t b, int64_t d, int64_t u) {
    float acc = bias_at(p, d);
    const int su = p.seq_idx != nullptr ? seq_at(p, b, u) : 0;
#pragma unroll
    for (int i = 0; i < W; ++i) {
        const int64_t s = u - (W - 1 - i);
        if (p.seq_idx != nullptr && seq_at(p, b, s) != su) continue;
        acc += weight_at(p, d, i) * src_x<T, W>(p, b, d, s);
    }
    return acc;
}

// Gradient at the pre-activation of time u: dy[u] * act'(pre[u]); zero outside [0, T) and at
// padding (a negative sequence id: the output there is the constant 0).
template <typename T, int W>
__device__ float g_at(const DflashConvParams& p, int64_t b, int64_t d, int64_t u) {
    if (u < 0 || u >= p.seqlen) return 0.f;
    if (p.seq_idx != nullptr && seq_at(p, b, u) < 0) return 0.f;
    float g = to_float(static_cast<const T*>(p.dy)[b * p.dy_sb + d * p.dy_sd + u * p.dy_st]);
    if (p.silu) g *= silu_grad(pre_at<T, W>(p, b, d, u));
    return g;
}

// final_states[b, d, :] = the last W - 1 inputs (no seq_idx masking, as in the Triton kernel).
template <typename T, int W>
__device__ void write_final(const DflashConvParams& p, int64_t b, int64_t d) {
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const float v = src_x<T, W>(p, b, d, p.seqlen - (W - 1) + j);
        store_any(p.final_states, p.fin_dtype, b * p.fin_sb + d * p.fin_sd + j * p.fin_st, v);
    }
}

// dinitial_states[b, d, k]: slot k sits at time k - (W - 1); output u = k - i reads it through
// weight i (and counts only when u is in the sequence of time 0). With T < W - 1 a final-state
// slot j = k - T is a copy of initial slot k, so its gradient flows back too.
template <typename T, int W>
__device__ void write_dinit(const DflashConvParams& p, int64_t b, int64_t d) {
    const int s0 = p.seq_idx != nullptr ? seq_at(p, b, 0) : 0;
#pragma unroll
    for (int k = 0; k < W - 1; ++k) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i <= k; ++i) {
            const int64_t u = k - i;
            if (u >= p.seqlen) continue;
            if (p.seq_idx != nullptr && seq_at(p, b, u) != s0) continue;
            acc += weight_at(p, d, i) * g_at<T, W>(p, b, d, u);
        }
        const int64_t j = k - p.seqlen;
        if (p.dfinal != nullptr && j >= 0 && j < W - 1)
            acc += load_any(p.dfinal, p.dfin_dtype, b * p.dfin_sb + d * p.dfin_sd + j * p.dfin_st);
        store_any(p.dinit, p.dinit_dtype, b * p.dinit_sb + d * p.dinit_sd + k * p.dinit_st, acc);
    }
}

// Number of multiprocessors of the current device (for grid sizing).
inline int num_sms() {
    int dev = 0, n = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
}

inline bool aligned(const void* ptr, int bytes) {
    return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0;
}

}  // namespace dflash
