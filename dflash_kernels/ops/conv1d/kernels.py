"""Triton kernels of the causal depthwise conv1d: forward, backward, decode update.

Notation: x is ``[B, D, T]`` (channel-first, stride 1 along T) or a channel-last view of a
``[B, T, D]`` tensor (stride 1 along D); ``CHANNEL_LAST`` picks which, so the unit stride is known at
compile time and loads along it vectorize. Weight is ``[D, W]`` (contiguous), W <= 4. Output:

    y[t] = act(bias + sum_i weight[i] * x[t - (W - 1 - i)])

A source time before 0 reads the initial state ``init[W - 1 + src]`` (zero without one). With
``seq_idx`` a source counts only when it belongs to the same sequence as t; times before 0 belong to
the sequence of t = 0. Each program owns a ``[BD, BT]`` tile of channels x times; the W shifted reads
of x hit L1/L2, so DRAM traffic stays close to one read of x and one write of y.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(b, d, t, stride_b, stride_d, stride_t, CHANNEL_LAST: tl.constexpr):
    # The unit stride is left out so the compiler knows it is 1 and can vectorize along it.
    if CHANNEL_LAST:
        return b * stride_b + d[:, None] + t[None, :] * stride_t
    else:
        return b * stride_b + d[:, None] * stride_d + t[None, :]


@triton.jit
def _load_src(x_ptr, init_ptr, seq_ptr, b, d, d_mask, src, t_seq, T,
              stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
              W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, CHANNEL_LAST: tl.constexpr):
    """fp32 ``[BD, BT]`` tile of x at source times ``src``, zero where the source does not count."""
    in_x = (src >= 0) & (src < T)
    val = tl.load(x_ptr + _tile_offsets(b, d, src, stride_xb, stride_xd, stride_xt, CHANNEL_LAST),
                  mask=d_mask[:, None] & in_x[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        in_init = (src < 0) & (src >= 1 - W)
        slot = tl.where(in_init, src + (W - 1), 0)
        val += tl.load(init_ptr + b * stride_ib + d[:, None] * stride_id + slot[None, :] * stride_it,
                       mask=d_mask[:, None] & in_init[None, :], other=0.0).to(tl.float32)
    if HAS_SEQ:
        src_seq = tl.load(seq_ptr + b * stride_sb + tl.maximum(src, 0), mask=src < T, other=-1)
        val = tl.where((src_seq == t_seq)[None, :], val, 0.0)
    return val


@triton.jit
def _preact(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, d_mask, t, t_seq, T,
            stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
            CHANNEL_LAST: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    """The pre-activation ``bias + sum_i w[i] x[t - (W-1-i)]`` as an fp32 ``[BD, BT]`` tile."""
    acc = tl.zeros((BD, BT), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=d_mask, other=0.0).to(tl.float32)
        xv = _load_src(x_ptr, init_ptr, seq_ptr, b, d, d_mask, t - (W - 1 - i), t_seq, T,
                       stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
                       W, HAS_INIT, HAS_SEQ, CHANNEL_LAST)
        acc += w_i[:, None] * xv
    return acc


@triton.jit
def _aligned(n):
    """``n`` rebuilt as ``n // 16 * 16``: equal when the launcher checked it is a multiple of 16, and
    then the compiler can prove it. Lengths and strides stay unspecialized (one kernel per bucket);
    with ALIGNED the tile rows start 16-byte aligned and the masks are uniform over 16 elements, so
    the accesses along the unit stride vectorize (sm_90 builds: 128-bit stores and aligned loads with
    it, 16-bit scalar accesses only without)."""
    return n // 16 * 16


@triton.jit(do_not_specialize=["T", "D", "stride_xb", "stride_xd", "stride_xt", "stride_ib", "stride_id",
                               "stride_it", "stride_sb", "stride_fb", "stride_fd", "stride_ft"])
def causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, seq_ptr, init_ptr, y_ptr, final_ptr,
    T, D, stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
    stride_fb, stride_fd, stride_ft,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_FINAL: tl.constexpr, ACT: tl.constexpr, CHANNEL_LAST: tl.constexpr, ALIGNED: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr,
):
    """y has x's strides. grid = (cdiv(T, BT), cdiv(D, BD), B)."""
    tl.static_assert(W >= 2 and W <= 4)
    if ALIGNED:  # the launcher checked: lengths and strides along the tile multiples of 16 (_aligned)
        if CHANNEL_LAST:
            D, stride_xb, stride_xt = _aligned(D), _aligned(stride_xb), _aligned(stride_xt)
        else:
            T, stride_xb, stride_xd = _aligned(T), _aligned(stride_xb), _aligned(stride_xd)
    pid_t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    b = tl.program_id(2).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    d_mask = d < D
    t_seq = tl.zeros((BT,), dtype=tl.int32)
    if HAS_SEQ:
        t_seq = tl.load(seq_ptr + b * stride_sb + t, mask=t < T, other=-2).to(tl.int32)
    acc = _preact(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, d_mask, t, t_seq, T,
                  stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
                  W, HAS_BIAS, HAS_INIT, HAS_SEQ, CHANNEL_LAST, BD, BT)
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + _tile_offsets(b, d, t, stride_xb, stride_xd, stride_xt, CHANNEL_LAST),
             acc.to(y_ptr.dtype.element_ty), mask=d_mask[:, None] & (t < T)[None, :])
    if HAS_FINAL:
        # The last W-1 inputs (initial state where T < W-1) become the state for the next call.
        if pid_t == tl.cdiv(T, BT) - 1:
            for j in tl.static_range(W - 1):
                src = T - (W - 1) + j
                src_v = tl.full((1,), src, tl.int32)
                val = _load_src(x_ptr, init_ptr, seq_ptr, b, d, d_mask, src_v, src_v * 0, T,
                                stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
                                W, HAS_INIT, False, CHANNEL_LAST)
                tl.store(final_ptr + b * stride_fb + d[:, None] * stride_fd + j * stride_ft,
                         val.to(final_ptr.dtype.element_ty), mask=d_mask[:, None])


