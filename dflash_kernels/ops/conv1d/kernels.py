"""Triton kernels of the causal depthwise conv1d (forward, backward, decode update) and their tuning candidates.

Notation: x is ``[B, D, T]`` (channel-first, stride 1 along T) or a channel-last view of a
``[B, T, D]`` tensor (stride 1 along D); ``CHANNEL_LAST`` picks which, so the unit stride is known at
compile time and loads along it vectorize. Weight is ``[D, W]`` (contiguous), W <= 4. Output:

    y[t] = act(bias + sum_i weight[i] * x[t - (W - 1 - i)])

A source time before 0 reads the initial state ``init[W - 1 + src]`` (zero without one). With
``seq_idx`` a source counts only when it belongs to the same sequence as t; times before 0 belong to
the sequence of t = 0; a negative id marks padding: y = 0 there, and no gradient flows through it. Each program owns a ``[BD, BT]`` tile of channels x times. Forward and backward
work on "positions" (the backward's section below): a tile's times are loaded with aligned, vectorized
loads and shifted in registers, never read again at an unaligned offset, so DRAM traffic stays close
to one read of each input and one write of each output, and each time's activation is computed once.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel


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
def _aligned(n):
    """``n`` rebuilt as ``n // 16 * 16``: equal when the launcher checked it is a multiple of 16, and
    then the compiler can prove it. Lengths and strides stay unspecialized (one kernel per bucket);
    with ALIGNED the tile rows start 16-byte aligned and the masks are uniform over 16 elements, so
    the accesses along the unit stride vectorize (sm_90 builds: 128-bit stores and aligned loads with
    it, 16-bit scalar accesses only without)."""
    return n // 16 * 16


@triton.jit(do_not_specialize=["T", "D", "stride_xb", "stride_xd", "stride_xt", "stride_ib", "stride_id",
                               "stride_it", "stride_sb", "stride_fb", "stride_fd", "stride_ft"])
def _conv1d_fwd_kernel(
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
    # On positions (see the backward's notes below): x is loaded as this tile and the one a block
    # earlier (vectorized; the halo), split into the positions -(W-1) .. V-1 in registers, and every
    # output is a sum of whole position tensors: no shifted, unaligned loads.
    V: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    M: tl.constexpr = BT // V
    tl.static_assert(BT % 16 == 0)
    pid_t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    b = tl.program_id(2).to(tl.int64)
    d_mask = d < D
    t0 = tl.multiple_of(pid_t * BT, 16)
    wl = ()  # wl[j] = weight[W-1-j] multiplies x at lag j
    for j in tl.static_range(W):
        wl = wl + (tl.load(w_ptr + d * W + (W - 1 - j), mask=d_mask, other=0.0).to(tl.float32)[:, None],)
    bias = tl.zeros((BD, 1), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    xs = _positions(x_ptr, b, d, d_mask, t0, T, stride_xb, stride_xd, stride_xt, -(W - 1), V,
                    False, CHANNEL_LAST, BD, BT, V)
    if HAS_INIT:  # x before time 0 (positions -(W-1) .. -1 of the first block) is the initial state
        init = ()
        for i in tl.static_range(W - 1):
            init = init + (tl.load(init_ptr + b * stride_ib + d * stride_id + i * stride_it, mask=d_mask,
                                   other=0.0).to(tl.float32)[:, None],)
        xs = _select((t0 + tl.arange(0, M) * V == 0)[None, :], init, xs, W - 1)
    qs = ()
    if HAS_SEQ:  # qs[i]: sequence ids at position i - (W-1), like xs
        qs = _positions(seq_ptr, b, d, d_mask, t0, T, stride_sb, 0, 1, -(W - 1), V, True, False, 1, BT, V)
    ys = ()
    for p in tl.static_range(V):
        acc = bias + wl[0] * xs[p + W - 1]
        for j in tl.static_range(1, W):
            acc += wl[j] * _source(xs, qs, p, j, W, HAS_SEQ)
        if ACT:
            acc = _silu(acc)
        if HAS_SEQ:  # a negative sequence id marks padding: its output is 0
            acc = tl.where(qs[p + W - 1] >= 0, acc, 0.0)
        ys = ys + (acc,)
    _store_positions(y_ptr, ys, b, d, d_mask, t0, T, stride_xb, stride_xd, stride_xt, CHANNEL_LAST, BD, BT, V)
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


# The backward works on "positions": the times t0 + [0, BT) of a tile are cut into M = BT / V blocks of
# V consecutive times (V = 16 bytes of x's dtype), and position p stands for the times t0 + m*V + p of
# all blocks m at once: an [R, M] tensor (R = BD channels, or 1 for sequence ids). Neighbouring times
# are then different tensors, not shifted loads: positions -(W-1) .. V+W-2 hold all the inputs and
# output gradients that the block's own times 0 .. V-1 need, so each time is loaded once (plus the
# W-1 halo positions on each side) and pre / g are computed once per time (the W-1 halo positions
# past the block twice), where a tile of shifted loads would load x 2W-1 times and recompute every
# g W times. Channel-first, the V times of a block are one vectorized load per thread, split into
# positions in registers (``_split_blocks``); channel-last, each position is a load of its own,
# vectorized along the channels.


@triton.jit
def _split_blocks(v, R: tl.constexpr, M: tl.constexpr, V: tl.constexpr):
    """The V positions of an ``[R, M*V]`` tile: time m*V + j goes to element j of the tuple (``[R, M]``
    each). With a block's V times in one thread (the layout of vectorized unit-stride loads), no data
    moves."""
    if V == 8:
        e, o = tl.split(tl.reshape(v, [R, M, 2, 2, 2]))  # time m*8 + 4a + 2b + c: split off c, then b, a
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        c0, c4 = tl.split(e0)
        c2, c6 = tl.split(e1)
        c1, c5 = tl.split(o0)
        c3, c7 = tl.split(o1)
        parts = (c0, c1, c2, c3, c4, c5, c6, c7)
    else:
        tl.static_assert(V == 4)
        e, o = tl.split(tl.reshape(v, [R, M, 2, 2]))  # time m*4 + 2b + c
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        parts = (c0, c1, c2, c3)
    return parts


@triton.jit
def _join_blocks(c, R: tl.constexpr, BT: tl.constexpr, V: tl.constexpr):
    """Inverse of ``_split_blocks``: the ``[R, BT]`` tile of the V positions in the tuple ``c``."""
    if V == 8:
        v = tl.join(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])),
                    tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])))
    else:
        v = tl.join(tl.join(c[0], c[2]), tl.join(c[1], c[3]))
    return tl.reshape(v, [R, BT])


@triton.jit
def _times(ptr, b, d, d_mask, src, T, stride_b, stride_d, stride_t, SEQ: tl.constexpr, CHANNEL_LAST: tl.constexpr):
    """The tile at times ``src`` (1D). x or dy (SEQ False): fp32 ``[BD, N]``, zero outside ``[0, T)``.
    Sequence ids (SEQ): int32 ``[1, N]``; times before 0 belong to the sequence of time 0, times from
    T on to none (-1)."""
    if SEQ:
        val = tl.load(ptr + b * stride_b + tl.maximum(src, 0)[None, :], mask=(src < T)[None, :],
                      other=-1).to(tl.int32)
    else:
        val = tl.load(ptr + _tile_offsets(b, d, src, stride_b, stride_d, stride_t, CHANNEL_LAST),
                      mask=d_mask[:, None] & ((src >= 0) & (src < T))[None, :], other=0.0).to(tl.float32)
    return val


@triton.jit
def _positions(ptr, b, d, d_mask, t0, T, stride_b, stride_d, stride_t, P0: tl.constexpr, P1: tl.constexpr,
               SEQ: tl.constexpr, CHANNEL_LAST: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, V: tl.constexpr):
    """Tuple of positions ``P0 .. P1-1`` (see above) of x, dy or the sequence ids (``_times``)."""
    M: tl.constexpr = BT // V
    out = ()
    if CHANNEL_LAST:
        # Times are along a non-unit stride: one load per position, vectorized along the channels.
        blocks = t0 + tl.arange(0, M) * V
        for p in tl.static_range(P0, P1):
            out = out + (_times(ptr, b, d, d_mask, blocks + p, T, stride_b, stride_d, stride_t, SEQ, CHANNEL_LAST),)
    else:
        # Times are along the unit stride: load whole tiles (vectorized), this one and the ones
        # shifted by whole blocks for the halo (those hit the cache), and split them into positions.
        for k in tl.static_range(P0 // V, (P1 + V - 1) // V):
            tile = _times(ptr, b, d, d_mask, t0 + k * V + tl.arange(0, BT), T, stride_b, stride_d, stride_t,
                          SEQ, CHANNEL_LAST)
            parts = _split_blocks(tile, R, M, V)
            for j in tl.static_range(V):
                if k * V + j >= P0:
                    if k * V + j < P1:
                        out = out + (parts[j],)
    return out


@triton.jit
def _store_positions(ptr, vals, b, d, d_mask, t0, T, stride_b, stride_d, stride_t, CHANNEL_LAST: tl.constexpr,
                     BD: tl.constexpr, BT: tl.constexpr, V: tl.constexpr):
    """Store the V positions ``vals`` of the tile at ``t0`` (inverse of ``_positions``), times < T only."""
    if CHANNEL_LAST:  # a store per position, vectorized along the channels
        blocks = t0 + tl.arange(0, BT // V) * V
        for p in tl.static_range(V):
            t = blocks + p
            tl.store(ptr + _tile_offsets(b, d, t, stride_b, stride_d, stride_t, CHANNEL_LAST),
                     vals[p].to(ptr.dtype.element_ty), mask=d_mask[:, None] & (t < T)[None, :])
    else:  # one tile store, vectorized along time
        t = t0 + tl.arange(0, BT)
        tl.store(ptr + _tile_offsets(b, d, t, stride_b, stride_d, stride_t, CHANNEL_LAST),
                 _join_blocks(vals, BD, BT, V).to(ptr.dtype.element_ty), mask=d_mask[:, None] & (t < T)[None, :])


@triton.jit
def _source(xs, qs, p: tl.constexpr, j: tl.constexpr, W: tl.constexpr, HAS_SEQ: tl.constexpr):
    """x at position p - j (``xs`` starts at position -(W-1)), zero unless in the sequence of position p."""
    v = xs[p - j + W - 1]
    if HAS_SEQ:
        if j > 0:
            v = tl.where(qs[p - j + W - 1] == qs[p + W - 1], v, 0.0)
    return v


@triton.jit
def _silu(pre):
    """``pre * sigmoid(pre)`` with the sigmoid of ``_silu_grad`` (exp2 and one rsqrt)."""
    e1 = 1.0 + tl.exp2(pre * -1.4426950408889634)
    return pre * tl.math.rsqrt(e1 * e1)


@triton.jit
def _silu_grad(pre, dy):
    """``dy * silu'(pre)``, silu' = sig * (1 + pre * (1 - sig)), with sig = rsqrt((1 + e)^2) and
    e = 2^(-pre * log2(e)): one special-function op each (tl.sigmoid's exp and division add range
    fix-ups). Where (1 + e)^2 overflows, sig < 1e-19 comes out 0."""
    e1 = 1.0 + tl.exp2(pre * -1.4426950408889634)
    sig = tl.math.rsqrt(e1 * e1)
    return dy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _select(cond, a, b, N: tl.constexpr):
    """The tuple ``b`` with its first N elements replaced by those of ``a`` where ``cond``."""
    out = ()
    for i in tl.static_range(len(b)):
        if i < N:
            out = out + (tl.where(cond, a[i], b[i]),)
        else:
            out = out + (b[i],)
    return out


@triton.jit
def _add_dfinal(dfinal_ptr, dxs, b, d, d_mask, blocks, T, stride_fb, stride_fd, stride_ft, W: tl.constexpr):
    """dx positions ``dxs`` (blocks starting at times ``blocks``) plus the final-state gradient, which
    the last W-1 times feed directly."""
    for j in tl.static_range(W - 1):
        df = tl.load(dfinal_ptr + b * stride_fb + d * stride_fd + j * stride_ft, mask=d_mask,
                     other=0.0).to(tl.float32)[:, None]
        out = ()
        for p in tl.static_range(len(dxs)):
            out = out + (tl.where((blocks + p == T - (W - 1) + j)[None, :], dxs[p] + df, dxs[p]),)
        dxs = out
    return dxs


@triton.jit
def _store_dinit(wl, dfinal_ptr, dinit_ptr, b, d, d_mask, gs, qs, T, D, stride_fb, stride_fd, stride_ft,
                 W: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFINAL: tl.constexpr, BD: tl.constexpr,
                 M: tl.constexpr):
    """Gradient of the initial state from the chunk's first tile: ``gs`` holds g at its positions
    0 .. W-2, ``qs`` the sequence ids at positions -(W-1) .. W-2 (block 0 starts at time 0).

    Slot k sits at time k - (W-1); output u = k - i (position u of block 0) reads it through weight i,
    and counts only when u is in the sequence of time 0 (``qs[0]``: time -(W-1) belongs to it). With
    T < W-1 a final-state slot copies an initial-state slot.
    """
    first = (tl.arange(0, M) == 0)[None, :]
    for k in tl.static_range(W - 1):
        acc = tl.zeros((BD,), dtype=tl.float32)
        for i in tl.static_range(k + 1):
            sel = first
            if HAS_SEQ:
                sel = sel & (qs[k - i + W - 1] == qs[0])
            acc += tl.sum(tl.where(sel, wl[W - 1 - i] * gs[k - i], 0.0), axis=1)
        if HAS_DFINAL:
            j = k - T
            jv = tl.full((BD,), 0, tl.int32) + j
            acc += tl.load(dfinal_ptr + b * stride_fb + d * stride_fd + jv * stride_ft,
                           mask=d_mask & (jv >= 0) & (jv < W - 1), other=0.0).to(tl.float32)
        tl.store(dinit_ptr + (b * D + d) * (W - 1) + k, acc.to(dinit_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["T", "D", "NT", "CHUNK", "stride_xb", "stride_xd", "stride_xt", "stride_ib",
                               "stride_id", "stride_it", "stride_sb", "stride_fb", "stride_fd", "stride_ft",
                               "stride_yb", "stride_yd", "stride_yt"])
def _conv1d_bwd_kernel(
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
    Per tile, on positions (above): pre and g at positions 0 .. V+W-2 from x at -(W-1) .. V+W-2, each
    source masked against the sequence of its output; dx at positions 0 .. V-1 from the g's.
    """
    tl.static_assert(W >= 2 and W <= 4)
    tl.static_assert(BT % 16 == 0)  # so a whole number of blocks (the launcher keeps it so)
    if ALIGNED:  # the launcher checked: lengths and strides along the tile multiples of 16 (_aligned)
        if CHANNEL_LAST:
            D, stride_xb, stride_xt = _aligned(D), _aligned(stride_xb), _aligned(stride_xt)
            stride_yb, stride_yt = _aligned(stride_yb), _aligned(stride_yt)
        else:
            T, stride_xb, stride_xd = _aligned(T), _aligned(stride_xb), _aligned(stride_xd)
            stride_yb, stride_yd = _aligned(stride_yb), _aligned(stride_yd)
    V: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth  # times per block (see above)
    M: tl.constexpr = BT // V
    pid_c = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    b = tl.program_id(2).to(tl.int64)
    d_mask = d < D
    # wl[j] = weight[W-1-j] multiplies x at lag j (position p - j) in the output at position p.
    wl = ()
    dw = ()  # dw[j]: the time-sums of g * x at lag j, reduced over blocks at the end
    for j in tl.static_range(W):
        wl = wl + (tl.load(w_ptr + d * W + (W - 1 - j), mask=d_mask, other=0.0).to(tl.float32)[:, None],)
        dw = dw + (tl.zeros((BD, M), dtype=tl.float32),)
    bias = tl.zeros((BD, 1), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    db = tl.zeros((BD, M), dtype=tl.float32)
    init = ()  # init[i]: the initial state at time i - (W-1)
    g_head = ()  # g at positions 0 .. W-2 of the chunk's first tile
    q_head = ()  # sequence ids at positions -(W-1) .. W-2 of the chunk's first tile
    if HAS_INIT:
        for i in tl.static_range(W - 1):
            init = init + (tl.load(init_ptr + b * stride_ib + d * stride_id + i * stride_it, mask=d_mask,
                                   other=0.0).to(tl.float32)[:, None],)
            g_head = g_head + (tl.zeros((BD, M), dtype=tl.float32),)
        if HAS_SEQ:
            for i in tl.static_range(2 * W - 2):
                q_head = q_head + (tl.zeros((1, M), dtype=tl.int32),)
    # A fixed trip count (the last chunk's tiles past T are fully masked) keeps the loop bounds
    # plain ints, which the interpreter needs too.
    for offset in tl.range(0, CHUNK, BT):
        t0 = tl.multiple_of(pid_c * CHUNK + offset, 16)  # CHUNK and BT are multiples of 16 (launcher)
        xs = _positions(x_ptr, b, d, d_mask, t0, T, stride_xb, stride_xd, stride_xt, -(W - 1), V + W - 1,
                        False, CHANNEL_LAST, BD, BT, V)
        if HAS_INIT:  # x before time 0 (positions -(W-1) .. -1 of the first block) is the initial state
            at_zero = (t0 + tl.arange(0, M) * V == 0)[None, :]
            xs = _select(at_zero, init, xs, W - 1)
        dys = _positions(dy_ptr, b, d, d_mask, t0, T, stride_yb, stride_yd, stride_yt, 0, V + W - 1,
                         False, CHANNEL_LAST, BD, BT, V)
        qs = ()
        if HAS_SEQ:  # qs[i]: sequence ids at position i - (W-1), like xs
            qs = _positions(seq_ptr, b, d, d_mask, t0, T, stride_sb, 0, 1, -(W - 1), V + W - 1,
                            True, False, 1, BT, V)
            # x at a padding time feeds no output: zeroed, so that a non-finite one cannot reach
            # dweight through the padding output's zero gradient (0 * NaN).
            xz = ()
            for i in tl.static_range(V + 2 * W - 2):  # positions -(W-1) .. V+W-2, as xs
                xz = xz + (tl.where(qs[i] >= 0, xs[i], 0.0),)
            xs = xz
        # g at positions 0 .. V+W-2; those of 0 .. V-1 (this tile's times) also feed dweight and dbias.
        gs = ()
        for p in tl.static_range(V + W - 1):
            g = dys[p]
            if ACT:
                pre = bias + wl[0] * xs[p + W - 1]
                for j in tl.static_range(1, W):
                    pre += wl[j] * _source(xs, qs, p, j, W, HAS_SEQ)
                g = _silu_grad(pre, g)
            if HAS_SEQ:  # padding outputs are constant 0: no gradient flows back from them
                g = tl.where(qs[p + W - 1] >= 0, g, 0.0)
            gs = gs + (g,)
            if p < V:
                new_dw = ()
                for j in tl.static_range(W):
                    new_dw = new_dw + (dw[j] + g * _source(xs, qs, p, j, W, HAS_SEQ),)
                dw = new_dw
                if HAS_BIAS:
                    db += g
        # dx at position p: x there reaches the outputs at p + s through weight W-1-s (lag s),
        # within its own sequence only.
        dxs = ()
        for p in tl.static_range(V):
            acc = wl[0] * gs[p]
            for s in tl.static_range(1, W):
                contrib = wl[s] * gs[p + s]
                if HAS_SEQ:
                    contrib = tl.where(qs[p + s + W - 1] == qs[p + W - 1], contrib, 0.0)
                acc += contrib
            dxs = dxs + (acc,)
        if HAS_INIT:  # keep what dinit needs from the chunk's first tile
            is_first = t0 == 0
            g_head = _select(is_first, gs, g_head, W - 1)
            if HAS_SEQ:
                q_head = _select(is_first, qs, q_head, 2 * W - 2)
        blocks = t0 + tl.arange(0, M) * V
        if HAS_DFINAL:
            if t0 + BT + (W - 1) > T:  # the tile may hold some of the last W-1 times
                dxs = _add_dfinal(dfinal_ptr, dxs, b, d, d_mask, blocks, T, stride_fb, stride_fd, stride_ft, W)
        _store_positions(dx_ptr, dxs, b, d, d_mask, t0, T, stride_xb, stride_xd, stride_xt, CHANNEL_LAST,
                         BD, BT, V)
    if HAS_INIT:
        if pid_c == 0:
            _store_dinit(wl, dfinal_ptr, dinit_ptr, b, d, d_mask, g_head, q_head, T, D, stride_fb, stride_fd,
                         stride_ft, W, HAS_SEQ, HAS_DFINAL, BD, M)
    row = b * NT + pid_c
    for j in tl.static_range(W):
        tl.store(dw_ptr + (row * D + d) * W + (W - 1 - j), tl.sum(dw[j], axis=1), mask=d_mask)
    if HAS_BIAS:
        tl.store(db_ptr + row * D + d, tl.sum(db, axis=1), mask=d_mask)


@triton.jit(do_not_specialize=["L", "D", "S", "N_STATE", "stride_xb", "stride_xd", "stride_xl",
                               "stride_sb", "stride_sd", "stride_ss", "stride_yb", "stride_yd", "stride_yl"])
def _conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, y_ptr, seqlens_ptr, index_ptr,
    L, D, S, N_STATE, stride_xb, stride_xd, stride_xl, stride_sb, stride_sd, stride_ss,
    stride_yb, stride_yd, stride_yl,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CIRCULAR: tl.constexpr,
    HAS_INDEX: tl.constexpr, BD: tl.constexpr,
):
    """Decode: L new steps per sequence against a state ``[N_STATE, D, S]`` (S >= W-1), updated in place.

    Row b uses state row ``index[b]`` (HAS_INDEX; a negative or out-of-range index is padding: y = 0,
    the state is neither read nor written), else row b. Without CIRCULAR the state holds the last S
    inputs and is shifted left by L; with CIRCULAR it is a ring not shifted: the new inputs go to
    ``(seqlens[b] + l) % S``, the W-1 before them are read at ``(seqlens[b] - j) % S``, j = 1..W-1.
    grid = (cdiv(D, BD), B). Each program owns its channels of one state row, so the in-place
    update has no race (given distinct indices).
    """
    tl.static_assert(W >= 2 and W <= 4)
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    b = tl.program_id(1).to(tl.int64)
    d_mask = d < D
    if HAS_INDEX:
        row = tl.load(index_ptr + b).to(tl.int64)
        live = (row >= 0) & (row < N_STATE)
        row = tl.where(live, row, 0)
        s_mask = d_mask & live
    else:
        row = b
        s_mask = d_mask
    state = state_ptr + row * stride_sb + d * stride_sd
    if CIRCULAR:
        head = tl.load(seqlens_ptr + b).to(tl.int64) % S
        head = tl.where(head < 0, head + S, head)  # the slot of the first new input
    else:
        head = S  # the slot after the last: the inputs before it are at S-1, S-2, ...
    # prev1 = x[t-1], prev2 = x[t-2], prev3 = x[t-3]; unused ones stay zero with zero weight.
    slot1 = head - 1
    slot1 = tl.where(slot1 < 0, slot1 + S, slot1)
    prev1 = tl.load(state + slot1 * stride_ss, mask=s_mask, other=0.0).to(tl.float32)
    prev2 = tl.zeros((BD,), dtype=tl.float32)
    prev3 = tl.zeros((BD,), dtype=tl.float32)
    w_cur = tl.load(w_ptr + d * W + (W - 1), mask=d_mask, other=0.0).to(tl.float32)
    w_1 = tl.load(w_ptr + d * W + (W - 2), mask=d_mask, other=0.0).to(tl.float32)
    w_2 = tl.zeros((BD,), dtype=tl.float32)
    w_3 = tl.zeros((BD,), dtype=tl.float32)
    if W >= 3:
        slot2 = head - 2
        slot2 = tl.where(slot2 < 0, slot2 + S, slot2)
        prev2 = tl.load(state + slot2 * stride_ss, mask=s_mask, other=0.0).to(tl.float32)
        w_2 = tl.load(w_ptr + d * W + (W - 3), mask=d_mask, other=0.0).to(tl.float32)
    if W >= 4:
        slot3 = head - 3
        slot3 = tl.where(slot3 < 0, slot3 + S, slot3)
        prev3 = tl.load(state + slot3 * stride_ss, mask=s_mask, other=0.0).to(tl.float32)
        w_3 = tl.load(w_ptr + d * W + (W - 4), mask=d_mask, other=0.0).to(tl.float32)
    bias = tl.zeros((BD,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    for l in tl.range(0, L):
        x_raw = tl.load(x_ptr + b * stride_xb + d * stride_xd + l * stride_xl, mask=d_mask, other=0.0)
        x_l = x_raw.to(tl.float32)
        acc = bias + w_cur * x_l + w_1 * prev1 + w_2 * prev2 + w_3 * prev3
        if ACT:
            acc = acc * tl.sigmoid(acc)
        if HAS_INDEX:  # padding rows: output 0
            acc = tl.where(s_mask, acc, 0.0)
        tl.store(y_ptr + b * stride_yb + d * stride_yd + l * stride_yl, acc.to(y_ptr.dtype.element_ty), mask=d_mask)
        if CIRCULAR:  # the ring is written in place; every input it loses was read above
            tl.store(state + ((head + l) % S) * stride_ss, x_l.to(state_ptr.dtype.element_ty), mask=s_mask)
        prev3 = prev2
        prev2 = prev1
        prev1 = x_l
    if not CIRCULAR:
        # Shift the state left by L and append the new inputs; ascending j reads j+L before writing it.
        for j in tl.range(0, S):
            src = j + L
            from_state = tl.load(state + src * stride_ss, mask=s_mask & (src < S), other=0.0)
            from_x = tl.load(x_ptr + b * stride_xb + d * stride_xd + (src - S) * stride_xl,
                             mask=s_mask & (src >= S), other=0.0)
            val = tl.where(src < S, from_state.to(tl.float32), from_x.to(tl.float32))
            tl.store(state + j * stride_ss, val.to(state_ptr.dtype.element_ty), mask=s_mask)


conv1d_fwd_kernel = TritonKernel(
    _conv1d_fwd_kernel, name="causal_conv1d_fwd",
    configs=[Config(BD=bd, BT=bt, num_warps=nw) for bd, bt, nw in
             [(16, 256, 4), (8, 512, 4), (32, 128, 4), (16, 512, 8), (64, 64, 4), (128, 32, 4), (64, 128, 8),
              (16, 128, 4), (8, 256, 4), (8, 128, 4), (16, 256, 8)]],
    interpret_config=Config(BD=16, BT=32),
)
# 16 elements per thread (BD * BT / threads) keep the backward's registers low (sm_90 builds, bf16,
# channel-first: no spills); two 8-per-thread candidates trade work per thread for occupancy.
conv1d_bwd_kernel = TritonKernel(
    _conv1d_bwd_kernel, name="causal_conv1d_bwd",
    configs=[Config(BD=bd, BT=bt, num_warps=nw) for bd, bt, nw in
             [(16, 128, 4), (8, 256, 4), (32, 64, 4), (64, 32, 4), (32, 128, 8), (16, 256, 8),
              (8, 128, 4), (32, 32, 4)]],
    interpret_config=Config(BD=16, BT=32),
)
conv1d_update_kernel = TritonKernel(
    _conv1d_update_kernel, name="causal_conv1d_update",
    configs=[Config(BD=bd, num_warps=nw) for bd, nw in [(64, 2), (128, 4), (256, 4)]],
    interpret_config=Config(BD=16),
    restore=("state_ptr",),
)

# The backward writes one row of partial dweight / dbias per chunk of CHUNK times (the launcher picks
# it between these two powers of two). Both are multiples of every candidate's BT, so the buffer's
# size does not depend on which config the tuner picks.
BWD_CHUNK, BWD_CHUNK_MIN = 1024, 256
assert all(BWD_CHUNK_MIN % c.meta["BT"] == 0
           for c in conv1d_bwd_kernel.configs + [conv1d_bwd_kernel.interpret_config])
