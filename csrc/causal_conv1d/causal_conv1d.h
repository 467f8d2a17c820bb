/* Causal depthwise conv1d: the C launch API of the CUDA kernels.
 *
 * Plain C types only (raw pointers, element strides, sizes, a cudaStream_t), so the kernels build
 * with nvcc alone and the torch binding (csrc/binding.cpp) stays a thin layer over this header.
 *
 * Semantics (the same as the Triton kernels in dflash_kernels/ops/conv1d/kernels.py), x is
 * [B, D, T] addressed through strides (channel-first: stride 1 along T; channel-last: stride 1
 * along D), weight [D, W] with W in 2..4:
 *
 *     y[t] = act(bias + sum_i weight[i] * x[t - (W - 1 - i)])
 *
 * A source time before 0 reads initial_states[W - 1 + src] (zero without them). With seq_idx a
 * source counts only when it is in the sequence of t; times before 0 are in the sequence of t = 0.
 * final_states[j] is the input at time T - (W - 1) + j (the initial state where that is negative).
 */
#ifndef DFLASH_CAUSAL_CONV1D_H_
#define DFLASH_CAUSAL_CONV1D_H_

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. x, y, dy and dx share one type; the small tensors (weight, bias, states) may each
 * have their own, read and written through a run-time switch. */
enum { DFLASH_F32 = 0, DFLASH_F16 = 1, DFLASH_BF16 = 2 };

typedef struct {
    /* Sizes. */
    int64_t batch, dim, seqlen;
    int width;          /* W, 2..4 */
    int x_dtype;        /* of x, y, dy, dx */
    int channel_last;   /* 1: x has stride 1 along D; 0: stride 1 along T */
    int silu;           /* activation: 0 none, 1 SiLU */

    /* Forward inputs. Optional pointers are NULL when absent. */
    const void* x;       int64_t x_sb, x_sd, x_st;
    const void* weight;  int64_t w_sd, w_sw;  int weight_dtype;
    const void* bias;    int64_t bias_s;      int bias_dtype;
    const int32_t* seq_idx; int64_t seq_sb;   /* [B, T] int32, stride 1 along T */
    const void* init;    int64_t init_sb, init_sd, init_st;  int init_dtype;   /* [B, D, W-1] */

    /* Forward outputs. */
    void* y;             int64_t y_sb, y_sd, y_st;
    void* final_states;  int64_t fin_sb, fin_sd, fin_st;  int fin_dtype;       /* [B, D, W-1] */

    /* Backward inputs and outputs. */
    const void* dy;      int64_t dy_sb, dy_sd, dy_st;
    const void* dfinal;  int64_t dfin_sb, dfin_sd, dfin_st;  int dfin_dtype;   /* [B, D, W-1] */
    void* dx;            int64_t dx_sb, dx_sd, dx_st;
    float* dweight_part; /* [P, D, W] fp32 partial sums, P = dflash_causal_conv1d_bwd_partials() */
    float* dbias_part;   /* [P, D] fp32, or NULL */
    void* dinit;         int64_t dinit_sb, dinit_sd, dinit_st;  int dinit_dtype; /* [B, D, W-1] */
} DflashConvParams;

typedef struct {
    int64_t batch, dim, len, state_len;  /* x [B, D, L]; conv_state [B, D, S], S >= W - 1 */
    int width;
    int silu;
    const void* x;       int64_t x_sb, x_sd, x_sl;  int x_dtype;
    void* state;         int64_t s_sb, s_sd, s_ss;  int state_dtype;
    const void* weight;  int64_t w_sd, w_sw;  int weight_dtype;
    const void* bias;    int64_t bias_s;      int bias_dtype;
    void* y;             int64_t y_sb, y_sd, y_sl;  int y_dtype;
} DflashConvUpdateParams;

/* Each returns cudaSuccess or the launch error; unsupported arguments give cudaErrorInvalidValue. */
cudaError_t dflash_causal_conv1d_fwd(const DflashConvParams* p, cudaStream_t stream);
cudaError_t dflash_causal_conv1d_bwd(const DflashConvParams* p, cudaStream_t stream);
cudaError_t dflash_causal_conv1d_update(const DflashConvUpdateParams* p, cudaStream_t stream);

/* Rows P of the backward's partial dweight/dbias buffers for these sizes on the current device.
 * Each row is written exactly once (no atomics); the caller sums over P. */
int64_t dflash_causal_conv1d_bwd_partials(const DflashConvParams* p);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_CAUSAL_CONV1D_H_ */