@triton.jit(do_not_specialize=["T", "D", "NT", "CHUNK", "stride_xb", "stride_xd", "stride_xt", "stride_ib",
                               "stride_id", "stride_it", "stride_sb", "stride_fb", "stride_fd", "stride_ft",
                               "stride_yb", "stride_yd", "stride_yt"])
def causal_conv1d_bwd_kernel(
    x_ptr, w_ptr, bias_ptr, seq_ptr, init_ptr, dy_ptr, dfinal_ptr, dx_ptr, dw_ptr, db_ptr, dinit_ptr,
    T, D, NT, CHUNK, stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
    stride_fb, stride_fd, stride_ft, stride_yb, stride_yd, stride_yt,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DFINAL: tl.constexpr, ACT: tl.constexpr, CHANNEL_LAST: tl.constexpr, ALIGNED: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr,
):
    """dx (x's strides), partial dweight ``[B*NT, D, W]`` and dbias ``[B*NT, D]`` in fp32, one row per
    chunk of CHUNK times (a multiple of BT; summed on the host: deterministic, no atomics), and dinit
    ``[B, D, W-1]`` from the first chunk. grid = (NT, cdiv(D, BD), B).

    x[t] feeds outputs u = t + s (s = 0..W-1) through weight W-1-s, so
    dx[t] = sum_s w[W-1-s] * g[t+s] with g = dy * act'(pre); pre is recomputed, never stored.
    """
    tl.static_assert(W >= 2 and W <= 4)
    if ALIGNED:  # the launcher checked: lengths and strides along the tile multiples of 16 (_aligned)
        if CHANNEL_LAST:
            D, stride_xb, stride_xt = _aligned(D), _aligned(stride_xb), _aligned(stride_xt)
            stride_yb, stride_yt = _aligned(stride_yb), _aligned(stride_yt)
        else:
            T, stride_xb, stride_xd = _aligned(T), _aligned(stride_xb), _aligned(stride_xd)
            stride_yb, stride_yd = _aligned(stride_yb), _aligned(stride_yd)
    pid_c = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    b = tl.program_id(2).to(tl.int64)
    d_mask = d < D
    w_cols = tl.arange(0, 4)
    dw_acc = tl.zeros((BD, 4), dtype=tl.float32)
    db_acc = tl.zeros((BD,), dtype=tl.float32)
    # A fixed trip count (the last chunk's tiles past T are fully masked) keeps the loop bounds
    # plain ints, which the interpreter needs too.
    for offset in tl.range(0, CHUNK, BT):
        t0 = tl.multiple_of(pid_c * CHUNK + offset, 16)  # CHUNK and BT are multiples of 16 (launcher)
        t = t0 + tl.arange(0, BT)
        t_seq = tl.zeros((BT,), dtype=tl.int32)
        if HAS_SEQ:
            t_seq = tl.load(seq_ptr + b * stride_sb + t, mask=t < T, other=-2).to(tl.int32)
        dx = tl.zeros((BD, BT), dtype=tl.float32)
        for s in tl.static_range(W):
            u = t + s
            u_seq = t_seq
            if HAS_SEQ:
                u_seq = tl.load(seq_ptr + b * stride_sb + u, mask=u < T, other=-2).to(tl.int32)
            g = tl.load(dy_ptr + _tile_offsets(b, d, u, stride_yb, stride_yd, stride_yt, CHANNEL_LAST),
                        mask=d_mask[:, None] & (u < T)[None, :], other=0.0).to(tl.float32)
            if ACT:
                pre = _preact(x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, b, d, d_mask, u, u_seq, T,
                              stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
                              W, HAS_BIAS, HAS_INIT, HAS_SEQ, CHANNEL_LAST, BD, BT)
                sig = tl.sigmoid(pre)
                g = g * sig * (1.0 + pre * (1.0 - sig))
            w_s = tl.load(w_ptr + d * W + (W - 1 - s), mask=d_mask, other=0.0).to(tl.float32)
            contrib = w_s[:, None] * g
            if HAS_SEQ:
                contrib = tl.where((u_seq == t_seq)[None, :], contrib, 0.0)
            dx += contrib
            if s == 0:
                # g holds the output gradient at this tile's own times: reduce it for dweight/dbias.
                for i in tl.static_range(W):
                    xv = _load_src(x_ptr, init_ptr, seq_ptr, b, d, d_mask, t - (W - 1 - i), t_seq, T,
                                   stride_xb, stride_xd, stride_xt, stride_ib, stride_id, stride_it, stride_sb,
                                   W, HAS_INIT, HAS_SEQ, CHANNEL_LAST)
                    dw_acc += tl.where((w_cols == i)[None, :], tl.sum(g * xv, axis=1)[:, None], 0.0)
                db_acc += tl.sum(g, axis=1)
                if HAS_INIT:
                    if t0 == 0:
                        _store_dinit(w_ptr, seq_ptr, dfinal_ptr, dinit_ptr, b, d, d_mask, t, t_seq, g, T, D,
                                     stride_sb, stride_fb, stride_fd, stride_ft, W, HAS_SEQ, HAS_DFINAL, BD)
        if HAS_DFINAL:
            for j in tl.static_range(W - 1):
                df = tl.load(dfinal_ptr + b * stride_fb + d * stride_fd + j * stride_ft,
                             mask=d_mask, other=0.0).to(tl.float32)
                dx += tl.where((t == T - (W - 1) + j)[None, :], df[:, None], 0.0)
        tl.store(dx_ptr + _tile_offsets(b, d, t, stride_xb, stride_xd, stride_xt, CHANNEL_LAST),
                 dx.to(dx_ptr.dtype.element_ty), mask=d_mask[:, None] & (t < T)[None, :])
    row = b * NT + pid_c
    tl.store(dw_ptr + (row * D + d[:, None]) * W + w_cols[None, :], dw_acc,
             mask=d_mask[:, None] & (w_cols < W)[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + row * D + d, db_acc, mask=d_mask)


@triton.jit
def _store_dinit(w_ptr, seq_ptr, dfinal_ptr, dinit_ptr, b, d, d_mask, t, t_seq, g, T, D,
                 stride_sb, stride_fb, stride_fd, stride_ft,
                 W: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFINAL: tl.constexpr, BD: tl.constexpr):
    """Gradient of the initial state, from the first tile's output gradient ``g`` (times 0..BT-1).

    Slot k sits at time k - (W-1); output u = k - i reads it through weight i, and counts only when
    u is in the sequence of time 0. With T < W-1 a final-state slot copies an initial-state slot.
    """
    seq0 = t_seq * 0
    if HAS_SEQ:
        seq0 = seq0 + tl.load(seq_ptr + b * stride_sb).to(tl.int32)
    for k in tl.static_range(W - 1):
        acc = tl.zeros((BD,), dtype=tl.float32)
        for i in tl.static_range(k + 1):
            w_i = tl.load(w_ptr + d * W + i, mask=d_mask, other=0.0).to(tl.float32)
            sel = (t == k - i) & (t_seq == seq0)
            acc += w_i * tl.sum(tl.where(sel[None, :], g, 0.0), axis=1)
        if HAS_DFINAL:
            j = k - T
            jv = tl.full((BD,), 0, tl.int32) + j
            acc += tl.load(dfinal_ptr + b * stride_fb + d * stride_fd + jv * stride_ft,
                           mask=d_mask & (jv >= 0) & (jv < W - 1), other=0.0).to(tl.float32)
        tl.store(dinit_ptr + (b * D + d) * (W - 1) + k, acc.to(dinit_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["L", "D", "S", "stride_xb", "stride_xd", "stride_xl",
                               "stride_sb", "stride_sd", "stride_ss", "stride_yb", "stride_yd", "stride_yl"])
def causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, y_ptr,
    L, D, S, stride_xb, stride_xd, stride_xl, stride_sb, stride_sd, stride_ss,
    stride_yb, stride_yd, stride_yl,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BD: tl.constexpr,
):
    """Decode: L new steps per sequence against a rolling state ``[B, D, S]`` (S >= W-1), updated in place.

    grid = (cdiv(D, BD), B). Each program owns its channels, so the in-place shift has no race.
    """
    tl.static_assert(W >= 2 and W <= 4)
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    b = tl.program_id(1).to(tl.int64)
    d_mask = d < D
    state = state_ptr + b * stride_sb + d * stride_sd
    # prev1 = x[t-1], prev2 = x[t-2], prev3 = x[t-3]; unused ones stay zero with zero weight.
    prev1 = tl.load(state + (S - 1) * stride_ss, mask=d_mask, other=0.0).to(tl.float32)
    prev2 = tl.zeros((BD,), dtype=tl.float32)
    prev3 = tl.zeros((BD,), dtype=tl.float32)
    w_cur = tl.load(w_ptr + d * W + (W - 1), mask=d_mask, other=0.0).to(tl.float32)
    w_1 = tl.load(w_ptr + d * W + (W - 2), mask=d_mask, other=0.0).to(tl.float32)
    w_2 = tl.zeros((BD,), dtype=tl.float32)
    w_3 = tl.zeros((BD,), dtype=tl.float32)
    if W >= 3:
        prev2 = tl.load(state + (S - 2) * stride_ss, mask=d_mask, other=0.0).to(tl.float32)
        w_2 = tl.load(w_ptr + d * W + (W - 3), mask=d_mask, other=0.0).to(tl.float32)
    if W >= 4:
        prev3 = tl.load(state + (S - 3) * stride_ss, mask=d_mask, other=0.0).to(tl.float32)
        w_3 = tl.load(w_ptr + d * W + (W - 4), mask=d_mask, other=0.0).to(tl.float32)
    bias = tl.zeros((BD,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    for l in tl.range(0, L):
        x_l = tl.load(x_ptr + b * stride_xb + d * stride_xd + l * stride_xl, mask=d_mask, other=0.0).to(tl.float32)
        acc = bias + w_cur * x_l + w_1 * prev1 + w_2 * prev2 + w_3 * prev3
        if ACT:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + b * stride_yb + d * stride_yd + l * stride_yl, acc.to(y_ptr.dtype.element_ty), mask=d_mask)
        prev3 = prev2
        prev2 = prev1
        prev1 = x_l
    # Shift the state left by L and append the new inputs; ascending j reads j+L before writing it.
    for j in tl.range(0, S):
        src = j + L
        from_state = tl.load(state + src * stride_ss, mask=d_mask & (src < S), other=0.0)
        from_x = tl.load(x_ptr + b * stride_xb + d * stride_xd + (src - S) * stride_xl,
                         mask=d_mask & (src >= S), other=0.0)
        val = tl.where(src < S, from_state.to(tl.float32), from_x.to(tl.float32))
        tl.store(state + j * stride_ss, val.to(state_ptr.dtype.element_ty), mask=d_mask)
